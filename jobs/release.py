"""Release a topic: `spark-submit jobs/release.py --topic NAME [--conf-file F] [--once]`.

Also `dejaq release`. Without --once it runs until SIGTERM or Ctrl-C and stops between
two micro-batches; with --once it releases what is deliverable now and exits. Between
batches it removes from the buffer what was settled over `settled_retention_ms` ago.
A topic the lease broker delivered before needs --take-over (`require_owner`), which
carries the brokers' reschedules and nack priorities (the ledger's `rescheduled` rows),
not their nack delays and retry backoffs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from dejaq.conf.kafka_login import check_login
from dejaq.conf.settings import load_settings

if TYPE_CHECKING:
    from dejaq.pipelines.release import Releaser

log = logging.getLogger("dejaq.release")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topic", required=True, help="a topic name from the configuration")
    p.add_argument("--conf-file", help="YAML configuration (default: $DEJAQ_CONF_FILE or packaged)")
    p.add_argument("--once", action="store_true", help="release what is deliverable now, then exit")
    p.add_argument(
        "--take-over",
        action="store_true",
        help="release a topic the lease broker delivered before: its brokers are stopped "
        "once their ledger caught up, and its workers drained. Reschedules and nack "
        "priorities are carried (the ledger holds them); nack delays and retry backoffs "
        "are not: such a message goes once its key is due",
    )


def summary(topic: str, releaser: Releaser) -> str:
    """The line printed at exit: totals over every batch the job ran, not only those
    whose stats it keeps."""
    t = releaser.totals
    return (
        f"release {topic}: {t.batches} batches, released {t.released}, late {t.late}, "
        f"pending {len(releaser.pending)}, settled removed from the buffer {t.removed}"
    )


def run(topic: str, conf_file: str | None, once: bool, take_over: bool = False) -> int:
    from pyspark.errors import StreamingQueryException

    from dejaq.conf.storage import export
    from dejaq.conf.tables import ensure_buffer
    from dejaq.jobs.logs import query_failure, setup
    from dejaq.jobs.spark_start import start_spark
    from dejaq.jobs.stopping import stop_between_batches, stop_on_signals
    from dejaq.pipelines.release import ReleaseJob, require_owner, require_release

    setup()
    settings = load_settings(conf_file)
    check_login(settings.kafka)
    topic_conf = settings.topic(topic)
    require_release(topic_conf)  # before Spark starts: a usage error should be quick
    export(settings)
    require_owner(settings, topic_conf, take_over)
    ensure_buffer(settings.warehouse, topic_conf)  # a changed kind, refused before Spark too
    spark = start_spark(f"dejaq-release-{topic}", settings)
    job = ReleaseJob(spark, settings, topic_conf, take_over)
    log.info(
        "release %s (%s) to Kafka topic %s every %d ms",
        topic,
        topic_conf.kind.value,
        topic_conf.output,
        topic_conf.release_interval_ms,
    )
    try:
        with stop_on_signals() as stopping:
            query = job.start()
            log.info("release %s: started (query %s)", topic, query.id)
            try:
                while query.isActive and not stopping.is_set():
                    query.awaitTermination(0.2)
                    job.report()
                    if once and job.releaser.idle:
                        stopping.set()
            except StreamingQueryException:
                log.info("release %s: the query failed", topic)  # Spark has logged its stack
            if query.isActive:
                if not once:
                    log.info("release %s: stopping after the current batch", topic)
                stop_between_batches(query)
            job.report()
    finally:
        job.releaser.finish()
    error = query_failure(query)
    print(summary(topic, job.releaser), flush=True)
    if error is not None:
        print(f"error: release {topic} failed: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from dejaq.conf.settings import ConfigError

    p = argparse.ArgumentParser(prog="jobs/release.py", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args.topic, args.conf_file, args.once, args.take_over)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
