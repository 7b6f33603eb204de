//! The parts a bucket's readers hold: every read of an object goes through
//! part-sized, part-aligned ranged GETs that run on the async runtime, not on
//! the reading thread, so the GETs in flight are set by the bucket's limit
//! and not by how many threads read. A sequential read (`reader.rs` decides:
//! one that goes on where a read of the object stopped) has the parts after
//! it fetched ahead while its reader works on what it has.
//!
//! Why: on a link where one connection gives tens of MB/s and every request
//! waits tens of milliseconds for its first byte, throughput comes from
//! requests in flight. One GET at a time per copy thread made a 384 MiB
//! download 3.6x slower than boto3's ten in flight (issue 43).
//!
//! Two limits, from the bucket's `max_in_flight` (K): at most K GETs fetch
//! ahead at a time, and the store holds at most 2K parts (in flight, or
//! fetched and not yet read). Parts come back in any order and are read in
//! order, so a part fetched early waits for the ones before it; were it to
//! count as in flight, fewer GETs would run than K says (measured on the
//! shaped link, 384 MiB at K = 8: 3.9 s with one limit of K parts held).
//! The threads reading at a time share the read-ahead: each may have
//! `2K / threads` parts fetched ahead of its read.
//!
//! Memory: at most 2K parts; a read whose own parts do not fit is never
//! refused, so at worst the parts of the reads waiting right now come on
//! top. A part goes
//! as soon as every byte of it has been read; a part read only in part (a
//! header) stays, as in a cache, until room is needed (least recently used
//! first). A part fetched ahead that nobody reads while `2 x limit` other
//! parts are read is dropped too. Parts already read in full are not fetched
//! ahead again (another reader starting there read them).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Kind, RemoteError, Result};

/// An object read through the store.
pub(super) trait Parts: Send + Sync {
    /// Its id in the store ([`ReadAhead::new_id`]).
    fn id(&self) -> u64;
    fn size(&self) -> u64;
    /// How it is named in messages.
    fn url(&self) -> String;
    /// Starts the GET of part `index` (bytes `start..start + len`); its
    /// result goes to [`ReadAhead::done`], from any thread, possibly before
    /// this returns.
    fn fetch(&self, index: u64, start: u64, len: u64);
}

enum Slot {
    Pending,
    Ready(Bytes),
    Failed(RemoteError),
}

struct Part {
    slot: Slot,
    /// Bytes of it handed to readers.
    used: u64,
    /// Reads that asked for it and have not copied from it yet: it stays.
    readers: usize,
    /// Fetched ahead; no read has asked for it yet.
    ahead: bool,
    /// The store's clock when a read last asked for it.
    touched: u64,
    /// Parts read in full when it was fetched.
    since: u64,
}

#[derive(Default)]
struct State {
    parts: HashMap<(u64, u64), Part>,
    /// Parts read in full, per object (not fetched ahead again).
    read: HashSet<(u64, u64)>,
    n_read: u64,
    clock: u64,
    /// The most parts held at once.
    peak: usize,
    /// Parts whose GET is in flight.
    pending: usize,
    /// The threads that read: whether one is inside a read, and when it
    /// last left one.
    readers: HashMap<ThreadId, (bool, Instant)>,
}

/// A thread that left a read this recently still counts as reading (a copy
/// thread writes 64 KiB between two reads).
const ACTIVE: Duration = Duration::from_millis(50);

impl State {
    /// Drops one part that may go, least recently asked for first: one
    /// fetched (or failed) that no read waits for. A part fetched ahead goes
    /// only once it is stale (untouched while `2 x limit` parts were read);
    /// for a part to be fetched ahead (`ahead`) only stale parts go, so that
    /// read-ahead never pushes out the rest of a part a reader is still to
    /// reach (where two copy threads' stretches meet inside a part).
    /// False where none may go.
    fn evict_one(&mut self, limit: usize, ahead: bool) -> bool {
        let n_read = self.n_read;
        let victim = self
            .parts
            .iter()
            .filter(|(_, p)| {
                let stale = n_read - p.since >= 2 * limit as u64;
                p.readers == 0 && !matches!(p.slot, Slot::Pending) && (stale || !(p.ahead || ahead))
            })
            .min_by_key(|(_, p)| p.touched)
            .map(|(k, _)| *k);
        victim.is_some_and(|k| self.parts.remove(&k).is_some())
    }

