//! The Python module `ravex_convert._core`: the only file that knows pyo3.
//!
//! Regions cross the boundary as plain tuples, `("box", offsets, sizes)` or
//! `("flat", start, length)`; a chunk's id is its index in the list given.
//! Chunks stored in files are `(file index, byte offset, region, dtype name)`.
//! Arguments are converted to Rust values first, then the work runs with the
//! GIL released. Malformed arguments raise `ValueError`; failing file
//! operations raise `OSError` (its subclass by errno, with `filename`); source
//! bytes that do not match their metadata raise `CorruptSourceError` (a
//! `ValueError`); a failed invariant of the job raises `InternalError` (a
//! `RuntimeError`). See `py_err`.

use std::path::PathBuf;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use crate::binding_s3::{inner_remote, s3_err, S3Object, S3Upload};
use crate::checksum::{self, checksum_ranges_of as checksum_ranges_impl, xxh3_64_bytes, Algo};
use crate::compare::{compare as compare_impl, Tolerance};
use crate::compress;
use crate::dcp::{self, Item, Leaf, LeafKind, PathItem};
use crate::dtype::DType;
use crate::exec::{self, Job, Options, Stats, TensorJob, DEFAULT_WINDOW_BYTES};
use crate::files::{ChunkRef, Error, Memory, Side, Source, Target};
use crate::geometry::Region;
use crate::plan::{plan, Chunk, PlanError};

/// `(target_index, source_index, src_elem, dst_elem, len)`
type RunTuple = (usize, usize, u64, u64, u64);

const REGION_FORMS: &str = "('box', offsets, sizes) or ('flat', start, length)";

/// Where a value sits in a call's arguments, for error messages: built from
/// borrowed parts while the arguments are walked, and formatted only when an
/// error needs it. (Formatting it eagerly, a few `format!`s per chunk, was
/// most of the time pyo3 took to hand a large job over.)
#[derive(Clone, Copy)]
enum At<'a> {
    Arg(&'a str),
    Index(&'a At<'a>, usize),
    Field(&'a At<'a>, &'static str),
}

impl<'a> At<'a> {
    fn at(&'a self, i: usize) -> At<'a> {
        At::Index(self, i)
    }

    fn field(&'a self, name: &'static str) -> At<'a> {
        At::Field(self, name)
    }
}

impl std::fmt::Display for At<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            At::Arg(name) => f.write_str(name),
            At::Index(at, i) => write!(f, "{at}[{i}]"),
            At::Field(at, name) => write!(f, "{at} {name}"),
        }
    }
}

/// `repr(obj)`, cut short: enough to recognise the value in an error message.
fn show(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map_or_else(|_| "<unprintable>".to_string(), |r| r.to_string());
    match text.char_indices().nth(80) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

fn non_negative_int(obj: &Bound<'_, PyAny>, what: At<'_>) -> PyResult<u64> {
    obj.extract::<u64>().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a non-negative int, got {}",
            show(obj)
        ))
    })
}

fn non_negative_ints(obj: &Bound<'_, PyAny>, what: At<'_>) -> PyResult<Vec<u64>> {
    // pyo3 refuses a str here rather than reading its characters.
    let items: Vec<Bound<'_, PyAny>> = obj.extract().map_err(|_| {
        PyValueError::new_err(format!("{what} must be a list of ints, got {}", show(obj)))
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, x)| non_negative_int(x, what.at(i)))
        .collect()
}

fn region(obj: &Bound<'_, PyAny>, what: At<'_>) -> PyResult<Region> {
    let bad = || PyValueError::new_err(format!("{what} must be {REGION_FORMS}, got {}", show(obj)));
    let tuple = obj.cast::<PyTuple>().map_err(|_| bad())?;
    if tuple.len() != 3 {
        return Err(bad());
    }
    let kind: String = tuple.get_item(0)?.extract().map_err(|_| bad())?;
    let (a, b) = (tuple.get_item(1)?, tuple.get_item(2)?);
    match kind.as_str() {
        "box" => Ok(Region::Box {
            offsets: non_negative_ints(&a, what.field("offsets"))?,
            sizes: non_negative_ints(&b, what.field("sizes"))?,
        }),
        "flat" => Ok(Region::Flat {
            start: non_negative_int(&a, what.field("start"))?,
            len: non_negative_int(&b, what.field("length"))?,
        }),
        _ => Err(bad()),
    }
}

fn chunks(list: &Bound<'_, PyAny>, what: At<'_>) -> PyResult<Vec<Chunk>> {
    let items: Vec<Bound<'_, PyAny>> = list.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a list of regions, got {}",
            show(list)
        ))
    })?;
    items
        .iter()
        .enumerate()
        .map(|(id, x)| {
            Ok(Chunk {
                id,
                region: region(x, what.at(id))?,
            })
        })
        .collect()
}

