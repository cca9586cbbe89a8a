"""Settled messages, and new keys of pending ones, waiting to be checkpointed into the
ledger: runs of columns for acks, one tuple per other event.

Every node keeps them, and every ack adds to them. A bulk ack of a whole lease is one
`Run` holding slices of the lease record's columns; smaller acks append to the
`AckRun` at the log's end (the compiled core's: a row of columns an ack, no object);
any other event (a death, a cancel, a reject, a redrive, a reschedule or a nack's new
key) adds a `Settlement`. Each names its messages by handle
(`broker/state/handles.py`), as the lease state does, a run's packed 16 bytes apiece:
the leader names them by id again through its index when it writes the ledger. Only
the leader reads them whole, a checkpoint at a time, into Arrow columns
(`broker.ledger_writer`); the other readers (a redrive's look for the dead, tests) and
snapshots see `Settlement`s. A `rescheduled` event settles nothing: it is there for
the ledger, so that a deliverer taking the topic over keeps the key in force.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Collection, Iterable, Iterator, Sequence
from itertools import chain, repeat
from operator import attrgetter
from typing import NamedTuple

from dejaq_core import AckRun

from dejaq.broker.state.handles import WIDTH, handles_in, mh, packed
from dejaq.conf.tables import LedgerEvent


class Settlement(NamedTuple):
    """One event of a message (settled, redriven or given a new key), by its handle, as
    snapshots hold it (by id in id-keyed snapshots: `EventLog.by_handle`)."""

    seq: int
    mh: int
    bucket: int
    event: str
    sort_key: int
    deliveries: int
    at: int
    reason: str | None = None


class Event:
    """A `Settlement` as Raft snapshots written before it held them (pickled as a list of
    the field values): unpickled, then made a `Settlement` by `TopicState.__setstate__`.
    """

    __slots__ = Settlement._fields

    def __setstate__(self, state: list) -> None:
        for f, value in zip(self.__slots__, state, strict=True):
            setattr(self, f, value)

    def settlement(self) -> Settlement:
        return Settlement(*(getattr(self, f) for f in self.__slots__))


class Run(NamedTuple):
    """Settled messages of consecutive seqs from `seq` on, settled alike (event, time,
    reason): the columns are the messages' own, by position, as their lease record
    packs them (`array`; lists in snapshots from before), their handles packed 16 bytes
    apiece (ids, a list or `PackedIds`, in id-keyed snapshots:
    `EventLog.by_handle`). Never changed once made: a checkpoint thread reads runs
    while the event loop adds and trims them."""

    seq: int
    handles: bytes
    buckets: Sequence[int]
    event: str
    sort_keys: Sequence[int]
    deliveries: Sequence[int]
    at: int
    reason: str | None = None

    def settlements(self) -> Iterator[Settlement]:
        return _settlements(self, repeat(self.at, count(self)))

    def part(self, start: int, end: int) -> Run:
        """Its events of seqs start..end-1 (which it holds)."""
        i, j = start - self.seq, end - self.seq
        return self._replace(
            seq=start,
            handles=self.handles[i * WIDTH : j * WIDTH],
            buckets=self.buckets[i:j],
            sort_keys=self.sort_keys[i:j],
            deliveries=self.deliveries[i:j],
        )


Entry = Settlement | Run | AckRun
_first_seq = attrgetter("seq")  # of any


def last(e: Entry) -> int:
    """The seq of the last event of `e`."""
    return e.seq + count(e) - 1


def count(e: Entry) -> int:
    kind = type(e)
    return 1 if kind is Settlement else len(e.handles) // WIDTH if kind is Run else len(e)


def settlements(entries: Iterable[Entry]) -> Iterator[Settlement]:
    for e in entries:
        kind = type(e)
        if kind is Settlement:
            yield e
        elif kind is Run:
            yield from e.settlements()
        else:
            yield from acks(e)


def acks(run: AckRun) -> Iterator[Settlement]:
    """An `AckRun`'s events, each as a `Settlement`."""
    return _settlements(run, run.ats)


def _settlements(run: Run | AckRun, ats: Iterable[int]) -> Iterator[Settlement]:
    """A run's events, each at its time in `ats`."""
    handles = handles_in(run.handles)
    n = len(handles)
    columns = (
        range(run.seq, run.seq + n),
        handles,
        run.buckets,
        repeat(run.event, n),
        run.sort_keys,
        run.deliveries,
        ats,
        repeat(run.reason, n),
    )
    return map(Settlement._make, zip(*columns, strict=True))


def redriven(events: Iterable[Settlement]) -> list[int]:
    """The handles of the messages whose latest of `events` (in seq order) is a redrive,
    their reschedules aside: a redriven message given a new key is pending all the same."""
    latest = {e.mh: e.event for e in events if e.event != LedgerEvent.RESCHEDULED}
    return [h for h, event in latest.items() if event == LedgerEvent.REDRIVEN]


