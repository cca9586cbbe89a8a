"""Bucket assignment among live consumers: fair, sticky and deterministic.

Deterministic because every Raft node computes it while applying the same command; sticky
so a join or leave moves as few buckets (and interrupts as few per-key orders) as
possible. A bucket always has exactly one owner, so no two consumers hold it at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


def rebalance(buckets: int, consumers: Iterable[str], current: dict[int, str]) -> dict[int, str]:
    """Assign every bucket to one of `consumers`, keeping current owners within their quota.

    Quotas differ by at most one bucket; the alphabetically first consumers get the
    larger quota, so the result depends only on the inputs. Each free bucket, in bucket
    order, goes to the consumer furthest below its quota, ties to the one first by
    `_tie_order`. Every node applies this to each join, leave and expiry on its event
    loop, so the tie order is computed once and the free buckets handed out from a heap:
    a call costs the buckets plus the ids once, not every id for every free bucket.
    """
    live = sorted(set(consumers))
    if not live:
        return {}
    base, extra = divmod(buckets, len(live))
    quota = {c: base + (1 if i < extra else 0) for i, c in enumerate(live)}
    owned = dict.fromkeys(live, 0)
    result: dict[int, str] = {}
    for b in range(buckets):
        owner = current.get(b)
        if owner in quota and owned[owner] < quota[owner]:
            result[b] = owner
            owned[owner] += 1
    # (-deficit, tie rank, consumer) of each consumer below its quota. The deficits sum
    # to the free buckets, so the head always has a deficit to fill.
    below = [
        (owned[c] - quota[c], rank, c)
        for rank, c in enumerate(sorted(live, key=_tie_order))
        if owned[c] < quota[c]
    ]
    heapq.heapify(below)
    for b in range(buckets):
        if b not in result:
            short, rank, owner = below[0]
            result[b] = owner
            if short + 1 < 0:
                heapq.heapreplace(below, (short + 1, rank, owner))
            else:
                heapq.heappop(below)
    return result


# Above any code point's four UTF-32 bytes (at most 00 10 ff ff): an id that is a prefix of
# another sorts after it.
_AFTER_ALL = b"\xff" * 4


def _tie_order(consumer: str) -> bytes:
    """Which of two consumers equally short of their quota takes a free bucket: the one
    whose key sorts first. The first differing character decides (the lower code point
    wins), else the longer id wins: a rule of the replicated state every node and journal
    keeps. Big-endian UTF-32 compares as the code points do, in one C call per id."""
    return consumer.encode("utf-32-be", "surrogatepass") + _AFTER_ALL
