"""The distribution installs one top-level package, `dejaq`, and works from any folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LAYOUT = ("conf", "broker", "jobs", "pipelines")


def test_only_dejaq_is_importable_outside_the_repo_and_its_data_files_come_along(
    tmp_path: Path,
) -> None:
    """Run where the repo's folders are not on the path, as a user's code would."""
    code = (
        "import importlib.util\n"
        f"bare = [n for n in {LAYOUT!r} if importlib.util.find_spec(n) is not None]\n"
        "assert not bare, f'top-level packages besides dejaq: {bare}'\n"
        "from dejaq.conf.settings import default_conf_file, load_settings\n"
        "from dejaq.jobs import cli\n"
        "print(load_settings(default_conf_file(), env={}).topics[0].name, cli.main.__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["orders", "dejaq.jobs.cli"]
