//! A message's handle ("mh"): the first 16 bytes of BLAKE3 of its id's UTF-8 bytes,
//! unkeyed, read as a little-endian u128. Every node's lease state is keyed by it (the
//! lease table, delivery counts, settled messages, overrides, delays, redrives), and
//! the index finds a row by it: 16 bytes whatever the id's length, one integer compare
//! per probe, and, since a 128-bit cryptographic hash has no collision among distinct
//! ids (accidental or chosen by a producer), no key to share: every node, and every
//! load of an id-keyed snapshot, computes the same one alone from the ids
//! the Raft commands carry (a lease's picks, a call naming messages by id).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::lease_table::{id_strs, raw_ids};

/// Bytes of a handle packed in a bytes object.
pub(crate) const WIDTH: usize = 16;

/// The handle of the id whose UTF-8 bytes are `raw`.
pub(crate) fn mh(raw: &[u8]) -> u128 {
    let digest = blake3::hash(raw);
    let mut first = [0u8; WIDTH];
    first.copy_from_slice(&digest.as_bytes()[..WIDTH]);
    u128::from_le_bytes(first)
}

/// The handle of `mid`, as a Python int.
#[pyfunction]
pub fn message_handle(mid: &str) -> u128 {
    mh(mid.as_bytes())
}

/// The handles of `mids` (a list or iterable of str, or `PackedIds`), packed 16 bytes
/// each, little-endian, in their order: one call and one bytes object for a batch, as
/// the index and a snapshot's upgrade hash them.
#[pyfunction]
pub fn message_handles<'py>(
    py: Python<'py>,
    mids: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let strs = id_strs(mids)?;
    let raws = raw_ids(py, mids, &strs)?;
    PyBytes::new_with(py, raws.len() * WIDTH, |blob| {
        for (raw, to) in raws.iter().zip(blob.chunks_exact_mut(WIDTH)) {
            to.copy_from_slice(&mh(raw).to_le_bytes());
        }
        Ok(())
    })
}

/// The handles packed in `blob` (16 bytes each, little-endian), as ints, in their order:
/// the lease state's maps are keyed by them. In Python a slice and an `int.from_bytes`
/// a handle cost ~190 ns, most of hashing a batch of ids into ints.
#[pyfunction]
pub fn unpack_handles<'py>(py: Python<'py>, blob: &[u8]) -> PyResult<Bound<'py, PyList>> {
    if !blob.len().is_multiple_of(WIDTH) {
        return Err(PyValueError::new_err(format!(
            "packed handles are {WIDTH} bytes each, not {} bytes in all",
            blob.len()
        )));
    }
    PyList::new(
        py,
        blob.chunks_exact(WIDTH)
            .map(|h| u128::from_le_bytes(h.try_into().expect("16 bytes"))),
    )
}
