"""The broker's FastAPI application: routers, shared state, errors as problem+json,
and the forwarding of leader-only requests (`dependencies.on_leader`) to the leader:
replayed against its HTTP address, its answer returned."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

import fastapi_offline
import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from dejaq.broker.api.access import (
    FORWARDED,
    KEY,
    ROUTES,
    Guard,
    forward_key,
    forward_tag,
    target_of,
)
from dejaq.broker.api.body_limits import BodyLimits, largest_body
from dejaq.broker.api.dependencies import NOT_LEADER, PROBLEM, ForwardToLeader, problem
from dejaq.broker.api.hotpath import HotPath
from dejaq.broker.api.http_server import NOT_APPLIED
from dejaq.broker.api.keys import KeyRing
from dejaq.broker.api.replayed_body import client_watch
from dejaq.broker.api.routers import (
    admin,
    consumers,
    health,
    leases,
    listings,
    messages,
    schedules,
    topics,
)
from dejaq.broker.api.routers.leases import WAIT_MS
from dejaq.broker.api.starting import Starting
from dejaq.broker.materialiser import Materialiser
from dejaq.broker.service import Broker, Problem, Producer

# The Swagger UI files fastapi-offline ships (its own app factory is not used).
OFFLINE_DOCS = Path(fastapi_offline.__file__).parent / "static"
FORWARD_WAIT_S = 3.0  # an election takes 0.5-1.5 s; a client should not see it
# A leader that has not answered a forward this long (beyond a long poll's wait) is
# taken for stalled (a stopped process still accepts connections): the client hears a
# 503 and tries again, by then at the leader elected in its place.
FORWARD_STALL_S = 2.0
LEADER_POLL_S = 0.05


async def _on_problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Problem)
    return problem(exc.status, exc.title, exc.detail, **exc.extra)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return problem(exc.status_code, str(exc.detail), str(exc.detail))


async def _on_invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type")}
        for e in exc.errors()
    ]
    detail = "; ".join(e["msg"] for e in errors)
    kind = request.headers.get("content-type", "")
    if ["body"] in (e["loc"] for e in errors) and not _is_json(kind):
        # FastAPI reads no body but a JSON one: its own words name the body's shape.
        given = repr(kind) if kind else "none"
        detail = f"the body must be JSON, with content-type application/json (given: {given})"
    return problem(422, "invalid request", detail, errors=errors)


def _is_json(content_type: str) -> bool:
    """A content type FastAPI reads a body of as JSON."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


async def _leader_address(broker: Broker, deadline: float) -> str | None:
    """The leader's HTTP address, waiting out an election until `deadline` (monotonic)."""
    while True:
        target = broker.raft.leader_http() if broker.raft is not None else None
        if target is not None or time.monotonic() >= deadline:
            return target
        await asyncio.sleep(LEADER_POLL_S)


def _not_leader(answer: httpx.Response) -> bool:
    """A node that stepped down before taking the request (see `on_leader`)."""
    if answer.status_code != 503 or answer.headers.get("content-type") != PROBLEM:
        return False
    return answer.json().get("title") == NOT_LEADER


