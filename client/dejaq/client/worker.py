"""A worker: lease from a topic, run a handler per message, settle by the outcome.

Success acks; an exception nacks with exponential backoff, or rejects (dead letter) for
the exception types named permanent. One that ends the process (SystemExit,
KeyboardInterrupt) nacks too before it ends `run()`: however often the worker is
restarted, such a message reaches `max_deliveries` and is dead-lettered. While handlers
are quick, the acks of the messages they handled go to the broker together, one request
for many (each request waits out a Raft commit): at most `ack_linger_s` after the first
of them, or once a handler took longer than that, and always before the next lease and
before leaving. While a handler
runs, a keeper thread extends the leases in hand once half of one has passed, and
heartbeats so the consumer keeps its buckets. On SIGTERM, SIGINT or `stop()` the
message in the handler is finished and acked, the consumer leaves (its unstarted leases
go back to pending, not counted as a delivery, and its buckets to the other consumers),
and `run()` returns.

A leased message waits in hand while the ones before it run. Its lease is extended for
at most `max_wait_s`: past that, a handler that hangs would otherwise pin the rest of its
batch for as long as it hangs. Its lease then lapses (within `lease_ms`), it goes to
another consumer (one more delivery counted), and this worker does not start it; one
whose turn comes before is extended as it starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dejaq.client.api import Client
from dejaq.client.errors import BrokerError, Conflict, ProblemError
from dejaq.client.models import Message
from dejaq.client.stopping import stop_on_signals

log = logging.getLogger("dejaq.worker")

Handler = Callable[[Message], object]
SETTLED = "already_settled"
NOT_LEASED = "not_leased"
# The refusals a retried settle gets when its first attempt, whose answer was lost, did
# it: an ack or a reject settled the message; a nack gave it back (not leased now) or,
# on its last delivery, dead-lettered it (settled).
_OWN = {"acked": {SETTLED}, "rejected": {SETTLED}, "nacked": {SETTLED, NOT_LEASED}}
# Once the trim after a checkpoint has dropped a settled lease's record, a retried ack or
# reject is told `not_leased`: the message's status then says whether it is settled so.
_STATUS = {"acked": {"acked", "cancelled"}, "rejected": {"dead", "cancelled"}}
ERROR_PAUSE_S = 1.0  # after a failed lease: a broker answering 500 is not asked again at once
ACK_LINGER_S = 0.05  # how long a handled message's ack may wait for the next ones
MAX_WAIT_S = 300.0  # how long an unstarted message's lease is kept while others run
# Leases go at most this often while a topic is idle: an empty answer comes at once with
# a `wait_ms` under it, and asking again at once would keep the leader busy for nothing.
MIN_POLL_S = 0.1


@dataclass(frozen=True)
class Backoff:
    """The nack delay after a failed delivery: base * 2^(deliveries-1), capped, so a
    message that keeps failing is retried less and less often."""

    base_ms: int = 1000
    max_ms: int = 300_000

    def delay_ms(self, deliveries: int) -> int:
        return min(self.max_ms, self.base_ms << max(deliveries - 1, 0))


@dataclass
class Counts:
    acked: int = 0
    nacked: int = 0
    rejected: int = 0
    dead: int = 0  # of the nacked: out of deliveries, dead-lettered by the broker
    # refused at settlement (lease expired, taken over), or its lease lapsed before its
    # turn: delivered again
    lost: int = 0


def default_consumer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """Runs `handler` over the messages of `topic` until stopped."""

    def __init__(
        self,
        client: Client,
        topic: str,
        handler: Handler,
        *,
        consumer_id: str | None = None,
        batch: int = 10,
        lease_ms: int = 30_000,
        wait_ms: int = 1_000,
        backoff: Backoff | None = None,
        reject_on: tuple[type[BaseException], ...] = (),
        heartbeat_s: float = 3.0,
        progress_s: float = 30.0,
        on_ack: Callable[[Message], object] | None = None,
        ack_linger_s: float = ACK_LINGER_S,
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        """`heartbeat_s` must stay under the broker's `heartbeat_timeout_ms`; `wait_ms`
        (the long poll) bounds how long a stop waits while nothing is in hand, and after
        an empty answer the next lease waits until `MIN_POLL_S` (0.1 s) after the last
        (a `wait_ms` under it polls an idle topic 10 times a second, no more); `on_ack`
        is called with each message whose ack the broker confirmed; `ack_linger_s` (0:
        each ack in its own request) is how long a handled message's ack may wait to go
        with the next ones'. A waiting ack's lease is kept as a handler's is; a handler
        that takes long after quick ones holds their acks until it returns (and a worker
        that dies meanwhile leaves them to be delivered again). `max_wait_s` is how long
        the lease of a message not yet started is extended while the ones before it run.

        `consumer_id` must be unique to one live worker: two under one id share its
        buckets, and the leave of the one that stops gives back the other's leases in
        flight, to be delivered again. The default, `<host>-<pid>-<random>`, is new for
        each Worker."""
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be above 0, not {max_wait_s}")
        self.client, self.topic, self.handler = client, topic, handler
        self.consumer_id = consumer_id or default_consumer_id()
        self.batch, self.lease_ms, self.wait_ms = batch, lease_ms, wait_ms
        self.backoff = backoff or Backoff()
        self.reject_on = reject_on
        self.heartbeat_s, self.progress_s = heartbeat_s, progress_s
        self.on_ack = on_ack
        self.ack_linger_s = ack_linger_s
        self.max_wait_s = max_wait_s
        self._acks: list[Message] = []  # handled, their acks not yet sent
        self._acks_since = 0.0  # when the first of them was handled
        self.counts = Counts()
        self._stop = threading.Event()
        self._signalled = threading.Event()
        self._done = threading.Event()
        self._held: dict[str, Message] = {}
        # Of `_held`, the leased ones not yet started, and when their lease came: the
        # keeper stops keeping them `max_wait_s` after.
        self._unstarted: set[str] = set()
        self._leased_at = 0.0
        self._lock = threading.Lock()
        self._contact = time.monotonic()

    @property
    def stopping(self) -> bool:
        """Asked to stop: a long handler may check this to finish early."""
        return self._stop.is_set() or self._signalled.is_set()

    def stop(self) -> None:
        """Finish the message in hand, leave, and return from `run()`."""
        self._stop.set()

    def run(self) -> None:
        """Lease and handle until stopped; SIGTERM and SIGINT stop it when run in the
        main thread."""
        main = threading.current_thread() is threading.main_thread()
        signals = stop_on_signals() if main else contextlib.nullcontext(threading.Event())
        keeper = threading.Thread(target=self._keep, name=f"keeper-{self.consumer_id}")
        self._done.clear()
        with signals as signalled:
            self._signalled = signalled
            keeper.start()
            log.info("%s: consuming %s", self.consumer_id, self.topic)
            try:
                self._loop()
            finally:
                self._done.set()
                keeper.join()
                self._send_acks()  # handled before an exception ended the loop
                self._leave()

    def _loop(self) -> None:
        shown = time.monotonic()
        while not self.stopping:
            asked = time.monotonic()
            try:
                messages = self.client.lease(
                    self.topic, self.consumer_id, self.batch, self.lease_ms, self.wait_ms
                )
            except BrokerError as e:
                if isinstance(e, ProblemError) and e.status < 500:
                    raise  # a bad topic or request: retrying will not help
                log.warning("%s: lease failed: %s", self.consumer_id, e)
                self._stop.wait(ERROR_PAUSE_S)
                continue
            self._touched()
            if not messages:
                self._stop.wait(max(0.0, asked + MIN_POLL_S - time.monotonic()))
            with self._lock:
                self._held.update((m.id, m) for m in messages)
                self._unstarted.update(m.id for m in messages)
                self._leased_at = time.monotonic()
            for m in messages:
                if self.stopping:
                    break
                with self._lock:
                    self._unstarted.discard(m.id)
                if not self._renewed(m):
                    self._lapsed(m)
                    continue
                self._handle(m)
            self._send_acks()
            with self._lock:
                self._held.clear()  # unstarted ones, if stopping: the leave releases them
                self._unstarted.clear()
            if time.monotonic() - shown >= self.progress_s:
                shown = time.monotonic()
                log.info("%s: %s", self.consumer_id, self.counts)

    def _renewed(self, m: Message) -> bool:
        """Whether `m`, about to start, is still ours: one past `max_wait_s`, whose lease
        the keeper stopped extending, is extended first if half of it is gone, or the
        broker could hand it to another consumer before the keeper's next tick."""
        if m.held_until - time.monotonic() < self.lease_ms / 2000:
            try:
                self._extend([m])
            except BrokerError as e:
                log.warning("%s: extending %s failed: %s", self.consumer_id, m.id, e)
        return time.monotonic() < m.held_until

    def _lapsed(self, m: Message) -> None:
        """Leave a message whose lease lapsed before its turn to whoever has it now."""
        self.counts.lost += 1
        self._let_go([m])
        log.warning(
            "%s: lease of %s lapsed before its handler started: not handled here",
            self.consumer_id,
            m.id,
        )

    def _handle(self, m: Message) -> None:
        started = time.monotonic()
        try:
            self.handler(m)
        except self.reject_on as e:
            log.warning("%s: %s rejected to the dead letters: %r", self.consumer_id, m.id, e)
            self._settle([m], "rejected", self.client.reject)
        except Exception as e:
            self._failed(m, e)
        except BaseException as e:
            # SystemExit, KeyboardInterrupt...: they end the worker, and its leave gives
            # back what it holds uncounted. This message counts as a failed delivery, or
            # one that ends every worker it reaches would be delivered first for ever.
            self._failed(m, e)
            raise
        else:
            if not self._acks:
                self._acks_since = time.monotonic()
            self._acks.append(m)  # held, and so kept, until its ack is sent
            now = time.monotonic()
            if now - self._acks_since >= self.ack_linger_s or now - started >= self.ack_linger_s:
                self._send_acks()

    def _failed(self, m: Message, e: BaseException) -> None:
        """Nack `m` after its handler raised `e`, with the backoff of its delivery."""
        delay = self.backoff.delay_ms(m.deliveries)
        dead: list[str] = []

        def nack(topic: str, consumer: str, **named: Any) -> None:
            dead.extend(self.client.nack(topic, consumer, delay_ms=delay, **named).dead)

        if done := self._settle([m], "nacked", nack):
            if dead or done[0][1] == SETTLED:  # the broker's last allowed delivery
                self.counts.dead += 1
                again = "out of deliveries: dead-lettered"
            else:
                again = f"again in {delay} ms"
            log.warning(
                "%s: %s failed on delivery %d, %s: %r",
                self.consumer_id,
                m.id,
                m.deliveries,
                again,
                e,
            )

    def _send_acks(self) -> None:
        """Ack the handled messages in one request."""
        if not self._acks:
            return
        handled, self._acks = self._acks, []
        for m, _ in self._settle(handled, "acked", self.client.ack):
            if self.on_ack is not None:
                self.on_ack(m)

    def _settle(
        self, messages: list[Message], outcome: str, call: Callable[..., object]
    ) -> list[tuple[Message, str | None]]:
        """Settle `messages`, by their receipts, in one request; returns those the broker
        has settled by this worker, each with the refusal that says its retry found it
        done (None: done by this attempt), and lets go of them all.

        Such a refusal (`_OWN`, or a `not_leased` that `_status_says` is) after a retry
        is this call's own first attempt when the lease still held: no one else could
        settle a message leased to us (but for an operator's cancel, which the worker
        takes for its own).
        """
        named, keys = _named(messages)
        refused: dict[str, str] = {}
        maybe_applied = False
        try:
            call(self.topic, self.consumer_id, **named)
        except Conflict as e:  # the others are settled; none named: all refused
            refused = e.refused or dict.fromkeys(keys, e.title)
            maybe_applied = e.maybe_applied
        except BrokerError as e:
            self.counts.lost += len(messages)
            log.warning("%s: %d not %s: %s", self.consumer_id, len(messages), outcome, e)
            self._let_go(messages)
            return []
        settled: list[tuple[Message, str | None]] = []
        for m, key in zip(messages, keys, strict=True):
            why = refused.get(key)
            if why is None:
                settled.append((m, None))
            elif (
                maybe_applied
                and time.monotonic() < m.held_until
                and (why in _OWN[outcome] or self._status_says(m, outcome, why))
            ):
                log.info(
                    "%s: %s %s by an attempt whose answer was lost", self.consumer_id, m.id, outcome
                )
                settled.append((m, why))
            else:
                self.counts.lost += 1
                log.warning("%s: %s not %s (%s)", self.consumer_id, m.id, outcome, why)
        self._touched()
        setattr(self.counts, outcome, getattr(self.counts, outcome) + len(settled))
        log.debug("%s: %d %s", self.consumer_id, len(settled), outcome)
        self._let_go(messages)
        return settled

    def _status_says(self, m: Message, outcome: str, why: str) -> bool:
        """Whether a retried ack's or reject's `not_leased` is its lost first attempt's
        doing, by `m`'s status: the trim may have dropped the lease's record since. A
        status the key may not read (no `read` role) leaves the message lost."""
        if why != NOT_LEASED or outcome not in _STATUS:
            return False
        try:
            status = self.client.peek(self.topic, m.id).status
        except BrokerError as e:
            log.warning("%s: status of %s unknown: %s", self.consumer_id, m.id, e)
            return False
        return status in _STATUS[outcome]

    def _let_go(self, messages: list[Message]) -> None:
        with self._lock:
            for m in messages:
                self._held.pop(m.id, None)

    def _touched(self) -> None:
        self._contact = time.monotonic()

    def _keep(self) -> None:
        """Extend the leases in hand past half their time; heartbeat while handling."""
        half = self.lease_ms / 2000
        tick = max(0.05, min(half / 2, self.heartbeat_s / 2))
        while not self._done.wait(tick):
            now = time.monotonic()
            with self._lock:
                held = list(self._held.values())
                waited = now - self._leased_at >= self.max_wait_s
                unstarted = set(self._unstarted) if waited else set()
            due = [m for m in held if m.held_until - now < half and m.id not in unstarted]
            try:
                if due:
                    self._extend(due)
                elif held and now - self._contact >= self.heartbeat_s:
                    self.client.heartbeat(self.topic, self.consumer_id)
                    self._touched()
            except BrokerError as e:
                log.warning("%s: keeping leases failed: %s", self.consumer_id, e)

    def _extend(self, due: list[Message]) -> None:
        sent = time.monotonic()
        refused: dict[str, str] = {}
        named, keys = _named(due)
        try:
            self.client.extend(self.topic, self.consumer_id, lease_ms=self.lease_ms, **named)
        except Conflict as e:
            refused = e.refused
        self._touched()
        for m, key in zip(due, keys, strict=True):
            why = refused.get(key)
            if why is None:
                m.held_until = sent + self.lease_ms / 1000
                continue
            # Lost or settled: nothing left to extend. Its handler still runs; the ack
            # that follows is refused and logged.
            with self._lock:
                self._held.pop(m.id, None)
            if why != SETTLED:  # settled: acked meanwhile
                m.held_until = 0.0  # no longer ours: a later `already_settled` is not our ack
                log.warning("%s: lease of %s lost: %s", self.consumer_id, m.id, why)

    def _leave(self) -> None:
        try:
            left = self.client.leave(self.topic, self.consumer_id)
        except BrokerError as e:
            log.warning(
                "%s: leaving %s failed (%s): leases expire", self.consumer_id, self.topic, e
            )
            return
        log.info(
            "%s: left %s, %d leases released; %s",
            self.consumer_id,
            self.topic,
            left.released,
            self.counts,
        )


def _named(messages: list[Message]) -> tuple[dict[str, list], list[str]]:
    """How a settling call names `messages` (by receipt, or by id where the broker gave
    none), and the key of each in a 409's `refused`."""
    if all(m.receipt is not None for m in messages):
        receipts = [m.receipt for m in messages]
        return {"receipts": receipts}, [str(r) for r in receipts]
    ids = [m.id for m in messages]
    return {"ids": ids}, ids
