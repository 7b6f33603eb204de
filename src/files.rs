//! Where chunk bytes live: source files mapped read-only, in-memory buffers,
//! and target files written in place; plus the checks that every chunk's
//! byte range lies inside its file before any byte moves.
//!
//! A source is mapped rather than read so that copies need no buffer of their
//! own: a copy without a cast hands the mapped slice straight to `pwrite`, and
//! the page cache, not the heap, holds what is in flight. A file truncated
//! after its size was checked can still fault (SIGBUS) on access; nothing
//! short of reading into our own buffers avoids that, and that costs the
//! memory bound.

use std::borrow::Cow;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use thiserror::Error;

use crate::dtype::{DType, DTypeError};
use crate::geometry::Region;
use crate::plan::PlanError;

/// Bytes read by range from elsewhere (an object in a bucket): the executor
/// fetches each piece's range into its own buffer.
pub trait ReadAt: Send + Sync + fmt::Debug {
    fn size(&self) -> u64;
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// How the source is named in messages (an `s3://` URL).
    fn name(&self) -> String;
    /// Says that reads will go on from `offset`, in order (a copy piece's
    /// bytes, a step at a time), so a reader that fetches ahead may start.
    fn reads_from(&self, _offset: u64) {}
}

/// A target written by range elsewhere (a multipart upload): copy threads
/// write disjoint ranges of it, in any order.
pub trait WriteAt: Send + Sync + fmt::Debug {
    fn size(&self) -> u64;
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    fn name(&self) -> String;
}

/// Where a source's bytes come from.
#[derive(Debug, Clone)]
pub enum Source<'a> {
    /// A file, mapped read-only.
    Path(PathBuf),
    /// Bytes the caller already holds (small tensors pickled inline).
    Bytes(&'a [u8]),
    /// An object read by range.
    Remote(Arc<dyn ReadAt>),
}

impl PartialEq for Source<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Source::Path(a), Source::Path(b)) => a == b,
            (Source::Bytes(a), Source::Bytes(b)) => a == b,
            (Source::Remote(a), Source::Remote(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// Which side of a copy, or of a comparison, a chunk is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Target,
    /// The first of two compared copies (read from the sources).
    A,
    /// The second of two compared copies (read from the sources).
    B,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Target => "target",
            Side::A => "a-side",
            Side::B => "b-side",
        })
    }
}

/// One chunk of a tensor on disk: element 0 of its region's row-major storage
/// is at byte `offset` of file `file` (an index into the sources or targets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRef {
    pub file: usize,
    pub offset: u64,
    pub region: Region,
    pub dtype: DType,
}

