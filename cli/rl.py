"""`primerl rl @ config.toml [--section.key value ...] [--dry-run] [--write DIR]`: one run, all four roles."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from primerl.runtime.config_base import ConfigError, ConfigWarning
from primerl.runtime.config_loader import dump_toml, load_config, parse_config_args, write_toml

USAGE = "primerl rl @ CONFIG.toml [@ MORE.toml ...] [--section.key VALUE ...] [--dry-run] [--write DIR]"
EPILOG = """\
config files (later ones win; tables merge, arrays and values replace):
  @ config.toml          a run config in the prime-rl shape, the flat lab shape or the legacy vf-rl shape

settings (applied after all files; dashes in keys are underscores):
  --orchestrator.batch-size 64          --trainer.optim.lr=1e-5
  --trainer.ckpt.resume-step 50         --inference-gpu-ids [0,1]
  --orchestrator.buffer.online-difficulty-filtering   (true)
  --no-orchestrator.mask-truncated-completions        (false)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl rl",
        usage=USAGE,
        description="Run RL training: broker, trainer, orchestrator and inference from one config.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config of each role and exit")
    parser.add_argument("--write", metavar="DIR", type=Path, help="with --dry-run: write each role's config to DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `primerl rl`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        parsed = parse_config_args(argv, cli_flags={"--dry-run", "-h", "--help"}, cli_options={"--write"})
        try:
            args = parser.parse_args(parsed.rest)
        except SystemExit as exit_:  # --help (0) or a usage error (2), already printed by argparse
            return int(exit_.code or 0)
        if not parsed.files and not parsed.overrides:
            parser.print_usage(sys.stderr)
            print("primerl rl: error: give a config file: primerl rl @ config.toml", file=sys.stderr)
            return 2
        from primerl.cli.rl_config import RLConfig

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            config = load_config(RLConfig, [*map(Path, parsed.files)], parsed.overrides)
        for warning in caught:
            print(f"warning: {warning.message}", file=sys.stderr)
    except ConfigError as err:
        print(f"primerl rl: {err}", file=sys.stderr)
        return 2

    if not args.dry_run:
        print(
            "primerl rl: starting the roles is not implemented yet; "
            "use --dry-run to check the config and see each role's resolved settings",
            file=sys.stderr,
        )
        return 2
    roles = config.role_configs()
    if args.write is not None:
        write_toml(config, args.write / "rl.toml")
        for role, role_config in roles.items():
            path = write_toml(role_config, args.write / f"{role}.toml")
            print(f"wrote {path}")
        return 0
    for role, role_config in roles.items():
        print(f"# --- {role} ---")
        print(dump_toml(role_config, redact_secrets=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
