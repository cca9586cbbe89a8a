"""Per-bucket indexes of pending sort keys: the Delta buffer minus the ledger.

Node-local, not replicated: every node builds it from the same tables and keeps it in step
with the Raft state through hooks (`push`, `forget`), so a follower can serve as leader
the moment it is elected. Entries are validated lazily against the Raft state when
they reach the top, which makes every hook idempotent and a duplicate entry harmless.
It holds nothing of a message once settled and checkpointed: the ledger is the record,
and a broker that kept even each settled id would grow by ~140 bytes per message. Nor
does it hold payloads: each message's rendered JSON is in the node's `HeadStore` on local
disk, read back when a lease grants it. What it holds of a pending message is in columns
(`RowStore`): its id, a token, and the fields ordering needs.

Each bucket's order is kept by the compiled core (`dejaq_core.Order`): a run of tokens,
sorted once and taken from its low end, and a heap of entries for what arrives a few at
a time (redeliveries, re-keyed messages, a trickle of new rows). A pick walks them and
checks what it meets against the Raft state there, making a Python object only of what
it takes: picking is the leader's largest step per leased message.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from dejaq_core import Order
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from dejaq.broker.state.handles import WIDTH, handles_in, mhs, packed_handles
from dejaq.broker.state.leases import Pick, Picks, TopicState, unpacked
from dejaq.broker.storage import head_store, message_json
from dejaq.broker.storage.head_store import SEP, SPAN_PER_HEAD, HeadStore, Segment
from dejaq.broker.storage.id_table import Encoded, decode
from dejaq.broker.storage.ledger_writer import History, app_id
from dejaq.broker.storage.row_store import (
    HANDLE_MASK,
    Batch,
    Heads,
    Row,
    RowStore,
    StoredIds,
    Taken,
    current,
)
from dejaq.conf.settings import ConfigError, TopicConfig, TopicKind
from dejaq.conf.table_watch import TableWatch
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    LedgerEvent,
    Table,
    conform,
    ensure_buffer,
    ensure_table,
    matching,
    scan,
)
from dejaq.pipelines.retention import (
    CLOCK_SKEW_MS,
    DEATHS,
    LogGap,
    commits,
    first_per_id,
    latest_events,
    split,
    watermark,
)

log = logging.getLogger("dejaq.broker.storage.index")
# Messages `TopicIndex.ids_of` names per hold of the lock.
NAME_SLICE = 4096
# A start's load, topic by topic and as it goes: lines an operator waits on, at INFO on a
# logger of their own, which `dejaq broker` shows beside its warnings.
LOAD_LOGGER = "dejaq.broker.load"
load_log = logging.getLogger(LOAD_LOGGER)
LOAD_SAID_EVERY_S = 10.0  # a load's progress is logged at most this often

_COLUMNS = ["message_id", "sort_key", "deliver_at", "key", "payload", "ingested_at"]
_COORDS = ["source_partition", "source_offset"]
_FILE_SCHEMA = pa.schema([BUFFER_SCHEMA.field(c) for c in _COLUMNS + _COORDS])
_ORDER = [("sort_key", "ascending"), *((c, "ascending") for c in _COORDS)]
_ORDER_COLUMNS = [c for c, _ in _ORDER]
_ORDER_SCHEMA = pa.schema([BUFFER_SCHEMA.field(c) for c in _ORDER_COLUMNS])
RUN_MIN = 64  # a bucket's heap takes up to this many rows (or an eighth of its run)
HEAD_SLICE = 1024  # rows read, rendered and written to the head store at once
COMPACT_READ = 2048  # heads a compaction reads per hold of the index lock
# Bytes of heads a compaction moves per round, the rest left to the next ones: a backlog
# drained evenly leaves every segment sparse at once, gigabytes of heads to move.
COMPACT_BYTES = head_store.SEGMENT_BYTES
# Delayed entries beyond twice the delays in force before the stale ones are dropped.
DELAYED_SLACK = 1024
NO_LIMIT = (1 << 63) - 1  # the highest key a pick takes where none is too early
# How long a message pending again may have a row nowhere before it is warned of: a node
# catching up forgets those a later entry settles within seconds (`TopicIndex.revive`).
UNFOUND_GRACE_S = 60.0


# Bytes of a head segment a repair's check reads per hold of the index lock (`pread`s
# from the page cache, well under a millisecond).
CHECK_READ = 1 << 20


class LoadStopped(Exception):
    """The node stops while a topic's first load runs: it ends between two slices."""


class Loading:
    """A topic's first load as it goes, which readiness shows and the node logs: buckets
    read of the topic's (those without files count once the files are listed), rows
    indexed so far."""

    def __init__(self, topic: str, buckets: int) -> None:
        self.topic, self.buckets = topic, buckets
        self.done = self.rows = 0
        self.began = self._said = time.monotonic()

    def listed(self, to_read: int) -> None:
        """The buffer's files are listed: `to_read` buckets hold some."""
        self.done = self.buckets - to_read

    def read(self, rows: int) -> None:
        """A bucket is indexed, `rows` rows in all so far."""
        self.done, self.rows = self.done + 1, rows
        if time.monotonic() - self._said >= LOAD_SAID_EVERY_S:
            self._said = time.monotonic()
            load_log.info("loading the index of %s", self)

    def seconds(self) -> float:
        return time.monotonic() - self.began

    def __str__(self) -> str:
        return f"{self.topic} {self.done}/{self.buckets} buckets, {self.rows} rows"


class HeadsUnreadable(Exception):
    """A lease's picks whose heads could not be read (the node's disk failing them):
    they are pending again, in the index as before the pick. Or a repair of such heads
    that failed (`TopicIndex.repair_heads`)."""


@dataclass
class Stats:
    pending: int
    deliverable: int
    oldest_ingested_ms: int | None