/// Everything that can go wrong moving, hashing or comparing chunk bytes.
#[derive(Debug, Error)]
pub enum Error {
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    DType(#[from] DTypeError),
    #[error("tensor {tensor}: {error}")]
    Plan { tensor: usize, error: PlanError },
    #[error("{at}: file index {index} is out of range; there are {count} {files} files")]
    FileIndex {
        at: ChunkAt,
        index: usize,
        count: usize,
        files: &'static str,
    },
    #[error(
        "{at}: {file} is {actual} bytes, but the chunk needs \
         bytes {offset}..{end}, a file of at least {end} bytes\nhint: {hint}"
    )]
    OutOfFile {
        at: ChunkAt,
        file: String,
        offset: u64,
        end: u128,
        actual: u64,
        hint: &'static str,
    },
    #[error(
        "{file}: tensor {tensor} chunk {chunk} (bytes {start}..{end}) overlaps tensor \
         {other_tensor} chunk {other_chunk} (bytes {other_start}..{other_end})\n\
         hint: each target byte may be written by one chunk only"
    )]
    TargetOverlap {
        file: String,
        tensor: usize,
        chunk: usize,
        start: u64,
        end: u64,
        other_tensor: usize,
        other_chunk: usize,
        other_start: u64,
        other_end: u64,
    },
    #[error("the byte range {offset}+{len} reaches past the end of {} ({actual} bytes)", path.display())]
    RangeOutOfFile {
        path: PathBuf,
        offset: u64,
        len: u64,
        actual: u64,
    },
    /// The source's bytes are not what its metadata says (a zstd frame that
    /// does not decode, chunks that leave part of a tensor uncovered).
    #[error("{0}")]
    Corrupt(String),
    /// A bad argument or an impossible job: a bug in the caller, not bad data.
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    pub(crate) fn io(action: &'static str, path: &Path, source: io::Error) -> Error {
        Error::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The bytes of one source, readable from any thread.
pub(crate) enum SourceData<'a> {
    /// A mapped file, and the file (same-dtype copies read it with pread).
    Map(Mmap, File),
    Bytes(&'a [u8]),
    /// An empty file: mapping zero bytes is an error on Linux.
    Empty,
    Remote(Arc<dyn ReadAt>),
}

impl SourceData<'_> {
    /// The file behind a mapped source.
    pub(crate) fn file(&self) -> Option<&File> {
        match self {
            SourceData::Map(_, f) => Some(f),
            _ => None,
        }
    }

    /// The bytes of a mapped or in-memory source (what `map_file` returns);
    /// a remote source has none here: read it with [`SourceData::range`].
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            SourceData::Map(m, _) => m,
            SourceData::Bytes(b) => b,
            SourceData::Empty | SourceData::Remote(_) => &[],
        }
    }

    /// The object behind a remote source.
    pub(crate) fn remote(&self) -> Option<&Arc<dyn ReadAt>> {
        match self {
            SourceData::Remote(r) => Some(r),
            _ => None,
        }
    }

    pub(crate) fn len(&self) -> u64 {
        match self {
            SourceData::Map(m, _) => m.len() as u64,
            SourceData::Bytes(b) => b.len() as u64,
            SourceData::Empty => 0,
            SourceData::Remote(r) => r.size(),
        }
    }

    /// Bytes `start..start + len`, which the caller has checked lie inside the
    /// source: borrowed where they are mapped or in memory, fetched where the
    /// source is remote (`name`: how the source is named in the error).
    pub(crate) fn range(
        &self,
        start: u64,
        len: u64,
        name: impl FnOnce() -> String,
    ) -> Result<Cow<'_, [u8]>, Error> {
        let (s, n) = (start as usize, len as usize);
        match self {
            SourceData::Map(m, _) => Ok(Cow::Borrowed(&m[s..s + n])),
            SourceData::Bytes(b) => Ok(Cow::Borrowed(&b[s..s + n])),
            SourceData::Empty => Ok(Cow::Borrowed(&[][s..s + n])),
            SourceData::Remote(r) => {
                let mut buf = vec![0u8; n];
                r.read_exact_at(&mut buf, start)
                    .map_err(|e| Error::io("cannot read source object", Path::new(&name()), e))?;
                Ok(Cow::Owned(buf))
            }
        }
    }
}

/// Maps a file read-only, whole.
pub(crate) fn map_file(path: &Path) -> Result<SourceData<'static>, Error> {
    let file = File::open(path).map_err(|e| Error::io("cannot open source file", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("cannot read the size of", path, e))?
        .len();
    if len == 0 {
        return Ok(SourceData::Empty);
    }
    // SAFETY: the map is only read. Another process truncating the file while
    // it is mapped would fault; that is the documented limit of mapping.
    let map =
        unsafe { Mmap::map(&file) }.map_err(|e| Error::io("cannot map source file", path, e))?;
    // No MADV_SEQUENTIAL: with it, pwrite straight from a mapping ran 2.7x
    // slower (5 GB: 4.05 against 1.49 s; the kernel's copy from the mapping
    // came up short and it zeroed and redid page-cache folios). Copies now
    // pread instead; casts and comparisons read the mapping in user space.
    Ok(SourceData::Map(map, file))
}

