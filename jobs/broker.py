"""`dejaq broker`: one node of the Raft-replicated HTTP lease broker. Never imports Spark."""

from __future__ import annotations

import argparse
import errno
import importlib.abc
import ipaddress
import logging
import resource
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from dejaq.jobs.ports import PORTS

if TYPE_CHECKING:  # uvicorn is imported when the node runs, not with the CLI
    from dejaq.broker.api.http_server import Server

EXIT_USAGE = 2


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--node-id", required=True, help="this node's name (also its data folder)")
    sp.add_argument(
        "--http", required=True, metavar="HOST:PORT", help="HTTP API address to listen on"
    )
    sp.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="where the other nodes and clients reach this node's HTTP API, as its TLS "
        "certificate names it (default: broker.advertise, else --http; required when "
        "--http listens on every interface)",
    )
    sp.add_argument(
        "--raft",
        required=True,
        metavar="HOST:PORT",
        help="Raft address: listened on, and the one the peers know this node by",
    )
    sp.add_argument(
        "--peers",
        default="",
        metavar="HOST:PORT,...",
        help="the other nodes' Raft addresses (this node's own is ignored); none: one node",
    )
    sp.add_argument(
        "--new-cluster",
        action="store_true",
        help="the first start of a new cluster, every node's data dir empty: this node "
        "votes from the start. Without it an empty node beside --peers waits for a leader "
        "to bring it up to date (a replaced disk, an added node) before it votes",
    )
    sp.add_argument(
        "--reconfigure",
        action="store_true",
        help="this node's --raft or --peers differ from those its data dir was made with: "
        "only with every node stopped, and all started so (README: Membership and disks)",
    )
    sp.add_argument(
        "--data-dir",
        help="Raft journal, snapshots, pending messages' heads (default: broker.data_dir/ID)",
    )
    sp.add_argument(
        "--conf-file", help="YAML configuration (default: $DEJAQ_CONF_FILE or the packaged one)"
    )


def _address(value: str, flag: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} expects HOST:PORT, got {value!r}")
    if int(port) not in PORTS:
        raise ValueError(f"{flag} {value}: the port must be in 1..65535")
    return host, int(port)


BACKLOG = 2048  # connections queued on the HTTP sockets: uvicorn's default


# How long a stopping node lets the requests in flight finish (a long poll waits up to
# 30 s) before it ends them: a stop takes this, then `Broker.stop`'s own bounds at most.
STOP_REQUESTS_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def _stopping_on_signals(
    server: Server, halt: Callable[[], None]
) -> Iterator[list[signal.Signals]]:
    """SIGTERM (systemd, Kubernetes, `kill`) or SIGINT while inside stops the server
    taking requests and returns from its `run`, so that the node stops (`Broker.stop`)
    and exits 0; the signals taken are listed. `halt` tells the node at once, so its
    waiting long polls answer rather than hold the stop. A second signal ends the
    process at once: their default actions are back from the first."""
    taken: list[signal.Signals] = []

    def stop(sig: int, _: object) -> None:
        taken.append(signal.Signals(sig))
        server.should_exit = True
        halt()
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield taken
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# A node's own files (Delta logs it reads, the Raft journal and term file, head store
# segments of 64 MB each, Kafka and Raft sockets) take a quarter of the open-file limit,
# at least FILES_RESERVED; HTTP connections the rest, so a crowd of long polls cannot
# take the descriptors the node needs to stay up.
FILES_RESERVED = 256
UNBOUNDED_FILES = 1 << 20  # taken for a limit RLIM_INFINITY: Linux's default fs.nr_open


