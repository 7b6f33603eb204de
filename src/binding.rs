//! The Python module `ravex_convert._core`. pyo3 is known here and in the
//! files under `binding/` alone: `args.rs` (the arguments as typed values),
//! `errors.rs` (one error enum, and where it becomes a Python exception),
//! `s3.rs` (the S3 client's classes); this file holds the functions and the
//! module.
//!
//! Regions cross the boundary as plain tuples, `("box", offsets, sizes)` or
//! `("flat", start, length)`; a chunk's id is its index in the list given.
//! Chunks stored in files are `(file index, byte offset, region, dtype name)`.
//! Arguments are converted to Rust values first, then the work runs with the
//! GIL released. See `errors.rs` for what each failure raises.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::checksum::{self, checksum_ranges_of as checksum_ranges_impl, xxh3_64_bytes, Algo};
use crate::compare::{compare as compare_impl, Tolerance};
use crate::compress;
use crate::dcp::{self, Item, Leaf};
use crate::exec::{self, Job, Options, Stats, TensorJob, DEFAULT_WINDOW_BYTES};
use crate::files::Error;
use crate::plan::{plan, Chunk};

mod args;
mod errors;
mod s3;

use args::{ArgError, ByteRange, Count, Held, LeafArg, List, RegionArg, TensorArg};
use errors::CoreError;

/// `(target_index, source_index, src_elem, dst_elem, len)`
type RunTuple = (usize, usize, u64, u64, u64);

/// The tensors of a job: `(shape, src_chunks, dst_chunks)` tuples.
fn tensors_arg(obj: &Bound<'_, PyAny>) -> Result<Vec<TensorJob>, ArgError> {
    let List(v) = args::extract::<List<TensorArg>>(obj, "tensors")?;
    Ok(v.into_iter().map(|TensorArg(t)| t).collect())
}

/// Plans the copies that fill every target chunk of one tensor from its
/// source chunks. Returns `(target_index, source_index, src_elem, dst_elem,
/// len)` tuples, grouped by target in target order, sorted by `dst_elem`
/// within a target; offsets and lengths count elements of each chunk's own
/// row-major storage. Where chunks overlap, the first source listed wins.
/// Raises `ValueError` for a malformed or out-of-bounds region, or when a
/// target element is in no source.
#[pyfunction]
fn plan_runs(
    py: Python<'_>,
    global_shape: &Bound<'_, PyAny>,
    sources: &Bound<'_, PyAny>,
    targets: &Bound<'_, PyAny>,
) -> Result<Vec<RunTuple>, CoreError> {
    let List(shape) = args::extract::<List<Count>>(global_shape, "global_shape")?;
    let shape: Vec<u64> = shape.into_iter().map(|Count(n)| n).collect();
    let chunks = |obj, arg| -> Result<Vec<Chunk>, ArgError> {
        let List(regions) = args::extract::<List<RegionArg>>(obj, arg)?;
        Ok(regions
            .into_iter()
            .enumerate()
            .map(|(id, RegionArg(region))| Chunk { id, region })
            .collect())
    };
    let sources = chunks(sources, "sources")?;
    let targets = chunks(targets, "targets")?;
    let plans = py.detach(|| plan(&shape, &sources, &targets))?;
    Ok(plans
        .iter()
        .flat_map(|p| {
            p.runs.iter().map(move |r| {
                (
                    p.target_id,
                    r.source_id,
                    r.run.src_elem,
                    r.run.dst_elem,
                    r.run.len,
                )
            })
        })
        .collect())
}

fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes_read", s.bytes_read)?;
    d.set_item("bytes_written", s.bytes_written)?;
    d.set_item("runs", s.runs)?;
    d.set_item("pieces", s.pieces)?;
    d.set_item("direct_bytes", s.direct_bytes)?;
    Ok(d)
}

// The signatures spell the default window out so that Python's
// `__text_signature__` (and so stubtest) sees the number.
const _: () = assert!(DEFAULT_WINDOW_BYTES == 67108864);

