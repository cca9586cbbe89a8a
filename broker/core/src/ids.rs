//! Look-ups in the index's id table (`broker/storage/id_table.py`): each id's slot, found
//! by the same hash and linear probing as the table was built with, without making an
//! array or a bytes object per id; ids deleted in the walk that finds them; and an id
//! read back from the column by its handle.

use pyo3::buffer::{PyBuffer, ReadOnlyCell};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::lease_table::{id_strs, raw_ids};
use crate::order::slice;
use crate::packed_ids::unpadded;

/// The longest id the column holds whole (`id_table.WIDEST`).
pub(crate) const WIDEST: usize = 64;
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;
const FMIX: [u64; 2] = [0xFF51_AFD7_ED55_8CCD, 0xC4CE_B9FE_1A85_EC53];
const EMPTY: i32 = 0;
const DELETED: i32 = -1;
/// `take_slots`: an id not stored, and one its call named before.
const ABSENT: i64 = -1;
const AGAIN: i64 = -3;
/// An id the caller must look up itself: one the column holds as a digest.
const ASK: i64 = -2;
/// Ids whose first slots and column entries a walk loads ahead of walking them.
const CHUNK: usize = 1024;

/// The position of an id padded with NUL bytes to `width` (a multiple of 8), as
/// `id_table._positions` computes it for a column: hashed word by word, then mixed.
fn hash(raw: &[u8], width: usize, seed: u64) -> u64 {
    let mut h = seed;
    for start in (0..width).step_by(8) {
        let mut word = [0u8; 8];
        if start < raw.len() {
            let end = raw.len().min(start + 8);
            word[..end - start].copy_from_slice(&raw[start..end]);
        }
        h ^= u64::from_le_bytes(word);
        h = h.wrapping_mul(MIX);
    }
    for c in FMIX {
        h ^= h >> 33;
        h = h.wrapping_mul(c);
    }
    (h ^ (h >> 33)) >> 1
}

/// The mask of a table of `len` slots over a column `width` bytes wide: a power of two
/// and a multiple of 8 up to WIDEST, or the caller passed something else.
fn mask_of(len: usize, width: usize) -> PyResult<usize> {
    if len == 0
        || !len.is_power_of_two()
        || width == 0
        || width > WIDEST
        || !width.is_multiple_of(8)
    {
        return Err(PyValueError::new_err(
            "the table's size must be a power of two and the width a multiple of 8 up to 64",
        ));
    }
    Ok(len - 1)
}

/// Whether the column's `width` bytes at `handle` hold `raw`, NUL-padded.
fn holds(ids: &[ReadOnlyCell<u8>], handle: usize, width: usize, raw: &[u8]) -> bool {
    let Some(key) = ids.get(handle * width..(handle + 1) * width) else {
        return false;
    };
    key[..raw.len()].iter().zip(raw).all(|(a, b)| a.get() == *b)
        && key[raw.len()..].iter().all(|a| a.get() == 0)
}

/// Each id's first slot in a table of `mask + 1` slots over a column `width` bytes wide,
/// or its answer if it is not walked: ASK for one the column would hold as a digest,
/// ABSENT for one longer than the column.
fn starts_of(chunk: &[&[u8]], width: usize, seed: u64, mask: usize) -> Vec<Result<usize, i64>> {
    chunk
        .iter()
        .map(|raw| {
            if raw.len() > WIDEST || raw.last() == Some(&0) {
                Err(ASK)
            } else if raw.len() > width {
                Err(ABSENT)
            } else {
                Ok((hash(raw, width, seed) as usize) & mask)
            }
        })
        .collect()
}

/// Reads the first slots of `starts` (`slot` reads one), and the column at their
/// handles, in passes of independent loads. A table of a million ids misses the cache
/// at almost every probe: loaded this way the CPU overlaps those misses, instead of
/// waiting each one out in turn as the walk would. Called a CHUNK of ids at a time:
/// over a whole trim's ids (tens of thousands), the lines the passes brought in were
/// gone again before the walk used them.
fn preload(
    slot: impl Fn(usize) -> i32,
    column: &[ReadOnlyCell<u8>],
    starts: &[Result<usize, i64>],
    width: usize,
) {
    let firsts: Vec<i32> = starts
        .iter()
        .map(|start| start.map_or(EMPTY, &slot))
        .collect();
    let mut touched = 0u8;
    for &s in &firsts {
        if let Some(byte) = column.get((s.max(1) - 1) as usize * width) {
            touched ^= byte.get();
        }
    }
    std::hint::black_box(touched);
}

