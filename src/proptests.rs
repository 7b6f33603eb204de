//! Property tests for the geometry and the planner, against a brute-force
//! per-element reference on small tensors (rank 0 to 4, zero extents included).

use std::collections::BTreeMap;

use proptest::prelude::*;

use crate::geometry::{copy_runs, numel, Region, Run};
use crate::plan::{plan, Chunk, PlanError, TargetPlan};

// ---------------------------------------------------------------- reference

fn unravel(mut g: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for (i, &d) in idx.iter_mut().zip(shape).rev() {
        *i = g % d;
        g /= d;
    }
    idx
}

/// Where global element `g` (multi-index `idx`) sits in the region's storage.
fn local_of(region: &Region, idx: &[u64], g: u64) -> Option<u64> {
    match region {
        Region::Box { offsets, sizes } => {
            let mut local = 0;
            for ((&i, &o), &s) in idx.iter().zip(offsets).zip(sizes) {
                if i < o || i >= o + s {
                    return None;
                }
                local = local * s + (i - o);
            }
            Some(local)
        }
        &Region::Flat { start, len } => (start <= g && g < start + len).then(|| g - start),
    }
}

/// Global flat index of every element of the region's storage, in storage order.
pub(crate) fn contents(shape: &[u64], region: &Region) -> Vec<u64> {
    let mut out = vec![u64::MAX; region.validate(shape).unwrap() as usize];
    for g in 0..numel(shape).unwrap() {
        if let Some(l) = local_of(region, &unravel(g, shape), g) {
            out[l as usize] = g;
        }
    }
    assert!(out.iter().all(|&g| g != u64::MAX));
    out
}

/// dst element -> src element, one per element the regions share.
fn reference_map(shape: &[u64], src: &Region, dst: &Region) -> BTreeMap<u64, u64> {
    let mut m = BTreeMap::new();
    for g in 0..numel(shape).unwrap() {
        let idx = unravel(g, shape);
        if let (Some(s), Some(d)) = (local_of(src, &idx, g), local_of(dst, &idx, g)) {
            m.insert(d, s);
        }
    }
    m
}

/// Checks the shape of a run list (bounds, order, no overlap, maximality) and
/// returns its dst -> src element map.
fn check_runs<'a>(
    runs: impl IntoIterator<Item = (usize, &'a Run)>,
    src_len: impl Fn(usize) -> u64,
    dst_len: u64,
) -> BTreeMap<u64, (usize, u64)> {
    let mut map = BTreeMap::new();
    let mut prev: Option<(usize, Run)> = None;
    for (source, r) in runs {
        assert!(r.len > 0, "empty run {r:?}");
        assert!(
            r.src_elem + r.len <= src_len(source),
            "{r:?} past its source"
        );
        assert!(r.dst_elem + r.len <= dst_len, "{r:?} past its target");
        if let Some((ps, p)) = prev {
            assert!(
                p.dst_elem + p.len <= r.dst_elem,
                "unsorted or overlapping: {p:?} {r:?}"
            );
            let continues = p.src_elem + p.len == r.src_elem && p.dst_elem + p.len == r.dst_elem;
            assert!(!(ps == source && continues), "not maximal: {p:?} {r:?}");
        }
        for k in 0..r.len {
            assert!(map
                .insert(r.dst_elem + k, (source, r.src_elem + k))
                .is_none());
        }
        prev = Some((source, *r));
    }
    map
}

// ---------------------------------------------------------------- strategies

/// Rank 0 to 4, extents up to 4; zero extents are kept rare, since one makes
/// the whole tensor empty.
pub(crate) fn shape() -> impl Strategy<Value = Vec<u64>> {
    let extent = prop_oneof![1 => Just(0u64), 8 => 1u64..=4];
    prop::collection::vec(extent, 0..=4)
}

fn region(shape: &[u64]) -> BoxedStrategy<Region> {
    let total = numel(shape).unwrap();
    let boxes = shape
        .iter()
        .map(|&d| (0..=d).prop_flat_map(move |o| (Just(o), 0..=d - o)))
        .collect::<Vec<_>>()
        .prop_map(|dims| Region::Box {
            offsets: dims.iter().map(|p| p.0).collect(),
            sizes: dims.iter().map(|p| p.1).collect(),
        });
    let flats = (0..=total)
        .prop_flat_map(move |s| (Just(s), 0..=total - s))
        .prop_map(|(start, len)| Region::Flat { start, len });
    prop_oneof![Just(Region::whole(shape)), boxes, flats].boxed()
}

