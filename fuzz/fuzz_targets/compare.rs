//! `compare::compare` of two arbitrary chunkings of one tensor over in-memory
//! sources: an error or a comparison, never a panic.
#![no_main]

use _core::compare::{compare, Tolerance};
use _core::files::Source;
use _core::geometry::numel;
use fuzz_input::Input;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let shape = inp.shape();
    if numel(&shape).is_ok_and(|n| n > 1 << 12) {
        return;
    }
    let rank = shape.len();
    let a: Vec<_> = (0..inp.count(3)).map(|_| inp.chunk(rank, 1)).collect();
    let b: Vec<_> = (0..inp.count(3)).map(|_| inp.chunk(rank, 1)).collect();
    let tol = match inp.u8() % 3 {
        0 => Tolerance::EXACT,
        1 => Tolerance { atol: f64::from(inp.u8()) / 100.0, rtol: 0.0, exact: false },
        _ => Tolerance { atol: f64::from_bits(inp.u64()), rtol: f64::from_bits(inp.u64()), exact: false },
    };
    let bytes = inp.rest();
    let _ = compare(&[Source::Bytes(bytes)], &shape, &a, &b, tol);
});
