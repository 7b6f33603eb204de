//! The copy executor: plans every tensor of a job, turns element runs into
//! byte copies (casting between float dtypes where the chunks differ), cuts
//! them into pieces no larger than the copy window allows, and runs the
//! pieces on a thread pool with positional writes into existing files.
//!
//! Memory: copies from files and casts go through one 64 KiB buffer per
//! thread (see `WRITE_STEP`), or one of 1 MiB with direct writes
//! (`Options::direct`, `DIRECT_STEP`); in-memory sources are written from
//! their own bytes (copied into the step buffer with direct writes). Plans are not kept for the whole job: a first pass
//! plans each tensor to validate and count it, and drops the plan; the second
//! plans the tensors again, up to `ORDER_GROUP` of them at a time, puts their
//! pieces in target order and gives each thread one stretch of it, so that
//! threads write different files where the job has several (a file takes
//! writes one at a time; threads sharing one spun on its lock for 15-25% of
//! their time). Planning is cheap next to moving the bytes, and this way the
//! heap holds the pieces of one group, however many tensors the checkpoint
//! has.
//!
//! Validation happens before any byte moves: file indices, regions, the plan's
//! coverage, casts, chunk byte ranges against file sizes, and target chunks
//! that would overwrite each other.

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use crate::dtype::{cast_into, check_cast, DType};
use crate::files::{
    check_chunk, open_sources, open_targets, source_name, source_sizes, ChunkAt, ChunkRef, Error,
    Opened, Side, Source, SourceData, Target,
};
use crate::plan::{plan, Chunk, TargetPlan};

/// The default copy window: runs are cut into pieces of at most
/// `window_bytes / threads` bytes (the bytes themselves move through one
/// 64 KiB buffer per thread, see `WRITE_STEP`).
pub const DEFAULT_WINDOW_BYTES: u64 = 64 << 20;

/// One logical tensor: its global shape and where its chunks are on each side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorJob {
    pub shape: Vec<u64>,
    pub src_chunks: Vec<ChunkRef>,
    pub dst_chunks: Vec<ChunkRef>,
}

/// Everything one conversion moves: `ChunkRef::file` indexes `sources` for
/// source chunks and `targets` for target chunks.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    pub sources: Vec<Source<'a>>,
    pub targets: Vec<Target<'a>>,
    pub tensors: Vec<TensorJob>,
}

/// How to run a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Worker threads; 0 lets rayon choose (one per CPU, or `RAYON_NUM_THREADS`).
    pub threads: usize,
    /// Sets the largest piece: `window_bytes / threads` bytes (not a buffer
    /// size: copies go through one 64 KiB buffer per thread).
    pub window_bytes: u64,
    /// fsync every target after the last write.
    pub sync: bool,
    /// Start the write-back of every piece as soon as it is written
    /// (`sync_file_range(SYNC_FILE_RANGE_WRITE)` on Linux; nothing elsewhere),
    /// so the disk works while the copy goes on and a later fsync waits for
    /// little. For callers that fsync the targets themselves.
    pub writeback: bool,
    /// Write file targets around the page cache where the system allows it
    /// (`O_DIRECT` on Linux): every whole, aligned page of a piece goes
    /// straight to the device from a 1 MiB step buffer, the unaligned ends of
    /// a piece through the page cache as before (a page is written one way
    /// only, so the two never overlap). For durable output, which has to
    /// reach the disk anyway: it skips allocating page cache for bytes that
    /// are written once and then only fsynced. A file the system will not
    /// open this way, or a write it refuses, goes through the page cache.
    pub direct: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            threads: 0,
            window_bytes: DEFAULT_WINDOW_BYTES,
            sync: true,
            writeback: false,
            direct: false,
        }
    }
}

/// What a job moved (or, from [`plan_summary`], would move).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Element runs from the plans.
    pub runs: u64,
    /// Copies after cutting runs to the window.
    pub pieces: u64,
    /// Of `bytes_written`, those written around the page cache
    /// ([`Options::direct`]); 0 from [`plan_summary`].
    pub direct_bytes: u64,
}

/// [`Stats`] plus the bytes written into each target, in target order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub stats: Stats,
    pub per_target_bytes: Vec<u64>,
}

/// One copy: `elems` elements from byte `src_off` of source `src` to byte
/// `dst_off` of target `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Piece {
    pub src: usize,
    pub src_off: u64,
    pub dst: usize,
    pub dst_off: u64,
    pub elems: u64,
    pub from: DType,
    pub to: DType,
}

impl Piece {
    pub fn src_bytes(&self) -> u64 {
        self.elems * self.from.size() as u64
    }

    pub fn dst_bytes(&self) -> u64 {
        self.elems * self.to.size() as u64
    }
}

/// The pool a job runs on.
pub(crate) fn pool(threads: usize) -> Result<rayon::ThreadPool, Error> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("ravex-copy-{i}"))
        .build()
        .map_err(|e| Error::Invalid(format!("cannot start {threads} copy threads: {e}")))
}

