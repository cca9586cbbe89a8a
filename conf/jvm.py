"""Where the pinned JVM jars live: `jvm/lib/<set>`, copied by `make` from `jvm/<set>/pom.xml`.

Four sets: `spark` (Delta Lake and Spark's Kafka source, handed to Spark as `spark.jars`),
`s3a` (Hadoop's S3 filesystem, added to them for an `s3://` warehouse), `kafka` (Apache
Kafka, run by `dejaq kafka`) and `s3proxy` (the S3-compatible server `dejaq s3` runs).
`DEJAQ_JARS_DIR` points elsewhere, for an installation that keeps the jars outside the
source tree.
"""

from __future__ import annotations

import os
from pathlib import Path

JARS_DIR_ENV = "DEJAQ_JARS_DIR"
SPARK = "spark"
KAFKA = "kafka"
S3A = "s3a"
S3PROXY = "s3proxy"


def jars_dir() -> Path:
    default = Path(__file__).resolve().parents[1] / "jvm" / "lib"
    return Path(os.environ.get(JARS_DIR_ENV) or default)


def jars(jar_set: str) -> list[Path]:
    """The set's jar files, sorted; empty where the set was never fetched."""
    folder = jars_dir() / jar_set
    return sorted(folder.glob("*.jar")) if folder.is_dir() else []


def require(jar_set: str) -> list[Path]:
    """The set's jars, or an error that says how to fetch them."""
    found = jars(jar_set)
    if not found:
        raise FileNotFoundError(
            f"no {jar_set} jars in {jars_dir() / jar_set}: run `make test` or `make demo` "
            f"(they fetch jvm/{jar_set}/pom.xml from Maven Central), or set {JARS_DIR_ENV}"
        )
    return found
