//! The S3 client of `ravex_convert._core` (`S3Bucket`, `S3Object`,
//! `S3Upload`; `S3Error` is raised from `errors.rs`): a thin pyo3 layer over
//! [`crate::remote`]. Every call that waits on the network releases the GIL.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::CoreError;
use crate::remote::{Bucket, Config, Meta, Mode, RemoteObject, Upload};

fn meta_tuple(m: Meta) -> (String, u64, String) {
    (m.key, m.size, m.etag)
}

/// A bucket: one client and connection pool.
#[pyclass(module = "ravex_convert._core", frozen)]
pub struct S3Bucket {
    pub(crate) inner: Arc<Bucket>,
}

#[pymethods]
impl S3Bucket {
    #[new]
    #[pyo3(signature = (bucket, *, endpoint=None, region=None, access_key=None, secret_key=None, session_token=None,
        virtual_hosted=false, part_size=8388608, max_in_flight=8, read_ahead=16, max_retries=10, retry_timeout_s=180.0,
        connect_timeout_s=5.0, request_timeout_s=30.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        bucket: String,
        endpoint: Option<String>,
        region: Option<String>,
        access_key: Option<String>,
        secret_key: Option<String>,
        session_token: Option<String>,
        virtual_hosted: bool,
        part_size: u64,
        max_in_flight: usize,
        read_ahead: usize,
        max_retries: usize,
        retry_timeout_s: f64,
        connect_timeout_s: f64,
        request_timeout_s: f64,
    ) -> Result<Self, CoreError> {
        let secs = |s: f64, what: &str| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                CoreError::Value(format!("{what} must be a number of seconds >= 0, got {s}"))
            })
        };
        let config = Config {
            bucket,
            endpoint,
            region,
            access_key,
            secret_key,
            session_token,
            virtual_hosted,
            part_size,
            max_in_flight,
            read_ahead,
            max_retries,
            retry_timeout: secs(retry_timeout_s, "retry_timeout_s")?,
            connect_timeout: secs(connect_timeout_s, "connect_timeout_s")?,
            request_timeout: secs(request_timeout_s, "request_timeout_s")?,
        };
        let inner = py.detach(|| Bucket::new(config))?;
        Ok(S3Bucket { inner })
    }

    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    #[getter]
    fn part_size(&self) -> u64 {
        self.inner.part_size()
    }

    /// `(key, size, etag)`, or None where no object has the key.
    fn head(
        &self,
        py: Python<'_>,
        key: String,
    ) -> Result<Option<(String, u64, String)>, CoreError> {
        py.detach(|| self.inner.head(&key))
            .map(|m| m.map(meta_tuple))
            .map_err(CoreError::from)
    }

    /// `(size, etag, last_modified)` (Unix seconds, the server's clock), or None where no
    /// object has the key.
    fn stat(
        &self,
        py: Python<'_>,
        key: String,
    ) -> Result<Option<(u64, String, f64)>, CoreError> {
        py.detach(|| self.inner.head(&key))
            .map(|m| m.map(|m| (m.size, m.etag, m.modified_ms as f64 / 1000.0)))
            .map_err(CoreError::from)
    }

    /// `(bytes, etag)` of a whole object.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: String,
    ) -> Result<(Bound<'py, PyBytes>, String), CoreError> {
        let (data, etag) = py.detach(|| self.inner.get(&key))?;
        Ok((PyBytes::new(py, &data), etag))
    }

    fn get_range<'py>(
        &self,
        py: Python<'py>,
        key: String,
        offset: u64,
        length: u64,
    ) -> Result<Bound<'py, PyBytes>, CoreError> {
        let data = py.detach(|| self.inner.get_range(&key, offset, length))?;
        Ok(PyBytes::new(py, &data))
    }

    /// Every object under `prefix`: `(key, size, etag)`, sorted by key.
    fn list(
        &self,
        py: Python<'_>,
        prefix: String,
    ) -> Result<Vec<(String, u64, String)>, CoreError> {
        let mut all = py.detach(|| self.inner.list(&prefix))?;
        all.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(all.into_iter().map(meta_tuple).collect())
    }

    /// `(objects, prefixes)` directly under `prefix`.
    #[allow(clippy::type_complexity)]
    fn list_dir(
        &self,
        py: Python<'_>,
        prefix: String,
    ) -> Result<(Vec<(String, u64, String)>, Vec<String>), CoreError> {
        let (objects, prefixes) = py.detach(|| self.inner.list_dir(&prefix))?;
        Ok((objects.into_iter().map(meta_tuple).collect(), prefixes))
    }

    /// Writes a whole object; `mode` is "overwrite", "create" (only where
    /// absent) or "replace" (only while its ETag is `etag`). Returns the new ETag.
    #[pyo3(signature = (key, data, mode="overwrite", etag=None))]
    fn put(
        &self,
        py: Python<'_>,
        key: String,
        data: Vec<u8>,
        mode: &str,
        etag: Option<String>,
    ) -> Result<String, CoreError> {
        let mode = match (mode, etag) {
            ("overwrite", None) => Mode::Overwrite,
            ("create", None) => Mode::Create,
            ("replace", Some(e)) => Mode::Replace(e),
            (m, e) => {
                return Err(CoreError::Value(format!(
                "mode {m:?} with etag {:?}: use 'overwrite', 'create', or 'replace' with an etag",
                e.is_some()
            )))
            }
        };
        py.detach(|| self.inner.put(&key, Bytes::from(data), mode))
            .map_err(CoreError::from)
    }

    fn delete(&self, py: Python<'_>, key: String) -> Result<(), CoreError> {
        py.detach(|| self.inner.delete(&key))
            .map_err(CoreError::from)
    }

    /// Deletes `key` only while its ETag is `etag`; False where it is gone already.
    fn delete_if(&self, py: Python<'_>, key: String, etag: String) -> Result<bool, CoreError> {
        py.detach(|| self.inner.delete_if(&key, &etag))
            .map_err(CoreError::from)
    }

    /// Unfinished multipart uploads under `prefix`: `(key, upload_id, initiated)`.
    fn unfinished(
        &self,
        py: Python<'_>,
        prefix: String,
    ) -> Result<Vec<(String, String, String)>, CoreError> {
        py.detach(|| self.inner.unfinished(&prefix))
            .map_err(CoreError::from)
    }

    fn abort_upload(
        &self,
        py: Python<'_>,
        key: String,
        upload_id: String,
    ) -> Result<(), CoreError> {
        py.detach(|| self.inner.abort_upload(&key, &upload_id))
            .map_err(CoreError::from)
    }

    /// A source for the executor: object `key`, `size` bytes long (as listed).
    fn object(&self, key: String, size: u64) -> S3Object {
        S3Object {
            inner: Arc::new(RemoteObject::new(self.inner.clone(), key, size)),
        }
    }

    /// A new object of `size` bytes, written by range (`pwrite`, or as an
    /// executor target) and uploaded in parts as they fill.
    fn upload(&self, py: Python<'_>, key: String, size: u64) -> Result<S3Upload, CoreError> {
        let up = py.detach(|| Upload::new(self.inner.clone(), &key, size))?;
        Ok(S3Upload { inner: up })
    }
}

