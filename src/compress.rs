//! zstd frames: one byte range of a file compressed into one independent
//! frame, and one stored frame decompressed back, for the native store's
//! optionally compressed chunks.

use std::path::Path;

use crate::files::{check_range, map_file, Error};

/// Compresses `len` bytes at `offset` of the file into one zstd frame (with
/// its content size recorded) at `level`.
pub fn compress_range(path: &Path, offset: u64, len: u64, level: i32) -> Result<Vec<u8>, Error> {
    let levels = zstd::compression_level_range();
    if !levels.contains(&level) {
        return Err(Error::Invalid(format!(
            "zstd level {level} is out of range; use {} to {}",
            levels.start(),
            levels.end()
        )));
    }
    let data = map_file(path)?;
    let range = check_range(path, data.bytes().len() as u64, offset, len)?;
    zstd::bulk::compress(&data.bytes()[range], level)
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
    let data = map_file(path)?;
    let range = check_range(path, data.bytes().len() as u64, offset, stored_len)?;
    let corrupt = |what: String| {
        Error::Invalid(format!(
            "{}: the zstd frame at byte {offset} ({stored_len} bytes) {what}\n\
             hint: the file is corrupt or truncated; restore it from a good copy",
            path.display()
        ))
    };
    let capacity = usize::try_from(expected_len)
        .map_err(|_| corrupt(format!("cannot hold {expected_len} bytes on this machine")))?;
    let out = zstd::bulk::decompress(&data.bytes()[range], capacity)
        .map_err(|e| corrupt(format!("does not decompress to {expected_len} bytes ({e})")))?;
    if out.len() != capacity {
        return Err(corrupt(format!(
            "holds {} bytes, not the expected {expected_len}",
            out.len()
        )));
    }
    Ok(out)
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

        let msg = decompress_frame(g.path(), 6, n, 49_999)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("does not decompress to 49999 bytes"), "{msg}");
        let msg = decompress_frame(g.path(), 6, n, 50_001)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("holds 50000 bytes, not the expected 50001"),
            "{msg}"
        );
        let msg = decompress_frame(g.path(), 5, n, 50_000)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("hint: the file is corrupt"), "{msg}");
        assert!(decompress_frame(g.path(), 6, n + 1, 50_000).is_err());
        assert!(compress_range(f.path(), 99_999, 2, 3).is_err());
        assert!(compress_range(f.path(), 0, 10, 1000).is_err());
    }

    #[test]
    fn empty_ranges_make_empty_frames() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let frame = compress_range(f.path(), 0, 0, 1).unwrap();
        assert!(!frame.is_empty());
        assert!(zstd::bulk::decompress(&frame, 0).unwrap().is_empty());
    }
}