async def _forward(request: Request, exc: Exception) -> Response:
    """Replay on the leader. An election or a dead leader is waited out, up to a bound:
    a refused connection or a "not leader" answer means nothing was done, so trying
    again is safe.

    A success is passed on as it arrives, not once whole: a lease of large payloads
    over a slow link would otherwise keep the client waiting in silence past its stall
    timeout, and the lease it gives up on, retried, again and again, each time costing
    its messages a delivery. Once its head has come, the answer's body is bounded by
    the HTTP client's read timeout alone."""
    broker: Broker = request.app.state.broker
    client: httpx.AsyncClient = request.app.state.http
    body = await request.body()
    raw = target_of(request.scope)  # as it came: decoded once, by the leader alone
    # httpx drops `.` and `..` segments from a path: what it would send is not what this
    # node authorized (`t/consumers/../../other/messages/m` would cancel in another
    # topic). The client sends such an id percent-encoded. The characters it encodes
    # (`"`, `{`, a backtick) the leader decodes back to what this node read.
    encoded = httpx.URL("http://leader").copy_with(raw_path=raw).raw_path
    if unquote_to_bytes(encoded) != unquote_to_bytes(raw):
        return problem(
            400,
            "invalid path",
            "a path with . or .. segments is not taken: percent-encode an id of . or .. (%2E)",
        )
    deadline = time.monotonic() + FORWARD_WAIT_S
    while True:
        target = await _leader_address(broker, deadline)
        if target is None:
            return problem(503, "no leader", "no Raft leader is known yet: retry shortly")
        try:
            url = httpx.URL(f"{request.app.state.scheme}://{target}").copy_with(raw_path=raw)
            outgoing = client.build_request(
                request.method,
                url,
                content=body,
                headers={"content-type": request.headers.get("content-type", "")},
            )
            tag = request.app.state.forward_tag
            sent = outgoing.url.raw_path.decode("latin-1")
            key = request.scope.get(KEY)  # None on a node without keys
            key_id = key.id if key is not None else None
            outgoing.headers[FORWARDED] = tag(outgoing.method, sent, body, key_id) if tag else "1"
            with client_watch(request.receive) as gone:
                answer = await _ask(
                    broker,
                    target,
                    client.send(outgoing, stream=True),
                    FORWARD_STALL_S + _long_poll_s(body),
                    gone,
                )
            if not answer.is_success:
                await answer.aread()
        except ClientGone:
            # The forward is closed, so a lease waiting on the leader grants nothing;
            # nobody reads this answer (nginx's code for a client that left).
            return Response(status_code=499)
        except LeaderStalled as e:
            return problem(503, "leader unreachable", str(e), retry_after=0)
        except httpx.ConnectError as e:
            if time.monotonic() < deadline:
                await asyncio.sleep(LEADER_POLL_S)
                continue
            return problem(503, "leader unreachable", f"{target}: {type(e).__name__}")
        except httpx.HTTPError as e:
            return problem(503, "leader unreachable", f"{target}: {type(e).__name__}")
        if _not_leader(answer) and time.monotonic() < deadline:
            await asyncio.sleep(LEADER_POLL_S)  # it stepped down before taking the request
            continue
        keep = {k: v for k, v in answer.headers.items() if k.lower() in _RELAYED_HEADERS}
        if not answer.is_success:
            return Response(answer.content, status_code=answer.status_code, headers=keep)
        for name in ("content-length", "content-encoding"):  # of the bytes relayed as they are
            if name in answer.headers:
                keep[name] = answer.headers[name]
        # Closed once sent, or once the client has gone before all of it was.
        return StreamingResponse(
            _relayed(answer),
            status_code=answer.status_code,
            headers=keep,
            background=BackgroundTask(answer.aclose),
        )


# The leader's headers a forwarded answer carries: with `dejaq-not-applied` (a leader
# starting or full), the client sends the request elsewhere, as it would asked directly.
_RELAYED_HEADERS = frozenset({"content-type", "retry-after", NOT_APPLIED})


async def _relayed(answer: httpx.Response) -> AsyncIterator[bytes]:
    """The leader's answer, a chunk at a time as it comes."""
    async for chunk in answer.aiter_raw():
        yield chunk


class LeaderStalled(Exception):
    """The leader a request was forwarded to stopped answering, or was replaced."""


class ClientGone(Exception):
    """The client of a forwarded request disconnected before the leader answered."""


def _long_poll_s(body: bytes) -> float:
    """A request's long-poll wait (a lease's `wait_ms`), which its answer may take: read
    as the leader's validation reads it, 0 where that refuses it. Parsed only where the
    key may be: written plainly, or escaped (`\\u0077ait_ms` is the same key)."""
    if b'"wait_ms"' not in body and b"\\u" not in body:
        return 0.0
    try:
        wait = WAIT_MS.validate_python(json.loads(body).get("wait_ms", 0))
    except (ValueError, AttributeError, RecursionError):
        return 0.0
    return wait / 1000


async def _ask(
    broker: Broker,
    target: str,
    sending: Awaitable[httpx.Response],
    patience_s: float,
    gone: Callable[[], bool],
) -> httpx.Response:
    """The leader's answer, unless it takes `patience_s` or Raft elects another leader
    first: either way the request may or may not have been applied (as after a lost
    answer), which the client knows how to retry. ClientGone once `gone()`."""
    task = asyncio.ensure_future(sending)
    give_up = time.monotonic() + patience_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LEADER_POLL_S)
            if done:
                return task.result()
            if gone():
                raise ClientGone
            leader = broker.raft.leader_http() if broker.raft is not None else None
            if leader is not None and leader != target:
                raise LeaderStalled(f"{target} was replaced by {leader} as leader")
            if time.monotonic() >= give_up:
                raise LeaderStalled(f"{target} did not answer in {patience_s:.1f} s")
    except BaseException:
        task.cancel()
        if task.done() and not task.cancelled() and task.exception() is None:
            await task.result().aclose()  # its head came just as this gave up
        raise


class BrokerApp(FastAPI):
    """FastAPI, behind the key check (`broker.access`, when keys are on) and the body
    limits (`broker.body_limits`), and with lease and ack offered to `broker.hotpath`
    before FastAPI's own per-request machinery (telemetry checks, middleware stack,
    routing) runs."""

    front: Any

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.front(scope, receive, send)


