//! Look-ups in the index's id table (`broker/storage/id_table.py`): each message's slot,
//! by its id or by its handle ("mh", `handles.rs`), found by linear probing from a
//! position mixed from the mh, without making an array or a bytes object per message;
//! messages deleted in the walk that finds them; and an id read back from the column by
//! its row's handle.
//!
//! A slot holds its row's handle + 1 and, in a parallel byte array, a tag of the mh's
//! mix: a probe reads the row only where the tag matches. A match is confirmed, for a
//! look-up by id, by the row's id compared with the one asked for (exact); for a look-up
//! by mh (every node's forget of a trim, the leader's naming of a checkpoint's events),
//! by the row's check: 64 bits of its mh (the high half, `check_of`), in a uint64 column
//! by row handle that `place_slots` fills wherever a row is placed. Hashing the row's id
//! again instead cost 0.13-0.15 µs a message. A false confirmation needs a row in the
//! probe chain with the same tag and the same 64 bits of mh, another message's: the mix
//! takes in each half of the mh bijectively given the other, so that is chance, about
//! 2^-72 a probe (2^-8 for the tag, 2^-64 for the check), whatever ids a producer
//! chooses, since BLAKE3 cannot be steered. The column costs 8 bytes per row of
//! capacity, half the 16-byte mh that would make it exact.

use pyo3::buffer::{PyBuffer, ReadOnlyCell};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::handles::{mh, WIDTH};
use crate::lease_table::{id_strs, raw_ids};
use crate::order::slice;
use crate::packed_ids::unpadded;

/// The longest id the column holds whole (`id_table.WIDEST`).
pub(crate) const WIDEST: usize = 64;
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;
const FMIX: [u64; 2] = [0xFF51_AFD7_ED55_8CCD, 0xC4CE_B9FE_1A85_EC53];
const EMPTY: i32 = 0;
const DELETED: i32 = -1;
/// `take_slots`: a message not stored, and one its call named before.
const ABSENT: i64 = -1;
const AGAIN: i64 = -3;
/// Messages whose first slots and column entries a walk loads ahead of walking them.
const CHUNK: usize = 1024;

/// The mix of a message's handle with the node's seed: its low bits are its position,
/// its top 8 its tag. The mh is uniform already, but anyone can compute it: mixed with
/// a seed drawn per process, ids cannot be chosen ahead to share a position on a node.
fn mixed(handle: u128, seed: u64) -> u64 {
    let mut h = seed;
    for word in [handle as u64, (handle >> 64) as u64] {
        h ^= word;
        h = h.wrapping_mul(MIX);
    }
    for c in FMIX {
        h ^= h >> 33;
        h = h.wrapping_mul(c);
    }
    h ^ (h >> 33)
}

fn tag_of(mix: u64) -> u8 {
    (mix >> 56) as u8
}

/// What the check column holds of a row's mh: its high 64 bits. Either half serves as
/// well (module doc); the position and tag mix the whole mh.
fn check_of(handle: u128) -> u64 {
    (handle >> 64) as u64
}

/// A table's first slot for `handle`, its tag and its row's check word.
fn start_of(handle: u128, seed: u64, mask: usize) -> (usize, u8, u64) {
    let mix = mixed(handle, seed);
    (mix as usize & mask, tag_of(mix), check_of(handle))
}

/// The number of rows of an id column of `len` bytes, `width` a row, which the check
/// column must match, or the caller passed columns of different rows.
fn rows_of(len: usize, width: usize, checks: usize) -> PyResult<usize> {
    if len != checks * width {
        return Err(PyValueError::new_err(format!(
            "the check column has {checks} rows, the id column {} bytes of {width}",
            len
        )));
    }
    Ok(checks)
}

/// The mask of a table of `len` slots over a column `width` bytes wide, whose tags are
/// `tags` long: a power of two, a multiple of 8 up to WIDEST, and as many tags as slots,
/// or the caller passed something else.
fn mask_of(len: usize, tags: usize, width: usize) -> PyResult<usize> {
    if len == 0
        || !len.is_power_of_two()
        || tags != len
        || width == 0
        || width > WIDEST
        || !width.is_multiple_of(8)
    {
        return Err(PyValueError::new_err(
            "the table's size must be a power of two, its tags as many, and the width a \
             multiple of 8 up to 64",
        ));
    }
    Ok(len - 1)
}

