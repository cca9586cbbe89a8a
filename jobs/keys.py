"""`dejaq keys add|list|revoke`: the broker's API keys, in the file `broker.keys_file` names.

Each node reads its own copy of the file again when it changes, so a key works, or
stops working, on that node within a second or two, with no restart. The command
changes the file on this host only: with nodes on several hosts, every node must read
the same file (storage they share, or a copy made to each host after every change). A
node whose copy is stale still takes a revoked key, for every call, those it forwards
to the leader too: the leader takes what a node forwards, and does not check again.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from dejaq.broker.api.keys import ROLES, add_key, read_keys, revoke_key
from dejaq.conf.settings import ConfigError, load_settings

EXIT_OK = 0
# Said after each change: the command writes this host's file, and nodes elsewhere read
# their own.
EVERY_NODE = "every node must read this same file: copy it to each node's host unless they share it"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("action", choices=["add", "list", "revoke"])
    sp.add_argument("name", nargs="?", help="the key's name (add, revoke)")
    sp.add_argument(
        "--role",
        action="append",
        choices=ROLES,
        default=[],
        help="repeatable: produce, consume (lease and settle), operate (pause, purge, "
        "redrive, cancel, reschedule, schedules), read (describe, peek, dead letters), "
        "monitor (metrics, cluster)",
    )
    sp.add_argument(
        "--topic",
        action="append",
        default=[],
        metavar="GLOB",
        help="repeatable: topics the roles hold on, globs allowed (default: '*', every one)",
    )
    sp.add_argument("--keys-file", help="default: the configuration's broker.keys_file")
    sp.add_argument(
        "--conf-file", help="YAML configuration (default: $DEJAQ_CONF_FILE or the packaged one)"
    )


def _path(args: argparse.Namespace) -> Path:
    if args.keys_file:
        return Path(args.keys_file)
    configured = load_settings(args.conf_file).broker.keys_file
    if configured is None:
        raise ConfigError(
            "no key file: set broker.keys_file in the configuration "
            "(or DEJAQ_BROKER_KEYS_FILE), or give --keys-file"
        )
    return Path(configured)


def run(args: argparse.Namespace) -> int:
    path = _path(args)
    if args.action == "list":
        for key in sorted(read_keys(path).values(), key=lambda k: k.name):
            created = dt.datetime.fromtimestamp(key.created_at / 1000, dt.UTC)
            grants = "; ".join(f"{g.role} on {','.join(g.topics)}" for g in key.grants)
            print(f"{key.name}\t{key.id}\t{created:%Y-%m-%d %H:%M}Z\t{grants}")
        return EXIT_OK
    if not args.name:
        raise ConfigError(f"dejaq keys {args.action}: give the key's name")
    if args.action == "revoke":
        key = revoke_key(path, args.name)
        print(
            f"revoked {key.name} ({key.id}) in {path}: a node refuses it within seconds of "
            f"reading this file; {EVERY_NODE}, or nodes with an old copy still take it",
            file=sys.stderr,
        )
        return EXIT_OK
    token = add_key(path, args.name, args.role, args.topic or ["*"])
    print(
        f"added {args.name} to {path} ({EVERY_NODE}); the key is shown once, keep it now:",
        file=sys.stderr,
    )
    print(token)
    return EXIT_OK
