"""One SparkSession per process, and the connectors its jobs will use.

The JVM Kafka and Delta connectors are the default path: from the cluster's own
packages (Databricks, `--packages`), or locally from the jars pinned in `jvm/spark`
(handed to Spark as `spark.jars`: local files, nothing resolved at run time). Where they
are absent, or `spark.connectors: python` forces it, the project's Python Data Sources
stand in with the same schemas and options, so a job never needs to know which it got.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession

from dejaq.conf import jvm
from dejaq.conf.kafka_clients import LOGIN_MODULES, SHADED_PREFIX

JVM_KAFKA_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
JVM_DELTA_CLASS = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"

PY_KAFKA_FORMAT = "dejaq_kafka"
PY_DELTA_FORMAT = "dejaq_delta"

AUTO, JVM, PYTHON = "auto", "jvm", "python"

# Table features delta-rs cannot write stay off for tables Spark creates, so the broker
# (delta-rs) can keep writing every table the jobs (delta-spark) write.
_DELTA_DEFAULTS = {
    "spark.databricks.delta.properties.defaults.enableDeletionVectors": "false",
    "spark.databricks.delta.properties.defaults.enableRowTracking": "false",
    "spark.databricks.delta.properties.defaults.enableInCommitTimestamps": "false",
}

# Delta rebuilds a table's state (its files and its (app id, version) pairs) for every
# JVM read with a shuffle into this many tasks, 50 by default: sized for a cluster. On a
# local master that is 50 tasks of scheduling, ~2.5 s for a small table (the ingest's
# dedup seed, a notebook's query); two tasks do the same in ~0.3 s.
LOOPBACK = "127.0.0.1"
SNAPSHOT_PARTITIONS = "spark.databricks.delta.snapshotPartitions"
LOCAL_SNAPSHOT_PARTITIONS = "2"

# Spark hides an option in its plans (explain(), the UI, the event log) where the key or
# the value matches this runtime setting (by default `url`) or `spark.redaction.regex`
# (`password`, `secret`, ...: the JAAS config). The Kafka client's key, given inline as
# `kafka.ssl.keystore.key`, matches neither.
OPTIONS_REDACTION = "spark.sql.redaction.options.regex"
SECRET_OPTIONS = r"ssl\.keystore\.key|PRIVATE KEY"


@dataclass(frozen=True)
class Connectors:
    """Which `format(...)` names the jobs read and write with."""

    kafka: str
    delta: str

    @property
    def jvm_kafka(self) -> bool:
        return self.kafka == "kafka"

    @property
    def jvm_delta(self) -> bool:
        return self.delta == "delta"

    def describe(self) -> str:
        k = "JVM (format 'kafka')" if self.jvm_kafka else f"Python on kafka-python ({self.kafka})"
        d = "JVM (format 'delta')" if self.jvm_delta else f"Python on delta-rs ({self.delta})"
        return f"Kafka: {k}\nDelta: {d}"


PYTHON_CONNECTORS = Connectors(kafka=PY_KAFKA_FORMAT, delta=PY_DELTA_FORMAT)


def get_spark(
    app_name: str = "dejaq",
    master: str = "local[2]",
    ui: bool = False,
    connectors: str = AUTO,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """The process's SparkSession, with Python workers on this interpreter.

    Without PYSPARK_PYTHON the workers start on the system python, cannot import
    pyarrow, and the query hangs for a minute before failing. Only the first call in a
    process configures the session (a later builder's settings are ignored), so the
    jars are set here or not at all. `conf` adds settings to a session this call starts
    (its `spark.jars` join the connectors'), except those its launcher gave; a Spark
    already running in the process (a notebook's on Databricks) keeps its own.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.ui.enabled", str(ui).lower())
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.python.worker.reuse", "true")
    )
    if _launched():
        SparkContext._ensure_initialized()  # connect to it: its conf is then visible
    given = SparkConf()
    loopback = _loopback_driver(given.get("spark.master", master), given, conf or {})
    if loopback:
        os.environ["SPARK_LOCAL_IP"] = LOOPBACK  # for the JVM this process may start
    settings = {
        **loopback,
        **_DELTA_DEFAULTS,
        **_connector_conf(connectors, given),
    }
    if SparkContext._active_spark_context is None:
        for key, value in (conf or {}).items():
            if given.contains(key):
                continue  # the launcher's (spark-submit --conf, a cluster's own) wins
            if key == "spark.jars" and settings.get(key):
                value = f"{settings[key]},{value}"  # both sets: the connectors' and these
            settings[key] = value
    for key, value in settings.items():
        builder = builder.config(key, value)
    # Under spark-submit the master comes from its --master; ours is only the default.
    if not given.contains("spark.master"):
        builder = builder.master(master)
    if given.get("spark.master", master).startswith("local") and not given.contains(
        SNAPSHOT_PARTITIONS
    ):
        builder = builder.config(SNAPSHOT_PARTITIONS, LOCAL_SNAPSHOT_PARTITIONS)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    redact_secret_options(spark)
    register_python_sources(spark)
    return spark


def redact_secret_options(spark: SparkSession) -> None:
    """Add the Kafka client's private key to the options Spark hides in its plans, to
    whatever the session already hides (a session it did not start included)."""
    current = spark.conf.get(OPTIONS_REDACTION, None) or "(?i)url"
    if SECRET_OPTIONS not in current:
        spark.conf.set(OPTIONS_REDACTION, f"{current}|{SECRET_OPTIONS}")


def _loopback_driver(
    master: str, given: SparkConf, conf: Mapping[str, str], env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The driver on 127.0.0.1 for a local master, so a laptop's other interfaces (a VPN,
    a hostname that resolves nowhere) never matter. Any other master's executors run on
    other hosts and must reach the driver at its own address, and a driver address the
    user gave (spark-submit `--conf`, `conf`, SPARK_LOCAL_IP or SPARK_LOCAL_HOSTNAME)
    wins: then nothing is set."""
    env = os.environ if env is None else env
    keys = ("spark.driver.host", "spark.driver.bindAddress")
    if not master.startswith("local") or any(given.contains(k) or k in conf for k in keys):
        return {}
    if env.get("SPARK_LOCAL_IP", LOOPBACK) != LOOPBACK or "SPARK_LOCAL_HOSTNAME" in env:
        return {}  # loopback is what a first session here set itself
    return dict.fromkeys(keys, LOOPBACK)


def _launched() -> bool:
    """Under spark-submit (or a notebook's running Spark) the JVM exists before the
    session: its classpath is final, so jars set now would not reach the driver."""
    return "PYSPARK_GATEWAY_PORT" in os.environ or SparkContext._jvm is not None


def _connector_conf(connectors: str, given: SparkConf) -> dict[str, str]:
    """`spark.jars` from jvm/lib/spark where this process starts Spark, and Delta's
    session extension and catalog where Delta is on the classpath (unless already set).

    A launched JVM keeps what its launcher chose (`--jars`, `--packages`, a cluster's
    own); without Delta there, the jobs fall back to the Python connectors.
    """
    if connectors == PYTHON:
        return {}
    if _launched():
        conf: dict[str, str] = {}
        has_delta = _load_class(SparkContext._jvm, JVM_DELTA_CLASS) is not None
    else:
        found = jvm.jars(jvm.SPARK)
        conf = {"spark.jars": ",".join(str(p) for p in found)} if found else {}
        has_delta = bool(found)
    if has_delta:
        for key, value in (
            ("spark.sql.extensions", JVM_DELTA_CLASS),
            ("spark.sql.catalog.spark_catalog", DELTA_CATALOG),
        ):
            if not given.contains(key):
                conf[key] = value
    return conf


def _load_class(jvm_view: object, class_name: str) -> object | None:
    """The class as Spark loads `spark.jars` and `--jars` (not the system loader), or None."""
    try:
        return jvm_view.org.apache.spark.util.Utils.classForName(class_name, True, False)  # type: ignore[attr-defined]
    except Exception:
        return None


def jvm_class(spark: SparkSession, class_name: str) -> object | None:
    return _load_class(spark.sparkContext._jvm, class_name)


def shaded_kafka(spark: SparkSession) -> bool:
    """Whether Spark's Kafka connector runs on Databricks' shaded Kafka client, whose
    login modules a JAAS config must name by their shaded classes."""
    return jvm_class(spark, SHADED_PREFIX + LOGIN_MODULES["PLAIN"]) is not None


def detect_connectors(spark: SparkSession, connectors: str = AUTO) -> Connectors:
    """The JVM connectors where present (Delta also needs its session extension), else the
    Python ones; `jvm` insists on the JVM ones, `python` forces the fallback."""
    if connectors == PYTHON:
        return PYTHON_CONNECTORS
    delta_ext = JVM_DELTA_CLASS in spark.conf.get("spark.sql.extensions", "")
    found = Connectors(
        kafka="kafka" if jvm_class(spark, JVM_KAFKA_CLASS) else PY_KAFKA_FORMAT,
        delta="delta" if delta_ext and jvm_class(spark, JVM_DELTA_CLASS) else PY_DELTA_FORMAT,
    )
    missing = [
        c
        for c, ok in ((JVM_KAFKA_CLASS, found.jvm_kafka), (JVM_DELTA_CLASS, found.jvm_delta))
        if not ok
    ]
    if connectors == JVM and missing:
        raise RuntimeError(
            f"spark.connectors is 'jvm' but Spark lacks {' and '.join(missing)}: fetch the "
            "pinned jars with `make test`, or give the connectors to spark-submit"
        )
    return found


def jvm_versions(spark: SparkSession) -> dict[str, str]:
    """Versions of Spark and of the JVM connectors this session loaded (for `dejaq doctor`)."""
    versions = {"spark": spark.version}
    delta = jvm_class(spark, JVM_DELTA_CLASS)
    if delta is not None:
        versions["delta"] = delta.getPackage().getImplementationVersion() or "unknown"  # type: ignore[attr-defined]
    kafka = jvm_class(spark, JVM_KAFKA_CLASS)
    if kafka is not None:
        versions["spark-sql-kafka"] = kafka.getPackage().getImplementationVersion() or "unknown"  # type: ignore[attr-defined]
        info = jvm_class(spark, "org.apache.kafka.common.utils.AppInfoParser")
        versions["kafka-clients"] = info.getMethod("getVersion", None).invoke(None, None)  # type: ignore[union-attr]
    return versions


def register_python_sources(spark: SparkSession) -> None:
    from dejaq.pipelines.delta_source import DeltaDataSource
    from dejaq.pipelines.kafka_source import KafkaDataSource

    spark.dataSource.register(KafkaDataSource)
    spark.dataSource.register(DeltaDataSource)
