"""How a long-running process stops: on SIGTERM or Ctrl-C, cleanly, never mid-write."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGTERM, SIGINT and SIGHUP (its terminal closed) set the event instead of ending
    the process, while inside; those the platform lacks (Windows has no SIGHUP) are
    passed over.

    The command then stops its own work in order (a batch boundary, a child's SIGTERM);
    the previous handlers are back afterwards.
    """
    stopping = threading.Event()
    names = ("SIGTERM", "SIGINT", "SIGHUP")
    present = [getattr(signal, n) for n in names if hasattr(signal, n)]
    previous = {s: signal.signal(s, lambda *_: stopping.set()) for s in present}
    try:
        yield stopping
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
