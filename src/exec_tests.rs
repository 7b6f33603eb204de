//! The executor and the comparison on real files: ZeRO-style resharding, the
//! exactly-once and bounds properties on random layouts, A -> B -> A identity,
//! determinism, validation errors, and comparisons that find exactly the
//! changed elements.

use std::fs;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use proptest::prelude::*;
use tempfile::TempDir;

use crate::compare::{compare, Tolerance};
use crate::dtype::DType;
use crate::exec::{
    build_pieces, execute, plan_summary, split_even_at, Job, Options, Piece, Sizes, TensorJob,
};
use crate::files::{ChunkRef, Memory, Source, Target};

use crate::geometry::{numel, Region};
use crate::proptests::{contents, layout, shape};

pub(crate) const SENTINEL: u8 = 0xA5;

// ---------------------------------------------------------------- helpers

/// The test value of global element `g` in `dtype`: exact in every float
/// dtype (tensors here have fewer than 2^8 elements, or use `bytes_of`).
fn value(dtype: DType, g: u64) -> f64 {
    match dtype {
        DType::Bool => (g % 2) as f64,
        DType::I8 => (g % 128) as f64,
        DType::U8 => (g % 256) as f64,
        _ => g as f64,
    }
}

fn encode(dtype: DType, v: f64) -> Vec<u8> {
    match dtype {
        DType::F32 => (v as f32).to_le_bytes().to_vec(),
        DType::F64 => v.to_le_bytes().to_vec(),
        DType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
        DType::I64 => (v as i64).to_le_bytes().to_vec(),
        DType::I32 => (v as i32).to_le_bytes().to_vec(),
        DType::I16 => (v as i16).to_le_bytes().to_vec(),
        DType::I8 => (v as i8).to_le_bytes().to_vec(),
        DType::U8 | DType::Bool => vec![v as u8],
    }
}

/// The bytes a chunk of `region` holds when element g has `value(g)`.
pub(crate) fn chunk_bytes(shape: &[u64], region: &Region, dtype: DType) -> Vec<u8> {
    contents(shape, region)
        .into_iter()
        .flat_map(|g| encode(dtype, value(dtype, g)))
        .collect()
}

/// Chunks laid out over `n_files` files, at unaligned offsets with gaps;
/// returns the chunk refs and each file's size.
fn place(
    shape: &[u64],
    regions: &[Region],
    dtype: DType,
    n_files: usize,
    seed: u64,
) -> (Vec<ChunkRef>, Vec<u64>) {
    let mut ends = vec![0u64; n_files];
    let chunks = regions
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let file = (seed as usize + i * 5) % n_files;
            let gap = (seed.wrapping_mul(31) + i as u64 * 7) % 5;
            let offset = ends[file] + gap;
            ends[file] = offset + r.validate(shape).unwrap() * dtype.size() as u64;
            ChunkRef {
                file,
                offset,
                region: r.clone(),
                dtype,
            }
        })
        .collect();
    (chunks, ends.iter().map(|e| e + 3).collect())
}

/// Files of the given sizes filled with `fill`, then the chunks' bytes.
fn write_files(
    dir: &Path,
    prefix: &str,
    sizes: &[u64],
    fill: u8,
    shape: &[u64],
    chunks: &[ChunkRef],
) -> Vec<PathBuf> {
    let mut data: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![fill; s as usize]).collect();
    for c in chunks {
        let b = chunk_bytes(shape, &c.region, c.dtype);
        let o = c.offset as usize;
        data[c.file][o..o + b.len()].copy_from_slice(&b);
    }
    write_data(dir, prefix, &data)
}

pub(crate) fn write_data(dir: &Path, prefix: &str, data: &[Vec<u8>]) -> Vec<PathBuf> {
    data.iter()
        .enumerate()
        .map(|(i, d)| {
            let p = dir.join(format!("{prefix}{i}"));
            fs::write(&p, d).unwrap();
            p
        })
        .collect()
}

/// Blank target files: the sentinel everywhere.
pub(crate) fn blank(dir: &Path, prefix: &str, sizes: &[u64]) -> Vec<PathBuf> {
    let data: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![SENTINEL; s as usize]).collect();
    write_data(dir, prefix, &data)
}

pub(crate) fn paths(p: &[PathBuf]) -> Vec<Source<'static>> {
    p.iter().cloned().map(Source::Path).collect()
}

fn options(threads: usize, window_bytes: u64) -> Options {
    Options {
        threads,
        window_bytes,
        sync: false,
        writeback: false,
        direct: false,
    }
}

/// Each target file as it should be: sentinel outside the chunks.
fn expected_files(sizes: &[u64], shape: &[u64], chunks: &[ChunkRef]) -> Vec<Vec<u8>> {
    let mut data: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![SENTINEL; s as usize]).collect();
    for c in chunks {
        let b = chunk_bytes(shape, &c.region, c.dtype);
        let o = c.offset as usize;
        data[c.file][o..o + b.len()].copy_from_slice(&b);
    }
    data
}

