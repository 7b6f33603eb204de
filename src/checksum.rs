//! Checksums of byte ranges of a file: xxh3-64 for the native store's chunks,
//! CRC-32 for zip entries (what `torch.save` archives record).

use std::path::Path;
use std::str::FromStr;

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::files::{check_range, label, open_source, Error, Source, SourceData};

/// A checksum algorithm, by the name the Python side uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// `"xxh3-64"`: XXH3, 64-bit, seed 0.
    Xxh3_64,
    /// `"crc32"`: CRC-32/ISO-HDLC, as zip and zlib compute it.
    Crc32,
}

impl FromStr for Algo {
    type Err = Error;

    fn from_str(s: &str) -> Result<Algo, Error> {
        match s {
            "xxh3-64" => Ok(Algo::Xxh3_64),
            "crc32" => Ok(Algo::Crc32),
            _ => Err(Error::Invalid(format!(
                "unknown checksum algorithm {s:?}; expected \"xxh3-64\" or \"crc32\""
            ))),
        }
    }
}

impl Algo {
    pub fn of(self, data: &[u8]) -> u64 {
        match self {
            Algo::Xxh3_64 => xxh3_64(data),
            Algo::Crc32 => u64::from(crc32fast::hash(data)),
        }
    }
}

/// XXH3-64 (seed 0) of a buffer.
pub fn xxh3_64_bytes(data: &[u8]) -> u64 {
    xxh3_64(data)
}

/// The checksum of each `(offset, len)` range of the file, in order; ranges
/// are hashed in parallel. Every range is checked against the file's size
/// before any is read.
pub fn checksum_ranges(path: &Path, ranges: &[(u64, u64)], algo: Algo) -> Result<Vec<u64>, Error> {
    checksum_ranges_of(&Source::Path(path.to_path_buf()), ranges, algo)
}

/// Bytes hashed per step of a remote source.
const REMOTE_STEP: u64 = 8 << 20;

/// [`checksum_ranges`] of any source: a remote one is read in steps of
/// `REMOTE_STEP` bytes, so memory stays flat in the range's length.
pub fn checksum_ranges_of(
    source: &Source<'_>,
    ranges: &[(u64, u64)],
    algo: Algo,
) -> Result<Vec<u64>, Error> {
    let data = open_source(source)?;
    let name = label(source);
    let checked = ranges
        .iter()
        .map(|&(offset, len)| check_range(&name, data.len(), offset, len))
        .collect::<Result<Vec<_>, _>>()?;
    if let SourceData::Remote(_) = &data {
        return checked
            .into_par_iter()
            .map(|r| {
                let (mut crc, mut xxh) = (crc32fast::Hasher::new(), xxhash_rust::xxh3::Xxh3::new());
                let mut at = r.start as u64;
                while at < r.end as u64 {
                    let n = REMOTE_STEP.min(r.end as u64 - at);
                    let piece = data.range(at, n, || name.display().to_string())?;
                    match algo {
                        Algo::Crc32 => crc.update(&piece),
                        Algo::Xxh3_64 => xxh.update(&piece),
                    }
                    at += n;
                }
                Ok(match algo {
                    Algo::Crc32 => u64::from(crc.finalize()),
                    Algo::Xxh3_64 => xxh.digest(),
                })
            })
            .collect();
    }
    let bytes = data.bytes();
    Ok(checked
        .into_par_iter()
        .map(|r| algo.of(&bytes[r]))
        .collect())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn file_with(data: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(data).unwrap();
        f
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        let f = file_with(b"xx123456789yy");
        let got = checksum_ranges(f.path(), &[(2, 9), (0, 0)], Algo::Crc32).unwrap();
        assert_eq!(got, vec![0xCBF4_3926, 0]);
    }

    #[test]
    fn xxh3_of_ranges_equals_xxh3_of_their_bytes() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let f = file_with(&data);
        let ranges = [(0, 10_000), (17, 4096), (9_999, 1), (5_000, 0)];
        let got = checksum_ranges(f.path(), &ranges, "xxh3-64".parse().unwrap()).unwrap();
        let want: Vec<u64> = ranges
            .iter()
            .map(|&(o, l)| xxh3_64_bytes(&data[o as usize..(o + l) as usize]))
            .collect();
        assert_eq!(got, want);
        // The published value for empty input, seed 0.
        assert_eq!(xxh3_64_bytes(b""), 0x2D06_8005_38D3_94C2);
    }

    #[test]
    fn ranges_past_the_end_and_unknown_algorithms_are_errors() {
        let f = file_with(&[0; 100]);
        let err = checksum_ranges(f.path(), &[(0, 10), (95, 6)], Algo::Crc32).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("the byte range 95+6 reaches past the end of"),
            "{msg}"
        );
        assert!(msg.ends_with("(100 bytes)"), "{msg}");
        assert!(checksum_ranges(f.path(), &[(u64::MAX, 2)], Algo::Crc32).is_err());
        assert!("md5".parse::<Algo>().is_err());
        let missing = checksum_ranges(Path::new("/nonexistent/x"), &[], Algo::Crc32);
        assert!(matches!(missing, Err(Error::Io { .. })));
    }

    #[test]
    fn empty_files_hash_empty_ranges() {
        let f = file_with(b"");
        let got = checksum_ranges(f.path(), &[(0, 0)], Algo::Xxh3_64).unwrap();
        assert_eq!(got, vec![xxh3_64_bytes(b"")]);
    }
}
