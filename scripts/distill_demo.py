"""`make distill`: on-policy distillation of a good teacher into a weaker student on the toy reverse-text task.

    python scripts/distill_demo.py                       # everything under runs/demo, what is there is reused
    python scripts/distill_demo.py --run-dir /tmp/d --distill-steps 20 --repeats 4

Teacher: the demo's RL-trained model (`make run`: SFT 1000 steps, then 30 RL steps on the reward); student: the
SFT checkpoint it started from, so the two differ by what RL taught (held-out 0.533 vs 0.771 in bench/RESULTS.md).
The student is then trained by `primerl rl` with a teacher (`[teacher]`: a frozen primerl-infer scoring every
rollout) and `[trainer.loss] teacher_tau = 1, adv_tau = 0`: pure on-policy distillation, the reward is never
used. Its held-out reward (`primerl eval`, the env's eval split) is measured before and after, next to the
teacher's; each eval samples every prompt `--repeats` times, and the spread is the std over those repeats
(repeat r = rollout r of every prompt, each seeded apart).

What is missing is built, what is there is reused: the tiny model (`RUN/tiny-model`), the SFT checkpoint
(`RUN/sft/weights/step_N`, as `make run` builds it), the teacher (`RUN/rl`'s final weights when `make run` left
them, else trained into `RUN/distill/teacher` with the same command). The distillation run, the evals and the
report (`RUN/distill/report.json`, printed) are made afresh each time.
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

from primerl.proto import telemetry

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
RL_EXAMPLE = REPO / "examples" / "reverse_text_rl.toml"
SFT_EXAMPLE = REPO / "examples" / "reverse_text_sft.toml"
DISTILL_EXAMPLE = REPO / "examples" / "reverse_text_distill.toml"  # teacher_tau 1, adv_tau 0, a [teacher] table
TEACHER_RL_STEPS = 30  # examples/reverse_text_rl.toml's max_steps: the demo's RL run
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def step(label: str, argv: list, log_path: Path) -> float:
    """Run one command with its output in ``log_path``; on failure show its tail and stop. Returns its seconds."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"{label} (log: {log_path}) ...", flush=True)
    started_s = time.monotonic()
    with log_path.open("w") as log:
        code = subprocess.run(
            [str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO
        ).returncode
    seconds = time.monotonic() - started_s
    if code != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        print("\n".join(lines[-30:]), file=sys.stderr)
        raise SystemExit(f"distill_demo: {label} failed (exit {code}); its log: {log_path}")
    print(f"  done in {seconds:.0f} s", flush=True)
    return seconds


def final_weights(run_dir: Path) -> Path | None:
    """A run directory's last exported weights (``weights/step_N`` with a config.json), or None."""
    steps = sorted(
        (int(p.name.split("_")[1]), p)
        for p in (run_dir / "weights").glob("step_*")
        if p.name.split("_")[1].isdigit() and (p / "config.json").exists()
    )
    return steps[-1][1] if steps else None


def build_student(run_dir: Path, sft_steps: int, timings: dict) -> Path:
    """The SFT checkpoint (`make run`'s first half), built when absent."""
    model, sft_dir = run_dir / "tiny-model", run_dir / "sft"
    weights = sft_dir / "weights" / f"step_{sft_steps}"
    if (weights / "config.json").exists():
        print(f"student: SFT checkpoint {weights} (reused)")
        return weights
    if not (model / "config.json").exists():
        timings["tiny_model_s"] = step(
            "tiny model", [BIN / "primerl", "init-tiny-model", model], run_dir / "distill" / "logs" / "init.log"
        )
    shutil.rmtree(sft_dir, ignore_errors=True)
    logs = run_dir / "distill" / "logs"
    step(
        "SFT data", [BIN / "primerl", "sft-data", "reverse-text", "-o", sft_dir / "clean.jsonl"], logs / "sft-data.log"
    )
    step(
        "chatty SFT data",
        [
            sys.executable,
            REPO / "examples" / "reverse_text" / "chatty_sft_data.py",
            sft_dir / "clean.jsonl",
            sft_dir / "data.jsonl",
        ],
        logs / "chatty.log",
    )
    timings["sft_s"] = step(
        f"SFT: {sft_steps} steps",
        [
            BIN / "primerl",
            "sft",
            "@",
            SFT_EXAMPLE,
            "--model.name",
            model,
            "--tokenizer.name",
            model,
            "--data.path",
            sft_dir / "data.jsonl",
            "--output-dir",
            sft_dir,
            "--max-steps",
            sft_steps,
        ],
        logs / "sft.log",
    )
    return weights


def build_teacher(run_dir: Path, student: Path, timings: dict) -> Path:
    """`make run`'s RL weights when there, else the same RL run from the SFT checkpoint."""
    for candidate in (run_dir / "rl", run_dir / "distill" / "teacher"):
        weights = final_weights(candidate)
        if weights is not None and weights.name == f"step_{TEACHER_RL_STEPS}":
            print(f"teacher: RL-trained {weights} (reused)")
            return weights
    teacher_dir = run_dir / "distill" / "teacher"
    shutil.rmtree(teacher_dir, ignore_errors=True)
    timings["teacher_rl_s"] = step(
        f"teacher: RL {TEACHER_RL_STEPS} steps from the SFT checkpoint",
        [
            BIN / "primerl",
            "rl",
            "@",
            RL_EXAMPLE,
            "--model.name",
            student,
            "--output-dir",
            teacher_dir,
            "--max-steps",
            TEACHER_RL_STEPS,
        ],
        run_dir / "distill" / "logs" / "teacher-rl.log",
    )
    weights = final_weights(teacher_dir)
    if weights is None:
        raise SystemExit(f"distill_demo: the teacher's RL run left no weights in {teacher_dir}/weights")
    return weights


def evaluate(label: str, model: Path, out_dir: Path, args: argparse.Namespace, timings: dict) -> dict:
    """``primerl eval`` of one model; the held-out mean reward of each repeat, their mean and std."""
    shutil.rmtree(out_dir, ignore_errors=True)
    timings[f"eval_{label}_s"] = step(
        f"eval: {label} ({model})",
        [
            BIN / "primerl",
            "eval",
            "reverse-text",
            "-m",
            model,
            "-n",
            args.num_examples,
            "-r",
            args.repeats,
            "-t",
            24,
            "-T",
            1.0,
            "--seed",
            args.seed,
            "-o",
            out_dir,
        ],
        out_dir.parent / f"eval-{label}.log",
    )
    return {"model": str(model), **repeat_stats(out_dir / "results.jsonl")}


def repeat_stats(results: Path) -> dict:
    """From ``primerl eval``'s results.jsonl: the mean reward of each repeat (rollout r of every prompt), and the
    mean and std of those means."""
    per_repeat: dict[int, list[float]] = {}
    for line in results.read_text().splitlines():
        row = json.loads(line)
        per_repeat.setdefault(int(row["rollout_index"]), []).append(float(row["reward"]))
    means = [sum(v) / len(v) for _, v in sorted(per_repeat.items())]
    return {
        "repeat_means": means,
        "mean": statistics.fmean(means),
        "std": statistics.stdev(means) if len(means) > 1 else 0.0,
    }


def distill(run_dir: Path, student: Path, teacher: Path, steps: int, timings: dict) -> Path:
    """``primerl rl @ examples/reverse_text_distill.toml`` from the student, with the teacher's weights."""
    out = run_dir / "distill" / "student"
    shutil.rmtree(out, ignore_errors=True)
    timings["distill_s"] = step(
        f"distillation: {steps} steps, teacher {teacher}",
        [
            BIN / "primerl",
            "rl",
            "@",
            DISTILL_EXAMPLE,
            "--model.name",
            student.resolve(),
            "--teacher.model.name",
            teacher.resolve(),
            "--output-dir",
            out,
            "--max-steps",
            steps,
        ],
        run_dir / "distill" / "logs" / "distill.log",
    )
    return out


def teacher_kl_curve(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {
        r["step"]: r[telemetry.TRAIN_TEACHER_KL]
        for r in rows
        if r.get("role") == "trainer" and telemetry.TRAIN_TEACHER_KL in r
    }
    return [curve[s] for s in sorted(curve)]


def report(result: dict) -> str:
    ev = result["eval"]
    head = (
        f"held-out reward: reverse-text eval split, {result['num_examples']} prompts x {result['repeats']} "
        f"repeats, temperature 1.0; mean ± std over the repeats"
    )
    rows = [
        f"  {'teacher (RL-trained)':<24}{ev['teacher']['mean']:.3f} ± {ev['teacher']['std']:.3f}",
        f"  {'student before':<24}{ev['before']['mean']:.3f} ± {ev['before']['std']:.3f}",
        f"  {'student after':<24}{ev['after']['mean']:.3f} ± {ev['after']['std']:.3f}",
    ]
    gap = ev["teacher"]["mean"] - ev["before"]["mean"]
    closed = (ev["after"]["mean"] - ev["before"]["mean"]) / gap if abs(gap) > 1e-9 else float("nan")
    kl = result["teacher_kl"]
    third = max(1, len(kl) // 3)
    lines = [
        head,
        *rows,
        f"  gap to the teacher closed: {closed:.0%} ({result['distill_steps']} distillation steps, rewards unused)",
        f"train/teacher_kl: first {third} steps {statistics.fmean(kl[:third]):.4f}, last {third} "
        f"{statistics.fmean(kl[-third:]):.4f} (step 1 {kl[0]:.4f}, step {len(kl)} {kl[-1]:.4f})",
        "wall: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in result["timings"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distill_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run-dir", type=Path, default=Path("runs/demo"), help="the demo's RUN_DIR (default: %(default)s)"
    )
    parser.add_argument("--sft-steps", type=int, default=1000, help="the SFT checkpoint's step (default: %(default)s)")
    parser.add_argument("--distill-steps", type=int, default=30, help="distillation steps (default: %(default)s)")
    parser.add_argument("--num-examples", type=int, default=200, help="held-out prompts (default: %(default)s)")
    parser.add_argument(
        "--repeats", type=int, default=4, help="samples of each prompt = repeats (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="eval sampling seed (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be >= 2 (the spread is the std over repeats)")
    run_dir = args.run_dir if args.run_dir.is_absolute() else (Path.cwd() / args.run_dir)
    started_s = time.monotonic()
    timings: dict[str, float] = {}
    student = build_student(run_dir, args.sft_steps, timings)
    teacher = build_teacher(run_dir, student, timings)
    evals = run_dir / "distill" / "eval"
    result_eval = {
        "teacher": evaluate("teacher", teacher, evals / "teacher", args, timings),
        "before": evaluate("before", student, evals / "before", args, timings),
    }
    distilled = distill(run_dir, student, teacher, args.distill_steps, timings)
    result_eval["after"] = evaluate("after", distilled, evals / "after", args, timings)
    timings["total_s"] = time.monotonic() - started_s
    result = {
        "teacher": str(teacher),
        "student": str(student),
        "distill_steps": args.distill_steps,
        "num_examples": args.num_examples,
        "repeats": args.repeats,
        "eval": result_eval,
        "teacher_kl": teacher_kl_curve(distilled),
        "timings": timings,
    }
    (run_dir / "distill" / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