fn read_all(p: &[PathBuf]) -> Vec<Vec<u8>> {
    p.iter().map(|p| fs::read(p).unwrap()).collect()
}

// ---------------------------------------------------------------- ZeRO-like resharding

/// Two tensors packed into one flat buffer, padded and cut into equal rank
/// slices, one file per rank behind a header (ZeRO stage 1/2), resharded
/// into dim-0 boxes (FSDP2-like) in other files, and back.
#[test]
fn zero_flat_partitions_reshard_to_dim0_boxes_and_back() {
    let dir = TempDir::new().unwrap();
    let shapes: [Vec<u64>; 2] = [vec![37, 19], vec![5, 3, 7]];
    let numels: Vec<u64> = shapes.iter().map(|s| numel(s).unwrap()).collect();
    let (ranks, header, dtype) = (4u64, 64u64, DType::F32);
    let total: u64 = numels.iter().sum();
    let slice = total.div_ceil(ranks) + 3; // padded, like DeepSpeed's alignment
                                           // Random-looking tensor values, kept to compare bytes at the end.
    let values: Vec<Vec<u8>> = numels
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            (0..n)
                .flat_map(|i| ((i * 2654435761 + t as u64) as f32 * 1e-3).to_le_bytes())
                .collect()
        })
        .collect();
    let mut rank_data = vec![vec![0u8; (header + slice * 4) as usize]; ranks as usize];
    let mut zero_chunks: Vec<Vec<ChunkRef>> = vec![Vec::new(), Vec::new()];
    let mut base = 0u64; // where the tensor starts in the flat buffer
    for (t, &n) in numels.iter().enumerate() {
        for r in 0..ranks {
            let (lo, hi) = ((r * slice).max(base), ((r + 1) * slice).min(base + n));
            if lo >= hi {
                continue;
            }
            let offset = header + (lo - r * slice) * 4;
            let bytes = &values[t][((lo - base) * 4) as usize..((hi - base) * 4) as usize];
            rank_data[r as usize][offset as usize..offset as usize + bytes.len()]
                .copy_from_slice(bytes);
            zero_chunks[t].push(ChunkRef {
                file: r as usize,
                offset,
                region: Region::Flat {
                    start: lo - base,
                    len: hi - lo,
                },
                dtype,
            });
        }
        base += n;
    }
    let rank_files = write_data(dir.path(), "zero", &rank_data);

    // Three FSDP2-like shards per tensor: dim-0 boxes, one file per shard rank.
    let mut box_chunks: Vec<Vec<ChunkRef>> = vec![Vec::new(), Vec::new()];
    let mut sizes = [0u64; 3];
    for (t, s) in shapes.iter().enumerate() {
        let rows = s[0].div_ceil(3);
        let inner: u64 = s[1..].iter().product();
        for k in 0..3u64 {
            let lo = (k * rows).min(s[0]);
            let n = rows.min(s[0] - lo);
            let mut offsets = vec![0; s.len()];
            offsets[0] = lo;
            let mut sz = s.clone();
            sz[0] = n;
            box_chunks[t].push(ChunkRef {
                file: k as usize,
                offset: sizes[k as usize],
                region: Region::Box { offsets, sizes: sz },
                dtype,
            });
            sizes[k as usize] += n * inner * 4;
        }
    }
    let shard_files = blank(dir.path(), "shard", &sizes);
    let job = |src: &[PathBuf], dst: &[PathBuf], a: &[Vec<ChunkRef>], b: &[Vec<ChunkRef>]| Job {
        sources: paths(src),
        targets: dst.iter().cloned().map(Target::from).collect(),
        tensors: (0..2)
            .map(|t| TensorJob {
                shape: shapes[t].clone(),
                src_chunks: a[t].clone(),
                dst_chunks: b[t].clone(),
            })
            .collect(),
    };
    let stats = execute(
        &job(&rank_files, &shard_files, &zero_chunks, &box_chunks),
        &options(2, 256),
    )
    .unwrap();
    assert_eq!(stats.bytes_read, total * 4);
    assert_eq!(stats.bytes_written, total * 4);
    assert!(stats.pieces > stats.runs, "a 256-byte window must cut runs");
    // Dim-0 boxes of a row-major tensor are contiguous: shard k of tensor t
    // is bytes [k*rows*inner*4, ...) of the tensor.
    let shards = read_all(&shard_files);
    for (t, chunks) in box_chunks.iter().enumerate() {
        let inner: u64 = shapes[t][1..].iter().product();
        for c in chunks {
            let Region::Box { offsets, sizes } = &c.region else {
                unreachable!()
            };
            let len = (sizes[0] * inner * 4) as usize;
            let start = (offsets[0] * inner * 4) as usize;
            let o = c.offset as usize;
            assert_eq!(&shards[c.file][o..o + len], &values[t][start..start + len]);
        }
    }

    // And back into fresh rank files: the slices match, padding untouched.
    let back = blank(
        dir.path(),
        "back",
        &vec![header + slice * 4; ranks as usize],
    );
    execute(
        &job(&shard_files, &back, &box_chunks, &zero_chunks),
        &options(0, 64 << 20),
    )
    .unwrap();
    // Exactly: every chunk's bytes equal, everything else still the sentinel.
    let all: Vec<ChunkRef> = zero_chunks.iter().flatten().cloned().collect();
    let got = read_all(&back);
    let mut expect: Vec<Vec<u8>> = got.iter().map(|g| vec![SENTINEL; g.len()]).collect();
    for c in &all {
        let Region::Flat { len, .. } = c.region else {
            unreachable!()
        };
        let (o, n) = (c.offset as usize, (len * 4) as usize);
        expect[c.file][o..o + n].copy_from_slice(&rank_data[c.file][o..o + n]);
    }
    assert_eq!(got, expect);
}

