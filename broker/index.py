"""Per-bucket indexes of pending sort keys: the Delta buffer minus the ledger.

Node-local, not replicated: every node builds it from the same tables and keeps it in step
with the Raft state through hooks (`push`, `forget`), so a follower can serve as leader
the moment it is elected. Heap entries are validated lazily against the Raft state when
they reach the top, which makes every hook idempotent and a duplicate entry harmless.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from broker.leases import Pick, TopicState
from conf.settings import TopicConfig, TopicKind
from conf.tables import LedgerEvent, Table, ensure_table

TERMINAL = {LedgerEvent.ACKED, LedgerEvent.DEAD, LedgerEvent.CANCELLED, LedgerEvent.RELEASED}
_COLUMNS = ["message_id", "sort_key", "priority", "deliver_at", "key", "payload", "ingested_at"]
_COORDS = ["source_partition", "source_offset"]


class Row(NamedTuple):
    bucket: int
    sort_key: int
    partition: int
    offset: int
    priority: int | None
    deliver_at: int | None  # epoch ms
    key: bytes | None
    payload: bytes
    ingested_at: int  # epoch ms


@dataclass
class Stats:
    pending: int
    deliverable: int
    oldest_ingested_ms: int | None


class TopicIndex:
    """The pending messages of one topic, ordered per bucket by (sort key, partition, offset)."""

    def __init__(self, warehouse: str, topic: TopicConfig) -> None:
        self.topic = topic
        self.timeline = topic.kind is TopicKind.TIMELINE
        self.buffer_path = ensure_table(warehouse, Table.BUFFER, topic.name)
        self.ledger_path = ensure_table(warehouse, Table.LEDGER, topic.name)
        self.lock = threading.Lock()
        self.rows: dict[str, Row] = {}
        self.heaps: list[list[tuple[int, int, int, str]]] = [[] for _ in range(topic.buckets)]
        self.delayed: list[tuple[int, str]] = []  # (not_before, message_id)
        self.gone: set[str] = set()  # settled and checkpointed: never deliverable again
        self.reserved: set[str] = set()  # picked by this leader, lease not yet committed
        self.json_cache: dict[str, str] = {}  # message id -> leased-message JSON, static part
        self.files: set[str] = set()
        self.version = -1
        self.loaded = False
        self._buffer: DeltaTable | None = None

    # --- following the tables ---------------------------------------------------------

    def load(self) -> None:
        """First load: settled ids from the ledger, then every buffer file."""
        ledger = DeltaTable(self.ledger_path).to_pyarrow_table(columns=["message_id", "event"])
        terminal = pc.is_in(
            ledger.column("event"), value_set=pa.array(sorted(TERMINAL), pa.string())
        )
        gone = ledger.filter(terminal).column("message_id").to_pylist()
        with self.lock:
            self.gone.update(gone)
        self.refresh()
        self.loaded = True

    def refresh(self) -> int:
        """Index buffer files added since the last call; returns how many rows were new."""
        if self._buffer is None:
            self._buffer = DeltaTable(self.buffer_path)
        else:
            self._buffer.update_incremental()
        version = self._buffer.version()
        if version == self.version:
            return 0
        actions = pa.table(self._buffer.get_add_actions(flatten=True)).to_pydict()
        paths = [p for p in actions["path"] if p not in self.files]
        buckets = dict(zip(actions["path"], actions["partition.bucket"], strict=True))
        # Read first, then insert every file of the version under one lock: a lease sees
        # a Delta commit whole or not at all, never some of its buckets.
        files = [self._read_file(path, buckets[path]) for path in paths]
        new = 0
        with self.lock:
            touched: set[int] = set()
            for bucket, rows in files:
                heap = self.heaps[bucket]
                for mid, row in rows:
                    if mid in self.rows or mid in self.gone:
                        continue  # duplicates by id: first wins
                    self.rows[mid] = row
                    heap.append((row.sort_key, row.partition, row.offset, mid))
                    new += 1
                touched.add(bucket)
            for bucket in touched:
                heapq.heapify(self.heaps[bucket])
        self.files.update(paths)
        self.version = version
        return new

    def _read_file(self, path: str, bucket: int) -> tuple[int, list[tuple[str, Row]]]:
        uri = path if "://" in path or path.startswith("/") else f"{self.buffer_path}/{path}"
        t = pq.read_table(uri, columns=_COLUMNS + _COORDS)
        ats = [
            None if a is None else a // 1000
            for a in pc.cast(t.column("deliver_at"), "int64").to_pylist()
        ]
        ingested = [a // 1000 for a in pc.cast(t.column("ingested_at"), "int64").to_pylist()]
        payloads = [p or b"" for p in t.column("payload").to_pylist()]
        columns = zip(
            t.column("sort_key").to_pylist(),
            t.column("source_partition").to_pylist(),
            t.column("source_offset").to_pylist(),
            t.column("priority").to_pylist(),
            ats,
            t.column("key").to_pylist(),
            payloads,
            ingested,
            strict=True,
        )
        rows = [
            (mid, Row(bucket, *values))
            for mid, values in zip(t.column("message_id").to_pylist(), columns, strict=True)
        ]
        return bucket, rows

    # --- hooks from the Raft state machine ------------------------------------------------

    def push(self, state: TopicState, mids: list[str]) -> None:
        """Messages pending again (lease expired, nacked, rescheduled, consumer left)."""
        with self.lock:
            for mid in mids:
                row = self.rows.get(mid)
                if row is None:
                    continue
                not_before = state.not_before.get(mid)
                if not_before is not None:
                    heapq.heappush(self.delayed, (not_before, mid))
                else:
                    key = state.sort_key(mid, row.sort_key)
                    heapq.heappush(self.heaps[row.bucket], (key, row.partition, row.offset, mid))

    def forget(self, mids: list[str]) -> None:
        """Settled messages checkpointed into the ledger: gone for good."""
        with self.lock:
            self.gone.update(mids)
            for mid in mids:  # heap entries left behind are dropped when they surface
                self.rows.pop(mid, None)
                self.json_cache.pop(mid, None)

    def rebuild(self, state: TopicState) -> None:
        """After a snapshot replaced the state wholesale: re-derive every heap."""
        with self.lock:
            heaps: list[list[tuple[int, int, int, str]]] = [[] for _ in self.heaps]
            for mid, row in self.rows.items():
                if mid not in self.gone:
                    key = state.sort_key(mid, row.sort_key)
                    heaps[row.bucket].append((key, row.partition, row.offset, mid))
            for heap in heaps:
                heapq.heapify(heap)
            self.heaps = heaps
            self.delayed = [(nb, mid) for mid, nb in state.not_before.items()]
            heapq.heapify(self.delayed)

    # --- leader side -----------------------------------------------------------------

    def _valid(self, state: TopicState, entry: tuple[int, int, int, str], now: int) -> bool:
        key, _, _, mid = entry
        if mid in self.gone or mid in state.settled or mid in state.leases:
            return False
        if mid in state.not_before and state.not_before[mid] > now:
            return False  # the delayed heap holds it
        return key == state.sort_key(mid, self.rows[mid].sort_key)

    def pick(self, state: TopicState, buckets: list[int], n: int, now: int) -> list[Pick]:
        """Reserve the `n` lowest deliverable sort keys across `buckets`.

        The caller commits them as a lease and then calls `release` with the picks, so
        a pick the state machine refused goes back into the index.
        """
        picks: list[Pick] = []
        with self.lock:
            while self.delayed and self.delayed[0][0] <= now:
                _, mid = heapq.heappop(self.delayed)
                row = self.rows.get(mid)
                if row is None:
                    continue
                key = state.sort_key(mid, row.sort_key)
                heapq.heappush(self.heaps[row.bucket], (key, row.partition, row.offset, mid))
            heads: list[tuple[tuple[int, int, int, str], int]] = []
            for b in buckets:
                head = self._head(state, b, now)
                if head is not None:
                    heads.append((head, b))
            heapq.heapify(heads)
            while heads and len(picks) < n:
                entry, b = heapq.heappop(heads)
                heapq.heappop(self.heaps[b])
                self.reserved.add(entry[3])
                picks.append((entry[3], b, entry[0]))
                head = self._head(state, b, now)
                if head is not None:
                    heapq.heappush(heads, (head, b))
        return picks

    def _head(self, state: TopicState, bucket: int, now: int) -> tuple[int, int, int, str] | None:
        heap = self.heaps[bucket]
        while heap:
            entry = heap[0]
            if entry[3] in self.reserved or not self._valid(state, entry, now):
                heapq.heappop(heap)
                continue
            if self.timeline and entry[0] > now:
                return None
            return entry
        return None

    def release(self, state: TopicState, picks: list[Pick]) -> None:
        """End a reservation; picks the lease did not take become pending again."""
        with self.lock:
            for mid, bucket, key in picks:
                self.reserved.discard(mid)
                row = self.rows.get(mid)
                if row is not None and mid not in state.leases and mid not in state.settled:
                    heapq.heappush(self.heaps[bucket], (key, row.partition, row.offset, mid))

    # --- reads -----------------------------------------------------------------------

    def stats(self, state: TopicState, now: int) -> tuple[dict[int, Stats], int]:
        """Per-bucket pending/deliverable counts and oldest ingestion; delayed count."""
        out: dict[int, Stats] = {}
        with self.lock:
            for b, heap in enumerate(self.heaps):
                seen: set[str] = set()
                pending = deliverable = 0
                oldest: int | None = None
                for key, _, _, mid in heap:
                    if mid in seen or mid in self.gone or mid in state.settled:
                        continue
                    if mid in state.leases or key != state.sort_key(mid, self.rows[mid].sort_key):
                        continue
                    seen.add(mid)
                    pending += 1
                    at = self.rows[mid].ingested_at
                    oldest = at if oldest is None else min(oldest, at)
                    if state.not_before.get(mid, 0) <= now and (not self.timeline or key <= now):
                        deliverable += 1
                out[b] = Stats(pending, deliverable, oldest)
            delayed = len({m for _, m in self.delayed if m not in state.leases})
        return out, delayed
