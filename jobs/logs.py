"""Log lines for the jobs: timestamped, to stderr, quiet about Spark's own chatter."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `dejaq kafka` and the broker log without Spark
    from pyspark.sql.streaming import StreamingQuery

_PYTHON_TRACEBACK = "Traceback (most recent call last):"


def setup(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("dejaq")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    logging.getLogger("py4j").setLevel(logging.WARNING)


@contextmanager
def stderr_to(path: Path) -> Iterator[Path]:
    """This process's file descriptor 2 appends to `path` meanwhile.

    Spark's driver JVM, its Python workers, Kafka and the broker nodes are child
    processes that inherit descriptor 2 when they start, so their logs land in the file
    too (and stay there after this returns), while stdout keeps a terminal display clean.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def query_failure(query: StreamingQuery) -> str | None:
    """Why a streaming query failed, in one line, or None if it did not.

    The root cause's class and message, from the JVM's exception chain: the query's own
    exception wraps it in the query's plan, and Spark has logged the whole stack already.
    A Python error (in foreachBatch, a Python source) comes as a traceback in the
    message; its last line names it.
    """
    failed = query._jsq.exception()
    if not failed.isDefined():
        return None
    cause = failed.get()
    while cause.getCause() is not None:
        cause = cause.getCause()
    text = str(cause.toString())
    if _PYTHON_TRACEBACK in text:
        return text.strip().splitlines()[-1].strip()
    return text.strip().splitlines()[0]


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
