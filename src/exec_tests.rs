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

use crate::exec_crc_tests::direct_works;
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
pub(crate) fn write_files(
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

pub(crate) fn options(threads: usize, window_bytes: u64) -> Options {
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

pub(crate) fn read_all(p: &[PathBuf]) -> Vec<Vec<u8>> {
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
pub(crate) struct Case {
    pub shape: Vec<u64>,
    pub a: Vec<ChunkRef>,
    pub a_sizes: Vec<u64>,
    pub b: Vec<ChunkRef>,
    pub b_sizes: Vec<u64>,
}

pub(crate) fn case() -> impl Strategy<Value = (Case, usize, u64)> {
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
pub(crate) fn ranges(shape: &[u64], chunks: &[ChunkRef]) -> Vec<(usize, u64, u64)> {
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
