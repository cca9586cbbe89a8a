//! A lease's JSON array, rendered from its picks' heads (`broker/storage/message_json.py`)
//! in one pass. In Python, a bytes format per receipt and the join cost the leader
//! 1.2 µs a message at batch 100 (`bench/broker_costs.py`), half what picking did;
//! here about 0.5.

use std::io::Write;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

/// The JSON array of a lease whose every pick was granted on its first delivery at its
/// row's own sort key: each head (`rendered`: (row sort key, head) per pick) closed with
/// deliveries 1, the lease's `deadline` and its receipt, `first_receipt` onwards.
///
/// None if a pick's key (`keys`, the picks' little-endian int64 sort keys) is not its
/// row's: a nack or a reschedule moved it, and the caller renders that lease itself.
#[pyfunction]
pub fn render_leased<'py>(
    py: Python<'py>,
    rendered: &Bound<'py, PyList>,
    keys: &[u8],
    deadline: i64,
    first_receipt: i64,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    if keys.len() != 8 * rendered.len() {
        return Err(PyValueError::new_err(format!(
            "{} bytes of sort keys for {} heads",
            keys.len(),
            rendered.len()
        )));
    }
    let mut heads = Vec::with_capacity(rendered.len());
    for (item, key) in rendered.iter().zip(keys.chunks_exact(8)) {
        let pair = item.downcast_into::<PyTuple>()?;
        let row_key: i64 = pair.get_borrowed_item(0)?.extract()?;
        if row_key != i64::from_le_bytes(key.try_into().expect("chunks of 8")) {
            return Ok(None);
        }
        heads.push(pair.get_item(1)?.downcast_into::<PyBytes>()?);
    }
    let size: usize = heads.iter().map(|h| h.as_bytes().len() + 80).sum();
    let mut out = Vec::with_capacity(size + 2);
    out.push(b'[');
    for (i, head) in heads.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(head.as_bytes());
        let receipt = first_receipt + i as i64;
        write!(
            out,
            ", \"deliveries\": 1, \"lease_deadline\": {deadline}, \"receipt\": {receipt}}}"
        )?;
    }
    out.push(b']');
    Ok(Some(PyBytes::new(py, &out)))
}