/// How runs are cut: the most elements one piece may hold, so that either
/// side of it stays within its thread's share of the window.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cut {
    share: u64,
}

impl Cut {
    pub(crate) fn new(window_bytes: u64, threads: usize) -> Result<Cut, Error> {
        if window_bytes == 0 {
            return Err(Error::Invalid("window_bytes must be positive".into()));
        }
        Ok(Cut {
            share: window_bytes / threads.max(1) as u64,
        })
    }

    fn elems(self, from: DType, to: DType) -> u64 {
        (self.share / from.size().max(to.size()) as u64).max(1)
    }
}

/// Where the job's files are, for validation: sizes of the sources, and of
/// the targets where they are known (not for a dry run, where targets need
/// not exist yet).
#[derive(Clone, Copy)]
pub(crate) struct Sizes<'s> {
    pub sources: &'s [u64],
    pub targets: Option<&'s [u64]>,
}

/// Plans tensor `t` and checks everything about it against the files.
fn plan_tensor(job: &Job<'_>, t: usize, sizes: Sizes<'_>) -> Result<Vec<TargetPlan>, Error> {
    let tensor = &job.tensors[t];
    let ids = |chunks: &[ChunkRef]| -> Vec<Chunk> {
        chunks
            .iter()
            .enumerate()
            .map(|(id, c)| Chunk {
                id,
                region: c.region.clone(),
            })
            .collect()
    };
    let plans = plan(
        &tensor.shape,
        &ids(&tensor.src_chunks),
        &ids(&tensor.dst_chunks),
    )
    .map_err(|error| Error::Plan { tensor: t, error })?;
    // The plan validated every region, so `validate` only returns lengths here.
    let elems = |c: &ChunkRef| c.region.validate(&tensor.shape).unwrap_or(0);
    for (i, c) in tensor.src_chunks.iter().enumerate() {
        let at = ChunkAt {
            tensor: Some(t),
            side: Side::Source,
            chunk: i,
        };
        check_chunk(
            at,
            c,
            elems(c),
            job.sources.len(),
            Some(sizes.sources),
            |f| source_name(&job.sources, f),
        )?;
    }
    for (i, c) in tensor.dst_chunks.iter().enumerate() {
        let at = ChunkAt {
            tensor: Some(t),
            side: Side::Target,
            chunk: i,
        };
        check_chunk(at, c, elems(c), job.targets.len(), sizes.targets, |f| {
            job.targets[f].name(f)
        })?;
    }
    for p in &plans {
        let dst = &tensor.dst_chunks[p.target_id];
        for r in &p.runs {
            check_cast(tensor.src_chunks[r.source_id].dtype, dst.dtype).map_err(|e| {
                Error::Invalid(format!(
                    "tensor {t}: source chunk {} to target chunk {}: {e}",
                    r.source_id, p.target_id
                ))
            })?;
        }
    }
    Ok(plans)
}

/// The pieces of one planned tensor, in parallel: every run cut into pieces
/// of at most `cut` elements, each turned into byte offsets.
fn pieces<'p>(
    tensor: &'p TensorJob,
    plans: &'p [TargetPlan],
    cut: Cut,
) -> impl ParallelIterator<Item = Piece> + 'p {
    plans
        .par_iter()
        .flat_map(|p| p.runs.par_iter().map(move |r| (p.target_id, r)))
        .flat_map(move |(target_id, r)| {
            let src = &tensor.src_chunks[r.source_id];
            let dst = &tensor.dst_chunks[target_id];
            let (from, to) = (src.dtype, dst.dtype);
            let step = cut.elems(from, to);
            (0..r.run.len.div_ceil(step)).into_par_iter().map(move |k| {
                let done = k * step;
                Piece {
                    src: src.file,
                    src_off: src.offset + (r.run.src_elem + done) * from.size() as u64,
                    dst: dst.file,
                    dst_off: dst.offset + (r.run.dst_elem + done) * to.size() as u64,
                    elems: step.min(r.run.len - done),
                    from,
                    to,
                }
            })
        })
}

