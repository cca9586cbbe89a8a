"""The replicated part of the broker: PySyncObj Raft around the lease state machine.

Replicated entry points `command(topic, op, args)` and `batch([...])` (a group of them,
one log entry) dispatch to `TopicState` methods, so the log holds small tuples and the
semantics stay in `broker.leases`. After each command the node-local indexes are told
which messages became pending or gone. The leader stamps the time into each command:
applying the log never reads a clock.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.syncobj import _RAFT_STATE

from broker.leases import TopicState
from conf.settings import BrokerConfig, ConfigError, TopicConfig

MAX_IN_FLIGHT = 2  # log entries of grouped commands awaiting commit
MAX_GROUP = 256  # commands per entry
BATCH_TIMEOUT_S = 10.0


class Listener(Protocol):
    """Node-local side effects of applied commands (the indexes)."""

    def pending(self, topic: str, state: TopicState, mids: list[str]) -> None: ...
    def gone(self, topic: str, mids: list[str]) -> None: ...
    def reset(self, states: dict[str, TopicState]) -> None: ...


class NotCommitted(RuntimeError):
    """The command did not reach a majority (no leader, leader changed, timeout)."""


class BrokerState(SyncObjConsumer):
    """Replicated: per-topic lease state and the Raft-to-HTTP address book."""

    def __init__(self, topics: list[TopicConfig], max_deliveries: int, listener: Listener) -> None:
        # Attributes set before SyncObjConsumer.__init__ are node-local (not serialised).
        self.listener = listener
        self.topic_conf = {t.name: t for t in topics}
        self.max_deliveries = max_deliveries
        super().__init__()
        self.topics: dict[str, TopicState] = {
            t.name: TopicState(t.buckets, max_deliveries) for t in topics
        }
        self.nodes: dict[str, str] = {}

    def _deserialize(self, data: dict[str, Any]) -> None:
        super()._deserialize(data)
        for name, t in self.topic_conf.items():
            self.topics.setdefault(name, TopicState(t.buckets, self.max_deliveries))
        self.listener.reset(self.topics)

    @replicated
    def register(self, raft_addr: str, http_addr: str) -> None:
        self.nodes[raft_addr] = http_addr

    @replicated
    def command(self, topic: str, op: str, args: tuple) -> Any:
        return self._apply(topic, op, args)

    @replicated
    def batch(self, commands: list[tuple[str, str, tuple]]) -> list[Any]:
        """Group commit: many requests' commands in one log entry, each result apart."""
        results: list[Any] = []
        for topic, op, args in commands:
            try:
                results.append(self._apply(topic, op, args))
            except Exception as e:  # deterministic on every node: fail this command only
                results.append(e)
        return results

    def _apply(self, topic: str, op: str, args: tuple) -> Any:
        st = self.topics[topic]
        if op == "lease":
            return st.lease(*args)
        if op in ("ack", "reject"):
            return getattr(st, op)(*args)
        if op == "touch":
            return st.touch(*args)
        if op == "extend":
            return st.extend(*args)
        if op == "cancel":
            return st.cancel(*args)
        if op == "trim":
            upto = args[0]
            self.listener.gone(topic, [e.message_id for e in st.events if e.seq <= upto])
            return st.trim(upto)
        if op == "nack":
            refused, pending = st.nack(*args)
            self.listener.pending(topic, st, pending)
            return refused
        if op == "leave":
            pending = st.leave(*args)
        elif op == "expire":
            pending = st.expire(*args)
        elif op == "reschedule":
            refused = st.reschedule(*args)
            pending = [] if refused else [args[0]]
            self.listener.pending(topic, st, pending)
            return refused
        else:
            raise ValueError(f"unknown command {op!r}")
        self.listener.pending(topic, st, pending)
        return pending


