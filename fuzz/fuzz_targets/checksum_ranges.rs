//! `checksum::checksum_ranges` with arbitrary ranges over an arbitrary file:
//! an error for any range past the end (including offset + len overflow),
//! otherwise the same values as hashing the slices directly.
#![no_main]

use _core::checksum::{checksum_ranges, Algo};
use fuzz_input::{scratch, write, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let algo = if inp.u8() % 2 == 0 { Algo::Xxh3_64 } else { Algo::Crc32 };
    let n = inp.count(6);
    let ranges: Vec<(u64, u64)> = (0..n).map(|_| (inp.dim(), inp.dim())).collect();
    let file = inp.rest();
    let path = scratch("data.bin");
    write(&path, file);
    match checksum_ranges(&path, &ranges, algo) {
        Ok(sums) => {
            assert_eq!(sums.len(), ranges.len());
            for (&(o, l), s) in ranges.iter().zip(sums) {
                let end = o.checked_add(l).expect("accepted an overflowing range");
                assert!(end <= file.len() as u64, "accepted a range past the end");
                assert_eq!(algo.of(&file[o as usize..end as usize]), s);
            }
        }
        Err(_) => {
            assert!(ranges.iter().any(|&(o, l)| o.checked_add(l).is_none_or(|e| e > file.len() as u64)));
        }
    }
});
