#!/usr/bin/env python
"""``primerl rl`` against TRL 1.16 ``GRPOTrainer`` on the demo's task, side by side (`make bench` parts a and g).

    .venv/bin/python bench/rl_vs_trl.py --part a --sft runs/bench/sft/weights/step_1000 \
        [--steps 30] [--repeats 3] [--markdown bench/sections/a.md] [--plots-dir bench/plots]
    .venv/bin/python bench/rl_vs_trl.py --part g [--steps 4] [--repeats 1]

Part a, from the demo's SFT checkpoint, with the demo's config (examples/reverse_text_rl.toml: 8 prompts x 8
rollouts, 24 new tokens, temperature 1, lr 5e-4 constant, no KL, max_async_level 1) on the primerl side and the
matched ``GRPOConfig`` of bench/trl_grpo.py on the TRL side (same prompts in the same order, the same reward,
advantages without std scaling, token-mean loss over the step, AdamW with the same hyper-parameters). The two
runs alternate (primerl, TRL, primerl, TRL, ...), so each pair sees about the same machine load. Reported:

- wall per step: steady state, (last step end - first step end) / (steps - 1), per run; min/median/max over runs,
  and the step-to-step intervals of all runs;
- start-up: launch of the command to the first scored batch of rollouts (primerl: the orchestrator's first
  ``metrics.jsonl`` row; TRL: the first call of the reward function), and launch to the end of the first step;
- samples/s: 64 / steady wall per step;
- held-out reward (``primerl eval reverse-text -m DIR -n 200 -r 1 -t 24 -T 1.0``, the demo's eval) of the SFT
  model, of both models after ``--steps`` steps (first repeat), and of TRL after the same wall time as that
  primerl run (launch to its last step); the eval's noise is the standard error of its 200 rewards, and
  "not worse beyond noise" means primerl >= TRL - 2 * sqrt(se_primerl^2 + se_trl^2).

Part g: a ~100M-parameter model of the same family (``primerl init-tiny-model DIR --hidden 768 --layers 12
--heads 12 --kv-heads 4 --intermediate 3072``, random weights, built once under ``--work-dir``), the same two
trainers and settings for ``--steps`` steps: samples/s (steady state) and start-up. No evals. primerl runs once per
``--cpu-sharing`` mode (default ``shared,split``: the run's ``cpu_sharing``, see primerl.runtime.cpu_budget) in each
repeat, then TRL; each mode's ratio to TRL is its own table.

Targets (printed met / missed): a: primerl/TRL wall per step <= 3.0 (aim 2.0), start-up ratio <= 3, held-out
reward after the steps not worse than TRL's beyond the eval noise; g: primerl/TRL samples/s >= 1.1 (the default
``cpu_sharing``; issue 31).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_info import cpu_phrase  # noqa: E402
from primerl_runs import (  # noqa: E402
    BENCH_PYTHON,
    PRIMERL,
    ROOT,
    BenchRunError,
    RunTimeline,
    python_version_of,
    run_child,
    run_eval,
    run_primerl,
    run_trl,
    write_prompts,
)
from report import Section, Stats, fmt, save_bars, save_curves, target_line  # noqa: E402

SAMPLES_PER_STEP = 64
EVAL_ESTIMATE_S = 60.0  # one held-out eval (vLLM start-up and 200 rollouts), two run at once
MODEL_100M_ARGS = ["--hidden", "768", "--layers", "12", "--heads", "12", "--kv-heads", "4", "--intermediate", "3072"]
G_PRIMERL_OVERRIDES = ["--orchestrator.constant-trainer-batch-size", "false"]
"""Part g, primerl: zero-advantage groups count toward the batch as in TRL (a random model's groups mostly have
equal rewards: with prime-rl's default primerl would generate until 64 rollouts with signal, ~4x TRL's work)."""
TRL_SETTINGS = (
    "per_device_train_batch_size=64, num_generations=8, gradient_accumulation_steps=1, "
    "max_completion_length=24, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False, beta=0.0, "
    "scale_rewards='none', loss_type='dapo', num_iterations=1, learning_rate=5e-4, "
    "lr_scheduler_type='constant', warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, "
    "adam_epsilon=1e-8, max_grad_norm=1.0, shuffle_dataset=False, use_cpu=True, fp32"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("a", "g"), default="a")
    parser.add_argument("--sft", default=None, help="part a: the SFT checkpoint (a HF model directory)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: a 30, g 4)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each trainer (default: a 3, g 1)")
    parser.add_argument("--eval-examples", type=int, default=200, help="held-out examples per eval (default 200)")
    parser.add_argument("--no-eval", action="store_true", help="part a without the held-out evals")
    parser.add_argument("--no-equal-wall", action="store_true", help="part a without the equal-wall-time TRL run")
    parser.add_argument("--run-timeout-s", type=float, default=900.0, help="time limit of one training run")
    parser.add_argument("--eval-timeout-s", type=float, default=300.0)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--markdown", type=Path, default=None, help="write this part's RESULTS.md section here")
    parser.add_argument("--json", type=Path, default=None, help="write the raw timelines here")
    parser.add_argument("--plots-dir", type=Path, default=ROOT / "bench" / "plots")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="time budget of the part: fewer repeats (never fewer than 1) when it would run over",
    )
    parser.add_argument("--quick", action="store_true", help="a: 5 steps x 1 repeat, evals on 50 examples; g: 2 steps")
    parser.add_argument(
        "--cpu-sharing",
        default="shared,split",
        help="part g: primerl's `cpu_sharing` modes to run, comma-separated, each in every repeat (default "
        "shared,split: the default and the earlier split side by side)",
    )
    return parser


def interval_stats(runs: list[RunTimeline]) -> Stats:
    stats = Stats()
    for run in runs:
        for value in run.step_intervals_s:
            stats.add(value)
    return stats


def per_run(runs: list[RunTimeline], attr: str) -> Stats:
    stats = Stats()
    for run in runs:
        value = getattr(run, attr)
        if value is not None:
            stats.add(value)
    return stats


def samples_stats(runs: list[RunTimeline]) -> Stats:
    stats = Stats()
    for run in runs:
        value = run.samples_per_s(SAMPLES_PER_STEP)
        if value is not None:
            stats.add(value)
    return stats


def ratio(numerator: Stats, denominator: Stats) -> float | None:
    if not numerator.values or not denominator.values or denominator.median == 0:
        return None
    return numerator.median / denominator.median


def paired_ratios(primerl: list[RunTimeline], trl: list[RunTimeline], attr: str) -> Stats:
    """primerl/TRL of one quantity for each (primerl run i, TRL run i) pair, measured back to back."""
    stats = Stats()
    for a, b in zip(primerl, trl):
        x, y = getattr(a, attr), getattr(b, attr)
        if x is not None and y:
            stats.add(x / y)
    return stats


def timing_rows(primerl: list[RunTimeline], trl: list[RunTimeline]) -> list[list[str]]:
    rows = []
    for label, attr in (
        ("wall per step, s (steady state, per run)", "steady_wall_per_step_s"),
        ("start-up: launch to first scored rollouts, s", "startup_to_rollouts_s"),
        ("start-up: launch to end of first step, s", "startup_to_first_step_s"),
    ):
        a, b = per_run(primerl, attr), per_run(trl, attr)
        rows.append([label, a.cell(), b.cell(), fmt(ratio(a, b)), paired_ratios(primerl, trl, attr).cell()])
    a, b = interval_stats(primerl), interval_stats(trl)
    rows.append(["step-to-step interval, s (all steps of all runs)", a.cell(), b.cell(), fmt(ratio(a, b)), "—"])
    a, b = samples_stats(primerl), samples_stats(trl)
    rows.append(["samples/s (64 / steady wall per step)", a.cell(), b.cell(), fmt(ratio(a, b)), "—"])
    return rows


def plot_rewards(path: Path, primerl: RunTimeline, trl: RunTimeline, trl_wall: RunTimeline | None, title: str) -> Path:
    curves = {}
    for label, run in (("primerl rl", primerl), ("TRL GRPOTrainer", trl), ("TRL, equal wall time", trl_wall)):
        if run is None:
            continue
        times = run.extra.get("reward_times") or run.step_ends  # primerl: when each batch was scored
        rewards = [(t - run.launch, r) for t, r in zip(times, run.step_rewards) if r is not None]
        if rewards:
            curves[label] = ([t for t, _ in rewards], [r for _, r in rewards])
    return save_curves(path, title, "wall time since launch, s", "mean training reward of the step's batch", curves)


def part_a(args: argparse.Namespace, section: Section, raw: dict) -> None:
    if not args.sft or not (Path(args.sft) / "config.json").is_file():
        raise BenchRunError(
            f"--sft {args.sft!r} is not a model directory (config.json); build the SFT checkpoint "
            "first (bench/run_all.py does)"
        )
    work = args.work_dir / "a"
    work.mkdir(parents=True, exist_ok=True)
    # Enough prompts for the equal-wall-time TRL run too (TRL runs ~0.2-0.5 s a step here).
    max_trl_steps = 4000
    prompts = write_prompts(work / "prompts.jsonl", max_trl_steps * 8, work)
    section.line(
        f"CPU: {cpu_phrase()}. SFT checkpoint `{args.sft}`; {args.steps} steps per run, {args.repeats} run(s) of "
        "each trainer, "
        "alternating primerl / TRL so that each pair shares the machine's load. primerl: "
        f"`{PRIMERL.relative_to(ROOT)} rl @ examples/reverse_text_rl.toml --model.name SFT --max-steps "
        f"{args.steps}` (the demo's config: max_async_level 1, default loss, 4 daemons + vLLM). TRL "
        f"{python_version_of(BENCH_PYTHON, 'trl')} (transformers {python_version_of(BENCH_PYTHON, 'transformers')}, "
        f"torch {python_version_of(BENCH_PYTHON, 'torch')}) `GRPOTrainer` in one process "
        f"(bench/trl_grpo.py): {TRL_SETTINGS}. Same prompts in the same order (the env's train split in "
        "EnvSampler order), same reward (LCS ratio)."
    )
    section.line()
    primerl_runs: list[RunTimeline] = []
    trl_runs: list[RunTimeline] = []
    started = time.time()
    for repeat in range(args.repeats):
        if repeat > 0 and args.budget_s is not None:
            # What is left after this repeat: the equal-wall TRL run (about one primerl run) and the evals.
            per_repeat_s = (time.time() - started) / repeat
            reserve_s = (0 if args.no_equal_wall else per_repeat_s) + (0 if args.no_eval else 2 * EVAL_ESTIMATE_S)
            if time.time() - args.part_started + per_repeat_s + reserve_s > args.budget_s:
                section.line(
                    f"_Repeats cut from {args.repeats} to {repeat} by the time budget ({args.budget_s:.0f} s; "
                    f"one repeat took {per_repeat_s:.0f} s)._"
                )
                section.line()
                break
        primerl_runs.append(
            run_primerl(
                args.sft,
                work / f"primerl-{repeat}",
                args.steps,
                args.run_timeout_s,
                what=f"primerl rl (repeat {repeat})",
            )
        )
        trl_runs.append(
            run_trl(
                args.sft,
                prompts,
                work / f"trl-{repeat}",
                args.steps,
                args.run_timeout_s,
                save=repeat == 0,
                what=f"TRL GRPOTrainer (repeat {repeat})",
            )
        )
        print(
            f"[a] repeat {repeat}: primerl {fmt(primerl_runs[-1].steady_wall_per_step_s)} s/step, "
            f"TRL {fmt(trl_runs[-1].steady_wall_per_step_s)} s/step",
            flush=True,
        )
    raw["primerl"] = [r.as_dict() for r in primerl_runs]
    raw["trl"] = [r.as_dict() for r in trl_runs]

    trl_wall = None
    primerl_wall_s = primerl_runs[0].step_ends[-1] - primerl_runs[0].launch
    if not args.no_equal_wall:
        trl_wall = run_trl(
            args.sft,
            prompts,
            work / "trl-equal-wall",
            max_trl_steps,
            args.run_timeout_s + primerl_wall_s,
            wall_budget_s=primerl_wall_s,
            what="TRL GRPOTrainer (equal wall time)",
        )
        raw["trl_equal_wall"] = trl_wall.as_dict()

    section.line(
        "**Speed** (median (min–max, n)); ratio = primerl / TRL of the medians; paired = the ratio within "
        "each back-to-back pair of runs:"
    )
    section.line()
    rows = timing_rows(primerl_runs, trl_runs)
    section.table(["quantity", "primerl rl", "TRL GRPOTrainer", "ratio", "paired ratio"], rows)
    wall_ratio = ratio(per_run(primerl_runs, "steady_wall_per_step_s"), per_run(trl_runs, "steady_wall_per_step_s"))
    startup_ratio = ratio(per_run(primerl_runs, "startup_to_rollouts_s"), per_run(trl_runs, "startup_to_rollouts_s"))
    trainer_step = Stats()
    for run in primerl_runs:
        for value in run.extra.get("step_time_s", []):
            trainer_step.add(value)
    section.line(
        f"primerl's own `perf/step_time_s` (trainer, all steps): {trainer_step.cell()} s. TRL threads: "
        f"{trl_runs[0].extra.get('num_threads')}."
    )
    section.line()

    evals: dict[str, object] = {}
    if not args.no_eval:
        n = args.eval_examples
        targets = [
            ("SFT checkpoint (start)", args.sft),
            (f"primerl after {args.steps} steps", primerl_runs[0].model_dir),
            (f"TRL after {args.steps} steps", trl_runs[0].model_dir),
        ]
        if trl_wall is not None:
            targets.append(
                (
                    f"TRL after primerl's wall time ({fmt(primerl_wall_s)} s: {trl_wall.num_steps} steps)",
                    trl_wall.model_dir,
                )
            )
        eval_rows = []
        # Evals are reward measurements, not timings: two at a time (each starts its own vLLM).
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = [
                pool.submit(run_eval, model, work / f"eval-{index}", args.eval_timeout_s, num_examples=n)
                for index, (_, model) in enumerate(targets)
            ]
            for (label, _), future in zip(targets, futures):
                try:
                    result = future.result()
                    evals[label] = result
                    eval_rows.append(
                        [label, fmt(result.reward_mean), fmt(result.reward_sem, 2), str(result.num_rollouts)]
                    )
                except BenchRunError as error:
                    evals[label] = None
                    eval_rows.append([label, f"not run: {str(error).splitlines()[0]}", "—", "—"])
        raw["evals"] = {k: (vars(v) if v is not None else None) for k, v in evals.items()}
        section.line(
            f"**Held-out reward** (`primerl eval reverse-text -m DIR -n {n} -r 1 -t 24 -T 1.0`, the demo's "
            "eval; se = standard error of the mean over the rollouts, the eval's sampling noise):"
        )
        section.line()
        section.table(["model", "held-out reward", "se", "rollouts"], eval_rows)

    section.line("**Targets**")
    section.line()
    section.line(
        target_line(
            "a: primerl/TRL wall per step",
            wall_ratio,
            "<=",
            3.0,
            f"(aim 2.0: {'met' if wall_ratio is not None and wall_ratio <= 2.0 else 'not yet'})",
        )
    )
    section.line(target_line("a: start-up ratio (launch to first rollouts)", startup_ratio, "<=", 3.0))
    primerl_eval = evals.get(f"primerl after {args.steps} steps")
    trl_eval = evals.get(f"TRL after {args.steps} steps")
    if primerl_eval is not None and trl_eval is not None:
        noise = 2 * math.sqrt(primerl_eval.reward_sem**2 + trl_eval.reward_sem**2)
        gap = primerl_eval.reward_mean - trl_eval.reward_mean
        section.line(
            target_line(
                f"a: held-out reward after {args.steps} steps, primerl - TRL",
                gap,
                ">=",
                -noise,
                f"(primerl {fmt(primerl_eval.reward_mean)}, TRL {fmt(trl_eval.reward_mean)}; "
                f"2 x combined se = {fmt(noise, 2)})",
            )
        )
    else:
        section.line("- **not measured** a: held-out reward (evals skipped or failed, see above)")
    section.line()

    plots = args.plots_dir
    bars = {
        "primerl rl": per_run(primerl_runs, "steady_wall_per_step_s"),
        "TRL GRPOTrainer": per_run(trl_runs, "steady_wall_per_step_s"),
    }
    section.image(
        save_bars(plots / "a_wall_per_step.png", "a. wall per step (steady state)", "seconds", bars),
        args.markdown.parent if args.markdown else ROOT / "bench",
        "a. wall per step",
    )
    section.image(
        plot_rewards(
            plots / "a_reward_vs_wall.png",
            primerl_runs[0],
            trl_runs[0],
            trl_wall,
            "a. training reward vs wall time (first repeat)",
        ),
        args.markdown.parent if args.markdown else ROOT / "bench",
        "a. reward vs wall time",
    )


def part_g(args: argparse.Namespace, section: Section, raw: dict) -> None:
    work = args.work_dir / "g"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model-100m"
    run_child(
        [str(PRIMERL), "init-tiny-model", str(model_dir), *MODEL_100M_ARGS],
        work / "init-model.log",
        600,
        "primerl init-tiny-model (100M)",
    )
    params = "?"
    for line in (work / "init-model.log").read_text().splitlines():
        if "parameters" in line:
            params = line.strip()
    if params == "?":  # the model was there already: count its parameters
        from safetensors import safe_open

        count = 0
        for path in model_dir.glob("*.safetensors"):
            with safe_open(str(path), "np") as weights:
                for name in weights.keys():
                    count += math.prod(weights.get_slice(name).get_shape())
        params = f"{count:,} parameters ({count / 1e6:.2f} M)" if count else "?"
    prompts = write_prompts(work / "prompts.jsonl", args.steps * 8, args.work_dir / "a")
    section.line(
        f"Model: `primerl init-tiny-model DIR {' '.join(MODEL_100M_ARGS)}` ({params}), random weights, "
        f"{args.steps} steps per run, {args.repeats} run(s) of each, the same settings as part a "
        "(every completion runs to 24 tokens: a random model rarely stops). samples/s = 64 / steady wall per "
        f"step (start-up excluded). primerl with `{' '.join(G_PRIMERL_OVERRIDES)}`: groups whose rewards are all "
        "equal (most of a random model's) count toward the 64 as in TRL, instead of being replaced by new ones."
    )
    section.line()
    modes = [m.strip() for m in args.cpu_sharing.split(",") if m.strip()]
    if not modes or any(m not in ("shared", "split") for m in modes):
        raise BenchRunError(f"--cpu-sharing {args.cpu_sharing!r}: list shared and/or split, comma-separated")
    section.line(
        f"CPU: {cpu_phrase()}. primerl runs once per `cpu_sharing` mode ({', '.join(modes)}; "
        "`--cpu-sharing MODE`) in each repeat, then TRL, so each repeat's runs share the machine's load."
    )
    section.line()
    primerl_runs: dict[str, list[RunTimeline]] = {mode: [] for mode in modes}
    trl_runs: list[RunTimeline] = []
    started = time.time()
    for repeat in range(args.repeats):
        if repeat > 0 and args.budget_s is not None:
            per_repeat_s = (time.time() - started) / repeat
            if time.time() - args.part_started + per_repeat_s > args.budget_s:
                section.line(
                    f"_Repeats cut from {args.repeats} to {repeat} by the time budget ({args.budget_s:.0f} s)._"
                )
                section.line()
                break
        for mode in modes:
            primerl_runs[mode].append(
                run_primerl(
                    str(model_dir),
                    work / f"primerl-{mode}-{repeat}",
                    args.steps,
                    args.run_timeout_s,
                    overrides=["--cpu-sharing", mode, *G_PRIMERL_OVERRIDES],
                    what=f"primerl rl 100M cpu_sharing={mode} (repeat {repeat})",
                )
            )
        trl_runs.append(
            run_trl(
                str(model_dir),
                prompts,
                work / f"trl-{repeat}",
                args.steps,
                args.run_timeout_s,
                save=False,
                what=f"TRL GRPOTrainer 100M (repeat {repeat})",
            )
        )
        rates = ", ".join(f"primerl {m} {fmt(primerl_runs[m][-1].samples_per_s(SAMPLES_PER_STEP))}" for m in modes)
        print(f"[g] repeat {repeat}: {rates}, TRL {fmt(trl_runs[-1].samples_per_s(SAMPLES_PER_STEP))} samples/s")
    raw["primerl"] = {mode: [r.as_dict() for r in runs] for mode, runs in primerl_runs.items()}
    raw["trl"] = [r.as_dict() for r in trl_runs]
    ratios = {}
    for mode in modes:
        section.line(f'**primerl `cpu_sharing = "{mode}"`** vs TRL:')
        section.line()
        section.table(
            ["quantity", f"primerl rl ({mode})", "TRL GRPOTrainer", "ratio", "paired ratio"],
            timing_rows(primerl_runs[mode], trl_runs),
        )
        ratios[mode] = ratio(samples_stats(primerl_runs[mode]), samples_stats(trl_runs))
    if len(modes) > 1:
        a, b = samples_stats(primerl_runs[modes[0]]), samples_stats(primerl_runs[modes[1]])
        # samples/s ratio of a pair = the inverse ratio of its walls per step
        pairs = paired_ratios(primerl_runs[modes[1]], primerl_runs[modes[0]], "steady_wall_per_step_s")
        section.line(f"samples/s, {modes[0]} / {modes[1]}: {fmt(ratio(a, b))} (per repeat: {pairs.cell()}).")
        section.line()
    section.line(f"The step-to-step intervals give min/median/max within runs ({args.steps - 1} per run).")
    section.line()
    section.line("**Targets**")
    section.line()
    for mode in modes:
        section.line(target_line(f"g: primerl ({mode}) / TRL samples/s at ~100M", ratios[mode], ">=", 1.1))
        section.line()
    bars = {f"primerl rl ({mode})": samples_stats(primerl_runs[mode]) for mode in modes}
    bars["TRL GRPOTrainer"] = samples_stats(trl_runs)
    section.image(
        save_bars(
            args.plots_dir / "g_samples_per_s.png", "g. ~100M model: samples/s (steady state)", "samples/s", bars
        ),
        args.markdown.parent if args.markdown else ROOT / "bench",
        "g. samples/s",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = {"a": (30, 3), "g": (4, 1)}[args.part]
    if args.quick:
        defaults = {"a": (5, 1), "g": (3, 1)}[args.part]
        if args.part == "a" and args.eval_examples == 200:
            args.eval_examples = 50
    args.steps = args.steps or defaults[0]
    args.repeats = args.repeats or defaults[1]
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (a steady-state step needs two step ends)")
    title = {
        "a": "a. `primerl rl` vs TRL `GRPOTrainer` (demo task, same SFT checkpoint)",
        "g": "g. ~100M-parameter model: `primerl rl` vs TRL `GRPOTrainer` samples/s",
    }[args.part]
    section = Section(title)
    raw: dict = {"part": args.part, "steps": args.steps, "repeats": args.repeats}
    started = args.part_started = time.time()
    status = 0
    try:
        (part_a if args.part == "a" else part_g)(args, section, raw)
    except BenchRunError as error:
        section.line(f"**not run: {error}**".replace("\n", "  \n"))
        print(error, file=sys.stderr)
        status = 1
    section.line(f"Part took {time.time() - started:.0f} s.")
    if args.markdown:
        section.write(args.markdown)
    else:
        print(section.text())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(raw, indent=1, default=str))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
