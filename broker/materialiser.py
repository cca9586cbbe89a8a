"""On the Raft leader: cron schedules' occurrences that fall due within the topic's
horizon become timeline messages on its Kafka input, the path every message takes.

An occurrence is sent with `dejaq-deliver-at` = its time and `dejaq-id` =
`<schedule id>@<epoch ms>`. The ingest buffers an id once within the topic's dedup
window, so an occurrence sent again (by a leader that died between sending and storing
its progress, or by a second node during an election) is buffered once. A schedule's
progress moves up to its last occurrence Kafka acknowledged with all before it: what
failed is sent again by the next round, and no occurrence is skipped. One schedule that
Kafka refuses (a payload larger than the input topic takes) holds back no other.

A schedule is topped up to the full horizon once its next occurrence comes within half
of it: one firing every second costs a progress commit every half horizon, not every
second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from dejaq.broker.service import Broker, Outgoing, Producer, now_ms
from dejaq.broker.state import cron
from dejaq.broker.state.schedules import Schedule, ScheduleStore
from dejaq.broker.streak import Streak
from dejaq.conf.settings import TopicConfig, TopicKind

log = logging.getLogger("dejaq.broker.state.cron")

PERIOD_S = 1.0
# Occurrences one schedule sends in a round: after a long outage a fast schedule catches
# up over several rounds instead of in one Kafka batch of unbounded size.
MAX_PER_ROUND = 10_000
# How long a schedule past its end, every occurrence sent, stays readable before the
# leader deletes it: a day to see how it ended, not the table growing with every one.
ENDED_KEPT_MS = 24 * 3600 * 1000


def occurrence_id(schedule_id: str, at_ms: int) -> str:
    return f"{schedule_id}@{at_ms}"


def message(schedule: Schedule, at_ms: int) -> Outgoing:
    """The occurrence at `at_ms` in the Kafka envelope of a timeline message."""
    headers = [
        *schedule.headers,
        ("dejaq-deliver-at", str(at_ms).encode()),
        ("dejaq-id", occurrence_id(schedule.schedule_id, at_ms).encode()),
    ]
    return Outgoing(schedule.key, schedule.payload, headers)


@dataclass
class Due:
    """One schedule's share of a round: its occurrences' times and messages, and the
    progress they make once all are sent."""

    schedule: Schedule
    times: list[int]
    messages: list[Outgoing]
    until: int

    def sent_until(self, outcomes: list[Exception | None]) -> int | None:
        """The progress `outcomes` (one per message) make: `until` if every message was
        sent, else the last occurrence before the first one not sent (None: none)."""
        failed = next((k for k, e in enumerate(outcomes) if e is not None), None)
        if failed is None:
            return self.until
        return self.times[failed - 1] if failed else None


class Materialiser:
    """Every cron topic's materialisation; `run` does a round a period while this node
    leads. Any node serves the schedules (`stores`) over HTTP."""

    def __init__(self, broker: Broker, producer: Producer) -> None:
        self.broker = broker
        self.producer = producer
        self.topics = {t.name: t for t in broker.settings.topics if t.kind is TopicKind.CRON}
        warehouse = broker.settings.warehouse
        self.stores = {name: ScheduleStore(warehouse, name) for name in self.topics}
        # (topic, id, created at) → (progress, the first occurrence after it), so a round
        # costs a dictionary look-up per schedule that is not due.
        self._next: dict[tuple[str, str, int], tuple[int, int | None]] = {}
        # (topic, id) of the schedules whose last round failed → the error logged for it
        # (None: none yet; failed among others, it is not told apart from them).
        self._failing: dict[tuple[str, str], str | None] = {}
        # topic → (id, created at) of the schedules `plan` found past their end with
        # every occurrence sent, for its round to delete.
        self._ended: dict[str, list[tuple[str, int]]] = {}
        self._rounds = {name: Streak(f"materialising cron topic {name}") for name in self.topics}

    async def run(self) -> None:
        """Until cancelled. A failed round is logged (once per streak and kind of error);
        the next one does it again."""
        while True:
            await asyncio.sleep(PERIOD_S)
            raft = self.broker.raft
            if raft is None or not raft.is_leader():
                continue
            for name in self.topics:
                try:
                    await self.round(name, now_ms())
                except Exception as e:
                    self._rounds[name].failed(e)
                else:
                    self._rounds[name].ok()

    async def round(self, topic: str, now: int) -> int:
        """Send what falls due within the horizon, then store the progress; returns how
        many messages were sent."""
        cfg, store = self.topics[topic], self.stores[topic]
        schedules = await asyncio.to_thread(store.all)
        due = await asyncio.to_thread(self.plan, cfg, schedules.values(), now)
        if ended := self._ended.pop(topic, []):
            await asyncio.to_thread(store.remove_ended, ended)
        if not due:
            return 0
        # Schedules whose last round failed go alone: Kafka's refusal of one record
        # fails every record the producer held with it, so one schedule it refuses
        # would fail the others with it, round after round.
        healthy = [d for d in due if (topic, d.schedule.schedule_id) not in self._failing]
        alone = [[d] for d in due if (topic, d.schedule.schedule_id) in self._failing]
        progress: dict[tuple[str, int], int] = {}
        failed: dict[str, Exception] = {}
        sent = 0
        for group in [healthy, *alone] if healthy else alone:
            outgoing = [m for d in group for m in d.messages]
            outcomes = await self.producer.send_each(cfg.source[0], outgoing)
            sent += sum(e is None for e in outcomes)
            start = 0
            for d in group:
                mine = outcomes[start : start + len(d.messages)]
                start += len(d.messages)
                until = d.sent_until(mine)
                if until is not None:
                    progress[(d.schedule.schedule_id, d.schedule.created_at)] = until
                if until != d.until:
                    failed[d.schedule.schedule_id] = next(e for e in mine if e is not None)
        await asyncio.to_thread(store.advance, progress)
        sent_alone = {group[0].schedule.schedule_id for group in alone}
        self._note(topic, [d.schedule.schedule_id for d in due], failed, sent_alone)
        return sent

    def _note(
        self, topic: str, schedules: list[str], failed: dict[str, Exception], alone: set[str]
    ) -> None:
        """Note the schedules whose occurrences Kafka did not all take; log one that
        failed sent alone (so its own), once per error until it changes or its
        occurrences go through."""
        for schedule_id in schedules:
            key = (topic, schedule_id)
            error = failed.get(schedule_id)
            if error is None:
                self._failing.pop(key, None)
                continue
            if schedule_id not in alone:
                self._failing.setdefault(key, None)
                continue
            why = f"{type(error).__name__}: {error}"
            if self._failing.get(key) != why:
                self._failing[key] = why
                log.warning(
                    "cron topic %s: Kafka did not take every occurrence of schedule %s (%s); "
                    "each round sends them again, the other schedules go on",
                    topic,
                    schedule_id,
                    why,
                )

    def plan(self, cfg: TopicConfig, schedules: Iterable[Schedule], now: int) -> list[Due]:
        """The schedules whose next occurrence is within half the horizon, each with its
        occurrences up to the full horizon (or its end). Those with no occurrence left
        before an end ENDED_KEPT_MS past are noted in `_ended`."""
        horizon = cfg.cron_horizon_ms
        due: list[Due] = []
        ended: list[tuple[str, int]] = []
        seen: dict[tuple[str, str, int], tuple[int, int | None]] = {}
        for s in schedules:
            tz = cron.zone(s.time_zone)
            key = (cfg.name, s.schedule_id, s.created_at)
            progress, first = self._next.get(key, (None, None))
            if progress != s.materialised_until:
                first = cron.next_after(s.cron, tz, s.materialised_until)
            seen[key] = (s.materialised_until, first)
            if s.end_at is not None and (first is None or first > s.end_at):
                if now - s.end_at >= ENDED_KEPT_MS:
                    ended.append((s.schedule_id, s.created_at))
                continue
            upto = now + horizon if s.end_at is None else min(now + horizon, s.end_at)
            if first is None or first > upto or first > now + horizon // 2:
                continue
            times = cron.occurrences(s.cron, tz, s.materialised_until, upto, MAX_PER_ROUND)
            until = times[-1] if len(times) == MAX_PER_ROUND else upto
            due.append(Due(s, times, [message(s, t) for t in times], until))
        self._next = {k: v for k, v in self._next.items() if k[0] != cfg.name} | seen
        self._ended[cfg.name] = ended
        return due
