"""Where the broker's CPU goes per message, measured in one process.

    .venv/bin/python bench/broker_costs.py [--batch B] [--messages N] [--workers W]

Three real Raft nodes (the broker's `RaftNode`: PySyncObj over TCP, AES-GCM, group
commit) share one event loop, each with its own `TopicIndex` over the same Delta buffer,
wired as `dejaq broker` wires them. Workers lease a batch (100 by default: picked and
packed by the leader's index, committed, rendered as the lease JSON) and ack it by its
receipts (the body parsed as the hot path parses it, a whole lease's as a range, as the
broker commits it); the leader checkpoints into the ledger in a thread, about a
second's acks at a time, and trims in slices, as the broker does. Each step is timed
where it runs, on which node (the methods are wrapped for the run, as a profiler would;
a group commit's leases and acks by receipt, which the core applies, as one step),
and the main thread's CPU is split into those steps and the rest: Raft's transport,
sealing, pickling and ticks, and the loop. The checkpoint's thread and the Delta
writer's own are counted apart. No HTTP and no clients (`bench/broker.py` measures the
live system); one event loop, so no step waits on another.

Baselines in the same run, on the same nodes, alternated with the main run in slices
(this VM's speed drifts): each request commits one tiny command instead, a consumer's
heartbeat, as the live Raft floor does; and each request commits what DejaQ's did in
the slice before (its lease's picks, its ack's receipts) as a command every node
refuses unread: Raft carrying DejaQ's bytes and applying nothing. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

from test_broker import buffer_rows, fill  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.broker.api.hotpath import _ack_args, _lease_args, _parsed  # noqa: E402
from dejaq.broker.service import GC_YOUNG_OBJECTS, TRIM_SLICE, trim_cuts  # noqa: E402
from dejaq.broker.state import raft  # noqa: E402
from dejaq.broker.state.leases import TopicState, consecutive, pick_count  # noqa: E402
from dejaq.broker.state.raft import BrokerState, RaftNode  # noqa: E402
from dejaq.broker.storage import message_json  # noqa: E402
from dejaq.broker.storage.index import TopicIndex  # noqa: E402
from dejaq.broker.storage.ledger_writer import checkpoint  # noqa: E402
from dejaq.conf.settings import BrokerConfig, TopicConfig  # noqa: E402
from dejaq.jobs.ports import free_port  # noqa: E402

BUCKETS = 64
# A purge made from a view older than any state (`TopicState.purge`): every node refuses
# it at once, unread, so the command's cost is its replication alone.
CARRY_UPTO = -1
# Events a checkpoint takes: about a second's acks at the live rate, as the broker
# checkpoints every second (`bench/broker.py`: ~5,000 at batch 1, ~50,000 at batch 100).
CHECKPOINT_EVENTS_BATCH_1, CHECKPOINT_EVENTS = 5_000, 50_000


class IndexListener:
    """What `broker.service.Broker` does with applied commands: tell the node's index."""

    def __init__(self, index: TopicIndex) -> None:
        self.index = index

    def pending(self, topic: str, state: TopicState, handles: list[int]) -> None:
        self.index.push(state, handles)

    def gone(self, topic: str, handles: bytes) -> None:
        self.index.forget(handles)

    def reset(self, states: dict[str, TopicState]) -> None:
        self.index.rebuild(states[self.index.topic.name])


CHECKPOINT_STEP = "checkpoint (its own thread)"  # counted in the other threads' CPU too
# Inside "apply": the group's leases and acks by receipt in the core, the rest by
# `BrokerState._apply` ("apply in Python"), which holds the Python transitions' steps.
IN_PYTHON = ("apply lease", "apply ack", "apply trim", "forget settled rows")
CORE_STEP = "apply leases and acks by receipt (core)"
DISPATCH_STEP = "dispatch other commands"


