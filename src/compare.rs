//! Element-wise comparison of two stored copies of one logical tensor, for
//! `ravex verify`: how many elements differ, the first that does (as a flat
//! row-major index of the global tensor), and the largest absolute difference.
//!
//! Each side is planned onto one whole-tensor target, which yields, for every
//! global element, the one chunk that holds it (the first listed, where
//! chunks are replicas). Walking both run lists together pairs the two sides
//! element by element, so every element is compared exactly once, replicas
//! are not counted twice, and the run's position in the whole-tensor target
//! is the global index. Both sides must cover the whole tensor.
//!
//! Rules: in exact mode, equal dtypes compare bit patterns and different
//! dtypes compare values (as f64; NaN equals NaN). In tolerance mode floats
//! match when `|a - b| <= atol + rtol * |b|`, NaN matches NaN and equal
//! infinities match. Integers and bools compare exactly in both modes.
//! `max_abs_diff` is over all elements: 0 for matching NaNs or infinities,
//! infinite where only one side is NaN or the infinities differ.

use rayon::prelude::*;

use crate::dtype::{value_f64, value_i128, DType};
use crate::files::{
    check_chunk, open_sources, source_name, ChunkAt, ChunkRef, Error, Side, Source, SourceData,
};
use crate::geometry::Region;
use crate::plan::{plan, Chunk, PlanError, SourcedRun};

/// Elements compared per parallel piece.
const PIECE_ELEMS: u64 = 1 << 20;
/// Elements decoded per step into stack scratch.
const BLOCK: usize = 2048;

/// How to compare.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
    pub exact: bool,
}

impl Tolerance {
    pub const EXACT: Tolerance = Tolerance {
        atol: 0.0,
        rtol: 0.0,
        exact: true,
    };
}

/// What a comparison found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Comparison {
    pub n_diff: u64,
    /// The smallest flat (row-major) global index of a differing element.
    pub first_diff: Option<u64>,
    pub max_abs_diff: f64,
}

impl Comparison {
    const SAME: Comparison = Comparison {
        n_diff: 0,
        first_diff: None,
        max_abs_diff: 0.0,
    };

    fn merge(self, other: Comparison) -> Comparison {
        Comparison {
            n_diff: self.n_diff + other.n_diff,
            first_diff: match (self.first_diff, other.first_diff) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            max_abs_diff: self.max_abs_diff.max(other.max_abs_diff),
        }
    }
}

/// Compares the tensor of global shape `shape` stored as `a` with the one
/// stored as `b`; `ChunkRef::file` indexes `sources` on both sides.
pub fn compare(
    sources: &[Source<'_>],
    shape: &[u64],
    a: &[ChunkRef],
    b: &[ChunkRef],
    tol: Tolerance,
) -> Result<Comparison, Error> {
    for (name, v) in [("atol", tol.atol), ("rtol", tol.rtol)] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(Error::Invalid(format!(
                "{name} must be a finite number >= 0, got {v}"
            )));
        }
    }
    let data = open_sources(sources)?;
    let sizes: Vec<u64> = data.iter().map(SourceData::len).collect();
    let a_runs = whole_runs(shape, a, Side::A)?;
    let b_runs = whole_runs(shape, b, Side::B)?;
    for (side, chunks) in [(Side::A, a), (Side::B, b)] {
        for (chunk, c) in chunks.iter().enumerate() {
            let at = ChunkAt {
                tensor: None,
                side,
                chunk,
            };
            let elems = c.region.validate(shape).unwrap_or(0);
            check_chunk(at, c, elems, sizes.len(), Some(&sizes), |f| {
                source_name(sources, f)
            })?;
        }
    }
    let pieces = pair_runs(&a_runs, &b_runs);
    // borrowed from a mapping, or fetched (one piece, at most PIECE_ELEMS elements) from a remote source
    let bytes = |c: &ChunkRef, elem: u64, len: u64| {
        let size = c.dtype.size() as u64;
        data[c.file].range(c.offset + elem * size, len * size, || {
            source_name(sources, c.file)
        })
    };
    pieces
        .par_iter()
        .map(|p| {
            let (ca, cb) = (&a[p.a], &b[p.b]);
            Ok(compare_slices(
                ca.dtype,
                &bytes(ca, p.a_elem, p.len)?,
                cb.dtype,
                &bytes(cb, p.b_elem, p.len)?,
                p.global,
                tol,
            ))
        })
        .try_reduce(|| Comparison::SAME, |x, y| Ok(x.merge(y)))
}

