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
        ("", {"DEJAQ_STORAGE_ENDPOINT": "http://minio:9000\n"}, "storage.endpoint: expected"),
        ("", {"DEJAQ_WAREHOUSE": "S3A://b/w"}, "write the S3 warehouse as s3://b/w"),
        ("kafka: [unclosed\n", {}, "not valid YAML"),
        ("kafka: {bootstrap: 'a:99999'}\n", {}, "kafka.bootstrap: expected host:port"),
        ("kafka: {bootstrap: 'a:1,b:0'}\n", {}, "ports 1..65535, got 'a:1,b:0'"),
        ("broker: {advertise: 'h:65536'}\n", {}, "broker.advertise: expected HOST:PORT"),
        ("broker: {advertise: 'h:0'}\n", {}, "broker.advertise: expected HOST:PORT"),
        ("broker: {advertise: '0.0.0.0:8443'}\n", {}, "broker.advertise: 0.0.0.0 listens"),
        ("broker: {advertise: '[::]:8443'}\n", {}, "broker.advertise: [::] listens"),
        ("spark: {master: ''}\n", {}, "spark.master: name the Spark master"),
        ("", {"DEJAQ_SPARK_MASTER": " "}, "spark.master: name the Spark master"),
        ('topics: [{name: "a\\n", kind: priority, source: [x]}]\n', {}, "topics.0.name"),
        ("topics: [{name: a, kind: priority, source: [x, y, x]}]\n", {}, "repeated: x"),
        (
            "topics: [{name: a, kind: timeline, source: [x], delivery: release, output: o,"
            " max_event_time_ahead_ms: 1000}]\n",
            {},
            "max_event_time_ahead_ms applies to event_time topics only",
        ),
        (
            "topics: [{name: a, kind: priority, source: [x], max_per_trigger: 5,"
            " release_interval_ms: 100}]\n",
            {},
            "topics.0: release_interval_ms, max_per_trigger apply to delivery: release topics only",
        ),
        (
            "topics: [{name: a, kind: priority, source: [x], max_rate: 5}]\n",
            {},
            "max_rate applies to delivery: release topics only, and this topic's is lease",
        ),
        (
            "topics: [{name: a, kind: timeline, source: [x], delivery: release, output: o,"
            " max_lease_rate: 5, retry_backoff_ms: 10, retry_backoff_max_ms: 100}]\n",
            {},
            "retry_backoff_ms, retry_backoff_max_ms apply to delivery: lease topics only",
        ),
        (
            "topics: [{name: a, kind: priority, source: [x], json_fields: {priority: ''}}]\n",
            {},
            "topics.0.json_fields.priority: a JSON field path such as order.ref",
        ),
        (
            "topics: [{name: a, kind: priority, source: [x], json_fields: {id: $.ref}}]\n",
            {},
            "topics.0.json_fields.id: a JSON field path such as order.ref (read as $.order.ref)"
            ", without the $, got '$.ref'",
        ),
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


