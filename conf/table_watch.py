"""Whether a followed Delta table has moved, at an object store's price.

Every broker node follows each buffer, and the release job its own, several times a
second. delta-rs's update lists the log from the version it holds: on S3 a LIST and a
GET each time, billed per thousand, idle or not. A new version is a new log entry, so
one HEAD of the next entry's key answers the question; while none comes, an object
store is asked less and less often, up to `IDLE_PROBE_MAX_S` apart (a local file
system is asked every time: a stat is free). The first new version resets the pace.

A follower further behind than the table keeps its log finds no next entry ever again
(`conf.tables.LOG_RETENTION`): while none comes, the table's `_last_checkpoint` is read
too, once a `CHECKPOINT_PROBE_S`, and a checkpoint past the follower's version is a move.
"""

from __future__ import annotations

import time

from dejaq.conf.delta_log import checkpointed, entry_key
from dejaq.conf.storage import filesystem, has_folders

IDLE_PROBE_MAX_S = 1.0
CHECKPOINT_PROBE_S = 60.0


class TableWatch:
    """Probes `<path>/_delta_log/<version + 1>.json`, backing off on an object store."""

    def __init__(self, path: str, first_wait_s: float = 0.2) -> None:
        self.path = path
        self.fs, self.root = filesystem(path)
        self.remote = not has_folders(self.fs)
        self.first_wait_s = first_wait_s
        self.wait_s = 0.0
        self.next_probe = 0.0
        self.next_checkpoint_probe = 0.0
        self.probes = 0  # requests made: what following the table has cost

    def moved(self, version: int) -> bool:
        """Whether `version + 1` is committed; False without asking while backing off."""
        now = time.monotonic()
        if now < self.next_probe:
            return False
        self.probes += 1
        found = self._exists(entry_key(self.root, version + 1))
        if not found and now >= self.next_checkpoint_probe:
            self.next_checkpoint_probe = now + CHECKPOINT_PROBE_S
            self.probes += 1
            found = checkpointed(self.fs, self.root) > version
        if found:
            self.wait_s = 0.0
        elif self.remote:
            self.wait_s = min(max(self.wait_s * 2, self.first_wait_s), IDLE_PROBE_MAX_S)
        self.next_probe = now + self.wait_s
        return found

    def _exists(self, key: str) -> bool:
        """One HEAD: opening a stream reads nothing until asked (`get_file_info` would
        also list the key as a folder when it is missing)."""
        try:
            self.fs.open_input_stream(key).close()
        except FileNotFoundError:
            return False
        return True
