"""`primerl-broker`: the broker daemon."""

from __future__ import annotations

from primerl.cli.role_entry import run_role


def main(argv: list[str] | None = None) -> int:
    from primerl.broker.config import BrokerConfig

    return run_role("primerl-broker", "broker", BrokerConfig, argv, example="--grpc-port 50051")


if __name__ == "__main__":
    raise SystemExit(main())