/// What each tensor moves, and that all of it is valid: the first pass.
/// Returns the job's stats and the bytes written into each target.
fn validate(job: &Job<'_>, sizes: Sizes<'_>, cut: Cut) -> Result<Summary, Error> {
    check_target_overlaps(job)?;
    // Per tensor: its stats and (target, bytes) for each run, kept sparse so
    // that many tensors times many targets costs nothing.
    let per_tensor = |t: usize| -> Result<(Stats, Vec<(usize, u64)>), Error> {
        let plans = plan_tensor(job, t, sizes)?;
        let tensor = &job.tensors[t];
        let mut stats = Stats::default();
        let mut written = Vec::new();
        for p in &plans {
            let dst = &tensor.dst_chunks[p.target_id];
            for r in &p.runs {
                let from = tensor.src_chunks[r.source_id].dtype;
                stats.runs += 1;
                stats.pieces += r.run.len.div_ceil(cut.elems(from, dst.dtype));
                stats.bytes_read += r.run.len * from.size() as u64;
                let n = r.run.len * dst.dtype.size() as u64;
                stats.bytes_written += n;
                written.push((dst.file, n));
            }
        }
        Ok((stats, written))
    };
    let empty = || Summary {
        stats: Stats::default(),
        per_target_bytes: vec![0; job.targets.len()],
    };
    let add = |mut a: Summary, b: &Stats| {
        a.stats.runs += b.runs;
        a.stats.pieces += b.pieces;
        a.stats.bytes_read += b.bytes_read;
        a.stats.bytes_written += b.bytes_written;
        a
    };
    (0..job.tensors.len())
        .into_par_iter()
        .map(per_tensor)
        .try_fold(empty, |acc, tensor| {
            let (stats, written) = tensor?;
            let mut acc = add(acc, &stats);
            for (file, n) in written {
                acc.per_target_bytes[file] += n;
            }
            Ok::<_, Error>(acc)
        })
        .try_reduce(empty, |a, b| {
            let mut a = add(a, &b.stats);
            for (x, y) in a.per_target_bytes.iter_mut().zip(&b.per_target_bytes) {
                *x += y;
            }
            Ok(a)
        })
}

/// Every piece of the job, in the executor's order (for tests: the executor
/// holds one `ORDER_GROUP` of tensors' pieces at a time, not all of them).
#[cfg(test)]
pub(crate) fn build_pieces(
    job: &Job<'_>,
    sizes: Sizes<'_>,
    window_bytes: u64,
    threads: usize,
) -> Result<(Vec<Piece>, u64), Error> {
    let cut = Cut::new(window_bytes, threads)?;
    let summary = validate(job, sizes, cut)?;
    let all = ordered_pieces(job, sizes, cut, 0..job.tensors.len())?;
    Ok((all, summary.stats.runs))
}

/// Refuses two target chunks whose byte ranges share a byte: the result
/// would depend on which write lands last.
fn check_target_overlaps(job: &Job<'_>) -> Result<(), Error> {
    // (file, start, end, tensor, chunk); chunks past their file are reported
    // later with a better message, so saturate here.
    let mut ranges: Vec<(usize, u64, u64, usize, usize)> = Vec::new();
    for (t, tensor) in job.tensors.iter().enumerate() {
        for (i, c) in tensor.dst_chunks.iter().enumerate() {
            let Ok(elems) = c.region.validate(&tensor.shape) else {
                continue;
            };
            let len = elems.saturating_mul(c.dtype.size() as u64);
            if len > 0 {
                ranges.push((c.file, c.offset, c.offset.saturating_add(len), t, i));
            }
        }
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let ((fa, sa, ea, ta, ca), (fb, sb, eb, tb, cb)) = (w[0], w[1]);
        if fa == fb && sb < ea {
            return Err(Error::TargetOverlap {
                file: job
                    .targets
                    .get(fa)
                    .map_or_else(|| format!("target {fa}"), |t| t.name(fa)),
                tensor: tb,
                chunk: cb,
                start: sb,
                end: eb,
                other_tensor: ta,
                other_chunk: ca,
                other_start: sa,
                other_end: ea,
            });
        }
    }
    Ok(())
}

/// What [`execute`] would do, without opening the targets or moving a byte.
/// Source files must exist (their sizes are checked); targets need not.
pub fn plan_summary(job: &Job<'_>, options: &Options) -> Result<Summary, Error> {
    let source_sizes = source_sizes(&job.sources)?;
    let pool = pool(options.threads)?;
    let cut = Cut::new(options.window_bytes, pool.current_num_threads())?;
    let sizes = Sizes {
        sources: &source_sizes,
        targets: None,
    };
    pool.install(|| validate(job, sizes, cut))
}

/// Runs the job: every target chunk is filled from the source chunks, each
/// target byte written once, then (with `options.sync`) every target fsynced.
/// Targets must already exist at their final size; bytes outside target
/// chunks are left as they are. Nothing is written unless the whole job is
/// valid.
pub fn execute(job: &Job<'_>, options: &Options) -> Result<Stats, Error> {
    run(job, options, None, None)
}

/// The CRC-32 of bytes one piece wrote: `len` bytes at `offset` of `target`.
/// `read`: where those bytes came from, `(source, offset)`, when the piece
/// copied them unchanged (same dtype): the CRC is then also that of the
/// `len` source bytes there, so a reader's checksums of the source can be
/// checked without reading it again (`None` for a cast).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrittenCrc {
    pub target: usize,
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
    pub read: Option<(usize, u64)>,
}

/// [`execute`], also returning the CRC-32 of every piece written, so a zip
/// writer gets its entries' CRCs without reading the output again (see
/// [`combine_crcs`]).
pub fn execute_with_crcs(
    job: &Job<'_>,
    options: &Options,
) -> Result<(Stats, Vec<WrittenCrc>), Error> {
    let crcs = Mutex::new(Vec::new());
    let stats = run(job, options, Some(&crcs), None)?;
    Ok((stats, crcs.into_inner().unwrap_or_else(|e| e.into_inner())))
}