/// Copies every target chunk's elements from the source chunks, casting
/// between float dtypes where the chunks' dtypes differ, with positional
/// writes into targets: files that already exist at their final size
/// (nothing is created or truncated), or writable buffers (a live tensor's
/// bytes); bytes outside target chunks are left alone.
/// `sources` are paths (mapped read-only) or `bytes`; each tensor is
/// `(shape, src_chunks, dst_chunks)` with chunks as `(file index, byte
/// offset, region, dtype)`. Runs on `threads` threads (0: one per CPU),
/// in pieces of at most `window_bytes / threads` bytes copied through one
/// 64 KiB buffer per thread; fsyncs every target
/// at the end when `sync`. Returns `bytes_read`, `bytes_written`, `runs` and
/// `pieces`. Everything is validated before the first byte moves. With
/// `crc_ranges` (`(target index, offset, length)` tuples) it also returns
/// `crcs`: the CRC-32 of each range, gathered while copying (None where the
/// job's writes do not tile the range), so zip writers need no second pass,
/// and `crc_parts`: `(range index, offset, length, crc)` of the pieces written
/// inside each range left None, to be joined with other calls' (`crc32_concat`).
/// With `read_crcs` it also returns `read_crcs`: `(source index, offset,
/// length, crc)` of every stretch of source bytes copied unchanged (a cast's
/// are not), so a reader's CRC-32s of its sources are checked without a
/// second read (combine them with `crc32_concat`).
/// `writeback` starts each piece's write-back to disk as soon as it is
/// written, for callers that fsync the targets afterwards themselves.
/// `direct` writes the whole pages of file targets around the page cache
/// (`O_DIRECT`, where the file system allows it), for durable output.
/// `hash_ranges` (`(target, offset, length)` tuples) returns `hashes`: the
/// xxh3-64 of each range, hashed as its bytes were written, or None where no
/// one copy thread wrote all of it in order (hash those from the file).
#[pyfunction]
#[pyo3(signature = (sources, targets, tensors, threads=0, window_bytes=67108864, sync=true, crc_ranges=None, writeback=false, read_crcs=false, direct=false, hash_ranges=None))]
#[allow(clippy::too_many_arguments)]
fn execute<'py>(
    py: Python<'py>,
    sources: &Bound<'py, PyAny>,
    targets: &Bound<'py, PyAny>,
    tensors: &Bound<'py, PyAny>,
    threads: i64,
    window_bytes: i64,
    sync: bool,
    crc_ranges: Option<&Bound<'py, PyAny>>,
    writeback: bool,
    read_crcs: bool,
    direct: bool,
    hash_ranges: Option<&Bound<'py, PyAny>>,
) -> Result<Bound<'py, PyDict>, CoreError> {
    let options = Options {
        threads: args::checked(threads, "threads")? as usize,
        window_bytes: args::checked(window_bytes, "window_bytes")?,
        sync,
        writeback,
        direct,
    };
    let held = Held::sources(sources)?;
    let held_outs = Held::targets(targets)?;
    let job = Job {
        sources: held.as_sources()?,
        targets: held_outs.as_targets()?,
        tensors: tensors_arg(tensors)?,
    };
    if crc_ranges.is_none() && !read_crcs && hash_ranges.is_none() {
        let stats = py.detach(|| exec::execute(&job, &options))?;
        return Ok(stats_dict(py, &stats)?);
    }
    let ranges = args::target_ranges(crc_ranges, "crc_ranges")?;
    let to_hash = args::target_ranges(hash_ranges, "hash_ranges")?;
    let want_crcs = crc_ranges.is_some() || read_crcs;
    let (stats, crcs, parts, read, hashes) = py.detach(|| {
        exec::execute_hashed(&job, &options, want_crcs, &to_hash).map(|(stats, pieces, hashes)| {
            let read: Vec<(usize, u64, u64, u32)> = pieces
                .iter()
                .filter_map(|p| p.read.map(|(src, at)| (src, at, p.len, p.crc)))
                .collect();
            let crcs = checksum::combine_crcs(pieces.clone(), &ranges);
            let parts = checksum::untiled_parts(pieces, &ranges, &crcs);
            (stats, crcs, parts, read, hashes)
        })
    })?;
    let dict = stats_dict(py, &stats)?;
    if crc_ranges.is_some() {
        dict.set_item("crcs", crcs)?;
        dict.set_item("crc_parts", parts)?;
    }
    if read_crcs {
        dict.set_item("read_crcs", read)?;
    }
    if hash_ranges.is_some() {
        dict.set_item("hashes", hashes)?;
    }
    Ok(dict)
}

