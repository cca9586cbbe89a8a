//! A group commit's commands applied on every node (`BrokerState.batch`), the two
//! commonest, lease and ack by receipt, without a Python step: at batch 1 each would
//! be a dispatch and a transition of some 50 Python lines, ~2.5 µs on every node for
//! every message, against ~1.7 here (`bench/broker_costs.py` has the figures). The
//! others, and these where a rarer case applies (a new consumer, a paused topic, a lease
//! rate, an ack by ids, a bulk ack of a run its consumer does not hold), are handed to
//! `BrokerState._apply`. A whole lease's ack, which a worker sends for its batch, is
//! settled here as one `Run` event, as `TopicState._ack_run` settles it. Both
//! ways change the state alike, step for step, as `TopicState.lease` and
//! `TopicState.ack` say; the tests apply random commands both ways and compare the
//! states.

use pyo3::exceptions::{PyAttributeError, PyKeyboardInterrupt, PySystemExit};
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
    /// `settlements.Run`, the event of a bulk ack.
    run: Py<PyAny>,
    /// `range`, as `leases.consecutive` carries a whole lease's receipts.
    range: Py<PyAny>,
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
/// node. The objects are the state's own, changed in place, but for its counts (`seq`,
/// the events' `size`, `totals`): kept here, and written back (`flush`) before
/// `_apply` runs or Python reads them, and at the group's end. Dropped whenever
/// `_apply` runs, which may replace an object (`owned` on a rebalance) or change
/// `paused` or `trimmed_upto` (a trim); an ack adds events after the last, which leaves
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
    /// `ending.append`, bound once a group rather than by each ack ending its lease
    /// (each at batch 1).
    ending_append: Bound<'py, PyAny>,
    events: Bound<'py, PyAny>,
    entries: Bound<'py, PyList>,
    /// `TopicState.trimmed_upto`, once a lease asked (a Python call).
    trimmed_upto: Option<i64>,
    /// `seq` as the acks here have moved it, and as the state holds it: each ack adds
    /// one event, so the events' `size` grows by their difference when written back.
    seq: i64,
    written_seq: i64,
    /// What the leases and acks here add to `totals`, not written yet.
    added: Added,
}

/// Counts a group's leases and acks add to a topic's `totals`, written back at once.
#[derive(Default)]
struct Added {
    /// By `Tally`: what is added to `totals`, and whether it names the key already. A
    /// key it does not name is added to it at once, so that `totals` names its keys in
    /// the order one command at a time would (snapshots compare to the byte).
    totals: [i64; 3],
    named: [bool; 3],
}

/// The `totals` a group's leases and acks count.
#[derive(Clone, Copy)]
enum Tally {
    Acked,
    Leased,
    Redelivered,
}

impl<'py> Topic<'py> {
    fn read(st: Bound<'py, PyAny>) -> PyResult<Self> {
        let py = st.py();
        let fields = st
            .getattr(intern!(py, "__dict__"))?
            .downcast_into::<PyDict>()?;
        let events = field(&fields, intern!(py, "events"))?;
        let seq = field(&fields, intern!(py, "seq"))?.extract()?;
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
            ending_append: field(&fields, intern!(py, "ending"))?.getattr(intern!(py, "append"))?,
            entries: events
                .getattr(intern!(py, "entries"))?
                .downcast_into::<PyList>()?,
            seq,
            written_seq: seq,
            events,
            fields,
            st,
            trimmed_upto: None,
            added: Added::default(),
        })
    }

    /// `totals`' key for `tally`.
    fn key(&self, tally: Tally, acked: &Bound<'py, PyAny>) -> Bound<'py, PyAny> {
        let py = self.st.py();
        match tally {
            Tally::Acked => acked.clone(),
            Tally::Leased => intern!(py, "leased").clone().into_any(),
            Tally::Redelivered => intern!(py, "redelivered").clone().into_any(),
        }
    }

    /// `totals[tally] += n`, kept here but for a key `totals` does not name yet.
    fn tally(&mut self, tally: Tally, n: i64, acked: &Bound<'py, PyAny>) -> PyResult<()> {
        let i = tally as usize;
        if n == 0 {
            return Ok(());
        }
        if !self.added.named[i] {
            let key = self.key(tally, acked);
            self.added.named[i] = true;
            if !self.totals.contains(&key)? {
                return count(&self.totals, &key, n);
            }
        }
        self.added.totals[i] += n;
        Ok(())
    }

    /// The counts kept here written to the state.
    fn flush(&mut self, acked: &Bound<'py, PyAny>) -> PyResult<()> {
        let py = self.st.py();
        let added = std::mem::take(&mut self.added);
        if self.seq != self.written_seq {
            let size: i64 = self.events.getattr(intern!(py, "size"))?.extract()?;
            self.events
                .setattr(intern!(py, "size"), size + self.seq - self.written_seq)?;
            self.fields.set_item(intern!(py, "seq"), self.seq)?;
            self.written_seq = self.seq;
        }
        for tally in [Tally::Acked, Tally::Leased, Tally::Redelivered] {
            let n = added.totals[tally as usize];
            if n > 0 {
                count(&self.totals, &self.key(tally, acked), n)?;
            }
        }
        Ok(())
    }

    fn trimmed_upto(&mut self, acked: &Bound<'py, PyAny>) -> PyResult<i64> {
        if let Some(upto) = self.trimmed_upto {
            return Ok(upto);
        }
        self.flush(acked)?; // it reads `seq`
        let upto = self
            .st
            .call_method0(intern!(self.st.py(), "trimmed_upto"))?
            .extract()?;
        self.trimmed_upto = Some(upto);
        Ok(upto)
    }
}

