//! `exec::plan_summary` and `exec::execute` (and through them `files`'
//! bounds checks) on jobs with arbitrary chunk references over in-memory
//! sources and one scratch target: an error, or writes that stay inside the
//! target file, never a panic.
#![no_main]

use _core::exec::{execute, plan_summary, Job, Options, TensorJob};
use _core::files::{Error, Side, Source};
use _core::geometry::numel;
use fuzz_input::{scratch, Input};
use libfuzzer_sys::fuzz_target;

const TARGET_BYTES: u64 = 4096;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let n_tensors = 1 + inp.count(2);
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let shape = inp.shape();
        if numel(&shape).is_ok_and(|n| n > 1 << 12) {
            return;
        }
        let rank = shape.len();
        let src_chunks = (0..inp.count(3)).map(|_| inp.chunk(rank, 2)).collect();
        let dst_chunks = (0..inp.count(2)).map(|_| inp.chunk(rank, 1)).collect();
        tensors.push(TensorJob { shape, src_chunks, dst_chunks });
    }
    let split = inp.u8() as usize;
    let bytes = inp.rest();
    let (a, b) = bytes.split_at(split.min(bytes.len()));
    let target = scratch("target.bin");
    std::fs::write(&target, vec![0u8; TARGET_BYTES as usize]).unwrap();
    let job = Job { sources: vec![Source::Bytes(a), Source::Bytes(b)], targets: vec![target.clone()], tensors };
    let options = Options { threads: 1, window_bytes: 1 << 12, sync: false, writeback: false };
    let summary = plan_summary(&job, &options);
    let stats = execute(&job, &options);
    // plan_summary does not look at the targets (they need not exist yet), so
    // only execute can refuse a target chunk that lies past its file's end
    match (&summary, &stats) {
        (Err(_), Ok(_)) => panic!("execute ran a job plan_summary refuses: {summary:?}"),
        (Ok(_), Err(e)) => assert!(
            matches!(e, Error::OutOfFile { at, .. } if at.side == Side::Target),
            "plan_summary accepts what execute refuses: {e}"
        ),
        (Ok(s), Ok(t)) => assert_eq!(s.stats, *t),
        (Err(_), Err(_)) => {}
    }
    assert_eq!(std::fs::metadata(&target).unwrap().len(), TARGET_BYTES, "the target grew");
});
