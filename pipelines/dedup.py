"""Producer-set message ids, deduplicated on the driver: first wins, within a window.

Only explicit ids (a `dejaq-id` header or a mapped JSON field) can repeat: a default id
is the record's own Kafka coordinates. Joining every micro-batch with the ids in the
buffer table costs a scan of the whole window per batch, growing with the table; this
index costs a dict lookup per explicit id. It is seeded when the job starts from the
buffer's rows, and from the ledger's events within `dedup_window_ms` (a settled message
leaves the buffer after `settled_retention_ms`, but its id stays taken), and learns a
batch's ids only once the batch is committed, so a restart or a failed batch forgets
nothing and invents nothing.

An id stays taken past the window while its row is in the buffer (a reminder due in a
month, a backlog): the broker's index and the release job know a message by its id, and
would take a second row of it for the first. Such ids linger until a look at the buffer
(`prune`) finds their rows gone: the ingest looks for those a batch reuses before
judging it, so a reused id is free as soon as its row has left, and for all of them now
and then, for memory. Memory: about 200 bytes per explicit id within `dedup_window_ms`
or in the buffer.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa

Coordinates = tuple[str, int, int]

IN_BATCH = "id seen earlier in the same batch"
IN_BUFFER = "id already in the buffer"
SETTLED = "id already settled"


def default_id_pattern(sources: list[str]) -> str:
    """A regular expression matching the default ids of records from `sources`:
    `<topic>-<partition>-<offset>`, the id a record without an explicit one gets, its
    numbers as Spark writes them (no leading zero), so an explicit id such as
    `orders-2024-0001` is not taken for one."""
    topics = "|".join(re.escape(t) for t in sources)
    number = r"(?:0|[1-9]\d*)"
    return rf"^(?:{topics})-{number}-{number}$"


@dataclass
class Verdict:
    """A batch's duplicates (coordinates → why) and the ids it adds once committed."""

    duplicates: dict[Coordinates, str] = field(default_factory=dict)
    kept: dict[str, Coordinates] = field(default_factory=dict)


class SeenIds:
    """Explicit ids stored within the window, with the coordinates that stored them
    (None: settled, seeded from the ledger, which does not keep them).

    A replayed batch finds its own ids with the same coordinates: not duplicates. Any
    record of an id seeded from the ledger is one: the ingest does not judge a batch
    the buffer already has (see `IngestJob.process_batch`).
    """

    def __init__(self, window_ms: int) -> None:
        self.window_ms = window_ms
        self._ids: dict[str, tuple[int, Coordinates | None]] = {}  # id -> (stored at ms, ...)
        self._expiry: deque[tuple[int, str]] = deque()  # (stored at ms, id), oldest first
        # Past the window, with a buffer row that may still be there: taken until `prune`.
        self.lingering: dict[str, Coordinates] = {}

    def __len__(self) -> int:
        return len(self._ids) + len(self.lingering)

    def load(self, rows: Iterable[tuple[str, str | None, int | None, int | None, int]]) -> None:
        """Seed from stored rows: (id, topic, partition, offset, at ms), the buffer's
        (at: ingested) and the ledger's (no coordinates; at: the event's).

        Each id expires a window after its earliest row and keeps the coordinates of its
        buffer row where it has one.
        """
        for mid, topic, partition, offset, at_ms in sorted(rows, key=lambda r: r[4]):
            here = None if topic is None else (topic, partition, offset)
            if mid not in self._ids:
                self._ids[mid] = (at_ms, here)
                self._expiry.append((at_ms, mid))
            elif self._ids[mid][1] is None:
                self._ids[mid] = (self._ids[mid][0], here)

    def check(self, batch: pa.Table, now_ms: int) -> Verdict:
        """Judge a batch's valid explicit-id rows at `now_ms` without changing the index.

        `batch` has message_id, source_topic, source_partition, source_offset and
        produced_at; within the batch the earliest Kafka timestamp wins, then the
        coordinates, as Kafka order does. An id settled before the window is free,
        though no commit has forgotten it yet (the input was idle), as a start would
        judge it.
        """
        verdict = Verdict()
        cutoff = now_ms - self.window_ms
        ordered = batch.sort_by(
            [
                ("produced_at", "ascending"),
                ("source_topic", "ascending"),
                ("source_partition", "ascending"),
                ("source_offset", "ascending"),
            ]
        )
        columns = [
            ordered.column(c).to_pylist()
            for c in ("message_id", "source_topic", "source_partition", "source_offset")
        ]
        for mid, *coordinates in zip(*columns, strict=True):
            here: Coordinates = tuple(coordinates)  # type: ignore[assignment]
            if mid in verdict.kept:
                verdict.duplicates[here] = IN_BATCH
                continue
            if mid in self._ids:
                at, stored = self._ids[mid]
                if stored is None and at <= cutoff:
                    stored = here
            else:
                stored = self.lingering.get(mid, here)
            if stored != here:
                verdict.duplicates[here] = IN_BUFFER if stored else SETTLED
            else:
                verdict.kept[mid] = here
        return verdict

    def expire(self, now_ms: int) -> None:
        """Forget the ids older than the window at `now_ms`; those with a buffer row
        linger. Time alone decides, so a batch may expire before it is judged: then the
        ids it reuses past their window are all in `lingering`, to be looked for."""
        cutoff = now_ms - self.window_ms
        while self._expiry and self._expiry[0][0] <= cutoff:
            _, mid = self._expiry.popleft()
            _, coordinates = self._ids.pop(mid)
            if coordinates is not None:
                self.lingering[mid] = coordinates

    def lingering_among(self, ids: Iterable[str]) -> dict[str, Coordinates]:
        """The lingering ones of `ids`, with their rows' coordinates: those a batch would
        find duplicates without a look at whether their rows are still in the buffer."""
        return {mid: self.lingering[mid] for mid in ids if mid in self.lingering}

    def commit(self, verdict: Verdict, now_ms: int) -> None:
        """Forget the ids older than the window (`expire`), then remember a committed
        batch's: in that order, so an id kept because its first had settled before the
        window is stored anew."""
        self.expire(now_ms)
        for mid, coordinates in verdict.kept.items():
            if mid not in self._ids and mid not in self.lingering:
                self._ids[mid] = (now_ms, coordinates)
                self._expiry.append((now_ms, mid))

    def prune(self, buffered: Iterable[str], among: Iterable[str] | None = None) -> int:
        """Free the lingering ids looked for (`among`, or all) whose rows are not among
        `buffered` (those of them the buffer holds); returns how many."""
        still = set(buffered)
        looked = self.lingering if among is None else self.lingering_among(among)
        gone = [mid for mid in looked if mid not in still]
        for mid in gone:
            del self.lingering[mid]
        return len(gone)
