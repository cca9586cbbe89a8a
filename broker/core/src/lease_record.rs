//! A lease command's record (`leases.LeaseRecord`): the messages one lease granted, by
//! position, which is what a receipt names. Every node makes one for every lease and
//! ends its positions on every ack, so its columns are Rust vectors: a record is one
//! Python object however many messages it holds, made without the five `array`s and
//! the `bytearray` its columns would otherwise be, and an ack reads and ends a position
//! in one call.
//!
//! Threads off the event loop read records (the leader's expiry check calls
//! `earliest`): methods make their Python objects before or after borrowing a record,
//! never during (`LeaseTable`'s note says why).

use std::collections::{BTreeMap, HashMap};

use pyo3::exceptions::{PyIndexError, PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::packed_ids::PackedIds;

/// A receipt is `lid << POSITION_BITS | position` (`leases.POSITION_BITS`).
const POSITION_BITS: u32 = 10;
/// How a position's lease ended (`leases.LEASED`...): the settling ones.
const ACKED: u8 = 1;
const REJECTED: u8 = 2;
const CANCELLED: u8 = 6;
const DEAD: u8 = 7;
/// `status` codes past the ended ones (1..=7), for a position not held by the caller.
const NOT_LEASED: u8 = 8;
const OTHER_CONSUMER: u8 = 9;
const EXPIRED_NOW: u8 = 10;

static ARRAY: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
static NEWOBJ: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

/// `array.array(code, data)`, data in native order.
fn array<'py>(py: Python<'py>, code: &str, data: Vec<u8>) -> PyResult<Bound<'py, PyAny>> {
    let array = ARRAY.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("array")?.getattr("array")?.unbind())
    })?;
    array.bind(py).call1((code, PyBytes::new(py, &data)))
}

/// A column from a snapshot: an `array` of its type, or (older) a list of ints.
fn column<'py, T: FromPyObject<'py>>(value: &Bound<'py, PyAny>) -> PyResult<Vec<T>> {
    value.try_iter()?.map(|v| v?.extract()).collect()
}

#[pyclass(module = "dejaq.broker.state.leases", name = "LeaseRecord")]
pub struct LeaseRecord {
    lid: i64,
    consumer: Py<PyString>,
    consumer_bytes: Box<[u8]>,
    deadline: i64,
    /// Packed ids (a lease granted whole, the usual case) or a list of str.
    mids: PyObject,
    buckets: Vec<u16>,
    sort_keys: Vec<i64>,
    deliveries: Vec<i32>,
    /// Per position: 0 while leased, else how its lease ended.
    ended: Vec<u8>,
    /// Positions extended on their own: their deadlines.
    deadlines: Option<BTreeMap<usize, i64>>,
    live: usize,
    /// Positions by id, made when an id names one (ids are the slower way).
    positions: Option<HashMap<Box<[u8]>, usize>>,
}

impl LeaseRecord {
    /// The granted picks, as `grant` found them: every position leased.
    pub(crate) fn fill(
        &mut self,
        mids: PyObject,
        buckets: Vec<u16>,
        sort_keys: Vec<i64>,
        deliveries: Vec<i32>,
    ) {
        let n = buckets.len();
        self.mids = mids;
        self.buckets = buckets;
        self.sort_keys = sort_keys;
        self.deliveries = deliveries;
        self.ended = vec![0; n];
        self.deadlines = None;
        self.live = n;
        self.positions = None;
    }

    fn deadline_at(&self, pos: usize) -> i64 {
        match &self.deadlines {
            Some(d) => *d.get(&pos).unwrap_or(&self.deadline),
            None => self.deadline,
        }
    }

    fn check(&self, pos: usize) -> PyResult<()> {
        if pos < self.ended.len() {
            Ok(())
        } else {
            Err(PyIndexError::new_err("no such position in the lease"))
        }
    }

    fn end_one(&mut self, pos: usize, how: u8) -> PyResult<usize> {
        self.check(pos)?;
        if self.ended[pos] != 0 || how == 0 {
            return Err(PyValueError::new_err("a position's lease ends once"));
        }
        self.ended[pos] = how;
        self.live -= 1;
        Ok(self.live)
    }

    fn status_of(&self, pos: usize, consumer: &[u8], now: i64) -> u8 {
        if pos >= self.ended.len() {
            NOT_LEASED
        } else if self.ended[pos] != 0 {
            self.ended[pos]
        } else if *self.consumer_bytes != *consumer {
            OTHER_CONSUMER
        } else if self.deadline_at(pos) <= now {
            EXPIRED_NOW
        } else {
            0
        }
    }
}

