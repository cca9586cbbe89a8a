"""TCP ports: the free ones on 127.0.0.1 for the servers a parent starts (Kafka, broker
nodes), and the port numbers a command takes.

A port is picked now and bound later by a child process. A port the kernel hands out
(`bind(0)`) comes from its ephemeral range, the same range it draws the local port of
every outgoing connection from: in between, a Raft or Kafka client connection can take
it, and the child fails to listen. So ports are drawn at random from below that range,
where the kernel never assigns one, checked free by binding, and never handed out twice
by one process.
"""

from __future__ import annotations

import argparse
import random
import socket
from pathlib import Path

from dejaq.conf.settings import PORTS

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000
ENOUGH = 1000
ATTEMPTS = 100

_handed_out: set[int] = set()


def _ceiling() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unknown)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, outside the range outgoing connections draw from."""
    ceiling = _ceiling()
    if ceiling - LOWEST >= ENOUGH:
        for _ in range(ATTEMPTS):
            port = random.randrange(LOWEST, ceiling)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def port(value: str) -> int:
    """argparse's type for a `--port` option: a port in `PORTS`, else a usage error."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {value!r}") from None
    if number not in PORTS:
        raise argparse.ArgumentTypeError(f"{value} is not a port in 1..65535")
    return number
