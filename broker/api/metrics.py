"""Prometheus metrics of one broker node, in a registry of its own."""

from __future__ import annotations

import copy
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from itertools import accumulate
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dejaq.broker.storage.checkpoints import Lag
from dejaq.pipelines.retention import RetentionRun

CLUSTER_TOTAL = (
    ", in the whole cluster: every node publishes the same total, so aggregate over "
    "nodes with max by (topic), not sum"
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._failures_seen: dict[str, int] = {}
        self._refresh_failures_seen: dict[str, int] = {}
        r = self.registry
        GCCollector(registry=r)  # collections per generation: GC pressure shows as latency
        ProcessCollector(registry=r)  # process_resident_memory_bytes among them
        # The cluster's totals, counted in the replicated state: every node publishes the
        # same (a follower a moment behind), so a sum over nodes counts each event once
        # per node. Published by every node, not the leader alone, so each node's series
        # counts on across leader changes instead of a new node's appearing at the total.
        self.leased, self.acked, self.nacked, self.redelivered, self.dead = (
            Counter(name, f"{what}{CLUSTER_TOTAL}", ["topic"], registry=r)
            for name, what in (
                ("dejaq_leased_messages", "Messages leased"),
                ("dejaq_acked_messages", "Messages acked"),
                ("dejaq_nacked_messages", "Messages nacked"),
                ("dejaq_redelivered_messages", "Leases of a message delivered before"),
                ("dejaq_dead_letters", "Messages sent to the dead letters"),
            )
        )
        self.lease_latency = LeaseLatency(registry=r)
        self.loop_lag = Histogram(
            "dejaq_event_loop_lag_seconds",
            "How late the event loop ran Raft's 10 ms timer; HTTP and Raft share the loop, "
            "and followers elect another leader after 0.5-1.5 s without heartbeats",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.raft_role = Gauge(
            "dejaq_raft_role", "1 for this node's current Raft role", ["role"], registry=r
        )
        self.raft_term = Gauge("dejaq_raft_term", "Current Raft term", registry=r)
        self.keys_unreadable = Gauge(
            "dejaq_keys_file_unreadable",
            "1 while this node cannot read its changed key file and refuses every keyed call "
            "(a keyed scrape too: seen where /metrics is open)",
            registry=r,
        )
        self.raft_log = Gauge(
            "dejaq_raft_log_entries",
            "Entries in this node's Raft log (compacted into a snapshot now and then)",
            registry=r,
        )
        self.ledger_lag = Gauge(
            "dejaq_ledger_lag_seconds",
            "Age of the oldest settled event not yet checkpointed into the ledger "
            "(0: none); alert when it stays above a minute",
            ["topic"],
            registry=r,
        )
        self.ledger_unwritten = Gauge(
            "dejaq_ledger_unwritten_events",
            "Events (settled messages, new keys) in Raft, not yet checkpointed into the ledger",
            ["topic"],
            registry=r,
        )
        self.dead_letters_unwritten = Gauge(
            "dejaq_dead_letters_unwritten",
            "Deaths in the ledger whose dead letters are not written yet (kept in Raft)",
            ["topic"],
            registry=r,
        )
        self.checkpoint_unnamed = Gauge(
            "dejaq_checkpoint_unnamed_events",
            "Settled events this node, as leader, cannot write to the ledger yet: its index "
            "has not read their messages' rows (a new leader catching up); they and every "
            "later event wait (see /readyz once it lasts)",
            ["topic"],
            registry=r,
        )
        self.ledger_contested = Gauge(
            "dejaq_ledger_contested",
            "1 while another broker cluster writes the topic's ledger over the same "
            "warehouse: this node stopped serving the topic (see /readyz)",
            ["topic"],
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "dejaq_checkpoint_failures",
            "Failed checkpoint attempts (ledger or dead letters) on this node as leader",
            ["topic"],
            registry=r,
        )
        self.index_size = Gauge(
            "dejaq_index_messages",
            "Messages in the index (pending, delayed or leased; settled ones leave at checkpoint)",
            ["topic"],
            registry=r,
        )
        self.buffer_rows = Gauge(
            "dejaq_buffer_rows", "Rows in the topic's buffer table", ["topic"], registry=r
        )
        self.head_store = Gauge(
            "dejaq_head_store_bytes",
            "Local disk held by the rendered JSON of the topic's pending messages",
            ["topic"],
            registry=r,
        )
        self.settled_rows = Gauge(
            "dejaq_buffer_settled_rows",
            "Buffer rows of settled messages, waiting for retention to remove them",
            ["topic"],
            registry=r,
        )
        self.refresh_failing = Gauge(
            "dejaq_index_refresh_failing_seconds",
            "How long this node's refreshes of the topic's index have failed in a row (0: "
            "the last one worked); new messages are not indexed meanwhile",
            ["topic"],
            registry=r,
        )
        self.refresh_failures = Counter(
            "dejaq_index_refresh_failures",
            "Failed refreshes of the topic's index on this node (one every 0.2 s while failing)",
            ["topic"],
            registry=r,
        )
        self.heads_repaired = Counter(
            "dejaq_heads_repaired",
            "Heads of pending messages this node could not read from its head store (its "
            "disk failing) and read again from the buffer",
            ["topic"],
            registry=r,
        )
        self.heads_unreadable = Counter(
            "dejaq_heads_unreadable",
            "Failed repairs of unreadable heads (one every 0.2 s while failing): the buffer "
            "could not give them again, and /readyz answers 503 meanwhile",
            ["topic"],
            registry=r,
        )
        self.retention_last = Gauge(
            "dejaq_retention_last_run_timestamp_seconds",
            "When this node last ran retention (the leader runs it)",
            ["topic"],
            registry=r,
        )
        self.retention_seconds = Gauge(
            "dejaq_retention_last_run_seconds", "How long that run took", ["topic"], registry=r
        )
        self.retention_removed = Counter(
            "dejaq_retention_removed_rows",
            "Settled messages retention removed from the buffer",
            ["topic"],
            registry=r,
        )

    def observe_ledger(
        self, topic: str, lag: Lag, now_ms: int, failures: int, unnamed: int
    ) -> None:
        """The ledger's lag behind Raft, this node's checkpoint failures in all, and the
        events its last checkpoint could not name (`Health.unnamed`)."""
        age = 0.0 if lag.oldest_ms is None else max(now_ms - lag.oldest_ms, 0) / 1000
        self.ledger_lag.labels(topic).set(age)
        self.ledger_unwritten.labels(topic).set(lag.events)
        self.dead_letters_unwritten.labels(topic).set(lag.unwritten_dead_letters)
        self.checkpoint_unnamed.labels(topic).set(unnamed)
        if (delta := failures - self._failures_seen.get(topic, 0)) > 0:
            self.checkpoint_failures.labels(topic).inc(delta)
            self._failures_seen[topic] = failures

    def observe_raft(self, role: str, term: int, log_entries: int) -> None:
        for r in ("leader", "follower", "candidate"):
            self.raft_role.labels(r).set(1 if r == role else 0)
        self.raft_term.set(term)
        self.raft_log.set(log_entries)

    def observe_index(self, sizes: dict[str, tuple[int, int, int]]) -> None:
        """Per topic: (messages in the index, rows in the buffer version it indexed, bytes
        in its head store)."""
        for topic, (indexed, rows, head_bytes) in sizes.items():
            self.index_size.labels(topic).set(indexed)
            self.head_store.labels(topic).set(head_bytes)
            self.buffer_rows.labels(topic).set(rows)
            self.settled_rows.labels(topic).set(max(rows - indexed, 0))

    def observe_refreshes(self, topic: str, failing_s: float, failures: int) -> None:
        """How long the topic's index refreshes have failed in a row, and their failures
        in all."""
        self.refresh_failing.labels(topic).set(failing_s)
        seen = self._refresh_failures_seen.get(topic, 0)
        self.refresh_failures.labels(topic).inc(max(failures - seen, 0))
        self._refresh_failures_seen[topic] = failures

    def observe_retention(self, topic: str, run: RetentionRun) -> None:
        self.retention_last.labels(topic).set(time.time())
        self.retention_seconds.labels(topic).set(run.seconds)
        self.retention_removed.labels(topic).inc(run.removed)


class TopicsShown(Collector):
    """A registry's metrics with the samples of the topics `shows` lets through, and every
    sample without a topic (Raft, the process): what a scrape by a key of some topics gets."""

    def __init__(self, registry: CollectorRegistry, shows: Callable[[str], bool]) -> None:
        self.registry, self.shows = registry, shows

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = [
                s
                for s in family.samples
                if "topic" not in s.labels or self.shows(s.labels["topic"])
            ]
            if len(kept) != len(family.samples):
                family = copy.copy(family)
                family.samples = kept
            yield family


class LeaseLatency(Collector):
    """`dejaq_lease_seconds`: each topic's lease latency on the leader, a histogram. From
    the picks found to the answer: the lease command's Raft commit and the answer's
    rendering, not a long poll's wait for messages to come (seconds that say nothing of
    the broker's speed, as many as the worker asked to wait).

    Observed once a lease, on the event loop: prometheus_client's `Histogram.observe`
    (a lock, and a Python loop over the buckets) takes ~0.75 µs, a count in a list found
    by bisection ~0.15. The scrape (an async route) runs in the same thread, so nothing
    is read half-written; the count is the buckets' sum, as the format needs.
    """

    BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 30)

    def __init__(self, registry: CollectorRegistry) -> None:
        self._topics: dict[str, Latencies] = {}
        registry.register(self)

    def labels(self, topic: str) -> Latencies:
        """The topic's histogram, made at first use."""
        return self._topics.setdefault(topic, Latencies(self.BOUNDS))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "dejaq_lease_seconds",
            "Lease latency on the leader, from the messages picked to the answer: the lease "
            "command's Raft commit included, a long poll's wait for messages not",
            labels=["topic"],
        )
        les = [*(str(float(bound)) for bound in self.BOUNDS), "+Inf"]
        for topic, latencies in self._topics.items():
            family.add_metric(
                [topic], list(zip(les, accumulate(latencies.counts), strict=True)), latencies.sum
            )
        yield family


class Latencies:
    """One topic's counts per bucket (the last past every bound) and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 where /proc is absent)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
