"""The `storage:` section, handed to every engine that reads or writes the warehouse.

Spark-free. delta-rs (object_store) and pyarrow read S3's endpoint, region and
addressing from the standard AWS variables, and so do the processes a job starts (the
broker's nodes): `export` sets them from the section once, at a job's start. Spark's S3A
reads Hadoop settings instead: `spark_conf` gives them where the job starts Spark. The
tasks a job sends to executors carry the variables themselves (`exported`), as an
executor's environment is its cluster's, not the job's: a Spark already running (a
notebook's) never sees `spark_conf`. Credentials are never copied: each engine finds
them itself (the AWS variables, or the instance's role).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from dejaq.conf import jvm
from dejaq.conf.settings import Settings, StorageConfig

S3A = "org.apache.hadoop.fs.s3a.S3AFileSystem"


def endpoint(storage: StorageConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The configured endpoint, else the one the AWS variables name (None: AWS itself)."""
    env = os.environ if env is None else env
    return storage.endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")


def region(storage: StorageConfig, env: Mapping[str, str] | None = None) -> str:
    """The configured region, else the one the AWS variables name, else us-east-1."""
    env = os.environ if env is None else env
    return storage.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"


def environment(storage: StorageConfig, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The AWS variables (none of them secret) that tell delta-rs and pyarrow the section."""
    found = endpoint(storage, env)
    variables = {
        "AWS_REGION": region(storage, env),
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": str(not storage.path_style).lower(),
    }
    if found:
        variables["AWS_ENDPOINT_URL"] = found
        variables["AWS_ALLOW_HTTP"] = str(found.startswith("http://")).lower()
    return variables


# The variables `environment` sets: none of them secret.
SECTION_VARIABLES = (
    "AWS_REGION",
    "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
    "AWS_ENDPOINT_URL",
    "AWS_ALLOW_HTTP",
)


def exported(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's section variables (`export`), for a task it sends to executors to
    hand to `filesystem` there."""
    env = os.environ if env is None else env
    return {name: env[name] for name in SECTION_VARIABLES if name in env}


def export(settings: Settings) -> None:
    """Set this process's AWS variables from the section (a job does it once, at start),
    for its own engines and for the processes it starts."""
    if settings.on_s3:
        os.environ.update(environment(settings.storage))


def spark_conf(settings: Settings) -> dict[str, str]:
    """Spark settings that reach an `s3://` warehouse: S3A for the `s3` scheme, the
    section as S3A settings, the variables for executors, and the S3A jars where they
    were fetched (used where this process starts Spark; a cluster brings its own)."""
    if not settings.on_s3:
        return {}
    storage = settings.storage
    conf = {
        "spark.hadoop.fs.s3.impl": S3A,
        "spark.hadoop.fs.s3a.endpoint.region": region(storage),
        "spark.hadoop.fs.s3a.path.style.access": str(storage.path_style).lower(),
    }
    if jars := jvm.jars(jvm.S3A):
        conf["spark.jars"] = ",".join(str(p) for p in jars)
    if found := endpoint(storage):
        conf["spark.hadoop.fs.s3a.endpoint"] = found
    for name, value in environment(storage).items():
        conf[f"spark.executorEnv.{name}"] = value
    return conf


def filesystem(uri: str, section: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for `uri` and the path in it; S3 as the AWS variables say
    (pyarrow itself reads only the credentials from them), each file stored whole.
    `section`: the driver's variables (`exported`), over this process's."""
    if uri.lower().startswith("s3://"):
        env = {**os.environ, **(section or {})}
        virtual = env.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "").lower() == "true"
        # A file written whole goes up in one PUT, not a multipart upload of three requests.
        options: dict[str, Any] = {"force_virtual_addressing": virtual, "allow_delayed_open": True}
        if named := env.get("AWS_REGION"):
            options["region"] = named
        if found := env.get("AWS_ENDPOINT_URL"):
            scheme, _, host = found.rpartition("://")
            options.update(endpoint_override=host, scheme=scheme or "https")
        return pafs.S3FileSystem(**options), uri[len("s3://") :].rstrip("/")
    return pafs.FileSystem.from_uri(uri)


def has_folders(fs: pafs.FileSystem) -> bool:
    """Whether a file's folder must exist first: not on an object store, where making
    one only adds a marker object (and a request)."""
    return fs.type_name not in ("s3", "gcs", "abfs")


def describe(settings: Settings) -> str:
    """A line for `doctor` and `status`: where the warehouse is and how it is reached,
    naming where credentials come from, never their value."""
    if not settings.on_s3:
        return settings.warehouse
    storage = settings.storage
    where = endpoint(storage) or "AWS"
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        creds = f"key {os.environ['AWS_ACCESS_KEY_ID']} from AWS_ACCESS_KEY_ID"
    else:
        creds = "the instance's role"
    style = "path-style" if storage.path_style else "virtual-hosted"
    return f"{settings.warehouse} at {where} ({region(storage)}, {style}; credentials: {creds})"
