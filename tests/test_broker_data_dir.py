"""A broker node's data dir as real `dejaq broker` processes meet it: damaged Raft
files, a dir in use, another node's dir, members changed."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import secrets
import struct
import subprocess
from pathlib import Path

import pytest
from conftest import wait_until
from pysyncobj.journal import FileJournal
from test_broker_cluster import exit_at_start, write_conf

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
        result = subprocess.run(
            cluster.node_command(second, [second], str(conf)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, result.stderr
        assert f"data dir {first.data_dir} in use by PID {first.proc.pid}" in result.stderr
        assert "Traceback" not in result.stderr, result.stderr
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


def test_a_data_dir_made_for_another_raft_address_is_refused(tmp_path) -> None:
    """A data dir copied from another node, or a node moved to another address, would
    vote and ack as the node whose journal it holds: refused, naming both addresses."""
    node, conf = one_node(tmp_path)
    assert identity(node) == {"raft": node.raft, "members": [node.raft]}
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
        assert identity(node) == {"raft": node.raft, "members": [node.raft]}
    finally:
        cluster.stop_node(node)
