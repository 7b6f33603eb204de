//! Chunk geometry: where a piece of a logical tensor sits, and which element
//! runs move between two pieces of the same tensor.
//!
//! A logical tensor has a global shape, flattened row-major (C order). A chunk
//! stores one [`Region`] of it in its own contiguous storage: an N-d box, stored
//! row-major within the box (whole tensors, DCP chunks, FSDP2 dim-0 shards), or
//! a 1-D range of the flattened tensor (DeepSpeed ZeRO flat partitions).
//! [`copy_runs`] intersects two regions and lists the element runs to copy from
//! the source chunk's storage into the target chunk's storage. Offsets count
//! elements, not bytes: the caller scales by the item size and handles casts.
//!
//! Written by hand because no library does this: ndarray-style slicing works on
//! strided views of one in-memory array, not between two independent storages,
//! and knows no flat-range chunks.

use thiserror::Error;

/// The part of a logical tensor that one chunk holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Region {
    /// `offsets[d] .. offsets[d] + sizes[d]` in every dimension `d`; the chunk
    /// stores the box row-major (its own strides, not the tensor's).
    Box { offsets: Vec<u64>, sizes: Vec<u64> },
    /// Elements `start .. start + len` of the tensor flattened row-major.
    Flat { start: u64, len: u64 },
}

/// One copy: `len` elements from element `src_elem` of the source chunk's
/// storage to element `dst_elem` of the target chunk's storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Run {
    pub src_elem: u64,
    pub dst_elem: u64,
    pub len: u64,
}

/// A region or a shape that cannot describe part of the tensor.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RegionError {
    #[error("the tensor shape {shape:?} has more than 2^64 elements")]
    ShapeTooLarge { shape: Vec<u64> },
    #[error("a box has {offsets} offsets but {sizes} sizes; it needs one of each per dimension")]
    BoxArity { offsets: usize, sizes: usize },
    #[error("a box of rank {region} cannot lie in a tensor of rank {tensor}")]
    RankMismatch { region: usize, tensor: usize },
    #[error(
        "a box reaches past dimension {dim} of the tensor: offset {offset} + size {size} > {extent}"
    )]
    BoxOutOfBounds {
        dim: usize,
        offset: u64,
        size: u64,
        extent: u64,
    },
    #[error(
        "a flat range of {len} elements at {start} reaches past the tensor's {numel} elements"
    )]
    FlatOutOfBounds { start: u64, len: u64, numel: u64 },
}

impl Region {
    /// The box covering the whole tensor.
    pub fn whole(shape: &[u64]) -> Region {
        Region::Box {
            offsets: vec![0; shape.len()],
            sizes: shape.to_vec(),
        }
    }

    /// Checks that the region lies inside a tensor of this shape and returns
    /// its number of elements (the length of the chunk's storage).
    pub fn validate(&self, shape: &[u64]) -> Result<u64, RegionError> {
        let total = numel(shape)?;
        match self {
            Region::Box { offsets, sizes } => {
                if offsets.len() != sizes.len() {
                    return Err(RegionError::BoxArity {
                        offsets: offsets.len(),
                        sizes: sizes.len(),
                    });
                }
                if offsets.len() != shape.len() {
                    return Err(RegionError::RankMismatch {
                        region: offsets.len(),
                        tensor: shape.len(),
                    });
                }
                for (dim, ((&offset, &size), &extent)) in
                    offsets.iter().zip(sizes).zip(shape).enumerate()
                {
                    if offset.checked_add(size).is_none_or(|end| end > extent) {
                        return Err(RegionError::BoxOutOfBounds {
                            dim,
                            offset,
                            size,
                            extent,
                        });
                    }
                }
                // Every size is at most its extent, so the product fits when the tensor's does.
                Ok(sizes.iter().product())
            }
            &Region::Flat { start, len } => {
                if start.checked_add(len).is_none_or(|end| end > total) {
                    return Err(RegionError::FlatOutOfBounds {
                        start,
                        len,
                        numel: total,
                    });
                }
                Ok(len)
            }
        }
    }

    /// The global multi-index of element `elem` of this region's storage.
    /// The region must be valid for `shape` and `elem` below its length.
    pub fn global_index(&self, shape: &[u64], elem: u64) -> Vec<u64> {
        let mut index = vec![0; shape.len()];
        match self {
            Region::Box { offsets, sizes } => {
                unravel(elem, sizes, &mut index);
                for (i, off) in index.iter_mut().zip(offsets) {
                    *i += off;
                }
            }
            Region::Flat { start, .. } => unravel(start + elem, shape, &mut index),
        }
        index
    }
}

/// The number of elements of a tensor of this shape (1 for rank 0).
pub fn numel(shape: &[u64]) -> Result<u64, RegionError> {
    // A zero extent anywhere makes the tensor empty, however large the others.
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| RegionError::ShapeTooLarge {
            shape: shape.to_vec(),
        })
}

