#!/usr/bin/env python
"""CPU seconds per training step of every process of a real `primerl rl` run (where a step's CPU goes).

    .venv/bin/python bench/cpu_per_process.py MODEL_DIR [--out runs/cpu] [--from-step 6] [--steps 15] [-- EXTRA ARGS]

Starts the demo's RL run (`examples/reverse_text_rl.toml`) from MODEL_DIR (e.g. the demo's SFT checkpoint
`runs/demo/sft/weights/step_1000`), reads the user + system CPU time of the launcher and all its descendants
(`psutil`, from /proc) when the trainer has written ``--from-step`` rows to `metrics.jsonl` and again
``--steps`` rows later, and prints each process's CPU seconds per step, their total and the wall time per step.
On a machine with C cores, a step cannot take less than total / C seconds of wall time. Arguments after `--` go
to `primerl rl` (e.g. `-- --inference.threads.num-threads 2`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from primerl.runtime.run_metrics import read_metrics_file

REPO = Path(__file__).resolve().parent.parent


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all processes, user + system + irq), from /proc/stat."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def load_text() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def trainer_rows(metrics: Path) -> int:
    try:
        rows = read_metrics_file(metrics, skip_bad_lines=True).rows
    except OSError:
        return 0
    return sum(1 for row in rows if row["role"] == "trainer")


def cpu_times(root: psutil.Process) -> dict[int, tuple[str, float]]:
    """pid -> (command line, user + system CPU seconds) of ``root`` and its descendants."""
    out = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            out[process.pid] = (" ".join(process.cmdline())[:100], times.user + times.system)
        except psutil.Error:
            continue
    return out


def wait_for_rows(metrics: Path, count: int, run: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while trainer_rows(metrics) < count:
        if run.poll() is not None:
            raise SystemExit(f"the run ended before step {count}: see its log")
        if time.monotonic() > deadline:
            raise SystemExit(f"no step {count} within {timeout_s:.0f} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "cpu")
    parser.add_argument(
        "--from-step", type=int, default=6, help="start counting once this step is done (start-up excluded)"
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args(own)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.setdefault("PRIMERL_ENV_PYTHON", str(REPO / ".venv-envs" / "bin" / "python"))
    last_step = args.from_step + args.steps
    command = [
        str(REPO / ".venv" / "bin" / "primerl"),
        "rl",
        "@",
        str(REPO / "examples" / "reverse_text_rl.toml"),
        "--model.name",
        args.model,
        "--max-steps",
        str(last_step + 2),
        "--output-dir",
        str(args.out / "run"),
        *extra,
    ]
    metrics = args.out / "run" / "metrics.jsonl"
    with open(args.out / "rl.log", "w") as log:
        run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        root = psutil.Process(run.pid)
        wait_for_rows(metrics, args.from_step, run, args.timeout_s)
        before, machine_before, started_s = cpu_times(root), machine_busy_s(), time.monotonic()
        wait_for_rows(metrics, last_step, run, args.timeout_s)
        after, machine_after, wall_s = cpu_times(root), machine_busy_s(), time.monotonic() - started_s
    finally:
        if run.poll() is None:
            run.wait(timeout=args.timeout_s)
    per_step = sorted(((cpu - before.get(pid, ("", 0.0))[1]) / args.steps, name) for pid, (name, cpu) in after.items())
    print(f"steps {args.from_step + 1}..{last_step} of `{' '.join(command[1:])}`")
    print(f"wall per step {wall_s / args.steps:.3f} s; {os.cpu_count()} CPUs")
    for seconds, name in reversed(per_step):
        if seconds >= 0.005:
            print(f"{seconds:7.3f} CPU-s/step  {name}")
    total = sum(seconds for seconds, _ in per_step)
    cores = len(os.sched_getaffinity(0))
    wall = wall_s / args.steps
    print(f"{total:7.3f} CPU-s/step in all: at least {total / cores:.3f} s of wall per step on these {cores} CPUs")
    others = max(0.0, (machine_after - machine_before) / args.steps - total)
    idle = max(0.0, cores * wall - total - others)
    print(f"{others:7.3f} CPU-s/step used by other processes of the machine (not this run)")
    print(
        f"{idle:7.3f} CPU-s/step idle ({cores} x {wall:.3f} s wall - {total:.3f} s this run - {others:.3f} s others; "
        f"{100 * idle / (cores * wall):.0f}% of the cores; load {load_text()})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