/// Plans one side onto the whole tensor: runs sorted by global index,
/// tiling it, each naming the chunk that holds it.
fn whole_runs(shape: &[u64], chunks: &[ChunkRef], side: Side) -> Result<Vec<SourcedRun>, Error> {
    let sources: Vec<Chunk> = chunks
        .iter()
        .enumerate()
        .map(|(id, c)| Chunk {
            id,
            region: c.region.clone(),
        })
        .collect();
    let whole = [Chunk {
        id: 0,
        region: Region::Flat {
            start: 0,
            len: crate::geometry::numel(shape).map_err(|e| Error::Invalid(e.to_string()))?,
        },
    }];
    match plan(shape, &sources, &whole) {
        Ok(mut plans) => Ok(plans.pop().map(|p| p.runs).unwrap_or_default()),
        Err(PlanError::Uncovered {
            missing,
            len,
            first_missing,
            ..
        }) => Err(Error::Corrupt(format!(
            "the {side} chunks leave {missing} of the tensor's {len} elements uncovered, \
             the first at global index {first_missing:?}"
        ))),
        Err(PlanError::Source { id, error }) => {
            Err(Error::Corrupt(format!("{side} chunk {id}: {error}")))
        }
        Err(e) => Err(Error::Invalid(e.to_string())),
    }
}

/// A stretch of `len` elements at global index `global`: element `a_elem` of
/// chunk `a` against element `b_elem` of chunk `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pair {
    a: usize,
    a_elem: u64,
    b: usize,
    b_elem: u64,
    global: u64,
    len: u64,
}

/// Walks two run lists that tile the same range, cut into pieces of at most
/// [`PIECE_ELEMS`].
fn pair_runs(a: &[SourcedRun], b: &[SourcedRun]) -> Vec<Pair> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    let mut g = 0u64;
    while i < a.len() && j < b.len() {
        let (ra, rb) = (&a[i].run, &b[j].run);
        let end = (ra.dst_elem + ra.len).min(rb.dst_elem + rb.len);
        let mut at = g;
        while at < end {
            let len = (end - at).min(PIECE_ELEMS);
            out.push(Pair {
                a: a[i].source_id,
                a_elem: ra.src_elem + (at - ra.dst_elem),
                b: b[j].source_id,
                b_elem: rb.src_elem + (at - rb.dst_elem),
                global: at,
                len,
            });
            at += len;
        }
        g = end;
        if ra.dst_elem + ra.len == end {
            i += 1;
        }
        if rb.dst_elem + rb.len == end {
            j += 1;
        }
    }
    out
}

/// The absolute difference as the comparison reports it.
fn abs_diff(x: f64, y: f64) -> f64 {
    match (x.is_nan(), y.is_nan()) {
        (true, true) => 0.0,
        (true, false) | (false, true) => f64::INFINITY,
        _ if x == y => 0.0,
        _ => (x - y).abs(),
    }
}

