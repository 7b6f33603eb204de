//! The executor refusing bad jobs before it writes a byte, and the edge
//! cases of sources: in-memory buffers, empty files, empty tensors.

use std::fs;
use std::path::Path;

use crate::dtype::DType;
use crate::exec::{execute, plan_summary, Job, Options, TensorJob};
use crate::exec_tests::{blank, chunk_bytes, one_tensor, paths, write_data, SENTINEL};
use crate::files::{ChunkRef, Error, Source, Target};
use crate::geometry::Region;
use tempfile::TempDir;

/// A 4x3 float32 tensor in one source file behind an 8-byte header, copied
/// whole into one target at offset 0.
fn simple(dir: &Path, source_len: Option<u64>, target_len: u64) -> Job<'static> {
    let shape = vec![4, 3];
    let mut data = vec![7u8; 8];
    data.extend(chunk_bytes(&shape, &Region::whole(&shape), DType::F32));
    if let Some(n) = source_len {
        data.truncate(n as usize);
    }
    let src = write_data(dir, "src", &[data]);
    let dst = blank(dir, "dst", &[target_len]);
    let chunk = |offset| ChunkRef {
        file: 0,
        offset,
        region: Region::whole(&shape),
        dtype: DType::F32,
    };
    one_tensor(paths(&src), dst, &shape, &[chunk(8)], &[chunk(0)])
}

#[test]
fn a_truncated_source_is_an_error_naming_the_file_and_sizes() {
    let dir = TempDir::new().unwrap();
    let job = simple(dir.path(), Some(50), 48);
    let err = execute(&job, &Options::default()).unwrap_err();
    let msg = err.to_string();
    let src = dir.path().join("src0");
    assert_eq!(
        msg,
        format!(
            "tensor 0, source chunk 0: {} is 50 bytes, but the chunk needs bytes 8..56, \
             a file of at least 56 bytes\nhint: the file is truncated, or the chunk's offset, \
             shape or dtype is wrong",
            src.display()
        )
    );
    // Nothing was written.
    assert_eq!(
        fs::read(dir.path().join("dst0")).unwrap(),
        vec![SENTINEL; 48]
    );
    assert!(plan_summary(&job, &Options::default()).is_err());
}

#[test]
fn targets_must_exist_at_their_final_size() {
    let dir = TempDir::new().unwrap();
    let job = simple(dir.path(), None, 40);
    let msg = execute(&job, &Options::default()).unwrap_err().to_string();
    assert!(
        msg.contains("is 40 bytes, but the chunk needs bytes 0..48"),
        "{msg}"
    );
    assert!(msg.ends_with("hint: create each target file at its final size before executing"));

    let mut job = simple(dir.path(), None, 48);
    job.targets[0] = Target::Path(dir.path().join("missing"));
    let err = execute(&job, &Options::default()).unwrap_err();
    assert!(
        matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    );
    assert!(err
        .to_string()
        .starts_with("cannot open target file for writing"));
    assert!(
        !dir.path().join("missing").exists(),
        "the executor never creates files"
    );
    // A dry run does not need the targets.
    let s = plan_summary(&job, &Options::default()).unwrap();
    assert_eq!(s.per_target_bytes, vec![48]);
    assert_eq!((s.stats.runs, s.stats.bytes_read), (1, 48));
}

#[test]
fn bad_jobs_are_refused_before_any_write() {
    let dir = TempDir::new().unwrap();
    let opts = Options::default();
    let mut job = simple(dir.path(), None, 200);
    // A second tensor whose target chunk overlaps the first's.
    let mut t = job.tensors[0].clone();
    t.dst_chunks[0].offset = 44;
    job.tensors.push(t);
    let msg = execute(&job, &opts).unwrap_err().to_string();
    assert!(
        msg.contains("tensor 1 chunk 0 (bytes 44..92) overlaps tensor 0 chunk 0 (bytes 0..48)"),
        "{msg}"
    );

    let mut job = simple(dir.path(), None, 200);
    job.tensors[0].src_chunks[0].file = 3;
    let msg = execute(&job, &opts).unwrap_err().to_string();
    assert_eq!(
        msg,
        "tensor 0, source chunk 0: file index 3 is out of range; there are 1 source files"
    );

    let mut job = simple(dir.path(), None, 200);
    job.tensors[0].dst_chunks[0].dtype = DType::I32;
    let msg = execute(&job, &opts).unwrap_err().to_string();
    assert!(
        msg.starts_with("tensor 0: source chunk 0 to target chunk 0: cannot cast float32 to int32"),
        "{msg}"
    );

    let mut job = simple(dir.path(), None, 200);
    job.tensors[0].src_chunks[0].region = Region::Flat { start: 0, len: 6 };
    let msg = execute(&job, &opts).unwrap_err().to_string();
    assert!(
        msg.starts_with("tensor 0: target chunk 0: 6 of its 12 elements are in no source chunk"),
        "{msg}"
    );

    let mut job = simple(dir.path(), None, 200);
    job.tensors[0].src_chunks[0].offset = u64::MAX - 4;
    let msg = execute(&job, &opts).unwrap_err().to_string();
    assert!(
        msg.contains("needs bytes 18446744073709551611..18446744073709551659"),
        "{msg}"
    );

    let job = simple(dir.path(), None, 200);
    let zero_window = Options {
        window_bytes: 0,
        ..opts
    };
    assert_eq!(
        execute(&job, &zero_window).unwrap_err().to_string(),
        "window_bytes must be positive"
    );
    assert_eq!(
        fs::read(dir.path().join("dst0")).unwrap(),
        vec![SENTINEL; 200]
    );
}

#[test]
fn in_memory_sources_and_empty_files() {
    let dir = TempDir::new().unwrap();
    let shape = [2u64, 2];
    let values: Vec<u8> = [1.5f32, -2.0, 3.25, f32::NAN]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let empty = write_data(dir.path(), "empty", &[Vec::new()]);
    let dst = blank(dir.path(), "dst", &[8]);
    let job = Job {
        sources: vec![Source::Path(empty[0].clone()), Source::Bytes(&values)],
        targets: dst.iter().cloned().map(Target::from).collect(),
        tensors: vec![
            TensorJob {
                shape: shape.to_vec(),
                src_chunks: vec![ChunkRef {
                    file: 1,
                    offset: 0,
                    region: Region::whole(&shape),
                    dtype: DType::F32,
                }],
                dst_chunks: vec![ChunkRef {
                    file: 0,
                    offset: 0,
                    region: Region::whole(&shape),
                    dtype: DType::BF16,
                }],
            },
            // An empty tensor stored in the empty file.
            TensorJob {
                shape: vec![0, 5],
                src_chunks: vec![ChunkRef {
                    file: 0,
                    offset: 0,
                    region: Region::whole(&[0, 5]),
                    dtype: DType::I64,
                }],
                dst_chunks: vec![ChunkRef {
                    file: 0,
                    offset: 8,
                    region: Region::whole(&[0, 5]),
                    dtype: DType::I64,
                }],
            },
        ],
    };
    let stats = execute(
        &job,
        &Options {
            sync: true,
            ..Options::default()
        },
    )
    .unwrap();
    assert_eq!(
        (stats.bytes_read, stats.bytes_written, stats.runs),
        (16, 8, 1)
    );
    let got = fs::read(&dst[0]).unwrap();
    assert_eq!(got, [0xC0, 0x3F, 0x00, 0xC0, 0x50, 0x40, 0xFF, 0xFF]);
}
