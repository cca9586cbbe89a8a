"""The replicated part of the broker: PySyncObj Raft around the lease state machine.

Replicated entry points `command(topic, op, args)` and `batch([...])` (a group of them,
one log entry) dispatch to `TopicState` methods, so the log holds small tuples and the
semantics stay in `broker.leases`. After each command the node-local indexes are told
which messages became pending or gone. The leader stamps the time into each command:
applying the log never reads a clock.

Raft runs in the event loop's thread (`LoopPoller`, `RaftNode.attach`), not in a tick
thread of its own, and its messages are sealed with AES-GCM and not deflated: per
commit, the handoffs between threads and PySyncObj's per-message crypto and zlib set-up
cost more CPU than the commands themselves. These replace PySyncObj internals of the
pinned release (checked at import). The loop now also carries the heartbeats: whatever
blocks it for ~0.5 s lets the followers elect another leader, so blocking work (Delta
reads, checkpoints, `describe`) runs in threads and `dejaq_event_loop_lag_seconds`
shows how late the loop runs.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import logging
import os
import pickle
import secrets
import select
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pysyncobj.atomic_replace
import pysyncobj.pickle
import pysyncobj.serializer
import pysyncobj.tcp_connection
import pysyncobj.version
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.pbkdf2 import PBKDF2HMAC
from pysyncobj import (
    FAIL_REASON,
    SyncObj,
    SyncObjConf,
    SyncObjConsumer,
    SyncObjException,
    replicated,
)
from pysyncobj.monotonic import monotonic as raft_clock
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.syncobj import _COMMAND_TYPE, _RAFT_STATE, AsyncResult

from dejaq.broker.state.data_dir import RECOVERY, DataDirError, check_raft_files
from dejaq.broker.state.handles import mh, mhs
from dejaq.broker.state.leases import TRANSITIONS, LeaseRecord, TopicState
from dejaq.broker.streak import Streak
from dejaq.conf.settings import BrokerConfig, ConfigError, TopicConfig

log = logging.getLogger("dejaq.broker.state.raft")

# `_RaftZlib`, `_SnapshotGzip`, `_SnapshotOs`, `AeadEncryptor`, `LoopPoller` and `_SyncObj`
# stand in for internals of this release (module globals, name-mangled methods, the
# transport's encryptor hooks).
PYSYNCOBJ_VERSION = "0.3.17"
if pysyncobj.version.VERSION != PYSYNCOBJ_VERSION:
    raise ImportError(
        f"broker.raft patches PySyncObj {PYSYNCOBJ_VERSION} internals; "
        f"found {pysyncobj.version.VERSION}: check the patches against it, then the pin"
    )

MAX_IN_FLIGHT = 1  # log entries of grouped commands awaiting commit (not apply)
MAX_GROUP = 256  # commands per entry
COMMIT_TIMEOUT_S = 5.0
HALT_CHECK_S = 0.05  # `committed` looks this often whether the node began to stop
# A command reaches the Raft log within this of the time it was stamped with, or never:
# it waits for an entry COMMIT_TIMEOUT_S at most (`RaftNode._flush`), after as long for
# the topic's first `configure` (`Broker._commit`), with as much again to spare. A
# retention run's cutoff stays this far back, or the event of a command stamped before
# it asked, and logged after, could land below its watermark.
STAMPED_WITHIN_MS = int(3 * COMMIT_TIMEOUT_S * 1000)
CATCH_UP_STEP_S = 0.005  # `RaftNode.lead` looks again after this
TICK_PERIOD_S = 0.01  # Raft timers (heartbeats, elections, reconnects) between events
ELECTION_TIMEOUT_S = (0.5, 1.5)  # a loaded 2-core machine can starve a leader for 300 ms
WARN_LAG_S = ELECTION_TIMEOUT_S[0] / 2
# A leader that has heard from no majority this long becomes a follower, and its /readyz
# says there is no leader (PySyncObj's default, 30 s, left a leader cut off from the
# others reporting itself leader and ready that long, while they elected another within
# an election timeout and none of its writes committed). Twice the longest election
# timeout: a leader stalled that long has been replaced already (its followers heard no
# heartbeat), and the followers answer every heartbeat (`appendEntriesPeriod`, 50 ms), so
# only all of them stalled together that long, ten times what a loaded machine stalls a
# loop, makes a working leader step down, and an election follows.
LEADER_FALLBACK_S = 2 * ELECTION_TIMEOUT_S[1]
COMPRESS_MIN_BYTES = 64 * 1024  # smaller Raft messages travel as stored (uncompressed) zlib
AUTH_LOG_EVERY_S = 30.0
PICKLE_PROTOCOL = 5  # Python 3.8 and later read it
OWN_MAX = 1_000  # own commands appended and not yet applied (`_SyncObj.own`)
SNAPSHOT_GZIP_LEVEL = 1  # `_SnapshotGzip`
SNAPSHOT_NICE = 10  # `_SnapshotOs`: a tenth of a core's share against a busy process


class SnapshotUnpickler(pickle.Unpickler):
    """Loads snapshots whose classes are named by the legacy top-level modules
    (`broker.leases.TopicState`): they map to the same modules under `dejaq`; and those
    named by the broker's modules before they were grouped by concern
    (`dejaq.broker.leases`): they map to the modules' places now."""

    LEGACY_TOP_LEVEL = frozenset({"broker", "conf", "jobs", "pipelines"})
    MOVED: ClassVar[dict[str, str]] = {
        f"dejaq.broker.{name}": f"dejaq.broker.state.{name}"
        for name in ("assignment", "cron", "leases", "raft", "schedules")
    }

    def find_class(self, module: str, name: str) -> Any:
        if module.partition(".")[0] in self.LEGACY_TOP_LEVEL:
            module = f"dejaq.{module}"
        return super().find_class(self.MOVED.get(module, module), name)


