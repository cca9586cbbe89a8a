"""Load and validate conf/dejaq.yaml with environment overrides.

Validation happens once, at start, so a typo fails with the key's name instead of a
stack trace twenty minutes into a job.
"""

from __future__ import annotations

import copy
import difflib
import ipaddress
import os
import re
from collections.abc import Hashable, Iterator, Mapping
from enum import StrEnum
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

ENV_PREFIX = "DEJAQ_"
# Anchored for the HTTP API's path pattern (searched, in JSON Schema's way); Python
# callers fullmatch it, as `$` alone lets a trailing newline through.
TOPIC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
# Kafka's own rule for a topic name: one it refuses would be waited for forever.
KAFKA_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
# A cron occurrence can be materialised again until its progress is stored, which happens
# seconds after it was first sent: the dedup window covers the horizon plus this margin.
CRON_DEDUP_SLACK_MS = 3600 * 1000
MAX_RATE = 1_000_000.0  # messages a second: rate limits above it limit nothing
# The most an event time may lead its record: beyond a week, the bound no longer guards
# the watermark against a clock or unit slip.
MAX_EVENT_TIME_AHEAD_MS = 7 * 24 * 3600 * 1000


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


def _kafka_topic(v: str) -> str:
    if not KAFKA_TOPIC.fullmatch(v) or v in (".", ".."):
        raise ValueError(f"not a Kafka topic name: 1-249 of [A-Za-z0-9._-], not . or .., got {v!r}")
    return v


KafkaTopic = Annotated[str, AfterValidator(_kafka_topic)]


# The ports a server can be told to listen on: the kernel takes a larger number modulo
# 65536 (99999 listens on 34463), and 0 asks it for any port, which nobody can then dial.
PORTS = range(1, 65536)


def _host_port(v: str) -> bool:
    """Whether `v` is HOST:PORT with a port a socket can have (`PORTS`): clients would
    call the port written, not the one a server listens on."""
    host, _, port = v.strip().rpartition(":")
    return bool(host) and port.isdigit() and int(port) in PORTS


class TopicKind(StrEnum):
    PRIORITY = "priority"
    TIMELINE = "timeline"
    EVENT_TIME = "event_time"
    CRON = "cron"

    @property
    def sorted_as(self) -> TopicKind:
        """The kind whose sort key and delivery rule apply: a cron topic's messages are
        its schedules' occurrences, delivered as a timeline (by deliver_at, never early)."""
        return TopicKind.TIMELINE if self is TopicKind.CRON else self


class Delivery(StrEnum):
    LEASE = "lease"
    RELEASE = "release"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JsonFields(_Strict):
    """Envelope fields taken from a JSON payload instead of Kafka headers."""

    priority: str | None = None
    deliver_at: str | None = None
    id: str | None = None
    event_time: str | None = None

    @field_validator("*")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        """A path is read as `$.<path>`: an empty one, or one with its own `$`, finds no
        field in any payload, and every record would be quarantined."""
        if v is not None and (not v or v.startswith("$")):
            raise ValueError(
                "a JSON field path such as order.ref (read as $.order.ref), without the $, "
                f"got {v!r}"
            )
        return v


# The settings only one delivery reads: given to a topic of the other, they would do
# nothing.
DELIVERY_SETTINGS = {
    Delivery.LEASE: ("max_lease_rate", "retry_backoff_ms", "retry_backoff_max_ms"),
    Delivery.RELEASE: ("release_interval_ms", "max_per_trigger", "max_rate"),
}


