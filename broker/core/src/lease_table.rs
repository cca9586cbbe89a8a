//! Which lease record holds each leased message (and each acked one, until its trim):
//! the state's one table by id, probed by every lease on every node. Keyed by the ids'
//! bytes, so a lease's packed ids (`packed_ids.rs`) are checked and entered, and a
//! trim's removed, in one call that makes no Python object per message; a value is a
//! reference to the record, as a dict's would be.

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyString};

use crate::grant::{grant, Overrides};

use crate::id_map::IdMap;
use crate::packed_ids::PackedIds;

/// Message id -> its lease record (`leases.LeaseRecord`), as `TopicState.leases`.
///
/// Threads off the event loop read it (an index's stats) while the loop changes it.
/// The GIL serialises them, but making a Python object while the table is borrowed may
/// run the garbage collector, and with it another thread, whose borrow would then fail:
/// so methods make their Python objects before or after borrowing it, never during.
#[pyclass(module = "dejaq_core")]
#[derive(Default)]
pub struct LeaseTable {
    map: IdMap<Py<PyAny>>,
}

fn as_str<'py>(py: Python<'py>, raw: &[u8]) -> Bound<'py, PyString> {
    // Every key was entered from a str's UTF-8 or from packed ids checked to be UTF-8.
    PyString::new(py, &String::from_utf8_lossy(raw))
}

/// The ids of packed ids, or of a list (or any iterable) of str, as strs' bytes (kept
/// alive by the caller's `holder`) or packed slices.
fn each_id<'a, 'py>(
    py: Python<'py>,
    mids: &'a Bound<'py, PyAny>,
    holder: &'a mut Vec<Bound<'py, PyString>>,
) -> PyResult<Vec<&'a [u8]>> {
    if let Ok(packed) = mids.downcast::<PackedIds>() {
        return packed_raws(py, packed.get());
    }
    if let Ok(list) = mids.downcast::<PyList>() {
        for m in list.iter() {
            holder.push(m.downcast_into::<PyString>()?);
        }
    } else {
        for m in mids.try_iter()? {
            holder.push(m?.downcast_into::<PyString>()?);
        }
    }
    holder.iter().map(|m| Ok(m.to_str()?.as_bytes())).collect()
}

/// The ids of packed ids, each checked to be UTF-8 (as it will be a str's).
pub(crate) fn packed_raws<'a>(py: Python<'a>, packed: &'a PackedIds) -> PyResult<Vec<&'a [u8]>> {
    let raws: Vec<&'a [u8]> = packed.each(py).collect();
    for raw in &raws {
        std::str::from_utf8(raw)
            .map_err(|_| PyValueError::new_err("a packed message id is not UTF-8"))?;
    }
    Ok(raws)
}

impl LeaseTable {
    fn ids<'py>(slf: &Bound<'py, Self>) -> PyResult<Vec<Bound<'py, PyString>>> {
        let py = slf.py();
        let raws: Vec<Vec<u8>> = (slf.borrow().map.iter())
            .map(|(k, _)| k.as_bytes().to_vec())
            .collect();
        Ok(raws.iter().map(|r| as_str(py, r)).collect())
    }

    /// Enter each of `raws` in `record` unless it is in a lease, or was entered just
    /// before (picked twice): the indexes of those entered.
    pub(crate) fn enter_each(&mut self, raws: &[&[u8]], record: &Bound<'_, PyAny>) -> Vec<usize> {
        self.map.reserve(raws.len());
        let tags = self.map.warm(raws);
        (raws.iter().zip(&tags).enumerate())
            .filter_map(|(k, (&raw, &tag))| {
                self.map
                    .add_tagged(raw, tag, record.clone().unbind())
                    .then_some(k)
            })
            .collect()
    }

    /// Whether the id whose bytes are `raw` is in a lease (the index's pick asks).
    pub(crate) fn holds(&self, raw: &[u8]) -> bool {
        self.map.contains_key(raw)
    }
}

#[pymethods]
impl LeaseTable {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    fn __len__(&self) -> usize {
        self.map.len()
    }

    /// Equal to another table or a dict holding the same ids, each in an equal record.
    fn __eq__(slf: &Bound<'_, Self>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let mine = Self::items(slf)?;
        let theirs = if let Ok(table) = other.downcast::<LeaseTable>() {
            Self::items(table)?
        } else if let Ok(dict) = other.downcast::<PyDict>() {
            dict.items()
        } else {
            return Ok(false);
        };
        if mine.len() != theirs.len() {
            return Ok(false);
        }
        let mine = PyDict::from_sequence(&mine.into_any())?;
        mine.eq(PyDict::from_sequence(&theirs.into_any())?)
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        Ok(format!("LeaseTable({})", Self::items(slf)?.repr()?))
    }

    fn __contains__(&self, mid: &Bound<'_, PyAny>) -> PyResult<bool> {
        match mid.downcast::<PyString>() {
            Ok(mid) => Ok(self.map.contains_key(mid.to_str()?.as_bytes())),
            Err(_) => Ok(false),
        }
    }

