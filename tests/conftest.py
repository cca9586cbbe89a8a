"""Shared fixtures: one Apache Kafka broker and one SparkSession (with the pinned JVM
connectors) per test run."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pytest

from dejaq.jobs.children import stop, wait_for_port
from dejaq.jobs.embedded_kafka import answers
from dejaq.jobs.ports import free_port

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery


def wait_until(cond: Callable[[], object], timeout: float = 30, what: str = "condition") -> object:
    """Poll `cond` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Named(dict[int, str]):
    """The ids a test wrote, by message handle: the lease state is keyed by handle
    (`broker/state/handles.py`), and a test names what it finds there by the ids it
    knows. Reading a handle it never noted fails the test, naming the handle."""

    def __init__(self, mids: Iterable[str] = ()) -> None:
        super().__init__()
        self.note(mids)

    def note(self, mids: Iterable[str]) -> None:
        """Know the handles of `mids` from now on (those known already keep their str: a
        test that counts memory may note its ids before it counts)."""
        from dejaq.broker.state.handles import mhs

        mids = list(mids)
        self.update((h, m) for h, m in zip(mhs(mids), mids, strict=True) if h not in self)

    def __missing__(self, handle: int) -> str:
        pytest.fail(f"handle {handle:032x} is of no id this test wrote")

    def ids(self, handles: Iterable[int]) -> list[str]:
        """The id of each of `handles`, in their order."""
        return [self[h] for h in handles]

    def names(self, handles: bytes) -> list[str | None]:
        """The id of each handle `handles` packs, None for one this test never noted: a
        `ledger_writer.Names`, as the leader's index names events."""
        from dejaq.broker.state.handles import handles_in

        return [self.get(h) for h in handles_in(handles)]


def buffer_names(warehouse: str, topic: str = "jobs") -> Callable[[bytes], list[str | None]]:
    """`Named.names` of the ids in the topic's buffer and dead letters now: what the
    leader's index names a test's events from (`ledger_writer.Names`)."""
    from dejaq.conf.tables import Table, ensure_table, scan

    ids = [
        mid
        for table in (Table.BUFFER, Table.DEAD_LETTER)
        for mid in scan(ensure_table(warehouse, table, topic), table, ["message_id"])
        .column("message_id")
        .to_pylist()
    ]
    return Named(ids).names


def sourced(env_file: Path) -> dict[str, str]:
    """The variables `env_file` (a `client.env`) exports, as a shell that sources it has
    them."""
    lines = env_file.read_text().splitlines()
    names = [line.removeprefix("export ").split("=", 1)[0] for line in lines]
    script = 'source "$1" && shift && for name; do printf "%s\\0" "${!name}"; done'
    shell = subprocess.run(
        ["bash", "-c", script, "bash", str(env_file), *names], capture_output=True, text=True
    )
    assert shell.returncode == 0 and not shell.stderr, shell.stderr
    return dict(zip(names, shell.stdout.split("\0")[:-1], strict=True))


class Lines:
    """A child's output lines, read by a thread of their own, so that waiting for one
    has a deadline: a child that falls silent fails its test instead of hanging it."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put("")  # the end of the output

    def next(self, timeout: float = 60, what: str = "a line") -> str:
        """The next line, "" at the end of the output; fails the test at the deadline."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")

    def until(self, cond: Callable[[str], bool], timeout: float = 60, what: str = "") -> list[str]:
        """The lines read up to and including the first `cond` holds for (without their
        newlines); fails the test at the deadline or at the end of the output."""
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        while not (lines and cond(lines[-1])):
            line = self.next(max(0.0, deadline - time.monotonic()), what or "a line")
            assert line, f"the output ended before {what or 'the line'}: {lines}"
            lines.append(line.rstrip("\n"))
        return lines

    def rest(self, timeout: float = 60) -> str:
        """The output left, to its end (the child exited or closed it)."""
        deadline = time.monotonic() + timeout
        out = []
        while line := self.next(max(0.0, deadline - time.monotonic()), "the output's end"):
            out.append(line)
        return "".join(out)


def assert_rows(actual: DataFrame, expected: list[tuple], ddl: str) -> None:
    """`actual` holds the rows `expected` (typed by the DDL `ddl`), each as often, in any
    order: chispa's comparison, nullability aside (Spark's sources and the contract's
    tables set it their own ways)."""
    from chispa import assert_df_equality

    want = actual.sparkSession.createDataFrame(expected, ddl)
    assert_df_equality(actual, want, ignore_row_order=True, ignore_nullable=True)


def run_to_end(query: StreamingQuery, timeout: float = 180) -> None:
    """Wait for a query that stops by itself (once, availableNow) to end, without an
    error; stopped either way, so a query that hangs or fails holds no Spark thread
    after its test."""
    try:
        assert query.awaitTermination(timeout), f"the streaming query ran over {timeout} s"
    finally:
        query.stop()
    assert query.exception() is None, query.exception()