class TopicConfig(_Strict):
    name: str
    kind: TopicKind
    source: list[KafkaTopic] = Field(min_length=1)
    buckets: int = Field(default=16, ge=1, le=4096)
    max_payload_bytes: int = Field(default=1024 * 1024, ge=1)
    delivery: Delivery = Delivery.LEASE
    output: KafkaTopic | None = None
    json_fields: JsonFields | None = None
    dedup_window_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=0)
    # How long a quarantined record is kept (deleted at the ingest's compactions).
    quarantine_retention_ms: int = Field(default=30 * 24 * 3600 * 1000, ge=3600 * 1000)
    # How long a settled message (acked, dead, cancelled, released) stays in the buffer
    # before retention removes it; the ledger keeps its record.
    settled_retention_ms: int = Field(default=3600 * 1000, ge=0)
    allowed_lateness_ms: int = Field(default=5000, ge=0)
    # Event time: how far ahead of its record's Kafka timestamp an event time may be; one
    # further ahead is quarantined, as it would hold the watermark up there.
    max_event_time_ahead_ms: int = Field(default=3600 * 1000, ge=0, le=MAX_EVENT_TIME_AHEAD_MS)
    # Event time: after this long without a newer event read, the watermark reaches the
    # newest one (None: never, as Spark's, so an event waits for allowed_lateness_ms of
    # newer event time however long that takes).
    idle_timeout_ms: int | None = Field(default=None, ge=1)
    # Ingest batches between compactions of the buffer's small files (0: never).
    compact_every_batches: int = Field(default=100, ge=0)
    # Release job (delivery: release): its trigger, and priority mode's caps.
    release_interval_ms: int = Field(default=250, ge=10, le=60_000)
    max_per_trigger: int = Field(default=10_000, ge=1)
    max_rate: float | None = Field(default=None, gt=0, le=MAX_RATE, allow_inf_nan=False)
    # Lease broker (delivery: lease): messages per second leased across all consumers (a
    # token bucket holding one second's worth, at least 1), and the wait before a message
    # whose lease expired or was nacked without a delay can be leased again:
    # retry_backoff_ms * 2^(deliveries - 1), at most retry_backoff_max_ms (0: at once).
    max_lease_rate: float | None = Field(default=None, gt=0, le=MAX_RATE, allow_inf_nan=False)
    retry_backoff_ms: int = Field(default=0, ge=0)
    retry_backoff_max_ms: int = Field(default=300_000, ge=0)
    # Cron topics: how far ahead of their time occurrences become timeline messages.
    cron_horizon_ms: int = Field(default=5 * 60 * 1000, ge=1000, le=24 * 3600 * 1000)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOPIC_NAME.fullmatch(v):
            raise ValueError("must be 1-200 of [A-Za-z0-9._-], starting with a letter or digit")
        return v

    @field_validator("source")
    @classmethod
    def _sources(cls, v: list[str]) -> list[str]:
        if dupes := sorted({t for t in v if v.count(t) > 1}):
            raise ValueError(f"Kafka topics must be unique, repeated: {', '.join(dupes)}")
        return v

    @model_validator(mode="after")
    def _delivery(self) -> TopicConfig:
        if self.kind is TopicKind.EVENT_TIME and self.delivery is Delivery.LEASE:
            raise ValueError("event_time topics are release-only: set delivery: release")
        if self.delivery is Delivery.RELEASE and not self.output:
            raise ValueError("delivery: release needs an output Kafka topic")
        if self.idle_timeout_ms is not None and self.kind is not TopicKind.EVENT_TIME:
            raise ValueError("idle_timeout_ms applies to event_time topics only")
        if self._given("max_event_time_ahead_ms") and self.kind is not TopicKind.EVENT_TIME:
            raise ValueError("max_event_time_ahead_ms applies to event_time topics only")
        other = Delivery.LEASE if self.delivery is Delivery.RELEASE else Delivery.RELEASE
        if given := self._given(*DELIVERY_SETTINGS[other]):
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(
                f"{', '.join(given)} {verb} to delivery: {other} topics only, and this "
                f"topic's is {self.delivery}"
            )
        if self.retry_backoff_max_ms < self.retry_backoff_ms:
            raise ValueError("retry_backoff_max_ms must be at least retry_backoff_ms")
        if self.kind is TopicKind.CRON:
            self._cron()
        return self

    def _given(self, *names: str) -> list[str]:
        """Those of `names` set to other than their defaults (a default written out, as
        a full dump of the settings does, changes nothing and is not refused)."""
        fields = type(self).model_fields
        return [n for n in names if getattr(self, n) != fields[n].default]

    def _cron(self) -> None:
        """Occurrences carry their envelope in headers and are deduplicated by id."""
        jf = self.json_fields
        if jf is not None and (jf.deliver_at or jf.id):
            raise ValueError("cron topics take deliver_at and id from headers, not json_fields")
        least = self.cron_horizon_ms + CRON_DEDUP_SLACK_MS
        if self.dedup_window_ms < least:
            raise ValueError(
                f"dedup_window_ms must be at least cron_horizon_ms + {CRON_DEDUP_SLACK_MS} "
                f"({least}) on a cron topic, or a re-materialised occurrence is buffered twice"
            )


