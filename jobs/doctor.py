"""`dejaq doctor`: what this machine will run the jobs with, and what is missing."""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

from dejaq.conf import jvm
from dejaq.conf.kafka_clients import python_config
from dejaq.conf.kafka_login import check_login
from dejaq.conf.settings import ConfigError, KafkaConfig, Settings, load_settings
from dejaq.conf.storage import describe, export, filesystem, spark_conf
from dejaq.jobs.logs import one_line, stderr_to


def java_version() -> tuple[int | None, str]:
    """(major, text) of the `java` on PATH, or (None, why not)."""
    java = shutil.which("java")
    if java is None:
        return None, "not found on PATH (Debian: apt-get install openjdk-17-jre-headless)"
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(\d+)', out)
    return (int(m.group(1)) if m else None), out.splitlines()[0] if out else "no output"


def kafka_answers(kafka: KafkaConfig, timeout_ms: int = 3000) -> tuple[bool, str]:
    """Whether Kafka answers, logged in as configured, and a line saying so (the login
    named, never its password).

    The bootstrap address only hands out the brokers' advertised addresses, which every
    client then uses: a broker advertising an address this machine cannot reach (a
    container's, another network's) answers the bootstrap and nothing else.
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    bootstrap = kafka.bootstrap
    login = kafka.security_protocol
    if kafka.sasl:
        login += f", {kafka.sasl_mechanism} as {kafka.sasl_username}"
    if kafka.ssl_cafile:
        login += f", CA {kafka.ssl_cafile}"
    try:
        check_login(kafka, timeout_ms)
    except ConfigError as e:
        return False, str(e)
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=timeout_ms / 1000).close()
            break
        except OSError:
            continue
    else:
        return False, f"nothing listens at {bootstrap}"
    try:
        admin = KafkaAdminClient(**python_config(kafka), request_timeout_ms=timeout_ms)
    except KafkaError as e:
        return False, f"no answer from {bootstrap} ({login}): {type(e).__name__}"
    try:
        topics = admin.list_topics()
    except KafkaError as e:
        return False, f"{bootstrap} answers, but its brokers' advertised addresses do not ({e})"
    finally:
        admin.close()
    return True, f"{bootstrap} answers ({login}; {len(topics)} topics)"


def store_answers(settings: Settings) -> tuple[bool, str]:
    """Whether the object store lists the warehouse with the key the engines will use,
    and a line naming the endpoint and where the key comes from (never the secret)."""
    fs, root = filesystem(settings.warehouse)
    try:
        fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError as e:
        return False, f"{describe(settings)}: {one_line(e)}"
    return True, describe(settings)


def _jar_sets() -> list[str]:
    sets = (jvm.SPARK, jvm.S3A, jvm.KAFKA, jvm.S3PROXY)
    return [f"{s}: {len(jvm.jars(s))} jars" for s in sets]


def warehouse_location(warehouse: str) -> str:
    """A URI as it is; a folder as the absolute path the jobs will write to."""
    return warehouse if "://" in warehouse else str(Path(warehouse).expanduser().resolve())


def check_spark(settings: Settings) -> bool:
    """Start Spark and report the connectors it has, its start-up chatter kept to a log.

    Spark's JVM inherits descriptor 2 when it starts, so the log file gets its warnings
    for as long as it runs; the file is removed again unless Spark failed to start.
    """
    from dejaq.pipelines.session import detect_connectors, get_spark, jvm_versions

    fd, path = tempfile.mkstemp(prefix="dejaq-doctor-", suffix=".log")
    os.close(fd)
    log_file = Path(path)
    mode = settings.spark.connectors
    with stderr_to(log_file):
        try:
            spark = get_spark(
                "dejaq-doctor", settings.spark.master, connectors=mode, conf=spark_conf(settings)
            )
        except Exception as e:
            print(f"         FAIL Spark did not start: {one_line(e)} (its log: {log_file})")
            return False
    log_file.unlink()
    ok = True
    try:
        connectors = detect_connectors(spark, mode)
    except RuntimeError as e:
        ok = False
        print(f"         FAIL {e}")
    else:
        for line in connectors.describe().splitlines():
            print(f"         {line}")
    versions = jvm_versions(spark)
    for name in ("delta", "spark-sql-kafka", "kafka-clients"):
        print(f"         {name} {versions.get(name, 'not on the classpath')}")
    return ok


def run(conf_file: str | None) -> int:
    settings = load_settings(conf_file)
    export(settings)
    ok = True
    print(f"python   {sys.version.split()[0]} ({sys.executable})")
    major, text = java_version()
    java_ok = major is not None and major >= 17
    ok &= java_ok
    print(f"java     {'ok  ' if java_ok else 'FAIL'} {text}")

    import pyspark

    print(f"spark    {pyspark.__version__} (master {settings.spark.master})", flush=True)
    if java_ok:
        ok &= check_spark(settings)
    print(f"jars     {jvm.jars_dir()} ({', '.join(_jar_sets())})")
    kafka_jar = next((p.name for p in jvm.jars(jvm.KAFKA) if p.name.startswith("kafka_")), None)
    print(f"         embedded Kafka: {kafka_jar or 'not fetched'}")
    kafka_ok, kafka_text = kafka_answers(settings.kafka)
    ok &= kafka_ok
    print(f"kafka    {'ok  ' if kafka_ok else 'FAIL'} {kafka_text}")
    if settings.on_s3:
        store_ok, store_text = store_answers(settings)
        ok &= store_ok
        print(f"warehouse {'ok  ' if store_ok else 'FAIL'} {store_text}")
    else:
        print(f"warehouse {warehouse_location(settings.warehouse)}")
    print(f"platform {platform.platform()}")
    return 0 if ok else 1
