"""`make bench`: run every benchmark, keep their JSON in one file, chart it, table it.

Writes bench/results.json and bench/results.png, and rewrites the README's benchmark
table between its `<!-- bench -->` markers, so the README's numbers are the last run's.
`--only NAME` reruns one benchmark and keeps the others' last figures, each with the
date it was measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHMARKS = ("ingest", "broker", "release")
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def run(name: str, extra: list[str]) -> dict:
    """One benchmark in its own process; its stdout is one JSON object."""
    print(f"bench: running {name} ...", file=sys.stderr, flush=True)
    out = subprocess.run(
        [sys.executable, str(HERE / f"{name}.py"), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench/{name}.py failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout[out.stdout.index("{") :])


@dataclass(frozen=True)
class Headline:
    """A figure and the baseline it is read against, both from the same run."""

    bench: str
    label: str
    path: str
    baseline_label: str = ""
    baseline_path: str = ""
    unit: str = "msgs/s"


# The README's table: one row per figure a user asks about, beside its same-run baseline.
HEADLINES = (
    Headline(
        "ingest",
        "ingest, Kafka → Delta buffer (JVM connectors)",
        "ingest.msgs_per_s",
        "Spark's plain copy of the topic",
        "spark_plain_copy.msgs_per_s",
    ),
    Headline(
        "ingest",
        "ingest (JVM connectors)",
        "ingest.msgs_per_s",
        "Spark's copy in the buffer's shape (by bucket, idempotent)",
        "spark_shaped_copy.msgs_per_s",
    ),
    Headline(
        "ingest",
        "ingest (JVM connectors)",
        "ingest.msgs_per_s",
        "one kafka-python consumer",
        "baseline_kafka_python_consumer.msgs_per_s",
    ),
    Headline("ingest", "visibility, produce → buffer, p50", "visibility_latency.p50_ms", unit="ms"),
    Headline("ingest", "visibility, produce → buffer, p99", "visibility_latency.p99_ms", unit="ms"),
    Headline(
        "broker",
        "lease + ack, batch 100, 8 workers, 3 nodes",
        "results.batch_100_workers_8.msgs_per_s",
        "Raft floor (HTTP + one Raft command)",
        "floor_http_and_raft.batch_100_workers_8.msgs_per_s",
    ),
    Headline(
        "broker",
        "the same, acking by receipt",
        "acking_by_receipt.batch_100_workers_8.msgs_per_s",
        "Raft floor (HTTP + one Raft command)",
        "floor_http_and_raft.batch_100_workers_8.msgs_per_s",
    ),
    Headline(
        "broker",
        "the same, through `dejaq.client.Worker`",
        "worker_client.batch_100_workers_8.msgs_per_s",
        "Raft floor (HTTP + one Raft command)",
        "floor_http_and_raft.batch_100_workers_8.msgs_per_s",
    ),
    Headline(
        "broker",
        "lease p99, batch 100",
        "results.batch_100_workers_8.lease_p99_ms",
        "Raft floor",
        "floor_http_and_raft.batch_100_workers_8.lease_p99_ms",
        unit="ms",
    ),
    Headline(
        "broker",
        "lease + ack, batch 1, 64 workers, 3 nodes",
        "results.batch_1_workers_64.msgs_per_s",
        "Raft floor (HTTP + one Raft command)",
        "floor_http_and_raft.batch_1_workers_64.msgs_per_s",
    ),
    Headline(
        "broker",
        "the same, acking by receipt",
        "acking_by_receipt.batch_1_workers_64.msgs_per_s",
        "Raft floor (HTTP + one Raft command)",
        "floor_http_and_raft.batch_1_workers_64.msgs_per_s",
    ),
    Headline(
        "broker",
        "the same, through `dejaq.client.Worker`",
        "worker_client.batch_1_workers_64.msgs_per_s",
        "Raft floor (HTTP + one Raft command)",
        "floor_http_and_raft.batch_1_workers_64.msgs_per_s",
    ),
    Headline(
        "release",
        "release, priority topic → Kafka",
        "priority.release_msgs_per_s",
        "kafka-python producer alone",
        "priority.raw_kafka_python_msgs_per_s",
    ),
    Headline(
        "release",
        "timeline lateness p99",
        "timeline.lateness_ms.p99",
        "kafka-python producer sleeping until each is due",
        "timeline.baseline_sleeping_producer.lateness_ms.p99",
        unit="ms",
    ),
    Headline("release", "timeline messages sent early", "timeline.early", unit="messages"),
)


def lookup(data: object, path: str) -> float | None:
    """The number at a dotted path; a list is indexed by its items' `phase` or position."""
    for part in path.split("."):
        if isinstance(data, list):
            data = next(
                (v for i, v in enumerate(data) if part in (str(i), v.get("phase"))),
                None,
            )
        elif isinstance(data, dict):
            data = data.get(part)
        else:
            return None
    return float(data) if isinstance(data, int | float) and not isinstance(data, bool) else None