    fn __getitem__(&self, py: Python<'_>, mid: &str) -> PyResult<PyObject> {
        self.map
            .get(mid.as_bytes())
            .map(|r| r.clone_ref(py))
            .ok_or_else(|| PyKeyError::new_err(mid.to_owned()))
    }

    fn __setitem__(&mut self, mid: &str, record: PyObject) {
        self.map.insert(mid.as_bytes(), record);
    }

    fn __delitem__(&mut self, mid: &str) -> PyResult<()> {
        self.map
            .remove(mid.as_bytes())
            .map(drop)
            .ok_or_else(|| PyKeyError::new_err(mid.to_owned()))
    }

    /// `mid`'s record, or `default`.
    #[pyo3(signature = (mid, default = None))]
    fn get(&self, py: Python<'_>, mid: &str, default: Option<PyObject>) -> Option<PyObject> {
        self.map
            .get(mid.as_bytes())
            .map(|r| r.clone_ref(py))
            .or(default)
    }

    /// Enter `mid` in `record` unless it is in one: whether it was entered.
    fn add(&mut self, mid: &str, record: PyObject) -> bool {
        self.map.add(mid.as_bytes(), record)
    }

    /// Remove `mid`: its record, or `default` if it was in none.
    #[pyo3(signature = (mid, default = None))]
    fn pop(&mut self, mid: &str, default: Option<PyObject>) -> Option<PyObject> {
        self.map.remove(mid.as_bytes()).or(default)
    }

    /// The ids, as a set (a dict's keys compare as one).
    fn keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PySet>> {
        PySet::new(slf.py(), Self::ids(slf)?)
    }

    /// The ids, in no order.
    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        PyList::new(slf.py(), Self::ids(slf)?)?
            .try_iter()
            .map(Bound::into_any)
    }

    /// (id, record) pairs, in no order.
    fn items<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let items: Vec<(Vec<u8>, PyObject)> = (slf.borrow().map.iter())
            .map(|(k, r)| (k.as_bytes().to_vec(), r.clone_ref(py)))
            .collect();
        PyList::new(py, items.into_iter().map(|(k, r)| (as_str(py, &k), r)))
    }

    /// Enter every id of `mids` in `record` if none is in a lease and none is named
    /// twice: whether they were. Otherwise nothing changes. A lease's usual case, all
    /// its picks available, in one call.
    fn add_all(slf: &Bound<'_, Self>, mids: &Bound<'_, PyAny>, record: PyObject) -> PyResult<bool> {
        let py = slf.py();
        let mut holder = Vec::new();
        let raws = each_id(py, mids, &mut holder)?;
        let mut table = slf.borrow_mut();
        let map = &mut table.map;
        map.reserve(raws.len());
        let tags = map.warm(&raws);
        for (added, (&raw, &tag)) in raws.iter().zip(&tags).enumerate() {
            if !map.add_tagged(raw, tag, record.clone_ref(py)) {
                for (&raw, &tag) in raws[..added].iter().zip(&tags) {
                    map.remove_tagged(raw, tag); // in no lease before this call: as they were
                }
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Grant `record` the lease command's picks still available (`grant.rs`); returns
    /// how many of those granted were redelivered.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        record, mids, buckets, keys, owned, held, consumer, settled, not_before, deliveries,
        now, allowed
    ))]
    fn grant<'py>(
        slf: &Bound<'py, Self>,
        record: &Bound<'py, PyAny>,
        mids: &Bound<'py, PyAny>,
        buckets: &Bound<'py, PyBytes>,
        keys: &Bound<'py, PyBytes>,
        owned: &Bound<'py, PyAny>,
        held: &Bound<'py, PyDict>,
        consumer: &Bound<'py, PyString>,
        settled: Bound<'py, PyDict>,
        not_before: Bound<'py, PyDict>,
        deliveries: Bound<'py, PyDict>,
        now: i64,
        allowed: Option<usize>,
    ) -> PyResult<usize> {
        let by_id = Overrides {
            settled,
            not_before,
            deliveries,
        };
        grant(
            slf, record, mids, buckets, keys, owned, held, consumer, &by_id, now, allowed,
        )
    }

    /// Remove every id of `mids` (packed ids, or str) that is in a lease: a trim's
    /// acked messages.
    fn discard_all(slf: &Bound<'_, Self>, mids: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut holder = Vec::new();
        let raws = each_id(slf.py(), mids, &mut holder)?;
        let removed: Vec<PyObject> = {
            let map = &mut slf.borrow_mut().map;
            let tags = map.warm(&raws);
            (raws.iter().zip(tags))
                .filter_map(|(raw, tag)| map.remove_tagged(raw, tag))
                .collect()
        };
        drop(removed); // the records' references go after the borrow
        Ok(())
    }
}
