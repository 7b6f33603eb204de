//! Turning fuzzer bytes into the core's inputs: shapes, regions, chunks.
//!
//! Hand-written rather than `arbitrary`-derived because the core's types are
//! not ours to derive on, and because the interesting values are chosen on
//! purpose: a selector byte picks small extents (so plans are valid often
//! enough to reach the copy code) or raw 64-bit ones (so overflow checks are
//! reached).

use std::path::{Path, PathBuf};

use _core::dtype::DType;
use _core::files::ChunkRef;
use _core::geometry::Region;

/// Reads values off the front of the input; past the end everything is zero.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data }
    }

    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.u8();
        }
        u64::from_le_bytes(b)
    }

    pub fn u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        for x in &mut b {
            *x = self.u8();
        }
        u32::from_le_bytes(b)
    }

    /// A count in `0..=max`.
    pub fn count(&mut self, max: usize) -> usize {
        self.u8() as usize % (max + 1)
    }

    /// An extent or offset: small (0..=16) most of the time, edge values or
    /// raw 64-bit ones otherwise.
    pub fn dim(&mut self) -> u64 {
        match self.u8() % 8 {
            0 => self.u64(),
            1 => u64::MAX - u64::from(self.u8()),
            2 => 1u64 << (self.u8() % 64),
            _ => u64::from(self.u8() % 17),
        }
    }

    pub fn shape(&mut self) -> Vec<u64> {
        let rank = self.count(4);
        (0..rank).map(|_| self.dim()).collect()
    }

    pub fn region(&mut self, rank: usize) -> Region {
        if self.u8() % 3 == 0 {
            Region::Flat {
                start: self.dim(),
                len: self.dim(),
            }
        } else {
            // usually of the tensor's rank; sometimes not, to reach the arity checks
            let r = if self.u8() % 8 == 0 { self.count(5) } else { rank };
            let r2 = if self.u8() % 16 == 0 { self.count(5) } else { r };
            Region::Box {
                offsets: (0..r).map(|_| self.dim()).collect(),
                sizes: (0..r2).map(|_| self.dim()).collect(),
            }
        }
    }

    pub fn dtype(&mut self) -> DType {
        DType::ALL[self.u8() as usize % DType::ALL.len()]
    }

    pub fn chunk(&mut self, rank: usize, files: usize) -> ChunkRef {
        ChunkRef {
            file: if self.u8() % 16 == 0 { self.count(8) } else { self.count(files.saturating_sub(1)) },
            offset: if self.u8() % 4 == 0 { self.dim() } else { u64::from(self.u8()) * 4 },
            region: self.region(rank),
            dtype: self.dtype(),
        }
    }

    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// A scratch file per fuzzing process (targets that take paths).
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ravex-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

pub fn write(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap();
}
