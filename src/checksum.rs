//! Checksums: xxh3-64 for the native store's chunks, CRC-32 for zip entries
//! (what `torch.save` archives record).
//!
//! - [`checksum_ranges`]: byte ranges of a file, read again.
//! - What the executor wrote, without reading it again: the CRC-32 of each
//!   piece ([`WrittenCrc`]) combined into a range's ([`combine_crcs`],
//!   [`untiled_parts`], [`crc32_concat`]), and the xxh3-64 of ranges hashed as
//!   their bytes go out (`HashRanges`, one `HashStream` per copy thread).

use std::path::Path;
use std::str::FromStr;
use std::sync::Mutex;

use rayon::prelude::*;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

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

// ---------------------------------------------------------------- checksums of what the executor wrote

/// The CRC-32 of bytes one piece wrote: `len` bytes at `offset` of `target`.
/// `read`: where those bytes came from, `(source, offset)`, when the piece
/// copied them unchanged (same dtype): the CRC is then also that of the
/// `len` source bytes there, so a reader's checksums of the source can be
/// checked without reading it again (`None` for a cast).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrittenCrc {
    pub target: usize,
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
    pub read: Option<(usize, u64)>,
}

/// Bytes one piece wrote: `len` bytes at `offset` of target `target`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub target: usize,
    pub offset: u64,
    pub len: u64,
}

/// A range to hash: `(target, offset, len, the caller's index of it)`.
pub(crate) type HashRange = (usize, u64, u64, usize);

/// The xxh3-64 of each range asked (None: not hashed), in the caller's order.
pub type Hashes = Vec<Option<u64>>;

/// The ranges to hash, sorted, and the hash found for each (in the caller's order).
pub(crate) struct HashRanges {
    /// `(target, offset, len, caller's index)`, by target and offset; empty
    /// ranges and ranges that overlap another are left out (the ones never
    /// hashed: their bytes would have to go to two hashes).
    sorted: Vec<HashRange>,
    found: Mutex<Hashes>,
}

impl HashRanges {
    pub(crate) fn new(ranges: &[(usize, u64, u64)]) -> HashRanges {
        let mut sorted: Vec<_> = ranges
            .iter()
            .enumerate()
            .filter(|(_, r)| r.2 > 0)
            .map(|(i, &(t, o, l))| (t, o, l, i))
            .collect();
        sorted.sort_unstable();
        let overlap = |a: HashRange, b: HashRange| a.0 == b.0 && b.1 < a.1.saturating_add(a.2);
        let alone: Vec<bool> = (0..sorted.len())
            .map(|i| {
                let before = i > 0 && overlap(sorted[i - 1], sorted[i]);
                let after = i + 1 < sorted.len() && overlap(sorted[i], sorted[i + 1]);
                !(before || after)
            })
            .collect();
        let mut kept = alone.into_iter();
        sorted.retain(|_| kept.next().unwrap_or(false));
        // An empty range holds the hash of no bytes; no piece writes it.
        let found = ranges
            .iter()
            .map(|&(_, _, l)| (l == 0).then(|| Xxh3::new().digest()))
            .collect();
        HashRanges {
            sorted,
            found: Mutex::new(found),
        }
    }

    /// The range that holds all of the written span `w`, if one does.
    pub(crate) fn holding(&self, w: Span) -> Option<HashRange> {
        let i = self
            .sorted
            .partition_point(|&(t, o, _, _)| (t, o) <= (w.target, w.offset));
        let r = *self.sorted.get(i.checked_sub(1)?)?;
        (r.0 == w.target && w.offset + w.len <= r.1 + r.2).then_some(r)
    }

    /// Whether a copy thread's stretch may begin at `w`: no range holds it, or
    /// one begins there (a cut there leaves every range to one thread).
    pub(crate) fn may_start(&self, w: Span) -> bool {
        self.holding(w).is_none_or(|r| r.1 == w.offset)
    }