#[pymethods]
impl LeaseRecord {
    #[new]
    #[pyo3(signature = (lid = 0, consumer = None, deadline = 0))]
    fn new(
        py: Python<'_>,
        lid: i64,
        consumer: Option<Bound<'_, PyString>>,
        deadline: i64,
    ) -> PyResult<Self> {
        let consumer = consumer.unwrap_or_else(|| PyString::new(py, ""));
        Ok(Self {
            lid,
            consumer_bytes: consumer.to_str()?.as_bytes().into(),
            consumer: consumer.unbind(),
            deadline,
            mids: PyList::empty(py).into_any().unbind(),
            buckets: Vec::new(),
            sort_keys: Vec::new(),
            deliveries: Vec::new(),
            ended: Vec::new(),
            deadlines: None,
            live: 0,
            positions: None,
        })
    }

    #[getter]
    fn lid(&self) -> i64 {
        self.lid
    }

    #[getter]
    fn consumer(&self, py: Python<'_>) -> Py<PyString> {
        self.consumer.clone_ref(py)
    }

    #[getter]
    fn deadline(&self) -> i64 {
        self.deadline
    }

    #[getter]
    fn live(&self) -> usize {
        self.live
    }

    /// The ids: the lease command's own object when it was granted whole.
    #[getter]
    fn mids(&self, py: Python<'_>) -> PyObject {
        self.mids.clone_ref(py)
    }

