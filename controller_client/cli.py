"""The `mtc` command line: the demo, the replicator daemon and admin commands."""

from __future__ import annotations

import argparse
import sys

from replicator import logs


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("multitier-checkpoint")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _demo(args: argparse.Namespace) -> int:
    from controller_client.demo.run import run_demo

    return run_demo(args.workdir, keep=args.keep)


def _status(args: argparse.Namespace) -> int:
    import json

    if args.local_dir:
        import grpc

        from mtc_rpc import control_pb2, control_pb2_grpc
        from sidecar.layout import control_socket

        sock = control_socket(args.local_dir)
        try:
            with grpc.insecure_channel(f"unix:{sock}") as ch:
                resp = control_pb2_grpc.LocalControlStub(ch).GetLocalStatus(
                    control_pb2.GetLocalStatusRequest(), timeout=args.timeout_seconds)
        except grpc.RpcError as e:
            print(f"mtc status: no replicator answers on {sock}: {e.code().name}", file=sys.stderr)
            return 1
        print(json.dumps(json.loads(resp.status_json), indent=2))
        return 0
    if not args.coordinator:
        print("mtc status: give --coordinator HOST:PORT or --local-dir DIR", file=sys.stderr)
        return 2
    import grpc

    from replicator.coordinator.client import CoordinatorClient
    from replicator.net.security import TlsOptions

    client = CoordinatorClient(args.coordinator, args.token_file, args.timeout_seconds,
                               tls=TlsOptions.from_args(args.tls_cert, args.tls_key, args.tls_ca))
    try:
        print(json.dumps(client.status(), indent=2))
    except grpc.RpcError as e:
        print(f"mtc status: coordinator {args.coordinator}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtc",
        description="multitier-checkpoint: RAM-disk, peer and bucket checkpointing for JAX training jobs.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    logs.add_arguments(p)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model on 8 CPU devices as 4 simulated hosts, crash, restore")
    d.add_argument("--workdir", help="directory for the simulated hosts' RAM dirs (default: a temp dir "
                   "under /dev/shm, removed afterwards)")
    d.add_argument("--keep", action="store_true", help="keep the working directory")
    logs.add_arguments(d, default=argparse.SUPPRESS)
    d.set_defaults(func=_demo)

    from replicator.main import configure_parser

    r = sub.add_parser("replicator", help="run the per-host replicator daemon (same as mtc-replicator)")
    configure_parser(r, log_default=argparse.SUPPRESS)
    r.set_defaults(prog="mtc replicator")

    from controller_client import manifests

    m = sub.add_parser("manifests", help="render a ready-to-apply Kubernetes set (JobSet, RAM disk, policy) for a job",
                       description="Render the Kubernetes objects of one job; see docs/deploy.md.")
    manifests.add_arguments(m)
    m.set_defaults(func=manifests.run)

    st = sub.add_parser("status", help="print the coordinator's (or one host's replicator's) status as JSON")
    st.add_argument("--coordinator", help="HOST:PORT of the coordinator")
    st.add_argument("--local-dir", help="ask this host's replicator over its Unix socket instead")
    st.add_argument("--token-file", help="file with the bearer token")
    st.add_argument("--tls-cert", help="client certificate (PEM), for mutual TLS")
    st.add_argument("--tls-key", help="client key (PEM)")
    st.add_argument("--tls-ca", help="CA bundle (PEM) that signed the coordinator's certificate")
    st.add_argument("--timeout-seconds", type=float, default=10.0)
    logs.add_arguments(st, default=argparse.SUPPRESS)
    st.set_defaults(func=_status)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(logs.level_from(args))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
