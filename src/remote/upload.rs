//! The multipart upload: a new object written by range ([`Upload`]). Bytes
//! fill fixed-size parts ([`PartPlan`]); a full part is uploaded at once in
//! the background, with at most `max_in_flight` parts in flight per bucket,
//! so memory stays at parts in flight × part size (plus parts being filled),
//! not the object's size. An object of one part is one PUT at `close`.
//! Nothing is spooled to local disk.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use bytes::Bytes;
use memmap2::MmapMut;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as Key;
use object_store::{MultipartId, PutPayload};

use super::{block_on, runtime, Bucket, Kind, Mode, RemoteError, Result};
use crate::files::WriteAt;
use crate::parts::PartPlan;

/// A part's bytes, in an anonymous map of their own that goes back to the system when the part
/// has gone up. (In `Vec`s, parts filled on copy threads and freed on upload threads stayed in
/// the allocator's arenas: 220-292 MiB at 8 parts of 8 MiB in flight, against 104 MiB of parts;
/// docs/benchmarks-s3.md.) Pages are zero until written, and only written pages take memory.
struct PartBuf {
    data: MmapMut,
    filled: u64,
}

fn part_buffer(len: u64, url: &str) -> Result<MmapMut> {
    MmapMut::map_anon(len.max(1) as usize).map_err(|e| RemoteError {
        kind: Kind::Other,
        url: url.to_string(),
        detail: format!("cannot map {len} bytes of memory for a part: {e}"),
    })
}

/// The first `len` bytes of a part's buffer, as the payload of a request (no copy).
fn payload(data: MmapMut, len: u64, url: &str) -> Result<Bytes> {
    let map = data.make_read_only().map_err(|e| RemoteError {
        kind: Kind::Other,
        url: url.to_string(),
        detail: format!("cannot seal a part's memory: {e}"),
    })?;
    Ok(Bytes::from_owner(map).slice(..len as usize))
}

#[derive(Default)]
struct UpState {
    /// The multipart upload, begun when the first part is ready to go up
    /// (an object of one part is one PUT and never has one).
    id: Option<MultipartId>,
    open: HashMap<usize, PartBuf>,
    sent: HashSet<usize>,
    done: HashMap<usize, PartId>,
    /// One past the last byte written.
    end: u64,
    in_flight: usize,
    error: Option<RemoteError>,
    finished: bool,
}

struct Shared {
    bucket: Arc<Bucket>,
    key: String,
    path: Key,
    plan: PartPlan,
    state: Mutex<UpState>,
    changed: Condvar,
}

/// A new object written by range and uploaded in parts as they fill. Writes
/// may reach past the size it was begun with (a zip's central directory, a
/// compressed file whose size is known at its end): the object is as long as
/// its furthest write, and the part size stays the one its first size chose.
#[derive(Clone)]
pub struct Upload(Arc<Shared>);

impl fmt::Debug for Upload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Upload({})", self.name())
    }
}

impl Upload {
    /// Begins object `key`, expected to be `size` bytes long.
    pub fn new(bucket: Arc<Bucket>, key: &str, size: u64) -> Result<Upload> {
        let path = bucket.key(key)?;
        let plan = PartPlan::new(size, bucket.part_size()).map_err(|detail| RemoteError {
            kind: Kind::Invalid,
            url: bucket.url(key),
            detail,
        })?;
        Ok(Upload(Arc::new(Shared {
            bucket,
            key: key.to_string(),
            path,
            plan,
            state: Mutex::new(UpState::default()),
            changed: Condvar::new(),
        })))
    }

    pub fn key(&self) -> &str {
        &self.0.key
    }

    /// The multipart upload's id, once one is begun.
    pub fn upload_id(&self) -> Option<String> {
        self.lock().id.clone()
    }

    pub fn plan(&self) -> PartPlan {
        self.0.plan
    }