fn regions(shape: &[u64], n: std::ops::RangeInclusive<usize>) -> BoxedStrategy<Vec<Region>> {
    prop::collection::vec(region(shape), n).boxed()
}

/// Pieces `[a, b)` of `[lo, hi)` cut at the chosen points.
fn cut(lo: u64, hi: u64, points: &[u64]) -> Vec<(u64, u64)> {
    let mut p: Vec<u64> = points
        .iter()
        .copied()
        .filter(|&x| lo < x && x < hi)
        .collect();
    p.sort_unstable();
    p.dedup();
    let mut edges = vec![lo];
    edges.extend(p);
    edges.push(hi);
    edges.windows(2).map(|w| (w[0], w[1])).collect()
}

/// A chunking that holds every element exactly once: rows `0..c` as flat
/// ranges (ZeRO-like, cut anywhere, empty pieces allowed) and rows `c..` as a
/// grid of boxes cut in every dimension.
fn tiling(shape: &[u64]) -> BoxedStrategy<Vec<Region>> {
    let shape = shape.to_vec();
    let total = numel(&shape).unwrap();
    let rows = shape.first().copied().unwrap_or(1);
    let grid_cuts = shape
        .iter()
        .map(|&d| prop::collection::vec(0..=d, 0..=2))
        .collect::<Vec<_>>();
    (0..=rows, grid_cuts, prop::collection::vec(0..=total, 0..=3))
        .prop_map(move |(c, grid_cuts, flat_cuts)| {
            if shape.is_empty() {
                // Rank 0: one element, held whole or as a flat range.
                return vec![if c == 0 {
                    Region::whole(&shape)
                } else {
                    Region::Flat { start: 0, len: 1 }
                }];
            }
            let inner = total.checked_div(rows).unwrap_or(0);
            let mut out: Vec<Region> = cut(0, c * inner, &flat_cuts)
                .into_iter()
                .map(|(a, b)| Region::Flat {
                    start: a,
                    len: b - a,
                })
                .collect();
            let mut boxes = vec![(Vec::new(), Vec::new())];
            for (d, &extent) in shape.iter().enumerate() {
                let lo = if d == 0 { c } else { 0 };
                let pieces = cut(lo, extent, &grid_cuts[d]);
                boxes = boxes
                    .into_iter()
                    .flat_map(|(o, s): (Vec<u64>, Vec<u64>)| {
                        pieces.iter().map(move |&(a, b)| {
                            let (mut o, mut s) = (o.clone(), s.clone());
                            o.push(a);
                            s.push(b - a);
                            (o, s)
                        })
                    })
                    .collect();
            }
            out.extend(
                boxes
                    .into_iter()
                    .map(|(offsets, sizes)| Region::Box { offsets, sizes }),
            );
            out
        })
        .boxed()
}

/// A tiling, plus up to two replica regions, in shuffled order.
pub(crate) fn layout(shape: &[u64]) -> BoxedStrategy<Vec<Region>> {
    (tiling(shape), regions(shape, 0..=2))
        .prop_map(|(mut t, extra)| {
            t.extend(extra);
            t
        })
        .prop_shuffle()
        .boxed()
}

fn chunks(regions: &[Region]) -> Vec<Chunk> {
    regions
        .iter()
        .enumerate()
        .map(|(id, region)| Chunk {
            id,
            region: region.clone(),
        })
        .collect()
}

/// Runs the plan on real buffers, as the executor will.
fn execute(plans: &[TargetPlan], sources: &[Vec<u32>], targets: &mut [Vec<u32>]) {
    for p in plans {
        let dst = &mut targets[p.target_id];
        for r in &p.runs {
            let (s, d, n) = (
                r.run.src_elem as usize,
                r.run.dst_elem as usize,
                r.run.len as usize,
            );
            dst[d..d + n].copy_from_slice(&sources[r.source_id][s..s + n]);
        }
    }
}

