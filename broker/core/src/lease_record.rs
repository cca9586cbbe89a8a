//! A lease command's record (`leases.LeaseRecord`): the messages one lease granted, by
//! position, which is what a receipt names, each by its message handle (`handles.rs`). Every node makes one for every lease and
//! ends its positions on every ack, so it is one Python object and one vector of
//! positions however many messages it holds: two allocations, where Python `array`s and
//! a `bytearray` for its columns would be nine (each node makes them at the lease and
//! frees them at its trim), and an ack reads and ends a position in one call.
//!
//! Threads off the event loop read records (the leader's expiry check calls
//! `earliest`): methods make their Python objects before or after borrowing a record,
//! never during (`LeaseTable`'s note says why).

use std::collections::{BTreeMap, HashMap};

use pyo3::exceptions::{PyIndexError, PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::buckets::per_bucket;
use crate::lease_table::handles_of;

/// A receipt is `lid << POSITION_BITS | position`: a lease holds at most 1000 messages.
pub(crate) const POSITION_BITS: u32 = 10;
/// How a position's lease ended (0 while it is leased), by the names the module exports.
pub(crate) const ENDED: [(&str, u8); 8] = [
    ("LEASED", 0),
    ("ACKED", ACKED),
    ("REJECTED", REJECTED),
    ("NACKED", NACKED),
    ("EXPIRED", EXPIRED),
    ("RELEASED", RELEASED),
    ("CANCELLED", CANCELLED),
    ("DEAD", DEAD),
];
pub(crate) const ACKED: u8 = 1;
const REJECTED: u8 = 2;
const NACKED: u8 = 3;
const EXPIRED: u8 = 4;
const RELEASED: u8 = 5;
const CANCELLED: u8 = 6;
const DEAD: u8 = 7;
/// `status` codes past the ended ones (1..=7), for a position not held by the caller.
pub(crate) const NOT_HELD: [(&str, u8); 3] = [
    ("NOT_LEASED", NOT_LEASED),
    ("OTHER_CONSUMER", OTHER_CONSUMER),
    ("EXPIRED_NOW", EXPIRED_NOW),
];
const NOT_LEASED: u8 = 8;
const OTHER_CONSUMER: u8 = 9;
const EXPIRED_NOW: u8 = 10;

static ARRAY: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
static NEWOBJ: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

/// `array.array(code, data)`, data in native order.
pub(crate) fn array<'py>(
    py: Python<'py>,
    code: &str,
    data: Vec<u8>,
) -> PyResult<Bound<'py, PyAny>> {
    let array = ARRAY.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("array")?.getattr("array")?.unbind())
    })?;
    array.bind(py).call1((code, PyBytes::new(py, &data)))
}

/// A column from a snapshot: an `array` of its type, or (older) a list of ints.
fn column<'py, T: FromPyObject<'py>>(value: &Bound<'py, PyAny>) -> PyResult<Vec<T>> {
    value.try_iter()?.map(|v| v?.extract()).collect()
}

/// One granted message, but for its id.
#[derive(Clone, Copy)]
pub(crate) struct Granted {
    pub(crate) sort_key: i64,
    pub(crate) deliveries: i32,
    pub(crate) bucket: u16,
    /// 0 while leased, else how its lease ended.
    ended: u8,
}

impl Granted {
    pub(crate) fn new(bucket: u16, sort_key: i64, deliveries: i32) -> Self {
        Self {
            sort_key,
            deliveries,
            bucket,
            ended: 0,
        }
    }
}

/// A position an ack took: its handle, its row, and how many of the lease are still
/// leased.
pub(crate) type Taken = (u128, Granted, usize);

/// `handles` packed 16 bytes each, little-endian, as a lease command carries them.
fn packed(handles: &[u128]) -> Vec<u8> {
    handles.iter().flat_map(|h| h.to_le_bytes()).collect()
}

/// Native-order bytes of one field of each of `run`, as an `array` of `code` holds them.
fn cells<const N: usize>(run: &[Granted], cell: impl Fn(&Granted) -> [u8; N]) -> Vec<u8> {
    run.iter().flat_map(cell).collect()
}

#[pyclass(module = "dejaq.broker.state.leases", name = "LeaseRecord")]
pub struct LeaseRecord {
    lid: i64,
    consumer: Py<PyString>,
    deadline: i64,
    /// Each position's message handle.
    handles: Vec<u128>,
    granted: Vec<Granted>,
    /// Positions extended on their own: their deadlines.
    deadlines: Option<BTreeMap<usize, i64>>,
    live: usize,
    /// Positions by handle, made when a handle names one (receipts are the usual way).
    positions: Option<HashMap<u128, usize>>,
}

