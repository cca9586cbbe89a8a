"""How the long-running commands stop: on SIGTERM or Ctrl-C, cleanly, never mid-write."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dejaq.client.stopping import stop_on_signals

if TYPE_CHECKING:  # `dejaq kafka` and `dejaq cluster` use this module without Spark
    from pyspark.sql.streaming import StreamingQuery

__all__ = ["stop_between_batches", "stop_on_signals"]

STOP_WAIT_SECONDS = 120


def stop_between_batches(query: StreamingQuery) -> None:
    """Wait for the running micro-batch to finish (bounded), then stop the query.

    Stopping mid-batch would also be safe (the batch is replayed idempotently), but a
    clean boundary makes a restart start with fresh work instead of a replay.
    """
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
        time.sleep(0.1)
    query.stop()