def _open_files() -> tuple[int, int]:
    """The open-file limit before and after raising the soft one towards the hard one:
    the soft default (often 1024) is far below what a node with many long polls holds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = UNBOUNDED_FILES if hard == resource.RLIM_INFINITY else hard
    # The kernel may refuse the hard limit itself (macOS: OPEN_MAX, 10240): lower tries.
    for target in (want, 1 << 16, 10240):
        if soft == resource.RLIM_INFINITY or soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        return soft, target
    return soft, soft


def connection_cap(files: int, probe_room: int, wanted: int | None = None) -> int:
    """The HTTP connections a node serves under an open-file limit of `files`, with
    `probe_room` more for its probes: what is left for its own files is a quarter of the
    limit, at least FILES_RESERVED; under a small limit, half of it goes to connections.
    `wanted` (`broker.max_connections`) lowers it, never raises it past the limit."""
    files = min(files, UNBOUNDED_FILES)
    cap = max(files - max(FILES_RESERVED, files // 4) - probe_room, files // 2, 1)
    return cap if wanted is None else min(cap, wanted)


def _bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """The HTTP API's sockets, bound (as asyncio binds them) and listening before the node
    opens its data dir: an address in use ends the node at once, and says so. Listening
    at once, as two sockets with SO_REUSEADDR that do not listen yet can share an
    address; connections queue until the server accepts them."""
    infos = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _wildcard(host: str) -> bool:
    """Whether `host` listens on every interface (0.0.0.0, ::): an address no other node
    can send to."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _advertised(http: str, advertise: str | None) -> str:
    """The HTTP address this node registers for the others to forward to: `advertise`,
    else `http` where that names a host; a wildcard would send each forward back to
    the forwarding node itself."""
    if advertise is None:
        if _wildcard(_address(http, "--http")[0]):
            raise ValueError(
                f"--http {http} listens on every interface, which names no host the other "
                "nodes and clients can reach: give --advertise HOST:PORT (or "
                "broker.advertise), this host's name or address as its certificate names it"
            )
        return http
    if _wildcard(_address(advertise, "--advertise")[0]):
        raise ValueError(f"--advertise {advertise}: give this host's name or address")
    return advertise


def _loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (a name is resolved)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


