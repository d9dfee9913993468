"""``primerl``: the umbrella command. Each sub-command lives in its own module, imported only when run."""

from __future__ import annotations

import importlib
import sys

# name -> (module with `main(argv) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "rl": ("primerl.cli.rl", "train with RL from one config: `primerl rl @ config.toml [--a.b value ...] [--dry-run]`"),
    "sft": ("primerl.cli.sft", "supervised fine-tuning on a JSONL file of chat samples: `primerl sft @ sft.toml`"),
    "init-tiny-model": ("primerl.cli.tiny_model", "build the tiny Qwen2 model and tokenizer offline into a directory"),
    "generate": (
        "primerl.cli.generate",
        "generate from a model with vLLM; --check-logprobs compares with transformers",
    ),
    "broker": ("primerl.cli.broker", "run the broker daemon (same as primerl-broker)"),
    "trainer": ("primerl.cli.trainer", "run a trainer rank (same as primerl-trainer)"),
    "infer": ("primerl.cli.infer", "run an inference worker (same as primerl-infer)"),
    "orchestrator": ("primerl.cli.orchestrator", "run the orchestrator (same as primerl-orchestrator)"),
    "slurm": (
        "primerl.cli.slurm",
        "run RL as SLURM jobs: `primerl slurm @ rl.toml [--trainer-nodes N] [--dry-run]`; `add-inference RUN_DIR`",
    ),
    "status": ("primerl.cli.status", "show a running job's status from the broker"),
    "certs": (
        "primerl.cli.certs",
        "make a CA, TLS certificates and CURVE keys for an encrypted wire: `primerl certs --out DIR --host H`",
    ),
    "sft-data": ("primerl.cli.sft_data", "write an environment's reference answers as SFT samples (JSONL)"),
    "eval": ("primerl.cli.eval", "evaluate a model or checkpoint on an environment: `primerl eval ENV_ID -m MODEL`"),
    "env": (
        "primerl.cli.env",
        "install an environment into the env interpreter and check it loads: "
        "`primerl env install PATH|PACKAGE`; `primerl env list`",
    ),
    "dashboard": (
        "primerl.cli.dashboard",
        "serve a run's live web page (metrics, rollouts, workers, events): `primerl dashboard RUN_DIR`",
    ),
    "plot": ("primerl.cli.plot", "write PNG curves of a run (reward, loss, lag, throughput): `primerl plot RUN_DIR`"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: primerl <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "Run `primerl <command> --help` for the arguments of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from primerl import __version__

        print(__version__)
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"primerl: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(command[0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
