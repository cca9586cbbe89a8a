"""Ingest a topic: `spark-submit jobs/ingest.py --topic NAME [--conf-file F] [--once]`.

Also `dejaq ingest`. Without --once it runs until SIGTERM or Ctrl-C and stops between
two micro-batches; with --once it reads everything available now and exits.
"""

from __future__ import annotations

import argparse
import logging
import sys

from dejaq.conf.settings import ConfigError, load_settings
from dejaq.jobs.stopping import stop_between_batches, stop_on_signals

log = logging.getLogger("dejaq.ingest")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topic", required=True, help="a topic name from the configuration")
    p.add_argument("--conf-file", help="YAML configuration (default: $DEJAQ_CONF_FILE or packaged)")
    p.add_argument("--once", action="store_true", help="process what is available now, then exit")
    p.add_argument(
        "--max-offsets-per-trigger",
        type=int,
        default=None,
        help="Kafka records per micro-batch at most (default 250000)",
    )


def run(
    topic: str, conf_file: str | None, once: bool, max_offsets_per_trigger: int | None = None
) -> int:
    from dejaq.jobs.logs import setup
    from dejaq.pipelines.ingest import DEFAULT_MAX_OFFSETS_PER_TRIGGER, IngestJob
    from dejaq.pipelines.session import detect_connectors, get_spark

    setup()
    settings = load_settings(conf_file)
    topic_conf = settings.topic(topic)
    mode = settings.spark.connectors
    spark = get_spark(f"dejaq-ingest-{topic}", settings.spark.master, settings.spark.ui, mode)
    connectors = detect_connectors(spark, mode)
    log.info(
        "ingest %s from %s; %s",
        topic,
        ",".join(topic_conf.source),
        connectors.describe().replace("\n", "; "),
    )
    job = IngestJob(
        spark,
        settings,
        topic_conf,
        connectors,
        max_offsets_per_trigger=max_offsets_per_trigger or DEFAULT_MAX_OFFSETS_PER_TRIGGER,
    )
    with stop_on_signals() as stopping:
        query = job.start(once)
        log.info("ingest %s: started (query %s)", topic, query.id)
        while query.isActive and not stopping.is_set():
            query.awaitTermination(0.5)
            job.report(query)
        if stopping.is_set():
            log.info("ingest %s: stopping after the current batch", topic)
            stop_between_batches(query)
        job.report(query)
    error = query.exception()
    totals = [sum(getattr(s, f) for s in job.stats) for f in ("rows_in", "buffered", "quarantined")]
    print(
        f"ingest {topic}: {len(job.stats)} batches, in {totals[0]}, "
        f"buffered {totals[1]}, quarantined {totals[2]}",
        flush=True,
    )
    if error is not None:
        print(f"error: ingest {topic} failed: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jobs/ingest.py", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args.topic, args.conf_file, args.once, args.max_offsets_per_trigger)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
