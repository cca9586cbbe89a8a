"""A typed, synchronous client for the broker's HTTP API, over every node of a cluster.

Any node takes any request (followers forward to the leader), so the client sticks to
one node and moves to the next when it does not answer. A 503 (an election, a node not
ready) is waited out as its `Retry-After` says. Both are bounded by a deadline per call;
past it the call raises `Unavailable`. A call that is not safe to send twice (a produce
without ids) is not retried: it raises `Unavailable`, or the 503's `ProblemError`. A 401
or 403 is asked of every other node once (each reads its own copy of the key file) before
it is raised. Other error answers raise a `ProblemError` (a subclass per status) carrying
the RFC 9457 problem details.

A call that may have been applied before its answer was lost (a reset connection, a
read timeout, a 503 from a node that had forwarded it) is sent again only where that is
safe; a 409 after such a retry says so (`Conflict.maybe_applied`), since the refusal
may be the call's own first attempt (an ack's `already_settled`, say).
"""

from __future__ import annotations

import base64
import logging
import os
import ssl
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from dejaq.client.connections import Connections, Lost, Node, NotSent, Response
from dejaq.client.errors import (
    InvalidRequest,
    ProblemError,
    Unavailable,
    problem_of,
    retry_after_s,
)
from dejaq.client.models import (
    Cluster,
    ExtendResult,
    Heartbeat,
    Left,
    Message,
    NackResult,
    NewMessage,
    Paused,
    Peeked,
    Purged,
    Redriven,
    Schedule,
    SettleResult,
    TopicStats,
    TopicSummary,
    decode,
)

log = logging.getLogger("dejaq.client")

TOKEN_VARIABLE = "DEJAQ_TOKEN"
RETRYABLE = frozenset({502, 503, 504})
# A header of a node's 503 that applied nothing, not even by forwarding (a node starting,
# a node at its connection cap): the request goes to another node as one that never left
# would, a produce without ids too, and no later answer is taken for a repeat of it.
NOT_APPLIED = "dejaq-not-applied"
DENIED = frozenset({401, 403})  # by this node's copy of the key file: others may differ
CONNECT_TIMEOUT_S = 3.0  # at most, per attempt
ROUND_PAUSE_S = (0.05, 1.0)  # after every node failed once: first pause, longest pause

T = TypeVar("T")


def node_url(node: str) -> str:
    """A node's base URL; `host:port` alone means plain HTTP."""
    node = node.rstrip("/")
    return node if "://" in node else f"http://{node}"


@dataclass
class Answer:
    response: Response
    sent_at: float  # time.monotonic() when the answered attempt was sent
    maybe_applied: bool  # an earlier attempt may have been applied


# --- the client ------------------------------------------------------------------------------