    pub(crate) fn into_found(self) -> Hashes {
        self.found.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

/// One copy thread's hash of the range its pieces are in: pieces come in
/// target order, so a range is hashed when its first piece starts it and
/// each next piece continues where the last ended.
pub(crate) struct HashStream<'a> {
    ranges: &'a HashRanges,
    /// The range being hashed (its entry in `ranges.sorted`), the next byte
    /// expected, and the hash so far.
    open: Option<(HashRange, u64, Xxh3)>,
}

impl<'a> HashStream<'a> {
    pub(crate) fn new(ranges: &'a HashRanges) -> HashStream<'a> {
        HashStream { ranges, open: None }
    }

    /// Where the bytes of span `w` are to be hashed, if its range is being hashed in order.
    pub(crate) fn feed(&mut self, w: Span) -> Option<&mut Xxh3> {
        let r = self.ranges.holding(w)?;
        if w.offset == r.1 {
            self.open = Some((r, r.1, Xxh3::new()));
        }
        let in_order =
            matches!(&self.open, Some((open, next, _)) if *open == r && *next == w.offset);
        if !in_order {
            self.open = None; // a gap, or a range begun by another thread
        }
        self.open.as_mut().map(|(_, _, h)| h)
    }

    /// After span `w` was written (and fed): the range's hash once its last byte is in.
    pub(crate) fn written(&mut self, w: Span) {
        let Some((r, next, h)) = &mut self.open else {
            return;
        };
        if *next != w.offset || self.ranges.holding(w) != Some(*r) {
            return;
        }
        *next += w.len;
        if *next == r.1 + r.2 {
            let digest = h.digest();
            self.ranges.found.lock().unwrap_or_else(|e| e.into_inner())[r.3] = Some(digest);
            self.open = None;
        }
    }
}

/// The CRC-32 of each `(target, offset, len)` range, combined from the pieces
/// that tile it exactly; `None` where the pieces written do not tile the range.
pub fn combine_crcs(mut pieces: Vec<WrittenCrc>, ranges: &[(usize, u64, u64)]) -> Vec<Option<u32>> {
    pieces.sort_by_key(|p| (p.target, p.offset));
    ranges
        .iter()
        .map(|&(target, offset, len)| {
            if len == 0 {
                return Some(0);
            }
            let mut i = pieces.partition_point(|p| (p.target, p.offset) < (target, offset));
            let mut at = offset;
            let mut hasher = crc32fast::Hasher::new();
            while at < offset + len {
                let p = pieces
                    .get(i)
                    .filter(|p| p.target == target && p.offset == at)?;
                if p.offset + p.len > offset + len {
                    return None;
                }
                hasher.combine(&crc32fast::Hasher::new_with_initial_len(p.crc, p.len));
                at += p.len;
                i += 1;
            }
            Some(hasher.finalize())
        })
        .collect()
}

/// For each range [`combine_crcs`] found no CRC for (`None` in `found`), the
/// pieces written inside it, as `(range index, offset, len, crc)`: a caller
/// running a job in batches joins them across batches (a range that one
/// batch's pieces do not tile, such as a ZeRO flat partition filled by
/// tensors of several batches, then needs no second read of the output).
pub fn untiled_parts(
    mut pieces: Vec<WrittenCrc>,
    ranges: &[(usize, u64, u64)],
    found: &[Option<u32>],
) -> Vec<(usize, u64, u64, u32)> {
    pieces.sort_by_key(|p| (p.target, p.offset));
    let mut out = Vec::new();
    for (i, &(target, offset, len)) in ranges.iter().enumerate() {
        if found.get(i).is_some_and(Option::is_some) {
            continue;
        }
        let first = pieces.partition_point(|p| (p.target, p.offset) < (target, offset));
        for p in pieces[first..]
            .iter()
            .take_while(|p| p.target == target && p.offset < offset + len)
        {
            if p.offset + p.len <= offset + len {
                out.push((i, p.offset, p.len, p.crc));
            }
        }
    }
    out
}

/// The CRC-32 of bytes `(crc, len)` after one another (zlib's crc32_combine).
pub fn crc32_concat(parts: &[(u32, u64)]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    for &(crc, len) in parts {
        hasher.combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
    }
    hasher.finalize()
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
