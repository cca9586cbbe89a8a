"""Request pieces shared by the routers."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from dejaq.conf.settings import TOPIC_NAME
from dejaq.conf.tables import SECONDS_LIKE_MS

TopicName = Annotated[str, Path(description="a lease topic", pattern=TOPIC_NAME.pattern)]
ConsumerId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")]
MAX_REQUEST_ID = 64  # characters: a uuid4's hex is 32
RequestId = Annotated[
    str, Field(min_length=1, max_length=MAX_REQUEST_ID, pattern=r"^[\x21-\x7e]+$")
]


def _utf8(s: str) -> str:
    """A JSON string may hold a lone surrogate ("\\ud800"), which no UTF-8 holds."""
    try:
        s.encode()
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate, which UTF-8 cannot encode") from None
    return s


def _utf8_headers(headers: dict[str, str]) -> dict[str, str]:
    for name, value in headers.items():
        for part, s in (("name", name), ("value", value)):
            try:
                _utf8(s)
            except ValueError as e:
                raise ValueError(f"header {name!r}: its {part} {e}") from None
    return headers


Utf8 = Annotated[str, AfterValidator(_utf8)]
# A message's headers, as Kafka carries them: UTF-8 names and values.
Headers = Annotated[dict[Annotated[str, Field(max_length=200)], str], AfterValidator(_utf8_headers)]
MessageId = Annotated[Utf8, Field(min_length=1, max_length=1000)]
Ids = Annotated[list[MessageId], Field(min_length=1, max_length=1000)]
MAX_EPOCH_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: the last a Delta timestamp holds
MAX_RECEIPT = 2**53 - 1  # exact in every JSON reader
Receipt = Annotated[int, Field(ge=0, le=MAX_RECEIPT)]
Receipts = Annotated[list[Receipt], Field(min_length=1, max_length=1000)]
Priority = Annotated[int, Field(ge=0, le=65535, description="0..65535, lower first")]


def _not_seconds(ms: int) -> int:
    if ms in SECONDS_LIKE_MS:
        raise ValueError("milliseconds expected; this looks like seconds")
    return ms


EpochMs = Annotated[
    int,
    Field(ge=0, le=MAX_EPOCH_MS, description="epoch milliseconds"),
    AfterValidator(_not_seconds),
]
LeaseMs = Annotated[int, Field(ge=1, le=12 * 3600 * 1000)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProblemDetail(BaseModel):
    """RFC 9457 problem details (media type application/problem+json)."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str = ""


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the problem responses a route can give."""
    return {
        code: {"model": ProblemDetail, "content": {"application/problem+json": {}}}
        for code in codes
    }