/// Whether the column's `width` bytes at `handle` hold `raw`, NUL-padded.
fn holds(ids: &[ReadOnlyCell<u8>], handle: usize, width: usize, raw: &[u8]) -> bool {
    let Some(key) = ids.get(handle * width..(handle + 1) * width) else {
        return false;
    };
    raw.len() <= width
        && key[..raw.len()].iter().zip(raw).all(|(a, b)| a.get() == *b)
        && key[raw.len()..].iter().all(|a| a.get() == 0)
}

/// Whether the column holds an id whole: one it does not is kept in `long`, the column
/// holding a digest of it.
fn whole(raw: &[u8]) -> bool {
    raw.len() <= WIDEST && raw.last() != Some(&0)
}

/// The rows' ids: the column, `width` bytes a handle, and `long`, the ids it holds as a
/// digest, by handle; and each row's check word (`check_of` its mh), by handle.
struct Rows<'a, 'py> {
    column: &'a [ReadOnlyCell<u8>],
    width: usize,
    long: &'a Bound<'py, PyDict>,
    checks: &'a [ReadOnlyCell<u64>],
}

impl Rows<'_, '_> {
    /// The id `long` holds for handle `h`, if any.
    fn long_id(&self, h: usize) -> PyResult<Option<Bound<'_, PyString>>> {
        if self.long.is_empty() {
            return Ok(None);
        }
        match self.long.get_item(h)? {
            Some(mid) => Ok(Some(mid.downcast_into::<PyString>()?)),
            None => Ok(None),
        }
    }

    /// Whether the row at `h` is the message `query` names: by its id's bytes, or by its
    /// check word for an mh (module doc).
    fn is(&self, h: usize, query: &Query<'_>) -> PyResult<bool> {
        let raw = match query {
            Query::Mh(handle) => {
                return Ok(self.checks.get(h).map(ReadOnlyCell::get) == Some(check_of(*handle)))
            }
            Query::Id(raw, _) => *raw,
        };
        match self.long_id(h)? {
            Some(mid) => Ok(mid.to_str()?.as_bytes() == raw),
            None => Ok(whole(raw) && holds(self.column, h, self.width, raw)),
        }
    }

    /// The 8-byte words of column the row at `h` needs: a digest's one if kept whole.
    fn words_at(&self, h: usize) -> PyResult<usize> {
        if self.long_id(h)?.is_some() {
            return Ok(1);
        }
        let key = column_key(self.column, h, self.width)?;
        Ok(unpadded(&key[..self.width]).len().div_ceil(8).max(1))
    }
}

/// A message asked for: by its id's bytes (and their mh), or by its mh.
enum Query<'a> {
    Id(&'a [u8], u128),
    Mh(u128),
}

impl Query<'_> {
    fn mh(&self) -> u128 {
        match self {
            Query::Id(_, handle) | Query::Mh(handle) => *handle,
        }
    }

    /// Whether the table cannot hold it, without a walk: an id wider than the column
    /// (which is as wide as the widest whole id it holds), or one held as a digest
    /// where none is.
    fn surely_absent(&self, width: usize, any_long: bool) -> bool {
        match self {
            Query::Id(raw, _) if whole(raw) => raw.len() > width,
            Query::Id(..) => !any_long,
            Query::Mh(_) => false,
        }
    }
}

/// The handles packed 16 bytes each in `blob`.
fn handles_in(blob: &[u8]) -> PyResult<Vec<u128>> {
    if !blob.len().is_multiple_of(WIDTH) {
        return Err(PyValueError::new_err("packed handles are 16 bytes each"));
    }
    Ok(blob
        .chunks_exact(WIDTH)
        .map(|b| u128::from_le_bytes(b.try_into().expect("16 bytes")))
        .collect())
}

