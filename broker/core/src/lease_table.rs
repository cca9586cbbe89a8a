//! Which lease record holds each leased message (and each acked one, until its trim):
//! the state's one table of messages, probed by every lease on every node. Keyed by
//! message handle (`handles.rs`), 16 bytes whatever the id, so a lease's picks are
//! checked and entered, and a trim's removed, in one call that makes no Python object
//! per message; a value is a reference to the record, as a dict's would be.

use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PySet, PyString};

use crate::handles::{mh, WIDTH};
use crate::id_map::IdMap;
use crate::packed_ids::PackedIds;

/// Message handle -> its lease record (`leases.LeaseRecord`), as `TopicState.leases`.
/// A message is named by its handle (int) or its id (str, hashed to its handle); the
/// keys it gives back are handles.
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

/// The handle of a message named by `key`: its handle (int) or its id (str); None for
/// anything else, which names no message.
fn handle_of(key: &Bound<'_, PyAny>) -> PyResult<Option<u128>> {
    if let Ok(mid) = key.downcast::<PyString>() {
        return Ok(Some(mh(mid.to_str()?.as_bytes())));
    }
    if key.downcast::<PyInt>().is_ok() {
        return Ok(key.extract::<u128>().ok());
    }
    Ok(None)
}

/// `handle_of`, for a call that must name a message.
fn named(key: &Bound<'_, PyAny>) -> PyResult<u128> {
    handle_of(key)?.ok_or_else(|| PyTypeError::new_err("a message is named by its id or handle"))
}

/// A message a call names, by handle or id: read as the call's argument, before the
/// table is borrowed (`LeaseTable`'s note).
struct Named(u128);

impl<'py> FromPyObject<'py> for Named {
    fn extract_bound(key: &Bound<'py, PyAny>) -> PyResult<Self> {
        named(key).map(Named)
    }
}

/// The handles of the messages `mids` names: handles packed 16 bytes each (bytes),
/// packed ids, or an iterable of ids (str) or handles (int).
pub(crate) fn handles_of(py: Python<'_>, mids: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
    if let Ok(blob) = mids.downcast::<PyBytes>() {
        let blob = blob.as_bytes();
        if !blob.len().is_multiple_of(WIDTH) {
            return Err(PyValueError::new_err("packed handles are 16 bytes each"));
        }
        return Ok(blob
            .chunks_exact(WIDTH)
            .map(|b| u128::from_le_bytes(b.try_into().expect("16 bytes")))
            .collect());
    }
    if let Ok(packed) = mids.downcast::<PackedIds>() {
        let strs = Vec::new();
        return Ok(raw_ids(py, packed.as_any(), &strs)?
            .into_iter()
            .map(mh)
            .collect());
    }
    mids.try_iter()?.map(|m| named(&m?)).collect()
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
    fn handles(slf: &Bound<'_, Self>) -> Vec<u128> {
        slf.borrow().map.iter().map(|(k, _)| k).collect()
    }

    /// Enter each of `handles` in `record` unless it is in a lease, or was entered just
    /// before (picked twice): the indexes of those entered.
    pub(crate) fn enter_each(&mut self, handles: &[u128], record: &Bound<'_, PyAny>) -> Vec<usize> {
        self.map.reserve(handles.len());
        let tags = self.map.warm(handles);
        (handles.iter().zip(&tags).enumerate())
            .filter_map(|(k, (&handle, &tag))| {
                self.map
                    .add_tagged(handle, tag, record.clone().unbind())
                    .then_some(k)
            })
            .collect()
    }

    /// Whether the message of handle `handle` is in a lease (the index's pick asks).
    pub(crate) fn holds(&self, handle: u128) -> bool {
        self.map.contains_key(handle)
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

    /// Equal to another table, or a dict by handle, holding the same messages, each in
    /// an equal record.
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
        Ok(handle_of(mid)?.is_some_and(|h| self.map.contains_key(h)))
    }

    fn __getitem__(&self, py: Python<'_>, mid: Named) -> PyResult<PyObject> {
        self.map
            .get(mid.0)
            .map(|r| r.clone_ref(py))
            .ok_or_else(|| PyKeyError::new_err(mid.0))
    }

    fn __setitem__(&mut self, mid: Named, record: PyObject) {
        self.map.insert(mid.0, record);
    }

    fn __delitem__(&mut self, mid: Named) -> PyResult<()> {
        self.map
            .remove(mid.0)
            .map(drop)
            .ok_or_else(|| PyKeyError::new_err(mid.0))
    }

    /// `mid`'s record, or `default`.
    #[pyo3(signature = (mid, default = None))]
    fn get(
        &self,
        py: Python<'_>,
        mid: &Bound<'_, PyAny>,
        default: Option<PyObject>,
    ) -> PyResult<Option<PyObject>> {
        let Some(h) = handle_of(mid)? else {
            return Ok(default);
        };
        Ok(self.map.get(h).map(|r| r.clone_ref(py)).or(default))
    }

    /// Enter `mid` in `record` unless it is in one: whether it was entered.
    fn add(&mut self, mid: Named, record: PyObject) -> bool {
        self.map.add(mid.0, record)
    }

    /// Remove `mid`: its record, or `default` if it was in none.
    #[pyo3(signature = (mid, default = None))]
    fn pop(&mut self, mid: Named, default: Option<PyObject>) -> Option<PyObject> {
        self.map.remove(mid.0).or(default)
    }

    /// The handles, as a set (a dict's keys compare as one).
    fn keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PySet>> {
        PySet::new(slf.py(), Self::handles(slf))
    }

    /// The handles, in no order.
    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        PyList::new(slf.py(), Self::handles(slf))?
            .try_iter()
            .map(Bound::into_any)
    }

    /// (handle, record) pairs, in no order.
    fn items<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let items: Vec<(u128, PyObject)> = (slf.borrow().map.iter())
            .map(|(k, r)| (k, r.clone_ref(py)))
            .collect();
        PyList::new(py, items)
    }

    /// Enter every message `mids` names (as `handles_of` reads it) in `record` if none
    /// is in a lease and none is named twice: whether they were. Otherwise nothing
    /// changes.
    fn add_all(slf: &Bound<'_, Self>, mids: &Bound<'_, PyAny>, record: PyObject) -> PyResult<bool> {
        let py = slf.py();
        let handles = handles_of(py, mids)?;
        let removed: Vec<PyObject> = {
            let mut table = slf.borrow_mut();
            let entered = table.enter_each(&handles, record.bind(py));
            if entered.len() == handles.len() {
                return Ok(true);
            }
            // In no lease before this call: as they were.
            (entered.iter())
                .filter_map(|&k| table.map.remove(handles[k]))
                .collect()
        };
        drop(removed); // the record's references go after the borrow
        Ok(false)
    }

    /// Remove every message `mids` names (as `handles_of` reads it) that is in a lease:
    /// a trim's acked messages.
    fn discard_all(slf: &Bound<'_, Self>, mids: &Bound<'_, PyAny>) -> PyResult<()> {
        let handles = handles_of(slf.py(), mids)?;
        let removed: Vec<PyObject> = {
            let map = &mut slf.borrow_mut().map;
            let tags = map.warm(&handles);
            (handles.iter().zip(tags))
                .filter_map(|(&handle, tag)| map.remove_tagged(handle, tag))
                .collect()
        };
        drop(removed); // the records' references go after the borrow
        Ok(())
    }
}
