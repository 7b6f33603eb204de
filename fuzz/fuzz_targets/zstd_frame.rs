//! `compress::decompress_frame` on arbitrary bytes at an arbitrary range, with
//! an arbitrary expected length: an error or exactly that many bytes, never a
//! panic. The expected length is kept under 16 MiB here: the function
//! allocates it up front (a finding reported in docs/security.md), and the
//! fuzzer's memory limit would stop at that every time.
#![no_main]

use fuzz_input::{scratch, write, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let expected = u64::from(inp.u32() % (16 << 20));
    let offset = u64::from(inp.u8() % 8);
    let fudge = inp.u8();
    let frame = inp.rest();
    let path = scratch("frame.zst");
    write(&path, frame);
    let stored = (frame.len() as u64).saturating_sub(offset).wrapping_add(u64::from(fudge % 3)).wrapping_sub(1);
    if let Ok(out) = _core::compress::decompress_frame(&path, offset, stored, expected) {
        assert_eq!(out.len() as u64, expected);
    }
});