    fn lock(&self) -> MutexGuard<'_, UpState> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self, st: &UpState) -> Result<()> {
        match &st.error {
            Some(e) => Err(e.clone()),
            None if st.finished => Err(RemoteError {
                kind: Kind::Invalid,
                url: self.name(),
                detail: "the upload is closed".into(),
            }),
            None => Ok(()),
        }
    }

    fn invalid(&self, detail: String) -> RemoteError {
        RemoteError {
            kind: Kind::Invalid,
            url: self.name(),
            detail,
        }
    }

    /// Copies `data` to byte `offset`; a part that fills goes up at once.
    pub fn write(&self, data: &[u8], offset: u64) -> Result<()> {
        let ps = self.0.plan.part_size;
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e.div_ceil(ps) > crate::parts::MAX_PARTS) {
            return Err(self.invalid(format!(
                "a write of {} bytes at {offset} makes the object longer than 10,000 parts of {ps} bytes",
                data.len()
            )));
        }
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let part = (at / ps) as usize;
            let start = part as u64 * ps;
            let n = ((start + ps - at) as usize).min(data.len() - done);
            let full = {
                let mut st = self.lock();
                self.failed(&st)?;
                if st.sent.contains(&part) {
                    return Err(self.invalid(format!(
                        "bytes {at}.. are written after their part went up (each byte is written once)"
                    )));
                }
                st.end = st.end.max(at + n as u64);
                let buf = match st.open.entry(part) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(PartBuf {
                        data: part_buffer(ps, &self.name())?,
                        filled: 0,
                    }),
                };
                let from = (at - start) as usize;
                buf.data[from..from + n].copy_from_slice(&data[done..done + n]);
                buf.filled += n as u64;
                if buf.filled >= ps {
                    st.sent.insert(part);
                    st.open.remove(&part).map(|b| b.data)
                } else {
                    None
                }
            };
            if let Some(bytes) = full {
                self.send(part, payload(bytes, ps, &self.name())?)?;
            }
            done += n;
        }
        Ok(())
    }

    /// The multipart upload, begun now if it is not yet.
    fn multipart_id(&self) -> Result<MultipartId> {
        if let Some(id) = self.lock().id.clone() {
            return Ok(id);
        }
        let bucket = &self.0.bucket;
        let store = bucket.store()?;
        let id = block_on(store.create_multipart(&self.0.path))
            .map_err(|e| bucket.error(&self.name(), e))?;
        let mut st = self.lock();
        match st.id.clone() {
            Some(first) => {
                // another thread began one meanwhile: keep theirs, drop ours
                drop(st);
                let _ = bucket.abort_upload(&self.0.key, &id);
                Ok(first)
            }
            None => {
                st.id = Some(id.clone());
                Ok(id)
            }
        }
    }

    /// Uploads part `part` in the background, once a slot is free.
    fn send(&self, part: usize, bytes: Bytes) -> Result<()> {
        let id = match self.multipart_id() {
            Ok(id) => id,
            Err(e) => {
                self.lock().error.get_or_insert(e.clone());
                return Err(e);
            }
        };
        let shared = self.0.clone();
        let store = shared.bucket.store()?;
        shared.bucket.take_slot();
        self.lock().in_flight += 1;
        runtime().spawn(async move {
            let r = store
                .put_part(&shared.path, &id, part, PutPayload::from(bytes))
                .await;
            let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.in_flight -= 1;
            match r {
                Ok(pid) => {
                    st.done.insert(part, pid);
                }
                Err(e) => {
                    let err = shared.bucket.error(&shared.bucket.url(&shared.key), e);
                    st.error.get_or_insert(err);
                }
            }
            drop(st);
            shared.bucket.free_slot();
            shared.changed.notify_all();
        });
        Ok(())
    }

    fn wait_idle(&self) -> MutexGuard<'_, UpState> {
        let mut st = self.lock();
        while st.in_flight > 0 {
            st = self.0.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st
    }

    /// Sends what is left (bytes never written are zeros, as in a new file of
    /// this size), completes the upload and returns the object's ETag. On
    /// any failure the upload is aborted: the object never appears.
    pub fn close(&self) -> Result<String> {
        let result = self.finish();
        if result.is_err() {
            self.abort();
        }
        result
    }

    fn finish(&self) -> Result<String> {
        let ps = self.0.plan.part_size;
        let bucket = &self.0.bucket;
        let (size, parts, single) = {
            let mut st = self.wait_idle();
            self.failed(&st)?;
            let size = st.end.max(self.0.plan.size);
            let parts = size.div_ceil(ps).max(1) as usize;
            let single = if parts == 1 && st.id.is_none() {
                st.finished = true;
                Some(st.open.remove(&0).map(|b| b.data))
            } else {
                None
            };
            (size, parts, single)
        };
        if let Some(data) = single {
            let data = match data {
                Some(d) => d,
                None => part_buffer(size, &self.name())?,
            };
            return bucket.put(
                &self.0.key,
                payload(data, size, &self.name())?,
                Mode::Overwrite,
            );
        }
        for part in 0..parts {
            let data = {
                let mut st = self.lock();
                self.failed(&st)?;
                if !st.sent.insert(part) {
                    continue;
                }
                let len = ((part as u64 + 1) * ps).min(size) - part as u64 * ps;
                (st.open.remove(&part).map(|b| b.data), len)
            };
            let (data, len) = data;
            let data = match data {
                Some(d) => d,
                None => part_buffer(len, &self.name())?, // never written: zeros, as in a new file
            };
            self.send(part, payload(data, len, &self.name())?)?;
        }
        let (id, ids) = {
            let mut st = self.wait_idle();
            self.failed(&st)?;
            st.finished = true;
            let ids: Option<Vec<PartId>> = (0..parts).map(|p| st.done.remove(&p)).collect();
            (st.id.clone(), ids)
        };
        let (Some(id), Some(ids)) = (id, ids) else {
            return Err(self.invalid("a part of the upload is missing at its end".into()));
        };
        let store = bucket.store()?;
        block_on(store.complete_multipart(&self.0.path, &id, ids))
            .map(|r| r.e_tag.unwrap_or_default())
            .map_err(|e| bucket.error(&self.name(), e))
    }

    /// Drops the upload: its parts are discarded and the object never appears.
    /// Without `cleanup` (the server stopped answering), the upload is left for
    /// the next writer at this prefix to abort.
    pub fn abort_with(&self, cleanup: bool) {
        let (id, unreachable) = {
            let mut st = self.wait_idle();
            st.error.get_or_insert(RemoteError {
                kind: Kind::Invalid,
                url: self.name(),
                detail: "the upload was aborted".into(),
            });
            st.finished = true;
            st.open.clear();
            let unreachable = st
                .error
                .as_ref()
                .is_some_and(|e| e.kind == Kind::Unreachable);
            (st.id.clone(), unreachable)
        };
        if let (Some(id), true, false) = (id, cleanup, unreachable) {
            let _ = self.0.bucket.abort_upload(&self.0.key, &id);
        }
    }

    pub fn abort(&self) {
        self.abort_with(true);
    }
}

impl WriteAt for Upload {
    fn size(&self) -> u64 {
        self.0.plan.size
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write(data, offset).map_err(io::Error::from)
    }

    fn name(&self) -> String {
        self.0.bucket.url(&self.0.key)
    }
}
