"""The quickstart notebook runs top to bottom against the embedded parts, and leaves
nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_notebook_runs(kafka_bootstrap: str, monkeypatch, tmp_path: Path) -> None:
    # The kernel starts in an empty folder with its own temporary folder, so whatever
    # the notebook leaves behind in either shows.
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setenv("DEJAQ_KAFKA_BOOTSTRAP", kafka_bootstrap)
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
    assert list(cwd.iterdir()) == [], "nothing left in the working folder"
    assert list(temp.glob("dejaq-quickstart-*")) == [], "its temporary folder removed"
