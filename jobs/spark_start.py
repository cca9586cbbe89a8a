"""The jobs' SparkSession, from the settings.

A Spark that cannot start (a master it does not know, no Java) ends the command with one
line naming `spark.master`, after what Spark's launcher printed, not a Python traceback.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from dejaq.conf.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def start_spark(app_name: str, settings: Settings) -> SparkSession:
    """The process's SparkSession, as `settings.spark` and the storage settings make it;
    if Spark does not start, the process exits 1 saying why in one line."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    from dejaq.conf.storage import spark_conf
    from dejaq.jobs.logs import one_line
    from dejaq.pipelines.session import get_spark

    spark = settings.spark
    try:
        return get_spark(
            app_name, spark.master, spark.ui, spark.connectors, conf=spark_conf(settings)
        )
    except (PySparkException, Py4JError) as e:
        cause = getattr(e, "java_exception", None)  # the JVM's own, for a Py4JJavaError
        while cause is not None and cause.getCause() is not None:
            cause = cause.getCause()
        why = one_line(e) if cause is None else str(cause.toString()).strip().splitlines()[0]
        sys.exit(f"error: Spark did not start (spark.master {spark.master!r}): {why}")
