"""Cron expressions in an IANA time zone: validation and occurrences, with cronsim.

cronsim evaluates expressions as Debian's cron does, time-zone transitions included: a
job at a fixed time that falls in a spring-forward gap runs once, when the gap ends (a
daily 02:30 in Europe/Berlin runs at 03:00 CEST that day); one in the repeated autumn
hour runs once, at its first pass. Jobs that run every hour or more often keep their
wall-clock fields and follow real time. Expressions have five fields, or six with
seconds first (`*/5 * * * * *`: every five seconds). A six-field expression runs at its
seconds within each minute its other five fields give, so it follows the same rules
(cronsim itself applies them to five-field expressions only).

Occurrences are instants in epoch milliseconds. Iterating from any instant yields the
same occurrences after it as iterating from an earlier one: a materialiser that resumes
from its stored progress neither skips nor invents one.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

MAX_EXPRESSION = 200


def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; ValueError if there is none."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"unknown IANA time zone {name!r} (e.g. UTC, Europe/Berlin)") from None


def check(expr: str) -> str:
    """`expr`, if it is a cron expression that ever occurs; ValueError saying why not."""
    if len(expr) > MAX_EXPRESSION:
        raise ValueError(f"a cron expression has at most {MAX_EXPRESSION} characters")
    try:
        next(CronSim(expr, dt.datetime.now(dt.UTC)))
    except CronSimError as e:
        raise ValueError(f"not a cron expression: {e}") from None
    except StopIteration:
        raise ValueError(f"{expr!r} never occurs") from None
    return expr


def _instants(expr: str, tz: ZoneInfo, after_ms: int) -> Iterator[int]:
    """Occurrences strictly after `after_ms`, ascending, without end."""
    fields = expr.split()
    seconds = [0]
    if len(fields) == 6:
        seconds = sorted(CronSim(expr, dt.datetime.now(dt.UTC)).seconds)
        expr = " ".join(fields[1:])
    # From a minute earlier: the minute under way may have seconds still to come.
    start = dt.datetime.fromtimestamp(after_ms / 1000 - 60, tz)
    for at in CronSim(expr, start):
        minute_ms = int(at.timestamp() * 1000)
        for second in seconds:
            ms = minute_ms + second * 1000
            # cronsim resumes from the local wall time, which cannot tell the two passes
            # of a repeated autumn hour apart: an occurrence of the first pass may come
            # back.
            if ms > after_ms:
                yield ms


def occurrences(expr: str, tz: ZoneInfo, after_ms: int, upto_ms: int, limit: int) -> list[int]:
    """The first `limit` occurrences in (after_ms, upto_ms], ascending."""
    out: list[int] = []
    if upto_ms <= after_ms:
        return out
    for ms in _instants(expr, tz, after_ms):
        if ms > upto_ms or len(out) >= limit:
            break
        out.append(ms)
    return out


def next_after(expr: str, tz: ZoneInfo, after_ms: int) -> int | None:
    """The first occurrence after `after_ms`; None if there is none within 50 years."""
    return next(_instants(expr, tz, after_ms), None)
