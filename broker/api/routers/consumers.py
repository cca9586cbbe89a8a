"""Consumers: heartbeat (join or stay) and leave; buckets are rebalanced on both."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from dejaq.broker.api.dependencies import LeaderBroker
from dejaq.broker.api.responses import Heartbeat, Left
from dejaq.broker.api.routers._common import TopicName, problems

router = APIRouter(tags=["consumers"])
# The last segments of the path: a consumer id may hold "/", which arrives decoded.
ConsumerPath = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")]


@router.post(
    "/topics/{topic}/consumers/{consumer_id:path}/heartbeat",
    response_model=Heartbeat,
    responses=problems(404, 503),
)
async def heartbeat(topic: TopicName, consumer_id: ConsumerPath, broker: LeaderBroker) -> Heartbeat:
    """Join or stay alive; returns the buckets this consumer may lease from now."""
    buckets = await broker.heartbeat(topic, consumer_id)
    return Heartbeat(consumer_id=consumer_id, buckets=buckets)


@router.delete(
    "/topics/{topic}/consumers/{consumer_id:path}",
    response_model=Left,
    responses=problems(404, 503),
)
async def leave(topic: TopicName, consumer_id: ConsumerPath, broker: LeaderBroker) -> Left:
    """Leave: the consumer's leases go back to pending and its buckets to the others."""
    return Left(consumer_id=consumer_id, released=await broker.leave(topic, consumer_id))
