"""A driver thread that produces each timeline message at its deliver_at, never before.

Micro-batches hand it what falls due before the next trigger and collect what Kafka has
acknowledged in order, for the ledger. Sending does not stop while a batch commits to
Delta or Spark plans the next trigger, so that overhead does not make messages late.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kafka import KafkaProducer, TopicPartition
from kafka.errors import KafkaTimeoutError

from dejaq.pipelines.kafka_sink import in_partition_order
from dejaq.pipelines.pending import Message, Order

# A message as it leaves: its record's key, value and headers.
Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


@dataclass
class _Send:
    """A message handed to the producer and not collected yet: its partition once the
    producer chose one, and whether Kafka acknowledged it (None until it answered)."""

    message: Message
    partition: TopicPartition | None = None
    acked: bool | None = None
    sent_at: float = 0.0  # monotonic


class TimedSender:
    """Sends scheduled messages in release order, each when the wall clock reaches its key."""

    def __init__(
        self,
        producer: KafkaProducer,
        topic: str,
        record: Callable[[Message], Record],
        wait_s: float,
    ) -> None:
        self._producer = producer
        self._topic = topic
        self._record = record
        self._wait_s = wait_s  # the longest a send waits for Kafka's answer
        self._cv = threading.Condition()
        self._queue: list[tuple[Order, Message]] = []
        self._sends: list[_Send] = []  # in send order
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
        """Messages queued, or sent and not yet collected."""
        with self._cv:
            return bool(self._queue or self._sends)

    def take_acked(self) -> list[Message]:
        """What Kafka acknowledged since the last call, an error or not, in order
        (`in_partition_order`): the ledger says it was released, or a restart would send
        it again. One acknowledged behind a send of its partition that failed is not
        taken: it is among `failed`, to be sent again after that one."""
        with self._cv:
            written = self._written()
            taken = [s.message for s, w in zip(self._sends, written, strict=True) if w]
            self._sends = [s for s, w in zip(self._sends, written, strict=True) if not w]
            return taken

    @property
    def error(self) -> BaseException | None:
        """The first send error, or a send Kafka has not answered within `wait_s`:
        sending stopped at it. A producer can be stuck for good (kafka-python's
        idempotent one, after Kafka was unreachable past its delivery timeout), and the
        job would go on scheduling sends that never end."""
        with self._cv:
            if self._error is None:
                now = time.monotonic()
                late = next((s for s in self._sends if s.acked is None), None)
                if late is not None and now - late.sent_at > self._wait_s:
                    self._error = KafkaTimeoutError(
                        f"Kafka has not answered a send to {self._topic} for "
                        f"{now - late.sent_at:.0f} s"
                    )
                    self._cv.notify()
            return self._error

    @property
    def failed(self) -> list[Message]:
        """After `stop`: the messages sent and not written in order, in release order:
        those whose send failed, and those behind one in their partition."""
        with self._cv:
            written = self._written()
            left = [s.message for s, w in zip(self._sends, written, strict=True) if not w]
            return sorted(left, key=lambda m: m.order)

    def _written(self) -> list[bool]:
        """Under the lock: which sends Kafka wrote in order so far."""
        return in_partition_order(
            [s.partition for s in self._sends], [s.acked is True for s in self._sends]
        )

    def stop(self) -> list[Message]:
        """Stop sending; wait for the acks of what was sent, `wait_s` at most: a send
        not answered by then stays among `failed`. Returns the unsent messages."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()
        # After an error each future says its own; past the wait, the producer is stuck.
        with contextlib.suppress(Exception):
            self._producer.flush(timeout=self._wait_s)
        with self._cv:
            unsent = [m for _, m in sorted(self._queue)]
            self._queue.clear()
            return unsent

    def _next_due(self) -> _Send | None:
        """Under the lock: wait until the first message is due; None when stopping, or
        after a send error (what follows is the release's to send, in order)."""
        while not self._stopping and self._error is None:
            if not self._queue:
                self._cv.wait()
                continue
            wait_ms = self._queue[0][1].sort_key - time.time() * 1000
            if wait_ms <= 0:
                send = _Send(heapq.heappop(self._queue)[1], sent_at=time.monotonic())
                self._sends.append(send)
                return send
            self._cv.wait(wait_ms / 1000)
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                send = self._next_due()
            if send is None:
                return
            try:
                key, value, headers = self._record(send.message)
                future = self._producer.send(self._topic, key=key, value=value, headers=headers)
            except BaseException as e:
                # Never taken by the producer, so last in every partition: no partition.
                self._answered(send, e)
                return
            with self._cv:
                send.partition = future._produce_future.topic_partition
            future.add_callback(lambda _, s=send: self._answered(s, None))
            future.add_errback(lambda e, s=send: self._answered(s, e))

    def _answered(self, send: _Send, error: BaseException | None) -> None:
        with self._cv:
            send.acked = error is None
            if error is not None and self._error is None:
                self._error = error
