"""`dejaq cluster up`: a local broker cluster for development, tests and the benchmark."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from dejaq.broker.state.data_dir import holds_data
from dejaq.conf.settings import load_settings
from dejaq.jobs.children import die_with_parent, stop
from dejaq.jobs.ports import PORTS, free_port
from dejaq.jobs.stopping import stop_on_signals


@dataclass
class Node:
    node_id: str
    http: str
    raft: str
    data_dir: Path
    proc: subprocess.Popen | None = None
    scheme: str = "http"
    ca: str | None = None  # verifies an https node's certificate

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.http}"

    def verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=self.ca) if self.ca else True


HTTP_PORT, RAFT_PORT = 8001, 8101  # `cluster up`'s: node i serves on 8000+i, Raft 8100+i


def plan(
    n: int, data_dir: Path, http_port: int | None = None, raft_port: int | None = None
) -> list[Node]:
    """Addresses for `n` nodes: node i on `http_port` + i - 1 and `raft_port` + i - 1, or
    on free ports where a base is None (tests, benchmarks)."""

    def port(base: int | None, i: int) -> int:
        return free_port() if base is None else base + i - 1

    return [
        Node(
            f"n{i}",
            f"127.0.0.1:{port(http_port, i)}",
            f"127.0.0.1:{port(raft_port, i)}",
            data_dir / f"n{i}",
        )
        for i in range(1, n + 1)
    ]


def bindable(address: str) -> bool:
    """Whether a server could listen on `address` ("host:port") now, binding as
    uvicorn and PySyncObj do (SO_REUSEADDR: a port in TIME_WAIT counts as free)."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


def taken(nodes: list[Node]) -> list[str]:
    """The addresses of `nodes` that something already listens on."""
    return [a for n in nodes for a in (n.http, n.raft) if not bindable(a)]


def fresh(nodes: list[Node]) -> bool:
    """Whether no node's data dir holds Raft state: a new cluster."""
    return not any(holds_data(n.data_dir) for n in nodes)


def node_command(
    node: Node, nodes: list[Node], conf_file: str | None, new_cluster: bool | None = None
) -> list[str]:
    """`dejaq broker` for `node`, with the others in `nodes` as its Raft peers, and
    --new-cluster if `new_cluster` (default: if the cluster is `fresh`). Each node
    advertises its own --http: one `broker.advertise` for all would have every node
    register the same address, and the others forward to it."""
    peers = ",".join(n.raft for n in nodes if n is not node)
    cmd = [
        sys.executable,
        "-m",
        "dejaq.jobs.cli",
        "broker",
        "--node-id",
        node.node_id,
        "--http",
        node.http,
        "--advertise",
        node.http,
        "--raft",
        node.raft,
        "--peers",
        peers,
        "--data-dir",
        str(node.data_dir),
    ]
    if conf_file:
        cmd += ["--conf-file", conf_file]
    if fresh(nodes) if new_cluster is None else new_cluster:
        cmd.append("--new-cluster")
    return cmd


def start_node(
    node: Node,
    nodes: list[Node],
    conf_file: str | None,
    env: dict[str, str],
    new_cluster: bool | None = None,
) -> None:
    """Start a node tied to this process: a `cluster up` killed hard takes its nodes with
    it, rather than leave a leader acting on the tables that nobody stops."""
    cmd = node_command(node, nodes, conf_file, new_cluster)
    node.proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )


def stop_node(node: Node, kill: bool = False, timeout: float = 10) -> None:
    """SIGTERM (or SIGKILL), by the PID we started."""
    if node.proc is not None:
        stop(node.proc, timeout, kill)


def ready(nodes: list[Node]) -> bool:
    """Every running node answers /readyz with 200."""
    for n in nodes:
        if n.proc is None or n.proc.poll() is not None:
            continue
        try:
            if httpx.get(f"{n.url}/readyz", timeout=1, verify=n.verify()).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
    return True


