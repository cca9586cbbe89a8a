"""The `dejaq` command. Each subcommand imports what it needs, so `dejaq kafka`, `dejaq s3`
and `dejaq broker` start without loading Spark."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _kafka(args: argparse.Namespace) -> int:
    from dejaq.jobs import embedded_kafka

    return embedded_kafka.run(args.port, Path(args.data_dir), args.secure)


def _s3(args: argparse.Namespace) -> int:
    from dejaq.jobs import embedded_s3

    return embedded_s3.run(args.port, Path(args.data_dir))


def _doctor(args: argparse.Namespace) -> int:
    from dejaq.jobs import doctor

    return doctor.run(args.conf_file)


def _ingest(args: argparse.Namespace) -> int:
    from dejaq.jobs import ingest

    return ingest.run(args.topic, args.conf_file, args.once, args.max_offsets_per_trigger)


def _release(args: argparse.Namespace) -> int:
    from dejaq.jobs import release

    return release.run(args.topic, args.conf_file, args.once, args.take_over)


def _status(args: argparse.Namespace) -> int:
    from dejaq.jobs import status

    return status.run(
        args.topic, args.conf_file, args.broker, args.token, args.cacert, args.insecure_http
    )


def _demo(args: argparse.Namespace) -> int:
    from dejaq.jobs import demo

    return demo.run(args.s3)


def _broker(args: argparse.Namespace) -> int:
    from dejaq.jobs import broker

    return broker.run(args)


def _operation(name: str) -> Callable[[argparse.Namespace], int]:
    """A topic operation of `dejaq.jobs.operations`, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        from dejaq.jobs import operations

        return getattr(operations, name)(args)

    return run


def _listing(table: str) -> Callable[[argparse.Namespace], int]:
    """`dejaq dead` or `dejaq quarantine`, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        from dejaq.conf.tables import Table
        from dejaq.jobs import listing

        return listing.run(Table(table), args)

    return run


def _certs(args: argparse.Namespace) -> int:
    from dejaq.jobs import certificates

    return certificates.run(Path(args.dir), args.hosts, args.name, args.force)


def _keys(args: argparse.Namespace) -> int:
    from dejaq.jobs import keys

    return keys.run(args)


def _cluster(args: argparse.Namespace) -> int:
    from dejaq.jobs import cluster

    return cluster.run(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dejaq",
        description="DejaQ: a reorder buffer between Kafka and your workers, on Spark and Delta.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    from dejaq.jobs.ports import port

    def conf_file(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--conf-file", help="YAML configuration (default: $DEJAQ_CONF_FILE or the packaged one)"
        )

    k = add("kafka", _kafka, "Run Apache Kafka (one KRaft node) on 127.0.0.1 in the foreground.")
    k.add_argument(
        "--port", type=port, default=None, help="port on 127.0.0.1 (default: a free one)"
    )
    k.add_argument("--data-dir", default=".dejaq/kafka", help="where the broker keeps its data")
    k.add_argument(
        "--secure",
        action="store_true",
        help="SASL_SSL (SCRAM and PLAIN) with certificates made here; settings in client.env",
    )
    s3 = add("s3", _s3, "Run an S3-compatible server (S3Proxy) on 127.0.0.1 in the foreground.")
    s3.add_argument(
        "--port", type=port, default=None, help="port on 127.0.0.1 (default: a free one)"
    )
    s3.add_argument("--data-dir", default=".dejaq/s3", help="where its buckets and key are kept")

    from dejaq.jobs.ingest import add_arguments as ingest_arguments

    ingest_arguments(add("ingest", _ingest, "Land a topic's Kafka records in its Delta buffer."))
    from dejaq.jobs.release import add_arguments as release_arguments

    release_arguments(add("release", _release, "Release a topic's buffer to Kafka, in order."))
    st = add("status", _status, "Buffer, retention, quarantine and ingest lag of a topic.")
    st.add_argument("--topic", required=True, help="a topic name from the configuration")
    from dejaq.jobs import operations

    operations.add_node(st, required=False)
    conf_file(st)
    conf_file(add("doctor", _doctor, "Check Java, Spark, the connectors in use and Kafka."))
    demo = add("demo", _demo, "Run the pipeline end to end on embedded parts.")
    demo.add_argument(
        "--s3",
        action="store_true",
        help="keep the warehouse on an S3-compatible server it starts (`dejaq s3`), not on disk",
    )
    from dejaq.jobs.broker import add_arguments as broker_arguments

    broker_arguments(add("broker", _broker, "Run one node of the HTTP lease broker (Raft)."))
    from dejaq.jobs.keys import add_arguments as keys_arguments

    keys_arguments(add("keys", _keys, "Add, list or revoke the broker's API keys."))
    ce = add("certs", _certs, "Make a local CA and a certificate for nodes serving HTTPS.")
    ce.add_argument("dir", help="where the PEM files go (a CA there is reused)")
    ce.add_argument("hosts", nargs="*", help="names and addresses (default: 127.0.0.1 localhost)")
    ce.add_argument(
        "--name", default="node", help="the files' name: NAME.pem, NAME-key.pem (default node)"
    )
    ce.add_argument("--force", action="store_true", help="replace another host's NAME.pem")

    operations.add_redrive(
        add("redrive", _operation("redrive"), "Make a topic's dead letters leasable again.")
    )
    operations.add_common(add("pause", _operation("pause"), "Stop leasing a topic on every node."))
    operations.add_common(add("resume", _operation("resume"), "Lease a paused topic again."))
    operations.add_purge(
        add("purge", _operation("purge"), "Cancel every pending message of a topic.")
    )
    from dejaq.jobs.listing import add_arguments as listing_arguments

    listing_arguments(add("dead", _listing("dead_letter"), "List a topic's dead letters."))
    listing_arguments(
        add("quarantine", _listing("quarantine"), "List a topic's quarantined records.")
    )
    cl = add("cluster", _cluster, "Start a local broker cluster for development.")
    cl.add_argument("action", choices=["up"], help="up: start, print addresses, run until Ctrl-C")
    cl.add_argument("--nodes", type=int, default=3, help="1, 3 or 5 (default 3)")
    cl.add_argument("--data-dir", default=".dejaq/cluster", help="the nodes' Raft data")
    from dejaq.jobs.cluster import HTTP_PORT, RAFT_PORT

    cl.add_argument(
        "--http-port", type=port, default=HTTP_PORT, help="node i's HTTP port is this + i - 1"
    )
    cl.add_argument(
        "--raft-port", type=port, default=RAFT_PORT, help="node i's Raft port, likewise"
    )
    conf_file(cl)
    return p


def main(argv: list[str] | None = None) -> int:
    from dejaq.conf.settings import ConfigError

    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
