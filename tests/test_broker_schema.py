"""Schemathesis against a live broker's OpenAPI spec: whatever fits (or nearly fits) the
spec, no request gets a 5xx."""

from __future__ import annotations

import os
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from test_broker import buffer_rows, fill

from dejaq.jobs import cluster


@pytest.fixture(scope="module")
def live_node(tmp_path_factory, kafka_bootstrap: str) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("schema")
    source = f"schema-in-{secrets.token_hex(4)}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(source, 1, 1)])
    admin.close()
    conf = tmp / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        "broker: {max_payload_bytes: 2000, lease_ms: 1000}\n"
        "topics:\n"
        f"  - {{name: jobs, kind: priority, source: [{source}], buckets: 4}}\n"
        f"  - {{name: later, kind: timeline, source: [{source}], buckets: 2}}\n"
    )
    fill(str(tmp / "warehouse"), "jobs", buffer_rows(list(range(50)), prefix="s"))
    os.environ.setdefault("DEJAQ_BROKER_RAFT_PASSWORD", secrets.token_hex(8))
    nodes = cluster.up(1, tmp / "raft", str(conf))
    try:
        yield nodes[0].url
    finally:
        cluster.stop_node(nodes[0])


def test_no_request_gets_a_5xx(live_node: str) -> None:
    """Every operation, ~20 generated cases each (valid and nearly valid)."""
    api = schemathesis.openapi.from_url(f"{live_node}/openapi.json")
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
            response = case.call(timeout=30)
            seen[f"{response.status_code // 100}xx"] += 1
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
            )
            if response.status_code >= 400:
                assert "application/problem+json" in response.headers["content-type"]

        call()
    assert seen["2xx"] > 20 and seen["4xx"] > 20, seen
