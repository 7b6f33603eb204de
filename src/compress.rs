//! zstd frames: one byte range of a file compressed into one independent
//! frame, and one stored frame decompressed back, for the native store's
//! optionally compressed chunks.
//!
//! A frame is untrusted input: a few KB can declare, and honestly decode to,
//! gigabytes. Before a byte is decoded, the frame's extent must be exactly the
//! stored length and the content size its header records (when it records
//! one) exactly the length expected; decoding then streams in pieces of
//! `PIECE` bytes and stops at the first byte past the length expected, so the
//! memory a frame costs is bounded by the caller's sink, not by the frame.

use std::io::{self, Read, Write};
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

use crate::files::{check_range, label, open_source, Error, Source};

/// How much is decoded at a time.
const PIECE: usize = 1 << 20;

/// Compresses `len` bytes at `offset` of the file into one zstd frame (with
/// its content size recorded) at `level`.
pub fn compress_range(path: &Path, offset: u64, len: u64, level: i32) -> Result<Vec<u8>, Error> {
    compress_range_of(&Source::Path(path.to_path_buf()), offset, len, level)
}

/// [`compress_range`] of any source.
pub fn compress_range_of(
    source: &Source<'_>,
    offset: u64,
    len: u64,
    level: i32,
) -> Result<Vec<u8>, Error> {
    let path = &label(source);
    let levels = zstd::compression_level_range();
    if !levels.contains(&level) {
        return Err(Error::Invalid(format!(
            "zstd level {level} is out of range; use {} to {}",
            levels.start(),
            levels.end()
        )));
    }
    let data = open_source(source)?;
    check_range(path, data.len(), offset, len)?;
    let bytes = data.range(offset, len, || path.display().to_string())?;
    zstd::bulk::compress(&bytes, level)
        .map_err(|e| Error::io("cannot zstd-compress a range of", path, e))
}

/// Decompresses the `stored_len` bytes at `offset` of the file, one zstd
/// frame, which must hold exactly `expected_len` bytes.
pub fn decompress_frame(
    path: &Path,
    offset: u64,
    stored_len: u64,
    expected_len: u64,
) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    decompress_frame_into(path, offset, stored_len, expected_len, &mut out)?;
    Ok(out)
}

/// Decodes the frame of `stored_len` bytes at `offset` of the file into
/// `sink`, `PIECE` bytes at a time, and returns the XXH3-64 (seed 0) of the
/// decoded bytes. It must decode to exactly `expected_len` bytes: a frame
/// whose header declares another size is refused before decoding, and one
/// that does not declare its size is stopped at the first byte too many.
pub fn decompress_frame_into<W: Write>(
    path: &Path,
    offset: u64,
    stored_len: u64,
    expected_len: u64,
    sink: &mut W,
) -> Result<u64, Error> {
    let source = Source::Path(path.to_path_buf());
    decompress_frame_into_of(&source, offset, stored_len, expected_len, sink)
}

