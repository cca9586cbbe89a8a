"""The leader's checkpoints of settled events, and how far behind they are.

A checkpoint writes the Raft-held events to `ledger/<topic>`, then the dead letters of
the deaths among them, then trims them from Raft. The ledger settles messages: it goes
first, and a dead letter that cannot be written never holds it back. Deaths whose dead
letters failed are kept in Raft by the trim (`TopicState.trim`'s `keep`) and tried again
with a backoff, while everything else is trimmed: retention cannot remove their buffer
rows meanwhile (it stops before the oldest event still in Raft). Failures of any step
of a round (the broker's: the ledger, the dead letters, restoring redriven rows, the
trim) are logged once per streak and kind (step and error type), and per message id,
counted, and shown (`Lag`) on `/metrics`, `/v1/cluster`, `/readyz` and
`dejaq status`.

A leader writes the events up to the first whose message its index cannot name yet (a
new leader whose index has not read the row the old one leased): the rest wait for its
index, counted (`Health.unnamed`, on `/metrics`) and, past `UNNAMED_GRACE_S`, told on
`/readyz`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dejaq.broker.state.handles import packed_handles
from dejaq.broker.state.leases import TopicState
from dejaq.broker.state.settlements import Events, count, entries_of, last, past
from dejaq.broker.storage.ledger_writer import (
    History,
    Names,
    Rival,
    deaths,
    id_list,
    up_to,
    write_dead_letters,
    write_ledger,
)

log = logging.getLogger("dejaq.broker.storage.checkpoints")

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
# A checkpoint failing this long shows in `/readyz`'s detail: an operator's alert.
FAILING_ALERT_S = 180.0
# Events waiting this long for the leader's index to name their messages show there
# too: an index that does not catch up (its refreshes failing, say) holds every trim.
UNNAMED_GRACE_S = 60.0


@dataclass
class Health:
    """A topic's checkpoints: the current streak of failures, if any."""

    failures: int = 0  # in all, since the node started: a counter
    streak: int = 0  # consecutive failed attempts
    failing_since: float | None = None  # wall-clock seconds of the streak's first
    last_error: str = ""
    retry_at: float = 0.0  # monotonic: dead letters are not tried before it
    logged: set[str] = field(default_factory=set)  # ids named in a log line this streak
    kinds: set[str] = field(default_factory=set)  # steps and error types logged this streak
    # Events the last round could not write, their messages not named by this node's
    # index yet (`ledger_writer.Names`), from seq `unnamed_from` on, since (wall clock).
    unnamed: int = 0
    unnamed_from: int = 0
    unnamed_since: float | None = None

    def failed(self, what: str, error: BaseException, ids: list[str]) -> None:
        self.failures += 1
        self.streak += 1
        self.last_error = f"{what}: {type(error).__name__}: {error}"
        if (kind := f"{what}: {type(error).__name__}") not in self.kinds:
            self.kinds.add(kind)
            log.error("checkpoint %s failed; retrying", what, exc_info=error)
        if self.failing_since is None:
            self.failing_since = time.time()
        delay = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(self.streak - 1, 16))
        self.retry_at = time.monotonic() + delay
        if new := [i for i in ids if i not in self.logged]:
            self.logged.update(new)
            log.warning("%s: %d messages wait for it: %s", what, len(new), new[:20])

    def waiting(self, events: int, first: int) -> None:
        """The round wrote the events before seq `first`: `events` from it on wait for
        this node's index to read their messages' rows."""
        if self.unnamed_since is None:
            self.unnamed_since = time.time()
            log.info("checkpoint: %d events from seq %d wait for the index", events, first)
        self.unnamed, self.unnamed_from = events, first

    def named(self) -> None:
        """The round named every event it took."""
        self.unnamed, self.unnamed_since = 0, None

    def ok(self) -> None:
        """A round went through, nothing kept back: at WARNING, as its failure was, so a
        node logging warnings only shows both."""
        if self.failing_since is not None:
            log.warning("checkpoints work again after %.0f s", time.time() - self.failing_since)
        self.ended()

    def ended(self) -> None:
        """End the streak without a success: this node stopped leading, and the next
        leader's checkpoints, not this node's last ones, are what an operator watches."""
        self.streak, self.failing_since, self.last_error = 0, None, ""
        self.retry_at = 0.0
        self.logged.clear()
        self.kinds.clear()
        self.named()

    def alert(self) -> str | None:
        """Why an operator should look, once failures have lasted `FAILING_ALERT_S`, or
        events waited `UNNAMED_GRACE_S` for the index. Each is read once: the
        checkpoints' thread changes them while others ask."""
        since, error = self.failing_since, self.last_error
        if since is not None and time.time() - since >= FAILING_ALERT_S:
            return f"failing for {time.time() - since:.0f} s ({error})"
        waiting, events, first = self.unnamed_since, self.unnamed, self.unnamed_from
        if waiting is not None and time.time() - waiting >= UNNAMED_GRACE_S:
            return (
                f"waiting {time.time() - waiting:.0f} s for this node's index to read the "
                f"rows of {events} settled messages (from seq {first} on): the ledger "
                "and the trims wait for them"
            )
        return None


