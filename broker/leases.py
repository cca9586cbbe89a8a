"""Lease, ack, nack, expiry and dead-letter semantics as a deterministic state machine.

Every transition takes the time from its command (the leader stamps it), so every Raft
node applying the same log reaches the same state: nothing here reads a clock, a table or
the network. The pending messages themselves live in the node-local index
(`broker.index`); this state only knows the messages something has happened to.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from enum import StrEnum
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

from dejaq.broker.assignment import rebalance
from dejaq.conf.tables import LedgerEvent


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


@dataclass(slots=True)
class Lease:
    consumer: str
    bucket: int
    sort_key: int
    deadline: int
    deliveries: int


class Settlement(NamedTuple):
    """A settled message waiting to be checkpointed into the ledger (and dead letters).

    A tuple: every node makes one per settled message, in the ack loop as a plain tuple
    is made (`_settlement`, not the Python-level `__new__`); a checkpoint converts a list
    of them to Arrow in one pass (`broker.ledger_writer.SETTLEMENT`).
    """

    seq: int
    message_id: str
    bucket: int
    event: str
    sort_key: int
    deliveries: int
    at: int
    reason: str | None = None


_settlement = tuple.__new__  # (Settlement, fields): a Settlement without a Python call


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


Pick = tuple[str, int, int]  # (message_id, bucket, sort_key), chosen by the leader's index
Dead = tuple[str, int, int]  # (message_id, bucket, sort_key at death), found by the leader
RetryBackoff = tuple[int, int]  # (retry_backoff_ms, retry_backoff_max_ms) of the topic
Grant = tuple[str, int, int]  # (message_id, deliveries, lease deadline ms)


class TopicState:
    """One topic's leases, delivery counts, overrides, consumers and bucket assignment."""

    def __init__(self, buckets: int, max_deliveries: int) -> None:
        self.buckets = buckets
        self.max_deliveries = max_deliveries
        self.leases: dict[str, Lease] = {}
        # Unsettled messages delivered at least once and not leased now (a lease holds its
        # own count): leasing and acking a first delivery, the usual case, touch no entry.
        self.deliveries: dict[str, int] = {}
        self.sort_keys: dict[str, int] = {}  # overrides: nack with priority, reschedule
        self.not_before: dict[str, int] = {}  # nack with delay
        self.settled: dict[str, str] = {}  # message_id -> event, until checkpointed
        self.events: list[Settlement] = []
        self.seq = 0
        self.consumers: dict[str, int] = {}  # consumer_id -> last seen, ms
        self.assignment: dict[int, str] = {}
        self.owned: dict[str, list[int]] = {}  # the assignment by consumer (derived)
        self.held: dict[int, Counter[str]] = {}  # bucket -> leases per consumer
        self.totals: Counter[str] = Counter()
        self.paused = False
        # The lease rate's token bucket (`max_lease_rate`), refilled up to the latest
        # leader-stamped time a lease carried: every node counts the same tokens.
        self.tokens = 0.0
        self.refilled_at = 0
        # message_id -> seq of its latest redriven event not yet trimmed (see `trim`).
        self.redriven_at: dict[str, int] = {}
        self.trimmed = 0  # the highest seq a trim reached (events it kept stay below it)

    def __getstate__(self) -> dict:
        """Snapshots hold what they held before `owned`: it is derived, rebuilt on load."""
        state = self.__dict__.copy()
        del state["owned"]
        return state

    def __setstate__(self, state: dict) -> None:
        # Snapshots from before pause, rate limits and redrive hold none of their state.
        self.paused, self.tokens, self.refilled_at, self.redriven_at = False, 0.0, 0, {}
        self.trimmed = 0
        self.__dict__.update(state)
        self.owned = _owners(self.assignment)
        for mid in self.leases:  # snapshots from before leases held the only count
            self.deliveries.pop(mid, None)
        self.events = [e.settlement() if isinstance(e, Event) else e for e in self.events]

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

    def leave(self, consumer: str, now: int) -> list[str]:
        """Remove a consumer and hand its leases back (not counted as a failed delivery)."""
        if self.consumers.pop(consumer, None) is None:
            return []
        released = [m for m, lease in self.leases.items() if lease.consumer == consumer]
        for mid in released:
            lease = self._drop_lease(mid)
            if lease.deliveries > 1:
                self.deliveries[mid] = lease.deliveries - 1
        self._rebalance()
        return released

    def buckets_of(self, consumer: str) -> list[int]:
        """Buckets assigned to `consumer` that no other consumer still holds leases in.

        Every lease asks, on every node: it walks the consumer's buckets, not all of them.
        """
        held = self.held
        out = []
        for b in self.owned.get(consumer, ()):
            h = held.get(b)
            mine_alone = not h or (len(h) == 1 and consumer in h)
            if mine_alone or not any(n for c, n in h.items() if c != consumer):
                out.append(b)
        return out

    def _rebalance(self) -> None:
        self.assignment = rebalance(self.buckets, self.consumers, self.assignment)
        self.owned = _owners(self.assignment)

    # --- leasing ---------------------------------------------------------------------

    def sort_key(self, mid: str, base: int) -> int:
        return self.sort_keys.get(mid, base)

    def is_available(self, mid: str, now: int) -> bool:
        """Neither leased nor settled nor held back by a nack delay."""
        return (
            mid not in self.leases
            and mid not in self.settled
            and self.not_before.get(mid, 0) <= now
        )

    def lease(
        self,
        consumer: str,
        now: int,
        lease_ms: int,
        picks: list[Pick],
        rate: float | None = None,
    ) -> list[Grant]:
        """Lease the leader's picks that are still available in the consumer's buckets.

        Every node runs this per leased message, so each costs two dict lookups of the
        message (settled? then insert unless leased), lookups are hoisted out of the loop
        and the per-bucket lease counts updated once per bucket. A paused topic leases
        nothing; `rate` (messages/s, from the leader's configuration) caps the picks at
        the tokens in the bucket: both checks once per lease, not per message.
        """
        self.touch(consumer, now)
        if self.paused:
            return []
        if rate is not None:
            self.tokens = self._tokens_at(now, rate)
            self.refilled_at = max(self.refilled_at, now)
            picks = picks[: int(self.tokens)]
        mine = set(self.buckets_of(consumer))
        deadline = now + lease_ms
        leases, settled, deliveries, not_before = (
            self.leases,
            self.settled,
            self.deliveries,
            self.not_before,
        )
        grants: list[Grant] = []
        per_bucket: dict[int, int] = {}
        redelivered = 0
        for mid, bucket, sort_key in picks:
            if bucket not in mine or mid in settled:
                continue
            # A leased message has neither a delay nor a count outside its lease.
            if not_before:
                if not_before.get(mid, 0) > now:
                    continue
                not_before.pop(mid, None)
            n = deliveries.pop(mid, 0) + 1 if deliveries else 1
            lease = Lease(consumer, bucket, sort_key, deadline, n)
            if leases.setdefault(mid, lease) is not lease:
                continue  # leased already
            if n > 1:
                redelivered += 1
            per_bucket[bucket] = per_bucket.get(bucket, 0) + 1
            grants.append((mid, n, deadline))
        for bucket, count in per_bucket.items():
            held = self.held.get(bucket)
            if held is None:
                held = self.held[bucket] = Counter()
            held[consumer] += count
        self.totals["leased"] += len(grants)
        self.totals["redelivered"] += redelivered
        if rate is not None:
            self.tokens -= len(grants)
        return grants

    def lease_budget(self, now: int, rate: float) -> int:
        """How many messages a lease at `now` may take under `rate`: the leader picks no
        more, so a limited topic does not pick (and put back) what it cannot grant."""
        return int(self._tokens_at(now, rate))

    def _tokens_at(self, now: int, rate: float) -> float:
        """The bucket at `now`: it holds one second's worth (at least 1), as the release
        job's `max_rate`. A leader stamping an earlier time than the last (a new leader
        whose clock is behind) refills nothing."""
        burst = max(rate, 1.0)
        elapsed = max(0, now - self.refilled_at)
        return min(self.tokens + elapsed * rate / 1000, burst)

    def _drop_lease(self, mid: str) -> Lease:
        lease = self.leases.pop(mid)
        held = self.held[lease.bucket]
        held[lease.consumer] -= 1
        if held[lease.consumer] <= 0:
            del held[lease.consumer]
        return lease

    def _check(self, consumer: str, mid: str, now: int) -> Lease | Refusal:
        if mid in self.settled:
            return Refusal.SETTLED
        lease = self.leases.get(mid)
        if lease is None:
            return Refusal.NOT_LEASED
        if lease.consumer != consumer:
            return Refusal.OTHER_CONSUMER
        if lease.deadline <= now:
            return Refusal.EXPIRED
        return lease

    def _settle(
        self,
        mid: str,
        bucket: int,
        sort_key: int,
        event: LedgerEvent,
        now: int,
        deliveries: int,
        reason: str | None = None,
    ) -> None:
        self.seq += 1
        self.events.append(
            Settlement(self.seq, mid, bucket, event, sort_key, deliveries, now, reason)
        )
        self.settled[mid] = event
        self.deliveries.pop(mid, None)
        self.sort_keys.pop(mid, None)
        self.not_before.pop(mid, None)
        self.totals[event] += 1

    def _take_leases(
        self, consumer: str, now: int, mids: list[str], refused: dict[str, Refusal]
    ) -> Iterator[tuple[str, Lease]]:
        """Each message whose lease `consumer` holds, with the lease now dropped.

        The others go into `refused` with the reason. Lazy, so each message is settled
        before the next is checked: an id given twice is refused the second time.
        """
        for mid in mids:
            lease = self._check(consumer, mid, now)
            if isinstance(lease, Refusal):
                refused[mid] = lease
                continue
            self._drop_lease(mid)
            yield mid, lease

    def ack(self, consumer: str, now: int, mids: list[str]) -> dict[str, Refusal]:
        """Settle leased messages for good; returns the refused ones with the reason.

        The hottest transition after `lease`, so `_take_leases`, `_check` and `_settle`
        are inlined, with the same refusals: an id given twice is refused the second
        time. The lease is popped first (a settled message has none), so an ack costs two
        dict lookups of the message, and the per-bucket lease counts are updated once per
        bucket. A leased message has no delay and no count outside its lease: only an
        override (a nack's new priority) is left to drop.
        """
        refused: dict[str, Refusal] = {}
        buckets: list[int] = []
        leases, settled, events, held = self.leases, self.settled, self.events, self.held
        sort_keys = self.sort_keys
        acked, seq = LedgerEvent.ACKED, self.seq
        for mid in mids:
            lease = leases.pop(mid, None)
            if lease is None:
                refused[mid] = Refusal.SETTLED if mid in settled else Refusal.NOT_LEASED
                continue
            if lease.consumer != consumer or lease.deadline <= now:
                leases[mid] = lease  # refused: the lease stands
                refused[mid] = (
                    Refusal.OTHER_CONSUMER if lease.consumer != consumer else Refusal.EXPIRED
                )
                continue
            buckets.append(lease.bucket)
            seq += 1
            events.append(
                _settlement(
                    Settlement,
                    (seq, mid, lease.bucket, acked, lease.sort_key, lease.deliveries, now, None),
                )
            )
            settled[mid] = acked
            if sort_keys:
                sort_keys.pop(mid, None)
        for bucket, count in Counter(buckets).items():
            counts = held[bucket]
            counts[consumer] -= count
            if counts[consumer] <= 0:
                del counts[consumer]
        if seq != self.seq:
            self.totals[acked] += seq - self.seq
            self.seq = seq
        self._seen(consumer, now)
        return refused

    def reject(self, consumer: str, now: int, mids: list[str]) -> dict[str, Refusal]:
        """Send leased messages straight to the dead letters."""
        refused: dict[str, Refusal] = {}
        for mid, lease in self._take_leases(consumer, now, mids, refused):
            self._settle(
                mid,
                lease.bucket,
                lease.sort_key,
                LedgerEvent.DEAD,
                now,
                lease.deliveries,
                "rejected",
            )
        return refused

    def nack(
        self,
        consumer: str,
        now: int,
        mids: list[str],
        delay_ms: int = 0,
        sort_key: int | None = None,
        backoff: RetryBackoff | None = None,
    ) -> tuple[dict[str, Refusal], list[str]]:
        """Give leased messages back; returns (refused, messages pending again).

        Without a delay, the topic's retry `backoff` (if any) holds each back.
        """
        refused: dict[str, Refusal] = {}
        pending: list[str] = []
        for mid, lease in self._take_leases(consumer, now, mids, refused):
            self.totals["nacked"] += 1
            if sort_key is not None:
                self.sort_keys[mid] = sort_key
            retry = None if delay_ms > 0 else backoff
            if self._redeliver_or_die(mid, lease, now, "max_deliveries", retry):
                pending.append(mid)
                if delay_ms > 0:
                    self.not_before[mid] = now + delay_ms
        return refused, pending

    def _redeliver_or_die(
        self, mid: str, lease: Lease, now: int, reason: str, backoff: RetryBackoff | None = None
    ) -> bool:
        """A lease ended unsettled: the message is pending again (after the retry backoff,
        if any), or dead if out of tries."""
        if lease.deliveries < self.max_deliveries:
            self.deliveries[mid] = lease.deliveries
            if backoff is not None and backoff[0] > 0:
                self.not_before[mid] = now + retry_delay(lease.deliveries, *backoff)
            return True
        self._settle(
            mid,
            lease.bucket,
            self.sort_key(mid, lease.sort_key),
            LedgerEvent.DEAD,
            now,
            lease.deliveries,
            reason,
        )
        return False

    def extend(
        self, consumer: str, now: int, mids: list[str], lease_ms: int
    ) -> tuple[dict[str, Refusal], int]:
        refused: dict[str, Refusal] = {}
        for mid in mids:
            lease = self._check(consumer, mid, now)
            if isinstance(lease, Refusal):
                refused[mid] = lease
            else:
                lease.deadline = now + lease_ms
        self._seen(consumer, now)
        return refused, now + lease_ms

    def cancel(self, now: int, mid: str, bucket: int, sort_key: int) -> Refusal | None:
        """Cancel a message whether pending or leased (its holder's ack then gets 409)."""
        if mid in self.settled:
            return Refusal.SETTLED
        deliveries = self.deliveries.get(mid, 0)
        if mid in self.leases:
            deliveries = self._drop_lease(mid).deliveries
        self._settle(
            mid, bucket, self.sort_key(mid, sort_key), LedgerEvent.CANCELLED, now, deliveries
        )
        return None

    def reschedule(self, mid: str, sort_key: int) -> Refusal | None:
        """Give a pending message a new sort key (priority or deliver_at)."""
        if mid in self.settled:
            return Refusal.SETTLED
        if mid in self.leases:
            return Refusal.LEASED
        self.sort_keys[mid] = sort_key
        self.not_before.pop(mid, None)
        return None

    def expire(
        self, now: int, heartbeat_timeout_ms: int, backoff: RetryBackoff | None = None
    ) -> list[str]:
        """Expire leases past their deadline and silent consumers; returns pending mids."""
        pending: list[str] = []
        for mid in [m for m, lease in self.leases.items() if lease.deadline <= now]:
            lease = self._drop_lease(mid)
            self.totals["expired"] += 1
            if self._redeliver_or_die(mid, lease, now, "max_deliveries", backoff):
                pending.append(mid)
        silent = [c for c, seen in self.consumers.items() if seen + heartbeat_timeout_ms <= now]
        for consumer in silent:
            del self.consumers[consumer]
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
        return max(self.trimmed, self.events[0].seq - 1 if self.events else self.seq)

    def purge(self, now: int, upto: int, pending: list[Pick]) -> int | None:
        """Cancel the leader's list of the topic's pending messages; returns how many, or
        None to have the leader list them again.

        The list was taken when this state was trimmed up to `upto`. A message on it that
        settled since is in `settled` unless a trim has forgotten it since: then the list
        may name a settled message, and nothing is done. A message leased meanwhile is
        left to its consumer, as are all leased ones: a worker mid-task can still ack,
        and a message it gives back is pending again.
        """
        if upto < self.trimmed_upto():
            return None
        cancelled = 0
        for mid, bucket, sort_key in pending:
            if mid in self.settled or mid in self.leases:
                continue
            key = self.sort_key(mid, sort_key)
            deliveries = self.deliveries.get(mid, 0)
            self._settle(mid, bucket, key, LedgerEvent.CANCELLED, now, deliveries)
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
            event = self.settled.get(mid)
            if event is None and (mid in self.redriven_at or mid in self.leases):
                refused[mid] = Refusal.REDRIVEN
                continue
            if event is not None and event != LedgerEvent.DEAD:
                refused[mid] = Refusal.SETTLED
                continue
            self.settled.pop(mid, None)
            key = key if sort_key is None else sort_key
            self.seq += 1
            self.events.append(Settlement(self.seq, mid, bucket, LedgerEvent.REDRIVEN, key, 0, now))
            self.redriven_at[mid] = self.seq
            self.sort_keys[mid] = key
            self.deliveries.pop(mid, None)
            self.not_before.pop(mid, None)
            redriven.append(mid)
        self.totals[LedgerEvent.REDRIVEN] += len(redriven)
        return redriven, refused

    def needs_expiry(self, now: int, heartbeat_timeout_ms: int) -> bool:
        return any(lease.deadline <= now for lease in list(self.leases.values())) or any(
            seen + heartbeat_timeout_ms <= now for seen in list(self.consumers.values())
        )

    def trim(self, upto_seq: int, keep: Collection[int] = ()) -> list[str]:
        """Forget events checkpointed into the ledger; returns their message ids.

        Events are appended in `seq` order, so the checkpointed ones are a prefix. It is
        cut off in place: a checkpoint is trimmed in slices, and copying the rest of the
        list each time touched every later event once per slice. The events of seqs in
        `keep` (deaths whose dead letter is not written yet) stay, at the front, for the
        next checkpoint to try again.
        """
        events = self.events
        cut = bisect_right(events, upto_seq, key=_seq)
        done = events[:cut]
        del events[:cut]
        self.trimmed = max(self.trimmed, upto_seq)
        if keep:
            kept = set(keep)
            events[:0] = [e for e in done if e.seq in kept]
            done = [e for e in done if e.seq not in kept]
        if self.redriven_at:
            return self._trim_redriven(done)
        mids = list(map(_message_id, done))
        deque(map(self.settled.pop, mids, repeat(None)), maxlen=0)
        return mids

    def _trim_redriven(self, done: list[Settlement]) -> list[str]:
        """`trim` while some message has an untrimmed redrive: a settlement followed by a
        later redrive of its message no longer says what the message is (pending again,
        or settled anew), and a redriven event settles nothing: neither is forgotten."""
        redriven_at, settled = self.redriven_at, self.settled
        mids: list[str] = []
        for e in done:
            mid = e.message_id
            last = redriven_at.get(mid, 0)
            if e.event == LedgerEvent.REDRIVEN:
                if last == e.seq:
                    del redriven_at[mid]
            elif last < e.seq:
                settled.pop(mid, None)
                mids.append(mid)
        return mids


def retry_delay(deliveries: int, base_ms: int, max_ms: int) -> int:
    """The wait after the `deliveries`-th delivery failed: base * 2^(deliveries - 1), capped."""
    return min(max_ms, base_ms << min(deliveries - 1, 48))


_seq = itemgetter(0)  # of a Settlement
_message_id = itemgetter(1)


def _owners(assignment: dict[int, str]) -> dict[str, list[int]]:
    owned: dict[str, list[int]] = {}
    for bucket, consumer in assignment.items():
        owned.setdefault(consumer, []).append(bucket)
    return owned
