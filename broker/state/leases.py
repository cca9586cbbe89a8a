"""Lease, ack, nack, expiry and dead-letter semantics as a deterministic state machine.

Every transition takes the time from its command (the leader stamps it), so every Raft
node applying the same log reaches the same state: nothing here reads a clock, a table or
the network. The pending messages themselves live in the node-local index
(`broker.index`); this state only knows the messages something has happened to.
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter, deque
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from itertools import repeat
from typing import TypeVar

from dejaq_core import (
    ACKED,
    CANCELLED,
    DEAD,
    EXPIRED,
    EXPIRED_NOW,
    LEASED,
    NACKED,
    NOT_LEASED,
    OTHER_CONSUMER,
    POSITION_BITS,
    REJECTED,
    RELEASED,
    LeaseRecord,
    LeaseTable,
    PackedIds,
    Transitions,
    count_buckets,
    free_buckets,
    grant,
    hold,
)

from dejaq.broker.state.assignment import rebalance
from dejaq.broker.state.handles import WIDTH, KeyedByHandle, handles_in, mh, packed_handles
from dejaq.broker.state.settlements import Event, EventLog, Run, Settlement, settlements
from dejaq.conf.tables import LedgerEvent

# One leader's leases apply within this of the order it stamped them in (a command is
# logged within `raft.STAMPED_WITHIN_MS` of its stamp): a stamp further behind the rate
# limit's last refill is another leader's clock, not a reordering.
CLOCK_BEHIND_MS = 15_000


class Refusal(StrEnum):
    """Why a message in an ack, nack, extend or reject was refused (HTTP 409), or why a
    redrive left it as it was."""

    NOT_LEASED = "not_leased"
    EXPIRED = "lease_expired"
    OTHER_CONSUMER = "leased_by_another_consumer"
    SETTLED = "already_settled"
    LEASED = "currently_leased"
    REDRIVEN = "already_redriven"  # pending again since its last death
    NOT_DEAD = "not_dead"
    # Made from a view of the state that a trim has passed since (`seen`): what the
    # message is can no longer be told here, so the leader reads it again. No client
    # is told this one.
    TRIMMED = "trimmed_since_read"


@dataclass(slots=True)
class Lease:
    """One leased message, as a peek shows it (and as snapshots before lease records
    held each lease)."""

    consumer: str
    bucket: int
    sort_key: int
    deadline: int
    deliveries: int


# A lease record (`dejaq_core.LeaseRecord`) holds the messages one lease command granted,
# by position: what a receipt names. One object per lease, not per message, its columns
# (ids, buckets, sort keys, deliveries, and a mark per position of how its lease ended)
# in the compiled core. A receipt is `lid << POSITION_BITS | position`: every node
# resolves it from its own copy of the record, without looking the message up by id.
#
# How a position's lease ended (`LEASED`, 0, while it is leased), `ACKED`...: the core's
# codes, as are `POSITION_BITS` and the `status` codes past them.
SETTLING = (ACKED, REJECTED, CANCELLED, DEAD)
# What a message named is told, by `LeaseRecord.status`: how its lease ended, or that
# there is no such position, another consumer holds it, or its deadline is past.
_REFUSAL: dict[int, Refusal | None] = {
    LEASED: None,  # held by the caller
    ACKED: Refusal.SETTLED,
    REJECTED: Refusal.SETTLED,
    NACKED: Refusal.NOT_LEASED,
    EXPIRED: Refusal.EXPIRED,
    RELEASED: Refusal.NOT_LEASED,
    CANCELLED: Refusal.SETTLED,
    DEAD: Refusal.SETTLED,
    NOT_LEASED: Refusal.NOT_LEASED,
    OTHER_CONSUMER: Refusal.OTHER_CONSUMER,
    EXPIRED_NOW: Refusal.EXPIRED,
}
_REFUSAL_OF = tuple(_REFUSAL[code] for code in range(len(_REFUSAL)))  # by code
POSITION_MASK = (1 << POSITION_BITS) - 1
# Receipts in an ack for its bulk path (`TopicState._ack_run`), and picks the leader
# packs (`TopicIndex.pick`): their fixed costs (~6 µs) pay from about 10 messages on.
BULK_MIN = 16


# Lease and ack by receipt as the compiled core applies them for a group commit
# (`BrokerState.batch`), with the objects they name.
TRANSITIONS = Transitions(LedgerEvent.ACKED, _REFUSAL_OF, Refusal.NOT_LEASED, BULK_MIN, Run)


@dataclass(frozen=True, slots=True)
class Again:
    """A lease command of the request the consumer's last lease answered (its answer
    lost, the request sent again): nothing is granted, and the answer is what lease
    `lid` still holds for the consumer."""

    lid: int


Pick = tuple[str, int, int]  # (message_id, bucket, sort_key), chosen by the leader's index
# A lease command's picks: their message handles, buckets and sort keys packed
# little-endian (16, 2 and 8 bytes each), as the leader's index picks them
# (`TopicIndex.pick`): three objects for Raft to pickle, and every node to unpickle,
# and no id on any node. Commands from before carry their ids in place of the handles
# (`PackedIds`, or a list of str), or a list of `Pick`s; `TopicState.lease` takes any,
# hashing their ids (the ids' strs in their heads are the leader's answer, not Raft's).
Picks = tuple[bytes, bytes, bytes]
OldPicks = tuple[PackedIds | list[str], bytes, bytes]  # id-keyed commands
Dead = tuple[str, int, int]  # (message_id, bucket, sort_key at death), found by the leader
RetryBackoff = tuple[int, int]  # (retry_backoff_ms, retry_backoff_max_ms) of the topic


class TopicState:
    """One topic's leases, delivery counts, overrides, consumers and bucket assignment."""

    def __init__(self, buckets: int, max_deliveries: int) -> None:
        # From the node's configuration until a `configure` command sets them: its own
        # values, at a point of the log every node applies alike (`configured`).
        self.buckets = buckets
        self.max_deliveries = max_deliveries
        self.configured = False
        # The Raft history the ledger's tags count this state's seqs in
        # (`ledger_writer.app_id`), and the last seq of it the ledger held when it began:
        # a new one when the leader finds the tags written by another (`Broker`).
        self.history, self.history_from = "", 0
        # The app transaction of the tags the history replaced and their version then:
        # watched by the leader, as another cluster's if they keep moving (`Rival`).
        self.replaced: tuple[str, int] | None = None
        # message -> its lease's record, while leased and, once acked, until the trim of
        # its event: an ack's settled mark is the record's `ended` byte, so the ack path
        # touches no table by id, and the lease path's one probe finds leased and acked.
        # Keyed by message handle (`handles.py`) in the compiled core, named by id or
        # handle: a lease's picks enter, and a trim's leave, without a Python object per
        # message.
        self.leases = LeaseTable()
        # Every lease's record by lid, until its messages' leases ended and the events of
        # that are trimmed (`ending`): a receipt resolves as long as an id would.
        self.records: dict[int, LeaseRecord] = {}
        # The records holding a message still leased: expiry looks for deadlines past,
        # and a leaving consumer's leases, among these, not among every record kept
        # until its trim (a second's leases, one a message at batch 1). Derived.
        self.leased: dict[int, LeaseRecord] = {}
        # Leases from before receipts (old snapshots, old journal entries) are numbered
        # down from -1: no receipt names them, and nodes whose snapshots were taken at
        # different points may number them differently without disagreeing on anything.
        self.unnumbered = 0
        self.ending: deque[tuple[int, int]] = deque()  # (seq to trim past, lid)
        # Unsettled messages delivered at least once and not leased now (a lease holds its
        # own count), by message handle: leasing and acking a first delivery, the usual
        # case, touch no entry.
        self.deliveries: dict[int, int] = {}
        # By message handle: overrides (a nack's priority, a reschedule, a redrive's key),
        # and delays (a nack's, a retry backoff's).
        self.sort_keys: dict[int, int] = {}
        self.not_before: dict[int, int] = {}
        # message handle -> event, until checkpointed: settled other than by an ack
        # (those are in `leases`), see `settled_event`.
        self.settled: dict[int, str] = {}
        self.events = EventLog()
        self.seq = 0
        self.consumers: dict[str, int] = {}  # consumer_id -> last seen, ms
        # consumer_id -> (request id, lid) of its last lease that granted something and
        # carried the id its client made for the request: the same request sent again is
        # answered with that lease (`again`). One entry per member, dropped as it leaves.
        self.requests: dict[str, tuple[str, int]] = {}
        self.assignment: dict[int, str] = {}
        self.owned: dict[str, list[int]] = {}  # the assignment by consumer (derived)
        # bucket -> leases per consumer, each count above 0: plain dicts, as Counter's
        # Python-level `__delitem__` cost every ack that ended a consumer's last lease.
        self.held: dict[int, dict[str, int]] = {}
        self.totals: Counter[str] = Counter()
        self.paused = False
        # The lease rate's token bucket (`max_lease_rate`), refilled up to the latest
        # leader-stamped time a lease carried: every node counts the same tokens.
        self.tokens = 0.0
        self.refilled_at = 0
        # message handle -> seq of its latest redriven event not yet trimmed (`trim`).
        self.redriven_at: dict[int, int] = {}
        # message handle -> id of each message `redriven_at` holds: its ledger row, the
        # putting back of its row and an index waiting for that row name it by id.
        self.redriven_ids: dict[int, str] = {}
        self.trimmed = 0  # the highest seq a trim reached (events it kept stay below it)

    def __getstate__(self) -> dict:
        """Snapshots hold what they held before `owned` and `leased`: both are derived,
        rebuilt on load; and `leases` as the dict they held before it was a `LeaseTable`,
        by message handle (by id in id-keyed snapshots: `__setstate__` hashes those). The mark
        `KeyedByHandle` makes a node of an id-keyed version refuse the snapshot."""
        state = self.__dict__.copy()
        del state["owned"], state["leased"]
        state["leases"] = dict(self.leases.items())
        state["keyed_by"] = KeyedByHandle
        return state

    def __setstate__(self, state: dict) -> None:
        # Snapshots from before pause, rate limits and redrive hold none of their state.
        self.paused, self.tokens, self.refilled_at, self.redriven_at = False, 0.0, 0, {}
        self.trimmed = 0
        self.requests = {}  # from before lease requests carried their id
        self.records, self.unnumbered, self.ending = {}, 0, deque()
        self.configured = False  # from before `configure`: the leader commits one
        self.history, self.history_from = "", 0  # from before histories: the first
        self.replaced = None
        state.pop("keyed_by", None)  # absent from id-keyed snapshots
        self.__dict__.update(state)
        self.owned = _owners(self.assignment)
        self.held = {b: {c: n for c, n in h.items() if n > 0} for b, h in self.held.items()}
        # Snapshots from before message handles: their maps by id, by handle.
        self.deliveries = _by_handle(self.deliveries)
        self.redriven_at = _by_handle(self.redriven_at)
        self.settled = _by_handle(self.settled)
        self.sort_keys = _by_handle(self.sort_keys)
        self.not_before = _by_handle(self.not_before)
        for mid in self.leases:  # snapshots from before leases held the only count
            self.deliveries.pop(mid if type(mid) is int else mh(mid), None)
        if not isinstance(self.events, EventLog):  # from before runs: a list of events
            self.events = EventLog(
                e.settlement() if isinstance(e, Event) else e for e in self.events
            )
        named = self.events.by_handle()  # id-keyed snapshots: events by id
        old = [(m, lease) for m, lease in self.leases.items() if isinstance(lease, Lease)]
        for mid, lease in old:  # from before lease records: a record each
            self.unnumbered -= 1
            record = LeaseRecord()
            record.__setstate__(
                (
                    array("H", [lease.bucket]),
                    lease.consumer,
                    lease.deadline,
                    None,
                    array("i", [lease.deliveries]),
                    bytearray([LEASED]),
                    self.unnumbered,
                    1,
                    [mid],
                    array("q", [lease.sort_key]),
                )
            )
            self.records[record.lid] = self.leases[mid] = record
        leases, self.leases = self.leases, LeaseTable()
        for mid, record in leases.items():  # by handle, or by id (hashed) from before
            self.leases[mid] = record
        self.leased = {lid: r for lid, r in self.records.items() if r.live}
        if "redriven_ids" not in state:  # from before it was kept
            self.redriven_ids = {h: m for h, m in named.items() if h in self.redriven_at}

    # --- consumers -------------------------------------------------------------------

    def touch(self, consumer: str, now: int) -> bool:
        """Record a sign of life; a new consumer joins and buckets are rebalanced."""
        joined = consumer not in self.consumers
        self.consumers[consumer] = now
        if joined:
            self._rebalance()
        return joined

    def _seen(self, consumer: str, now: int) -> None:
        """A settle or extend is a sign of life of a member, and not a way back in: a
        consumer the heartbeat expiry removed rejoins by its next lease or heartbeat
        (`touch`), which rebalances; re-added here it would own no bucket for good."""
        if consumer in self.consumers:
            self.consumers[consumer] = max(self.consumers[consumer], now)

    def leave(self, consumer: str, now: int, expired_too: bool = False) -> list[int]:
        """Remove a consumer and hand its leases back (not counted as a failed delivery),
        returning their messages' handles;
        with `expired_too`, those of one the heartbeat expiry removed too, which still
        hold their buckets. A command says it (`Broker.leave`): one from before applies,
        replayed from a journal, as the nodes whose snapshots hold it applied it."""
        member = self.consumers.pop(consumer, None) is not None
        if not (member or expired_too):
            return []
        self.requests.pop(consumer, None)
        released: list[int] = []
        for record in [r for r in self.leased.values() if r.consumer == consumer]:
            for pos in record.live_positions():
                h = record.mh(pos)
                self._end(record, pos, RELEASED, h)
                deliveries = record.entry(pos)[3]
                if deliveries > 1:
                    self.deliveries[h] = deliveries - 1
                released.append(h)
        if member:
            self._rebalance()
        return released

    def buckets_of(self, consumer: str) -> list[int]:
        """Buckets assigned to `consumer` that no other consumer still holds leases in,
        in the order it owns them: the leader's pick asks (every node's lease checks
        the same in the core, `dejaq_core.grant`). It walks the consumer's buckets, not
        all of them."""
        return free_buckets(self.owned.get(consumer, ()), self.held, consumer)

    def _rebalance(self) -> None:
        self.assignment = rebalance(self.buckets, self.consumers, self.assignment)
        self.owned = _owners(self.assignment)

    def configure(self, buckets: int, max_deliveries: int) -> bool:
        """Take the topic's configuration, as the leader commits it; whether it changed.

        A command, not each node's own file: snapshots and journals carry the values, so
        only a point of the log every node applies alike changes them. New buckets are
        assigned at once. Buckets removed are assigned no more; leases in them stay
        valid until acked, nacked or expired, and their `held` counts drain as they end.
        A lower `max_deliveries` kills a message at its next unsettled lease end.
        """
        changed = (buckets, max_deliveries) != (self.buckets, self.max_deliveries)
        rebalanced = buckets != self.buckets
        self.buckets, self.max_deliveries, self.configured = buckets, max_deliveries, True
        if rebalanced:
            self._rebalance()
        return changed

    def begin_history(
        self, history: str, written: int, replaced: tuple[str, int] | None = None
    ) -> None:
        """Count the ledger's tags under `history` from now on, its events up to seq
        `written` in the ledger already: the tags found were another history's, and
        this state's events past its last trim would not be written under them.
        `replaced`: those tags' app transaction and version (none in commands from
        before it)."""
        self.history, self.history_from, self.replaced = history, written, replaced

    # --- leasing ---------------------------------------------------------------------

    def sort_key(self, h: int, base: int) -> int:
        """The key in force of the message of handle `h`, whose own key is `base`."""
        return self.sort_keys.get(h, base)

    def settled_event(self, mid: str, h: int | None = None) -> str | None:
        """What settled the message, if its event is not trimmed yet: `settled`, or an
        ack marked in its lease's record. `h`: its handle, where the caller has it."""
        if h is None:
            h = mh(mid)
        event = self.settled.get(h)
        if event is not None or (record := self.leases.get(h)) is None:
            return event
        return LedgerEvent.ACKED if record.ended_at(record.position(h)) == ACKED else None

    def is_available(self, mid: str, now: int) -> bool:
        """Neither leased nor settled nor held back by a nack delay."""
        h = mh(mid)
        return h not in self.leases and h not in self.settled and self.not_before.get(h, 0) <= now

    def lease(
        self,
        consumer: str,
        now: int,
        lease_ms: int,
        picks: Picks | OldPicks | list[Pick],
        rate: float | None = None,
        lid: int | None = None,
        seen: int | None = None,
    ) -> LeaseRecord:
        """Lease the leader's picks (`Picks`; commands from before carry their ids, or a
        list of `Pick`s, hashed here) that are still available in the consumer's buckets;
        returns the lease's record (empty if nothing was granted), numbered `lid` (the
        cluster's lease count, `BrokerState`), or unnumbered for a command from before
        receipts.

        Every node runs this for every lease: the core checks the picks and fills the
        record (`dejaq_core.grant`), making no object per message. A pick is granted if
        it is in one of the consumer's buckets that no other consumer holds leases in,
        neither settled nor delayed (a delay past is dropped), picked at its key in
        force (a reschedule applied after the pick is not undone by it), nor leased, nor
        granted earlier in the same picks; its deliveries count one more than its count outside a
        lease. A paused topic leases nothing; `rate` (messages/s, from the leader's
        configuration) caps the picks at the tokens in the bucket: both checks once per
        lease, not per message.

        A group commit (`BrokerState.batch`) has the core apply a numbered lease of a
        member on a topic neither paused nor rate-limited (`TRANSITIONS`), the same
        steps; the tests hold the two alike.

        `seen` is the seq the leader's state was at when it picked (None in commands
        from before it was carried). A message settled since is known as settled
        (`settled_event`) until a trim forgets it; once a trim has passed `seen`, a pick
        settled and trimmed meanwhile would look pending, so nothing is granted and the
        leader picks again.
        """
        consumers = self.consumers
        if consumer in consumers:  # `touch`, inlined: a member's lease
            consumers[consumer] = now
        else:
            self.touch(consumer, now)
        numbered = lid is not None
        record = LeaseRecord(lid if numbered else self.unnumbered - 1, consumer, now + lease_ms)
        if self.paused or _trimmed_past(self, seen):
            return record
        handles, buckets, keys = picks if isinstance(picks, tuple) else _as_picks(picks)
        allowed = None
        if rate is not None:
            self.tokens = self._tokens_at(now, rate)
            self.refilled_at = now if self._clock_behind(now) else max(self.refilled_at, now)
            allowed = int(self.tokens)
        owned = self.owned.get(consumer, ())
        redelivered = grant(
            self.leases,
            record,
            handles,
            buckets,
            keys,
            owned,
            self.held,
            consumer,
            self.settled,
            self.not_before,
            self.sort_keys,
            self.deliveries,
            now,
            allowed,
        )
        n = record.live
        if not n:
            return record
        if not numbered:
            self.unnumbered = record.lid
        self.records[record.lid] = self.leased[record.lid] = record
        totals = self.totals
        totals["leased"] += n
        if redelivered:
            totals["redelivered"] += redelivered
        if rate is not None:
            self.tokens -= n
        return record

    def again(self, consumer: str, request: str) -> Again | None:
        """The consumer's last lease, if `request` is the request it answered: a client
        that lost the answer sends the same request (and id) again, and is given what
        that lease still holds rather than more messages, while the first stay leased
        to it unseen. None for any other request."""
        last = self.requests.get(consumer)
        return Again(last[1]) if last is not None and last[0] == request else None

    def requested(self, consumer: str, request: str, record: LeaseRecord) -> None:
        """Remember `record` as the lease that answered the consumer's `request`, if it
        granted anything: one that granted nothing has nothing to answer again with,
        and the request polls on (a long poll commits several)."""
        if len(record):
            self.requests[consumer] = (request, record.lid)

    def lease_budget(self, now: int, rate: float) -> int:
        """How many messages a lease at `now` may take under `rate`: the leader picks no
        more, so a limited topic does not pick (and put back) what it cannot grant. At
        least one where `now` is a clock behind the last refill's by more than
        CLOCK_BEHIND_MS (a new leader's): its lease moves the refill's time back to its
        own clock (`lease`), and the bucket refills from there, where it would otherwise
        refill nothing until that clock had caught up, hours perhaps."""
        budget = int(self._tokens_at(now, rate))
        return max(budget, 1) if self._clock_behind(now) else budget

    def _clock_behind(self, now: int) -> bool:
        """Whether a lease stamped `now` is another leader's clock, behind the last
        refill's by more than any reordering of one leader's leases (CLOCK_BEHIND_MS)."""
        return now < self.refilled_at - CLOCK_BEHIND_MS

    def _tokens_at(self, now: int, rate: float) -> float:
        """The bucket at `now`: it holds one second's worth (at least 1), as the release
        job's `max_rate`. A leader stamping an earlier time than the last (a new leader
        whose clock is behind, or leases applied out of their stamps' order) refills
        nothing."""
        burst = max(rate, 1.0)
        elapsed = max(0, now - self.refilled_at)
        return min(self.tokens + elapsed * rate / 1000, burst)

    def lease_of(self, mid: str) -> Lease | None:
        """A leased message's lease (a peek's view)."""
        h = mh(mid)
        record = self.leases.get(h)
        if record is None or record.ended_at(pos := record.position(h)):
            return None
        bucket, sort_key, deadline, deliveries = record.entry(pos)
        return Lease(record.consumer, bucket, sort_key, deadline, deliveries)

    def _end(self, record: LeaseRecord, pos: int, how: int, h: int) -> None:
        """End the lease of the message of handle `h` at `pos` of `record` (`how`:
        ACKED, EXPIRED...). Given the handle: each caller hashes the id once, for every
        map it touches.

        The record's last end removes it: once the events of its settled messages are
        trimmed (a receipt is answered as long as an id is), or at once if none settled
        (all pending again): with no event to checkpoint, no trim would ever come.
        """
        if not record.end(pos, how):
            del self.leased[record.lid]
            if how in SETTLING:  # its event comes next
                self.ending.append((self.seq + 1, record.lid))
            elif record.settled_any():
                self.ending.append((self.seq, record.lid))
            else:
                del self.records[record.lid]
        del self.leases[h]
        hold(self.held, {record.entry(pos)[0]: 1}, record.consumer, -1)

    def receipts_of(self, mids: list[str]) -> tuple[list[int], dict[str, Refusal]] | None:
        """The receipts of the leases holding messages named by id, in their order, and
        the refusals of those no lease record holds (settled, or not leased): the
        leader turns a settling request by ids into a command by receipts, so that Raft
        carries integers and every node resolves them from the record, not by id. None
        if a lease from before receipts holds one (no receipt names it): the command
        then names the ids."""
        receipts: list[int] = []
        refused: dict[str, Refusal] = {}
        leases, settled = self.leases, self.settled
        for mid in mids:
            h = mh(mid)
            record = None if h in settled else leases.get(h)
            if record is None:
                refused[mid] = Refusal.SETTLED if h in settled else Refusal.NOT_LEASED
            elif record.lid < 0:
                return None
            else:
                receipts.append(record.lid << POSITION_BITS | record.position(h))
        return receipts, refused

    def _held(
        self,
        consumer: str,
        now: int,
        mids: list[str],
        receipts: list[int] | None,
        refused: dict[str | int, Refusal],
    ) -> Iterator[tuple[LeaseRecord, int]]:
        """The (record, position) of each message named, by id or by `receipts`, whose
        lease `consumer` holds; the others go into `refused` with the reason.

        Lazy, so each message is dealt with before the next is checked: one named twice
        is refused the second time.
        """
        by_receipt = receipts is not None
        for key in receipts if by_receipt else mids:
            if by_receipt:
                record = self.records.get(key >> POSITION_BITS)
                if record is None:
                    refused[key] = Refusal.NOT_LEASED
                    continue
                pos = key & POSITION_MASK
            else:
                h = mh(key)
                if h in self.settled:
                    refused[key] = Refusal.SETTLED
                    continue
                record = self.leases.get(h)
                if record is None:
                    refused[key] = Refusal.NOT_LEASED
                    continue
                pos = record.position(h)
            status = record.status(pos, consumer, now)
            if status:
                refused[key] = _REFUSAL_OF[status]
            else:
                yield record, pos

    def _settle(
        self,
        h: int,
        bucket: int,
        sort_key: int,
        event: LedgerEvent,
        now: int,
        deliveries: int,
        reason: str | None = None,
    ) -> None:
        self.seq += 1
        self.events.append(
            Settlement(self.seq, h, bucket, event, sort_key, deliveries, now, reason)
        )
        self.settled[h] = event
        if self.deliveries:
            self.deliveries.pop(h, None)
        self.sort_keys.pop(h, None)
        self.not_before.pop(h, None)
        self.totals[event] += 1

    def ack(
        self, consumer: str, now: int, mids: list[str], receipts: list[int] | None = None
    ) -> dict[str | int, Refusal]:
        """Settle leased messages for good; returns the refused ones with the reason.

        The hottest transition after `lease`, run on every node: a run of one lease's
        receipts is settled in bulk; otherwise `_held`, `_end` and `_settle` are inlined
        (a generator and two calls per message cost a third more at batch 100). A leased
        message has no delay and no count outside its lease, so only an override (a
        nack's new priority) is left to drop. An acked message stays in `leases`, marked
        ACKED in its record, until the trim of its event: no table by id is written.
        A group commit has the core apply an ack by receipts (`TRANSITIONS`), the
        same steps: a run in bulk, or fewer receipts than `BULK_MIN` one by one.
        """
        bulk = receipts is not None and len(receipts) >= BULK_MIN
        if bulk and (record := self._run_of(consumer, now, receipts)) is not None:
            self._ack_run(record, receipts[0] & POSITION_MASK, len(receipts), now)
            self._seen(consumer, now)
            return {}
        consumers = self.consumers
        refused: dict[str | int, Refusal] = {}
        leases, records, settled = self.leases, self.records, self.settled
        sort_keys, ending, held = self.sort_keys, self.ending, self.held
        acked, seq, events = LedgerEvent.ACKED, self.seq, self.events
        by_receipt = receipts is not None
        for key in receipts if by_receipt else mids:
            if by_receipt:
                record = records.get(key >> POSITION_BITS)
                if record is None:
                    refused[key] = Refusal.NOT_LEASED
                    continue
                pos = key & POSITION_MASK
            else:
                h = mh(key)
                record = leases.get(h)
                if record is None:
                    refused[key] = Refusal.SETTLED if h in settled else Refusal.NOT_LEASED
                    continue
                pos = record.position(h)
            taken = record.take(pos, consumer, now, ACKED)  # checked and ended, or why not
            if type(taken) is int:
                refused[key] = _REFUSAL_OF[taken]
                continue
            h, bucket, sort_key, deliveries, live = taken
            if not live:  # `_end`, inlined
                del self.leased[record.lid]
                ending.append((seq + 1, record.lid))
            counts = held[bucket]
            left = counts[consumer] - 1
            if left > 0:
                counts[consumer] = left
            else:
                del counts[consumer]
            seq += 1
            events.ack(seq, h, bucket, acked, sort_key, deliveries, now)
            if sort_keys:
                sort_keys.pop(h, None)
        if seq != self.seq:
            self.totals[acked] += seq - self.seq
            self.seq = seq
        if consumer in consumers and consumers[consumer] < now:  # `_seen`, inlined
            consumers[consumer] = now
        return refused

    def _run_of(self, consumer: str, now: int, receipts: list[int]) -> LeaseRecord | None:
        """The record whose consecutive positions `receipts` name, in order, each still
        leased by `consumer` before its deadline: what a worker acking its whole batch
        sends, settled in bulk (`_ack_run`). None otherwise."""
        first = receipts[0]
        record = self.records.get(first >> POSITION_BITS)
        start, n = first & POSITION_MASK, len(receipts)
        if record is None or not record.run_held(start, n, consumer, now):
            return None
        span = range(first, first + n)  # a range if the leader sent one (`consecutive`)
        return record if receipts == (span if type(receipts) is range else list(span)) else None

    def _ack_run(self, record: LeaseRecord, start: int, n: int, now: int) -> None:
        """Ack positions start..start+n of `record`, all leased: `ack`'s loop as C-level
        passes over the record's columns, no Python step per message."""
        acked, seq = LedgerEvent.ACKED, self.seq
        if not record.end_run(start, n, ACKED):
            del self.leased[record.lid]
            self.ending.append((seq + n, record.lid))
        handles, buckets, keys, counts = record.columns(start, start + n)
        hold(self.held, count_buckets(buckets), record.consumer, -1)
        self.events.add(Run(seq + 1, handles, buckets, acked, keys, counts, now))
        if self.sort_keys:
            deque(map(self.sort_keys.pop, handles_in(handles), repeat(None)), maxlen=0)
        self.seq = seq + n
        self.totals[acked] += n

    def reject(
        self, consumer: str, now: int, mids: list[str], receipts: list[int] | None = None
    ) -> dict[str | int, Refusal]:
        """Send leased messages straight to the dead letters."""
        refused: dict[str | int, Refusal] = {}
        for record, pos in self._held(consumer, now, mids, receipts, refused):
            h = record.mh(pos)
            self._end(record, pos, REJECTED, h)
            bucket, sort_key, _, deliveries = record.entry(pos)
            self._settle(h, bucket, sort_key, LedgerEvent.DEAD, now, deliveries, "rejected")
        return refused

    def nack(
        self,
        consumer: str,
        now: int,
        mids: list[str],
        delay_ms: int = 0,
        sort_key: int | None = None,
        backoff: RetryBackoff | None = None,
        receipts: list[int] | None = None,
    ) -> tuple[dict[str | int, Refusal], list[int], list[int]]:
        """Give leased messages back; returns (refused, the handles of those pending
        again, and of those dead: the leader names them for its answer, `Broker.nack`).

        Without a delay, the topic's retry `backoff` (if any) holds each back.
        """
        refused: dict[str | int, Refusal] = {}
        pending: list[int] = []
        dead: list[int] = []
        for record, pos in self._held(consumer, now, mids, receipts, refused):
            self.totals["nacked"] += 1
            h = record.mh(pos)
            if sort_key is not None:
                self.sort_keys[h] = sort_key
            retry = None if delay_ms > 0 else backoff
            if self._redeliver_or_die(record, pos, h, NACKED, now, retry):
                pending.append(h)
                if delay_ms > 0:
                    self.not_before[h] = now + delay_ms
                if sort_key is not None:
                    self._rescheduled(h, record.entry(pos)[0], sort_key, now)
            else:
                dead.append(h)
        return refused, pending, dead

    def _redeliver_or_die(
        self,
        record: LeaseRecord,
        pos: int,
        h: int,
        how: int,
        now: int,
        backoff: RetryBackoff | None = None,
    ) -> bool:
        """A lease ended unsettled (`how`): the message (of handle `h`) is pending again
        (after the retry backoff, if any), or dead if out of tries."""
        bucket, base_key, _, deliveries = record.entry(pos)
        if deliveries < self.max_deliveries:
            self._end(record, pos, how, h)
            self.deliveries[h] = deliveries
            if backoff is not None and backoff[0] > 0:
                self.not_before[h] = now + retry_delay(deliveries, *backoff)
            return True
        self._end(record, pos, DEAD, h)
        self._settle(
            h,
            bucket,
            self.sort_key(h, base_key),
            LedgerEvent.DEAD,
            now,
            deliveries,
            "max_deliveries",
        )
        return False

    def extend(
        self,
        consumer: str,
        now: int,
        mids: list[str],
        lease_ms: int,
        receipts: list[int] | None = None,
    ) -> tuple[dict[str | int, Refusal], int]:
        refused: dict[str | int, Refusal] = {}
        deadline = now + lease_ms
        for record, pos in self._held(consumer, now, mids, receipts, refused):
            record.extend(pos, deadline)
        self._seen(consumer, now)
        return refused, deadline

    def cancel(
        self, now: int, mid: str, bucket: int, sort_key: int, seen: int | None = None
    ) -> Refusal | None:
        """Cancel a message whether pending or leased (its holder's ack then gets 409).

        `seen`: the seq at which the leader found the message's row (None in commands
        from before it was carried). A message settled since is known as settled until
        a trim forgets it; past such a trim it could be settled a second time.
        """
        if _trimmed_past(self, seen):
            return Refusal.TRIMMED
        h = mh(mid)
        if self.settled_event(mid, h) is not None:
            return Refusal.SETTLED
        deliveries = self.deliveries.get(h, 0)
        record = self.leases.get(h)
        if record is not None:
            pos = record.position(h)
            deliveries = record.entry(pos)[3]
            self._end(record, pos, CANCELLED, h)
        self._settle(h, bucket, self.sort_key(h, sort_key), LedgerEvent.CANCELLED, now, deliveries)
        return None

    def reschedule(
        self,
        mid: str,
        sort_key: int,
        seen: int | None = None,
        now: int | None = None,
        bucket: int | None = None,
    ) -> Refusal | None:
        """Give a pending message a new sort key (priority or deliver_at). `seen` as in
        `cancel`: past a trim, a message settled since would keep its override for good.
        `now` and `bucket` (the time and the message's row's, absent from commands from
        before they were carried, which record no event): its `rescheduled` event."""
        if _trimmed_past(self, seen):
            return Refusal.TRIMMED
        h = mh(mid)
        if self.settled_event(mid, h) is not None:
            return Refusal.SETTLED
        if h in self.leases:
            return Refusal.LEASED
        self.sort_keys[h] = sort_key
        self.not_before.pop(h, None)
        if now is not None and bucket is not None:
            self._rescheduled(h, bucket, sort_key, now)
        return None

    def _rescheduled(self, h: int, bucket: int, sort_key: int, now: int) -> None:
        """Record the new key of the pending message of handle `h` as the next event: the
        ledger then holds it, for a deliverer that takes the topic over from the brokers
        (`pipelines.release`). It settles nothing: a trim forgets nothing of it."""
        self.seq += 1
        deliveries = self.deliveries.get(h, 0)
        event = Settlement(self.seq, h, bucket, LedgerEvent.RESCHEDULED, sort_key, deliveries, now)
        self.events.append(event)

    def expire(
        self, now: int, heartbeat_timeout_ms: int, backoff: RetryBackoff | None = None
    ) -> list[int]:
        """Expire leases past their deadline and silent consumers; returns the handles
        of the messages pending again."""
        pending: list[int] = []
        due = [r for r in self.leased.values() if r.earliest() <= now]
        for record in due:
            for pos in record.live_positions():
                if record.deadline_of(pos) > now:
                    continue
                self.totals["expired"] += 1
                h = record.mh(pos)
                if self._redeliver_or_die(record, pos, h, EXPIRED, now, backoff):
                    pending.append(h)
        silent = [c for c, seen in self.consumers.items() if seen + heartbeat_timeout_ms <= now]
        for consumer in silent:
            del self.consumers[consumer]
            self.requests.pop(consumer, None)
        if silent:
            self._rebalance()
        return pending

    def pause(self, paused: bool) -> bool:
        """Stop (or resume) leasing; acks, nacks, extends and expiry go on. Whether it
        changed anything."""
        changed, self.paused = self.paused != paused, paused
        return changed

    def trimmed_upto(self) -> int:
        """The last event seq trimmed away: events up to it are in the ledger, and here
        only those a trim kept."""
        first = self.events.first()
        return max(self.trimmed, self.seq if first is None else first - 1)

    def purge(self, now: int, upto: int, pending: list[Pick]) -> int | None:
        """Cancel the leader's list of the topic's pending messages; returns how many, or
        None to have the leader list them again.

        The list was taken when this state was trimmed up to `upto`. A message on it
        that settled since is known as settled unless a trim has forgotten it since: then
        the list may name a settled message, and nothing is done. A message leased
        meanwhile is left to its consumer, as are all leased ones: a worker mid-task can
        still ack, and a message it gives back is pending again.
        """
        if upto < self.trimmed_upto():
            return None
        cancelled = 0
        for mid, bucket, sort_key in pending:
            h = mh(mid)
            if h in self.settled or h in self.leases:
                continue
            key = self.sort_key(h, sort_key)
            deliveries = self.deliveries.get(h, 0)
            self._settle(h, bucket, key, LedgerEvent.CANCELLED, now, deliveries)
            cancelled += 1
        return cancelled

    def redrive(
        self, now: int, upto: int, dead: list[Dead], sort_key: int | None = None
    ) -> tuple[list[str], dict[str, Refusal]] | None:
        """Dead messages pending again, deliveries from 0, at `sort_key` or the key they
        died with; returns (redriven, refused), or None to have the leader read again.

        The leader finds the dead in the ledger (checkpointed up to seq `upto`) and in
        this state's events. Events after `upto` are here unless trimmed since: then the
        leader's list may be stale (a message redriven and settled since), so nothing is
        done. A message dead in `settled` died after anything the ledger says; one neither
        settled nor redriven since is as the ledger says. At most one redrive per death.
        """
        if upto < self.trimmed_upto():
            return None
        redriven: list[str] = []
        refused: dict[str, Refusal] = {}
        for mid, bucket, key in dead:
            h = mh(mid)
            event = self.settled_event(mid, h)
            if event is None and (h in self.redriven_at or h in self.leases):
                refused[mid] = Refusal.REDRIVEN
                continue
            if event is not None and event != LedgerEvent.DEAD:
                refused[mid] = Refusal.SETTLED
                continue
            self.settled.pop(h, None)
            key = key if sort_key is None else sort_key
            self.seq += 1
            self.events.append(Settlement(self.seq, h, bucket, LedgerEvent.REDRIVEN, key, 0, now))
            self.redriven_at[h] = self.seq
            self.redriven_ids[h] = mid
            self.sort_keys[h] = key
            self.deliveries.pop(h, None)
            self.not_before.pop(h, None)
            redriven.append(mid)
        self.totals[LedgerEvent.REDRIVEN] += len(redriven)
        return redriven, refused

    def needs_expiry(self, now: int, heartbeat_timeout_ms: int) -> bool:
        leased = list(self.leased.values())
        return any(r.earliest() <= now for r in leased) or any(
            seen + heartbeat_timeout_ms <= now for seen in list(self.consumers.values())
        )

    def trim(self, upto_seq: int, keep: Collection[int] = ()) -> bytes:
        """Forget events checkpointed into the ledger; returns their messages' handles,
        packed (`handles.packed`): every node's index forgets them by handle.

        Events are appended in `seq` order, so the checkpointed ones are a prefix of the
        runs (`EventLog.cut`). The events of seqs in `keep` (deaths whose dead letter is
        not written yet) stay, at the front, for the next checkpoint to try again.
        """
        ending, records = self.ending, self.records
        done = min(upto_seq, min(keep) - 1) if keep else upto_seq  # kept deaths: kept
        while ending and ending[0][0] <= done:
            records.pop(ending.popleft()[1], None)
        done = self.events.cut(upto_seq, keep)
        self.trimmed = max(self.trimmed, upto_seq)
        if self.redriven_at:
            return self._trim_redriven(settlements(done), upto_seq)
        parts: list[bytes] = []
        acked: list[int] = []  # single settlements' handles: acks from snapshots, by records
        others: list[int] = []  # in `settled`
        for e in done:
            if type(e) is Settlement:
                if e.event != LedgerEvent.RESCHEDULED:  # settles nothing
                    (acked if e.event == LedgerEvent.ACKED else others).append(e.mh)
            else:  # a `Run` or an `AckRun`
                parts.append(self._forget(e.handles, e.event == LedgerEvent.ACKED))
        if acked:
            parts.append(self._forget(packed_handles(acked), True))
        if others:
            parts.append(self._forget(packed_handles(others), False))
        return b"".join(parts)

    def _forget(self, handles: bytes, acked: bool) -> bytes:
        """Drop the settled messages of `handles` (packed): acked ones from `leases`
        (their records mark them), the others from `settled`."""
        if acked:
            self.leases.discard_all(handles)
        else:
            deque(map(self.settled.pop, handles_in(handles), repeat(None)), maxlen=0)
        return handles

    def _trim_redriven(self, done: Iterable[Settlement], upto_seq: int) -> bytes:
        """`trim` while some message has an untrimmed redrive: a settlement followed by a
        later redrive of its message no longer says what the message is (pending again,
        or settled anew), and a redriven or rescheduled event settles nothing: neither
        is forgotten.

        A redrive is remembered until its event and every earlier one of its message
        are trimmed: a death the trims kept (its dead letter not written yet) can be
        redriven, and trimmed after the redrive's event."""
        redriven_at, settled, leases = self.redriven_at, self.settled, self.leases
        handles: list[int] = []
        for e in done:
            h = e.mh
            if e.event not in _UNSETTLING and redriven_at.get(h, 0) < e.seq:
                (leases if e.event == LedgerEvent.ACKED else settled).pop(h, None)
                handles.append(h)
        kept = {e.mh for e in settlements(self.events.past(upto_seq)[0])}
        for h in [h for h, seq in redriven_at.items() if seq <= upto_seq and h not in kept]:
            del redriven_at[h]
            self.redriven_ids.pop(h, None)
        return packed_handles(handles)