class KafkaConfig(_Strict):
    """Where Kafka is and how to log in: every Kafka client of the project uses this (see
    `conf.kafka_clients`). The password is a `SecretStr`: it never prints."""

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None  # PEM: the CA that signed the brokers' certificates
    ssl_certfile: str | None = None  # PEM: a client certificate, for mutual TLS
    ssl_keyfile: str | None = None  # PEM (PKCS#8): its key
    ssl_check_hostname: bool = True
    # What the ingest reads of its input topics: read_committed skips the records of
    # aborted transactions (a retry commits them again at other offsets, under other
    # default ids) and stops at an open transaction until it ends.
    isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed"

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.security_protocol.endswith("SSL")

    @model_validator(mode="after")
    def _security(self) -> KafkaConfig:
        sasl = ("sasl_mechanism", "sasl_username", "sasl_password")
        if self.sasl:
            missing = [name for name in sasl if getattr(self, name) is None]
            if missing:
                raise ValueError(
                    f"security_protocol {self.security_protocol} needs {', '.join(missing)}"
                )
        elif given := [name for name in sasl if getattr(self, name) is not None]:
            raise ValueError(
                f"{', '.join(given)} given, but {self.security_protocol} has no SASL: "
                "set security_protocol to SASL_SSL or SASL_PLAINTEXT"
            )
        files = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
        if not self.tls and (given := [n for n in files if getattr(self, n) is not None]):
            raise ValueError(
                f"{', '.join(given)} given, but {self.security_protocol} has no TLS: "
                "set security_protocol to SSL or SASL_SSL"
            )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together (mutual TLS)")
        for name in files:
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
        return self

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap(cls, v: str) -> str:
        if not all(_host_port(server) for server in v.split(",")):
            raise ValueError(f"expected host:port[,host:port...] with ports 1..65535, got {v!r}")
        return v


