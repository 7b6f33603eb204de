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

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::TryStreamExt;
use http::header::{HeaderValue, IF_MATCH};
use http::Method;
use memmap2::MmapMut;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as Key;
use object_store::signer::{SignedUrlOptions, Signer};
use object_store::{
    ClientOptions, MultipartId, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig, UpdateVersion,
};

use crate::files::{ReadAt, WriteAt};
use crate::parts::PartPlan;
pub use crate::s3text::Kind;
use crate::s3text::{answer, classify, element, elements, last_reason, scrub, short, xml_text};

/// Reads smaller than this go through the block cache.
const BLOCK: u64 = 8 << 20;
/// Blocks the cache of one bucket holds.
const CACHED_BLOCKS: usize = 8;

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

type Result<T> = std::result::Result<T, RemoteError>;

/// One tokio runtime per process; a forked child builds its own (the
/// parent's threads are not in it).
fn runtime() -> Arc<tokio::runtime::Runtime> {
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

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

fn install_crypto() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        #[allow(deprecated)]
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// How to reach a bucket. Unset fields come from the `AWS_*` environment, as
/// the AWS tools read it (web identity, container and instance credentials
/// included).
#[derive(Clone, Default)]
pub struct Config {
    pub bucket: String,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key: Option<String>,
    pub secret_key: Option<String>,
    pub session_token: Option<String>,
    pub virtual_hosted: bool,
    pub part_size: u64,
    pub max_in_flight: usize,
    pub max_retries: usize,
    pub retry_timeout: Duration,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // never the credentials
        f.debug_struct("Config")
            .field("bucket", &self.bucket)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// A bucket: one client, one connection pool, one block cache and one limit
/// on parts in flight, shared by every object of it.
pub struct Bucket {
    config: Config,
    client: Mutex<Option<(u32, Arc<AmazonS3>)>>,
    http: Mutex<Option<(u32, reqwest::Client)>>,
    /// Strings never to show: the credentials in use.
    secrets: Vec<String>,
    slots: Mutex<usize>,
    slot_free: Condvar,
    cache: Mutex<VecDeque<(u64, u64, Bytes)>>,
    next_id: AtomicU64,
}

impl fmt::Debug for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bucket({})", self.config.bucket)
    }
}

/// An object's size and ETag.
#[derive(Debug, Clone)]
pub struct Meta {
    pub key: String,
    pub size: u64,
    pub etag: String,
}

/// How a put may replace what is there.
#[derive(Debug, Clone)]
pub enum Mode {
    Overwrite,
    /// Only where no object has the key (`If-None-Match: *`).
    Create,
    /// Only where the object's ETag is this one (`If-Match`).
    Replace(String),
}

