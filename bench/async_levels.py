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

``--cpu-sharing shared,split`` runs every level once per mode of the run's ``cpu_sharing`` (how trainer and vLLM
share the cores, primerl.runtime.cpu_budget), in rotation too; the control runs with the first mode only.
``--model-100m`` starts from the ~100M random model of part g (built under ``--work-dir``/g like part g does)
instead of the SFT checkpoint: steps/s at a compute-bound size (its reward means nothing: random weights).

Target (issue 31): level 1 / level 0 steps/s >= 1.3 on the 100M model, per mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_info import cpu_phrase  # noqa: E402
from primerl_runs import PRIMERL, ROOT, BenchRunError, RunTimeline, run_child, run_primerl  # noqa: E402
from report import Section, Stats, fmt, save_bars, save_curves, target_line  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", default=None, help="the SFT checkpoint (HF model directory) the runs start from")
    parser.add_argument(
        "--model-100m",
        action="store_true",
        help="start from part g's ~100M random model instead of --sft (built under --work-dir/g if missing)",
    )
    parser.add_argument(
        "--cpu-sharing",
        default="shared",
        help="primerl's `cpu_sharing` modes, comma-separated: each level runs once per mode (default: shared)",
    )
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
MODEL_100M_ARGS = ["--hidden", "768", "--layers", "12", "--heads", "12", "--kv-heads", "4", "--intermediate", "3072"]
LEVEL1_TARGET = 1.3


def model_100m(work_dir: Path) -> str:
    """Part g's ~100M random model (the same command and directory as bench/rl_vs_trl.py --part g)."""
    model_dir = work_dir / "g" / "model-100m"
    if not (model_dir / "config.json").is_file():
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        run_child(
            [str(PRIMERL), "init-tiny-model", str(model_dir), *MODEL_100M_ARGS],
            model_dir.parent / "init-model.log",
            600,
            "primerl init-tiny-model (100M)",
        )
    return str(model_dir)


def late_reward(run: RunTimeline) -> float | None:
    rewards = [r for r in run.step_rewards if r is not None]
    if not rewards:
        return None
    return statistics.fmean(rewards[len(rewards) // 2 :])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_100m:
        args.steps = args.steps or (3 if args.quick else 5)
        args.repeats = args.repeats or 1
    else:
        args.steps = args.steps or (5 if args.quick else 12)
        args.repeats = args.repeats or (1 if args.quick else 2)
    modes = [m.strip() for m in args.cpu_sharing.split(",") if m.strip()]
    if not modes or any(m not in ("shared", "split") for m in modes) or len(set(modes)) != len(modes):
        raise SystemExit(f"--cpu-sharing {args.cpu_sharing!r}: list shared and/or split, comma-separated")
    if not args.model_100m and not args.sft:
        raise SystemExit("give --sft DIR (the demo's SFT checkpoint) or --model-100m")
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--levels must be integers separated by commas, got {args.levels!r}") from None
    if not levels or any(level < 0 for level in levels):
        raise SystemExit(f"--levels must be >= 0, got {args.levels!r}")
    if args.steps < 3:
        raise SystemExit("--steps must be >= 3")
    started = time.time()
    try:
        model = model_100m(args.work_dir) if args.model_100m else args.sft
    except BenchRunError as error:
        raise SystemExit(str(error)) from None
    what = "the ~100M random model of part g" if args.model_100m else "SFT checkpoint"
    section = Section(
        f"f. `max_async_level` {' vs '.join(map(str, levels))}: steps/s and reward"
        + (" (~100M model)" if args.model_100m else "")
    )
    section.line(
        f"CPU: {cpu_phrase()}. {what} `{model}`; `primerl rl @ examples/reverse_text_rl.toml --model.name MODEL "
        f"--max-async-level L --cpu-sharing MODE --max-steps {args.steps}`, {args.repeats} run(s) per level and "
        f"mode (`cpu_sharing`: {', '.join(modes)}), in rotation. steps/s excludes start-up; reward = mean "
        "training reward (orchestrator `train/reward`) over the last half of the steps; KL = mean "
        "`train/kl_divergence` (k3, inference || trainer)."
    )
    section.line()
    multi = len(modes) > 1
    # A random model's groups mostly have equal rewards: count them toward the batch (as part g does), so that a
    # step generates one batch, not ~4 until 64 rollouts carry signal.
    model_flags = ["--orchestrator.constant-trainer-batch-size", "false"] if args.model_100m else []
    if model_flags:
        section.line(f"100M runs with `{' '.join(model_flags)}` (as part g): one batch generated per step.")
        section.line()
    variants = [
        (f"{level}, {mode}" if multi else str(level), level, ["--cpu-sharing", mode, *model_flags])
        for mode in modes
        for level in levels
    ]
    variants.sort(key=lambda v: v[1])  # rotation: level 0 in each mode, then level 1, ...
    if args.control:
        variants.append((CONTROL, 1, ["--cpu-sharing", modes[0], *model_flags, "--trainer.optim.lr", str(CONTROL_LR)]))
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
            name = "control" if label == CONTROL else f"level{level}-{overrides[1]}"
            try:
                run = run_primerl(
                    model,
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
    bases: dict[str, float] = {}  # mode -> median steps/s of its first level
    for label, level, overrides in variants:
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
        mode = overrides[1]
        if level == levels[0] and label != CONTROL and rate.values:
            base = bases.setdefault(mode, rate.median)
        else:
            base = bases.get(mode)
        if label != CONTROL:
            steps_per_s[f"level {level}, {mode}" if multi else f"level {level}"] = rate
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
            "max_async_level" + (", cpu_sharing" if multi else ""),
            "steps/s (per run)",
            f"vs level {levels[0]}" + (" (same mode)" if multi else ""),
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
    if 0 in levels and 1 in levels:
        section.line("**Targets**")
        section.line()
        for mode in modes:
            suffix = f", {mode}" if multi else ""
            zero, one = steps_per_s.get(f"level 0{suffix}"), steps_per_s.get(f"level 1{suffix}")
            value = one.median / zero.median if zero and one and zero.values and one.values else None
            note = "" if args.model_100m else "(the target is for the ~100M model: `--model-100m`)"
            section.line(target_line(f"f: level 1 / level 0 steps/s ({mode})", value, ">=", LEVEL1_TARGET, note))
            section.line()
    if any(runs.values()):
        plot_suffix = "_100m" if args.model_100m else ""
        rel = args.markdown.parent if args.markdown else ROOT / "bench"
        section.image(
            save_bars(
                args.plots_dir / f"f_steps_per_s{plot_suffix}.png",
                "f. steps/s by max_async_level",
                "steps/s",
                {k: v for k, v in steps_per_s.items() if v.values},
            ),
            rel,
            "f. steps/s",
        )
        curves = {}
        for label, level, _ in variants:
            if label != CONTROL and runs[label]:
                rewards = [r for r in runs[label][0].step_rewards if r is not None]
                curves[f"max_async_level {label}"] = (list(range(len(rewards))), rewards)
        section.image(
            save_curves(
                args.plots_dir / f"f_reward{plot_suffix}.png",
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