/// [`execute`], with the CRC-32 of every piece when `crcs` (as
/// [`execute_with_crcs`]) and the xxh3-64 of each `(target, offset, len)` of
/// `hash_ranges`, hashed from the bytes as they are written (a native store's
/// chunk checksums without reading its files again). A range's hash is
/// `None` where one copy thread did not write all of it in order: where two
/// threads' stretches of the targets meet inside it, or no pieces tile it;
/// and for ranges that overlap one another.
pub fn execute_hashed(
    job: &Job<'_>,
    options: &Options,
    crcs: bool,
    hash_ranges: &[(usize, u64, u64)],
) -> Result<(Stats, Vec<WrittenCrc>, Hashes), Error> {
    let pieces = Mutex::new(Vec::new());
    let hashes = HashRanges::new(hash_ranges);
    let stats = run(job, options, crcs.then_some(&pieces), Some(&hashes))?;
    let pieces = pieces.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok((stats, pieces, hashes.into_found()))
}

/// A range to hash: `(target, offset, len, the caller's index of it)`.
type HashRange = (usize, u64, u64, usize);

/// The xxh3-64 of each range asked (None: not hashed), in the caller's order.
pub type Hashes = Vec<Option<u64>>;

/// The ranges to hash, sorted, and the hash found for each (in the caller's order).
struct HashRanges {
    /// `(target, offset, len, caller's index)`, by target and offset; empty
    /// ranges and ranges that overlap another are left out (the ones never
    /// hashed: their bytes would have to go to two hashes).
    sorted: Vec<HashRange>,
    found: Mutex<Hashes>,
}

impl HashRanges {
    fn new(ranges: &[(usize, u64, u64)]) -> HashRanges {
        let mut sorted: Vec<_> = ranges
            .iter()
            .enumerate()
            .filter(|(_, r)| r.2 > 0)
            .map(|(i, &(t, o, l))| (t, o, l, i))
            .collect();
        sorted.sort_unstable();
        let overlap = |a: HashRange, b: HashRange| a.0 == b.0 && b.1 < a.1.saturating_add(a.2);
        let alone: Vec<bool> = (0..sorted.len())
            .map(|i| {
                let before = i > 0 && overlap(sorted[i - 1], sorted[i]);
                let after = i + 1 < sorted.len() && overlap(sorted[i], sorted[i + 1]);
                !(before || after)
            })
            .collect();
        let mut kept = alone.into_iter();
        sorted.retain(|_| kept.next().unwrap_or(false));
        // An empty range holds the hash of no bytes; no piece writes it.
        let found = ranges
            .iter()
            .map(|&(_, _, l)| (l == 0).then(|| Xxh3::new().digest()))
            .collect();
        HashRanges {
            sorted,
            found: Mutex::new(found),
        }
    }

    /// The range that holds all of `p`'s bytes, if one does.
    fn holding(&self, p: &Piece) -> Option<HashRange> {
        let i = self
            .sorted
            .partition_point(|&(t, o, _, _)| (t, o) <= (p.dst, p.dst_off));
        let r = *self.sorted.get(i.checked_sub(1)?)?;
        (r.0 == p.dst && p.dst_off + p.dst_bytes() <= r.1 + r.2).then_some(r)
    }

    fn into_found(self) -> Hashes {
        self.found.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

/// One copy thread's hash of the range its pieces are in: pieces come in
/// target order, so a range is hashed when its first piece starts it and
/// each next piece continues where the last ended.
struct HashStream<'a> {
    ranges: &'a HashRanges,
    /// The range being hashed (its entry in `ranges.sorted`), the next byte
    /// expected, and the hash so far.
    open: Option<(HashRange, u64, Xxh3)>,
}

impl HashStream<'_> {
    /// Where `p`'s bytes are to be hashed, if its range is being hashed in order.
    fn feed(&mut self, p: &Piece) -> Option<&mut Xxh3> {
        let r = self.ranges.holding(p)?;
        if p.dst_off == r.1 {
            self.open = Some((r, r.1, Xxh3::new()));
        }
        let in_order =
            matches!(&self.open, Some((open, next, _)) if *open == r && *next == p.dst_off);
        if !in_order {
            self.open = None; // a gap, or a range begun by another thread
        }
        self.open.as_mut().map(|(_, _, h)| h)
    }

    /// After `p` was written (and fed): the range's hash once its last byte is in.
    fn written(&mut self, p: &Piece) {
        let Some((r, next, h)) = &mut self.open else {
            return;
        };
        if *next != p.dst_off || self.ranges.holding(p) != Some(*r) {
            return;
        }
        *next += p.dst_bytes();
        if *next == r.1 + r.2 {
            let digest = h.digest();
            self.ranges.found.lock().unwrap_or_else(|e| e.into_inner())[r.3] = Some(digest);
            self.open = None;
        }
    }
}

