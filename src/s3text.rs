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

/// What kind of failure an error chain describes, from the words servers and
/// HTTP clients use.
pub fn classify(text: &str) -> Kind {
    let t = text.to_ascii_lowercase();
    if t.contains("nosuchbucket") {
        Kind::NoBucket
    } else if t.contains("403")
        || t.contains("accessdenied")
        || t.contains("invalidaccesskeyid")
        || t.contains("signaturedoesnotmatch")
        || t.contains("credential")
    {
        Kind::Denied
    } else if t.contains("connection refused")
        || t.contains("error sending request")
        || t.contains("timed out")
        || t.contains("timeout")
        || t.contains("dns error")
        || t.contains("connection reset")
        || t.contains("connection closed")
        || t.contains("broken pipe")
        || t.contains("retry")
    {
        Kind::Unreachable
    } else {
        Kind::Other
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
        assert_eq!(classify("404 <Code>NoSuchBucket</Code>"), Kind::NoBucket);
        assert_eq!(
            classify("403 Forbidden <Code>SignatureDoesNotMatch</Code>"),
            Kind::Denied
        );
        assert_eq!(
            classify("tcp connect error: Connection refused (os error 111)"),
            Kind::Unreachable
        );
        assert_eq!(classify("operation timed out"), Kind::Unreachable);
        assert_eq!(classify("500 Internal Server Error"), Kind::Other);
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
