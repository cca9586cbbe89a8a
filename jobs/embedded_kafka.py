"""`dejaq kafka`: a Kafka-protocol broker from the noida-db package, on 127.0.0.1.

For development, the demo and the tests; everything else also runs against a real Kafka.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.resources import files
from pathlib import Path

from jobs.stopping import stop_on_signals

PR_SET_PDEATHSIG = 1
# noida-db 0.2.3's binary warns about a glibc symbol it does not need; users need not see it.
_HARMLESS = "GLIBC_2.39' not found"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def noida_binary() -> Path:
    path = Path(str(files("noida_db").joinpath("noida-db")))
    if not path.is_file():
        raise FileNotFoundError(f"noida-db binary not found at {path}: reinstall with `make test`")
    path.chmod(0o755)
    return path


def wait_for_port(
    port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "Kafka broker"
) -> None:
    """Block until 127.0.0.1:port accepts a connection, the process dies, or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


def _forward_stderr(stream, sink) -> None:
    for line in stream:
        if _HARMLESS not in line:
            sink.write(line)
            sink.flush()


def _die_with_parent() -> None:
    """In the child: SIGTERM it if this process dies, even by SIGKILL (Linux).

    A test or demo killed hard must not leave a broker holding its port.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(port: int, data_dir: Path) -> subprocess.Popen:
    """Start noida-db with only its Kafka service; return once the port answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(noida_binary()),
        "start",
        "--only",
        "kafka",
        "--host",
        "127.0.0.1",
        "--kafka-port",
        str(port),
        "--data-dir",
        str(data_dir),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        preexec_fn=_die_with_parent,
    )
    threading.Thread(target=_forward_stderr, args=(proc.stderr, sys.stderr), daemon=True).start()
    try:
        wait_for_port(port, timeout=30, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen, timeout: float = 10, kill: bool = False) -> int:
    """Stop a process we started, by its PID: SIGTERM (noida-db saves its data, a broker
    node leaves cleanly), then SIGKILL if it does not go; or SIGKILL at once."""
    if proc.poll() is None:
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run(port: int | None, data_dir: Path) -> int:
    """Foreground: print the bootstrap address, serve until SIGTERM or Ctrl-C."""
    port = port or free_port()
    # Before the broker starts: a SIGTERM as soon as the port answers must still stop it.
    with stop_on_signals() as stopping:
        proc = start(port, data_dir)
        print(f"kafka bootstrap: 127.0.0.1:{port}", flush=True)
        print(f"data dir: {data_dir.resolve()}  (SIGTERM or Ctrl-C stops it)", flush=True)
        while not stopping.is_set() and proc.poll() is None:
            stopping.wait(0.5)
        if proc.poll() is not None:
            print(f"error: Kafka broker exited with code {proc.returncode}", file=sys.stderr)
            return 1
        stop(proc)
    print("kafka stopped", flush=True)
    return 0