/// The messages `mids` names: ids (a list of str, or `PackedIds`), or handles packed 16
/// bytes each (bytes), as the ids' bytes (`raws` holds them) and handles: hashed here,
/// or, for ids, `mhs` packing each one's handle already (an ingest hashes each id once,
/// for its look-up and its insert).
fn queries<'a>(
    mids: &'a Bound<'_, PyAny>,
    raws: &'a [&'a [u8]],
    mhs: Option<&Bound<'_, PyBytes>>,
) -> PyResult<Vec<Query<'a>>> {
    if let Ok(blob) = mids.downcast::<PyBytes>() {
        return Ok(handles_in(blob.as_bytes())?
            .into_iter()
            .map(Query::Mh)
            .collect());
    }
    let Some(mhs) = mhs else {
        return Ok(raws.iter().map(|&raw| Query::Id(raw, mh(raw))).collect());
    };
    let handles = handles_in(mhs.as_bytes())?;
    if handles.len() != raws.len() {
        return Err(PyValueError::new_err(format!(
            "{} handles for {} ids",
            handles.len(),
            raws.len()
        )));
    }
    Ok(raws
        .iter()
        .zip(handles)
        .map(|(&raw, handle)| Query::Id(raw, handle))
        .collect())
}

/// The ids' bytes that `mids` names (none for packed handles), `strs` holding their strs.
fn raws_of<'a, 'py>(
    py: Python<'py>,
    mids: &'a Bound<'py, PyAny>,
    strs: &'a [Bound<'py, PyString>],
) -> PyResult<Vec<&'a [u8]>> {
    if mids.downcast::<PyBytes>().is_ok() {
        return Ok(Vec::new());
    }
    raw_ids(py, mids, strs)
}

/// The strs of `mids`, if it names ids as str.
fn strs_of<'py>(mids: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyString>>> {
    if mids.downcast::<PyBytes>().is_ok() {
        return Ok(Vec::new());
    }
    id_strs(mids)
}

