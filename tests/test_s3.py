"""An `s3://` warehouse on a real S3-compatible server (`dejaq s3`): the store refuses a
second create of one key, every writer of a table keeps its commits when they race, and
the jobs reach it through the one `storage:` section."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import botocore.session
import pyarrow as pa
import pytest
from botocore.config import Config
from conftest import Named, S3Server, sourced, wait_until
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from test_broker import buffer_rows
from test_retention import ingest_append

from dejaq.broker.state.handles import mh
from dejaq.broker.state.leases import Settlement
from dejaq.broker.storage.ledger_writer import write_ledger
from dejaq.conf.settings import ConfigError, StorageConfig, load_settings
from dejaq.conf.storage import describe, environment, filesystem, region, spark_conf
from dejaq.conf.table_watch import IDLE_PROBE_MAX_S, TableWatch
from dejaq.conf.tables import (
    LEDGER_SCHEMA,
    Table,
    app_transactions,
    ensure_table,
    scan,
    table_path,
)
from dejaq.jobs import embedded_s3
from dejaq.jobs.doctor import store_answers
from dejaq.jobs.ports import free_port
from dejaq.pipelines.compaction import maintain
from dejaq.pipelines.log_compaction import Rewritten, seal
from dejaq.pipelines.retention import OPERATION, LogGap, commits, retain

HOUR = 3600 * 1000
RETENTION_TRIES = 50  # runs of one round before a race counts as starved


@pytest.fixture
def warehouse_s3(s3_env: dict[str, str]) -> str:
    return f"s3://dejaq/test-{uuid.uuid4().hex[:10]}"


def s3_client(env: dict[str, str]):
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=env["DEJAQ_STORAGE_ENDPOINT"],
        region_name=env["DEJAQ_STORAGE_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}),
    )


def test_the_server_refuses_a_second_create_of_one_key(s3: S3Server) -> None:
    """Delta's put-if-absent on S3: `If-None-Match: *` creates once, then 412."""
    client = s3_client(s3.env)
    key = f"probe/{uuid.uuid4().hex}.json"
    first = client.put_object(Bucket="dejaq", Key=key, Body=b"first", IfNoneMatch="*")
    assert first["ResponseMetadata"]["HTTPStatusCode"] == 200
    with pytest.raises(client.exceptions.ClientError) as refused:
        client.put_object(Bucket="dejaq", Key=key, Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket="dejaq", Key=key)["Body"].read() == b"first"