class _WithoutPandas(importlib.abc.MetaPathFinder):
    """Refuses pandas, which the broker never calls: pyarrow imports it on its first
    array-like check, for tens of MB per node. pyarrow takes the refusal for an absent
    pandas and carries on without its pandas conversions."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("the broker runs without pandas", name=name)


def run(args: argparse.Namespace) -> int:
    if "pandas" not in sys.modules:
        sys.meta_path.insert(0, _WithoutPandas())
    import pyarrow as pa
    import uvicorn

    from dejaq.broker.api.app import create_app
    from dejaq.broker.api.http_server import PROBE_ROOM, SETTINGS, Server
    from dejaq.broker.service import Broker, Producer
    from dejaq.broker.state.data_dir import DataDirError
    from dejaq.broker.storage.head_store import ReserveReached
    from dejaq.broker.storage.index import LOAD_LOGGER
    from dejaq.conf.kafka_login import check_login
    from dejaq.conf.settings import ConfigError, load_settings
    from dejaq.conf.storage import export

    settings = load_settings(args.conf_file)
    export(settings)
    try:
        host, port = _address(args.http, "--http")
        advertised = _advertised(args.http, args.advertise or settings.broker.advertise)
        if _wildcard(_address(args.raft, "--raft")[0]):
            raise ValueError(
                f"--raft {args.raft}: the peers know this node by its Raft address, "
                "so give this host's name or address, as the other nodes' --peers do"
            )
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        for p in peers:
            _address(p, "--peers")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    peers = [p for p in peers if p != args.raft]
    if len(peers) not in (0, 2, 4):
        print(f"error: run 1, 3 or 5 nodes; got {len(peers) + 1}", file=sys.stderr)
        return EXIT_USAGE
    if peers and not settings.broker.raft_password:
        raise ConfigError(
            "broker.raft_password is required for a multi-node cluster "
            "(set it in the configuration or as DEJAQ_BROKER_RAFT_PASSWORD)"
        )
    check_login(settings.kafka)
    conf = settings.broker
    if not _loopback(host) and conf.keys_file is None and not conf.insecure:
        print(
            f"error: --http {args.http} is reachable beyond this machine and no API keys are "
            "configured: set broker.keys_file (and add keys with `dejaq keys add`), or set "
            "broker.insecure: true if this node is meant to be open to anyone who reaches it",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not _loopback(host) and conf.keys_file is not None and not conf.tls.on:
        if not conf.insecure:
            print(
                f"error: --http {args.http} is reachable beyond this machine without TLS, so "
                "API keys would cross the network in clear: set broker.tls.cert and "
                "broker.tls.key (`dejaq certs` makes a CA and a certificate), or set "
                "broker.insecure: true if something in front of this node encrypts its traffic",
                file=sys.stderr,
            )
            return EXIT_USAGE
        print(
            f"warning: --http {args.http} serves plain HTTP beyond this machine "
            "(broker.insecure): API keys cross the network in clear unless something in "
            "front of this node encrypts its traffic",
            file=sys.stderr,
        )
    # The event loop (HTTP and Raft) shares the GIL with the threads that follow the
    # buffer table and checkpoint the ledger: get it back within 0.5 ms, not the default
    # 5 ms, so requests and heartbeats do not queue behind those threads' Python loops.
    sys.setswitchinterval(0.0005)
    # Arrow's default allocator (mimalloc) keeps tens of MB of what a start's reads
    # freed, even when asked to release them; the C library's gives them back: a node's
    # memory then follows what it holds, not the most its start read at once.
    pa.set_memory_pool(pa.system_memory_pool())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger(LOAD_LOGGER).setLevel(logging.INFO)  # a start's load, as it goes
    was, files = _open_files()
    wanted = settings.broker.max_connections
    cap = connection_cap(files, PROBE_ROOM, wanted)
    print(
        f"broker {args.node_id}: open files {files}"
        + (f" (raised from {was})" if files != was else "")
        + f", HTTP connections up to {cap}"
        + (f" (broker.max_connections {wanted})" if wanted is not None else ""),
        flush=True,
    )
    if wanted is not None and cap < wanted:
        print(
            f"warning: broker.max_connections is {wanted}, but the open-file limit "
            f"({files}) leaves room for {cap}: raise the hard limit for more",
            file=sys.stderr,
        )
    data_dir = Path(args.data_dir or Path(settings.broker.data_dir) / args.node_id)
    broker = Broker(
        settings,
        args.node_id,
        advertised,
        args.raft,
        peers,
        data_dir,
        args.reconfigure,
        args.new_cluster,
    )
    tls = {"ssl_certfile": conf.tls.cert, "ssl_keyfile": conf.tls.key} if conf.tls.on else {}
    app = create_app(broker, Producer(settings.kafka))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=STOP_REQUESTS_S,
        limit_concurrency=cap,
        **SETTINGS,
        **tls,
    )
    server = Server(config)
    # The indexes load while the server answers probes (`Broker.start_behind`). A load
    # that fails, or a snapshot from the leader that does not load, ends the node as a
    # damaged file at start does: it stops serving, then says why and exits, below.
    broker.on_failure = partial(setattr, server, "should_exit", True)
    with ExitStack() as held:
        try:
            sockets = [held.enter_context(s) for s in _bind(host, port, BACKLOG)]
        except OSError as e:
            taken = e.errno == errno.EADDRINUSE
            why = "is already in use" if taken else f"cannot be listened on: {e.strerror or e}"
            print(f"error: --http {args.http} {why}", file=sys.stderr)
            return 1
        try:
            broker.open()
        except DataDirError as e:
            print(f"error: node {args.node_id}: {e}", file=sys.stderr)
            return 1
        assert broker.identity is not None
        if not broker.identity.joined:
            print(
                f"broker {args.node_id}: data dir {data_dir} was empty, so this node waits for "
                "a leader to bring it up to date and neither votes nor stands for election "
                "until then (a new cluster's first start takes --new-cluster on every node; "
                "started without it, restart each with it while no node has heard of a Raft "
                "term)",
                file=sys.stderr,
                flush=True,
            )
        print(
            f"broker {args.node_id}: {conf.tls.scheme}://{advertised} "
            f"(listening on {args.http}) raft {args.raft}",
            flush=True,
        )
        with _stopping_on_signals(server, broker.halt) as signals:
            try:
                server.run(sockets)
            finally:
                broker.stop()
            if signals:
                print(f"broker {args.node_id}: stopped on {signals[0].name}", flush=True)
    try:
        if broker.failure is not None:
            raise broker.failure
    except ReserveReached as e:
        print(
            f"error: node {args.node_id} cannot index its pending messages: {e.strerror}",
            file=sys.stderr,
        )
        return 1
    except DataDirError as e:
        print(f"error: node {args.node_id}: {e}", file=sys.stderr)
        return 1
    if broker.raft is not None and broker.raft.sync.failure is not None:
        print(f"error: node {args.node_id}: {broker.raft.sync.failure}", file=sys.stderr)
        return 1
    return 0
