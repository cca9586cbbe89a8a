"""The messages a release job still has to write: buffer rows minus settled ledger events.

Held in the driver's memory and fed with the rows Delta gains (see DeltaFollower), so
choosing what to release costs a heap operation per message, not a Spark job per trigger.
Order is total: (sort_key, source partition, source offset, source topic, id).
"""

from __future__ import annotations

import datetime as dt
import heapq
from dataclasses import dataclass

import pyarrow as pa

from dejaq.conf.tables import LedgerEvent

# Ledger events after which a message is never written again.
SETTLED = frozenset(
    {LedgerEvent.RELEASED, LedgerEvent.CANCELLED, LedgerEvent.ACKED, LedgerEvent.DEAD}
)

Order = tuple[int, int, int, str, str]


@dataclass
class Message:
    """One buffer row, with the sort key in force (a reschedule replaces the buffer's)."""

    message_id: str
    bucket: int
    sort_key: int
    key: bytes | None
    payload: bytes | None
    headers: list[dict]
    source_topic: str
    source_partition: int
    source_offset: int

    @property
    def order(self) -> Order:
        return (
            self.sort_key,
            self.source_partition,
            self.source_offset,
            self.source_topic,
            self.message_id,
        )


_MIN_AT = dt.datetime.min.replace(tzinfo=dt.UTC)


class PendingSet:
    """Pending messages in release order, with ledger cancels and reschedules applied.

    Ledger state is kept for ids whose buffer row is not seen yet too, so the order in
    which the two tables are read does not matter.
    """

    def __init__(self) -> None:
        self._messages: dict[str, Message] = {}
        self._heap: list[Order] = []
        self._settled: set[str] = set()
        self._rescheduled: dict[str, tuple[dt.datetime, int]] = {}
        self.max_sort_key: int | None = None

    def __len__(self) -> int:
        return len(self._messages)

    def add_buffer_rows(self, rows: pa.Table) -> list[Message]:
        """Add new buffer rows; a repeated id is ignored (first wins). Returns those added."""
        added = []
        for row in rows.to_pylist():
            sort_key = row["sort_key"]
            if self.max_sort_key is None or sort_key > self.max_sort_key:
                self.max_sort_key = sort_key
            mid = row["message_id"]
            if mid in self._messages or mid in self._settled:
                continue
            if mid in self._rescheduled:
                sort_key = self._rescheduled[mid][1]
            m = Message(
                message_id=mid,
                bucket=row["bucket"],
                sort_key=sort_key,
                key=row["key"],
                payload=row["payload"],
                headers=row["headers"] or [],
                source_topic=row["source_topic"],
                source_partition=row["source_partition"],
                source_offset=row["source_offset"],
            )
            self._messages[mid] = m
            heapq.heappush(self._heap, m.order)
            added.append(m)
        return added

    def apply_ledger_rows(self, rows: pa.Table) -> None:
        """Settled ids leave for good; a reschedule moves a message to its new sort key.

        Of several reschedules of one id, the latest (`at`) wins, whatever order the
        ledger's files are read in.
        """
        for row in rows.to_pylist():
            mid, event = row["message_id"], row["event"]
            if event in SETTLED:
                self._settled.add(mid)
                self._messages.pop(mid, None)
            elif event == LedgerEvent.RESCHEDULED and row["sort_key"] is not None:
                at = row["at"] or _MIN_AT
                if mid in self._rescheduled and self._rescheduled[mid][0] > at:
                    continue
                self._rescheduled[mid] = (at, row["sort_key"])
                m = self._messages.get(mid)
                if m is not None and m.sort_key != row["sort_key"]:
                    m.sort_key = row["sort_key"]
                    heapq.heappush(self._heap, m.order)

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
            if m.message_id not in self._settled:
                self._messages[m.message_id] = m
                heapq.heappush(self._heap, m.order)

    def settle(self, messages: list[Message]) -> None:
        """Record messages as released, so a re-read of their buffer rows skips them."""
        self._settled.update(m.message_id for m in messages)
