"""The README's `spark-submit` lines, run as written but for what a laptop must change.

The commands come from README.md itself (the `sh` block of "Running on a cluster"), so
the test fails when the README drifts from what runs. Adapted: the venv's spark-submit,
`--master local[2]`, the pinned jars of jvm/lib/spark for `--packages` (the README's
alternative; `--packages` would resolve against Maven Central at every run), a
configuration in tmp_path for the README's, and `--once` so the job ends.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from conftest import wait_until
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from dejaq.conf import jvm
from dejaq.conf.settings import load_settings
from dejaq.conf.tables import Table, table_path
from dejaq.jobs.status import row_count

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
POM = ROOT / "jvm" / "spark" / "pom.xml"
SECTION = "The jobs are ordinary PySpark entry points"
JVM_CONNECTORS = "Kafka: JVM (format 'kafka'); Delta: JVM (format 'delta')"


def readme_commands() -> dict[str, list[str]]:
    """The spark-submit commands of the section's first `sh` block, by script path."""
    text = README.read_text()
    at = text.find(SECTION)
    assert at >= 0, f"README.md has no {SECTION!r}"
    block = re.search(r"```sh\n(.*?)```", text[at:], re.DOTALL)
    assert block, f"no ```sh block after {SECTION!r}"
    commands: dict[str, list[str]] = {}
    for line in block.group(1).replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "spark-submit":
            script = next(a for a in argv if a.endswith(".py"))
            commands[script] = argv
    return commands


def pinned_packages() -> set[str]:
    """group:artifact:version of each dependency jvm/spark/pom.xml pins."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    fields = ("groupId", "artifactId", "version")
    return {
        ":".join(d.findtext(f"m:{f}", "", ns) for f in fields)
        for d in ET.parse(POM).getroot().findall("m:dependencies/m:dependency", ns)
    }


def adapt(argv: list[str], conf: Path) -> list[str]:
    """The README's command, runnable here (see the module's docstring)."""
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    launcher, job = argv[1:script], argv[script:]
    local = [str(Path(sys.executable).parent / "spark-submit")]
    if "--master" not in launcher:
        local += ["--master", "local[2]"]
    options = iter(launcher)
    for option in options:
        if option == "--packages":
            assert set(next(options).split(",")) == pinned_packages()
            local += ["--jars", ",".join(str(p) for p in jvm.require(jvm.SPARK))]
        else:
            local.append(option)
    job = [str(conf) if prev == "--conf-file" else a for prev, a in pairwise(job)]
    return local + job + ([] if "--once" in job else ["--once"])


def pairwise(argv: list[str]) -> list[tuple[str, str]]:
    """(the argument before, the argument) for each argument."""
    return list(zip(["", *argv[:-1]], argv, strict=True))


def topic_of(argv: list[str]) -> str:
    return argv[argv.index("--topic") + 1]


def submit(argv: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,  # the README's script paths are the repository's
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def produce_priorities(bootstrap: str, topic: str, priorities: list[int]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i, prio in enumerate(priorities):
        producer.send(
            topic,
            key=f"k{i}".encode(),
            value=f"v{i}".encode(),
            headers=[("dejaq-priority", str(prio).encode())],
            partition=0,
        )
    producer.flush()
    producer.close()


def test_readme_packages_are_the_pinned_connectors() -> None:
    for argv in readme_commands().values():
        if "--packages" in argv:
            packages = argv[argv.index("--packages") + 1]
            assert set(packages.split(",")) == pinned_packages(), "README vs jvm/spark/pom.xml"


def test_readme_ingest_line_lands_records_in_the_buffer(
    kafka_bootstrap, topic_factory, tmp_path
) -> None:
    command = readme_commands().get("jobs/ingest.py")
    assert command, "README shows no spark-submit line for jobs/ingest.py"
    name, source = topic_of(command), topic_factory(partitions=1)
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        f"topics:\n  - {{name: {name}, kind: priority, source: [{source}], buckets: 4}}\n"
    )
    produce_priorities(kafka_bootstrap, source, list(range(20)))

    result = submit(adapt(command, conf))

    assert JVM_CONNECTORS in result.stdout + result.stderr, "--jars gave Spark the connectors"
    settings = load_settings(conf, env={})
    assert row_count(table_path(settings.warehouse, Table.BUFFER, name)) == 20


def test_readme_release_line_releases_in_order(kafka_bootstrap, topic_factory, tmp_path) -> None:
    commands = readme_commands()
    assert "jobs/release.py" in commands, "the README shows how to submit the release job"
    release = commands["jobs/release.py"]
    name = topic_of(release)
    # The README's ingest line, for the release line's topic: it fills the buffer.
    ingest = [name if prev == "--topic" else a for prev, a in pairwise(commands["jobs/ingest.py"])]
    source, out = topic_factory(partitions=1), topic_factory(partitions=1)
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        f"topics:\n  - {{name: {name}, kind: priority, source: [{source}], buckets: 4,"
        f" delivery: release, output: {out}}}\n"
    )
    priorities = [7, 3, 9, 1, 5, 0, 8, 2, 6, 4]
    produce_priorities(kafka_bootstrap, source, priorities)

    submit(adapt(ingest, conf))
    submit(adapt(release, conf))

    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    records: list = []
    try:
        consumer.assign([TopicPartition(out, 0)])
        consumer.seek_to_beginning()

        def polled() -> bool:
            records.extend(r for rs in consumer.poll(timeout_ms=200).values() for r in rs)
            return len(records) >= len(priorities)

        wait_until(polled, timeout=60, what="the released records")
    finally:
        consumer.close()
    released = [priorities[int(r.value.decode().removeprefix("v"))] for r in records]
    assert released == sorted(priorities)


DRIVER_ADDRESS = """
from dejaq.pipelines.session import get_spark

