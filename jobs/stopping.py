"""How the long-running commands stop: on SIGTERM or Ctrl-C, cleanly, never mid-write."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `dejaq kafka` and `dejaq cluster` use this module without Spark
    from pyspark.sql.streaming import StreamingQuery

STOP_WAIT_SECONDS = 120


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGTERM, SIGINT and SIGHUP (its terminal closed) set the event instead of ending
    the process, while inside.

    The command then stops its own work in order (a batch boundary, a child's SIGTERM);
    the previous handlers are back afterwards.
    """
    stopping = threading.Event()
    previous = {
        s: signal.signal(s, lambda *_: stopping.set())
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    try:
        yield stopping
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_between_batches(query: StreamingQuery) -> None:
    """Wait for the running micro-batch to finish (bounded), then stop the query.

    Stopping mid-batch would also be safe (the batch is replayed idempotently), but a
    clean boundary makes a restart start with fresh work instead of a replay.
    """
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
        time.sleep(0.1)
    query.stop()