/// Opens one source for reading: a file is mapped, a buffer borrowed.
pub(crate) fn open_source<'a>(source: &Source<'a>) -> Result<SourceData<'a>, Error> {
    match source {
        Source::Path(p) => map_file(p),
        Source::Bytes(b) => Ok(SourceData::Bytes(b)),
        Source::Remote(r) => Ok(SourceData::Remote(r.clone())),
    }
}

/// How one source is named in messages (its path or URL).
pub(crate) fn label(source: &Source<'_>) -> PathBuf {
    match source {
        Source::Path(p) => p.clone(),
        Source::Bytes(_) => PathBuf::from("an in-memory buffer"),
        Source::Remote(r) => PathBuf::from(r.name()),
    }
}

/// Opens every source: files are mapped, buffers borrowed.
pub(crate) fn open_sources<'a>(sources: &[Source<'a>]) -> Result<Vec<SourceData<'a>>, Error> {
    sources.iter().map(open_source).collect()
}

/// The size of each source without mapping it (for plans that move nothing).
pub(crate) fn source_sizes(sources: &[Source<'_>]) -> Result<Vec<u64>, Error> {
    sources
        .iter()
        .map(|s| match s {
            Source::Path(p) => std::fs::metadata(p)
                .map(|m| m.len())
                .map_err(|e| Error::io("cannot read the size of source file", p, e)),
            Source::Bytes(b) => Ok(b.len() as u64),
            Source::Remote(r) => Ok(r.size()),
        })
        .collect()
}

/// Where a target's bytes go: a file that exists at its final size, or
/// memory the caller lends for the call (a live tensor's storage, a buffer
/// an upload is made from).
#[derive(Debug, Clone)]
pub enum Target<'a> {
    Path(PathBuf),
    Memory(Memory<'a>),
    /// An object uploaded in parts.
    Remote(Arc<dyn WriteAt>),
}

impl From<PathBuf> for Target<'_> {
    fn from(p: PathBuf) -> Self {
        Target::Path(p)
    }
}

impl Target<'_> {
    /// How the target is named in messages.
    pub fn name(&self, index: usize) -> String {
        match self {
            Target::Path(p) => p.display().to_string(),
            Target::Memory(m) => format!("target {index} (an in-memory buffer of {} bytes)", m.len),
            Target::Remote(r) => r.name(),
        }
    }
}

/// Writable memory lent to the executor: `len` bytes at `ptr`, for `'a`.
/// Copy threads write disjoint ranges of it (the executor refuses target
/// chunks that overlap before any byte moves), so sharing it is sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory<'a> {
    ptr: *mut u8,
    len: usize,
    _lent: std::marker::PhantomData<&'a mut [u8]>,
}

// SAFETY: see the type's documentation: writes go to disjoint ranges only.
unsafe impl Send for Memory<'_> {}
// SAFETY: as above.
unsafe impl Sync for Memory<'_> {}

impl<'a> Memory<'a> {
    pub fn new(buf: &'a mut [u8]) -> Memory<'a> {
        Memory {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _lent: std::marker::PhantomData,
        }
    }

    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes for `'a`, and nothing
    /// else may read or write that memory meanwhile.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Memory<'a> {
        Memory {
            ptr,
            len,
            _lent: std::marker::PhantomData,
        }
    }

    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= self.len as u64);
        if end.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "write past the end of an in-memory target",
            ));
        }
        if !data.is_empty() {
            // SAFETY: in bounds (checked above); the range is this piece's alone.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    self.ptr.add(offset as usize),
                    data.len(),
                )
            };
        }
        Ok(())
    }
}

/// An open target.
pub(crate) enum Opened<'a> {
    File(File, u64),
    Memory(Memory<'a>),
    Remote(Arc<dyn WriteAt>),
}

