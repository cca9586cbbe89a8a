"""Cron topics: the expression and time-zone maths, schedules over HTTP on a real 3-node
cluster, and occurrences through real Kafka, the ingest and the broker, once each."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import itertools
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import httpx
import pytest
from conftest import run_to_end, wait_until
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from test_broker_cluster import PROBLEM, follower, leader_of, start, stop

from dejaq.broker.materialiser import Materialiser, occurrence_id
from dejaq.broker.service import Outgoing, Problem, Producer
from dejaq.broker.state import cron
from dejaq.broker.state.schedules import Schedule
from dejaq.conf.settings import ConfigError, KafkaConfig, Settings, TopicConfig, load_settings
from dejaq.conf.tables import Table, scan, table_path
from dejaq.jobs import cluster
from dejaq.pipelines.ingest import IngestJob
from dejaq.pipelines.session import detect_connectors

BERLIN = ZoneInfo("Europe/Berlin")
HOUR_MS = 3600 * 1000


def ms(at: dt.datetime) -> int:
    return int(at.timestamp() * 1000)


def local(at_ms: int, tz: ZoneInfo) -> dt.datetime:
    return dt.datetime.fromtimestamp(at_ms / 1000, tz)


# --- maths -----------------------------------------------------------------------------


def test_a_daily_0230_in_berlin_runs_once_on_both_dst_days() -> None:
    spring = cron.occurrences(
        "30 2 * * *", BERLIN, ms(dt.datetime(2026, 3, 28, 12, tzinfo=BERLIN)), 2**62, 3
    )
    assert [local(t, BERLIN).isoformat() for t in spring] == [
        "2026-03-29T03:00:00+02:00",  # 02:30 does not exist that day: as the gap ends
        "2026-03-30T02:30:00+02:00",
        "2026-03-31T02:30:00+02:00",
    ]
    autumn = cron.occurrences(
        "30 2 * * *", BERLIN, ms(dt.datetime(2026, 10, 24, 12, tzinfo=BERLIN)), 2**62, 2
    )
    assert [local(t, BERLIN).isoformat() for t in autumn] == [
        "2026-10-25T02:30:00+02:00",  # 02:30 happens twice that day: the first only
        "2026-10-26T02:30:00+01:00",
    ]


def test_a_daily_0230_with_seconds_runs_once_on_both_dst_days_as_without() -> None:
    """Six fields follow the five-field rules: a fixed second within each minute the
    other fields give (once at 03:00:00 in spring, not skipped; once in autumn)."""
    days = [dt.datetime(2026, 3, 29, tzinfo=BERLIN), dt.datetime(2026, 10, 25, tzinfo=BERLIN)]
    runs = []
    for day in days:
        start, end = ms(day), ms(day + dt.timedelta(days=1))
        six = cron.occurrences("0 30 2 * * *", BERLIN, start, end, 10)
        assert six == cron.occurrences("30 2 * * *", BERLIN, start, end, 10)
        runs.append([local(t, BERLIN).isoformat() for t in six])
    assert runs == [["2026-03-29T03:00:00+02:00"], ["2026-10-25T02:30:00+02:00"]]
    spring = cron.occurrences(
        "15,45 30 2 * * *", BERLIN, ms(dt.datetime(2026, 3, 29, tzinfo=BERLIN)), 2**62, 2
    )
    assert [local(t, BERLIN).isoformat() for t in spring] == [
        "2026-03-29T03:00:15+02:00",
        "2026-03-29T03:00:45+02:00",
    ]


def test_hourly_follows_real_hours_across_the_autumn_change() -> None:
    day = ms(dt.datetime(2026, 10, 25, tzinfo=BERLIN))
    hours = cron.occurrences("0 * * * *", BERLIN, day - 1, day + 25 * HOUR_MS - 1, 100)
    assert len(hours) == 25, "the day has 25 hours"
    assert all(b - a == HOUR_MS for a, b in itertools.pairwise(hours))


def test_seconds_field_and_bounds() -> None:
    start = ms(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert cron.occurrences("*/15 * * * * *", ZoneInfo("UTC"), start, start + 60_000, 10) == [
        start + 15_000,
        start + 30_000,
        start + 45_000,
        start + 60_000,
    ], "strictly after the start, up to and including the end"
    assert len(cron.occurrences("* * * * * *", ZoneInfo("UTC"), start, start + 60_000, 7)) == 7
    assert cron.next_after("0 0 29 2 *", ZoneInfo("UTC"), start) == ms(
        dt.datetime(2028, 2, 29, tzinfo=dt.UTC)
    )


@pytest.mark.parametrize(
    "expr", ["", "* * *", "61 * * * *", "* 24 * * *", "0 0 31 2 *", "x * * * *", "* " * 7]
)
def test_invalid_expressions_say_why(expr: str) -> None:
    with pytest.raises(ValueError, match=r"cron expression|never occurs|at most"):
        cron.check(expr)


@pytest.mark.parametrize("name", ["Mars/Olympus", "", "../etc/passwd", "Europe"])
def test_unknown_time_zones(name: str) -> None:
    with pytest.raises(ValueError, match="unknown IANA time zone"):
        cron.zone(name)


def _field(values: st.SearchStrategy[int], top: int) -> st.SearchStrategy[str]:
    return st.one_of(
        st.just("*"),
        st.integers(2, top // 2).map(lambda n: f"*/{n}"),
        st.lists(values, min_size=1, max_size=3, unique=True).map(
            lambda v: ",".join(map(str, sorted(v)))
        ),
    )


# Expressions over seconds, minutes and hours: what a time-zone change can disturb.
EXPRESSIONS = st.one_of(
    st.tuples(_field(st.integers(0, 59), 60), _field(st.integers(0, 23), 24)).map(
        lambda f: f"{f[0]} {f[1]} * * *"
    ),
    st.tuples(
        st.lists(st.integers(0, 59), min_size=1, max_size=2, unique=True),
        st.lists(st.integers(0, 59), min_size=1, max_size=2, unique=True),
        _field(st.integers(0, 23), 24),
    ).map(lambda f: f"{','.join(map(str, f[0]))} {','.join(map(str, f[1]))} {f[2]} * * *"),
)
ZONES = st.sampled_from(
    ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kathmandu"]
)
# Near the 2026 changes of those zones, or anywhere in the decade.
NEAR = [
    dt.datetime(2026, 3, 29, 1, tzinfo=dt.UTC),
    dt.datetime(2026, 10, 25, 1, tzinfo=dt.UTC),
    dt.datetime(2026, 3, 8, 7, tzinfo=dt.UTC),
    dt.datetime(2026, 11, 1, 6, tzinfo=dt.UTC),
    dt.datetime(2026, 4, 4, 15, tzinfo=dt.UTC),
    dt.datetime(2026, 10, 3, 15, tzinfo=dt.UTC),
]
STARTS = st.one_of(
    st.tuples(st.sampled_from(NEAR), st.integers(-6 * HOUR_MS, 6 * HOUR_MS)).map(
        lambda p: ms(p[0]) + p[1]
    ),
    st.integers(
        ms(dt.datetime(2020, 1, 1, tzinfo=dt.UTC)), ms(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    ),
)


def _matches(expr: str, at: dt.datetime) -> bool:
    fields = expr.split()
    if len(fields) == 5:
        fields.insert(0, "0")
    second, minute, hour = fields[:3]

    def ok(spec: str, value: int) -> bool:
        if spec == "*":
            return True
        if spec.startswith("*/"):
            return value % int(spec[2:]) == 0
        return value in {int(v) for v in spec.split(",")}

    return ok(second, at.second) and ok(minute, at.minute) and ok(hour, at.hour)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    expr=EXPRESSIONS,
    zone=ZONES,
    start=STARTS,
    span=st.integers(1, 12 * HOUR_MS),
    cut=st.floats(0, 1),
)
def test_occurrences_increase_match_and_resume_without_gaps(
    expr: str, zone: str, start: int, span: int, cut: float
) -> None:
    tz = ZoneInfo(zone)
    end = start + span
    got = cron.occurrences(expr, tz, start, end, 100_000)
    assert all(start < t <= end for t in got), "none before its start, none after its end"
    assert all(a < b for a, b in itertools.pairwise(got)), "strictly increasing"
    for t in got:
        at = local(t, tz)
        # Debian's special case: a fixed-time job in a skipped hour runs as the gap ends.
        changed = local(t - 3 * HOUR_MS, tz).utcoffset() != at.utcoffset()
        assert _matches(expr, at) or changed, f"{at.isoformat()} does not match {expr!r}"
    middle = start + int(span * cut)
    resumed = cron.occurrences(expr, tz, start, middle, 100_000) + cron.occurrences(
        expr, tz, middle, end, 100_000
    )
    assert resumed == got, "resuming from any progress neither skips nor repeats"


def test_cron_topics_need_a_dedup_window_over_the_horizon(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(
        "topics:\n  - {name: c, kind: cron, source: [in], cron_horizon_ms: 600000,"
        " dedup_window_ms: 60000}\n"
    )
    with pytest.raises(ConfigError, match=r"topics\.0\.dedup_window_ms|dedup_window_ms"):
        load_settings(conf, env={})
    conf.write_text("topics:\n  - {name: c, kind: cron, source: [in]}\n")
    topic = load_settings(conf, env={}).topic("c")
    assert topic.dedup_window_ms >= topic.cron_horizon_ms + 3600 * 1000
    assert topic.kind.sorted_as == "timeline"


def test_schedules_read_by_two_threads_at_once_are_cached_under_their_own_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads read the schedules at once, one at the version before a create: the
    cache may keep either's rows, never the older rows under the newer version's number
    (the new schedule would never fire, until the next write). Here the newer read stops
    between its rows and its version number while the older one finishes."""
    import threading

    import pyarrow as pa

    from dejaq.broker.state import schedules

    store = schedules.ScheduleStore(str(tmp_path / "warehouse"), "ticks")
    store.add(Schedule("a", "* * * * *", "UTC", None, b"a"))
    older_scanning, newer_rows, older_done = (threading.Event() for _ in range(3))
    scan = schedules.scan

    def gated_scan(table: DeltaTable, kind: Table) -> pa.Table:
        if threading.current_thread().name == "older":
            older_scanning.set()
            newer_rows.wait(30)
        return scan(table, kind)

    class GatedTable(DeltaTable):
        """Stops the newer thread at a second version() call, made once it has its rows
        (as a read that takes the number after the rows does)."""

        def version(self) -> int:
            if threading.current_thread().name == "newer":
                self.calls = getattr(self, "calls", 0) + 1
                if self.calls == 2:
                    newer_rows.set()
                    older_done.wait(30)
            return super().version()

    def read() -> None:
        try:
            store.all()
        finally:
            newer_rows.set()

    monkeypatch.setattr(schedules, "scan", gated_scan)
    monkeypatch.setattr(schedules, "DeltaTable", GatedTable)
    older = threading.Thread(target=store.all, name="older")
    older.start()
    assert older_scanning.wait(30)
    store.add(Schedule("b", "* * * * *", "UTC", None, b"b"))  # a newer version
    newer = threading.Thread(target=read, name="newer")
    newer.start()
    older.join(30)
    older_done.set()
    newer.join(30)
    assert not older.is_alive() and not newer.is_alive()
    in_table = set(scan(store.path, Table.SCHEDULES, ["schedule_id"])["schedule_id"].to_pylist())
    assert in_table == {"a", "b"}
    assert set(store.all()) == in_table