def raft_conf(broker: BrokerConfig, data_dir: Path, multi_node: bool) -> SyncObjConf:
    """Always password-protected: PySyncObj unpickles what arrives on its port."""
    password = broker.raft_password
    if not password:
        if multi_node:
            raise ConfigError(
                "broker.raft_password is required for a multi-node cluster "
                "(set it in the configuration or as DEJAQ_BROKER_RAFT_PASSWORD)"
            )
        password = secrets.token_hex(16)  # one node: nobody else needs to know it
    data_dir.mkdir(parents=True, exist_ok=True)
    return SyncObjConf(
        password=password,
        appendEntriesUseBatch=False,  # send each entry at once: ms, not ~100 ms, per commit
        appendEntriesBatchSizeBytes=2**20,
        journalFile=str(data_dir / "raft.journal"),
        fullDumpFile=str(data_dir / "raft.dump"),
        appendEntriesPeriod=0.05,
        raftMinTimeout=0.5,  # a loaded 2-core machine can starve a leader for 300 ms
        raftMaxTimeout=1.5,
        connectionRetryTime=0.5,
        commandsQueueSize=100_000,
        logCompactionMinEntries=20_000,
        logCompactionMinTime=60,
        useFork=os.name == "posix",
    )


class RaftNode:
    """This node's Raft member: commit commands and ask who leads."""

    def __init__(
        self,
        raft_addr: str,
        peers: list[str],
        topics: list[TopicConfig],
        broker: BrokerConfig,
        data_dir: Path,
        listener: Listener,
    ) -> None:
        self.raft_addr = raft_addr
        self.state = BrokerState(topics, broker.max_deliveries, listener)
        conf = raft_conf(broker, data_dir, multi_node=bool(peers))
        self.sync = SyncObj(raft_addr, peers, conf, consumers=[self.state])
        self._pending: list[tuple[tuple[str, str, tuple], asyncio.Future]] = []
        self._in_flight: dict[int, float] = {}
        self._batches = 0

    def is_leader(self) -> bool:
        return self.sync._isLeader()

    def leader(self) -> str | None:
        node = self.sync._getLeader()
        return None if node is None else node.id

    def leader_http(self) -> str | None:
        leader = self.leader()
        return None if leader is None else self.state.nodes.get(leader)

    def role(self) -> str:
        state = self.sync.getStatus()["state"]
        return {
            _RAFT_STATE.LEADER: "leader",
            _RAFT_STATE.CANDIDATE: "candidate",
        }.get(state, "follower")

    def term(self) -> int:
        return self.sync.raftCurrentTerm

    async def commit(self, topic: str, op: str, *args: Any, timeout: float = 5.0) -> Any:
        """Replicate a command; return its result once a majority has it.

        Commands arriving while earlier ones are in flight are grouped into one log
        entry: under load one Raft round trip serves many requests.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.append(((topic, op, args), fut))
        self._flush(loop)
        try:
            result = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise NotCommitted("timed out waiting for a Raft majority") from None
        if isinstance(result, Exception):
            raise result
        return result

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        for batch_id, started in list(self._in_flight.items()):
            if now - started > BATCH_TIMEOUT_S:  # its callback is not coming: stop waiting
                del self._in_flight[batch_id]
        while self._pending and len(self._in_flight) < MAX_IN_FLIGHT:
            group, self._pending = self._pending[:MAX_GROUP], self._pending[MAX_GROUP:]
            self._batches += 1
            batch_id = self._batches
            self._in_flight[batch_id] = now
            futs = [f for _, f in group]

            def done(result: Any, err: int, batch_id: int = batch_id, futs=futs) -> None:
                loop.call_soon_threadsafe(self._done, loop, batch_id, futs, result, err)

            self.state.batch([c for c, _ in group], callback=done)

    def _done(self, loop, batch_id: int, futs: list, results: Any, err: int) -> None:
        self._in_flight.pop(batch_id, None)
        for i, fut in enumerate(futs):
            _resolve(fut, results[i] if err == FAIL_REASON.SUCCESS else None, err)
        self._flush(loop)

    def destroy(self) -> None:
        self.sync.destroy()


def _resolve(fut: asyncio.Future, result: Any, err: int) -> None:
    if fut.done():
        return
    if err == FAIL_REASON.SUCCESS:
        fut.set_result(result)
    else:
        fut.set_exception(NotCommitted(f"Raft refused the command (reason {err})"))
