//! Acks awaiting their checkpoint, as columns (`settlements.AckRun`): every node keeps
//! each ack's event until the trim after the ledger has it, for every ack of a few
//! messages (every ack at batch 1). As a `Settlement` each would be a tuple of eight
//! fields with three new ints, tracked by the cyclic GC and read back field by field by
//! the trim and the checkpoint; here it is a row of fixed-size fields, its message's
//! handle among them (`handles.rs`), appended to the run at the log's end.
//!
//! A run is open while it is the log's last entry and nothing has read it: acks of
//! consecutive seqs append to it. A reader in another thread (the checkpoint's) gets
//! the log's entries with the last run sealed (`EventLog.view`), so what it reads
//! never changes under it; the next ack starts a new run.

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::lease_record::array;

#[derive(Clone, Copy)]
struct Acked {
    mh: u128,
    sort_key: i64,
    at: i64,
    deliveries: i32,
    bucket: u16,
}

/// Acks of consecutive seqs, a row each, in the order they were applied.
#[pyclass(module = "dejaq_core")]
pub struct AckRun {
    /// The first ack's seq; the others follow it, one apart.
    seq: i64,
    /// `LedgerEvent.ACKED`, as the other entries name their event.
    event: PyObject,
    rows: Vec<Acked>,
    sealed: bool,
}

impl AckRun {
    /// A column as an `array` of `code`: its bytes copied under a borrow that ends
    /// before `array` runs Python, which may let the event loop's thread append to the
    /// run meanwhile (`LeaseTable`'s note says why).
    fn column<'py, const N: usize>(
        slf: &Bound<'py, Self>,
        code: &str,
        cell: impl Fn(&Acked) -> [u8; N],
    ) -> PyResult<Bound<'py, PyAny>> {
        let data = slf.borrow().rows.iter().flat_map(cell).collect();
        array(slf.py(), code, data)
    }
}

#[pymethods]
impl AckRun {
    /// Append an ack of seq `seq` (its arguments a `Settlement`'s fields) to the open run
    /// at the end of `entries` (an `EventLog`'s) that it continues, or to a new run
    /// appended there: the core's ack and the Python transition's alike.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn append(
        entries: &Bound<'_, PyList>,
        seq: i64,
        mh: u128,
        bucket: u16,
        event: &Bound<'_, PyAny>,
        sort_key: i64,
        deliveries: i32,
        at: i64,
    ) -> PyResult<()> {
        let row = Acked {
            mh,
            sort_key,
            at,
            deliveries,
            bucket,
        };
        if let Some(last) = entries.len().checked_sub(1) {
            let last = entries.get_item(last)?;
            // A run borrowed now is one a reader is copying a column of, so sealed: the
            // ack starts a new run.
            let open = last
                .downcast::<AckRun>()
                .ok()
                .and_then(|r| r.try_borrow_mut().ok());
            if let Some(mut run) = open {
                if !run.sealed && run.seq + run.rows.len() as i64 == seq {
                    run.rows.push(row);
                    return Ok(());
                }
            }
        }
        let run = AckRun {
            seq,
            event: event.clone().unbind(),
            rows: vec![row],
            sealed: false,
        };
        entries.append(Bound::new(entries.py(), run)?)
    }

    /// No ack joins it from now on: a reader has it.
    fn seal(&mut self) {
        self.sealed = true;
    }

    #[getter]
    fn sealed(&self) -> bool {
        self.sealed
    }

    #[getter]
    fn seq(&self) -> i64 {
        self.seq
    }

    #[getter]
    fn event(&self, py: Python<'_>) -> PyObject {
        self.event.clone_ref(py)
    }

    /// An ack has no reason, as a `Run` of acks has none.
    #[getter]
    fn reason(&self, py: Python<'_>) -> PyObject {
        py.None()
    }

    /// The first ack's time: how old the oldest unwritten event is (`checkpoints.lag`).
    #[getter]
    fn at(&self) -> PyResult<i64> {
        self.rows
            .first()
            .map(|r| r.at)
            .ok_or_else(|| PyIndexError::new_err("an empty run has no time"))
    }

    /// The acked messages' handles, packed 16 bytes each, little-endian, as a `Run`'s.
    #[getter]
    fn handles<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyBytes>> {
        let packed: Vec<u8> = slf
            .borrow()
            .rows
            .iter()
            .flat_map(|r| r.mh.to_le_bytes())
            .collect();
        Ok(PyBytes::new(slf.py(), &packed))
    }

    /// The columns as `Run`'s are: `array`s ('H', 'q', 'i'), and each ack's time ('q').
    #[getter]
    fn buckets<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::column(slf, "H", |r| r.bucket.to_ne_bytes())
    }

    #[getter]
    fn sort_keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::column(slf, "q", |r| r.sort_key.to_ne_bytes())
    }

    #[getter]
    fn deliveries<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::column(slf, "i", |r| r.deliveries.to_ne_bytes())
    }

    #[getter]
    fn ats<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::column(slf, "q", |r| r.at.to_ne_bytes())
    }

    /// Its acks of seqs start..end-1 (which it holds), as a sealed run.
    fn part(&self, py: Python<'_>, start: i64, end: i64) -> PyResult<Self> {
        let n = self.rows.len() as i64;
        if start < self.seq || end < start || end > self.seq + n {
            return Err(PyValueError::new_err(format!(
                "seqs {start}..{end} are not all in a run of {}..{}",
                self.seq,
                self.seq + n
            )));
        }
        let (i, j) = ((start - self.seq) as usize, (end - self.seq) as usize);
        Ok(Self {
            seq: start,
            event: self.event.clone_ref(py),
            rows: self.rows[i..j].to_vec(),
            sealed: true,
        })
    }

    fn __len__(&self) -> usize {
        self.rows.len()
    }
}
