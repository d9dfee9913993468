"""`primerl-trainer`: the trainer daemon."""

from __future__ import annotations

from primerl.cli.role_entry import run_role


def main(argv: list[str] | None = None) -> int:
    from primerl.trainer.config import TrainerConfig

    return run_role("primerl-trainer", "trainer", TrainerConfig, argv, example="--optim.lr 1e-5")


if __name__ == "__main__":
    raise SystemExit(main())
