"""`dejaq demo`: placeholder until the ingest lands."""

from __future__ import annotations


def run(conf_file: str | None) -> int:
    raise NotImplementedError
