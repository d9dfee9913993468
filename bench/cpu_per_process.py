#!/usr/bin/env python
"""CPU seconds per training step of every process of a real `primerl rl` run, and the cores' idle time per step
(where a step's CPU goes; `make bench` part cpu).

    .venv/bin/python bench/cpu_per_process.py MODEL_DIR [--cpu-sharing shared,split] [--rounds 1] [--from-step 6]
        [--steps 15] [--out runs/cpu] [--markdown bench/sections/cpu.md] [-- EXTRA ARGS]

Starts the demo's RL run (`examples/reverse_text_rl.toml`) from MODEL_DIR (e.g. the demo's SFT checkpoint
`runs/demo/sft/weights/step_1000`; ``--sft DIR`` is the same), once per ``--cpu-sharing`` mode (the run's
``cpu_sharing``, primerl.runtime.cpu_budget) per round, modes in rotation. For each run it reads the user + system
CPU time of the launcher and all its descendants (`psutil`, from /proc) and of the whole machine (/proc/stat) when
the trainer has written ``--from-step`` rows to `metrics.jsonl` and again ``--steps`` rows later, and prints each
process's CPU seconds per step, their total, the wall time per step, the CPU the machine's other processes took
meanwhile (other users of a shared machine), and the cores' idle time per step: cores x wall - this run - others.
On a machine with C cores a step cannot take less than total / C seconds of wall time; idle time is a core that
had nothing to run (e.g. vLLM's cores while the trainer computes with the budget split in halves). Arguments after
`--` go to `primerl rl` (e.g. `-- --inference.threads.num-threads 2`); ``--cpu-sharing none`` passes no mode (the
config's own).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from primerl.runtime.run_metrics import read_metrics_file  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROCESS_NAMES = (
    ("primerl-trainer", "trainer"),
    ("VLLM::EngineCore", "vLLM engine core"),
    ("primerl-infer", "primerl-infer (API server)"),
    ("classic_worker", "env worker"),
    ("primerl-orchestrator", "orchestrator"),
    ("primerl-broker", "broker"),
    ("primerl rl", "launcher (primerl rl)"),
    ("process_reaper", "process reaper"),
)


def process_name(cmdline: str) -> str:
    for needle, name in PROCESS_NAMES:
        if needle in cmdline:
            return name
    return cmdline[:60]


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
            raise RuntimeError(f"the run ended before step {count}: see its log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step {count} within {timeout_s:.0f} s")
        time.sleep(0.05)


def measure(model: str, out: Path, from_step: int, steps: int, timeout_s: float, extra: list[str]) -> dict:
    """One run: per-process CPU-s per step, total, others, idle, wall per step (see the module doc)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.setdefault("PRIMERL_ENV_PYTHON", str(REPO / ".venv-envs" / "bin" / "python"))
    last_step = from_step + steps
    command = [
        str(REPO / ".venv" / "bin" / "primerl"),
        "rl",
        "@",
        str(REPO / "examples" / "reverse_text_rl.toml"),
        "--model.name",
        model,
        "--max-steps",
        str(last_step + 2),
        "--output-dir",
        str(out / "run"),
        *extra,
    ]
    metrics = out / "run" / "metrics.jsonl"
    with open(out / "rl.log", "w") as log:
        run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        root = psutil.Process(run.pid)
        wait_for_rows(metrics, from_step, run, timeout_s)
        before, machine_before, started_s = cpu_times(root), machine_busy_s(), time.monotonic()
        wait_for_rows(metrics, last_step, run, timeout_s)
        after, machine_after, wall_s = cpu_times(root), machine_busy_s(), time.monotonic() - started_s
        load = load_text()
    finally:
        if run.poll() is None:
            run.wait(timeout=timeout_s)
    processes: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        key = process_name(name)
        processes[key] = processes.get(key, 0.0) + (cpu - before.get(pid, ("", 0.0))[1]) / steps
    total = sum(processes.values())
    cores = len(os.sched_getaffinity(0))
    wall = wall_s / steps
    others = max(0.0, (machine_after - machine_before) / steps - total)
    idle = max(0.0, cores * wall - total - others)
    return {
        "command": " ".join(command[1:]),
        "steps": f"{from_step + 1}..{last_step}",
        "cores": cores,
        "wall_per_step_s": wall,
        "processes": processes,
        "total": total,
        "others": others,
        "idle": idle,
        "idle_fraction": idle / (cores * wall) if wall > 0 else 0.0,
        "load": load,
    }


def print_run(label: str, result: dict) -> None:
    print(f"[{label}] steps {result['steps']} of `{result['command']}`")
    print(f"wall per step {result['wall_per_step_s']:.3f} s; {result['cores']} CPUs; load {result['load']}")
    for name, seconds in sorted(result["processes"].items(), key=lambda item: -item[1]):
        if seconds >= 0.005:
            print(f"{seconds:7.3f} CPU-s/step  {name}")
    cores, total = result["cores"], result["total"]
    print(f"{total:7.3f} CPU-s/step in all: at least {total / cores:.3f} s of wall per step on these {cores} CPUs")
    print(f"{result['others']:7.3f} CPU-s/step used by other processes of the machine (not this run)")
    print(
        f"{result['idle']:7.3f} CPU-s/step idle ({cores} x {result['wall_per_step_s']:.3f} s wall - {total:.3f} s "
        f"this run - {result['others']:.3f} s others; {100 * result['idle_fraction']:.0f}% of the cores)",
        flush=True,
    )