// ---------------------------------------------------------------- properties

/// A dtype pair to copy with: same dtype (any) or a float cast.
fn dtype_pair() -> impl Strategy<Value = (DType, DType)> {
    let floats = [DType::F32, DType::F64, DType::F16, DType::BF16];
    prop_oneof![
        prop::sample::select(DType::ALL.to_vec()).prop_map(|d| (d, d)),
        (
            prop::sample::select(floats.to_vec()),
            prop::sample::select(floats.to_vec())
        ),
    ]
}

#[derive(Debug)]
struct Case {
    shape: Vec<u64>,
    a: Vec<ChunkRef>,
    a_sizes: Vec<u64>,
    b: Vec<ChunkRef>,
    b_sizes: Vec<u64>,
}

fn case() -> impl Strategy<Value = (Case, usize, u64)> {
    let layouts = shape().prop_flat_map(|s| (Just(s.clone()), layout(&s), layout(&s)));
    (
        layouts,
        dtype_pair(),
        1usize..=3,
        1usize..=3,
        any::<u64>(),
        1usize..=3,
        1u64..=96,
    )
        .prop_map(
            |((shape, ra, rb), (da, db), na, nb, seed, threads, window)| {
                let (a, a_sizes) = place(&shape, &ra, da, na, seed);
                let (b, b_sizes) = place(&shape, &rb, db, nb, seed >> 7);
                (
                    Case {
                        shape,
                        a,
                        a_sizes,
                        b,
                        b_sizes,
                    },
                    threads,
                    window,
                )
            },
        )
}

pub(crate) fn one_tensor<'a>(
    sources: Vec<Source<'a>>,
    targets: Vec<PathBuf>,
    shape: &[u64],
    src: &[ChunkRef],
    dst: &[ChunkRef],
) -> Job<'a> {
    Job {
        sources,
        targets: targets.into_iter().map(Target::from).collect(),
        tensors: vec![TensorJob {
            shape: shape.to_vec(),
            src_chunks: src.to_vec(),
            dst_chunks: dst.to_vec(),
        }],
    }
}

