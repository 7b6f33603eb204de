//! Every error `_core` raises: one enum ([`CoreError`]) for what goes wrong
//! in any call, and the one place it becomes a Python exception
//! (`From<CoreError> for PyErr`). Malformed arguments raise `ValueError`;
//! failing file operations raise `OSError` (its subclass by errno, with
//! `filename`); a failed request to a bucket raises [`S3Error`] (an
//! `OSError`); source bytes that do not match their metadata raise
//! [`CorruptSourceError`] (a `ValueError`); a failed invariant of Ravex's own
//! raises [`InternalError`] (a `RuntimeError`).

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::args::ArgError;
use crate::dcp::LayoutError;
use crate::files::{Error, Side};
use crate::plan::PlanError;
use crate::remote::{Kind, RemoteError};

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
pyo3::create_exception!(
    ravex_convert._core,
    S3Error,
    PyOSError,
    "A request to an S3-compatible store failed. `kind` is one of 'not_found', 'precondition', 'denied', 'no_bucket', 'unreachable', 'invalid', 'other'; `url` is the s3:// URL of the object or prefix. The message never holds credentials."
);

/// Whatever a call of `_core` fails with.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CoreError {
    /// A malformed argument, named by where it sits.
    #[error(transparent)]
    Arg(#[from] ArgError),
    /// A well-formed argument the call cannot take (a rank outside the
    /// layout, a put mode without its ETag).
    #[error("{0}")]
    Value(String),
    /// Moving, hashing, compressing or comparing chunk bytes failed.
    #[error(transparent)]
    Core(#[from] Error),
    /// No plan fills the targets from the sources given.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A DCP output that cannot be laid out.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A request to a bucket failed.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// Reading an object in a bucket by range failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Raised by Python itself (handing a result over), passed on as it is.
    #[error(transparent)]
    Python(#[from] PyErr),
}

impl From<ArgError> for PyErr {
    fn from(e: ArgError) -> PyErr {
        CoreError::Arg(e).into()
    }
}

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        match e {
            CoreError::Arg(_) | CoreError::Value(_) | CoreError::Plan(_) | CoreError::Layout(_) => {
                PyValueError::new_err(e.to_string())
            }
            CoreError::Core(e) => core_err(e),
            CoreError::Remote(e) => s3_err(&e),
            CoreError::Io(e) => PyOSError::new_err(e.to_string()),
            CoreError::Python(e) => e,
        }
    }
}

/// A core error as the Python exception that means the same: an OS error as
/// `OSError` (its subclass by errno, with `filename`), or as [`S3Error`] where
/// a bucket's request failed; bad source data as [`CorruptSourceError`];
/// anything else, which only a bug in Ravex produces, as [`InternalError`].
fn core_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::Io { source, .. } if inner_remote(source).is_some() => {
            s3_err(inner_remote(source).expect("checked"))
        }
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

fn kind_name(k: &Kind) -> &'static str {
    match k {
        Kind::NotFound => "not_found",
        Kind::Precondition => "precondition",
        Kind::Denied => "denied",
        Kind::NoBucket => "no_bucket",
        Kind::Unreachable => "unreachable",
        Kind::Invalid => "invalid",
        Kind::Other => "other",
    }
}

fn s3_err(e: &RemoteError) -> PyErr {
    Python::attach(|py| {
        let err = PyErr::new::<S3Error, _>(e.to_string());
        let value = err.value(py);
        let _ = value.setattr("kind", kind_name(&e.kind));
        let _ = value.setattr("url", e.url.clone());
        err
    })
}

/// The remote error inside an executor's I/O error, if it holds one.
fn inner_remote(e: &std::io::Error) -> Option<&RemoteError> {
    e.get_ref().and_then(|x| x.downcast_ref::<RemoteError>())
}

/// The exception classes, with class-level defaults for their attributes
/// (so every instance, and the stub, has them).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    for (name, ty) in [
        ("CorruptSourceError", py.get_type::<CorruptSourceError>()),
        ("InternalError", py.get_type::<InternalError>()),
    ] {
        ty.setattr("tensor", py.None())?;
        ty.setattr("path", py.None())?;
        m.add(name, ty)?;
    }
    let ty = py.get_type::<S3Error>();
    ty.setattr("kind", "other")?;
    ty.setattr("url", py.None())?;
    m.add("S3Error", ty)?;
    Ok(())
}