# The events of a message still pending: a trim forgets nothing of them.
_UNSETTLING = (LedgerEvent.REDRIVEN, LedgerEvent.RESCHEDULED)
_V = TypeVar("_V")


def _by_handle(by_id: dict[str | int, _V]) -> dict[int, _V]:
    """A map of a snapshot from before message handles (by id) by handle; one by handle
    as it is. Every node hashes alike, so their states stay equal."""
    if not any(type(k) is str for k in by_id):
        return by_id
    return {mh(k) if type(k) is str else k: v for k, v in by_id.items()}


def pick_count(picks: Picks) -> int:
    """How many messages `picks` holds."""
    return len(picks[0]) // WIDTH


def unpacked(picks: Picks) -> tuple[list[int], array, array]:
    """A lease command's picks as (handles, buckets, sort keys), the latter two as a
    lease record keeps them: what the leader puts back, and renders its answer by."""
    handles, buckets, keys = picks
    return handles_in(handles), _little(array("H", buckets)), _little(array("q", keys))


def _as_picks(picks: list[Pick]) -> OldPicks:
    """A list of `Pick`s, as commands from before `Picks` carry them, as `Picks`."""
    mids = [m for m, _, _ in picks]
    buckets = _little(array("H", [b for _, b, _ in picks])).tobytes()
    return mids, buckets, _little(array("q", [k for _, _, k in picks])).tobytes()


