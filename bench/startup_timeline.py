"""Start-up timeline of ``primerl rl``: from the launch of the command to the end of step 1, when each milestone
happened, over N runs (median and range), optionally for two start orders interleaved (A/B in one session).

    python bench/startup_timeline.py                      # 3 runs, the default order (preflight beside the roles)
    python bench/startup_timeline.py --runs 4 --compare   # A/B: --preflight-first (the old order) and the default
    python bench/startup_timeline.py --trl                # also TRL's launch to end of step 1 (bench/rl_vs_trl.py a)
    python bench/startup_timeline.py --orders parallel,no-preflight   # what the preflight costs the start

Each run is ``primerl rl @ examples/reverse_text_rl.toml --max-steps 3`` from the SFT checkpoint (else the tiny
model), as a user starts it (``bench/primerl_runs.run_primerl``). The milestones come from the timestamps the
run writes: the first line of each role's log (``logs/<role>.log``: the process is up and has its thread
budget), the preflight's end (``logs/preflight.log``), the broker's and inference's ready files (their mtime),
the lines ``starting vLLM`` (vLLM's import is done), ``model loaded`` (trainer), ``environment loaded`` and
``inference worker serving`` (orchestrator), and ``metrics.jsonl`` (first scored rollouts, end of step 1). A
milestone a run did not log is shown as ``-``. Say ``cat /proc/loadavg`` beside the figures: the machine is
shared.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import primerl_runs  # noqa: E402 - the bench directory's shared runner

ROOT = primerl_runs.ROOT
SFT_MODEL = ROOT / "runs" / "demo" / "sft" / "weights" / "step_1000"
TINY_MODEL = ROOT / "runs" / "demo" / "tiny-model"
ORDERS = {"parallel": [], "preflight-first": ["--preflight-first"], "no-preflight": ["--no-preflight"]}

LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z \[\s*\w+\s*\] (.+?)(?:\s{2,}\[|\s*$)")
PREFLIGHT_LINE = re.compile(r"^(\S+|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) primerl rl preflight: ([\d.]+) s")

# (label, log file, event) in the order they usually happen; the first line of the event in that log
LOG_MILESTONES = [
    ("broker process up", "broker.log", None),
    ("inference process up", "inference.log", None),
    ("trainer process up", "trainer.log", None),
    ("orchestrator process up", "orchestrator.log", None),
    ("vLLM imported (starting vLLM)", "inference.log", "starting vLLM"),
    ("trainer has its model", "trainer.log", "model loaded"),
    ("env workers ready (environment loaded)", "orchestrator.log", "environment loaded"),
    ("orchestrator sees inference serving", "orchestrator.log", "inference worker serving"),
]


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp).replace(tzinfo=timezone.utc).timestamp()


def first_event(log_path: Path, event: str | None) -> float | None:
    """Unix time of the first structured line of ``log_path`` (with ``event``: the first line of that event)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        match = LINE.match(line)
        if match and (event is None or match.group(2).strip() == event):
            return _unix(match.group(1))
    return None


def preflight_end(log_path: Path) -> float | None:
    """The end of the last preflight in ``logs/preflight.log`` (its summary line's stamp)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    end = None
    for line in lines:
        match = PREFLIGHT_LINE.match(line)
        if match:
            stamp = match.group(1)
            if "T" in stamp:
                end = _unix(stamp.rstrip("Z"))
            else:  # before issue 31: local time, whole seconds
                end = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    return end


def milestones(run_dir: Path, timeline: primerl_runs.RunTimeline) -> dict[str, float | None]:
    """Offsets (s) from the launch of ``primerl rl`` to each milestone of one run."""
    logs = run_dir / "logs"

    def offset(when: float | None) -> float | None:
        return None if when is None else when - timeline.launch

    def mtime(path: Path) -> float | None:
        return path.stat().st_mtime if path.exists() else None

    out: dict[str, float | None] = {"preflight done": offset(preflight_end(logs / "preflight.log"))}
    out["broker ready (ready file)"] = offset(mtime(run_dir / "broker.ready.json"))
    for label, log_name, event in LOG_MILESTONES:
        out[label] = offset(first_event(logs / log_name, event))
    out["inference serving (ready file)"] = offset(mtime(run_dir / "inference.ready.json"))
    out["first scored rollouts (metrics.jsonl)"] = timeline.startup_to_rollouts_s
    out["end of step 1 (metrics.jsonl)"] = timeline.startup_to_first_step_s
    return out


def run_once(
    model: Path, work: Path, order: str, index: int, timeout_s: float, before: Path | None = None
) -> dict[str, float | None]:
    """One run; ``order`` "before": the code of ``--before REV`` (a clone whose package directory is ``before``,
    put first on PYTHONPATH, so the venv's entry points import it), else this tree with ``ORDERS[order]``."""
    run_dir = work / f"{order}-{index}"
    if order != "before":
        timeline = primerl_runs.run_primerl(
            str(model), run_dir, max_steps=3, timeout_s=timeout_s, overrides=ORDERS[order], what=f"primerl rl ({order})"
        )
        return milestones(run_dir, timeline)
    assert before is not None
    cmd = [
        str(primerl_runs.PRIMERL),
        "rl",
        "@",
        str(primerl_runs.RL_CONFIG),
        "--model.name",
        str(model),
        "--output-dir",
        str(run_dir),
        "--max-steps",
        "3",
        "--broker.grpc-port",
        str(primerl_runs.free_port()),
    ]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    extra_env = {"PYTHONPATH": str(before.parent)}
    launch = primerl_runs.run_child(cmd, log_path, timeout_s, "primerl rl (before)", extra_env=extra_env)
    return milestones(run_dir, primerl_runs.read_primerl_timeline(run_dir, launch, time.time()))


def clone_before(rev: str, work: Path) -> Path:
    """This repository at ``rev`` in ``work/before/primerl`` (the package's name, for PYTHONPATH)."""
    import subprocess

    target = work / "before" / "primerl"
    if not target.exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(target)], check=True)
    subprocess.run(["git", "-C", str(target), "checkout", "-q", rev], check=True)
    return target


