"""The quickstart notebook runs top to bottom against the embedded parts, and leaves
nothing behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from test_secure_kafka import secure_kafka, secure_kafka_dir  # noqa: F401 (its fixture)

from dejaq.conf.tables import Table, scan

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("store", ["local", "s3", "secure-kafka"])
def test_quickstart_notebook_runs(
    store: str, request: pytest.FixtureRequest, kafka_bootstrap: str, monkeypatch, tmp_path: Path
) -> None:
    """`s3`: its warehouse, and so its Spark SQL reads, on the S3 server. `secure-kafka`:
    a Kafka that takes SASL_SSL only, given as its advice says (`DEJAQ_KAFKA_*`)."""
    # The kernel starts in an empty folder with its own temporary folder, so whatever
    # the notebook leaves behind in either shows.
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setenv("DEJAQ_KAFKA_BOOTSTRAP", kafka_bootstrap)
    if store == "s3":
        s3 = request.getfixturevalue("s3_env")
        for name in ("DEJAQ_STORAGE_ENDPOINT", "DEJAQ_STORAGE_PATH_STYLE"):
            monkeypatch.setenv(name, s3[name])
        monkeypatch.setenv("DEJAQ_WAREHOUSE", f"s3://dejaq/{tmp_path.name}")
    if store == "secure-kafka":
        for name, value in request.getfixturevalue("secure_kafka").items():
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was drawn"
    text = "".join(o.get("text", "") for o in outputs)
    assert "quarantined 1" in text
    assert "leased and acked 300 messages" in text
    # Its own topic, never one a warehouse given from outside may already hold.
    topic = re.search(r"topic: (quickstart-\d+)", text)
    assert topic, text[:2000]
    if store == "s3":
        buffer = f"s3://dejaq/{tmp_path.name}/buffer/{topic.group(1)}"
        assert scan(buffer, Table.BUFFER).num_rows == 300, "its buffer is in the bucket"
    assert list(cwd.iterdir()) == [], "nothing left in the working folder"
    assert list(temp.glob("dejaq-quickstart-*")) == [], "its temporary folder removed"