/// The CRC-32 of each `(target, offset, len)` range, combined from the pieces
/// that tile it exactly; `None` where the pieces written do not tile the range.
pub fn combine_crcs(mut pieces: Vec<WrittenCrc>, ranges: &[(usize, u64, u64)]) -> Vec<Option<u32>> {
    pieces.sort_by_key(|p| (p.target, p.offset));
    ranges
        .iter()
        .map(|&(target, offset, len)| {
            if len == 0 {
                return Some(0);
            }
            let mut i = pieces.partition_point(|p| (p.target, p.offset) < (target, offset));
            let mut at = offset;
            let mut hasher = crc32fast::Hasher::new();
            while at < offset + len {
                let p = pieces
                    .get(i)
                    .filter(|p| p.target == target && p.offset == at)?;
                if p.offset + p.len > offset + len {
                    return None;
                }
                hasher.combine(&crc32fast::Hasher::new_with_initial_len(p.crc, p.len));
                at += p.len;
                i += 1;
            }
            Some(hasher.finalize())
        })
        .collect()
}

/// For each range [`combine_crcs`] found no CRC for (`None` in `found`), the
/// pieces written inside it, as `(range index, offset, len, crc)`: a caller
/// running a job in batches joins them across batches (a range that one
/// batch's pieces do not tile, such as a ZeRO flat partition filled by
/// tensors of several batches, then needs no second read of the output).
pub fn untiled_parts(
    mut pieces: Vec<WrittenCrc>,
    ranges: &[(usize, u64, u64)],
    found: &[Option<u32>],
) -> Vec<(usize, u64, u64, u32)> {
    pieces.sort_by_key(|p| (p.target, p.offset));
    let mut out = Vec::new();
    for (i, &(target, offset, len)) in ranges.iter().enumerate() {
        if found.get(i).is_some_and(Option::is_some) {
            continue;
        }
        let first = pieces.partition_point(|p| (p.target, p.offset) < (target, offset));
        for p in pieces[first..]
            .iter()
            .take_while(|p| p.target == target && p.offset < offset + len)
        {
            if p.offset + p.len <= offset + len {
                out.push((i, p.offset, p.len, p.crc));
            }
        }
    }
    out
}

/// The CRC-32 of bytes `(crc, len)` after one another (zlib's crc32_combine).
pub fn crc32_concat(parts: &[(u32, u64)]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    for &(crc, len) in parts {
        hasher.combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
    }
    hasher.finalize()
}

/// How many tensors' pieces are planned, put in target order and shared out
/// among the copy threads at a time (bounds the pieces held in memory).
const ORDER_GROUP: usize = 4096;

/// The pieces of `tensors` in target order (file, then offset).
fn ordered_pieces(
    job: &Job<'_>,
    sizes: Sizes<'_>,
    cut: Cut,
    tensors: std::ops::Range<usize>,
) -> Result<Vec<Piece>, Error> {
    let mut all = tensors
        .into_par_iter()
        .map(|t| -> Result<Vec<Piece>, Error> {
            let plans = plan_tensor(job, t, sizes)?;
            Ok(pieces(&job.tensors[t], &plans, cut).collect())
        })
        .try_reduce(Vec::new, |mut a, mut b| {
            a.append(&mut b);
            Ok(a)
        })?;
    all.sort_unstable_by_key(|p| (p.dst, p.dst_off));
    Ok(all)
}

/// `pieces` (in target order) cut into `parts` runs of consecutive pieces
/// with about the same bytes each, one per copy thread: each thread walks its
/// own stretch of the targets, so two threads write the same file only where
/// their stretches meet (a file takes writes one at a time). Each cut is put
/// off to the next piece that `cut_before` takes (one that starts a hash
/// range: one thread then hashes all of it), as long as the pieces it adds
/// come to at most a quarter of a stretch (one huge range is still shared).
pub(crate) fn split_even_at(
    pieces: &[Piece],
    parts: usize,
    cut_before: impl Fn(&Piece) -> bool,
) -> Vec<&[Piece]> {
    let total: u64 = pieces.iter().map(Piece::dst_bytes).sum();
    let parts = parts.max(1) as u64;
    let slack = total / parts / 4;
    let mut out = Vec::new();
    let (mut start, mut acc, mut k) = (0usize, 0u64, 1u64);
    let mut due: Option<u64> = None; // a cut is due since `acc` was this
    for (i, p) in pieces.iter().enumerate() {
        if let Some(since) = due {
            if cut_before(p) || acc - since + p.dst_bytes() > slack {
                out.push(&pieces[start..i]);
                start = i;
                k += 1;
                due = None;
            }
        }
        acc += p.dst_bytes();
        if due.is_none() && k < parts && acc * parts >= total * k {
            due = Some(acc);
        }
    }
    if start < pieces.len() {
        out.push(&pieces[start..]);
    }
    out
}

/// Asks the kernel to start writing `len` bytes at `offset` of the file to
/// disk, without waiting (best effort: an error here shows up at the fsync).
#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: a plain syscall on an open descriptor; no memory is passed.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: u64) {}