fn compare_slices(
    da: DType,
    a: &[u8],
    db: DType,
    b: &[u8],
    global: u64,
    tol: Tolerance,
) -> Comparison {
    let n = a.len() / da.size();
    let mut out = Comparison::SAME;
    let mut note = |i: usize, differs: bool, diff: f64| {
        if differs {
            out.n_diff += 1;
            out.first_diff.get_or_insert(global + i as u64);
        }
        out.max_abs_diff = out.max_abs_diff.max(diff);
    };
    if da == db && (tol.exact || !da.is_float()) {
        // Bit patterns; for integers that is value equality too.
        if a == b {
            return out;
        }
        let s = da.size();
        for i in 0..n {
            if a[i * s..(i + 1) * s] != b[i * s..(i + 1) * s] {
                let diff = if da.is_float() {
                    abs_diff(value_f64(da, a, i), value_f64(db, b, i))
                } else {
                    (value_i128(da, a, i) - value_i128(db, b, i)).unsigned_abs() as f64
                };
                note(i, true, diff);
            }
        }
    } else if !da.is_float() && !db.is_float() {
        for i in 0..n {
            let d = value_i128(da, a, i) - value_i128(db, b, i);
            note(i, d != 0, d.unsigned_abs() as f64);
        }
    } else if !da.is_float() || !db.is_float() {
        // An integer against a float: values, exactly.
        for i in 0..n {
            let diff = abs_diff(value_f64(da, a, i), value_f64(db, b, i));
            note(i, diff != 0.0, diff);
        }
    } else {
        let (mut xs, mut ys) = ([0f64; BLOCK], [0f64; BLOCK]);
        for start in (0..n).step_by(BLOCK) {
            let m = BLOCK.min(n - start);
            let (xs, ys) = (&mut xs[..m], &mut ys[..m]);
            decode_f64(da, &a[start * da.size()..], xs);
            decode_f64(db, &b[start * db.size()..], ys);
            for (k, (&x, &y)) in xs.iter().zip(ys.iter()).enumerate() {
                let diff = abs_diff(x, y);
                // An infinity matches only itself, whatever the tolerance.
                let ok = diff == 0.0
                    || (!tol.exact
                        && x.is_finite()
                        && y.is_finite()
                        && diff <= tol.atol + tol.rtol * y.abs());
                note(start + k, !ok, diff);
            }
        }
    }
    out
}

