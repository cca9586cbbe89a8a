//! Each bucket's pending rows in lease order, as tokens: no Python object per row.
//!
//! A bucket keeps a run, tokens sorted once and taken from its low end, and a heap of
//! entries for what arrives a few at a time (redeliveries, re-keyed messages, a trickle
//! of new rows). A run's token carries no key: its row's columns (the index's NumPy
//! arrays, passed to each call) say where it sorts. A heap entry carries its key, as a
//! nack or a reschedule may have moved it from its row's own.
//!
//! A token is its row's handle (low 32 bits) and the batch that stored it (high 32): the
//! row store's `batch` column holding the token's batch at its handle says it is still
//! its message's. Tokens that are not are dropped as they surface:
//! their message settled, and the handle may since stand for another.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::handles::{mh, WIDTH};
use crate::ids::{column_key, WIDEST};
use crate::lease_table::LeaseTable;
use crate::packed_ids::unpadded;

use pyo3::buffer::{Element, PyBuffer, ReadOnlyCell};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::heads::{self, joined_heads, HeadCache, JoinedHeads};

/// Picks as a lease command carries them (`leases.Picks`): message handles, buckets,
/// sort keys, each packed little-endian.
type Picks<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
);

/// A token's handle: its low 32 bits (`row_store.HANDLE_MASK`).
pub(crate) const HANDLE_MASK: i64 = (1 << 32) - 1;
/// A token's batch: its high 32 bits (`row_store.HANDLE_BITS`).
const BATCH_SHIFT: u32 = 32;
/// A run's taken part goes once it passes this many tokens and half the run.
const COMPACT_AFTER: usize = 4096;

/// Where a row sorts: (sort key, partition, offset), the token last (the order among
/// duplicates of one message's coordinates), as `RowStore.order` sorts.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    key: i64,
    partition: i64,
    offset: i64,
    token: i64,
}

/// The row store's columns for one call, borrowed from the NumPy arrays.
struct Columns<'a> {
    batch: &'a [ReadOnlyCell<u32>],
    sort_key: &'a [ReadOnlyCell<i64>],
    partition: &'a [ReadOnlyCell<i32>],
    offset: &'a [ReadOnlyCell<i64>],
}

pub(crate) fn slice<'a, T: pyo3::buffer::Element>(
    py: Python<'a>,
    buffer: &'a PyBuffer<T>,
    name: &str,
) -> PyResult<&'a [ReadOnlyCell<T>]> {
    buffer
        .as_slice(py)
        .ok_or_else(|| PyValueError::new_err(format!("the {name} column is not contiguous")))
}

impl<'a> Columns<'a> {
    fn new(
        py: Python<'a>,
        batch: &'a PyBuffer<u32>,
        sort_key: &'a PyBuffer<i64>,
        partition: &'a PyBuffer<i32>,
        offset: &'a PyBuffer<i64>,
    ) -> PyResult<Self> {
        let columns = Columns {
            batch: slice(py, batch, "batch")?,
            sort_key: slice(py, sort_key, "sort_key")?,
            partition: slice(py, partition, "partition")?,
            offset: slice(py, offset, "offset")?,
        };
        let n = columns.batch.len();
        if columns.sort_key.len() != n || columns.partition.len() != n || columns.offset.len() != n
        {
            return Err(PyValueError::new_err("the columns differ in length"));
        }
        Ok(columns)
    }

    /// Whether `token` is still its message's.
    fn current(&self, token: i64) -> bool {
        let h = (token & HANDLE_MASK) as usize;
        let batch = (token >> BATCH_SHIFT) as u32;
        self.batch
            .get(h)
            .is_some_and(|b| b.get() == batch && batch != 0)
    }

    /// A current token's entry at its row's own key.
    fn entry(&self, token: i64) -> Entry {
        let h = (token & HANDLE_MASK) as usize;
        Entry {
            key: self.sort_key[h].get(),
            partition: self.partition[h].get() as i64,
            offset: self.offset[h].get(),
            token,
        }
    }
}

#[derive(Default)]
struct Bucket {
    run: Vec<i64>,
    next: usize, // tokens before it are taken
    heap: BinaryHeap<Reverse<Entry>>,
}

impl Bucket {
    fn len(&self) -> usize {
        self.run.len() - self.next + self.heap.len()
    }

