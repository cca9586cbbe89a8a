//! DejaQ broker's compiled core: per-message state the index keeps outside the Python
//! heap, updated a lease or a batch of rows at a time, and the lease's answer rendered
//! from it; and the checks of the lease and ack bodies the leader answers first.

use pyo3::prelude::*;

mod ack_run;
mod apply;
mod bodies;
mod buckets;
mod grant;
mod handles;
mod heads;
mod id_map;
mod ids;
mod lease_json;
mod lease_record;
mod lease_table;
mod order;
mod packed_ids;

#[pymodule]
fn dejaq_core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<order::Order>()?;
    m.add_class::<ack_run::AckRun>()?;
    m.add_class::<apply::Transitions>()?;
    m.add_class::<bodies::Bodies>()?;
    m.add_class::<lease_table::LeaseTable>()?;
    m.add_class::<lease_record::LeaseRecord>()?;
    m.add_class::<packed_ids::PackedIds>()?;
    m.add_function(wrap_pyfunction!(buckets::count_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(buckets::free_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(buckets::hold, m)?)?;
    m.add_function(wrap_pyfunction!(grant::grant, m)?)?;
    m.add_function(wrap_pyfunction!(handles::message_handle, m)?)?;
    m.add_function(wrap_pyfunction!(handles::message_handles, m)?)?;
    m.add_function(wrap_pyfunction!(handles::unpack_handles, m)?)?;
    m.add_function(wrap_pyfunction!(ids::arrow_ids, m)?)?;
    m.add_function(wrap_pyfunction!(ids::find_slots, m)?)?;
    m.add_function(wrap_pyfunction!(ids::place_slots, m)?)?;
    m.add_function(wrap_pyfunction!(ids::take_slots, m)?)?;
    m.add_function(wrap_pyfunction!(heads::read_heads, m)?)?;
    m.add_function(wrap_pyfunction!(heads::read_joined_heads, m)?)?;
    m.add_function(wrap_pyfunction!(lease_json::render_leased, m)?)?;
    // A lease record's codes, for `leases.py` to name: one definition, here.
    m.add("POSITION_BITS", lease_record::POSITION_BITS)?;
    for (name, code) in lease_record::ENDED.iter().chain(&lease_record::NOT_HELD) {
        m.add(*name, *code)?;
    }
    Ok(())
}