class Client:
    """The broker's HTTP API as methods, over a list of node base URLs.

    Thread-safe: a worker's lease-keeping thread shares its client with the handler loop.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        *,
        token: str | None = None,
        verify: bool | str | ssl.SSLContext = True,
        timeout: float = 10.0,
        stall_s: float = 2.0,
        deadline: float = 30.0,
        max_retry_after: float = 5.0,
        insecure_http: bool = False,
    ) -> None:
        """`token`: an API key, sent as a bearer token (default: `$DEJAQ_TOKEN`, if set).
        `verify`: how `https://` nodes are checked: True (the system's CAs), a CA file's
        path, an `ssl.SSLContext`, or False (not at all). `timeout` bounds one attempt;
        `stall_s` one attempt of a worker's calls (lease, ack, nack, extend, reject,
        heartbeat, leave), which the broker answers in milliseconds: a node silent for
        longer is taken for stalled (a stopped process still accepts connections) and
        the call moves to the next node. A lease's `wait_ms` is added to either.
        `deadline` bounds a call, every node and retry included, and an answer still
        arriving (a node sending a byte now and then is never silent for long); a
        `Retry-After` is obeyed up to `max_retry_after` seconds. With a token, an
        `http://` node beyond loopback is refused, as the key would cross the network in
        clear, unless `insecure_http` says something in front of it encrypts the traffic."""
        if not nodes:
            raise ValueError("nodes: give at least one node base URL")
        self.nodes = [node_url(n) for n in nodes]
        self._parsed = {url: Node.parse(url) for url in self.nodes}
        self.timeout, self.deadline, self.max_retry_after = timeout, deadline, max_retry_after
        self.stall_s = stall_s
        # False once a node refused a lease's `request_id` (a broker of a version from
        # before it): leases go without, as that broker would take them.
        self._request_ids = True
        token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
        if token and not insecure_http:
            for url, node in self._parsed.items():
                if not node.tls and not node.loopback:
                    raise ValueError(
                        f"{url}: the API key would cross the network in clear over http://; "
                        "give an https:// URL, or allow it with insecure_http if something "
                        "in front of the node encrypts its traffic"
                    )
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = Connections(headers, verify)
        self._current = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def node(self) -> str:
        """The node calls go to until it fails."""
        return self.nodes[self._current]

    def _move_on(self, failed: str) -> None:
        with self._lock:
            if self.nodes[self._current] == failed:
                self._current = (self._current + 1) % len(self.nodes)

    def _send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        wait_s: float = 0.0,
        replay_safe: bool = True,
        worker: bool = False,
    ) -> Answer:
        """One call: across nodes and 503s until the deadline; an answer that is not a
        retryable 5xx is returned (2xx) or raised (as its `ProblemError`). A 401 or 403
        is raised once every node has refused or could not be reached: each reads its
        own copy of the key file, and another's may know the key already, so a node that
        refused is not asked again while another may still judge the key (one answering
        503, an election say, is asked until the deadline). `worker`: one of a worker's
        calls, given `stall_s` per attempt."""
        deadline = time.monotonic() + self.deadline + wait_s
        attempt = self.stall_s if worker else self.timeout
        connect = min(attempt, CONNECT_TIMEOUT_S)
        maybe_applied = False
        failures = 0
        why = "no time left"
        denied: set[str] = set()  # nodes that refused the key (401, 403): it is not applied
        unreachable: set[str] = set()  # nodes that could not be sent the call
        refusal: ProblemError | None = None  # the last of the refusals
        while True:
            node = self.node
            if refusal is not None and node in denied | unreachable:
                if denied | unreachable >= set(self.nodes):  # no node left to judge it
                    raise refusal
                self._move_on(node)  # another node's copy of the key file decides
                continue
            sent_at = time.monotonic()
            left = deadline - sent_at  # an attempt, its answer too, ends by the deadline
            if left <= 0:
                raise Unavailable(f"{method} {path}: no node served it in time; last: {why}")
            stay = False
            try:
                answer = self._http.request(
                    self._parsed[node],
                    method,
                    path,
                    body,
                    timeout=attempt + wait_s,
                    connect_timeout=min(connect, left),
                    until=deadline,
                )
            except NotSent as e:
                why, pause = f"{node}: {e}", 0.0
                unreachable.add(node)
            except Lost as e:
                if not replay_safe:
                    raise Unavailable(f"{node}: {e}; not safe to retry") from e
                why, pause, maybe_applied = f"{node}: {e}", 0.0, True
            else:
                if answer.status_code in DENIED:
                    refusal = problem_of(answer, maybe_applied)
                    denied.add(node)
                    unreachable.discard(node)
                    why, pause = f"{node}: {refusal}", 0.0
                elif answer.status_code not in RETRYABLE:
                    if answer.is_success:
                        return Answer(answer, sent_at, maybe_applied)
                    raise problem_of(answer, maybe_applied)
                elif NOT_APPLIED in answer.headers:
                    why, pause = f"{node}: {answer.status_code} {answer.text[:200]}", 0.0
                elif not replay_safe:
                    raise problem_of(answer, maybe_applied)
                else:
                    why = f"{node}: {answer.status_code} {answer.text[:200]}"
                    pause = min(retry_after_s(answer), self.max_retry_after)
                    maybe_applied = True  # a follower may have forwarded it before failing
                    # Retry-After 0: the node gave up on a stalled leader and knows the new
                    # one (or is it): asked again, it forwards there, where another node
                    # might be the stalled one.
                    stay = answer.headers.get("retry-after") == "0"
            failures += 1
            if not stay:
                self._move_on(node)
            if failures % len(self.nodes) == 0:  # every node failed once more: slow down
                first, longest = ROUND_PAUSE_S
                pause = max(pause, min(longest, first * 2 ** (failures // len(self.nodes) - 1)))
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"{method} {path}: no node served it in time; last: {why}")
            log.info("%s %s: %s; retrying on %s", method, path, why, self.node)
            time.sleep(min(pause, left))

    def _json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        return self._send(method, path, body, **kw).response.json()

    def _model(self, model: type[T], method: str, path: str, body: Any = None) -> T:
        return decode(model, self._json(method, path, body))

    # --- leasing -----------------------------------------------------------------------

    def lease(
        self,
        topic: str,
        consumer_id: str,
        max_messages: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> list[Message]:
        """Up to `max_messages` of the lowest deliverable sort keys of the consumer's
        buckets, waiting up to `wait_ms` for some (long poll). Leasing joins the topic.
        A `consumer_id` is one live process's own: another using it shares its buckets,
        and its `leave` gives back this one's leases too.

        Each call makes a `request_id` and sends it with every attempt: one sent again
        after a lost answer is answered with what the lost attempt leased, its receipts
        and deliveries (less what ended since: expired, or settled through another
        call), rather than more messages while those wait out their lease unseen. The
        broker keeps the consumer's last request only: a consumer that left or was
        expired meanwhile leases anew, and the lost attempt's messages come back once
        their lease expires, with one more delivery counted.
        """
        body: dict[str, Any] = {
            "consumer_id": consumer_id,
            "max_messages": max_messages,
            "wait_ms": wait_ms,
        }
        if self._request_ids:
            body["request_id"] = uuid.uuid4().hex
        if lease_ms is not None:
            body["lease_ms"] = lease_ms
        path = f"/v1/topics/{topic}/leases"
        first_sent = time.monotonic()
        try:
            answer = self._send("POST", path, body, wait_s=wait_ms / 1000, worker=True)
        except InvalidRequest as e:
            if "request_id" not in body or not _names_field(e, "request_id"):
                raise
            log.warning("%s refuses a lease's request_id (an older broker): leasing without", e)
            self._request_ids = False
            del body["request_id"]
            first_sent = time.monotonic()
            answer = self._send("POST", path, body, wait_s=wait_ms / 1000, worker=True)
        sent_at = first_sent if answer.maybe_applied else answer.sent_at  # whose lease it is
        messages = decode(list[Message], answer.response.json()["messages"])
        for m in messages:
            held_ms = lease_ms if lease_ms is not None else m.lease_deadline - _epoch_ms()
            m.held_until = sent_at + held_ms / 1000
        return messages

    def _settle(
        self,
        topic: str,
        verb: str,
        consumer_id: str,
        ids: Iterable[str] | None,
        receipts: Iterable[int] | None,
        **extra: Any,
    ) -> Any:
        if (ids is None) == (receipts is None):
            raise ValueError("name the messages by ids or by receipts (one of the two)")
        named = {"ids": list(ids)} if ids is not None else {"receipts": list(receipts or ())}
        body = {"consumer_id": consumer_id, **named, **extra}
        return self._json("POST", f"/v1/topics/{topic}/{verb}", body, worker=True)

    def ack(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> SettleResult:
        """Done: never delivered again. The messages are named by `ids` or by the
        `receipts` their lease gave (`Message.receipt`, the faster way); in a
        `Conflict`, `refused` is keyed by what was given (a receipt as a string)."""
        return decode(SettleResult, self._settle(topic, "acks", consumer_id, ids, receipts))

    def nack(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        delay_ms: int = 0,
        priority: int | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> NackResult:
        """Give back for redelivery after `delay_ms`, optionally at a new priority; those
        out of deliveries go to the dead letters instead (`dead`, by id)."""
        extra: dict[str, Any] = {"delay_ms": delay_ms}
        if priority is not None:
            extra["priority"] = priority
        got = self._settle(topic, "nacks", consumer_id, ids, receipts, **extra)
        return decode(NackResult, got)

    def extend(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        lease_ms: int | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> ExtendResult:
        """Push the leases' deadline to now + `lease_ms` (default: the broker's)."""
        extra = {} if lease_ms is None else {"lease_ms": lease_ms}
        got = self._settle(topic, "extensions", consumer_id, ids, receipts, **extra)
        return decode(ExtendResult, got)

    def reject(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> SettleResult:
        """Poison: straight to the dead letters."""
        got = self._settle(topic, "rejections", consumer_id, ids, receipts)
        return decode(SettleResult, got)

    # --- consumers ---------------------------------------------------------------------

    def heartbeat(self, topic: str, consumer_id: str) -> Heartbeat:
        """Join or stay alive; the answer lists the buckets the consumer may lease from."""
        path = f"/v1/topics/{topic}/consumers/{_segment(consumer_id)}/heartbeat"
        return decode(Heartbeat, self._json("POST", path, worker=True))

    def leave(self, topic: str, consumer_id: str) -> Left:
        """Leave: the consumer's leases go back to pending, its buckets to the others;
        all its leases, those of any other process using the same `consumer_id` too."""
        path = f"/v1/topics/{topic}/consumers/{_segment(consumer_id)}"
        return decode(Left, self._json("DELETE", path, worker=True))

    # --- messages ----------------------------------------------------------------------

    def produce(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        priority: int | None = None,
        deliver_at: int | None = None,
        id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> str:
        """One message into the topic's Kafka input; returns its id once Kafka has it."""
        message = NewMessage(payload, key, priority, deliver_at, id, headers)
        answer = self._send(
            "POST", f"/v1/topics/{topic}/messages", message.to_json(), replay_safe=id is not None
        )
        return answer.response.json()["ids"][0]

    def produce_batch(self, topic: str, messages: Sequence[NewMessage]) -> list[str]:
        """Up to 1000 messages; returns their ids once Kafka has all of them.

        Sent again after a lost answer or a 503 only if every message carries its own id
        (the buffer keeps the first of a duplicated id): otherwise it raises
        `Unavailable`, or the 503's `ProblemError`.
        """
        body = {"messages": [m.to_json() for m in messages]}
        safe = all(m.id is not None for m in messages)
        answer = self._send("POST", f"/v1/topics/{topic}/messages/batch", body, replay_safe=safe)
        return list(answer.response.json()["ids"])

    def peek(self, topic: str, message_id: str) -> Peeked:
        """A message's status (pending, delayed, leased, acked, dead, cancelled)."""
        return self._model(Peeked, "GET", _message_path(topic, message_id))

    def cancel(self, topic: str, message_id: str) -> None:
        """Never deliver a pending or leased message (again)."""
        self._send("DELETE", _message_path(topic, message_id))

    def reschedule(
        self,
        topic: str,
        message_id: str,
        *,
        priority: int | None = None,
        deliver_at: int | None = None,
    ) -> None:
        """A pending message's new priority (priority topics) or deliver_at (timelines)."""
        body = {
            k: v for k, v in (("priority", priority), ("deliver_at", deliver_at)) if v is not None
        }
        self._send("PATCH", _message_path(topic, message_id), body)

    # --- operations --------------------------------------------------------------------

    def pause(self, topic: str) -> Paused:
        """Stop leasing on every node (a lease long-poll waits); settling goes on."""
        return self._model(Paused, "POST", f"/v1/topics/{topic}/pause")

    def resume(self, topic: str) -> Paused:
        """Lease again."""
        return self._model(Paused, "POST", f"/v1/topics/{topic}/resume")

    def purge(self, topic: str, confirm: str) -> Purged:
        """Cancel every pending message; `confirm` must be the topic's name. Leased ones
        are left to their consumers. Sent again after a lost answer, it also cancels what
        became pending meanwhile, as a purge sent that much later would."""
        return self._model(Purged, "POST", f"/v1/topics/{topic}/purge", {"confirm": confirm})

    def redrive(
        self,
        topic: str,
        ids: Iterable[str] | None = None,
        *,
        every: bool = False,
        priority: int | None = None,
        deliver_at: int | None = None,
    ) -> Redriven:
        """Dead messages (`ids`, or `every` one of the topic) pending again, deliveries
        from 0, at a new priority or deliver_at if given. Once per death: a retried call
        counts what the lost attempt redrove as skipped, `already_redriven`, and says that
        an earlier attempt may have been applied (`maybe_applied`)."""
        body: dict[str, Any] = {"all": every}
        if ids is not None:
            body["ids"] = list(ids)
        for name, value in (("priority", priority), ("deliver_at", deliver_at)):
            if value is not None:
                body[name] = value
        answer = self._send("POST", f"/v1/topics/{topic}/dead-letters/redrive", body)
        result = decode(Redriven, answer.response.json())
        object.__setattr__(result, "maybe_applied", answer.maybe_applied)  # frozen
        return result

    # --- schedules (cron topics) -------------------------------------------------------

    def create_schedule(
        self,
        topic: str,
        cron: str,
        payload: bytes,
        *,
        key: str | None = None,
        time_zone: str = "UTC",
        headers: dict[str, str] | None = None,
        end: int | None = None,
        schedule_id: str | None = None,
    ) -> Schedule:
        """From now on, each occurrence of `cron` (in `time_zone`, up to `end`, epoch ms)
        becomes a message delivered at its time. The id is generated here if not given,
        so a retry finds the schedule made (same definition: no error)."""
        body: dict[str, Any] = {
            "id": uuid.uuid4().hex if schedule_id is None else schedule_id,
            "cron": cron,
            "time_zone": time_zone,
            "payload": base64.b64encode(payload).decode("ascii"),
        }
        for name, value in (("key", key), ("headers", headers), ("end", end)):
            if value is not None:
                body[name] = value
        return self._model(Schedule, "POST", f"/v1/topics/{topic}/schedules", body)

    def schedules(self, topic: str) -> list[Schedule]:
        """Every schedule of a cron topic, by id."""
        got = self._json("GET", f"/v1/topics/{topic}/schedules")["schedules"]
        return decode(list[Schedule], got)

    def schedule(self, topic: str, schedule_id: str) -> Schedule:
        """One schedule, with its next occurrence and how far it is materialised."""
        return self._model(Schedule, "GET", _schedule_path(topic, schedule_id))

    def delete_schedule(self, topic: str, schedule_id: str) -> None:
        """Stop the schedule; occurrences already materialised stay. A 404 after a retry
        (`NotFound.maybe_applied`) may be the lost attempt's own delete."""
        self._send("DELETE", _schedule_path(topic, schedule_id))

    # --- topics and cluster ------------------------------------------------------------

    def topics(self) -> list[TopicSummary]:
        """The topics the broker leases from."""
        return decode(list[TopicSummary], self._json("GET", "/v1/topics"))

    def topic_stats(self, topic: str) -> TopicStats:
        """Pending, delayed, leased, acked, dead, consumers; per bucket too."""
        return self._model(TopicStats, "GET", f"/v1/topics/{topic}")

    def cluster(self) -> Cluster:
        """The current node's view of the cluster: role, term, leader, every node."""
        return self._model(Cluster, "GET", "/v1/cluster")


def _message_path(topic: str, message_id: str) -> str:
    return f"/v1/topics/{topic}/messages/{_segment(message_id)}"


def _schedule_path(topic: str, schedule_id: str) -> str:
    return f"/v1/topics/{topic}/schedules/{_segment(schedule_id)}"


def _epoch_ms() -> int:
    return time.time_ns() // 1_000_000


def _segment(name: str) -> str:
    """An id as one path segment: percent-encoded, and `.` and `..` as `%2E`s, which a
    URL's normalisation would otherwise take for the current and the parent folder."""
    quoted = quote(name, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


def _names_field(error: InvalidRequest, name: str) -> bool:
    """Whether a 422 refused the body's field `name` (FastAPI's `loc` ends with it)."""
    return any(list(e.get("loc") or [])[-1:] == [name] for e in error.errors)
