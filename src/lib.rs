//! Ravex core: the reshard planner, as plain Rust.
//!
//! [`geometry`] says where a chunk sits in its logical tensor and which element
//! runs move between two chunks; [`plan`] turns the source and target chunkings
//! of one tensor into copy runs that fill every target element exactly once.
//! Nothing here knows torch or pickle. The Python module `ravex_convert._core`
//! is a thin layer over this, built only with the `python` feature.

pub mod geometry;
pub mod plan;

#[cfg(test)]
mod proptests;

#[cfg(feature = "python")]
mod binding;
