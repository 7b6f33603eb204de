//! A bucket: one `object_store` client per process, its requests, and what
//! `object_store` lacks (conditional deletes, listing unfinished multipart
//! uploads) through URLs it presigns, sent with `reqwest`.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::TryStreamExt;
use http::header::{HeaderValue, IF_MATCH};
use http::Method;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::multipart::MultipartStore;
use object_store::path::Path as Key;
use object_store::signer::{SignedUrlOptions, Signer};
use object_store::{
    ClientOptions, GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig, UpdateVersion,
};

use super::readahead::ReadAhead;
use super::{block_on, error_chain, install_crypto, runtime, Kind, RemoteError, Result};
use crate::s3text::{answer, classify, element, elements, last_reason, scrub, short, xml_text};
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
    /// Ranged GETs in flight ahead of the bucket's readers (`readahead.rs`).
    pub read_ahead: usize,
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

/// A bucket: one client, one connection pool, one read-ahead store and one
/// limit on parts in flight, shared by every object of it.
pub struct Bucket {
    config: Config,
    client: Mutex<Option<(u32, Arc<AmazonS3>)>>,
    http: Mutex<Option<(u32, reqwest::Client)>>,
    /// Strings never to show: the credentials in use.
    secrets: Vec<String>,
    slots: Mutex<usize>,
    slot_free: Condvar,
    /// The parts its readers hold (`readahead.rs`).
    pub(super) cache: ReadAhead,
}

impl fmt::Debug for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bucket({})", self.config.bucket)
    }
}

/// An object's size, ETag and Last-Modified.
#[derive(Debug, Clone)]
pub struct Meta {
    pub key: String,
    pub size: u64,
    pub etag: String,
    /// When the server last wrote the object (its Last-Modified), in Unix milliseconds: the
    /// server's clock, which a lease's age is judged by.
    pub modified_ms: i64,
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
            cache: ReadAhead::new(config.read_ahead, config.part_size),
            config,
            client: Mutex::new(None),
            http: Mutex::new(None),
            secrets,
            slots: Mutex::new(0),
            slot_free: Condvar::new(),
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
    pub(super) fn store(&self) -> Result<Arc<AmazonS3>> {
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

    pub(super) fn error(&self, url: &str, e: object_store::Error) -> RemoteError {
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

    pub(super) fn key(&self, key: &str) -> Result<Key> {
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

    /// [`Bucket::get_range`] on the async runtime (the read-ahead's GETs).
    /// The body goes straight into an anonymous map of its own, which goes
    /// back to the system when the last reader of the part lets it go. (In
    /// a `Vec` filled on a network thread and freed on a copy thread, parts
    /// stayed in the allocator's arenas, as upload parts did: peak RssAnon
    /// 234-278 MiB at 16 parts of 8 MiB held, against 128 MiB of parts.)
    pub(super) async fn get_range_async(&self, key: &str, offset: u64, len: u64) -> Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let store = self.store()?;
        let k = self.key(key)?;
        let url = self.url(key);
        let short = |got: u64| {
            RemoteError {
            kind: Kind::Other,
            url: url.clone(),
            detail: format!(
                "asked for bytes {offset}..{}, got {got} bytes (the object changed or was truncated)",
                offset + len
            ),
        }
        };
        let mut map = memmap2::MmapMut::map_anon(len as usize).map_err(|e| RemoteError {
            kind: Kind::Other,
            url: url.clone(),
            detail: format!("cannot map {len} bytes of memory for a part: {e}"),
        })?;
        let options = GetOptions::new().with_range(Some(offset..offset + len));
        let mut body = store
            .get_opts(&k, options)
            .await
            .map_err(|e| self.error(&url, e))?
            .into_stream();
        let mut at = 0usize;
        while let Some(chunk) = body.try_next().await.map_err(|e| self.error(&url, e))? {
            if at + chunk.len() > map.len() {
                return Err(short((at + chunk.len()) as u64));
            }
            map[at..at + chunk.len()].copy_from_slice(&chunk);
            at += chunk.len();
        }
        if at as u64 != len {
            return Err(short(at as u64));
        }
        let map = map.make_read_only().map_err(|e| RemoteError {
            kind: Kind::Other,
            url: url.clone(),
            detail: format!("cannot seal a part's memory: {e}"),
        })?;
        Ok(Bytes::from_owner(map))
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
    pub(super) fn take_slot(&self) {
        let mut n = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= self.config.max_in_flight.max(1) {
            n = self.slot_free.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n += 1;
    }

    pub(super) fn free_slot(&self) {
        let mut n = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        self.slot_free.notify_one();
    }
}

fn meta(m: object_store::ObjectMeta) -> Meta {
    Meta {
        key: m.location.to_string(),
        size: m.size,
        etag: m.e_tag.unwrap_or_default(),
        modified_ms: m.last_modified.timestamp_millis(),
    }
}