Row = tuple[Headline, float, float | None]


def headline(results: dict) -> list[Row]:
    """The headline figures the results hold, each with its baseline's value or None."""
    rows = []
    for h in HEADLINES:
        data = results.get(h.bench, {})
        value = lookup(data, h.path)
        if value is not None:
            rows.append((h, value, lookup(data, h.baseline_path) if h.baseline_path else None))
    return rows


def _fmt(value: float) -> str:
    return f"{value:,.3g}" if value < 10 else f"{value:,.0f}"


def chart(rows: list[Row], path: Path, when: str) -> None:
    """Each throughput beside its baseline: the ratio is what the chart shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(h, v, b) for h, v, b in rows if h.unit == "msgs/s" and b]
    fig, ax = plt.subplots(figsize=(11, 0.9 * len(pairs) + 1.5), layout="constrained")
    labels = [f"{h.label}\nvs {h.baseline_label}: {v / b:.2f}x" for h, v, b in pairs]
    ys = range(len(pairs))
    ax.barh([y + 0.2 for y in ys], [v for _, v, _ in pairs], height=0.4, label="DejaQ")
    ax.barh([y - 0.2 for y in ys], [b for _, _, b in pairs], height=0.4, label="baseline")
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("msgs/s")
    ax.legend(loc="lower right")
    fig.suptitle(f"DejaQ against same-run baselines, measured {when}, {os.cpu_count()} cores")
    fig.savefig(path, dpi=110)


def merge(saved: dict | None, fresh: dict, when: str, machine: str) -> dict:
    """The saved results with `fresh` in place of theirs, in BENCHMARKS order, and the
    date each benchmark was last measured (results.json from before had one date)."""
    saved = saved or {"results": {}}
    measured = {
        name: saved.get("measured", {}).get(name, saved.get("date")) for name in saved["results"]
    }
    measured |= dict.fromkeys(fresh, when)
    results = {**saved["results"], **fresh}
    order = [n for n in BENCHMARKS if n in results] + [n for n in results if n not in BENCHMARKS]
    return {
        "date": when,
        "machine": machine,
        "measured": {n: measured[n] for n in order},
        "results": {n: results[n] for n in order},
    }


def when_line(measured: dict[str, str]) -> str:
    """'2026-11-23', or each benchmark's date when `--only` left them apart."""
    dates = set(measured.values())
    if len(dates) == 1:
        return dates.pop()
    return ", ".join(f"{name} {date}" for name, date in measured.items())


def table(rows: list[Row], when: str, machine: str) -> str:
    lines = [
        f"Measured {when} on {machine} by `make bench` "
        "(all figures: bench/results.json; chart: bench/results.png).",
        "",
        "| figure | DejaQ | baseline, same run | ratio |",
        "|---|---|---|---|",
    ]
    for h, value, base in rows:
        # A baseline of 0 (a lateness under a millisecond) is shown, with no ratio.
        against = f"{h.baseline_label}: {_fmt(base)}" if base is not None else ""
        ratio = f"{value / base:.2f}x" if base else ""
        lines.append(f"| {h.label} | {_fmt(value)} {h.unit} | {against} | {ratio} |")
    return "\n".join(lines)


def update_readme(text: str) -> None:
    readme = ROOT / "README.md"
    content = readme.read_text()
    if START not in content or END not in content:
        raise SystemExit(f"README.md has no {START} ... {END} section to update")
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=BENCHMARKS, action="append", help="run just these")
    p.add_argument("--no-readme", action="store_true", help="leave README.md alone")
    p.add_argument("--replot", action="store_true", help="redraw from bench/results.json")
    args = p.parse_args()
    path = HERE / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else None
    if args.replot:
        if saved is None:
            raise SystemExit(f"--replot: {path} does not exist; run the benchmarks first")
        saved = merge(saved, {}, saved["date"], saved["machine"])
    else:
        fresh = {name: run(name, []) for name in args.only or BENCHMARKS}
        machine = (
            f"{os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}"
        )
        saved = merge(saved, fresh, dt.date.today().isoformat(), machine)
        path.write_text(json.dumps(saved, indent=2) + "\n")
    results, machine, when = saved["results"], saved["machine"], when_line(saved["measured"])
    rows = headline(results)
    chart(rows, HERE / "results.png", when)
    if not args.no_readme:
        update_readme(table(rows, when, machine))
    print(table(rows, when, machine))


if __name__ == "__main__":
    main()
