"""`primerl dashboard RUN_DIR | --broker ADDR`: serve a run's read-only web page and print its URL with a login token.

A finished run: its run directory alone (``rl.toml``, ``metrics.jsonl``, ``rollouts.jsonl``, ``logs/``). A live run:
the run directory (its ``run.json`` names the broker, the token and the TLS files) or ``--broker`` with ``--token``
and ``--tls-*`` for a broker on another host (then workers, queues and errors come from the broker only)."""

from __future__ import annotations

import argparse
import sys

from primerl.cli.status import ENV_TOKEN


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl dashboard",
        usage="primerl dashboard [RUN_DIR] [--broker HOST:PORT] [--token TOKEN] [--host H] [--port P]",
        description="Serve a read-only web page of a run (live or finished) and print its URL with a login token.",
    )
    parser.add_argument("run_dir", nargs="?", default=None, metavar="RUN_DIR", help="output_dir of a `primerl rl` run")
    parser.add_argument("--broker", default=None, help="gRPC address of a live run's broker (default: RUN_DIR's)")
    parser.add_argument("--token", default=None, help=f"the run token (default: RUN_DIR's, else ${ENV_TOKEN})")
    parser.add_argument("--tls-ca", default=None, help="PEM CA file: connect to the broker with TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS), with --tls-key")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, help="name to check the broker's certificate against")
    parser.add_argument("--no-broker", action="store_true", help="read RUN_DIR only, even if its run.json names one")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default %(default)s: this machine)")
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one)")
    parser.add_argument("--login-token", default=None, help="the page's login token (default: a fresh random one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.run_dir is None and args.broker is None:
        print(
            "primerl dashboard: give a run directory (RUN_DIR) or a live broker (--broker HOST:PORT)", file=sys.stderr
        )
        return 2
    if not 0 <= args.port <= 65535:
        print(f"primerl dashboard: --port {args.port} is not a port (0-65535; 0: a free one)", file=sys.stderr)
        return 2
    import structlog

    from primerl.runtime.log_setup import configure_logging

    if not structlog.is_configured():
        configure_logging("dashboard", level="warning")
    from primerl.dashboard.server import Dashboard, DashboardServer
    from primerl.dashboard.sources import RunDirSource

    try:
        run_dir = RunDirSource(args.run_dir) if args.run_dir is not None else None
        broker = None if args.no_broker else _broker(args)
    except ValueError as err:
        print(f"primerl dashboard: {err}", file=sys.stderr)
        return 2
    try:
        server = DashboardServer(Dashboard(run_dir, broker), args.host, args.port, args.login_token)
    except OSError as err:
        print(f"primerl dashboard: cannot serve on {args.host}:{args.port}: {err.strerror or err}", file=sys.stderr)
        return 1
    what = f"run {args.run_dir}" if args.run_dir else f"broker {args.broker}"
    _stop_on_signals()
    print(f"primerl dashboard: {what} at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.dashboard.close()
    return 0


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM end `serve_forever` (exit 0). Set here, not left to Python's default: a
    command started in the background of a script inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt for it (the command never stopped on Ctrl-C or SIGINT there; SIGTERM killed it unclean)."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)


def _broker(args: argparse.Namespace):
    """The live broker to read, or None (a run directory without run.json: a run read from its files only)."""
    import os

    from primerl.dashboard.sources import connect_broker
    from primerl.supervisor.run_file import RunFileError, read_run_file

    tls = {"tls_ca_path": args.tls_ca, "tls_cert_path": args.tls_cert, "tls_key_path": args.tls_key}
    address, token, server_name = args.broker, args.token, args.tls_server_name
    if args.run_dir is not None:
        try:
            run = read_run_file(args.run_dir)
        except RunFileError:
            run = None
        if run is not None:
            address = address or run.broker_address
            token = token if token is not None else run.run_token
            if not any(tls.values()):
                tls = {
                    "tls_ca_path": run.tls_ca_path,
                    "tls_cert_path": run.tls_cert_path,
                    "tls_key_path": run.tls_key_path,
                }
                server_name = server_name or run.tls_server_name
    if address is None:
        return None
    if token is None:
        token = os.environ.get(ENV_TOKEN) or None
    return connect_broker(address, token, tls_server_name=server_name, **tls)


if __name__ == "__main__":
    raise SystemExit(main())
