//! The ranged reader: an object the executor reads by range ([`RemoteObject`]).
//! A piece's bytes come in one ranged GET; reads smaller than a block go
//! through a small bucket-wide cache of 8 MiB blocks, so that a run of small
//! tensors costs one GET, not one each.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::{Bucket, Kind, RemoteError, Result};
use crate::files::ReadAt;

/// Reads smaller than this go through the block cache.
const BLOCK: u64 = 8 << 20;
/// Blocks the cache of one bucket holds.
const CACHED_BLOCKS: usize = 8;

/// The blocks a bucket's objects read last, `(object id, block index, bytes)`
/// oldest first, and the next object's id.
#[derive(Default)]
pub(super) struct BlockCache {
    blocks: Mutex<VecDeque<(u64, u64, Bytes)>>,
    next_id: AtomicU64,
}

impl BlockCache {
    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, u64, Bytes)>> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, id: u64, block: u64) -> Option<Bytes> {
        self.lock()
            .iter()
            .find(|(i, k, _)| *i == id && *k == block)
            .map(|(_, _, b)| b.clone())
    }

    fn put(&self, id: u64, block: u64, data: Bytes) {
        let mut cache = self.lock();
        cache.push_back((id, block, data));
        while cache.len() > CACHED_BLOCKS {
            cache.pop_front();
        }
    }

    /// Drops the cached blocks of an object.
    fn forget(&self, id: u64) {
        self.lock().retain(|(i, _, _)| *i != id);
    }
}

/// An object the executor reads by range.
#[derive(Debug)]
pub struct RemoteObject {
    bucket: Arc<Bucket>,
    key: String,
    size: u64,
    id: u64,
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
        }
    }
}

impl Drop for RemoteObject {
    fn drop(&mut self) {
        self.bucket.cache.forget(self.id);
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
                    self.name(),
                    self.size
                ),
            ));
        }
        self.read_cached(buf, offset).map_err(io::Error::from)
    }

    fn name(&self) -> String {
        self.bucket.url(&self.key)
    }
}

impl RemoteObject {
    /// Bytes `offset..offset + buf.len()`, through the block cache where the
    /// read is small.
    fn read_cached(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        if len >= BLOCK {
            let got = self.bucket.get_range(&self.key, offset, len)?;
            buf.copy_from_slice(&got);
            return Ok(());
        }
        let mut done = 0u64;
        while done < len {
            let at = offset + done;
            let block = at / BLOCK;
            let start = block * BLOCK;
            let data = self.block(block, start)?;
            let from = (at - start) as usize;
            let n = ((data.len() - from) as u64).min(len - done) as usize;
            if n == 0 {
                return Err(RemoteError {
                    kind: Kind::Other,
                    url: self.bucket.url(&self.key),
                    detail: format!("bytes from {at} are past the object's end"),
                });
            }
            buf[done as usize..done as usize + n].copy_from_slice(&data[from..from + n]);
            done += n as u64;
        }
        Ok(())
    }

    fn block(&self, block: u64, start: u64) -> Result<Bytes> {
        let cache = &self.bucket.cache;
        if let Some(b) = cache.get(self.id, block) {
            return Ok(b);
        }
        let data =
            self.bucket
                .get_range(&self.key, start, BLOCK.min(self.size.saturating_sub(start)))?;
        cache.put(self.id, block, data.clone());
        Ok(data)
    }
}
