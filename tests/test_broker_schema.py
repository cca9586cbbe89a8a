"""Schemathesis against a live broker's OpenAPI spec: whatever fits (or nearly fits) the
spec, no request gets a 5xx."""

from __future__ import annotations

import os
import secrets
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from test_broker import buffer_rows, fill

from dejaq.broker.api.keys import ROLES, add_key
from dejaq.jobs import cluster
from dejaq.jobs.certificates import new_authority


@dataclass
class Node:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    verify: str | bool = True


@pytest.fixture(scope="module", params=["open", "secured"])
def live_node(request, tmp_path_factory, kafka_bootstrap: str) -> Iterator[Node]:
    """One node as the local default runs it, and one with TLS and API keys on (requests
    sent with a key that holds every role)."""
    tmp: Path = tmp_path_factory.mktemp("schema")
    secured = request.param == "secured"
    source = f"schema-in-{secrets.token_hex(4)}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(source, 1, 1)])
    admin.close()
    conf, keys = tmp / "dejaq.yaml", tmp / "keys.json"
    ca = new_authority(tmp / "pki")
    pki = ca.issue(tmp / "pki", "node", ["127.0.0.1"])
    tls = f"{{cert: {pki.cert}, key: {pki.key}, ca: {ca.cert}}}"
    secure = f", keys_file: {keys}, tls: {tls}" if secured else ""
    conf.write_text(
        f"warehouse: {tmp / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        f"broker: {{max_payload_bytes: 2000, lease_ms: 1000{secure}}}\n"
        "topics:\n"
        f"  - {{name: jobs, kind: priority, source: [{source}], buckets: 4}}\n"
        f"  - {{name: later, kind: timeline, source: [{source}], buckets: 2}}\n"
    )
    fill(str(tmp / "warehouse"), "jobs", buffer_rows(list(range(50)), prefix="s"))
    os.environ.setdefault("DEJAQ_BROKER_RAFT_PASSWORD", secrets.token_hex(8))
    token = add_key(keys, "schema", list(ROLES), ["*"])
    nodes = cluster.up(1, tmp / "raft", str(conf))
    node = Node(nodes[0].url)
    if secured:
        node = Node(nodes[0].url, {"authorization": f"Bearer {token}"}, str(ca.cert))
    try:
        yield node
    finally:
        cluster.stop_node(nodes[0])


def test_no_request_gets_a_5xx(live_node: Node) -> None:
    """Every operation, ~20 generated cases each (valid and nearly valid)."""
    api = schemathesis.openapi.from_url(f"{live_node.url}/openapi.json", verify=live_node.verify)
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 15
    seen: Counter[str] = Counter()

    for operation in operations:

        @settings(
            max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(
            case=operation.as_strategy(),
            topic=st.sampled_from(["jobs", "later", None]),
            message=st.sampled_from([f"s{i}" for i in range(50)] + [None]),
        )
        def call(case, topic: str | None, message: str | None) -> None:
            params = case.path_parameters or {}
            if topic and "topic" in params:  # mostly real topics and messages, not just 404s
                params["topic"] = topic
            if message and "message_id" in params:
                params["message_id"] = message
            if isinstance(case.body, dict) and isinstance(case.body.get("wait_ms"), int):
                case.body["wait_ms"] = min(case.body["wait_ms"], 50)  # keep long-polls short
            response = case.call(timeout=30, headers=live_node.headers, verify=live_node.verify)
            seen[f"{response.status_code // 100}xx"] += 1
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
            )
            if response.status_code >= 400:
                assert "application/problem+json" in response.headers["content-type"]
            assert response.status_code not in (401, 403), response.text  # the key holds all

        call()
    assert seen["2xx"] > 20 and seen["4xx"] > 20, seen
