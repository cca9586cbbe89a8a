"""One SparkSession per process, and the connectors its jobs will use.

The JVM Kafka and Delta connectors are used when their classes are on the classpath
(Databricks, `--packages`); otherwise the project's Python Data Sources stand in with
the same schemas, so a job never needs to know which it got.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from pyspark import SparkConf
from pyspark.sql import SparkSession

JVM_KAFKA_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
JVM_DELTA_CLASS = "io.delta.sql.DeltaSparkSessionExtension"

PY_KAFKA_FORMAT = "dejaq_kafka"
PY_DELTA_FORMAT = "dejaq_delta"


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


def get_spark(app_name: str = "dejaq", master: str = "local[2]", ui: bool = False) -> SparkSession:
    """The process's SparkSession, with Python workers on this interpreter.

    Without PYSPARK_PYTHON the workers start on the system python, cannot import
    pyarrow, and the query hangs for a minute before failing.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.ui.enabled", str(ui).lower())
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
    )
    # Under spark-submit the master comes from its --master; ours is only the default.
    if not SparkConf().contains("spark.master"):
        builder = builder.master(master)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    register_python_sources(spark)
    return spark


def _jvm_has(spark: SparkSession, class_name: str) -> bool:
    try:
        spark.sparkContext._jvm.java.lang.Class.forName(class_name)  # type: ignore[union-attr]
    except Exception:
        return False
    return True


def detect_connectors(spark: SparkSession) -> Connectors:
    """Prefer the JVM connectors; Delta also needs its session extension configured."""
    delta_ext = JVM_DELTA_CLASS in spark.conf.get("spark.sql.extensions", "")
    return Connectors(
        kafka="kafka" if _jvm_has(spark, JVM_KAFKA_CLASS) else PY_KAFKA_FORMAT,
        delta="delta" if delta_ext and _jvm_has(spark, JVM_DELTA_CLASS) else PY_DELTA_FORMAT,
    )


def register_python_sources(spark: SparkSession) -> None:
    from pipelines.delta_source import DeltaDataSource
    from pipelines.kafka_source import KafkaDataSource

    spark.dataSource.register(KafkaDataSource)
    spark.dataSource.register(DeltaDataSource)