/// An object the executor reads by range.
#[pyclass(module = "ravex_convert._core", frozen)]
pub struct S3Object {
    pub(crate) inner: Arc<RemoteObject>,
}

#[pymethods]
impl S3Object {
    fn __len__(&self) -> usize {
        crate::files::ReadAt::size(&*self.inner) as usize
    }

    fn __repr__(&self) -> String {
        format!("S3Object({})", crate::files::ReadAt::name(&*self.inner))
    }

    /// `length` bytes from `offset` (through the bucket's block cache).
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: u64,
    ) -> Result<Bound<'py, PyBytes>, CoreError> {
        let mut buf = vec![0u8; length as usize];
        py.detach(|| crate::files::ReadAt::read_exact_at(&*self.inner, &mut buf, offset))?;
        Ok(PyBytes::new(py, &buf))
    }
}

/// A new object being uploaded.
#[pyclass(module = "ravex_convert._core", frozen)]
pub struct S3Upload {
    pub(crate) inner: Upload,
}

#[pymethods]
impl S3Upload {
    #[getter]
    fn key(&self) -> String {
        self.inner.key().to_string()
    }

    #[getter]
    fn upload_id(&self) -> Option<String> {
        self.inner.upload_id()
    }

    #[getter]
    fn part_size(&self) -> u64 {
        self.inner.plan().part_size
    }

    #[getter]
    fn parts(&self) -> usize {
        self.inner.plan().parts()
    }

    fn __len__(&self) -> usize {
        self.inner.plan().size as usize
    }

    fn pwrite(&self, py: Python<'_>, data: Vec<u8>, offset: u64) -> Result<(), CoreError> {
        py.detach(|| self.inner.write(&data, offset))
            .map_err(CoreError::from)
    }

    /// Completes the object and returns its ETag (aborts it on failure).
    fn close(&self, py: Python<'_>) -> Result<String, CoreError> {
        py.detach(|| self.inner.close()).map_err(CoreError::from)
    }

    /// Discards the upload; `cleanup=False` leaves it for the next writer to abort (a server that
    /// stopped answering would only make this wait out its timeouts).
    #[pyo3(signature = (cleanup=true))]
    fn abort(&self, py: Python<'_>, cleanup: bool) {
        py.detach(|| self.inner.abort_with(cleanup))
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<S3Bucket>()?;
    m.add_class::<S3Object>()?;
    m.add_class::<S3Upload>()?;
    Ok(())
}
