//! `plan::plan` (and through it `geometry`) from arbitrary shapes and chunk
//! regions: an error, or a plan whose runs tile every target exactly once and
//! stay inside their source chunks, never a panic or an overflow.
#![no_main]

use _core::geometry::{copy_runs, numel};
use _core::plan::{plan, Chunk};
use fuzz_input::Input;
use libfuzzer_sys::fuzz_target;

/// Bounds the work one input may ask for, so that the fuzzer measures
/// correctness, not the size of plans the input legitimately describes.
const MAX_ELEMS: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let shape = inp.shape();
    let rank = shape.len();
    let sources: Vec<Chunk> = (0..inp.count(6)).map(|id| Chunk { id, region: inp.region(rank) }).collect();
    let targets: Vec<Chunk> = (0..inp.count(4)).map(|id| Chunk { id, region: inp.region(rank) }).collect();
    let total = numel(&shape);
    if total.is_ok_and(|n| n > MAX_ELEMS) {
        // big tensors: only the validating paths (no plan is built)
        for c in sources.iter().chain(&targets) {
            let _ = c.region.validate(&shape);
        }
        return;
    }
    for s in &sources {
        for t in &targets {
            let _ = copy_runs(&shape, &s.region, &t.region);
        }
    }
    let Ok(plans) = plan(&shape, &sources, &targets) else { return };
    assert_eq!(plans.len(), targets.len());
    for (p, t) in plans.iter().zip(&targets) {
        let len = t.region.validate(&shape).expect("planned an invalid target");
        let mut runs: Vec<_> = p.runs.iter().map(|r| (r.run.dst_elem, r.run.len, r.source_id, r.run.src_elem)).collect();
        runs.sort();
        let mut next = 0u64;
        for &(dst, n, sid, src) in &runs {
            assert_eq!(dst, next, "target {} not tiled exactly once", t.id);
            assert!(n > 0);
            next = dst + n;
            let slen = sources.iter().find(|s| s.id == sid).map(|s| s.region.validate(&shape).unwrap()).unwrap();
            assert!(src + n <= slen, "run reads past its source chunk");
        }
        assert_eq!(next, len, "target {} not fully covered", t.id);
        if len > 0 {
            // global_index's contract: a valid region and an element below its length
            let g = t.region.global_index(&shape, len - 1);
            assert!(g.iter().zip(&shape).all(|(i, d)| i < d), "global index {g:?} outside {shape:?}");
        }
    }
});
