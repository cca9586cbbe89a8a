"""A leased message as JSON: rendered once when its row is indexed, finished per lease.

Formatting JSON (base64, escaping, nine fields) was the lease path's largest cost after
picking, on the leader's event loop. Each message's fixed fields are rendered once
(`head`, in the thread that follows the tables) into the node's `HeadStore`; a lease
only adds what it decides, deliveries, deadline and receipt: in the compiled core, in
one pass, for the usual case (first delivery, the row's own sort key).
"""

from __future__ import annotations

import binascii
import json
from typing import Any

from dejaq_core import render_leased

from dejaq.broker.state.handles import WIDTH, handles_in
from dejaq.broker.state.leases import LeaseRecord, Picks, unpacked
from dejaq.broker.storage.row_store import Heads, Taken

_json_str = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def _b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def head(
    mid: str,
    bucket: int,
    key: bytes | None,
    payload: bytes | None,
    sort_key: int,
    deliver_at: int | None,
    timeline: bool,
) -> str:
    """The message's JSON object up to (not including) deliveries and lease deadline. A
    record without a value (a Kafka tombstone) has a null payload, as an empty one has "",
    and is released as it came."""
    k = "null" if key is None else f'"{_b64(key)}"'
    p = "null" if payload is None else f'"{_b64(payload)}"'
    prio, at = ("null", sort_key) if timeline else (sort_key, deliver_at)
    return (
        f'{{"id": {_json_str(mid)}, "bucket": {bucket}, "key": {k}, '
        f'"payload": {p}, "sort_key": {sort_key}, "priority": {prio}, '
        f'"deliver_at": {"null" if at is None else at}'
    )


def message(
    rendered: Taken,
    sort_key: int,
    deliveries: int,
    deadline: int,
    timeline: bool,
    receipt: int | None = None,
) -> dict[str, Any]:
    """The message as a dict, with its current sort key (a nack or reschedule may have
    changed it from `rendered`'s, the row's): what `leased_array` renders (with the
    lease's `receipt`), and what peek shows. `rendered`: (the row's sort key, its head)."""
    row_key, head = rendered
    out = json.loads(head + b"}")
    if sort_key != row_key:
        out.update(
            sort_key=sort_key,
            priority=None if timeline else sort_key,
            deliver_at=sort_key if timeline else out["deliver_at"],
        )
    out.update(deliveries=deliveries, lease_deadline=deadline)
    if receipt is not None:
        out["receipt"] = receipt
    return out


def leased_array(picks: Picks, rendered: Heads, lease: LeaseRecord, timeline: bool) -> bytes:
    """The JSON array of leased messages: what `json.dumps` gives of their `message`s.

    `picks` and their `rendered` heads (which hold the messages' ids) are what the
    lease asked for; `lease`, what it got: the picks it took, in pick order, so both
    are walked together by message handle.
    """
    n = len(lease)
    if not n:
        return b"[]"
    deadline, receipt = lease.deadline, lease.receipt(0)
    packed_handles, _, packed_keys = picks
    if n * WIDTH == len(packed_handles) and lease.all_first():  # every pick, first delivery
        whole = render_leased(
            rendered.joined, rendered.ends, rendered.row_keys, packed_keys, deadline, receipt
        )
        if whole is not None:  # each at its row's own key
            return whole
    first = b', "deliveries": 1, "lease_deadline": %d, "receipt": %%d}, ' % deadline
    picked, _, keys = unpacked(picks)
    parts = []
    i = 0
    for h, deliveries in zip(handles_in(lease.handles), lease.deliveries, strict=True):
        while picked[i] != h:
            i += 1
        key, (row_key, head) = keys[i], rendered[i]
        if deliveries == 1 and key == row_key:
            parts.append(head)
            parts.append(first % receipt)
        else:
            msg = message(rendered[i], key, deliveries, deadline, timeline, receipt)
            parts.append(json.dumps(msg).encode() + b", ")
        receipt += 1
    return b"[" + b"".join(parts)[:-2] + b"]"


def held_array(
    lease: LeaseRecord, positions: list[int], rendered: list[Taken | None], timeline: bool
) -> bytes:
    """The JSON array of the messages at `positions` of `lease`, each with its
    `rendered` head (None: the index forgot it, and it is left out), as `leased_array`
    rendered them when it was granted but for a deadline extended since: the answer to
    the same request sent again."""
    messages = []
    for pos, taken in zip(positions, rendered, strict=True):
        if taken is not None:
            _, sort_key, deadline, deliveries = lease.entry(pos)
            receipt = lease.receipt(pos)
            messages.append(message(taken, sort_key, deliveries, deadline, timeline, receipt))
    return json.dumps(messages).encode()
