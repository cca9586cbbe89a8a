"""Response bodies of the HTTP API, as the routes declare them in the OpenAPI.

The worker client (`dejaq.client.models`) decodes them into dataclasses of the same
fields, without pydantic; a test keeps the two alike.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SettleResult(BaseModel):
    settled: int


class NackResult(SettleResult):
    dead: list[str] = Field(
        [], description="of these ids, those out of deliveries: sent to the dead letters"
    )


class ExtendResult(SettleResult):
    lease_deadline: int = Field(description="epoch ms, the broker's clock")


class Heartbeat(BaseModel):
    consumer_id: str
    buckets: list[int]


class Left(BaseModel):
    consumer_id: str
    released: int


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
    paused: bool
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


class RetentionView(BaseModel):
    at_ms: int = Field(description="when the run started, epoch ms")
    seconds: float
    removed: int = Field(description="settled messages removed from the buffer")
    watermark_ms: int = Field(description="every message settled before it is gone")


class LedgerLag(BaseModel):
    events: int = Field(description="settled events in Raft not yet in the ledger")
    oldest_ms: int | None = Field(description="epoch ms of the oldest of them")
    unwritten_dead_letters: int = Field(
        description="deaths in the ledger whose dead letters wait in Raft"
    )
    checkpoint_failures: int = Field(description="failed checkpoints on this node as leader")
    failing: str | None = Field(
        description="while this node leads, its checkpoints failing for minutes: since when, why"
    )


class NodeTopic(BaseModel):
    indexed: int = Field(description="messages in this node's index")
    buffer_rows: int = Field(description="rows in the buffer version it indexed")
    settled_rows: int = Field(description="of those, settled ones waiting for retention")
    head_store_bytes: int = Field(
        0, description="local disk held by its pending messages' rendered JSON"
    )
    last_retention: RetentionView | None = Field(description="run on this node (the leader)")
    ledger_lag: LedgerLag | None = Field(None, description="the ledger behind Raft")


class Cluster(BaseModel):
    node_id: str
    role: str
    term: int
    commit_index: int = Field(
        0, description="the last Raft log index this node knows committed: the cluster's progress"
    )
    leader: str | None
    leader_http: str | None
    nodes: dict[str, str]
    resident_bytes: int = Field(0, description="this node's resident memory")
    topics: dict[str, NodeTopic] = {}


class Paused(BaseModel):
    paused: bool


class Purged(BaseModel):
    cancelled: int


class Redriven(BaseModel):
    redriven: int
    skipped: dict[str, str] = Field(
        description="ids given but left as they were, and why: already_redriven (pending "
        "again since its last death), already_settled, not_dead"
    )
