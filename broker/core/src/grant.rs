//! A lease command's grant (`TopicState.lease`), applied by every node for every lease:
//! which of the leader's picks are still available, entered in the lease table and the
//! record's columns, in one call. Written in Python it is a dozen steps of a fraction
//! of a µs each (the picks' columns unpacked, the consumer's free buckets made a set, a
//! loop over the picks, the holds counted), a large part of a follower's work at batch 1.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::buckets::{hold_in, is_free};
use crate::lease_record::{Granted, LeaseRecord};
use crate::lease_table::{handles_of, LeaseTable};

/// Grant `record` (a `leases.LeaseRecord`) the picks (`handles`: their message handles
/// packed 16 bytes each, or, in id-keyed commands, their ids as packed ids
/// or a list of str, hashed here; `buckets` and `keys` as little-endian uint16 and
/// int64 bytes), at most
/// `allowed` of them, that are available at `now`: in a free bucket of the consumer's
/// (`owned`, `held`), neither settled nor delayed (`settled`, `not_before`), picked at
/// the key in force (`sort_keys`: a reschedule or a nack's priority applied since the
/// pick moved it), nor leased (in `table`), nor picked twice; each with one delivery
/// more than its count in `deliveries`. Fills the record's positions (all leased);
/// counts the holds. Returns how many of the granted were redelivered. `table`,
/// `settled`, `not_before`, `sort_keys` and `deliveries` are keyed by message handle.
/// `TopicState.lease` says the rules; this is their loop.
#[pyfunction]
#[pyo3(signature = (
    table, record, handles, buckets, keys, owned, held, consumer, settled, not_before, sort_keys,
    deliveries, now, allowed
))]
#[allow(clippy::too_many_arguments)]
pub fn grant<'py>(
    table: &Bound<'py, LeaseTable>,
    record: &Bound<'py, LeaseRecord>,
    handles: &Bound<'py, PyAny>,
    buckets: &Bound<'py, PyBytes>,
    keys: &Bound<'py, PyBytes>,
    owned: &Bound<'py, PyAny>,
    held: &Bound<'py, PyDict>,
    consumer: &Bound<'py, PyString>,
    settled: &Bound<'py, PyDict>,
    not_before: &Bound<'py, PyDict>,
    sort_keys: &Bound<'py, PyDict>,
    deliveries: &Bound<'py, PyDict>,
    now: i64,
    allowed: Option<usize>,
) -> PyResult<usize> {
    let py = table.py();
    let handles = handles_of(py, handles)?;
    let (bucket_bytes, key_bytes) = (buckets.as_bytes(), keys.as_bytes());
    if bucket_bytes.len() != 2 * handles.len() || key_bytes.len() != 8 * handles.len() {
        return Err(PyValueError::new_err(format!(
            "{} picks with {} bytes of buckets and {} of sort keys",
            handles.len(),
            bucket_bytes.len(),
            key_bytes.len()
        )));
    }
    let bucket_of = |i: usize| u16::from_le_bytes([bucket_bytes[2 * i], bucket_bytes[2 * i + 1]]);
    let key_of = |i: usize| {
        let mut le = [0u8; 8];
        le.copy_from_slice(&key_bytes[8 * i..8 * i + 8]);
        i64::from_le_bytes(le)
    };
    let take = allowed.map_or(handles.len(), |a| a.min(handles.len()));

    // Which picks may be granted, before the table is borrowed: the checks below make
    // Python objects (an int per handle to probe a dict, an int per bucket), and making
    // one may run another thread, which may read the table (`LeaseTable`'s note). Each
    // candidate's handle is made a Python int once, for every dict it is looked up in,
    // here and in `deliveries` below.
    let mine = owned_buckets(owned)?;
    let mut free: ByBucket<bool> = ByBucket::default();
    let probe = !(settled.is_empty() && not_before.is_empty() && sort_keys.is_empty());
    let mut candidates: Vec<usize> = Vec::with_capacity(take);
    let mut picked: Vec<u128> = Vec::with_capacity(take);
    let mut ints: Vec<Bound<'py, PyAny>> = Vec::with_capacity(if probe { take } else { 0 });
    for (i, &handle) in handles[..take].iter().enumerate() {
        let bucket = bucket_of(i);
        let ok = match free.get(bucket) {
            Some(ok) => ok,
            None => {
                let ok = mine.binary_search(&bucket).is_ok()
                    && is_free(held, &bucket.into_bound_py_any(py)?, consumer)?;
                free.insert(bucket, ok);
                ok
            }
        };
        if !ok {
            continue;
        }
        if probe {
            let int = handle.into_pyobject(py)?.into_any();
            if !settled.is_empty() && settled.contains(&int)? {
                continue;
            }
            // Picked before a reschedule moved it: early at its old time, or out of order.
            if !sort_keys.is_empty() {
                if let Some(key) = sort_keys.get_item(&int)? {
                    if key.extract::<i64>()? != key_of(i) {
                        continue;
                    }
                }
            }
            // A leased message has neither a delay nor a count outside its lease.
            if !not_before.is_empty() {
                if let Some(at) = not_before.get_item(&int)? {
                    if at.extract::<i64>()? > now {
                        continue;
                    }
                    not_before.del_item(&int)?;
                }
            }
            ints.push(int);
        }
        candidates.push(i);
        picked.push(handle);
    }

    let entered: Vec<usize> = table.borrow_mut().enter_each(&picked, record.as_any());
    let granted: Vec<usize> = entered.iter().map(|&k| candidates[k]).collect();

    let mut counts: Vec<i32> = vec![1; granted.len()];
    let mut redelivered = 0;
    if !deliveries.is_empty() {
        for (count, &k) in counts.iter_mut().zip(&entered) {
            let int = match ints.get(k) {
                Some(int) => int.clone(),
                None => picked[k].into_pyobject(py)?.into_any(),
            };
            if let Some(before) = deliveries.get_item(&int)? {
                *count += before.extract::<i32>()?;
                deliveries.del_item(&int)?;
                if *count > 1 {
                    redelivered += 1;
                }
            }
        }
    }

    let granted_handles: Vec<u128> = entered.iter().map(|&k| picked[k]).collect();
    let rows: Vec<Granted> = (granted.iter().zip(counts))
        .map(|(&i, count)| {
            let raw: [u8; 8] = key_bytes[8 * i..8 * i + 8].try_into().expect("8 bytes");
            Granted::new(bucket_of(i), i64::from_le_bytes(raw), count)
        })
        .collect();
    record.borrow_mut().fill(granted_handles, rows);

    // In the order each bucket first appears, as every node then adds to `held`.
    let mut per_bucket: Vec<(u16, i64)> = Vec::new();
    let mut at: ByBucket<usize> = ByBucket::default();
    for &i in &granted {
        let bucket = bucket_of(i);
        let k = match at.get(bucket) {
            Some(k) => k,
            None => {
                per_bucket.push((bucket, 0));
                at.insert(bucket, per_bucket.len() - 1);
                per_bucket.len() - 1
            }
        };
        per_bucket[k].1 += 1;
    }
    for (bucket, count) in per_bucket {
        hold_in(held, &bucket.into_bound_py_any(py)?, count, consumer, 1)?;
    }
    Ok(redelivered)
}