    /// The lowest entry still its message's, and whether it is the heap's; the stale
    /// ones before it are dropped.
    fn top(&mut self, c: &Columns) -> Option<(Entry, bool)> {
        while self.next < self.run.len() && !c.current(self.run[self.next]) {
            self.next += 1;
        }
        while let Some(Reverse(e)) = self.heap.peek() {
            if c.current(e.token) {
                break;
            }
            self.heap.pop();
        }
        let run = (self.next < self.run.len()).then(|| c.entry(self.run[self.next]));
        let heap = self.heap.peek().map(|Reverse(e)| *e);
        match (run, heap) {
            (Some(r), Some(h)) if h <= r => Some((h, true)),
            (Some(r), _) => Some((r, false)),
            (None, Some(h)) => Some((h, true)),
            (None, None) => None,
        }
    }

    /// Take the entry `top` gave.
    fn take(&mut self, from_heap: bool) {
        if from_heap {
            self.heap.pop();
            if self.heap.capacity() > 64 && 4 * self.heap.len() < self.heap.capacity() {
                self.heap.shrink_to_fit(); // as a run's: what is left, not the peak
            }
            return;
        }
        self.next += 1;
        if self.next > COMPACT_AFTER && 2 * self.next > self.run.len() {
            self.run.drain(..self.next);
            self.run.shrink_to_fit(); // a drained run holds what is left, not its peak
            self.next = 0;
        }
    }

    /// Every token not taken: the run's in order, then the heap's.
    fn tokens(&self) -> impl Iterator<Item = i64> + '_ {
        self.run[self.next..]
            .iter()
            .copied()
            .chain(self.heap.iter().map(|Reverse(e)| e.token))
    }
}

/// A column as a pick last acquired it, kept while the same array is passed: a buffer
/// costs ~0.12 us to acquire (its format is parsed and checked), and a lease's pick and
/// heads read seven. The buffer holds a reference to its array, so the array's address
/// names it while held.
struct Held<T: Element> {
    array: usize,
    buffer: PyBuffer<T>,
}

/// `array`'s buffer: the held one if it is the same array, else acquired and held.
fn held<'a, T: Element>(
    slot: &'a mut Option<Held<T>>,
    array: &Bound<'_, PyAny>,
) -> PyResult<&'a PyBuffer<T>> {
    let address = array.as_ptr() as usize;
    if slot.as_ref().is_none_or(|h| h.array != address) {
        *slot = None; // let go first: a failed acquisition holds nothing stale
        *slot = Some(Held {
            array: address,
            buffer: PyBuffer::get(array)?,
        });
    }
    Ok(buffer(slot))
}

/// The buffer of a slot `held` has filled.
fn buffer<T: Element>(slot: &Option<Held<T>>) -> &PyBuffer<T> {
    &slot.as_ref().expect("held first").buffer
}

/// The row store's columns as the leader's picks pass them, held between picks.
#[derive(Default)]
struct HeldColumns {
    batch: Option<Held<u32>>,
    sort_key: Option<Held<i64>>,
    partition: Option<Held<i32>>,
    offset: Option<Held<i64>>,
    ids: Option<Held<u8>>,
    segment: Option<Held<i32>>,
    position: Option<Held<i32>>,
}

impl HeldColumns {
    /// The ordering columns held, or None until a pick has held them all.
    fn columns<'a>(&'a self, py: Python<'a>) -> PyResult<Option<Columns<'a>>> {
        let (Some(batch), Some(sort_key), Some(partition), Some(offset)) =
            (&self.batch, &self.sort_key, &self.partition, &self.offset)
        else {
            return Ok(None);
        };
        Columns::new(
            py,
            &batch.buffer,
            &sort_key.buffer,
            &partition.buffer,
            &offset.buffer,
        )
        .map(Some)
    }
}

/// The row store's columns a pick reads (`Order.pick`'s arguments of the same names).
type PickColumns<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
);

/// The Raft state's maps a pick asks, each by message handle: settled, leases,
/// not_before and overrides.
type PickState<'py> = (
    Bound<'py, PyDict>,
    Bound<'py, LeaseTable>,
    Bound<'py, PyDict>,
    Bound<'py, PyDict>,
);

/// The order of one topic's pending rows, per bucket.
#[pyclass(module = "dejaq_core")]
pub struct Order {
    buckets: Vec<Bucket>,
    held: HeldColumns,
    heads: HeadCache,
}

impl Order {
    fn bucket(&mut self, b: usize) -> PyResult<&mut Bucket> {
        bucket_of(&mut self.buckets, b)
    }