/// Each message's first slot and tag, or None where it is surely absent.
fn starts_of(
    chunk: &[Query<'_>],
    width: usize,
    any_long: bool,
    seed: u64,
    mask: usize,
) -> Vec<Option<(usize, u8)>> {
    chunk
        .iter()
        .map(|q| {
            if q.surely_absent(width, any_long) {
                return None;
            }
            let mix = mixed(q.mh(), seed);
            Some((mix as usize & mask, tag_of(mix)))
        })
        .collect()
}

/// Reads the first slots of `starts` (`slot` reads one), and what confirms a row at
/// their handles (its check word for a look-up by mh, else its id in the column; its id
/// too where `and_ids`, as a take by mh reads it for the widths' tally), in passes of
/// independent loads. A table of a million ids misses the cache at almost every probe:
/// loaded this way the CPU overlaps those misses, instead of waiting each one out in
/// turn as the walk would. Called a CHUNK of messages at a
/// time: over a whole trim's (tens of thousands), the lines the passes brought in were
/// gone again before the walk used them.
fn preload(
    slot: impl Fn(usize) -> i32,
    rows: &Rows<'_, '_>,
    starts: &[Option<(usize, u8)>],
    by_mh: bool,
    and_ids: bool,
) {
    let firsts: Vec<i32> = starts
        .iter()
        .map(|start| start.map_or(EMPTY, |(i, _)| slot(i)))
        .collect();
    let mut touched = 0u64;
    for &s in &firsts {
        let h = (s.max(1) - 1) as usize;
        if by_mh {
            touched ^= rows.checks.get(h).map_or(0, ReadOnlyCell::get);
        }
        if !by_mh || and_ids {
            touched ^= rows
                .column
                .get(h * rows.width)
                .map_or(0, |b| u64::from(b.get()));
        }
    }
    std::hint::black_box(touched);
}

/// What a walk from a message's first slot met: the slot holding it and its value (the
/// handle + 1), a slot `take_slots` marked for it earlier in its call, or an empty slot.
enum Probe {
    Found(usize, i32),
    Marked,
    Absent,
}

/// Walks a table of `len` slots (`slot` reads one, `tag` its tag) from `start` until a
/// slot of tag `want` holds the message `query` names, or a slot is empty, or every
/// slot was read. A slot below DELETED is one `take_slots` marked in this call, holding
/// its handle `h` as `-(h + 2)`; no other walk meets one, since `take_slots` leaves no
/// marks behind.
fn probe(
    slot: impl Fn(usize) -> i32,
    tag: impl Fn(usize) -> u8,
    len: usize,
    rows: &Rows<'_, '_>,
    query: &Query<'_>,
    (start, want): (usize, u8),
) -> PyResult<Probe> {
    let mut i = start;
    for _ in 0..len {
        let s = slot(i);
        if s == EMPTY {
            return Ok(Probe::Absent);
        }
        if s > 0 && tag(i) == want && rows.is((s - 1) as usize, query)? {
            return Ok(Probe::Found(i, s));
        }
        if s < DELETED && tag(i) == want && rows.is((-2 - i64::from(s)) as usize, query)? {
            return Ok(Probe::Marked);
        }
        i = (i + 1) & (len - 1);
    }
    Ok(Probe::Absent)
}

/// The id table `walk` reads besides its slots: each slot's tag, each row's check word,
/// the id column (`width` bytes a handle), the ids held as a digest, and the seed.
type Table<'a, 'py> = (
    &'a PyBuffer<u8>,
    &'a PyBuffer<u64>,
    &'a PyBuffer<u8>,
    usize,
    &'a Bound<'py, PyDict>,
    u64,
);

/// The walk `find_slots` and `take_slots` share, over a table of `len` slots (`slot`
/// reads one): each message `mids` names, walked from its first slot, a CHUNK at a time
/// with their first slots and rows loaded ahead (`preload`, the rows' ids too where
/// `and_ids`), and what its walk met told to `each`, in order. Built here, the queries
/// borrow the ids' strs and bytes for no longer than the walk.
fn walk<'py>(
    py: Python<'py>,
    mids: &Bound<'py, PyAny>,
    (slot, len): (impl Fn(usize) -> i32, usize),
    (tags, checks, ids, width, long, seed): Table<'_, 'py>,
    mhs: Option<&Bound<'py, PyBytes>>,
    and_ids: bool,
    mut each: impl FnMut(Probe, &Rows<'_, 'py>) -> PyResult<()>,
) -> PyResult<()> {
    let tags = slice(py, tags, "id table's tag")?;
    let column = slice(py, ids, "id")?;
    let checks = slice(py, checks, "check")?;
    let mask = mask_of(len, tags.len(), width)?;
    rows_of(column.len(), width, checks.len())?;
    let strs = strs_of(mids)?;
    let raws = raws_of(py, mids, &strs)?;
    let asked = queries(mids, &raws, mhs)?;
    let by_mh = mids.downcast::<PyBytes>().is_ok();
    let rows = Rows {
        column,
        width,
        long,
        checks,
    };
    let tag = |i: usize| tags[i].get();
    for chunk in asked.chunks(CHUNK) {
        let starts = starts_of(chunk, width, !long.is_empty(), seed, mask);
        preload(&slot, &rows, &starts, by_mh, and_ids);
        for (query, start) in chunk.iter().zip(&starts) {
            let walked = match start {
                Some(start) => probe(&slot, tag, len, &rows, query, *start)?,
                None => Probe::Absent,
            };
            each(walked, &rows)?;
        }
    }
    Ok(())
}

/// The slot of each message `mids` names (ids as a list of str or `PackedIds`, or
/// handles packed 16 bytes each in bytes) (-1: not stored), and its row's handle (-1
/// unless found), as two int64 bytes: the walk has read the slot, so the caller does
/// not read the table again. `slots` is the table (a handle + 1 per used slot, -1
/// deleted), `tags` each slot's tag, `checks` each row's check word (`check_of` its mh),
/// by handle, `ids` the column's bytes (`width` per handle), `long` the ids it holds as
/// a digest, by handle, and `seed` the position's; `mhs`, for ids, their handles packed,
/// if hashed already.
#[pyfunction]
#[pyo3(signature = (mids, slots, tags, checks, ids, width, long, seed, mhs = None))]
#[allow(clippy::too_many_arguments)]
pub fn find_slots<'py>(
    py: Python<'py>,
    mids: &Bound<'py, PyAny>,
    slots: PyBuffer<i32>,
    tags: PyBuffer<u8>,
    checks: PyBuffer<u64>,
    ids: PyBuffer<u8>,
    width: usize,
    long: &Bound<'py, PyDict>,
    seed: u64,
    mhs: Option<&Bound<'py, PyBytes>>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let table = slice(py, &slots, "id table's")?;
    let mut found: Vec<u8> = Vec::new();
    let mut handles: Vec<u8> = Vec::new();
    let each = |walked: Probe, _: &Rows<'_, '_>| {
        let (slot, handle) = match walked {
            Probe::Found(slot, s) => (slot as i64, i64::from(s) - 1),
            Probe::Marked | Probe::Absent => (-1, -1),
        };
        found.extend_from_slice(&slot.to_ne_bytes());
        handles.extend_from_slice(&handle.to_ne_bytes());
        Ok(())
    };
    let table_of = (&tags, &checks, &ids, width, long, seed);
    let slot = |i: usize| table[i].get();
    walk(py, mids, (slot, table.len()), table_of, mhs, false, each)?;
    Ok((PyBytes::new(py, &found), PyBytes::new(py, &handles)))
}