DOCS_ASSETS = "/docs-assets"


def _serve_docs(app: FastAPI) -> None:
    """`/docs`, Swagger UI from files the node serves itself: FastAPI's own page loads
    them from a CDN, and is blank offline or behind a firewall."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=OFFLINE_DOCS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )


def create_app(broker: Broker, producer: Producer) -> FastAPI:
    """The HTTP API of one node; the caller opens (`Broker.open`) and stops `broker`. Its
    indexes load and its Raft node starts behind the server (`Broker.start_behind`),
    which answers probes meanwhile (`starting.Starting`)."""
    materialiser = Materialiser(broker, producer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        broker.start_behind(asyncio.get_running_loop())
        try:
            async with httpx.AsyncClient(timeout=40, verify=_verify(broker)) as client:
                app.state.http = client
                crons = asyncio.create_task(materialiser.run())
                try:
                    yield
                finally:
                    crons.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await crons
        finally:
            broker.halt()  # before Raft is detached: a load ending now does not attach it
            if broker.raft is not None and broker.raft.attached():
                broker.raft.detach()
        producer.close()

    app = BrokerApp(
        title="DejaQ broker",
        version="1",
        summary="Lease the lowest sort keys of a reorder buffer; ack, nack, extend, reject.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    _serve_docs(app)
    app.state.broker = broker
    app.state.producer = producer
    app.state.materialiser = materialiser
    app.add_exception_handler(Problem, _on_problem)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(ForwardToLeader, _forward)
    for router in (
        topics.router,
        messages.router,
        leases.router,
        consumers.router,
        schedules.router,
        admin.router,
        listings.router,
    ):
        app.include_router(router, prefix="/v1")
    app.include_router(health.router)
    conf = broker.conf
    app.state.scheme = conf.tls.scheme
    password = conf.raft_password
    # Signs each forward (`access.forward_tag`); unsigned where no password is set (one
    # node, without keys).
    app.state.forward_tag = partial(forward_tag, password, broker.http_addr) if password else None
    if password:
        forward_key(password)  # stretched here, once, not on the event loop at a forward
    app.front = Starting(
        BodyLimits(HotPath(partial(FastAPI.__call__, app), broker), broker), broker
    )
    if conf.keys_file is not None:
        broker.keys = KeyRing(Path(conf.keys_file))
        app.front = Guard(
            app.front,
            broker.keys,
            password,
            largest_body(conf.max_payload_bytes),
            conf.metrics_open,
        )
        _declare_security(app, conf.metrics_open)
    _document_problems(app)
    return app


def _verify(broker: Broker) -> ssl.SSLContext | bool:
    """How a follower checks the leader it forwards to: the cluster's CA, if given."""
    tls = broker.conf.tls
    return ssl.create_default_context(cafile=tls.ca) if tls.ca is not None else True


def _document_problems(app: FastAPI) -> None:
    """The OpenAPI as the node answers: every error a problem detail under its own media
    type (FastAPI files a response model under application/json), and what any route
    taking a body may answer besides its own."""
    schema = app.openapi()
    detail = {PROBLEM: {"schema": {"$ref": "#/components/schemas/ProblemDetail"}}}
    body_errors = {
        "400": "the body cannot be read: not UTF-8",
        "413": "the body is larger than the route takes",
        "422": "the body is invalid: not JSON, sent without content-type application/json, "
        "or not what the route takes",
    }
    for operations in schema["paths"].values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if "requestBody" in operation:
                for code, description in body_errors.items():
                    responses.setdefault(code, {})["description"] = description
            for code, response in responses.items():
                if code.startswith(("4", "5")):
                    response["content"] = detail


def _declare_security(app: FastAPI, metrics_open: bool) -> None:
    """The OpenAPI names the bearer scheme, and on each operation the role it needs."""
    roles = {(m, p): r for m, p, r in ROUTES}
    schema = app.openapi()
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["apiKey"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "a DejaQ API key (`dejaq keys add`); roles per topic",
    }
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            key = (method.upper(), path)
            if key not in roles or (path == "/metrics" and metrics_open):
                continue
            operation["security"] = [{"apiKey": []}]
            role = roles[key]
            operation["x-dejaq-role"] = role
            if role is not None:
                note = f"Needs an API key with the role `{role}`"
                where = " on the topic." if "{topic}" in path else "."
                operation["description"] = f"{operation.get('description', '')}\n\n{note}{where}"
            operation.setdefault("responses", {}).update(
                {
                    "401": {"description": "no API key, or an unknown or revoked one"},
                    "403": {"description": "the key lacks the role on this topic"},
                }
            )
