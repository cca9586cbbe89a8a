"""A Structured Streaming checkpoint's offsets log, read without Spark.

Spark writes `offsets/<batch>` before it runs a batch (where it planned each source to
end it) and `commits/<batch>` once the batch is done. The ingest reads a batch's range
from it (`pipelines.ingest_resume.planned`), `dejaq status` the last committed batch's
to count what is not ingested yet: one reader, so both read the same layout or refuse it
by the same name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs

from dejaq.conf.storage import filesystem


def folder(checkpoint: str) -> tuple[pafs.FileSystem, str]:
    """The checkpoint's filesystem and folder in it: a URI as it is, a path made
    absolute."""
    return filesystem(checkpoint if "://" in checkpoint else str(Path(checkpoint).resolve()))


def batches(fs: pafs.FileSystem, root: str, log: str = "offsets") -> set[int]:
    """The batches with an entry in the checkpoint's `log`: `offsets` (planned) or
    `commits` (done)."""
    found = fs.get_file_info(pafs.FileSelector(f"{root}/{log}", allow_not_found=True))
    return {int(f.base_name) for f in found if f.base_name.isdigit()}


def entry(fs: pafs.FileSystem, root: str, batch_id: int) -> dict[str, dict[str, int]]:
    """Where Spark planned batch `batch_id` to end, per Kafka topic and partition (a
    str, as Spark writes it). Raises ValueError for an entry of another layout than this
    reads, rather than misread a batch's range."""
    path = f"{root}/offsets/{batch_id}"
    with fs.open_input_stream(path) as f:
        lines = f.read().decode().splitlines()
    # A version line, the batch's metadata, then a line per source: the query's one, Kafka.
    if len(lines) != 3 or lines[0] != "v1":
        raise ValueError(
            f"{path} is not an offsets log entry of the layout this ingest reads (v1, the "
            f"batch's metadata, one source's offsets): {len(lines)} lines, the first "
            f"{lines[0] if lines else ''!r}"
        )
    return json.loads(lines[2])


def last_committed(checkpoint: str) -> dict[str, dict[str, int]]:
    """`entry` of the checkpoint's last committed batch; none before its first."""
    fs, root = folder(checkpoint)
    committed = batches(fs, root, "offsets") & batches(fs, root, "commits")
    return entry(fs, root, max(committed)) if committed else {}
