"""`primerl-infer`: the inference daemon."""

from __future__ import annotations

from primerl.cli.role_entry import run_role


def main(argv: list[str] | None = None) -> int:
    from primerl.inference.config import InferenceConfig

    return run_role("primerl-infer", "inference", InferenceConfig, argv, example="--model.max-model-len 4096")


if __name__ == "__main__":
    raise SystemExit(main())
