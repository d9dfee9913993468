"""`primerl slurm`: a run as SLURM jobs, from the same config as `primerl rl` (``primerl.slurm``).

primerl slurm @ rl.toml [--section.key VALUE ...] [--run-dir DIR] [--shape jobs|one-job] [--trainer-nodes N]
              [--inference-nodes N] [--gpus-per-node G] [--partition P] [--account A] [--time T] [--dry-run]
primerl slurm add-inference RUN_DIR --nodes K [--dry-run]
primerl slurm step ROLE RUN_DIR                              (run by the batch scripts)
primerl slurm settle ROLE RUN_DIR --status N [--cancelled 0|1]  (run by the batch scripts)
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from primerl.cli.command_args import config_warnings_printed, parse_command_args
from primerl.runtime.config_base import ConfigError
from primerl.runtime.config_loader import load_config, parse_config_args

USAGE = (
    "primerl slurm @ CONFIG.toml [--section.key VALUE ...] [--run-dir DIR] [--shape {jobs,one-job}]\n"
    "                     [--trainer-nodes N] [--inference-nodes N] [--gpus-per-node G] [--partition P]\n"
    "                     [--account A] [--time T] [--job-name NAME] [--requeue-limit N] [--sbatch-arg ARG ...]\n"
    "                     [--dry-run]\n"
    "       primerl slurm add-inference RUN_DIR --nodes K [--dry-run]"
)
EPILOG = """\
shapes:
  jobs (default)  every role a job of its own: the broker first, then the trainer (torchrun over --trainer-nodes),
                  the inference workers (a job array, one worker per node) and the orchestrator. A role whose step
                  fails is requeued alone (`scontrol requeue`, at most --requeue-limit times) and rejoins the run;
                  the others go on. `primerl slurm add-inference RUN_DIR --nodes K` adds workers as a job of their
                  own; `scancel` of that job takes them out again, with no step lost.
  one-job         one allocation (1 + trainer + inference nodes), prime-rl's fate sharing: the first role that fails
                  stops the others and ends the job.