def markdown(args: argparse.Namespace, modes: list[str], results: dict[str, list[dict]], started: float) -> None:
    from cpu_info import cpu_phrase
    from report import Section, Stats, fmt, save_bars

    section = Section("cpu. Where a step's CPU goes: CPU seconds per step by process, and idle cores")
    section.line(
        f"CPU: {cpu_phrase()}. The demo's `primerl rl` (examples/reverse_text_rl.toml) from `{args.model}`, "
        f"steps {args.from_step + 1}..{args.from_step + args.steps} of each run (start-up excluded), "
        f"{args.rounds} run(s) per `cpu_sharing` mode, modes in rotation. CPU-s/step from /proc (user + system, "
        "each process and its threads); others = what the machine's other processes took meanwhile (a shared "
        "machine); idle = cores x wall - this run - others: a core that had nothing to run."
    )
    section.line()
    stats: dict[str, dict[str, Stats]] = {mode: {} for mode in modes}
    for mode in modes:
        for result in results[mode]:
            for name, value in result["processes"].items():
                stats[mode].setdefault(name, Stats()).add(value)
            for key in ("total", "others", "idle", "wall_per_step_s"):
                stats[mode].setdefault(f"_{key}", Stats()).add(result[key])
            stats[mode].setdefault("_idle_pct", Stats()).add(100 * result["idle_fraction"])
    names = sorted(
        {name for mode in modes for name in stats[mode] if not name.startswith("_")},
        key=lambda name: -max(stats[m][name].median if name in stats[m] else 0.0 for m in modes),
    )
    rows = [[name, *(stats[m][name].cell() if name in stats[m] else "—" for m in modes)] for name in names]
    for key, label in (
        ("_total", "**this run, all processes**"),
        ("_wall_per_step_s", "**wall per step, s**"),
        ("_others", "other processes of the machine"),
        ("_idle", "**idle cores, CPU-s/step**"),
        ("_idle_pct", "idle, % of cores x wall"),
    ):
        rows.append([label, *(stats[m][key].cell() if key in stats[m] else "—" for m in modes)])
    section.table(["CPU-s per step", *(f"`cpu_sharing = {m}`" for m in modes)], rows)
    loads = "; ".join(f"{m}: {', '.join(r['load'] for r in results[m])}" for m in modes)
    section.line(f"Load (1/5/15 min) at the end of each measured window: {loads}.")
    section.line()
    if len(modes) > 1 and all(stats[m].get("_wall_per_step_s") for m in modes):
        base = stats[modes[-1]]["_wall_per_step_s"].median
        ratios = ", ".join(f"{m} {fmt(stats[m]['_wall_per_step_s'].median / base)}" for m in modes[:-1])
        section.line(f"Wall per step relative to `{modes[-1]}` (medians): {ratios}.")
        section.line()
    section.image(
        save_bars(
            args.plots_dir / "cpu_idle_per_step.png",
            "cpu. idle core time per step (demo)",
            "CPU-s per step",
            {f"idle, {m}": stats[m]["_idle"] for m in modes if stats[m].get("_idle")},
        ),
        args.markdown.parent,
        "cpu. idle per step",
    )
    section.line(f"Part took {time.time() - started:.0f} s.")
    section.write(args.markdown)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--sft", default=None, help="the model to start from (the same as MODEL_DIR)")
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: WORK_DIR/cpu)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs")
    parser.add_argument(
        "--from-step", type=int, default=6, help="start counting once this step is done (start-up excluded)"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps measured per run (default 15; --quick 5)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per mode")
    parser.add_argument(
        "--cpu-sharing",
        default="shared,split",
        help="`cpu_sharing` modes, comma-separated, one run each per round (default shared,split); none: the "
        "config's own",
    )
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--markdown", type=Path, default=None, help="write a RESULTS.md section here")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plots-dir", type=Path, default=REPO / "bench" / "plots")
    parser.add_argument("--budget-s", type=float, default=None, help="fewer rounds (never fewer than 1) past it")
    parser.add_argument("--quick", action="store_true", help="5 steps from step 3")
    args = parser.parse_args(own)
    args.model = args.model or args.sft
    if not args.model:
        parser.error("give MODEL_DIR (or --sft DIR)")
    if args.quick:
        args.from_step = min(args.from_step, 3)
    args.steps = args.steps or (5 if args.quick else 15)
    modes = [m.strip() for m in args.cpu_sharing.split(",") if m.strip()]
    if not modes or any(m not in ("shared", "split", "none") for m in modes):
        parser.error(f"--cpu-sharing {args.cpu_sharing!r}: list shared, split or none, comma-separated")
    out = args.out or args.work_dir / "cpu"
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    started = time.time()
    status = 0
    for round_ in range(args.rounds):
        if round_ > 0 and args.budget_s is not None:
            if (time.time() - started) * (round_ + 1) / round_ > args.budget_s:
                print(f"rounds cut from {args.rounds} to {round_} by the time budget", flush=True)
                break
        for mode in modes:
            flags = [] if mode == "none" else ["--cpu-sharing", mode]
            try:
                result = measure(
                    args.model, out / f"{mode}-{round_}", args.from_step, args.steps, args.timeout_s, flags + extra
                )
            except RuntimeError as error:
                print(f"[{mode}] round {round_}: {error} ({out / f'{mode}-{round_}' / 'rl.log'})", flush=True)
                status = 1
                continue
            results[mode].append(result)
            print_run(f"{mode}, round {round_}", result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        markdown(args, modes, results, started)
    for mode in modes:
        walls = [r["wall_per_step_s"] for r in results[mode]]
        idle = [r["idle"] for r in results[mode]]
        if walls:
            print(
                f"{mode}: wall per step {statistics.median(walls):.3f} s, idle {statistics.median(idle):.3f} "
                f"CPU-s/step (medians of {len(walls)})"
            )
    return status


if __name__ == "__main__":
    raise SystemExit(main())