/// The CRC-32 of byte strings one after another, from each one's `(crc, length)`.
#[pyfunction]
fn crc32_concat(parts: Vec<(u32, u64)>) -> u32 {
    checksum::crc32_concat(&parts)
}

/// What `execute` would do with the same arguments, without moving a byte:
/// `bytes_read`, `bytes_written`, `runs`, `pieces` and `per_target_bytes`
/// (bytes written into each target, in order). Source files must exist (their
/// sizes are checked); targets need not.
#[pyfunction]
#[pyo3(signature = (sources, targets, tensors, threads=0, window_bytes=67108864))]
fn plan_summary<'py>(
    py: Python<'py>,
    sources: &Bound<'py, PyAny>,
    targets: &Bound<'py, PyAny>,
    tensors: &Bound<'py, PyAny>,
    threads: i64,
    window_bytes: i64,
) -> Result<Bound<'py, PyDict>, CoreError> {
    let options = Options {
        threads: args::checked(threads, "threads")? as usize,
        window_bytes: args::checked(window_bytes, "window_bytes")?,
        sync: false,
        writeback: false,
        direct: false,
    };
    let held = Held::sources(sources)?;
    let held_outs = Held::targets(targets)?;
    let job = Job {
        sources: held.as_sources()?,
        targets: held_outs.as_targets()?,
        tensors: tensors_arg(tensors)?,
    };
    let summary = py.detach(|| exec::plan_summary(&job, &options))?;
    let d = stats_dict(py, &summary.stats)?;
    d.set_item("per_target_bytes", summary.per_target_bytes)?;
    Ok(d)
}

/// The checksum of each `(offset, length)` byte range of the file, in order:
/// `algo` is `"xxh3-64"` (seed 0) or `"crc32"` (as zip records it).
#[pyfunction]
fn checksum_ranges(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    ranges: &Bound<'_, PyAny>,
    algo: &str,
) -> Result<Vec<u64>, CoreError> {
    let source = args::source(path, "path")?;
    let List(ranges) = args::extract::<List<ByteRange>>(ranges, "ranges")?;
    let ranges: Vec<(u64, u64)> = ranges.into_iter().map(|ByteRange(r)| r).collect();
    let algo: Algo = algo.parse()?;
    Ok(py.detach(|| checksum_ranges_impl(&source, &ranges, algo))?)
}

/// XXH3-64 (seed 0) of the bytes (`bytes` or any C-contiguous byte buffer,
/// which must not change during the call).
#[pyfunction]
fn xxh3_64(py: Python<'_>, data: &Bound<'_, PyAny>) -> Result<u64, CoreError> {
    if let Ok(b) = data.cast::<PyBytes>() {
        let bytes = b.as_bytes();
        return Ok(py.detach(|| xxh3_64_bytes(bytes)));
    }
    let Some(buf) = args::byte_buffer(data).map_err(|e| e.named("data"))? else {
        return Err(CoreError::Value(format!(
            "data must be bytes or a buffer of unsigned bytes, got {}",
            args::show(data)
        )));
    };
    let bytes = args::buffer_bytes(&buf);
    Ok(py.detach(|| xxh3_64_bytes(bytes)))
}

/// `length` bytes at `offset` of the file, compressed into one zstd frame.
#[pyfunction]
#[pyo3(signature = (path, offset, length, level=3))]
fn compress_range<'py>(
    py: Python<'py>,
    path: &Bound<'py, PyAny>,
    offset: i64,
    length: i64,
    level: i32,
) -> Result<Bound<'py, PyBytes>, CoreError> {
    let source = args::source(path, "path")?;
    let offset = args::checked(offset, "offset")?;
    let length = args::checked(length, "length")?;
    let frame = py.detach(|| compress::compress_range_of(&source, offset, length, level))?;
    Ok(PyBytes::new(py, &frame))
}

/// The zstd frame of `stored_len` bytes at `offset` of the file,
/// decompressed; it must hold exactly `expected_len` bytes.
#[pyfunction]
fn decompress_frame<'py>(
    py: Python<'py>,
    path: &Bound<'py, PyAny>,
    offset: i64,
    stored_len: i64,
    expected_len: i64,
) -> Result<Bound<'py, PyBytes>, CoreError> {
    let source = args::source(path, "path")?;
    let offset = args::checked(offset, "offset")?;
    let stored_len = args::checked(stored_len, "stored_len")?;
    let expected_len = args::checked(expected_len, "expected_len")?;
    let data = py.detach(|| {
        let mut out = Vec::new();
        compress::decompress_frame_into_of(&source, offset, stored_len, expected_len, &mut out)
            .map(|_| out)
    })?;
    Ok(PyBytes::new(py, &data))
}

