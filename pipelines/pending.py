"""The messages a release job still has to write: buffer rows minus settled ledger events.

Held in the driver's memory and fed with the rows Delta gains (see DeltaFollower), so
choosing what to release costs a heap operation per message, not a Spark job per trigger.
Order is total: (sort_key, source partition, source offset, source topic, id).
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from dejaq.conf.tables import LedgerEvent, in_applied_order

# Ledger events after which a message is never written again.
SETTLED = frozenset(
    {LedgerEvent.RELEASED, LedgerEvent.CANCELLED, LedgerEvent.ACKED, LedgerEvent.DEAD}
)
# Stale heap entries (settled or moved messages) tolerated beyond the live ones.
HEAP_SLACK = 1024
# Buffer rows turned into messages at a time: a start's read of a large buffer says its
# progress per slice.
ROWS_AT_A_TIME = 50_000

Order = tuple[int, int, int, str, str]
Header = tuple[str, bytes | None]


@dataclass(slots=True)
class Message:
    """One buffer row, with the sort key in force (a reschedule replaces the buffer's).

    Held for every pending message, so kept small beside its payload: slots, headers as
    pairs (a dict each would cost ~230 bytes), the source topic's name shared."""

    message_id: str
    bucket: int
    sort_key: int
    key: bytes | None
    payload: bytes | None
    headers: tuple[Header, ...]
    source_topic: str
    source_partition: int
    source_offset: int
    rescheduled_at: int = -1  # epoch µs of the reschedule in force; -1: none

    @property
    def order(self) -> Order:
        return (
            self.sort_key,
            self.source_partition,
            self.source_offset,
            self.source_topic,
            self.message_id,
        )


@dataclass
class _Early:
    """Ledger state for an id whose buffer row is not here: settled, or a new sort key."""

    at: int  # epoch µs of the latest event applied
    settled: bool
    sort_key: int | None = None


class PendingSet:
    """Pending messages in release order, with ledger cancels and reschedules applied.

    Memory follows what is pending, not history. Each buffer row comes once (the
    follower does not read rewritten files), so no id is kept to skip a message that
    has left. A ledger event that finds its message here is applied and forgotten, and
    so is this job's own release read back (`settle` notes those ids until then, a
    batch or two). Only an event that finds neither is kept (`_early`): it may precede
    its buffer row, the ledger being read after a buffer version without the row, and
    the row is settled or moved when it comes.

    The bound: an early entry goes when its row comes, or when the retention watermark
    of the buffer version read passes the event (`forget_before`). A row the buffer
    held by then has been read (the follower reads every version up to that one), and
    retention keeps nothing in the buffer that was settled before its watermark. So
    `_early` holds at most the events since the watermark (`settled_retention_ms` and
    a minute or two behind the clock) that found no row: repeated events, and events
    ahead of their row. A row that comes more than that after its event is pending,
    here as for retention, which reads the ledger from its watermark on.
    """

    def __init__(self) -> None:
        self._messages: dict[str, Message] = {}
        self._heap: list[Order] = []
        self._early: dict[str, _Early] = {}
        self._taken: set[str] = set()  # released, their ledger row not read back yet
        self._watermark_us = 0
        self.max_sort_key: int | None = None

    def __len__(self) -> int:
        return len(self._messages)

    def __contains__(self, message_id: object) -> bool:
        """Whether the message of this id is pending."""
        return message_id in self._messages

    def afresh(self) -> PendingSet:
        """An empty set to read the tables into again, keeping the releases not yet read
        back from the ledger (a timeline's timed sender may still hold them: a re-read
        must not add them back) and the event-time high mark."""
        fresh = PendingSet()
        fresh._taken = set(self._taken)
        fresh.max_sort_key = self.max_sort_key
        return fresh

    @property
    def remembered(self) -> int:
        """Ids held besides the pending messages: events early for their row, and
        releases not yet read back from the ledger."""
        return len(self._early) + len(self._taken)

    def add_buffer_rows(
        self,
        rows: pa.Table,
        mark_up_to: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[Message]:
        """Add new buffer rows; a repeated id is ignored (first wins). Returns those added.

        `max_sort_key` follows the sort keys up to `mark_up_to` (None: all): an event
        time ahead of the clock must not raise the event-time watermark. `progress` is
        told the rows done after each slice of ROWS_AT_A_TIME.
        """
        added: list[Message] = []
        done = 0
        for batch in rows.to_batches(max_chunksize=ROWS_AT_A_TIME):
            added += self._add_rows(batch.to_pylist(), mark_up_to)
            done += batch.num_rows
            if progress is not None:
                progress(done)
        return added

    def _add_rows(self, rows: list[dict], mark_up_to: int | None) -> list[Message]:
        added = []
        for row in rows:
            sort_key = row["sort_key"]
            if (self.max_sort_key is None or sort_key > self.max_sort_key) and (
                mark_up_to is None or sort_key <= mark_up_to
            ):
                self.max_sort_key = sort_key
            mid = row["message_id"]
            if mid in self._messages or mid in self._taken:
                continue
            early = self._early.pop(mid, None)
            if early is not None and early.settled:
                continue
            m = Message(
                message_id=mid,
                bucket=row["bucket"],
                sort_key=sort_key,
                key=row["key"],
                payload=row["payload"],
                headers=tuple((h["key"], h["value"]) for h in row["headers"] or ()),
                source_topic=sys.intern(row["source_topic"]),
                source_partition=row["source_partition"],
                source_offset=row["source_offset"],
            )
            if early is not None and early.sort_key is not None:
                m.sort_key, m.rescheduled_at = early.sort_key, early.at
            self._messages[mid] = m
            heapq.heappush(self._heap, m.order)
            added.append(m)
        return added

    def apply_ledger_rows(self, rows: pa.Table) -> None:
        """Settled ids leave; a reschedule moves a message to its new sort key, and a
        redrive (the broker's, of a topic it delivered before) makes a dead one pending
        again at its key.

        Applied in the order they were (`in_applied_order`, as `retention.latest_events`
        reads them: within a millisecond a redrive follows a death, and an ack or a
        cancel follows the redrive), so a message whose latest event here is a redrive
        is pending, whatever order the ledger's files are read in. A death applied in an
        earlier call is final here: its row has left.
        """
        if pc.any(pc.equal(rows.column("event"), LedgerEvent.REDRIVEN)).as_py():
            rows = in_applied_order(rows)  # else the order changes nothing
        columns = (
            rows.column("message_id").to_pylist(),
            rows.column("event").to_pylist(),
            rows.column("sort_key").to_pylist(),
            rows.column("at").cast(pa.int64()).fill_null(0).to_pylist(),
        )
        ordered: Iterable[tuple[str, str, int | None, int]] = zip(*columns, strict=True)
        dead: dict[str, Message] = {}  # died in these rows: a redrive after brings them back
        for mid, event, sort_key, at in ordered:
            settles = event in SETTLED
            redrive = event == LedgerEvent.REDRIVEN
            moves = event == LedgerEvent.RESCHEDULED or redrive
            if not settles and (not moves or sort_key is None):
                continue
            if mid in self._taken:  # written already: only its own release is news
                if event in (LedgerEvent.RELEASED, LedgerEvent.DEAD):
                    self._taken.discard(mid)
                continue
            m = self._messages.get(mid)
            if m is None and redrive and mid in dead:
                m = self._messages[mid] = dead.pop(mid)
                heapq.heappush(self._heap, m.order)
            if m is None:
                self._remember(mid, at, settles, sort_key, redrive)
            elif settles:
                del self._messages[mid]
                if event == LedgerEvent.DEAD:
                    dead[mid] = m
            elif at >= m.rescheduled_at and m.sort_key != sort_key:
                m.sort_key, m.rescheduled_at = sort_key, at
                heapq.heappush(self._heap, m.order)
        self._trim_heap()

    def _remember(
        self, mid: str, at: int, settles: bool, sort_key: int | None, redrive: bool = False
    ) -> None:
        """Keep an event that found no row, unless retention has passed it; a redrive
        undoes a death before it."""
        if at < self._watermark_us:
            return
        early = self._early.get(mid)
        if early is None:
            self._early[mid] = _Early(at, settles, None if settles else sort_key)
        elif settles:
            early.settled, early.at, early.sort_key = True, max(at, early.at), None
        elif (redrive or not early.settled) and at >= early.at:
            early.settled, early.at, early.sort_key = False, at, sort_key

    def forget_before(self, watermark_ms: int) -> None:
        """The buffer version read has this retention watermark: forget the early events
        before it (see the class)."""
        watermark_us = watermark_ms * 1000
        if watermark_us <= self._watermark_us:
            return
        self._watermark_us = watermark_us
        self._early = {mid: e for mid, e in self._early.items() if e.at >= watermark_us}

    def _trim_heap(self) -> None:
        """Drop stale heap entries once they outnumber the live ones: a message settled
        far from the head would otherwise hold its entry until the head reaches it."""
        if len(self._heap) > 2 * len(self._messages) + HEAP_SLACK:
            self._heap = [m.order for m in self._messages.values()]
            heapq.heapify(self._heap)

    def _live_top(self) -> Message | None:
        """The first message in order, dropping heap entries that are stale."""
        while self._heap:
            order = self._heap[0]
            m = self._messages.get(order[-1])
            if m is not None and m.order == order:
                return m
            heapq.heappop(self._heap)
        return None

    def take(self, limit: int, up_to: int | None = None) -> list[Message]:
        """Remove and return, in order, at most `limit` messages with sort_key <= up_to."""
        taken = []
        while len(taken) < limit:
            m = self._live_top()
            if m is None or (up_to is not None and m.sort_key > up_to):
                break
            heapq.heappop(self._heap)
            del self._messages[m.message_id]
            taken.append(m)
        return taken

    def next_sort_key(self) -> int | None:
        m = self._live_top()
        return None if m is None else m.sort_key

    def put_back(self, messages: list[Message]) -> None:
        """Undo a take whose write failed, so the messages are tried again."""
        for m in messages:
            self._messages[m.message_id] = m
            heapq.heappush(self._heap, m.order)

    def settle(self, messages: list[Message]) -> None:
        """Note messages as written: their `released` ledger rows, read back later, find
        no row here and must not be kept as early (see the class)."""
        self._taken.update(m.message_id for m in messages)
