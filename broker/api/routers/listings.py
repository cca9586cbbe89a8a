"""Listing a topic's dead letters and quarantine, a page at a time, on any node."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from dejaq.broker.api.dependencies import AnyBroker
from dejaq.broker.api.routers._common import TopicName, problems
from dejaq.broker.service import Broker, Problem
from dejaq.broker.storage.listings import MAX_PAGE, BadCursor, page
from dejaq.conf.settings import ConfigError
from dejaq.conf.tables import Table, ensure_table

router = APIRouter(tags=["listings"])

Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="rows per page")]
After = Annotated[str | None, Query(max_length=4096, description="`next` of the last page")]


class Listed(BaseModel):
    rows: list[dict[str, Any]] = Field(description="oldest first; bytes as base64, times epoch ms")
    next: str | None = Field(description="`after` for the next page; null at the end")


async def _page(broker: Broker, topic: str, table: Table, limit: int, after: str | None) -> Listed:
    try:
        broker.settings.topic(topic)
    except ConfigError as e:
        raise Problem(404, "unknown topic", str(e)) from None
    path = ensure_table(broker.settings.warehouse, table, topic)
    try:
        got = await asyncio.to_thread(page, path, table, limit, after)
    except BadCursor as e:
        raise Problem(422, "invalid request", f"after: {e}") from None
    return Listed(rows=got.rows, next=got.next)


@router.get("/topics/{topic}/dead-letters", response_model=Listed, responses=problems(404, 422))
async def dead_letters(
    topic: TopicName, broker: AnyBroker, limit: Limit = 100, after: After = None
) -> Listed:
    """Dead messages, whole (buffer row, deliveries, reason, dead_at), in order of death:
    the ids to redrive. A message that died twice has two rows."""
    return await _page(broker, topic, Table.DEAD_LETTER, limit, after)


@router.get("/topics/{topic}/quarantine", response_model=Listed, responses=problems(404, 422))
async def quarantine(
    topic: TopicName, broker: AnyBroker, limit: Limit = 100, after: After = None
) -> Listed:
    """Records the ingest could not parse (raw key, value, headers, Kafka coordinates,
    reason), in order of arrival."""
    return await _page(broker, topic, Table.QUARANTINE, limit, after)
