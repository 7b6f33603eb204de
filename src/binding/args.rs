//! The arguments of `_core`'s functions as typed values. Each tuple form the
//! Python side passes has a struct that extracts it ([`FromPyObject`]):
//! regions `("box", offsets, sizes)` or `("flat", start, length)` as
//! [`RegionArg`], chunks stored in files `(file index, byte offset, region,
//! dtype name)` as [`FileChunk`], a tensor to copy `(shape, src_chunks,
//! dst_chunks)` as [`TensorArg`], and so on; a list of any of them is a
//! [`List`].
//!
//! A malformed value is an [`ArgError`] that says where it sits, e.g.
//! `tensors[0] src_chunks[1] region offsets[1] must be a non-negative int,
//! got 'x'`. The place is put together only when an error is raised, each
//! struct adding its own step on the way out. (Formatting it eagerly, a few
//! `format!`s per chunk, was most of the time pyo3 took to hand a large job
//! over.)
//!
//! Sources and targets are not extracted but borrowed: bytes and byte buffers
//! are read (or written) where they are, so the buffers are held for the
//! whole call ([`Held`]).

use std::fmt;
use std::path::PathBuf;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyString, PyTuple};

use super::s3::{S3Object, S3Upload};
use crate::dcp::{Leaf, LeafKind, PathItem};
use crate::dtype::DType;
use crate::exec::TensorJob;
use crate::files::{ChunkRef, Memory, Source, Target};
use crate::geometry::Region;

/// One step from an argument to a value inside it.
#[derive(Debug, Clone, Copy)]
enum Step {
    Index(usize),
    Field(&'static str),
}

/// A malformed argument: what is wrong with the value and where it sits.
#[derive(Debug)]
pub(crate) struct ArgError {
    /// The argument's name, once [`ArgError::named`] gave it.
    arg: &'static str,
    /// From the value out to the argument.
    steps: Vec<Step>,
    /// Said after the place: `" must be ..."`, `": ..."`.
    problem: String,
}

impl ArgError {
    fn new(problem: String) -> ArgError {
        ArgError {
            arg: "",
            steps: Vec::new(),
            problem,
        }
    }

    /// "... must be `form`, got `repr(obj)`".
    fn must_be(form: &str, obj: &Bound<'_, PyAny>) -> ArgError {
        ArgError::new(format!(" must be {form}, got {}", show(obj)))
    }

    fn at(mut self, i: usize) -> ArgError {
        self.steps.push(Step::Index(i));
        self
    }

    fn field(mut self, name: &'static str) -> ArgError {
        self.steps.push(Step::Field(name));
        self
    }

    /// The error of argument `arg`.
    pub(crate) fn named(mut self, arg: &'static str) -> ArgError {
        self.arg = arg;
        self
    }
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.arg)?;
        for step in self.steps.iter().rev() {
            match step {
                Step::Index(i) => write!(f, "[{i}]")?,
                Step::Field(name) => write!(f, " {name}")?,
            }
        }
        f.write_str(&self.problem)
    }
}

impl std::error::Error for ArgError {}

