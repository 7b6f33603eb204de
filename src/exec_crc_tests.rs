//! The executor's checksums of what it wrote, on real files: CRC-32s per
//! piece combined per range (and the pieces of ranges left untiled), xxh3-64
//! hashed as the bytes go out, through the page cache and around it.

use std::fs;
use std::path::Path;

use half::bf16;
use proptest::prelude::*;
use tempfile::TempDir;

use crate::dtype::DType;
use crate::exec::{Job, Options, TensorJob};
use crate::exec_tests::{
    blank, case, one_tensor, options, paths, ranges, read_all, write_data, write_files, SENTINEL,
};
use crate::files::{ChunkRef, Target};
use crate::geometry::Region;

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
pub(crate) fn direct_works(dir: &Path) -> bool {
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