/// Plans the copies that fill every target chunk of one tensor from its
/// source chunks. Returns `(target_index, source_index, src_elem, dst_elem,
/// len)` tuples, grouped by target in target order, sorted by `dst_elem`
/// within a target; offsets and lengths count elements of each chunk's own
/// row-major storage. Where chunks overlap, the first source listed wins.
/// Raises `ValueError` for a malformed or out-of-bounds region, or when a
/// target element is in no source.
#[pyfunction]
fn plan_runs(
    py: Python<'_>,
    global_shape: &Bound<'_, PyAny>,
    sources: &Bound<'_, PyAny>,
    targets: &Bound<'_, PyAny>,
) -> PyResult<Vec<RunTuple>> {
    let shape = non_negative_ints(global_shape, At::Arg("global_shape"))?;
    let sources = chunks(sources, At::Arg("sources"))?;
    let targets = chunks(targets, At::Arg("targets"))?;
    let plans = py
        .detach(|| plan(&shape, &sources, &targets))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(plans
        .iter()
        .flat_map(|p| {
            p.runs.iter().map(move |r| {
                (
                    p.target_id,
                    r.source_id,
                    r.run.src_elem,
                    r.run.dst_elem,
                    r.run.len,
                )
            })
        })
        .collect())
}

pyo3::create_exception!(
    ravex_convert._core,
    CorruptSourceError,
    PyValueError,
    "A source's bytes are not what its metadata says (a file shorter than its chunks, a frame that does not decode, chunks that leave a tensor uncovered). `tensor` is the tensor's index in the job and `path` the file, where known."
);
pyo3::create_exception!(
    ravex_convert._core,
    InternalError,
    PyRuntimeError,
    "An invariant of Ravex's own failed (a plan that does not tile its targets, a bad argument from the Python side): a bug to report, not bad data."
);

/// An exception of class `T` carrying `tensor` and `path` attributes.
fn with_place<T: pyo3::PyTypeInfo>(
    msg: String,
    tensor: Option<usize>,
    path: Option<String>,
) -> PyErr {
    Python::attach(|py| {
        let err = PyErr::new::<T, _>(msg);
        let value = err.value(py);
        // Setting attributes on a fresh exception instance cannot fail.
        let _ = value.setattr("tensor", tensor);
        let _ = value.setattr("path", path);
        err
    })
}

/// A core error as the Python exception that means the same: an OS error as
/// `OSError` (its subclass by errno, with `filename`); bad source data as
/// [`CorruptSourceError`] (a `ValueError`); anything else, which only a bug in
/// Ravex produces, as [`InternalError`].
fn py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::Io {
            action,
            path,
            source,
        } if inner_remote(source).is_some() => s3_err(inner_remote(source).expect("checked")),
        Error::Io {
            action,
            path,
            source,
        } => match source.raw_os_error() {
            // OSError(errno, strerror, filename) picks the subclass
            // (FileNotFoundError, PermissionError, ...) from the errno.
            Some(errno) => {
                let kind = source.to_string();
                let kind = kind.split(" (os error").next().unwrap_or(&kind);
                PyOSError::new_err((
                    errno,
                    format!("{action}: {kind}"),
                    path.display().to_string(),
                ))
            }
            None => PyOSError::new_err(msg),
        },
        Error::OutOfFile { at, file, .. } if at.side != Side::Target => {
            with_place::<CorruptSourceError>(msg, at.tensor, Some(file.clone()))
        }
        Error::RangeOutOfFile { path, .. } => {
            with_place::<CorruptSourceError>(msg, None, Some(path.display().to_string()))
        }
        // The readers take source chunks and shapes from the checkpoint's
        // metadata; targets are Ravex's own choice.
        Error::Plan {
            tensor,
            error: PlanError::Source { .. } | PlanError::Uncovered { .. } | PlanError::Shape(_),
        } => with_place::<CorruptSourceError>(msg, Some(*tensor), None),
        Error::Corrupt(_) => with_place::<CorruptSourceError>(msg, None, None),
        Error::Plan { tensor, .. } => with_place::<InternalError>(msg, Some(*tensor), None),
        Error::OutOfFile { at, .. } => with_place::<InternalError>(msg, at.tensor, None),
        Error::DType(_)
        | Error::FileIndex { .. }
        | Error::TargetOverlap { .. }
        | Error::Invalid(_) => with_place::<InternalError>(msg, None, None),
    }
}

/// An int argument that must not be negative.
fn checked(v: i64, what: &str) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| PyValueError::new_err(format!("{what} must be >= 0, got {v}")))
}

fn path_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<PathBuf> {
    if obj.is_instance_of::<PyBytes>() {
        return Err(PyValueError::new_err(format!(
            "{what} must be a path (str), got bytes"
        )));
    }
    obj.extract::<PathBuf>().map_err(|_| {
        PyValueError::new_err(format!("{what} must be a path (str), got {}", show(obj)))
    })
}

