//! The ranged reader: an object the executor (and `S3Path.open`) reads by
//! range ([`RemoteObject`]). Its bytes come through the bucket's read-ahead
//! store (`readahead.rs`): part-sized ranged GETs on the async runtime, the
//! parts after a sequential read (one that goes on where a read stopped, or
//! where the executor said a piece starts) fetched ahead, at most
//! `2 x read_ahead` parts held per bucket. A run of small tensors is served
//! from the parts it falls in (one GET, not one each); an object's first read,
//! where small (a header), is one GET of its own bytes.

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

/// An object's first read, of at most this many bytes, where no part held has
/// them, is one GET of those bytes: a part (8 MiB) would cost a header reader
/// a quarter of a second on a link of 32 MB/s per connection. Later reads that
/// are not sequential go through parts, which stay, so that a scan that skips
/// forward (a zip's local headers, one per storage) costs a GET per part, not
/// one per read.
const EXACT: u64 = 1 << 20;

/// An object the executor reads by range.
#[derive(Debug)]
pub struct RemoteObject {
    bucket: Arc<Bucket>,
    key: String,
    size: u64,
    id: u64,
    /// Where recent reads ended, oldest first.
    ends: Mutex<VecDeque<u64>>,
    /// Its GETs that may still be in flight: a closed object's are
    /// stopped, so parts fetched ahead for it take no more of the link.
    gets: Mutex<Vec<tokio::task::AbortHandle>>,
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
            gets: Mutex::new(Vec::new()),
        }
    }

    fn ends(&self) -> std::sync::MutexGuard<'_, VecDeque<u64>> {
        self.ends.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a read of `len` bytes at `offset` goes on where a read
    /// stopped (or where [`ReadAt::reads_from`] said reads would start), and
    /// whether it is the object's first; notes where it ends. The first read
    /// of an object is not sequential by itself: a reader of a header (8
    /// bytes, then a megabyte at most) would have the whole read-ahead fetched
    /// for nothing.
    fn sequential(&self, offset: u64, len: u64) -> (bool, bool) {
        let mut ends = self.ends();
        let first = ends.is_empty();
        let found = ends.iter().position(|&e| e == offset);
        if let Some(i) = found {
            ends.remove(i);
        }
        ends.push_back(offset + len);
        while ends.len() > STREAMS {
            ends.pop_front();
        }
        (found.is_some(), first)
    }
}

impl Drop for RemoteObject {
    fn drop(&mut self) {
        for get in self
            .gets
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            get.abort();
        }
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
        let get = super::runtime().spawn(async move {
            let got = bucket.get_range_async(&key, start, len).await;
            bucket.cache.done(id, index, got);
        });
        let mut gets = self.gets.lock().unwrap_or_else(|e| e.into_inner());
        gets.retain(|g| !g.is_finished());
        gets.push(get.abort_handle());
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
        let len = buf.len() as u64;
        let (sequential, first) = self.sequential(offset, len);
        if first && !sequential && len <= EXACT && !self.bucket.cache.holds(self.id, offset, len) {
            // a header, a zip's directory: one GET of what is asked, kept nowhere
            let got = self.bucket.get_range(&self.key, offset, len)?;
            buf.copy_from_slice(&got);
            return Ok(());
        }
        self.bucket
            .cache
            .read(self, buf, offset, sequential)
            .map_err(io::Error::from)
    }

    fn name(&self) -> String {
        self.bucket.url(&self.key)
    }

    fn reads_from(&self, offset: u64) {
        let mut ends = self.ends();
        if !ends.contains(&offset) {
            ends.push_back(offset);
            while ends.len() > STREAMS {
                ends.pop_front();
            }
        }
    }
}