def drop_first_answer(
    client: Any,
    suffix: str,
    meanwhile: Callable[[Any], object] | None = None,
    lost: list[Any] | None = None,
) -> list[str]:
    """Make the client's first request to a path ending in `suffix` reach the broker,
    then lose its answer as a dropped connection would (the client's own `Lost`); the
    rest is real. `meanwhile` is called with that request's body before the loss, to
    hold the retry back until the broker is in the state it is to find; `lost`, if
    given, receives the answer the client never saw. Returns the paths dropped, to
    assert it happened."""
    from dejaq.client.connections import Lost

    real = client._http.request
    dropped: list[str] = []

    def request(node: str, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        answer = real(node, method, path, body, **kw)
        if path.endswith(suffix) and not dropped:
            dropped.append(path)
            if lost is not None:
                lost.append(answer)
            if meanwhile is not None:
                meanwhile(body)
            raise Lost("the connection dropped before the answer")
        return answer

    client._http.request = request
    return dropped


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Kafka: $DEJAQ_KAFKA_BOOTSTRAP if set, else `dejaq kafka` on a free port."""
    external = os.environ.get("DEJAQ_KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    port = free_port()
    data_dir = tmp_path_factory.mktemp("kafka")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dejaq.jobs.cli",
            "kafka",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    bootstrap = f"127.0.0.1:{port}"
    try:
        wait_for_port(port, timeout=90, proc=proc)
        wait_until(lambda: answers(bootstrap), timeout=90, what="Kafka to answer")
        yield bootstrap
    finally:
        stop(proc, timeout=20)


@pytest.fixture
def topic_factory(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Create uniquely named topics (with topic `configs`, if given); delete them afterwards."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    created: list[str] = []

    def make(partitions: int = 3, prefix: str = "t", configs: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs or {})])
        created.append(name)
        return name

    yield make
    with contextlib.suppress(KafkaError):  # best effort: names are unique per test
        admin.delete_topics(created)
    admin.close()


@pytest.fixture(scope="module")
def kafka_source(kafka_bootstrap: str) -> str:
    """A one-partition Kafka topic per test module, the input of the brokers it starts."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    name = f"broker-in-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(name, 1, 1)])
    admin.close()
    return name


# How long a Spark JVM whose gateway has closed gets to exit before it is killed.
JVM_EXIT_WAIT_S = 30.0


class SparkJvmExited(UserWarning):
    """The run's Spark JVM was found dead between tests, and started again."""


def spark_jvm() -> subprocess.Popen | None:
    """The driver JVM PySpark launched in this process (its gateway's child), if any."""
    from pyspark import SparkContext

    return getattr(SparkContext._gateway, "proc", None)


def _how_it_ended(proc: subprocess.Popen) -> str:
    """The exit status in words, and the JVM's own crash report where it wrote one."""
    code = proc.returncode
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    if code == -9:
        how += " (SIGKILL: the kernel's OOM killer, or another process)"
    report = Path(f"hs_err_pid{proc.pid}.log")
    if report.exists():
        how += f"; its crash report: {report.resolve()}"
    return how


def _answers(jvm: Any) -> bool:
    """Whether the JVM's gateway still takes calls: a JVM exiting closes it first, and
    runs its shutdown hooks (Spark's stop, its temporary folders) before it is gone."""
    from py4j.protocol import Py4JError

    try:
        jvm.java.lang.System.nanoTime()
    except Py4JError:  # its network errors included
        return False
    return True


def live_spark() -> SparkSession:
    """The run's SparkSession, started again if its JVM has died since the last test,
    or stopped answering (ended first).

    That JVM idles for minutes between the tests that use it while others start and
    stop Kafka, S3 and Spark jobs of their own. Should it die meanwhile, PySpark keeps a
    gateway to a dead process and every later test fails on a refused connection, none
    of them at fault: a new one is started instead, with a warning in the run's summary
    saying how the other ended.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from dejaq.pipelines.session import get_spark

    proc = spark_jvm()
    if proc is not None and (proc.poll() is not None or not _answers(SparkContext._jvm)):
        with contextlib.suppress(subprocess.TimeoutExpired):  # its gateway closed:
            proc.wait(timeout=JVM_EXIT_WAIT_S)  # on its way out, or stuck there
        stop(proc, kill=True)
        warnings.warn(
            f"Spark's JVM (pid {proc.pid}) had ended, {_how_it_ended(proc)}: started again",
            SparkJvmExited,
            stacklevel=2,
        )
        SparkContext._gateway = SparkContext._jvm = SparkContext._active_spark_context = None
        SparkSession._instantiatedSession = SparkSession._activeSession = None
    return get_spark("dejaq-tests", master="local[2]", ui=False)


@pytest.fixture(scope="session")
def _spark_run() -> Iterator[None]:
    """Stops the run's SparkSession at the end, unless its JVM is gone already."""
    yield
    from pyspark.sql import SparkSession

    proc, session = spark_jvm(), SparkSession._instantiatedSession
    if proc is not None and proc.poll() is None and session is not None:
        session.stop()


@pytest.fixture
def spark(_spark_run: None) -> SparkSession:
    """One SparkSession for the run (see `live_spark`)."""
    return live_spark()


@pytest.fixture
def warehouse(tmp_path: Path) -> str:
    return str(tmp_path / "warehouse")


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process, and the nodes and jobs it starts, reach the server as a job would:
    its storage section as the AWS variables, and its key."""
    from dejaq.conf.settings import load_settings
    from dejaq.conf.storage import environment

    variables = {**environment(load_settings(env=s3.env).storage), **s3.env}
    for name, value in variables.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    return s3.env


@dataclass(frozen=True)
class S3Server:
    env: dict[str, str]  # its client.env: the warehouse, the storage section, the key
    data_dir: Path  # its buckets, and its request counts (`embedded_s3.requests`)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-compatible server: `dejaq s3` on a free port."""
    port = free_port()
    data_dir = tmp_path_factory.mktemp("s3")
    command = ["s3", "--port", str(port), "--data-dir", str(data_dir)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dejaq.jobs.cli", *command],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        Lines(proc.stdout).until(lambda line: "s3 endpoint" in line, 90, "dejaq s3 to serve")
        yield S3Server(sourced(data_dir / "client.env"), data_dir)
    finally:
        stop(proc, timeout=20)
