//! The text of S3 answers and errors, without a client: what kind of failure a
//! message is, its short form, the elements of an XML answer, and scrubbing
//! the credentials out of any text before it is shown. Plain functions, so
//! that `cargo test` checks them without a server.

/// What went wrong, in kinds the Python side maps to its errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    NotFound,
    /// A conditional put or delete lost (412), or the object already exists.
    Precondition,
    /// 403, or credentials refused or missing.
    Denied,
    /// The bucket does not exist.
    NoBucket,
    /// Could not reach the server, or it stopped answering.
    Unreachable,
    /// An argument Ravex cannot send (a key S3 cannot hold, an object too large).
    Invalid,
    Other,
}

/// `text` with every credential in `secrets`, and the signature, credential
/// scope and session token of any presigned URL, replaced by `***`.
pub fn scrub(text: &str, secrets: &[String]) -> String {
    let mut t = text.to_string();
    for s in secrets {
        t = t.replace(s.as_str(), "***");
    }
    for marker in [
        "X-Amz-Signature=",
        "X-Amz-Credential=",
        "X-Amz-Security-Token=",
    ] {
        let mut from = 0;
        while let Some(i) = t[from..].find(marker) {
            let start = from + i + marker.len();
            let end = t[start..]
                .find(|c: char| c == '&' || c.is_whitespace() || c == '"' || c == ')')
                .map_or(t.len(), |j| start + j);
            t.replace_range(start..end, "***");
            from = start + 3;
        }
    }
    t
}

/// The HTTP status a server answered, where the text records one ("… status code: 403 …").
pub fn status(text: &str) -> Option<u16> {
    let at = text.find("status code: ")? + "status code: ".len();
    text[at..].get(..3)?.parse().ok()
}

/// `text` without its URLs: a key, a host or a port must never decide what an error is.
fn without_urls(text: &str) -> String {
    text.split_whitespace()
        .filter(|w| !w.contains("://"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The S3 error codes that mean the credentials were refused.
const DENIED: [&str; 6] = [
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
];

/// What kind of failure an error chain describes: from the server's S3 error
/// code and HTTP status where it answered, else from the words of the
/// connection-level failure (never from a URL, a key or a port in the text).
pub fn classify(text: &str) -> Kind {
    let code = element(text, "Code");
    if code == Some("NoSuchBucket") {
        return Kind::NoBucket;
    }
    if code.is_some_and(|c| DENIED.contains(&c)) {
        return Kind::Denied;
    }
    match status(text) {
        Some(403) => return Kind::Denied,
        Some(404) if code.is_none() || code == Some("NoSuchKey") => return Kind::NotFound,
        Some(_) => return Kind::Other,
        None => {}
    }
    let t = without_urls(text).to_ascii_lowercase();
    let connection = [
        "connection refused",
        "error sending request",
        "timed out",
        "timeout",
        "dns error",
        "connection reset",
        "connection closed",
        "broken pipe",
        "incomplete message",
    ];
    if connection.iter().any(|w| t.contains(w)) {
        Kind::Unreachable
    } else if t.contains("credential") {
        Kind::Denied // no credentials found, or the provider failed
    } else {
        Kind::Other
    }
}

/// What a server answered, in a few words: "500 Internal Server Error (InternalError: …)".
pub fn answer(text: &str) -> String {
    let status = status(text).map_or(String::new(), |s| s.to_string());
    let reason = text
        .find("status code: ")
        .and_then(|i| text[i..].split(':').nth(1))
        .map(|r| {
            r.trim()
                .trim_start_matches(char::is_numeric)
                .trim()
                .to_string()
        })
        .unwrap_or_default();
    let code = element(text, "Code").unwrap_or_default();
    let message = element(text, "Message").unwrap_or_default();
    let mut out = format!("{status} {reason}").trim().to_string();
    if !code.is_empty() {
        out.push_str(&format!(
            " ({code}{}{message})",
            if message.is_empty() { "" } else { ": " }
        ));
    }
    if out.is_empty() {
        last_reason(text)
    } else {
        short(&out)
    }
}

/// The innermost cause of an error chain ("Connection refused (os error 111)"), short.
pub fn last_reason(chain: &str) -> String {
    let last = chain.rsplit(": ").next().unwrap_or(chain).trim();
    short(if last.is_empty() { chain } else { last })
}

/// One line, at most 300 characters.
pub fn short(text: &str) -> String {
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() > 300 {
        format!("{}…", line.chars().take(300).collect::<String>())
    } else {
        line
    }
}

/// The text of each `<name>…</name>` element of an S3 XML answer.
pub fn elements<'a>(xml: &'a str, name: &str) -> Vec<&'a str> {
    let (open, close) = (format!("<{name}>"), format!("</{name}>"));
    let mut found = Vec::new();
    let mut rest = xml;
    while let Some(i) = rest.find(&open) {
        let body = &rest[i + open.len()..];
        match body.find(&close) {
            Some(j) => {
                found.push(&body[..j]);
                rest = &body[j + close.len()..];
            }
            None => break,
        }
    }
    found
}

pub fn element<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    elements(xml, name).into_iter().next()
}

