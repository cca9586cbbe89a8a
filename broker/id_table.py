"""Message id -> handle, as an open-addressing hash table in one NumPy array.

A dict from id to token cost ~60 bytes per message besides the id (its slot, ~30, and
the token's int object, 32); here a message costs 4 to 8 bytes of slots. A slot holds
a handle + 1 (0: empty, -1: deleted). The ids themselves stay where the row store keeps
them, by handle: a slot matches an id when the id at its handle is equal. Positions
come from Python's str hash, which each str caches and which differs between processes:
the table is a node's own, rebuilt from its handles at start.

Linear probing, vectorised: a call over k ids walks every id one slot per pass, a pass
being a few NumPy operations. Deleted slots are reused only by a rebuild, which runs
when used slots pass three quarters, into a table at most half full.
"""

from __future__ import annotations

from operator import eq

import numpy as np

EMPTY = 0
DELETED = -1
MIN_SLOTS = 1024


class IdTable:
    """Handles by id. `ids` is the row store's list of ids by handle, read, not owned."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.slots = np.zeros(MIN_SLOTS, np.int32)
        self.live = 0
        self.deleted = 0

    def __len__(self) -> int:
        return self.live

    def get(self, mid: str) -> int | None:
        """The handle of `mid`, if stored: one id, probed in Python."""
        slots, ids = self.slots, self.ids
        mask = len(slots) - 1
        i = hash(mid) & mask
        while True:
            s = int(slots[i])
            if s == EMPTY:
                return None
            if s > 0 and ids[s - 1] == mid:
                return s - 1
            i = (i + 1) & mask

    def find(self, mids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(handle, slot) of each id; -1 for both where it is not stored."""
        n = len(mids)
        slots, ids = self.slots, self.ids
        mask = len(slots) - 1
        pos = np.fromiter(map(hash, mids), np.int64, n) & mask
        found = np.full(n, -1, np.int64)
        todo = np.arange(n)
        while len(todo):
            at = pos[todo]
            s = slots[at].astype(np.int64)
            live = np.flatnonzero(s > 0)
            same = np.fromiter(
                map(
                    eq,
                    map(ids.__getitem__, (s[live] - 1).tolist()),
                    map(mids.__getitem__, todo[live].tolist()),
                ),
                bool,
                len(live),
            )
            hit = live[same]
            found[todo[hit]] = at[hit]
            go_on = s != EMPTY
            go_on[hit] = False
            todo = todo[go_on]
            pos[todo] = (pos[todo] + 1) & mask
        handles = np.where(found >= 0, slots[np.maximum(found, 0)].astype(np.int64) - 1, -1)
        return handles, found

    def insert(self, handles: np.ndarray) -> None:
        """Store `handles`, whose ids are in `ids` and none of them stored already."""
        if 4 * (self.live + self.deleted + len(handles)) > 3 * len(self.slots):
            self._rebuild(self.live + len(handles))
        self._place(handles)
        self.live += len(handles)

    def delete(self, slots: np.ndarray) -> None:
        """Empty `slots` (as `find` returned them, each a stored id's)."""
        self.slots[slots] = DELETED
        self.live -= len(slots)
        self.deleted += len(slots)

    def rebuild(self, handles: np.ndarray) -> None:
        """A fresh table of `handles` alone: the stored ones, after wholesale changes."""
        self.live = self.deleted = 0
        self.slots = np.zeros(_size_for(len(handles)), np.int32)
        self.insert(handles)

    def _rebuild(self, live: int) -> None:
        kept = self.slots[self.slots > 0].astype(np.int64) - 1
        self.slots = np.zeros(_size_for(live), np.int32)
        self.deleted = 0
        self._place(kept)

    def _place(self, handles: np.ndarray) -> None:
        """Each handle into the first empty slot from its id's position; of two handles
        wanting one slot in a pass, the first takes it and the other walks on."""
        slots, ids = self.slots, self.ids
        mask = len(slots) - 1
        n = len(handles)
        pos = np.fromiter(map(hash, map(ids.__getitem__, handles.tolist())), np.int64, n) & mask
        todo = np.arange(n)
        while len(todo):
            at = pos[todo]
            free = np.flatnonzero(slots[at] == EMPTY)
            taken, first = np.unique(at[free], return_index=True)
            slots[taken] = handles[todo[free[first]]] + 1
            go_on = np.ones(len(todo), bool)
            go_on[free[first]] = False
            todo = todo[go_on]
            pos[todo] = (pos[todo] + 1) & mask


def _size_for(live: int) -> int:
    """Slots for `live` ids: a power of two at least twice as many."""
    size = MIN_SLOTS
    while size < 2 * live:
        size *= 2
    return size