def summarize(runs: list[dict[str, float | None]]) -> dict[str, tuple[float, float, float] | None]:
    out = {}
    for key in runs[0]:
        values = [run[key] for run in runs if run.get(key) is not None]
        out[key] = (statistics.median(values), min(values), max(values)) if values else None
    return out


def fmt(stats: tuple[float, float, float] | None) -> str:
    if stats is None:
        return "-"
    median, low, high = stats
    return f"{median:6.1f} ({low:.1f}-{high:.1f})"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per order (default %(default)d)")
    parser.add_argument("--compare", action="store_true", help="also the old order (--preflight-first), interleaved")
    parser.add_argument(
        "--orders",
        default=None,
        help=f"comma-separated start orders to run, interleaved (of {', '.join(ORDERS)}; default: parallel)",
    )
    parser.add_argument("--model", type=Path, default=None, help="model (default: the SFT checkpoint, else tiny)")
    parser.add_argument(
        "--before",
        metavar="REV",
        default=None,
        help="also the code at git REV (a clone, imported through PYTHONPATH), interleaved",
    )
    parser.add_argument("--trl", action="store_true", help="also TRL GRPOTrainer's launch to end of step 1")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per run (default %(default)g)")
    parser.add_argument("--json", type=Path, default=None, help="write the raw offsets here")
    args = parser.parse_args(argv)
    model = args.model or (SFT_MODEL if SFT_MODEL.exists() else TINY_MODEL)
    if not model.exists():
        print(f"no model at {model}: run `make run` (SFT) or `primerl init-tiny-model {TINY_MODEL}`", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="startup-timeline-"))
    orders = ["preflight-first", "parallel"] if args.compare else ["parallel"]
    if args.orders:
        orders = [order.strip() for order in args.orders.split(",") if order.strip()]
        unknown = [order for order in orders if order not in ORDERS]
        if unknown:
            print(f"unknown order(s) {', '.join(unknown)}: choose from {', '.join(ORDERS)}", file=sys.stderr)
            return 2
    before = None
    if args.before:
        before = clone_before(args.before, work)
        orders.insert(0, "before")
    results: dict[str, list[dict[str, float | None]]] = {order: [] for order in orders}
    trl: list[float] = []
    loads = [loadavg()]
    for index in range(args.runs):
        for order in orders if index % 2 == 0 else orders[::-1]:  # ABBA: drifting load hits both alike
            started = time.monotonic()
            results[order].append(run_once(model, work, order, index, args.timeout_s, before))
            step1 = results[order][-1]["end of step 1 (metrics.jsonl)"]
            print(
                f"run {index} {order}: end of step 1 at {step1 or float('nan'):.1f} s "
                f"(run {time.monotonic() - started:.0f} s)",
                flush=True,
            )
        if args.trl:
            prompts = primerl_runs.write_prompts(work / "trl-prompts.jsonl", 64 * 3, work)
            timeline = primerl_runs.run_trl(str(model), prompts, work / f"trl-{index}", 3, args.timeout_s, save=False)
            trl.append(timeline.startup_to_first_step_s)
            print(f"run {index} TRL: end of step 1 at {trl[-1]:.1f} s", flush=True)
        loads.append(loadavg())
    print(
        f"\nprimerl rl start-up timeline, {model}, --max-steps 3; seconds from launch, median (min-max) "
        f"over {args.runs} runs; load averages seen: {', '.join(loads)}"
    )
    summaries = {order: summarize(runs) for order, runs in results.items()}
    header = f"{'milestone':42s}" + "".join(f"{order:>22s}" for order in orders)
    print(header)
    for key in summaries[orders[0]]:
        print(f"{key:42s}" + "".join(f"{fmt(summaries[order][key]):>22s}" for order in orders))
    end_key = "end of step 1 (metrics.jsonl)"
    for base in ("preflight-first", "before"):
        if base not in results:
            continue
        pairs = [
            (a[end_key], b[end_key])
            for a, b in zip(results[base], results["parallel"])
            if a[end_key] is not None and b[end_key] is not None
        ]
        if pairs:
            ratios = [b / a for a, b in pairs]
            print(
                f"end of step 1, parallel / {base}, paired: median {statistics.median(ratios):.2f} "
                f"(range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)"
            )
    if trl:
        print(
            f"TRL GRPOTrainer launch to end of step 1: median {statistics.median(trl):.1f} s "
            f"({min(trl):.1f}-{max(trl):.1f})"
        )
        for order in orders:
            if summaries[order][end_key] is not None:
                print(f"  primerl ({order}) / TRL: {summaries[order][end_key][0] / statistics.median(trl):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"loads": loads, "runs": results, "trl": trl}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