class TimedTransitions:
    """`leases.TRANSITIONS` timed by node, as `Clock.wrap` times a Python method (the
    core's class cannot be patched)."""

    def __init__(self, core: Any, clock: Clock) -> None:
        self.core, self.clock = core, clock

    def apply_group(self, state: Any, commands: Any, apply: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.core.apply_group(state, commands, apply)
        finally:
            if self.clock.on:
                role = self.clock.roles[id(state)]
                self.clock.spent[role, "apply group"] += time.perf_counter() - t


class Clock:
    """Seconds spent per (node role, step), while `on`."""

    def __init__(self) -> None:
        self.spent: Counter[tuple[str, str]] = Counter()
        self.roles: dict[int, str] = {}
        self.on = True

    def wrap(self, cls: type, name: str, step: str, owner: Callable[[Any], Any]) -> None:
        """Time every call of `cls.name`, by the role of the node `owner(self)` is of."""
        original = getattr(cls, name)

        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                if self.on:
                    role = self.roles[id(owner(obj))]
                    self.spent[role, step] += time.perf_counter() - t

        setattr(cls, name, timed)

    def time(self, role: str, step: str, since: float) -> float:
        now = time.perf_counter()
        self.spent[role, step] += now - since
        return now


def nodes_up(warehouse: Path, data_dir: Path) -> tuple[list[RaftNode], list[TopicIndex]]:
    topic = TopicConfig(name="t", kind="priority", source=["t-in"], buckets=BUCKETS)
    conf = BrokerConfig(raft_password=secrets.token_hex(16))
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    indexes = [TopicIndex(str(warehouse), topic) for _ in addrs]
    for index in indexes:
        index.load()
    nodes = [
        RaftNode(a, [p for p in addrs if p != a], [topic], conf, data_dir / f"n{i}", listener)
        for i, (a, listener) in enumerate(zip(addrs, map(IndexListener, indexes), strict=True))
    ]
    return nodes, indexes


async def run(args: argparse.Namespace, data_dir: Path) -> dict:
    nodes, indexes = nodes_up(args.warehouse, data_dir)
    gc.freeze()  # as `Broker.start`: the loaded rows stay out of the cyclic GC
    gc.set_threshold(GC_YOUNG_OBJECTS, 10, 10)
    loop = asyncio.get_running_loop()
    for node in nodes:
        node.attach(loop)
    try:
        deadline = loop.time() + 30
        while not any(n.is_leader() for n in nodes):
            if loop.time() > deadline:
                raise TimeoutError("no Raft leader within 30 s")
            await asyncio.sleep(0.01)
        lead = next(i for i, n in enumerate(nodes) if n.is_leader())
        return await measure(args, nodes, indexes, lead)
    finally:
        for node in nodes:
            node.destroy()


async def measure(
    args: argparse.Namespace, nodes: list[RaftNode], indexes: list[TopicIndex], lead: int
) -> dict:
    leader, index = nodes[lead], indexes[lead]
    state = leader.state.topics["t"]
    clock = Clock()
    for i, node in enumerate(nodes):
        role = "leader" if i == lead else "followers"
        clock.roles[id(node.state.topics["t"])] = role
        clock.roles[id(node.state)] = role
        clock.roles[id(indexes[i])] = role
        clock.roles[id(node.sync)] = role
    for name in ("lease", "ack", "trim"):
        clock.wrap(TopicState, name, f"apply {name}", lambda s: s)
    clock.wrap(TopicIndex, "forget", "forget settled rows", lambda i: i)
    clock.wrap(BrokerState, "_apply", "apply in Python", lambda s: s)
    raft.TRANSITIONS = TimedTransitions(raft.TRANSITIONS, clock)
    # The broker's SyncObj applies the leader's own commands without unpickling them.
    clock.wrap(type(leader.sync), "_SyncObj__doApplyCommand", "apply", lambda s: s)
    workers = [f"w{i}" for i in range(args.workers)]
    for w in workers:
        await leader.commit("t", "touch", w, int(time.time() * 1000))

    sent: dict[str, list[tuple]] = {w: [] for w in workers}  # the commands of each worker
    tally: Counter[str] = Counter()  # leases a trim refused, and checkpoints taken

    async def dejaq(me: str, rounds: int) -> None:
        sent[me] = []
        for _ in range(rounds):
            t = time.perf_counter()
            request = secrets.token_hex(16)  # as the client makes one per lease call
            body = (
                f'{{"consumer_id": "{me}", "max_messages": {args.batch}, '
                f'"request_id": "{request}"}}'
            ).encode()
            assert _lease_args(_parsed(body)) is not None
            now = int(time.time() * 1000)
            t = clock.time("leader", "parse requests", t)
            grants = None
            while not grants:  # as `Broker.lease`: none granted (a trim passed) picks again
                picks, taken = index.pick_with_heads(state, state.buckets_of(me), args.batch, now)
                t = clock.time("leader", "pick", t)
                if not picks[0]:
                    raise RuntimeError(f"{me}'s buckets ran dry: fill more messages")
                lease = (me, now, 30_000, picks, None, request, state.seq)  # as `Broker.lease`
                grants = await leader.commit("t", "lease", *lease)
                sent[me].append(lease)
                tally["repicks"] += not grants
                t = time.perf_counter()
                if len(grants) < pick_count(picks):  # as `Broker.lease`: what was not granted
                    index.release(state, picks)
                    t = clock.time("leader", "release picks", t)
            body = message_json.leased_array(picks, taken, grants, False)
            t = clock.time("leader", "lease JSON", t)
            receipts = [m["receipt"] for m in json.loads(body)]
            ack_body = json.dumps({"consumer_id": me, "receipts": receipts}).encode()
            t = clock.time("client", "read the lease, write the ack", t)  # not counted
            ack = _ack_args(_parsed(ack_body))
            assert ack is not None
            clock.time("leader", "parse requests", t)
            now = int(time.time() * 1000)
            settle = (me, now, [], consecutive(ack[1]))
            refused = await leader.commit("t", "ack", *settle)
            assert not refused, refused
            sent[me].append(settle)
            busy = duties and not duties[-1].done()
            if len(state.events) >= args.checkpoint_events and not busy:
                # A task of its own, as the broker's checkpoint duty: awaited here, it
                # would hold this worker back, and its requests would no longer fall in
                # the others' Raft entries.
                duties.append(asyncio.create_task(checkpoint_and_trim()))

    def checkpoint_in_thread(events: list) -> int:
        t = time.thread_time()
        upto = checkpoint(str(args.warehouse), "t", events, index.id_column)
        clock.spent["leader", CHECKPOINT_STEP] += time.thread_time() - t
        tally["checkpoints"] += 1
        return upto

    checkpointing = asyncio.Lock()
    duties: list[asyncio.Task] = []

    async def checkpoint_and_trim() -> None:
        """In a thread, as the broker's: the workers go on leasing and acking meanwhile,
        and the trims land among their commands."""
        async with checkpointing:
            events = state.events.view()
            if not events:  # a slice's end, just after a checkpoint mid-slice took them all
                return
            upto = await asyncio.to_thread(checkpoint_in_thread, events)
            for cut in trim_cuts(events, upto):
                await leader.commit("t", "trim", cut)

    async def floor(me: str, rounds: int) -> None:
        for _ in range(2 * rounds):  # a lease and an ack per round
            await leader.commit("t", "touch", me, int(time.time() * 1000))

    async def carrying(me: str, rounds: int) -> None:
        for command in sent[me]:  # the last main slice's, each refused unread on apply
            await leader.commit("t", "purge", int(time.time() * 1000), CARRY_UPTO, command)

    rounds = args.messages // (args.batch * args.workers * args.slices)
    cpu: Counter[str] = Counter()
    entries: Counter[str] = Counter()
    for s in range(args.slices):
        systems = (("dejaq", dejaq), ("floor", floor), ("carrying", carrying))
        for name, request in systems[:: 1 if s % 2 == 0 else -1]:
            clock.on = name == "dejaq"  # the floor's applies are not DejaQ's steps
            started, main_started = time.process_time(), time.thread_time()
            first_entry = leader.commit_index()
            await asyncio.gather(*(request(w, rounds) for w in workers))
            if name == "dejaq":
                await asyncio.gather(*duties)
                duties.clear()
                await checkpoint_and_trim()
            cpu[name] += time.process_time() - started
            cpu[f"{name} main thread"] += time.thread_time() - main_started
            entries[name] += leader.commit_index() - first_entry
    n = rounds * args.batch * args.workers * args.slices
    figures = report(clock.spent, cpu, n)
    return {
        **figures,
        # Group commit puts many requests' commands in one Raft entry; each entry costs
        # the same transport, so a system whose requests arrive apart pays more a message.
        "raft_entries_per_message": {k: round(v / n, 4) for k, v in entries.items()},
        "acked": state.totals["acked"],
        "leases_a_trim_refused": tally["repicks"],
        "checkpoints": tally["checkpoints"],
    }


def report(spent: Counter[tuple[str, str]], cpu: Counter[str], n: int) -> dict:
    """µs per message: each step by role (a follower's are the mean of the two), what
    the timed steps leave of the main thread's CPU, and the CPU of the process's other
    threads (the checkpoint's, and the Delta writer's own under it)."""
    steps: dict[str, dict[str, float]] = {}
    timed = 0.0
    for role, share in (("leader", 1), ("followers", 2)):
        inner = ("apply", "apply group", "apply in Python")
        mine = {step: v for (r, step), v in spent.items() if r == role and step not in inner}
        mine["unpickle and dispatch commands"] = spent[role, "apply"] - spent[role, "apply group"]
        mine[CORE_STEP] = spent[role, "apply group"] - spent[role, "apply in Python"]
        mine[DISPATCH_STEP] = spent[role, "apply in Python"] - sum(
            spent[role, s] for s in IN_PYTHON
        )
        timed += sum(v for step, v in mine.items() if step != CHECKPOINT_STEP)
        steps[role] = {k: round(v / n / share * 1e6, 2) for k, v in sorted(mine.items())}
    client = sum(v for (r, _), v in spent.items() if r == "client")
    main = cpu["dejaq main thread"] - client
    return {
        "cpu_us_per_msg": round((cpu["dejaq"] - client) / n * 1e6, 2),
        "steps_us_per_msg": steps,
        "raft_transport_ticks_and_loop_us_per_msg": round((main - timed) / n * 1e6, 2),
        "other_threads_us_per_msg": round((cpu["dejaq"] - cpu["dejaq main thread"]) / n * 1e6, 2),
        "baseline_raft_floor_cpu_us_per_msg": round(cpu["floor"] / n * 1e6, 2),
        "raft_carrying_the_commands_cpu_us_per_msg": round(cpu["carrying"] / n * 1e6, 2),
        "messages": n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=100, help="messages per lease")
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=8, help="concurrent lease+ack loops")
    ap.add_argument("--slices", type=int, default=4, help="alternations with the baseline")
    ap.add_argument("--checkpoint-events", type=int, help="events that start a checkpoint")
    args = ap.parse_args()
    if args.checkpoint_events is None:
        args.checkpoint_events = CHECKPOINT_EVENTS_BATCH_1 if args.batch == 1 else CHECKPOINT_EVENTS
    with tempfile.TemporaryDirectory(prefix="dejaq-costs-") as tmp:
        args.warehouse = Path(tmp) / "warehouse"
        filled = args.messages + args.messages // 10  # buckets drain unevenly
        for start in range(0, filled, 50_000):
            keys = [(i * 7919) % 65536 for i in range(start, min(filled, start + 50_000))]
            rows = buffer_rows(keys, lambda i: i % BUCKETS, f"t-{start}-", noted=False)
            fill(str(args.warehouse), "t", rows)
        figures = asyncio.run(run(args, Path(tmp) / "raft"))
    print(
        json.dumps(
            {
                "benchmark": "broker CPU per message, 3 Raft nodes in one process",
                **figures,
                "parameters": {
                    "batch": args.batch,
                    "workers": args.workers,
                    "buckets": BUCKETS,
                    "slices": args.slices,
                    "checkpoint_events": args.checkpoint_events,
                    "trim_slice": TRIM_SLICE,
                },
                "machine": machine(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
