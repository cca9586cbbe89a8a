"""Ingest a topic: `spark-submit jobs/ingest.py --topic NAME [--conf-file F] [--once]`.

Also `dejaq ingest`. Without --once it waits for its Kafka input topics to exist, then
runs until SIGTERM or Ctrl-C and stops between two micro-batches; with --once it reads
everything available now and exits (a missing input topic is an error then).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dejaq.conf.kafka_clients import python_config
from dejaq.conf.kafka_login import check_login
from dejaq.conf.settings import ConfigError, KafkaConfig, load_settings
from dejaq.jobs.stopping import stop_between_batches, stop_on_signals

if TYPE_CHECKING:
    from dejaq.pipelines.ingest import IngestJob

log = logging.getLogger("dejaq.ingest")

TOPIC_POLL_SECONDS = 1.0  # how soon a topic that appears is seen
WAITING_EVERY_SECONDS = 10.0  # how often the waiting line is repeated


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


def missing_topics(kafka: KafkaConfig, topics: Sequence[str]) -> list[str]:
    """The topics Kafka does not have; raises KafkaError when it does not answer."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(
        **python_config(kafka), request_timeout_ms=5000, bootstrap_timeout_ms=5000
    )
    try:
        existing = set(admin.list_topics())
    finally:
        admin.close()
    return [t for t in topics if t not in existing]


def _topics(missing: list[str]) -> tuple[str, str]:
    """(`Kafka topic a` or `Kafka topics a, b`, and the pronoun for it)."""
    if len(missing) == 1:
        return f"Kafka topic {missing[0]}", "it"
    return f"Kafka topics {', '.join(missing)}", "them"


def wait_for_topics(kafka: KafkaConfig, topics: Sequence[str], stopping: threading.Event) -> bool:
    """Return once Kafka has every topic (True), or when `stopping` is set first (False).

    Spark's Kafka source fails the query when a subscribed topic is missing, and
    creating it here would guess its partitions, so the job waits for whoever owns the
    topic (or a producer, where Kafka creates topics on first use), saying so every
    WAITING_EVERY_SECONDS.
    """
    from kafka.errors import KafkaError

    said = -WAITING_EVERY_SECONDS
    while True:
        try:
            missing = missing_topics(kafka, topics)
        except KafkaError as e:
            waiting_for = f"Kafka at {kafka.bootstrap} to answer ({type(e).__name__})"
        else:
            if not missing:
                return True
            subject, it = _topics(missing)
            waiting_for = f"{subject} to exist (create {it} or produce to {it})"
        if time.monotonic() - said >= WAITING_EVERY_SECONDS:
            log.info("waiting for %s", waiting_for)
            said = time.monotonic()
        if stopping.wait(TOPIC_POLL_SECONDS):
            return False


def unreadable_topics(kafka: KafkaConfig, topics: Sequence[str]) -> str | None:
    """Why a --once run cannot read every input topic now, or None."""
    from kafka.errors import KafkaError

    try:
        missing = missing_topics(kafka, topics)
    except KafkaError as e:
        return f"Kafka at {kafka.bootstrap} does not answer ({type(e).__name__})"
    if not missing:
        return None
    subject, it = _topics(missing)
    verb = "does" if len(missing) == 1 else "do"
    return f"{subject} {verb} not exist (create {it} or produce to {it})"


def summary(topic: str, job: IngestJob) -> str:
    """The line printed at exit: totals over every batch the job ran, not only those
    whose stats it keeps."""
    t = job.totals
    return (
        f"ingest {topic}: {t.batches} batches, in {t.rows_in}, "
        f"buffered {t.buffered}, quarantined {t.quarantined}"
    )


def run(
    topic: str, conf_file: str | None, once: bool, max_offsets_per_trigger: int | None = None
) -> int:
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException, StreamingQueryException

    from dejaq.conf.storage import export
    from dejaq.conf.tables import ensure_buffer
    from dejaq.jobs.logs import one_line, query_failure, setup
    from dejaq.jobs.spark_start import start_spark
    from dejaq.pipelines.ingest import DEFAULT_MAX_OFFSETS_PER_TRIGGER, IngestJob
    from dejaq.pipelines.ingest_resume import CannotResume
    from dejaq.pipelines.session import detect_connectors

    setup()
    settings = load_settings(conf_file)
    topic_conf = settings.topic(topic)
    check_login(settings.kafka)
    mode = settings.spark.connectors
    export(settings)
    ensure_buffer(settings.warehouse, topic_conf)  # a changed kind, refused before Spark too
    spark = start_spark(f"dejaq-ingest-{topic}", settings)
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
        if once:
            why = unreadable_topics(settings.kafka, topic_conf.source)
            if why is not None:
                print(f"error: ingest {topic}: {why}", file=sys.stderr)
                return 1
        elif not wait_for_topics(settings.kafka, topic_conf.source, stopping):
            log.info("ingest %s: stopped before its Kafka topics existed", topic)
            return 0
        try:
            query = job.start(once)
        except CannotResume as e:
            print(f"error: ingest {topic}: {e}", file=sys.stderr)
            return 1
        except (PySparkException, Py4JError) as e:
            log.error("ingest %s: the query did not start", topic, exc_info=True)
            print(f"error: ingest {topic} failed to start: {one_line(e)}", file=sys.stderr)
            return 1
        log.info("ingest %s: started (query %s)", topic, query.id)
        try:
            while query.isActive and not stopping.is_set():
                query.awaitTermination(0.5)
                job.report(query)
        except StreamingQueryException:
            log.info("ingest %s: the query failed", topic)  # Spark has logged its stack
        if query.isActive:
            log.info("ingest %s: stopping after the current batch", topic)
            stop_between_batches(query)
        job.report(query)
    error = query_failure(query)
    print(summary(topic, job), flush=True)
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
