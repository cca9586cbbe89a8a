//! Message ids packed in one bytes object, each NUL-padded to one width: how lease
//! commands, lease records and ack runs from before message handles (`handles.rs`)
//! carried their messages. Kept so that journals and snapshots of that time load:
//! every node hashes their ids into handles as it applies or loads them.

use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySlice, PyString, PyTuple};

use crate::ids::WIDEST;

/// Ids `width` bytes apiece, NUL-padded: an id ending in a NUL byte, or longer than
/// `ids::WIDEST`, cannot be packed, and its lease carries a list of str instead.
/// Immutable; a slice shares the bytes object of what it was cut from.
#[pyclass(module = "dejaq_core", frozen, sequence)]
pub struct PackedIds {
    blob: Py<PyBytes>,
    pub(crate) width: usize,
    start: usize,
    len: usize,
}

impl PackedIds {
    /// The packed bytes of its ids.
    pub(crate) fn raw<'a>(&'a self, py: Python<'a>) -> &'a [u8] {
        let w = self.width;
        &self.blob.as_bytes(py)[self.start * w..(self.start + self.len) * w]
    }

    /// Each id's bytes, without its padding.
    pub(crate) fn each<'a>(&'a self, py: Python<'a>) -> impl Iterator<Item = &'a [u8]> {
        self.raw(py).chunks_exact(self.width).map(unpadded)
    }

    fn id<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyString>> {
        let w = self.width;
        as_str(py, unpadded(&self.raw(py)[i * w..(i + 1) * w]))
    }

    fn strs<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyString>>> {
        self.each(py).map(|raw| as_str(py, raw)).collect()
    }
}

/// `count` ids, `width` bytes apiece in one bytes object, each NUL-padded (the object
/// starts zeroed).
fn padded<'py, 'a>(
    py: Python<'py>,
    width: usize,
    count: usize,
    ids: impl Iterator<Item = &'a [u8]>,
) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, width * count, |blob| {
        for (id, to) in ids.zip(blob.chunks_exact_mut(width)) {
            to[..id.len()].copy_from_slice(id);
        }
        Ok(())
    })
}

/// An id's bytes without the NUL bytes that pad it.
pub(crate) fn unpadded(raw: &[u8]) -> &[u8] {
    let len = raw.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    &raw[..len]
}

fn as_str<'py>(py: Python<'py>, raw: &[u8]) -> PyResult<Bound<'py, PyString>> {
    let mid = std::str::from_utf8(raw)
        .map_err(|_| PyValueError::new_err("a packed message id is not UTF-8"))?;
    Ok(PyString::new(py, mid))
}

#[pymethods]
impl PackedIds {
    /// `blob`: the ids, `width` bytes apiece (1..=64), each NUL-padded.
    #[new]
    fn new(blob: Bound<'_, PyBytes>, width: usize) -> PyResult<Self> {
        let size = blob.as_bytes().len();
        if width == 0 || width > WIDEST || size % width != 0 {
            return Err(PyValueError::new_err(format!(
                "packed ids are 1 to {WIDEST} bytes wide and fill their bytes: \
                 {size} bytes at width {width}"
            )));
        }
        Ok(Self {
            blob: blob.unbind(),
            width,
            start: 0,
            len: size / width,
        })
    }

    /// Packs `mids` at the width of the longest, or None if one cannot be packed (longer
    /// than 64 bytes, or ending in a NUL byte, which its padding would swallow).
    #[staticmethod]
    fn pack(py: Python<'_>, mids: Vec<String>) -> PyResult<Option<Self>> {
        let width = mids.iter().map(String::len).max().unwrap_or(1).max(1);
        if width > WIDEST || mids.iter().any(|m| m.ends_with('\0')) {
            return Ok(None);
        }
        let blob = padded(py, width, mids.len(), mids.iter().map(String::as_bytes))?;
        Self::new(blob, width).map(Some)
    }

    #[getter]
    fn width(&self) -> usize {
        self.width
    }

    /// The packed bytes: the very object it was made from unless it is a slice.
    #[getter]
    fn blob<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let whole = self.blob.bind(py);
        if self.start == 0 && self.len * self.width == whole.as_bytes().len() {
            return whole.clone();
        }
        PyBytes::new(py, self.raw(py))
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// An id as a str; a slice (of step 1) as packed ids sharing these bytes.
    fn __getitem__<'py>(&self, py: Python<'py>, at: &Bound<'py, PyAny>) -> PyResult<PyObject> {
        if let Ok(slice) = at.downcast::<PySlice>() {
            let ix = slice.indices(self.len as isize)?;
            if ix.step != 1 {
                let picked = (0..ix.slicelength)
                    .map(|k| self.id(py, (ix.start + k as isize * ix.step) as usize))
                    .collect::<PyResult<Vec<_>>>()?;
                return Ok(PyList::new(py, picked)?.into_any().unbind());
            }
            let part = Self {
                blob: self.blob.clone_ref(py),
                width: self.width,
                start: self.start + ix.start as usize,
                len: ix.slicelength,
            };
            return Ok(Bound::new(py, part)?.into_any().unbind());
        }
        let i: isize = at
            .extract()
            .map_err(|_| PyTypeError::new_err("packed ids are indexed by int or slice"))?;
        let i = if i < 0 { i + self.len as isize } else { i };
        if i < 0 || i as usize >= self.len {
            return Err(PyIndexError::new_err("packed id index out of range"));
        }
        Ok(self.id(py, i as usize)?.into_any().unbind())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyList::new(py, self.strs(py)?)?
            .try_iter()
            .map(Bound::into_any)
    }

    /// Equal to packed ids, or to a sequence of str, holding the same ids in order.
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Ok(other) = other.downcast::<PackedIds>() {
            let other = other.get();
            return Ok(self.len == other.len && self.each(py).eq(other.each(py)));
        }
        let Ok(mids) = other.extract::<Vec<String>>() else {
            return Ok(false);
        };
        Ok(mids.len() == self.len && self.each(py).eq(mids.iter().map(String::as_bytes)))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let mids: Vec<String> = self.strs(py)?.iter().map(|s| s.to_string()).collect();
        Ok(format!("PackedIds({mids:?})"))
    }

    /// Pickled as its bytes and width (a slice's own bytes, not what it was cut from).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let me = slf.get();
        let args = (me.blob(py), me.width).into_pyobject(py)?;
        PyTuple::new(py, [slf.get_type().into_any(), args.into_any()])
    }
}