/// Deletes the messages `mids` names (as `find_slots`'s) from the table, in the one
/// walk that finds them, and their ids from `long`: the handle of each (int64 bytes),
/// ABSENT where it is not stored, AGAIN where `mids` named it earlier; and how many of
/// those deleted need each count of the column's 8-byte words (index 1..=WIDEST / 8),
/// for the caller's tally. Each node forgets a trim's messages this way: finding them,
/// then emptying their slots, would read every slot and the column at it twice.
/// Arguments as `find_slots`'s, the table writable.
///
/// A slot found is marked with its handle `h` as `-(h + 2)` until the walk ends, so that
/// a later naming of the same message is told apart from one never stored; then every
/// mark becomes a deleted slot.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn take_slots<'py>(
    py: Python<'py>,
    mids: &Bound<'py, PyAny>,
    slots: PyBuffer<i32>,
    tags: PyBuffer<u8>,
    checks: PyBuffer<u64>,
    ids: PyBuffer<u8>,
    width: usize,
    long: &Bound<'py, PyDict>,
    seed: u64,
) -> PyResult<(Bound<'py, PyBytes>, Vec<i64>)> {
    let table = slots
        .as_mut_slice(py)
        .ok_or_else(|| PyValueError::new_err("the id table is not writable and contiguous"))?;
    let mut handles: Vec<u8> = Vec::new();
    let mut taken: Vec<usize> = Vec::new();
    let mut words = vec![0i64; WIDEST / 8 + 1];
    let each = |walked: Probe, rows: &Rows<'_, '_>| {
        let handle = match walked {
            Probe::Found(i, s) => {
                table[i].set(-1 - s);
                taken.push(i);
                words[rows.words_at((s - 1) as usize)?] += 1;
                i64::from(s) - 1
            }
            Probe::Marked => AGAIN,
            Probe::Absent => ABSENT,
        };
        handles.extend_from_slice(&handle.to_ne_bytes());
        Ok(())
    };
    let table_of = (&tags, &checks, &ids, width, long, seed);
    let slot = |i: usize| table[i].get();
    walk(py, mids, (slot, table.len()), table_of, None, true, each)?;
    // Marks, and ids in `long`, are read by the walk until it ends.
    for i in taken {
        let h = -2 - i64::from(table[i].get());
        table[i].set(DELETED);
        if !long.is_empty() && long.contains(h)? {
            long.del_item(h)?;
        }
    }
    Ok((PyBytes::new(py, &handles), words))
}

/// Rows placed at once past which `place_slots` hashes their ids with the GIL released:
/// a rebuild of a million ids hashes for a fifth of a second, which every other thread
/// of the node (the event loop's Raft applies and leases) would otherwise wait out.
/// Below it, the hashing takes a few ms at most, less than another thread may hold the
/// GIL before it is taken back.
const HASH_FREE_MIN: usize = 16_384;

/// The ids of `handles` copied out of the column (`width` bytes each, NUL-padded) and
/// `long` (those it holds as a digest, by position in `handles`), for hashing without
/// the GIL.
struct Copied {
    keys: Vec<u8>,
    long: Vec<(usize, Vec<u8>)>,
    width: usize,
}

