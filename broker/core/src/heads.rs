//! Heads read back from the head store (`broker/storage/head_store.py`) for a lease's
//! picks: no Python object but the heads themselves.
//!
//! A segment is a file of heads, each followed by a NUL byte, and `ends[i]` is where
//! head i's NUL ends. A bucket's heads lie in its sort order, so a lease's picks are a
//! few runs of nearby positions: each run is one `pread`, split here.
//!
//! A lease's pick (`Order.pick_heads`) reads short runs through a `HeadCache` of the
//! segments' blocks: at batch 1 each lease reads one head of ~150 bytes, the one after
//! the last its bucket's lease read, and a `pread` of it, a system call, costs the
//! leader more than copying it out of a block read for an earlier lease.

use std::collections::HashMap;
use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;

use foldhash::fast::RandomState;
use pyo3::buffer::{PyBuffer, ReadOnlyCell};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::order::{slice, HANDLE_MASK};

/// The row sort key and head of each token's row, in the order of `tokens`.
///
/// `sort_key`, `segment` and `position` are the row store's columns (by handle, a
/// token's low 32 bits), `segments` its segments by number (`Segment`: `file`, `ends`).
/// Wanted heads at most `span` positions apart are read as one range, through those
/// between them.
#[pyfunction]
pub fn read_heads<'py>(
    py: Python<'py>,
    tokens: PyBuffer<i64>,
    sort_key: PyBuffer<i64>,
    segment: PyBuffer<i32>,
    position: PyBuffer<i32>,
    segments: &Bound<'py, PyDict>,
    span: usize,
) -> PyResult<Vec<(i64, Bound<'py, PyBytes>)>> {
    let tokens: Vec<i64> = slice(py, &tokens, "tokens")?
        .iter()
        .map(|t| t.get())
        .collect();
    let mut heads: Vec<Option<Bound<'py, PyBytes>>> = vec![None; tokens.len()];
    let columns = columns(py, &sort_key, &segment, &position)?;
    let row_keys = gather(py, &tokens, columns, segments, span, None, |i, head| {
        heads[i] = Some(PyBytes::new(py, head));
    })?;
    Ok(row_keys
        .into_iter()
        .zip(heads)
        .map(|(key, head)| (key, head.expect("every wanted head is read")))
        .collect())
}

/// A lease's heads as three bytes objects rather than two Python objects a message:
/// the heads joined in the order of `tokens` (int64 bytes in native order, as
/// `Order.pick` gives them), where each ends in them (uint32), and their rows' sort
/// keys (int64), both little-endian as a lease command's columns are. Read as
/// `read_heads` reads them. With `sep`, each head is followed by it, and ends after
/// it: a compaction's heads, ready to append to a segment.
#[pyfunction]
#[pyo3(signature = (tokens, sort_key, segment, position, segments, span, sep=None))]
#[allow(clippy::too_many_arguments)]
pub fn read_joined_heads<'py>(
    py: Python<'py>,
    tokens: &[u8],
    sort_key: PyBuffer<i64>,
    segment: PyBuffer<i32>,
    position: PyBuffer<i32>,
    segments: &Bound<'py, PyDict>,
    span: usize,
    sep: Option<u8>,
) -> PyResult<JoinedHeads<'py>> {
    if !tokens.len().is_multiple_of(8) {
        return Err(PyValueError::new_err("tokens are int64 bytes"));
    }
    let tokens: Vec<i64> = tokens
        .chunks_exact(8)
        .map(|t| i64::from_ne_bytes(t.try_into().expect("chunks of 8")))
        .collect();
    let columns = columns(py, &sort_key, &segment, &position)?;
    joined_heads(py, &tokens, columns, segments, span, sep, None)
}

/// A lease's heads joined, where each ends (uint32) and their rows' sort keys (int64).
pub(crate) type JoinedHeads<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
);

/// The row store's sort_key, segment and position columns, by handle.
pub(crate) type HeadColumns<'a> = (
    &'a [ReadOnlyCell<i64>],
    &'a [ReadOnlyCell<i32>],
    &'a [ReadOnlyCell<i32>],
);

/// The columns a heads read takes, borrowed from their buffers.
pub(crate) fn columns<'a>(
    py: Python<'a>,
    sort_key: &'a PyBuffer<i64>,
    segment: &'a PyBuffer<i32>,
    position: &'a PyBuffer<i32>,
) -> PyResult<HeadColumns<'a>> {
    Ok((
        slice(py, sort_key, "sort_key")?,
        slice(py, segment, "segment")?,
        slice(py, position, "position")?,
    ))
}

