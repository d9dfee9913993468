"""`primerl status`: show a running job's status from its broker, as a table or JSON, once or live."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from primerl.cli.status_view import render_status

ENV_TOKEN = "PRIMERL_RUN_TOKEN"
ENV_BROKER = "PRIMERL_BROKER"
DEFAULT_BROKER = "127.0.0.1:50051"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="primerl status", description="Show a running job's status from the broker.")
    parser.add_argument(
        "--broker",
        default=os.environ.get(ENV_BROKER, DEFAULT_BROKER),
        help=f"gRPC address of the broker, host:port (default: ${ENV_BROKER} or {DEFAULT_BROKER})",
    )
    parser.add_argument("--token", default=None, help=f"run token (default: ${ENV_TOKEN})")
    parser.add_argument(
        "--tls-ca", default=None, help="PEM CA file: connect with TLS, checking the broker's certificate"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (with --watch: one object per line)")
    parser.add_argument("--watch", action="store_true", help="redraw on every change until Ctrl-C")
    parser.add_argument(
        "--interval-ms", type=int, default=500, help="with --watch: at most one update per this many ms"
    )
    parser.add_argument("--timeout-s", type=float, default=5.0, help="how long to wait for the broker (default 5)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.timeout_s <= 0:
        print("primerl status: --timeout-s must be > 0", file=sys.stderr)
        return 2

    import structlog
    from pydantic import ValidationError

    from primerl.runtime.log_setup import configure_logging

    if not structlog.is_configured():  # log lines (if any) go to stderr: stdout is the status (maybe JSON)
        configure_logging("status", level="warning")
    from primerl.broker.control_client import BrokerError, ControlClient
    from primerl.runtime.config_common import BrokerClientConfig

    token = args.token if args.token is not None else os.environ.get(ENV_TOKEN) or None
    try:
        config = BrokerClientConfig(
            address=args.broker, run_token=token, tls_ca_path=args.tls_ca, connect_timeout_s=args.timeout_s
        )
    except ValidationError as err:
        problems = "; ".join(e["msg"] for e in err.errors())
        print(f"primerl status: --broker: {problems}", file=sys.stderr)
        return 2
    try:
        client = ControlClient(config, role="client", name="primerl-status", rpc_timeout_s=args.timeout_s)
    except ValueError as err:
        print(f"primerl status: {err}", file=sys.stderr)
        return 2
    try:
        client.wait_ready()
        if not args.watch:
            _show(client.get_run_status(), args.json, sys.stdout, clear=False)
            return 0
        stream = client.watch_run_status(min_interval_ms=max(0, args.interval_ms))
        try:
            for status in stream:
                _show(status, args.json, sys.stdout, clear=not args.json and sys.stdout.isatty(), one_line=True)
            print("primerl status: the broker ended the stream (it is shutting down)", file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            stream.cancel()
            return 0
    except BrokerError as err:
        print(f"primerl status: {_explain(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _explain(err) -> str:
    import grpc

    if err.code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{err}\n  pass the run's token with --token or ${ENV_TOKEN}"
    return str(err)


def _show(status, as_json: bool, out: TextIO, *, clear: bool, one_line: bool = False) -> None:
    if as_json:
        from google.protobuf.json_format import MessageToDict

        data = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        out.write(json.dumps(data, indent=None if one_line else 2, sort_keys=True) + "\n")
    else:
        if clear:
            out.write("\x1b[2J\x1b[H")
        elif one_line:  # watching without a terminal: separate the snapshots
            out.write("-" * 80 + "\n")
        out.write(render_status(status) + "\n")
    out.flush()


if __name__ == "__main__":
    raise SystemExit(main())
