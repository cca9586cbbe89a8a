"""The README's quick start, run as a new user would: its commands in order, its snippets
taken from the README itself, on the addresses it shows (Kafka on 9092, the broker on
8001-8003), in an empty folder. Then its HTTP API examples against the same cluster,
and its secure set-up and S3 warehouse in the same folder, each after the processes
before it stopped, as a reader following it from the top would run them.

Adapted only where a terminal differs from a test: `. .venv/bin/activate` becomes the
venv's bin first on PATH, a trailing `&` a background process stopped (by its PID) at
the end, and Python's output is unbuffered so the worker's lines arrive as printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Lines, wait_until

from dejaq.jobs.embedded_kafka import answers

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The README's text under `## title`, up to the next `## `."""
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of `text`: (language, code)."""
    return re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)


def command(line: str) -> str:
    """A shell line without its trailing comment."""
    return re.sub(r"\s+#.*$", "", line).strip()


class Terminal:
    """The user's shell: the venv activated, in an empty folder, jobs in the background."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        venv_bin = Path(sys.executable).parent
        self.env = {
            **os.environ,
            "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1",
        }
        self.jobs: list[subprocess.Popen] = []  # every process it started: `close` stops them
        self.logged: dict[subprocess.Popen, Path] = {}  # a background job: its log
        self.logs = Path(tempfile.mkdtemp(prefix="logs-", dir=cwd))

    @property
    def background_jobs(self) -> list[subprocess.Popen]:
        """The `&` lines' jobs, which run until `close`."""
        return [job for job in self.jobs if job in self.logged]

    def background(self, line: str) -> subprocess.Popen:
        path = self.logs / f"job{len(self.logged)}.log"
        out = path.open("w")
        job = subprocess.Popen(
            ["bash", "-c", f"exec {line}"],
            cwd=self.cwd,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.jobs.append(job)
        self.logged[job] = path
        return job

    def run(self, script: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", script],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(self, code: str) -> subprocess.Popen:
        """`code` run by the venv's python, its output piped; a job, so `close` stops it
        should the test fail first."""
        job = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.jobs.append(job)
        return job

    def log(self, job: subprocess.Popen) -> str:
        return self.logged[job].read_text()

    def close(self) -> None:
        for job in reversed(self.jobs):  # worker, cluster, ingest, Kafka: as `kill %3 %2 %1`
            if job.poll() is None:
                job.send_signal(signal.SIGTERM)
                try:
                    job.wait(120)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reader's folder, shared by the sections in the order the README has them."""
    return tmp_path_factory.mktemp("reader")


@pytest.fixture
def terminal(folder: Path) -> Iterator[Terminal]:
    t = Terminal(folder)
    try:
        yield t
    finally:
        t.close()


QUICK_START_ORDER = ["1 job 3", "3 job 1", "5 job 4", "7 job 0", "9 job 2"]


def quick_start_worker(terminal: Terminal, work: str) -> list[str]:
    """Run the quick start's worker until it has printed five lines, stop it by SIGTERM
    (it must exit 0); the lines."""
    worker = terminal.python(work)
    printed: list[str] = []
    out = Lines(worker.stdout)
    try:
        while len(printed) < 5:
            line = out.next(180, "the worker's next line")
            assert line, worker.stderr.read()
            printed.append(line.strip())
    finally:
        worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.stderr.read()
    return printed


def test_the_quick_start_works_as_written(terminal: Terminal) -> None:
    quick = blocks(section("Quickstart (five minutes)"))
    assert [lang for lang, _ in quick] == ["sh", "python", "sh", "python"]
    (_, start), (_, produce), (_, status), (_, work) = quick
    lines = [command(line) for line in start.splitlines()]
    assert lines[0] == ". .venv/bin/activate"
    jobs = {}
    for line in lines[1:]:
        assert line.endswith(" &"), line
        jobs[line.split()[1]] = terminal.background(line.removesuffix(" &"))
    kafka, ingest, cluster = jobs["kafka"], jobs["ingest"], jobs["cluster"]
    wait_until(lambda: answers("127.0.0.1:9092"), timeout=120, what="Kafka on 9092")
    wait_until(
        lambda: "stops the cluster" in terminal.log(cluster) or cluster.poll() is not None,
        timeout=120,
        what="the cluster up",
    )
    assert cluster.poll() is None, terminal.log(cluster)
    assert "workers: Client(['http://127.0.0.1:8001'," in terminal.log(cluster)

    producer = terminal.python(produce)
    assert producer.wait(60) == 0, producer.stderr.read()
    [status_line] = [command(line) for line in status.splitlines()]

    def buffered() -> bool:
        assert ingest.poll() is None, terminal.log(ingest)
        out = terminal.run(status_line).stdout
        return re.search(r"^buffer\s+5$", out, flags=re.M) is not None

    wait_until(buffered, timeout=180, what="the five orders in the buffer")

    assert quick_start_worker(terminal, work) == QUICK_START_ORDER
    assert re.search(r"# 1 job 3, 3 job 1, 5 job 4, 7 job 0, 9 job 2", work), "as it says"

    [(_, api)] = [b for b in blocks(section("HTTP API")) if b[0] == "sh"]
    said = terminal.run(f"set -euo pipefail\n{api}")
    assert said.returncode == 0, said.stderr
    assert '{"settled":1}' in said.stdout, said.stdout
    assert said.stdout.rstrip().endswith('{"rows":[],"next":null}')
    for job in (kafka, ingest, cluster):
        assert job.poll() is None, terminal.log(job)


class Shell(Terminal):
    """A shell whose `export` and `source` last: each line runs in bash with the
    environment the lines before left, which it then reads back."""

    def line(self, line: str, timeout: float = 120) -> subprocess.CompletedProcess:
        dump = self.cwd / ".env-after"
        done = self.run(f"set -e\n{line}\nenv -0 > {dump}", timeout)
        assert done.returncode == 0, (line, done.stderr)
        self.env = dict(item.split("=", 1) for item in dump.read_text().split("\0") if "=" in item)
        return done


def test_the_secure_set_up_works_as_written(folder: Path) -> None:
    shell = Shell(folder)
    try:
        secure = blocks(section("Secure set-up"))
        assert [lang for lang, _ in secure] == ["sh", "sh", "sh", "python"]
        (_, kafka), (_, setup), (_, calls), (_, work) = secure
        lines = [command(line) for line in kafka.splitlines()]
        assert lines[0] == ". .venv/bin/activate" and lines[1].endswith(" &")
        kafka_job = shell.background(lines[1].removesuffix(" &"))
        wait_until(
            lambda: "kafka bootstrap: 127.0.0.1:9093" in shell.log(kafka_job),
            timeout=120,
            what="the secured Kafka",
        )
        for line in (command(line) for line in setup.splitlines()):
            if line.endswith(" &"):
                shell.background(line.removesuffix(" &"))
            else:
                shell.line(line)
        assert shell.env["DEJAQ_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
        assert (folder / "worker-1.key").read_text().startswith("dq_")
        assert (folder / "worker-1.key").stat().st_mode & 0o077 == 0, "the key, for its owner"
        cluster = shell.background_jobs[-1]
        wait_until(
            lambda: "stops the cluster" in shell.log(cluster) or cluster.poll() is not None,
            timeout=120,
            what="the secured cluster up",
        )
        assert "Client(['https://127.0.0.1:8441'," in shell.log(cluster), shell.log(cluster)
        said = shell.line(calls.replace("\\\n", ""))
        assert '{"ids":["orders-in-0-0"]}' in said.stdout, said.stdout
        assert "send 'Authorization: Bearer <key>'; this call needs role 'read'" in said.stdout
        assert "nodes" in said.stdout and "ingest lag" in said.stdout, said.stdout
        worker = shell.python(work)
        try:
            hello = Lines(worker.stdout).next(180, "the worker's hello")
            assert hello.strip() == "hello", hello or worker.stderr.read()
        finally:
            worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker.stderr.read()
        password = shell.env["DEJAQ_KAFKA_SASL_PASSWORD"]
        for log in shell.logs.iterdir():
            assert password not in log.read_text()
            assert shell.env["DEJAQ_TOKEN"].split("_", 2)[2] not in log.read_text()
        for job in shell.background_jobs:
            assert job.poll() is None, shell.log(job)
    finally:
        shell.close()


def test_the_s3_warehouse_works_as_written(folder: Path) -> None:
    """Deploying's S3 lines in a shell, then the quick start's producer and worker: the
    tables land in the S3 server's bucket and nothing on local disk."""
    shell = Shell(folder)
    local = {p for p in folder.glob("warehouse*/**/*") if p.is_file()}
    try:
        deploying = blocks(section("Deploying"))
        at = next(i for i, (_, code) in enumerate(deploying) if "dejaq s3 --port" in code)
        (_, server), (_, steps) = deploying[at], deploying[at + 1]
        lines = [command(line) for line in server.splitlines()]
        assert lines[0] == ". .venv/bin/activate" and lines[1].endswith(" &")
        s3_job = shell.background(lines[1].removesuffix(" &"))
        wait_until(
            lambda: "s3 endpoint: http://127.0.0.1:9000" in shell.log(s3_job),
            timeout=120,
            what="dejaq s3",
        )
        for line in (command(line) for line in steps.splitlines()):
            if not line.endswith(" &"):
                said = shell.line(line)
                continue
            job = shell.background(line.removesuffix(" &"))
            if line.startswith("dejaq kafka"):
                wait_until(lambda: answers("127.0.0.1:9092"), timeout=120, what="Kafka")
            if line.startswith("dejaq cluster"):
                wait_until(
                    lambda job=job: "stops the cluster" in shell.log(job) or job.poll() is not None,
                    timeout=120,
                    what="the cluster up",
                )
        assert "warehouse   s3://dejaq/warehouse at http://127.0.0.1:9000" in said.stdout
        assert shell.env["AWS_SECRET_ACCESS_KEY"] not in said.stdout + said.stderr

        quick = blocks(section("Quickstart (five minutes)"))
        (_, produce), (_, work) = quick[1], quick[3]
        producer = shell.python(produce)
        assert producer.wait(60) == 0, producer.stderr.read()
        wait_until(
            lambda: re.search(
                r"^buffer\s+5$", shell.run("dejaq status --topic orders").stdout, flags=re.M
            ),
            timeout=180,
            what="the five orders in the bucket's buffer",
        )
        assert quick_start_worker(shell, work) == QUICK_START_ORDER
        bucket = folder / ".dejaq" / "s3" / "buckets" / "dejaq" / "warehouse"
        assert list((bucket / "buffer" / "orders" / "_delta_log").glob("*.json"))
        now = {p for p in folder.glob("warehouse*/**/*") if p.is_file()}
        assert now == local, "no table on local disk"
        for job in shell.background_jobs:
            assert job.poll() is None, shell.log(job)
    finally:
        shell.close()
