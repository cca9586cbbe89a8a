"""Ports for the servers a parent starts: never from the range outgoing connections use."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dejaq.jobs import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ceiling = ports._ceiling()
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST <= p < ceiling for p in picked)
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


def test_a_port_something_listens_on_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "_ceiling", lambda: taken + 1 + ports.ENOUGH)
        assert all(ports.free_port() != taken for _ in range(50))


def test_without_room_below_the_range_the_kernel_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", wide)
    assert ports._ceiling() == 1024
    port = ports.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