def wait_ready(nodes: list[Node], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready(nodes):
        for n in nodes:
            if n.proc is not None and n.proc.poll() is not None:
                raise RuntimeError(f"broker {n.node_id} exited with code {n.proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broker cluster was not ready within {timeout:.0f}s")
        time.sleep(0.1)


def node_env(conf_file: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The nodes' environment: `environ`, with a fresh Raft password for them to share
    where neither it nor the configuration holds one."""
    env = dict(environ)
    if not load_settings(conf_file, env).broker.raft_password:
        env["DEJAQ_BROKER_RAFT_PASSWORD"] = secrets.token_hex(16)
    return env


def up(
    n: int,
    data_dir: Path,
    conf_file: str | None,
    http_port: int | None = None,
    raft_port: int | None = None,
) -> list[Node]:
    """Start `n` nodes sharing one Raft password (the configured one, else a fresh one):
    a new cluster (--new-cluster) where no node's data dir holds state yet."""
    env = node_env(conf_file, os.environ)
    tls = load_settings(conf_file, env).broker.tls
    nodes = plan(n, data_dir, http_port, raft_port)
    for node in nodes:
        node.scheme, node.ca = tls.scheme, tls.ca
    if busy := taken(nodes):
        raise PortsTaken(busy)
    held = [n for n in nodes if holds_data(n.data_dir)]
    if held and len(held) < len(nodes):
        raise MixedDataDirs(held, [n for n in nodes if n not in held])
    for node in nodes:
        start_node(node, nodes, conf_file, env, new_cluster=not held)
    try:
        wait_ready(nodes)
    except BaseException:
        for node in nodes:
            stop_node(node)
        raise
    return nodes


class PortsTaken(Exception):
    def __init__(self, addresses: list[str]) -> None:
        super().__init__(
            f"already in use: {', '.join(addresses)} (another cluster running? "
            "pick others with --http-port and --raft-port)"
        )


class MixedDataDirs(Exception):
    """Some nodes hold Raft state and others none: started together, the empty ones
    would need a leader to bring them up to date, and the others alone are no majority
    (more nodes than last time), or a disk was lost."""

    def __init__(self, held: list[Node], empty: list[Node]) -> None:
        super().__init__(
            f"{', '.join(str(n.data_dir) for n in held)} hold Raft state and "
            f"{', '.join(str(n.data_dir) for n in empty)} none (more --nodes than this data "
            "dir was started with, or a lost disk): give another --data-dir for a new "
            "cluster, or see README, Operations, 'Membership and disks'"
        )


def client_line(nodes: list[Node]) -> str:
    """The worker client's constructor for these nodes, to paste."""
    verify = f", verify={nodes[0].ca!r}" if nodes and nodes[0].ca else ""
    return f"Client([{', '.join(repr(n.url) for n in nodes)}]{verify})"


def run(args: argparse.Namespace) -> int:
    """Foreground: print the HTTP addresses, serve until SIGTERM, SIGHUP or Ctrl-C."""
    if args.nodes not in (1, 3, 5):
        print("error: --nodes must be 1, 3 or 5", file=sys.stderr)
        return 2
    for flag, base in (("--http-port", args.http_port), ("--raft-port", args.raft_port)):
        if base + args.nodes - 1 not in PORTS:
            print(f"error: {flag} {base} puts node {args.nodes} past port 65535", file=sys.stderr)
            return 2
    with stop_on_signals() as stopping:
        try:
            nodes = up(
                args.nodes, Path(args.data_dir), args.conf_file, args.http_port, args.raft_port
            )
        except (PortsTaken, MixedDataDirs) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            return _serve(nodes, stopping)
        finally:
            for node in nodes:
                stop_node(node)


def _serve(nodes: list[Node], stopping: threading.Event) -> int:
    """Print where the nodes are and watch them until a signal or one exits."""
    for node in nodes:
        print(f"{node.node_id}: {node.url}  (raft {node.raft})", flush=True)
    print(f"workers: {client_line(nodes)}", flush=True)
    print("SIGTERM, SIGHUP or Ctrl-C stops the cluster", flush=True)
    while not stopping.wait(0.5):
        exited = [n for n in nodes if n.proc is not None and n.proc.poll() is not None]
        if exited:
            codes = ", ".join(f"{n.node_id} exit {n.proc.returncode}" for n in exited)
            print(f"error: a broker exited ({codes}); stopping the others", file=sys.stderr)
            return 1
    return 0
