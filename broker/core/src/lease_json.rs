//! A lease's JSON array, rendered in one pass from its picks' heads as they were read,
//! joined (`broker/storage/message_json.py`). In Python, a bytes format per receipt and
//! the join cost the leader 1.2 µs a message at batch 100 (`bench/broker_costs.py`),
//! half what picking did; here about 0.1.

use std::io::Write;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The JSON array of a lease whose every pick was granted on its first delivery at its
/// row's own sort key: each head (`heads` joined, each ending where `ends`, uint32, says)
/// closed with deliveries 1, the lease's `deadline` and its receipt, `first_receipt`
/// onwards.
///
/// None if a pick's key (`keys`, the picks' int64 sort keys) is not its row's
/// (`row_keys`, the same), both little-endian: a nack or a reschedule moved it, and the
/// caller renders that lease itself.
#[pyfunction]
pub fn render_leased<'py>(
    py: Python<'py>,
    heads: &[u8],
    ends: &[u8],
    row_keys: &[u8],
    keys: &[u8],
    deadline: i64,
    first_receipt: i64,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let n = ends.len() / 4;
    if !ends.len().is_multiple_of(4) || row_keys.len() != 8 * n || keys.len() != 8 * n {
        return Err(PyValueError::new_err(format!(
            "{} bytes of sort keys and {} of row keys for {} bytes of head ends",
            keys.len(),
            row_keys.len(),
            ends.len()
        )));
    }
    if keys != row_keys {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(heads.len() + 80 * n + 2);
    out.push(b'[');
    let mut start = 0;
    for (i, end) in ends.chunks_exact(4).enumerate() {
        let end = u32::from_le_bytes(end.try_into().expect("chunks of 4")) as usize;
        let head = heads
            .get(start..end)
            .ok_or_else(|| PyValueError::new_err(format!("head {i} ends out of order")))?;
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(head);
        let receipt = first_receipt + i as i64;
        write!(
            out,
            ", \"deliveries\": 1, \"lease_deadline\": {deadline}, \"receipt\": {receipt}}}"
        )?;
        start = end;
    }
    out.push(b']');
    Ok(Some(PyBytes::new(py, &out)))
}
