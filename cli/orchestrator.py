"""`primerl-orchestrator`: the orchestrator daemon."""

from __future__ import annotations

from primerl.cli.role_entry import run_role


def main(argv: list[str] | None = None) -> int:
    from primerl.orchestrator.config import OrchestratorConfig

    return run_role("primerl-orchestrator", "orchestrator", OrchestratorConfig, argv, example="--batch-size 64")


if __name__ == "__main__":
    raise SystemExit(main())