/// `repr(obj)`, cut short: enough to recognise the value in an error message.
pub(crate) fn show(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map_or_else(|_| "<unprintable>".to_string(), |r| r.to_string());
    match text.char_indices().nth(80) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// Argument `arg` as a `T`.
pub(crate) fn extract<'py, T>(obj: &Bound<'py, PyAny>, arg: &'static str) -> Result<T, ArgError>
where
    T: for<'a> FromPyObject<'a, 'py, Error = ArgError>,
{
    obj.extract::<T>().map_err(|e| e.named(arg))
}

/// An int argument that must not be negative.
pub(crate) fn checked(v: i64, arg: &'static str) -> Result<u64, ArgError> {
    u64::try_from(v).map_err(|_| ArgError::new(format!(" must be >= 0, got {v}")).named(arg))
}

/// A non-negative int.
pub(crate) struct Count(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for Count {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<Count, ArgError> {
        obj.extract::<u64>()
            .map(Count)
            .map_err(|_| ArgError::must_be("a non-negative int", &obj))
    }
}

/// A non-negative int that is an index.
pub(crate) struct Index(pub usize);

impl<'a, 'py> FromPyObject<'a, 'py> for Index {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<Index, ArgError> {
        let Count(v) = obj.extract()?;
        usize::try_from(v)
            .map(Index)
            .map_err(|_| ArgError::new(format!(" is too large: {v}")))
    }
}

/// What a list of these is called in a message ("a list of ...").
pub(crate) trait Plural {
    const PLURAL: &'static str;
}

impl Plural for Count {
    const PLURAL: &'static str = "ints";
}

/// A list (any sequence but a `str`) of `T`.
pub(crate) struct List<T>(pub Vec<T>);

impl<'a, 'py, T> FromPyObject<'a, 'py> for List<T>
where
    T: for<'b> FromPyObject<'b, 'py, Error = ArgError> + Plural,
{
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<List<T>, ArgError> {
        // pyo3 refuses a str here rather than reading its characters.
        let items: Vec<Bound<'py, PyAny>> = obj
            .extract()
            .map_err(|_| ArgError::must_be(&format!("a list of {}", T::PLURAL), &obj))?;
        items
            .iter()
            .enumerate()
            .map(|(i, x)| x.extract::<T>().map_err(|e| e.at(i)))
            .collect::<Result<_, _>>()
            .map(List)
    }
}

/// Non-negative ints (a shape, offsets, sizes).
fn counts(obj: &Bound<'_, PyAny>) -> Result<Vec<u64>, ArgError> {
    let List(v) = obj.extract::<List<Count>>()?;
    Ok(v.into_iter().map(|Count(n)| n).collect())
}

/// The items of a tuple of `n`, or the error `bad` makes.
fn tuple_of<'py>(
    obj: &Bound<'py, PyAny>,
    n: usize,
    bad: impl Fn() -> ArgError,
) -> Result<Vec<Bound<'py, PyAny>>, ArgError> {
    let t = obj.cast::<PyTuple>().map_err(|_| bad())?;
    if t.len() != n {
        return Err(bad());
    }
    Ok(t.iter().collect())
}

const REGION_FORMS: &str = "('box', offsets, sizes) or ('flat', start, length)";

/// `("box", offsets, sizes)` or `("flat", start, length)`.
pub(crate) struct RegionArg(pub Region);

impl Plural for RegionArg {
    const PLURAL: &'static str = "regions";
}

impl<'a, 'py> FromPyObject<'a, 'py> for RegionArg {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<RegionArg, ArgError> {
        let obj = obj.to_owned();
        let bad = || ArgError::must_be(REGION_FORMS, &obj);
        let t = tuple_of(&obj, 3, bad)?;
        let kind: String = t[0].extract().map_err(|_| bad())?;
        let count = |x: &Bound<'py, PyAny>, name| {
            x.extract()
                .map(|Count(n)| n)
                .map_err(|e: ArgError| e.field(name))
        };
        let ints = |x: &Bound<'py, PyAny>, name| counts(x).map_err(|e| e.field(name));
        match kind.as_str() {
            "box" => Ok(RegionArg(Region::Box {
                offsets: ints(&t[1], "offsets")?,
                sizes: ints(&t[2], "sizes")?,
            })),
            "flat" => Ok(RegionArg(Region::Flat {
                start: count(&t[1], "start")?,
                len: count(&t[2], "length")?,
            })),
            _ => Err(bad()),
        }
    }
}

/// A dtype by its name (`"float32"`).
struct DTypeArg(DType);

impl<'a, 'py> FromPyObject<'a, 'py> for DTypeArg {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<DTypeArg, ArgError> {
        let name: String = obj
            .extract()
            .map_err(|_| ArgError::must_be("a dtype name (str)", &obj))?;
        name.parse()
            .map(DTypeArg)
            .map_err(|e| ArgError::new(format!(": {e}")))
    }
}

/// A chunk stored in a file: `(file index, byte offset, region, dtype)`.
pub(crate) struct FileChunk(pub ChunkRef);

impl Plural for FileChunk {
    const PLURAL: &'static str = "(file index, byte offset, region, dtype) tuples";
}