Every job is named after the run (--job-name, default primerl-<run dir name>): `scancel --name NAME` stops every
role cleanly (SIGTERM, as systemd would). `primerl status RUN_DIR` and `primerl dashboard RUN_DIR` work as for a
local run once the broker's job runs. The run directory must be on a file system every node sees.
"""
SUBCOMMANDS = ("add-inference", "step", "settle")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl slurm",
        usage=USAGE,
        description="Run RL training as SLURM jobs: broker, trainer, inference and orchestrator from one config.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--dry-run", action="store_true", help="write the run's files and print the batch scripts; submit nothing")
    add("--run-dir", type=Path, metavar="DIR", help="directory of the run (sets output_dir); shared by every node")
    add("--shape", choices=("jobs", "one-job"), default="jobs", help="roles as jobs of their own, or one job")
    add("--trainer-nodes", type=int, default=1, metavar="N", help="nodes of the trainer (default %(default)s)")
    add("--inference-nodes", type=int, default=1, metavar="N", help="inference workers, one per node (default 1)")
    add("--gpus-per-node", type=int, default=0, metavar="G", help="GPUs per trainer and inference node; 0: CPU")
    add("--partition", metavar="P", help="sbatch --partition")
    add("--account", metavar="A", help="sbatch --account")
    add("--time", metavar="T", help="sbatch --time of each job (e.g. 1-00:00:00)")
    add("--job-name", metavar="NAME", help="the name of every job of the run (default primerl-<run dir name>)")
    add("--requeue-limit", type=int, default=3, metavar="N", help="requeues of one job (default %(default)s)")
    add("--sbatch-arg", action="append", default=[], metavar="ARG", help="one more #SBATCH option, e.g. --qos=high")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _subcommand(argv[0], argv[1:])
    parser = _parser()
    options = {"--run-dir", "--shape", "--trainer-nodes", "--inference-nodes", "--gpus-per-node", "--partition"}
    options |= {"--account", "--time", "--job-name", "--requeue-limit", "--sbatch-arg"}
    try:
        parsed = parse_config_args(argv, cli_flags={"--dry-run", "-h", "--help"}, cli_options=options)
        args = parse_command_args(parser, parsed.rest)
        if isinstance(args, int):
            return args
        if not parsed.files and not parsed.overrides:
            parser.print_usage(sys.stderr)
            print("primerl slurm: error: give a config file: primerl slurm @ rl.toml", file=sys.stderr)
            return 2
        return _submit(args, parsed)
    except ConfigError as err:
        print(f"primerl slurm: {err}", file=sys.stderr)
        return 2


def _submit(args: argparse.Namespace, parsed) -> int:
    from primerl.configs.rl import RLConfig
    from primerl.slurm.plan import PlanError, SlurmPlan
    from primerl.slurm.submit import SubmitError, prepare_run, submit_run

    overrides = dict(parsed.overrides)
    if args.run_dir is not None:
        overrides["output_dir"] = str(args.run_dir)
    ranks = max(1, args.gpus_per_node) * max(1, args.trainer_nodes)
    overrides.setdefault("orchestrator.num_train_ranks", ranks)  # the trainer's world size: each rank's batch share
    with config_warnings_printed():
        config = load_config(RLConfig, [*map(Path, parsed.files)], overrides)
    run_dir = Path(config.output_dir).resolve()
    try:
        plan = SlurmPlan(
            run_dir=str(run_dir),
            job_name=args.job_name or f"primerl-{run_dir.name}",
            shape=args.shape,
            trainer_nodes=args.trainer_nodes,
            inference_nodes=args.inference_nodes,
            gpus_per_node=args.gpus_per_node,
            partition=args.partition,
            account=args.account,
            time_limit=args.time,
            requeue_limit=args.requeue_limit,
            sbatch_args=list(args.sbatch_arg),
            broker_ports={
                key: getattr(config.broker, key)
                for key in ("grpc_port", "rollout_port", "weight_port")
                if key in config.broker.model_fields_set
            },
        )
    except PlanError as err:
        print(f"primerl slurm: {err}", file=sys.stderr)
        return 2
    token = config.broker.run_token or os.environ.get("PRIMERL_RUN_TOKEN") or secrets.token_urlsafe(24)
    paths = prepare_run(config, plan, token)
    if args.dry_run:
        from primerl.slurm.submit import sbatch_argv

        for name, path in paths.items():
            command = " ".join(sbatch_argv(plan, name, path, "$BROKER_JOB"))
            print(f"# --- {path} ---\n# submitted with: {command}\n{path.read_text()}")
        return 0
    try:
        submit_run(plan, paths, sys.stdout)
    except SubmitError as err:
        print(f"primerl slurm: {err}", file=sys.stderr)
        return 1
    print(f"run directory {run_dir}: `primerl status {run_dir}`; `scancel --name {plan.job_name}` stops the run")
    return 0


def _subcommand(name: str, argv: list[str]) -> int:
    from primerl.slurm.plan import PlanError, read_plan

    parser = argparse.ArgumentParser(prog=f"primerl slurm {name}", allow_abbrev=False)
    if name != "add-inference":
        parser.add_argument("role", choices=("broker", "trainer", "orchestrator", "inference"))
    parser.add_argument("run_dir", metavar="RUN_DIR")
    if name == "add-inference":
        parser.add_argument("--nodes", type=int, required=True, metavar="K", help="workers to add, one per node")
        parser.add_argument("--dry-run", action="store_true", help="print the sbatch command and script only")
    if name == "settle":
        parser.add_argument("--status", type=int, required=True)
        parser.add_argument("--cancelled", type=int, choices=(0, 1), default=0)
    args = parser.parse_args(argv)
    if name == "step":
        from primerl.slurm.step import main as step

        return step(args.role, args.run_dir)
    if name == "settle":
        from primerl.slurm.settle import main as settle

        return settle(args.role, args.run_dir, args.status, bool(args.cancelled))
    from primerl.slurm.submit import SubmitError, add_inference

    try:
        return add_inference(read_plan(args.run_dir), args.nodes, args.dry_run, sys.stdout)
    except (PlanError, SubmitError) as err:
        print(f"primerl slurm add-inference: {err}", file=sys.stderr)
        return 2