/// The zstd frame of `stored_len` bytes at `offset` of the file, decoded in
/// bounded pieces into the file `dst` (which must exist; it is truncated), or
/// only hashed when `dst` is None. Returns the XXH3-64 of the decoded bytes.
#[pyfunction]
#[pyo3(signature = (path, offset, stored_len, expected_len, dst=None))]
fn decompress_frame_to(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    offset: i64,
    stored_len: i64,
    expected_len: i64,
    dst: Option<&Bound<'_, PyAny>>,
) -> Result<u64, CoreError> {
    let source = args::source(path, "path")?;
    let offset = args::checked(offset, "offset")?;
    let stored_len = args::checked(stored_len, "stored_len")?;
    let expected_len = args::checked(expected_len, "expected_len")?;
    let dst = dst.map(|d| args::path(d, "dst")).transpose()?;
    let h = py.detach(|| -> Result<u64, Error> {
        match &dst {
            None => compress::decompress_frame_into_of(
                &source,
                offset,
                stored_len,
                expected_len,
                &mut std::io::sink(),
            ),
            Some(d) => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .truncate(true)
                    .open(d)
                    .map_err(|e| Error::io("cannot open", d, e))?;
                let mut out = std::io::BufWriter::new(file);
                let h = compress::decompress_frame_into_of(
                    &source,
                    offset,
                    stored_len,
                    expected_len,
                    &mut out,
                )?;
                std::io::Write::flush(&mut out).map_err(|e| Error::io("cannot write", d, e))?;
                Ok(h)
            }
        }
    })?;
    Ok(h)
}

/// Compares two stored copies of one tensor of global shape `shape`, element
/// by element: `a_chunks` and `b_chunks` are `(source index, byte offset,
/// region, dtype)` and must each cover the tensor. Returns `(n_diff,
/// first_diff, max_abs_diff)`: the number of differing elements, the flat
/// row-major index of the first, and the largest absolute difference. With
/// `exact`, equal dtypes compare bits and different ones values; otherwise
/// floats match when `|a - b| <= atol + rtol * |b|`. NaN matches NaN;
/// integers and bools always compare exactly.
#[pyfunction]
#[pyo3(signature = (sources, shape, a_chunks, b_chunks, atol=0.0, rtol=0.0, exact=true))]
#[allow(clippy::too_many_arguments)]
fn compare<'py>(
    py: Python<'py>,
    sources: &Bound<'py, PyAny>,
    shape: &Bound<'py, PyAny>,
    a_chunks: &Bound<'py, PyAny>,
    b_chunks: &Bound<'py, PyAny>,
    atol: f64,
    rtol: f64,
    exact: bool,
) -> Result<(u64, Option<u64>, f64), CoreError> {
    let held = Held::sources(sources)?;
    let sources = held.as_sources()?;
    let List(shape) = args::extract::<List<Count>>(shape, "shape")?;
    let shape: Vec<u64> = shape.into_iter().map(|Count(n)| n).collect();
    let a = args::file_chunks(a_chunks, "a_chunks")?;
    let b = args::file_chunks(b_chunks, "b_chunks")?;
    let tol = Tolerance { atol, rtol, exact };
    let c = py.detach(|| compare_impl(&sources, &shape, &a, &b, tol))?;
    Ok((c.n_diff, c.first_diff, c.max_abs_diff))
}

/// A rank's item as Python gets it: `(leaf, index, offset, total, row0, rows)`.
type RankItem = (u32, u32, u64, u64, u64, u64);

/// A DCP output's layout (`dcp::place`): its items, each rank file's size,
/// and its `.metadata`, from one description per key.
#[pyclass(frozen, module = "ravex_convert._core")]
struct DcpLayout {
    leaves: Vec<Leaf>,
    items: Vec<Item>,
    sizes: Vec<u64>,
    by_rank: Vec<u32>,       // item indices, grouped by rank, in file order
    rank_starts: Vec<usize>, // by_rank[rank_starts[r]..rank_starts[r + 1]]: rank r's items
}

