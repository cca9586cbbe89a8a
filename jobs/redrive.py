"""`dejaq redrive`: dead letters of a topic pending again, through the broker's HTTP API."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

from dejaq.broker.client import BrokerError, Client

EXIT_OK, EXIT_FAIL = 0, 1


def epoch_ms(value: str) -> int:
    """Epoch milliseconds, or ISO-8601 with an offset (as the dejaq-deliver-at header)."""
    if value.isdigit():
        return int(value)
    try:
        at = dt.datetime.fromisoformat(value)
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"expected epoch ms or ISO-8601 with an offset, got {value!r}"
        )
    return int(at.timestamp() * 1000)


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--topic", required=True, help="a lease topic")
    which = sp.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", action="append", dest="ids", metavar="ID", help="repeatable")
    which.add_argument("--all", action="store_true", help="every dead message of the topic")
    key = sp.add_mutually_exclusive_group()
    key.add_argument("--priority", type=int, help="new priority (priority topics)")
    key.add_argument(
        "--deliver-at", type=epoch_ms, help="new deliver_at, epoch ms or ISO-8601 (timelines)"
    )
    sp.add_argument("--broker", required=True, metavar="URL", help="any broker node's URL")


def run(args: argparse.Namespace) -> int:
    try:
        with Client([args.broker], timeout=60) as client:
            result = client.redrive(
                args.topic,
                args.ids,
                every=args.all,
                priority=args.priority,
                deliver_at=args.deliver_at,
            )
    except BrokerError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(f"redriven {result.redriven}")
    for mid, reason in result.skipped.items():
        print(f"skipped {json.dumps(mid)}: {reason}")
    return EXIT_OK