def test_two_nodes_creating_one_schedule_id_at_once_store_one_definition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deposed leader that still takes itself for one and the new leader create the same
    id at once, with different definitions: one is stored, and the other node is told
    of it (not new), rather than two rows of which either may win a read. Here node A
    looks for the id, node B creates it, then A goes on."""
    from dejaq.broker.state import schedules

    warehouse = str(tmp_path / "warehouse")
    a, b = schedules.ScheduleStore(warehouse, "ticks"), schedules.ScheduleStore(warehouse, "ticks")
    mine = Schedule("x", "* * * * *", "UTC", None, b"from a")
    theirs = Schedule("x", "*/5 * * * *", "UTC", None, b"from b")
    looked = a.get
    told: list[tuple[Schedule, bool]] = []

    def look_then_b_creates(schedule_id: str) -> Schedule | None:
        found = looked(schedule_id)
        if not told:
            told.append(b.add(theirs))
        return found

    monkeypatch.setattr(a, "get", look_then_b_creates)
    stored, new = a.add(mine)
    assert told == [(theirs, True)]
    assert (stored, new) == (theirs, False), "A is told of B's"
    rows = scan(a.path, Table.SCHEDULES).to_pylist()
    assert [(r["schedule_id"], r["payload"]) for r in rows] == [("x", b"from b")]


# --- over HTTP, on a real cluster --------------------------------------------------------

HORIZON_MS = 60_000


@pytest.fixture(scope="module")
def crons(tmp_path_factory, kafka_bootstrap: str, kafka_source: str) -> Iterator[tuple]:
    source = kafka_source
    tmp_path = tmp_path_factory.mktemp("cron")
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        "broker: {max_payload_bytes: 1000}\n"
        "topics:\n"
        f"  - {{name: ticks, kind: cron, source: [{source}], buckets: 2,"
        f" cron_horizon_ms: {HORIZON_MS}}}\n"
        f"  - {{name: crud, kind: cron, source: [unused-{source}], buckets: 2}}\n"
        f"  - {{name: plain, kind: priority, source: [{source}]}}\n"
    )
    nodes = start(tmp_path, conf)
    with httpx.Client(timeout=40) as client:
        try:
            yield nodes, client, conf
        finally:
            stop(nodes)


def test_schedules_crud_on_any_node(crons) -> None:
    nodes, client, _ = crons
    a, b = follower(nodes, client, 0), follower(nodes, client, 1)
    url = "/v1/topics/crud/schedules"
    body = {
        "id": "nightly.report",
        "cron": "30 2 * * *",
        "time_zone": "Europe/Berlin",
        "payload": base64.b64encode(b"report").decode(),
        "key": "reports",
        "headers": {"trace": "t1", "dejaq-id": "ignored"},
        "end": "2099-01-01T00:00:00+01:00",
    }
    made = client.post(a.url + url, json=body)
    assert made.status_code == 201, made.text
    got = made.json()
    assert (got["id"], got["time_zone"], got["key"], got["headers"]) == (
        "nightly.report",
        "Europe/Berlin",
        "reports",
        {"trace": "t1"},
    )
    assert got["end"] == ms(dt.datetime(2099, 1, 1, tzinfo=dt.UTC)) - HOUR_MS
    assert local(got["next_at"], BERLIN).strftime("%H:%M") in ("02:30", "03:00")
    assert client.get(f"{b.url}{url}/nightly.report").json() == got, "any node reads it"
    assert client.post(b.url + url, json=body).status_code == 200, "same again: idempotent"
    other = client.post(b.url + url, json={**body, "cron": "0 3 * * *"})
    assert other.status_code == 409 and other.headers["content-type"] == PROBLEM

    generated = client.post(a.url + url, json={"cron": "0 0 * * MON", "payload": ""})
    assert generated.status_code == 201, generated.text
    gid = generated.json()["id"]
    assert len(gid) == 32 and generated.json()["time_zone"] == "UTC"
    listed = client.get(f"{a.url}{url}").json()["schedules"]
    assert [s["id"] for s in listed] == sorted([gid, "nightly.report"])

    for node in (a, b):
        target = gid if node is a else "nightly.report"
        assert client.delete(f"{node.url}{url}/{target}").status_code == 204
        gone = client.get(f"{node.url}{url}/{target}")
        assert gone.status_code == 404 and gone.headers["content-type"] == PROBLEM
    assert client.delete(f"{a.url}{url}/{gid}").status_code == 404
    assert client.get(f"{b.url}{url}").json() == {"schedules": []}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * *"}, "cron"),
        ({"cron": "0 0 31 2 *"}, "cron"),
        ({"time_zone": "Mars/Olympus"}, "time_zone"),
        ({"end": 1000}, "end"),
        ({"end": "2001-01-01T00:00:00Z"}, "end"),
        ({"end": "2099-01-01T00:00:00"}, "end"),
        ({"end": "9999-12-31T23:00:00-05:00"}, "end"),
        ({"id": "a@b"}, "id"),
        ({"payload": "%%%"}, "payload"),
    ],
)
def test_bad_schedules_are_422_naming_the_field(crons, change: dict, field: str) -> None:
    nodes, client, _ = crons
    body = {"cron": "* * * * *", "payload": "", **change}
    got = client.post(f"{follower(nodes, client).url}/v1/topics/crud/schedules", json=body)
    assert got.status_code == 422 and got.headers["content-type"] == PROBLEM
    problem = got.json()
    named = {part for e in problem.get("errors", []) for part in e["loc"]}
    assert field in named or field in problem["detail"], problem


def test_unknown_and_non_cron_topics_are_404(crons) -> None:
    nodes, client, _ = crons
    node = follower(nodes, client)
    for topic in ("nope", "plain"):
        body = {"cron": "* * * * *", "payload": ""}
        assert client.post(f"{node.url}/v1/topics/{topic}/schedules", json=body).status_code == 404
        assert client.get(f"{node.url}/v1/topics/{topic}/schedules").status_code == 404


def test_a_produce_to_a_cron_topic_takes_a_deliver_at_and_names_its_kind(crons) -> None:
    """A message produced to a cron topic is delivered by its deliver_at, as the
    occurrences are: without one, or with a priority, it is refused naming the kind."""
    nodes, client, _ = crons
    url = f"{follower(nodes, client).url}/v1/topics/crud/messages"
    now = int(time.time() * 1000)
    for body, detail in (
        ({"payload": ""}, "topic crud is a cron topic"),
        ({"payload": "", "deliver_at": now, "priority": 1}, "topic crud is a cron topic: it "),
    ):
        refused = client.post(url, json=body)
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"].startswith(detail), refused.text


@contextmanager
def materialising(
    kafka_bootstrap: str, tmp_path: Path, topic_configs: dict[str, str] | None = None
) -> Iterator[tuple[Materialiser, str]]:
    """A materialiser of cron topic `ticks` over a new Kafka input (with `topic_configs`),
    and that input's name. Its broker is a stand-in holding the settings alone (a round
    uses nothing else of it); Kafka, the producer and the schedules table are real."""
    source = f"ticks-in-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(source, 1, 1, topic_configs=topic_configs or {})])
    settings = Settings(
        warehouse=str(tmp_path / "warehouse"),
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        topics=[TopicConfig(name="ticks", kind="cron", source=[source])],
    )
    producer = Producer(settings.kafka)
    try:
        yield Materialiser(SimpleNamespace(settings=settings), producer), source  # type: ignore[arg-type]
    finally:
        producer.close()
        admin.delete_topics([source])
        admin.close()


def test_a_schedule_kafka_refuses_holds_back_no_other(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One schedule's payload is larger than the input topic takes: its occurrences are
    refused unsent, round after round, while the other schedule's go out and its
    progress moves. The materialiser's broker is a stand-in holding the settings alone (a round
    uses nothing else of it); Kafka, the producer and the schedules table are real."""
    limited = {"max.message.bytes": "10000"}
    with materialising(kafka_bootstrap, tmp_path, limited) as (materialiser, source):
        store = materialiser.stores["ticks"]
        now = int(time.time() * 1000)
        for schedule_id, payload in (("small", b"hi"), ("big", b"x" * 20_000)):
            schedule = Schedule(
                schedule_id, "* * * * * *", "UTC", None, payload, [], None, now, now
            )
            store.add(schedule)
        with caplog.at_level("WARNING", logger="dejaq.broker.state.cron"):
            sent = [asyncio.run(materialiser.round("ticks", now)) for _ in range(3)]
        progress = {i: s.materialised_until for i, s in store.all().items()}
        records = input_records(kafka_bootstrap, source)
    horizon = materialiser.topics["ticks"].cron_horizon_ms
    # The first round sends the small one's; the next have nothing of it due, and try
    # the big one alone.
    occurrences = horizon // 1000
    assert sent == [occurrences, 0, 0]
    assert progress == {"small": now + horizon, "big": now}
    ids = {dict(r.headers)["dejaq-id"].decode() for r in records}
    assert ids == {occurrence_id("small", now // 1000 * 1000 + k * 1000) for k in range(1, 301)}
    assert not [r for r in caplog.records if "schedule small" in r.getMessage()]
    refusals = [r for r in caplog.records if "schedule big" in r.getMessage()]
    assert len(refusals) == 1 and "takes at most 10000" in refusals[0].getMessage()


def test_a_schedule_past_its_end_with_every_occurrence_sent_is_removed(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A schedule a day past its end, its occurrences all sent, leaves the table: each
    round's work and the table follow the live schedules, not every one ever made. One
    still firing stays, as does one ended within the day, one whose last occurrences
    before its end are yet to send, and one re-created under an ended one's id. The
    broker is a stand-in holding the settings alone (a round uses nothing else of it);
    Kafka and the table are real."""
    with materialising(kafka_bootstrap, tmp_path) as (materialiser, _):
        after_one, after_two = _rounds_over_ended_schedules(materialiser)
    assert after_one == {"ended-lately", "firing", "last-one-due"}
    assert set(after_two) == {"ended", "ended-lately", "firing", "last-one-due"}
    assert after_two["ended"].payload == b"y", "the one made again under its id stays"


def _rounds_over_ended_schedules(materialiser: Materialiser) -> tuple[set[str], dict]:
    """Two rounds over schedules ended long ago or lately, firing, or with a minute's
    occurrence left (one ended long ago made again between them): the ids after the
    first, and the schedules after the second."""
    store = materialiser.stores["ticks"]
    now = int(time.time() * 1000)
    hour = 3600 * 1000
    for schedule_id, end, created in (
        ("ended", now - 25 * hour, now - 26 * hour),  # all sent up to its end
        ("ended-lately", now - hour, now - 26 * hour),  # kept a day
        ("firing", None, now - 26 * hour),
        ("last-one-due", now + 90_000, now - 26 * hour),  # a minute's occurrence left
    ):
        store.add(Schedule(schedule_id, "* * * * *", "UTC", None, b"x", [], end, created))
    store.advance(
        {
            ("ended", now - 26 * hour): now - 25 * hour,
            ("ended-lately", now - 26 * hour): now - hour,
            ("firing", now - 26 * hour): now + 60_000,
        }
    )
    store.advance({("last-one-due", now - 26 * hour): now})
    asyncio.run(materialiser.round("ticks", now))
    after_one = set(store.all())
    store.add(Schedule("ended", "* * * * *", "UTC", None, b"y", [], None, now))
    asyncio.run(materialiser.round("ticks", now))
    return after_one, store.all()


def test_the_nodes_producer_takes_the_next_message_after_one_kafka_refuses(
    kafka_bootstrap: str,
) -> None:
    """The node's producer (HTTP produce, cron) is idempotent: a record Kafka refuses for
    good (the topic's limit lowered since the producer described it) leaves it refusing
    every later send: it is replaced."""
    source = f"produce-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(source, 1, 1, topic_configs={"max.message.bytes": "100000"})])
    producer = Producer(KafkaConfig(bootstrap=kafka_bootstrap))
    small = Outgoing(None, b"hi", [("dejaq-id", b"after")])
    try:
        assert asyncio.run(producer.send(source, [Outgoing(None, b"w", [])])) != []
        lowered = ConfigResource(ConfigResourceType.TOPIC, source, {"max.message.bytes": "10000"})
        admin.alter_configs([lowered])
        with pytest.raises(Problem, match=r"takes at most 10000") as refused:
            asyncio.run(producer.send(source, [Outgoing(None, b"x" * 20_000, [])]))
        assert refused.value.status == 413, "not to be retried as is"
        assert asyncio.run(producer.send(source, [small])) == ["after"]
        records = input_records(kafka_bootstrap, source)
    finally:
        producer.close()
        admin.delete_topics([source])
        admin.close()
    assert [r.value for r in records] == [b"w", b"hi"]


# --- end to end --------------------------------------------------------------------------


def input_records(bootstrap: str, topic: str) -> list:
    """Everything on the input topic so far."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    ends = consumer.end_offsets(parts)
    out = []
    while any(consumer.position(p) < ends[p] for p in parts):
        for batch in consumer.poll(timeout_ms=500).values():
            out += batch
    consumer.close()
    return out


def ingest_once(spark, conf: Path) -> None:
    s = load_settings(conf, env={})
    run_to_end(IngestJob(spark, s, s.topic("ticks"), detect_connectors(spark)).start(once=True))


def buffered(conf: Path, table: Table) -> list[dict]:
    path = table_path(load_settings(conf, env={}).warehouse, table, "ticks")
    return scan(path, table).to_pylist() if DeltaTable.is_deltatable(path) else []


def test_occurrences_are_buffered_once_however_often_materialised_and_never_early(
    crons, spark, kafka_bootstrap: str, kafka_source: str
) -> None:
    """Runs last in the module: it kills the leader."""
    nodes, client, conf = crons
    url = f"{follower(nodes, client).url}/v1/topics/ticks/schedules"
    end = int(time.time() * 1000) + 40_000
    body = {"id": "tick", "cron": "*/2 * * * * *", "payload": "aGk=", "key": "k", "end": end}
    made = client.post(url, json=body)
    assert made.status_code == 201, made.text
    created = made.json()["created_at"]
    expected = {
        occurrence_id("tick", t)
        for t in cron.occurrences(body["cron"], ZoneInfo("UTC"), created, end, 1000)
    }
    assert len(expected) >= 15

    wait_until(
        lambda: client.get(f"{url}/tick").json()["materialised_until"] == end,
        what="materialised up to its end, the horizon covering it",
    )
    first = input_records(kafka_bootstrap, kafka_source)
    assert Counter(dict(r.headers)["dejaq-id"].decode() for r in first) == Counter(expected), (
        "the leader alone materialises, each occurrence once"
    )
    for r in first:
        headers = dict(r.headers)
        assert headers["dejaq-id"].decode() == f"tick@{headers['dejaq-deliver-at'].decode()}"
        assert (r.key, r.value) == (b"k", b"hi")
    ingest_once(spark, conf)
    assert {r["message_id"] for r in buffered(conf, Table.BUFFER)} == expected

    # A leader that sent but died before storing its progress: a new leader sends again.
    cluster.stop_node(leader_of(nodes, client), kill=True)
    path = table_path(load_settings(conf, env={}).warehouse, Table.SCHEDULES, "ticks")
    DeltaTable(path).update(updates={"materialised_until": "created_at"})
    wait_until(
        lambda: len(input_records(kafka_bootstrap, kafka_source)) == 2 * len(expected),
        timeout=60,
        what="a new leader to materialise the schedule again",
    )
    ingest_once(spark, conf)
    rows = buffered(conf, Table.BUFFER)
    assert sorted(r["message_id"] for r in rows) == sorted(expected), "buffered once each"
    assert [r["reason"] for r in buffered(conf, Table.QUARANTINE)] == ["duplicate"] * len(expected)

    leased: dict[str, int] = {}
    alive = [n for n in nodes if n.proc is not None and n.proc.poll() is None]

    def lease() -> bool:
        got = client.post(
            f"{alive[0].url}/v1/topics/ticks/leases",
            json={"consumer_id": "w", "max_messages": 100, "wait_ms": 2000, "lease_ms": 60_000},
        )
        if got.status_code == 200:
            for m in got.json()["messages"]:
                assert m["lease_deadline"] - 60_000 >= m["deliver_at"], "never early"
                assert m["id"] == occurrence_id("tick", m["deliver_at"])
                assert m["id"] not in leased, "delivered once"
                leased[m["id"]] = m["deliver_at"]
        return len(leased) == len(expected)

    wait_until(lease, timeout=90, what="every occurrence to be delivered")
    assert set(leased) == expected
