"""The run's shared SparkSession survives its JVM's death between tests."""

from __future__ import annotations

import os
import signal
import warnings

import pytest
from conftest import SparkJvmExited, live_spark, spark_jvm
from pyspark.sql import SparkSession


def test_a_spark_jvm_that_died_is_started_again_with_a_warning(spark: SparkSession) -> None:
    jvm = spark_jvm()
    assert jvm is not None and jvm.poll() is None
    os.kill(jvm.pid, signal.SIGKILL)
    jvm.wait(timeout=60)
    with pytest.warns(SparkJvmExited, match=rf"pid {jvm.pid}\) had ended, killed by signal 9"):
        again = live_spark()
    assert spark_jvm().pid != jvm.pid
    assert again.range(5).count() == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", SparkJvmExited)
        assert live_spark() is again  # alive: the same session, and no warning