class SparkConfig(_Strict):
    master: str = "local[2]"
    ui: bool = False
    # auto: the JVM Kafka and Delta connectors where Spark has them, else the Python ones;
    # jvm: fail without them; python: always the Python Data Sources (kafka-python, delta-rs).
    connectors: Literal["auto", "jvm", "python"] = "auto"

    @field_validator("master")
    @classmethod
    def _master(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(
                f"name the Spark master, such as local[2] or spark://host:7077, got {v!r}"
            )
        return v


class TlsConfig(_Strict):
    """PEM files for the broker's HTTPS: this node's certificate and key, and the CA that
    signed the nodes' certificates (a follower verifies the leader with it)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if (self.cert is None) != (self.key is None):
            raise ValueError("give both cert and key (PEM files), or neither")
        if self.ca is not None and self.cert is None:
            raise ValueError("ca is for verifying the nodes' certificates: give cert and key")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
        return self

    @property
    def on(self) -> bool:
        return self.cert is not None

    @property
    def scheme(self) -> str:
        """What the nodes serve: https with a certificate, else http."""
        return "https" if self.on else "http"


class BrokerConfig(_Strict):
    """The HTTP lease broker; `raft_password` is required for more than one node.

    `keys_file` turns on API keys (`dejaq keys add`); a node bound beyond loopback
    without it refuses to start unless `insecure` says it is meant to be open, and with
    it, but without `tls`, unless `insecure` says something in front encrypts its traffic.
    """

    raft_password: str | None = None
    # HOST:PORT this node registers for the others to forward to (`dejaq broker --advertise`).
    advertise: str | None = None
    keys_file: str | None = None
    insecure: bool = False
    metrics_open: bool = False  # /metrics without a key (a scraper on a trusted network)
    tls: TlsConfig = TlsConfig()
    lease_ms: int = Field(default=30_000, ge=1, le=12 * 3600 * 1000)
    max_deliveries: int = Field(default=5, ge=1)
    heartbeat_timeout_ms: int = Field(default=10_000, ge=100)
    max_payload_bytes: int = Field(default=1024 * 1024, ge=1)
    data_dir: str = "./.dejaq/broker"
    # Free space in `data_dir` new messages' heads leave for the Raft journal and
    # snapshots: PySyncObj maps its journal into memory, and a write into a full disk
    # kills the node (SIGBUS). 0: none kept.
    disk_reserve_bytes: int = Field(default=1024**3, ge=0)
    # HTTP connections a node serves at once, long polls' too; None: what its open-file
    # limit leaves after its own files. A lower cap bounds the memory a crowd holds.
    max_connections: int | None = Field(default=None, ge=1)

    @field_validator("advertise")
    @classmethod
    def _advertise(cls, v: str | None) -> str | None:
        """The address the other nodes forward to: a wildcard would send each forward
        back to the forwarding node itself."""
        if v is None:
            return v
        if not _host_port(v):
            raise ValueError(f"expected HOST:PORT with a port 1..65535, got {v!r}")
        host = v.rpartition(":")[0].strip("[]")
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            wildcard = False
        if wildcard:
            raise ValueError(
                f"{v.rpartition(':')[0]} listens on every interface, which names no host: "
                "give this host's name or address, as its certificate names it"
            )
        return v


class StorageConfig(_Strict):
    """How every engine reaches an `s3://` warehouse (see `conf.storage`).

    Credentials are not settings: each engine takes them from the standard AWS
    variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or the
    instance's role, so no configuration file or log line holds a secret. Not from an
    AWS profile: delta-rs 1.6 does not read them.
    """

    endpoint: str | None = None  # an S3-compatible server; None: AWS (or $AWS_ENDPOINT_URL)
    region: str | None = None  # None: $AWS_REGION, else us-east-1
    path_style: bool = False  # bucket in the path, not the host name (most non-AWS servers)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^/\s]+/?", v):
            raise ValueError(f"expected http(s)://host[:port], got {v!r}")
        return v.rstrip("/") if v else v


# Spark's own names for S3; the warehouse says s3://, which every engine reads as S3.
HADOOP_S3_SCHEMES = ("s3a://", "s3n://")


class Settings(_Strict):
    warehouse: str = "./warehouse"
    storage: StorageConfig = StorageConfig()
    kafka: KafkaConfig = KafkaConfig()
    spark: SparkConfig = SparkConfig()
    broker: BrokerConfig = BrokerConfig()
    topics: list[TopicConfig] = []

    @field_validator("warehouse")
    @classmethod
    def _warehouse(cls, v: str) -> str:
        """One name per store: delta-rs and pyarrow know `s3://`, and Spark is given
        S3A for it, so the tables' paths read the same to every engine."""
        if v.lower().startswith(HADOOP_S3_SCHEMES):
            raise ValueError(
                f"write the S3 warehouse as s3://{v.split('://', 1)[1]}: every engine "
                "reads s3://, and Spark is given S3A for it"
            )
        return v

    @property
    def on_s3(self) -> bool:
        return self.warehouse.lower().startswith("s3://")

    @model_validator(mode="after")
    def _unique_topics(self) -> Settings:
        names = [t.name for t in self.topics]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"topic names must be unique, repeated: {', '.join(dupes)}")
        return self

    def topic(self, name: str) -> TopicConfig:
        """The named topic's configuration, or a ConfigError listing the known ones."""
        for t in self.topics:
            if t.name == name:
                return t
        known = ", ".join(t.name for t in self.topics) or "none"
        raise ConfigError(f"unknown topic {name!r} (configured: {known})")


def default_conf_file() -> Path:
    return Path(str(files("dejaq.conf").joinpath("dejaq.yaml")))


# Variables of the prefix that are not settings: where the configuration and the jars are,
# and the API key the CLI and the worker client send.
NOT_SETTINGS = frozenset({"DEJAQ_CONF_FILE", "DEJAQ_JARS_DIR", "DEJAQ_TOKEN"})


def _env_overrides(
    model: type[BaseModel], env: Mapping[str, str], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str]]:
    """Yield (key path, variable name) for every scalar leaf, set in `env` or not.

    Names are generated from the model, not parsed from the variable, so keys with
    underscores stay unambiguous.
    """
    for name, field in model.model_fields.items():
        sub = field.annotation
        key = (*path, name)
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from _env_overrides(sub, env, key)
        elif name != "topics":
            yield key, ENV_PREFIX + "_".join(key).upper()


