"""`make chaos` / `python scripts/chaos`: seeded kill-and-restart runs of a real short RL run (tiny model, toy
reverse-text environment), in mode ``separate`` (the four daemons under a systemd-like restarter) and mode ``rl``
(`primerl rl --restart on-failure`); prints a summary per seed and mode; exit status 1 when any check fails.
docs/chaos.md describes the kills and the checks."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from .checks import judge, summary, write_summary
from .driver import Driver
from .plan import CHECKPOINT_DISK, PARTITIONS, SPOOL_DISK, make_plan, steps_needed
from .runs import (
    REPO_ROOT,
    RunSpec,
    build_tiny_model,
    faketime_refusal,
    partition_refusal,
    rl_has_restart_option,
    shipped_restart_sec,
    tmpfs_refusal,
    unmount_leftover,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python scripts/chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default %(default)s)")
    parser.add_argument("--modes", default="separate,rl", help="separate, rl or both (default %(default)s)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the CI profile: one kill per role (broker during a push, trainer between a publish "
        "and its checkpoint, orchestrator and inference at random moments)",
    )
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default: enough for the plan)")
    parser.add_argument(
        "--run-root",
        type=Path,
        default=REPO_ROOT / "runs" / "chaos",
        help="runs go to RUN_ROOT/<mode>-seed<seed> (default %(default)s)",
    )
    parser.add_argument(
        "--restart-sec",
        type=float,
        default=None,
        help="RestartSec of every role (default: the shipped systemd units' values)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound of one run (default %(default)g)")
    parser.add_argument(
        "--stall-s",
        type=float,
        default=240.0,
        help="give a run up when no step is done for this long (default %(default)g)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"separate", "rl"}
    if unknown or not seeds:
        print(f"chaos: --modes takes separate and/or rl (got {sorted(unknown)}); --seeds at least one", file=sys.stderr)
        return 2
    restart_sec = shipped_restart_sec()
    if args.restart_sec is not None:
        restart_sec = {role: args.restart_sec for role in restart_sec}
    model = build_tiny_model(args.run_root / "tiny-model")
    results: list[tuple[str, bool]] = []
    summaries: list[str] = []
    if "rl" in modes and not rl_has_restart_option():
        message = "== mode rl: FAIL: `primerl rl --help` shows no --restart option; mode rl not run"
        print(message, flush=True)
        summaries.append(message)
        results.append(("rl", False))
        modes.remove("rl")
    disk_refusal = None if args.quick else tmpfs_refusal()
    if disk_refusal:
        message = f"chaos: the spool-disk and checkpoint-disk faults are left out of the plan: {disk_refusal}"
        print(message, flush=True)
        summaries.append(message)
    clock_refusal = None if args.quick or "separate" not in modes else faketime_refusal()
    if clock_refusal:
        message = f"chaos: the skewed-clock fault is left out of the plan: {clock_refusal}"
        print(message, flush=True)
        summaries.append(message)
    network_refusal = None if args.quick or "separate" not in modes else partition_refusal()
    if network_refusal:
        message = f"chaos: the partition faults are left out of the plan: {network_refusal}"
        print(message, flush=True)
        summaries.append(message)
    for mode in modes:
        for seed in seeds:
            plan = make_plan(
                seed,
                full=not args.quick,
                relay=mode == "separate",
                launcher=mode == "rl",
                trainer_rank=mode == "rl",
                stall=not args.quick,
                disk=not args.quick and disk_refusal is None,
                checkpoint_disk=not args.quick and disk_refusal is None,
                clock=mode == "separate" and not args.quick and clock_refusal is None,
                partitions=mode == "separate" and not args.quick and network_refusal is None,
                mid_send=not args.quick,
            )
            max_steps = args.steps or steps_needed(plan)
            run_dir = (args.run_root / f"{mode}-seed{seed}").resolve()
            if run_dir.exists():
                import shutil

                for small_disk in (run_dir / "broker" / "spool", run_dir / "checkpoints"):
                    unmount_leftover(small_disk)  # a tmpfs a killed harness left behind
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            stall = any(kill.moment == "stall" for kill in plan)
            roles = {kill.role for kill in plan}
            spec = RunSpec.create(
                mode,
                seed,
                run_dir,
                model.resolve(),
                max_steps,
                restart_sec,
                stall=stall,
                disk=SPOOL_DISK in roles,
                checkpoint_disk=CHECKPOINT_DISK in roles,
                partitions=bool(roles & set(PARTITIONS)),
            )
            print(
                f"chaos: mode {mode} seed {seed}: {max_steps} steps, kills "
                f"{', '.join(k.describe() for k in plan)} ({time.strftime('%H:%M:%S')})",
                flush=True,
            )
            driver = Driver(
                spec, plan, timeout_s=args.timeout_s, stall_s=args.stall_s, say=lambda text: print(text, flush=True)
            )
            try:
                record = driver.run()
            except Exception:  # the harness's own fault: shown, judged as aborted (the roles are stopped)
                traceback.print_exc()
                record = driver.record
            verdict = judge(record)
            write_summary(verdict)
            text = summary(verdict)
            print(text, flush=True)
            summaries.append(text)
            results.append((f"{mode}-seed{seed}", verdict.ok))
    print("\n".join(["", "chaos summary:", *summaries]))
    print("chaos: " + ", ".join(f"{name} {'PASS' if ok else 'FAIL'}" for name, ok in results))
    return 0 if all(ok for _, ok in results) else 1
