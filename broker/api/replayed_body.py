"""A request body read ahead of the app that serves it: the ASGI layers that look at a
body before routing (the key check's forward tags, the lease and ack fast path) hand it
on as the server would have. And once it is read, a watch on the client's leaving."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]


async def read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """The request's body, whole; what had come if the client left before the end; None
    once it passes `limit` bytes (the rest is not read)."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields the already-read body, then the server's own messages."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


@contextmanager
def client_watch(receive: Receive) -> Iterator[Callable[[], bool]]:
    """Whether the client has disconnected, for work that should not go on for nobody
    (a long poll's lease). Only once the request's body is read: the server's next
    message is then the disconnect. The watch stops on exit, before the answer is sent
    (a streamed answer listens for the disconnect itself)."""
    watch = asyncio.ensure_future(receive())

    def gone() -> bool:
        if not watch.done() or watch.cancelled() or watch.exception() is not None:
            return False
        return watch.result().get("type") == "http.disconnect"

    try:
        yield gone
    finally:
        watch.cancel()
