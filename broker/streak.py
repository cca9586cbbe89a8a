"""Failures in a row of something a node does again and again (a duty's round, a Raft
tick), logged once per streak and kind of error rather than at each failure."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field


@dataclass
class Streak:
    """Failures in a row. Each kind of error (its type: messages carry paths and numbers
    that change every round) is logged once per streak, not at each round: an index
    refresh fails five times a second, and a Raft tick runs at every event of the loop;
    a traceback each would fill the disk. The end is logged at WARNING as the failure
    is, so a node logging warnings only (`jobs.broker`) shows both."""

    what: str  # what fails, as a log line names it: "indexing jobs"
    failures: int = 0  # in all, since the node started: a counter
    failing_since: float | None = None  # monotonic: the streak's first failure
    last_error: str = ""
    kinds: set[str] = field(default_factory=set)  # error types logged this streak
    log: logging.Logger = field(default=logging.getLogger("dejaq.broker"), repr=False)

    def failed(self, error: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        if type(error).__name__ not in self.kinds:
            self.kinds.add(type(error).__name__)
            self.log.error("%s failed; retrying", self.what, exc_info=error)
        if self.failing_since is None:
            self.failing_since = time.monotonic()

    def ok(self) -> None:
        """The streak, if any, ends. Nothing to do otherwise: cheap enough for each Raft
        tick."""
        if self.failing_since is None:
            return
        self.log.warning("%s works again after %.0f s", self.what, self.failing_for())
        self.failing_since, self.last_error = None, ""
        self.kinds.clear()

    def failing_for(self) -> float:
        """Seconds the streak has lasted; 0 if the last round worked. Read once: the
        duty's thread ends a streak while other threads ask."""
        since = self.failing_since
        return 0.0 if since is None else time.monotonic() - since
