//! DejaQ broker's compiled core: per-message state the index keeps outside the Python
//! heap, updated a lease or a batch of rows at a time.

use pyo3::prelude::*;

mod heads;
mod ids;
mod order;

#[pymodule]
fn dejaq_core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<order::Order>()?;
    m.add_function(wrap_pyfunction!(ids::find_slots, m)?)?;
    m.add_function(wrap_pyfunction!(ids::place_slots, m)?)?;
    m.add_function(wrap_pyfunction!(heads::read_heads, m)?)?;
    Ok(())
}