class TopicIndex:
    """The pending messages of one topic, ordered per bucket by (sort key, partition, offset)."""

    def __init__(
        self, warehouse: str, topic: TopicConfig, heads_dir: str | None = None, reserve: int = 0
    ) -> None:
        self.topic = topic
        self.timeline = topic.kind.sorted_as is TopicKind.TIMELINE
        self.buffer_path = ensure_buffer(warehouse, topic)
        self.ledger_path = ensure_table(warehouse, Table.LEDGER, topic.name)
        self.dead_letter_path = ensure_table(warehouse, Table.DEAD_LETTER, topic.name)
        self.watch = TableWatch(self.buffer_path)
        self.lock = threading.Lock()
        self.heads = HeadStore(heads_dir, reserve)  # `reserve`: disk bytes left free
        self.store = RowStore()
        self.rows = StoredIds(self.store)  # message id -> token: what is indexed
        # An entry is valid while its handle's batch is its token's (`RowStore.batch`).
        self.order = Order(topic.buckets)
        # The id column and its bytes view as the last pick passed them (`_pick_args`).
        self._ids: np.ndarray | None = None
        self._ids_bytes: np.ndarray | None = None
        self.delayed: list[tuple[int, int]] = []  # (not_before, message handle)
        # Pending again with no row here: redriven after the row was forgotten (or not yet
        # read by this node). `revive` reads them from the buffer. By message handle (a
        # trim names messages so), each with its id.
        self.unread: dict[int, str] = {}
        # Message handles of messages with a delay or an override in force and no row
        # here yet, which the state names by handle alone (a snapshot's, a delay come
        # due): indexed at them once a `refresh` reads their rows (`_repend_indexed`).
        self.awaited: set[int] = set()
        # Message handles of messages settled without a row here yet (`forget`).
        self.forgotten: set[int] = set()
        # Pending again, `revive` found no row: message handle -> (id, when, by
        # time.monotonic), until a trim forgets it or it is warned of (`_warn_unfound`).
        self.unfound: dict[int, tuple[str, float]] = {}
        # Rows `revive` found there, not in the buffer: message handle -> id.
        self.from_dead_letters: dict[int, str] = {}
        # The versions of the buffer and the dead letters `ids_in_tables` last read, and
        # the handles it found in neither: asked for those alone again, before either
        # table changes, it reads nothing.
        self._not_in_tables: tuple[int, int, frozenset[int]] = (-1, -1, frozenset())
        self.files: set[str] = set()  # of the version indexed
        # Buckets of files seen but not read: the ingest writes more than this node has.
        self.beyond: set[int] = set()
        self.buffer_rows = 0  # in that version, pending or settled
        self.version = -1
        self.ledger_version = -1  # of the last full read of the ledger's settled ids
        # Rows `revive` indexed since that read: a journal replayed at start can revive a
        # message that a later entry, or the snapshot that replaces the state, settles.
        self.revived_since_read = False
        self.loaded = False
        self.loading = Loading(topic.name, topic.buckets)
        self._halt: threading.Event | None = None  # set: the first load stops (`load`)
        self._buffer: DeltaTable | None = None
        # A read of heads failed (a lease's, a peek's): why, until `repair_heads` looks
        # for the heads that cannot be read.
        self.heads_failed: str | None = None
        # Tokens whose heads cannot be read, until read again from the buffer.
        self.damaged = np.zeros(0, np.int64)

    # --- following the tables ---------------------------------------------------------

    def load(self, halt: threading.Event | None = None) -> None:
        """First load: the settled ids in the ledger's tail, then every buffer file, a
        bucket at a time (`loading` says how far). Raises LoadStopped once `halt` is set.

        A message the tail has redriven since its last death whose row no buffer file
        holds (a retention run removed it, and its row is put back only before the
        watermark passes the redrive) is pending all the same: `revive` reads it from
        the dead letters."""
        self._halt = halt
        self.loading = Loading(self.topic.name, self.topic.buckets)
        try:
            self._buffer = DeltaTable(self.buffer_path)
            settled, redriven = self._settled_ids()
            self.refresh(settled)
        finally:
            self._halt = None
        with self.lock:
            self._unread(m for m in redriven if self.store.get(m) is None)
        self.loaded = True

    def _halted(self) -> None:
        """Raise LoadStopped if the first load is to stop."""
        if self._halt is not None and self._halt.is_set():
            raise LoadStopped(f"the load of {self.topic.name} stopped at {self.loading}")

    def _settled_ids(self, note: bool = True) -> tuple[set[str], set[str]]:
        """The ids the ledger has settled since the buffer's retention watermark, and
        those it has redriven since their last death (pending again); notes the ledger
        version read (`rebuild`) if `note`, where they are applied to every row held.

        Retention has removed every message settled before the watermark from the
        buffer (`dejaq.pipelines.retention`), so the ledger before it is history no
        buffer row needs: a start reads the tail, however long the ledger has grown.
        """
        assert self._buffer is not None
        since = watermark(self._buffer)
        if note:
            self.revived_since_read = False
            self.ledger_version = DeltaTable(self.ledger_path).version()
        settled, redriven = split(latest_events(self.ledger_path, since))
        return set(settled), set(redriven)

    def refresh(self, settled: Set[str] = frozenset()) -> int:
        """Index buffer files added since the last call; returns how many rows were new.

        `settled`: the ids in the ledger, on the first load. Later files hold new ids (the
        ingest drops duplicates within its window), except those a compaction or a
        retention run writes, which `_unseen` leaves unread, and except messages this
        node has already seen settle and forgot (`forget`): a node that reads a version
        later than the leader can apply a message's trim before reading its row.
        """
        with self.lock:  # taken before the version: what it forgot is in that version
            forgotten, self.forgotten = self.forgotten, set()
        try:
            return self._refresh(settled, forgotten)
        except BaseException:
            with self.lock:  # kept for the next try
                self.forgotten |= forgotten
            raise

    def _refresh(self, settled: Set[str], forgotten: set[int]) -> int:
        if self._buffer is None:
            self._buffer = DeltaTable(self.buffer_path)
        elif self.watch.moved(self._buffer.version()):
            self._buffer.update_incremental()
        version = self._buffer.version()
        if version == self.version:
            # No version read (an object store's watch probes the table less often
            # while it is quiet): what this node forgot is kept for the version that
            # holds its rows, or they would be indexed as pending once read.
            with self.lock:
                self.forgotten |= forgotten
            return 0
        try:
            return self._read_new(version, *self._unseen(version), settled, forgotten)
        except (LogGap, TableNotFoundError, FileNotFoundError) as e:
            # Which of the versions between were rewrites cannot be told (their log is
            # gone, or a file an older one added was vacuumed since): every file not
            # seen is read, as a start reads them, without what the ledger has settled
            # since the retention watermark (a start's `settled`). Applied to those
            # files alone: `rebuild` must still read the ledger for the rows held.
            log.warning("%s: reading the buffer's files not indexed yet, as a start does", e)
            unread, current, rows = self._unseen(version, walk=False)
            settled = set(settled) | self._settled_ids(note=False)[0]
            return self._read_new(version, unread, current, rows, settled, forgotten)

    def _read_new(
        self,
        version: int,
        unread: list[tuple[str, int, int]],
        current: set[str],
        rows: int,
        settled: Set[str],
        forgotten: set[int],
    ) -> int:
        """Index `unread` (`_unseen`), as of `version`, which holds `rows` rows; how many
        rows were new. Raises before indexing any where a file is missing, once the first
        load is done. `buffer_rows` takes `rows` once they are read: counted before, rows
        that cannot be read would count as settled (buffer rows the index lacks).

        A file in a bucket this node has not refuses the first load (its messages would
        never be leased); later, the ingest runs with more buckets than this node was
        started with: such a file waits for a start with them (`beyond`), and the files
        of this node's buckets are indexed all the same."""
        paths: dict[int, list[str]] = {}
        beyond: set[int] = set()
        for path, bucket, _ in unread:
            if not 0 <= bucket < self.topic.buckets:
                if not self.loaded:
                    raise ConfigError(
                        f"topics[{self.topic.name}].buckets is {self.topic.buckets}, but the "
                        f"buffer holds messages in bucket {bucket}: a topic's buckets cannot "
                        "be lowered while messages in the higher ones are pending or "
                        "retained (if the ingest was given more, give the brokers as many)"
                    )
                beyond.add(bucket)
                continue
            uri = path if "://" in path or path.startswith("/") else f"{self.buffer_path}/{path}"
            paths.setdefault(bucket, []).append(uri)
        if fresh := beyond - self.beyond:  # said before the version's other rows show
            log.warning("%s", self.beyond_alert(fresh))
            self.beyond |= fresh
        # Read first, then insert every file of the version under one lock: a lease sees
        # a Delta commit whole or not at all, never some of its buckets. Except on the
        # first load, before the node serves or applies anything: there a bucket at a
        # time, so that a load holds one bucket's rows, not the buffer's.
        groups = [list(paths.items())] if self.loaded else [[item] for item in paths.items()]
        if not self.loaded:
            self.loading.listed(len(groups))
        if len(groups) > 1:
            # Sized once for what the load will likely add (every row it reads, but the
            # settled), not grown a bucket at a time: each growth copies the columns.
            expected = max(0, sum(rows for _, _, rows in unread) - len(settled))
            self.store.table.make_room(expected, self.lock)
            with self.lock:
                self.store.reserve(expected)
        added = 0
        for group in groups:
            self._halted()
            added += self._index(group, settled, forgotten)
            if not self.loaded:
                # Arrow's allocator keeps what a bucket's reading freed for reuse: a load
                # would hold the most any bucket took, and a node that never reads that
                # much again would hold it for its life.
                pa.default_memory_pool().release_unused()
                self.loading.read(added)
        self.files = current
        self.version = version
        self.buffer_rows = rows
        return added

    def beyond_alert(self, buckets: Set[int] | None = None) -> str | None:
        """What readiness says of the buffer's buckets this node has not (`beyond`, or
        `buckets`): their messages wait until it starts with them."""
        buckets = self.beyond if buckets is None else buckets
        if not buckets:
            return None
        listed = ", ".join(map(str, sorted(buckets)))
        return (
            f"{self.topic.name}: the buffer holds messages in bucket {listed}, this node is "
            f"configured for {self.topic.buckets}: restart the brokers with the new "
            "configuration; those messages wait until then"
        )

    def _index(
        self, buckets: list[tuple[int, list[str]]], settled: Set[str], forgotten: set[int]
    ) -> int:
        """Read the files of `buckets` and index their rows not indexed, settled or
        forgotten already; returns how many. Raises with no head of its own counted live:
        a refresh that fails and is tried again would leave each try's heads behind."""
        batches: list[tuple[int, Batch]] = []
        try:
            for bucket, uris in buckets:
                batches.append((bucket, self._read_bucket(bucket, uris)))
            kept, adding = self._new_rows(batches, settled, forgotten)
        except BaseException:
            self.heads.release(_heads_of(batch for _, batch in batches))
            raise
        # Heads written for rows not indexed (duplicates, settled, forgotten) are released.
        unused: Counter[Segment] = Counter()
        added = 0
        with self.lock:
            self.store.reserve(adding)
            # Forgotten while the files were read: not indexed.
            gone = self.forgotten
            for bucket, batch, keep, encoded in kept:
                if gone and len(keep):
                    stay = ~_named(mhs(encoded.mids), gone)
                    keep, encoded = keep[stay], encoded.kept(stay)
                if len(keep) < len(batch.mids):
                    unused.update(_unindexed(batch, keep))
                if len(keep):
                    self._add(bucket, self.store.add(bucket, batch, keep, encoded))
                    added += len(keep)
        self.heads.release(+unused)
        return added

    def _new_rows(
        self, batches: list[tuple[int, Batch]], settled: Set[str], forgotten: set[int]
    ) -> tuple[list[tuple[int, Batch, np.ndarray, Encoded]], int]:
        """Each batch's rows to index (neither indexed, settled nor forgotten already,
        the first of duplicates) with their ids encoded, and how many in all (room made
        for them in the id table). Hashed (`mhs`) only while something is `forgotten`,
        which names messages by handle."""
        # The per-row checks, and the ids' encoding for the id table, happen before
        # taking the lock, which the event loop (Raft applies, leases) also takes: under
        # it, column copies and inserts. The id table is read outside it: only this
        # thread adds to it, so an id not found stays unindexed until the insert below.
        table = self.store.table
        seen: set[str] = set()
        kept: list[tuple[int, Batch, np.ndarray, Encoded]] = []
        for bucket, batch in batches:
            # Duplicates by id: first wins. A mask, not a list of positions: an int object
            # per row, made while the ids are, would leave the heap fragmented.
            new = np.fromiter(
                (
                    not (mid in seen or mid in settled) and seen.add(mid) is None
                    for mid in batch.mids
                ),
                bool,
                len(batch.mids),
            )
            if forgotten and len(batch.mids):
                new &= ~_named(mhs(batch.mids), forgotten)
            keep = np.flatnonzero(new)
            # Encoded (and hashed) once, for the look-up and the insert.
            encoded = table.encode(batch.mids_at(keep))
            if len(table) and len(keep):  # indexed already (by `revive`)
                unread = self.store.tokens(encoded.mids, encoded.mhs) == 0
                keep, encoded = keep[unread], encoded.kept(unread)
            kept.append((bucket, batch, keep, encoded))
        adding = sum(len(keep) for _, _, keep, _ in kept)
        table.make_room(adding, self.lock)
        return kept, adding

    def _unseen(
        self, version: int, walk: bool = True
    ) -> tuple[list[tuple[str, int, int]], set[str], int]:
        """Files of `version` that this index has not seen: (to read, with their bucket
        and row count; all of them; the rows of `version`). `walk`: False to read every
        file not seen, without the versions between (`LogGap`).

        A compaction (OPTIMIZE) or a retention run rewrites rows the table already had,
        settled ones too, so its files are seen but not read: the index keeps no settled
        ids to skip them by. When appends and a rewrite of them arrive in one step, the
        versions are walked one at a time, so the appended files are read even though
        the rewrite has replaced them (replaced files stay on disk for the table's
        retention), each from its own log entry (`commits`), which says whether it is a
        rewrite anyway: a snapshot of each would cost a listing, a checkpoint and all
        its add actions.
        """
        assert self._buffer is not None
        actions = pa.table(self._buffer.get_add_actions(flatten=True)).to_pydict()
        added = [(path, bucket, rows, False) for path, bucket, rows in _files(actions)]
        if self.version >= 0 and walk:
            walked = commits(self.buffer_path, range(self.version + 1, version + 1))
            if any(c.rewrite for c in walked):
                added = [
                    (add.path, int(add.partition["bucket"]), add.rows, c.rewrite)
                    for c in walked
                    for add in c.adds
                ]
        unread: list[tuple[str, int, int]] = []
        seen: set[str] = set()
        for path, bucket, rows, rewrite in added:
            if path in self.files or path in seen:
                continue
            seen.add(path)
            if not rewrite:
                unread.append((path, bucket, rows or 0))
        return unread, set(actions["path"]), sum(n or 0 for n in actions["num_records"])

    def _read_bucket(self, bucket: int, uris: list[str]) -> Batch:
        """Rows of one bucket's files in sort order, their heads written, read a slice of
        rows at a time: a load holds one slice's payloads, not the bucket's (a million
        1 KB messages in 16 buckets are 64 MB a bucket).

        A bucket's heads end up in its sort order, so a lease, which takes a bucket's
        lowest keys, reads them as one range of the head store. Rows the files hold in
        another order have their heads written in file order to a scratch store first,
        then copied from it in sort order a slice at a time. Between two copies of an id
        in one bucket's new files the lower sort key wins (the ingest drops such
        duplicates before they reach the buffer: this only keeps the index consistent).
        Raises with none of its heads counted live in the node's store, at once if the
        disk is within the node's reserve (`HeadStore.check_room`).
        """
        self.heads.check_room()
        keys = pa.concat_tables(
            conform(
                pq.read_table(
                    uri, columns=_ORDER_COLUMNS, use_threads=False, pre_buffer=_pre_buffer(uri)
                ),
                _ORDER_SCHEMA,
            )
            for uri in uris
        )
        order = pc.sort_indices(keys, sort_keys=_ORDER).to_numpy()
        del keys
        sorted_already = bool((order[1:] > order[:-1]).all())
        store = self.heads if sorted_already else HeadStore(self.heads.folder, self.heads.reserve)
        mine: Counter[Segment] = Counter()  # heads written to the node's store so far
        try:
            mids: list[str] = []
            written: dict[int, Segment] = {}
            parts: list[tuple[np.ndarray, ...]] = []
            for uri in uris:
                for rows in _slices(uri):
                    self._halted()
                    part_mids = rows.column("message_id").to_pylist()
                    segment, positions = self._render(store, rows, part_mids, bucket)
                    if store is self.heads:
                        mine[segment] += len(positions)
                    mids += part_mids
                    written[segment.number] = segment
                    parts.append(
                        (
                            rows.column("sort_key").to_numpy(),
                            rows.column("source_partition").to_numpy(),
                            rows.column("source_offset").to_numpy(),
                            _epoch_s(rows.column("ingested_at")),
                            np.full(len(positions), segment.number, np.int32),
                            positions,
                        )
                    )
            columns = [np.concatenate(c) for c in zip(*parts, strict=True)] or [
                np.zeros(0, dtype)
                for dtype in (np.int64, np.int32, np.int64, np.int64, np.int32, np.int64)
            ]
            del parts
            if not sorted_already:
                mids = list(map(mids.__getitem__, order.tolist()))
                columns = [c[order] for c in columns]
                columns[4], columns[5], written = self._copy_heads(
                    columns[4], columns[5], written, mine
                )
        except BaseException:
            self.heads.release(mine)
            raise
        finally:
            if store is not self.heads:
                store.close()
        return Batch(mids, *columns, written)

    def _render(
        self, store: HeadStore, rows: pa.Table, mids: list[str], bucket: int
    ) -> tuple[Segment, np.ndarray]:
        """Write the heads of `rows` to `store`, in the rows' order; returns where: one
        segment, at consecutive positions."""
        heads = [
            message_json.head(mid, bucket, key, payload, sort_key, at, self.timeline)
            for mid, key, payload, sort_key, at in zip(
                mids,
                rows.column("key").to_pylist(),
                rows.column("payload").to_pylist(),
                rows.column("sort_key").to_pylist(),
                _ms(rows.column("deliver_at")),
                strict=True,
            )
        ]
        segment, first = store.write(heads)
        return segment, np.arange(first, first + len(heads))

    def _copy_heads(
        self,
        numbers: np.ndarray,
        positions: np.ndarray,
        segments: dict[int, Segment],
        mine: Counter[Segment],
    ) -> tuple[np.ndarray, np.ndarray, dict[int, Segment]]:
        """Copy the heads at these places of a scratch store (`segments` by number) to
        the node's store, in this order, a slice at a time, counting each write in
        `mine`; returns their new places."""
        copied = np.empty(len(positions), np.int32)
        moved = np.empty(len(positions), np.int64)
        written: dict[int, Segment] = {}
        for start in range(0, len(positions), HEAD_SLICE):
            end = start + HEAD_SLICE
            found = head_store.read(numbers[start:end], positions[start:end], segments)
            heads = [head.decode("ascii") for head in found]
            segment, first = self.heads.write(heads)
            mine[segment] += len(heads)
            written[segment.number] = segment
            copied[start:end] = segment.number
            moved[start:end] = np.arange(first, first + len(heads))
        return copied, moved, written

    def _batch(self, t: pa.Table, bucket: int) -> Batch:
        """Buffer rows of one bucket in sort order, their heads written to the store: a
        table read whole (`revive`'s few rows). Raises with none of its heads counted."""
        t = t.take(pc.sort_indices(t, sort_keys=_ORDER))
        mids = t.column("message_id").to_pylist()
        numbers = np.empty(len(mids), np.int32)
        positions = np.empty(len(mids), np.int64)
        written: dict[int, Segment] = {}
        mine: Counter[Segment] = Counter()
        try:
            for start in range(0, len(mids), HEAD_SLICE):  # payloads a slice at a time
                end = start + HEAD_SLICE
                part = t.slice(start, HEAD_SLICE)
                segment, placed = self._render(self.heads, part, mids[start:end], bucket)
                mine[segment] += len(placed)
                written[segment.number] = segment
                numbers[start:end] = segment.number
                positions[start:end] = placed
        except BaseException:
            self.heads.release(mine)
            raise
        return Batch(
            mids,
            t.column("sort_key").to_numpy(),
            t.column("source_partition").to_numpy(),
            t.column("source_offset").to_numpy(),
            _epoch_s(t.column("ingested_at")),
            numbers,
            positions,
            written,
        )

    def _batches(self, t: pa.Table) -> list[tuple[int, Batch]]:
        """Rows of any buckets (read by id: a revive's, a repair's) as a batch per bucket,
        their heads written; those written are released if one bucket fails."""
        batches: list[tuple[int, Batch]] = []
        try:
            for bucket in pc.unique(t.column("bucket")).to_pylist():
                rows = t.filter(pc.equal(t.column("bucket"), bucket))
                batches.append((bucket, self._batch(rows, bucket)))
        except BaseException:
            self.heads.release(_heads_of(batch for _, batch in batches))
            raise
        return batches

    def revive(self, state: TopicState) -> int:
        """Index the `unread` messages again from the buffer; returns how many.

        Blocking (reads the buffer): run by the thread that follows the tables. A
        message settled meanwhile is skipped, and one checkpointed meanwhile has left
        `unread` (`forget`), so no settled message comes back.
        """
        if self.unfound:
            self._warn_unfound()
        with self.lock:
            self._repend_indexed(state)
            unread = dict(self.unread)
        if not unread:
            return 0
        wanted = sorted(unread.values())
        t = _read_ids(self.buffer_path, Table.BUFFER, wanted, "ingested_at")
        if missing := set(wanted).difference(t.column("message_id").to_pylist()):
            # Dead long enough for retention to have removed its buffer row: the dead
            # letters keep the message whole, stamped with its death for an ingestion.
            dead = first_per_id(
                _read_ids(self.dead_letter_path, Table.DEAD_LETTER, sorted(missing), "dead_at")
            )
            t = pa.concat_tables([t, dead], promote_options="permissive")
            lettered = dead.column("message_id").to_pylist()
            with self.lock:
                self.from_dead_letters.update(zip(mhs(lettered), lettered, strict=True))
        batches = self._batches(t)
        found = {mid for _, batch in batches for mid in batch.mids}
        found_here: set[str] = set()  # a row read twice is indexed once
        unused: Counter[Segment] = Counter()
        revived = 0
        with self.lock:
            for bucket, batch in batches:
                keep = np.array(
                    [
                        i
                        for i, (mid, h) in enumerate(zip(batch.mids, mhs(batch.mids), strict=True))
                        if h in self.unread
                        and self.store.get(mid) is None
                        and state.settled_event(mid, h) is None
                        and mid not in found_here
                        and found_here.add(mid) is None
                    ],
                    np.int64,
                )
                unused.update(_unindexed(batch, keep))
                if not len(keep):
                    continue
                tokens = self.store.add(bucket, batch, keep)
                handles = mhs(batch.mids_at(keep))
                # Awaited by handle too (a redrive's key is an override): one entry.
                self.awaited.difference_update(handles)
                for h, token in zip(handles, tokens.tolist(), strict=True):
                    self._pending(state, h, token)
                revived += len(keep)
                self.revived_since_read = True
            for h in unread:
                self.unread.pop(h, None)
        self.heads.release(+unused)
        if missing := [(h, m) for h, m in unread.items() if m not in found]:
            now = time.monotonic()
            with self.lock:
                for h, mid in missing:
                    self.unfound.setdefault(h, (mid, now))
        return revived

    def _repend_indexed(self, state: TopicState) -> None:
        """Messages pending again before this node read their rows, and indexed since by
        a `refresh`, at their rows' own keys (under the lock): a delay (a nack's, a retry
        backoff's) or a new key (a nack's priority, a redrive's) in force gets its own
        entry, as `push` would have made it; a pick drops the row's entry as stale."""
        store = self.store
        indexed = [
            (h, mid, token)
            for h, mid in self.unread.items()
            if (token := store.get(mid)) is not None
        ]
        for h, mid, token in indexed:
            del self.unread[h]
            self.awaited.discard(h)  # one entry, should a redrive await it by handle too
            overridden = h in state.not_before or h in state.sort_keys
            if overridden and state.settled_event(mid, h) is None:
                self._pending(state, h, token)
        if not self.awaited:
            return
        awaited = list(self.awaited)
        tokens = store.tokens_mh(packed_handles(awaited)).tolist()
        for h, token in zip(awaited, tokens, strict=True):
            if token:
                self.awaited.discard(h)
                if h not in state.settled and (h in state.not_before or h in state.sort_keys):
                    self._pending(state, h, token)

    def _warn_unfound(self) -> None:
        """Warn of the messages pending again with a row nowhere that no trim has
        forgotten within UNFOUND_GRACE_S. A node catching up (a restart applying its log)
        makes pending again what a later entry settles, whose row retention may have
        removed since; that entry's trim comes next, and forgets it (`forget`)."""
        now = time.monotonic()
        with self.lock:
            gone = [(h, m) for h, (m, t) in self.unfound.items() if now - t >= UNFOUND_GRACE_S]
            for h, _ in gone:
                del self.unfound[h]
            late = sorted(m for _, m in gone)
        if late:
            log.warning(
                "%s: %d messages pending again have neither a buffer row nor a dead letter, "
                "so they cannot be leased: %s",
                self.topic.name,
                len(late),
                late[:10],
            )

    # --- hooks from the Raft state machine ------------------------------------------------

    def push(self, state: TopicState, handles: list[int]) -> None:
        """Messages pending again (lease expired, nacked, rescheduled, redriven, consumer
        left), by message handle, as the state names them.

        One with no row here: a redriven one is read from the buffer by its id, which
        the state keeps (`revive`); any other was leased or rescheduled from a row this
        node has not read yet, and is indexed when a `refresh` reads it, at its row's
        key, and at a delay or an override in force (`awaited`)."""
        if not handles:
            return
        with self.lock:
            tokens = self.store.tokens_mh(packed_handles(handles)).tolist()
            for h, token in zip(handles, tokens, strict=True):
                if token:
                    self._pending(state, h, token)
                elif (mid := state.redriven_ids.get(h)) is not None:
                    self.unread[h] = mid
                else:
                    self.awaited.add(h)

    def _unread(self, mids: Iterable[str]) -> None:
        """Messages pending again with no row here (under the lock): `revive` reads them."""
        mids = list(mids)
        self.unread.update(zip(mhs(mids), mids, strict=True))

    def _pending(self, state: TopicState, h: int, token: int) -> None:
        """An entry for a pending message of handle `h` (under the lock): delayed, or at
        its sort key."""
        not_before = state.not_before.get(h)
        if not_before is not None:
            heapq.heappush(self.delayed, (not_before, h))
            if len(self.delayed) > 2 * len(state.not_before) + DELAYED_SLACK:
                self._drop_stale_delays(state)
        else:
            self._due(state, h, token)

    def _drop_stale_delays(self, state: TopicState) -> None:
        """Keep the delayed entries the state still holds (under the lock). Only a pick
        pops them, so a follower's would hold one for each delay ever made; a delay
        ends with its message's lease (`grant`), or is replaced by a later one."""
        held = state.not_before
        self.delayed = sorted({(nb, h) for nb, h in self.delayed if held.get(h) == nb})

    def _due(self, state: TopicState, h: int, token: int) -> None:
        """An entry at the sort key in force of the message of handle `h`, on its
        bucket's heap (under the lock)."""
        row = self.store.row(token)
        key = state.sort_key(h, row.sort_key)
        self.order.push(row.bucket, key, row.partition, row.offset, token)

    def _add(self, bucket: int, tokens: np.ndarray) -> None:
        """New rows of a bucket: pushed on its heap while that stays small next to the
        run, else merged into the run, with the heap's entries at their row's own key
        (the others, re-keyed by a nack or a reschedule, stay in the heap): a sort once
        per run/8 rows added. A merge drops the tokens of messages forgotten since, or
        a follower's runs (it never picks) would hold every message it ever saw."""
        self.order.add(bucket, tokens, RUN_MIN, *self._columns())

    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The columns the order reads a token's place from (under the lock: a growth
        or a shrink replaces them)."""
        store = self.store
        return store.batch, store.sort_key, store.partition, store.offset

    def forget(self, handles: bytes) -> None:
        """Settled messages checkpointed into the ledger, named by their message handles
        packed (as a trim returns them, `TopicState.trim`): gone for good.

        One without a row here is remembered until the next `refresh`: its row is in a
        version this node has not read yet.
        """
        with self.lock:
            # Entries left behind are dropped when they surface.
            released, missing = self.store.forget_mh(handles)
            self.forgotten.update(missing)
            self.heads.release(released)
            if self.from_dead_letters or self.unread or self.awaited or self.unfound:
                gone = handles_in(handles)
                for named in (self.from_dead_letters, self.unread, self.unfound):
                    if named:
                        deque(map(named.pop, gone, repeat(None)), maxlen=0)
                if self.awaited:
                    self.awaited.difference_update(gone)

    def ids_of(self, handles: bytes) -> list[str | None]:
        """The id of each message whose handle `handles` packs (16 bytes each), None for
        one with no row here."""
        return self.id_column(handles).to_pylist()

    def id_column(self, handles: bytes) -> pa.ChunkedArray:
        """`ids_of` as an Arrow string column (null where no row here holds one): the
        leader names the events the state holds by handle so when it writes them to the
        ledger, the column made from the id table's bytes (`IdTable.arrow_ids`). Under
        the lock a slice at a time: a checkpoint of 50,000 events would otherwise hold
        the event loop for all of them."""
        chunks: list[pa.Array] = []
        step = NAME_SLICE * WIDTH
        for i in range(0, len(handles), step):
            with self.lock:
                table = self.store.table
                chunks.append(table.arrow_ids(table.find_mh(handles[i : i + step])[0]))
        return pa.chunked_array(chunks, pa.string())

    def ids_in_tables(self, handles: Set[int]) -> dict[int, str]:
        """The ids of the messages of `handles` whose rows the buffer or the dead letters
        hold, found by hashing every id they hold, once this index has read the
        buffer's current version (else {}: the rows may be in the versions it has yet to
        read, and a refresh brings them). For a row the index read and dropped: one the
        ledger had settled when it loaded (another history's ledger, its state's events
        naming it still), or forgotten. Blocking, and costly: a read of both tables' ids,
        so once per change of either table for handles in neither (a message whose row
        retention removed, asked for each checkpoint round while its event waits)."""
        version = DeltaTable(self.buffer_path).version()
        if version != self.version:
            return {}
        dead_version = DeltaTable(self.dead_letter_path).version()
        read_at, dead_read_at, absent = self._not_in_tables
        if (read_at, dead_read_at) == (version, dead_version) and handles <= absent:
            return {}
        named: dict[int, str] = {}
        for path, table in (
            (self.buffer_path, Table.BUFFER),
            (self.dead_letter_path, Table.DEAD_LETTER),
        ):
            mids = scan(path, table, ["message_id"]).column("message_id").to_pylist()
            named.update((h, m) for h, m in zip(mhs(mids), mids, strict=True) if h in handles)
        self._not_in_tables = (version, dead_version, frozenset(handles - named.keys()))
        return named

    def rebuild(self, state: TopicState) -> None:
        """After a snapshot replaced the state wholesale: re-derive every entry.

        The snapshot can cover trims this node never applied (it was behind), so the
        messages they settled are found in the ledger's tail, written before each trim,
        and forgotten. Rows it holds that the buffer no longer has are messages that
        settled before the retention watermark, or died, left the buffer and were
        redriven since: the ledger from their rows' ingestion on says which, for them
        alone (`_ingested_from`). Reads the ledger's tails and the buffer's ids: a
        snapshot arrives rarely, to a node that lags. Not when the ledger is as `load`
        read it and nothing was revived since (a node starting from its own snapshot).
        """
        settled: set[str] = set()
        revived: set[str] = set()
        ledger_moved = DeltaTable(self.ledger_path).version() != self.ledger_version
        if ledger_moved or self.revived_since_read:
            settled, revived = self._settled_ids()
            buffered = scan(self.buffer_path, Table.BUFFER, ["message_id"]).column("message_id")
            with self.lock:
                held = set(self.rows).difference(self.from_dead_letters.values())
                gone = sorted(held.difference(buffered.to_pylist()))
                since = self._ingested_from(gone) - CLOCK_SKEW_MS
            if gone:
                done, again = split(latest_events(self.ledger_path, since, gone))
                settled.update(done, again)  # its row here is the buffer's: the dead letter's next
                revived.update(again)
        store = self.store
        with self.lock:
            released, missing = store.forget(list(settled))
            self.heads.release(released)
            # Settled in a version this node has not read yet (the trims the snapshot
            # covers came before it read the row): skipped when it does, as `forget`'s.
            self.forgotten.update(mhs(missing))
            # What earlier commands pushed without a row is history the snapshot replaced
            # (a journal replayed over tables that had settled it since): pending without
            # a row now means redriven since its row left, or given a new key before this
            # node read its row (indexed at it once read, `revive`; a delay's entry is the
            # delayed heap's, below).
            again = revived | set(state.redriven_ids.values())
            self.unread = {}
            self._unread(m for m in again if store.get(m) is None and m not in state.leases)
            keyed = list(state.sort_keys.keys() - state.not_before.keys())
            tokens = store.tokens_mh(packed_handles(keyed)).tolist()
            self.awaited = {
                h for h, t in zip(keyed, tokens, strict=True) if not t and h not in state.leases
            }
            self.unfound.clear()
            self._reorder(state, range(self.topic.buckets))
            self.delayed = [(nb, h) for h, nb in state.not_before.items()]
            heapq.heapify(self.delayed)

    def _ingested_from(self, mids: list[str]) -> int:
        """The earliest ingestion (epoch ms) of the rows held of `mids` (under the lock;
        0: none held).

        A message settles only once the leader has read its row (a lease, a cancel), and
        a redrive follows a death, so no event of a held row's message is older, but for
        the clocks of the ingest and the leaders, which `CLOCK_SKEW_MS` allows for: a
        ledger read for them starts there, not at the ledger's first event.
        """
        store = self.store
        tokens = [t for m in mids if (t := store.get(m)) is not None]
        return min((store.row(t).ingested_at for t in tokens), default=0)

    def _reorder(self, state: TopicState, buckets: Iterable[int]) -> None:
        """Re-derive the order of `buckets` from the rows held (under the lock): re-keyed
        messages in the heaps at their keys, the others in the runs at their rows'. A pick
        drops what is leased, settled or delayed as stale."""
        store = self.store
        wanted = sorted(set(buckets))
        heaps: dict[int, list[tuple[int, int, int, int]]] = {b: [] for b in wanted}
        overrides = list(state.sort_keys.items())
        tokens = store.tokens_mh(packed_handles(h for h, _ in overrides))
        for (_, key), token in zip(overrides, tokens.tolist(), strict=True):
            if token:
                row = store.row(token)
                if row.bucket in heaps:
                    heaps[row.bucket].append((key, row.partition, row.offset, token))
        h = store.stored()
        if len(wanted) < self.topic.buckets:
            h = h[np.isin(store.bucket[h], wanted)]
        if overrides:  # re-keyed: in the heaps, at their overrides
            h = h[~np.isin(h, tokens[tokens != 0] & HANDLE_MASK)]
        tokens = store.tokens_at(h)
        in_bucket = store.bucket[h]
        for b, heap in heaps.items():
            run = store.order(tokens[in_bucket == b])
            self.order.replace(b, run, np.array(heap, np.int64).reshape(-1))

    # --- leader side -----------------------------------------------------------------

    def pick(self, state: TopicState, buckets: list[int], n: int, now: int) -> Picks:
        """Take the `n` lowest deliverable sort keys across `buckets` out of the index,
        as a lease command carries them (`Picks`: the core packs their handles, buckets
        and keys as it picks).

        The caller commits them as a lease and then calls `release` with the picks, so
        a pick the state machine refused goes back into the index. Two leases in flight
        can pick the same message only through a duplicate entry; the state machine
        grants it once, and `release` puts the other pick back.
        """
        with self.lock:
            return self.order.pick(buckets, n, *self._pick_args(state, now))[0]

    def pick_with_heads(
        self, state: TopicState, buckets: list[int], n: int, now: int
    ) -> tuple[Picks, Heads]:
        """`pick`, and each pick's row sort key and head, for the lease's JSON: read now,
        as the index may forget the row (and its head) before the lease commits. One
        call into the core, which holds the columns between calls (`release_columns`)."""
        with self.lock:
            store = self.store
            try:
                picks, read = self.order.pick_heads(
                    buckets,
                    n,
                    *self._pick_args(state, now),
                    store.segment,
                    store.position,
                    store.segments,
                    SPAN_PER_HEAD,
                )
            except Exception as e:
                # The core takes the picks out of the order before it reads their heads,
                # and hands none back when a read fails: the buckets are re-derived from
                # the rows, or the picks would lease nowhere until the node restarted.
                self._reorder(state, buckets)
                raise self._unreadable("reading heads to lease", e) from e
            return picks, Heads(*read)

    def due(self, buckets: list[int], timeline: bool) -> int | None:
        """When time alone may next make a message of `buckets` leasable: the first end
        of a delay (a nack's, a retry backoff's; of any bucket, kept apart from the
        buckets until then), and on a timeline the lowest sort key of `buckets`'
        messages, when the next is due (`Order.lowest`); None if neither is known. Maybe
        early (an entry no longer its message's), never late."""
        with self.lock:
            dues = [self.delayed[0][0]] if self.delayed else []
            if timeline and (lowest := self.order.lowest(buckets)) is not None:
                dues.append(lowest)
        return min(dues, default=None)

    def repairing(self) -> bool:
        """Whether a read of heads failed and `repair_heads` has not read them again."""
        return self.heads_failed is not None or len(self.damaged) > 0

    def _unreadable(self, doing: str, error: Exception) -> HeadsUnreadable:
        """A read of heads failed (under the lock): noted for `repair_heads`, and logged
        unless a repair is under way already. Not noted while damaged heads wait for
        their repair: the read failed on those (a long poll trying again, a peek), or it
        fails again once they have moved and is noted then; noted, it would send the
        next repair looking for damage it has already repaired."""
        failed = HeadsUnreadable(f"{self.topic.name}: {doing}: {error}")
        if not self.repairing():
            log.error("%s; reading them again from the buffer", failed)
        if not len(self.damaged):
            self.heads_failed = str(failed)
        return failed

    def _pick_args(self, state: TopicState, now: int) -> tuple:
        """`Order.pick`'s arguments from `max_key` to `long`, the delayed messages due by
        `now` put back first; the caller holds the lock."""
        while self.delayed and self.delayed[0][0] <= now:
            not_before, h = heapq.heappop(self.delayed)
            token = int(self.store.tokens_mh(packed_handles([h]))[0])
            if token:
                self._due(state, h, token)
            elif state.not_before.get(h) == not_before:  # its row not read here yet
                self.awaited.add(h)
        table = self.store.table
        ids = table.ids
        if self._ids is not ids:  # the same view while the column is, as the core holds it
            self._ids, self._ids_bytes = ids, ids.view(np.uint8)
        due = now if self.timeline else NO_LIMIT  # a timeline's key is its time
        # Stale entries are dropped as they are met: settled, leased, delayed by a
        # nack (the delayed heap holds it) or re-keyed (a newer entry holds it).
        state_maps = (state.settled, state.leases, state.not_before, state.sort_keys)
        return (
            due,
            now,
            state_maps,
            *self._columns(),
            self._ids_bytes,
            ids.dtype.itemsize,
            table.long,
        )

    def release_columns(self) -> None:
        """Let go of the columns the pick holds (`Order.pick_heads`), so that arrays the
        store has since replaced (grown, narrowed, shrunk) are freed: called after each
        round of the steps that replace them, which a node runs whether it leads or not."""
        with self.lock:
            self.order.release_columns()  # and the blocks of heads it read
            self._ids = self._ids_bytes = None
            self.heads.recycle()

    def row(self, mid: str) -> Row | None:
        """An indexed message's row (None once forgotten)."""
        with self.lock:
            token = self.store.get(mid)
            return None if token is None else self.store.row(token)

    def head(self, message: str | int) -> Taken | None:
        """An indexed message's row sort key and head (None once forgotten), the message
        named by id (a peek's) or by handle (a lease record's). Raises `HeadsUnreadable`
        where the node cannot read it, noted for a repair."""
        with self.lock:
            if type(message) is str:
                token = self.store.get(message)
            else:
                token = int(self.store.tokens_mh(packed_handles([message]))[0]) or None
            if token is None:
                return None
            try:
                return self.store.heads(np.array([token], np.int64))[0]
            except Exception as e:
                named = message if type(message) is str else f"handle {message:032x}"
                raise self._unreadable(f"reading the head of {named}", e) from e

    def close(self) -> None:
        """Free the head store's files (they go with the process anyway)."""
        self.heads.close()

    def repair_heads(self) -> int:
        """Read again from the buffer the heads that cannot be read, into fresh segments,
        once a read of heads has failed; returns how many. The heads are a cache of the
        buffer's rows: a segment the disk fails (an I/O error, a file cut short) would
        otherwise fail every lease that picks its messages, the lowest keys, for as long
        as the node runs. Run by the thread that follows the tables, which alone writes
        heads. Raises `HeadsUnreadable` while some cannot be read again (the buffer
        failing too), kept for the next call.

        The failure stays noted until the damage found takes its place, in one hold of
        the lock, so that the repair is under way (`repairing`) from the failure until
        the heads have moved: a reader waiting on it does not read them meanwhile."""
        with self.lock:
            failed = self.heads_failed
        if failed is not None and not len(self.damaged):
            found = self._unreadable_heads()
            with self.lock:
                # A read that failed during the search met what it found, or fails again.
                self.heads_failed = None
                self.damaged = np.union1d(self.damaged, found)
                if not len(self.damaged):
                    raise HeadsUnreadable(f"{failed}, yet every head held reads whole")
        if not len(self.damaged):
            return 0
        moved, unfound = self._read_again(self.damaged)
        with self.lock:
            self.damaged = unfound[current(self.store.batch, unfound)]
            if len(self.damaged):
                raise HeadsUnreadable(
                    f"{self.topic.name}: {len(self.damaged)} messages' heads cannot be read, "
                    "and neither the buffer nor the dead letters hold their rows"
                )
        return moved

    def _unreadable_heads(self) -> np.ndarray:
        """The tokens whose heads cannot be read (`_unreadable_in`), their segments
        retired (`HeadStore.retire`)."""
        store = self.store
        with self.lock:
            h = store.stored()
            tokens = store.tokens_at(h)
            numbers = store.segment[h]
            positions = store.position[h].astype(np.int64)
        found = [np.zeros(0, np.int64)]
        for number in np.unique(numbers).tolist():
            at = numbers == number
            lost = self._unreadable_in(number, positions[at])
            if lost.any():
                found.append(tokens[at][lost])
                with self.lock:
                    segment = store.segments.get(number)
                if segment is not None:
                    self.heads.retire([segment])
        return np.concatenate(found)

    def _unreadable_in(self, number: int, positions: np.ndarray) -> np.ndarray:
        """Which heads at `positions` of segment `number` cannot be read: past its ends, in
        a range its file fails or ends before, or not a head (a head starts with "{" and
        is followed by SEP; a file cut and written past its end again reads zeros there).
        Read CHECK_READ at a time under the lock, which keeps the segment open."""
        with self.lock:
            segment = self.store.segments.get(number)
            if segment is None:
                return np.ones(len(positions), bool)
            ends = np.frombuffer(segment.ends, np.uint32).astype(np.int64)
        lost = positions >= len(ends)
        if lost.all():
            return lost
        p = np.where(lost, 0, positions)
        stops = np.where(lost, 0, ends[p])
        starts = np.where(lost | (p == 0), 0, ends[np.maximum(p - 1, 0)])
        read_to = int(stops.max())
        for at in range(int(starts[~lost].min()), read_to, CHECK_READ):
            size = min(CHECK_READ, read_to - at)
            failed = False
            with self.lock:
                if segment.file.closed:  # freed: its messages settled meanwhile
                    return np.zeros(len(positions), bool)
                try:
                    data = os.pread(segment.fd, size, at)
                except OSError:
                    data, failed = b"", True
            got = np.frombuffer(data, np.uint8)
            end = at + len(got)
            if len(got) < size:  # the range failed, or the file ends early: all past it
                lost |= (starts < (at + size if failed else read_to)) & (stops > end)
            first = (starts >= at) & (starts < end)
            lost[first] |= got[starts[first] - at] != ord("{")
            last = (stops > at) & (stops <= end)
            lost[last] |= got[stops[last] - 1 - at] != SEP[0]
            if len(got) < size and not failed:
                break
        return lost

    def _read_again(self, tokens: np.ndarray) -> tuple[int, np.ndarray]:
        """Render the heads of `tokens` again from their rows (the buffer's, else the
        dead letters'), found by id and coordinates, into the head store, and move the
        rows still indexed to them; returns how many moved, and the tokens whose rows
        neither table holds."""
        store = self.store
        with self.lock:
            tokens = tokens[current(store.batch, tokens)]
            h = tokens & HANDLE_MASK
            mids = store.table.mids(h)
            wanted = dict(
                zip(
                    zip(mids, store.partition[h].tolist(), store.offset[h].tolist(), strict=True),
                    tokens.tolist(),
                    strict=True,
                )
            )
        if not wanted:
            return 0, tokens
        ids = sorted(set(mids))
        buffered = _read_ids(self.buffer_path, Table.BUFFER, ids, "ingested_at")
        rows = _coordinated(buffered, wanted.keys())
        if missing := set(wanted).difference(_coordinates(rows)):
            dead = _read_ids(
                self.dead_letter_path,
                Table.DEAD_LETTER,
                sorted({mid for mid, _, _ in missing}),
                "dead_at",
            )
            rows = pa.concat_tables(
                [rows, _coordinated(dead, missing)],
                promote_options="permissive",
            )
        batches = self._batches(rows)
        unused: Counter[Segment] = Counter()
        moved = 0
        with self.lock:
            for _, batch in batches:
                was = np.array([wanted.get(c, 0) for c in _coordinates_of(batch)], np.int64)
                keep = np.flatnonzero((was != 0) & current(store.batch, was))
                unused.update(_unindexed(batch, keep))
                for number, segment in batch.written.items():
                    at = keep[batch.segment[keep] == number]
                    if len(at):
                        unused.update(
                            store.move(was[at] & HANDLE_MASK, segment, batch.position[at])
                        )
                moved += len(keep)
        self.heads.release(+unused)
        found = {c for _, batch in batches for c in _coordinates_of(batch)}
        return moved, np.array([t for c, t in wanted.items() if c not in found], np.int64)

    def compact_heads(self, now: float | None = None) -> int:
        """Move the heads still live in segments that have stayed mostly settled
        (`HeadStore.sparse`, at `now`) to the current one, so those segments go; returns
        how many moved: up to COMPACT_BYTES of heads, the rest in the next calls. Run by
        the thread that follows the tables, which alone adds rows: a moved message keeps
        its handle and entries, only its head's place changes."""
        if self.repairing():  # the heads to move may be the ones that cannot be read
            return 0
        sparse = set(self.heads.sparse(now))
        if not sparse:
            return 0
        store = self.store
        with self.lock:
            numbers = store.segment[: store.size].copy()
        # Freed handles keep their last segment's number: the tokens below drop them.
        handles = np.flatnonzero(np.isin(numbers, [s.number for s in sparse]))
        del numbers
        with self.lock:
            tokens = store.tokens_at(handles)
            tokens = store.order(tokens[tokens != 0])
            # A bucket's in its sort order, as a first write.
            h = tokens & HANDLE_MASK
            tokens = tokens[np.argsort(store.bucket[h], kind="stable")]
            held = {store.segments[n] for n in np.unique(store.segment[h]).tolist()}
            tokens = tokens[: self._within(tokens, COMPACT_BYTES)]
        if orphans := sparse.difference(held):
            log.warning("%s: %d head segments held by no message", self.topic.name, len(orphans))
            self.heads.release({s: s.live for s in orphans})
        tokens, joined, ends = self._read_heads(tokens)
        if not len(tokens):
            return 0
        h = tokens & HANDLE_MASK
        new, first = self.heads.write_joined(joined, ends)
        del joined
        with self.lock:
            still = current(store.batch, tokens)  # not settled and forgotten meanwhile
            unused = store.move(h[still], new, first + np.flatnonzero(still))
        moved = int(np.count_nonzero(still))
        if moved < len(still):
            unused[new] += len(still) - moved
        self.heads.release(unused)
        return moved

    def _within(self, tokens: np.ndarray, limit: int) -> int:
        """How many of `tokens`, from the first, have heads of at most `limit` bytes in
        all (at least one), from their segments' ends (under the lock)."""
        store = self.store
        h = tokens & HANDLE_MASK
        numbers, positions = store.segment[h], store.position[h].astype(np.int64)
        sizes = np.empty(len(h), np.int64)
        for number in np.unique(numbers).tolist():
            at = numbers == number
            ends = np.frombuffer(store.segments[number].ends, np.uint32).astype(np.int64)
            p = positions[at]
            sizes[at] = ends[p] - np.where(p > 0, ends[p - 1], 0)
        return max(1, int(np.searchsorted(np.cumsum(sizes), limit, side="right")))

    def _read_heads(self, tokens: np.ndarray) -> tuple[np.ndarray, bytes, np.ndarray]:
        """The tokens still indexed among `tokens`, their heads as a segment holds them,
        and where each one's separator ends there: read COMPACT_READ at a time under the
        lock, which keeps their segments open. A lease waits for the lock, and with it
        the event loop and Raft's heartbeats: ~100,000 heads read in one hold would keep
        it a few hundred ms. No Python object per head: every node moves the same heads
        at the same time."""
        kept, parts, ends = [], [], []
        read_to = 0
        for start in range(0, len(tokens), COMPACT_READ):
            with self.lock:
                part = tokens[start : start + COMPACT_READ]
                part = part[current(self.store.batch, part)]  # not settled meanwhile
                try:
                    joined, part_ends = self.store.separated_heads(part)
                except Exception as e:
                    raise self._unreadable("reading heads to move", e) from e
            kept.append(part)
            parts.append(joined)
            ends.append(part_ends + np.int64(read_to))
            read_to += len(joined)
        if not kept:
            return tokens, b"", np.zeros(0, np.int64)
        return np.concatenate(kept), b"".join(parts), np.concatenate(ends)

    def narrow_ids(self) -> None:
        """Narrow the id column once the longest ids in it are gone (`IdTable.narrow`).
        Run by the thread that follows the tables, which alone adds rows."""
        width = self.store.table.narrow(self.lock)
        if width is not None:
            log.info("%s: id column narrowed to %d bytes", self.topic.name, width)

    def shrink(self) -> None:
        """Renumber the rows once that halves the columns (`RowStore.shrink`), and move
        the tokens the order holds to the new handles, dropping stale ones. Run
        by the thread that follows the tables, which alone adds rows; under the lock,
        as the tokens must move with the rows (at most a few hundred ms for a million)."""
        with self.lock:
            before, size = self.store.batch, self.store.size
            new = self.store.shrink()
            if new is None:
                return

            def moved(tokens: np.ndarray) -> np.ndarray:
                return (tokens & ~HANDLE_MASK) | new[tokens & HANDLE_MASK]

            self.damaged = moved(self.damaged[current(before, self.damaged)])

            store = self.store
            for b in range(self.topic.buckets):
                tokens, keys = self._entries(b)
                ran = len(tokens) - len(keys)
                live = current(before, tokens)
                run = moved(tokens[:ran][live[:ran]])
                heap = moved(tokens[ran:][live[ran:]])
                h = heap & HANDLE_MASK
                # A heap entry keeps its key (a re-keyed message's); its coordinates
                # are its row's.
                rows = [keys[live[ran:]], store.partition[h], store.offset[h], heap]
                self.order.replace(b, run, np.column_stack(rows).astype(np.int64).reshape(-1))
        log.info(
            "%s: rows renumbered: %d handles down to %d", self.topic.name, size, len(self.rows)
        )

    def _entries(self, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """A bucket's tokens (its run's in order, then its heap's) and its heap entries'
        keys (under the lock)."""
        tokens, keys = self.order.entries(bucket)
        return np.frombuffer(tokens, np.int64), np.frombuffer(keys, np.int64)

    def release(self, state: TopicState, picks: Picks) -> None:
        """Picks the lease did not take (or that were not committed) are pending again."""
        handles, buckets, keys = unpacked(picks)
        with self.lock:
            tokens = self.store.tokens_mh(picks[0]).tolist()
            for h, token, bucket, key in zip(handles, tokens, buckets, keys, strict=True):
                if h in state.leases or h in state.settled:
                    continue  # the usual case: taken
                if token:
                    row = self.store.row(token)
                    self.order.push(bucket, key, row.partition, row.offset, token)

    # --- reads -----------------------------------------------------------------------

    def settled_event(self, mid: str) -> str | None:
        """The ledger's terminal event for a message settled since the buffer's
        retention watermark, if it has one.

        The index forgets settled messages, so a question about one (peek, cancel,
        reschedule) reads the ledger: its tail from the watermark, as a start does, so
        that a question, of an unknown id too, costs the tail and not the ledger's
        history. A message settled before the watermark has left the buffer as well;
        its record is the ledger table's. Blocking: call it off the event loop.
        """
        since = watermark(DeltaTable(self.buffer_path))
        last = latest_events(self.ledger_path, since, [mid]).column("event_last").to_pylist()
        return last[0] if last and last[0] != LedgerEvent.REDRIVEN else None

    def dead(
        self, ids: list[str] | None, history: History = ("", 0)
    ) -> tuple[int, dict[str, tuple[int, int]], dict[str, int]]:
        """What the ledger says about deaths, for a redrive of `ids` (None: all); its
        checkpoint seq counted in the state's `history`.

        Returns the checkpoint seq the ledger was read at; the dead not redriven since,
        each with its bucket and sort key at its last death; and the ids redriven since
        their last death, each with its redrive's time (epoch ms). The dead letters name
        the candidates (they hold deaths only), and the ledger is read from the earliest
        of their last deaths on, less the clock skew a redrive stamped by another leader
        may show: its cost follows how long ago they last died, not the ledger's history.
        A death whose dead letter is not written yet is still in Raft (`TopicState.trim`'s
        `keep`), where the caller looks too. Blocking: call it off the event loop.
        """
        table = DeltaTable(self.ledger_path)
        upto = max(table.transaction_version(app_id(history[0])) or 0, history[1])
        named = None if ids is None else matching(Table.DEAD_LETTER, message_id=ids)
        letters = scan(self.dead_letter_path, Table.DEAD_LETTER, ["message_id", "dead_at"], named)
        if not letters.num_rows:
            return upto, {}, {}
        # Each message's last death: what came before it does not say what it is now.
        last_deaths = letters.group_by("message_id", use_threads=False).aggregate(
            [("dead_at", "max")]
        )
        first_ms = pc.min(last_deaths.column("dead_at_max")).value // 1000
        candidates = None if ids is None else sorted(set(letters.column("message_id").to_pylist()))
        last = latest_events(
            self.ledger_path,
            first_ms - CLOCK_SKEW_MS,
            candidates,
            events=DEATHS,
            also=("bucket", "sort_key"),
        )
        died = pc.equal(last.column("event_last"), LedgerEvent.DEAD)
        dead_rows = last.filter(died)
        dead = {
            mid: (bucket, key)
            for mid, bucket, key in zip(
                dead_rows.column("message_id").to_pylist(),
                dead_rows.column("bucket_last").to_pylist(),
                dead_rows.column("sort_key_last").to_pylist(),
                strict=True,
            )
        }
        again = last.filter(pc.invert(died))
        redriven = dict(
            zip(
                again.column("message_id").to_pylist(),
                (at.value // 1000 for at in again.column("at_last")),
                strict=True,
            )
        )
        return upto, dead, redriven

    def pending(self, state: TopicState) -> list[Pick]:
        """Every indexed message neither settled nor leased, at its row's sort key (a
        purge's list). Off the event loop, on a copy taken under the lock."""
        with self.lock:
            h = self.store.stored()
            mids = self.store.table.mids(h)
            buckets, keys = self.store.bucket[h].tolist(), self.store.sort_key[h].tolist()
        settled, leases = state.settled, state.leases
        return [
            (m, b, k)
            for m, h, b, k in zip(mids, mhs(mids), buckets, keys, strict=True)
            if h not in settled and h not in leases
        ]

    def held(self, picks: list[Pick]) -> list[Pick]:
        """The picks whose messages the index still holds (not forgotten by a trim)."""
        with self.lock:
            tokens = self.store.tokens([mid for mid, _, _ in picks])
        return [p for p, token in zip(picks, tokens.tolist(), strict=True) if token]

    def stats(self, state: TopicState, now: int) -> tuple[dict[int, Stats], int]:
        """Per-bucket pending/deliverable counts and oldest ingestion; delayed count."""
        # Walks every entry: on a copy, so the lock (and the event loop waiting for it)
        # is held for copies, not for the walk. Rows checkpointed meanwhile are skipped;
        # the counts are a moment's view either way.
        store = self.store
        with self.lock:
            # By handle: a handle freed meanwhile may be another's.
            ids, long = store.table.ids.copy(), dict(store.table.long)
            parts = []
            for b in range(self.topic.buckets):
                tokens, heap_keys = self._entries(b)
                keys = store.sort_key[tokens & HANDLE_MASK]
                keys[len(tokens) - len(heap_keys) :] = heap_keys
                # The entries of freed handles are left out: a freed handle's id slot
                # may hold the digest of a long id whose whole copy is gone.
                live = current(store.batch, tokens)
                tokens, keys = tokens[live], keys[live]
                h = tokens & HANDLE_MASK
                parts.append((tokens, h, keys, store.sort_key[h], store.ingested_at[h]))
            delayed_handles = [m for _, m in self.delayed]
        counted: list[tuple[np.ndarray, list[int], list[bool]]] = []
        for tokens, h, *columns in parts:
            seen: set[str] = set()
            taken: list[int] = []
            ingested: list[int] = []
            ready: list[bool] = []
            mids = decode(ids, long, h)
            lists = [c.tolist() for c in columns]
            handles = mhs(mids)
            for token, mid, m, key, base_key, at in zip(
                tokens.tolist(), mids, handles, *lists, strict=True
            ):
                if mid in seen or m in state.settled:
                    continue
                if m in state.leases or key != state.sort_key(m, base_key):
                    continue
                seen.add(mid)
                taken.append(token)
                ingested.append(at)
                ready.append(
                    state.not_before.get(m, 0) <= now and (not self.timeline or key <= now)
                )
            counted.append((np.array(taken, np.int64), ingested, ready))
        # A message a trim forgot during the walk has left the settled set, so it was
        # counted: the index no longer holding it tells it apart.
        with self.lock:
            held = [current(store.batch, tokens).tolist() for tokens, _, _ in counted]
        out: dict[int, Stats] = {}
        for b, ((_, ingested, ready), still) in enumerate(zip(counted, held, strict=True)):
            at = [a for a, kept in zip(ingested, still, strict=True) if kept]
            deliverable = sum(r for r, kept in zip(ready, still, strict=True) if kept)
            out[b] = Stats(len(at), deliverable, min(at) * 1000 if at else None)
        delayed = len({m for m in delayed_handles if m not in state.leases})
        return out, delayed


def _named(handles: list[int], named: Set[int]) -> np.ndarray:
    """A mask of `handles` (message handles) in `named`."""
    return np.fromiter((h in named for h in handles), bool, len(handles))


def _read_ids(path: str, table: Table, ids: list[str], ingested_at: str) -> pa.Table:
    """The rows of `ids` in a table holding buffer columns, `ingested_at` taken from the
    named column."""
    columns = ["bucket", *(c for c in _COLUMNS if c != "ingested_at"), *_COORDS, ingested_at]
    t = scan(path, table, columns, matching(table, message_id=ids))
    return t.rename_columns([*columns[:-1], "ingested_at"])


def _coordinates(t: pa.Table) -> list[tuple[str, int, int]]:
    """Each row's id and place in its source (partition, offset): a row of the index."""
    columns = ("message_id", "source_partition", "source_offset")
    return list(zip(*(t.column(c).to_pylist() for c in columns), strict=True))


def _coordinates_of(batch: Batch) -> Iterator[tuple[str, int, int]]:
    """`_coordinates` of a batch's rows."""
    return zip(batch.mids, batch.partition.tolist(), batch.offset.tolist(), strict=True)


def _coordinated(t: pa.Table, wanted: Set[tuple[str, int, int]]) -> pa.Table:
    """The rows of `t` at `wanted` (`_coordinates`), one each."""
    rows: dict[tuple[str, int, int], int] = {}
    for i, c in enumerate(_coordinates(t)):
        if c in wanted:
            rows.setdefault(c, i)
    return t.take(pa.array(sorted(rows.values()), pa.int64()))


def _ms(timestamps: pa.ChunkedArray) -> list[int | None]:
    """Epoch milliseconds of a microsecond timestamp column."""
    return [None if us is None else us // 1000 for us in pc.cast(timestamps, "int64").to_pylist()]


def _files(actions: dict[str, list]) -> Iterator[tuple[str, int, int | None]]:
    """A snapshot's files (its add actions, as columns): path, bucket and row count."""
    return zip(actions["path"], actions["partition.bucket"], actions["num_records"], strict=True)


def _pre_buffer(uri: str) -> bool:
    """Whether to read a file's column chunks ahead, on Arrow's I/O threads: on an
    object store, where it makes one request of many. Not on a local disk, where it
    saves nothing, and what those threads allocated and the reader freed stays in their
    allocator's free lists: ~5 bytes a pending message on a node that loaded a million."""
    return "://" in uri and not uri.startswith("file://")


def _slices(uri: str) -> Iterator[pa.Table]:
    """A buffer file's rows, HEAD_SLICE at a time, as `_FILE_SCHEMA`."""
    file = pq.ParquetFile(uri, pre_buffer=_pre_buffer(uri))
    columns = [c for c in _COLUMNS + _COORDS if c in file.schema_arrow.names]
    for rows in file.iter_batches(HEAD_SLICE, columns=columns, use_threads=False):
        # delta-rs's MERGE (retention) writes strings as Arrow views: plain ones here.
        yield conform(pa.Table.from_batches([rows]), _FILE_SCHEMA)


def _epoch_s(column: pa.ChunkedArray) -> np.ndarray:
    """Epoch seconds of a microsecond timestamp column."""
    return pc.divide(pc.cast(column, pa.int64()), 1_000_000).to_numpy()


def _heads_of(batches: Iterable[Batch]) -> Counter[Segment]:
    """Every head written for `batches`, by segment: to release when none is indexed."""
    counts: Counter[Segment] = Counter()
    for batch in batches:
        counts.update(batch.by_segment(batch.segment))
    return counts


def _unindexed(batch: Batch, keep: np.ndarray) -> Counter[Segment]:
    """Heads written for the rows of `batch` not among `keep`, by segment: to release."""
    dropped = np.ones(len(batch.mids), bool)
    dropped[keep] = False
    return batch.by_segment(batch.segment[dropped])