/// What a walk from an id's first slot met: the slot holding it and its value (the
/// handle + 1), a slot `take_slots` marked for it earlier in its call, or an empty slot.
enum Probe {
    Found(usize, i32),
    Marked,
    Absent,
}

/// Walks a table of `len` slots (`slot` reads one) from `start` until a slot holds `raw`
/// in the column, or a slot is empty, or every slot was read. A slot below DELETED is one
/// `take_slots` marked in this call, holding its handle `h` as `-(h + 2)`; no other walk
/// meets one, since `take_slots` leaves no marks behind.
fn probe(
    slot: impl Fn(usize) -> i32,
    len: usize,
    column: &[ReadOnlyCell<u8>],
    width: usize,
    raw: &[u8],
    start: usize,
) -> Probe {
    let mut i = start;
    for _ in 0..len {
        let s = slot(i);
        if s == EMPTY {
            return Probe::Absent;
        }
        if s > 0 && holds(column, (s - 1) as usize, width, raw) {
            return Probe::Found(i, s);
        }
        if s < DELETED && holds(column, (-2 - i64::from(s)) as usize, width, raw) {
            return Probe::Marked;
        }
        i = (i + 1) & (len - 1);
    }
    Probe::Absent
}

/// The slot of each id in `mids` (str, or `PackedIds`) (-1: not stored; -2: held as a
/// digest, for the caller to look up), and its handle (-1 unless found), as two int64
/// bytes: the walk has read the slot, so the caller does not read the table again.
/// `slots` is the table (a handle + 1 per used slot, -1 deleted), `ids` the column's
/// bytes (`width` per handle) and `seed` the hash's. For a table that holds no id as a
/// digest.
#[pyfunction]
pub fn find_slots<'py>(
    py: Python<'py>,
    mids: &Bound<'py, PyAny>,
    slots: PyBuffer<i32>,
    ids: PyBuffer<u8>,
    width: usize,
    seed: u64,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let table = slice(py, &slots, "id table's")?;
    let column = slice(py, &ids, "id")?;
    let mask = mask_of(table.len(), width)?;
    let strs = id_strs(mids)?;
    let raws = raw_ids(py, mids, &strs)?;
    let mut found: Vec<u8> = Vec::with_capacity(raws.len() * 8);
    let mut handles: Vec<u8> = Vec::with_capacity(raws.len() * 8);
    let at = |i: usize| table[i].get();
    for chunk in raws.chunks(CHUNK) {
        let starts = starts_of(chunk, width, seed, mask);
        preload(at, column, &starts, width);
        for (raw, start) in chunk.iter().zip(&starts) {
            let (slot, handle) =
                match start.map(|start| probe(at, table.len(), column, width, raw, start)) {
                    Err(answer) => (answer, -1),
                    Ok(Probe::Found(slot, s)) => (slot as i64, i64::from(s) - 1),
                    Ok(Probe::Marked | Probe::Absent) => (-1, -1),
                };
            found.extend_from_slice(&slot.to_ne_bytes());
            handles.extend_from_slice(&handle.to_ne_bytes());
        }
    }
    Ok((PyBytes::new(py, &found), PyBytes::new(py, &handles)))
}