/// [`decompress_frame_into`] of any source (a remote frame is fetched whole:
/// memory is the frame's stored size).
pub fn decompress_frame_into_of<W: Write>(
    source: &Source<'_>,
    offset: u64,
    stored_len: u64,
    expected_len: u64,
    sink: &mut W,
) -> Result<u64, Error> {
    let path = &label(source);
    let data = open_source(source)?;
    check_range(path, data.len(), offset, stored_len)?;
    let src = data.range(offset, stored_len, || path.display().to_string())?;
    let src = &src[..];
    let corrupt = |what: String| {
        Error::Corrupt(format!(
            "{}: the zstd frame at byte {offset} ({stored_len} bytes) {what}\n\
             hint: the file is corrupt or truncated; restore it from a good copy",
            path.display()
        ))
    };
    match zstd::zstd_safe::find_frame_compressed_size(src) {
        Ok(n) if n as u64 == stored_len => {}
        Ok(n) => {
            return Err(corrupt(format!(
                "is not one complete zstd frame: the frame there is {n} bytes long"
            )))
        }
        Err(code) => {
            return Err(corrupt(format!(
                "is not one complete zstd frame ({})",
                zstd::zstd_safe::get_error_name(code)
            )))
        }
    }
    match zstd::zstd_safe::get_frame_content_size(src) {
        Ok(Some(declared)) if declared != expected_len => {
            return Err(corrupt(format!(
                "declares {declared} bytes, not the expected {expected_len}"
            )))
        }
        Ok(_) => {}
        Err(_) => return Err(corrupt("has an unreadable frame header".to_string())),
    }
    let mut decoder = zstd::stream::read::Decoder::with_buffer(src)
        .map_err(|e| corrupt(format!("cannot be decoded ({e})")))?
        .single_frame();
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; PIECE];
    let mut total: u64 = 0;
    loop {
        let n = match decoder.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(corrupt(format!(
                    "does not decompress to {expected_len} bytes ({e})"
                )))
            }
        };
        total += n as u64;
        if total > expected_len {
            return Err(corrupt(format!(
                "holds more than the expected {expected_len} bytes"
            )));
        }
        hasher.update(&buf[..n]);
        sink.write_all(&buf[..n])
            .map_err(|e| Error::io("cannot write the decompressed bytes of", path, e))?;
    }
    if total != expected_len {
        return Err(corrupt(format!(
            "holds {total} bytes, not the expected {expected_len}"
        )));
    }
    Ok(hasher.digest())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn a_range_round_trips_through_one_frame() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 13) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        let frame = compress_range(f.path(), 1000, 50_000, 3).unwrap();
        assert!(frame.len() < 5_000);
        assert_eq!(
            zstd::bulk::decompress(&frame, 50_000).unwrap(),
            &data[1000..51_000]
        );

        let mut g = tempfile::NamedTempFile::new().unwrap();
        g.write_all(b"header").unwrap();
        g.write_all(&frame).unwrap();
        let n = frame.len() as u64;
        let back = decompress_frame(g.path(), 6, n, 50_000).unwrap();
        assert_eq!(back, &data[1000..51_000]);

        // A header that declares another size is refused before decoding.
        let msg = decompress_frame(g.path(), 6, n, 49_999)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("declares 50000 bytes, not the expected 49999"),
            "{msg}"
        );
        let msg = decompress_frame(g.path(), 6, n, 50_001)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("declares 50000 bytes, not the expected 50001"),
            "{msg}"
        );
        let msg = decompress_frame(g.path(), 5, n, 50_000)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("is not one complete zstd frame"), "{msg}");
        assert!(msg.contains("hint: the file is corrupt"), "{msg}");
        let msg = decompress_frame(g.path(), 6, n - 1, 50_000)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("is not one complete zstd frame"), "{msg}");
        assert!(decompress_frame(g.path(), 6, n + 1, 50_000).is_err());
        assert!(compress_range(f.path(), 99_999, 2, 3).is_err());
        assert!(compress_range(f.path(), 0, 10, 1000).is_err());
    }

    /// A frame that records no content size is decoded in pieces and
    /// stopped at the first byte past the length expected.
    #[test]
    fn a_frame_without_its_size_is_bounded_while_decoding() {
        let data = vec![7u8; 3 * PIECE + 5];
        let mut frame = Vec::new();
        {
            let mut enc = zstd::stream::write::Encoder::new(&mut frame, 3).unwrap();
            enc.include_contentsize(false).unwrap();
            enc.write_all(&data).unwrap();
            enc.finish().unwrap();
        }
        assert!(matches!(
            zstd::zstd_safe::get_frame_content_size(&frame),
            Ok(None)
        ));
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&frame).unwrap();
        f.write_all(b"next frame").unwrap();
        let n = frame.len() as u64;
        let mut out = Vec::new();
        let h = decompress_frame_into(f.path(), 0, n, data.len() as u64, &mut out).unwrap();
        assert_eq!(out, data);
        assert_eq!(h, xxhash_rust::xxh3::xxh3_64(&data));
        let mut out = Vec::new();
        let msg = decompress_frame_into(f.path(), 0, n, PIECE as u64, &mut out)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("holds more than the expected"), "{msg}");
        assert!(out.len() <= PIECE, "decoding went on past the bound");
        let msg = decompress_frame(f.path(), 0, n, data.len() as u64 + 1)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("holds 3145733 bytes, not the expected 3145734"),
            "{msg}"
        );
        // The stored length must be exactly the frame's: trailing bytes are refused.
        let msg = decompress_frame(f.path(), 0, n + 4, data.len() as u64)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("the frame there is"), "{msg}");
    }

    #[test]
    fn empty_ranges_make_empty_frames() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let frame = compress_range(f.path(), 0, 0, 1).unwrap();
        assert!(!frame.is_empty());
        assert!(zstd::bulk::decompress(&frame, 0).unwrap().is_empty());
    }
}