/// One source named by a path (str) or an `S3Object`.
fn source_one(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Source<'static>> {
    if let Ok(o) = obj.cast::<S3Object>() {
        return Ok(Source::Remote(o.get().inner.clone()));
    }
    path_arg(obj, what).map(Source::Path)
}

fn list<'py>(obj: &Bound<'py, PyAny>, what: At<'_>, of: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    obj.extract().map_err(|_| {
        PyValueError::new_err(format!("{what} must be a list of {of}, got {}", show(obj)))
    })
}

/// `x` as a C-contiguous buffer of bytes (a memoryview of a tensor's storage),
/// or `None` when it exports no such buffer.
fn byte_buffer(x: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<PyBuffer<u8>>> {
    let Ok(buf) = PyBuffer::<u8>::get(x) else {
        return Ok(None);
    };
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what}: the buffer is not C-contiguous"
        )));
    }
    Ok(Some(buf))
}

/// Inline sources that are not `bytes` but another byte buffer: held for the
/// whole call so the executor can read them without the GIL. `None` for bytes
/// and paths.
fn held_buffers(items: &[Bound<'_, PyAny>]) -> PyResult<Vec<Option<PyBuffer<u8>>>> {
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            if x.is_instance_of::<PyBytes>()
                || x.is_instance_of::<S3Object>()
                || x.extract::<PathBuf>().is_ok()
            {
                return Ok(None);
            }
            let what = format!("sources[{i}]");
            byte_buffer(x, &what)?.map(Some).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{what} must be a path (str), bytes or a buffer of unsigned bytes, got {}",
                    show(x)
                ))
            })
        })
        .collect()
}

/// The bytes a held buffer exposes.
fn buffer_bytes(buf: &PyBuffer<u8>) -> &[u8] {
    let len = buf.len_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: the buffer is C-contiguous, `len` bytes long and stays exported
    // (its memory valid) while `buf` lives. The caller promises not to change
    // it during the call (the runtime hands over snapshot copies).
    unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, len) }
}

/// Sources: `bytes` and other byte buffers are read where they are (no
/// copy), anything else is a path. `items` and `held` must outlive the
/// returned sources.
fn sources_arg<'a>(
    items: &'a [Bound<'_, PyAny>],
    held: &'a [Option<PyBuffer<u8>>],
) -> PyResult<Vec<Source<'a>>> {
    items
        .iter()
        .zip(held)
        .enumerate()
        .map(|(i, (x, buf))| {
            if let Some(buf) = buf {
                return Ok(Source::Bytes(buffer_bytes(buf)));
            }
            if let Ok(obj) = x.cast::<S3Object>() {
                return Ok(Source::Remote(obj.get().inner.clone()));
            }
            match x.cast::<PyBytes>() {
                // bytes are immutable, so reading them without the GIL is safe.
                Ok(b) => Ok(Source::Bytes(b.as_bytes())),
                Err(_) => x.extract::<PathBuf>().map(Source::Path).map_err(|_| {
                    PyValueError::new_err(format!(
                        "sources[{i}] must be a path (str), bytes or a buffer of unsigned bytes, got {}",
                        show(x)
                    ))
                }),
            }
        })
        .collect()
}

fn dtype_arg(obj: &Bound<'_, PyAny>, what: At<'_>) -> PyResult<DType> {
    let name: String = obj.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a dtype name (str), got {}",
            show(obj)
        ))
    })?;
    name.parse()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
}

fn index_arg(obj: &Bound<'_, PyAny>, what: At<'_>) -> PyResult<usize> {
    let v = non_negative_int(obj, what)?;
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{what} is too large: {v}")))
}

/// `(file index, byte offset, region, dtype)` tuples.
fn file_chunks(obj: &Bound<'_, PyAny>, what: At<'_>) -> PyResult<Vec<ChunkRef>> {
    const FORM: &str = "(file index, byte offset, region, dtype) tuples";
    list(obj, what, FORM)?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let what = what.at(i);
            let bad = || PyValueError::new_err(format!("{what} must be {FORM}, got {}", show(x)));
            let t = x.cast::<PyTuple>().map_err(|_| bad())?;
            if t.len() != 4 {
                return Err(bad());
            }
            Ok(ChunkRef {
                file: index_arg(&t.get_item(0)?, what.field("file index"))?,
                offset: non_negative_int(&t.get_item(1)?, what.field("byte offset"))?,
                region: region(&t.get_item(2)?, what.field("region"))?,
                dtype: dtype_arg(&t.get_item(3)?, what.field("dtype"))?,
            })
        })
        .collect()
}

