"""Log lines for the jobs: timestamped, to stderr, quiet about Spark's own chatter."""

from __future__ import annotations

import logging
import sys


def setup(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("dejaq")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    logging.getLogger("py4j").setLevel(logging.WARNING)