impl<'a, 'py> FromPyObject<'a, 'py> for FileChunk {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<FileChunk, ArgError> {
        let obj = obj.to_owned();
        let t = tuple_of(&obj, 4, || {
            ArgError::must_be("(file index, byte offset, region, dtype) tuples", &obj)
        })?;
        Ok(FileChunk(ChunkRef {
            file: t[0]
                .extract::<Index>()
                .map_err(|e| e.field("file index"))?
                .0,
            offset: t[1]
                .extract::<Count>()
                .map_err(|e| e.field("byte offset"))?
                .0,
            region: t[2]
                .extract::<RegionArg>()
                .map_err(|e| e.field("region"))?
                .0,
            dtype: t[3].extract::<DTypeArg>().map_err(|e| e.field("dtype"))?.0,
        }))
    }
}

/// Chunks stored in files.
pub(crate) fn file_chunks(
    obj: &Bound<'_, PyAny>,
    arg: &'static str,
) -> Result<Vec<ChunkRef>, ArgError> {
    let List(v) = extract::<List<FileChunk>>(obj, arg)?;
    Ok(v.into_iter().map(|FileChunk(c)| c).collect())
}

/// One logical tensor to copy: `(shape, src_chunks, dst_chunks)`.
pub(crate) struct TensorArg(pub TensorJob);

impl Plural for TensorArg {
    const PLURAL: &'static str = "(shape, src_chunks, dst_chunks) tuples";
}

impl<'a, 'py> FromPyObject<'a, 'py> for TensorArg {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<TensorArg, ArgError> {
        let obj = obj.to_owned();
        let t = tuple_of(&obj, 3, || {
            ArgError::must_be("(shape, src_chunks, dst_chunks) tuples", &obj)
        })?;
        let chunks = |x: &Bound<'py, PyAny>, name| {
            x.extract::<List<FileChunk>>()
                .map(|List(v)| v.into_iter().map(|FileChunk(c)| c).collect())
                .map_err(|e| e.field(name))
        };
        Ok(TensorArg(TensorJob {
            shape: counts(&t[0]).map_err(|e| e.field("shape"))?,
            src_chunks: chunks(&t[1], "src_chunks")?,
            dst_chunks: chunks(&t[2], "dst_chunks")?,
        }))
    }
}

/// `(target, offset, length)`: bytes of a target.
pub(crate) struct TargetRange(pub (usize, u64, u64));

impl Plural for TargetRange {
    const PLURAL: &'static str = "(target, offset, length) tuples";
}

impl<'a, 'py> FromPyObject<'a, 'py> for TargetRange {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<TargetRange, ArgError> {
        let (t, o, l): (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>) = obj
            .extract()
            .map_err(|_| ArgError::must_be("a (target, offset, length) tuple", &obj))?;
        Ok(TargetRange((
            t.extract::<Index>().map_err(|e| e.field("target"))?.0,
            o.extract::<Count>().map_err(|e| e.field("offset"))?.0,
            l.extract::<Count>().map_err(|e| e.field("length"))?.0,
        )))
    }
}

/// `(target, offset, length)` ranges of argument `arg`; none where it is None.
pub(crate) fn target_ranges(
    obj: Option<&Bound<'_, PyAny>>,
    arg: &'static str,
) -> Result<Vec<(usize, u64, u64)>, ArgError> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    let List(v) = extract::<List<TargetRange>>(obj, arg)?;
    Ok(v.into_iter().map(|TargetRange(r)| r).collect())
}

/// `(offset, length)`: bytes of a file.
pub(crate) struct ByteRange(pub (u64, u64));

impl Plural for ByteRange {
    const PLURAL: &'static str = "(offset, length) tuples";
}

impl<'a, 'py> FromPyObject<'a, 'py> for ByteRange {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<ByteRange, ArgError> {
        let (o, l): (Bound<'py, PyAny>, Bound<'py, PyAny>) = obj
            .extract()
            .map_err(|_| ArgError::must_be("an (offset, length) tuple", &obj))?;
        Ok(ByteRange((
            o.extract::<Count>().map_err(|e| e.field("offset"))?.0,
            l.extract::<Count>().map_err(|e| e.field("length"))?.0,
        )))
    }
}