fn tensors_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<TensorJob>> {
    const FORM: &str = "(shape, src_chunks, dst_chunks) tuples";
    let tensors = At::Arg("tensors");
    list(obj, tensors, FORM)?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let what = tensors.at(i);
            let bad = || PyValueError::new_err(format!("{what} must be {FORM}, got {}", show(x)));
            let t = x.cast::<PyTuple>().map_err(|_| bad())?;
            if t.len() != 3 {
                return Err(bad());
            }
            Ok(TensorJob {
                shape: non_negative_ints(&t.get_item(0)?, what.field("shape"))?,
                src_chunks: file_chunks(&t.get_item(1)?, what.field("src_chunks"))?,
                dst_chunks: file_chunks(&t.get_item(2)?, what.field("dst_chunks"))?,
            })
        })
        .collect()
}

/// Targets that are writable buffers (a live tensor's bytes, a bytearray):
/// held for the whole call so the executor can write them without the GIL.
/// `None` for paths.
fn held_targets(items: &[Bound<'_, PyAny>]) -> PyResult<Vec<Option<PyBuffer<u8>>>> {
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            if x.is_instance_of::<PyBytes>()
                || x.is_instance_of::<S3Upload>()
                || x.extract::<PathBuf>().is_ok()
            {
                return Ok(None);
            }
            let what = format!("targets[{i}]");
            let buf = byte_buffer(x, &what)?.ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{what} must be a path (str) or a writable buffer of unsigned bytes, got {}",
                    show(x)
                ))
            })?;
            if buf.readonly() {
                return Err(PyValueError::new_err(format!(
                    "{what}: the buffer is read-only"
                )));
            }
            Ok(Some(buf))
        })
        .collect()
}

fn targets_arg<'a>(
    items: &'a [Bound<'_, PyAny>],
    held: &'a [Option<PyBuffer<u8>>],
) -> PyResult<Vec<Target<'a>>> {
    items
        .iter()
        .zip(held)
        .enumerate()
        .map(|(i, (x, buf))| match buf {
            Some(buf) => {
                // SAFETY: the buffer is C-contiguous, writable and `len_bytes()` long, and stays
                // exported (its memory valid) while `held` lives, for the whole call. The caller
                // promises not to touch it during the call (the runtime restores into tensors
                // nothing else uses until the restore returns).
                Ok(Target::Memory(unsafe {
                    Memory::from_raw(buf.buf_ptr() as *mut u8, buf.len_bytes())
                }))
            }
            None => match x.cast::<S3Upload>() {
                Ok(up) => Ok(Target::Remote(std::sync::Arc::new(up.get().inner.clone()))),
                Err(_) => path_arg(x, &format!("targets[{i}]")).map(Target::Path),
            },
        })
        .collect()
}

fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes_read", s.bytes_read)?;
    d.set_item("bytes_written", s.bytes_written)?;
    d.set_item("runs", s.runs)?;
    d.set_item("pieces", s.pieces)?;
    d.set_item("direct_bytes", s.direct_bytes)?;
    Ok(d)
}

// The signatures spell the default window out so that Python's
// `__text_signature__` (and so stubtest) sees the number.
const _: () = assert!(DEFAULT_WINDOW_BYTES == 67108864);

