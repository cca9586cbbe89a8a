//! Leases per bucket of a lease's picks or of an acked run (`broker/state/leases.py`),
//! counted from the record's packed column, and kept by bucket and consumer for the
//! sticky handover of buckets. Every node counts them for every lease and bulk ack: with
//! `collections.Counter`, and the picks' column unpacked into a list of ints to feed it,
//! that was ~15 µs a lease of 100 on each node, and a Python loop over a lease's buckets
//! to keep the counts ~5 µs more, on lease and on ack.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::order::slice;

/// {bucket: how many of `buckets` (a uint16 column, as `array('H')`) name it}, in the
/// order each bucket first appears.
#[pyfunction]
pub fn count_buckets<'py>(py: Python<'py>, buckets: PyBuffer<u16>) -> PyResult<Bound<'py, PyDict>> {
    let column = slice(py, &buckets, "buckets")?;
    let out = PyDict::new(py);
    for (bucket, n) in per_bucket(column.iter().map(|cell| cell.get())) {
        out.set_item(bucket, n)?;
    }
    Ok(out)
}

/// Each bucket `buckets` names and how many times, in the order each first appears.
pub(crate) fn per_bucket(buckets: impl Iterator<Item = u16> + Clone) -> Vec<(u16, i64)> {
    let top = buckets.clone().max().unwrap_or(0);
    let mut counts = vec![0i64; usize::from(top) + 1];
    let mut seen: Vec<u16> = Vec::new();
    for bucket in buckets {
        let count = &mut counts[usize::from(bucket)];
        if *count == 0 {
            seen.push(bucket);
        }
        *count += 1;
    }
    (seen.into_iter())
        .map(|b| (b, counts[usize::from(b)]))
        .collect()
}

/// `held` (bucket -> {consumer: leases held in it}) with `consumer`'s leases counted in
/// `per_bucket` (bucket -> how many) taken (`sign` 1) or ended (-1). A consumer whose
/// count reaches 0 is no longer named, so a bucket's dict names only holders, as
/// `TopicState.buckets_of` asks; ending leases a bucket or consumer does not hold is a
/// KeyError, as the dicts would raise.
#[pyfunction]
pub fn hold(
    held: &Bound<'_, PyDict>,
    per_bucket: &Bound<'_, PyDict>,
    consumer: &Bound<'_, PyString>,
    sign: i64,
) -> PyResult<()> {
    for (bucket, n) in per_bucket.iter() {
        hold_in(held, &bucket, n.extract()?, consumer, sign)?;
    }
    Ok(())
}

/// `hold` for one bucket: `n` of `consumer`'s leases in `bucket` taken or ended.
pub(crate) fn hold_in(
    held: &Bound<'_, PyDict>,
    bucket: &Bound<'_, PyAny>,
    n: i64,
    consumer: &Bound<'_, PyString>,
    sign: i64,
) -> PyResult<()> {
    let counts = match held.get_item(bucket)? {
        Some(counts) => counts.downcast_into::<PyDict>()?,
        None if sign > 0 => {
            let counts = PyDict::new(held.py());
            held.set_item(bucket, &counts)?;
            counts
        }
        None => return Err(PyKeyError::new_err(bucket.clone().unbind())),
    };
    let before: i64 = match counts.get_item(consumer)? {
        Some(count) => count.extract()?,
        None if sign > 0 => 0,
        None => return Err(PyKeyError::new_err(consumer.clone().unbind())),
    };
    let left = before + sign * n;
    if left > 0 {
        counts.set_item(consumer, left)?;
    } else {
        counts.del_item(consumer)?;
    }
    Ok(())
}

/// The buckets of `owned` in which no consumer but `consumer` holds leases (`held`, as
/// `hold` keeps it), in `owned`'s order: where it may lease now
/// (`TopicState.buckets_of`, the leader's every pick).
#[pyfunction]
pub fn free_buckets<'py>(
    owned: &Bound<'py, PyAny>,
    held: &Bound<'py, PyDict>,
    consumer: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(held.py());
    for bucket in owned.try_iter()? {
        let bucket = bucket?;
        if is_free(held, &bucket, consumer)? {
            out.append(bucket)?;
        }
    }
    Ok(out)
}

/// Whether no consumer but `consumer` holds leases in `bucket`.
pub(crate) fn is_free(
    held: &Bound<'_, PyDict>,
    bucket: &Bound<'_, PyAny>,
    consumer: &Bound<'_, PyString>,
) -> PyResult<bool> {
    Ok(match held.get_item(bucket)? {
        None => true,
        Some(counts) => {
            let counts = counts.downcast_into::<PyDict>()?;
            counts.is_empty() || (counts.len() == 1 && counts.contains(consumer)?)
        }
    })
}