/// The runs that copy every element the two regions share from the source
/// chunk's storage into the target chunk's storage: sorted by `dst_elem`,
/// non-overlapping, and maximal (no two consecutive runs could be one).
pub fn copy_runs(shape: &[u64], src: &Region, dst: &Region) -> Result<Vec<Run>, RegionError> {
    src.validate(shape)?;
    dst.validate(shape)?;
    Ok(copy_runs_unchecked(shape, src, dst))
}

/// [`copy_runs`] for regions already validated against `shape`.
pub(crate) fn copy_runs_unchecked(shape: &[u64], src: &Region, dst: &Region) -> Vec<Run> {
    let runs = match (src, dst) {
        (&Region::Flat { start: a, len: la }, &Region::Flat { start: b, len: lb }) => {
            let lo = a.max(b);
            let hi = (a + la).min(b + lb);
            if lo < hi {
                vec![Run {
                    src_elem: lo - a,
                    dst_elem: lo - b,
                    len: hi - lo,
                }]
            } else {
                Vec::new()
            }
        }
        (
            Region::Box {
                offsets: so,
                sizes: ss,
            },
            Region::Box {
                offsets: to,
                sizes: ts,
            },
        ) => box_box(so, ss, to, ts),
        (Region::Box { offsets, sizes }, &Region::Flat { start, len }) => {
            box_segments(shape, offsets, sizes, start, start + len)
                .map(|s| Run {
                    src_elem: s.local,
                    dst_elem: s.global - start,
                    len: s.len,
                })
                .collect()
        }
        (&Region::Flat { start, len }, Region::Box { offsets, sizes }) => {
            box_segments(shape, offsets, sizes, start, start + len)
                .map(|s| Run {
                    src_elem: s.global - start,
                    dst_elem: s.local,
                    len: s.len,
                })
                .collect()
        }
    };
    debug_assert!(runs.is_sorted_by_key(|r| r.dst_elem));
    merge_adjacent(runs)
}

/// Joins consecutive runs that continue each other in both storages.
fn merge_adjacent(runs: Vec<Run>) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for run in runs {
        match out.last_mut() {
            Some(last)
                if last.src_elem + last.len == run.src_elem
                    && last.dst_elem + last.len == run.dst_elem =>
            {
                last.len += run.len;
            }
            _ => out.push(run),
        }
    }
    out
}

/// Row-major strides of a dense array with these extents.
fn strides(dims: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * dims[d + 1];
    }
    s
}

/// Writes the row-major multi-index of `i` within `dims` into `out`.
fn unravel(mut i: u64, dims: &[u64], out: &mut [u64]) {
    for (o, &d) in out.iter_mut().zip(dims).rev() {
        *o = i % d;
        i /= d;
    }
}

/// The first dimension of the block that stays contiguous: every dimension
/// after it is taken whole (`inner[d] == outer[d]` for each pair). Rank 0 gives 0.
fn block_start(inner: &[u64], outers: &[&[u64]]) -> usize {
    let mut j = inner.len().saturating_sub(1);
    while j > 0 && outers.iter().all(|o| o[j] == inner[j]) {
        j -= 1;
    }
    j
}

/// Box ∩ box: the intersection is a box; its rows over the dimensions that
/// both chunks hold whole are contiguous in both storages.
fn box_box(so: &[u64], ss: &[u64], to: &[u64], ts: &[u64]) -> Vec<Run> {
    let n = so.len();
    let mut lo = vec![0u64; n];
    let mut size = vec![0u64; n];
    for d in 0..n {
        let l = so[d].max(to[d]);
        let h = (so[d] + ss[d]).min(to[d] + ts[d]);
        if h <= l {
            return Vec::new();
        }
        lo[d] = l;
        size[d] = h - l;
    }
    // Both boxes are non-empty here, so their strides fit in u64.
    let (s_stride, t_stride) = (strides(ss), strides(ts));
    let j = block_start(&size, &[ss, ts]);
    let len: u64 = size[j..].iter().product();
    let s0: u64 = (0..n).map(|d| (lo[d] - so[d]) * s_stride[d]).sum();
    let t0: u64 = (0..n).map(|d| (lo[d] - to[d]) * t_stride[d]).sum();
    let outer = &size[..j];
    let count: u64 = outer.iter().product();
    let mut m = vec![0u64; j];
    (0..count)
        .map(|i| {
            unravel(i, outer, &mut m);
            let dot = |st: &[u64]| m.iter().zip(st).map(|(a, b)| a * b).sum::<u64>();
            Run {
                src_elem: s0 + dot(&s_stride),
                dst_elem: t0 + dot(&t_stride),
                len,
            }
        })
        .collect()
}