def test_wrongly_signed_requests_are_refused(s3: S3Server) -> None:
    wrong = s3_client({**s3.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    with pytest.raises(wrong.exceptions.ClientError) as refused:
        wrong.list_objects_v2(Bucket="dejaq")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_the_storage_section_reaches_every_engine_and_no_secret_does(s3: S3Server) -> None:
    env = s3.env
    settings = load_settings(env=env)
    assert settings.on_s3 and settings.storage.path_style
    variables = environment(settings.storage)
    assert variables["AWS_ENDPOINT_URL"] == env["DEJAQ_STORAGE_ENDPOINT"]
    assert variables["AWS_ALLOW_HTTP"] == "true"
    assert variables["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] == "false"
    conf = spark_conf(settings)
    assert conf["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert conf["spark.hadoop.fs.s3a.endpoint"] == env["DEJAQ_STORAGE_ENDPOINT"]
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert "hadoop-aws-3.5.0.jar" in conf["spark.jars"]
    secret = env["AWS_SECRET_ACCESS_KEY"]
    assert not any(secret in v for v in [*variables.values(), *conf.values()])
    assert env["DEJAQ_STORAGE_ENDPOINT"] in describe(settings)
    assert spark_conf(load_settings(env={})) == {}, "a local warehouse needs nothing"


def test_client_env_sources_whole_from_a_data_dir_whose_path_has_a_space(tmp_path) -> None:
    """What a shell reads from `client.env` is the settings the server was started with
    (written before it starts; none needs it running)."""
    data_dir, port = tmp_path / "my s3", free_port()
    _, credentials = embedded_s3.prepare(port, data_dir)
    settings = embedded_s3.client_settings(port, credentials)
    assert sourced(data_dir / embedded_s3.CLIENT_ENV) == settings


def test_the_region_is_the_sections_else_the_aws_variables() -> None:
    """A region the environment names is kept unless the section names one."""
    given = {"AWS_REGION": "ap-south-1"}
    assert region(StorageConfig(region="eu-west-1"), given) == "eu-west-1"
    assert region(StorageConfig(), given) == "ap-south-1"
    assert region(StorageConfig(), {"AWS_DEFAULT_REGION": "sa-east-1"}) == "sa-east-1"
    assert region(StorageConfig(), {}) == "us-east-1"
    assert environment(StorageConfig(), given)["AWS_REGION"] == "ap-south-1"


@pytest.mark.parametrize("scheme", ["s3a", "s3n"])
def test_spark_names_for_s3_are_refused_naming_s3(scheme: str) -> None:
    with pytest.raises(ConfigError, match="s3://bucket/wh"):
        load_settings(env={"DEJAQ_WAREHOUSE": f"{scheme}://bucket/wh"})


def test_a_malformed_endpoint_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"storage\.endpoint"):
        load_settings(env={"DEJAQ_STORAGE_ENDPOINT": "127.0.0.1:9000"})


# --- writers racing on one table --------------------------------------------------------


def acks(ids: list[str], at_ms: int) -> pa.Table:
    at = dt.datetime.fromtimestamp(at_ms / 1000, dt.UTC)
    return pa.Table.from_pylist(
        [
            {"message_id": m, "bucket": 0, "event": "acked", "sort_key": 0, "deliveries": 1}
            | {"at": at}
            for m in ids
        ],
        schema=LEDGER_SCHEMA,
    )


def race(*writers: Callable[[], None]) -> None:
    """Run the writers at once, from one start line; re-raise the first error."""
    start = threading.Barrier(len(writers))
    errors: list[BaseException] = []

    def run(writer: Callable[[], None]) -> None:
        start.wait()
        try:
            writer()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a writer did not finish"
    if errors:
        raise errors[0]


def interleaved(path: str) -> bool:
    """Whether a retention commit landed between two of the ingest's: the writers raced."""
    kinds = [
        "ingest" if "dejaq.appId" in c else "retention" if OPERATION in c else "other"
        for c in sorted(DeltaTable(path).history(), key=lambda c: c["version"])
    ]
    appends = [i for i, k in enumerate(kinds) if k == "ingest"]
    return any(k == "retention" for k in kinds[appends[0] : appends[-1]])


def buffer_ids(path: str) -> list[str]:
    return scan(path, Table.BUFFER, ["message_id"]).column(0).to_pylist()


def retention_rounds(
    buffer: str, ledger: str, start_ms: int, rounds: int, first: int, lost: list[str]
) -> None:
    """Each round acks 10 more of the initial messages, then removes the settled ones.

    Round r's acks are stamped after the previous round's cutoff, so each run reads them
    from the ledger's tail; a run that loses its commit to another writer is noted in
    `lost` and tried again (as the deliverer's next round would), a bounded number of
    times."""
    for r in range(rounds):
        cutoff = start_ms + (r + 1) * 10_000
        ids = [f"m{i}" for i in range(first + 10 * r, first + 10 * (r + 1))]
        write_deltalake(ledger, acks(ids, cutoff - 5_000), mode="append")
        for _ in range(RETENTION_TRIES):
            try:
                retain(buffer, ledger, HOUR, cutoff + HOUR)
                break
            except CommitFailedError as e:
                lost.append(str(e))
        else:
            raise AssertionError(f"round {r}: {RETENTION_TRIES} runs lost their commits")


def test_ingest_appends_racing_retention_keep_every_commit(
    warehouse_s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ingest's appends and retention's rewrites of one buffer, at once, on S3: every
    appended row stays, every settled one goes, no row twice, and no append fails a
    rewrite, however slow the store makes it."""
    monkeypatch.setattr("dejaq.pipelines.retention.ATTEMPTS", 1)  # a lost commit: `lost`
    lost: list[str] = []
    buffer = ensure_table(warehouse_s3, Table.BUFFER, "jobs")
    ledger = ensure_table(warehouse_s3, Table.LEDGER, "jobs")
    write_deltalake(buffer, buffer_rows(list(range(100))), mode="append", partition_by=["bucket"])
    start = int(time.time() * 1000) - 3 * HOUR
    retained = threading.Event()
    batches = 0

    def ingest() -> None:
        """A batch per trigger interval (0.5 s here, 1 s by default) while retention runs."""
        nonlocal batches
        while batches < 3 or not retained.wait(0.5):
            rows = buffer_rows([1] * 10, prefix=f"b{batches}-")
            ingest_append(buffer, rows, "dejaq-ingest-jobs", batches)
            batches += 1

    def retention() -> None:
        retention_rounds(buffer, ledger, start, rounds=8, first=0, lost=lost)
        retained.set()

    race(ingest, retention)
    ids = buffer_ids(buffer)
    assert len(ids) == len(set(ids)), "no row twice"
    appended = {f"b{b}-{i}" for b in range(batches) for i in range(10)}
    assert set(ids) == appended | {f"m{i}" for i in range(80, 100)}
    assert DeltaTable(buffer).transaction_version("dejaq-ingest-jobs") == batches - 1
    assert interleaved(buffer), "the writers' commits interleave"
    assert lost == [], "an append failed a retention run"


def test_compaction_racing_retention_keeps_every_row(warehouse_s3: str) -> None:
    """The ingest's compaction and retention both rewrite the buffer's files: whichever
    loses a commit fails and tries again, and no row is lost or doubled."""
    buffer = ensure_table(warehouse_s3, Table.BUFFER, "jobs")
    ledger = ensure_table(warehouse_s3, Table.LEDGER, "jobs")
    for part in range(10):  # small files, for compaction to rewrite
        rows = buffer_rows(list(range(10)), prefix=f"m{part}")
        rows = rows.set_column(0, "message_id", pa.array([f"m{part * 10 + i}" for i in range(10)]))
        write_deltalake(buffer, rows, mode="append", partition_by=["bucket"])
    start = int(time.time() * 1000) - 3 * HOUR
    compactions: list[object] = []

    def compact() -> None:
        for _ in range(6):
            compactions.append(maintain(buffer, target_size=1024))

    race(compact, lambda: retention_rounds(buffer, ledger, start, rounds=6, first=0, lost=[]))
    ids = buffer_ids(buffer)
    assert len(ids) == len(set(ids)), "no row twice"
    assert set(ids) == {f"m{i}" for i in range(60, 100)}
    assert any(c is not None for c in compactions), "compaction ran at least once"


def test_a_seal_on_s3_keeps_every_row_beside_the_leaders_appends(warehouse_s3: str) -> None:
    """A seal's file goes up through pyarrow and its commit through delta-rs's S3 log;
    the leader's appends meanwhile are other files, so both commit, and no row is lost
    or doubled."""
    ledger = ensure_table(warehouse_s3, Table.LEDGER, "jobs")
    now = int(time.time() * 1000)
    old = [f"o{k}-{i}" for k in range(10) for i in range(20)]
    for k in range(10):
        write_deltalake(
            ledger, acks(old[k * 20 : (k + 1) * 20], now - (72 - k) * HOUR), mode="append"
        )
    new = [f"n{k}" for k in range(10)]
    sealed: list[Rewritten | None] = []

    def append() -> None:
        for m in new:
            write_deltalake(ledger, acks([m], now), mode="append")

    race(lambda: sealed.append(seal(ledger, "at", now - 25 * HOUR)), append)

    assert sealed[0] is not None and sealed[0].files_removed == 10
    ids = scan(ledger, Table.LEDGER, ["message_id"]).column(0).to_pylist()
    assert sorted(ids) == sorted(old + new)
    adds = pa.table(DeltaTable(ledger).get_add_actions(flatten=True)).to_pylist()
    assert [a["num_records"] for a in adds if a["path"].endswith(".sealed.snappy.parquet")] == [200]
    assert len(adds) == 11


def test_two_leaders_writing_the_ledger_keep_each_event_once(warehouse_s3: str) -> None:
    """A deposed leader's late checkpoints race its successor's on S3: each settled
    event lands exactly once, whichever commit wins each version."""
    now = int(time.time() * 1000)
    events = [Settlement(s, mh(f"m{s}"), 0, "acked", s, 1, now) for s in range(1, 301)]
    names = Named(f"m{s}" for s in range(1, 301))

    def leader(ends: list[int]) -> Callable[[], None]:
        def checkpoints() -> None:
            for end in ends:
                while True:
                    try:
                        write_ledger(warehouse_s3, "jobs", events[:end], names.names)
                        break
                    except CommitFailedError:
                        continue  # the next checkpoint round, from a fresh snapshot

        return checkpoints

    race(leader([50, 100, 150, 200]), leader([100, 200, 250, 300]))
    ledger = DeltaTable(table_path(warehouse_s3, Table.LEDGER, "jobs"))
    ids = scan(ledger, Table.LEDGER, ["message_id"]).column(0).to_pylist()
    assert sorted(ids) == sorted(names.values())


def test_a_ledgers_app_transactions_are_read_from_its_log_on_s3(warehouse_s3: str) -> None:
    """The brokers' tags of every Raft history, as delta-rs has them, read from the
    ledger's Delta checkpoint and the commits after it on an object store."""
    now = int(time.time() * 1000)
    events = [Settlement(s, mh(f"m{s}"), 0, "acked", s, 1, now) for s in range(1, 13)]
    names = Named(f"m{s}" for s in range(1, 13)).names
    for end in range(1, 7):
        write_ledger(warehouse_s3, "jobs", events[:end], names)
    for end in range(7, 13):
        write_ledger(warehouse_s3, "jobs", events[:end], names, ("later", 6))
    ledger = ensure_table(warehouse_s3, Table.LEDGER, "jobs")
    found = app_transactions(ledger)
    table = DeltaTable(ledger)
    assert found == {app: table.transaction_version(app) for app in found}
    assert found == {"dejaq-broker": 6, "dejaq-broker:later": 12}, found
    fs, root = filesystem(ledger)
    with fs.open_input_stream(f"{root}/_delta_log/_last_checkpoint") as f:
        assert 0 < json.loads(f.read())["version"] < table.version(), "a checkpoint, then commits"


# --- the jobs on S3 ---------------------------------------------------------------------


def produce(bootstrap: str, topic: str, n: int) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for i in range(n):
        headers = [("dejaq-priority", str(i % 7).encode())]
        producer.send(topic, f"job-{i}".encode(), headers=headers)
    producer.send(topic, b"bad", headers=[("dejaq-priority", b"not-a-number")])
    producer.flush()
    producer.close()


def job_env(s3: dict[str, str], warehouse: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEJAQ_", "AWS_"))}
    return {**env, **s3, "DEJAQ_WAREHOUSE": warehouse, **more}


@pytest.mark.parametrize("connectors", ["jvm", "python"])
def test_ingest_lands_records_on_s3(
    connectors: str,
    s3_env: dict[str, str],
    warehouse_s3: str,
    kafka_bootstrap: str,
    topic_factory,
    tmp_path: Path,
) -> None:
    source = topic_factory(partitions=2)
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(f"topics:\n  - name: jobs\n    kind: priority\n    source: [{source}]\n")
    produce(kafka_bootstrap, source, 40)
    env = job_env(
        s3_env,
        warehouse_s3,
        DEJAQ_KAFKA_BOOTSTRAP=kafka_bootstrap,
        DEJAQ_SPARK_CONNECTORS=connectors,
    )

    def dejaq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "dejaq.jobs.cli", *args, "--conf-file", str(conf)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)

    run = dejaq("ingest", "--topic", "jobs", "--once", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "buffered 40, quarantined 1" in run.stdout
    buffer = DeltaTable(table_path(warehouse_s3, Table.BUFFER, "jobs"))
    assert scan(buffer, Table.BUFFER).num_rows == 40
    quarantine = DeltaTable(table_path(warehouse_s3, Table.QUARANTINE, "jobs"))
    assert scan(quarantine, Table.QUARANTINE).num_rows == 1
    status = dejaq("status", "--topic", "jobs")
    assert status.returncode == 0, status.stderr
    assert "buffer      40" in status.stdout and "ingest lag  0" in status.stdout
    assert s3_env["DEJAQ_STORAGE_ENDPOINT"] in status.stdout
    listed = dejaq("quarantine", "--topic", "jobs")
    assert listed.returncode == 0, listed.stderr
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["reason"] == "invalid_priority", row
    secret = s3_env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in run.stdout + run.stderr + status.stdout + status.stderr


def test_doctor_checks_the_store_with_the_key_and_never_says_the_secret(
    s3_env: dict[str, str], warehouse_s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`doctor`'s warehouse line: the store listed with the key the engines use."""
    settings = load_settings(env={**s3_env, "DEJAQ_WAREHOUSE": warehouse_s3})
    ok, line = store_answers(settings)
    assert ok, line
    assert s3_env["DEJAQ_STORAGE_ENDPOINT"] in line and warehouse_s3 in line
    assert s3_env["AWS_ACCESS_KEY_ID"] in line, "which key, by its id"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    refused, why = store_answers(settings)
    assert not refused, why
    for said in (line, why):
        assert s3_env["AWS_SECRET_ACCESS_KEY"] not in said and "not-the-secret" not in said


@pytest.mark.slow
def test_kill_9_of_the_ingest_on_s3_loses_and_duplicates_nothing(
    s3_env: dict[str, str], warehouse_s3: str, kafka_bootstrap: str, topic_factory, tmp_path
) -> None:
    """Killed between and within its S3 commits, then run again: every record once."""
    source = topic_factory(partitions=3)
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(f"topics:\n  - name: jobs\n    kind: priority\n    source: [{source}]\n")
    total = 3000
    produce(kafka_bootstrap, source, total - 1)  # and one bad record
    env = job_env(s3_env, warehouse_s3, DEJAQ_KAFKA_BOOTSTRAP=kafka_bootstrap)
    command = [sys.executable, "-m", "dejaq.jobs.cli", "ingest", "--topic", "jobs"]
    command += ["--conf-file", str(conf), "--max-offsets-per-trigger", "150"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    buffer = table_path(warehouse_s3, Table.BUFFER, "jobs")

    def landed() -> int:
        return len(buffer_ids(buffer)) if DeltaTable.is_deltatable(buffer) else 0

    try:
        wait_until(lambda: landed() >= 300, timeout=180, what="some batches on S3")
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert landed() < total - 1, "killed mid-stream"
    again = subprocess.run([*command, "--once"], env=env, capture_output=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    ids = buffer_ids(buffer)
    assert len(ids) == len(set(ids)) == total - 1
    quarantine = DeltaTable(table_path(warehouse_s3, Table.QUARANTINE, "jobs"))
    assert scan(quarantine, Table.QUARANTINE).num_rows == 1


# --- what the store is asked ---------------------------------------------------------------


def test_an_ingest_append_stores_each_file_in_one_put(s3: S3Server, warehouse_s3: str) -> None:
    """Its Parquet files, one per bucket, each one PUT (no multipart upload, no HEAD of
    what was written), then the commit: one more PUT, a conditional create."""
    buffer = ensure_table(warehouse_s3, Table.BUFFER, "jobs")
    before = embedded_s3.requests(s3.data_dir)
    ingest_append(buffer, buffer_rows(list(range(8))), "dejaq-ingest-jobs", 0)  # 4 buckets
    after = embedded_s3.requests(s3.data_dir)
    made = embedded_s3.requests_between(before, after)
    assert made.get("PutObject") == 4 + 1, made
    assert "CreateMultipartUpload" not in made and "UploadPart" not in made, made
    assert len(buffer_ids(buffer)) == 8


# --- what following a table costs ---------------------------------------------------------


def test_a_follower_behind_the_log_on_s3_sees_the_move_and_the_gap(
    s3_env: dict[str, str], warehouse_s3: str
) -> None:
    """On an object store too: with the next log entry a follower needs deleted (as log
    retention deletes expired ones), the table's Delta checkpoint says it moved, and
    walking the versions says the log no longer holds them."""
    buffer = ensure_table(warehouse_s3, Table.BUFFER, "jobs")
    for i in range(11):
        write_deltalake(buffer, buffer_rows([i]), mode="append", partition_by=["bucket"])
    prefix = warehouse_s3.removeprefix("s3://dejaq/")
    s3_client(s3_env).delete_object(
        Bucket="dejaq", Key=f"{prefix}/buffer/jobs/_delta_log/{2:020d}.json"
    )
    watch = TableWatch(buffer)
    assert watch.moved(1), "by the checkpoint: the next entry is gone"
    with pytest.raises(LogGap, match="no longer holds version 2"):
        commits(buffer, range(2, 4))
    assert not commits(buffer, range(3, 4))[0].rewrite


def test_following_an_idle_table_costs_a_request_a_second_at_most(
    s3: S3Server, warehouse_s3: str
) -> None:
    """A node polls its buffer every 0.2 s: on S3 each idle poll is one HEAD of the next
    log entry, spaced out to a second apart (and once a minute one read of the table's
    Delta checkpoint pointer, here absent: one HEAD), and a new version is still seen."""
    buffer = ensure_table(warehouse_s3, Table.BUFFER, "jobs")
    version = DeltaTable(buffer).version()
    watch = TableWatch(buffer)
    assert watch.remote
    data_dir = s3.data_dir
    before = embedded_s3.requests(data_dir)
    polls = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert not watch.moved(version)
        polls += 1
        time.sleep(0.05)  # the follower's poll interval, shortened
    after = embedded_s3.requests(data_dir)
    made = embedded_s3.requests_between(before, after)
    assert polls >= 60
    assert made == {"HeadObject": watch.probes}, made
    assert watch.probes <= 4 + 3 + 1, "backed off to one probe a second"
    write_deltalake(buffer, buffer_rows([1]), mode="append", partition_by=["bucket"])
    wait_until(lambda: watch.moved(version), IDLE_PROBE_MAX_S + 2, "the new version")
