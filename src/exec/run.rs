//! Running a validated job: the copy threads, each walking its stretch of
//! the pieces in target order, and the one function that moves a piece's
//! bytes (`run_piece`), through the page cache or around it.

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use super::{
    ordered_pieces, pool, split_even_at, validate, Cut, Job, Options, Piece, Sizes, Stats,
    ORDER_GROUP,
};
use crate::checksum::{HashRanges, HashStream, WrittenCrc};
use crate::dtype::cast_into;
use crate::files::{open_sources, open_targets, source_name, Error, Opened, SourceData, Target};

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

pub(super) fn run(
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
                    hashes.is_none_or(|h| h.may_start(p.span()))
                })
                .into_par_iter()
                .try_for_each(|part| {
                    let mut stream = hashes.map(HashStream::new);
                    part.iter().try_for_each(|p| {
                        let hash = stream.as_mut().and_then(|s| s.feed(p.span()));
                        let sink = match &direct[p.dst] {
                            Some(file) => Sink::Direct {
                                file,
                                align: page_size,
                                direct_bytes: &direct_bytes,
                            },
                            None => Sink::Cached {
                                writeback: tx.as_ref(),
                            },
                        };
                        run_piece(p, &sources, &targets, job, sink, (crcs, hash))?;
                        if let Some(s) = stream.as_mut() {
                            s.written(p.span());
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

/// Where one piece's bytes go.
#[derive(Clone, Copy)]
enum Sink<'a> {
    /// Through the page cache, [`WRITE_STEP`] bytes at a time; with
    /// `writeback`, the piece's write-back is started once it is written.
    Cached {
        writeback: Option<&'a mpsc::Sender<(usize, u64, u64)>>,
    },
    /// Whole pages straight to the device through `file` (see `open_direct`),
    /// [`DIRECT_STEP`] bytes at a time, from a buffer whose bytes sit at the
    /// same offset within a page (`align`) as in the target; a step's partial
    /// first and last pages, and pages the file system refuses to take this
    /// way, through the page cache. `direct_bytes` counts what went around it.
    Direct {
        file: &'a File,
        align: usize,
        direct_bytes: &'a AtomicU64,
    },
}

impl Sink<'_> {
    fn step(self) -> usize {
        match self {
            Sink::Cached { .. } => WRITE_STEP,
            Sink::Direct { .. } => DIRECT_STEP,
        }
    }

    /// What a step's place in the buffer is aligned to (1: anywhere).
    fn align(self) -> usize {
        match self {
            Sink::Cached { .. } => 1,
            Sink::Direct { align, .. } => align,
        }
    }

    /// Writes one step's `bytes` at `at` of the target (`cached`: its handle
    /// through the page cache).
    fn write(self, cached: &Opened<'_>, bytes: &[u8], at: u64) -> std::io::Result<()> {
        let Sink::Direct {
            file,
            align,
            direct_bytes,
        } = self
        else {
            return cached.write_all_at(bytes, at);
        };
        let align = align as u64;
        let end = at + bytes.len() as u64;
        let lo = at.div_ceil(align).saturating_mul(align).min(end);
        let hi = (end / align * align).max(lo);
        let part = |a: u64, b: u64| &bytes[(a - at) as usize..(b - at) as usize];
        cached.write_all_at(part(at, lo), at)?;
        if hi > lo {
            match file.write_all_at(part(lo, hi), lo) {
                Ok(()) => {
                    direct_bytes.fetch_add(hi - lo, Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                    cached.write_all_at(part(lo, hi), lo)?;
                }
                Err(e) => return Err(e),
            }
        }
        cached.write_all_at(part(hi, end), hi)
    }
}

thread_local! {
    /// A copy thread's step buffer (one step, plus room to start it at any
    /// offset within a page), reused from piece to piece; it goes when the
    /// job's pool does.
    static STEP_BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One piece, one step at a time. A step's bytes are read from a file
/// source, copied from an in-memory one or cast, into the thread's buffer
/// (an in-memory source of the target's dtype going through the page cache
/// is written from its own bytes), hashed while they are in the CPU cache,
/// and written to the sink. Steps end on step boundaries of the target file
/// (a cast's hold whole elements), so that every write but a piece's first
/// and last covers whole pages.
fn run_piece(
    p: &Piece,
    sources: &[SourceData<'_>],
    targets: &[Opened<'_>],
    job: &Job<'_>,
    sink: Sink<'_>,
    (crcs, mut hash): (Option<&Mutex<Vec<WrittenCrc>>>, Option<&mut Xxh3>),
) -> Result<(), Error> {
    let target_err = |e| {
        Error::io(
            "cannot write to target",
            Path::new(&job.targets[p.dst].name(p.dst)),
            e,
        )
    };
    let file = sources[p.src].file();
    // A remote source of the target's dtype is read a step at a time, as a
    // file is: its bytes come from the parts its reader holds, and no buffer
    // of the piece's size is filled first (two 32 MiB pieces in flight cost
    // 64 MiB on top of the parts).
    let remote = sources[p.src].remote().filter(|_| p.from == p.to);
    if let Some(r) = remote {
        r.reads_from(p.src_off);
    }
    // Validated against the sizes before the first piece ran.
    let src = match remote {
        Some(_) => std::borrow::Cow::Borrowed(&[][..]),
        None => sources[p.src].range(p.src_off, p.src_bytes(), || {
            source_name(&job.sources, p.src)
        })?,
    };
    let src = &src[..];
    let (from, to) = (p.from.size(), p.to.size());
    let (step, align) = (sink.step(), sink.align());
    let total = p.dst_bytes() as usize;
    let mut crc = crc32fast::Hasher::new();
    STEP_BUFFER.with(|cell| -> Result<(), Error> {
        let mut buf = cell.borrow_mut();
        if buf.len() < step + 2 * align {
            buf.resize(step + 2 * align, 0);
        }
        let base = buf.as_ptr().align_offset(align);
        let mut done = 0usize;
        while done < total {
            let at = p.dst_off + done as u64;
            let mut len = (step - (at % step as u64) as usize).min(total - done);
            if p.from != p.to {
                len = (len - len % to).max(to);
            }
            let bytes: &[u8] = match (p.from == p.to, file.is_some() || remote.is_some(), sink) {
                (true, false, Sink::Cached { .. }) => &src[done..done + len],
                _ => {
                    let pad = (at % align as u64) as usize;
                    let region = &mut buf[base + pad..base + pad + len];
                    let from_at = p.src_off + done as u64;
                    match (p.from == p.to, file, remote) {
                        (true, Some(f), _) => read_source(f, region, p, from_at, job)?,
                        (true, None, Some(r)) => r.read_exact_at(region, from_at).map_err(|e| {
                            let name = source_name(&job.sources, p.src);
                            Error::io("cannot read source object", Path::new(&name), e)
                        })?,
                        (true, None, None) => region.copy_from_slice(&src[done..done + len]),
                        (false, _, _) => {
                            let first = done / to;
                            let elems = &src[first * from..(first + len / to) * from];
                            cast_into(p.from, p.to, elems, region);
                        }
                    }
                    region
                }
            };
            if crcs.is_some() {
                crc.update(bytes);
            }
            if let Some(h) = hash.as_mut() {
                h.update(bytes);
            }
            sink.write(&targets[p.dst], bytes, at).map_err(target_err)?;
            done += len;
        }
        Ok(())
    })?;
    record_crc(p, crcs, crc.finalize());
    if let Sink::Cached {
        writeback: Some(tx),
    } = sink
    {
        // the flusher thread is gone only when the job has failed
        let _ = tx.send((p.dst, p.dst_off, p.dst_bytes()));
    }
    Ok(())
}