/// `read_joined_heads` of `tokens`, its columns already borrowed (`Order.pick_heads`,
/// with its `cache`).
pub(crate) fn joined_heads<'py>(
    py: Python<'py>,
    tokens: &[i64],
    columns: HeadColumns<'_>,
    segments: &Bound<'py, PyDict>,
    span: usize,
    sep: Option<u8>,
    cache: Option<&mut HeadCache>,
) -> PyResult<JoinedHeads<'py>> {
    // Read segment by segment: staged, then laid out in the order of `tokens`.
    let mut staged = Vec::new();
    let mut spans = vec![(0usize, 0usize); tokens.len()];
    let row_keys = gather(py, tokens, columns, segments, span, cache, |i, head| {
        spans[i] = (staged.len(), head.len());
        staged.extend_from_slice(head);
    })?;
    let mut joined = Vec::with_capacity(staged.len());
    let mut ends = Vec::with_capacity(4 * tokens.len());
    for &(from, len) in &spans {
        joined.extend_from_slice(&staged[from..from + len]);
        joined.extend(sep);
        let end = u32::try_from(joined.len())
            .map_err(|_| PyValueError::new_err("a lease's heads are past 4 GiB"))?;
        ends.extend_from_slice(&end.to_le_bytes());
    }
    let keys: Vec<u8> = row_keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    Ok((
        PyBytes::new(py, &joined),
        PyBytes::new(py, &ends),
        PyBytes::new(py, &keys),
    ))
}

/// Each token's head handed to `found` (its place in `tokens`, its bytes), segment by
/// segment; returns the row sort keys, in the order of `tokens`.
fn gather<'py>(
    py: Python<'py>,
    tokens: &[i64],
    (keys, numbers, positions): HeadColumns<'_>,
    segments: &Bound<'py, PyDict>,
    span: usize,
    mut cache: Option<&mut HeadCache>,
    mut found: impl FnMut(usize, &[u8]),
) -> PyResult<Vec<i64>> {
    // (segment, position, where in `tokens`), sorted: each segment's wanted heads in order.
    let mut wanted = Vec::with_capacity(tokens.len());
    let mut row_keys = Vec::with_capacity(tokens.len());
    for (i, &token) in tokens.iter().enumerate() {
        let h = (token & HANDLE_MASK) as usize;
        let (Some(k), Some(n), Some(p)) = (keys.get(h), numbers.get(h), positions.get(h)) else {
            return Err(PyIndexError::new_err(format!("no row at handle {h}")));
        };
        wanted.push((n.get(), p.get() as usize, i));
        row_keys.push(k.get());
    }
    wanted.sort_unstable();
    for group in wanted.chunk_by(|a, b| a.0 == b.0) {
        let seg = segments
            .get_item(group[0].0)?
            .ok_or_else(|| PyValueError::new_err(format!("no head segment {}", group[0].0)))?;
        let fd: i32 = seg.getattr(intern!(py, "fd"))?.extract()?;
        let ends = PyBuffer::<u32>::get(&seg.getattr(intern!(py, "ends"))?)?;
        let ends = slice(py, &ends, "ends")?;
        // A segment's file stays open while a row names it; the caller holds the lock
        // that keeps it so. Borrowed, never closed here.
        let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        let mut first = 0;
        for k in 1..=group.len() {
            let split = k == group.len()
                || group[k].1 - group[k - 1].1 > span
                || extent(ends, group[first].1, group[k].1)? > RUN_BYTES_MAX;
            if split {
                let run = &group[first..k];
                read_run(&file, ends, run, cache.as_deref_mut(), &mut found)?;
                first = k;
            }
        }
    }
    Ok(row_keys)
}

/// The most bytes one `pread` takes: a wide `span` (a compaction's) reads through many
/// unwanted heads, and a run as long as a segment would be a buffer as large.
const RUN_BYTES_MAX: usize = 1 << 20;

/// Where head `pos` ends, its separator included.
fn end_of(ends: &[ReadOnlyCell<u32>], pos: usize) -> PyResult<usize> {
    ends.get(pos)
        .map(|e| e.get() as usize)
        .ok_or_else(|| PyIndexError::new_err(format!("no head at position {pos}")))
}

/// Where head `pos` starts: where the one before it ends.
fn start_of(ends: &[ReadOnlyCell<u32>], pos: usize) -> PyResult<usize> {
    if pos == 0 {
        Ok(0)
    } else {
        end_of(ends, pos - 1)
    }
}

/// The bytes from head `first`'s start to head `last`'s end.
fn extent(ends: &[ReadOnlyCell<u32>], first: usize, last: usize) -> PyResult<usize> {
    Ok(end_of(ends, last)?.saturating_sub(start_of(ends, first)?))
}

