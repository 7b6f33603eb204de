//! Ravex core: the reshard planner and the copy executor, as plain Rust.
//!
//! [`geometry`] says where a chunk sits in its logical tensor and which element
//! runs move between two chunks; [`plan`] turns the source and target chunkings
//! of one tensor into copy runs that fill every target element exactly once;
//! [`exec`] runs those plans over files (memory maps, casts between float
//! dtypes from [`dtype`], positional writes, a thread pool, a bounded copy
//! window). [`checksum`], [`compress`] and [`compare`] hash, frame and compare
//! chunk bytes. [`dcp`] lays out a DCP output's items and writes its
//! `.metadata` pickle from one description per key (the one place here that
//! knows torch's class names; nothing here imports or runs torch). `remote`
//! reads and writes objects in S3-compatible buckets (the executor sees them
//! only as `ReadAt`/`WriteAt`). The Python module `ravex_convert._core` is a
//! thin layer over this, built only with the `python` feature: `binding`
//! (src/binding.rs and src/binding/), the only code that knows pyo3.

pub mod checksum;
pub mod compare;
pub mod compress;
pub mod dcp;
pub mod dtype;
pub mod exec;
pub mod files;
pub mod geometry;
pub mod parts;
pub mod plan;
#[cfg(feature = "remote")]
pub mod remote;
pub mod s3text;

#[cfg(test)]
mod exec_crc_tests;
#[cfg(test)]
mod exec_remote_tests;
#[cfg(test)]
mod exec_tests;
#[cfg(test)]
mod exec_validation_tests;
#[cfg(test)]
mod proptests;

#[cfg(feature = "python")]
mod binding;