impl LeaseRecord {
    /// A lease's record before its grant: no position yet.
    pub(crate) fn empty(lid: i64, consumer: Py<PyString>, deadline: i64) -> Self {
        Self {
            lid,
            consumer,
            deadline,
            handles: Vec::new(),
            granted: Vec::new(),
            deadlines: None,
            live: 0,
            positions: None,
        }
    }

    pub(crate) fn number(&self) -> i64 {
        self.lid
    }

    pub(crate) fn leased(&self) -> usize {
        self.live
    }

    /// `take`'s step as Rust values: the handle, the position's row and how many are
    /// still leased, or the status code that refuses it.
    pub(crate) fn take_at(
        slf: &Bound<'_, Self>,
        pos: usize,
        consumer: &str,
        now: i64,
        how: u8,
    ) -> PyResult<Result<Taken, u8>> {
        let mut me = slf.borrow_mut();
        Ok(match me.status_of(slf.py(), pos, consumer, now)? {
            0 => {
                let live = me.end_one(pos, how)?;
                Ok((me.handles[pos], me.granted[pos], live))
            }
            status => Err(status),
        })
    }

    /// The message handles of positions start..end (which the record holds).
    pub(crate) fn run_handles(&self, start: usize, end: usize) -> &[u128] {
        &self.handles[start..end]
    }

    /// Each bucket of positions start..end with how many of them it holds, in the
    /// order each first appears, as `buckets.count_buckets` counts a run's column.
    pub(crate) fn run_buckets(&self, start: usize, end: usize) -> Vec<(u16, i64)> {
        per_bucket(self.granted[start..end].iter().map(|g| g.bucket))
    }

    /// The granted picks, as `grant` found them: every position leased.
    pub(crate) fn fill(&mut self, handles: Vec<u128>, granted: Vec<Granted>) {
        self.live = granted.len();
        self.handles = handles;
        self.granted = granted;
        self.deadlines = None;
        self.positions = None;
    }

    fn deadline_at(&self, pos: usize) -> i64 {
        match &self.deadlines {
            Some(d) => *d.get(&pos).unwrap_or(&self.deadline),
            None => self.deadline,
        }
    }

    fn at(&self, pos: usize) -> PyResult<&Granted> {
        (self.granted.get(pos))
            .ok_or_else(|| PyIndexError::new_err("no such position in the lease"))
    }

    fn end_one(&mut self, pos: usize, how: u8) -> PyResult<usize> {
        if self.at(pos)?.ended != 0 || how == 0 {
            return Err(PyValueError::new_err("a position's lease ends once"));
        }
        self.granted[pos].ended = how;
        self.live -= 1;
        Ok(self.live)
    }

    fn status_of(&self, py: Python<'_>, pos: usize, consumer: &str, now: i64) -> PyResult<u8> {
        let Some(g) = self.granted.get(pos) else {
            return Ok(NOT_LEASED);
        };
        Ok(if g.ended != 0 {
            g.ended
        } else if !self.held_by(py, consumer)? {
            OTHER_CONSUMER
        } else if self.deadline_at(pos) <= now {
            EXPIRED_NOW
        } else {
            0
        })
    }

    /// Whether `consumer` holds the lease: its str's UTF-8, which a str of ASCII
    /// characters (the usual consumer id) holds without making it.
    fn held_by(&self, py: Python<'_>, consumer: &str) -> PyResult<bool> {
        Ok(self.consumer.bind(py).to_str()? == consumer)
    }