/// A second handle on a target file for direct writes, or `None` where the
/// file system refuses `O_DIRECT` (tmpfs on older kernels, some FUSE file
/// systems): those targets are written through the page cache.
///
/// The file's first `len` bytes are allocated first (`fallocate`, mode 0:
/// unwritten extents, read as zeros; a target is pre-sized but sparse). On
/// ext4 a direct write that must allocate blocks holds the inode lock
/// exclusively, so two copy threads writing one file reach the device one
/// at a time; a direct write into allocated blocks takes it shared. Measured
/// on this project's VM against the build before, 5 GB DCP -> torch_save
/// durable, 6 interleaved rounds in a slow-disk phase: 7.8-10.7 s with the
/// blocks allocated, 10.2-13.0 s without
/// (docs/notes/2026-11-29-copy-steps.md). Each executor call allocates its
/// targets again; over blocks already allocated that is
/// one cheap call per file. Refused
/// (`EOPNOTSUPP`, a file system without it) -> the file stays sparse; never
/// `posix_fallocate`, which glibc emulates by writing zeros.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path, len: u64) -> Option<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()?;
    if let Ok(len) = libc::off_t::try_from(len) {
        if len > 0 {
            // SAFETY: a plain syscall on an open descriptor; no memory is passed.
            unsafe {
                libc::fallocate(file.as_raw_fd(), 0, 0, len);
            }
        }
    }
    Some(file)
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path, _len: u64) -> Option<File> {
    None
}

fn run(
    job: &Job<'_>,
    options: &Options,
    crcs: Option<&Mutex<Vec<WrittenCrc>>>,
    hashes: Option<&HashRanges>,
) -> Result<Stats, Error> {
    let sources = open_sources(&job.sources)?;
    let targets = open_targets(&job.targets)?;
    let direct: Vec<Option<File>> = job
        .targets
        .iter()
        .zip(&targets)
        .map(|(t, opened)| match t {
            Target::Path(path) if options.direct => open_direct(path, opened.len()),
            _ => None,
        })
        .collect();
    let direct_bytes = AtomicU64::new(0);
    let page_size = direct_align();
    let source_sizes: Vec<u64> = sources.iter().map(SourceData::len).collect();
    let target_sizes: Vec<u64> = targets.iter().map(Opened::len).collect();
    let sizes = Sizes {
        sources: &source_sizes,
        targets: Some(&target_sizes),
    };
    let pool = pool(options.threads)?;
    let cut = Cut::new(options.window_bytes, pool.current_num_threads())?;
    let summary = std::thread::scope(|scope| {
        // Early write-back runs on a thread of its own, as asking the kernel
        // to write a range can wait for the device and a copy thread should
        // not. (Early write-back itself, measured durable into one 2.5 GB
        // file: 0.74-0.79 s with it, 1.04-1.11 s without.)
        let (tx, rx) = mpsc::channel::<(usize, u64, u64)>();
        let flusher = options.writeback.then(|| {
            let targets = &targets;
            scope.spawn(move || {
                for (t, offset, len) in rx {
                    if let Some(file) = targets[t].file() {
                        start_writeback(file, offset, len);
                    }
                }
            })
        });
        let tx = flusher.is_some().then_some(tx);
        let copied = pool.install(|| {
            let summary = validate(job, sizes, cut)?;
            let n = job.tensors.len();
            for first in (0..n).step_by(ORDER_GROUP) {
                let all = ordered_pieces(job, sizes, cut, first..n.min(first + ORDER_GROUP))?;
                split_even_at(&all, pool.current_num_threads(), |p| {
                    hashes.is_none_or(|h| h.holding(p).is_none_or(|r| r.1 == p.dst_off))
                })
                .into_par_iter()
                .try_for_each(|part| {
                    let mut stream = hashes.map(|ranges| HashStream { ranges, open: None });
                    part.iter().try_for_each(|p| {
                        let hash = stream.as_mut().and_then(|s| s.feed(p));
                        match &direct[p.dst] {
                            Some(d) => run_piece_direct(
                                p,
                                &sources,
                                &targets,
                                (d, page_size, &direct_bytes),
                                job,
                                (crcs, hash),
                            ),
                            None => {
                                run_piece(p, &sources, &targets, job, (crcs, hash), tx.as_ref())
                            }
                        }?;
                        if let Some(s) = stream.as_mut() {
                            s.written(p);
                        }
                        Ok::<(), Error>(())
                    })
                })?;
            }
            Ok::<_, Error>(summary)
        });
        drop(tx);
        if let Some(flusher) = flusher {
            let _ = flusher.join();
        }
        copied
    })?;
    let mut stats = summary.stats;
    stats.direct_bytes = direct_bytes.into_inner();
    if options.sync {
        pool.install(|| {
            targets
                .par_iter()
                .zip(&job.targets)
                .try_for_each(|(opened, target)| match (opened.file(), target) {
                    (Some(f), Target::Path(path)) => f
                        .sync_all()
                        .map_err(|e| Error::io("cannot fsync target file", path, e)),
                    _ => Ok(()),
                })
        })?;
    }
    Ok(stats)
}

