//! The reshard plan for one logical tensor: which runs of which source chunk
//! fill each target chunk.
//!
//! Every target element is written exactly once. Where several source chunks
//! hold the same element (replicas: DDP copies, DCP's replicated entries,
//! overlapping chunkings), the one listed first wins, so the plan depends only
//! on the inputs and their order. A target element that no source holds is an
//! error, never a silent hole.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::geometry::{copy_runs_unchecked, numel, Region, RegionError, Run};

/// One chunk of the tensor: the region it holds and the caller's name for it
/// (typically an index into the caller's own table of files and offsets).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Chunk {
    pub id: usize,
    pub region: Region,
}

/// A copy run together with the source chunk it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourcedRun {
    pub source_id: usize,
    pub run: Run,
}

/// Everything that fills one target chunk: runs sorted by `run.dst_elem`,
/// tiling `0 .. len` of the target's storage exactly once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetPlan {
    pub target_id: usize,
    pub runs: Vec<SourcedRun>,
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    #[error(transparent)]
    Shape(#[from] RegionError),
    #[error("source chunk {id}: {error}")]
    Source { id: usize, error: RegionError },
    #[error("target chunk {id}: {error}")]
    Target { id: usize, error: RegionError },
    #[error(
        "target chunk {target_id}: {missing} of its {len} elements are in no source chunk, \
         the first at global index {first_missing:?}"
    )]
    Uncovered {
        target_id: usize,
        missing: u64,
        len: u64,
        first_missing: Vec<u64>,
    },
}

/// Plans the copies that fill every target chunk from the source chunks of
/// one tensor of global shape `shape`. Returns one [`TargetPlan`] per target,
/// in the order of `targets`.
pub fn plan(
    shape: &[u64],
    sources: &[Chunk],
    targets: &[Chunk],
) -> Result<Vec<TargetPlan>, PlanError> {
    numel(shape)?;
    for s in sources {
        s.region
            .validate(shape)
            .map_err(|error| PlanError::Source { id: s.id, error })?;
    }
    targets
        .iter()
        .map(|t| {
            let len = t
                .region
                .validate(shape)
                .map_err(|error| PlanError::Target { id: t.id, error })?;
            plan_target(shape, sources, t, len)
        })
        .collect()
}

fn plan_target(
    shape: &[u64],
    sources: &[Chunk],
    target: &Chunk,
    len: u64,
) -> Result<TargetPlan, PlanError> {
    let mut covered = Coverage::default();
    // (position in `sources`, run): ids are the caller's and need not be unique.
    let mut runs: Vec<(usize, Run)> = Vec::new();
    for (index, source) in sources.iter().enumerate() {
        if covered.total == len {
            break;
        }
        for run in copy_runs_unchecked(shape, &source.region, &target.region) {
            let end = run.dst_elem + run.len;
            // Only what earlier sources left open: the first source listed wins.
            for (a, b) in covered.gaps(run.dst_elem, end) {
                covered.insert(a, b);
                let src_elem = run.src_elem + (a - run.dst_elem);
                runs.push((
                    index,
                    Run {
                        src_elem,
                        dst_elem: a,
                        len: b - a,
                    },
                ));
            }
        }
    }
    if covered.total < len {
        let first = covered.gaps(0, len).first().map_or(0, |&(a, _)| a);
        return Err(PlanError::Uncovered {
            target_id: target.id,
            missing: len - covered.total,
            len,
            first_missing: target.region.global_index(shape, first),
        });
    }
    runs.sort_unstable_by_key(|&(_, r)| r.dst_elem);
    let runs = merge_adjacent(runs)
        .into_iter()
        .map(|(index, run)| SourcedRun {
            source_id: sources[index].id,
            run,
        })
        .collect();
    Ok(TargetPlan {
        target_id: target.id,
        runs,
    })
}

/// Joins consecutive runs from the same source chunk that continue each other
/// in both storages. Each source's own runs are already maximal and a gap left
/// by earlier sources cannot join two of them, so this is a safety net that
/// normally changes nothing.
fn merge_adjacent(runs: Vec<(usize, Run)>) -> Vec<(usize, Run)> {
    let mut out: Vec<(usize, Run)> = Vec::with_capacity(runs.len());
    for (index, r) in runs {
        match out.last_mut() {
            Some((last_index, last))
                if *last_index == index
                    && last.src_elem + last.len == r.src_elem
                    && last.dst_elem + last.len == r.dst_elem =>
            {
                last.len += r.len;
            }
            _ => out.push((index, r)),
        }
    }
    out
}

/// The parts of a target's storage already written, as disjoint, coalesced
/// intervals `start -> end`. Coalescing keeps it one entry per hole-free
/// stretch, so the common case (sources that tile the target) stays small.
#[derive(Default)]
struct Coverage {
    intervals: BTreeMap<u64, u64>,
    total: u64,
}

impl Coverage {
    /// The uncovered parts of `[a, b)`, in order.
    fn gaps(&self, a: u64, b: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut cur = a;
        if let Some((_, &end)) = self.intervals.range(..=a).next_back() {
            cur = cur.max(end);
        }
        for (&s, &e) in self.intervals.range(a..b) {
            if s > cur {
                out.push((cur, s));
            }
            cur = cur.max(e);
        }
        if cur < b {
            out.push((cur, b));
        }
        out
    }