/// Copies every target chunk's elements from the source chunks, casting
/// between float dtypes where the chunks' dtypes differ, with positional
/// writes into targets: files that already exist at their final size
/// (nothing is created or truncated), or writable buffers (a live tensor's
/// bytes); bytes outside target chunks are left alone.
/// `sources` are paths (mapped read-only) or `bytes`; each tensor is
/// `(shape, src_chunks, dst_chunks)` with chunks as `(file index, byte
/// offset, region, dtype)`. Runs on `threads` threads (0: one per CPU),
/// in pieces of at most `window_bytes / threads` bytes copied through one
/// 64 KiB buffer per thread; fsyncs every target
/// at the end when `sync`. Returns `bytes_read`, `bytes_written`, `runs` and
/// `pieces`. Everything is validated before the first byte moves. With
/// `crc_ranges` (`(target index, offset, length)` tuples) it also returns
/// `crcs`: the CRC-32 of each range, gathered while copying (None where the
/// job's writes do not tile the range), so zip writers need no second pass,
/// and `crc_parts`: `(range index, offset, length, crc)` of the pieces written
/// inside each range left None, to be joined with other calls' (`crc32_concat`).
/// With `read_crcs` it also returns `read_crcs`: `(source index, offset,
/// length, crc)` of every stretch of source bytes copied unchanged (a cast's
/// are not), so a reader's CRC-32s of its sources are checked without a
/// second read (combine them with `crc32_concat`).
/// `writeback` starts each piece's write-back to disk as soon as it is
/// written, for callers that fsync the targets afterwards themselves.
/// `direct` writes the whole pages of file targets around the page cache
/// (`O_DIRECT`, where the file system allows it), for durable output.
/// `hash_ranges` (`(target, offset, length)` tuples) returns `hashes`: the
/// xxh3-64 of each range, hashed as its bytes were written, or None where no
/// one copy thread wrote all of it in order (hash those from the file).
#[pyfunction]
#[pyo3(signature = (sources, targets, tensors, threads=0, window_bytes=67108864, sync=true, crc_ranges=None, writeback=false, read_crcs=false, direct=false, hash_ranges=None))]
#[allow(clippy::too_many_arguments)]
fn execute<'py>(
    py: Python<'py>,
    sources: &Bound<'py, PyAny>,
    targets: &Bound<'py, PyAny>,
    tensors: &Bound<'py, PyAny>,
    threads: i64,
    window_bytes: i64,
    sync: bool,
    crc_ranges: Option<&Bound<'py, PyAny>>,
    writeback: bool,
    read_crcs: bool,
    direct: bool,
    hash_ranges: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let options = Options {
        threads: checked(threads, "threads")? as usize,
        window_bytes: checked(window_bytes, "window_bytes")?,
        sync,
        writeback,
        direct,
    };
    let items = list(sources, At::Arg("sources"), "paths or bytes")?;
    let held = held_buffers(&items)?;
    let outs = list(targets, At::Arg("targets"), "paths or writable buffers")?;
    let held_outs = held_targets(&outs)?;
    let job = Job {
        sources: sources_arg(&items, &held)?,
        targets: targets_arg(&outs, &held_outs)?,
        tensors: tensors_arg(tensors)?,
    };
    if crc_ranges.is_none() && !read_crcs && hash_ranges.is_none() {
        let stats = py
            .detach(|| exec::execute(&job, &options))
            .map_err(py_err)?;
        return stats_dict(py, &stats);
    }
    let ranges = ranges_arg(py, crc_ranges, At::Arg("crc_ranges"))?;
    let to_hash = ranges_arg(py, hash_ranges, At::Arg("hash_ranges"))?;
    let want_crcs = crc_ranges.is_some() || read_crcs;
    let (stats, crcs, parts, read, hashes) = py
        .detach(|| {
            exec::execute_hashed(&job, &options, want_crcs, &to_hash).map(
                |(stats, pieces, hashes)| {
                    let read: Vec<(usize, u64, u64, u32)> = pieces
                        .iter()
                        .filter_map(|p| p.read.map(|(src, at)| (src, at, p.len, p.crc)))
                        .collect();
                    let crcs = checksum::combine_crcs(pieces.clone(), &ranges);
                    let parts = checksum::untiled_parts(pieces, &ranges, &crcs);
                    (stats, crcs, parts, read, hashes)
                },
            )
        })
        .map_err(py_err)?;
    let dict = stats_dict(py, &stats)?;
    if crc_ranges.is_some() {
        dict.set_item("crcs", crcs)?;
        dict.set_item("crc_parts", parts)?;
    }
    if read_crcs {
        dict.set_item("read_crcs", read)?;
    }
    if hash_ranges.is_some() {
        dict.set_item("hashes", hashes)?;
    }
    Ok(dict)
}

/// `(target, offset, length)` tuples of an argument named `what` (none when it is None).
fn ranges_arg(
    py: Python<'_>,
    arg: Option<&Bound<'_, PyAny>>,
    what: At<'_>,
) -> PyResult<Vec<(usize, u64, u64)>> {
    let empty = PyList::empty(py);
    list(
        arg.unwrap_or(empty.as_any()),
        what,
        "(target, offset, length) tuples",
    )?
    .iter()
    .enumerate()
    .map(|(i, x)| {
        let (t, o, l): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) =
            x.extract().map_err(|_| {
                PyValueError::new_err(format!(
                    "{what}[{i}] must be a (target, offset, length) tuple, got {}",
                    show(x)
                ))
            })?;
        let at = what.at(i);
        Ok((
            index_arg(&t, at.field("target"))?,
            non_negative_int(&o, at.field("offset"))?,
            non_negative_int(&l, at.field("length"))?,
        ))
    })
    .collect()
}

/// The CRC-32 of byte strings one after another, from each one's `(crc, length)`.
#[pyfunction]
fn crc32_concat(parts: Vec<(u32, u64)>) -> u32 {
    checksum::crc32_concat(&parts)
}

/// What `execute` would do with the same arguments, without moving a byte:
/// `bytes_read`, `bytes_written`, `runs`, `pieces` and `per_target_bytes`
/// (bytes written into each target, in order). Source files must exist (their
/// sizes are checked); targets need not.
#[pyfunction]
#[pyo3(signature = (sources, targets, tensors, threads=0, window_bytes=67108864))]
fn plan_summary<'py>(
    py: Python<'py>,
    sources: &Bound<'py, PyAny>,
    targets: &Bound<'py, PyAny>,
    tensors: &Bound<'py, PyAny>,
    threads: i64,
    window_bytes: i64,
) -> PyResult<Bound<'py, PyDict>> {
    let options = Options {
        threads: checked(threads, "threads")? as usize,
        window_bytes: checked(window_bytes, "window_bytes")?,
        sync: false,
        writeback: false,
        direct: false,
    };
    let items = list(sources, At::Arg("sources"), "paths or bytes")?;
    let held = held_buffers(&items)?;
    let outs = list(targets, At::Arg("targets"), "paths or writable buffers")?;
    let held_outs = held_targets(&outs)?;
    let job = Job {
        sources: sources_arg(&items, &held)?,
        targets: targets_arg(&outs, &held_outs)?,
        tensors: tensors_arg(tensors)?,
    };
    let summary = py
        .detach(|| exec::plan_summary(&job, &options))
        .map_err(py_err)?;
    let d = stats_dict(py, &summary.stats)?;
    d.set_item("per_target_bytes", summary.per_target_bytes)?;
    Ok(d)
}

