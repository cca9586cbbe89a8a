"""Liveness, readiness, Prometheus metrics and the cluster view."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dejaq.broker.api.access import monitored
from dejaq.broker.api.dependencies import AnyBroker, problem
from dejaq.broker.api.metrics import TopicsShown, resident_bytes
from dejaq.broker.api.responses import Cluster
from dejaq.broker.api.starting import NODE_STARTING

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process serves HTTP: the liveness probe. It answers from the node's start on,
    while its indexes load too (minutes over a large backlog)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"content": {"application/problem+json": {}}}})
async def readyz(broker: AnyBroker) -> Response:
    """Ready: a Raft leader is known, the log is applied, the indexes are loaded and
    refresh, the background threads run, and no topic's message heads are unreadable
    here and from the buffer alike. While the indexes load, a 503 titled "node starting"
    says how far: "indexes loading: <topic> <n>/<m> buckets, <rows> rows"; every call
    but the probes, metrics and docs answers 503 "node starting" meanwhile."""
    ok, why = broker.ready()
    if not ok:
        return problem(503, "not ready" if broker.serving() else NODE_STARTING, why)
    return JSONResponse({"status": why})


@router.get("/metrics", response_class=Response)
async def metrics(broker: AnyBroker, request: Request) -> Response:
    """A key's scrape has the series of its `monitor` topics, and those of no topic."""
    shown = TopicsShown(broker.metrics.registry, monitored(request.scope))
    return Response(generate_latest(shown), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cluster", response_model=Cluster)
async def cluster(broker: AnyBroker, request: Request) -> Cluster:
    """This node's view: role, term, the leader and every node's HTTP address; its
    memory, and per topic (those the key monitors) its index and the buffer's settled
    rows."""
    shows = monitored(request.scope)
    raft = broker.raft
    assert raft is not None
    return Cluster(
        node_id=broker.node_id,
        role=raft.role(),
        term=raft.term(),
        commit_index=raft.commit_index(),
        leader=raft.leader(),
        leader_http=raft.leader_http(),
        nodes=raft.http_addresses(),
        resident_bytes=resident_bytes(),
        topics={name: t for name, t in broker.node_topics().items() if shows(name)},
    )
