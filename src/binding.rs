//! The Python module `ravex_convert._core`: the only file that knows pyo3.
//!
//! Regions cross the boundary as plain tuples, `("box", offsets, sizes)` or
//! `("flat", start, length)`; a chunk's id is its index in the list given.
//! Arguments are converted to Rust values first, then planning runs with the
//! GIL released.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::geometry::Region;
use crate::plan::{plan, Chunk};

/// `(target_index, source_index, src_elem, dst_elem, len)`
type RunTuple = (usize, usize, u64, u64, u64);

const REGION_FORMS: &str = "('box', offsets, sizes) or ('flat', start, length)";

/// `repr(obj)`, cut short: enough to recognise the value in an error message.
fn show(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map_or_else(|_| "<unprintable>".to_string(), |r| r.to_string());
    match text.char_indices().nth(80) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

fn non_negative_int(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    obj.extract::<u64>().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a non-negative int, got {}",
            show(obj)
        ))
    })
}

fn non_negative_ints(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    // pyo3 refuses a str here rather than reading its characters.
    let items: Vec<Bound<'_, PyAny>> = obj.extract().map_err(|_| {
        PyValueError::new_err(format!("{what} must be a list of ints, got {}", show(obj)))
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, x)| non_negative_int(x, &format!("{what}[{i}]")))
        .collect()
}

fn region(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Region> {
    let bad = || PyValueError::new_err(format!("{what} must be {REGION_FORMS}, got {}", show(obj)));
    let tuple = obj.cast::<PyTuple>().map_err(|_| bad())?;
    if tuple.len() != 3 {
        return Err(bad());
    }
    let kind: String = tuple.get_item(0)?.extract().map_err(|_| bad())?;
    let (a, b) = (tuple.get_item(1)?, tuple.get_item(2)?);
    match kind.as_str() {
        "box" => Ok(Region::Box {
            offsets: non_negative_ints(&a, &format!("{what} offsets"))?,
            sizes: non_negative_ints(&b, &format!("{what} sizes"))?,
        }),
        "flat" => Ok(Region::Flat {
            start: non_negative_int(&a, &format!("{what} start"))?,
            len: non_negative_int(&b, &format!("{what} length"))?,
        }),
        _ => Err(bad()),
    }
}

fn chunks(list: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Chunk>> {
    let items: Vec<Bound<'_, PyAny>> = list.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a list of regions, got {}",
            show(list)
        ))
    })?;
    items
        .iter()
        .enumerate()
        .map(|(id, x)| {
            Ok(Chunk {
                id,
                region: region(x, &format!("{what}[{id}]"))?,
            })
        })
        .collect()
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
) -> PyResult<Vec<RunTuple>> {
    let shape = non_negative_ints(global_shape, "global_shape")?;
    let sources = chunks(sources, "sources")?;
    let targets = chunks(targets, "targets")?;
    let plans = py
        .detach(|| plan(&shape, &sources, &targets))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(plan_runs, m)?)?;
    Ok(())
}
