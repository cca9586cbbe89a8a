"""The Delta table features a DejaQ table may carry, and the refusal of any other.

A table made by DejaQ has none beyond Delta's first protocol, but one made or altered
by Spark or Databricks can carry features every one of its readers and writers would
have to honour: DejaQ's readers list a version's files and read their Parquet with
Arrow (the broker's index, the release job's follower, retention, `dejaq_delta`), and
its writers are delta-rs and files committed by hand. Read so, a deletion vector's rows
are read (and leased) again, and column-mapped files read as nulls; delta-rs refuses
to commit to some. Such a table is refused, naming it and the feature, when a process
opens it (`conf.tables.ensure_table`), rather than read wrong or retried to no end.
"""

from __future__ import annotations

import re
import threading

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.table import ProtocolVersions

from dejaq.conf.settings import ConfigError

# Every DejaQ reader and writer handles these: Delta's first writer protocol (2), which
# every table DejaQ makes has, implies the first two; the contract has no timestamp
# without a time zone, and delta-rs and Arrow read one alike.
HONOURED = frozenset({"appendOnly", "invariants", "timestampNtz"})

# The features a protocol older than table features (reader 3, writer 7) implies.
_LEGACY_READER = {2: {"columnMapping"}}
_LEGACY_WRITER = {
    2: {"appendOnly", "invariants"},
    3: {"checkConstraints"},
    4: {"changeDataFeed", "generatedColumns"},
    5: {"columnMapping"},
    6: {"identityColumns"},
}

# Delta's first writer protocol's features, which every table uses; of the others a
# legacy protocol implies, those its properties or its columns say it uses.
_ALWAYS_USED = frozenset({"appendOnly", "invariants"})
_BY_PROPERTIES = frozenset({"checkConstraints", "changeDataFeed", "columnMapping"})
_BY_COLUMNS = frozenset({"generatedColumns", "identityColumns"})


# Why a feature is refused, where more can be said than that DejaQ does not handle it.
_WHY = {
    "deletionVectors": "DejaQ reads a table's files whole, so rows a deletion vector "
    "marks deleted would be read, and delivered, again",
    "columnMapping": "its files name columns by physical names DejaQ does not map: "
    "every column would read as null",
    "v2Checkpoint": "delta-rs writes classic checkpoints into it, which a v2 table's "
    "Delta readers may not expect",
    "checkConstraints": "the ingest commits files it wrote without evaluating constraints",
    "changeDataFeed": "the rewrites DejaQ commits itself write no change data",
    "generatedColumns": "DejaQ's writers compute no generated column",
    "identityColumns": "DejaQ's writers assign no identity values",
    "rowTracking": "delta-rs cannot commit to such a table",
    "domainMetadata": "delta-rs cannot commit to such a table",
    "inCommitTimestamp": "delta-rs cannot commit to such a table",
}

# delta-rs's refusal of a commit for the table's features, as its message words it.
_REFUSED_COMMIT = re.compile(r"Unsupported table features required: \[([^\]]*)\]")

# Tables this process found honoured: checked at its first open of each, not at every
# ensure (the ledger's is once a second). A table altered while a process runs is
# caught by delta-rs's refusal to commit (`refused_commit`), and by vacuum's own look.
_honoured: set[str] = set()
_honoured_lock = threading.Lock()


class UnsupportedTable(ConfigError):
    """A table with a Delta feature DejaQ's readers or writers cannot honour."""


def features(table: DeltaTable, configuration: dict[str, str] | None = None) -> set[str]:
    """The reader and writer features of the table's protocol, named as Delta lists them.
    A legacy protocol's versions imply features whether the table uses them or not (a
    change data feed turned on once leaves writer version 4 for good), so of those only
    the ones it uses count (`_used`). `configuration`: the table's, where the caller has
    read it."""
    protocol = table.protocol()
    reader, writer = protocol.min_reader_version, protocol.min_writer_version
    implied: set[str] = set()
    if reader < 3:
        implied.update(*(f for v, f in _LEGACY_READER.items() if reader >= v))
    if writer < 7:
        implied.update(*(f for v, f in _LEGACY_WRITER.items() if writer >= v))
    return _listed(protocol) | _used(table, implied, configuration)


def _listed(protocol: ProtocolVersions) -> set[str]:
    """The features a table-features protocol lists (a legacy one lists none)."""
    return set(protocol.reader_features or []) | set(protocol.writer_features or [])


