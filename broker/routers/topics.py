"""Topics: list them, describe one with live statistics."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from broker.app import AnyBroker, LeaderBroker
from broker.routers._common import TopicName, problems

router = APIRouter(tags=["topics"])


class TopicSummary(BaseModel):
    name: str
    kind: str
    buckets: int
    sources: list[str]


class BucketStats(BaseModel):
    bucket: int
    consumer_id: str | None
    pending: int
    leased: int
    deliverable_now: int
    oldest_age_ms: int | None


class TopicStats(BaseModel):
    name: str
    kind: str
    buckets: int
    pending: int
    delayed: int
    leased: int
    deliverable_now: int
    acked: int
    dead: int
    cancelled: int
    oldest_age_ms: int | None
    consumers: list[str]
    per_bucket: list[BucketStats]


@router.get("/topics", response_model=list[TopicSummary])
async def list_topics(broker: AnyBroker) -> list[TopicSummary]:
    """The topics this broker leases from (topics with `delivery: lease`)."""
    return [
        TopicSummary(name=t.name, kind=str(t.kind), buckets=t.buckets, sources=t.source)
        for t in broker.topics.values()
    ]


@router.get("/topics/{topic}", response_model=TopicStats, responses=problems(404, 503))
async def describe_topic(topic: TopicName, broker: LeaderBroker) -> dict:
    """Pending, leased, deliverable now, acked, dead, oldest age; per bucket too."""
    return broker.describe(topic)