/// The checksum of each `(offset, length)` byte range of the file, in order:
/// `algo` is `"xxh3-64"` (seed 0) or `"crc32"` (as zip records it).
#[pyfunction]
fn checksum_ranges(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    ranges: &Bound<'_, PyAny>,
    algo: &str,
) -> PyResult<Vec<u64>> {
    let source = source_one(path, "path")?;
    let ranges = list(ranges, At::Arg("ranges"), "(offset, length) tuples")?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let (o, l): (Bound<'_, PyAny>, Bound<'_, PyAny>) = x.extract().map_err(|_| {
                PyValueError::new_err(format!(
                    "ranges[{i}] must be an (offset, length) tuple, got {}",
                    show(x)
                ))
            })?;
            let ranges = At::Arg("ranges");
            let at = ranges.at(i);
            Ok((
                non_negative_int(&o, at.field("offset"))?,
                non_negative_int(&l, at.field("length"))?,
            ))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let algo: Algo = algo.parse().map_err(py_err)?;
    py.detach(|| checksum_ranges_impl(&source, &ranges, algo))
        .map_err(py_err)
}

/// XXH3-64 (seed 0) of the bytes (`bytes` or any C-contiguous byte buffer,
/// which must not change during the call).
#[pyfunction]
fn xxh3_64(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(b) = data.cast::<PyBytes>() {
        let bytes = b.as_bytes();
        return Ok(py.detach(|| xxh3_64_bytes(bytes)));
    }
    let Some(buf) = byte_buffer(data, "data")? else {
        return Err(PyValueError::new_err(format!(
            "data must be bytes or a buffer of unsigned bytes, got {}",
            show(data)
        )));
    };
    let bytes = buffer_bytes(&buf);
    Ok(py.detach(|| xxh3_64_bytes(bytes)))
}

/// `length` bytes at `offset` of the file, compressed into one zstd frame.
#[pyfunction]
#[pyo3(signature = (path, offset, length, level=3))]
fn compress_range<'py>(
    py: Python<'py>,
    path: &Bound<'py, PyAny>,
    offset: i64,
    length: i64,
    level: i32,
) -> PyResult<Bound<'py, PyBytes>> {
    let source = source_one(path, "path")?;
    let offset = checked(offset, "offset")?;
    let length = checked(length, "length")?;
    let frame = py
        .detach(|| compress::compress_range_of(&source, offset, length, level))
        .map_err(py_err)?;
    Ok(PyBytes::new(py, &frame))
}

/// The zstd frame of `stored_len` bytes at `offset` of the file,
/// decompressed; it must hold exactly `expected_len` bytes.
#[pyfunction]
fn decompress_frame<'py>(
    py: Python<'py>,
    path: &Bound<'py, PyAny>,
    offset: i64,
    stored_len: i64,
    expected_len: i64,
) -> PyResult<Bound<'py, PyBytes>> {
    let source = source_one(path, "path")?;
    let offset = checked(offset, "offset")?;
    let stored_len = checked(stored_len, "stored_len")?;
    let expected_len = checked(expected_len, "expected_len")?;
    let data = py
        .detach(|| {
            let mut out = Vec::new();
            compress::decompress_frame_into_of(&source, offset, stored_len, expected_len, &mut out)
                .map(|_| out)
        })
        .map_err(py_err)?;
    Ok(PyBytes::new(py, &data))
}

/// The zstd frame of `stored_len` bytes at `offset` of the file, decoded in
/// bounded pieces into the file `dst` (which must exist; it is truncated), or
/// only hashed when `dst` is None. Returns the XXH3-64 of the decoded bytes.
#[pyfunction]
#[pyo3(signature = (path, offset, stored_len, expected_len, dst=None))]
fn decompress_frame_to(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    offset: i64,
    stored_len: i64,
    expected_len: i64,
    dst: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let source = source_one(path, "path")?;
    let offset = checked(offset, "offset")?;
    let stored_len = checked(stored_len, "stored_len")?;
    let expected_len = checked(expected_len, "expected_len")?;
    let dst = dst.map(|d| path_arg(d, "dst")).transpose()?;
    py.detach(|| -> Result<u64, Error> {
        match &dst {
            None => compress::decompress_frame_into_of(
                &source,
                offset,
                stored_len,
                expected_len,
                &mut std::io::sink(),
            ),
            Some(d) => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .truncate(true)
                    .open(d)
                    .map_err(|e| Error::io("cannot open", d, e))?;
                let mut out = std::io::BufWriter::new(file);
                let h = compress::decompress_frame_into_of(
                    &source,
                    offset,
                    stored_len,
                    expected_len,
                    &mut out,
                )?;
                std::io::Write::flush(&mut out).map_err(|e| Error::io("cannot write", d, e))?;
                Ok(h)
            }
        }
    })
    .map_err(py_err)
}