impl Bucket {
    pub fn new(config: Config) -> Result<Arc<Bucket>> {
        install_crypto();
        let mut secrets: Vec<String> = [
            &config.access_key,
            &config.secret_key,
            &config.session_token,
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        for var in [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "RAVEX_S3_ACCESS_KEY",
            "RAVEX_S3_SECRET_KEY",
        ] {
            if let Ok(v) = std::env::var(var) {
                secrets.push(v);
            }
        }
        secrets.retain(|s| s.len() >= 4);
        let bucket = Arc::new(Bucket {
            config,
            client: Mutex::new(None),
            http: Mutex::new(None),
            secrets,
            slots: Mutex::new(0),
            slot_free: Condvar::new(),
            cache: Mutex::new(VecDeque::new()),
            next_id: AtomicU64::new(0),
        });
        bucket.store()?; // refuse a bad configuration now, not at the first byte
        Ok(bucket)
    }

    pub fn name(&self) -> &str {
        &self.config.bucket
    }

    pub fn part_size(&self) -> u64 {
        self.config.part_size
    }

    pub fn url(&self, key: &str) -> String {
        format!("s3://{}/{}", self.config.bucket, key)
    }

    fn build(&self) -> Result<AmazonS3> {
        let c = &self.config;
        let mut b = AmazonS3Builder::from_env().with_bucket_name(&c.bucket);
        let mut options = ClientOptions::new()
            .with_connect_timeout(c.connect_timeout)
            .with_timeout(c.request_timeout);
        if let Some(e) = &c.endpoint {
            if e.starts_with("http://") {
                // an http:// endpoint given explicitly is used as given
                options = options.with_allow_http(true);
            }
            b = b.with_endpoint(e);
        }
        if std::env::var("AWS_ENDPOINT_URL").is_ok_and(|e| e.starts_with("http://")) {
            options = options.with_allow_http(true);
        }
        if let Some(r) = &c.region {
            b = b.with_region(r);
        }
        if let Some(k) = &c.access_key {
            b = b.with_access_key_id(k);
        }
        if let Some(k) = &c.secret_key {
            b = b.with_secret_access_key(k);
        }
        if let Some(t) = &c.session_token {
            b = b.with_token(t);
        }
        let retry = RetryConfig {
            max_retries: c.max_retries,
            retry_timeout: c.retry_timeout,
            ..RetryConfig::default()
        };
        b.with_virtual_hosted_style_request(c.virtual_hosted)
            .with_client_options(options)
            .with_retry(retry)
            .build()
            .map_err(|e| self.error(&self.url(""), e))
    }

    /// The client of this process (a forked child builds its own: the
    /// parent's connections belong to the parent's runtime).
    fn store(&self) -> Result<Arc<AmazonS3>> {
        let mut client = self.client.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        if let Some((p, s)) = &*client {
            if *p == pid {
                return Ok(s.clone());
            }
        }
        let s = Arc::new(self.build()?);
        *client = Some((pid, s.clone()));
        Ok(s)
    }

    fn http(&self) -> Result<reqwest::Client> {
        let mut http = self.http.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        if let Some((p, c)) = &*http {
            if *p == pid {
                return Ok(c.clone());
            }
        }
        let rt = runtime();
        let _inside = rt.enter();
        let c = reqwest::Client::builder()
            .connect_timeout(self.config.connect_timeout)
            .timeout(self.config.request_timeout)
            .build()
            .map_err(|e| RemoteError {
                kind: Kind::Other,
                url: self.url(""),
                detail: format!("cannot make an HTTP client: {e}"),
            })?;
        *http = Some((pid, c.clone()));
        Ok(c)
    }

    fn scrub(&self, text: &str) -> String {
        scrub(text, &self.secrets)
    }

    fn error(&self, url: &str, e: object_store::Error) -> RemoteError {
        let chain = self.scrub(&error_chain(&e));
        let kind = match &e {
            object_store::Error::NotFound { .. } => {
                if chain.contains("NoSuchBucket") {
                    Kind::NoBucket
                } else {
                    Kind::NotFound
                }
            }
            object_store::Error::Precondition { .. }
            | object_store::Error::AlreadyExists { .. } => Kind::Precondition,
            object_store::Error::InvalidPath { .. } => Kind::Invalid,
            _ => classify(&chain),
        };
        let detail = match kind {
            Kind::NotFound => "no such object".to_string(),
            Kind::NoBucket => format!("the bucket {} does not exist", self.config.bucket),
            Kind::Precondition => {
                "the object is not as this writer last saw it (a conditional request lost)"
                    .to_string()
            }
            Kind::Denied => format!(
                "access denied ({})",
                element(&chain, "Code").unwrap_or("403 Forbidden")
            ),
            Kind::Unreachable => format!("cannot reach the server ({})", last_reason(&chain)),
            _ => format!("the server answered {}", answer(&chain)),
        };
        RemoteError {
            kind,
            url: url.to_string(),
            detail,
        }
    }

    fn key(&self, key: &str) -> Result<Key> {
        Key::parse(key).map_err(|e| RemoteError {
            kind: Kind::Invalid,
            url: self.url(key),
            detail: format!("not a key Ravex writes or reads: {e}"),
        })
    }

    pub fn head(&self, key: &str) -> Result<Option<Meta>> {
        let store = self.store()?;
        let k = self.key(key)?;
        match block_on(store.head(&k)) {
            Ok(m) => Ok(Some(meta(m))),
            Err(e) => {
                let err = self.error(&self.url(key), e);
                if err.kind == Kind::NotFound {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// A whole object and its ETag.
    pub fn get(&self, key: &str) -> Result<(Bytes, String)> {
        let store = self.store()?;
        let k = self.key(key)?;
        let url = self.url(key);
        block_on(async {
            let r = store.get(&k).await?;
            let etag = r.meta.e_tag.clone().unwrap_or_default();
            Ok((r.bytes().await?, etag))
        })
        .map_err(|e| self.error(&url, e))
    }

    pub fn get_range(&self, key: &str, offset: u64, len: u64) -> Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let store = self.store()?;
        let k = self.key(key)?;
        let got = block_on(store.get_range(&k, offset..offset + len))
            .map_err(|e| self.error(&self.url(key), e))?;
        if got.len() as u64 != len {
            return Err(RemoteError {
                kind: Kind::Other,
                url: self.url(key),
                detail: format!(
                    "asked for bytes {offset}..{}, got {} bytes (the object changed or was truncated)",
                    offset + len,
                    got.len()
                ),
            });
        }
        Ok(got)
    }

    /// Objects under `prefix` ("" for the whole bucket), every level.
    pub fn list(&self, prefix: &str) -> Result<Vec<Meta>> {
        let store = self.store()?;
        let p = if prefix.is_empty() {
            None
        } else {
            Some(self.key(prefix)?)
        };
        block_on(store.list(p.as_ref()).try_collect::<Vec<_>>())
            .map(|v| v.into_iter().map(meta).collect())
            .map_err(|e| self.error(&self.url(prefix), e))
    }

    /// The objects directly under `prefix`, and the "directories" there.
    pub fn list_dir(&self, prefix: &str) -> Result<(Vec<Meta>, Vec<String>)> {
        let store = self.store()?;
        let p = if prefix.is_empty() {
            None
        } else {
            Some(self.key(prefix)?)
        };
        block_on(store.list_with_delimiter(p.as_ref()))
            .map(|r| {
                (
                    r.objects.into_iter().map(meta).collect(),
                    r.common_prefixes
                        .into_iter()
                        .map(|p| p.to_string())
                        .collect(),
                )
            })
            .map_err(|e| self.error(&self.url(prefix), e))
    }

    /// Writes a whole object; returns its ETag.
    pub fn put(&self, key: &str, data: Bytes, mode: Mode) -> Result<String> {
        let store = self.store()?;
        let k = self.key(key)?;
        let mode = match mode {
            Mode::Overwrite => PutMode::Overwrite,
            Mode::Create => PutMode::Create,
            Mode::Replace(etag) => PutMode::Update(UpdateVersion {
                e_tag: Some(etag),
                version: None,
            }),
        };
        let opts = PutOptions {
            mode,
            ..PutOptions::default()
        };
        block_on(store.put_opts(&k, PutPayload::from(data), opts))
            .map(|r| r.e_tag.unwrap_or_default())
            .map_err(|e| self.error(&self.url(key), e))
    }

    pub fn delete(&self, key: &str) -> Result<()> {
        let store = self.store()?;
        let k = self.key(key)?;
        block_on(ObjectStoreExt::delete(&*store, &k)).map_err(|e| self.error(&self.url(key), e))
    }

    /// Deletes `key` only while its ETag is `etag` (`DELETE` with `If-Match`):
    /// Ok(false) where it is gone already.
    pub fn delete_if(&self, key: &str, etag: &str) -> Result<bool> {
        let store = self.store()?;
        let k = self.key(key)?;
        let url = self.url(key);
        let value = HeaderValue::from_str(etag).map_err(|_| RemoteError {
            kind: Kind::Invalid,
            url: url.clone(),
            detail: "the ETag is not a header value".into(),
        })?;
        let http = self.http()?;
        let opts = SignedUrlOptions::default().with_signed_header(IF_MATCH, value.clone());
        let signed =
            block_on(store.signed_url_opts(Method::DELETE, &k, Duration::from_secs(300), &opts))
                .map_err(|e| self.error(&url, e))?;
        let (status, body) = block_on(async move {
            let r = http.delete(signed).header(IF_MATCH, value).send().await?;
            let status = r.status().as_u16();
            Ok::<_, reqwest::Error>((status, r.text().await.unwrap_or_default()))
        })
        .map_err(|e| self.http_error(&url, &e))?;
        match status {
            200..=299 => Ok(true),
            404 => Ok(false),
            412 => Err(self.error(
                &url,
                object_store::Error::Precondition {
                    path: key.to_string(),
                    source: "412".into(),
                },
            )),
            status => Err(RemoteError {
                kind: classify(&format!("{status} {body}")),
                url,
                detail: format!("DELETE answered {status}: {}", short(&self.scrub(&body))),
            }),
        }
    }

    /// Multipart uploads begun under `prefix` and neither completed nor
    /// aborted: `(key, upload id, initiated)` (S3's `ListMultipartUploads`).
    pub fn unfinished(&self, prefix: &str) -> Result<Vec<(String, String, String)>> {
        let store = self.store()?;
        let http = self.http()?;
        let url = self.url(prefix);
        let mut found = Vec::new();
        let (mut key_marker, mut id_marker) = (String::new(), String::new());
        loop {
            let mut query = vec![
                ("uploads".to_string(), String::new()),
                ("prefix".to_string(), prefix.to_string()),
            ];
            if !key_marker.is_empty() {
                query.push(("key-marker".into(), key_marker.clone()));
                query.push(("upload-id-marker".into(), id_marker.clone()));
            }
            let opts = SignedUrlOptions::default().with_query(query);
            let signed = block_on(store.signed_url_opts(
                Method::GET,
                &Key::default(),
                Duration::from_secs(300),
                &opts,
            ))
            .map_err(|e| self.error(&url, e))?;
            let http = http.clone();
            let (status, body) = block_on(async move {
                let r = http.get(signed).send().await?;
                let status = r.status().as_u16();
                Ok::<_, reqwest::Error>((status, r.text().await?))
            })
            .map_err(|e| self.http_error(&url, &e))?;
            if !(200..300).contains(&status) {
                return Err(RemoteError {
                    kind: classify(&format!("{status} {body}")),
                    url,
                    detail: format!(
                        "listing unfinished uploads answered {status}: {}",
                        short(&self.scrub(&body))
                    ),
                });
            }
            for upload in elements(&body, "Upload") {
                let key = element(upload, "Key").unwrap_or_default();
                let id = element(upload, "UploadId").unwrap_or_default();
                let initiated = element(upload, "Initiated").unwrap_or_default();
                if key.starts_with(prefix) && !id.is_empty() {
                    found.push((xml_text(key), xml_text(id), xml_text(initiated)));
                }
            }
            if element(&body, "IsTruncated") != Some("true") {
                break;
            }
            key_marker = element(&body, "NextKeyMarker")
                .map(xml_text)
                .unwrap_or_default();
            id_marker = element(&body, "NextUploadIdMarker")
                .map(xml_text)
                .unwrap_or_default();
            if key_marker.is_empty() {
                break;
            }
        }
        Ok(found)
    }

    pub fn abort_upload(&self, key: &str, id: &str) -> Result<()> {
        let store = self.store()?;
        let k = self.key(key)?;
        block_on(store.abort_multipart(&k, &id.to_string()))
            .map_err(|e| self.error(&self.url(key), e))
    }

    fn http_error(&self, url: &str, e: &reqwest::Error) -> RemoteError {
        let chain = self.scrub(&error_chain(e));
        let kind = if e.is_connect() || e.is_timeout() {
            Kind::Unreachable
        } else {
            classify(&chain)
        };
        RemoteError {
            kind,
            url: url.to_string(),
            detail: short(&chain),
        }
    }

    /// Blocks until fewer than `max_in_flight` parts of this bucket are in
    /// flight, then takes a slot.
    fn take_slot(&self) {
        let mut n = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= self.config.max_in_flight.max(1) {
            n = self.slot_free.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n += 1;
    }

    fn free_slot(&self) {
        let mut n = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        self.slot_free.notify_one();
    }

    /// Bytes `offset..offset + buf.len()` of object `id` (`key`), through the
    /// block cache where the read is small.
    fn read_cached(
        &self,
        id: u64,
        key: &str,
        size: u64,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<()> {
        let len = buf.len() as u64;
        if len >= BLOCK {
            let got = self.get_range(key, offset, len)?;
            buf.copy_from_slice(&got);
            return Ok(());
        }
        let mut done = 0u64;
        while done < len {
            let at = offset + done;
            let block = at / BLOCK;
            let start = block * BLOCK;
            let data = self.block(id, key, size, block, start)?;
            let from = (at - start) as usize;
            let n = ((data.len() - from) as u64).min(len - done) as usize;
            if n == 0 {
                return Err(RemoteError {
                    kind: Kind::Other,
                    url: self.url(key),
                    detail: format!("bytes from {at} are past the object's end"),
                });
            }
            buf[done as usize..done as usize + n].copy_from_slice(&data[from..from + n]);
            done += n as u64;
        }
        Ok(())
    }

    fn block(&self, id: u64, key: &str, size: u64, block: u64, start: u64) -> Result<Bytes> {
        {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((_, _, b)) = cache.iter().find(|(i, k, _)| *i == id && *k == block) {
                return Ok(b.clone());
            }
        }
        let data = self.get_range(key, start, BLOCK.min(size.saturating_sub(start)))?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.push_back((id, block, data.clone()));
        while cache.len() > CACHED_BLOCKS {
            cache.pop_front();
        }
        Ok(data)
    }

    /// Drops the cached blocks of an object.
    fn forget(&self, id: u64) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.retain(|(i, _, _)| *i != id);
    }
}

fn meta(m: object_store::ObjectMeta) -> Meta {
    Meta {
        key: m.location.to_string(),
        size: m.size,
        etag: m.e_tag.unwrap_or_default(),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
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

/// An object the executor reads by range.
#[derive(Debug)]
pub struct RemoteObject {
    bucket: Arc<Bucket>,
    key: String,
    size: u64,
    id: u64,
}

impl RemoteObject {
    /// `size`: what the caller was told (a listing, a HEAD); reads past it are refused.
    pub fn new(bucket: Arc<Bucket>, key: String, size: u64) -> RemoteObject {
        let id = bucket.next_id.fetch_add(1, Ordering::Relaxed);
        RemoteObject {
            bucket,
            key,
            size,
            id,
        }
    }
}

impl Drop for RemoteObject {
    fn drop(&mut self) {
        self.bucket.forget(self.id);
    }
}

impl ReadAt for RemoteObject {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > self.size)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: a read past the object's {} bytes",
                    self.name(),
                    self.size
                ),
            ));
        }
        self.bucket
            .read_cached(self.id, &self.key, self.size, buf, offset)
            .map_err(io::Error::from)
    }

    fn name(&self) -> String {
        self.bucket.url(&self.key)
    }
}

/// A part's bytes, in an anonymous map of their own that goes back to the system when the part
/// has gone up. (In `Vec`s, parts filled on copy threads and freed on upload threads stayed in
/// the allocator's arenas: 220-292 MiB at 8 parts of 8 MiB in flight, against 104 MiB of parts;
/// docs/benchmarks-s3.md.) Pages are zero until written, and only written pages take memory.
struct PartBuf {
    data: MmapMut,
    filled: u64,
}

fn part_buffer(len: u64, url: &str) -> Result<MmapMut> {
    MmapMut::map_anon(len.max(1) as usize).map_err(|e| RemoteError {
        kind: Kind::Other,
        url: url.to_string(),
        detail: format!("cannot map {len} bytes of memory for a part: {e}"),
    })
}

/// The first `len` bytes of a part's buffer, as the payload of a request (no copy).
fn payload(data: MmapMut, len: u64, url: &str) -> Result<Bytes> {
    let map = data.make_read_only().map_err(|e| RemoteError {
        kind: Kind::Other,
        url: url.to_string(),
        detail: format!("cannot seal a part's memory: {e}"),
    })?;
    Ok(Bytes::from_owner(map).slice(..len as usize))
}

#[derive(Default)]
struct UpState {
    /// The multipart upload, begun when the first part is ready to go up
    /// (an object of one part is one PUT and never has one).
    id: Option<MultipartId>,
    open: HashMap<usize, PartBuf>,
    sent: std::collections::HashSet<usize>,
    done: HashMap<usize, PartId>,
    /// One past the last byte written.
    end: u64,
    in_flight: usize,
    error: Option<RemoteError>,
    finished: bool,
}

struct Shared {
    bucket: Arc<Bucket>,
    key: String,
    path: Key,
    plan: PartPlan,
    state: Mutex<UpState>,
    changed: Condvar,
}

/// A new object written by range and uploaded in parts as they fill. Writes
/// may reach past the size it was begun with (a zip's central directory, a
/// compressed file whose size is known at its end): the object is as long as
/// its furthest write, and the part size stays the one its first size chose.
#[derive(Clone)]
pub struct Upload(Arc<Shared>);

impl fmt::Debug for Upload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Upload({})", self.name())
    }
}