#[pymethods]
impl DcpLayout {
    /// `leaves`: `(key, path, kind, dtype, shape, totals)` per key in the
    /// flattened state's order; kind 0: a tensor cut on dim 0, 1: a tensor
    /// stored whole, 2: a non-tensor; totals: the item archive's size for a
    /// full, the last (shorter) and an empty shard (kinds 1 and 2: the first).
    #[new]
    fn new(
        py: Python<'_>,
        leaves: &Bound<'_, PyAny>,
        world_size: usize,
    ) -> Result<Self, CoreError> {
        let List(leaves) = args::extract::<List<LeafArg>>(leaves, "leaves")?;
        let leaves: Vec<Leaf> = leaves.into_iter().map(|LeafArg(l)| l).collect();
        let (leaves, items, sizes, by_rank, rank_starts) =
            py.detach(move || -> Result<_, dcp::LayoutError> {
                let (items, sizes) = dcp::place(&leaves, world_size)?;
                let mut rank_starts = vec![0usize; world_size + 1];
                for it in &items {
                    rank_starts[it.rank as usize + 1] += 1;
                }
                for r in 0..world_size {
                    rank_starts[r + 1] += rank_starts[r];
                }
                let mut fill = rank_starts.clone();
                let mut by_rank = vec![0u32; items.len()];
                for (i, it) in items.iter().enumerate() {
                    by_rank[fill[it.rank as usize]] = i as u32;
                    fill[it.rank as usize] += 1;
                }
                Ok((leaves, items, sizes, by_rank, rank_starts))
            })?;
        Ok(DcpLayout {
            leaves,
            items,
            sizes,
            by_rank,
            rank_starts,
        })
    }

    /// Each rank file's size in bytes.
    #[getter]
    fn file_sizes(&self) -> Vec<u64> {
        self.sizes.clone()
    }

    fn __len__(&self) -> usize {
        self.items.len()
    }

    /// Rank `rank`'s items in file order: `(leaf, index, offset, total, row0, rows)`.
    fn items_of(&self, rank: usize) -> Result<Vec<RankItem>, CoreError> {
        if rank + 1 >= self.rank_starts.len() {
            return Err(CoreError::Value(format!(
                "rank {rank} is not in a layout of {} ranks",
                self.sizes.len()
            )));
        }
        Ok(
            self.by_rank[self.rank_starts[rank]..self.rank_starts[rank + 1]]
                .iter()
                .map(|&i| {
                    let it = &self.items[i as usize];
                    (it.leaf, it.index, it.offset, it.total, it.row0, it.rows)
                })
                .collect(),
        )
    }

    /// Every item in key order: `(leaf, index, rank, offset, total, row0, rows)`.
    fn items(&self) -> Vec<(u32, u32, u32, u64, u64, u64, u64)> {
        self.items
            .iter()
            .map(|it| {
                (
                    it.leaf, it.index, it.rank, it.offset, it.total, it.row0, it.rows,
                )
            })
            .collect()
    }

    /// The length of [`DcpLayout::metadata`]'s bytes, without making them.
    fn metadata_size(
        &self,
        py: Python<'_>,
        current: bool,
        save_id: &str,
    ) -> Result<usize, CoreError> {
        Ok(py.detach(|| dcp::metadata_len(&self.leaves, &self.items, current, save_id))?)
    }

    /// The `.metadata` pickle (`current`: with `TensorProperties.strides`, as torch 2.15 writes it).
    fn metadata<'py>(
        &self,
        py: Python<'py>,
        current: bool,
        save_id: &str,
    ) -> Result<Bound<'py, PyBytes>, CoreError> {
        let bytes = py.detach(|| dcp::metadata(&self.leaves, &self.items, current, save_id))?;
        Ok(PyBytes::new(py, &bytes))
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(plan_runs, m)?)?;
    m.add_function(wrap_pyfunction!(execute, m)?)?;
    m.add_function(wrap_pyfunction!(plan_summary, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(crc32_concat, m)?)?;
    m.add_function(wrap_pyfunction!(xxh3_64, m)?)?;
    m.add_function(wrap_pyfunction!(compress_range, m)?)?;
    m.add_function(wrap_pyfunction!(decompress_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decompress_frame_to, m)?)?;
    m.add_function(wrap_pyfunction!(compare, m)?)?;
    m.add_class::<DcpLayout>()?;
    s3::register(m)?;
    Ok(())
}