/// One range of a segment, first to last wanted position: read (through `cache` if it
/// is short), and each wanted head cut out of it and handed to `found`.
fn read_run(
    file: &File,
    ends: &[ReadOnlyCell<u32>],
    run: &[(i32, usize, usize)],
    cache: Option<&mut HeadCache>,
    found: &mut impl FnMut(usize, &[u8]),
) -> PyResult<()> {
    let (first, last) = (run[0].1, run[run.len() - 1].1);
    let start = start_of(ends, first)?;
    let end = end_of(ends, last)?;
    if end < start {
        return Err(PyValueError::new_err(format!(
            "the ends are out of order at {last}"
        )));
    }
    let number = run[0].0;
    let mut cache = cache.filter(|_| end - start <= BLOCK);
    let hit = match cache.as_deref_mut() {
        Some(cache) => cache.read(file, number, start, end)?,
        None => None,
    };
    let from_cache = hit.is_some();
    let data = match hit {
        Some(data) => data,
        None => read_range(file, start, end)?,
    };
    let mut heads = cut(ends, run, start, &data)?;
    let reread;
    if from_cache && heads.iter().any(|head| head.contains(&0)) {
        // A block read before a head in it was written holds zeros there (a head
        // holds no NUL): read again, from the file.
        if let Some(cache) = cache {
            cache.forget(number, start, end);
        }
        reread = read_range(file, start, end)?;
        heads = cut(ends, run, start, &reread)?;
    }
    for (&(_, _, i), head) in run.iter().zip(heads) {
        found(i, head);
    }
    Ok(())
}

/// Bytes `start..end` of a segment, from its file.
fn read_range(file: &File, start: usize, end: usize) -> PyResult<Vec<u8>> {
    let mut data = vec![0u8; end - start];
    file.read_exact_at(&mut data, start as u64)?;
    Ok(data)
}

/// Each wanted head of `run`, cut out of `data` (the segment's bytes from `start`).
fn cut<'d>(
    ends: &[ReadOnlyCell<u32>],
    run: &[(i32, usize, usize)],
    start: usize,
    data: &'d [u8],
) -> PyResult<Vec<&'d [u8]>> {
    run.iter()
        .map(|&(_, pos, _)| {
            let (from, to) = (
                start_of(ends, pos)?.checked_sub(start),
                end_of(ends, pos)?.checked_sub(start),
            );
            from.zip(to)
                .and_then(|(from, to)| data.get(from..to.checked_sub(1)?))
                .ok_or_else(|| PyValueError::new_err(format!("the ends are out of order at {pos}")))
        })
        .collect()
}

/// Bytes of a segment the cache reads and keeps at once, at offsets a multiple of it.
const BLOCK: usize = 4096;
/// Blocks kept: 1 MiB, a block for each of 256 buckets leased one message at a time.
/// Emptied when full, and whenever the index lets its columns go.
const CACHE_BLOCKS: usize = 256;

/// Blocks of head segments as last read, by (segment number, block). A segment's bytes
/// are written once, after its end, and its number is not taken again before the index
/// empties this cache (`release_columns`, then `HeadStore.recycle`), so a block stays
/// true but where it was read before a head in it was written: `read_run` checks.
#[derive(Default)]
pub(crate) struct HeadCache {
    blocks: HashMap<(i32, usize), Vec<u8>, RandomState>,
}

impl HeadCache {
    /// Bytes `start..end` of segment `number` (open as `file`), or None if the file
    /// ends before `end`.
    fn read(
        &mut self,
        file: &File,
        number: i32,
        start: usize,
        end: usize,
    ) -> PyResult<Option<Vec<u8>>> {
        let mut out = Vec::with_capacity(end - start);
        for b in start / BLOCK..=(end.max(start + 1) - 1) / BLOCK {
            let (lo, hi) = (start.max(b * BLOCK), end.min((b + 1) * BLOCK));
            let held = self.blocks.get(&(number, b));
            let block = match held {
                Some(block) if block.len() >= hi - b * BLOCK => block,
                _ => {
                    let block = read_block(file, b)?;
                    if self.blocks.len() >= CACHE_BLOCKS {
                        self.blocks.clear();
                    }
                    self.blocks
                        .entry((number, b))
                        .insert_entry(block)
                        .into_mut()
                }
            };
            match block.get(lo - b * BLOCK..hi - b * BLOCK) {
                Some(bytes) => out.extend_from_slice(bytes),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    /// Drop the blocks holding bytes `start..end` of segment `number`.
    fn forget(&mut self, number: i32, start: usize, end: usize) {
        for b in start / BLOCK..=(end.max(start + 1) - 1) / BLOCK {
            self.blocks.remove(&(number, b));
        }
    }

    pub(crate) fn clear(&mut self) {
        self.blocks = HashMap::default();
    }
}

/// Block `b` of a segment: fewer bytes where the file ends within it.
fn read_block(file: &File, b: usize) -> PyResult<Vec<u8>> {
    let mut block = vec![0u8; BLOCK];
    let mut got = 0;
    while got < BLOCK {
        match file.read_at(&mut block[got..], (b * BLOCK + got) as u64)? {
            0 => break,
            n => got += n,
        }
    }
    block.truncate(got);
    Ok(block)
}