    /// The columns, as copies: `array`s ('H', 'q', 'i') and the ended marks' bytes.
    #[getter]
    fn buckets<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let data = slf
            .borrow()
            .buckets
            .iter()
            .flat_map(|b| b.to_ne_bytes())
            .collect();
        array(slf.py(), "H", data)
    }

    #[getter]
    fn sort_keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let data = slf
            .borrow()
            .sort_keys
            .iter()
            .flat_map(|k| k.to_ne_bytes())
            .collect();
        array(slf.py(), "q", data)
    }

    #[getter]
    fn deliveries<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let data = slf
            .borrow()
            .deliveries
            .iter()
            .flat_map(|d| d.to_ne_bytes())
            .collect();
        array(slf.py(), "i", data)
    }

    #[getter]
    fn ended<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyBytes> {
        let data = slf.borrow().ended.clone();
        PyBytes::new(slf.py(), &data)
    }

    /// {position: deadline} of the positions extended on their own, or None.
    #[getter]
    fn deadlines<'py>(slf: &Bound<'py, Self>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(d) = slf.borrow().deadlines.clone() else {
            return Ok(None);
        };
        let out = PyDict::new(slf.py());
        for (pos, deadline) in d {
            out.set_item(pos, deadline)?;
        }
        Ok(Some(out))
    }

    fn __len__(&self) -> usize {
        self.ended.len()
    }

    fn receipt(&self, pos: usize) -> i64 {
        self.lid << POSITION_BITS | pos as i64
    }

    /// Where a message of this lease is: ids are the slower way to name it.
    fn position(slf: &Bound<'_, Self>, mid: &str) -> PyResult<usize> {
        if slf.borrow().positions.is_none() {
            let py = slf.py();
            let mids = slf.borrow().mids.clone_ref(py).into_bound(py);
            let keys: Vec<Box<[u8]>> = match mids.downcast::<PackedIds>() {
                Ok(packed) => packed.get().each(py).map(Into::into).collect(),
                Err(_) => (mids.try_iter()?)
                    .map(|m| Ok(m?.downcast::<PyString>()?.to_str()?.as_bytes().into()))
                    .collect::<PyResult<_>>()?,
            };
            let positions = keys.into_iter().enumerate().map(|(i, k)| (k, i)).collect();
            slf.borrow_mut().positions = Some(positions);
        }
        let me = slf.borrow();
        let positions = me.positions.as_ref().expect("made above");
        (positions.get(mid.as_bytes()).copied()).ok_or_else(|| PyKeyError::new_err(mid.to_owned()))
    }

    /// The id at `pos`.
    fn mid<'py>(slf: &Bound<'py, Self>, pos: usize) -> PyResult<Bound<'py, PyAny>> {
        let mids = slf.borrow().mids.clone_ref(slf.py());
        mids.into_bound(slf.py()).get_item(pos)
    }

    fn deadline_of(&self, pos: usize) -> i64 {
        self.deadline_at(pos)
    }

    /// The earliest deadline of a position still leased.
    fn earliest(&self) -> i64 {
        let Some(d) = &self.deadlines else {
            return self.deadline;
        };
        (self.ended.iter().enumerate())
            .filter(|(_, &e)| e == 0)
            .map(|(p, _)| *d.get(&p).unwrap_or(&self.deadline))
            .min()
            .unwrap_or(self.deadline)
    }

    /// How `pos`'s lease ended (0: it is leased).
    fn ended_at(&self, pos: usize) -> PyResult<u8> {
        self.check(pos)?;
        Ok(self.ended[pos])
    }

    /// (bucket, sort key, deadline, deliveries) of `pos`.
    fn entry(&self, pos: usize) -> PyResult<(u16, i64, i64, i32)> {
        self.check(pos)?;
        let deadline = self.deadline_at(pos);
        Ok((
            self.buckets[pos],
            self.sort_keys[pos],
            deadline,
            self.deliveries[pos],
        ))
    }

    /// 0 if `consumer` holds `pos` at `now`; else how its lease ended (1..=7), or 8 (no
    /// such position), 9 (another consumer's), 10 (past its deadline).
    fn status(&self, pos: usize, consumer: &str, now: i64) -> u8 {
        self.status_of(pos, consumer.as_bytes(), now)
    }

    /// End `pos`'s lease (`how`: ACKED, EXPIRED...); returns how many are still leased.
    fn end(&mut self, pos: usize, how: u8) -> PyResult<usize> {
        self.end_one(pos, how)
    }

    /// `status`, and if held, end it with `how`: then (id, bucket, sort key,
    /// deliveries, how many are still leased), else the status code. An ack's step.
    fn take<'py>(
        slf: &Bound<'py, Self>,
        pos: usize,
        consumer: &str,
        now: i64,
        how: u8,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let taken = {
            let mut me = slf.borrow_mut();
            let status = me.status_of(pos, consumer.as_bytes(), now);
            if status != 0 {
                Err(status)
            } else {
                let live = me.end_one(pos, how)?;
                Ok((me.buckets[pos], me.sort_keys[pos], me.deliveries[pos], live))
            }
        };
        match taken {
            Err(status) => status.into_bound_py_any(py),
            Ok((bucket, key, deliveries, live)) => {
                let mid = Self::mid(slf, pos)?;
                (mid, bucket, key, deliveries, live).into_bound_py_any(py)
            }
        }
    }

    /// Whether any position's lease ended settled (acked, rejected, cancelled, dead).
    fn settled_any(&self) -> bool {
        (self.ended.iter()).any(|e| matches!(*e, ACKED | REJECTED | CANCELLED | DEAD))
    }

    /// The positions still leased.
    fn live_positions(&self) -> Vec<usize> {
        (self.ended.iter().enumerate())
            .filter(|(_, &e)| e == 0)
            .map(|(p, _)| p)
            .collect()
    }

    /// Extend `pos`'s lease on its own, to `deadline`.
    fn extend(&mut self, pos: usize, deadline: i64) -> PyResult<()> {
        self.check(pos)?;
        self.deadlines
            .get_or_insert_with(BTreeMap::new)
            .insert(pos, deadline);
        Ok(())
    }

    /// Whether positions start..start+n are all leased by `consumer` before their
    /// (common) deadline: a run an ack settles in bulk.
    fn run_held(&self, start: usize, n: usize, consumer: &str, now: i64) -> bool {
        *self.consumer_bytes == *consumer.as_bytes()
            && self.deadlines.is_none()
            && self.deadline > now
            && start + n <= self.ended.len()
            && self.ended[start..start + n].iter().all(|&e| e == 0)
    }

    /// End positions start..start+n, all leased, with `how`: how many are still leased.
    fn end_run(&mut self, start: usize, n: usize, how: u8) -> PyResult<usize> {
        if how == 0 || start + n > self.ended.len() {
            return Err(PyValueError::new_err("no such run in the lease"));
        }
        let run = &mut self.ended[start..start + n];
        if run.iter().any(|&e| e != 0) {
            return Err(PyValueError::new_err("a position's lease ends once"));
        }
        run.fill(how);
        self.live -= n;
        Ok(self.live)
    }

    /// Positions start..end as (ids, buckets, sort keys, deliveries): a settled run's
    /// columns (`settlements.Run`), the ids as the record holds them, the rest `array`s.
    fn columns<'py>(
        slf: &Bound<'py, Self>,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let (mids, b, k, d) = {
            let me = slf.borrow();
            if start > end || end > me.ended.len() {
                return Err(PyIndexError::new_err("no such run in the lease"));
            }
            let b: Vec<u8> = me.buckets[start..end]
                .iter()
                .flat_map(|x| x.to_ne_bytes())
                .collect();
            let k: Vec<u8> = me.sort_keys[start..end]
                .iter()
                .flat_map(|x| x.to_ne_bytes())
                .collect();
            let d: Vec<u8> = me.deliveries[start..end]
                .iter()
                .flat_map(|x| x.to_ne_bytes())
                .collect();
            (me.mids.clone_ref(py), b, k, d)
        };
        let mids = mids.into_bound(py).get_item(pyo3::types::PySlice::new(
            py,
            start as isize,
            end as isize,
            1,
        ))?;
        PyTuple::new(
            py,
            [
                mids,
                array(py, "H", b)?,
                array(py, "q", k)?,
                array(py, "i", d)?,
            ],
        )
    }

    /// Whether every position was a first delivery.
    fn all_first(&self) -> bool {
        self.deliveries.iter().all(|&d| d == 1)
    }

    /// Pickled as the Python record was, its fields in this order: (buckets, consumer,
    /// deadline, deadlines, deliveries, ended, lid, live, mids, sort_keys), so
    /// snapshots of either load in the other.
    fn __getstate__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let (consumer, deadline, lid, live, mids, ended) = {
            let me = slf.borrow();
            let ended = me.ended.clone();
            (
                me.consumer.clone_ref(py),
                me.deadline,
                me.lid,
                me.live,
                me.mids.clone_ref(py),
                ended,
            )
        };
        let fields: Vec<Bound<'py, PyAny>> = vec![
            Self::buckets(slf)?,
            consumer.into_bound(py).into_any(),
            deadline.into_bound_py_any(py)?,
            Self::deadlines(slf)?.into_bound_py_any(py)?,
            Self::deliveries(slf)?,
            PyByteArray::new(py, &ended).into_any(),
            lid.into_bound_py_any(py)?,
            live.into_bound_py_any(py)?,
            mids.into_bound(py),
            Self::sort_keys(slf)?,
        ];
        PyTuple::new(py, fields)
    }

    fn __setstate__(slf: &Bound<'_, Self>, state: &Bound<'_, PyTuple>) -> PyResult<()> {
        let [buckets, consumer, deadline, deadlines, deliveries, ended, lid, live, mids, keys]: [Bound<'_, PyAny>; 10] =
            (state.iter().collect::<Vec<_>>())
                .try_into()
                .map_err(|_| PyValueError::new_err("a lease record's state has 10 fields"))?;
        let consumer = consumer.downcast_into::<PyString>()?;
        let deadlines: Option<BTreeMap<usize, i64>> = deadlines.extract()?;
        let record = Self {
            lid: lid.extract()?,
            consumer_bytes: consumer.to_str()?.as_bytes().into(),
            consumer: consumer.unbind(),
            deadline: deadline.extract()?,
            mids: mids.unbind(),
            buckets: column(&buckets)?,
            sort_keys: column(&keys)?,
            deliveries: column(&deliveries)?,
            ended: column(&ended)?,
            deadlines,
            live: live.extract()?,
            positions: None,
        };
        let n = record.ended.len();
        if [
            record.buckets.len(),
            record.sort_keys.len(),
            record.deliveries.len(),
        ] != [n; 3]
        {
            return Err(PyValueError::new_err(
                "a lease record's columns differ in length",
            ));
        }
        *slf.borrow_mut() = record;
        Ok(())
    }

    /// `copyreg.__newobj__`, as a Python object with `__getstate__` pickles: a record
    /// loads by `LeaseRecord.__new__` and `__setstate__`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let newobj = NEWOBJ.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            Ok(py.import("copyreg")?.getattr("__newobj__")?.unbind())
        })?;
        let args = PyTuple::new(py, [slf.get_type()])?;
        PyTuple::new(
            py,
            [
                newobj.bind(py).clone(),
                args.into_any(),
                Self::__getstate__(slf)?.into_any(),
            ],
        )
    }
}