/// Compares two stored copies of one tensor of global shape `shape`, element
/// by element: `a_chunks` and `b_chunks` are `(source index, byte offset,
/// region, dtype)` and must each cover the tensor. Returns `(n_diff,
/// first_diff, max_abs_diff)`: the number of differing elements, the flat
/// row-major index of the first, and the largest absolute difference. With
/// `exact`, equal dtypes compare bits and different ones values; otherwise
/// floats match when `|a - b| <= atol + rtol * |b|`. NaN matches NaN;
/// integers and bools always compare exactly.
#[pyfunction]
#[pyo3(signature = (sources, shape, a_chunks, b_chunks, atol=0.0, rtol=0.0, exact=true))]
#[allow(clippy::too_many_arguments)]
fn compare<'py>(
    py: Python<'py>,
    sources: &Bound<'py, PyAny>,
    shape: &Bound<'py, PyAny>,
    a_chunks: &Bound<'py, PyAny>,
    b_chunks: &Bound<'py, PyAny>,
    atol: f64,
    rtol: f64,
    exact: bool,
) -> PyResult<(u64, Option<u64>, f64)> {
    let items = list(sources, At::Arg("sources"), "paths or bytes")?;
    let held = held_buffers(&items)?;
    let sources = sources_arg(&items, &held)?;
    let shape = non_negative_ints(shape, At::Arg("shape"))?;
    let a = file_chunks(a_chunks, At::Arg("a_chunks"))?;
    let b = file_chunks(b_chunks, At::Arg("b_chunks"))?;
    let tol = Tolerance { atol, rtol, exact };
    let c = py
        .detach(|| compare_impl(&sources, &shape, &a, &b, tol))
        .map_err(py_err)?;
    Ok((c.n_diff, c.first_diff, c.max_abs_diff))
}

fn dcp_leaf(obj: &Bound<'_, PyAny>, i: usize) -> PyResult<Leaf> {
    let leaves = At::Arg("leaves");
    let what = leaves.at(i);
    let bad = || {
        PyValueError::new_err(format!(
            "{what} must be (key, path, kind, dtype, shape, totals), got {}",
            show(obj)
        ))
    };
    let t = obj.cast::<PyTuple>().map_err(|_| bad())?;
    if t.len() != 6 {
        return Err(bad());
    }
    let key: String = t.get_item(0)?.extract().map_err(|_| bad())?;
    let path_items: Vec<Bound<'_, PyAny>> = t.get_item(1)?.extract().map_err(|_| bad())?;
    let mut path = Vec::with_capacity(path_items.len());
    for x in &path_items {
        if x.is_instance_of::<PyString>() {
            path.push(PathItem::Str(x.extract()?));
        } else if x.is_instance_of::<PyInt>() {
            path.push(PathItem::Int(x.extract().map_err(|_| bad())?));
        } else {
            return Err(PyValueError::new_err(format!(
                "{what} path items must be str or int, got {}",
                show(x)
            )));
        }
    }
    let kind = match t.get_item(2)?.extract::<u8>().map_err(|_| bad())? {
        0 => LeafKind::Sharded,
        1 => LeafKind::Whole,
        2 => LeafKind::Bytes,
        k => {
            return Err(PyValueError::new_err(format!(
                "{what} kind must be 0, 1 or 2, got {k}"
            )))
        }
    };
    let dtype: String = t.get_item(3)?.extract().map_err(|_| bad())?;
    let shape = non_negative_ints(&t.get_item(4)?, what.field("shape"))?;
    let totals = non_negative_ints(&t.get_item(5)?, what.field("totals"))?;
    let totals: [u64; 3] = totals
        .try_into()
        .map_err(|_| PyValueError::new_err(format!("{what} totals must be three ints")))?;
    Ok(Leaf {
        key,
        path,
        kind,
        dtype,
        shape,
        totals,
    })
}

/// A rank's item as Python gets it: `(leaf, index, offset, total, row0, rows)`.
type RankItem = (u32, u32, u64, u64, u64, u64);

