//! A group commit's commands applied on every node (`BrokerState.batch`), the two
//! commonest, lease and ack by receipt, without a Python step: at batch 1 each would
//! be a dispatch and a transition of some 50 Python lines, ~2.5 µs on every node for
//! every message, against ~1.7 here (`bench/broker_costs.py` has the figures). The
//! others, and these where a rarer case applies (a new consumer, a paused topic, a lease
//! rate, an ack by ids or of a whole lease), are handed to `BrokerState._apply`. Both
//! ways change the state alike, step for step, as `TopicState.lease` and
//! `TopicState.ack` say; the tests apply random commands both ways and compare the
//! states.

use pyo3::exceptions::{PyAttributeError, PyException};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::ack_run::AckRun;
use crate::buckets::hold_in;
use crate::grant::grant;
use crate::lease_record::{LeaseRecord, ACKED, POSITION_BITS};
use crate::lease_table::LeaseTable;

/// The Python objects the transitions name, given once by `broker.state.leases`.
#[pyclass(module = "dejaq_core", frozen)]
pub struct Transitions {
    /// `LedgerEvent.ACKED`.
    acked: Py<PyAny>,
    /// `Refusal`s by `LeaseRecord.status` code, and the one for no such lease.
    refusal_of: Py<PyTuple>,
    not_leased: Py<PyAny>,
    /// Receipts from which an ack takes the bulk path (`TopicState._ack_run`).
    bulk_min: usize,
}

/// An attribute of a plain Python object, read from its `__dict__`.
fn field<'py>(
    fields: &Bound<'py, PyDict>,
    name: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyAny>> {
    fields
        .get_item(name)?
        .ok_or_else(|| PyAttributeError::new_err(name.clone().unbind()))
}

fn dict<'py>(
    fields: &Bound<'py, PyDict>,
    name: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyDict>> {
    Ok(field(fields, name)?.downcast_into::<PyDict>()?)
}

/// `counter[key] += n`, as `collections.Counter` does it (a missing key counts 0).
fn count(counter: &Bound<'_, PyDict>, key: &Bound<'_, PyAny>, n: i64) -> PyResult<()> {
    let before: i64 = match counter.get_item(key)? {
        Some(v) => v.extract()?,
        None => 0,
    };
    counter.set_item(key, before + n)
}

/// One topic state's attributes that the leases and acks applied here use, read from
/// its `__dict__` at a group's first command on it: a group holds many commands of a
/// topic, and reading each attribute anew for each cost ~0.3 µs a command on every
/// node. The objects are the state's own, changed in place. Dropped whenever `_apply`
/// runs, which may replace one (`owned` on a rebalance) or change `paused` or
/// `trimmed_upto` (a trim); an ack adds events after the last, which leaves
/// `trimmed_upto` as it was.
struct Topic<'py> {
    st: Bound<'py, PyAny>,
    fields: Bound<'py, PyDict>,
    paused: bool,
    consumers: Bound<'py, PyDict>,
    owned: Bound<'py, PyDict>,
    leases: Bound<'py, LeaseTable>,
    held: Bound<'py, PyDict>,
    settled: Bound<'py, PyDict>,
    not_before: Bound<'py, PyDict>,
    deliveries: Bound<'py, PyDict>,
    records: Bound<'py, PyDict>,
    leased: Bound<'py, PyDict>,
    totals: Bound<'py, PyDict>,
    sort_keys: Bound<'py, PyDict>,
    ending: Bound<'py, PyAny>,
    events: Bound<'py, PyAny>,
    entries: Bound<'py, PyList>,
    /// `TopicState.trimmed_upto`, once a lease asked (a Python call).
    trimmed_upto: Option<i64>,
}

impl<'py> Topic<'py> {
    fn read(st: Bound<'py, PyAny>) -> PyResult<Self> {
        let py = st.py();
        let fields = st
            .getattr(intern!(py, "__dict__"))?
            .downcast_into::<PyDict>()?;
        let events = field(&fields, intern!(py, "events"))?;
        Ok(Self {
            paused: field(&fields, intern!(py, "paused"))?.is_truthy()?,
            consumers: dict(&fields, intern!(py, "consumers"))?,
            owned: dict(&fields, intern!(py, "owned"))?,
            leases: field(&fields, intern!(py, "leases"))?.downcast_into()?,
            held: dict(&fields, intern!(py, "held"))?,
            settled: dict(&fields, intern!(py, "settled"))?,
            not_before: dict(&fields, intern!(py, "not_before"))?,
            deliveries: dict(&fields, intern!(py, "deliveries"))?,
            records: dict(&fields, intern!(py, "records"))?,
            leased: dict(&fields, intern!(py, "leased"))?,
            totals: dict(&fields, intern!(py, "totals"))?,
            sort_keys: dict(&fields, intern!(py, "sort_keys"))?,
            ending: field(&fields, intern!(py, "ending"))?,
            entries: events
                .getattr(intern!(py, "entries"))?
                .downcast_into::<PyList>()?,
            events,
            fields,
            st,
            trimmed_upto: None,
        })
    }

