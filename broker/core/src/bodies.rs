//! Lease and ack bodies, as parsed JSON, checked for the broker's hot path
//! (`broker.api.hotpath`): the arguments of one FastAPI's models would take as it is,
//! or None, and the body goes to FastAPI, which answers it (coerced, or a 422).
//!
//! Each lease and each ack is checked on the leader's event loop: in Python (a set of
//! keys, a regex, a type test and bounds per field) that was ~0.5 µs a request, twice a
//! message at batch 1. Here the same checks, in the same order, make no object but the
//! answer's tuple.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyString};

/// The lease body's keys (`LeaseRequest`'s fields).
const LEASE_KEYS: [&str; 4] = ["consumer_id", "max_messages", "lease_ms", "wait_ms"];
const MAX_MESSAGES: i64 = 1000;
const MAX_WAIT_MS: i64 = 30_000;
/// Ids or receipts an ack names, and an id's length in characters.
const MAX_NAMED: usize = 1000;
const MAX_ID_CHARS: usize = 1000;
const MAX_CONSUMER_CHARS: usize = 200;

/// The models' limits that Python defines (`hotpath.MAX_LEASE_MS`,
/// `routers._common.MAX_RECEIPT`), given once.
#[pyclass(module = "dejaq_core", frozen)]
pub struct Bodies {
    max_lease_ms: i64,
    max_receipt: i64,
}

/// `type(value) is int and low <= value <= high`.
fn int_in(value: &Bound<'_, PyAny>, low: i64, high: i64) -> Option<i64> {
    if !value.is_exact_instance_of::<PyInt>() {
        return None;
    }
    let v: i64 = value.extract().ok()?;
    (low..=high).contains(&v).then_some(v)
}

/// A consumer id as the models take it: a str of 1 to 200 printable ASCII characters
/// (`[\x21-\x7e]{1,200}`).
fn consumer<'py>(value: Option<Bound<'py, PyAny>>) -> Option<Bound<'py, PyString>> {
    let value = value?;
    if !value.is_exact_instance_of::<PyString>() {
        return None;
    }
    let id = value.downcast_into::<PyString>().ok()?;
    let text = id.to_str().ok()?;
    let printable = text.bytes().all(|b| (0x21..=0x7e).contains(&b));
    (printable && (1..=MAX_CONSUMER_CHARS).contains(&text.len())).then_some(id)
}

/// A list of 1 to 1000 items, each as `each` takes it.
fn listed<'py>(
    value: Bound<'py, PyAny>,
    each: impl Fn(&Bound<'py, PyAny>) -> bool,
) -> Option<Bound<'py, PyList>> {
    if !value.is_exact_instance_of::<PyList>() {
        return None;
    }
    let list = value.downcast_into::<PyList>().ok()?;
    if !(1..=MAX_NAMED).contains(&list.len()) || !list.iter().all(|item| each(&item)) {
        return None;
    }
    Some(list)
}

/// A message id as the models take it: a str of 1 to 1000 characters that encodes as
/// UTF-8 (a JSON escape can give a lone surrogate, which pydantic refuses).
fn message_id(value: &Bound<'_, PyAny>) -> bool {
    let Ok(id) = value.downcast_exact::<PyString>() else {
        return false;
    };
    matches!(id.len(), Ok(n) if (1..=MAX_ID_CHARS).contains(&n)) && id.to_str().is_ok()
}

#[pymethods]
impl Bodies {
    #[new]
    fn new(max_lease_ms: i64, max_receipt: i64) -> Self {
        Self {
            max_lease_ms,
            max_receipt,
        }
    }

    /// (consumer, max_messages, lease_ms, wait_ms) of a valid `LeaseRequest`, else None.
    fn lease<'py>(
        &self,
        body: &Bound<'py, PyAny>,
    ) -> Option<(Bound<'py, PyString>, i64, Option<i64>, i64)> {
        let py = body.py();
        if !body.is_exact_instance_of::<PyDict>() {
            return None;
        }
        let body = body.downcast::<PyDict>().ok()?;
        for key in body.keys() {
            let key = key.downcast_into::<PyString>().ok()?;
            if !LEASE_KEYS.contains(&key.to_str().ok()?) {
                return None;
            }
        }
        let get = |name| body.get_item(name).ok().flatten();
        let consumer = consumer(get(intern!(py, "consumer_id")))?;
        let n = match get(intern!(py, "max_messages")) {
            Some(n) => int_in(&n, 1, MAX_MESSAGES)?,
            None => 1,
        };
        let lease_ms = match get(intern!(py, "lease_ms")) {
            Some(ms) if !ms.is_none() => Some(int_in(&ms, 1, self.max_lease_ms)?),
            _ => None,
        };
        let wait_ms = match get(intern!(py, "wait_ms")) {
            Some(ms) => int_in(&ms, 0, MAX_WAIT_MS)?,
            None => 0,
        };
        Some((consumer, n, lease_ms, wait_ms))
    }

    /// (consumer, ids or receipts, whether receipts) of a valid `Settle`, else None: the
    /// list is the body's own.
    fn ack<'py>(
        &self,
        body: &Bound<'py, PyAny>,
    ) -> Option<(Bound<'py, PyString>, Bound<'py, PyList>, bool)> {
        let py = body.py();
        if !body.is_exact_instance_of::<PyDict>() {
            return None;
        }
        let body = body.downcast::<PyDict>().ok()?;
        if body.len() != 2 {
            return None;
        }
        let get = |name| body.get_item(name).ok().flatten().filter(|v| !v.is_none());
        let consumer = consumer(get(intern!(py, "consumer_id")))?;
        if let Some(receipts) = get(intern!(py, "receipts")) {
            let max = self.max_receipt;
            let receipts = listed(receipts, |r| int_in(r, 0, max).is_some())?;
            return Some((consumer, receipts, true));
        }
        let ids = listed(get(intern!(py, "ids"))?, message_id)?;
        Some((consumer, ids, false))
    }
}
