//! Objects in an S3-compatible bucket (AWS S3, Cloudflare R2, MinIO,
//! SeaweedFS) through the `object_store` crate: signing, retries and HTTP are
//! its; nothing here builds a request by hand.
//!
//! - [`RemoteObject`] is a source the executor reads by range: each piece's
//!   bytes come in one ranged GET, and reads smaller than a block go through a
//!   small bucket-wide cache of 8 MiB blocks, so that a run of small tensors
//!   costs one GET, not one each.
//! - [`Upload`] is a target the executor (and Python) writes by range: bytes
//!   fill fixed-size parts ([`PartPlan`]); a full part is uploaded at once in
//!   the background, with at most `max_in_flight` parts in flight per bucket,
//!   so memory stays at parts in flight × part size (plus parts being
//!   filled), not the object's size. An object of one part is one PUT at
//!   `close`. Nothing is spooled to local disk.
//! - Conditional puts (`If-None-Match: *`, `If-Match`), conditional deletes
//!   and listing unfinished multipart uploads (which `object_store` lacks)
//!   use URLs that `object_store` presigns, sent with `reqwest`.
//!
//! Every message names the object by its `s3://bucket/key` URL; credentials
//! are scrubbed from any text a server sends back.
//!
//! One job per file: `client.rs` the bucket ([`Bucket`]: the client, requests,
//! conditional puts and deletes, listings), `reader.rs` the ranged reader
//! ([`RemoteObject`] and the block cache), `upload.rs` the multipart upload
//! ([`Upload`]); here what they share (the error, the async runtime).

use std::fmt;
use std::io;
use std::sync::{Arc, Mutex, OnceLock};

pub use crate::s3text::Kind;

mod client;
mod readahead;
mod reader;
mod upload;

pub use client::{Bucket, Config, Meta, Mode};
pub use reader::RemoteObject;
pub use upload::Upload;

#[derive(Debug, Clone)]
pub struct RemoteError {
    pub kind: Kind,
    /// The `s3://` URL of the object or prefix.
    pub url: String,
    /// What happened, credentials scrubbed, one line.
    pub detail: String,
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.url, self.detail)
    }
}

impl std::error::Error for RemoteError {}

impl From<RemoteError> for io::Error {
    fn from(e: RemoteError) -> io::Error {
        let kind = match e.kind {
            Kind::NotFound | Kind::NoBucket => io::ErrorKind::NotFound,
            Kind::Denied => io::ErrorKind::PermissionDenied,
            Kind::Unreachable => io::ErrorKind::ConnectionRefused,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

pub(crate) type Result<T> = std::result::Result<T, RemoteError>;

/// One tokio runtime per process; a forked child builds its own (the
/// parent's threads are not in it).
pub(crate) fn runtime() -> Arc<tokio::runtime::Runtime> {
    static RT: Mutex<Option<(u32, Arc<tokio::runtime::Runtime>)>> = Mutex::new(None);
    let mut rt = RT.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    match &*rt {
        Some((p, r)) if *p == pid => r.clone(),
        _ => {
            let r = Arc::new(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(4)
                    .thread_name("ravex-s3")
                    .enable_all()
                    .build()
                    .expect("a tokio runtime"),
            );
            if let Some((_, old)) = rt.take() {
                // a parent's runtime: its threads do not exist here, so dropping it could hang
                std::mem::forget(old);
            }
            *rt = Some((pid, r.clone()));
            r
        }
    }
}

pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

pub(crate) fn install_crypto() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        #[allow(deprecated)]
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod readahead_tests;
