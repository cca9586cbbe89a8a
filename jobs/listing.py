"""`dejaq dead` and `dejaq quarantine`: a topic's dead letters or quarantined records, a
page at a time, as JSON lines, read from the warehouse (no broker, no Spark)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI builds its parser without pyarrow and deltalake
    from dejaq.conf.tables import Table

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_LIMIT = 100


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--topic", required=True, help="a topic name from the configuration")
    sp.add_argument(
        "--limit", type=int, default=DEFAULT_LIMIT, help=f"rows, 1..1000 (default {DEFAULT_LIMIT})"
    )
    sp.add_argument("--after", metavar="CURSOR", help="where the last page said to go on")
    sp.add_argument(
        "--conf-file", help="YAML configuration (default: $DEJAQ_CONF_FILE or the packaged one)"
    )


def run(table: Table, args: argparse.Namespace) -> int:
    """One JSON object a line on stdout, oldest first; on stderr, how to get the next page.
    Reads only: a table missing (a wrong warehouse, or one not set up) is an error, not an
    empty page, and is not made here."""
    from deltalake.exceptions import TableNotFoundError

    from dejaq.broker.storage.listings import MAX_PAGE, BadCursor, page
    from dejaq.conf.settings import load_settings
    from dejaq.conf.storage import export
    from dejaq.conf.tables import Table, table_path

    if not 1 <= args.limit <= MAX_PAGE:
        print(f"error: --limit must be 1..{MAX_PAGE}", file=sys.stderr)
        return EXIT_USAGE
    settings = load_settings(args.conf_file)
    export(settings)
    settings.topic(args.topic)
    path = table_path(settings.warehouse, table, args.topic)
    try:
        got = page(path, table, args.limit, args.after)
    except BadCursor as e:
        print(f"error: --after: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TableNotFoundError:
        print(
            f"error: no {table.value} table at {path}: is `warehouse` right? (the broker "
            "and the ingest make their tables when they start)",
            file=sys.stderr,
        )
        return EXIT_FAIL
    for row in got.rows:
        print(json.dumps(row))
    if got.next is not None:
        command = ["dejaq", "dead" if table is Table.DEAD_LETTER else "quarantine"]
        command += ["--topic", args.topic]
        if args.limit != DEFAULT_LIMIT:
            command += ["--limit", str(args.limit)]
        if args.conf_file is not None:
            command += ["--conf-file", args.conf_file]
        print(f"more: {shlex.join([*command, '--after', got.next])}", file=sys.stderr)
    return EXIT_OK