/// Byte ranges `(file, start, end)` of chunks.
fn ranges(shape: &[u64], chunks: &[ChunkRef]) -> Vec<(usize, u64, u64)> {
    chunks
        .iter()
        .map(|c| {
            let n = c.region.validate(shape).unwrap() * c.dtype.size() as u64;
            (c.file, c.offset, c.offset + n)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn execute_writes_every_target_byte_once_in_bounds_and_round_trips(
        (c, threads, window) in case()
    ) {
        let dir = TempDir::new().unwrap();
        let a_files = write_files(dir.path(), "a", &c.a_sizes, 0x3C, &c.shape, &c.a);
        let b_files = blank(dir.path(), "b", &c.b_sizes);
        let job = one_tensor(paths(&a_files), b_files.clone(), &c.shape, &c.a, &c.b);
        let opts = options(threads, window);

        // Pieces: inside the chunks they serve, within the window, and
        // tiling the target chunks' bytes exactly once (disjoint, each inside
        // a target chunk, adding up to all of them).
        let sizes = Sizes { sources: &c.a_sizes, targets: Some(&c.b_sizes) };
        let (pieces, runs) = build_pieces(&job, sizes, window, threads).unwrap();
        let (src_ranges, dst_ranges) = (ranges(&c.shape, &c.a), ranges(&c.shape, &c.b));
        let share = (window / threads as u64).max(8);
        let mut written: Vec<(usize, u64, u64)> = Vec::new();
        for p in &pieces {
            prop_assert!(p.elems > 0);
            prop_assert!(p.src_bytes() <= share && p.dst_bytes() <= share, "{:?} past the window", p);
            let (s0, s1) = (p.src_off, p.src_off + p.src_bytes());
            prop_assert!(src_ranges.iter().any(|&(f, a, b)| f == p.src && a <= s0 && s1 <= b));
            let (d0, d1) = (p.dst_off, p.dst_off + p.dst_bytes());
            prop_assert!(dst_ranges.iter().any(|&(f, a, b)| f == p.dst && a <= d0 && d1 <= b));
            written.push((p.dst, d0, d1));
        }
        written.sort_unstable();
        for w in written.windows(2) {
            prop_assert!(w[0].0 != w[1].0 || w[0].2 <= w[1].1, "overlapping writes {:?}", w);
        }
        let total = |r: &[(usize, u64, u64)]| r.iter().map(|x| x.2 - x.1).sum::<u64>();
        prop_assert_eq!(total(&written), total(&dst_ranges));

        let stats = execute(&job, &opts).unwrap();
        prop_assert_eq!(stats.pieces, pieces.len() as u64);
        prop_assert_eq!(stats.runs, runs);
        prop_assert_eq!(stats.bytes_written, total(&dst_ranges));
        // Values and coverage: chunk bytes as expected, the rest untouched.
        prop_assert_eq!(read_all(&b_files), expected_files(&c.b_sizes, &c.shape, &c.b));

        let summary = plan_summary(&job, &opts).unwrap();
        prop_assert_eq!(summary.stats, stats);
        let mut per_target = vec![0u64; c.b_sizes.len()];
        for (f, a, b) in &dst_ranges {
            per_target[*f] += b - a;
        }
        prop_assert_eq!(summary.per_target_bytes, per_target);

        // Deterministic: the same pieces again, and the same bytes with any
        // number of threads, written direct (whole pages around the page
        // cache) as through it.
        prop_assert_eq!(build_pieces(&job, sizes, window, threads).unwrap(), (pieces, runs));
        let b2 = blank(dir.path(), "again", &c.b_sizes);
        let job2 = one_tensor(paths(&a_files), b2.clone(), &c.shape, &c.a, &c.b);
        let direct = Options { direct: true, ..options(4 - threads, window) };
        let again = execute(&job2, &direct).unwrap();
        prop_assert_eq!((again.bytes_read, again.bytes_written, again.runs), (stats.bytes_read, stats.bytes_written, stats.runs));
        prop_assert_eq!(read_all(&b2), read_all(&b_files));

        // B -> A through the files gives A's chunks back (the test values are
        // exact in every dtype, so casts lose nothing).
        let back = blank(dir.path(), "back", &c.a_sizes);
        execute(&one_tensor(paths(&b_files), back.clone(), &c.shape, &c.b, &c.a), &opts).unwrap();
        prop_assert_eq!(read_all(&back), expected_files(&c.a_sizes, &c.shape, &c.a));
    }

    #[test]
    fn compare_counts_exactly_the_changed_elements(
        (c, _, _) in case(),
        changes in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        prop_assume!(c.a[0].dtype == c.b[0].dtype);
        let dtype = c.a[0].dtype;
        let dir = TempDir::new().unwrap();
        // A and B chunks over the same files list: A's, then B's.
        let a_files = write_files(dir.path(), "a", &c.a_sizes, 0, &c.shape, &c.a);
        let b_files = write_files(dir.path(), "b", &c.b_sizes, 0, &c.shape, &c.b);
        let shift = a_files.len();
        let b: Vec<ChunkRef> = c.b.iter().cloned().map(|mut x| { x.file += shift; x }).collect();
        let files: Vec<PathBuf> = a_files.iter().chain(&b_files).cloned().collect();
        let same = compare(&paths(&files), &c.shape, &c.a, &b, Tolerance::EXACT).unwrap();
        prop_assert_eq!(same.n_diff, 0);
        prop_assert_eq!(same.first_diff, None);

        // Change some elements of B's copy: flip a bit of the first listed
        // B chunk holding each (the one compared).
        let total = numel(&c.shape).unwrap();
        prop_assume!(total > 0);
        let mut data = read_all(&b_files);
        let mut changed: Vec<u64> = changes.iter().map(|i| i.index(total as usize) as u64).collect();
        changed.sort_unstable();
        changed.dedup();
        for &g in &changed {
            let (chunk, local) = c.b.iter().find_map(|ch| {
                contents(&c.shape, &ch.region).iter().position(|&x| x == g).map(|l| (ch, l))
            }).unwrap();
            // The lowest bit (little-endian: of the first byte) gives a
            // different value in every dtype; for bool, 0 <-> 1.
            data[chunk.file][chunk.offset as usize + local * dtype.size()] ^= 1;
        }
        let b_files = write_data(dir.path(), "b", &data);
        let files: Vec<PathBuf> = a_files.iter().chain(&b_files).cloned().collect();
        let got = compare(&paths(&files), &c.shape, &c.a, &b, Tolerance::EXACT).unwrap();
        prop_assert_eq!(got.n_diff, changed.len() as u64);
        prop_assert_eq!(got.first_diff, changed.first().copied());
        prop_assert_eq!(got.max_abs_diff > 0.0, !changed.is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The CRC-32s gathered while copying, combined per target chunk, equal
    /// the CRC-32 of the bytes that ended up there; a range the job did not
    /// tile exactly gets none.
    #[test]
    fn crcs_from_pieces_equal_crcs_of_the_written_bytes((c, threads, window) in case()) {
        use crate::checksum::combine_crcs;
        use crate::exec::execute_with_crcs;
        let dir = TempDir::new().unwrap();
        let a_files = write_files(dir.path(), "a", &c.a_sizes, 0x3C, &c.shape, &c.a);
        let b_files = blank(dir.path(), "b", &c.b_sizes);
        let job = one_tensor(paths(&a_files), b_files.clone(), &c.shape, &c.a, &c.b);
        let (_, pieces) = execute_with_crcs(&job, &options(threads, window)).unwrap();
        let dst: Vec<(usize, u64, u64)> = ranges(&c.shape, &c.b).into_iter().map(|(f, a, b)| (f, a, b - a)).collect();
        let crcs = combine_crcs(pieces.clone(), &dst);
        let files = read_all(&b_files);
        for ((f, off, len), crc) in dst.iter().zip(&crcs) {
            let want = crc32fast::hash(&files[*f][*off as usize..(*off + *len) as usize]);
            prop_assert_eq!(*crc, Some(want));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The xxh3-64 hashed while copying equals that of the bytes that ended
    /// up in each range, through the page cache or around it; with one copy
    /// thread every target chunk gets one, with more a chunk where two
    /// threads' stretches meet may get none, never a wrong one. A range that
    /// no piece tiles from its start (part of a chunk, a chunk's tail) gets none.
    #[test]
    fn hashes_from_the_copy_equal_xxh3_of_the_written_bytes((c, threads, window) in case(), direct in any::<bool>()) {
        use crate::exec::execute_hashed;
        use xxhash_rust::xxh3::xxh3_64;
        let dir = TempDir::new().unwrap();
        let a_files = write_files(dir.path(), "a", &c.a_sizes, 0x3C, &c.shape, &c.a);
        let b_files = blank(dir.path(), "b", &c.b_sizes);
        let job = one_tensor(paths(&a_files), b_files.clone(), &c.shape, &c.a, &c.b);
        let chunks: Vec<(usize, u64, u64)> = ranges(&c.shape, &c.b).into_iter().map(|(f, a, b)| (f, a, b - a)).collect();
        // the second half of each chunk: no piece need start there; and both at once:
        // ranges that overlap, never hashed
        let halves: Vec<(usize, u64, u64)> = chunks.iter().map(|&(f, o, l)| (f, o + l / 2, l - l / 2)).collect();
        let both: Vec<_> = chunks.iter().chain(&halves).copied().collect();
        let opts = Options { direct, ..options(threads, window) };
        for (what, asked) in [("chunks", &chunks), ("halves", &halves), ("both", &both)] {
            let (_, crcs, hashes) = execute_hashed(&job, &opts, false, asked).unwrap();
            prop_assert!(crcs.is_empty());
            let files = read_all(&b_files);
            for (i, ((f, off, len), h)) in asked.iter().zip(&hashes).enumerate() {
                let want = xxh3_64(&files[*f][*off as usize..(*off + *len) as usize]);
                match h {
                    Some(h) => prop_assert_eq!(*h, want, "{} {}", what, i),
                    None => prop_assert!(what != "chunks" || threads > 1, "chunk {} not hashed by one thread", i),
                }
            }
        }
    }
}

#[test]
fn crcs_of_ranges_not_tiled_are_none() {
    use crate::checksum::{combine_crcs, WrittenCrc};
    let piece = |offset: u64, data: &[u8]| WrittenCrc {
        target: 0,
        offset,
        len: data.len() as u64,
        crc: crc32fast::hash(data),
        read: None,
    };
    let pieces = vec![piece(8, b"efgh"), piece(0, b"abcd")];
    assert_eq!(combine_crcs(pieces.clone(), &[(0, 0, 8)]), vec![None]); // a gap at 4..8
    assert_eq!(
        combine_crcs(
            pieces.clone(),
            &[(0, 0, 4), (0, 8, 4), (0, 8, 2), (1, 0, 4), (0, 3, 0)]
        ),
        vec![
            Some(crc32fast::hash(b"abcd")),
            Some(crc32fast::hash(b"efgh")),
            None,
            None,
            Some(0)
        ]
    );
    let pieces = vec![piece(0, b"abcd"), piece(4, b"efgh")];
    assert_eq!(
        combine_crcs(pieces, &[(0, 0, 8)]),
        vec![Some(crc32fast::hash(b"abcdefgh"))]
    );
}

/// Pieces larger than one write step, at target offsets on and off the
/// step and page boundaries, same dtype and cast, with and without early
/// write-back: every byte lands once and the CRC gathered step by step is
/// the CRC of the written range.
#[test]
fn multi_step_pieces_land_with_their_crcs_at_any_target_offset() {
    use crate::checksum::combine_crcs;
    use crate::exec::execute_with_crcs;
    let dir = TempDir::new().unwrap();
    let n: u64 = 300_000; // f32 elements: 1.2 MB, many 64 KiB steps, several pieces per window
    let data: Vec<u8> = (0..n)
        .flat_map(|i| ((i * 2654435761) as f32).to_le_bytes())
        .collect();
    let src_off = 4096 * 3 + 64;
    let mut file = vec![0u8; src_off as usize];
    file.extend_from_slice(&data);
    let sources = write_data(dir.path(), "src", &[file]);
    let bf16_bytes: Vec<u8> = data
        .chunks(4)
        .flat_map(|b| bf16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes())
        .collect();
    for (to, want) in [(DType::F32, &data), (DType::BF16, &bf16_bytes)] {
        for (dst_off, writeback) in [
            (src_off, false),
            (src_off + 4096, true),
            (100, false),
            (4097, true),
            ((64 << 10) - 8, false),
        ] {
            let len = want.len() as u64;
            let targets = blank(
                dir.path(),
                &format!("dst{}-{dst_off}-", to.name()),
                &[dst_off + len + 5],
            );
            let chunk = |file, offset, dtype| ChunkRef {
                file,
                offset,
                region: Region::Flat { start: 0, len: n },
                dtype,
            };
            let job = Job {
                sources: paths(&sources),
                targets: targets.iter().cloned().map(Target::from).collect(),
                tensors: vec![TensorJob {
                    shape: vec![n],
                    src_chunks: vec![chunk(0, src_off, DType::F32)],
                    dst_chunks: vec![chunk(0, dst_off, to)],
                }],
            };
            // direct writes where the early write-back is off, so every
            // offset here runs both ways
            let opts = Options {
                writeback,
                direct: !writeback,
                ..options(2, 256 << 10)
            };
            let (stats, pieces) = execute_with_crcs(&job, &opts).unwrap();
            if opts.direct && direct_works(dir.path()) {
                // all but each piece's partial end pages go direct
                let ends = 2 * 4096 * stats.pieces;
                assert!(stats.direct_bytes > 0, "{dst_off}: {stats:?}");
                assert!(stats.direct_bytes + ends >= len, "{dst_off}: {stats:?}");
            } else {
                assert_eq!(stats.direct_bytes, 0);
            }
            let out = fs::read(&targets[0]).unwrap();
            let (at, end) = (dst_off as usize, (dst_off + len) as usize);
            assert!(out[..at].iter().all(|&b| b == SENTINEL), "{dst_off}");
            assert_eq!(&out[at..end], &want[..], "{dst_off}");
            assert!(out[end..].iter().all(|&b| b == SENTINEL), "{dst_off}");
            // an unchanged copy says where its bytes came from; a cast does not
            for p in &pieces {
                match p.read {
                    Some((src, at)) => {
                        assert!(to == DType::F32 && src == 0, "{dst_off}");
                        let from = (at - src_off) as usize;
                        assert_eq!(p.crc, crc32fast::hash(&data[from..from + p.len as usize]));
                        assert_eq!(at - src_off, p.offset - dst_off);
                    }
                    None => assert_eq!(to, DType::BF16, "{dst_off}"),
                }
            }
            assert_eq!(
                combine_crcs(pieces, &[(0, dst_off, len)]),
                vec![Some(crc32fast::hash(want))],
                "{dst_off}"
            );
            // one thread writes the range in order: its xxh3 comes from the copy, both ways
            let one = Options { threads: 1, ..opts };
            let (_, _, hashes) =
                crate::exec::execute_hashed(&job, &one, true, &[(0, dst_off, len)]).unwrap();
            assert_eq!(
                hashes,
                vec![Some(xxhash_rust::xxh3::xxh3_64(want))],
                "{dst_off}"
            );
            assert_eq!(&fs::read(&targets[0]).unwrap()[at..end], &want[..]);
        }
    }
}

/// Whether the file system of `dir` takes an aligned O_DIRECT write (ext4
/// does; tmpfs on older kernels does not).
fn direct_works(dir: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let path = dir.join("direct-probe");
        let Ok(file) = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
        else {
            return false;
        };
        let buf = vec![0u8; 3 * 4096];
        let at = buf.as_ptr().align_offset(4096);
        let ok = file.write_all_at(&buf[at..at + 4096], 0).is_ok();
        let _ = fs::remove_file(&path);
        ok
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = dir;
        false
    }
}

#[test]
fn untiled_parts_gives_the_pieces_inside_each_range_left_without_a_crc() {
    use crate::checksum::{combine_crcs, crc32_concat, untiled_parts, WrittenCrc};
    let data: Vec<u8> = (0..100u8).collect();
    let piece = |target, offset: u64, len: u64| WrittenCrc {
        target,
        offset,
        len,
        crc: crc32fast::hash(&data[offset as usize..(offset + len) as usize]),
        read: None,
    };
    // range 0 (target 0, 10..60) gets two of its three pieces in this call;
    // range 1 (target 0, 60..70) is tiled; range 2 is on another target
    let pieces = vec![
        piece(0, 40, 20),
        piece(0, 10, 10),
        piece(0, 60, 10),
        piece(1, 0, 30),
        piece(0, 70, 5),
    ];
    let ranges = [(0, 10, 50), (0, 60, 10), (1, 0, 40)];
    let found = combine_crcs(pieces.clone(), &ranges);
    assert_eq!(found[..2], [None, Some(crc32fast::hash(&data[60..70]))]);
    let parts = untiled_parts(pieces, &ranges, &found);
    let crc = |a: usize, b: usize| crc32fast::hash(&data[a..b]);
    assert_eq!(
        parts,
        vec![
            (0, 10, 10, crc(10, 20)),
            (0, 40, 20, crc(40, 60)),
            (2, 0, 30, crc(0, 30))
        ]
    );
    // with the missing piece from another call, range 0's CRC joins
    let all = [(crc(10, 20), 10), (crc(20, 40), 20), (crc(40, 60), 20)];
    assert_eq!(crc32_concat(&all), crc(10, 60));
}

#[test]
fn crc32_concat_is_the_crc_of_the_bytes_one_after_another() {
    use crate::checksum::crc32_concat;
    let (a, b, c): (&[u8], &[u8], &[u8]) = (b"abc", b"", b"defgh");
    let parts = [a, b, c].map(|d| (crc32fast::hash(d), d.len() as u64));
    assert_eq!(crc32_concat(&parts), crc32fast::hash(b"abcdefgh"));
    assert_eq!(crc32_concat(&[]), 0);
}

proptest! {
    /// The copy threads' shares: consecutive stretches of the pieces, in order, none empty,
    /// at most one per thread, each within one piece of an even share of the bytes.
    #[test]
    fn threads_share_the_pieces_in_order_and_evenly(
        lens in prop::collection::vec(0u64..5000, 0..60),
        parts in 1usize..9,
    ) {
        let pieces: Vec<Piece> = lens
            .iter()
            .enumerate()
            .map(|(i, &elems)| Piece { src: 0, src_off: 0, dst: i / 7, dst_off: (i % 7) as u64 * 8, elems, from: DType::F32, to: DType::F32 })
            .collect();
        let shares = split_even_at(&pieces, parts, |_| true);
        prop_assert!(shares.len() <= parts);
        prop_assert!(shares.iter().all(|s| !s.is_empty()));
        let joined: Vec<Piece> = shares.iter().flat_map(|s| s.iter().copied()).collect();
        prop_assert_eq!(joined, pieces.clone());
        let total: u64 = pieces.iter().map(Piece::dst_bytes).sum();
        let largest = pieces.iter().map(Piece::dst_bytes).max().unwrap_or(0);
        for s in &shares {
            let bytes: u64 = s.iter().map(Piece::dst_bytes).sum();
            prop_assert!(bytes <= total / parts as u64 + largest + 1, "{bytes} of {total} in {parts} parts");
        }
    }
}

/// With hash ranges, a cut between two threads waits for the next piece that
/// starts a range, as long as that is within a quarter of a share; past
/// that, it cuts inside the range.
#[test]
fn cuts_wait_for_the_start_of_a_hash_range_within_a_quarter_share() {
    // 8 pieces of 100 elements (400 bytes) in one file; ranges start at the pieces in `starts`
    let pieces: Vec<Piece> = (0..8u64)
        .map(|i| Piece {
            src: 0,
            src_off: 0,
            dst: 0,
            dst_off: i * 400,
            elems: 100,
            from: DType::F32,
            to: DType::F32,
        })
        .collect();
    let starts = |at: &'static [u64]| move |p: &Piece| at.contains(&(p.dst_off / 400));
    let lens = |shares: Vec<&[Piece]>| shares.iter().map(|s| s.len()).collect::<Vec<_>>();
    // even cut after piece 3 (1600 of 3200 bytes); the next start is piece 5, 400 bytes on: within 400 (a quarter of 1600)
    assert_eq!(lens(split_even_at(&pieces, 2, starts(&[0, 5]))), vec![5, 3]);
    // a start at piece 4 is where the cut falls anyway
    assert_eq!(lens(split_even_at(&pieces, 2, starts(&[0, 4]))), vec![4, 4]);
    // the next start 800 bytes on: too far; cut after one piece of slack
    assert_eq!(lens(split_even_at(&pieces, 2, starts(&[0, 6]))), vec![5, 3]);
    assert_eq!(lens(split_even_at(&pieces, 2, starts(&[0]))), vec![5, 3]);
    assert_eq!(lens(split_even_at(&pieces, 2, |_| true)), vec![4, 4]);
}

/// A target can be memory the caller lends (a live tensor): the same copy and
/// cast as into a file, nothing written outside the chunks, a write past its
/// end refused before any byte moves.
#[test]
fn copies_and_casts_into_memory_targets() {
    let dir = TempDir::new().unwrap();
    let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let src = write_data(dir.path(), "src", std::slice::from_ref(&bytes)).remove(0);
    let mut same = vec![0xAAu8; 4 + 24 * 4];
    let mut halves = vec![0xAAu8; 24 * 2];
    let whole = Region::Flat { start: 0, len: 24 };
    let job = Job {
        sources: vec![Source::Path(src)],
        targets: vec![
            Target::Memory(Memory::new(&mut same)),
            Target::Memory(Memory::new(&mut halves)),
        ],
        tensors: vec![TensorJob {
            shape: vec![24],
            src_chunks: vec![ChunkRef {
                file: 0,
                offset: 0,
                region: whole.clone(),
                dtype: DType::F32,
            }],
            dst_chunks: vec![
                ChunkRef {
                    file: 0,
                    offset: 4,
                    region: whole.clone(),
                    dtype: DType::F32,
                },
                ChunkRef {
                    file: 1,
                    offset: 0,
                    region: whole.clone(),
                    dtype: DType::BF16,
                },
            ],
        }],
    };
    execute(&job, &Options::default()).unwrap();
    drop(job);
    assert_eq!(&same[..4], &[0xAA; 4]);
    assert_eq!(&same[4..], &bytes[..]);
    let want: Vec<u8> = values
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
        .collect();
    assert_eq!(halves, want);

    let mut small = vec![0u8; 8];
    let job = Job {
        sources: vec![Source::Bytes(&bytes)],
        targets: vec![Target::Memory(Memory::new(&mut small))],
        tensors: vec![TensorJob {
            shape: vec![24],
            src_chunks: vec![ChunkRef {
                file: 0,
                offset: 0,
                region: whole.clone(),
                dtype: DType::F32,
            }],
            dst_chunks: vec![ChunkRef {
                file: 0,
                offset: 0,
                region: whole,
                dtype: DType::F32,
            }],
        }],
    };
    let err = execute(&job, &Options::default()).unwrap_err().to_string();
    assert!(err.contains("in-memory buffer of 8 bytes"), "{err}");
    drop(job);
    assert_eq!(small, vec![0u8; 8]);
}

/// A sparse target written direct has its blocks allocated first (so two
/// threads' direct writes into one ext4 file share the inode lock): after
/// the job the file occupies its whole length on disk, the bytes written
/// are the source's, and the bytes no piece wrote still read as zeros.
/// Written through the cache, the same target stays sparse.
#[test]
fn direct_targets_are_allocated_before_the_copy() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new().unwrap();
    if !direct_works(dir.path()) {
        return; // nothing to check: this file system takes no direct writes
    }
    let n: u64 = 1 << 20; // 4 MiB of f32
    let data: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let sources = write_data(dir.path(), "src", std::slice::from_ref(&data));
    let (dst_off, size) = (8 << 20, 16 << 20); // written: [8, 12) MiB of 16
    for direct in [true, false] {
        let target = dir.path().join(format!("dst-{direct}"));
        fs::File::create(&target).unwrap().set_len(size).unwrap(); // sparse, as the writers make it
        let chunk = |offset| ChunkRef {
            file: 0,
            offset,
            region: Region::Flat { start: 0, len: n },
            dtype: DType::F32,
        };
        let job = Job {
            sources: paths(&sources),
            targets: vec![Target::from(target.clone())],
            tensors: vec![TensorJob {
                shape: vec![n],
                src_chunks: vec![chunk(0)],
                dst_chunks: vec![chunk(dst_off)],
            }],
        };
        let stats = execute(
            &job,
            &Options {
                direct,
                ..options(2, 1 << 20)
            },
        )
        .unwrap();
        let on_disk = fs::metadata(&target).unwrap().blocks() * 512;
        if direct {
            assert!(stats.direct_bytes > 0, "{stats:?}");
            assert!(on_disk >= size, "{on_disk} bytes allocated of {size}");
        } else {
            assert!(on_disk < size, "{on_disk} bytes allocated of {size}");
        }
        let out = fs::read(&target).unwrap();
        let (at, end) = (dst_off as usize, dst_off as usize + data.len());
        assert_eq!(&out[at..end], &data[..]);
        assert!(out[..at].iter().chain(&out[end..]).all(|&b| b == 0));
    }
}