pub fn xml_text(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_signatures_never_survive() {
        let secrets = vec!["AKIAEXAMPLEKEY".to_string(), "s3cr3t-value".to_string()];
        let text = "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAEXAMPLEKEY%2F20261205&X-Amz-Signature=abcdef0123 \
                    failed: <AWSAccessKeyId>AKIAEXAMPLEKEY</AWSAccessKeyId> secret s3cr3t-value";
        let out = scrub(text, &secrets);
        for gone in ["AKIAEXAMPLEKEY", "s3cr3t-value", "abcdef0123", "20261205"] {
            assert!(!out.contains(gone), "{gone} in {out}");
        }
        assert!(out.contains("X-Amz-Signature=***"));
    }

    #[test]
    fn failures_are_told_apart() {
        let denied = "status code: 403 Forbidden: <Code>SignatureDoesNotMatch</Code>";
        assert_eq!(
            classify("status code: 404 Not Found: <Code>NoSuchBucket</Code>"),
            Kind::NoBucket
        );
        assert_eq!(classify(denied), Kind::Denied);
        assert_eq!(
            classify("tcp connect error: Connection refused (os error 111)"),
            Kind::Unreachable
        );
        assert_eq!(classify("operation timed out"), Kind::Unreachable);
        let failed = "Server returned non-2xx status code: 500 Internal Server Error: <Code>InternalError</Code>";
        assert_eq!(classify(failed), Kind::Other);
    }

    #[test]
    fn a_key_a_port_or_a_retry_count_decides_nothing() {
        // a 500 on key run-403/obj, through a server on port 34037, after retries
        let text = "Error performing PUT http://127.0.0.1:34037/ckpt/run-403/obj in 1.4031ms, after 3 retries, \
                    max_retries: 3 - Server returned non-2xx status code: 500 Internal Server Error: <Code>InternalError</Code>";
        assert_eq!(classify(text), Kind::Other);
        assert_eq!(answer(text), "500 Internal Server Error (InternalError)");
        let refused = "Error performing GET http://127.0.0.1:4031/timeout-403/x - HTTP error: error sending request: \
                       client error (Connect): tcp connect error: Connection refused (os error 111)";
        assert_eq!(classify(refused), Kind::Unreachable);
        let on_a_key = "GET http://h/credential-403 failed: status code: 500 Internal Server Error";
        assert_eq!(classify(on_a_key), Kind::Other);
    }

    #[test]
    fn an_answer_reads_as_one_short_line() {
        assert_eq!(last_reason("Generic S3 error: request failed: tcp connect error: Connection refused (os error 111)"),
                   "Connection refused (os error 111)");
        assert_eq!(short(&"x ".repeat(400)).chars().count(), 301);
        let xml = "<R><Upload><Key>a&amp;b</Key><UploadId>1</UploadId></Upload><Upload><Key>c</Key></Upload><IsTruncated>false</IsTruncated></R>";
        let ups = elements(xml, "Upload");
        assert_eq!(ups.len(), 2);
        assert_eq!(xml_text(element(ups[0], "Key").unwrap()), "a&b");
        assert_eq!(element(ups[1], "UploadId"), None);
        assert_eq!(element(xml, "IsTruncated"), Some("false"));
    }
}
