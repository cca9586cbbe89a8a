"""Message handles ("mh") in Python: the compiled core's hash of an id (the first 16 bytes
of its BLAKE3, little-endian, `dejaq_core.message_handle`), as an int, which the lease
state is keyed by, and batches of them packed 16 bytes each, as the index looks them up
and a snapshot's upgrade hashes them."""

from __future__ import annotations

from collections.abc import Iterable

from dejaq_core import PackedIds, message_handle, message_handles, unpack_handles

WIDTH = 16  # bytes of a packed handle


class KeyedByHandle:
    """The mark a snapshot's topic state carries (`TopicState.__getstate__`): its lease
    state is keyed by message handle. Pickled as a reference to this class, which an
    id-keyed version lacks, so a node of that version refuses the snapshot (unpickling
    it fails on this module) instead of loading handles where it expects ids, which
    would lease settled messages again."""


def mh(mid: str) -> int:
    """The handle of `mid`: every node computes the same one, with no key to share."""
    return message_handle(mid)


def packed(mids: Iterable[str] | PackedIds) -> bytes:
    """The handles of `mids` packed in one bytes object, in their order: one call for a
    batch, no int per id."""
    return message_handles(mids if isinstance(mids, list | PackedIds) else list(mids))


def packed_handles(handles: Iterable[int]) -> bytes:
    """Handles (ints) packed as `packed` packs those of ids: an index looks them up so."""
    return b"".join(h.to_bytes(WIDTH, "little") for h in handles)


def handles_in(blob: bytes) -> list[int]:
    """The handles packed in `blob`, as ints: the core's loop, with no Python step per
    handle (`unpack_handles`)."""
    return unpack_handles(blob)


def mhs(mids: Iterable[str] | PackedIds) -> list[int]:
    """The handle of each of `mids`, as ints."""
    return handles_in(packed(mids))
