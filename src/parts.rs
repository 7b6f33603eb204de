//! How an object of known size is cut into the parts of a multipart upload.
//!
//! Every part but the last has the same size (Cloudflare R2 refuses unequal
//! parts), at least 5 MiB (S3's floor for all parts but the last), and an
//! object has at most 10,000 parts, so the part size grows with the object:
//! a 200 GiB object gets parts of 21 MiB. An object that fits in one part is
//! one plain PUT. Pure arithmetic, so that `cargo test` checks it without a
//! client or a server.

use std::ops::Range;

/// S3's smallest part, except the last.
pub const MIN_PART: u64 = 5 << 20;
/// S3's (and R2's) most parts per upload.
pub const MAX_PARTS: u64 = 10_000;
/// S3's largest part, and its largest single PUT.
pub const MAX_PART: u64 = 5 << 30;
/// Part sizes are whole MiB.
const STEP: u64 = 1 << 20;

/// The parts of one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartPlan {
    pub size: u64,
    pub part_size: u64,
}

impl PartPlan {
    /// Parts of `preferred` bytes, or larger where the object needs more than
    /// 10,000 of them; an error only for an object S3 cannot hold (over
    /// 10,000 parts of 5 GiB).
    pub fn new(size: u64, preferred: u64) -> Result<PartPlan, String> {
        let needed = size.div_ceil(MAX_PARTS).div_ceil(STEP) * STEP;
        let part_size = preferred.max(MIN_PART).max(needed).div_ceil(STEP) * STEP;
        if part_size > MAX_PART {
            return Err(format!(
                "an object of {size} bytes needs parts over 5 GiB (10,000 parts at most); S3 cannot hold it"
            ));
        }
        Ok(PartPlan { size, part_size })
    }

    /// How many parts (an empty object is one empty part).
    pub fn parts(&self) -> usize {
        self.size.div_ceil(self.part_size).max(1) as usize
    }

    /// Whether the object goes up as a multipart upload (more than one part).
    pub fn multipart(&self) -> bool {
        self.parts() > 1
    }

    /// The byte range of part `i`.
    pub fn range(&self, i: usize) -> Range<u64> {
        let start = i as u64 * self.part_size;
        start.min(self.size)..(start + self.part_size).min(self.size)
    }

    /// The part holding byte `offset`.
    pub fn part_of(&self, offset: u64) -> usize {
        (offset / self.part_size) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(plan: PartPlan) {
        let n = plan.parts();
        assert!(n as u64 <= MAX_PARTS);
        let mut at = 0;
        for i in 0..n {
            let r = plan.range(i);
            assert_eq!(r.start, at);
            if i + 1 < n {
                assert_eq!(r.end - r.start, plan.part_size, "part {i} of {plan:?}");
                assert!(plan.part_size >= MIN_PART);
            }
            at = r.end;
        }
        assert_eq!(at, plan.size);
        assert_eq!(plan.part_size % STEP, 0);
    }

    #[test]
    fn equal_parts_but_the_last_and_never_more_than_ten_thousand() {
        for size in [
            0,
            1,
            MIN_PART - 1,
            MIN_PART,
            8 << 20,
            (8 << 20) + 1,
            5_000_000_000,
            80 << 30,
            200 << 30,
            MAX_PARTS * MAX_PART,
        ] {
            for preferred in [0, 1, 8 << 20, 64 << 20] {
                check(PartPlan::new(size, preferred).unwrap());
            }
        }
    }

    #[test]
    fn the_part_grows_with_the_object() {
        assert_eq!(PartPlan::new(1 << 30, 8 << 20).unwrap().part_size, 8 << 20);
        // 200 GiB / 10,000 = 20.48 MiB, rounded up to whole MiB
        let big = PartPlan::new(200 << 30, 8 << 20).unwrap();
        assert_eq!(big.part_size, 21 << 20);
        assert_eq!(big.parts(), 9_753);
    }

    #[test]
    fn small_objects_are_one_put() {
        assert!(!PartPlan::new(0, 8 << 20).unwrap().multipart());
        assert!(!PartPlan::new(8 << 20, 8 << 20).unwrap().multipart());
        assert!(PartPlan::new((8 << 20) + 1, 8 << 20).unwrap().multipart());
        assert_eq!(
            PartPlan::new((8 << 20) + 1, 8 << 20).unwrap().range(1),
            (8 << 20)..((8 << 20) + 1)
        );
    }

    #[test]
    fn too_large_for_s3_is_an_error() {
        assert!(PartPlan::new(MAX_PARTS * MAX_PART + 1, 0).is_err());
    }

    #[test]
    fn part_of_matches_range() {
        let plan = PartPlan::new(100 << 20, 8 << 20).unwrap();
        for offset in [0, 1, (8 << 20) - 1, 8 << 20, (100 << 20) - 1] {
            assert!(plan.range(plan.part_of(offset)).contains(&offset));
        }
    }
}
