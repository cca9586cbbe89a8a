//! Which lease record holds each leased message (and each acked one, until its trim):
//! the state's one table by id, probed by every lease on every node. Keyed by the ids'
//! bytes, so a lease's packed ids (`packed_ids.rs`) are checked and entered, and a
//! trim's removed, in one call that makes no Python object per message; a value is a
//! reference to the record, as a dict's would be.

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString};

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

/// The strs of a list (or any iterable) of str; none for packed ids, whose bytes
/// `raw_ids` reads where they are.
pub(crate) fn id_strs<'py>(mids: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyString>>> {
    if mids.downcast::<PackedIds>().is_ok() {
        return Ok(Vec::new());
    }
    if let Ok(list) = mids.downcast::<PyList>() {
        return list.iter().map(|m| Ok(m.downcast_into()?)).collect();
    }
    mids.try_iter()?.map(|m| Ok(m?.downcast_into()?)).collect()
}

/// The ids' bytes: packed ids' own (each checked to be UTF-8, as it will be a str's),
/// or those of `strs`, the ids' strs (`id_strs`).
pub(crate) fn raw_ids<'a, 'py>(
    py: Python<'py>,
    mids: &'a Bound<'py, PyAny>,
    strs: &'a [Bound<'py, PyString>],
) -> PyResult<Vec<&'a [u8]>> {
    let Ok(packed) = mids.downcast::<PackedIds>() else {
        return strs.iter().map(|m| Ok(m.to_str()?.as_bytes())).collect();
    };
    let packed: &'a PackedIds = packed.get();
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
    /// twice: whether they were. Otherwise nothing changes.
    fn add_all(slf: &Bound<'_, Self>, mids: &Bound<'_, PyAny>, record: PyObject) -> PyResult<bool> {
        let py = slf.py();
        let strs = id_strs(mids)?;
        let raws = raw_ids(py, mids, &strs)?;
        let removed: Vec<PyObject> = {
            let mut table = slf.borrow_mut();
            let entered = table.enter_each(&raws, record.bind(py));
            if entered.len() == raws.len() {
                return Ok(true);
            }
            // In no lease before this call: as they were.
            (entered.iter())
                .filter_map(|&k| table.map.remove(raws[k]))
                .collect()
        };
        drop(removed); // the record's references go after the borrow
        Ok(false)
    }

    /// Remove every id of `mids` (packed ids, or str) that is in a lease: a trim's
    /// acked messages.
    fn discard_all(slf: &Bound<'_, Self>, mids: &Bound<'_, PyAny>) -> PyResult<()> {
        let strs = id_strs(mids)?;
        let raws = raw_ids(slf.py(), mids, &strs)?;
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
