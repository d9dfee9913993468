#!/usr/bin/env python
"""``max_async_level`` 0 vs 1 vs 2 on the demo's task: steps/s and reward (`make bench` part f).

    .venv/bin/python bench/async_levels.py --sft runs/bench/sft/weights/step_1000 [--steps 12] [--repeats 2] \
        [--levels 0,1,2] [--markdown bench/sections/f.md] [--plots-dir bench/plots]

For each level, ``primerl rl @ examples/reverse_text_rl.toml --model.name SFT --max-async-level L --max-steps N``
(the demo's config otherwise). Levels run in rotation (0, 1, 2, 0, 1, 2, ...) so the repeats of each level see
the same spread of machine load. Per level:

- steps/s: steady state, (steps - 1) / (last step end - first step end), from the trainer's rows of
  ``metrics.jsonl`` (start-up excluded); min/median/max over repeats, and over step-to-step intervals;
- reward: mean of the orchestrator's ``train/reward`` over the last half of the steps (the training reward of the
  batches, not a held-out eval: the runs are short);
- trainer/inference KL: mean ``train/kl_divergence`` over the steps (0 at level 0 up to numerics: the batch was
  sampled by the very weights being trained).

A control row (``--control``, on by default): level 1 with a learning rate of 1e-12, so the trainer's weights
stay those that sampled the batch while everything else (the lag, the weight pushes, the version tags) runs as at
level 1. Its KL is the engine/trainer mismatch alone; the KL of the real level-1 runs minus it is how far one
optimizer step moved the policy.

Targets: none of its own in the issue; the table shows what asynchrony buys (level 1 and 2 over level 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from primerl_runs import ROOT, BenchRunError, RunTimeline, run_primerl  # noqa: E402
from report import Section, Stats, fmt, save_bars, save_curves  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", required=True, help="the SFT checkpoint (HF model directory) the runs start from")
    parser.add_argument("--levels", default="0,1,2", help="comma-separated max_async_level values")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 12; --quick 5)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per level (default 1)")
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plots-dir", type=Path, default=ROOT / "bench" / "plots")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="time budget: fewer repeats (never fewer than 1) when the next would run over",
    )
    parser.add_argument("--quick", action="store_true", help="5 steps x 1 repeat")
    parser.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add level 1 with lr 1e-12: the KL of engine/trainer mismatch alone (default: on)",
    )
    return parser


CONTROL = "1, lr 1e-12 (control)"
CONTROL_LR = 1e-12


def late_reward(run: RunTimeline) -> float | None:
    rewards = [r for r in run.step_rewards if r is not None]
    if not rewards:
        return None
    return statistics.fmean(rewards[len(rewards) // 2 :])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 12)
    args.repeats = args.repeats or (1 if args.quick else 2)
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--levels must be integers separated by commas, got {args.levels!r}") from None
    if not levels or any(level < 0 for level in levels):
        raise SystemExit(f"--levels must be >= 0, got {args.levels!r}")
    if args.steps < 3:
        raise SystemExit("--steps must be >= 3")
    section = Section("f. `max_async_level` 0 vs 1 vs 2: steps/s and reward")
    section.line(
        f"SFT checkpoint `{args.sft}`; `primerl rl @ examples/reverse_text_rl.toml --model.name SFT "
        f"--max-async-level L --max-steps {args.steps}`, {args.repeats} run(s) per level, levels in "
        "rotation. steps/s excludes start-up; reward = mean training reward (orchestrator `train/reward`) "
        "over the last half of the steps; KL = mean `train/kl_divergence` (k3, inference || trainer)."
    )
    section.line()
    started = time.time()
    variants = [(str(level), level, []) for level in levels]
    if args.control:
        variants.append((CONTROL, 1, ["--trainer.optim.lr", str(CONTROL_LR)]))
    runs: dict[str, list[RunTimeline]] = {label: [] for label, _, _ in variants}
    errors: dict[str, str] = {}
    status = 0
    for repeat in range(args.repeats):
        if repeat > 0 and args.budget_s is not None:
            per_repeat_s = (time.time() - started) / repeat
            if time.time() - started + per_repeat_s > args.budget_s:
                section.line(
                    f"_Repeats cut from {args.repeats} to {repeat} by the time budget ({args.budget_s:.0f} s)._"
                )
                section.line()
                break
        for label, level, overrides in variants:
            if label in errors or (label == CONTROL and repeat > 0):  # the control needs one run
                continue
            name = "control" if label == CONTROL else f"level{level}"
            try:
                run = run_primerl(
                    args.sft,
                    args.work_dir / "f" / f"{name}-{repeat}",
                    args.steps,
                    args.run_timeout_s,
                    overrides=["--max-async-level", str(level), *overrides],
                    what=f"primerl rl max_async_level={level} {' '.join(overrides)} (repeat {repeat})",
                )
            except BenchRunError as error:
                errors[label] = str(error)
                status = 1
                continue
            runs[label].append(run)
            print(f"[f] {label} repeat {repeat}: {fmt(run.steady_wall_per_step_s)} s/step", flush=True)

    rows = []
    steps_per_s: dict[str, Stats] = {}
    base = None
    for label, level, _ in variants:
        if label in errors:
            rows.append([label, f"not run: {errors[label].splitlines()[0]}", "—", "—", "—", "—", "—"])
            continue
        rate, interval, reward, kl, kl_max = Stats(), Stats(), Stats(), Stats(), Stats()
        for run in runs[label]:
            if run.steady_wall_per_step_s:
                rate.add(1.0 / run.steady_wall_per_step_s)
            for value in run.step_intervals_s:
                interval.add(value)
            value = late_reward(run)
            if value is not None:
                reward.add(value)
            kls = run.extra.get("kl_divergence") or []
            if kls:
                kl.add(statistics.fmean(kls))
                kl_max.add(max(kls))
        if label == variants[0][0] and rate.values:
            base = rate.median
        if label != CONTROL:
            steps_per_s[f"level {level}"] = rate
        rows.append(
            [
                label,
                rate.cell(),
                fmt(rate.median / base) if base and rate.values else "—",
                interval.cell(),
                reward.cell(),
                kl.cell(4),
                kl_max.cell(4),
            ]
        )
    section.table(
        [
            "max_async_level",
            "steps/s (per run)",
            f"vs level {levels[0]}",
            "step interval, s (all steps)",
            "late training reward",
            "mean KL(inf || trainer)",
            "largest step KL",
        ],
        rows,
    )
    if args.control:
        section.line(
            f"`{CONTROL}`: max_async_level 1 with `--trainer.optim.lr {CONTROL_LR}` (weights do not move): its "
            "KL is what engine and trainer disagree on by themselves; above it, the KL of a level-1 run is "
            "the policy moving one optimizer step between sampling and training."
        )
        section.line()
    for label, error in errors.items():
        section.line(f"**not run: {label}: {error}**".replace("\n", "  \n"))
    if any(runs.values()):
        rel = args.markdown.parent if args.markdown else ROOT / "bench"
        section.image(
            save_bars(
                args.plots_dir / "f_steps_per_s.png",
                "f. steps/s by max_async_level",
                "steps/s",
                {k: v for k, v in steps_per_s.items() if v.values},
            ),
            rel,
            "f. steps/s",
        )
        curves = {}
        for level in levels:
            if runs[str(level)]:
                run = runs[str(level)][0]
                rewards = [r for r in run.step_rewards if r is not None]
                curves[f"max_async_level {level}"] = (list(range(len(rewards))), rewards)
        section.image(
            save_curves(
                args.plots_dir / "f_reward.png",
                "f. training reward per step (first repeat)",
                "step",
                "mean training reward",
                curves,
            ),
            rel,
            "f. reward per step",
        )
    section.line(f"Part took {time.time() - started:.0f} s.")
    if args.markdown:
        section.write(args.markdown)
    else:
        print(section.text())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({str(k): [r.as_dict() for r in v] for k, v in runs.items()}, indent=1))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