    /// `pick`'s work: the picks and their tokens.
    #[allow(clippy::too_many_arguments)]
    fn picked<'py>(
        &mut self,
        py: Python<'py>,
        buckets: Vec<usize>,
        n: usize,
        max_key: i64,
        now: i64,
        state: PickState<'py>,
        columns: PickColumns<'_, 'py>,
        width: usize,
        long: &Bound<'py, PyDict>,
    ) -> PyResult<(Picks<'py>, Vec<i64>)> {
        let (settled, leases, not_before, overrides) = state;
        let (batch, sort_key, partition, offset, ids) = columns;
        let h = &mut self.held;
        // Acquired in turn (each borrows `held` mutably), then read together.
        held(&mut h.batch, batch)?;
        held(&mut h.sort_key, sort_key)?;
        held(&mut h.partition, partition)?;
        held(&mut h.offset, offset)?;
        held(&mut h.ids, ids)?;
        let c = h.columns(py)?.expect("held above");
        let column = slice(py, buffer(&h.ids), "id")?;
        if width == 0 || width > WIDEST || column.len() != width * c.batch.len() {
            return Err(PyValueError::new_err(
                "the id column does not match the others",
            ));
        }
        let mut tops = BinaryHeap::with_capacity(buckets.len());
        let mut asked = vec![false; self.buckets.len()];
        for &b in &buckets {
            let bucket = bucket_of(&mut self.buckets, b)?;
            if std::mem::replace(&mut asked[b], true) {
                continue; // named twice: one top per bucket, or one entry would be taken twice
            }
            if let Some((e, heap)) = bucket.top(&c) {
                tops.push(Reverse((e, b, heap)));
            }
        }
        let mut packed = Vec::with_capacity(WIDTH * n.min(1024));
        let mut picked_buckets = Vec::with_capacity(2 * n.min(1024));
        let mut keys = Vec::with_capacity(8 * n.min(1024));
        let mut tokens = Vec::with_capacity(n.min(1024));
        while tokens.len() < n {
            let Some(Reverse((e, b, heap))) = tops.pop() else {
                break;
            };
            if e.key > max_key {
                continue; // and so is every other of the bucket's
            }
            let bucket = &mut self.buckets[b];
            bucket.take(heap);
            if let Some((next, heap)) = bucket.top(&c) {
                tops.push(Reverse((next, b, heap)));
            }
            let h = (e.token & HANDLE_MASK) as usize;
            let raw = column_key(column, h, width)?;
            let long_mid = if long.is_empty() {
                None
            } else {
                long.get_item(h)?
                    .map(|m| m.downcast_into::<PyString>())
                    .transpose()?
            };
            let handle = match &long_mid {
                Some(mid) => mh(mid.to_str()?.as_bytes()),
                None => mh(unpadded(&raw[..width])),
            };
            // Looked up in the state's dicts too where any holds something.
            let probe = !(settled.is_empty() && not_before.is_empty() && overrides.is_empty());
            let stale = leases.borrow().holds(handle)
                || (probe && {
                    let int = handle.into_pyobject(py)?; // one Python int for every map
                    (!settled.is_empty() && settled.contains(&int)?)
                        || (!not_before.is_empty()
                            && match not_before.get_item(&int)? {
                                Some(at) => at.extract::<i64>()? > now,
                                None => false,
                            })
                        || (!overrides.is_empty()
                            && match overrides.get_item(&int)? {
                                Some(key) => key.extract::<i64>()? != e.key,
                                None => c.entry(e.token).key != e.key,
                            })
                });
            if !stale {
                let bucket = u16::try_from(b)
                    .map_err(|_| PyValueError::new_err(format!("bucket {b} is past uint16")))?;
                packed.extend_from_slice(&handle.to_le_bytes());
                picked_buckets.extend_from_slice(&bucket.to_le_bytes());
                keys.extend_from_slice(&e.key.to_le_bytes());
                tokens.push(e.token);
            }
        }
        let picks = (
            PyBytes::new(py, &packed),
            PyBytes::new(py, &picked_buckets),
            PyBytes::new(py, &keys),
        );
        Ok((picks, tokens))
    }
}

/// Bucket `b` of `buckets`, or an IndexError naming how many there are.
fn bucket_of(buckets: &mut [Bucket], b: usize) -> PyResult<&mut Bucket> {
    let n = buckets.len();
    buckets
        .get_mut(b)
        .ok_or_else(|| PyIndexError::new_err(format!("bucket {b} of {n}")))
}

#[pymethods]
impl Order {
    #[new]
    fn new(buckets: usize) -> Self {
        Order {
            buckets: (0..buckets).map(|_| Bucket::default()).collect(),
            held: HeldColumns::default(),
            heads: HeadCache::default(),
        }
    }

    /// Let go of the columns held since the last pick: once its arrays are replaced (a
    /// growth, a narrower id column, a shrink), the held ones would stay in memory
    /// until the next pick, and a node that no longer leads picks no more. The heads'
    /// blocks cached by the picks go too.
    fn release_columns(&mut self) {
        self.held = HeldColumns::default();
        self.heads.clear();
    }

