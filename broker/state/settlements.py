"""Settled messages waiting to be checkpointed into the ledger, as runs of columns.

Every node keeps them, and every ack adds to them: a bulk ack of a whole lease is one
`Run` holding slices of the lease record's columns, not an object per message. Only
the leader reads them whole, a checkpoint at a time, into Arrow columns
(`broker.ledger_writer`); the other readers (a redrive's look for the dead, tests) see
`Settlement`s.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from itertools import chain, repeat
from typing import NamedTuple


class Settlement(NamedTuple):
    """One settled message, as the ledger gets it: how readers see a `Run`'s events."""

    seq: int
    message_id: str
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
    reason): the columns are the message's own, by position. Never changed once made:
    a checkpoint thread reads runs while the event loop adds and trims them."""

    seq: int
    message_ids: list[str]
    buckets: list[int]
    event: str
    sort_keys: list[int]
    deliveries: list[int]
    at: int
    reason: str | None = None

    @property
    def last(self) -> int:
        return self.seq + len(self.message_ids) - 1

    def settlements(self) -> Iterator[Settlement]:
        n = len(self.message_ids)
        columns = (
            range(self.seq, self.seq + n),
            self.message_ids,
            self.buckets,
            repeat(self.event, n),
            self.sort_keys,
            self.deliveries,
            repeat(self.at, n),
            repeat(self.reason, n),
        )
        return map(Settlement._make, zip(*columns, strict=True))

    def after(self, seq: int) -> Run:
        """The part of the run past `seq` (which it holds)."""
        k = seq - self.seq + 1
        return self._replace(
            seq=seq + 1,
            message_ids=self.message_ids[k:],
            buckets=self.buckets[k:],
            sort_keys=self.sort_keys[k:],
            deliveries=self.deliveries[k:],
        )

    def upto(self, seq: int) -> Run:
        """The part of the run up to `seq` (which it holds)."""
        k = seq - self.seq + 1
        return self._replace(
            message_ids=self.message_ids[:k],
            buckets=self.buckets[:k],
            sort_keys=self.sort_keys[:k],
            deliveries=self.deliveries[:k],
        )


def single(e: Settlement) -> Run:
    return Run(
        e.seq, [e.message_id], [e.bucket], e.event, [e.sort_key], [e.deliveries], e.at, e.reason
    )


def settlements(runs: Iterable[Run]) -> Iterator[Settlement]:
    return chain.from_iterable(r.settlements() for r in runs)


def past(runs: list[Run], seq: int) -> list[Run]:
    """The events of `runs` (ascending seqs) after `seq`."""
    out = [r for r in runs if r.last > seq]
    if out and out[0].seq <= seq:
        out[0] = out[0].after(seq)
    return out


def seqs(runs: Iterable[Run]) -> Iterator[int]:
    return chain.from_iterable(range(r.seq, r.last + 1) for r in runs)


class EventLog:
    """The runs not yet trimmed, in ascending seq. `runs` is replaced or appended to, a
    whole run at a time, so `list(log.runs)` (one C call under the GIL) is a consistent
    view for another thread."""

    __slots__ = ("runs", "size")

    def __init__(self, runs: Iterable[Run] = ()) -> None:
        self.runs: list[Run] = list(runs)
        self.size = sum(len(r.message_ids) for r in self.runs)

    @classmethod
    def of(cls, events: Iterable[Settlement]) -> EventLog:
        return cls(map(single, events))

    def __getstate__(self) -> list[Run]:
        return self.runs

    def __setstate__(self, runs: list[Run]) -> None:
        self.runs = runs
        self.size = sum(len(r.message_ids) for r in runs)

    def add(self, run: Run) -> None:
        if run.message_ids:
            self.runs.append(run)
            self.size += len(run.message_ids)

    def append(self, e: Settlement) -> None:
        self.add(single(e))

    def view(self) -> list[Run]:
        """The runs as they are now, for a reader in another thread: `runs` is appended
        to, or replaced whole, by the event loop."""
        return list(self.runs)

    def first(self) -> int | None:
        """The seq of the first event, if any."""
        runs = self.runs
        return runs[0].seq if runs else None

    def cut(self, upto: int, keep: Collection[int] = ()) -> list[Run]:
        """Remove the events up to seq `upto` but those of the seqs in `keep`, which stay
        in front; returns the removed. The runs are replaced in one step, so a reader's
        view holds all of them or none."""
        runs = self.runs
        n = 0
        while n < len(runs) and runs[n].last <= upto:
            n += 1
        done, rest = runs[:n], runs[n:]
        if rest and rest[0].seq <= upto:
            done.append(rest[0].upto(upto))
            rest[0] = rest[0].after(upto)
        if keep:
            kept = set(keep)
            events = list(settlements(done))
            rest[:0] = [single(e) for e in events if e.seq in kept]
            done = [single(e) for e in events if e.seq not in kept]
        self.runs = rest
        self.size -= sum(len(r.message_ids) for r in done)
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


# What the ledger's writers take: a log, its runs, or settlements (each its own run).
Events = EventLog | list[Run] | list[Settlement]


def as_runs(events: Events) -> list[Run]:
    """`events` as runs: a log's as they are now (`EventLog.view`), runs as they are,
    settlements a run each."""
    if isinstance(events, EventLog):
        return events.view()
    if all(isinstance(e, Run) for e in events):
        return list(events)
    return [single(e) for e in events]