/// One key of a DCP output: `(key, path, kind, dtype, shape, totals)`.
pub(crate) struct LeafArg(pub Leaf);

impl Plural for LeafArg {
    const PLURAL: &'static str = "tuples";
}

impl<'a, 'py> FromPyObject<'a, 'py> for LeafArg {
    type Error = ArgError;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<LeafArg, ArgError> {
        let obj = obj.to_owned();
        let bad = || ArgError::must_be("(key, path, kind, dtype, shape, totals)", &obj);
        let t = tuple_of(&obj, 6, bad)?;
        let key: String = t[0].extract().map_err(|_| bad())?;
        let path_items: Vec<Bound<'py, PyAny>> = t[1].extract().map_err(|_| bad())?;
        let mut path = Vec::with_capacity(path_items.len());
        for x in &path_items {
            if x.is_instance_of::<PyString>() {
                path.push(PathItem::Str(x.extract().map_err(|_| bad())?));
            } else if x.is_instance_of::<PyInt>() {
                path.push(PathItem::Int(x.extract().map_err(|_| bad())?));
            } else {
                return Err(ArgError::new(format!(
                    " path items must be str or int, got {}",
                    show(x)
                )));
            }
        }
        let kind = match t[2].extract::<u8>().map_err(|_| bad())? {
            0 => LeafKind::Sharded,
            1 => LeafKind::Whole,
            2 => LeafKind::Bytes,
            k => return Err(ArgError::new(format!(" kind must be 0, 1 or 2, got {k}"))),
        };
        let dtype: String = t[3].extract().map_err(|_| bad())?;
        let shape = counts(&t[4]).map_err(|e| e.field("shape"))?;
        let totals: [u64; 3] = counts(&t[5])
            .map_err(|e| e.field("totals"))?
            .try_into()
            .map_err(|_| ArgError::new(" totals must be three ints".into()))?;
        Ok(LeafArg(Leaf {
            key,
            path,
            kind,
            dtype,
            shape,
            totals,
        }))
    }
}

// ---------------------------------------------------------------- sources and targets, borrowed

fn path_arg(obj: &Bound<'_, PyAny>) -> Result<PathBuf, ArgError> {
    if obj.is_instance_of::<PyBytes>() {
        return Err(ArgError::new(" must be a path (str), got bytes".into()));
    }
    obj.extract::<PathBuf>()
        .map_err(|_| ArgError::must_be("a path (str)", obj))
}

/// A path argument.
pub(crate) fn path(obj: &Bound<'_, PyAny>, arg: &'static str) -> Result<PathBuf, ArgError> {
    path_arg(obj).map_err(|e| e.named(arg))
}

/// One source named by a path (str) or an `S3Object`.
pub(crate) fn source(
    obj: &Bound<'_, PyAny>,
    arg: &'static str,
) -> Result<Source<'static>, ArgError> {
    if let Ok(o) = obj.cast::<S3Object>() {
        return Ok(Source::Remote(o.get().inner.clone()));
    }
    path(obj, arg).map(Source::Path)
}

/// `x` as a C-contiguous buffer of bytes (a memoryview of a tensor's storage),
/// or `None` when it exports no such buffer.
pub(crate) fn byte_buffer(x: &Bound<'_, PyAny>) -> Result<Option<PyBuffer<u8>>, ArgError> {
    let Ok(buf) = PyBuffer::<u8>::get(x) else {
        return Ok(None);
    };
    if !buf.is_c_contiguous() {
        return Err(ArgError::new(": the buffer is not C-contiguous".into()));
    }
    Ok(Some(buf))
}

/// The bytes a held buffer exposes.
pub(crate) fn buffer_bytes(buf: &PyBuffer<u8>) -> &[u8] {
    let len = buf.len_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: the buffer is C-contiguous, `len` bytes long and stays exported
    // (its memory valid) while `buf` lives. The caller promises not to change
    // it during the call (the runtime hands over snapshot copies).
    unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, len) }
}

