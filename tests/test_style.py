"""The code base stays `ruff check` and `ruff format` clean, and the broker's compiled core
`cargo fmt` and `cargo clippy` clean: CI is the place that notices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "args", [["fmt", "--check"], ["clippy", "--release", "--locked", "--", "-D", "warnings"]]
)
def test_cargo(args: list[str]) -> None:
    result = subprocess.run(
        ["cargo", *args], cwd=ROOT / "broker" / "core", capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
