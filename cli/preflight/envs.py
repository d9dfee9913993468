"""The preflight's check of the environments (`primerl.orchestrator.envs.checks` holds the checks themselves, so
that the orchestrator runs them on its own env workers under `primerl rl`): here, each environment is loaded in an
env worker of the check's own (`primerl rl --check`, `--preflight-first`, a daemon started alone)."""

from __future__ import annotations

from primerl.cli.preflight.base import Check, Finding


def usable_tokenizer(tokenizer: str | None) -> str | None:
    """``tokenizer`` when prompts can be measured with it (the model check reports a name that is not usable)."""
    from primerl.cli.preflight.model import name_problem

    return tokenizer if tokenizer is not None and name_problem("tokenizer", tokenizer, "tokenizer") is None else None


def env_checks(orchestrator, *, prefix: str, tokenizer: str | None, max_model_len: int | None) -> Check:
    """The environments of an orchestrator config, each loaded in an env worker of its own; prompts measured with
    ``tokenizer`` (skipped when None, or when it is not a usable name: the model check says why)."""

    def check() -> list[Finding]:
        from primerl.orchestrator.envs.checks import check_planned, env_plan

        return check_planned(
            orchestrator,
            env_plan(orchestrator, prefix),
            prefix=prefix,
            tokenizer=usable_tokenizer(tokenizer),
            max_model_len=max_model_len,
        )

    return check
