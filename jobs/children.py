"""The servers a command starts as child processes (Kafka, S3Proxy, broker nodes): wait
until they listen, tie them to their parent, stop them by PID, never by name."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


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


def die_with_parent() -> None:
    """In the child: SIGTERM it if this process dies, even by SIGKILL (Linux).

    A test or demo killed hard must not leave a broker holding its port.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def check_free(port: int) -> None:
    """Fail at once on a busy port: another broker there would answer in this one's place."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise OSError(f"127.0.0.1:{port} is already in use: {e.strerror}") from None


def stop(proc: subprocess.Popen, timeout: float = 30, kill: bool = False) -> int:
    """Stop a process we started, by its PID: SIGTERM (Kafka shuts down cleanly, a broker
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


def serve(proc: subprocess.Popen, stopping: threading.Event, what: str) -> int:
    """Foreground: wait until `stopping` is set (a signal) or the server exits; stop it.
    0 when stopped, 1 (said on stderr) when it exited by itself."""
    while not stopping.is_set() and proc.poll() is None:
        stopping.wait(0.5)
    if proc.poll() is not None:
        print(f"error: {what} exited with code {proc.returncode}", file=sys.stderr)
        return 1
    stop(proc)
    return 0
