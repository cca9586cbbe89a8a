"""The run's shared SparkSession outlives a JVM that died, or stopped answering, between tests."""

from __future__ import annotations

import os
import signal
import warnings

import conftest
import pytest
from conftest import SparkJvmExited, live_spark, spark_jvm
from py4j.protocol import Py4JNetworkError
from pyspark import SparkContext
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


class _Unanswering:
    """A gateway's JVM view whose every call fails as a closed gateway's does."""

    def __getattr__(self, name: str) -> object:
        raise Py4JNetworkError("Answer from Java side is empty")


def test_a_spark_jvm_that_stopped_answering_is_ended_and_started_again(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    jvm = spark_jvm()
    assert jvm is not None and jvm.poll() is None
    monkeypatch.setattr(conftest, "JVM_EXIT_WAIT_S", 0.5)
    SparkContext._jvm = _Unanswering()  # not restored: the new session replaces it
    with pytest.warns(SparkJvmExited, match=rf"pid {jvm.pid}\) had ended, killed by signal 9"):
        again = live_spark()
    assert jvm.returncode == -9
    assert again.range(3).count() == 3


def test_a_local_session_puts_its_driver_on_loopback(spark: SparkSession) -> None:
    conf = spark.sparkContext.getConf()
    assert (conf.get("spark.driver.host"), conf.get("spark.driver.bindAddress")) == (
        "127.0.0.1",
        "127.0.0.1",
    )


def test_plans_hide_the_kafka_clients_private_key(
    spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    from dejaq.pipelines.session import JVM_KAFKA_CLASS, jvm_class

    if jvm_class(spark, JVM_KAFKA_CLASS) is None:
        pytest.skip("the JVM Kafka connector is not on this Spark's classpath (`make test`)")
    key = "-----BEGIN PRIVATE KEY-----\nKEYMATERIAL\n-----END PRIVATE KEY-----\n"
    options = {"kafka.bootstrap.servers": "127.0.0.1:1", "subscribe": "t"}
    stream = spark.readStream.format("kafka").options(**options)
    stream.option("kafka.ssl.keystore.key", key).load().explain(True)
    plan = capsys.readouterr().out
    assert "kafka.ssl.keystore.key" in plan and "*********(redacted)" in plan, plan
    assert "KEYMATERIAL" not in plan


def test_apache_kafka_clients_login_modules_keep_their_own_names(spark: SparkSession) -> None:
    from pydantic import SecretStr

    from dejaq.conf.kafka_clients import jvm_options
    from dejaq.conf.settings import KafkaConfig
    from dejaq.pipelines.session import shaded_kafka

    kafka = KafkaConfig(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username="u",
        sasl_password=SecretStr("p"),
    )
    jaas = jvm_options(kafka, shaded=shaded_kafka(spark))["kafka.sasl.jaas.config"]
    assert jaas.startswith("org.apache.kafka.common.security.plain.PlainLoginModule required")