conf = get_spark("driver-address", connectors="python").sparkContext.getConf()
print("driver", conf.get("spark.driver.host"), conf.get("spark.driver.bindAddress"))
"""


def test_a_driver_address_given_to_spark_submit_is_kept(tmp_path) -> None:
    """A cluster's executors reach the driver at the address its launcher gives: the
    session keeps it (127.0.0.2: a loopback address other than the local default)."""
    script = tmp_path / "driver_address.py"
    script.write_text(DRIVER_ADDRESS)
    argv = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]"]
    argv += [
        "--conf",
        "spark.driver.host=127.0.0.2",
        "--conf",
        "spark.driver.bindAddress=127.0.0.2",
    ]

    result = submit([*argv, str(script)])

    assert "driver 127.0.0.2 127.0.0.2" in result.stdout, result.stdout[-2000:]


def test_only_a_local_master_gets_a_loopback_driver() -> None:
    from pyspark import SparkConf

    from dejaq.pipelines.session import _loopback_driver

    nothing_given = SparkConf(loadDefaults=False)
    local = _loopback_driver("local[2]", nothing_given, {}, env={})
    assert local == {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
    for master in ("yarn", "k8s://https://10.0.0.1:6443", "spark://10.0.0.2:7077"):
        assert _loopback_driver(master, nothing_given, {}, env={}) == {}, master
    given = SparkConf(loadDefaults=False).set("spark.driver.host", "10.9.8.7")
    assert _loopback_driver("local[2]", given, {}, env={}) == {}
    assert (
        _loopback_driver("local[2]", nothing_given, {"spark.driver.bindAddress": "0.0.0.0"}) == {}
    )
    assert _loopback_driver("local[2]", nothing_given, {}, env={"SPARK_LOCAL_IP": "10.1.1.1"}) == {}
    again = _loopback_driver("local[2]", nothing_given, {}, env={"SPARK_LOCAL_IP": "127.0.0.1"})
    assert again == local, "a second session in a process whose first set loopback"


SHADED_LOGIN = """
from pydantic import SecretStr

from dejaq.conf.kafka_clients import jvm_options
from dejaq.conf.settings import KafkaConfig
from dejaq.pipelines.session import get_spark, shaded_kafka