    fn trimmed_upto(&mut self) -> PyResult<i64> {
        if let Some(upto) = self.trimmed_upto {
            return Ok(upto);
        }
        let upto = self
            .st
            .call_method0(intern!(self.st.py(), "trimmed_upto"))?
            .extract()?;
        self.trimmed_upto = Some(upto);
        Ok(upto)
    }
}

/// The topics a group's commands have read so far, by their state object's address.
type Topics<'py> = Vec<(usize, Topic<'py>)>;

impl Transitions {
    /// One command applied here, or None for `_apply` to apply.
    fn one<'py>(
        &self,
        read: &mut Topics<'py>,
        state: &Bound<'py, PyDict>,
        topics: &Bound<'py, PyDict>,
        topic: &Bound<'py, PyAny>,
        op: &Bound<'py, PyAny>,
        args: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let (Ok(op), Ok(args)) = (op.downcast::<PyString>(), args.downcast::<PyTuple>()) else {
            return Ok(None);
        };
        let lease = match op.to_str()? {
            "lease" if args.len() == 6 || args.len() == 7 => true,
            "ack" if args.len() == 4 => false,
            _ => return Ok(None),
        };
        let Some(st) = topics.get_item(topic)? else {
            return Ok(None);
        };
        let key = st.as_ptr() as usize;
        let t = match read.iter().position(|(k, _)| *k == key) {
            Some(i) => &mut read[i].1,
            None => {
                read.push((key, Topic::read(st)?));
                &mut read.last_mut().expect("just pushed").1
            }
        };
        if lease {
            self.lease(state, t, args)
        } else {
            self.ack(t, args)
        }
    }

    /// `TopicState.lease` of a numbered lease on the topic `t`, or None where `_apply`
    /// must: the consumer is not a member (it joins, and buckets move), the topic is
    /// paused or rate-limited, or the picks are not `Picks`.
    fn lease<'py>(
        &self,
        state: &Bound<'py, PyDict>,
        t: &mut Topic<'py>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = state.py();
        let consumer = args.get_item(0)?;
        let picks = args.get_item(3)?;
        let (Ok(consumer), Ok(picks)) = (
            consumer.downcast_into::<PyString>(),
            picks.downcast_into::<PyTuple>(),
        ) else {
            return Ok(None);
        };
        if picks.len() != 3
            || !args.get_item(4)?.is_none()
            || t.paused
            || !t.consumers.contains(&consumer)?
        {
            return Ok(None);
        }
        let now_obj = args.get_item(1)?;
        let seen = args.get_item(6).ok().filter(|seen| !seen.is_none());
        let (Ok(now), Ok(lease_ms), Ok(seen)) = (
            now_obj.extract::<i64>(),
            args.get_item(2)?.extract::<i64>(),
            seen.map(|s| s.extract::<i64>()).transpose(),
        ) else {
            return Ok(None);
        };
        let lid: i64 = field(state, intern!(py, "lids"))?.extract::<i64>()? + 1;
        state.set_item(intern!(py, "lids"), lid)?;
        t.consumers.set_item(&consumer, &now_obj)?;
        let record = Bound::new(
            py,
            LeaseRecord::empty(py, lid, consumer.clone().unbind(), now + lease_ms),
        )?;
        if let Some(seen) = seen {
            if t.trimmed_upto()? > seen {
                return Ok(Some(record.into_any()));
            }
        }
        let owned = match t.owned.get_item(&consumer)? {
            Some(owned) => owned,
            None => PyTuple::empty(py).into_any(),
        };
        let redelivered = grant(
            &t.leases,
            &record,
            &picks.get_item(0)?,
            picks.get_item(1)?.downcast()?,
            picks.get_item(2)?.downcast()?,
            &owned,
            &t.held,
            &consumer,
            &t.settled,
            &t.not_before,
            &t.deliveries,
            now,
            None,
        )?;
        let n = record.borrow().leased();
        if n == 0 {
            return Ok(Some(record.into_any()));
        }
        t.records.set_item(lid, &record)?;
        t.leased.set_item(lid, &record)?;
        count(&t.totals, intern!(py, "leased"), n as i64)?;
        if redelivered > 0 {
            count(&t.totals, intern!(py, "redelivered"), redelivered as i64)?;
        }
        Ok(Some(record.into_any()))
    }

    /// `TopicState.ack` by fewer receipts than a bulk ack takes, on the topic `t`, or
    /// None where `_apply` must (ids, a bulk ack, receipts that are not small ints).
    fn ack<'py>(
        &self,
        t: &Topic<'py>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = args.py();
        let receipts = args.get_item(3)?;
        let consumer = args.get_item(0)?;
        let (Ok(receipts), Ok(consumer)) = (
            receipts.downcast_into::<PyList>(),
            consumer.downcast_into::<PyString>(),
        ) else {
            return Ok(None);
        };
        if receipts.len() >= self.bulk_min {
            return Ok(None);
        }
        let keys: Vec<i64> = match receipts
            .iter()
            .map(|r| r.extract::<i64>())
            .collect::<PyResult<Vec<i64>>>()
        {
            Ok(keys) if keys.iter().all(|&k| k >= 0) => keys,
            _ => return Ok(None),
        };
        let now_obj = args.get_item(1)?;
        let Ok(now) = now_obj.extract::<i64>() else {
            return Ok(None);
        };
        let who = consumer.to_str()?;
        let start: i64 = field(&t.fields, intern!(py, "seq"))?.extract()?;
        let mut seq = start;
        let refused = PyDict::new(py);
        let (acked, refusal_of) = (self.acked.bind(py), self.refusal_of.bind(py));
        for (key, &k) in receipts.iter().zip(&keys) {
            let Some(record) = t.records.get_item(k >> POSITION_BITS)? else {
                refused.set_item(&key, &self.not_leased)?;
                continue;
            };
            let record = record.downcast_into::<LeaseRecord>()?;
            let pos = (k & ((1 << POSITION_BITS) - 1)) as usize;
            let (mid, g, live) = match LeaseRecord::take_at(&record, pos, who, now, ACKED)? {
                Err(status) => {
                    refused.set_item(&key, refusal_of.get_item(status as usize)?)?;
                    continue;
                }
                Ok(taken) => taken,
            };
            let lid = record.borrow().number();
            if live == 0 {
                t.leased.del_item(lid)?;
                t.ending
                    .call_method1(intern!(py, "append"), ((seq + 1, lid),))?;
            }
            let bucket = g.bucket.into_pyobject(py)?;
            hold_in(&t.held, &bucket, 1, &consumer, -1)?;
            seq += 1;
            AckRun::append(
                &t.entries,
                seq,
                mid.clone().unbind(),
                g.bucket,
                acked,
                g.sort_key,
                g.deliveries,
                now,
            )?;
            if !t.sort_keys.is_empty() && t.sort_keys.contains(&mid)? {
                t.sort_keys.del_item(&mid)?;
            }
        }
        if seq != start {
            let size: i64 = t.events.getattr(intern!(py, "size"))?.extract()?;
            t.events.setattr(intern!(py, "size"), size + seq - start)?;
            count(&t.totals, acked, seq - start)?;
            t.fields.set_item(intern!(py, "seq"), seq)?;
        }
        if let Some(seen) = t.consumers.get_item(&consumer)? {
            if seen.extract::<i64>()? < now {
                t.consumers.set_item(&consumer, &now_obj)?;
            }
        }
        Ok(Some(refused.into_any()))
    }
}

