"""`primerl rl @ config.toml [--section.key value ...] [--dry-run] [--write DIR]`: one run, all four roles."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.cli.command_args import config_warnings_printed, parse_command_args
from primerl.runtime.config_base import ConfigError
from primerl.runtime.config_loader import dump_toml, load_config, parse_config_args, write_toml
from primerl.runtime.run_files import LOGS_DIR, RUN_CONFIG_FILE
from primerl.supervisor.restart_policy import RESTART_MODES, RestartPolicy

if TYPE_CHECKING:
    from primerl.configs.rl import RLConfig

USAGE = (
    "primerl rl @ CONFIG.toml [@ MORE.toml ...] [--section.key VALUE ...] [--run-dir DIR] [--tmux]\n"
    "                  [--restart {on-failure,never}] [--restart-limit N]\n"
    "                  [--check | --no-preflight | --preflight-first]\n"
    "                  [--no-dashboard | --dashboard-port PORT] [--dry-run [--write DIR]]"
)
EPILOG = """\
config files (later ones win; tables merge, arrays and values replace):
  @ config.toml          a run config in the prime-rl shape, the flat lab shape or the legacy vf-rl shape

settings (applied after all files; dashes in keys are underscores):
  --orchestrator.batch-size 64          --trainer.optim.lr=1e-5
  --trainer.ckpt.resume-step 50         --inference-gpu-ids [0,1]
  --orchestrator.buffer.online-difficulty-filtering   (true)
  --no-orchestrator.mask-truncated-completions        (false)

