//! Leases per bucket of a lease's picks or of an acked run (`broker/state/leases.py`),
//! counted from the record's packed column. Every node counts them for every lease and
//! bulk ack: with `collections.Counter`, and the picks' column unpacked into a list of
//! ints to feed it, that was ~15 µs a lease of 100 on each node.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::order::slice;

/// {bucket: how many of `buckets` (a uint16 column, as `array('H')`) name it}, in the
/// order each bucket first appears.
#[pyfunction]
pub fn count_buckets<'py>(py: Python<'py>, buckets: PyBuffer<u16>) -> PyResult<Bound<'py, PyDict>> {
    let column = slice(py, &buckets, "buckets")?;
    let top = column.iter().map(|cell| cell.get()).max().unwrap_or(0);
    let mut counts = vec![0u32; usize::from(top) + 1];
    let mut seen: Vec<u16> = Vec::new();
    for cell in column {
        let bucket = cell.get();
        let count = &mut counts[usize::from(bucket)];
        if *count == 0 {
            seen.push(bucket);
        }
        *count += 1;
    }
    let out = PyDict::new(py);
    for bucket in seen {
        out.set_item(bucket, counts[usize::from(bucket)])?;
    }
    Ok(out)
}