    /// New rows of `bucket` (tokens of stored rows): pushed on its heap while that
    /// stays under max(run_min, run/8), else merged with the run, the heap's entries at
    /// their row's own key and the new rows into one sorted run (once per run/8 rows
    /// added). Tokens no longer their messages', the heap's too, are dropped by the merge.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        py: Python<'_>,
        bucket: usize,
        tokens: PyBuffer<i64>,
        run_min: usize,
        batch: PyBuffer<u32>,
        sort_key: PyBuffer<i64>,
        partition: PyBuffer<i32>,
        offset: PyBuffer<i64>,
    ) -> PyResult<()> {
        let c = Columns::new(py, &batch, &sort_key, &partition, &offset)?;
        let new: Vec<i64> = slice(py, &tokens, "tokens")?
            .iter()
            .map(|t| t.get())
            .collect();
        if let Some(&t) = new.iter().find(|&&t| !c.current(t)) {
            return Err(PyValueError::new_err(format!("token {t} is not stored")));
        }
        let b = self.bucket(bucket)?;
        let run_len = b.run.len() - b.next;
        if b.heap.len() + new.len() < run_min.max(run_len / 8) {
            b.heap.extend(new.into_iter().map(|t| Reverse(c.entry(t))));
            return Ok(());
        }
        // The heap's stale entries go too: a follower never picks, so an entry left in
        // its heap would stay for the life of the process.
        let (own, rekeyed): (Vec<Entry>, Vec<Entry>) = std::mem::take(&mut b.heap)
            .into_iter()
            .map(|Reverse(e)| e)
            .filter(|e| c.current(e.token))
            .partition(|e| c.entry(e.token).key == e.key);
        b.heap = rekeyed.into_iter().map(Reverse).collect();
        b.heap.shrink_to_fit();
        // Each token's place read once, not at every comparison: a merge of a whole
        // bucket at start sorts a million, whose rows lie all over the columns.
        let mut merged: Vec<Entry> = b.run[b.next..]
            .iter()
            .copied()
            .filter(|&t| c.current(t))
            .chain(own.iter().map(|e| e.token))
            .chain(new)
            .map(|t| c.entry(t))
            .collect();
        merged.sort_unstable();
        b.run = merged.iter().map(|e| e.token).collect();
        b.next = 0;
        Ok(())
    }

    /// One entry at `key` (a pending message's key in force) on its bucket's heap.
    fn push(
        &mut self,
        bucket: usize,
        key: i64,
        partition: i64,
        offset: i64,
        token: i64,
    ) -> PyResult<()> {
        let entry = Entry {
            key,
            partition,
            offset,
            token,
        };
        self.bucket(bucket)?.heap.push(Reverse(entry));
        Ok(())
    }

    /// Take the `n` lowest deliverable entries across `buckets`, in order: `TopicIndex.pick`
    /// in one call. An entry is stale, and dropped as it is met, when its token is no
    /// longer its message's, or by the Raft state: its message `settled` or in `leases`
    /// (a `LeaseTable`), held back in `not_before` past `now`, or re-keyed (its key not
    /// the one in force: its override in `overrides`, else its row's own); each asked by
    /// its message handle, hashed once per entry met. A bucket whose lowest key is
    /// above `max_key` has nothing due and gives none. Ids come from the id column
    /// (`ids`, `width` bytes a handle) or from `long`, the ids it holds as digests, by
    /// handle. Returns the picks as a lease command carries them (`leases.Picks`): their
    /// message handles (hashed from those ids as the stale check needs them anyway),
    /// buckets and keys, packed little-endian (16, 2 and 8 bytes each); and their
    /// tokens, as int64 bytes (native order, for NumPy).
    /// The columns' buffers are held until other arrays are passed (`release_columns`).
    #[allow(clippy::too_many_arguments)]
    fn pick<'py>(
        &mut self,
        py: Python<'py>,
        buckets: Vec<usize>,
        n: usize,
        max_key: i64,
        now: i64,
        state: PickState<'py>,
        batch: &Bound<'py, PyAny>,
        sort_key: &Bound<'py, PyAny>,
        partition: &Bound<'py, PyAny>,
        offset: &Bound<'py, PyAny>,
        ids: &Bound<'py, PyAny>,
        width: usize,
        long: &Bound<'py, PyDict>,
    ) -> PyResult<(Picks<'py>, Bound<'py, PyBytes>)> {
        let columns = (batch, sort_key, partition, offset, ids);
        let (picks, tokens) =
            self.picked(py, buckets, n, max_key, now, state, columns, width, long)?;
        let tokens: Vec<u8> = tokens.iter().flat_map(|t| t.to_ne_bytes()).collect();
        Ok((picks, PyBytes::new(py, &tokens)))
    }

    /// `pick`, and the picks' heads read as `read_joined_heads` reads them (from the
    /// row store's `segment` and `position` columns and its `segments`, through runs
    /// at most `span` apart): a lease's pick and heads in one call, its columns held
    /// between calls. Returns the picks and (heads joined, where each ends, their rows'
    /// sort keys).
    #[allow(clippy::too_many_arguments)]
    fn pick_heads<'py>(
        &mut self,
        py: Python<'py>,
        buckets: Vec<usize>,
        n: usize,
        max_key: i64,
        now: i64,
        state: PickState<'py>,
        batch: &Bound<'py, PyAny>,
        sort_key: &Bound<'py, PyAny>,
        partition: &Bound<'py, PyAny>,
        offset: &Bound<'py, PyAny>,
        ids: &Bound<'py, PyAny>,
        width: usize,
        long: &Bound<'py, PyDict>,
        segment: &Bound<'py, PyAny>,
        position: &Bound<'py, PyAny>,
        segments: &Bound<'py, PyDict>,
        span: usize,
    ) -> PyResult<(Picks<'py>, JoinedHeads<'py>)> {
        let columns = (batch, sort_key, partition, offset, ids);
        let (picks, tokens) =
            self.picked(py, buckets, n, max_key, now, state, columns, width, long)?;
        let h = &mut self.held;
        held(&mut h.segment, segment)?;
        held(&mut h.position, position)?;
        let borrowed = heads::columns(
            py,
            buffer(&h.sort_key),
            buffer(&h.segment),
            buffer(&h.position),
        )?;
        let read = joined_heads(
            py,
            &tokens,
            borrowed,
            segments,
            span,
            None,
            Some(&mut self.heads),
        )?;
        Ok((picks, read))
    }

    /// The lowest sort key among `buckets`' entries still their messages' (a
    /// timeline's next due time, at which its waiting leases look again), or None if
    /// they hold none, or if no pick has held the columns since they were released. An
    /// entry a pick would skip (settled, moved by an override) may be the lowest: a
    /// lease then looks early, never late.
    fn lowest(&mut self, py: Python<'_>, buckets: Vec<usize>) -> PyResult<Option<i64>> {
        let Some(c) = self.held.columns(py)? else {
            return Ok(None);
        };
        let mut lowest: Option<i64> = None;
        for b in buckets {
            if let Some((e, _)) = bucket_of(&mut self.buckets, b)?.top(&c) {
                lowest = Some(lowest.map_or(e.key, |k| k.min(e.key)));
            }
        }
        Ok(lowest)
    }

    /// A bucket's tokens not taken, as int64 bytes: the run's in order, then the heap's;
    /// and the heap's entries' keys, in the same order as its tokens.
    fn entries<'py>(
        &mut self,
        py: Python<'py>,
        bucket: usize,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let b = self.bucket(bucket)?;
        let tokens: Vec<u8> = b.tokens().flat_map(i64::to_ne_bytes).collect();
        let keys: Vec<u8> = b
            .heap
            .iter()
            .flat_map(|Reverse(e)| e.key.to_ne_bytes())
            .collect();
        Ok((PyBytes::new(py, &tokens), PyBytes::new(py, &keys)))
    }

    /// Replace a bucket: `run`, tokens already in order, and heap entries given as
    /// int64 (key, partition, offset, token) rows, flattened.
    fn replace(
        &mut self,
        py: Python<'_>,
        bucket: usize,
        run: PyBuffer<i64>,
        heap: PyBuffer<i64>,
    ) -> PyResult<()> {
        let run: Vec<i64> = slice(py, &run, "run")?.iter().map(|t| t.get()).collect();
        let flat = slice(py, &heap, "heap")?;
        if flat.len() % 4 != 0 {
            return Err(PyValueError::new_err("heap entries are rows of 4 int64"));
        }
        let heap = flat
            .chunks_exact(4)
            .map(|e| {
                Reverse(Entry {
                    key: e[0].get(),
                    partition: e[1].get(),
                    offset: e[2].get(),
                    token: e[3].get(),
                })
            })
            .collect();
        *self.bucket(bucket)? = Bucket { run, next: 0, heap };
        Ok(())
    }

    /// Entries held in all buckets.
    fn __len__(&self) -> usize {
        self.buckets.iter().map(Bucket::len).sum()
    }
}