/// A DCP output's layout (`dcp::place`): its items, each rank file's size,
/// and its `.metadata`, from one description per key.
#[pyclass(frozen, module = "ravex_convert._core")]
struct DcpLayout {
    leaves: Vec<Leaf>,
    items: Vec<Item>,
    sizes: Vec<u64>,
    by_rank: Vec<u32>,       // item indices, grouped by rank, in file order
    rank_starts: Vec<usize>, // by_rank[rank_starts[r]..rank_starts[r + 1]]: rank r's items
}

#[pymethods]
impl DcpLayout {
    /// `leaves`: `(key, path, kind, dtype, shape, totals)` per key in the
    /// flattened state's order; kind 0: a tensor cut on dim 0, 1: a tensor
    /// stored whole, 2: a non-tensor; totals: the item archive's size for a
    /// full, the last (shorter) and an empty shard (kinds 1 and 2: the first).
    #[new]
    fn new(py: Python<'_>, leaves: &Bound<'_, PyAny>, world_size: usize) -> PyResult<Self> {
        let objs = list(leaves, At::Arg("leaves"), "tuples")?;
        let leaves = objs
            .iter()
            .enumerate()
            .map(|(i, x)| dcp_leaf(x, i))
            .collect::<PyResult<Vec<_>>>()?;
        let (leaves, items, sizes, by_rank, rank_starts) = py
            .detach(move || -> Result<_, dcp::LayoutError> {
                let (items, sizes) = dcp::place(&leaves, world_size)?;
                let mut rank_starts = vec![0usize; world_size + 1];
                for it in &items {
                    rank_starts[it.rank as usize + 1] += 1;
                }
                for r in 0..world_size {
                    rank_starts[r + 1] += rank_starts[r];
                }
                let mut fill = rank_starts.clone();
                let mut by_rank = vec![0u32; items.len()];
                for (i, it) in items.iter().enumerate() {
                    by_rank[fill[it.rank as usize]] = i as u32;
                    fill[it.rank as usize] += 1;
                }
                Ok((leaves, items, sizes, by_rank, rank_starts))
            })
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(DcpLayout {
            leaves,
            items,
            sizes,
            by_rank,
            rank_starts,
        })
    }

    /// Each rank file's size in bytes.
    #[getter]
    fn file_sizes(&self) -> Vec<u64> {
        self.sizes.clone()
    }

    fn __len__(&self) -> usize {
        self.items.len()
    }

    /// Rank `rank`'s items in file order: `(leaf, index, offset, total, row0, rows)`.
    fn items_of(&self, rank: usize) -> PyResult<Vec<RankItem>> {
        if rank + 1 >= self.rank_starts.len() {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is not in a layout of {} ranks",
                self.sizes.len()
            )));
        }
        Ok(
            self.by_rank[self.rank_starts[rank]..self.rank_starts[rank + 1]]
                .iter()
                .map(|&i| {
                    let it = &self.items[i as usize];
                    (it.leaf, it.index, it.offset, it.total, it.row0, it.rows)
                })
                .collect(),
        )
    }

    /// Every item in key order: `(leaf, index, rank, offset, total, row0, rows)`.
    fn items(&self) -> Vec<(u32, u32, u32, u64, u64, u64, u64)> {
        self.items
            .iter()
            .map(|it| {
                (
                    it.leaf, it.index, it.rank, it.offset, it.total, it.row0, it.rows,
                )
            })
            .collect()
    }

    /// The length of [`DcpLayout::metadata`]'s bytes, without making them.
    fn metadata_size(&self, py: Python<'_>, current: bool, save_id: &str) -> PyResult<usize> {
        py.detach(|| dcp::metadata_len(&self.leaves, &self.items, current, save_id))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// The `.metadata` pickle (`current`: with `TensorProperties.strides`, as torch 2.15 writes it).
    fn metadata<'py>(
        &self,
        py: Python<'py>,
        current: bool,
        save_id: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = py
            .detach(|| dcp::metadata(&self.leaves, &self.items, current, save_id))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let py = m.py();
    for (name, ty) in [
        ("CorruptSourceError", py.get_type::<CorruptSourceError>()),
        ("InternalError", py.get_type::<InternalError>()),
    ] {
        // class-level defaults, so every instance (and the stub) has both
        ty.setattr("tensor", py.None())?;
        ty.setattr("path", py.None())?;
        m.add(name, ty)?;
    }
    m.add_function(wrap_pyfunction!(plan_runs, m)?)?;
    m.add_function(wrap_pyfunction!(execute, m)?)?;
    m.add_function(wrap_pyfunction!(plan_summary, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(crc32_concat, m)?)?;
    m.add_function(wrap_pyfunction!(xxh3_64, m)?)?;
    m.add_function(wrap_pyfunction!(compress_range, m)?)?;
    m.add_function(wrap_pyfunction!(decompress_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decompress_frame_to, m)?)?;
    m.add_function(wrap_pyfunction!(compare, m)?)?;
    m.add_class::<DcpLayout>()?;
    crate::binding_s3::register(m)?;
    Ok(())
}