a preflight checks the config against this machine: the model and tokenizer paths exist, fixed ports are free,
W&B has a login (else it logs offline, with a warning) -- before anything starts, in milliseconds -- and, while
the roles start (vLLM's import alone takes seconds), the env interpreter imports verifiers, every environment
loads with its args, sampled prompts fit seq_len after the chat template; the orchestrator's first rollout waits
for that verdict. Each mistake is one line and exit status 2 (the roles started meanwhile are stopped first);
details in {run_dir}/logs/preflight.log. --check runs only the preflight; --no-preflight skips it;
--preflight-first runs all of it before anything starts.

a run (without --dry-run) writes rl.toml and one <role>.toml per role into the run directory (output_dir),
starts broker, inference, orchestrator and trainer with their logs in {run_dir}/logs/<role>.log, shows the
progress, and stops every role when the trainer finishes, when a role fails for good, or on Ctrl-C. The run token
(broker.run_token, else an exported $PRIMERL_RUN_TOKEN, else a fresh one) reaches the roles as $PRIMERL_RUN_TOKEN;
only RUN_DIR/run.json (mode 0600) holds it, for `primerl status RUN_DIR`.

restarts (like systemd's Restart=on-failure, StartLimitBurst, StartLimitIntervalSec, RestartSec):
  with --restart on-failure (the default) a role that exits non-zero or is killed by a signal during the run is
  started again with the same command after --restart-delay-s (doubled for each further restart of that role
  within the window, at most --restart-delay-max-s), at most --restart-limit times per --restart-window-s; one
  more failure, an exit status of 2 (a configuration or data error) or --restart never stops the run and prints
  the role's last error line. The broker comes back on the same ports, spool and run id; the trainer resumes
  from its newest checkpoint; the others wait for the broker (broker.outage_s) and register again.

If primerl rl itself is killed (even with SIGKILL), every process it started ends within a few seconds.
"""


RESTART_OPTIONS = ("--restart", "--restart-limit", "--restart-window-s", "--restart-delay-s", "--restart-delay-max-s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl rl",
        usage=USAGE,
        description="Run RL training: broker, trainer, orchestrator and inference from one config.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    _add_mode_arguments(parser)
    _add_restart_arguments(parser)
    return parser


def _add_mode_arguments(parser: argparse.ArgumentParser) -> None:
    """What to do (dry run, check, run) with which preflight, where the run goes and what shows it."""
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config of each role and exit")
    parser.add_argument("--write", metavar="DIR", type=Path, help="with --dry-run: write each role's config to DIR")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the preflight checks (environments, prompts, model, ports, W&B) and exit",
    )
    parser.add_argument("--no-preflight", action="store_true", help="start without the preflight checks")
    parser.add_argument(
        "--preflight-first",
        action="store_true",
        help="run every preflight check before any role starts (slower start: nothing runs beside the checks)",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        type=Path,
        help="directory of the run (sets output_dir, which every role writes under)",
    )
    parser.add_argument("--tmux", action="store_true", help="also open a tmux session with one pane per role's log")
    parser.add_argument(
        "--no-dashboard", action="store_true", help="do not serve the run's web page (`primerl dashboard`) beside it"
    )
    parser.add_argument(
        "--dashboard-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of the run's web page on 127.0.0.1 (default: a free one)",
    )
    parser.add_argument(
        "--inference-timeout-s",
        type=float,
        default=300.0,
        metavar="S",
        help="how long inference may take to start serving (default %(default)g)",
    )
    parser.add_argument(
        "--stop-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="how long a role may take to stop before it is killed (default %(default)g)",
    )


def _add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    """``RESTART_OPTIONS``: whether and how often a role that fails during the run is restarted."""
    parser.add_argument(
        "--restart",
        choices=RESTART_MODES,
        default="on-failure",
        help="restart a role that fails during the run (default %(default)s), or stop the run",
    )
    parser.add_argument(
        "--restart-limit",
        type=int,
        default=5,
        metavar="N",
        help="most restarts of one role within --restart-window-s (default %(default)d)",
    )
    parser.add_argument(
        "--restart-window-s",
        type=float,
        default=300.0,
        metavar="S",
        help="the window of --restart-limit (default %(default)g)",
    )
    parser.add_argument(
        "--restart-delay-s",
        type=float,
        default=1.0,
        metavar="S",
        help="wait before a restart, doubled for each further one in the window (default %(default)g)",
    )
    parser.add_argument(
        "--restart-delay-max-s",
        type=float,
        default=30.0,
        metavar="S",
        help="longest wait before a restart (default %(default)g)",
    )


def _preflight_log(config) -> Path:
    return Path(config.output_dir) / LOGS_DIR / "preflight.log"


def _preflight(config) -> int | None:
    """The preflight of the whole run (`primerl.cli.preflight`): None when nothing stops the start, else 2."""
    from primerl.cli.preflight.roles import rl_preflight

    return rl_preflight(config, _preflight_log(config))


def main(argv: list[str] | None = None) -> int:
    """Entry point of `primerl rl`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        parsed = parse_config_args(
            argv,
            cli_flags={
                "--dry-run",
                "--tmux",
                "--check",
                "--no-preflight",
                "--preflight-first",
                "--no-dashboard",
                "-h",
                "--help",
            },
            cli_options={
                "--write",
                "--run-dir",
                "--inference-timeout-s",
                "--stop-timeout-s",
                "--dashboard-port",
                *RESTART_OPTIONS,
            },
        )
        args = parse_command_args(parser, parsed.rest)
        if isinstance(args, int):
            return args
        if not parsed.files and not parsed.overrides:
            parser.print_usage(sys.stderr)
            print("primerl rl: error: give a config file: primerl rl @ config.toml", file=sys.stderr)
            return 2
        from primerl.configs.rl import RLConfig

        overrides = dict(parsed.overrides)
        if args.run_dir is not None:
            overrides["output_dir"] = str(args.run_dir)

        with config_warnings_printed():
            config = load_config(RLConfig, [*map(Path, parsed.files)], overrides)
    except ConfigError as err:
        print(f"primerl rl: {err}", file=sys.stderr)
        return 2

    if args.check:
        return _preflight(config) or 0
    if not args.dry_run:
        return _launch(config, args)
    roles = config.role_configs()
    if args.write is not None:
        write_toml(config, args.write / RUN_CONFIG_FILE)
        for role, role_config in roles.items():
            path = write_toml(role_config, args.write / f"{role}.toml")
            print(f"wrote {path}")
        return 0
    for role, role_config in roles.items():
        print(f"# --- {role} ---")
        print(dump_toml(role_config, redact_secrets=True))
    return 0


def _launch(config: RLConfig, args: argparse.Namespace) -> int:
    """Check the launch options, run the preflight (fast checks now, slow ones beside the start unless told
    otherwise), then the launcher; returns the exit status."""
    if args.inference_timeout_s <= 0 or args.stop_timeout_s <= 0:
        print("primerl rl: --inference-timeout-s and --stop-timeout-s must be > 0", file=sys.stderr)
        return 2
    try:
        restart = RestartPolicy(
            mode=args.restart,
            limit=args.restart_limit,
            window_s=args.restart_window_s,
            delay_s=args.restart_delay_s,
            max_delay_s=args.restart_delay_max_s,
        )
    except ValueError as err:
        print(f"primerl rl: {err}", file=sys.stderr)
        return 2
    if args.no_preflight and args.preflight_first:
        print("primerl rl: --no-preflight and --preflight-first contradict each other; give one", file=sys.stderr)
        return 2
    background = None
    if args.no_preflight:
        status = None
    elif args.preflight_first:
        status = _preflight(config)
    else:  # the fast checks now; the slow ones beside the start (the environments: by the orchestrator)
        from primerl.cli.preflight.roles import BackgroundPreflight, rl_fast_preflight
        from primerl.runtime.start_gate import ENV_CHECK_FILE_NAME
        from primerl.supervisor.launcher import orchestrator_starts_early

        status = rl_fast_preflight(config, _preflight_log(config))
        # an orchestrator that starts with the others checks the environments it loads; one that waits for
        # inference (evals, a teacher) would report too late: the preflight loads them itself then
        early = orchestrator_starts_early(config)
        env_report = Path(config.output_dir).resolve() / ENV_CHECK_FILE_NAME if early else None
        background = BackgroundPreflight(config, _preflight_log(config), env_report=env_report)
    if status is not None:
        return status
    from primerl.cli.preflight.base import SKIP_VAR
    from primerl.supervisor.launcher import Launcher, LaunchOptions

    os.environ[SKIP_VAR] = "1"  # checked here (or skipped on purpose): the roles inherit it and skip theirs

    options = LaunchOptions(
        inference_timeout_s=args.inference_timeout_s,
        stop_timeout_s=args.stop_timeout_s,
        tmux=args.tmux,
        dashboard=not args.no_dashboard,
        dashboard_port=args.dashboard_port,
        restart=restart,
        preflight=background,
    )
    return Launcher(config, options).run()


if __name__ == "__main__":
    raise SystemExit(main())
