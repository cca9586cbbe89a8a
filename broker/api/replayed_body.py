"""A request body read ahead of the app that serves it: the ASGI layers that look at a
body before routing (the key check's forward tags, the lease and ack fast path) hand it
on as the server would have."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
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
