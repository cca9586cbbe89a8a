"""`dejaq s3`: an S3-compatible server (S3Proxy over a local folder) run as a child JVM.

For the tests, the benchmarks and `dejaq demo --s3`: the same requests an object store
gets, signed and checked (AWS v4), with the conditional create (`If-None-Match: *`) that
Delta commits on S3 rely on. Buckets are folders under `data_dir/buckets`; the bucket
`dejaq` is made at start. Its Prometheus metrics count the requests it serves by S3
operation: what the store would bill. Its access key and secret are made once per data folder and
written, owner-only, to `data_dir/client.env` with the settings that point DejaQ at it.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from dejaq.conf import jvm
from dejaq.jobs.children import check_free, die_with_parent, serve, stop, wait_for_port
from dejaq.jobs.ports import free_port
from dejaq.jobs.stopping import stop_on_signals

BUCKET = "dejaq"
WAREHOUSE = f"s3://{BUCKET}/warehouse"
REGION = "us-east-1"
HEAP = ["-Xms64m", "-Xmx512m"]
READY_TIMEOUT_S = 60
LOG_FILE = "s3proxy.log"
CLIENT_ENV = "client.env"
CREDENTIALS = "credentials.json"
# Logback logs everything at DEBUG without a configuration: S3Proxy's start and warnings.
LOGBACK = """<configuration>
  <appender name="out" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d{HH:mm:ss.SSS} %-5level %logger{36} %msg%n</pattern></encoder>
  </appender>
  <root level="WARN"><appender-ref ref="out"/></root>
  <logger name="org.gaul.s3proxy.Main" level="INFO"/>
</configuration>
"""


@dataclass(frozen=True)
class Credentials:
    """The server's one access key: made once per data folder, kept owner-only."""

    access_key: str
    secret_key: str

    @classmethod
    def load_or_create(cls, data_dir: Path) -> Credentials:
        path = data_dir / CREDENTIALS
        if path.exists():
            return cls(**json.loads(path.read_text()))
        made = cls(access_key=f"DQ{secrets.token_hex(8).upper()}", secret_key=secrets.token_hex(20))
        path.touch(mode=0o600)
        path.write_text(json.dumps(asdict(made)))
        return made


def endpoint(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def metrics_port(data_dir: Path) -> int:
    """The port of the server's Prometheus metrics (requests by S3 operation), kept with
    its data: a restart serves them where a reader expects them."""
    path = data_dir / "metrics.port"
    if not path.exists():
        path.write_text(str(free_port()))
    return int(path.read_text())


def client_settings(port: int, credentials: Credentials) -> dict[str, str]:
    """What a job needs to use the server: the warehouse, the storage section, and the
    key as the standard AWS variables (which every engine reads)."""
    return {
        "DEJAQ_WAREHOUSE": WAREHOUSE,
        "DEJAQ_STORAGE_ENDPOINT": endpoint(port),
        "DEJAQ_STORAGE_REGION": REGION,
        "DEJAQ_STORAGE_PATH_STYLE": "true",
        "AWS_ACCESS_KEY_ID": credentials.access_key,
        "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
    }


def prepare(port: int, data_dir: Path) -> tuple[Path, Credentials]:
    """The server's properties file (owner-only: it holds the secret), the bucket's
    folder, and `client.env`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    credentials = Credentials.load_or_create(data_dir)
    buckets = data_dir / "buckets"
    (buckets / BUCKET).mkdir(parents=True, exist_ok=True)
    properties = {
        "s3proxy.endpoint": endpoint(port),
        "s3proxy.authorization": "aws-v2-or-v4",
        "s3proxy.identity": credentials.access_key,
        "s3proxy.credential": credentials.secret_key,
        "jclouds.provider": "filesystem",
        "jclouds.filesystem.basedir": str(buckets.resolve()),
        "jclouds.region": REGION,
        "s3proxy.metrics.enabled": "true",
        "s3proxy.metrics.host": "127.0.0.1",
        "s3proxy.metrics.port": str(metrics_port(data_dir)),
    }
    (data_dir / "logback.xml").write_text(LOGBACK)
    path = data_dir / "s3proxy.properties"
    path.touch(mode=0o600)
    path.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
    env = data_dir / CLIENT_ENV
    env.touch(mode=0o600)
    env.write_text(
        "".join(
            f"export {k}={shlex.quote(v)}\n" for k, v in client_settings(port, credentials).items()
        )
    )
    return path, credentials


def requests(data_dir: Path) -> dict[str, int]:
    """Requests served so far, by S3 operation (GetObject, ListObjectsV2, PutObject...)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port(data_dir)}/metrics", timeout=5).text
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("http_server_request_duration_seconds_count{"):
            operation = re.search(r's3_operation="([^"]*)"', line)
            name = operation.group(1) if operation else "other"
            counts[name] = counts.get(name, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


def requests_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The requests served between two `requests` counts, by operation (none left at 0)."""
    return {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}


def answers(port: int) -> bool:
    """Whether the server answers HTTP (an unsigned request gets S3's 403: it is up)."""
    try:
        return httpx.get(endpoint(port), timeout=2).status_code in (200, 403)
    except httpx.HTTPError:
        return False


def start(port: int, data_dir: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """Start the server; return it, once it answers, and its client settings."""
    check_free(port)
    properties, credentials = prepare(port, data_dir)
    classpath = ":".join(str(p) for p in jvm.require(jvm.S3PROXY))
    with (data_dir / LOG_FILE).open("ab") as log:
        proc = subprocess.Popen(
            [
                "java",
                *HEAP,
                f"-Dlogback.configurationFile={(data_dir / 'logback.xml').resolve()}",
                "-cp",
                classpath,
                "org.gaul.s3proxy.Main",
                "--properties",
                str(properties),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
    try:
        wait_for_port(port, timeout=READY_TIMEOUT_S, proc=proc, what="S3Proxy")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"S3Proxy on 127.0.0.1:{port} did not answer: see {data_dir}")
            time.sleep(0.1)
    except BaseException:
        stop(proc)
        raise
    return proc, client_settings(port, credentials)


def run(port: int | None, data_dir: Path) -> int:
    """Foreground: print the endpoint, serve until SIGTERM or Ctrl-C."""
    port = port or free_port()
    with stop_on_signals() as stopping:
        try:
            proc, _ = start(port, data_dir)
        except (OSError, RuntimeError) as e:  # a busy port, jars not fetched
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"s3 endpoint: {endpoint(port)} (bucket {BUCKET})", flush=True)
        print(f"requests by operation: http://127.0.0.1:{metrics_port(data_dir)}/metrics")
        print(
            f"its settings and key are in {(data_dir / CLIENT_ENV).resolve()} (source it)",
            flush=True,
        )
        print(f"data dir: {data_dir.resolve()}  (log: {LOG_FILE}; SIGTERM or Ctrl-C stops it)")
        if serve(proc, stopping, "S3Proxy"):
            return 1
    print("s3 stopped", flush=True)
    return 0
