"""Schedules of cron topics: create, list, fetch, delete.

Any node takes any request: creates and deletes go to the leader (the schedules table's
one writer), reads are served from the table by the node asked.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import AwareDatetime, BaseModel, Field, field_validator

from dejaq.broker.api.dependencies import LeaderBroker, on_leader
from dejaq.broker.api.routers._common import (
    MAX_EPOCH_MS,
    Body,
    EpochMs,
    Headers,
    TopicName,
    Utf8,
    problems,
)
from dejaq.broker.api.routers.messages import decode_payload, own_headers
from dejaq.broker.materialiser import Materialiser
from dejaq.broker.service import Problem, now_ms
from dejaq.broker.state import cron
from dejaq.broker.state.schedules import Schedule, ScheduleStore

router = APIRouter(tags=["schedules"])

# No "@": an occurrence's id is `<schedule id>@<epoch ms>`. No "/": it is a path segment.
SCHEDULE_ID = r"^[A-Za-z0-9._~:-]+$"
ScheduleId = Annotated[str, Field(min_length=1, max_length=200, pattern=SCHEDULE_ID)]
ScheduleIdPath = Annotated[str, Path(min_length=1, max_length=200, pattern=SCHEDULE_ID)]


class NewSchedule(Body):
    id: ScheduleId | None = Field(default=None, description="default: a generated one")
    cron: str = Field(
        max_length=cron.MAX_EXPRESSION,
        description="5 fields (minute hour day month weekday), or 6 with seconds first",
    )
    time_zone: str = Field(default="UTC", max_length=100, description="IANA name")
    payload: str = Field(description="base64", max_length=200 * 1024 * 1024)
    key: Utf8 | None = Field(default=None, max_length=10_000, description="bucket key, UTF-8")
    headers: Headers | None = None
    end: EpochMs | AwareDatetime | None = Field(
        default=None, description="epoch ms or ISO-8601 with offset: no occurrence after it"
    )

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        return cron.check(v)

    @field_validator("time_zone")
    @classmethod
    def _time_zone(cls, v: str) -> str:
        cron.zone(v)
        return v

    @field_validator("end")
    @classmethod
    def _end(cls, v: int | AwareDatetime | None) -> int | None:
        if v is None:
            return None
        ms = v if isinstance(v, int) else int(v.timestamp() * 1000)
        if ms > MAX_EPOCH_MS:
            # An ISO time in year 9999 with a negative offset is past it in UTC.
            raise ValueError("end is after 9999-12-31T23:59:59.999Z, the latest time stored")
        if ms <= now_ms():
            raise ValueError("end is in the past: the schedule would never produce")
        return ms


class ScheduleOut(BaseModel):
    id: str
    cron: str
    time_zone: str
    key: str | None
    payload: str = Field(description="base64")
    headers: dict[str, str]
    end: int | None = Field(description="epoch ms")
    created_at: int = Field(description="epoch ms; occurrences strictly after it")
    materialised_until: int = Field(
        description="epoch ms; every occurrence up to it is on the topic's Kafka input"
    )
    next_at: int | None = Field(description="epoch ms; the next occurrence, none once ended")


class Schedules(BaseModel):
    schedules: list[ScheduleOut]


async def get_materialiser(request: Request) -> Materialiser:
    return request.app.state.materialiser


AnyMaterialiser = Annotated[Materialiser, Depends(get_materialiser)]


def _store(materialiser: Materialiser, topic: str) -> ScheduleStore:
    store = materialiser.stores.get(topic)
    if store is None:
        raise Problem(404, "unknown topic", f"no cron topic named {topic!r}")
    return store


def _out(s: Schedule, now: int) -> ScheduleOut:
    upcoming = cron.next_after(s.cron, cron.zone(s.time_zone), max(now, s.created_at))
    if upcoming is not None and s.end_at is not None and upcoming > s.end_at:
        upcoming = None
    return ScheduleOut(
        id=s.schedule_id,
        cron=s.cron,
        time_zone=s.time_zone,
        key=None if s.key is None else s.key.decode(),
        payload=base64.b64encode(s.payload).decode(),
        headers={k: v.decode() for k, v in s.headers},
        end=s.end_at,
        created_at=s.created_at,
        materialised_until=s.materialised_until,
        next_at=upcoming,
    )


@router.post(
    "/topics/{topic}/schedules",
    response_model=ScheduleOut,
    status_code=201,
    responses={
        200: {"model": ScheduleOut, "description": "the id exists with this definition"},
        **problems(404, 409, 422, 503),
    },
)
async def create_schedule(
    topic: TopicName,
    body: NewSchedule,
    broker: LeaderBroker,
    materialiser: AnyMaterialiser,
    response: Response,
) -> ScheduleOut:
    """A schedule: from now on, each occurrence becomes a message delivered at its time.

    Creating an existing id again with the same definition returns it (200); with
    another definition it is a 409.
    """
    store = _store(materialiser, topic)
    cfg = materialiser.topics[topic]
    payload = decode_payload(
        body.payload, min(cfg.max_payload_bytes, broker.conf.max_payload_bytes)
    )
    now = now_ms()
    wanted = Schedule(
        schedule_id=body.id or uuid.uuid4().hex,
        cron=body.cron,
        time_zone=body.time_zone,
        key=None if body.key is None else body.key.encode(),
        payload=payload,
        headers=own_headers(body.headers),
        end_at=body.end,  # type: ignore[arg-type]  # the validator made it epoch ms
        created_at=now,
        materialised_until=now,
    )
    stored, new = await asyncio.to_thread(store.add, wanted)
    if not new:
        if stored.definition() != wanted.definition():
            raise Problem(
                409,
                "schedule exists",
                f"schedule {stored.schedule_id!r} exists with another definition: delete it first",
            )
        response.status_code = 200
    return _out(stored, now)


@router.get("/topics/{topic}/schedules", response_model=Schedules, responses=problems(404))
async def list_schedules(topic: TopicName, materialiser: AnyMaterialiser) -> Schedules:
    """Every schedule of the topic, by id."""
    store = _store(materialiser, topic)

    def listed() -> Schedules:
        now = now_ms()
        found = store.all()
        return Schedules(schedules=[_out(found[k], now) for k in sorted(found)])

    return await asyncio.to_thread(listed)


@router.get(
    "/topics/{topic}/schedules/{schedule_id}",
    response_model=ScheduleOut,
    responses=problems(404),
)
async def get_schedule(
    topic: TopicName, schedule_id: ScheduleIdPath, materialiser: AnyMaterialiser
) -> ScheduleOut:
    """One schedule, with its next occurrence and how far it is materialised."""
    found = await asyncio.to_thread(_store(materialiser, topic).get, schedule_id)
    if found is None:
        raise Problem(404, "unknown schedule", f"no schedule {schedule_id!r} in topic {topic!r}")
    return _out(found, now_ms())


@router.delete(
    "/topics/{topic}/schedules/{schedule_id}",
    status_code=204,
    response_class=Response,  # no body, so no content-type
    responses=problems(404, 503),
    dependencies=[Depends(on_leader)],
)
async def delete_schedule(
    topic: TopicName, schedule_id: ScheduleIdPath, materialiser: AnyMaterialiser
) -> None:
    """Stop the schedule. Occurrences already materialised (within the horizon) stay."""
    deleted = await asyncio.to_thread(_store(materialiser, topic).delete, schedule_id)
    if not deleted:
        raise Problem(404, "unknown schedule", f"no schedule {schedule_id!r} in topic {topic!r}")
