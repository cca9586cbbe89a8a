"""The distribution installs one top-level package, `dejaq`, and works from any folder."""

from __future__ import annotations

import subprocess
import sys
import zipfile
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


def test_the_three_wheels_build_as_deploying_says(tmp_path: Path) -> None:
    """`pip wheel --no-deps ./client ./broker/core .`, from the checkout: the worker
    client's, the compiled core's (its extension module inside) and dejaq's."""
    root = Path(__file__).resolve().parent.parent
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    result = subprocess.run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--wheel-dir",
            str(tmp_path),
            "./client",
            "./broker/core",
            ".",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = {w.name.split("-")[0]: w for w in tmp_path.glob("*.whl")}
    assert sorted(wheels) == ["dejaq", "dejaq_client", "dejaq_core"]
    with zipfile.ZipFile(wheels["dejaq_core"]) as core:
        assert any(n.startswith("dejaq_core") and n.endswith(".so") for n in core.namelist())