class _SnapshotPickle:
    """What PySyncObj's serializer calls `pickle`: its own dump, and a load that knows
    the legacy module names (journal entries and Raft messages hold only builtins)."""

    dump = staticmethod(pysyncobj.pickle.dump)
    to_bytes = staticmethod(pysyncobj.pickle.to_bytes)

    @staticmethod
    def load(file: Any) -> Any:
        return SnapshotUnpickler(file).load()


pysyncobj.serializer.pickle = _SnapshotPickle  # type: ignore[assignment]
# PySyncObj pickles commands, Raft messages and snapshots with protocol 2, for Python 2
# peers: each bytes object travels as a call that encodes it from text. Protocol 5
# pickles a command or a message of small leases and acks in half the time or less, in
# a third fewer bytes. Any node reads either (`pickle.loads` is told by the data), so
# journals and snapshots written before still load.
setattr(pysyncobj.pickle, "__protocol", PICKLE_PROTOCOL)


class _SnapshotGzip:
    """Stands in for `gzip` in PySyncObj's serializer, which writes each snapshot through
    gzip at its default level, 9: on a snapshot's pickle some thirty times the CPU of
    level 1 (over half a second for a few MB), for a file a quarter smaller. Any level
    reads back the same."""

    @staticmethod
    def GzipFile(*args: Any, **kwargs: Any) -> gzip.GzipFile:
        kwargs.setdefault("compresslevel", SNAPSHOT_GZIP_LEVEL)
        return gzip.GzipFile(*args, **kwargs)


class _SnapshotOs:
    """Stands in for `os` in PySyncObj's serializer, which forks a child to write each
    snapshot: the child runs at a lower CPU priority. Its work can wait; the requests the
    node and its peers on the same host serve meanwhile cannot. Every node compacts its
    log after the same number of entries, so on a shared host three children start at
    once."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def fork() -> int:
        pid = os.fork()
        if pid == 0:
            # An exception here would return into the parent's code, in the child: a
            # child that may not lower its priority writes the snapshot at the parent's.
            with suppress(OSError):
                os.nice(SNAPSHOT_NICE)
        return pid


def _durable_replace(tmp: str, path: str) -> None:
    """Stands in for PySyncObj's serializer's rename of a snapshot written (or received)
    over the last: the file reaches the disk first, and the rename after it. Renamed
    unsynced, a crash can leave a snapshot of zeros in place of the last good one, the
    journal before it already compacted away."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    pysyncobj.atomic_replace.atomicReplace(tmp, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


pysyncobj.serializer.gzip = _SnapshotGzip  # type: ignore[attr-defined]
pysyncobj.serializer.os = _SnapshotOs()  # type: ignore[attr-defined]
pysyncobj.serializer.atomicReplace = _durable_replace  # type: ignore[attr-defined]


class _RaftZlib:
    """Stands in for `zlib` in PySyncObj's TCP connections, which compress every message.

    `zlib.compress` costs ~60-90 µs per call whatever the size (setting up the deflate
    state), more than applying a Raft command; the Raft messages of leases and acks are a
    few KB. Small messages go out as stored blocks: still a zlib stream, so any PySyncObj
    peer reads them, at a few µs. Large ones (snapshots) are still compressed.
    """

    decompress = staticmethod(zlib.decompress)

    @staticmethod
    def compress(data: bytes, level: int = -1) -> bytes:
        if len(data) >= COMPRESS_MIN_BYTES:
            return zlib.compress(data, 1)
        stored = zlib.compressobj(0, zlib.DEFLATED, 9, 1)
        return stored.compress(data) + stored.flush()


pysyncobj.tcp_connection.zlib = _RaftZlib  # type: ignore[attr-defined]

KDF_SALT = b"dejaq-broker-raft-aesgcm-v1"


FERNET_PREFIX = b"gAAAAA"  # base64 of Fernet's version byte and a timestamp's high bytes


class AeadEncryptor:
    """Authenticated encryption of Raft messages with AES-256-GCM.

    Replaces PySyncObj's Fernet (AES-CBC, HMAC, base64, several Python calls each way,
    and the HMAC checked twice per message), which costs ~30 µs per message; this is one
    C call each way. Token: 8-byte timestamp (authenticated as associated data), 12-byte
    nonce, ciphertext and tag. PySyncObj's per-connection random keys still bind every
    message to its connection, so one recorded on another cannot be replayed.

    Every node derives the same key from the password, for as long as the cluster lives,
    so nonces must never repeat: each process counts up from a random 96-bit start
    (random nonces would make a repeat likely after ~2^32 messages: weeks at full load).

    A peer on the other wire format (Fernet: DejaQ before this change, or PySyncObj as
    shipped) or with another password fails authentication: PySyncObj drops the
    connection, nothing is applied, and this logs why.
    """

    def __init__(self, password: str) -> None:
        kdf = PBKDF2HMAC(algorithm=hashes.SHA256(), length=32, salt=KDF_SALT, iterations=100_000)
        self._aead = AESGCM(kdf.derive(password.encode()))
        self._nonces = itertools.count(int.from_bytes(os.urandom(12), "big"))
        self._last_warning = -AUTH_LOG_EVERY_S

    def encrypt_at_time(self, data: bytes, at: int) -> bytes:
        stamp = at.to_bytes(8, "big")
        nonce = (next(self._nonces) % 2**96).to_bytes(12, "big")
        return stamp + nonce + self._aead.encrypt(nonce, data, stamp)

    def extract_timestamp(self, token: bytes) -> int:
        """Unauthenticated until `decrypt`; a forged one fails there and drops the link."""
        return int.from_bytes(token[:8], "big")

    def decrypt(self, token: bytes) -> bytes:
        try:
            return self._aead.decrypt(token[8:20], token[20:], token[:8])
        except (InvalidTag, ValueError):
            self._refused(token)
            raise

    def _refused(self, token: bytes) -> None:
        now = time.monotonic()
        if now - self._last_warning < AUTH_LOG_EVERY_S:
            return
        self._last_warning = now
        if token.startswith(FERNET_PREFIX):
            log.error(
                "a Raft peer speaks the Fernet wire format (a DejaQ broker from before "
                "AES-GCM Raft messages): dropped its connection; upgrade every node together"
            )
        else:
            log.error(
                "a Raft message failed authentication (another broker.raft_password?): "
                "dropped the connection"
            )


