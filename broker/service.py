"""One broker node: indexes, Raft member, background duties, and the operations the
routers call. Leader-only operations assume the caller checked leadership (the routers
forward to the leader otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
from kafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)
from kafka.record.default_records import DefaultRecordBatchBuilder

from dejaq.broker.api.keys import KeyRing
from dejaq.broker.api.metrics import Metrics
from dejaq.broker.api.responses import LedgerLag, NodeTopic, RetentionView
from dejaq.broker.state.data_dir import Identity, admit, lock, mark_joined
from dejaq.broker.state.handles import handles_in, mh, mhs, packed_handles
from dejaq.broker.state.leases import (
    Again,
    Dead,
    LeaseRecord,
    Refusal,
    RetryBackoff,
    TopicState,
    consecutive,
    pick_count,
)
from dejaq.broker.state.raft import STAMPED_WITHIN_MS, Halted, NotCommitted, RaftNode, committed
from dejaq.broker.state.settlements import Entry, count, last, redriven, seqs, settlements
from dejaq.broker.storage import message_json
from dejaq.broker.storage.checkpoints import Health, checkpoint, lag
from dejaq.broker.storage.head_store import ReserveReached
from dejaq.broker.storage.index import HeadsUnreadable, LoadStopped, TopicIndex, load_log
from dejaq.broker.storage.ledger_writer import (
    COMPACT_EVERY,
    Claimed,
    Contested,
    Names,
    Rival,
    app_id,
    compact_dead_letters,
    compact_ledger,
    foreign,
    tag_of,
    up_to,
)
from dejaq.broker.storage.row_store import Row, Taken
from dejaq.broker.streak import Streak
from dejaq.broker.wakeups import Wakeups
from dejaq.conf.kafka_clients import close_producer, python_config
from dejaq.conf.settings import Delivery, KafkaConfig, Settings, TopicConfig, TopicKind
from dejaq.conf.tables import LedgerEvent
from dejaq.pipelines.retention import RetentionRun, period_s, restore, retain

log = logging.getLogger("dejaq.broker")

FOLLOW_PERIOD_S = 0.2  # new buffer rows are indexed within this of their Delta commit
# An index refresh failing this long makes the node unready, naming the topic and the
# error: its new messages are not indexed meanwhile. Long past a transient failure of
# the object store (a throttled or retried read fails a few rounds, seconds), short
# against the minutes an operator would otherwise learn of it from a stalled topic.
REFRESH_ALERT_S = 30.0
# A failed repair of unreadable heads is tried again after this, doubled per failure.
REPAIR_BACKOFF_MIN_S, REPAIR_BACKOFF_MAX_S = 1.0, 60.0
DUTY_PERIOD_S = 0.05
# How long a stop waits for a load to end: it checks between slices of rows, but a read
# of the warehouse it waits on ends when the object store answers.
LOAD_STOP_WAIT_S = 10.0
# How long a stop waits for the duties, all of them together: each checks the stop
# between steps, but a step under way (a retention rewrite, a checkpoint's Delta commit)
# ends when the warehouse answers. One deadline, so four duties cannot hold it four times.
DUTY_STOP_WAIT_S = 5.0
CHECKPOINT_PERIOD_S = 1.0
# A ledger tag of another Raft history is taken over only if the ledger had no commit
# for this long (read twice this far apart otherwise): a live cluster's checkpoints,
# one a second under load, move it well within.
TAKEOVER_QUIET_S = 5 * CHECKPOINT_PERIOD_S
# Events a checkpoint writes at most: a backlog the ledger could not take for hours is
# written a part at a time, each part's id column well within Arrow's 2 GiB of strings.
CHECKPOINT_MAX_EVENTS = 1_000_000
# Settled events forgotten per Raft command after a checkpoint. Each trim stalls every
# node's event loop while it forgets (about 0.3 µs an event), and each costs every node a
# log entry's transport and a forget's fixed cost (~25 µs): at batch 100, slices of 500
# were a third of the log, and 2,000 took 15% off the CPU per message of the three nodes
# (`bench/broker_costs.py`, 5.9-6.1 against 4.9-5.6 µs). A forget's walk of the id table
# costs less an event the more it forgets at once (0.17-0.20 µs at 2,000, 0.11 at 5,000,
# 200,000 held): 5,000 took each node's forget from 0.26-0.29 to 0.20-0.24 µs a message
# (three runs of each, alternated), the stalls 1-2 ms, well under a lease's p99.
TRIM_SLICE = 5000
# A long poll looks for messages again at each change of its topic (`Wakeups`), when its
# timeline's next message is due or its topic's first nack delay or retry backoff ends,
# and at least this often when time alone can make one leasable otherwise: a rate
# limit's refill, a due time passed that its pick still skipped.
LONG_POLL_STEP_S = 0.02
# And at least this often otherwise: a change no command or index refresh told of (none
# known) costs a poll this much delay at most, where a step each costs the idle CPU.
IDLE_POLL_STEP_S = 1.0
# Commands after which a topic may hold something to lease: they end leases, move
# messages or buckets, or lift a pause (a lease, a heartbeat or an extension do not).
WAKING = frozenset(
    {"ack", "reject", "nack", "leave", "expire", "reschedule", "redrive", "pause", "configure"}
)
# Messages per Raft command of a redrive or purge: each applies in one event-loop tick on
# every node (about a microsecond a message), a stall of ~0.5 ms.
OPS_SLICE = 500
# Reads a redrive, purge, cancel or reschedule makes, and picks a lease makes, while
# checkpoints keep trimming under it
REDRIVE_READS = 3
# Every lease and ack allocates objects that live until checkpointed; at CPython's default
# (a young collection per 700 net allocations) 200k messages at batch 100 cost each node
# ~8 full collections of ~100 ms and 0.8-1.6 s of GC in all. 10k: none, and 0.3-0.7 s.
GC_YOUNG_OBJECTS = 10_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def trim_cuts(entries: list[Entry], upto: int) -> list[int]:
    """Where to trim a checkpoint of `entries` up to `upto`, a slice per Raft command: each
    applies in one event-loop tick on every node, so requests wait milliseconds behind
    it, not tens of them."""
    return [*islice(seqs(entries), TRIM_SLICE - 1, None, TRIM_SLICE), upto]


def first_events(entries: list[Entry], trimmed: int, n: int) -> list[Entry]:
    """The entries holding the first `n` events past `trimmed`, the last of them cut
    there (a follower's acks join one run until it leads and checkpoints); the deaths a
    trim kept, in front, do not count: they alone would hold the rest back."""
    total = 0
    for i, e in enumerate(entries):
        if last(e) <= trimmed:
            continue
        left, size = n - total, count(e)
        if size >= left:
            return [*entries[:i], e if size == left else e.part(e.seq, e.seq + left)]
        total += size
    return entries


class Problem(Exception):
    """An HTTP error as RFC 9457 problem details."""

    def __init__(self, status: int, title: str, detail: str = "", **extra: Any) -> None:
        super().__init__(detail or title)
        self.status, self.title, self.detail, self.extra = status, title, detail, extra


@dataclass
class Settled:
    ok: int
    refused: dict[str | int, Refusal]  # by id, or by receipt
    # Of a nack: out of deliveries, by id (by handle in hex where unnamed, `_ids_of`).
    dead: list[str] = field(default_factory=list)

    def settled_or_409(self, verb: str) -> int:
        """How many were settled; a 409 naming each refused id and why, if any was."""
        if self.refused:
            raise Problem(
                409,
                f"some messages could not be {verb}",
                "; ".join(f"{m}: {r}" for m, r in self.refused.items()),
                settled=self.ok,
                refused={str(m): str(r) for m, r in self.refused.items()},
            )
        return self.ok


@dataclass
class Refreshes(Streak):
    """A topic's index refreshes on this node: the current streak of failures, if any,
    which readiness and `/metrics` show."""

    topic: str = ""

    def alert(self, bound_s: float) -> str | None:
        """Why the node is not ready, once the streak has lasted `bound_s`."""
        failing_s, error = self.failing_for(), self.last_error
        if failing_s < bound_s or failing_s == 0.0:
            return None
        return (
            f"indexing {self.topic} has failed for {failing_s:.0f} s ({error}); "
            "its new messages wait in the buffer"
        )


@contextlib.contextmanager
def _going_on(duty: Streak) -> Iterator[None]:
    """A duty thread's round: what it raises is told to the duty's streak and the next
    round tries again, a core panic (a `BaseException`) too, or the thread would end with
    its duty undone."""
    try:
        yield
    except Halted:  # the node stops: no round comes next
        pass
    except NotCommitted as e:  # a leader change: the next round asks again
        log.warning("%s: %s; retrying", duty.what, e)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        duty.failed(e)
    else:
        duty.ok()


def _head(index: TopicIndex, mid: str | int) -> Taken | None:
    """`TopicIndex.head`, a 503 where the node cannot read it (its repair under way)."""
    try:
        return index.head(mid)
    except HeadsUnreadable as e:
        raise Problem(503, "messages unreadable on this node", str(e)) from None


def _refuse_removed_buckets(cfg: TopicConfig, dead: list[Dead]) -> None:
    """A 409 if a dead message died in a bucket the topic no longer has (its buckets
    lowered since, its buffer row gone by retention): no bucket would index it, and its
    row put back into the buffer would keep every node from starting."""
    beyond = [(mid, bucket) for mid, bucket, _ in dead if bucket >= cfg.buckets]
    if beyond:
        named = ", ".join(f"{mid} in bucket {bucket}" for mid, bucket in beyond[:10])
        raise Problem(
            409,
            "dead in a removed bucket",
            f"topics[{cfg.name}].buckets is {cfg.buckets}, but {len(beyond)} of these dead "
            f"messages died in a higher bucket ({named}): they cannot be redriven unless "
            "the topic's buckets are raised again; redrive the others by id",
            ids=[mid for mid, _ in beyond],
        )


class Broker:
    def __init__(
        self,
        settings: Settings,
        node_id: str,
        http_addr: str,
        raft_addr: str,
        peers: list[str],
        data_dir: Path,
        reconfigure: bool = False,
        new_cluster: bool = False,
    ) -> None:
        """`reconfigure`: this node's Raft address or members change; `new_cluster`: its
        empty data dir starts a new cluster, so it votes from the start (`admit`)."""
        self.settings = settings
        self.conf = settings.broker
        self.node_id, self.http_addr, self.raft_addr, self.peers = (
            node_id,
            http_addr,
            raft_addr,
            peers,
        )
        self.data_dir = data_dir
        self.reconfigure, self.new_cluster = reconfigure, new_cluster
        self.topics: dict[str, TopicConfig] = {
            t.name: t for t in settings.topics if t.delivery is Delivery.LEASE
        }
        self.indexes = {
            n: TopicIndex(
                settings.warehouse, t, str(data_dir / "heads" / n), self.conf.disk_reserve_bytes
            )
            for n, t in self.topics.items()
        }
        self.metrics = Metrics()
        self._lease_latency = {n: self.metrics.lease_latency.labels(n) for n in self.topics}
        for n in self.topics:  # at 0 from the start: an alert sees the first repair's rise
            self.metrics.heads_repaired.labels(n)
            self.metrics.heads_unreadable.labels(n)
            self.metrics.ledger_contested.labels(n)
        self.raft: RaftNode | None = None
        self._held: IO[str] | None = None  # the data dir's lock (`lock`)
        self.identity: Identity | None = None  # its data dir's (`open`)
        self._stopping = threading.Event()
        self.wakeups = Wakeups()
        self._loader: threading.Thread | None = None  # `start_behind`'s
        # What ended a load run behind the HTTP server (`start_behind`), and what then
        # ends the node: it stops serving, then says why and exits, as `start` would.
        self.failure: BaseException | None = None
        self.on_failure: Callable[[], None] = lambda: None
        self._threads: list[threading.Thread] = []
        self._totals: dict[str, dict[str, int]] = {n: {} for n in self.topics}
        self._checkpoints: Counter[str] = Counter()
        self.checkpoint_health = {n: Health() for n in self.topics}
        self.refreshes = {n: Refreshes(f"indexing {n}", topic=n) for n in self.topics}
        self._duties: dict[str, Streak] = {}  # the other duties' streaks, by what they do
        self.refresh_alert_s = REFRESH_ALERT_S
        self.retention_runs: dict[str, RetentionRun] = {}  # the last one per topic, here
        self.keys: KeyRing | None = None  # the API keys, where `broker.keys_file` is set
        # Topics whose new messages wait for disk space (`broker.disk_reserve_bytes`).
        self.short_of_disk: dict[str, str] = {}
        # Topics with heads this node can read neither from its head store nor again from
        # the buffer (`TopicIndex.repair_heads`), with the alert: their lowest keys wait.
        self.heads_unreadable: dict[str, str] = {}
        self._repair_at: dict[str, float] = {}  # monotonic: no repair of a topic before it
        self._repair_delay: dict[str, float] = {}  # the last backoff, doubled per failure
        # Topics whose ledger another cluster writes, with the alert: this node leases
        # them no more and leaves their duties (checkpoints, retention, expiry) undone.
        self.contested: dict[str, str] = {}
        self._rivals: dict[str, Rival] = {}  # the tags each topic's history replaced
        self._claims_checked: dict[str, int] = {}  # the term each topic's tag was read in

    # --- Listener: hooks from applied Raft commands ---------------------------------------

    def pending(self, topic: str, state: TopicState, handles: list[int]) -> None:
        """Nothing to tell for a topic this node does not serve (`BrokerState`)."""
        index = self.indexes.get(topic)
        if index is not None:
            index.push(state, handles)

    def gone(self, topic: str, handles: bytes) -> None:
        """Messages checkpointed and trimmed, by handle (packed): the index forgets them."""
        index = self.indexes.get(topic)
        if index is not None:
            index.forget(handles)

    def reset(self, states: dict[str, TopicState]) -> None:
        for name, index in self.indexes.items():
            index.rebuild(states[name])

    # --- life cycle ---------------------------------------------------------------------

    def open(self) -> None:
        """Hold the data dir and check it is this node's: before it serves anything."""
        self._held = lock(self.data_dir)
        self.identity = admit(
            self.data_dir, self.raft_addr, self.peers, self.new_cluster, self.reconfigure
        )

    def start(self) -> None:
        """`open`, then `load`, in this thread: a node run in process, Raft attached to a
        loop by the caller. `dejaq broker` serves HTTP first (`start_behind`)."""
        self.open()
        self.load()

    def start_behind(self, loop: asyncio.AbstractEventLoop) -> None:
        """`load` on a thread of its own while `loop` serves HTTP, then run Raft on
        `loop`. A large backlog takes minutes to load: meanwhile liveness answers (an
        orchestrator does not kill the node for the time its start takes), readiness
        says how far the load is, and every other request is refused (`serving`). A
        load that fails sets `failure` and calls `on_failure`."""
        self._loader = threading.Thread(
            target=self._load_behind, args=(loop,), name="load", daemon=True
        )
        self._loader.start()

    def _load_behind(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.load()
        except LoadStopped as e:
            load_log.info("%s: the node stops", e)
            return
        except BaseException as e:  # said by `dejaq broker` as a failed `start` is
            self.failure = e
            self.on_failure()
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the node stopped
            loop.call_soon_threadsafe(self._run_raft, loop)

    def _run_raft(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: Raft runs there from now on, and requests are served."""
        if self.raft is not None and not self._stopping.is_set():
            self.raft.attach(loop)

    def load(self) -> None:
        """Load the indexes, then join Raft (replaying the journal needs the indexes) and
        start the duties. Raises LoadStopped if the node stops meanwhile."""
        assert self.identity is not None, "open() first"
        identity = self.identity
        for n, (name, index) in enumerate(self.indexes.items(), 1):
            load_log.info("loading the index of %s (topic %d of %d)", name, n, len(self.indexes))
            index.load(self._stopping)
            load_log.info(
                "indexed %s: %d pending messages of %d buffer rows in %.1f s",
                name,
                len(index.rows),
                index.buffer_rows,
                index.loading.seconds(),
            )
        # The loaded rows live as long as the node: keep them out of the cyclic GC, or
        # each full collection walks them all (~100 ms for 200k rows, stalling requests).
        gc.freeze()
        gc.set_threshold(GC_YOUNG_OBJECTS, 10, 10)
        _return_free_heap()
        if self._stopping.is_set():
            raise LoadStopped("the node stopped once its indexes were loaded")
        self.raft = RaftNode(
            self.raft_addr,
            self.peers,
            list(self.topics.values()),
            self.conf,
            self.data_dir,
            listener=self,
            on_joined=None if identity.joined else partial(mark_joined, self.data_dir, identity),
        )
        self.raft.on_lag = self.metrics.loop_lag.observe
        self.raft.on_committed = self._committed
        self.raft.sync.on_failure = lambda: self.on_failure()
        duties = (self._follow_tables, self._leader_duties, self._checkpoints_duty, self._retention)
        for target in duties:
            t = threading.Thread(target=target, name=target.__name__, daemon=True)
            t.start()
            self._threads.append(t)

    def serving(self) -> bool:
        """Whether the indexes are loaded and Raft runs: requests other than probes,
        metrics and docs are refused until then (`api.starting`)."""
        return self.raft is not None and self.raft.attached()

    def starting(self) -> str:
        """Why the node does not serve yet: the load's progress, or Raft's start."""
        loading = [i for i in self.indexes.values() if not i.loaded]
        if not loading:
            return "indexes loaded, Raft starting"
        at = len(self.indexes) - len(loading) + 1
        of = f" (topic {at} of {len(self.indexes)})" if len(self.indexes) > 1 else ""
        return f"indexes loading: {loading[0].loading}{of}"

    def halt(self) -> None:
        """The node is stopping: a load still running ends at its next slice of rows,
        Raft does not start after it, and the duties end their rounds (`stop`)."""
        self._stopping.set()
        self.wakeups.notify_all()  # waiting polls answer at once

    def stop(self) -> None:
        """Stop the load if it runs, the duties, Raft and the head stores; release the
        data dir. A load held up reading the warehouse past LOAD_STOP_WAIT_S is left to
        end with the process, its head stores open under it."""
        self.halt()
        if self._loader is not None:
            self._loader.join(LOAD_STOP_WAIT_S)
            if self._loader.is_alive():
                log.warning("the load did not stop within %.0f s", LOAD_STOP_WAIT_S)
                return
        deadline = time.monotonic() + DUTY_STOP_WAIT_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if running := [t.name for t in self._threads if t.is_alive()]:
            log.warning(
                "duties still running %.1f s into the stop, left to end with the process: %s",
                DUTY_STOP_WAIT_S,
                ", ".join(running),
            )
        if self.raft is not None:
            self.raft.destroy()
        for index in self.indexes.values():
            index.close()
        if self._held is not None:
            self._held.close()

    def ready(self) -> tuple[bool, str]:
        if not self.serving():
            return False, self.starting()
        ended = [t.name for t in self._threads if not t.is_alive()]
        if ended:  # its duty undone for good: expiry, checkpoints, indexing new rows
            return False, f"background thread {', '.join(ended)} ended; restart the node"
        if self.raft.sync.failure is not None:  # it exits (`jobs.broker`)
            return False, str(self.raft.sync.failure)
        if not self.raft.sync.voting:
            return False, (
                "this node started on an empty data dir: it waits for a leader to bring it "
                "up to date, and neither votes nor stands for election until then"
            )
        if self.raft.leader() is None:
            return False, "no Raft leader"
        if not self.raft.sync.isReady():
            return False, "Raft log not yet applied"
        if not self._registered():
            return False, "this node's HTTP address not yet registered"
        if self.contested:
            return False, "; ".join(self.contested.values())
        if self.keys is not None and (error := self.keys.check()) is not None:
            return False, f"{error}; every call with a key is refused"
        stalled = [a for r in self.refreshes.values() if (a := r.alert(self.refresh_alert_s))]
        if stalled:
            return False, "; ".join(stalled)
        if self.heads_unreadable:
            return False, "; ".join(self.heads_unreadable.values())
        alerts = [
            f"checkpoints of {name} {alert}"
            for name in self.checkpoint_health
            if (alert := self._checkpoint_alert(name)) is not None
        ]
        alerts += [a for index in self.indexes.values() if (a := index.beyond_alert())]
        alerts += self.short_of_disk.values()
        return True, "; ".join(["ready", *alerts])

    def _checkpoint_alert(self, name: str) -> str | None:
        """The topic's checkpoints failing for minutes, while this node leads: only the
        leader checkpoints, and a former leader's last streak says nothing of the ledger."""
        if self.raft is None or not self.raft.leading():
            return None
        return self.checkpoint_health[name].alert()

    def _registered(self) -> bool:
        """Whether the applied state lists this node's HTTP address, as clients read it
        from /v1/cluster: readiness waits for it, and the duties register it until so."""
        assert self.raft is not None
        return self.raft.state.nodes.get(self.raft_addr) == self.http_addr

    def state(self, topic: str) -> TopicState:
        assert self.raft is not None
        return self.raft.state.topics[topic]

    def _follow_tables(self) -> None:
        """Every node: index new buffer versions and redriven messages, publish metrics."""
        while not self._stopping.wait(FOLLOW_PERIOD_S):
            for name, index in self.indexes.items():
                try:
                    try:
                        if index.refresh() + index.revive(self.state(name)):
                            self.wakeups.notify(name)
                    except ReserveReached as e:  # said once, and by readiness while it lasts
                        if name not in self.short_of_disk:
                            log.warning("%s: %s", name, e)
                        self.short_of_disk[name] = f"{name}: {e.strerror}"
                    else:
                        self.short_of_disk.pop(name, None)
                    index.compact_heads()
                    index.narrow_ids()
                    index.shrink()
                    index.release_columns()
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:  # a panic in the core too: the thread must go on
                    self.refreshes[name].failed(e)
                else:
                    self.refreshes[name].ok()
                self._repair_heads(name, index)
            self._publish_metrics()

    def _wait_committed(self, method: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """`committed`, given up (Halted) once the node begins to stop: its duties end
        their rounds then, and Raft stops ticking with the server."""
        return committed(method, *args, timeout=timeout, halted=self._stopping)

    def _duty(self, what: str) -> Streak:
        """The streak of failures of a background duty, kept across its rounds."""
        streak = self._duties.get(what)
        if streak is None:
            streak = self._duties[what] = Streak(what)
        return streak

    def _repair_heads(self, name: str, index: TopicIndex) -> None:
        """Read again from the buffer the heads of `name` this node failed to read
        (`TopicIndex.repair_heads`). A repair that fails is counted, logged once a
        streak, said by readiness while it lasts (the lowest keys of the topic cannot be
        leased from this node meanwhile), and tried again after a backoff: each try may
        read the whole buffer, which the follow thread would otherwise do five times a
        second."""
        if time.monotonic() < self._repair_at.get(name, 0.0):
            return
        streak = self._duty(f"repairing the heads of {name}")
        try:
            repaired = index.repair_heads()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # the buffer unreadable too, a panic in the core
            self.metrics.heads_unreadable.labels(name).inc()
            streak.failed(e)
            delay = min(REPAIR_BACKOFF_MAX_S, 2 * self._repair_delay.get(name, 0.0))
            self._repair_delay[name] = max(REPAIR_BACKOFF_MIN_S, delay)
            self._repair_at[name] = time.monotonic() + self._repair_delay[name]
            self.heads_unreadable[name] = (
                f"heads of {name} unreadable on this node, and reading them again from the "
                f"buffer failed ({type(e).__name__}: {e}): its lowest keys wait"
            )
            return
        streak.ok()
        self._repair_delay.pop(name, None)
        self.heads_unreadable.pop(name, None)
        if repaired:
            self.metrics.heads_repaired.labels(name).inc(repaired)
            log.warning("%s: %d heads read again from the buffer", name, repaired)

    def _publish_metrics(self) -> None:
        """Each family of metrics on its own: one that fails (it reads Raft's state while
        the event loop changes it) is logged and leaves the others current."""
        if self.raft is None:
            return
        for step in (
            self._publish_raft,
            self._publish_keys,
            self._publish_ledger,
            self._publish_index,
            self._publish_totals,
        ):
            with _going_on(self._duty(f"publishing metrics ({step.__name__})")):
                step()

    def _publish_raft(self) -> None:
        assert self.raft is not None
        self.metrics.observe_raft(self.raft.role(), self.raft.term(), self.raft.log_entries())

    def _publish_keys(self) -> None:
        if self.keys is not None:
            self.metrics.keys_unreadable.set(self.keys.check() is not None)

    def _publish_ledger(self) -> None:
        now = now_ms()
        for name, health in self.checkpoint_health.items():
            st = self.state(name)
            self.metrics.observe_ledger(name, lag(st), now, health.failures, health.unnamed)

    def _publish_index(self) -> None:
        self.metrics.observe_index(
            {n: (len(i.rows), i.buffer_rows, i.heads.disk_bytes()) for n, i in self.indexes.items()}
        )
        for name, r in self.refreshes.items():
            self.metrics.observe_refreshes(name, r.failing_for(), r.failures)

    def _publish_totals(self) -> None:
        m = self.metrics
        counters = {
            "leased": m.leased,
            "acked": m.acked,
            "nacked": m.nacked,
            "redelivered": m.redelivered,
            "dead": m.dead,
        }
        for name in self.topics:
            totals = self.state(name).totals
            seen = self._totals[name]
            for key, counter in counters.items():
                delta = totals.get(key, 0) - seen.get(key, 0)
                if delta > 0:
                    counter.labels(name).inc(delta)
                seen[key] = totals.get(key, 0)

    def _leader_duties(self) -> None:
        """Register our HTTP address; on the leader: configure topics, expire leases and
        consumers. Checkpoints run on their own thread (`_checkpoints_duty`): on a slow
        object store they would hold up expiry, a lease kept past its deadline."""
        while not self._stopping.wait(DUTY_PERIOD_S):
            raft = self.raft
            assert raft is not None
            with _going_on(self._duty("leader duties")):
                if raft.leader() is None:
                    continue
                if not self._registered():
                    self._wait_committed(
                        raft.state.register, self.raft_addr, self.http_addr, timeout=2
                    )
                if not raft.leading():
                    continue
                for name, cfg in self.topics.items():
                    if name in self.contested:
                        continue
                    st = self.state(name)
                    self._configure(name, cfg, st)
                    now = now_ms()
                    if st.needs_expiry(now, self.conf.heartbeat_timeout_ms):
                        args = (now, self.conf.heartbeat_timeout_ms, _backoff(cfg))
                        self._wait_committed(raft.state.command, name, "expire", args, timeout=2)

    def _checkpoints_duty(self) -> None:
        """On the leader: checkpoint the ledger every CHECKPOINT_PERIOD_S, or as soon as
        the last one ends if it took longer."""
        began = time.monotonic()
        while not self._stopping.wait(max(0.0, began + CHECKPOINT_PERIOD_S - time.monotonic())):
            began = time.monotonic()
            raft = self.raft
            if raft is None or not raft.leading():
                for health in self.checkpoint_health.values():
                    health.ended()
                continue
            with _going_on(self._duty("checkpoints")):
                self._checkpoint()

    def _configure(self, name: str, cfg: TopicConfig, st: TopicState) -> None:
        """Commit the topic's `buckets` and `max_deliveries` from this node's configuration
        if the replicated state holds others, or never took any from the log: each node
        keeps its snapshot's, and one replaying its journal from the log's start begins
        from its own file, so only a command changes them on every node at one point.
        Each new leader's configuration wins."""
        assert self.raft is not None
        wanted = self._configuration(cfg)
        if st.configured and (st.buckets, st.max_deliveries) == wanted:
            return
        self._wait_committed(self.raft.state.command, name, "configure", wanted, timeout=2)
        log.info("topic %s configured: buckets %d, max_deliveries %d", name, *wanted)

    def _configuration(self, cfg: TopicConfig) -> tuple[int, int]:
        """A topic's `configure` command's arguments, from this node's configuration."""
        return cfg.buckets, self.conf.max_deliveries

    def _checkpoint(self) -> None:
        """Each topic on its own: one whose store fails does not hold up the others."""
        for name in self.topics:
            if self._stopping.is_set():
                return
            self._checkpoint_topic(name)

    def _checkpoint_topic(self, name: str) -> None:
        """One round of a topic's checkpoint, a failure of any step told to its `Health`
        under the step's name. A step after the ledger took the events (restoring
        redriven rows, the trim) stalls the checkpoints as surely as the ledger: the
        trims stop, Raft's state and the buffer grow. So a streak ends only with a round
        that went through, no death kept back."""
        assert self.raft is not None
        health = self.checkpoint_health[name]
        step = f"ledger of {name}"
        try:
            written = self._write_ledger(name, health)
            if written is None:
                return
            events, upto, keep = written
            st = self.state(name)
            if st.redriven_at:  # before their redrives leave Raft
                step = f"redriven rows of {name}"
                index = self.indexes[name]
                again = [st.redriven_ids[h] for h in redriven(settlements(events))]
                restore(index.buffer_path, index.dead_letter_path, again, now_ms())
            step = f"trim of {name}"
            for cut in trim_cuts(events, upto):
                args = (cut, [k for k in keep if k <= cut]) if keep else (cut,)
                self._wait_committed(self.raft.state.command, name, "trim", args, timeout=5)
            self._checkpoints[name] += 1
        except Halted:  # the node stops: its next leader checkpoints these events
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a panic in the core too: the thread must go on
            if isinstance(e, NotCommitted) and not self.raft.leading():
                # A leader change cut it off: the next leader trims these events.
                log.info("%s not committed, this node no longer leading: %s", step, e)
                return
            health.failed(step, e, [])
            return
        if not keep:
            health.ok()
        if self._checkpoints[name] % COMPACT_EVERY == 0:
            # Not a step of the round: a compaction that fails holds no trim back, and
            # an idle topic would keep its alert until the next one (thirty rounds on).
            with _going_on(self._duty(f"compaction of {name}")):
                tail_ms = self.topic(name).settled_retention_ms
                compact_ledger(self.settings.warehouse, name, tail_ms)
                compact_dead_letters(self.settings.warehouse, name, tail_ms)

    def _write_ledger(self, name: str, health: Health) -> tuple[list[Entry], int, list[int]] | None:
        """Write the topic's next events to the ledger and their dead letters: (the
        events, the last seq the ledger holds, the deaths to keep in Raft), or None if
        there is nothing to trim (no events, the topic contested, a history begun)."""
        assert self.raft is not None
        if name in self.contested:
            return None
        term = self.raft.term()
        if self._claims_checked.get(name) != term:
            self._check_claim(name)
            self._claims_checked[name] = term
            if name in self.contested:
                return None
        st = self.state(name)
        events = first_events(st.events.view(), st.trimmed, CHECKPOINT_MAX_EVENTS)
        if not events:
            return None
        history = (st.history, st.history_from)
        warehouse = self.settings.warehouse
        trimmed = st.trimmed_upto()
        names = self._names(name)
        try:
            rival = self._rival(name, st)
            upto, keep = checkpoint(warehouse, name, events, names, health, history, trimmed, rival)
        except Contested as e:
            self._contest(name, e.app, f"moved from version {e.since} to {e.now}")
            return None
        except Claimed as claim:
            if self._began_history(name, claim.done):
                return None  # the next round writes under it
            upto, keep = checkpoint(warehouse, name, events, names, health, history)
        last_trim = self.state(name).trimmed
        if upto <= last_trim and (keep or events[0].seq > last_trim):
            # Nothing to trim: only deaths a trim kept, their dead letters still failing,
            # or nothing written, the first event's message not named here yet
            # (`Health.waiting`).
            return None
        return up_to(events, upto), upto, keep

    def _names(self, name: str) -> Names:
        """The ids of messages named by handle, as the leader's checkpoint asks
        (`ledger_writer.Names`): its index's rows, else the redriven messages' ids the
        state keeps (a redrive's row may have left the index with its death's trim),
        else, once the index has read the buffer's current version, the tables' rows
        (`TopicIndex.ids_in_tables`: rows it dropped). A row it has yet to read is
        waited for."""
        index, st = self.indexes[name], self.state(name)

        def names(handles: bytes) -> pa.ChunkedArray | list[str | None]:
            column = index.id_column(handles)
            if not column.null_count:
                return column
            ids = column.to_pylist()
            every = handles_in(handles)
            redriven = st.redriven_ids
            ids = [redriven.get(h) if m is None else m for m, h in zip(ids, every, strict=True)]
            if None not in ids:
                return ids
            found = index.ids_in_tables({h for m, h in zip(ids, every, strict=True) if m is None})
            return [found.get(h) if m is None else m for m, h in zip(ids, every, strict=True)]

        return names

    def _check_claim(self, name: str) -> None:
        """At the start of a term's leadership: a ledger tag past the last trim is looked
        into at once (`_began_history`), not at the first checkpoint with events, by
        when this node would have leased messages another cluster leases too."""
        st = self.state(name)
        app = app_id(st.history)
        done, _ = tag_of(self.settings.warehouse, name, app)
        if done > st.trimmed_upto():
            self._began_history(name, done)

    def _rival(self, name: str, st: TopicState) -> Rival | None:
        """The watch on the tags `st`'s history replaced, kept across rounds."""
        if st.replaced is None:
            return None
        rival = self._rivals.get(name)
        if rival is None or (rival.app, rival.origin) != st.replaced:
            rival = self._rivals[name] = Rival(*st.replaced)
        return rival

    def _contest(self, name: str, app: str, how: str) -> None:
        """Stop serving `name`: another cluster writes its ledger under `app`."""
        alert = (
            f"another broker cluster writes the ledger of {name}: its tag {app} {how}. Two "
            "clusters run over this warehouse, each leasing the topic's messages and "
            "unaware of the other's acks; this node no longer leases them nor checkpoints, "
            f"expires or retains {name}. Stop one of the clusters, then restart this one's "
            "nodes if it is to serve the topic"
        )
        log.error("%s", alert)
        self._set_contested(name, alert)

    def _set_contested(self, name: str, alert: str | None) -> None:
        """Contest `name` with `alert` (None: serve it again), its gauge with it, the
        gauge first: whoever read the alert on /readyz finds it on /metrics. Published
        with the other metrics, a round of the follow thread later, the gauge lagged
        /readyz, and read 0 between the quiet wait's alert and the contest's."""
        self.metrics.ledger_contested.labels(name).set(alert is not None)
        if alert is None:
            self.contested.pop(name, None)
        else:
            self.contested[name] = alert

    def _quiet(self, name: str, app: str, done: int) -> int | None:
        """The version of the tag `done` for `app`, to take over from, unless it moves
        (`None`, and the topic contested): taken at once where the ledger had no commit
        for `TAKEOVER_QUIET_S`, else read again that long after its newest commit."""
        warehouse = self.settings.warehouse
        version, age_s = tag_of(warehouse, name, app)
        if version == done and age_s >= TAKEOVER_QUIET_S:
            return version
        if version == done:
            alert = (
                f"the ledger of {name} holds tags of another Raft history, written "
                f"{age_s:.0f} s ago: leases wait while this node checks that no other "
                "cluster writes them"
            )
            self._set_contested(name, alert)
            self._stopping.wait(min(TAKEOVER_QUIET_S, TAKEOVER_QUIET_S - age_s))
            version, _ = tag_of(warehouse, name, app)
            if version == done:
                self._set_contested(name, None)
                return version
        self._contest(name, app, f"moved from version {done} to {version} meanwhile")
        return None

    def _began_history(self, name: str, done: int) -> bool:
        """Whether the ledger's tag `done` past the last trim is another Raft history's
        (`ledger_writer.foreign`): then this leader begins one, under which the events
        past what the ledger holds of this state are written, unless that tag moves
        (`_quiet`): another cluster's, live. Asked once every entry committed before is
        applied here: the `register` command orders it after them."""
        assert self.raft is not None
        self._wait_committed(self.raft.state.register, self.raft_addr, self.http_addr, timeout=5)
        st = self.state(name)
        written = foreign(
            self.settings.warehouse, name, st.events.view(), st.trimmed_upto(), done, st.seq
        )
        if written is None:
            return False
        replaced = app_id(st.history)
        version = self._quiet(name, replaced, done)
        if version is None:
            return True  # contested: the topic's duties stop here
        history = uuid.uuid4().hex
        log.error(
            "the ledger of %s holds checkpoints up to seq %d of another Raft history (the "
            "nodes' data folders replaced, or the journal's last commands lost): its tags "
            "count anew under %s, past seq %d",
            name,
            done,
            history,
            written,
        )
        args = (history, written, (replaced, version))
        self._wait_committed(self.raft.state.command, name, "history", args, timeout=5)
        return True

    def _retention(self) -> None:
        """On the leader: remove settled messages from the buffers (`pipelines.retention`).

        Its own thread: a run reads the ledger's tail and rewrites buffer files, which
        must not hold up lease expiry or checkpoints. The cutoff stays before the oldest
        event not yet checkpointed, so no older one can reach the ledger after a run.
        """
        last: dict[str, float] = {}
        while not self._stopping.wait(DUTY_PERIOD_S * 10):
            raft = self.raft
            if raft is None or not raft.is_leader():
                continue
            for name, cfg in self.topics.items():
                if self._stopping.is_set():
                    return
                if name in self.contested:
                    continue
                period = period_s(cfg.settled_retention_ms)
                if time.monotonic() - last.get(name, -period) < period:
                    continue
                last[name] = time.monotonic()
                try:
                    self._retain(name, cfg)
                except Halted:
                    return
                except NotCommitted as e:
                    log.warning("retention of %s: %s; the next round tries again", name, e)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException:  # a panic in the core too: the thread must go on
                    log.warning(
                        "retention of %s failed; the next round tries again", name, exc_info=True
                    )

    def _retain(self, name: str, cfg: TopicConfig) -> None:
        """One retention run of a topic, bounded by the events not yet in the ledger.

        Those are known once this node has applied every entry committed before it
        asked: a command committed through Raft first (the leader's own address, again)
        orders the question after them. A new leader has not applied the last term's
        entries yet when it is elected, and a run before them would miss their events.
        A command stamped before the question but logged after it (queued behind a
        group in flight, or stamped on another thread) is not ordered so: the cutoff
        stays `STAMPED_WITHIN_MS` back at least, or its event could land below the
        watermark.
        """
        assert self.raft is not None
        now = now_ms()  # read before the question, so that it orders what was stamped before
        self._wait_committed(self.raft.state.register, self.raft_addr, self.http_addr, timeout=5)
        entries = self.state(name).events.view()
        unwritten = min((e.at for e in entries), default=None)
        index = self.indexes[name]
        run = retain(
            index.buffer_path,
            index.ledger_path,
            max(cfg.settled_retention_ms, STAMPED_WITHIN_MS),
            now,
            unwritten,
            index.dead_letter_path,
        )
        if run is None:
            return
        self.retention_runs[name] = run
        self.metrics.observe_retention(name, run)

    def node_topics(self) -> dict[str, NodeTopic]:
        """Per topic, this node's index and view of the buffer, and its last retention run."""
        out = {}
        for name, index in self.indexes.items():
            run = self.retention_runs.get(name)
            indexed = len(index.rows)
            behind = lag(self.state(name)) if self.raft is not None else None
            health = self.checkpoint_health[name]
            out[name] = NodeTopic(
                ledger_lag=None
                if behind is None
                else LedgerLag(
                    events=behind.events,
                    oldest_ms=behind.oldest_ms,
                    unwritten_dead_letters=behind.unwritten_dead_letters,
                    checkpoint_failures=health.failures,
                    failing=self._checkpoint_alert(name),
                ),
                indexed=indexed,
                buffer_rows=index.buffer_rows,
                settled_rows=max(index.buffer_rows - indexed, 0),
                head_store_bytes=index.heads.disk_bytes(),
                last_retention=None
                if run is None
                else RetentionView(
                    at_ms=run.at_ms,
                    seconds=run.seconds,
                    removed=run.removed,
                    watermark_ms=run.watermark_ms,
                ),
            )
        return out

    # --- operations (leader) -------------------------------------------------------------

    def topic(self, name: str) -> TopicConfig:
        t = self.topics.get(name)
        if t is None:
            raise Problem(404, "unknown topic", f"no lease topic named {name!r}")
        return t

    def _committed(self, topic: str, op: str) -> None:
        """A command this node committed is applied: polls waiting on its topic look
        again if it may have made something leasable."""
        if op in WAKING:
            self.wakeups.notify(topic)

    async def _commit(self, topic: str, op: str, *args: Any) -> Any:
        """Commit a command on `topic`, named by its configured name rather than the
        request's copy: a group commit then holds one str for all its commands on the
        topic (pickle's memo), which every node unpickles once.

        A topic the log never configured is configured first, ahead of the duties: a
        node whose file lacks the topic takes its state from that command, and would
        refuse one before it that the nodes serving the topic apply."""
        assert self.raft is not None
        cfg = self.topic(topic)
        try:
            if not self.state(cfg.name).configured:
                await self.raft.commit(cfg.name, "configure", *self._configuration(cfg))
            return await self.raft.commit(cfg.name, op, *args)
        except NotCommitted as e:
            raise Problem(503, "not committed", str(e)) from None

    async def lease(
        self,
        topic: str,
        consumer: str,
        n: int,
        lease_ms: int,
        wait_ms: int,
        gone: Callable[[], bool] = lambda: False,
        request: str | None = None,
    ) -> bytes:
        """The lowest deliverable sort keys of the consumer's buckets, long-polling.

        Returns the JSON array of leased messages, formatted by `message_json`. A lease
        whose command granted none of its picks (a trim passed the view they were picked
        from, or the consumer's buckets moved) picks again at once, up to REDRIVE_READS
        times, whatever `wait_ms`: messages are pending, and an empty answer would tell
        the worker there are none.

        A poll ends with nothing once `gone()` says its client has disconnected (it
        would heartbeat a consumer that is gone), and grants nothing then, nor once its
        consumer has left meanwhile (it would join again): messages leased to nobody
        wait out their lease and come back a delivery closer to dead.

        Picks whose heads this node cannot read (its disk failing them) are pending again
        at once; the poll waits while the index reads those heads again from the buffer
        (`TopicIndex.repair_heads`), and is refused (503) if `wait_ms` passes first.

        `request`: the id the client made for the request, sent again with it when its
        answer is lost. The consumer's last lease, if it answered that request, is the
        answer (`_again`): found before picking, or by the lease command itself when the
        first attempt committed meanwhile (`TopicState.again`). Each lease command
        carries the id, so a new leader knows it too.
        """
        cfg = self.topic(topic)
        if (contested := self.contested.get(cfg.name)) is not None:
            raise Problem(503, "topic contested", contested)
        index, st = self.indexes[topic], self.state(topic)
        deadline = time.monotonic() + wait_ms / 1000
        rate = cfg.max_lease_rate
        # A lease first commits the consumer's heartbeat (`touch`) if it is new, or once
        # a third of its heartbeat timeout has passed; most leases need none.
        touch_after = self.conf.heartbeat_timeout_ms // 3
        repicks = 0
        first = True
        picked: float | None = None  # when picks were first found: the latency's start
        while True:
            changed = self.wakeups.mark(topic)  # before the look: a change meanwhile sets it
            if not first and gone():
                return b"[]"  # its client left: the poll ends, and heartbeats nobody
            if request is not None and (again := st.again(consumer, request)) is not None:
                return self._again(topic, again, consumer)
            now = now_ms()
            seen = st.consumers.get(consumer)
            if seen is None and not first:
                return b"[]"  # it left during the poll
            if seen is None or now - seen > touch_after:
                await self._commit(topic, "touch", consumer, now)
                now = now_ms()
            first = False
            take = 0 if st.paused else n if rate is None else min(n, st.lease_budget(now, rate))
            buckets = st.buckets_of(consumer)
            try:
                picks, heads = index.pick_with_heads(st, buckets, take, now)
            except HeadsUnreadable as e:  # logged by the index, which repairs them
                if time.monotonic() >= deadline:
                    raise Problem(503, "messages unreadable on this node", str(e)) from None
                while index.repairing() and time.monotonic() < deadline:
                    await asyncio.sleep(LONG_POLL_STEP_S)
                continue
            if picks[0] and gone():
                index.release(st, picks)
                self.wakeups.notify(topic)  # put back: another poll may take them
                return b"[]"
            if picks[0]:
                picked = time.monotonic() if picked is None else picked
                granted = None
                try:
                    # Numbered (True, or the request's id), and made from the state at
                    # `seq`: see `TopicState.lease`.
                    numbered = True if request is None else request
                    args = (consumer, now, lease_ms, picks, rate, numbered, st.seq)
                    granted = await self._commit(topic, "lease", *args)
                finally:
                    if type(granted) is not LeaseRecord or len(granted) < pick_count(picks):
                        index.release(st, picks)  # some to put back
                        self.wakeups.notify(topic)
                if type(granted) is Again:
                    return self._again(topic, granted, consumer)
                if granted:
                    timeline = cfg.kind.sorted_as is TopicKind.TIMELINE
                    answer = message_json.leased_array(picks, heads, granted, timeline)
                    self._lease_latency[topic].observe(time.monotonic() - picked)
                    return answer
                if repicks < REDRIVE_READS:
                    repicks += 1
                    continue
            # A node stopping answers its waiting polls at once: a poll cut at the stop's
            # end would get an error, and keep the stop waiting until then.
            if time.monotonic() >= deadline or self._stopping.is_set():
                return b"[]"
            limited = take == 0 and rate is not None and not st.paused
            step = self._idle_step(cfg, index, buckets, now, limited, st.paused)
            looked = time.monotonic()
            await self.wakeups.wait(changed, min(step, deadline - looked))
            # Changes come in bursts (each ack of a busy topic is one): a poll looks at
            # most once a step, as it would on a timer.
            if (since := time.monotonic() - looked) < LONG_POLL_STEP_S:
                await asyncio.sleep(LONG_POLL_STEP_S - since)

    @staticmethod
    def _idle_step(
        cfg: TopicConfig,
        index: TopicIndex,
        buckets: list[int],
        now: int,
        limited: bool,
        paused: bool,
    ) -> float:
        """How long a poll that found nothing may wait for its topic's next change:
        until its timeline's next message is due or its topic's first delay ends (time
        alone ends either), a short step where the rate limit left it nothing
        (`limited`), else at most IDLE_POLL_STEP_S, as on a paused topic, whose resume
        is a change."""
        if paused:
            return IDLE_POLL_STEP_S
        if limited:
            return LONG_POLL_STEP_S
        due = index.due(buckets, cfg.kind.sorted_as is TopicKind.TIMELINE)
        if due is None:
            return IDLE_POLL_STEP_S
        # Due already, yet not picked: an entry the pick skips; looked at again soon.
        return LONG_POLL_STEP_S if due <= now else min(IDLE_POLL_STEP_S, (due - now) / 1000)

    def _again(self, topic: str, again: Again, consumer: str) -> bytes:
        """The JSON array of what the lease `again` names still holds for `consumer`,
        as its first answer rendered it: a message of it acked, nacked, rejected or
        past its deadline since is left out."""
        record = self.state(topic).records.get(again.lid)
        if record is None:  # every message of it ended, and the trim forgot the record
            return b"[]"
        now, index = now_ms(), self.indexes[topic]
        held = [p for p in record.live_positions() if not record.status(p, consumer, now)]
        heads = [_head(index, record.mh(p)) for p in held]
        timeline = self.topic(topic).kind.sorted_as is TopicKind.TIMELINE
        return message_json.held_array(record, held, heads, timeline)

    async def settle(
        self, topic: str, op: str, consumer: str, ids: Named, receipts: bool = False
    ) -> Settled:
        """ack or reject the messages named by `ids`, or by receipt if `receipts`."""
        self.topic(topic)
        ids = _once_each(ids)
        mids, named, names, early = self._named(topic, ids, receipts)
        refused = await self._commit(topic, op, consumer, now_ms(), mids, named)
        refused = _by_name(refused, names, early)
        return Settled(len(ids) - len(refused), refused)

    async def nack(
        self,
        topic: str,
        consumer: str,
        ids: Named,
        delay_ms: int,
        priority: int | None,
        receipts: bool = False,
    ) -> Settled:
        cfg = self.topic(topic)
        if priority is not None and cfg.kind is not TopicKind.PRIORITY:
            raise Problem(422, "invalid nack", "a new priority applies to priority topics only")
        ids = _once_each(ids)
        mids, named, names, early = self._named(topic, ids, receipts)
        args = (consumer, now_ms(), mids, delay_ms, priority, _backoff(cfg), named)
        refused, dead = await self._commit(topic, "nack", *args)
        refused = _by_name(refused, names, early)
        asked = [] if receipts else ids
        return Settled(len(ids) - len(refused), refused, self._ids_of(topic, dead, asked))

    def _ids_of(self, topic: str, handles: list[int], asked: list[str]) -> list[str]:
        """The ids of messages a command answered by handle (a nack's dead): those the
        request named, else the leader's index's. One neither names (a new leader whose
        index has not read its row) is given as its handle, in hex."""
        by_handle = dict(zip(mhs(asked), asked, strict=True)) if asked else {}
        if missing := [h for h in handles if h not in by_handle]:
            found = self.indexes[topic].ids_of(packed_handles(missing))
            by_handle.update(zip(missing, found, strict=True))
        return [by_handle[h] or f"{h:032x}" for h in handles]

    async def extend(
        self, topic: str, consumer: str, ids: Named, lease_ms: int, receipts: bool = False
    ) -> tuple[Settled, int]:
        self.topic(topic)
        ids = _once_each(ids)
        mids, named, names, early = self._named(topic, ids, receipts)
        args = (consumer, now_ms(), mids, lease_ms, named)
        refused, deadline = await self._commit(topic, "extend", *args)
        refused = _by_name(refused, names, early)
        return Settled(len(ids) - len(refused), refused), deadline

    def _named(
        self, topic: str, ids: Named, receipts: bool
    ) -> tuple[list[str], list[int] | range | None, dict[int, str], dict[str, Refusal]]:
        """A settling command's (ids, receipts) arguments, with the id each receipt the
        leader made stands for and the ids refused before any command (`receipts_of`):
        ids are turned into their leases' receipts, so the command carries integers.
        Commands from before receipts carried ids alone, as one naming a lease from
        before them still does."""
        if receipts:
            return [], consecutive(ids), {}, {}  # type: ignore[arg-type]
        mids: list[str] = ids  # type: ignore[assignment]
        found = self.state(topic).receipts_of(mids)
        if found is None:
            return mids, None, {}, {}
        made, early = found
        names = dict(zip(made, (m for m in mids if m not in early), strict=True))
        return [], consecutive(made), names, early

    async def _row_or_event(self, topic: str, mid: str) -> Row | str:
        """The message's index row or, once settled and checkpointed (the index forgets
        it), the ledger's event; 404 if unknown."""
        index = self.indexes[topic]
        row = index.row(mid)
        if row is not None:
            return row
        event = await asyncio.to_thread(index.settled_event, mid)
        if event is None:
            raise _unknown(topic, mid)
        return event

    async def _row(self, topic: str, mid: str) -> Row:
        """The message's index row: 409 once settled and checkpointed, 404 if unknown."""
        found = await self._row_or_event(topic, mid)
        if isinstance(found, str):
            raise Problem(409, "already settled", f"{mid} is {found}", reason=Refusal.SETTLED)
        return found

    async def _commit_on_row(
        self, topic: str, mid: str, op: str, args: Callable[[Row, int], tuple]
    ) -> Refusal | None:
        """Commit `op` on a message found in the index (404 or 409 if it is not): its
        arguments made from the row and the seq the row was found at. Refused as
        trimmed if a trim passed that seq (the message may have settled and been
        forgotten meanwhile): the row is read again."""
        for _ in range(REDRIVE_READS):
            row = await self._row(topic, mid)
            seen = self.state(topic).seq
            refused = await self._commit(topic, op, *args(row, seen))
            if refused != Refusal.TRIMMED:
                return refused
        raise Problem(503, f"{op} interrupted", "checkpoints kept trimming under it: retry")

    async def cancel(self, topic: str, mid: str) -> None:
        self.topic(topic)
        refused = await self._commit_on_row(
            topic, mid, "cancel", lambda row, seen: (now_ms(), mid, row.bucket, row.sort_key, seen)
        )
        if refused:
            raise Problem(409, "cannot cancel", f"{mid}: {refused}", reason=refused)

    async def reschedule(
        self, topic: str, mid: str, priority: int | None, deliver_at: int | None
    ) -> None:
        cfg = self.topic(topic)
        wanted = _sort_key(cfg, priority, deliver_at, "reschedule", required=True)
        # The time and the row's bucket make its `rescheduled` event, for the ledger.
        refused = await self._commit_on_row(
            topic, mid, "reschedule", lambda row, seen: (mid, wanted, seen, now_ms(), row.bucket)
        )
        if refused:
            raise Problem(409, "cannot reschedule", f"{mid}: {refused}", reason=refused)

    async def pause(self, topic: str, paused: bool) -> None:
        """Stop or resume leasing on every node; a lease long-poll meanwhile waits."""
        self.topic(topic)
        await self._commit(topic, "pause", paused)

    async def purge(self, topic: str, confirm: str) -> int:
        """Cancel every pending message; leased ones are left to their consumers.

        What is pending when the purge starts: messages indexed after it are kept.
        """
        self.topic(topic)
        if confirm != topic:
            raise Problem(
                422,
                "purge not confirmed",
                f"confirm must be the topic's name, {topic!r}",
                errors=[{"loc": ["body", "confirm"], "msg": "must be the topic's name"}],
            )
        cancelled = 0
        index = self.indexes[topic]
        pending = await asyncio.to_thread(index.pending, self.state(topic))
        for i in range(0, len(pending), OPS_SLICE):
            listed = pending[i : i + OPS_SLICE]
            for _ in range(REDRIVE_READS):
                # Checked here, on the event loop, where no trim is half applied: the walk
                # may have listed a message a trim forgot meanwhile (settled then), which
                # the index no longer holds. The slice is then a list taken at this trim,
                # which the command refuses only if another passes it: checked again at
                # that one, the slice alone, not the walk (seconds for a large topic,
                # where trims come every second).
                state = self.state(topic)
                held = index.held(listed)
                chunk = [
                    pick
                    for pick, m in zip(held, mhs([mid for mid, _, _ in held]), strict=True)
                    if m not in state.settled and m not in state.leases
                ]
                if not chunk:
                    break
                done = await self._commit(topic, "purge", now_ms(), state.trimmed_upto(), chunk)
                if done is not None:
                    cancelled += done
                    break
            else:
                raise Problem(503, "purge interrupted", "checkpoints kept trimming under it: retry")
        return cancelled

    async def redrive(
        self, topic: str, ids: list[str] | None, priority: int | None, deliver_at: int | None
    ) -> tuple[int, dict[str, Refusal]]:
        """Dead messages (`ids`, or all) pending again with deliveries reset, at a new
        priority or deliver_at if given. Returns how many, and why each id left out was.
        """
        cfg = self.topic(topic)
        key = _sort_key(cfg, priority, deliver_at, "redrive", required=False)
        done: set[str] = set()
        refused: dict[str, Refusal] = {}
        for _ in range(REDRIVE_READS):
            upto, dead, redriven = await asyncio.to_thread(self._dead, topic, ids)
            _refuse_removed_buckets(cfg, dead)
            todo = [d for d in dead if d[0] not in refused and d[0] not in done]
            if await self._redrive(topic, upto, todo, key, done, refused):
                break
        else:
            raise Problem(503, "redrive interrupted", "checkpoints kept moving the ledger: retry")
        if ids is None:
            return len(done), {}
        left = [mid for mid in dict.fromkeys(ids) if mid not in done]
        for mid in left:
            refused.setdefault(mid, Refusal.REDRIVEN if mid in redriven else Refusal.NOT_DEAD)
        return len(done), {m: refused[m] for m in left}

    async def _redrive(
        self,
        topic: str,
        upto: int,
        dead: list[Dead],
        key: int | None,
        done: set[str],
        refused: dict[str, Refusal],
    ) -> bool:
        """Commit a redrive of `dead` a slice at a time, into `done` and `refused`; False
        if the state was trimmed past the ledger read `upto` (the rest needs a new read)."""
        for i in range(0, len(dead), OPS_SLICE):
            result = await self._commit(
                topic, "redrive", now_ms(), upto, dead[i : i + OPS_SLICE], key
            )
            if result is None:
                return False
            done.update(result[0])
            refused.update(result[1])
        return True

    def _dead(self, topic: str, ids: list[str] | None) -> tuple[int, list[Dead], dict[str, int]]:
        """The dead of `ids` (None: all), from the ledger and then the events not yet in
        it; the ledger's checkpoint seq; the ids it has redriven since their last death.

        The events are read before the tables as well: the tables know a death by its
        dead letter, which a checkpoint writes before it trims the death, so one trimmed
        while they are read is in that first read; it stands unless the tables hold a
        redrive of its message from after it."""
        st = self.state(topic)
        index = self.indexes[topic]
        wanted = None if ids is None else dict(zip(mhs(ids), ids, strict=True))

        def deaths() -> dict[str, tuple[int, int, int]]:
            """The deaths among the events, by id: those asked for, or all that the
            index names (one whose row it has not read yet is redriven once it has)."""
            dead = [
                e
                for e in settlements(e for e in st.events.view() if e.event == LedgerEvent.DEAD)
                if wanted is None or e.mh in wanted
            ]
            handles = [e.mh for e in dead]
            named = (
                [wanted[h] for h in handles]
                if wanted is not None
                else index.ids_of(packed_handles(handles))
            )
            return {
                mid: (e.bucket, e.sort_key, e.at)
                for e, mid in zip(dead, named, strict=True)
                if mid is not None
            }

        before = deaths()
        upto, dead, redriven = index.dead(ids, (st.history, st.history_from))
        for mid, (bucket, key, at) in before.items():
            if at > redriven.get(mid, at - 1):
                dead.setdefault(mid, (bucket, key))
                redriven.pop(mid, None)
        dead.update((mid, (bucket, key)) for mid, (bucket, key, _) in deaths().items())
        return upto, [(mid, b, k) for mid, (b, k) in dead.items()], redriven

    async def peek(self, topic: str, mid: str) -> dict[str, Any]:
        cfg = self.topic(topic)
        index = self.indexes[topic]
        row = await self._row_or_event(topic, mid)
        rendered = None if isinstance(row, str) else _head(index, mid)
        if isinstance(row, str) or rendered is None:  # checkpointed: the ledger's fact alone
            if not isinstance(row, str):  # just now
                row = await asyncio.to_thread(index.settled_event, mid) or "pending"
            return {"id": mid, "status": row}
        st = self.state(topic)
        h = mh(mid)
        key = st.sort_key(h, row.sort_key)
        lease = st.lease_of(mid)
        if (event := st.settled_event(mid, h)) is not None:
            status = event
        elif lease is not None:
            status = "leased"
        elif st.not_before.get(h, 0) > now_ms():
            status = "delayed"
        else:
            status = "pending"
        timeline = cfg.kind.sorted_as is TopicKind.TIMELINE
        deliveries = lease.deliveries if lease else st.deliveries.get(h, 0)
        msg = message_json.message(rendered, key, deliveries, 0, timeline)
        msg.update(
            status=status,
            lease_deadline=lease.deadline if lease else None,
            consumer_id=lease.consumer if lease else None,
        )
        return msg

    async def heartbeat(self, topic: str, consumer: str) -> list[int]:
        self.topic(topic)
        await self._commit(topic, "touch", consumer, now_ms())
        return sorted(self.state(topic).buckets_of(consumer))

    async def leave(self, topic: str, consumer: str) -> int:
        self.topic(topic)
        return len(await self._commit(topic, "leave", consumer, now_ms(), True))

    def describe(self, topic: str) -> dict[str, Any]:
        cfg = self.topic(topic)
        st, index = self.state(topic), self.indexes[topic]
        now = now_ms()
        per_bucket, delayed = index.stats(st, now)
        leased = {b: sum(list(held.values())) for b, held in list(st.held.items())}
        buckets = []
        for b, s in per_bucket.items():
            buckets.append(
                {
                    "bucket": b,
                    "consumer_id": st.assignment.get(b),
                    "pending": s.pending,
                    "leased": leased.get(b, 0),
                    "deliverable_now": s.deliverable,
                    "oldest_age_ms": None
                    if s.oldest_ingested_ms is None
                    else now - s.oldest_ingested_ms,
                }
            )
        ages = [b["oldest_age_ms"] for b in buckets if b["oldest_age_ms"] is not None]
        return {
            "name": cfg.name,
            "kind": str(cfg.kind),
            "buckets": cfg.buckets,
            "paused": st.paused,
            "pending": sum(b["pending"] for b in buckets) + delayed,
            "delayed": delayed,
            "leased": sum(leased.values()),
            "deliverable_now": sum(b["deliverable_now"] for b in buckets),
            "acked": st.totals.get("acked", 0),
            "dead": st.totals.get("dead", 0),
            "cancelled": st.totals.get("cancelled", 0),
            "oldest_age_ms": max(ages) if ages else None,
            "consumers": sorted(st.consumers),
            "per_bucket": buckets,
        }


def _sort_key(
    cfg: TopicConfig, priority: int | None, deliver_at: int | None, verb: str, required: bool
) -> int | None:
    """The new sort key a request gives: a priority on priority topics, else a deliver_at;
    422 naming the field a topic of this kind takes if it gives the other (or none)."""
    field, wanted, other = (
        ("priority", priority, deliver_at)
        if cfg.kind is TopicKind.PRIORITY
        else ("deliver_at", deliver_at, priority)
    )
    if other is not None or (required and wanted is None):
        raise Problem(422, f"invalid {verb}", f"a {cfg.kind} topic takes only {field}")
    return wanted


Named = list[str] | list[int]  # message ids, or the receipts of their leases


def _once_each(names: Named) -> Named:
    """A request naming a message twice settles it once, and counts it once."""
    return list(dict.fromkeys(names))  # type: ignore[return-value]


def _by_name(
    refused: dict[str | int, Refusal], names: dict[int, str], early: dict[str, Refusal]
) -> dict[str | int, Refusal]:
    """A command's refusals by what the request named: the ids of the receipts the
    leader made for it (`Broker._named`), with those refused before it."""
    return {**early, **{names.get(r, r): why for r, why in refused.items()}}  # type: ignore[call-overload]


def _backoff(cfg: TopicConfig) -> RetryBackoff | None:
    """The topic's retry backoff, as lease commands carry it (None: redeliver at once)."""
    return (cfg.retry_backoff_ms, cfg.retry_backoff_max_ms) if cfg.retry_backoff_ms else None


def _unknown(topic: str, mid: str) -> Problem:
    return Problem(
        404,
        "unknown message",
        f"no message {mid!r} in topic {topic!r} (one settled before the last retention"
        " run's cutoff is in its ledger table only)",
    )


@dataclass
class Outgoing:
    """A message produced over HTTP, in the Kafka envelope the ingest job parses."""

    key: bytes | None
    payload: bytes
    headers: list[tuple[str, bytes]]

    def record_bytes(self) -> int:
        """An upper bound of the message's size as Kafka weighs it against the topic's
        max.message.bytes: a batch of this record alone, with the most overhead a record
        and a batch header can add (the producer sends a record too large for its batch
        alone, and splits a batch of several that Kafka refuses)."""
        estimate = DefaultRecordBatchBuilder.estimate_size_in_bytes
        return estimate(self.key, self.payload, self.headers)


class TooLargeForKafka(Exception):
    """A record larger than its Kafka topic takes, refused here before it is sent."""

    def __init__(self, kafka_topic: str, size: int, limit: int, sent: bool = False) -> None:
        super().__init__(
            f"a record of {size} bytes (payload, key, headers and Kafka's record overhead); "
            f"the Kafka topic {kafka_topic} takes at most {limit} (its max.message.bytes)"
        )
        self.limit = limit
        self.sent = sent  # Kafka refused it: the producer had others of its request too


class FailedOnAnother(Exception):
    """A record the producer failed with another it held, which Kafka refused as too
    large: the idempotent producer fails every record it holds on such a refusal."""


class NotSent(Exception):
    """A record not sent: another of its request's is too large, or time ran out."""


TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)
# A produce answers within this, under the 10 s the client gives an attempt, so a client
# does not give up on an attempt the broker still works on.
PRODUCE_DEADLINE_S = 8.0
# A cron round's sends wait for no client: up to 10,000 occurrences a schedule after an
# outage go out in one round, which takes longer than an HTTP produce may.
MATERIALISE_DEADLINE_S = 120.0
# The longest a send waits for a topic's partitions; none starts later than this before
# the deadline.
MAX_BLOCK_S = 2.0
# How long a record may take to be acknowledged once batched (Kafka's request timeout
# and linger within it), and to reach Kafka at all.
DELIVERY_TIMEOUT_MS, REQUEST_TIMEOUT_MS, BOOTSTRAP_TIMEOUT_MS = 7000, 5000, 2000
DESCRIBE_TIMEOUT_MS = 2000
LIMIT_TTL_S = 60.0  # a topic's max.message.bytes is described again after this
MAX_IN_FLIGHT = 32  # HTTP produces waiting on Kafka at once; beyond, a 503 at once


class Producer:
    """Produce to a topic's Kafka input, so HTTP messages take the same ingest path.

    Produces block on Kafka, so they run on their own threads (one more than
    `max_in_flight`, for the cron materialiser): in an outage they must not hold the
    threads every other endpoint's blocking work runs on."""

    def __init__(self, kafka: KafkaConfig, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.kafka = kafka
        self.max_in_flight = max_in_flight
        self._producer: Any = None
        self._admin: Any = None
        self._lock = threading.Lock()
        self._admin_lock = threading.Lock()
        # Kafka topic → (when described, its max.message.bytes; None: Kafka did not say)
        self._limits: dict[str, tuple[float, int | None]] = {}
        # Producers closed after Kafka refused a record as too large: every other record
        # they failed, they failed for that one.
        self._refused: weakref.WeakSet[Any] = weakref.WeakSet()
        self._in_flight = 0
        self._counting = threading.Lock()
        self._pool = ThreadPoolExecutor(max_in_flight + 1, thread_name_prefix="dejaq-produce")

    def _get(self, deadline: float) -> Any:
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise KafkaTimeoutError("another produce is still connecting to Kafka")
        try:
            if self._producer is None:
                from kafka import KafkaProducer

                self._producer = KafkaProducer(
                    **python_config(self.kafka),
                    acks="all",
                    linger_ms=2,
                    max_request_size=64 * 1024 * 1024,
                    max_block_ms=int(MAX_BLOCK_S * 1000),
                    request_timeout_ms=REQUEST_TIMEOUT_MS,
                    delivery_timeout_ms=DELIVERY_TIMEOUT_MS,
                    bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS,
                )
            return self._producer
        finally:
            self._lock.release()

    def _describe(self, kafka_topic: str) -> int | None:
        """The Kafka topic's max.message.bytes; None where Kafka does not say (describing
        its configs not allowed, Kafka unreachable): then records go unchecked."""
        from kafka import KafkaAdminClient
        from kafka.admin import ConfigResource, ConfigResourceType

        try:
            if self._admin is None:
                self._admin = KafkaAdminClient(
                    **python_config(self.kafka),
                    request_timeout_ms=DESCRIBE_TIMEOUT_MS,
                    bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS,
                )
            wanted = {"max.message.bytes": None}
            topic = ConfigResource(ConfigResourceType.TOPIC, kafka_topic, wanted)
            found = self._admin.describe_configs([topic], config_filter="all")
            return int(found["topic"][kafka_topic]["max.message.bytes"]["value"])
        except Exception as e:  # not allowed, unreachable, no such topic
            log.info("max.message.bytes of Kafka topic %s unknown: %r", kafka_topic, e)
            return None

    def _limit(self, kafka_topic: str, deadline: float, since: float = 0.0) -> int | None:
        """The Kafka topic's max.message.bytes, described at most every LIMIT_TTL_S (a
        failure to describe too, so an outage does not add a describe to every produce),
        and again if described before `since` (Kafka refused a record after it: the limit
        was lowered meanwhile)."""

        def current(described_at: float) -> bool:
            return since <= described_at > time.monotonic() - LIMIT_TTL_S

        known = self._limits.get(kafka_topic)
        if known is not None and current(known[0]):
            return known[1]
        if not self._admin_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None if known is None else known[1]
        try:  # described by another produce while this one waited?
            known = self._limits.get(kafka_topic)
            if known is None or not current(known[0]):
                known = (time.monotonic(), self._describe(kafka_topic))
                self._limits[kafka_topic] = known
            return known[1]
        finally:
            self._admin_lock.release()

    def _send(
        self,
        kafka_topic: str,
        messages: list[Outgoing],
        whole: bool,
        deadline_s: float = PRODUCE_DEADLINE_S,
    ) -> list[Any]:
        """Each message's record metadata once Kafka acknowledged it, or the error that
        kept it out. Records larger than the Kafka topic takes are not sent: a refusal
        by Kafka would fail every record the producer holds, other requests' too. With
        `whole`, none is sent if any is too large."""
        began = time.monotonic()
        deadline = began + deadline_s
        limit = self._limit(kafka_topic, deadline)
        sizes = [m.record_bytes() for m in messages]
        over = [
            TooLargeForKafka(kafka_topic, s, limit) if limit is not None and s > limit else None
            for s in sizes
        ]
        if whole and any(over):
            return [o or NotSent("another of the request is too large") for o in over]
        try:
            producer = self._get(deadline)
        except Exception as e:  # no broker reached, say
            return [e] * len(messages)
        futures: list[Any] = []
        for m, o in zip(messages, over, strict=True):
            if o is not None:
                futures.append(o)
            elif time.monotonic() > deadline - MAX_BLOCK_S:
                futures.append(NotSent("no time left to wait for Kafka"))
            else:
                try:
                    futures.append(
                        producer.send(kafka_topic, key=m.key, value=m.payload, headers=m.headers)
                    )
                except Exception as e:  # the producer's own checks, before sending
                    futures.append(e)
        with contextlib.suppress(Exception):  # each future says how its record fared
            producer.flush(timeout=max(0.0, deadline - time.monotonic()))
        out: list[Any] = []
        broken = refused = False
        for f in futures:
            if isinstance(f, Exception):  # not sent: the producer is unharmed
                out.append(f)
                continue
            try:
                out.append(f.get(timeout=max(0.0, deadline - time.monotonic())))
            except Exception as e:
                out.append(e)
                broken = broken or (isinstance(e, KafkaError) and not e.retriable)
                refused = refused or isinstance(e, TOO_LARGE)
        if broken:
            # The producer is idempotent: an error from Kafka it cannot retry (a record
            # larger than the topic takes) fails every batch it holds and leaves it
            # refusing every later send. A new one takes the next.
            with self._lock:
                if self._producer is producer:
                    self._producer = None
            if refused:
                self._refused.add(producer)
            close_producer(producer, 0)
        if producer in self._refused:
            out = self._own_refusals(kafka_topic, sizes, out, began, deadline)
        return out

    def _own_refusals(
        self, kafka_topic: str, sizes: list[int], out: list[Any], began: float, deadline: float
    ) -> list[Any]:
        """Kafka refused a record as too large, so the producer failed every record it
        held and was closed under any it was given meanwhile: each failed record within
        the topic's limit, described afresh, failed for another's (this request's or
        another's) and may be sent again. Where the limit stays unknown, one Kafka
        refused as too large stays refused."""
        limit = None
        if any(isinstance(o, TOO_LARGE) for o in out):
            limit = self._limit(kafka_topic, deadline, since=began)

        def why(size: int, o: Any) -> Any:
            if not isinstance(o, Exception) or isinstance(o, NotSent | TooLargeForKafka):
                return o
            if isinstance(o, TOO_LARGE):
                if limit is None:
                    return o
                if size > limit:
                    return TooLargeForKafka(kafka_topic, size, limit, sent=True)
            return FailedOnAnother()

        return [why(s, o) for s, o in zip(sizes, out, strict=True)]

    async def send_each(self, kafka_topic: str, messages: list[Outgoing]) -> list[Exception | None]:
        """Send all, then each message's outcome: None once Kafka acknowledged it, or the
        error that kept it out."""
        sending = self._pool.submit(
            self._send, kafka_topic, messages, False, MATERIALISE_DEADLINE_S
        )
        out = await asyncio.wrap_future(sending)
        return [o if isinstance(o, Exception) else None for o in out]

    def _done(self, _: object) -> None:
        with self._counting:
            self._in_flight -= 1

    async def send(self, kafka_topic: str, messages: list[Outgoing]) -> list[str]:
        """Returns the message ids once Kafka acknowledged every message. At most
        `max_in_flight` wait on Kafka at once (a request given up keeps its place until
        its send ends): more are refused at once, so an outage does not pile them up."""
        with self._counting:
            if self._in_flight >= self.max_in_flight:
                raise Problem(
                    503,
                    "too many produces in flight",
                    f"{self._in_flight} produces are waiting on Kafka already; retry",
                    retry_after=1,
                )
            self._in_flight += 1
        running = self._pool.submit(self._send, kafka_topic, messages, True)
        running.add_done_callback(self._done)
        out = await asyncio.wrap_future(running)
        self._answer(kafka_topic, out)
        ids = []
        for m, meta in zip(messages, out, strict=True):
            given = dict(m.headers).get("dejaq-id")
            ids.append(given.decode() if given else f"{kafka_topic}-{meta.partition}-{meta.offset}")
        return ids

    @staticmethod
    def _answer(kafka_topic: str, out: list[Any]) -> None:
        """The problem a request whose records Kafka did not all take answers with."""
        failed = [o for o in out if isinstance(o, Exception)]
        if not failed:
            return
        maybe = (
            "; some of its messages may have been written: resend with ids (`id`), which "
            "the ingest keeps once"
        )
        own = next((e for e in failed if isinstance(e, TooLargeForKafka)), None)
        if own is not None:
            rest = maybe if own.sent else "; none of the request's messages was sent"
            raise Problem(413, "too large for Kafka", f"{own}{rest}", limit=own.limit)
        refused = next((e for e in failed if isinstance(e, TOO_LARGE)), None)
        if refused is not None:
            raise Problem(
                413,
                "too large for Kafka",
                f"the Kafka topic {kafka_topic} refused a record ({type(refused).__name__}), "
                "this request's or one sent with it: raise its max.message.bytes, or lower "
                f"the topic's max_payload_bytes below it{maybe}",
            )
        if any(isinstance(e, FailedOnAnother) for e in failed):
            raise Problem(
                503,
                "not sent",
                "not sent because the producer failed on another record (Kafka refused it "
                f"as too large); retry{maybe}",
            )
        cause = next((e for e in failed if not isinstance(e, NotSent)), failed[0])
        raise Problem(
            503,
            "Kafka unavailable",
            f"{type(cause).__name__}: {cause}. The outcome is unknown: some messages may "
            "have been written, or may be yet; a retry with ids (`id`) is safe, the ingest "
            "keeps each id once",
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._producer is not None:
            close_producer(self._producer, 5)
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()


def _return_free_heap() -> None:
    """Give the C heap that loading freed back to the system. Loading makes and drops
    a payload and a head per row; glibc keeps such freed memory for reuse, and a node
    that never loads that much again would hold it (tens of MB per million rows) for
    its life. Nothing to do on another C library."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)