def past(entries: list[Entry], seq: int) -> list[Entry]:
    """The events of `entries` (ascending seqs) after `seq`."""
    out = [e for e in entries if last(e) > seq]
    if out and out[0].seq <= seq:  # a run holding `seq`
        out[0] = out[0].part(seq + 1, last(out[0]) + 1)
    return out


def seqs(entries: Iterable[Entry]) -> Iterator[int]:
    return chain.from_iterable(range(e.seq, last(e) + 1) for e in entries)


class EventLog:
    """The events not yet trimmed, in ascending seq.

    The event loop adds and cuts entries; a checkpoint thread reads them (`view`).
    Adding is one append or extend; a cut changes the list in place (no copy of the
    rest: a backlog trimmed in slices would copy it once per slice) under a lock the
    views take too, so a view never holds part of a cut."""

    __slots__ = ("_lock", "entries", "size")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self.entries: list[Entry] = list(entries)
        self.size = sum(map(count, self.entries))
        self._lock = threading.Lock()

    def __getstate__(self) -> list[Entry]:
        """Acks' runs as their settlements: snapshots keep the format every node reads."""
        return [s for e in self.entries for s in (acks(e) if type(e) is AckRun else (e,))]

    def __setstate__(self, entries: list[Entry]) -> None:
        self.__init__(entries)

    def by_handle(self) -> dict[int, str]:
        """Name by handle the settlements and runs that name their messages by id (those
        of id-keyed snapshots); returns the single settlements' ids by
        handle. Every node hashes alike, so their logs stay equal."""
        entries, named = self.entries, {}
        with self._lock:
            for i, e in enumerate(entries):
                if type(e) is Settlement and type(e.mh) is str:
                    h = mh(e.mh)
                    named[h] = e.mh
                    entries[i] = e._replace(mh=h)
                elif type(e) is Run and type(e.handles) is not bytes:  # ids
                    entries[i] = e._replace(handles=packed(e.handles))
        return named

    def add(self, run: Run) -> None:
        if run.handles:
            self.entries.append(run)
            self.size += count(run)

    def append(self, e: Settlement) -> None:
        self.entries.append(e)
        self.size += 1

    def ack(
        self, seq: int, h: int, bucket: int, event: str, sort_key: int, deliveries: int, at: int
    ) -> None:
        """An ack of the message of handle `h`, the next event: a row of the open
        `AckRun` at the end, as the core's ack adds it (`AckRun.append`)."""
        AckRun.append(self.entries, seq, h, bucket, event, sort_key, deliveries, at)
        self.size += 1

    def view(self) -> list[Entry]:
        """The entries as they are now, for a reader in another thread: the copy's last
        run of acks sealed, so that none joins it while the reader has it. Sealed after
        the copy: an ack the event loop adds between the two is in the run, and a run
        it starts after the seal is not in the copy."""
        with self._lock:
            entries = list(self.entries)
        if entries and type(entries[-1]) is AckRun:
            entries[-1].seal()
        return entries

    def past(self, seq: int) -> tuple[list[Entry], Entry | None]:
        """The entries up to `seq` (the deaths a trim kept stay in front), and the first
        after them: for a reader in another thread, without a copy of the rest."""
        with self._lock:
            entries = self.entries
            n = bisect_right(entries, seq, key=last)
            return entries[:n], entries[n] if n < len(entries) else None

    def first(self) -> int | None:
        """The seq of the first event, if any."""
        entries = self.entries
        return entries[0].seq if entries else None

    def cut(self, upto: int, keep: Collection[int] = ()) -> list[Entry]:
        """Remove the events up to seq `upto` but those of the seqs in `keep`, which stay
        in front; returns the removed."""
        entries = self.entries
        n = bisect_right(entries, upto, key=_first_seq)  # the entries starting by `upto`
        done = entries[:n]
        rest = None
        if n and last(entries[n - 1]) > upto:  # a run holding `upto`
            n -= 1
            run = done.pop()
            done.append(run.part(run.seq, upto + 1))
            rest = run.part(upto + 1, last(run) + 1)
        kept: list[Entry] = []
        if keep:
            wanted = set(keep)
            events = list(settlements(done))
            kept = [e for e in events if e.seq in wanted]
            done = [e for e in events if e.seq not in wanted]
        with self._lock:
            if rest is not None:
                entries[n] = rest
            entries[:n] = kept
        self.size -= sum(map(count, done))
        return done

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Settlement]:
        return settlements(self.view())

    def __getitem__(self, i: int | slice) -> Settlement | list[Settlement]:
        return list(self)[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EventLog | list):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


# What the ledger's writers take: a log, its entries, or settlements.
Events = EventLog | list[Entry]


def entries_of(events: Events) -> list[Entry]:
    """`events` as entries: a log's as they are now (`EventLog.view`), others as given."""
    return events.view() if isinstance(events, EventLog) else list(events)