impl Copied {
    fn of(rows: &Rows<'_, '_>, handles: &[usize]) -> PyResult<Self> {
        let width = rows.width;
        let mut keys = vec![0u8; handles.len() * width];
        let mut long = Vec::new();
        for (k, (&handle, to)) in handles.iter().zip(keys.chunks_exact_mut(width)).enumerate() {
            if let Some(mid) = rows.long_id(handle)? {
                long.push((k, mid.to_str()?.as_bytes().to_vec()));
            } else {
                for (to, from) in to.iter_mut().zip(&rows.column[handle * width..]) {
                    *to = from.get();
                }
            }
        }
        Ok(Copied { keys, long, width })
    }

    /// Each id's mix with `seed`: its position under `mask`, its tag, and its check
    /// word. A freed handle's digest, which a rebuild may meet, need not be UTF-8:
    /// hashed as bytes, it only places a slot that the rebuild then deletes.
    fn starts(&self, seed: u64, mask: usize) -> Vec<(usize, u8, u64)> {
        let mut long = self.long.iter().peekable();
        self.keys
            .chunks_exact(self.width)
            .enumerate()
            .map(|(k, key)| {
                let raw = match long.next_if(|(at, _)| *at == k) {
                    Some((_, mid)) => mid.as_slice(),
                    None => unpadded(key),
                };
                start_of(mh(raw), seed, mask)
            })
            .collect()
    }
}

/// Index `handles` (stored in the column: `width` bytes each, or in `long`) in `slots`
/// and `tags`: each into the first empty slot from its position, in order, as
/// `find_slots` walks; and write each one's check word (`check_of` its mh) into
/// `checks`, by handle, which confirms it to a look-up by mh. Each row's mh is `mhs`'s
/// (packed, in the order of `handles`) if given, as an insert of ids hashed for their
/// look-up gives them; else its id is hashed again, with the GIL released for a batch
/// of HASH_FREE_MIN or more (over a copy of the ids), as a rebuild does. Positions are
/// computed for all first and their slots read in a pass of independent loads, as in
/// `find_slots`; a table too full to take them all is an error (the caller sizes it).
#[pyfunction]
#[pyo3(signature = (slots, tags, checks, ids, width, long, seed, handles, mhs = None))]
#[allow(clippy::too_many_arguments)]
pub fn place_slots(
    py: Python<'_>,
    slots: PyBuffer<i32>,
    tags: PyBuffer<u8>,
    checks: PyBuffer<u64>,
    ids: PyBuffer<u8>,
    width: usize,
    long: &Bound<'_, PyDict>,
    seed: u64,
    handles: PyBuffer<i64>,
    mhs: Option<&Bound<'_, PyBytes>>,
) -> PyResult<()> {
    let table = slots
        .as_mut_slice(py)
        .ok_or_else(|| PyValueError::new_err("the id table is not writable and contiguous"))?;
    let tags = tags
        .as_mut_slice(py)
        .ok_or_else(|| PyValueError::new_err("the id table's tags are not writable"))?;
    let checks = checks
        .as_mut_slice(py)
        .ok_or_else(|| PyValueError::new_err("the id table's checks are not writable"))?;
    let column = slice(py, &ids, "id")?;
    let handles = slice(py, &handles, "handle")?;
    let mask = mask_of(table.len(), tags.len(), width)?;
    let n = rows_of(column.len(), width, checks.len())?;
    let rows = Rows {
        column,
        width,
        long,
        checks: &[], // read for ids only: placing writes the checks, reads none
    };
    let placed = handles
        .iter()
        .map(|h| {
            let h = h.get();
            usize::try_from(h)
                .ok()
                .filter(|&h| h < i32::MAX as usize && h < n)
                .ok_or_else(|| PyValueError::new_err(format!("no handle {h} in the id column")))
        })
        .collect::<PyResult<Vec<usize>>>()?;
    let starts: Vec<(usize, u8, u64)> = match mhs {
        Some(mhs) => {
            let given = handles_in(mhs.as_bytes())?;
            if given.len() != placed.len() {
                return Err(PyValueError::new_err(format!(
                    "{} message handles for {} rows",
                    given.len(),
                    placed.len()
                )));
            }
            given
                .into_iter()
                .map(|handle| start_of(handle, seed, mask))
                .collect()
        }
        None => {
            let copied = Copied::of(&rows, &placed)?;
            if placed.len() >= HASH_FREE_MIN {
                py.allow_threads(|| copied.starts(seed, mask))
            } else {
                copied.starts(seed, mask)
            }
        }
    };
    let mut touched = 0i32;
    for &(i, _, _) in &starts {
        touched ^= table[i].get();
    }
    std::hint::black_box(touched);
    for (&h, &(start, tag, check)) in placed.iter().zip(&starts) {
        let mut i = start;
        let mut probes = 0;
        while table[i].get() != EMPTY {
            probes += 1;
            if probes >= table.len() {
                return Err(PyValueError::new_err("the id table has no empty slot left"));
            }
            i = (i + 1) & mask;
        }
        table[i].set(h as i32 + 1);
        tags[i].set(tag);
        checks[h].set(check);
    }
    Ok(())
}