/// The consumer's buckets (`owned`: a list, or a tuple when it owns none), sorted for
/// a binary search: a lease at batch 1 asks once, and a hash set would cost an
/// allocation and its hashing for a consumer that owns a bucket or two.
fn owned_buckets(owned: &Bound<'_, PyAny>) -> PyResult<Vec<u16>> {
    let mut mine: Vec<u16> = if let Ok(list) = owned.downcast::<PyList>() {
        list.iter().map(|b| b.extract()).collect::<PyResult<_>>()?
    } else if let Ok(tuple) = owned.downcast::<PyTuple>() {
        tuple.iter().map(|b| b.extract()).collect::<PyResult<_>>()?
    } else {
        owned
            .try_iter()?
            .map(|b| b?.extract())
            .collect::<PyResult<_>>()?
    };
    mine.sort_unstable();
    Ok(mine)
}

/// A value per bucket met in a lease's picks: searched in a short vector while few
/// buckets are (a lease at batch 1 meets one), in a map past that, as a lease of 1000
/// picks may meet as many buckets.
enum ByBucket<V> {
    Few(Vec<(u16, V)>),
    Many(HashMap<u16, V, RandomState>),
}

/// Buckets kept in the vector before the map takes over.
const FEW_BUCKETS: usize = 16;

impl<V> Default for ByBucket<V> {
    fn default() -> Self {
        Self::Few(Vec::new())
    }
}

impl<V: Copy> ByBucket<V> {
    fn get(&self, bucket: u16) -> Option<V> {
        match self {
            Self::Few(few) => few.iter().find(|(b, _)| *b == bucket).map(|&(_, v)| v),
            Self::Many(many) => many.get(&bucket).copied(),
        }
    }

    /// Add a bucket not in the map yet.
    fn insert(&mut self, bucket: u16, value: V) {
        match self {
            Self::Few(few) if few.len() < FEW_BUCKETS => few.push((bucket, value)),
            Self::Few(few) => {
                let mut many: HashMap<u16, V, RandomState> = few.drain(..).collect();
                many.insert(bucket, value);
                *self = Self::Many(many);
            }
            Self::Many(many) => {
                many.insert(bucket, value);
            }
        }
    }
}