spark = get_spark("shaded-kafka", master="local[1]", connectors="python")
kafka = KafkaConfig(
    security_protocol="SASL_PLAINTEXT",
    sasl_mechanism="SCRAM-SHA-512",
    sasl_username="u",
    sasl_password=SecretStr("p"),
)
print("jaas", jvm_options(kafka, shaded=shaded_kafka(spark))["kafka.sasl.jaas.config"])
"""


def test_a_shaded_kafka_client_gets_its_shaded_login_module(tmp_path) -> None:
    """Databricks' Kafka client is shaded under `kafkashaded.`. Its runtime cannot run
    here: a jar holding an empty class of the shaded name stands in for it on the
    driver's classpath, which is all the choice looks at."""
    source = tmp_path / "src" / "kafkashaded/org/apache/kafka/common/security/plain"
    source.mkdir(parents=True)
    (source / "PlainLoginModule.java").write_text(
        "package kafkashaded.org.apache.kafka.common.security.plain;\n"
        "public class PlainLoginModule {}\n"
    )
    classes, jar = tmp_path / "classes", tmp_path / "kafkashaded.jar"
    subprocess.run(["javac", "-d", str(classes), str(source / "PlainLoginModule.java")], check=True)
    subprocess.run(["jar", "cf", str(jar), "-C", str(classes), "."], check=True)
    script = tmp_path / "shaded_login.py"
    script.write_text(SHADED_LOGIN)
    spark_submit = str(Path(sys.executable).parent / "spark-submit")

    result = submit([spark_submit, "--master", "local[1]", "--jars", str(jar), str(script)])

    login = "kafkashaded.org.apache.kafka.common.security.scram.ScramLoginModule required"
    assert f"jaas {login}" in result.stdout, result.stdout[-2000:]


WRITE_ON_EXECUTORS = """
import sys
import uuid

import pyarrow as pa
from deltalake import write_deltalake
from pyspark.sql import SparkSession

from dejaq.conf.settings import load_settings
from dejaq.conf.storage import export, filesystem
from dejaq.pipelines.delta_source import WriteTarget, write_files

# A session started before the job's, as a notebook's is: no executorEnv of the section.
spark = SparkSession.builder.master("local[1]").getOrCreate()
settings = load_settings(env={"DEJAQ_WAREHOUSE": sys.argv[1], **dict(
    a.split("=", 1) for a in sys.argv[2:]
)})
export(settings)  # the job's start: the driver's environment only
path = f"{settings.warehouse}/executors-{uuid.uuid4().hex[:8]}"
write_deltalake(path, pa.table({"id": pa.array([], pa.int64())}))
target = WriteTarget.of(path)


def write(batches):
    for batch in batches:
        for action in write_files(target, pa.Table.from_batches([batch])):
            yield pa.RecordBatch.from_pylist([{"path": action.path}])


written = spark.range(5, numPartitions=1).mapInArrow(write, "path string").collect()
fs, root = filesystem(path)
print("written", [fs.get_file_info(f"{root}/{r.path}").size > 0 for r in written])
"""


def test_executors_write_to_s3_in_a_session_the_job_did_not_start(s3, tmp_path) -> None:
    """A Spark running before the job's (a notebook's) never gets the job's Spark
    settings: the tasks it runs reach the storage section's S3 all the same."""
    script = tmp_path / "write_on_executors.py"
    script.write_text(WRITE_ON_EXECUTORS)
    section = [f"{k}={v}" for k, v in s3.env.items() if k.startswith("DEJAQ_STORAGE_")]
    # The executors' environment: the key (found there, as an instance role would be),
    # and none of the section's variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DEJAQ_"))}
    env.update(AWS_ACCESS_KEY_ID=s3.env["AWS_ACCESS_KEY_ID"])
    env.update(AWS_SECRET_ACCESS_KEY=s3.env["AWS_SECRET_ACCESS_KEY"], PYSPARK_PYTHON=sys.executable)
    spark_submit = str(Path(sys.executable).parent / "spark-submit")
    argv = [spark_submit, "--master", "local[1]", str(script), "s3://dejaq/spark-submit"]

    result = subprocess.run(
        [*argv, *section], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )

    assert result.returncode == 0, result.stderr[-3000:]
    assert "written [True]" in result.stdout, result.stdout[-2000:]
