"""Log lines for the jobs: timestamped, to stderr, quiet about Spark's own chatter."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
