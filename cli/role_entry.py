"""What the role daemons' entry points share: config loading from `@ file.toml` and overrides, `--dry-run`
printing the resolved config, `--ready-file` for launchers (its format: `primerl.proto.ready_file`), the run
token from `$PRIMERL_RUN_TOKEN`, and the preflight checks of the role before it starts (`primerl.cli.preflight`;
skipped under `primerl rl`, which ran them for every role)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from primerl.cli.command_args import config_warnings_printed, parse_command_args
from primerl.runtime.config_base import ConfigError
from primerl.runtime.config_loader import dump_toml, load_role_config
from primerl.runtime.parent_death import arm_from_environment

RUN_TOKEN_ENV = "PRIMERL_RUN_TOKEN"

EPILOG = """\
config files (later ones win) and settings (dashes in keys are underscores):
  @ {role}.toml                 a {role} config, e.g. one written by `primerl rl ... --dry-run --write DIR`
  --section.key VALUE           e.g. {example}
  --flag / --no-flag            booleans

environment:
  PRIMERL_RUN_TOKEN             the run token, unless given on the command line (keeps it out of files)
  PRIMERL_SKIP_PREFLIGHT=1      start without the preflight checks (primerl rl sets it: it checked already)
"""


def run_role(
    prog: str,
    role: str,
    config_cls: type,
    argv: list[str] | None,
    *,
    example: str,
    serve: Callable[[object, argparse.Namespace], int],
    token_key: str = "broker.run_token",
) -> int:
    """Parse the command line of a role daemon; ``serve(config, args)`` runs the daemon and returns its exit code.

    ``$PRIMERL_RUN_TOKEN``, when set, gives the run token (key ``token_key``) unless the command line does:
    secrets stay out of config files and process listings (systemd passes it with ``EnvironmentFile=``).
    """
    # Started by a launcher (``primerl rl``): end with it, SIGKILL included (before anything slow happens here).
    arm_from_environment()
    argv = sys.argv[1:] if argv is None else list(argv)
    token_option = "--" + token_key.replace("_", "-")
    if os.environ.get(RUN_TOKEN_ENV) and not any(a.split("=")[0] in (token_option, "--" + token_key) for a in argv):
        argv += [f"{token_option}={os.environ[RUN_TOKEN_ENV]}"]
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [@ {role}.toml ...] [--section.key VALUE ...] [--dry-run]",
        description=f"Run the primerl {role} daemon.",
        epilog=EPILOG.format(role=role, example=example),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument(
        "--ready-file",
        type=Path,
        metavar="PATH",
        help="once serving, write the bound ports and pid as JSON to PATH (for launchers and tests)",
    )
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0
    try:
        with config_warnings_printed():
            config, rest = load_role_config(
                config_cls, argv, cli_flags={"--dry-run", "-h", "--help"}, cli_options={"--ready-file"}
            )
        args = parse_command_args(parser, rest)
        if isinstance(args, int):
            return args
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_toml(config, redact_secrets=True), end="")
        return 0
    from primerl.cli.preflight.roles import role_preflight

    status = role_preflight(prog, role, config)  # a mistake: one line each and 2, before anything starts
    if status is not None:
        return status
    return serve(config, args)