/// A list argument's items, as they are.
fn items<'py>(
    obj: &Bound<'py, PyAny>,
    arg: &'static str,
    of: &str,
) -> Result<Vec<Bound<'py, PyAny>>, ArgError> {
    obj.extract()
        .map_err(|_| ArgError::must_be(&format!("a list of {of}"), obj).named(arg))
}

/// A job's sources (and targets): the Python objects, and the buffers among
/// them held for the whole call so the executor can use them without the GIL.
pub(crate) struct Held<'py> {
    items: Vec<Bound<'py, PyAny>>,
    buffers: Vec<Option<PyBuffer<u8>>>,
}

impl<'py> Held<'py> {
    /// Sources: paths, `S3Object`s, `bytes`, or other buffers of bytes.
    pub(crate) fn sources(obj: &Bound<'py, PyAny>) -> Result<Held<'py>, ArgError> {
        const FORM: &str = "a path (str), bytes or a buffer of unsigned bytes";
        let items = items(obj, "sources", "paths or bytes")?;
        let buffers = items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                if x.is_instance_of::<PyBytes>()
                    || x.is_instance_of::<S3Object>()
                    || x.extract::<PathBuf>().is_ok()
                {
                    return Ok(None);
                }
                let at = |e: ArgError| e.at(i).named("sources");
                let buf = byte_buffer(x).map_err(at)?;
                buf.map(Some).ok_or_else(|| at(ArgError::must_be(FORM, x)))
            })
            .collect::<Result<_, _>>()?;
        Ok(Held { items, buffers })
    }

    /// Targets: paths, `S3Upload`s, or writable buffers of bytes.
    pub(crate) fn targets(obj: &Bound<'py, PyAny>) -> Result<Held<'py>, ArgError> {
        const FORM: &str = "a path (str) or a writable buffer of unsigned bytes";
        let items = items(obj, "targets", "paths or writable buffers")?;
        let buffers = items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                if x.is_instance_of::<PyBytes>()
                    || x.is_instance_of::<S3Upload>()
                    || x.extract::<PathBuf>().is_ok()
                {
                    return Ok(None);
                }
                let at = |e: ArgError| e.at(i).named("targets");
                let buf = byte_buffer(x)
                    .map_err(at)?
                    .ok_or_else(|| at(ArgError::must_be(FORM, x)))?;
                if buf.readonly() {
                    return Err(at(ArgError::new(": the buffer is read-only".into())));
                }
                Ok(Some(buf))
            })
            .collect::<Result<_, _>>()?;
        Ok(Held { items, buffers })
    }

    /// The sources as the executor reads them: `bytes` and other byte buffers
    /// where they are (no copy), `S3Object`s by range, anything else a path.
    pub(crate) fn as_sources(&self) -> Result<Vec<Source<'_>>, ArgError> {
        self.items
            .iter()
            .zip(&self.buffers)
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
                        ArgError::must_be("a path (str), bytes or a buffer of unsigned bytes", x)
                            .at(i)
                            .named("sources")
                    }),
                }
            })
            .collect()
    }

    /// The targets as the executor writes them.
    pub(crate) fn as_targets(&self) -> Result<Vec<Target<'_>>, ArgError> {
        self.items
            .iter()
            .zip(&self.buffers)
            .enumerate()
            .map(|(i, (x, buf))| match buf {
                Some(buf) => {
                    // SAFETY: the buffer is C-contiguous, writable and `len_bytes()` long, and
                    // stays exported (its memory valid) while `self` lives, for the whole call.
                    // The caller promises not to touch it during the call (the runtime restores
                    // into tensors nothing else uses until the restore returns).
                    Ok(Target::Memory(unsafe {
                        Memory::from_raw(buf.buf_ptr() as *mut u8, buf.len_bytes())
                    }))
                }
                None => match x.cast::<S3Upload>() {
                    Ok(up) => Ok(Target::Remote(std::sync::Arc::new(up.get().inner.clone()))),
                    Err(_) => path_arg(x)
                        .map(Target::Path)
                        .map_err(|e| e.at(i).named("targets")),
                },
            })
            .collect()
    }
}