/// Decodes the first `out.len()` elements of `src` as f64.
fn decode_f64(dtype: DType, src: &[u8], out: &mut [f64]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = value_f64(dtype, src, i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(dtype: DType, vals: &[f64]) -> Vec<u8> {
        vals.iter()
            .flat_map(|&v| match dtype {
                DType::F32 => (v as f32).to_le_bytes().to_vec(),
                DType::F64 => v.to_le_bytes().to_vec(),
                DType::BF16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
                DType::I64 => (v as i64).to_le_bytes().to_vec(),
                DType::I32 => (v as i32).to_le_bytes().to_vec(),
                _ => unimplemented!("{dtype}"),
            })
            .collect()
    }

    fn compare_bufs(
        a: (DType, &[u8]),
        b: (DType, &[u8]),
        n: u64,
        tol: Tolerance,
    ) -> (u64, Option<u64>, f64) {
        let sources = [Source::Bytes(a.1), Source::Bytes(b.1)];
        let whole = |file, dtype| {
            vec![ChunkRef {
                file,
                offset: 0,
                region: Region::Flat { start: 0, len: n },
                dtype,
            }]
        };
        let c = compare(&sources, &[n], &whole(0, a.0), &whole(1, b.0), tol).unwrap();
        (c.n_diff, c.first_diff, c.max_abs_diff)
    }

    #[test]
    fn compare_modes_treat_nan_inf_and_tolerance_as_documented() {
        let inf = f64::INFINITY;
        let a = floats(DType::F32, &[1.0, f64::NAN, inf, 1.0, 100.0, 0.0, -inf]);
        let b = floats(
            DType::F32,
            &[1.0, f64::NAN, inf, 1.0 + 1e-6, 100.5, -0.0, inf],
        );
        let n = 7;
        // Exact, same dtype: bits. 1+1e-6, 100.5, -0.0 and -inf differ.
        let (d, first, max) = compare_bufs((DType::F32, &a), (DType::F32, &b), n, Tolerance::EXACT);
        assert_eq!((d, first, max), (4, Some(3), inf));
        // Tolerance: 1e-6 is within atol, 0.5 within rtol of 100.5; -inf vs inf never.
        let tol = Tolerance {
            atol: 1e-5,
            rtol: 0.01,
            exact: false,
        };
        let (d, first, _) = compare_bufs((DType::F32, &a), (DType::F32, &b), n, tol);
        assert_eq!((d, first), (1, Some(6)));
        let tight = Tolerance {
            atol: 1e-5,
            rtol: 0.0,
            exact: false,
        };
        assert_eq!(
            compare_bufs((DType::F32, &a), (DType::F32, &b), n, tight).0,
            2
        );
        // Exact across dtypes compares values: bfloat16 copies of exact values match.
        let vals = [0.5, -3.0, f64::NAN, inf, 1e30];
        let f = floats(DType::F32, &vals);
        let h = floats(DType::BF16, &vals);
        let (d, first, _) = compare_bufs((DType::F32, &f), (DType::BF16, &h), 5, Tolerance::EXACT);
        assert_eq!((d, first), (1, Some(4)), "1e30 is not exact in bfloat16");
        // A NaN against a number differs, with an infinite difference.
        let x = floats(DType::F64, &[f64::NAN, 2.0]);
        let y = floats(DType::F64, &[1.0, 2.0]);
        assert_eq!(
            compare_bufs((DType::F64, &x), (DType::F64, &y), 2, tol),
            (1, Some(0), inf)
        );
    }

    #[test]
    fn integers_compare_exactly_in_both_modes() {
        let a = floats(DType::I64, &[1.0, 2.0, 3.0, -4.0]);
        let b = floats(DType::I64, &[1.0, 2.0, 4.0, -4.0]);
        let loose = Tolerance {
            atol: 10.0,
            rtol: 1.0,
            exact: false,
        };
        assert_eq!(
            compare_bufs((DType::I64, &a), (DType::I64, &b), 4, loose),
            (1, Some(2), 1.0)
        );
        let c = floats(DType::I32, &[1.0, 2.0, 3.0, -7.0]);
        assert_eq!(
            compare_bufs((DType::I64, &a), (DType::I32, &c), 4, loose),
            (1, Some(3), 3.0)
        );
        let f = floats(DType::F32, &[1.0, 2.5, 3.0, -4.0]);
        assert_eq!(
            compare_bufs((DType::I64, &a), (DType::F32, &f), 4, loose),
            (1, Some(1), 0.5)
        );
    }

    #[test]
    fn compare_refuses_partial_layouts_and_bad_tolerances() {
        let data = floats(DType::F32, &[1.0; 6]);
        let sources = [Source::Bytes(&data)];
        let chunk = |start, len| ChunkRef {
            file: 0,
            offset: 0,
            region: Region::Flat { start, len },
            dtype: DType::F32,
        };
        let err = compare(
            &sources,
            &[2, 3],
            &[chunk(0, 6)],
            &[chunk(0, 4)],
            Tolerance::EXACT,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the b-side chunks leave 2 of the tensor's 6 elements uncovered, the first at global index [1, 1]"
        );
        let mut short = chunk(0, 6);
        short.offset = 4;
        let msg = compare(
            &sources,
            &[2, 3],
            &[short],
            &[chunk(0, 6)],
            Tolerance::EXACT,
        )
        .unwrap_err()
        .to_string();
        assert!(msg.starts_with("a-side chunk 0: source 0 (an in-memory buffer) is 24 bytes, but the chunk needs bytes 4..28"), "{msg}");
        let bad = Tolerance {
            atol: f64::NAN,
            rtol: 0.0,
            exact: false,
        };
        assert!(compare(&sources, &[6], &[chunk(0, 6)], &[chunk(0, 6)], bad).is_err());
    }

    #[test]
    fn compare_pairs_replicas_once_across_pieces() {
        // 3M elements, so several parallel pieces; B holds the tensor twice
        // (a replica listed second is never compared).
        let n = 3_000_000u64;
        let a: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let mut b = a.clone();
        b.extend_from_slice(&a);
        // Counted: two in the first chunk, one in the replica past the first
        // chunk's end. Not counted: the replica's copy of element 5.
        let n_us = n as usize;
        for i in [1_500_000, 1_048_577, n_us + 2_999_999, n_us + 5] {
            b[i * 4] ^= 1;
        }
        let sources = [Source::Bytes(&a), Source::Bytes(&b)];
        let chunk = |file, offset, start, len| ChunkRef {
            file,
            offset,
            region: Region::Flat { start, len },
            dtype: DType::F32,
        };
        let b_chunks = [chunk(1, 0, 0, 2_000_000), chunk(1, n * 4, 0, n)];
        let c = compare(
            &sources,
            &[n],
            &[chunk(0, 0, 0, n)],
            &b_chunks,
            Tolerance::EXACT,
        )
        .unwrap();
        assert_eq!((c.n_diff, c.first_diff), (3, Some(1_048_577)));
        assert!(c.max_abs_diff > 0.0);
    }
}