impl Opened<'_> {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Opened::File(_, len) => *len,
            Opened::Memory(m) => m.len as u64,
            Opened::Remote(r) => r.size(),
        }
    }

    pub(crate) fn file(&self) -> Option<&File> {
        match self {
            Opened::File(f, _) => Some(f),
            Opened::Memory(_) | Opened::Remote(_) => None,
        }
    }

    pub(crate) fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        match self {
            Opened::File(f, _) => f.write_all_at(data, offset),
            Opened::Memory(m) => m.write_at(data, offset),
            Opened::Remote(r) => r.write_all_at(data, offset),
        }
    }
}

/// Opens the targets for positional writes: files must exist already, at
/// their final size; nothing is created or truncated.
pub(crate) fn open_targets<'a>(targets: &[Target<'a>]) -> Result<Vec<Opened<'a>>, Error> {
    targets
        .iter()
        .map(|t| match t {
            Target::Memory(m) => Ok(Opened::Memory(*m)),
            Target::Remote(r) => Ok(Opened::Remote(r.clone())),
            Target::Path(p) => {
                let file = OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(|e| Error::io("cannot open target file for writing", p, e))?;
                let len = file
                    .metadata()
                    .map_err(|e| Error::io("cannot read the size of", p, e))?
                    .len();
                Ok(Opened::File(file, len))
            }
        })
        .collect()
}

/// How a file is named in messages.
pub(crate) fn source_name(sources: &[Source<'_>], index: usize) -> String {
    match &sources[index] {
        Source::Path(p) => p.display().to_string(),
        Source::Bytes(_) => format!("source {index} (an in-memory buffer)"),
        Source::Remote(r) => r.name(),
    }
}

/// A chunk's place in the job, for messages: "tensor 3, source chunk 2".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkAt {
    /// The tensor's index in the job; none in a comparison of one tensor.
    pub tensor: Option<usize>,
    pub side: Side,
    pub chunk: usize,
}

impl fmt::Display for ChunkAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(t) = self.tensor {
            write!(f, "tensor {t}, ")?;
        }
        write!(f, "{} chunk {}", self.side, self.chunk)
    }
}

/// Checks that a chunk names one of the job's `count` files and, where the
/// files' sizes are given, that its `elems` elements fit in its file; returns
/// the byte range `start..end`.
pub(crate) fn check_chunk(
    at: ChunkAt,
    chunk: &ChunkRef,
    elems: u64,
    count: usize,
    sizes: Option<&[u64]>,
    name: impl Fn(usize) -> String,
) -> Result<(u64, u64), Error> {
    if chunk.file >= count {
        return Err(Error::FileIndex {
            at,
            index: chunk.file,
            count,
            files: if at.side == Side::Target {
                "target"
            } else {
                "source"
            },
        });
    }
    let size = sizes.map_or(u64::MAX, |s| s[chunk.file]);
    // In u128 so that an absurd offset still gets an exact message.
    let end = u128::from(elems) * chunk.dtype.size() as u128 + u128::from(chunk.offset);
    match u64::try_from(end) {
        Ok(end) if end <= size => Ok((chunk.offset, end)),
        _ => Err(Error::OutOfFile {
            at,
            file: name(chunk.file),
            offset: chunk.offset,
            end,
            actual: size,
            hint: match at.side {
                Side::Target => "create each target file at its final size before executing",
                _ => "the file is truncated, or the chunk's offset, shape or dtype is wrong",
            },
        }),
    }
}

/// Checks that `offset..offset + len` lies inside a file of `size` bytes and
/// returns it as a slice range.
pub(crate) fn check_range(
    path: &Path,
    size: u64,
    offset: u64,
    len: u64,
) -> Result<std::ops::Range<usize>, Error> {
    match offset.checked_add(len) {
        // Inside a mapped file, so within usize.
        Some(end) if end <= size => Ok(offset as usize..end as usize),
        _ => Err(Error::RangeOutOfFile {
            path: path.to_path_buf(),
            offset,
            len,
            actual: size,
        }),
    }
}