    /// Makes room for one more part; false where the store is full of
    /// parts that may not go.
    fn room(&mut self, limit: usize, ahead: bool) -> bool {
        while self.parts.len() >= limit {
            if !self.evict_one(limit, ahead) {
                return false;
            }
        }
        true
    }

    /// Parts each reading thread may have fetched ahead: the limit shared
    /// among the threads reading now. (Where the first thread to read on took
    /// every slot, the other read one part at a time, on one connection,
    /// while the first had them all: 384 MiB on the shaped link took 4.9 s
    /// at 8 parts, against 2.5 s for boto3's 10 connections.)
    fn share(&mut self, limit: usize) -> usize {
        let now = Instant::now();
        self.readers
            .retain(|_, (inside, left)| *inside || now - *left < 20 * ACTIVE);
        let active = self
            .readers
            .values()
            .filter(|(inside, left)| *inside || now - *left < ACTIVE)
            .count();
        (limit / active.max(1)).max(1)
    }

    fn insert(&mut self, key: (u64, u64), ahead: bool) {
        self.clock += 1;
        let part = Part {
            slot: Slot::Pending,
            used: 0,
            readers: usize::from(!ahead),
            ahead,
            touched: self.clock,
            since: self.n_read,
        };
        self.parts.insert(key, part);
        self.pending += 1;
        self.peak = self.peak.max(self.parts.len());
    }
}

/// The parts of one bucket's objects, and the limits on how many it holds
/// and fetches ahead.
pub(super) struct ReadAhead {
    state: Mutex<State>,
    changed: Condvar,
    next_id: AtomicU64,
    /// Parts held, at most.
    limit: usize,
    /// GETs fetching ahead at a time, at most.
    flight: usize,
    part: u64,
}

impl ReadAhead {
    /// At most `in_flight` GETs ahead and `2 x in_flight` parts held, of `part` bytes.
    pub(super) fn new(in_flight: usize, part: u64) -> ReadAhead {
        ReadAhead {
            state: Mutex::default(),
            changed: Condvar::new(),
            next_id: AtomicU64::new(0),
            limit: 2 * in_flight.max(1),
            flight: in_flight.max(1),
            part: part.max(1),
        }
    }

    pub(super) fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most parts held at once so far.
    #[cfg(test)]
    pub(super) fn peak(&self) -> usize {
        self.lock().peak
    }

