"""What every benchmark's JSON says of the machine it ran on: a figure from another day
or machine is only comparable through its own baseline, and these say which it was."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine(**more: Any) -> dict[str, Any]:
    """The cores, CPU model, Python and platform, and `more` (a Spark version, say)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        **more,
    }