/// A group's commands applied so far: the topics they read, by their state object's
/// address, and the lease numbers they took (`BrokerState.lids`), not written yet.
struct Group<'py> {
    state: Bound<'py, PyDict>,
    topics: Vec<(usize, Topic<'py>)>,
    lids: Option<i64>,
}

/// The next lease number: one past `lids`, read from the state at a group's first.
fn next_lid(state: &Bound<'_, PyDict>, lids: &mut Option<i64>) -> PyResult<i64> {
    let lid = match *lids {
        Some(lid) => lid,
        None => field(state, intern!(state.py(), "lids"))?.extract()?,
    } + 1;
    *lids = Some(lid);
    Ok(lid)
}

impl<'py> Group<'py> {
    /// What the group's commands kept here written to the state, and its topics
    /// dropped: before `_apply` runs, and at the group's end.
    fn flush(&mut self, acked: &Bound<'py, PyAny>) -> PyResult<()> {
        if let Some(lids) = self.lids.take() {
            self.state
                .set_item(intern!(self.state.py(), "lids"), lids)?;
        }
        for (_, t) in &mut self.topics {
            t.flush(acked)?;
        }
        self.topics.clear();
        Ok(())
    }
}

impl Transitions {
    /// `apply_group`'s loop: each command's result, or what it raised in its place,
    /// a malformed command's error and a panic included. Raised past the loop, an
    /// error would leave PySyncObj to apply the whole entry again at its next tick,
    /// and again, its earlier commands' effects with it, and never the entries after.
    fn each<'py>(
        &self,
        group: &mut Group<'py>,
        topics: &Bound<'py, PyDict>,
        commands: &Bound<'py, PyAny>,
        apply: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = topics.py();
        let results = PyList::empty(py);
        for command in commands.try_iter()? {
            let result = command.and_then(|command| {
                let (topic, op, args): (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>) =
                    command.extract()?;
                match self.one(group, topics, &topic, &op, &args)? {
                    Some(result) => Ok(result),
                    None => {
                        group.flush(self.acked.bind(py))?;
                        apply.call1((&topic, &op, &args))
                    }
                }
            });
            match result {
                Ok(result) => results.append(result)?,
                Err(e)
                    if e.is_instance_of::<PyKeyboardInterrupt>(py)
                        || e.is_instance_of::<PySystemExit>(py) =>
                {
                    return Err(e)
                }
                Err(e) => results.append(e.into_value(py))?,
            }
        }
        Ok(results)
    }

    /// One command applied here, or None for `_apply` to apply.
    fn one<'py>(
        &self,
        group: &mut Group<'py>,
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
        let i = match group.topics.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                group.topics.push((key, Topic::read(st)?));
                group.topics.len() - 1
            }
        };
        let t = &mut group.topics[i].1;
        if lease {
            self.lease(&group.state, &mut group.lids, t, args)
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
        lids: &mut Option<i64>,
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
        let lid = next_lid(state, lids)?;
        t.consumers.set_item(&consumer, &now_obj)?;
        let record = Bound::new(
            py,
            LeaseRecord::empty(lid, consumer.clone().unbind(), now + lease_ms),
        )?;
        if let Some(seen) = seen {
            if t.trimmed_upto(self.acked.bind(py))? > seen {
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
            &t.sort_keys,
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
        t.tally(Tally::Leased, n as i64, self.acked.bind(py))?;
        t.tally(Tally::Redelivered, redelivered as i64, self.acked.bind(py))?;
        Ok(Some(record.into_any()))
    }

    /// `TopicState.ack` by receipts on the topic `t`: a whole run of one lease's in
    /// bulk (`_ack_run`), others one by one, fewer than a bulk ack takes. None where
    /// `_apply` must (ids, receipts that are not small ints, a bulk ack that is not one
    /// lease's run held by the consumer).
    fn ack<'py>(
        &self,
        t: &mut Topic<'py>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = args.py();
        let receipts = args.get_item(3)?;
        let consumer = args.get_item(0)?;
        let now_obj = args.get_item(1)?;
        let (Ok(consumer), Ok(now)) = (
            consumer.downcast_into::<PyString>(),
            now_obj.extract::<i64>(),
        ) else {
            return Ok(None);
        };
        if let Some((first, n)) = self.run_named(&receipts)? {
            return self.ack_run(t, &consumer, &now_obj, now, first, n);
        }
        let Ok(receipts) = receipts.downcast_into::<PyList>() else {
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
        let who = consumer.to_str()?;
        let refused = PyDict::new(py);
        let (acked, refusal_of) = (self.acked.bind(py), self.refusal_of.bind(py));
        for (key, &k) in receipts.iter().zip(&keys) {
            let Some(record) = t.records.get_item(k >> POSITION_BITS)? else {
                refused.set_item(&key, &self.not_leased)?;
                continue;
            };
            let record = record.downcast_into::<LeaseRecord>()?;
            let pos = (k & ((1 << POSITION_BITS) - 1)) as usize;
            let (handle, g, live) = match LeaseRecord::take_at(&record, pos, who, now, ACKED)? {
                Err(status) => {
                    refused.set_item(&key, refusal_of.get_item(status as usize)?)?;
                    continue;
                }
                Ok(taken) => taken,
            };
            let lid = record.borrow().number();
            if live == 0 {
                t.leased.del_item(lid)?;
                t.ending_append.call1(((t.seq + 1, lid),))?;
            }
            let bucket = g.bucket.into_pyobject(py)?;
            hold_in(&t.held, &bucket, 1, &consumer, -1)?;
            AckRun::append(
                &t.entries,
                t.seq + 1,
                handle,
                g.bucket,
                acked,
                g.sort_key,
                g.deliveries,
                now,
            )?;
            t.seq += 1;
            t.tally(Tally::Acked, 1, acked)?;
            if !t.sort_keys.is_empty() && t.sort_keys.contains(handle)? {
                t.sort_keys.del_item(handle)?;
            }
        }
        seen(t, &consumer, &now_obj, now)?;
        Ok(Some(refused.into_any()))
    }

    /// (first, n) where `receipts` are n consecutive receipts from `first`, at least a
    /// bulk ack's: a `range` of step 1, as the leader carries a whole lease's, or a list.
    /// None for anything else, which `_apply` reads as `TopicState.ack` does.
    fn run_named(&self, receipts: &Bound<'_, PyAny>) -> PyResult<Option<(i64, usize)>> {
        let py = receipts.py();
        let (first, n) = if receipts.get_type().is(self.range.bind(py)) {
            let int = |name| receipts.getattr(name).and_then(|v| v.extract::<i64>()).ok();
            let (Some(start), Some(1), Ok(n)) = (
                int(intern!(py, "start")),
                int(intern!(py, "step")),
                receipts.len(),
            ) else {
                return Ok(None);
            };
            (start, n)
        } else if let Ok(list) = receipts.downcast::<PyList>() {
            if list.len() < self.bulk_min {
                return Ok(None); // one by one, before any is read
            }
            let Some(Ok(first)) = list.iter().next().map(|r| r.extract::<i64>()) else {
                return Ok(None);
            };
            for (i, r) in list.iter().enumerate() {
                if r.extract::<i64>().ok() != first.checked_add(i as i64) {
                    return Ok(None);
                }
            }
            (first, list.len())
        } else {
            return Ok(None);
        };
        Ok((n >= self.bulk_min && first >= 0).then_some((first, n)))
    }

    /// `TopicState._ack_run`: positions of one lease from `first`'s, `n` of them, all
    /// held by `consumer`, acked as one `Run` event; None where they are not (`_apply`
    /// refuses them one by one).
    fn ack_run<'py>(
        &self,
        t: &mut Topic<'py>,
        consumer: &Bound<'py, PyString>,
        now_obj: &Bound<'py, PyAny>,
        now: i64,
        first: i64,
        n: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = consumer.py();
        let Some(record) = t.records.get_item(first >> POSITION_BITS)? else {
            return Ok(None);
        };
        let record = record.downcast_into::<LeaseRecord>()?;
        let start = (first & ((1 << POSITION_BITS) - 1)) as usize;
        if !record
            .borrow()
            .run_held(py, start, n, consumer.to_str()?, now)?
        {
            return Ok(None);
        }
        let (lid, live, per_bucket) = {
            let mut r = record.borrow_mut();
            let live = r.end_run(start, n, ACKED)?;
            (r.number(), live, r.run_buckets(start, start + n))
        };
        let last = t.seq + n as i64;
        if live == 0 {
            t.leased.del_item(lid)?;
            t.ending_append.call1(((last, lid),))?;
        }
        for (bucket, count) in per_bucket {
            hold_in(
                &t.held,
                bucket.into_pyobject(py)?.as_any(),
                count,
                consumer,
                -1,
            )?;
        }
        let columns = LeaseRecord::columns(&record, start, start + n)?;
        let (handles, buckets, keys, deliveries) = (
            columns.get_item(0)?,
            columns.get_item(1)?,
            columns.get_item(2)?,
            columns.get_item(3)?,
        );
        let acked = self.acked.bind(py);
        let event = (
            t.seq + 1,
            handles,
            buckets,
            acked,
            keys,
            deliveries,
            now_obj,
        );
        t.entries.append(self.run.bind(py).call1(event)?)?;
        if !t.sort_keys.is_empty() {
            // Copied out: a Python int made while the record is borrowed may run the GC,
            // and another thread whose borrow would fail (`LeaseTable`'s note).
            let handles = record.borrow().run_handles(start, start + n).to_vec();
            for handle in handles {
                if t.sort_keys.contains(handle)? {
                    t.sort_keys.del_item(handle)?;
                }
            }
        }
        t.seq = last;
        t.tally(Tally::Acked, n as i64, acked)?;
        seen(t, consumer, now_obj, now)?;
        Ok(Some(PyDict::new(py).into_any()))
    }
}