_BIG_ENDIAN = sys.byteorder == "big"


def _little(a: array) -> array:
    """`a` from or to little-endian order, in place."""
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def consecutive(receipts: list[int]) -> list[int] | range:
    """Receipts as a Raft command carries them: a whole lease's, in order (a worker
    acking its batch), as a range, two ints instead of one per message; others as
    they are. Every transition taking receipts reads a range as the list it stands for.
    """
    if len(receipts) < BULK_MIN:
        return receipts
    span = range(receipts[0], receipts[0] + len(receipts))
    return span if receipts == list(span) else receipts


def retry_delay(deliveries: int, base_ms: int, max_ms: int) -> int:
    """The wait after the `deliveries`-th delivery failed: base * 2^(deliveries - 1), capped."""
    return min(max_ms, base_ms << min(deliveries - 1, 48))


def _trimmed_past(state: TopicState, seen: int | None) -> bool:
    """Whether a trim has passed seq `seen` (the state a command was made from): a
    message settled after it may be forgotten, no longer known as settled."""
    return seen is not None and state.trimmed_upto() > seen


def _owners(assignment: dict[int, str]) -> dict[str, list[int]]:
    owned: dict[str, list[int]] = {}
    for bucket, consumer in assignment.items():
        owned.setdefault(consumer, []).append(bucket)
    return owned
