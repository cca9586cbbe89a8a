"""Configuration: defaults load, env overrides apply, and bad config names the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dejaq.conf.settings import ConfigError, Delivery, TopicKind, default_conf_file, load_settings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "dejaq.yaml"
    path.write_text(text)
    return path


def test_packaged_defaults_load() -> None:
    s = load_settings(default_conf_file(), env={})
    assert s.kafka.bootstrap == "127.0.0.1:9092"
    assert s.topic("orders").kind is TopicKind.PRIORITY
    assert s.topic("orders").buckets == 16
    assert s.topic("reminders").delivery is Delivery.RELEASE


def test_env_overrides_leaf_keys() -> None:
    env = {
        "DEJAQ_KAFKA_BOOTSTRAP": "10.0.0.1:9093",
        "DEJAQ_SPARK_UI": "true",
        "DEJAQ_WAREHOUSE": "gs://b/w",
    }
    s = load_settings(default_conf_file(), env=env)
    assert (s.kafka.bootstrap, s.spark.ui, s.warehouse) == ("10.0.0.1:9093", True, "gs://b/w")


def test_conf_file_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, "warehouse: /data/wh\n")
    assert load_settings(env={"DEJAQ_CONF_FILE": str(path)}).warehouse == "/data/wh"


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("kafka: {bootstrap: nohostport}\n", {}, "kafka.bootstrap: expected host:port"),
        ("kafka: {bootstarp: a:1}\n", {}, "kafka.bootstarp: unknown key"),
        ("spark: {ui: maybe}\n", {}, "spark.ui"),
        (
            "kafka: {isolation_level: committed}\n",
            {},
            "kafka.isolation_level: Input should be 'read_committed' or 'read_uncommitted'",
        ),
        ("", {"DEJAQ_KAFKA_BOOTSTRAP": "x"}, "kafka.bootstrap"),
        ("topics: [{name: a, kind: fifo, source: [x]}]\n", {}, "topics.0.kind"),
        ("topics: [{name: 'a/b', kind: priority, source: [x]}]\n", {}, "topics.0.name"),
        ("topics: [{name: a, kind: priority, source: []}]\n", {}, "topics.0.source"),
        ("topics: [{name: a, kind: priority, source: [x], buckets: 0}]\n", {}, "topics.0.buckets"),
        ("topics: [{name: a, kind: event_time, source: [x]}]\n", {}, "release-only"),
        ("topics: [{name: a, kind: priority, source: [x], max_lease_rate: .inf}]\n", {}, "rate"),
        ("topics: [{name: a, kind: priority, source: [x], max_lease_rate: 1e20}]\n", {}, "rate"),
        ("topics: [{name: a, kind: priority, source: [x], max_rate: .nan}]\n", {}, "max_rate"),
        ("topics: [{name: a, kind: timeline, source: [x], delivery: release}]\n", {}, "output"),
        (
            "topics: [{name: a, kind: event_time, source: [x], delivery: release, output: o,"
            " max_event_time_ahead_ms: -1}]\n",
            {},
            "topics.0.max_event_time_ahead_ms",
        ),
        (
            "topics: [{name: a, kind: event_time, source: [x], delivery: release, output: o,"
            " max_event_time_ahead_ms: 604800001}]\n",
            {},
            "topics.0.max_event_time_ahead_ms",
        ),
        (
            "topics: [{name: a, kind: event_time, source: [x], delivery: release, output: o,"
            " idle_timeout_ms: 0}]\n",
            {},
            "topics.0.idle_timeout_ms: Input should be greater than or equal to 1",
        ),
        (
            "topics: [{name: a, kind: timeline, source: [x], delivery: release, output: o,"
            " idle_timeout_ms: 1000}]\n",
            {},
            "idle_timeout_ms applies to event_time topics only",
        ),
        (
            "topics: [{name: a, kind: priority, source: [x]},"
            " {name: a, kind: priority, source: [y]}]\n",
            {},
            "repeated: a",
        ),
        ("- just\n- a list\n", {}, "mapping at the top level"),
        ("warehouse: s3a://bucket/dejaq\n", {}, "warehouse: write the S3 warehouse as s3://"),
        ("storage: {endpoint: minio:9000}\n", {}, "storage.endpoint: expected http(s)://"),
        ("", {"DEJAQ_WAREHOUSE": "S3A://b/w"}, "write the S3 warehouse as s3://b/w"),
        ("kafka: [unclosed\n", {}, "not valid YAML"),
    ],
)
def test_invalid_config_names_the_key(tmp_path: Path, text: str, env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text), env=env)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "line",
    [
        "  raft_password: @Sup3rS3cret",
        "  raft_password: `Sup3rS3cret`",
        "  raft_password: %Sup3rS3cret",
        '  raft_password: "a\\qSup3rS3cret"',
        "  raft_password: *Sup3rS3cret",
        "  raft_password: !Sup3rS3cret x",
    ],
)
def test_a_file_that_is_not_yaml_is_named_by_line_and_column_not_by_its_text(
    tmp_path: Path, line: str
) -> None:
    """The line YAML stops at may hold a password: no command prints it."""
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, f"broker:\n  lease_ms: 100\n{line}\n"), env={})
    said = str(err.value)
    assert "Sup3r" not in said and "\\q" not in said
    assert "not valid YAML at line 3, column " in said


def test_the_environment_is_named_for_what_it_set(tmp_path: Path) -> None:
    conf = write(tmp_path, "broker: {max_deliveries: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(conf, env={"DEJAQ_BROKER_LEASE_MS": "abc"})
    first, line = str(err.value).splitlines()
    assert first == "invalid configuration in the environment:"
    assert line.startswith("  broker.lease_ms: Input should be a valid integer")
    assert line.endswith("(from the environment: DEJAQ_BROKER_LEASE_MS)")
    with pytest.raises(ConfigError, match=f"invalid configuration in {conf}:"):
        load_settings(write(tmp_path, "broker: {max_deliveries: x}\n"), env={})


def test_a_misspelt_variable_is_an_error_not_ignored() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(default_conf_file(), env={"DEJAQ_KAFKA_BOOTSTRAPS": "x:1"})
    assert str(err.value).splitlines()[1] == (
        "  DEJAQ_KAFKA_BOOTSTRAPS: unknown setting (did you mean DEJAQ_KAFKA_BOOTSTRAP?)"
    )
    env = {"DEJAQ_CONF_FILE": str(default_conf_file()), "DEJAQ_JARS_DIR": "/j", "OTHER": "1"}
    assert load_settings(env=env).kafka.bootstrap == "127.0.0.1:9092"


def test_missing_file_and_unknown_topic(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.yaml", env={})
    with pytest.raises(ConfigError, match=r"unknown topic 'zzz' \(configured: orders, reminders\)"):
        load_settings(default_conf_file(), env={}).topic("zzz")