    /// Parts held now.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.lock().parts.len()
    }

    /// Bytes `start..start + len` of part `index`: where it starts, and how long it is.
    fn span(&self, size: u64, index: u64) -> (u64, u64) {
        let start = index * self.part;
        (start, self.part.min(size - start))
    }

    /// Whether bytes `offset..offset + len` of object `id` are in parts held now.
    pub(super) fn holds(&self, id: u64, offset: u64, len: u64) -> bool {
        let st = self.lock();
        let last = (offset + len.max(1) - 1) / self.part;
        (offset / self.part..=last).all(|i| st.parts.contains_key(&(id, i)))
    }

    /// The result of a GET that [`Parts::fetch`] started.
    pub(super) fn done(&self, id: u64, index: u64, got: Result<Bytes>) {
        let mut st = self.lock();
        let st = &mut *st;
        if let Some(part) = st.parts.get_mut(&(id, index)) {
            if matches!(part.slot, Slot::Pending) {
                st.pending -= 1;
                part.slot = match got {
                    Ok(b) => Slot::Ready(b),
                    Err(e) => Slot::Failed(e),
                };
            }
        }
        self.changed.notify_all();
    }

    /// Drops what the store holds of object `id` (it is closed).
    pub(super) fn forget(&self, id: u64) {
        let mut st = self.lock();
        let gone = st
            .parts
            .iter()
            .filter(|((i, _), p)| *i == id && matches!(p.slot, Slot::Pending))
            .count();
        st.pending -= gone;
        st.parts.retain(|(i, _), _| *i != id);
        st.read.retain(|(i, _)| *i != id);
    }

    /// Fills `buf` from byte `offset` of `obj` (which the caller has checked
    /// holds them). `sequential`: the read goes on where one stopped, so the
    /// parts after it are fetched ahead.
    pub(super) fn read(
        &self,
        obj: &dyn Parts,
        buf: &mut [u8],
        offset: u64,
        sequential: bool,
    ) -> Result<()> {
        let me = std::thread::current().id();
        self.lock().readers.insert(me, (true, Instant::now()));
        let done = self.read_parts(obj, buf, offset, sequential);
        self.lock().readers.insert(me, (false, Instant::now()));
        done
    }

    fn read_parts(
        &self,
        obj: &dyn Parts,
        buf: &mut [u8],
        offset: u64,
        sequential: bool,
    ) -> Result<()> {
        let len = buf.len() as u64;
        if len == 0 {
            return Ok(());
        }
        let (id, size) = (obj.id(), obj.size());
        let (first, last) = (offset / self.part, (offset + len - 1) / self.part);
        let mut start = Vec::new();
        {
            let mut st = self.lock();
            for i in first..=last {
                st.clock += 1;
                let (clock, n_read) = (st.clock, st.n_read);
                match st.parts.get_mut(&(id, i)) {
                    Some(p) => {
                        p.ahead = false;
                        p.touched = clock;
                        p.since = n_read;
                        p.readers += 1;
                    }
                    None => {
                        // what a read needs now is fetched even where the store is full
                        st.room(self.limit, false);
                        st.insert((id, i), false);
                        start.push(i);
                    }
                }
            }
            if sequential {
                let end = size.div_ceil(self.part);
                let ahead = st.share(self.limit) as u64;
                for i in last + 1..end.min(last + 1 + ahead) {
                    if st.parts.contains_key(&(id, i)) || st.read.contains(&(id, i)) {
                        continue;
                    }
                    if st.pending >= self.flight || !st.room(self.limit, true) {
                        break;
                    }
                    st.insert((id, i), true);
                    start.push(i);
                }
            }
        }
        for &i in &start {
            let (s, n) = self.span(size, i);
            obj.fetch(i, s, n);
        }
        let mut done = 0u64;
        for i in first..=last {
            let (s, n) = self.span(size, i);
            let data = match self.wait(obj, i) {
                Ok(d) => d,
                Err(e) => {
                    self.release(id, i + 1..=last);
                    return Err(e);
                }
            };
            if data.len() as u64 != n {
                self.release(id, i..=last);
                return Err(RemoteError {
                    kind: Kind::Other,
                    url: obj.url(),
                    detail: format!(
                        "asked for bytes {s}..{}, got {} bytes (the object changed or was truncated)",
                        s + n,
                        data.len()
                    ),
                });
            }
            let from = (offset + done - s) as usize;
            let take = (n - from as u64).min(len - done) as usize;
            buf[done as usize..done as usize + take].copy_from_slice(&data[from..from + take]);
            done += take as u64;
            self.used(id, i, take as u64, n);
        }
        Ok(())
    }

    /// Part `index` of `obj` once its GET is done; fetched again where it
    /// went meanwhile. A failed GET's error goes to this reader, and the part
    /// with it (a later read asks again).
    fn wait(&self, obj: &dyn Parts, index: u64) -> Result<Bytes> {
        let key = (obj.id(), index);
        let mut st = self.lock();
        loop {
            match st.parts.get(&key).map(|p| &p.slot) {
                Some(Slot::Ready(b)) => return Ok(b.clone()),
                Some(Slot::Failed(_)) => {
                    let Some(Part {
                        slot: Slot::Failed(e),
                        ..
                    }) = st.parts.remove(&key)
                    else {
                        unreachable!("the slot was just seen failed")
                    };
                    return Err(e);
                }
                Some(Slot::Pending) => {
                    st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                None => {
                    st.room(self.limit, false);
                    st.insert(key, false);
                    drop(st);
                    let (s, n) = self.span(obj.size(), index);
                    obj.fetch(index, s, n);
                    st = self.lock();
                }
            }
        }
    }

    /// A failed read gives up the parts it has not copied from yet.
    fn release(&self, id: u64, parts: std::ops::RangeInclusive<u64>) {
        let mut st = self.lock();
        for i in parts {
            if let Some(p) = st.parts.get_mut(&(id, i)) {
                p.readers = p.readers.saturating_sub(1);
            }
        }
    }

    /// Notes `n` more bytes of part `index` read; a part read in full goes.
    fn used(&self, id: u64, index: u64, n: u64, len: u64) {
        let mut st = self.lock();
        let Some(part) = st.parts.get_mut(&(id, index)) else {
            return;
        };
        part.used += n;
        part.readers = part.readers.saturating_sub(1);
        if part.used >= len {
            st.parts.remove(&(id, index));
            st.read.insert((id, index));
            st.n_read += 1;
        }
    }
}