/// A stretch of a box that is contiguous both in the flattened tensor
/// (`global`) and in the box's own storage (`local`).
struct Segment {
    global: u64,
    local: u64,
    len: u64,
}

/// The parts of a box inside the flat range `[lo, hi)`, in increasing order.
/// Segments outside the range are skipped by binary search, so a small flat
/// chunk against a large box costs only what it overlaps.
fn box_segments<'a>(
    shape: &'a [u64],
    offsets: &'a [u64],
    sizes: &'a [u64],
    lo: u64,
    hi: u64,
) -> impl Iterator<Item = Segment> + 'a {
    let empty = lo >= hi || sizes.contains(&0);
    // A non-empty box means a non-empty tensor, so the tensor's strides fit.
    let g_stride = if empty { Vec::new() } else { strides(shape) };
    let j = block_start(sizes, &[shape]);
    let block: u64 = sizes[j..].iter().product();
    let outer = &sizes[..j];
    let count: u64 = if empty { 0 } else { outer.iter().product() };
    let base: u64 = offsets.iter().zip(&g_stride).map(|(o, s)| o * s).sum();
    let mut m = vec![0u64; j];
    let mut start_of = move |i: u64| -> u64 {
        unravel(i, outer, &mut m);
        base + m.iter().zip(&g_stride).map(|(a, b)| a * b).sum::<u64>()
    };
    // First segment that ends after `lo`; segment starts increase with i.
    let (mut a, mut b) = (0u64, count);
    while a < b {
        let mid = a + (b - a) / 2;
        if start_of(mid) + block <= lo {
            a = mid + 1;
        } else {
            b = mid;
        }
    }
    (a..count)
        .map(move |i| (i, start_of(i)))
        .take_while(move |&(_, g)| g < hi)
        .map(move |(i, g)| {
            let s = g.max(lo);
            let e = (g + block).min(hi);
            Segment {
                global: s,
                local: i * block + (s - g),
                len: e - s,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bx(offsets: &[u64], sizes: &[u64]) -> Region {
        Region::Box {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
        }
    }

    fn flat(start: u64, len: u64) -> Region {
        Region::Flat { start, len }
    }

    fn run(src_elem: u64, dst_elem: u64, len: u64) -> Run {
        Run {
            src_elem,
            dst_elem,
            len,
        }
    }

    #[test]
    fn whole_to_whole_is_one_run() {
        let shape = [3, 4, 5];
        let w = Region::whole(&shape);
        assert_eq!(copy_runs(&shape, &w, &w).unwrap(), vec![run(0, 0, 60)]);
    }

    #[test]
    fn rows_covering_trailing_dims_are_one_run() {
        // Rows 1..3 of a 4x3 tensor: one stretch of 6 elements, not two rows.
        let shape = [4, 3];
        let runs = copy_runs(&shape, &Region::whole(&shape), &bx(&[1, 0], &[2, 3])).unwrap();
        assert_eq!(runs, vec![run(3, 0, 6)]);
    }

    #[test]
    fn identical_partial_boxes_are_one_run() {
        // Not contiguous in the tensor, but both storages hold the same box.
        let shape = [4, 4];
        let b = bx(&[1, 1], &[2, 2]);
        assert_eq!(copy_runs(&shape, &b, &b).unwrap(), vec![run(0, 0, 4)]);
    }

    #[test]
    fn column_split_gives_a_run_per_row() {
        let shape = [2, 4];
        let runs = copy_runs(&shape, &Region::whole(&shape), &bx(&[0, 1], &[2, 2])).unwrap();
        assert_eq!(runs, vec![run(1, 0, 2), run(5, 2, 2)]);
        let back = copy_runs(&shape, &bx(&[0, 1], &[2, 2]), &Region::whole(&shape)).unwrap();
        assert_eq!(back, vec![run(0, 1, 2), run(2, 5, 2)]);
    }

    #[test]
    fn box_into_flat_and_back() {
        // 3x4 tensor; box rows 0..3, cols 1..3; flat range [2, 9).
        let shape = [3, 4];
        let b = bx(&[0, 1], &[3, 2]);
        let f = flat(2, 7);
        // Box elements at global 1,2 | 5,6 | 9,10 → inside [2,9): 2 | 5,6.
        assert_eq!(
            copy_runs(&shape, &b, &f).unwrap(),
            vec![run(1, 0, 1), run(2, 3, 2)]
        );
        assert_eq!(
            copy_runs(&shape, &f, &b).unwrap(),
            vec![run(0, 1, 1), run(3, 2, 2)]
        );
    }

    #[test]
    fn flat_range_starting_where_a_box_row_ends() {
        // Box rows cover global 0..2 and 3..5; the range starts at 2, right
        // after the first row: no empty run for that row.
        let shape = [2, 3];
        let runs = copy_runs(&shape, &bx(&[0, 0], &[2, 2]), &flat(2, 4)).unwrap();
        assert_eq!(runs, vec![run(2, 1, 2)]);
    }

    #[test]
    fn flat_ranges_overlap_in_one_run() {
        let shape = [10];
        assert_eq!(
            copy_runs(&shape, &flat(2, 5), &flat(4, 6)).unwrap(),
            vec![run(2, 0, 3)]
        );
        assert!(copy_runs(&shape, &flat(0, 4), &flat(4, 6))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn flat_against_whole_trailing_box_is_one_run() {
        let shape = [4, 3];
        let runs = copy_runs(&shape, &flat(4, 5), &bx(&[1, 0], &[3, 3])).unwrap();
        assert_eq!(runs, vec![run(0, 1, 5)]);
    }

    #[test]
    fn rank_zero_is_one_element() {
        let shape: [u64; 0] = [];
        let w = Region::whole(&shape);
        assert_eq!(
            copy_runs(&shape, &w, &flat(0, 1)).unwrap(),
            vec![run(0, 0, 1)]
        );
        assert_eq!(
            copy_runs(&shape, &flat(0, 1), &w).unwrap(),
            vec![run(0, 0, 1)]
        );
        assert!(copy_runs(&shape, &flat(1, 0), &w).unwrap().is_empty());
    }

    #[test]
    fn zero_size_dims_give_no_runs() {
        let shape = [3, 0, 2];
        let w = Region::whole(&shape);
        assert_eq!(w.validate(&shape), Ok(0));
        assert!(copy_runs(&shape, &w, &w).unwrap().is_empty());
        assert!(copy_runs(&shape, &w, &flat(0, 0)).unwrap().is_empty());
        let shape = [3, 2];
        assert!(
            copy_runs(&shape, &bx(&[1, 0], &[0, 2]), &Region::whole(&shape))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn huge_shape_with_a_zero_dim_is_empty_not_overflow() {
        assert_eq!(numel(&[1 << 40, 1 << 40, 0]), Ok(0));
        let err = numel(&[1 << 40, 1 << 40]).unwrap_err();
        assert!(matches!(err, RegionError::ShapeTooLarge { .. }));
    }

    #[test]
    fn invalid_regions_are_typed_errors() {
        let shape = [4, 3];
        let w = Region::whole(&shape);
        assert_eq!(
            copy_runs(&shape, &bx(&[0], &[4]), &w),
            Err(RegionError::RankMismatch {
                region: 1,
                tensor: 2
            })
        );
        assert_eq!(
            copy_runs(&shape, &w, &bx(&[0, 0], &[4])),
            Err(RegionError::BoxArity {
                offsets: 2,
                sizes: 1
            })
        );
        assert_eq!(
            copy_runs(&shape, &bx(&[0, 2], &[4, 2]), &w),
            Err(RegionError::BoxOutOfBounds {
                dim: 1,
                offset: 2,
                size: 2,
                extent: 3
            })
        );
        assert_eq!(
            copy_runs(&shape, &w, &bx(&[u64::MAX, 0], &[2, 1])),
            Err(RegionError::BoxOutOfBounds {
                dim: 0,
                offset: u64::MAX,
                size: 2,
                extent: 4
            })
        );
        assert_eq!(
            copy_runs(&shape, &flat(10, 3), &w),
            Err(RegionError::FlatOutOfBounds {
                start: 10,
                len: 3,
                numel: 12
            })
        );
        assert!(copy_runs(&shape, &flat(u64::MAX, 2), &w).is_err());
        assert!(copy_runs(&shape, &flat(12, 0), &w).unwrap().is_empty());
    }

    #[test]
    fn error_messages_read_as_sentences() {
        let err = bx(&[0, 2], &[4, 2]).validate(&[4, 3]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "a box reaches past dimension 1 of the tensor: offset 2 + size 2 > 3"
        );
    }

    #[test]
    fn global_index_of_box_and_flat_elements() {
        let shape = [3, 4];
        assert_eq!(bx(&[1, 1], &[2, 3]).global_index(&shape, 4), vec![2, 2]);
        assert_eq!(flat(5, 4).global_index(&shape, 2), vec![1, 3]);
    }

    #[test]
    fn small_flat_range_in_a_large_box_skips_far_segments() {
        // 1,000,000 rows of 3 columns, box holds column 1 only: the flat range
        // covers rows 500000..500002 and must yield just those two runs.
        let shape = [1_000_000, 3];
        let b = bx(&[0, 1], &[1_000_000, 1]);
        let f = flat(1_500_000, 6);
        let runs = copy_runs(&shape, &b, &f).unwrap();
        assert_eq!(runs, vec![run(500_000, 1, 1), run(500_001, 4, 1)]);
    }
}
