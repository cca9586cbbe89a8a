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
from collections.abc import Iterator
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


def leaves(value: object, path: tuple[str, ...] = ()) -> Iterator[tuple[str, float]]:
    """(dotted path, number) for every numeric leaf, parameters and machine facts aside."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k not in ("parameters", "machine", "date", "benchmark"):
                yield from leaves(v, (*path, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            label = str(i)
            if isinstance(v, dict):
                label = str(v.get("phase") or v.get("name") or f"batch_{v.get('batch', i)}")
            yield from leaves(v, (*path, str(label)))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield ".".join(path), float(value)


def _is_latency(name: str) -> bool:
    return any(q in name.split("_") for q in ("p50", "p99", "max"))


def headline(results: dict) -> list[tuple[str, str, float]]:
    """The figures worth a table row: throughputs, latencies, ratios, early counts."""
    rows = []
    for bench, data in results.items():
        for name, number in leaves(data):
            last = name.rsplit(".", 1)[-1]
            if (
                "per_s" in last
                or _is_latency(last)
                or last in ("early", "ingest_vs_baseline", "floor_vs_baseline")
            ):
                rows.append((bench, name, number))
    return rows


def chart(rows: list[tuple[str, str, float]], path: Path, when: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [(f"{b}: {n}", v) for b, n, v in rows if "per_s" in n.rsplit(".", 1)[-1]]
    lat = [
        (f"{b}: {n}", v)
        for b, n, v in rows
        if any(q in n.rsplit(".", 1)[-1].split("_") for q in ("p50", "p99"))
    ]
    height = max(4, 0.35 * max(len(rates), len(lat)))
    fig, axes = plt.subplots(1, 2, figsize=(17, height), layout="constrained")
    for ax, data, title in ((axes[0], rates, "throughput (msgs/s)"), (axes[1], lat, "latency")):
        if data:
            ax.barh([d[0] for d in data], [d[1] for d in data])
            ax.set_xscale("log")
        ax.set_title(title)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"DejaQ benchmarks, measured {when}, {os.cpu_count()} cores")
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


def table(rows: list[tuple[str, str, float]], when: str, machine: str) -> str:
    lines = [
        f"Measured {when} on {machine} by `make bench` (bench/results.json, bench/results.png).",
        "",
        "| benchmark | figure | value |",
        "|---|---|---|",
    ]
    lines += [
        f"| {b} | `{n}` | {v:,.3g} |" if v < 10 else f"| {b} | `{n}` | {v:,.0f} |"
        for b, n, v in rows
    ]
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