@dataclass(frozen=True)
class Lag:
    """How far the ledger is behind this node's Raft state, for one topic."""

    events: int  # events in Raft (settled messages, new keys) not yet written to the ledger
    # `at` of the first of them in log order, epoch ms: the oldest, as the leader stamps
    # each command's time (but for a clock difference between successive leaders).
    oldest_ms: int | None
    unwritten_dead_letters: int  # deaths in the ledger whose dead letters wait in Raft


def lag(state: TopicState) -> Lag:
    """Read on any node: every node applies the same trims.

    Every node reads it five times a second, also over the backlog of a ledger that
    has been failing: it reads the deaths a trim kept and the first event after them,
    never every event.
    """
    kept, first = state.events.past(state.trimmed)
    dead = sum(map(count, kept))
    return Lag(max(len(state.events) - dead, 0), None if first is None else first.at, dead)


def checkpoint(
    warehouse: str,
    topic: str,
    events: Events,
    names: Names,
    health: Health,
    history: History = ("", 0),
    trimmed: int | None = None,
    rival: Rival | None = None,
) -> tuple[int, list[int]]:
    """Write `events` to the ledger and their dead letters under `history`, up to the
    first whose message `names` cannot name (the rest told to `health` as waiting): (the
    last seq the ledger holds of them, the seqs of deaths to keep in Raft). Raises if
    the ledger write fails, `Claimed` where its tag is past `trimmed` (if given), and
    `Contested` where `rival`'s tag keeps moving; a dead letter that fails is told to
    `health`.

    The caller tells `health` what it raises, and ends a streak (`Health.ok`) once the
    rest of its round (the trim) has gone through too, with nothing to keep: a step
    after the ledger that fails stalls the checkpoints as surely."""
    events = entries_of(events)
    upto = write_ledger(warehouse, topic, events, names, history, trimmed, rival)
    if upto < last(events[-1]):
        left = past(events, upto)
        health.waiting(sum(map(count, left)), left[0].seq)
    else:
        health.named()
    events = up_to(events, upto)
    dead = deaths(events)
    if not dead:
        return upto, []
    if time.monotonic() < health.retry_at:
        return upto, [e.seq for e in dead]
    try:
        write_dead_letters(warehouse, topic, events, names, history)
    except Exception as e:
        ids = id_list(names(packed_handles([d.mh for d in dead])))
        named = [m or f"handle {d.mh:032x}" for d, m in zip(dead, ids, strict=True)]
        health.failed(f"dead letters of {topic}", e, named)
        return upto, [e.seq for e in dead]
    return upto, []