// ---------------------------------------------------------------- properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn copy_runs_match_per_element_reference(
        (shape, src, dst) in shape().prop_flat_map(|s| (Just(s.clone()), region(&s), region(&s)))
    ) {
        let runs = copy_runs(&shape, &src, &dst).unwrap();
        prop_assert_eq!(&runs, &copy_runs(&shape, &src, &dst).unwrap(), "not deterministic");
        let (src_len, dst_len) = (src.validate(&shape).unwrap(), dst.validate(&shape).unwrap());
        let got: BTreeMap<u64, u64> = check_runs(runs.iter().map(|r| (0, r)), |_| src_len, dst_len)
            .into_iter()
            .map(|(d, (_, s))| (d, s))
            .collect();
        prop_assert_eq!(got, reference_map(&shape, &src, &dst));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn plan_fills_each_target_element_once_from_the_first_source(
        (shape, sources, targets) in shape().prop_flat_map(|s| {
            let srcs = (regions(&s, 0..=3), prop::option::of(tiling(&s)))
                .prop_map(|(mut r, t)| { r.extend(t.unwrap_or_default()); r })
                .prop_shuffle();
            (Just(s.clone()), srcs, regions(&s, 1..=3))
        })
    ) {
        let (src_chunks, dst_chunks) = (chunks(&sources), chunks(&targets));
        let result = plan(&shape, &src_chunks, &dst_chunks);
        prop_assert_eq!(&result, &plan(&shape, &src_chunks, &dst_chunks), "not deterministic");

        // Reference: per target element, the first listed source holding it.
        let mut first_hole: Option<(usize, u64, Vec<u64>)> = None;
        let mut expected = Vec::new();
        for (t, target) in targets.iter().enumerate() {
            let mut want = BTreeMap::new();
            let (mut missing, mut first) = (0, None);
            for (d, g) in contents(&shape, target).into_iter().enumerate() {
                let idx = unravel(g, &shape);
                let hit = sources
                    .iter()
                    .enumerate()
                    .find_map(|(i, s)| local_of(s, &idx, g).map(|l| (i, l)));
                match hit {
                    Some(hit) => { want.insert(d as u64, hit); }
                    None => { missing += 1; first.get_or_insert(idx); }
                }
            }
            expected.push(want);
            if let Some(idx) = first {
                first_hole = Some((t, missing, idx));
                break;
            }
        }

        match (result, first_hole) {
            (Ok(plans), None) => {
                prop_assert_eq!(plans.len(), targets.len());
                for (t, p) in plans.iter().enumerate() {
                    prop_assert_eq!(p.target_id, t);
                    let len = targets[t].validate(&shape).unwrap();
                    let got = check_runs(
                        p.runs.iter().map(|r| (r.source_id, &r.run)),
                        |s| sources[s].validate(&shape).unwrap(),
                        len,
                    );
                    prop_assert_eq!(got.len() as u64, len);
                    prop_assert_eq!(&got, &expected[t]);
                }
            }
            (Err(PlanError::Uncovered { target_id, missing, len, first_missing }), Some((t, m, idx))) => {
                prop_assert_eq!(target_id, t);
                prop_assert_eq!(missing, m);
                prop_assert_eq!(len, targets[t].validate(&shape).unwrap());
                prop_assert_eq!(first_missing, idx);
            }
            (other, hole) => prop_assert!(false, "plan gave {:?}, reference hole {:?}", other, hole),
        }
    }

    #[test]
    fn plan_a_to_b_to_a_is_the_identity(
        (shape, a, b) in shape().prop_flat_map(|s| (Just(s.clone()), layout(&s), layout(&s)))
    ) {
        let (a_chunks, b_chunks) = (chunks(&a), chunks(&b));
        // Every element holds its own global index.
        let a_bufs: Vec<Vec<u32>> = a
            .iter()
            .map(|r| contents(&shape, r).into_iter().map(|g| g as u32).collect())
            .collect();
        let blank = |layout: &[Region]| -> Vec<Vec<u32>> {
            layout.iter().map(|r| vec![u32::MAX; r.validate(&shape).unwrap() as usize]).collect()
        };

        let mut b_bufs = blank(&b);
        execute(&plan(&shape, &a_chunks, &b_chunks).unwrap(), &a_bufs, &mut b_bufs);
        for (region, buf) in b.iter().zip(&b_bufs) {
            let want: Vec<u32> = contents(&shape, region).into_iter().map(|g| g as u32).collect();
            prop_assert_eq!(buf, &want);
        }

        let mut back = blank(&a);
        execute(&plan(&shape, &b_chunks, &a_chunks).unwrap(), &b_bufs, &mut back);
        prop_assert_eq!(back, a_bufs);
    }
}
