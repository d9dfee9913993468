"""`primerl-broker`: the broker daemon."""

from __future__ import annotations

import argparse
import threading

from primerl.cli.role_entry import run_role
from primerl.cli.role_signals import StopSignals
from primerl.proto.ready_file import write_ready_file


def serve(config, args: argparse.Namespace) -> int:
    from primerl.broker.service import BrokerService
    from primerl.broker.spool import SpoolError
    from primerl.runtime.log_setup import configure_logging

    service = BrokerService(config)
    log = configure_logging("broker", service.run_id, level=config.log.level, fmt=config.log.format)
    stop_event = threading.Event()
    # Its start-up only binds ports: a stop is graceful from the first (serve_until returns at once).
    StopSignals(log, stop_event, set_up=lambda: True).install()
    try:
        endpoints = service.start()
    except (OSError, SpoolError, ValueError) as exc:  # a port in use, a spool that cannot be written or is locked
        log.error("broker cannot start", error=str(exc))
        return 1
    try:
        if args.ready_file is not None:
            write_ready_file(args.ready_file, "broker", endpoints.as_dict())
        return service.serve_until(stop_event)
    finally:
        service.stop(grace_s=5.0)


def main(argv: list[str] | None = None) -> int:
    from primerl.configs.broker import BrokerConfig

    return run_role(
        "primerl-broker", "broker", BrokerConfig, argv, example="--grpc-port 50051", serve=serve, token_key="run_token"
    )


if __name__ == "__main__":
    raise SystemExit(main())