/// Bytes per read and positional write. Small, so that a step's bytes stay in
/// the CPU cache between the read, the CRC and the write, and so that the
/// page cache of the target grows in small folios. Measured on this project's
/// 2-CPU VM (ext4, warm cache, DCP to torch_save, `--no-sync`): 64 KiB steps
/// 0.77 s at 2.5 GB and 1.78 s at 5 GB; 256 KiB or 512 KiB steps that start
/// on their own size's boundaries in the target were as fast at one time
/// (0.58 s at 2.5 GB) and 2.5-3.5x slower at another (4.4-6.8 s at 5 GB,
/// nearly all kernel time in the copy into new page-cache folios), while
/// 64 KiB steps stayed put. Writes straight from a source's mapping were
/// slower still in that state (the kernel's copy from the mapping came up
/// short and zeroed and redid folios).
const WRITE_STEP: usize = 64 << 10;

/// Fills `buf` from byte `at` of the piece's source file.
fn read_source(
    file: &File,
    buf: &mut [u8],
    p: &Piece,
    at: u64,
    job: &Job<'_>,
) -> Result<(), Error> {
    file.read_exact_at(buf, at).map_err(|e| {
        Error::io(
            "cannot read source file",
            Path::new(&source_name(&job.sources, p.src)),
            e,
        )
    })
}

/// Notes the CRC-32 of the bytes that now stand at the piece's target range.
fn record_crc(p: &Piece, crcs: Option<&Mutex<Vec<WrittenCrc>>>, crc: u32) {
    if let Some(crcs) = crcs {
        let crc = WrittenCrc {
            target: p.dst,
            offset: p.dst_off,
            len: p.dst_bytes(),
            crc,
            read: (p.from == p.to).then_some((p.src, p.src_off)),
        };
        crcs.lock().unwrap_or_else(|e| e.into_inner()).push(crc);
    }
}

