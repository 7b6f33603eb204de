//! The executor over a source read by range (what an object in a bucket is
//! to it): same-dtype copies read it a step at a time, casts a piece at a
//! time; either way the bytes are the source's, and a failed read is an
//! error naming the source.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use half::bf16;

use crate::dtype::DType;
use crate::exec::{execute, Job, Options, TensorJob};
use crate::files::{ChunkRef, Memory, ReadAt, Source, Target};
use crate::geometry::Region;

#[derive(Debug)]
struct Ranged {
    data: Vec<u8>,
    /// The byte whose read fails, if any.
    fail_at: Option<u64>,
    largest_read: AtomicUsize,
}

impl ReadAt for Ranged {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.largest_read.fetch_max(buf.len(), Ordering::Relaxed);
        let end = offset + buf.len() as u64;
        if self.fail_at.is_some_and(|f| (offset..end).contains(&f)) {
            return Err(io::Error::other("connection reset"));
        }
        buf.copy_from_slice(&self.data[offset as usize..end as usize]);
        Ok(())
    }
    fn name(&self) -> String {
        "s3://b/src".into()
    }
}

fn chunk(offset: u64, n: u64, dtype: DType) -> ChunkRef {
    ChunkRef {
        file: 0,
        offset,
        region: Region::Flat { start: 0, len: n },
        dtype,
    }
}

/// `n` f32 elements from byte 8 of `src` into `out` as `to`.
fn run(src: &Arc<Ranged>, n: u64, to: DType, out: &mut [u8]) -> Result<(), String> {
    let job = Job {
        sources: vec![Source::Remote(src.clone())],
        targets: vec![Target::Memory(Memory::new(out))],
        tensors: vec![TensorJob {
            shape: vec![n],
            src_chunks: vec![chunk(8, n, DType::F32)],
            dst_chunks: vec![chunk(0, n, to)],
        }],
    };
    let options = Options {
        threads: 3,
        window_bytes: 3 << 20, // pieces of 1 MiB: several per thread
        ..Options::default()
    };
    execute(&job, &options)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn source(n: usize, fail_at: Option<u64>) -> Arc<Ranged> {
    let mut data = vec![0u8; 8];
    data.extend((0..n).flat_map(|i| (i as f32 * 0.25).to_le_bytes()));
    Arc::new(Ranged {
        data,
        fail_at,
        largest_read: AtomicUsize::new(0),
    })
}

#[test]
fn a_remote_source_is_copied_a_step_at_a_time_and_cast_whole() {
    let n = 1_500_000usize; // about 5.7 MiB
    let src = source(n, None);
    let mut out = vec![0u8; n * 4];
    run(&src, n as u64, DType::F32, &mut out).unwrap();
    assert_eq!(out, src.data[8..]);
    // no read of a piece's size: steps only
    assert!(src.largest_read.load(Ordering::Relaxed) <= 1 << 20);

    let mut half = vec![0u8; n * 2];
    run(&src, n as u64, DType::BF16, &mut half).unwrap();
    let want: Vec<u8> = (0..n)
        .flat_map(|i| bf16::from_f32(i as f32 * 0.25).to_le_bytes())
        .collect();
    assert_eq!(half, want);
}

#[test]
fn a_failed_remote_read_is_an_error_naming_the_object() {
    let n = 1_000_000usize;
    for to in [DType::F32, DType::BF16] {
        let src = source(n, Some(3_000_000));
        let mut out = vec![0u8; n * to.size()];
        let err = run(&src, n as u64, to, &mut out).unwrap_err();
        assert!(err.contains("s3://b/src"), "{err}");
        assert!(err.contains("connection reset"), "{err}");
    }
}
