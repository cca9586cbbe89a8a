"""A broker node's data dir as real `dejaq broker` processes meet it: damaged Raft
files, a dir in use, another node's dir, members changed, empty dirs beside peers."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import wait_until
from pysyncobj.journal import FileJournal
from test_broker import buffer_rows, fill
from test_broker_cluster import (
    cluster_info,
    exit_at_start,
    leader_of,
    start_logged,
    stop,
    write_conf,
)

from dejaq.broker.state.data_dir import IDENTITY, RAFT_FILES
from dejaq.broker.state.raft import ELECTION_TIMEOUT_S
from dejaq.jobs import cluster
from dejaq.jobs.cluster import Node
from dejaq.jobs.ports import free_port


def truncated_dump(data_dir: Path) -> Path:
    """A snapshot cut short, as a crash mid-write leaves one."""
    path = data_dir / "raft.dump"
    whole = gzip.compress(pickle.dumps(({"x": list(range(10_000))}, (b"", 3, 1), (b"", 2, 1))))
    path.write_bytes(whole[: len(whole) // 2])
    return path


def zeroed_journal_record(data_dir: Path) -> Path:
    """A journal of three records, PySyncObj's, whose last record is zeros."""
    path = data_dir / "raft.journal"
    journal = FileJournal(str(path))
    for idx in (1, 2, 3):
        journal.add(b"\x00" + bytes(20), idx, 1)
    journal._destroy()
    raw = bytearray(path.read_bytes())
    (end,) = struct.unpack_from("<I", raw, 36)
    size = 16 + 21 + 8
    raw[end - size : end] = bytes(size)
    path.write_bytes(raw)
    return path


