#!/usr/bin/env python
"""Batch semantics on the demo's task (`make bench` part i): environment shares at ``max_async_level = 1``,
constant vs variable batch size, and the waste of generated tokens.

    .venv/bin/python bench/batch_semantics.py --sft runs/bench/sft/weights/step_1000 [--mixed-steps 30] \
        [--steps 12] [--markdown bench/sections/i.md] [--quick]

Runs, one after another, as a user starts them (``primerl rl``, a free broker port each):

1. mixed: ``primerl rl @ examples/reverse_text_mixed_rl.toml --model.name SFT --max-async-level 1`` (classic +
   v1 environments, weights 1:1): each environment's share of the trained rollouts (the sum of
   ``env/<id>/num_rollouts`` over the steps), the groups cancelled as stale (``rollout/stale_groups_cancelled``),
   and the discarded share of the generated tokens (``rollout/tokens_discarded`` over ``rollout/tokens_generated``,
   by reason). Target: each share 0.5 +- 0.05, no cancellation storm.
2. constant vs variable: ``primerl rl @ examples/reverse_text_rl.toml --model.name SFT --max-async-level 1`` with
   ``--orchestrator.constant-trainer-batch-size true`` and then ``false``, side by side: steady seconds per step
   (trainer rows, start-up excluded), rollouts with signal per step (``batch_size`` less
   ``batch/zero_advantage_rollouts``), and the waste. prime-rl measured +35% step time for constant mode.
   Target: discarded / generated tokens <= 5% at ``max_async_level = 1``.

One run per configuration (the spread shown is over the steps of that run, not over repeats): the figures are a
measurement on a loaded 2-core machine, the load is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from primerl_runs import PRIMERL, ROOT, BenchRunError, free_port, read_primerl_timeline, run_child  # noqa: E402
from report import Section, fmt, machine_load, target_line  # noqa: E402

MIXED_CONFIG = ROOT / "examples" / "reverse_text_mixed_rl.toml"
SINGLE_CONFIG = ROOT / "examples" / "reverse_text_rl.toml"
REASONS = ("stale", "filtered", "failed", "cancelled", "surplus")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", required=True, help="the SFT checkpoint (HF model directory) the runs start from")
    parser.add_argument("--mixed-steps", type=int, default=None, help="steps of the mixed run (default 30; quick 8)")
    parser.add_argument("--steps", type=int, default=None, help="steps of each constant/variable run (12; quick 5)")
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plots-dir", type=Path, default=None, help="accepted for run_all.py; this part draws none")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget: no new run once it is spent")
    parser.add_argument("--quick", action="store_true", help="8 mixed steps, 5 steps per constant/variable run")
    parser.add_argument(
        "--pairs", type=int, default=1, help="constant/variable pairs, each pair's order the other way round (1)"
    )
    parser.add_argument("--skip-mixed", action="store_true", help="only the constant/variable comparison")
    return parser


def orchestrator_rows(run_dir: Path) -> list[dict]:
    from primerl.runtime.run_metrics import read_metrics_file

    rows = read_metrics_file(run_dir / "metrics.jsonl", skip_bad_lines=True).rows
    return [r for r in rows if r.get("role") == "orchestrator" and "train/reward" in r]


def run(config: Path, model: str, out_dir: Path, steps: int, timeout_s: float, overrides: list[str], what: str):
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    cmd = [
        str(PRIMERL),
        "rl",
        "@",
        str(config),
        "--model.name",
        model,
        "--output-dir",
        str(out_dir),
        "--max-steps",
        str(steps),
        "--broker.grpc-port",
        str(free_port()),
        "--max-async-level",
        "1",
        "--no-preflight",  # the demo's environments are known; under load the v1 listing can outlast its 60 s
        *overrides,
    ]
    launch = run_child(cmd, out_dir.parent / f"{out_dir.name}.log", timeout_s, what)
    timeline = read_primerl_timeline(out_dir, launch, time.time())
    return timeline, orchestrator_rows(out_dir)


def waste(rows: list[dict]) -> dict[str, float]:
    generated = sum(r.get("rollout/tokens_generated", 0.0) for r in rows)
    discarded = sum(r.get("rollout/tokens_discarded", 0.0) for r in rows)
    result = {
        "generated": generated,
        "trained": sum(r.get("rollout/tokens_trained", 0.0) for r in rows),
        "discarded": discarded,
        "fraction": discarded / generated if generated else float("nan"),
        "stale_groups_cancelled": sum(r.get("rollout/stale_groups_cancelled", 0.0) for r in rows),
    }
    for reason in REASONS:
        result[reason] = sum(r.get(f"rollout/tokens_discarded/{reason}", 0.0) for r in rows)
    return result


def waste_cell(w: dict[str, float]) -> str:
    reasons = ", ".join(f"{reason} {int(w[reason])}" for reason in REASONS if w[reason]) or "none"
    return f"{fmt(100 * w['fraction'], 3)}% ({int(w['discarded'])} of {int(w['generated'])}; {reasons})"


def steady_s_per_step(timeline) -> tuple[float, float, float]:
    ends = timeline.step_ends
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    if not gaps:
        return float("nan"), float("nan"), float("nan")
    return (ends[-1] - ends[0]) / len(gaps), min(gaps), max(gaps)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mixed_steps = args.mixed_steps or (8 if args.quick else 30)
    steps = args.steps or (5 if args.quick else 12)
    if mixed_steps < 2 or steps < 3:
        raise SystemExit("--mixed-steps must be >= 2 and --steps >= 3")
    work = args.work_dir / "i"
    section = Section("i. Batch semantics: environment shares, constant vs variable batch size, waste")
    section.line(
        f"SFT checkpoint `{args.sft}`, `--max-async-level 1` everywhere; one run per configuration "
        f"(mixed: {mixed_steps} steps of `examples/reverse_text_mixed_rl.toml`; constant/variable: {steps} steps "
        "each of `examples/reverse_text_rl.toml`, one after the other). Spreads are over the steps of a run."
    )
    section.line()
    results: dict = {"load_start": machine_load()}
    started = time.time()
    status = 0

    print(f"[i] mixed run, {mixed_steps} steps ({machine_load()})", flush=True)
    try:
        if args.skip_mixed:
            raise BenchRunError("skipped (--skip-mixed)")
        _, rows = run(
            MIXED_CONFIG, args.sft, work / "mixed", mixed_steps, args.run_timeout_s, [], "mixed run (async 1)"
        )
        env_ids = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("env/") and "num_rollouts" in k})
        per_env = {e: sum(r.get(f"env/{e}/num_rollouts", 0.0) for r in rows) for e in env_ids}
        total = sum(per_env.values())
        shares = {e: n / total for e, n in per_env.items()} if total else {}
        per_step = {
            e: [r.get(f"env/{e}/num_rollouts", 0.0) / max(1.0, r.get("buffer/num_rollouts", 1.0)) for r in rows]
            for e in env_ids
        }
        w = waste(rows)
        results["mixed"] = {"shares": shares, "rollouts": per_env, "waste": w, "steps": len(rows)}
        section.table(
            ["environment", "trained rollouts", "share", "per-step share (min–max)"],
            [
                [e, int(per_env[e]), fmt(shares[e], 3), f"{fmt(min(per_step[e]), 3)}–{fmt(max(per_step[e]), 3)}"]
                for e in env_ids
            ],
        )
        for e in env_ids:
            verdict = "met" if abs(shares[e] - 0.5) <= 0.05 else "missed"
            section.line(f"- **{verdict}** share of `{e}`: {fmt(shares[e])} (target 0.5 ± 0.05)  ")
        section.line(
            f"Groups cancelled as stale: {int(w['stale_groups_cancelled'])} over {len(rows)} steps. "
            f"Discarded tokens: {waste_cell(w)}."
        )
        section.line()
    except BenchRunError as error:
        section.line(f"mixed run: not run: {str(error).splitlines()[0]}")
        section.line()
        status = status if args.skip_mixed else 1

    modes = {}
    runs: dict[str, list[dict]] = {"constant": [], "variable": []}
    order = [("constant", "true"), ("variable", "false")]
    for pair in range(max(1, args.pairs)):
        for label, value in order if pair % 2 == 0 else order[::-1]:
            if args.budget_s is not None and time.time() - started > args.budget_s:
                section.line(f"{label}: not run: the time budget ({args.budget_s:.0f} s) is spent")
                status = 1
                continue
            print(f"[i] {label} batch size, {steps} steps, pair {pair + 1} ({machine_load()})", flush=True)
            try:
                timeline, rows = run(
                    SINGLE_CONFIG,
                    args.sft,
                    work / label,
                    steps,
                    args.run_timeout_s,
                    ["--orchestrator.constant-trainer-batch-size", value],
                    f"{label} batch size",
                )
            except BenchRunError as error:
                section.line(f"{label}: not run: {str(error).splitlines()[0]}")
                status = 1
                continue
            batch = [r.get("buffer/num_rollouts", 0.0) for r in rows]
            signal = [b - r.get("batch/zero_advantage_rollouts", 0.0) for b, r in zip(batch, rows)]
            modes[label] = {
                "s_per_step": steady_s_per_step(timeline),
                "signal": signal,
                "batch": batch,
                "waste": waste(rows),
                "reward": statistics.fmean(r["train/reward"] for r in rows[len(rows) // 2 :]) if rows else float("nan"),
                "pair": pair + 1,
                "load": machine_load(),
            }
            runs[label].append(modes[label])
    if modes:
        section.table(
            [
                "batch size",
                "s/step (min–max)",
                "rollouts with signal / step (min–max)",
                "reward (last half)",
                "discarded tokens",
            ],
            [
                [
                    f"{label} (pair {m['pair']}, {m['load']})" if len(mode_runs) > 1 else label,
                    f"{fmt(m['s_per_step'][0])} ({fmt(m['s_per_step'][1])}–{fmt(m['s_per_step'][2])})",
                    f"{fmt(statistics.fmean(m['signal']), 4)} ({fmt(min(m['signal']), 4)}–{fmt(max(m['signal']), 4)})",
                    fmt(m["reward"]),
                    waste_cell(m["waste"]),
                ]
                for label, mode_runs in runs.items()
                for m in mode_runs
            ],
        )
    if "constant" in modes and "variable" in modes:
        paired = [
            c["s_per_step"][0] / v["s_per_step"][0]
            for c, v in zip(runs["constant"], runs["variable"], strict=False)
            if c["pair"] == v["pair"]
        ]
        ratio = statistics.median(paired)
        section.line(
            f"Constant / variable seconds per step: {fmt(ratio)} (median of {len(paired)} pair(s): "
            f"{', '.join(fmt(r) for r in paired)}; prime-rl measured 1.35).  "
        )
        section.line(
            target_line(
                "discarded / generated tokens, constant mode", modes["constant"]["waste"]["fraction"], "<=", 0.05
            )
        )
        # what of the waste is the scheduler's, and what constant mode discards by definition: the groups without
        # signal, which variable mode trains instead (with zero advantages)
        constant_waste, variable = modes["constant"]["waste"], modes["variable"]
        scheduler_tokens = sum(constant_waste[reason] for reason in REASONS if reason != "filtered")
        silent = 1 - sum(variable["signal"]) / sum(variable["batch"]) if sum(variable["batch"]) else float("nan")
        section.line(
            f"Of the constant mode's generated tokens, {fmt(100 * scheduler_tokens / constant_waste['generated'], 3)}% "
            f"were discarded by the scheduler (stale, cancelled, surplus, failed) and "
            f"{fmt(100 * constant_waste['filtered'] / constant_waste['generated'], 3)}% as groups without signal "
            f"(filtered), which constant mode drops by definition; variable mode trained {fmt(100 * silent, 3)}% of "
            "its rollouts without signal instead.  "
        )
        results["constant_over_variable_s_per_step"] = ratio
    results["modes"] = runs
    results["load_end"] = machine_load()
    section.line()
    print("\n".join(section.lines), flush=True)
    if args.markdown:
        section.write(args.markdown)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