    /// A column of every position's, as an `array` of `code`.
    fn column<'py, const N: usize>(
        slf: &Bound<'py, Self>,
        code: &str,
        cell: impl Fn(&Granted) -> [u8; N],
    ) -> PyResult<Bound<'py, PyAny>> {
        let data = cells(&slf.borrow().granted, cell);
        array(slf.py(), code, data)
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
        Ok(Self::empty(lid, consumer.unbind(), deadline))
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

    /// The positions' handles, packed 16 bytes each (little-endian).
    #[getter]
    fn handles<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &packed(&self.handles))
    }

    /// The columns, as copies: `array`s ('H', 'q', 'i') and the ended marks' bytes.
    #[getter]
    fn buckets<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::column(slf, "H", |g| g.bucket.to_ne_bytes())
    }

    #[getter]
    fn sort_keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::column(slf, "q", |g| g.sort_key.to_ne_bytes())
    }

    #[getter]
    fn deliveries<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::column(slf, "i", |g| g.deliveries.to_ne_bytes())
    }

    #[getter]
    fn ended<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyBytes> {
        let data = cells(&slf.borrow().granted, |g| [g.ended]);
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
        self.granted.len()
    }

    fn receipt(&self, pos: usize) -> i64 {
        self.lid << POSITION_BITS | pos as i64
    }

    /// Where the message of handle `handle` is in this lease: receipts are the usual way
    /// to name a position, so the map is made the first time a handle names one.
    fn position(&mut self, handle: u128) -> PyResult<usize> {
        let handles = &self.handles;
        let positions = (self.positions)
            .get_or_insert_with(|| handles.iter().enumerate().map(|(i, &h)| (h, i)).collect());
        (positions.get(&handle).copied()).ok_or_else(|| PyKeyError::new_err(handle))
    }

    /// The message handle at `pos`.
    fn mh(&self, pos: usize) -> PyResult<u128> {
        (self.handles.get(pos).copied())
            .ok_or_else(|| PyIndexError::new_err("no such position in the lease"))
    }

    fn deadline_of(&self, pos: usize) -> i64 {
        self.deadline_at(pos)
    }

    /// The earliest deadline of a position still leased.
    fn earliest(&self) -> i64 {
        let Some(d) = &self.deadlines else {
            return self.deadline;
        };
        (self.granted.iter().enumerate())
            .filter(|(_, g)| g.ended == 0)
            .map(|(p, _)| *d.get(&p).unwrap_or(&self.deadline))
            .min()
            .unwrap_or(self.deadline)
    }

    /// How `pos`'s lease ended (0: it is leased).
    fn ended_at(&self, pos: usize) -> PyResult<u8> {
        Ok(self.at(pos)?.ended)
    }

    /// (bucket, sort key, deadline, deliveries) of `pos`.
    fn entry(&self, pos: usize) -> PyResult<(u16, i64, i64, i32)> {
        let g = self.at(pos)?;
        Ok((g.bucket, g.sort_key, self.deadline_at(pos), g.deliveries))
    }

    /// 0 if `consumer` holds `pos` at `now`; else how its lease ended (1..=7), or 8 (no
    /// such position), 9 (another consumer's), 10 (past its deadline).
    fn status(&self, py: Python<'_>, pos: usize, consumer: &str, now: i64) -> PyResult<u8> {
        self.status_of(py, pos, consumer, now)
    }

    /// End `pos`'s lease (`how`: ACKED, EXPIRED...); returns how many are still leased.
    fn end(&mut self, pos: usize, how: u8) -> PyResult<usize> {
        self.end_one(pos, how)
    }

    /// `status`, and if held, end it with `how`: then (handle, bucket, sort key,
    /// deliveries, how many are still leased), else the status code. An ack's step.
    fn take<'py>(
        slf: &Bound<'py, Self>,
        pos: usize,
        consumer: &str,
        now: i64,
        how: u8,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        match Self::take_at(slf, pos, consumer, now, how)? {
            Err(status) => status.into_bound_py_any(py),
            Ok((handle, g, live)) => {
                (handle, g.bucket, g.sort_key, g.deliveries, live).into_bound_py_any(py)
            }
        }
    }

    /// Whether any position's lease ended settled (acked, rejected, cancelled, dead).
    fn settled_any(&self) -> bool {
        (self.granted.iter()).any(|g| matches!(g.ended, ACKED | REJECTED | CANCELLED | DEAD))
    }

    /// The positions still leased.
    fn live_positions(&self) -> Vec<usize> {
        (self.granted.iter().enumerate())
            .filter(|(_, g)| g.ended == 0)
            .map(|(p, _)| p)
            .collect()
    }

    /// Extend `pos`'s lease on its own, to `deadline`.
    fn extend(&mut self, pos: usize, deadline: i64) -> PyResult<()> {
        self.at(pos)?;
        (self.deadlines.get_or_insert_with(BTreeMap::new)).insert(pos, deadline);
        Ok(())
    }

    /// Whether positions start..start+n are all leased by `consumer` before their
    /// (common) deadline: a run an ack settles in bulk.
    pub(crate) fn run_held(
        &self,
        py: Python<'_>,
        start: usize,
        n: usize,
        consumer: &str,
        now: i64,
    ) -> PyResult<bool> {
        Ok(self.held_by(py, consumer)?
            && self.deadlines.is_none()
            && self.deadline > now
            && start + n <= self.granted.len()
            && self.granted[start..start + n].iter().all(|g| g.ended == 0))
    }

    /// End positions start..start+n, all leased, with `how`: how many are still leased.
    pub(crate) fn end_run(&mut self, start: usize, n: usize, how: u8) -> PyResult<usize> {
        if how == 0 || start + n > self.granted.len() {
            return Err(PyValueError::new_err("no such run in the lease"));
        }
        let run = &mut self.granted[start..start + n];
        if run.iter().any(|g| g.ended != 0) {
            return Err(PyValueError::new_err("a position's lease ends once"));
        }
        run.iter_mut().for_each(|g| g.ended = how);
        self.live -= n;
        Ok(self.live)
    }

    /// Positions start..end as (handles, buckets, sort keys, deliveries): a settled
    /// run's columns (`settlements.Run`), the handles packed 16 bytes each, the rest
    /// `array`s.
    pub(crate) fn columns<'py>(
        slf: &Bound<'py, Self>,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let (h, b, k, d) = {
            let me = slf.borrow();
            let Some(run) = me.granted.get(start..end) else {
                return Err(PyIndexError::new_err("no such run in the lease"));
            };
            let h = packed(&me.handles[start..end]);
            let b = cells(run, |g| g.bucket.to_ne_bytes());
            let k = cells(run, |g| g.sort_key.to_ne_bytes());
            let d = cells(run, |g| g.deliveries.to_ne_bytes());
            (h, b, k, d)
        };
        let columns = [
            PyBytes::new(py, &h).into_any(),
            array(py, "H", b)?,
            array(py, "q", k)?,
            array(py, "i", d)?,
        ];
        PyTuple::new(py, columns)
    }

    /// Whether every position was a first delivery.
    fn all_first(&self) -> bool {
        self.granted.iter().all(|g| g.deliveries == 1)
    }

    /// Pickled as the Python record was, its fields in this order: (buckets, consumer,
    /// deadline, deadlines, deliveries, ended, lid, live, handles, sort_keys), the
    /// handles packed (bytes) where records from before held ids (`__setstate__`).
    fn __getstate__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let (consumer, deadline, lid, live, handles, ended) = {
            let me = slf.borrow();
            let ended = cells(&me.granted, |g| [g.ended]);
            let consumer = me.consumer.clone_ref(py);
            (
                consumer,
                me.deadline,
                me.lid,
                me.live,
                packed(&me.handles),
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
            PyBytes::new(py, &handles).into_any(),
            Self::sort_keys(slf)?,
        ];
        PyTuple::new(py, fields)
    }

    /// A record's state; an id-keyed one holds its ids (a list of str, or
    /// `PackedIds`), hashed here as every node hashes them.
    fn __setstate__(slf: &Bound<'_, Self>, state: &Bound<'_, PyTuple>) -> PyResult<()> {
        let py = slf.py();
        let fields: Vec<Bound<'_, PyAny>> = state.iter().collect();
        let [buckets, consumer, deadline, deadlines, deliveries, ended, lid, live, mids, keys] =
            <[Bound<'_, PyAny>; 10]>::try_from(fields)
                .map_err(|_| PyValueError::new_err("a lease record's state has 10 fields"))?;
        let consumer = consumer.downcast_into::<PyString>()?;
        let buckets: Vec<u16> = column(&buckets)?;
        let keys: Vec<i64> = column(&keys)?;
        let deliveries: Vec<i32> = column(&deliveries)?;
        let ended: Vec<u8> = column(&ended)?;
        let handles = handles_of(py, &mids)?;
        let n = ended.len();
        if [buckets.len(), keys.len(), deliveries.len(), handles.len()] != [n; 4] {
            return Err(PyValueError::new_err(
                "a lease record's columns differ in length",
            ));
        }
        let granted = (0..n)
            .map(|i| Granted {
                ended: ended[i],
                ..Granted::new(buckets[i], keys[i], deliveries[i])
            })
            .collect();
        let record = Self {
            lid: lid.extract()?,
            consumer: consumer.unbind(),
            deadline: deadline.extract()?,
            handles,
            granted,
            deadlines: deadlines.extract()?,
            live: live.extract()?,
            positions: None,
        };
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
        let args = PyTuple::new(py, [slf.get_type()])?.into_any();
        let state = Self::__getstate__(slf)?.into_any();
        PyTuple::new(py, [newobj.bind(py).clone(), args, state])
    }
}
