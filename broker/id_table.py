"""Message id -> handle, as an open-addressing hash table in one NumPy array.

A dict from id to token cost ~60 bytes per message besides the id (its slot, ~30, and
the token's int object, 32); here a message costs 5 to 16 bytes of int32 slots (the
table is a quarter to three quarters full). A slot holds a handle + 1 (0: empty, -1:
deleted). The ids themselves stay where the row store keeps them, by handle: a slot
matches an id when the id at its handle is equal. Positions come from Python's str
hash, which each str caches and which differs between processes: the table is a node's
own, rebuilt from its handles at start.

Linear probing. A look-up of many ids takes one vectorised step (a few NumPy
operations), which settles nearly all of them, then probes the rest one at a time.
Deleted slots are reused only by a rebuild, when used slots would pass three quarters,
into a table at most half full. A rebuild over a million ids takes a fraction of a
second: `make_room` does it before an insert, outside the caller's lock.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from itertools import compress
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
        self._deleting: list[np.ndarray] | None = None  # handles deleted during a rebuild

    def __len__(self) -> int:
        return self.live

    def get(self, mid: str) -> int | None:
        """The handle of `mid`, if stored: one id, probed in Python."""
        i = self._slot(mid, hash(mid) & (len(self.slots) - 1))
        return None if i < 0 else int(self.slots[i]) - 1

    def _slot(self, mid: str, i: int) -> int:
        """The slot of `mid` probing from slot `i`, or -1."""
        slots, ids = self.slots, self.ids
        mask = len(slots) - 1
        while True:
            s = int(slots[i])
            if s == EMPTY:
                return -1
            if s > 0 and ids[s - 1] == mid:
                return i
            i = (i + 1) & mask

    def find(self, mids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(handle, slot) of each id; -1 for both where it is not stored."""
        n = len(mids)
        slots, ids = self.slots, self.ids
        mask = len(slots) - 1
        found = np.fromiter(map(hash, mids), np.int64, n) & mask
        s = slots[found].astype(np.int64)
        live = s > 0
        live[live] = np.fromiter(
            map(eq, map(ids.__getitem__, (s[live] - 1).tolist()), compress(mids, live.tolist())),
            bool,
        )
        # At its first slot, or not stored: the rest walk on, one at a time.
        for k in np.flatnonzero(~live & (s != EMPTY)).tolist():
            found[k] = self._slot(mids[k], (int(found[k]) + 1) & mask)
        found[s == EMPTY] = -1
        handles = np.where(found >= 0, slots[np.maximum(found, 0)].astype(np.int64) - 1, -1)
        return handles, found

    def _full(self, n: int) -> bool:
        return 4 * (self.live + self.deleted + n) > 3 * len(self.slots)

    def make_room(self, n: int, lock: AbstractContextManager) -> None:
        """Room for `n` inserts, by a rebuild if need be, called outside `lock` (which
        every other call to this table is made under) by the one thread that inserts.

        The new table is built from the handles stored when it starts; those deleted
        meanwhile are noted as they go and deleted from it under the lock, as it
        replaces the old table.
        """
        with lock:
            if not self._full(n):
                return
            kept = self._stored()
            self._deleting = []
        try:
            slots = self._built(kept, n)
        except BaseException:
            with lock:
                self._deleting = None
            raise
        with lock:
            deleting, self._deleting = self._deleting or [], None
            if deleting:
                used = np.flatnonzero(slots > 0)
                gone = np.isin(slots[used] - 1, np.concatenate(deleting))
                slots[used[gone]] = DELETED
            deleted = sum(map(len, deleting))
            self.slots, self.live, self.deleted = slots, len(kept) - deleted, deleted

    def insert(self, handles: np.ndarray) -> None:
        """Store `handles`, whose ids are in `ids` and none of them stored already."""
        if self._full(len(handles)):
            self.slots = self._built(self._stored(), len(handles))
            self.deleted = 0
        _place(self.slots, self.ids, handles)
        self.live += len(handles)

    def delete(self, slots: np.ndarray) -> None:
        """Empty `slots` (as `find` returned them, each a stored id's)."""
        if self._deleting is not None:  # a rebuild is under way
            self._deleting.append(self.slots[slots].astype(np.int64) - 1)
        self.slots[slots] = DELETED
        self.live -= len(slots)
        self.deleted += len(slots)

    def _stored(self) -> np.ndarray:
        """The handles the table holds."""
        return self.slots[self.slots > 0].astype(np.int64) - 1

    def _built(self, handles: np.ndarray, more: int) -> np.ndarray:
        """A table of `handles` with room for `more`."""
        slots = np.zeros(_size_for(len(handles) + more), np.int32)
        _place(slots, self.ids, handles)
        return slots


def _place(slots: np.ndarray, ids: list[str], handles: np.ndarray) -> None:
    """Each handle into the first empty slot from its id's position; of two handles
    wanting one slot in a pass, the first takes it and the other walks on."""
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
