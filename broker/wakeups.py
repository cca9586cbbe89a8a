"""Long polls woken when their topic may have something to lease, not by a timer.

A long poll that finds nothing waits for its topic's next change: rows indexed, a lease
ended (acked, nacked, expired, left), a message rescheduled or redriven, a pause lifted,
a configuration applied. An idle topic's waiting polls then cost nothing between
changes, where a timer costs each poll a pick every few milliseconds: a thousand idle
workers would keep half a core busy. What time alone makes leasable is looked for when
it is due (a timeline's next message), or on a short step (a nack delay, a rate limit's
refill): `Broker.lease` decides how long a poll waits.
"""

from __future__ import annotations

import asyncio
import contextlib


class Wakeups:
    """Per topic, an event the waiting polls hold, set and replaced at each change.

    A poll takes the topic's event (`mark`) before it looks for messages, and waits on
    that one: a change between its look and its wait has set it already, so no change
    is missed. Changes come from the event loop (commands committed) and from the
    thread that indexes the buffer (`notify` is safe from any thread).
    """

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def mark(self, topic: str) -> asyncio.Event:
        """The event the next change of `topic` sets: on the event loop."""
        self._loop = asyncio.get_running_loop()
        event = self._events.get(topic)
        if event is None:
            event = self._events[topic] = asyncio.Event()
        return event

    def notify(self, topic: str) -> None:
        """`topic` changed: its waiting polls look again. From any thread; nothing to do
        before a poll has waited (no loop known yet)."""
        loop = self._loop
        if loop is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wake(topic)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: the node stopped
                loop.call_soon_threadsafe(self._wake, topic)

    def notify_all(self) -> None:
        """Every topic's waiting polls look again (the node is stopping)."""
        for topic in list(self._events):
            self.notify(topic)

    def _wake(self, topic: str) -> None:
        event = self._events.pop(topic, None)
        if event is not None:
            event.set()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> None:
        """Until `event` is set or `timeout_s` has passed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await event.wait()