def _used(table: DeltaTable, implied: set[str], configuration: dict[str, str] | None) -> set[str]:
    """Of the legacy protocol's `implied` features, those the table uses: the table's
    properties and columns read only where a feature they decide is implied (every
    table DejaQ makes implies none of those), the properties from `configuration` if
    given."""
    used = implied & _ALWAYS_USED
    if implied & _BY_PROPERTIES:
        config = table.metadata().configuration if configuration is None else configuration
        if any(key.startswith("delta.constraints.") for key in config):
            used.add("checkConstraints")
        if config.get("delta.enableChangeDataFeed", "false").lower() == "true":
            used.add("changeDataFeed")
        if config.get("delta.columnMapping.mode", "none") != "none":
            used.add("columnMapping")
    if implied & _BY_COLUMNS:
        fields = [f.metadata for f in table.schema().fields]
        if any("delta.generationExpression" in m for m in fields):
            used.add("generatedColumns")
        if any(any(k.startswith("delta.identity.") for k in m) for m in fields):
            used.add("identityColumns")
    return used & implied


def has_deletion_vectors(table: DeltaTable) -> bool:
    """Whether the table may hold deletion vectors (whose files only a full vacuum, which
    knows nothing of them, would delete): a feature its protocol lists, as no legacy
    protocol implies it."""
    return "deletionVectors" in _listed(table.protocol())


def check_table(table: DeltaTable, path: str | None = None) -> None:
    """Raise UnsupportedTable, naming the table (`path`, as its caller knows it, or its
    URI) and the feature, where the table has a feature outside `HONOURED` or maps its
    columns."""
    path = path or table.table_uri
    config = table.metadata().configuration
    mode = config.get("delta.columnMapping.mode", "none")
    if mode != "none":
        raise UnsupportedTable(
            f"Delta table {path} maps its columns (delta.columnMapping.mode={mode}, feature "
            f"columnMapping): {_WHY['columnMapping']}. Make the table without it, or drop "
            "the feature (ALTER TABLE ... DROP FEATURE columnMapping TRUNCATE HISTORY, in "
            "Spark)"
        )
    if config.get("delta.appendOnly", "false").lower() == "true":
        raise UnsupportedTable(
            f"Delta table {path} is append-only (delta.appendOnly=true): retention and "
            "compaction remove the files they replace, which Delta refuses on such a "
            "table. Set delta.appendOnly = false"
        )
    if unhonoured := sorted(features(table, config) - HONOURED):
        raise UnsupportedTable(_refusal(path, unhonoured))


def check_path(path: str) -> None:
    """`check_table` of the table at `path`, once per process (`_honoured`)."""
    with _honoured_lock:
        if path in _honoured:
            return
    check_table(DeltaTable(path), path)
    with _honoured_lock:
        _honoured.add(path)


def refused_commit(path: str, error: CommitFailedError) -> None:
    """Raise UnsupportedTable where delta-rs refused a commit to the table at `path` for
    its features: a retry meets the same features, so a commit loop calls this before
    it tries again."""
    if found := _REFUSED_COMMIT.search(str(error)):
        named = [_delta_name(name) for name in found.group(1).split(", ") if name]
        raise UnsupportedTable(_refusal(path, named)) from error


def _delta_name(rust: str) -> str:
    """A feature as Delta names it, from delta-rs's name of it (`DeletionVectors`,
    `TimestampWithoutTimezone`, `Unknown("x")`)."""
    if unknown := re.fullmatch(r'Unknown\("?([^")]*)"?\)', rust):
        return unknown.group(1)
    return _RUST_NAMES.get(rust, rust[:1].lower() + rust[1:])


# delta-rs's names for the features whose Delta names are not theirs with a lower initial.
_RUST_NAMES = {"TimestampWithoutTimezone": "timestampNtz"}


def _refusal(path: str, unhonoured: list[str]) -> str:
    """The message naming the table, its features DejaQ cannot honour, why, and the way
    out."""
    why = "; ".join(f"{name}: {_WHY.get(name, 'DejaQ does not handle it')}" for name in unhonoured)
    return (
        f"Delta table {path} has table features DejaQ cannot honour ({why}). Make the "
        "table without them (Databricks turns deletion vectors on for new tables: "
        "set delta.enableDeletionVectors = false), or remove them where Delta can "
        "(ALTER TABLE ... SET TBLPROPERTIES to turn one off, then ALTER TABLE ... DROP "
        "FEATURE ... TRUNCATE HISTORY, in Spark: without TRUNCATE HISTORY, Delta 4 adds "
        "the checkpointProtection feature in its place)"
    )
