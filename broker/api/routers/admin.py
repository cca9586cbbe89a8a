"""Operating a topic: pause and resume leasing, purge what is pending, redrive dead letters.

Each is one or more Raft commands, so every node agrees once the answer is 2xx.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field, model_validator

from dejaq.broker.api.dependencies import LeaderBroker
from dejaq.broker.api.responses import Paused, Purged, Redriven
from dejaq.broker.api.routers._common import Body, EpochMs, Ids, Priority, TopicName, problems

router = APIRouter(tags=["operations"])


class Purge(Body):
    confirm: str = Field(description="the topic's name: a purge cannot be undone")


class Redrive(Body):
    ids: Ids | None = Field(default=None, description="these dead messages")
    all: bool = Field(default=False, description="every dead message of the topic")
    priority: Priority | None = Field(default=None, description="priority topics")
    deliver_at: EpochMs | None = Field(default=None, description="timeline topics")

    @model_validator(mode="after")
    def _which(self) -> Redrive:
        if (self.ids is not None) == self.all:
            raise ValueError('give either "ids" or "all": true')
        return self


@router.post("/topics/{topic}/pause", response_model=Paused, responses=problems(404, 503))
async def pause(topic: TopicName, broker: LeaderBroker) -> Paused:
    """Stop leasing on every node: leases return no messages (a long-poll waits); acks,
    nacks, extends and lease expiry go on."""
    await broker.pause(topic, True)
    return Paused(paused=True)


@router.post("/topics/{topic}/resume", response_model=Paused, responses=problems(404, 503))
async def resume(topic: TopicName, broker: LeaderBroker) -> Paused:
    """Lease again."""
    await broker.pause(topic, False)
    return Paused(paused=False)


@router.post("/topics/{topic}/purge", response_model=Purged, responses=problems(404, 422, 503))
async def purge(topic: TopicName, body: Purge, broker: LeaderBroker) -> Purged:
    """Cancel every pending message (ledger event `cancelled`); `confirm` must be the
    topic's name. Leased messages are left to their consumers: an ack still settles
    one, and one given back is pending again."""
    return Purged(cancelled=await broker.purge(topic, body.confirm))


@router.post(
    "/topics/{topic}/dead-letters/redrive",
    response_model=Redriven,
    responses=problems(404, 409, 422, 503),
)
async def redrive(topic: TopicName, body: Redrive, broker: LeaderBroker) -> Redriven:
    """Dead messages pending again, deliveries from 0, at a new priority or deliver_at
    if given (else the sort key they died with). Once per death: a message redriven
    and not dead since is skipped. A 409 names any that died in a bucket the topic no
    longer has."""
    count, skipped = await broker.redrive(topic, body.ids, body.priority, body.deliver_at)
    return Redriven(redriven=count, skipped={m: str(r) for m, r in skipped.items()})