#[pymethods]
impl Transitions {
    #[new]
    fn new(
        acked: Py<PyAny>,
        refusal_of: Py<PyTuple>,
        not_leased: Py<PyAny>,
        bulk_min: usize,
    ) -> Self {
        Self {
            acked,
            refusal_of,
            not_leased,
            bulk_min,
        }
    }

    /// `BrokerState.batch`: each of `commands` (topic, op, args) applied in order, its
    /// result or the Exception it raised in its place; `apply(topic, op, args)`
    /// (`BrokerState._apply`) for those not applied here.
    fn apply_group<'py>(
        &self,
        state: &Bound<'py, PyAny>,
        commands: &Bound<'py, PyAny>,
        apply: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = state.py();
        let fields = state
            .getattr(intern!(py, "__dict__"))?
            .downcast_into::<PyDict>()?;
        let topics = dict(&fields, intern!(py, "topics"))?;
        let results = PyList::empty(py);
        let mut read = Topics::new();
        for command in commands.try_iter()? {
            let (topic, op, args): (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>) =
                command?.extract()?;
            let result = self
                .one(&mut read, &fields, &topics, &topic, &op, &args)
                .and_then(|done| match done {
                    Some(result) => Ok(result),
                    None => {
                        read.clear();
                        apply.call1((&topic, &op, &args))
                    }
                });
            match result {
                Ok(result) => results.append(result)?,
                Err(e) if e.is_instance_of::<PyException>(py) => {
                    results.append(e.into_value(py))?
                }
                Err(e) => return Err(e),
            }
        }
        Ok(results)
    }
}