impl Upload {
    /// Begins object `key`, expected to be `size` bytes long.
    pub fn new(bucket: Arc<Bucket>, key: &str, size: u64) -> Result<Upload> {
        let path = bucket.key(key)?;
        let plan = PartPlan::new(size, bucket.part_size()).map_err(|detail| RemoteError {
            kind: Kind::Invalid,
            url: bucket.url(key),
            detail,
        })?;
        Ok(Upload(Arc::new(Shared {
            bucket,
            key: key.to_string(),
            path,
            plan,
            state: Mutex::new(UpState::default()),
            changed: Condvar::new(),
        })))
    }

    pub fn key(&self) -> &str {
        &self.0.key
    }

    /// The multipart upload's id, once one is begun.
    pub fn upload_id(&self) -> Option<String> {
        self.lock().id.clone()
    }

    pub fn plan(&self) -> PartPlan {
        self.0.plan
    }

    fn lock(&self) -> MutexGuard<'_, UpState> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self, st: &UpState) -> Result<()> {
        match &st.error {
            Some(e) => Err(e.clone()),
            None if st.finished => Err(RemoteError {
                kind: Kind::Invalid,
                url: self.name(),
                detail: "the upload is closed".into(),
            }),
            None => Ok(()),
        }
    }

    fn invalid(&self, detail: String) -> RemoteError {
        RemoteError {
            kind: Kind::Invalid,
            url: self.name(),
            detail,
        }
    }

    /// Copies `data` to byte `offset`; a part that fills goes up at once.
    pub fn write(&self, data: &[u8], offset: u64) -> Result<()> {
        let ps = self.0.plan.part_size;
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e.div_ceil(ps) > crate::parts::MAX_PARTS) {
            return Err(self.invalid(format!(
                "a write of {} bytes at {offset} makes the object longer than 10,000 parts of {ps} bytes",
                data.len()
            )));
        }
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let part = (at / ps) as usize;
            let start = part as u64 * ps;
            let n = ((start + ps - at) as usize).min(data.len() - done);
            let full = {
                let mut st = self.lock();
                self.failed(&st)?;
                if st.sent.contains(&part) {
                    return Err(self.invalid(format!(
                        "bytes {at}.. are written after their part went up (each byte is written once)"
                    )));
                }
                st.end = st.end.max(at + n as u64);
                let buf = match st.open.entry(part) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(PartBuf {
                        data: part_buffer(ps, &self.name())?,
                        filled: 0,
                    }),
                };
                let from = (at - start) as usize;
                buf.data[from..from + n].copy_from_slice(&data[done..done + n]);
                buf.filled += n as u64;
                if buf.filled >= ps {
                    st.sent.insert(part);
                    st.open.remove(&part).map(|b| b.data)
                } else {
                    None
                }
            };
            if let Some(bytes) = full {
                self.send(part, payload(bytes, ps, &self.name())?)?;
            }
            done += n;
        }
        Ok(())
    }

    /// The multipart upload, begun now if it is not yet.
    fn multipart_id(&self) -> Result<MultipartId> {
        if let Some(id) = self.lock().id.clone() {
            return Ok(id);
        }
        let bucket = &self.0.bucket;
        let store = bucket.store()?;
        let id = block_on(store.create_multipart(&self.0.path))
            .map_err(|e| bucket.error(&self.name(), e))?;
        let mut st = self.lock();
        match st.id.clone() {
            Some(first) => {
                // another thread began one meanwhile: keep theirs, drop ours
                drop(st);
                let _ = bucket.abort_upload(&self.0.key, &id);
                Ok(first)
            }
            None => {
                st.id = Some(id.clone());
                Ok(id)
            }
        }
    }

    /// Uploads part `part` in the background, once a slot is free.
    fn send(&self, part: usize, bytes: Bytes) -> Result<()> {
        let id = match self.multipart_id() {
            Ok(id) => id,
            Err(e) => {
                self.lock().error.get_or_insert(e.clone());
                return Err(e);
            }
        };
        let shared = self.0.clone();
        let store = shared.bucket.store()?;
        shared.bucket.take_slot();
        self.lock().in_flight += 1;
        runtime().spawn(async move {
            let r = store
                .put_part(&shared.path, &id, part, PutPayload::from(bytes))
                .await;
            let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.in_flight -= 1;
            match r {
                Ok(pid) => {
                    st.done.insert(part, pid);
                }
                Err(e) => {
                    let err = shared.bucket.error(&shared.bucket.url(&shared.key), e);
                    st.error.get_or_insert(err);
                }
            }
            drop(st);
            shared.bucket.free_slot();
            shared.changed.notify_all();
        });
        Ok(())
    }

    fn wait_idle(&self) -> MutexGuard<'_, UpState> {
        let mut st = self.lock();
        while st.in_flight > 0 {
            st = self.0.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st
    }

    /// Sends what is left (bytes never written are zeros, as in a new file of
    /// this size), completes the upload and returns the object's ETag. On
    /// any failure the upload is aborted: the object never appears.
    pub fn close(&self) -> Result<String> {
        let result = self.finish();
        if result.is_err() {
            self.abort();
        }
        result
    }

    fn finish(&self) -> Result<String> {
        let ps = self.0.plan.part_size;
        let bucket = &self.0.bucket;
        let (size, parts, single) = {
            let mut st = self.wait_idle();
            self.failed(&st)?;
            let size = st.end.max(self.0.plan.size);
            let parts = size.div_ceil(ps).max(1) as usize;
            let single = if parts == 1 && st.id.is_none() {
                st.finished = true;
                Some(st.open.remove(&0).map(|b| b.data))
            } else {
                None
            };
            (size, parts, single)
        };
        if let Some(data) = single {
            let data = match data {
                Some(d) => d,
                None => part_buffer(size, &self.name())?,
            };
            return bucket.put(
                &self.0.key,
                payload(data, size, &self.name())?,
                Mode::Overwrite,
            );
        }
        for part in 0..parts {
            let data = {
                let mut st = self.lock();
                self.failed(&st)?;
                if !st.sent.insert(part) {
                    continue;
                }
                let len = ((part as u64 + 1) * ps).min(size) - part as u64 * ps;
                (st.open.remove(&part).map(|b| b.data), len)
            };
            let (data, len) = data;
            let data = match data {
                Some(d) => d,
                None => part_buffer(len, &self.name())?, // never written: zeros, as in a new file
            };
            self.send(part, payload(data, len, &self.name())?)?;
        }
        let (id, ids) = {
            let mut st = self.wait_idle();
            self.failed(&st)?;
            st.finished = true;
            let ids: Option<Vec<PartId>> = (0..parts).map(|p| st.done.remove(&p)).collect();
            (st.id.clone(), ids)
        };
        let (Some(id), Some(ids)) = (id, ids) else {
            return Err(self.invalid("a part of the upload is missing at its end".into()));
        };
        let store = bucket.store()?;
        block_on(store.complete_multipart(&self.0.path, &id, ids))
            .map(|r| r.e_tag.unwrap_or_default())
            .map_err(|e| bucket.error(&self.name(), e))
    }

    /// Drops the upload: its parts are discarded and the object never appears.
    /// Without `cleanup` (the server stopped answering), the upload is left for
    /// the next writer at this prefix to abort.
    pub fn abort_with(&self, cleanup: bool) {
        let (id, unreachable) = {
            let mut st = self.wait_idle();
            st.error.get_or_insert(RemoteError {
                kind: Kind::Invalid,
                url: self.name(),
                detail: "the upload was aborted".into(),
            });
            st.finished = true;
            st.open.clear();
            let unreachable = st
                .error
                .as_ref()
                .is_some_and(|e| e.kind == Kind::Unreachable);
            (st.id.clone(), unreachable)
        };
        if let (Some(id), true, false) = (id, cleanup, unreachable) {
            let _ = self.0.bucket.abort_upload(&self.0.key, &id);
        }
    }

    pub fn abort(&self) {
        self.abort_with(true);
    }
}

impl WriteAt for Upload {
    fn size(&self) -> u64 {
        self.0.plan.size
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write(data, offset).map_err(io::Error::from)
    }

    fn name(&self) -> String {
        self.0.bucket.url(&self.0.key)
    }
}