/// `TopicState._seen`: a settle is a sign of life of a member.
fn seen<'py>(
    t: &Topic<'py>,
    consumer: &Bound<'py, PyString>,
    now_obj: &Bound<'py, PyAny>,
    now: i64,
) -> PyResult<()> {
    if let Some(seen) = t.consumers.get_item(consumer)? {
        if seen.extract::<i64>()? < now {
            t.consumers.set_item(consumer, now_obj)?;
        }
    }
    Ok(())
}

#[pymethods]
impl Transitions {
    #[new]
    fn new(
        acked: Py<PyAny>,
        refusal_of: Py<PyTuple>,
        not_leased: Py<PyAny>,
        bulk_min: usize,
        run: Py<PyAny>,
        py: Python<'_>,
    ) -> PyResult<Self> {
        Ok(Self {
            acked,
            refusal_of,
            not_leased,
            bulk_min,
            run,
            range: py.import("builtins")?.getattr("range")?.unbind(),
        })
    }

    /// `BrokerState.batch`: each of `commands` (topic, op, args) applied in order, its
    /// result or what it raised in its place; `apply(topic, op, args)`
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
        let mut group = Group {
            state: fields,
            topics: Vec::new(),
            lids: None,
        };
        let results = self.each(&mut group, &topics, commands, apply);
        // Written back even where the loop stopped (an interrupt, or `commands` itself).
        let flushed = group.flush(self.acked.bind(py));
        let results = results?;
        flushed?;
        Ok(results)
    }
}