/// An Arrow string column's buffers: value offsets, data, validity bitmap; and its
/// null count.
type ArrowColumn<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    usize,
);

/// The Arrow string column of the ids at `rows` (handles, -1 where there is none: a
/// null there), as (value offsets, int32; data; validity bitmap; null count), each
/// buffer as bytes in native order: the column's `width` bytes at each row without
/// their NUL padding, or the id `long` holds whole for a row the column holds as a
/// digest. The leader's checkpoint names its events so (`IdTable.arrow_ids`), with no
/// str per id: decoding each into a str, then Arrow copying it back, cost more than
/// finding it.
#[pyfunction]
pub fn arrow_ids<'py>(
    py: Python<'py>,
    rows: PyBuffer<i64>,
    ids: PyBuffer<u8>,
    width: usize,
    long: &Bound<'py, PyDict>,
) -> PyResult<ArrowColumn<'py>> {
    let rows = slice(py, &rows, "row")?;
    let column = slice(py, &ids, "id")?;
    let n = rows.len();
    let mut offsets: Vec<u8> = Vec::with_capacity(4 * (n + 1));
    offsets.extend_from_slice(&0i32.to_ne_bytes());
    let mut data: Vec<u8> = Vec::with_capacity(n * width);
    let mut valid = vec![0u8; n.div_ceil(8)];
    let mut nulls = 0;
    for (i, row) in rows.iter().enumerate() {
        let row = row.get();
        if row < 0 {
            nulls += 1;
        } else {
            valid[i / 8] |= 1 << (i % 8);
            let h = row as usize;
            let whole = if long.is_empty() {
                None
            } else {
                long.get_item(h)?
            };
            match whole {
                Some(mid) => {
                    data.extend_from_slice(mid.downcast::<PyString>()?.to_str()?.as_bytes())
                }
                None => {
                    let key = column.get(h * width..(h + 1) * width).ok_or_else(|| {
                        PyIndexError::new_err(format!("no handle {h} in the id column"))
                    })?;
                    let len = key.iter().rposition(|b| b.get() != 0).map_or(0, |k| k + 1);
                    data.extend(key[..len].iter().map(ReadOnlyCell::get));
                }
            }
        }
        let end = i32::try_from(data.len())
            .map_err(|_| PyValueError::new_err("ids past an Arrow string column's 2 GiB"))?;
        offsets.extend_from_slice(&end.to_ne_bytes());
    }
    Ok((
        PyBytes::new(py, &offsets),
        PyBytes::new(py, &data),
        PyBytes::new(py, &valid),
        nulls,
    ))
}

/// The column's `width` bytes at handle `h`, NUL-padded as it holds them.
pub(crate) fn column_key(
    column: &[ReadOnlyCell<u8>],
    h: usize,
    width: usize,
) -> PyResult<[u8; WIDEST]> {
    let key = column
        .get(h * width..(h + 1) * width)
        .ok_or_else(|| PyIndexError::new_err(format!("no handle {h} in the id column")))?;
    let mut raw = [0u8; WIDEST];
    for (to, from) in raw.iter_mut().zip(key) {
        *to = from.get();
    }
    Ok(raw)
}
