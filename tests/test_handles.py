"""Message handles (`broker/state/handles.py`, `dejaq_core.message_handle`): BLAKE3's
reference digests, read as the design fixes them (first 16 bytes, little-endian), so a
node of any build and a snapshot's upgrade agree; one id and a batch hash alike, from
strs or packed ids; and the tests' helper names the handles back."""

from __future__ import annotations

import pytest
from conftest import Named
from dejaq_core import PackedIds
from hypothesis import given, settings
from hypothesis import strategies as st

from dejaq.broker.state.handles import WIDTH, handles_in, mh, mhs, packed, packed_handles

# BLAKE3's digests of b"" and b"abc" (its reference test vectors), first 16 bytes.
REFERENCE = {
    "": "af1349b9f5f9a1a6a0404dea36dcc949",
    "abc": "6437b3ac38465133ffb63b75273a8db5",
}
IDS = st.text(st.characters(codec="utf-8"), max_size=90)


def test_a_handle_is_the_first_16_bytes_of_blake3_read_little_endian() -> None:
    for mid, digest in REFERENCE.items():
        assert mh(mid) == int.from_bytes(bytes.fromhex(digest), "little")
        assert packed([mid]) == bytes.fromhex(digest)
    assert mh("é") != mh("e") and mh("a\0") != mh("a")  # every byte of the id counts


@settings(max_examples=200, deadline=None)
@given(mids=st.lists(IDS, max_size=20))
def test_a_batch_hashes_as_its_ids_one_by_one(mids: list[str]) -> None:
    blob = packed(mids)
    assert len(blob) == WIDTH * len(mids)
    assert handles_in(blob) == mhs(mids) == [mh(m) for m in mids]
    assert all(0 <= h < 1 << 128 for h in mhs(mids))
    assert packed(iter(mids)) == blob
    pack = PackedIds.pack(mids)
    if pack is not None:  # ids a lease command packs hash as their strs do
        assert packed(pack) == blob


def test_packed_handles_read_back_as_the_ints_they_pack() -> None:
    handles = [0, 1, 1 << 127 | 5, (1 << 128) - 1]
    blob = packed_handles(handles)
    assert blob[: WIDTH + 1] == bytes(WIDTH) + b"\x01", "little-endian"
    assert handles_in(blob) == handles and handles_in(b"") == []
    with pytest.raises(ValueError, match="16 bytes each"):
        handles_in(blob[:-1])


def test_distinct_ids_have_distinct_handles() -> None:
    mids = [f"m-{i}" for i in range(100_000)]
    assert len(set(mhs(mids))) == len(mids)


def test_named_gives_back_the_ids_a_test_wrote() -> None:
    named = Named(["a", "b"])
    named.note(["é"])
    assert named.ids([mh("é"), mh("a")]) == ["é", "a"]
    with pytest.raises(pytest.fail.Exception, match=f"{mh('c'):032x}"):
        named[mh("c")]