thread_local! {
    /// A copy thread's read or cast buffer (one step), reused from piece to piece; it goes when
    /// the job's pool does.
    static CAST_BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One piece, one step at a time: through the thread's buffer (a file
/// source, or a cast), or straight from an in-memory source's bytes.
fn run_piece(
    p: &Piece,
    sources: &[SourceData<'_>],
    targets: &[Opened<'_>],
    job: &Job<'_>,
    (crcs, mut hash): (Option<&Mutex<Vec<WrittenCrc>>>, Option<&mut Xxh3>),
    writeback: Option<&mpsc::Sender<(usize, u64, u64)>>,
) -> Result<(), Error> {
    let write_at = |data: &[u8], offset: u64| {
        targets[p.dst].write_all_at(data, offset).map_err(|e| {
            Error::io(
                "cannot write to target",
                Path::new(&job.targets[p.dst].name(p.dst)),
                e,
            )
        })
    };
    // Validated against the sizes before the first piece ran.
    let src = sources[p.src].range(p.src_off, p.src_bytes(), || {
        source_name(&job.sources, p.src)
    })?;
    let src = &src[..];
    let record_crc = |crc: u32| record_crc(p, crcs, crc);
    let written = |len: u64| {
        if let Some(tx) = writeback {
            // the flusher thread is gone only when the job has failed
            let _ = tx.send((p.dst, p.dst_off, len));
        }
    };
    let mut hasher = crc32fast::Hasher::new();
    if p.from == p.to {
        // Same dtype, in steps (see WRITE_STEP): a file source is read into
        // the thread's buffer and written from there, an in-memory source
        // is written from its bytes; each step is hashed while it is cached.
        let mut done = 0usize;
        while done < src.len() {
            // Steps end on WRITE_STEP boundaries of the target file, so that
            // every write but a piece's first and last covers whole pages.
            let at = p.dst_off + done as u64;
            let len = (WRITE_STEP - (at % WRITE_STEP as u64) as usize).min(src.len() - done);
            match sources[p.src].file() {
                Some(file) => CAST_BUFFER.with(|buf| {
                    let mut buf = buf.borrow_mut();
                    if buf.len() < len {
                        buf.resize(WRITE_STEP, 0);
                    }
                    let data = &mut buf[..len];
                    read_source(file, data, p, p.src_off + done as u64, job)?;
                    write_at(data, at)?;
                    if crcs.is_some() {
                        hasher.update(data);
                    }
                    if let Some(h) = hash.as_mut() {
                        h.update(data);
                    }
                    Ok::<(), Error>(())
                })?,
                _ => {
                    let step = &src[done..done + len];
                    write_at(step, at)?;
                    if crcs.is_some() {
                        hasher.update(step);
                    }
                    if let Some(h) = hash.as_mut() {
                        h.update(step);
                    }
                }
            }
            done += len;
        }
    } else {
        // A cast: a step's worth of elements at a time through the thread's
        // buffer, which stays in the CPU cache.
        let (from, to) = (p.from.size(), p.to.size());
        let per_step = (WRITE_STEP / to).max(1);
        CAST_BUFFER.with(|buf| -> Result<(), Error> {
            let mut buf = buf.borrow_mut();
            for (k, part) in src.chunks(per_step * from).enumerate() {
                buf.clear();
                buf.resize(part.len() / from * to, 0);
                cast_into(p.from, p.to, part, &mut buf);
                write_at(&buf, p.dst_off + (k * per_step * to) as u64)?;
                if crcs.is_some() {
                    hasher.update(&buf);
                }
                if let Some(h) = hash.as_mut() {
                    h.update(&buf);
                }
            }
            Ok(())
        })?;
    }
    record_crc(hasher.finalize());
    written(p.dst_bytes());
    Ok(())
}

/// The unit of direct writes: their file offsets, lengths and buffer
/// addresses are multiples of it. The page size (at least 4 KiB, a multiple
/// of every common logical block size), so that no page of the cache holds
/// both bytes written through it and bytes written around it.
fn direct_align() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf reads a constant of the system; no memory is passed.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(page).map_or(4096, |p| p.clamp(4096, DIRECT_STEP))
    }
    #[cfg(not(unix))]
    {
        4096
    }
}

/// Bytes per step of a direct write. Measured on this project's VM (ext4 on
/// virtio, 2 GiB with `dd oflag=direct`): 64 KiB requests 3.9 s, 1 MiB 1.4 s,
/// 4 MiB 1.4 s; the same 2 GiB through the page cache and fsynced 7.0-8.3 s,
/// nearly all of it kernel time spent getting pages for the cache.
const DIRECT_STEP: usize = 1 << 20;

thread_local! {
    /// A copy thread's step buffer for direct writes: one step plus room to
    /// start it on a page boundary.
    static DIRECT_BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One piece with direct writes, a step at a time: the step's bytes (read,
/// copied or cast) are put in the thread's buffer at the same offset within a
/// page as in the target, so that its whole pages can be written from an
/// aligned address; its first and last partial pages go through the page
/// cache (`targets`), as do the whole pages if the direct write is refused.
fn run_piece_direct(
    p: &Piece,
    sources: &[SourceData<'_>],
    targets: &[Opened<'_>],
    (direct, page_size, direct_bytes): (&File, usize, &AtomicU64),
    job: &Job<'_>,
    (crcs, mut hash): (Option<&Mutex<Vec<WrittenCrc>>>, Option<&mut Xxh3>),
) -> Result<(), Error> {
    let target_err = |e| {
        Error::io(
            "cannot write to target",
            Path::new(&job.targets[p.dst].name(p.dst)),
            e,
        )
    };
    let src = sources[p.src].range(p.src_off, p.src_bytes(), || {
        source_name(&job.sources, p.src)
    })?;
    let src = &src[..];
    let (from, to) = (p.from.size(), p.to.size());
    let total = p.dst_bytes() as usize;
    let align = page_size as u64;
    let mut hasher = crc32fast::Hasher::new();
    DIRECT_BUFFER.with(|cell| -> Result<(), Error> {
        let mut buf = cell.borrow_mut();
        if buf.len() < DIRECT_STEP + 2 * page_size {
            buf.resize(DIRECT_STEP + 2 * page_size, 0);
        }
        let base = buf.as_ptr().align_offset(page_size);
        let mut done = 0usize;
        while done < total {
            let at = p.dst_off + done as u64;
            // Steps end on DIRECT_STEP boundaries of the target; a cast's hold
            // whole elements.
            let mut len = (DIRECT_STEP - (at % DIRECT_STEP as u64) as usize).min(total - done);
            if p.from != p.to {
                len = (len - len % to).max(to);
            }
            let pad = (at % align) as usize;
            let region = &mut buf[base + pad..base + pad + len];
            if p.from == p.to {
                match sources[p.src].file() {
                    Some(file) => read_source(file, region, p, p.src_off + done as u64, job)?,
                    None => region.copy_from_slice(&src[done..done + len]),
                }
            } else {
                let first = done / to;
                cast_into(
                    p.from,
                    p.to,
                    &src[first * from..(first + len / to) * from],
                    region,
                );
            }
            if crcs.is_some() {
                hasher.update(region);
            }
            if let Some(h) = hash.as_mut() {
                h.update(region);
            }
            let page = at - pad as u64;
            let end = at + len as u64;
            let lo = at.div_ceil(align).saturating_mul(align).min(end);
            let hi = (end / align * align).max(lo);
            let slice = |a: u64, b: u64| base + (a - page) as usize..base + (b - page) as usize;
            targets[p.dst]
                .write_all_at(&buf[slice(at, lo)], at)
                .map_err(target_err)?;
            if hi > lo {
                let whole = &buf[slice(lo, hi)];
                match direct.write_all_at(whole, lo) {
                    Ok(()) => {
                        direct_bytes.fetch_add(hi - lo, Ordering::Relaxed);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                        targets[p.dst].write_all_at(whole, lo).map_err(target_err)?;
                    }
                    Err(e) => return Err(target_err(e)),
                }
            }
            targets[p.dst]
                .write_all_at(&buf[slice(hi, end)], hi)
                .map_err(target_err)?;
            done += len;
        }
        Ok(())
    })?;
    record_crc(p, crcs, hasher.finalize());
    Ok(())
}
