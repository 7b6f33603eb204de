//! The copy executor: plans every tensor of a job, turns element runs into
//! byte copies (casting between float dtypes where the chunks differ), cuts
//! them into pieces no larger than the copy window allows, and runs the
//! pieces on a thread pool with positional writes into existing files.
//!
//! Memory: copies from files and casts go through one step buffer per
//! thread, 64 KiB (`WRITE_STEP`), or 1 MiB with direct writes
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
//! that would overwrite each other. This file plans, validates and orders the
//! pieces; `run` (exec/run.rs) moves their bytes. The checksums of what is written are
//! [`crate::checksum`]'s.

use std::sync::Mutex;

use rayon::prelude::*;

use crate::checksum::{HashRanges, Hashes, Span, WrittenCrc};
use crate::dtype::{check_cast, DType};
use crate::files::{
    check_chunk, source_name, source_sizes, ChunkAt, ChunkRef, Error, Side, Source, Target,
};
use crate::plan::{plan, Chunk, TargetPlan};

mod run;

use run::run;

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

    /// The bytes it writes.
    pub fn span(&self) -> Span {
        Span {
            target: self.dst,
            offset: self.dst_off,
            len: self.dst_bytes(),
        }
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

/// [`execute`], also returning the CRC-32 of every piece written, so a zip
/// writer gets its entries' CRCs without reading the output again (see
/// [`crate::checksum::combine_crcs`]).
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
