"""A driver thread that produces each timeline message at its deliver_at, never before.

Micro-batches hand it what falls due before the next trigger and collect what Kafka has
acknowledged, for the ledger. Sending does not stop while a batch commits to Delta or
Spark plans the next trigger, so that overhead does not make messages late.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable

from kafka import KafkaProducer

from dejaq.pipelines.pending import Message, Order

# A message as it leaves: its record's key, value and headers.
Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


class TimedSender:
    """Sends scheduled messages in release order, each when the wall clock reaches its key."""

    def __init__(
        self, producer: KafkaProducer, topic: str, record: Callable[[Message], Record]
    ) -> None:
        self._producer = producer
        self._topic = topic
        self._record = record
        self._cv = threading.Condition()
        self._queue: list[tuple[Order, Message]] = []
        self._in_flight = 0
        self._acked: list[Message] = []
        self._failed: list[Message] = []
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dejaq-timed-sender", daemon=True)
        self._thread.start()

    def schedule(self, messages: list[Message]) -> None:
        with self._cv:
            for m in messages:
                heapq.heappush(self._queue, (m.order, m))
            self._cv.notify()

    @property
    def busy(self) -> bool:
        """Messages queued, in flight, or acknowledged but not yet collected."""
        with self._cv:
            return bool(self._queue or self._in_flight or self._acked)

    def take_acked(self) -> list[Message]:
        """What Kafka acknowledged since the last call, an error or not: the ledger says
        it was released, or a restart would send it again."""
        with self._cv:
            acked, self._acked = self._acked, []
            return acked

    @property
    def error(self) -> BaseException | None:
        """The first send error: sending stopped at it."""
        with self._cv:
            return self._error

    @property
    def failed(self) -> list[Message]:
        """The messages whose send failed, in release order."""
        with self._cv:
            return sorted(self._failed, key=lambda m: m.order)

    def stop(self) -> list[Message]:
        """Stop sending; wait for the acks of what was sent. Returns the unsent messages."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()
        with contextlib.suppress(Exception):  # after an error, each future says its own
            self._producer.flush()
        with self._cv:
            unsent = [m for _, m in sorted(self._queue)]
            self._queue.clear()
            return unsent

    def _next_due(self) -> Message | None:
        """Under the lock: wait until the first message is due; None when stopping, or
        after a send error (what follows is the release's to send, in order)."""
        while not self._stopping and self._error is None:
            if not self._queue:
                self._cv.wait()
                continue
            wait_ms = self._queue[0][1].sort_key - time.time() * 1000
            if wait_ms <= 0:
                self._in_flight += 1
                return heapq.heappop(self._queue)[1]
            self._cv.wait(wait_ms / 1000)
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                m = self._next_due()
            if m is None:
                return
            try:
                key, value, headers = self._record(m)
                future = self._producer.send(self._topic, key=key, value=value, headers=headers)
            except BaseException as e:
                self._fail(m, e)
                return
            future.add_callback(lambda _, m=m: self._sent(m))
            future.add_errback(lambda e, m=m: self._fail(m, e))

    def _sent(self, m: Message) -> None:
        with self._cv:
            self._in_flight -= 1
            self._acked.append(m)

    def _fail(self, m: Message, error: BaseException) -> None:
        with self._cv:
            self._in_flight -= 1
            self._failed.append(m)
            if self._error is None:
                self._error = error