def truncated_meta(data_dir: Path) -> Path:
    """The term-and-vote file empty, as a crash before its write reached the disk."""
    path = data_dir / "raft.journal.meta"
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("damage", [truncated_dump, zeroed_journal_record, truncated_meta])
def test_a_node_whose_raft_files_do_not_read_exits_at_start_naming_the_file(
    tmp_path, damage
) -> None:
    """A snapshot, journal or term-and-vote file that cannot be read ends the node at
    start, naming the file and the way out: not a traceback, nor a node that carries on
    without it (one that never applies again, or forgets the vote it gave)."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    (tmp_path / "a").mkdir()
    path = damage(tmp_path / "a")
    code, said = exit_at_start(tmp_path, conf)
    assert code == 1, said
    assert f"{path} cannot be read" in said, said
    assert "Membership and disks" in said and "Traceback" not in said, said


def test_a_second_node_on_a_data_dir_in_use_exits_naming_the_process(tmp_path) -> None:
    """Two processes on one data dir (a --node-id pasted twice on one host) would write
    one journal and give two votes from one: the second refuses, naming the first."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    os.environ.setdefault("DEJAQ_BROKER_RAFT_PASSWORD", secrets.token_hex(8))
    (first,) = cluster.up(1, tmp_path / "raft", str(conf))
    try:
        second = Node("b", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", first.data_dir)
        said = refused(second, [second], conf)
        assert f"data dir {first.data_dir} in use by PID {first.proc.pid}" in said, said
        assert cluster.ready([first])
    finally:
        cluster.stop_node(first)


def refused(node: Node, members: list[Node], conf: Path, *flags: str) -> str:
    """Start `node` as a member of `members`, expecting it to exit 1 at start: what it
    said."""
    result = subprocess.run(
        [*cluster.node_command(node, members, str(conf)), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


def one_node(tmp_path: Path) -> tuple[Node, Path]:
    """A one-node cluster that has run and stopped: the node and its configuration."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    os.environ.setdefault("DEJAQ_BROKER_RAFT_PASSWORD", secrets.token_hex(8))
    (node,) = cluster.up(1, tmp_path / "raft", str(conf))
    cluster.stop_node(node)
    return node, conf


def identity(node: Node) -> dict:
    return json.loads((node.data_dir / "node.json").read_text())


def test_a_child_the_node_forked_does_not_keep_its_data_dir_locked(tmp_path) -> None:
    """A node forks a child to write each snapshot: killed and restarted while that child
    still writes, the node must find its dir free, not in use by itself."""
    from dejaq.broker.state.data_dir import lock

    held = lock(tmp_path)
    done_r, done_w = os.pipe()
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # the snapshot writer's stand-in: it lives until told
        os.close(done_w)
        os.write(ready_w, b"1")  # forked: what runs in a child at its fork has run
        os.read(done_r, 1)
        os._exit(0)
    os.close(done_r)
    try:
        assert os.read(ready_r, 1) == b"1"
        held.close()  # the node ends, its child still writing
        lock(tmp_path).close()
    finally:
        os.close(done_w)
        os.waitpid(child, 0)
        os.close(ready_r)
        os.close(ready_w)


def test_a_data_dir_made_for_another_raft_address_is_refused(tmp_path) -> None:
    """A data dir copied from another node, or a node moved to another address, would
    vote and ack as the node whose journal it holds: refused, naming both addresses."""
    node, conf = one_node(tmp_path)
    assert identity(node) == {"raft": node.raft, "members": [node.raft], "joined": True}
    moved = Node("n1", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", node.data_dir)
    said = refused(moved, [moved], conf)
    assert f"belongs to the node at Raft address {node.raft}, not --raft {moved.raft}" in said
    assert "--reconfigure" in said, said


def test_members_changed_by_restarting_a_node_with_other_peers_are_refused(tmp_path) -> None:
    """A node restarted with other --peers than its data dir was made with could form a
    majority of the new members while the old ones form another, two leaders each
    committing: refused, with the way to change members. --reconfigure, for every node
    started so, records the new set."""
    node, conf = one_node(tmp_path)
    grown = [node, *cluster.plan(3, tmp_path / "new")[1:]]
    said = refused(node, grown, conf)
    assert "Members must not be changed by restarting nodes one at a time" in said, said
    assert "--reconfigure" in said and "Membership and disks" in said, said
    assert identity(node)["members"] == [node.raft]
    node.proc = subprocess.Popen(
        [*cluster.node_command(node, grown, str(conf)), "--reconfigure"],
        stdout=subprocess.DEVNULL,
    )
    try:
        members = sorted(n.raft for n in grown)
        wait_until(lambda: identity(node)["members"] == members, what="the new members")
        assert node.proc.poll() is None
    finally:
        cluster.stop_node(node)


def test_a_data_dir_from_before_identities_adopts_the_nodes_flags_once(tmp_path) -> None:
    """A dir with Raft files and no identity file (made before nodes recorded one) is
    taken as it stands and records this start's address and members."""
    node, conf = one_node(tmp_path)
    (node.data_dir / "node.json").unlink()
    cluster.start_node(node, [node], str(conf), dict(os.environ))
    try:
        cluster.wait_ready([node])
        assert identity(node) == {"raft": node.raft, "members": [node.raft], "joined": True}
    finally:
        cluster.stop_node(node)


def lease_and_ack(client: httpx.Client, node: Node, n: int) -> list[str]:
    """Lease `n` messages of topic `hot` on `node` and ack them: their ids."""
    url = f"{node.url}/v1/topics/hot"
    body = {"consumer_id": "c", "max_messages": n, "wait_ms": 5000, "lease_ms": 600_000}
    ids = [m["id"] for m in client.post(f"{url}/leases", json=body).json()["messages"]]
    assert len(ids) == n
    acks = client.post(f"{url}/acks", json={"consumer_id": "c", "ids": ids}).json()
    assert acks == {"settled": n}
    return ids


def test_empty_nodes_beside_one_with_history_elect_nobody_until_it_leads(tmp_path) -> None:
    """Growing one node to three by starting two empty ones: the two could elect each
    other and have the first node's log, its acks, truncated. An empty node beside
    peers waits for a leader to bring it up to date and neither votes nor stands until
    then; `cluster up` refuses such a mix. The way that works: every node stopped, the
    first one's Raft files copied to the new ones, all started with --reconfigure."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    fill(str(tmp_path / "warehouse"), "hot", buffer_rows(list(range(4)), lambda i: 0))
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(3, tmp_path / "raft")
    first, *added = nodes
    try:
        with httpx.Client(timeout=30) as client:
            cluster.start_node(first, [first], str(conf), env)
            cluster.wait_ready([first])
            acked = lease_and_ack(client, first, 2)
            cluster.stop_node(first)
            with pytest.raises(cluster.MixedDataDirs, match="hold Raft state"):
                cluster.up(3, tmp_path / "raft", str(conf))
            for node in added:
                cluster.start_node(node, nodes, str(conf), env)

            def term(node: Node) -> int:
                info = cluster_info(client, node)
                return -1 if info is None else info["term"]

            wait_until(lambda: min(map(term, added)) == 0, what="the empty nodes serving")
            for node in added:
                said = client.get(f"{node.url}/readyz").text
                assert "waits for a leader to bring it up to date" in said, said
            # Three election timeouts: they stand for no election, so no term begins.
            deadline = time.monotonic() + 3 * ELECTION_TIMEOUT_S[1]
            while time.monotonic() < deadline:
                assert [term(node) for node in added] == [0, 0]
            stop(added)
            for node in added:
                shutil.rmtree(node.data_dir)
                node.data_dir.mkdir()
                for name in (*RAFT_FILES, IDENTITY):
                    if (first.data_dir / name).exists():
                        shutil.copy(first.data_dir / name, node.data_dir / name)
            for node in nodes:
                node.proc = subprocess.Popen(
                    [*cluster.node_command(node, nodes, str(conf)), "--reconfigure"], env=env
                )
            cluster.wait_ready(nodes)
            for node in nodes:
                for mid in acked:
                    status = client.get(f"{node.url}/v1/topics/hot/messages/{mid}").json()
                    assert status["status"] in ("acked", "settled"), (node.node_id, status)
            leader = leader_of(nodes, client)
            assert sorted(lease_and_ack(client, leader, 2)) == sorted(
                {"m0", "m1", "m2", "m3"} - set(acked)
            )
    finally:
        stop(nodes)


def test_a_node_on_a_replaced_disk_votes_once_a_leader_brought_it_up_to_date(
    tmp_path,
) -> None:
    """A node whose disk was replaced starts empty, without --new-cluster: it may not
    vote as if it never had. The leader brings it up to date; it records that it has
    joined, and from then on it votes: with another node stopped, it and the third
    elect a leader that still knows the acks made before."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    fill(str(tmp_path / "warehouse"), "hot", buffer_rows(list(range(4)), lambda i: 0))
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(3, tmp_path / "raft")
    try:
        for node in nodes:
            cluster.start_node(node, nodes, str(conf), env, new_cluster=True)
        cluster.wait_ready(nodes)
        with httpx.Client(timeout=30) as client:
            acked = lease_and_ack(client, leader_of(nodes, client), 2)
            replaced = next(n for n in nodes if n is not leader_of(nodes, client))
            cluster.stop_node(replaced)
            shutil.rmtree(replaced.data_dir)
            cluster.start_node(replaced, nodes, str(conf), env)
            cluster.wait_ready(nodes)
            assert identity(replaced)["joined"] is True
            cluster.stop_node(leader_of(nodes, client))
            running = [n for n in nodes if n.proc.poll() is None]
            wait_until(lambda: leader_of(running, client), what="a leader of the two left")
            for mid in acked:
                status = client.get(f"{replaced.url}/v1/topics/hot/messages/{mid}").json()
                assert status["status"] in ("acked", "settled"), status
    finally:
        stop(nodes)


def test_new_cluster_is_refused_on_a_data_dir_with_data(tmp_path) -> None:
    """--new-cluster lets an empty node vote from the start: left on a node's command
    line past its first start, it must not make a replaced disk's node vote at once."""
    node, conf = one_node(tmp_path)
    said = refused(node, [node], conf, "--new-cluster")
    assert f"--new-cluster: data dir {node.data_dir} already holds this node's state" in said


def test_a_new_cluster_started_without_its_flag_takes_it_at_a_restart(tmp_path) -> None:
    """Every node of a new cluster started without --new-cluster waits for a leader that
    never comes: none has heard of a term. Restarted with the flag, each may vote, as
    nothing was ever committed that an election could lose."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(3, tmp_path / "raft")
    try:
        with httpx.Client(timeout=30) as client:
            for node in nodes:
                cluster.start_node(node, nodes, str(conf), env, new_cluster=False)
            wait_until(
                lambda: all(cluster_info(client, n) is not None for n in nodes),
                what="the nodes serving",
            )
            assert all(identity(n)["joined"] is False for n in nodes)
            stop(nodes)
            for node in nodes:
                cluster.start_node(node, nodes, str(conf), env, new_cluster=True)
            cluster.wait_ready(nodes)
            assert all(identity(n)["joined"] is True for n in nodes)
            assert leader_of(nodes, client) is not None
    finally:
        stop(nodes)


def log_entries(client: httpx.Client, node: Node) -> int:
    """The entries in `node`'s Raft log, as its metrics last published them."""
    text = client.get(f"{node.url}/metrics").text
    return int(float(re.search(r"^dejaq_raft_log_entries (\S+)$", text, re.M).group(1)))


def compacted_past(client: httpx.Client, node: Node, at: float, view: dict) -> bool:
    """Whether `node` wrote a snapshot of its state after time `at`, when its view was
    `view`, and compacted its log to entries after that view's commit index: a follower
    stopped at `at` then needs the snapshot. The log's length alone does not tell: the
    entries committed after a compaction (retention's rounds, a checkpoint's trims) can
    make it as long as before."""
    dump = node.data_dir / "raft.dump"
    if not dump.exists() or dump.stat().st_mtime < at:
        return False
    entries = log_entries(client, node)
    commit = client.get(f"{node.url}/v1/cluster").json()["commit_index"]
    return commit - entries > view["commit_index"]


@contextmanager
def ledgers_out_of_reach(warehouse: Path) -> Iterator[None]:
    """The warehouse's ledgers out of every node's reach, as an object store's outage
    leaves them: moved aside, with a file in their place so that no writer makes them
    anew; back as they were after."""
    ledgers, aside = warehouse / "ledger", warehouse / "ledger.aside"
    ledgers.rename(aside)
    ledgers.write_bytes(b"")
    try:
        yield
    finally:
        ledgers.unlink()
        aside.rename(ledgers)


def test_a_follower_whose_snapshot_from_the_leader_does_not_load_exits_naming_it(
    tmp_path,
) -> None:
    """A follower stopped while the leader compacts its log gets the leader's snapshot
    when it returns. Loading it rebuilds the node's indexes from the warehouse's ledgers:
    with those out of reach it does not load, and PySyncObj would log that and go on
    with the state from before the snapshot, the node voting and standing for election.
    It exits 1 instead, naming the file and the way back, as a damaged file at start
    does; the others go on leasing. Started again, the ledgers back, it loads the
    snapshot from its file and knows the acks made while it was stopped."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    warehouse = tmp_path / "warehouse"
    fill(str(warehouse), "hot", buffer_rows(list(range(6)), lambda i: 0))
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(3, tmp_path / "raft")
    try:
        logs = start_logged(nodes, nodes, conf, env, tmp_path)
        cluster.wait_ready(nodes)
        with httpx.Client(timeout=30) as client:
            leader = leader_of(nodes, client)
            lagging = next(n for n in nodes if n is not leader)
            os.kill(lagging.proc.pid, signal.SIGSTOP)
            try:
                stopped = (time.time(), client.get(f"{leader.url}/v1/cluster").json())
                acked = lease_and_ack(client, leader, 2)
                # PySyncObj compacts a log a minute after the last compaction (or start).
                wait_until(
                    lambda: compacted_past(client, leader, *stopped),
                    timeout=150,
                    what="the leader to compact its log past the entries the follower has",
                )
                with ledgers_out_of_reach(warehouse):
                    os.kill(lagging.proc.pid, signal.SIGCONT)
                    wait_until(
                        lambda: lagging.proc.poll() is not None, timeout=60, what="it to exit"
                    )
            finally:
                if lagging.proc.poll() is None:
                    os.kill(lagging.proc.pid, signal.SIGCONT)
            said = logs[nodes.index(lagging)].read_text()
            assert lagging.proc.returncode == 1, said
            dump = lagging.data_dir / "raft.dump"
            failed = f"{dump}, the snapshot received from the leader, did not load"
            assert f"error: node {lagging.node_id}: {failed}" in said, said
            assert "takes no further part in Raft and exits; start it again" in said, said
            running = [n for n in nodes if n is not lagging]
            leading = wait_until(lambda: leader_of(running, client), what="a leader of the two")
            assert sorted(lease_and_ack(client, leading, 2)) == sorted(
                {f"m{i}" for i in range(4)} - set(acked)
            )
            cluster.start_node(lagging, nodes, str(conf), env)
            cluster.wait_ready(nodes)
            for mid in acked:
                status = client.get(f"{lagging.url}/v1/topics/hot/messages/{mid}").json()
                assert status["status"] in ("acked", "settled"), status
    finally:
        stop(nodes)
