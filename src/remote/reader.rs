//! The ranged reader: an object the executor (and `S3Path.open`) reads by
//! range ([`RemoteObject`]). Its bytes come through the bucket's read-ahead
//! store (`readahead.rs`): part-sized ranged GETs on the async runtime, the
//! parts after a sequential read fetched ahead, at most `max_in_flight` parts
//! held per bucket. Small reads (a header, a run of small tensors) are served
//! from the part they fall in, so a run of small tensors costs one GET, not
//! one each.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex};

use super::readahead::Parts;
use super::Bucket;
use crate::files::ReadAt;

/// Readers of one object whose next byte is remembered (a copy thread each,
/// or a Python reader): a read that starts where one of them stopped is
/// sequential.
const STREAMS: usize = 16;

/// An object the executor reads by range.
#[derive(Debug)]
pub struct RemoteObject {
    bucket: Arc<Bucket>,
    key: String,
    size: u64,
    id: u64,
    /// Where recent reads ended, oldest first.
    ends: Mutex<VecDeque<u64>>,
}

impl RemoteObject {
    /// `size`: what the caller was told (a listing, a HEAD); reads past it are refused.
    pub fn new(bucket: Arc<Bucket>, key: String, size: u64) -> RemoteObject {
        let id = bucket.cache.new_id();
        RemoteObject {
            bucket,
            key,
            size,
            id,
            ends: Mutex::new(VecDeque::new()),
        }
    }

    /// Whether a read of `len` bytes at `offset` goes on where a read
    /// stopped (or starts the object), and notes where it ends.
    fn sequential(&self, offset: u64, len: u64) -> bool {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        let found = ends.iter().position(|&e| e == offset);
        if let Some(i) = found {
            ends.remove(i);
        }
        ends.push_back(offset + len);
        while ends.len() > STREAMS {
            ends.pop_front();
        }
        found.is_some() || offset == 0
    }
}

impl Drop for RemoteObject {
    fn drop(&mut self) {
        self.bucket.cache.forget(self.id);
    }
}

impl Parts for RemoteObject {
    fn id(&self) -> u64 {
        self.id
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn url(&self) -> String {
        self.bucket.url(&self.key)
    }

    fn fetch(&self, index: u64, start: u64, len: u64) {
        let (bucket, key, id) = (self.bucket.clone(), self.key.clone(), self.id);
        super::runtime().spawn(async move {
            let got = bucket.get_range_async(&key, start, len).await;
            bucket.cache.done(id, index, got);
        });
    }
}

impl ReadAt for RemoteObject {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > self.size)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: a read past the object's {} bytes",
                    ReadAt::name(self),
                    self.size
                ),
            ));
        }
        let sequential = self.sequential(offset, buf.len() as u64);
        self.bucket
            .cache
            .read(self, buf, offset, sequential)
            .map_err(io::Error::from)
    }

    fn name(&self) -> String {
        self.bucket.url(&self.key)
    }
}