/// Deletes the ids in `mids` (str, or `PackedIds`) from the table, in the one walk that
/// finds them: the handle of each (int64 bytes), ABSENT where it is not stored, AGAIN
/// where `mids` named it earlier; and how many of the ids deleted need each count of
/// the column's 8-byte words (index 1..=WIDEST / 8), for the caller's tally. Each node
/// forgets a trim's ids this way: finding them, then emptying their slots, would read
/// every slot and the column at it twice. Arguments as `find_slots`'s, the table
/// writable; for a table that holds no id as a digest (an id it would hold as one is
/// ABSENT).
///
/// A slot found is marked with its handle `h` as `-(h + 2)` until the walk ends, so that
/// a later id of the same message is told apart from one never stored; then every mark
/// becomes a deleted slot.
#[pyfunction]
pub fn take_slots<'py>(
    py: Python<'py>,
    mids: &Bound<'py, PyAny>,
    slots: PyBuffer<i32>,
    ids: PyBuffer<u8>,
    width: usize,
    seed: u64,
) -> PyResult<(Bound<'py, PyBytes>, Vec<i64>)> {
    let table = slots
        .as_mut_slice(py)
        .ok_or_else(|| PyValueError::new_err("the id table is not writable and contiguous"))?;
    let column = slice(py, &ids, "id")?;
    let mask = mask_of(table.len(), width)?;
    let strs = id_strs(mids)?;
    let raws = raw_ids(py, mids, &strs)?;
    let mut handles: Vec<u8> = Vec::with_capacity(raws.len() * 8);
    let mut taken: Vec<usize> = Vec::with_capacity(raws.len());
    let mut words = vec![0i64; WIDEST / 8 + 1];
    let at = |i: usize| table[i].get();
    for chunk in raws.chunks(CHUNK) {
        let starts = starts_of(chunk, width, seed, mask);
        preload(at, column, &starts, width);
        for (raw, start) in chunk.iter().zip(&starts) {
            let handle = match start.map(|start| probe(at, table.len(), column, width, raw, start))
            {
                Ok(Probe::Found(i, s)) => {
                    table[i].set(-1 - s);
                    taken.push(i);
                    words[raw.len().div_ceil(8).max(1)] += 1;
                    i64::from(s) - 1
                }
                Ok(Probe::Marked) => AGAIN,
                Ok(Probe::Absent) | Err(_) => ABSENT,
            };
            handles.extend_from_slice(&handle.to_ne_bytes());
        }
    }
    for i in taken {
        table[i].set(DELETED);
    }
    Ok((PyBytes::new(py, &handles), words))
}

/// Index `handles` (stored in the column: `width` bytes each) in `slots`: each into the
/// first empty slot from its id's position, in order, as `find_slots` walks. Positions
/// are computed for all first and their slots read in a pass of independent loads, as
/// in `find_slots`; a table too full to take them all is an error (the caller sizes it).
#[pyfunction]
pub fn place_slots(
    py: Python<'_>,
    slots: PyBuffer<i32>,
    ids: PyBuffer<u8>,
    width: usize,
    seed: u64,
    handles: PyBuffer<i64>,
) -> PyResult<()> {
    let table = slots
        .as_mut_slice(py)
        .ok_or_else(|| PyValueError::new_err("the id table is not writable and contiguous"))?;
    let column = slice(py, &ids, "id")?;
    let handles = slice(py, &handles, "handle")?;
    let mask = mask_of(table.len(), width)?;
    let mut starts = Vec::with_capacity(handles.len());
    for h in handles {
        let h = h.get();
        let key = usize::try_from(h)
            .ok()
            .and_then(|h| column.get(h * width..(h + 1) * width))
            .filter(|_| h < i64::from(i32::MAX))
            .ok_or_else(|| PyValueError::new_err(format!("no handle {h} in the id column")))?;
        let mut raw = [0u8; WIDEST];
        for (to, from) in raw.iter_mut().zip(key) {
            *to = from.get();
        }
        starts.push((hash(&raw[..width], width, seed) as usize) & mask);
    }
    let mut touched = 0i32;
    for &i in &starts {
        touched ^= table[i].get();
    }
    std::hint::black_box(touched);
    for (h, &start) in handles.iter().zip(&starts) {
        let mut i = start;
        let mut probes = 0;
        while table[i].get() != EMPTY {
            probes += 1;
            if probes >= table.len() {
                return Err(PyValueError::new_err("the id table has no empty slot left"));
            }
            i = (i + 1) & mask;
        }
        table[i].set(h.get() as i32 + 1);
    }
    Ok(())
}

/// The id at handle `h`: from `long` if the column holds it as a digest, else the
/// column's `width` bytes at `h`, without their NUL padding.
pub(crate) fn id_of<'py>(
    py: Python<'py>,
    h: usize,
    column: &[ReadOnlyCell<u8>],
    width: usize,
    long: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyString>> {
    if !long.is_empty() {
        if let Some(mid) = long.get_item(h)? {
            return Ok(mid.downcast_into::<PyString>()?);
        }
    }
    key_str(py, h, &column_key(column, h, width)?[..width])
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

/// The id the column holds at handle `h` as `key`, its bytes there, as a str.
pub(crate) fn key_str<'py>(
    py: Python<'py>,
    h: usize,
    key: &[u8],
) -> PyResult<Bound<'py, PyString>> {
    let mid = std::str::from_utf8(unpadded(key))
        .map_err(|_| PyValueError::new_err(format!("the id at handle {h} is not UTF-8")))?;
    Ok(PyString::new(py, mid))
}