def _unknown_variables(env: Mapping[str, str], known: set[str]) -> list[str]:
    """A line per DEJAQ_ variable that names no setting: a misspelt override would
    otherwise be ignored without a word."""
    lines = []
    for var in sorted(v for v in env if v.startswith(ENV_PREFIX)):
        if var in known or var in NOT_SETTINGS:
            continue
        near = difflib.get_close_matches(var, sorted(known | NOT_SETTINGS), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        lines.append(f"  {var}: unknown setting{hint}")
    return lines


def _set(data: dict[str, Any], key: tuple[str, ...], value: str) -> None:
    for part in key[:-1]:
        child = data.get(part)
        if not isinstance(child, dict):
            child = data[part] = {}
        data = child
    data[key[-1]] = value


def _in_file(data: Any, key: tuple[str, ...]) -> bool:
    """Whether the file's own data holds `key` (a list index as its digits)."""
    for part in key:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return False
    return True


def _describe(
    err: ValidationError, path: Path, file_data: Any, from_env: Mapping[tuple[str, ...], str]
) -> str:
    """A line per error, naming the key and where its value came from: the key's own
    variable, or for a section's error (one setting against another) every variable set
    under it, beside the file where the file sets the section too."""
    lines = []
    sources = set()
    for e in err.errors():
        key = tuple(str(p) for p in e["loc"])
        loc = ".".join(key) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        own = [var for k, var in from_env.items() if key[: len(k)] == k]
        under = [var for k, var in from_env.items() if key and k[: len(key)] == key]
        names = own or under
        if names:
            sources.add("the environment")
        if not own and (not names or _in_file(file_data, key)):
            sources.add(str(path))
        said = f" (from the environment: {', '.join(names)})" if names else ""
        lines.append(f"  {loc}: {msg}{said}")
    return "\n".join([f"invalid configuration in {' and '.join(sorted(sources))}:", *lines])


class _RepeatedKey(Exception):
    """A mapping names a key twice: YAML would keep the last value without a word."""

    def __init__(self, key: Hashable, line: int, first: int) -> None:
        super().__init__(f"the key {key!r} at line {line} (first at line {first})")


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in a mapping (a second `broker:`
    section would drop the first one's keys_file, and API keys with it)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Hashable, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<`: merged keys are defaults the mapping's own override
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the mapping's own construction refuses it, with its mark
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _RepeatedKey(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# What PyYAML quotes in its messages: a parser token (kept) or the file's text (left out).
_YAML_QUOTED = re.compile(r"'(?:\\.|[^'\\])*'" r'|"(?:\\.|[^"\\])*"')
_YAML_TOKEN = re.compile(r"'(<[a-z ]+>|[\[\]{},?:-])'")


def _yaml_problem(err: yaml.YAMLError) -> str:
    """Where the file is not YAML and why, without its text: PyYAML's own message shows
    the line, and the line may hold a password."""
    if not isinstance(err, yaml.MarkedYAMLError):  # a character YAML takes nowhere: its code
        return f": {err}"
    mark = err.problem_mark or err.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    said = "; ".join(p for p in (err.context, err.problem) if p)
    said = _YAML_QUOTED.sub(lambda m: m[0] if _YAML_TOKEN.fullmatch(m[0]) else "<hidden>", said)
    return f"{where}: {said}" if said else where


def load_settings(
    conf_file: str | Path | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Read the YAML file (default: the packaged conf/dejaq.yaml), apply env, validate."""
    env = os.environ if env is None else env
    path = Path(conf_file or env.get("DEJAQ_CONF_FILE") or default_conf_file())
    try:
        data = yaml.load(path.read_text(), Loader=_Loader) or {}
    except FileNotFoundError:
        raise ConfigError(f"configuration file not found: {path}") from None
    except _RepeatedKey as e:
        raise ConfigError(f"configuration file {path} repeats {e}") from None
    except yaml.YAMLError as e:
        problem = _yaml_problem(e)
        raise ConfigError(f"configuration file {path} is not valid YAML{problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"configuration file {path} must hold a mapping at the top level")
    variables = dict(_env_overrides(Settings, env))
    if unknown := _unknown_variables(env, set(variables.values())):
        raise ConfigError("\n".join(["invalid configuration in the environment:", *unknown]))
    from_env = {key: var for key, var in variables.items() if var in env}
    file_data = copy.deepcopy(data)
    for key, var in from_env.items():
        _set(data, key, env[var])
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, path, file_data, from_env)) from None