@pytest.mark.parametrize(
    ("text", "repeated"),
    [
        (
            "broker:\n  keys_file: /k\nkafka: {bootstrap: 'a:1'}\nbroker:\n  lease_ms: 100\n",
            "'broker' at line 4 (first at line 1)",
        ),
        ("kafka:\n  bootstrap: a:1\n  bootstrap: b:2\n", "'bootstrap' at line 3 (first at line 2)"),
        (
            "topics:\n  - {name: a, kind: priority, source: [x], kind: timeline}\n",
            "'kind' at line 2 (first at line 2)",
        ),
    ],
)
def test_a_repeated_key_is_refused_naming_it_and_its_line(
    tmp_path: Path, text: str, repeated: str
) -> None:
    """YAML keeps the last of a repeated key: a second `broker:` section would drop the
    first one's keys_file, and API keys with it, without a word."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_settings(path, env={})
    assert str(err.value) == f"configuration file {path} repeats the key {repeated}"


def test_a_merge_key_is_not_a_repeated_key(tmp_path: Path) -> None:
    text = "broker: {<<: {lease_ms: 100, max_deliveries: 3}, lease_ms: 200}\n"
    s = load_settings(write(tmp_path, text), env={})
    assert (s.broker.lease_ms, s.broker.max_deliveries) == (200, 3)


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x" * 250, ".", "..", "in\n", "é"])
@pytest.mark.parametrize("where", ["source: [x, {}]", "source: [x], delivery: release, output: {}"])
def test_a_kafka_topic_name_kafka_cannot_hold_is_refused(
    tmp_path: Path, bad: str, where: str
) -> None:
    """The ingest would wait forever for a topic Kafka can never create."""
    quoted = '"' + bad.replace("\n", "\\n") + '"'
    text = f"topics: [{{name: a, kind: timeline, {where.format(quoted)}}}]\n"
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text), env={})
    key = "topics.0.output" if "output" in where else "topics.0.source.1"
    said = f"  {key}: not a Kafka topic name: 1-249 of [A-Za-z0-9._-], not . or .., got {bad!r}"
    assert said in str(err.value)


def test_the_longest_kafka_topic_names_load(tmp_path: Path) -> None:
    longest = "x" * 249
    text = f"topics: [{{name: a, kind: priority, source: [{longest}, a.b_c-D, '...']}}]\n"
    assert load_settings(write(tmp_path, text), env={}).topic("a").source == [
        longest,
        "a.b_c-D",
        "...",
    ]


def test_a_model_level_error_names_the_variables_under_its_key(tmp_path: Path) -> None:
    """A password set in the environment over a file without SASL: the variable is
    named, beside the file that set the rest of the section. A check across the topics,
    which no variable sets, names none."""
    conf = write(tmp_path, "kafka: {bootstrap: 'a:1'}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(conf, env={"DEJAQ_KAFKA_SASL_PASSWORD": "pw"})
    first, line = str(err.value).splitlines()
    assert first == f"invalid configuration in {conf} and the environment:"
    assert line.startswith("  kafka: sasl_password given, but PLAINTEXT has no SASL")
    assert line.endswith("(from the environment: DEJAQ_KAFKA_SASL_PASSWORD)")
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, "warehouse: /w\n"), env={"DEJAQ_KAFKA_SASL_PASSWORD": "pw"})
    assert str(err.value).splitlines()[0] == "invalid configuration in the environment:"
    text = (
        "topics: [{name: a, kind: priority, source: [x]}, {name: a, kind: priority, source: [y]}]"
    )
    twice = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as err:
        load_settings(twice, env={"DEJAQ_WAREHOUSE": "/w"})
    assert str(err.value).splitlines() == [
        f"invalid configuration in {twice}:",
        "  (top level): topic names must be unique, repeated: a",
    ]


def test_an_advertised_address_from_the_environment_is_named_by_its_variable() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(default_conf_file(), env={"DEJAQ_BROKER_ADVERTISE": "nohost"})
    assert str(err.value).splitlines() == [
        "invalid configuration in the environment:",
        "  broker.advertise: expected HOST:PORT with a port 1..65535, got 'nohost'"
        " (from the environment: DEJAQ_BROKER_ADVERTISE)",
    ]
    env = {"DEJAQ_BROKER_ADVERTISE": "[::1]:8443"}
    assert load_settings(default_conf_file(), env=env).broker.advertise == "[::1]:8443"


def test_a_default_written_out_is_not_a_setting_of_the_other_delivery(tmp_path: Path) -> None:
    """What a full dump of the settings writes loads again: only a value that would
    change something is refused on a topic that does not read it."""
    text = (
        "topics: [{name: a, kind: priority, source: [x], release_interval_ms: 250,"
        " max_per_trigger: 10000, max_rate: null, max_event_time_ahead_ms: 3600000}]\n"
    )
    assert load_settings(write(tmp_path, text), env={}).topic("a").delivery is Delivery.LEASE
