"""The table contract: paths under the warehouse and schemas both sides agree on."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import from_arrow_schema

from dejaq.conf.tables import PARTITION_BY, SCHEMAS, Table, table_path


def test_paths_local_and_uri(tmp_path) -> None:
    assert table_path(str(tmp_path), Table.BUFFER, "orders") == f"{tmp_path}/buffer/orders"
    assert table_path("s3://bucket/wh/", Table.LEDGER, "o.v2") == "s3://bucket/wh/ledger/o.v2"
    assert table_path("relative", "quarantine", "x").startswith("/")


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "-x", "a b"])
def test_topic_names_that_would_escape_the_warehouse_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid topic name"):
        table_path("/w", Table.BUFFER, bad)


@pytest.mark.parametrize("table", list(Table))
def test_every_schema_converts_to_spark_and_partitions_exist(table: Table) -> None:
    schema = SCHEMAS[table]
    spark_schema = from_arrow_schema(schema)
    assert spark_schema.fieldNames() == schema.names
    for column in PARTITION_BY[table]:
        assert column in schema.names
    if "headers" in schema.names:
        assert schema.field("headers").type == pa.list_(
            pa.struct([("key", pa.string()), ("value", pa.binary())])
        )
