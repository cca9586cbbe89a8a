"""`dejaq redrive`, `pause`, `resume` and `purge`: a topic's operations, through any broker
node's HTTP API (the node forwards them to the Raft leader)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import ssl
import sys
from collections.abc import Callable
from typing import Any

import httpx

from dejaq.client import BrokerError, Client, Unavailable
from dejaq.conf.settings import ConfigError

EXIT_OK, EXIT_FAIL = 0, 1
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
FRACTION = re.compile(r"\d{2}:\d{2}:\d{2}[.,](\d+)")  # an ISO time's fraction of a second


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
    # Exact, and rounded up as the header's: a time finer than a millisecond is not due
    # before it. Python keeps microseconds: a digit past them makes one more.
    micros = (at - EPOCH) // dt.timedelta(microseconds=1)
    fraction = FRACTION.search(value)
    micros += fraction is not None and fraction.group(1)[6:].strip("0") != ""
    return -(-micros // 1000)


def add_node(sp: argparse.ArgumentParser, required: bool = True) -> None:
    """--broker, and how to reach it: --token and --cacert."""
    sp.add_argument("--broker", required=required, metavar="URL", help="any broker node's URL")
    sp.add_argument(
        "--token",
        help="an API key (default: $DEJAQ_TOKEN, which, unlike an argument, no process "
        "listing shows)",
    )
    sp.add_argument("--cacert", metavar="PEM", help="the CA that signed an https:// node's cert")
    sp.add_argument(
        "--insecure-http",
        action="store_true",
        help="send the API key to an http:// node beyond loopback, in clear (only where "
        "something in front of the node encrypts its traffic)",
    )


def add_common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--topic", required=True, help="a lease topic")
    add_node(sp)


def add_redrive(sp: argparse.ArgumentParser) -> None:
    add_common(sp)
    which = sp.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", action="append", dest="ids", metavar="ID", help="repeatable")
    which.add_argument("--all", action="store_true", help="every dead message of the topic")
    key = sp.add_mutually_exclusive_group()
    key.add_argument("--priority", type=int, help="new priority (priority topics)")
    key.add_argument(
        "--deliver-at", type=epoch_ms, help="new deliver_at, epoch ms or ISO-8601 (timelines)"
    )


def add_purge(sp: argparse.ArgumentParser) -> None:
    add_common(sp)
    sp.add_argument(
        "--confirm", required=True, metavar="TOPIC", help="the topic's name again, to confirm"
    )


PROBE_TIMEOUT_S = 2.0


def connect(
    url: str,
    timeout: float = 60.0,
    token: str | None = None,
    cacert: str | None = None,
    insecure_http: bool = False,
) -> Client:
    """A client of the node at `url`, once it answers at all: a command given a wrong
    address fails at once, not after the client's retries (meant to ride out a node's
    restart) have run out. A URL the client refuses (the key in clear over http:// beyond
    loopback) is a usage error, before anything is sent."""
    verify = ssl.create_default_context(cafile=cacert) if cacert else True
    try:
        client = Client(
            [url],
            token=token,
            verify=verify,
            timeout=timeout,
            deadline=10.0,
            insecure_http=insecure_http,
        )
    except ValueError as e:
        raise ConfigError(f"--broker {e} (--insecure-http allows it)") from e
    try:
        httpx.get(f"{client.node}/healthz", timeout=PROBE_TIMEOUT_S, verify=verify)
    except httpx.HTTPError as e:
        client.close()
        raise Unavailable(f"no broker node answers at {url} ({type(e).__name__})") from e
    return client


def _call(args: argparse.Namespace, call: Callable[[Client], Any]) -> Any:
    """The call's answer; a broker error is printed and becomes None."""
    try:
        with connect(
            args.broker, token=args.token, cacert=args.cacert, insecure_http=args.insecure_http
        ) as client:
            return call(client)
    except BrokerError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def redrive(args: argparse.Namespace) -> int:
    result = _call(
        args,
        lambda c: c.redrive(
            args.topic,
            args.ids,
            every=args.all,
            priority=args.priority,
            deliver_at=args.deliver_at,
        ),
    )
    if result is None:
        return EXIT_FAIL
    print(f"redriven {result.redriven}")
    failed = False
    for mid, reason in result.skipped.items():
        if reason == "already_redriven" and result.maybe_applied:
            # Pending again, as asked: most likely by this command's first attempt.
            note = "redriven by an earlier attempt of this command, whose answer was lost"
            print(f"{json.dumps(mid)} {note}", file=sys.stderr)
        else:
            failed = True
            print(f"error: {json.dumps(mid)} not redriven: {reason}", file=sys.stderr)
    return EXIT_FAIL if failed else EXIT_OK


def pause(args: argparse.Namespace) -> int:
    return _set_paused(args, True)


def resume(args: argparse.Namespace) -> int:
    return _set_paused(args, False)


def _set_paused(args: argparse.Namespace, paused: bool) -> int:
    result = _call(args, lambda c: c.pause(args.topic) if paused else c.resume(args.topic))
    if result is None:
        return EXIT_FAIL
    print(f"{args.topic}: {'paused' if result.paused else 'leasing'}")
    return EXIT_OK


def purge(args: argparse.Namespace) -> int:
    result = _call(args, lambda c: c.purge(args.topic, args.confirm))
    if result is None:
        return EXIT_FAIL
    print(f"cancelled {result.cancelled}")
    return EXIT_OK
