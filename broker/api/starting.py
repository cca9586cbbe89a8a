"""Requests to a node that is starting: its indexes load (minutes over a large backlog)
and its Raft node runs only after them (`Broker.start_behind`).

Liveness, readiness, metrics and the API docs answer meanwhile: an orchestrator's
liveness probe must not kill a node for the time its start takes, and readiness says how
far the load is. Every other request would read a half-loaded index or a Raft node not
started: it gets a 503 saying so, marked as applying nothing, which the client takes as a
node it could not reach: it sends the request to another node, whatever the request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dejaq.broker.api.dependencies import problem
from dejaq.broker.api.http_server import NOT_APPLIED
from dejaq.broker.service import Broker

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ANSWERED = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"})
DOCS_ASSETS = "/docs-assets/"
NODE_STARTING = "node starting"


class Starting:
    """ASGI front of the app: a 503 for what a starting node cannot serve."""

    def __init__(self, app: ASGIApp, broker: Broker) -> None:
        self.app, self.broker = app, broker
        self._served = False  # once the node serves, it does until it stops

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._served or scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.broker.serving():
            self._served = True
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in ANSWERED or path.startswith(DOCS_ASSETS):
            return await self.app(scope, receive, send)
        detail = f"{self.broker.starting()}: retry shortly, or ask another node"
        answer = problem(503, NODE_STARTING, detail)
        answer.headers[NOT_APPLIED] = "starting"  # nothing done: any request may go elsewhere
        await answer(scope, receive, send)