    /// Marks `[a, b)` as written; it must be a gap.
    fn insert(&mut self, a: u64, b: u64) {
        let mut start = a;
        let mut end = b;
        if let Some((&s, &e)) = self.intervals.range(..a).next_back() {
            if e == a {
                start = s;
            }
        }
        if let Some(e) = self.intervals.remove(&b) {
            end = e;
        }
        self.intervals.insert(start, end);
        self.total += b - a;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: usize, region: Region) -> Chunk {
        Chunk { id, region }
    }

    fn flat(start: u64, len: u64) -> Region {
        Region::Flat { start, len }
    }

    fn bx(offsets: &[u64], sizes: &[u64]) -> Region {
        Region::Box {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
        }
    }

    fn sr(source_id: usize, src_elem: u64, dst_elem: u64, len: u64) -> SourcedRun {
        SourcedRun {
            source_id,
            run: Run {
                src_elem,
                dst_elem,
                len,
            },
        }
    }

    #[test]
    fn zero_flat_partitions_to_dim0_shards() {
        // A 4x3 tensor saved as two ZeRO-style flat slices of 6 and 6,
        // resharded into dim-0 shards of 1 and 3 rows.
        let shape = [4, 3];
        let sources = [chunk(10, flat(0, 6)), chunk(11, flat(6, 6))];
        let targets = [
            chunk(0, bx(&[0, 0], &[1, 3])),
            chunk(1, bx(&[1, 0], &[3, 3])),
        ];
        let p = plan(&shape, &sources, &targets).unwrap();
        assert_eq!(p[0].target_id, 0);
        assert_eq!(p[0].runs, vec![sr(10, 0, 0, 3)]);
        assert_eq!(p[1].runs, vec![sr(10, 3, 0, 3), sr(11, 0, 3, 6)]);
    }

    #[test]
    fn replicas_first_listed_wins_and_fills_only_gaps() {
        let shape = [8];
        // Source 1 holds 2..5; source 2 (a full replica) fills the rest.
        let sources = [chunk(1, flat(2, 3)), chunk(2, flat(0, 8))];
        let targets = [chunk(0, flat(0, 8))];
        let p = plan(&shape, &sources, &targets).unwrap();
        assert_eq!(
            p[0].runs,
            vec![sr(2, 0, 0, 2), sr(1, 0, 2, 3), sr(2, 5, 5, 3)]
        );
    }

    #[test]
    fn runs_of_different_chunks_never_merge_even_with_equal_ids() {
        let shape = [6];
        let sources = [
            chunk(0, flat(0, 2)),
            chunk(1, flat(4, 2)),
            chunk(0, flat(0, 6)),
        ];
        let p = plan(&shape, &sources, &[chunk(9, flat(0, 6))]).unwrap();
        assert_eq!(
            p[0].runs,
            vec![sr(0, 0, 0, 2), sr(0, 2, 2, 2), sr(1, 0, 4, 2)]
        );
    }

    #[test]
    fn uncovered_target_is_an_error_naming_the_first_hole() {
        let shape = [2, 3];
        let sources = [chunk(0, flat(0, 4))];
        let targets = [chunk(7, Region::whole(&shape))];
        let err = plan(&shape, &sources, &targets).unwrap_err();
        assert_eq!(
            err,
            PlanError::Uncovered {
                target_id: 7,
                missing: 2,
                len: 6,
                first_missing: vec![1, 1],
            }
        );
        assert_eq!(
            err.to_string(),
            "target chunk 7: 2 of its 6 elements are in no source chunk, \
             the first at global index [1, 1]"
        );
    }

    #[test]
    fn invalid_chunks_name_their_side_and_id() {
        let shape = [4];
        let ok = [chunk(0, flat(0, 4))];
        let bad = [chunk(3, flat(2, 3))];
        assert!(matches!(
            plan(&shape, &bad, &ok),
            Err(PlanError::Source { id: 3, .. })
        ));
        let err = plan(&shape, &ok, &bad).unwrap_err();
        assert!(matches!(err, PlanError::Target { id: 3, .. }));
        assert_eq!(
            err.to_string(),
            "target chunk 3: a flat range of 3 elements at 2 reaches past the tensor's 4 elements"
        );
        assert!(matches!(
            plan(&[u64::MAX, 2], &[], &[]),
            Err(PlanError::Shape(RegionError::ShapeTooLarge { .. }))
        ));
    }

    #[test]
    fn empty_targets_need_no_sources() {
        let shape = [0, 5];
        let p = plan(&shape, &[], &[chunk(0, Region::whole(&shape))]).unwrap();
        assert!(p[0].runs.is_empty());
        let p = plan(&[5], &[], &[chunk(0, flat(3, 0))]).unwrap();
        assert!(p[0].runs.is_empty());
    }

    #[test]
    fn coverage_coalesces_and_reports_gaps() {
        let mut c = Coverage::default();
        c.insert(2, 4);
        c.insert(6, 8);
        assert_eq!(c.gaps(0, 10), vec![(0, 2), (4, 6), (8, 10)]);
        assert_eq!(c.gaps(3, 7), vec![(4, 6)]);
        c.insert(4, 6);
        assert_eq!(c.intervals.len(), 1);
        assert_eq!(c.gaps(0, 10), vec![(0, 2), (8, 10)]);
        assert_eq!(c.total, 6);
    }
}
