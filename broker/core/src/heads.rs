//! Heads read back from the head store (`broker/storage/head_store.py`) for a lease's
//! picks: no Python object but the heads themselves.
//!
//! A segment is a file of heads, each followed by a NUL byte, and `ends[i]` is where
//! head i's NUL ends. A bucket's heads lie in its sort order, so a lease's picks are a
//! few runs of nearby positions: each run is one `pread`, split here.

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;

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
    let row_keys = gather(py, &tokens, columns, segments, span, |i, head| {
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
    joined_heads(py, &tokens, columns, segments, span, sep)
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

/// `read_joined_heads` of `tokens`, its columns already borrowed (`Order.pick_heads`).
pub(crate) fn joined_heads<'py>(
    py: Python<'py>,
    tokens: &[i64],
    columns: HeadColumns<'_>,
    segments: &Bound<'py, PyDict>,
    span: usize,
    sep: Option<u8>,
) -> PyResult<JoinedHeads<'py>> {
    // Read segment by segment: staged, then laid out in the order of `tokens`.
    let mut staged = Vec::new();
    let mut spans = vec![(0usize, 0usize); tokens.len()];
    let row_keys = gather(py, tokens, columns, segments, span, |i, head| {
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
                read_run(&file, ends, &group[first..k], &mut found)?;
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

/// One range of a segment, first to last wanted position: read, and each wanted head
/// cut out of it and handed to `found`.
fn read_run(
    file: &File,
    ends: &[ReadOnlyCell<u32>],
    run: &[(i32, usize, usize)],
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
    let mut data = vec![0u8; end - start];
    file.read_exact_at(&mut data, start as u64)?;
    for &(_, pos, i) in run {
        let (from, to) = (
            start_of(ends, pos)?.checked_sub(start),
            end_of(ends, pos)?.checked_sub(start),
        );
        let head = from
            .zip(to)
            .and_then(|(from, to)| data.get(from..to.checked_sub(1)?));
        let Some(head) = head else {
            return Err(PyValueError::new_err(format!(
                "the ends are out of order at {pos}"
            )));
        };
        found(i, head);
    }
    Ok(())
}