class LoopPoller:
    """PySyncObj's poller on the asyncio event loop: Raft runs in the loop's thread.

    With its own tick thread, every commit handed work between that thread and the
    event loop (a pipe write one way, `call_soon_threadsafe` the other) and the two
    contended for the GIL. Here sockets are watched by the loop, and `RaftNode` ticks
    after their events, after new commands, and every TICK_PERIOD_S for timers.
    Subscriptions made before the loop is attached are kept and registered then.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_event: Callable[[], None] = lambda: None
        self._subs: dict[int, tuple[Callable[[int, int], None], int]] = {}
        # A socket event PySyncObj fails to handle fails again at the next, many a second
        # (a connection in a state it does not expect, still readable): logged once a
        # streak. The streak ends when that socket's next event is handled, not another
        # socket's: the other peers' events go on meanwhile.
        self.events = Streak("Raft socket event", log=log)
        self._failed_fd: int | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, on_event: Callable[[], None]) -> None:
        self.loop, self.on_event = loop, on_event
        for fd, (callback, mask) in list(self._subs.items()):
            self._register(fd, callback, mask)

    def detach(self) -> None:
        for fd in list(self._subs):
            self._unregister(fd)
        self.loop = None

    def subscribe(self, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        self._subs[fd] = (callback, mask)
        if self.loop is not None:
            self._register(fd, callback, mask)

    def unsubscribe(self, fd: int) -> None:
        if self._subs.pop(fd, None) is not None and self.loop is not None:
            self._unregister(fd)

    def poll(self, timeout: float) -> None:
        """The loop polls; PySyncObj's tick ends here."""

    def readable(self) -> list[int]:
        """The Raft sockets watched for reading that have something to read now."""
        ready = select.poll()
        for fd, (_, mask) in self._subs.items():
            if mask & POLL_EVENT_TYPE.READ:
                ready.register(fd, select.POLLIN)
        return [fd for fd, _ in ready.poll(0)]

    def drain(self) -> None:
        """Handle the Raft sockets that are readable now, ahead of the loop's I/O phase."""
        for fd in self.readable():
            sub = self._subs.get(fd)
            if sub is not None:
                self._call(sub[0], fd, POLL_EVENT_TYPE.READ)

    def _register(self, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        assert self.loop is not None
        if mask & POLL_EVENT_TYPE.READ:
            self.loop.add_reader(fd, self._fire, fd, POLL_EVENT_TYPE.READ)
        else:
            self.loop.remove_reader(fd)
        if mask & POLL_EVENT_TYPE.WRITE:
            self.loop.add_writer(fd, self._fire, fd, POLL_EVENT_TYPE.WRITE)
        else:
            self.loop.remove_writer(fd)

    def _unregister(self, fd: int) -> None:
        """Stop watching `fd`, which may be closed already: PySyncObj's disconnect closes
        a connection's socket before it unsubscribes, and removing the reader of an fd
        also watched for writing (a connection with bytes still to send) modifies its
        registration, which fails on a closed fd. The selector has dropped the fd then,
        as the kernel did at its close. Raised out of the disconnect, the failure would
        leave the connection half torn down and never dialled again: its peer out of
        reach until a restart."""
        assert self.loop is not None
        for remove in (self.loop.remove_reader, self.loop.remove_writer):
            with suppress(OSError):
                remove(fd)

    def _fire(self, fd: int, event: int) -> None:
        sub = self._subs.get(fd)
        if sub is not None:
            self._call(sub[0], fd, event)
        self.on_event()

    def _call(self, callback: Callable[[int, int], None], fd: int, event: int) -> None:
        try:
            callback(fd, event)
        except Exception as e:
            self._failed_fd = fd
            self.events.failed(e)
        else:
            if fd == self._failed_fd:
                self._failed_fd = None
                self.events.ok()


class _SyncObj(SyncObj):
    """A SyncObj whose connections use `AeadEncryptor` instead of Fernet, and that does
    not broadcast every commit at once.

    With `appendEntriesUseBatch` off, PySyncObj sends each new entry at once (good: that
    is the commit latency) and, after applying committed entries, another round of
    AppendEntries just to tell followers the new commit index: twice the Raft messages
    per commit. Followers learn it with the next entry or heartbeat (`appendEntriesPeriod`)
    instead; the leader's commit, and so every 2xx, does not depend on it.
    """

    def __init__(
        self, *args: Any, encryptor: AeadEncryptor, poller: LoopPoller, **kwargs: Any
    ) -> None:
        self._aead = encryptor  # read by the transport during SyncObj.__init__
        self._loop_poller = poller
        self.on_all_committed: Callable[[], None] = lambda: None
        # The command this thread's next `_applyCommand` appends, as the object it was
        # pickled from (`own`): per thread, as the leader's duties commit from theirs
        # meanwhile. And those appended so, by their log entry's id.
        self._next_own = threading.local()
        self._own: dict[int, tuple[bytes, Callable[[], Any]]] = {}
        # The index of the first entry of this node's current term as leader (None while
        # it becomes leader): `RaftNode.leading`.
        self.term_start: int | None = None
        # False for a node started on an empty data dir beside peers (`RaftNode`): it
        # neither votes nor stands for election until `_join`, which calls `on_joined`.
        self.voting = True
        self.on_joined: Callable[[], None] = lambda: None
        # Why this node stopped taking part in Raft (a snapshot received from the leader
        # did not load: `_SyncObj__loadDumpFile`), and what then ends the node.
        self.failure: DataDirError | None = None
        self.on_failure: Callable[[], None] = lambda: None
        super().__init__(*args, **kwargs)

    @contextmanager
    def own(self, apply: Callable[[], Any]) -> Iterator[None]:
        """The command this thread appends next, here, is applied by calling `apply`
        (the call it was pickled from), not by unpickling its log entry: the leader
        applies every command of the cluster, and unpickling them cost it as much as a
        follower. `apply` must not be changed until it is applied."""
        self._next_own.apply = apply
        try:
            yield
        finally:
            self._next_own.apply = None  # taken, unless pickling the command failed

    def _applyCommand(self, command: bytes, callback: Any, commandType: int | None = None) -> None:
        """Append a command, noting it if it is this thread's `own`. The entry is the
        same bytes object from the queue to the log (PySyncObj's journal keeps it in
        memory), so its id finds the command's call until it is applied."""
        own = getattr(self._next_own, "apply", None)
        self._next_own.apply = None
        if own is None or commandType != _COMMAND_TYPE.REGULAR:
            super()._applyCommand(command, callback, commandType)
            return
        if len(self._own) >= OWN_MAX:  # a leader cut off, appending what never commits
            self._own.clear()
        entry = bytes((commandType,)) + command
        self._own[id(entry)] = (entry, own)
        super()._applyCommand(entry, callback)

    def _SyncObj__doApplyCommand(self, command: bytes) -> Any:  # overrides SyncObj's
        own = self._own.pop(id(command), None)
        if own is not None and own[0] is command:
            return own[1]()
        return _do_apply_command(self, command)

    def load_snapshot(self) -> None:
        """Load this node's snapshot now, at start: PySyncObj loads it at the first tick
        and, where it cannot, logs it and goes on with the journal after it alone. Such
        a node never applies an entry again, yet votes and can lead, and then no write
        commits anywhere, restart or not."""
        self._SyncObj__needLoadDumpFile = False
        path = self._SyncObj__conf.fullDumpFile
        if path is None or not os.path.isfile(path):
            return
        why = self._unloaded(clear_journal=False)
        if why is not None:
            raise DataDirError(f"{path} {why}: {RECOVERY}")

    def _SyncObj__loadDumpFile(self, clearJournal: bool) -> None:  # overrides SyncObj's
        """Load the snapshot the leader sent, written over this node's own (PySyncObj's
        install path, for a follower whose next entry the leader's log no longer holds).

        Where it does not load (the warehouse out of reach while the indexes are rebuilt
        from it, say), PySyncObj logs it and goes on: the node keeps the state from
        before the snapshot, or part of the snapshot's, applies no entry again, yet
        votes and stands for election, and takes each copy the leader sends again, each
        written and fsynced on the event loop. Instead it stops taking part at once
        (`failure`: no vote, no election, nothing applied) and ends (`on_failure`), as a
        damaged file at start ends it. Started again, it loads the file as its own
        snapshot, or exits saying why."""
        if self.failure is not None:
            return
        why = self._unloaded(clear_journal=clearJournal)
        if why is None:
            return
        self.voting = False
        self.failure = DataDirError(
            f"{self._SyncObj__conf.fullDumpFile}, the snapshot received from the leader, "
            f"{why}: this node takes no further part in Raft and exits; start it again "
            "once the cause is put right, and it loads the file at start or exits saying why"
        )
        log.error("%s", self.failure)
        self.on_failure()

    def _unloaded(self, clear_journal: bool) -> str | None:
        """Load the snapshot file as PySyncObj does: why it did not load, or None."""
        serializer = self._SyncObj__serializer
        try:
            data = serializer.deserialize()
        except Exception as e:
            return f"cannot be read ({e!r})"
        serializer.deserialize = lambda: data  # PySyncObj's load, on what was read
        try:
            _load_dump_file(self, clearJournal=clear_journal)
        finally:
            del serializer.deserialize
        if self._SyncObj__raftLastApplied != data[1][1]:
            return "did not load (its error is logged above)"
        return None

    @property
    def _poller(self) -> LoopPoller:
        return self._loop_poller

    @_poller.setter
    def _poller(self, _: Any) -> None:
        """SyncObj.__init__ assigns its own poller; ours stays."""

    @property
    def encryptor(self) -> AeadEncryptor:
        return self._aead

    def _getEncryptor(self) -> AeadEncryptor:
        return self._aead

    def _SyncObj__applyLogEntries(self) -> bool:  # overrides SyncObj.__applyLogEntries
        """Apply what is committed; on the leader, once the whole log is, first send the
        commands that waited for that (`RaftNode._all_committed`): the followers take
        them while this node applies. Nothing, once the node stopped taking part
        (`failure`)."""
        if self.failure is not None:
            return False
        if (
            self._SyncObj__raftCommitIndex > self._SyncObj__raftLastApplied
            and self._SyncObj__raftCommitIndex == self._SyncObj__getCurrentLogIndex()
            and self._isLeader()
        ):
            self.on_all_committed()
        if self._own and not self._isLeader():  # appended in a term that has ended
            self._own.clear()
        _apply_log_entries(self)
        if not self.voting:
            self._join()
        return False

    def _join(self) -> None:
        """Vote and stand from now on, once a leader has brought this node up to date:
        it has applied what the leader last said is committed, an entry of the leader's
        own term, so every entry committed before that term too. Recorded first
        (`on_joined`), and as a vote for that leader in its term: this node's earlier
        life may have voted in it."""
        leader = self._SyncObj__raftLeader
        commit = self._SyncObj__leaderCommitIndex
        if leader is None or commit is None or self._SyncObj__raftLastApplied < commit:
            return
        entries = self._SyncObj__getEntries(commit, 1)
        term = self._SyncObj__raftCurrentTerm
        if not entries or entries[0][2] != term:
            return
        self.on_joined()
        self._SyncObj__setCurrentTerm(term, leader.id)
        self.voting = True

    def _SyncObj__onBecomeLeader(self) -> None:  # overrides SyncObj.__onBecomeLeader
        """Note the index of the no-op entry PySyncObj appends on becoming leader: only
        once that is applied has this node applied every entry committed before its term
        (a new leader learns of their commit with its first own entry's)."""
        self.term_start = None
        _on_become_leader(self)
        self.term_start = self._SyncObj__noopIDx

    def _SyncObj__connectedToAnyone(self) -> bool:  # overrides SyncObj.__connectedToAnyone
        """Asked by a tick only once the election deadline has passed: read what peers sent
        first, so a follower whose process stalled (a pause, a stop, a starved core) does
        not start an election that heartbeats already in its sockets would have prevented.
        After a stall the loop runs its timers, so a tick, before it reads the sockets.

        The clock is read before the sockets: a stall between the two cannot make
        heartbeats that arrived during it look late, wherever in the tick it lands. (Raft's
        deadlines are on PySyncObj's clock, CLOCK_MONOTONIC_RAW, not `time.monotonic`.)
        """
        if not self.voting:  # stands for no election until it has joined (`_join`)
            return False
        now = raft_clock()
        self._loop_poller.drain()
        if self._SyncObj__raftElectionDeadline >= now:
            return False
        return _connected_to_anyone(self)

    def _SyncObj__onMessageReceived(self, node: Any, message: dict) -> None:
        """Keep a follower's next index from moving back on an older entry's success.

        Entries are pipelined: the follower acknowledging entry k may already have k+1 in
        flight. PySyncObj sets the next index to k+1 all the same, so the next append
        sends k+1 again; the follower then truncates what it has (applied, maybe) and
        appends the same entries anew, twice the Raft traffic to the slower follower. A
        refusal (`reset`) still moves the index back: that is how a diverged log heals.

        A node that has not joined (`_join`) ignores vote requests and leadership
        transfers: it votes in no election until it is up to date.
        """
        if not self.voting and message.get("type") in ("request_vote", "timeout_now"):
            return None
        if message.get("type") != "next_node_idx" or message["reset"] or not message["success"]:
            return _on_message_received(self, node, message)
        next_index = self._SyncObj__raftNextIndex
        sent = next_index.get(node, 0)
        _on_message_received(self, node, message)
        if next_index.get(node, 0) < sent:
            next_index[node] = sent


_apply_log_entries = SyncObj._SyncObj__applyLogEntries  # type: ignore[attr-defined]
_do_apply_command = SyncObj._SyncObj__doApplyCommand  # type: ignore[attr-defined]
_on_message_received = SyncObj._SyncObj__onMessageReceived  # type: ignore[attr-defined]
_connected_to_anyone = SyncObj._SyncObj__connectedToAnyone  # type: ignore[attr-defined]
_on_become_leader = SyncObj._SyncObj__onBecomeLeader  # type: ignore[attr-defined]
_load_dump_file = SyncObj._SyncObj__loadDumpFile  # type: ignore[attr-defined]


class Listener(Protocol):
    """Node-local side effects of applied commands (the indexes). It is told of every
    topic in the replicated state, those this node does not serve too."""

    def pending(self, topic: str, state: TopicState, handles: list[int]) -> None: ...
    def gone(self, topic: str, handles: bytes) -> None: ...
    def reset(self, states: dict[str, TopicState]) -> None: ...


class NotCommitted(RuntimeError):
    """The command did not reach a majority (no leader, leader changed, timeout)."""


class Halted(NotCommitted):
    """The node began to stop while its thread waited for the command: Raft no longer
    ticks here once the server ends, so the wait would only run out its timeout. The
    command may still commit on the other nodes, as one whose wait timed out."""


class CommandFailed(RuntimeError):
    """A command raised what is no Exception (a panic in the compiled core): raised as
    itself, it would end the thread that committed it (a leader's duties)."""


def _raised(result: BaseException) -> Exception:
    return result if isinstance(result, Exception) else CommandFailed(repr(result))


# PySyncObj's reasons for not committing a command, as a log line or a 503 says them.
_FAILURES = {
    FAIL_REASON.QUEUE_FULL: "the leader's command queue is full",
    FAIL_REASON.MISSING_LEADER: "there is no leader (an election is under way)",
    FAIL_REASON.DISCARDED: "a new leader was elected before it committed",
    FAIL_REASON.NOT_LEADER: "this node stopped leading before it committed",
    FAIL_REASON.LEADER_CHANGED: "the leader changed before it committed",
    FAIL_REASON.REQUEST_DENIED: "Raft denied it",
    FAIL_REASON.UNKNOWN_OUTCOME: "its outcome is unknown",
}


def not_committed(reason: int) -> NotCommitted:
    """A command's failure, with PySyncObj's reason (a FAIL_REASON) in words."""
    return NotCommitted(f"Raft command not committed: {_FAILURES.get(reason, reason)}")


def committed(
    method: Callable[..., Any], *args: Any, timeout: float, halted: threading.Event | None = None
) -> Any:
    """Call a replicated method of `BrokerState` and wait for its result, from a thread
    other than the event loop; NotCommitted if a majority did not take it, Halted once
    `halted` is set, and what the command raised (on every node alike) if it failed."""
    done = AsyncResult()
    method(*args, callback=done.onResult)
    deadline = time.monotonic() + timeout
    while not done.event.wait(min(HALT_CHECK_S, max(0.0, deadline - time.monotonic()))):
        if halted is not None and halted.is_set():
            raise Halted("Raft command not waited for: this node is stopping")
        if time.monotonic() >= deadline:  # PySyncObj holds commands while there is no leader
            raise NotCommitted(
                f"Raft command not committed within {timeout:g} s (no leader, or no majority)"
            )
    if done.error != FAIL_REASON.SUCCESS:
        raise not_committed(done.error)
    if isinstance(done.result, BaseException):
        raise _raised(done.result)
    return done.result


class BrokerState(SyncObjConsumer):
    """Replicated: per-topic lease state and the Raft-to-HTTP address book.

    The topics are those the log configured (`_apply`), whatever each node's own file
    names: a node's file only adds its own topics' states, unconfigured, until then."""

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
        # Leases granted by numbered lease commands, every topic's: a lease's number (its
        # receipts') is the same on every node and names one lease in the whole cluster.
        self.lids = 0

    def _deserialize(self, data: dict[str, Any]) -> None:
        super()._deserialize(data)
        if "lids" not in data:  # a snapshot from before receipts numbered no lease
            self.lids = 0
        for name, t in self.topic_conf.items():  # the snapshot's state, where it has one
            self.topics.setdefault(name, TopicState(t.buckets, self.max_deliveries))
        self.listener.reset(self.topics)

    @replicated
    def register(self, raft_addr: str, http_addr: str) -> None:
        self.nodes[raft_addr] = http_addr

    @replicated
    def command(self, topic: str, op: str, args: tuple) -> Any:
        """One command; what it raises is its result, as in `batch`: raised out of the
        apply, PySyncObj would apply this entry again at every tick and never the
        entries after it, a node stalled for good."""
        return self._applied(topic, op, args)

    @replicated
    def batch(self, commands: list[tuple[str, str, tuple]]) -> list[Any]:
        """Group commit: many requests' commands in one log entry, each result apart, or
        the Exception it raised (deterministic on every node: it fails that command
        only). Leases and acks by receipt are applied in the compiled core, the rest
        by `_apply`.

        A lease may carry its request's id where the core reads the mark of a numbered
        lease (True), and the core reads no id: runs of commands go to the core as one,
        and the ids of their leases that granted are remembered once the run is
        applied, in order, as `_apply` remembers each as it leases (those the core
        hands it, too): a run holds no command that forgets one (a leave or an expiry
        ends it). A lease that may be the same request again (its id is its consumer's
        last, or a lease before it in the run carries it) ends the run too, and is
        applied alone by `_apply`, from the state every command before it left. Every
        node does the same, so all hold the same ids."""
        marked = [
            i
            for i, c in enumerate(commands)
            if type(c) is tuple and len(c) == 3 and c[1] in _MARKED
        ]
        if not marked:
            return TRANSITIONS.apply_group(self, commands, self._apply)
        results: list[Any] = []
        start = 0  # the run is commands[start:], up to the next cut
        asked: list[tuple[int, TopicState, str, str]] = []  # (place, state, consumer, id)
        ids: set[str] = set()  # of `asked`

        def apply_run(end: int) -> None:
            got = TRANSITIONS.apply_group(self, commands[start:end], self._apply)
            for place, st, consumer, request in asked:
                record = got[place - start]
                if type(record) is LeaseRecord:
                    st.requested(consumer, request, record)
            results.extend(got)
            asked.clear()
            ids.clear()

        topics = self.topics
        for i in marked:
            topic, op, args = commands[i]
            if op == "lease":
                if not (
                    type(args) is tuple
                    and len(args) > 5
                    and type(request := args[5]) is str
                    and type(consumer := args[0]) is str
                    and type(topic) is str
                ):
                    continue  # no id (True), or malformed: the core fails it alone
                st = topics.get(topic)
                if st is None or request in ids or st.again(consumer, request) is not None:
                    apply_run(i)
                    results.append(self._applied(topic, op, args))
                    start = i + 1
                else:
                    asked.append((i, st, consumer, request))
                    ids.add(request)
            elif asked:  # a leave or an expiry: it may forget one
                apply_run(i)
                start = i
        apply_run(len(commands))
        return results

    def _applied(self, topic: str, op: str, args: tuple) -> Any:
        """`_apply`, what it raises its result (a panic in the core is a BaseException)."""
        try:
            return self._apply(topic, op, args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            return e

    def _apply(self, topic: str, op: str, args: tuple) -> Any:
        st = self.topics.get(topic)
        if st is None:
            if op != "configure":  # no leader configured the topic before it
                raise KeyError(f"no topic {topic!r} in the replicated state")
            # A topic of the leader's configuration that this node's file lacks (a topic
            # added in a rolling restart): the node keeps its state all the same, so its
            # snapshots carry it, and restarted with the topic in its file it serves it.
            st = self.topics[topic] = TopicState(*args)
        if op == "lease":
            if len(args) <= 5:  # from before receipts (4: before rate limits): unnumbered
                return st.lease(*args)
            # A numbered lease: its sixth argument says so, True or the id its client
            # made for the request (`TopicState.again`).
            request = args[5] if _asks(args) else None
            if request is not None and (again := st.again(args[0], request)) is not None:
                return again
            self.lids += 1
            seen = args[6] if len(args) > 6 else None  # from before the pick's seq: None
            record = st.lease(args[0], args[1], args[2], args[3], args[4], self.lids, seen)
            if request is not None:
                st.requested(args[0], request, record)
            return record
        if op in ("ack", "reject"):
            return getattr(st, op)(*args)
        if op == "touch":
            return st.touch(*args)
        if op == "extend":
            return st.extend(*args)
        if op == "cancel":
            return st.cancel(*args)
        if op == "purge":
            if len(args) == 2:  # (now, pending), from before it carried its trim: as then
                return st.purge(args[0], st.trimmed_upto(), args[1])
            return st.purge(*args)
        if op == "pause":
            return st.pause(*args)
        if op == "configure":
            return st.configure(*args)
        if op == "history":
            return st.begin_history(*args)
        if op == "redrive":
            result = st.redrive(*args)
            if result is not None:
                self.listener.pending(topic, st, mhs(result[0]))
            return result
        if op == "trim":
            handles = st.trim(*args)
            self.listener.gone(topic, handles)
            return handles
        if op == "nack":
            refused, pending, dead = st.nack(*args)
            self.listener.pending(topic, st, pending)
            return refused, dead
        if op == "leave":
            pending = st.leave(*args)
        elif op == "expire":
            pending = st.expire(*args)
        elif op == "reschedule":
            refused = st.reschedule(*args)
            pending = [] if refused else [mh(args[0])]
            self.listener.pending(topic, st, pending)
            return refused
        else:
            raise ValueError(f"unknown command {op!r}")
        self.listener.pending(topic, st, pending)
        return pending


def _asks(lease: tuple) -> bool:
    """Whether a lease command's arguments carry its request's id (a str where others
    carry True)."""
    return len(lease) > 5 and type(lease[5]) is str


# A group commit's commands that `BrokerState.batch` looks at: leases, and those that
# may forget a consumer's last request.
_MARKED = ("lease", "leave", "expire")


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
        raftMinTimeout=ELECTION_TIMEOUT_S[0],
        raftMaxTimeout=ELECTION_TIMEOUT_S[1],
        leaderFallbackTimeout=LEADER_FALLBACK_S,
        connectionRetryTime=0.5,
        commandsQueueSize=100_000,
        logCompactionMinEntries=20_000,
        logCompactionMinTime=60,
        useFork=os.name == "posix",
        autoTick=False,  # ticked by RaftNode on the event loop
        # Without a tick thread, SyncObj() itself retries a failed bind, spinning a core
        # forever (the default retries without end): try once, fail (`RaftNode`).
        maxBindRetries=1,
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
        on_joined: Callable[[], None] | None = None,
    ) -> None:
        """`on_joined`: this node's data dir was empty beside peers that may hold the
        cluster's history; it neither votes nor stands for election until a leader has
        brought it up to date, and then calls `on_joined` (which records that) first."""
        self.raft_addr = raft_addr
        self.members = frozenset([raft_addr, *peers])
        self.state = BrokerState(topics, broker.max_deliveries, listener)
        conf = raft_conf(broker, data_dir, multi_node=bool(peers))
        check_raft_files(data_dir)
        self.poller = LoopPoller()
        try:
            self.sync = _SyncObj(
                raft_addr,
                peers,
                conf,
                consumers=[self.state],
                encryptor=AeadEncryptor(conf.password),
                poller=self.poller,
            )
        except SyncObjException as e:
            raise ConfigError(f"cannot listen on the Raft address {raft_addr} ({e})") from None
        if on_joined is not None:
            self.sync.voting, self.sync.on_joined = False, on_joined
        try:
            self.sync.load_snapshot()
        except BaseException:
            self.sync.destroy()
            raise
        self.on_lag: Callable[[float], None] = lambda lag: None
        # Told of each command this node committed (topic, op), once applied here.
        self.on_committed: Callable[[str, str], None] = lambda topic, op: None
        self.sync.on_all_committed = self._all_committed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._catching_up: asyncio.Future[bool] | None = None  # `lead`'s shared look
        self._tick_due = False
        # A tick that fails fails again at the next, many a second: logged once a streak.
        self.ticks = Streak("Raft tick", log=log)
        self._flush_due = False
        self._ticker: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._pending: list[tuple[tuple[str, str, tuple], asyncio.Future, float]] = []
        self._in_flight: dict[int, asyncio.TimerHandle] = {}  # by group: until applied
        self._uncommitted: set[int] = set()  # groups holding an in-flight slot
        self._batches = 0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start running Raft on `loop` (in its thread); until then nothing ticks."""
        self._loop = loop
        self.poller.attach(loop, self._tick_soon)
        self._due = loop.time()
        self._periodic()

    def attached(self) -> bool:
        """Whether Raft runs on a loop (`attach`)."""
        return self._loop is not None

    def detach(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        self.poller.detach()
        self._loop = None

    def _tick_soon(self) -> None:
        """One tick for everything that happened in this loop iteration."""
        if not self._tick_due and self._loop is not None:
            self._tick_due = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._tick_due = False
        try:
            self.sync.doTick(0)
        except Exception as e:
            self.ticks.failed(e)
        else:
            self.ticks.ok()

    def _periodic(self) -> None:
        if self._loop is None:
            return
        now = self._loop.time()
        lag = max(0.0, now - self._due)
        self.on_lag(lag)
        if lag >= WARN_LAG_S:
            log.warning(
                "the event loop ran %.2f s late: Raft heartbeats were late too "
                "(followers elect another leader after %.1f-%.1f s)",
                lag,
                *ELECTION_TIMEOUT_S,
            )
        self._due = now + TICK_PERIOD_S
        self._tick_soon()
        self._ticker = self._loop.call_at(self._due, self._periodic)

    def is_leader(self) -> bool:
        return self.sync._isLeader()

    def leading(self) -> bool:
        """Leader, with every entry committed before its term applied here. Until then
        its state lacks commands the cluster committed (PySyncObj says leader at once,
        and applies them once its own first entry commits): an answer read from it would
        refuse an ack of a lease it has not applied yet, say."""
        sync = self.sync
        if not sync._isLeader():  # before `term_start`: becoming leader resets it first
            return False
        start = sync.term_start
        return start is not None and sync._SyncObj__raftLastApplied >= start

    async def lead(self, wait_s: float) -> bool:
        """Whether this node is `leading`, waiting up to `wait_s` while it leads and
        applies the entries committed before its term. The requests waiting share one
        look every CATCH_UP_STEP_S, on the loop that applies the entries they wait for."""
        if self.leading():
            return True
        if not self.is_leader():
            return False
        if self._catching_up is None or self._catching_up.done():
            self._catching_up = asyncio.ensure_future(self._catch_up())
        try:
            return await asyncio.wait_for(asyncio.shield(self._catching_up), wait_s)
        except TimeoutError:
            return False

    async def _catch_up(self) -> bool:
        """Whether this node came to lead, looked at until it does or stops leading."""
        while not self.leading():
            if not self.is_leader():
                return False
            await asyncio.sleep(CATCH_UP_STEP_S)
        return True

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

    def http_addresses(self) -> dict[str, str]:
        """The HTTP address of each member by its Raft address. The replicated map keeps
        every address a node ever registered: after a restart on other ports, the old."""
        return {r: h for r, h in self.state.nodes.items() if r in self.members}

    def commit_index(self) -> int:
        """The last log index this node knows committed."""
        return self.sync._SyncObj__raftCommitIndex

    def log_entries(self) -> int:
        """Entries in the Raft log (PySyncObj compacts it into a snapshot now and then)."""
        return self.sync.getStatus()["log_len"]

    async def commit(self, topic: str, op: str, *args: Any) -> Any:
        """Replicate a command; return its result once a majority has it.

        Commands arriving while earlier ones are in flight, or in the same event-loop
        iteration, are grouped into one log entry: under load one Raft round trip
        serves many requests. A command not committed within COMMIT_TIMEOUT_S of its
        arrival fails with NotCommitted.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.append(((topic, op, args), fut, loop.time()))
        if not self._flush_due and len(self._uncommitted) < MAX_IN_FLIGHT:
            self._flush_due = True
            loop.call_soon(self._flush, loop)
        result = await fut
        if isinstance(result, BaseException):
            raise _raised(result)
        self.on_committed(topic, op)
        return result

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send the waiting commands, a group an entry, while entries are free. One that
        waited COMMIT_TIMEOUT_S for an entry fails and is not sent: its caller is told it
        did not commit, so it must not (and its time stamp is as old as that, at most
        `STAMPED_WITHIN_MS` when it is logged)."""
        self._flush_due = False
        stale = loop.time() - COMMIT_TIMEOUT_S
        waited = next((i for i, p in enumerate(self._pending) if p[2] > stale), None)
        for _, fut, _ in self._pending[:waited]:  # in order of arrival: the stale first
            if not fut.done():
                fut.set_exception(NotCommitted("timed out waiting for a Raft log entry"))
        del self._pending[:waited]
        while self._pending and len(self._uncommitted) < MAX_IN_FLIGHT:
            group, self._pending = self._pending[:MAX_GROUP], self._pending[MAX_GROUP:]
            self._batches += 1
            batch_id = self._batches
            self._uncommitted.add(batch_id)
            futs = [f for _, f, _ in group]
            # One timer per group, not per request; its oldest command sets the deadline.
            self._in_flight[batch_id] = loop.call_at(
                group[0][2] + COMMIT_TIMEOUT_S, self._expire, loop, batch_id, futs
            )

            def done(result: Any, err: int, batch_id: int = batch_id, futs=futs) -> None:
                self._done(loop, batch_id, futs, result, err)  # ticks run in the loop

            commands = [c for c, _, _ in group]
            with self.sync.own(partial(self.state.batch, commands, _doApply=True)):
                self.state.batch(commands, callback=done)
        if len(self.members) == 1 and self.sync._isLeader():
            # A tick commits and applies what the log held when it began and appends new
            # commands last; alone, nothing else ticks soon after (no follower answers),
            # and on uvloop the group waited for the periodic tick: 10 ms per request.
            # Appended now, the next tick commits and applies it.
            self.sync._checkCommandsToApply()
        self._tick_soon()

    def _all_committed(self) -> None:
        """Every group sent is committed, not yet applied: send the waiting commands now.

        Applying a group of leases and acks takes the leader a millisecond or more; sent
        after it, the next group would reach the followers that much later, and the
        other core would idle meanwhile.
        """
        self._uncommitted.clear()
        if self._pending and self._loop is not None:
            self._flush(self._loop)
            self.sync._checkCommandsToApply()  # into the log and sent, before applying

    def _done(self, loop, batch_id: int, futs: list, results: Any, err: int) -> None:
        self._uncommitted.discard(batch_id)
        timer = self._in_flight.pop(batch_id, None)
        if timer is not None:
            timer.cancel()
        for i, fut in enumerate(futs):
            _resolve(fut, results[i] if err == FAIL_REASON.SUCCESS else None, err)
        self._flush(loop)

    def _expire(self, loop, batch_id: int, futs: list) -> None:
        """The group's Raft callback is late: fail its requests and free the slot."""
        self._uncommitted.discard(batch_id)
        self._in_flight.pop(batch_id, None)
        for fut in futs:
            if not fut.done():
                fut.set_exception(NotCommitted("timed out waiting for a Raft majority"))
        self._flush(loop)

    def destroy(self) -> None:
        self.sync.destroy()


def _resolve(fut: asyncio.Future, result: Any, err: int) -> None:
    if fut.done():
        return
    if err == FAIL_REASON.SUCCESS:
        fut.set_result(result)
    else:
        fut.set_exception(not_committed(err))
