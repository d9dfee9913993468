"""`primerl status [RUN_DIR]`: show a running job's status from its broker, as a table or JSON, once or live; a
`primerl rl` run that has ended, from its run directory.

The broker's address and the token come from the command line, else from RUN_DIR/run.json (written by
`primerl rl`, ``primerl.supervisor.run_file``), else from ``$PRIMERL_BROKER`` and ``$PRIMERL_RUN_TOKEN``. A RUN_DIR
whose run has ended (``primerl.runtime.run_outcome``: its ``run_end.json``, or a launcher that is gone) is shown
from what it holds, without asking a broker, with exit status 0 (``--broker`` asks the broker anyway). ``--json``
adds ``run_state`` (``running``, ``finished``, ``stopped``, ``failed``) and ``run_end`` (how it ended; null for a
run whose broker answered) to the broker's ``RunStatus`` fields."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from primerl.supervisor.fleet_view import annotate_json
from primerl.supervisor.run_file import RunFileError, read_run_file
from primerl.supervisor.status_view import print_status, run_state

ENV_TOKEN = "PRIMERL_RUN_TOKEN"
ENV_BROKER = "PRIMERL_BROKER"
DEFAULT_BROKER = "127.0.0.1:50051"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl status",
        usage="primerl status [RUN_DIR] [--broker HOST:PORT] [--token TOKEN] [--json] [--watch]",
        description="Show a running job's status from the broker, or how a `primerl rl` run ended.",
        epilog="A `primerl rl` run: `primerl status RUN_DIR` (the run's output_dir) reads the broker's address and "
        "the run token from RUN_DIR/run.json, which only the user who started the run can read; a run that has "
        "ended is shown from RUN_DIR (its run_end.json). Daemons started on their own: --broker and --token (or "
        "$PRIMERL_BROKER and $PRIMERL_RUN_TOKEN).",
    )
    parser.add_argument(
        "run_dir",
        nargs="?",
        default=None,
        metavar="RUN_DIR",
        help="run directory of a `primerl rl` run: address, token and TLS CA from its run.json",
    )
    parser.add_argument(
        "--broker",
        default=None,
        help=f"gRPC address of the broker, host:port (default: RUN_DIR's, else ${ENV_BROKER}, else {DEFAULT_BROKER})",
    )
    parser.add_argument("--token", default=None, help=f"run token (default: RUN_DIR's, else ${ENV_TOKEN})")
    parser.add_argument(
        "--tls-ca", default=None, help="PEM CA file: connect with TLS, checking the broker's certificate"
    )
    parser.add_argument(
        "--tls-cert",
        default=None,
        help="PEM client certificate, for a broker that requires one (broker.tls_client_ca_path); with --tls-key",
    )
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name",
        default=None,
        help="name to check the broker's certificate against instead of --broker's host",
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
    from primerl.client.broker_errors import BrokerError
    from primerl.client.control import ControlClient
    from primerl.runtime.config_common import BrokerClientConfig
    from primerl.runtime.run_outcome import read_run_outcome

    outcome = read_run_outcome(args.run_dir) if args.run_dir is not None and args.broker is None else None
    if outcome is not None and outcome.ended:  # nothing to ask: its broker stopped with it
        _show_ended(outcome, args.json, sys.stdout)
        return 0
    try:
        address, token, tls = _connection(args)
    except RunFileError as err:
        print(f"primerl status: {err}", file=sys.stderr)
        return 2
    try:
        config = BrokerClientConfig(
            address=address,
            run_token=token,
            connect_timeout_s=args.timeout_s,
            tls_server_name=args.tls_server_name,
            **tls,
        )
    except ValidationError as err:
        problems = "; ".join(e["msg"] for e in err.errors())
        print(f"primerl status: --broker/--tls-*: {problems}", file=sys.stderr)
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
        print(f"primerl status: {_explain(err, args.run_dir, outcome)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _connection(args: argparse.Namespace) -> tuple[str, str | None, dict[str, str | None]]:
    """Address, token and TLS files (CA, client certificate and key): the command line's, else RUN_DIR's run.json,
    else the environment's."""
    tls = {"tls_ca_path": args.tls_ca, "tls_cert_path": args.tls_cert, "tls_key_path": args.tls_key}
    if args.run_dir is not None:
        run = read_run_file(args.run_dir)
        if not any(tls.values()):
            tls = {"tls_ca_path": run.tls_ca_path, "tls_cert_path": run.tls_cert_path, "tls_key_path": run.tls_key_path}
            args.tls_server_name = args.tls_server_name or run.tls_server_name
        return (args.broker or run.broker_address, args.token if args.token is not None else run.run_token, tls)
    address = args.broker or os.environ.get(ENV_BROKER) or DEFAULT_BROKER
    token = args.token if args.token is not None else os.environ.get(ENV_TOKEN) or None
    return address, token, tls


def _explain(err, run_dir: str | None = None, outcome=None) -> str:
    import grpc

    from primerl.runtime.run_outcome import RUNNING

    if err.code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{err}\n  pass the run's token with --token or ${ENV_TOKEN}"
    if err.code == grpc.StatusCode.UNAVAILABLE and outcome is not None and outcome.state == RUNNING:
        return (
            f"{err}\n  (the run in {run_dir} is still running: its launcher, pid {outcome.launcher_pid}, is alive; "
            "its broker may be restarting or overloaded)"
        )
    if err.code == grpc.StatusCode.UNAVAILABLE and run_dir is not None:
        return f"{err}\n  (the run in {run_dir} may have ended: its run.json names the broker it last had)"
    return str(err)


def _show_ended(outcome, as_json: bool, out: TextIO) -> None:
    """A run that has ended, as its run directory says: the same view as a live one's, from its last known status."""
    from primerl.proto.v1 import control_pb2

    _show(outcome.fill_status(control_pb2.RunStatus()), as_json, out, clear=False, outcome=outcome)


def _show(status, as_json: bool, out: TextIO, *, clear: bool, one_line: bool = False, outcome=None) -> None:
    if as_json:
        from google.protobuf.json_format import MessageToDict

        data = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        annotate_json(status, data)
        data["run_state"] = run_state(status, outcome)
        data["run_end"] = outcome.to_json() if outcome is not None and outcome.ended else None
        out.write(json.dumps(data, indent=None if one_line else 2, sort_keys=True) + "\n")
    else:
        if clear:
            out.write("\x1b[2J\x1b[H")
        elif one_line:  # watching without a terminal: separate the snapshots
            out.write("-" * 80 + "\n")
        print_status(status, out, outcome=outcome)  # rich tables on a terminal, the plain lines otherwise
    out.flush()


if __name__ == "__main__":
    raise SystemExit(main())
