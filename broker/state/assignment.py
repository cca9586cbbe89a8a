"""Bucket assignment among live consumers: fair, sticky and deterministic.

Deterministic because every Raft node computes it while applying the same command; sticky
so a join or leave moves as few buckets (and interrupts as few per-key orders) as
possible. A bucket always has exactly one owner, so no two consumers hold it at once.
"""

from __future__ import annotations

from collections.abc import Iterable


def rebalance(buckets: int, consumers: Iterable[str], current: dict[int, str]) -> dict[int, str]:
    """Assign every bucket to one of `consumers`, keeping current owners within their quota.

    Quotas differ by at most one bucket; the alphabetically first consumers get the
    larger quota, so the result depends only on the inputs.
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
    for b in range(buckets):
        if b not in result:
            owner = max(live, key=lambda c: (quota[c] - owned[c], [-ord(ch) for ch in c]))
            result[b] = owner
            owned[owner] += 1
    return result
