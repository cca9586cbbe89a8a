"""What the broker's routes depend on: the node's broker and producer, the leader, and
errors as problem+json. Apart from the app module, so routers never import the app.

Any node takes any request. A route that needs the leader's state depends on
`on_leader`; on a follower that raises `ForwardToLeader`, and the app's handler replays
the request against the leader's HTTP address and returns the leader's answer.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from dejaq.broker.api.access import FORWARDED
from dejaq.broker.service import Broker, Problem, Producer

PROBLEM = "application/problem+json"
NOT_LEADER = "not leader"
# The longest a request waits for a new leader to apply the last term's entries: less
# than a follower waits for a forward's answer (`app.FORWARD_STALL_S`).
CATCH_UP_WAIT_S = 1.0


class ForwardToLeader(Exception):
    """This node is not the leader: the request goes to the one that is."""


async def get_broker(request: Request) -> Broker:
    return request.app.state.broker


async def get_producer(request: Request) -> Producer:
    return request.app.state.producer


AnyBroker = Annotated[Broker, Depends(get_broker)]
AnyProducer = Annotated[Producer, Depends(get_producer)]


async def on_leader(request: Request, broker: AnyBroker) -> Broker:
    """Dependency of leader-only routes (the hot path's too: it leaves a leader not yet
    `leading` to them). A new leader answers once it has applied what the cluster
    committed before its term, or 503s after CATCH_UP_WAIT_S: its state would lack
    leases and acks that are final."""
    raft = broker.raft
    if raft is not None and raft.is_leader():
        if await raft.lead(CATCH_UP_WAIT_S):
            return broker
        if raft.is_leader():
            raise Problem(
                503,
                "leader catching up",
                "the new leader has not yet applied what the last one committed; retry",
                retry_after=1,
            )
    if request.headers.get(FORWARDED):
        raise Problem(503, NOT_LEADER, "the node this was forwarded to is no longer leader")
    raise ForwardToLeader()


LeaderBroker = Annotated[Broker, Depends(on_leader)]


def problem(
    status: int, title: str, detail: str = "", retry_after: int = 1, **extra: Any
) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    headers = {"retry-after": str(retry_after)} if status == 503 else None
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)
