"""On-policy distillation end to end: `primerl rl` with a teacher, through the real daemons.

The student is the tiny model after a few SFT steps on reverse-text samples (`primerl sft`), the teacher the
same model after more of them, so the two disagree on most tokens. `primerl rl` starts broker, inference (the student),
the teacher (a frozen primerl-infer with role teacher), orchestrator (which scores every rollout with the
teacher) and trainer with `[trainer.loss] teacher_tau = 1, adv_tau = 0`: pure distillation. Every step is
trained once, on micro-batches that carry the teacher's logprobs, and `train/teacher_kl` (student - teacher
logprob on the sampled tokens) is non-zero at every step and falls over the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.proto import telemetry

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_distill.toml"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
ENV = {
    **os.environ,
    "PRIMERL_ENV_PYTHON": ENV_PYTHON,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
ENV.pop("PRIMERL_RUN_TOKEN", None)
NUM_STEPS = 9
STUDENT_SFT_STEPS = 6
TEACHER_SFT_STEPS = 30
RUN_TIMEOUT_S = 420

OVERLAY = """\
# on top of examples/reverse_text_distill.toml (teacher_tau 1, adv_tau 0, a [teacher] table): short and quick
max_steps = {steps}

[orchestrator]
batch_size = 32              # 4 prompts x 8 rollouts
rollouts_per_example = 8

[orchestrator.sampling]
max_tokens = 16

[trainer.optim]
lr = 1e-2                    # a tiny student: large steps, so the fall shows within a few steps
"""


def reverse_dataset(path: Path, count: int = 256, seed: int = 0) -> Path:
    """Reverse-text chat samples in the environment's prompt format."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(count):
            letters = [rng.choice("abcdef") for _ in range(rng.randint(3, 6))]
            system = "Reverse the letters. Answer with the letters only, separated by spaces."
            handle.write(
                json.dumps(
                    {
                        "prompt": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": " ".join(letters)},
                        ],
                        "completion": [{"role": "assistant", "content": " ".join(reversed(letters))}],
                    }
                )
                + "\n"
            )
    return path


def start_sft(model: Path, data: Path, out: Path, steps: int, log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as log:
        return subprocess.Popen(
            [
                str(BIN / "primerl"),
                "sft",
                "--model.name",
                str(model),
                "--data.path",
                str(data),
                "--data.batch-size",
                "16",
                "--data.epochs",
                "10",
                "--max-steps",
                str(steps),
                "--optim.lr",
                "3e-3",
                "--seq-len",
                "256",
                "--output-dir",
                str(out),
                "--model.parallel",
                "ddp",
                "--threads.wait-policy",
                "passive",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=ENV,
        )


@pytest.fixture(scope="module")
def student_and_teacher(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model after a few SFT steps (the student) and after more (the teacher), on the same samples; the
    two SFT runs side by side."""
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    root = tmp_path_factory.mktemp("distill-models")
    data = reverse_dataset(root / "reverse.jsonl")
    runs = {
        name: (steps, start_sft(tiny_model, data, root / name, steps, root / f"{name}.log"))
        for name, steps in (("student", STUDENT_SFT_STEPS), ("teacher", TEACHER_SFT_STEPS))
    }
    weights = []
    for name, (steps, process) in runs.items():
        try:
            code = process.wait(timeout=300)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
        assert code == 0, (root / f"{name}.log").read_text()[-3000:]
        weights.append(root / name / "weights" / f"step_{steps}")
        assert (weights[-1] / "config.json").exists()
    return weights[0], weights[1]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_with_a_teacher_trains_every_step_and_its_teacher_kl_falls(student_and_teacher, tmp_path):
    student, teacher = student_and_teacher
    run_dir = tmp_path / "run"
    overlay = tmp_path / "distill.toml"
    overlay.write_text(OVERLAY.format(steps=NUM_STEPS))
    from support.probes import free_port

    args = [
        str(BIN / "primerl"),
        "rl",
        "@",
        str(EXAMPLE),
        "@",
        str(overlay),
        "--model.name",
        str(student),
        "--teacher.model.name",
        str(teacher),
        "--output-dir",
        str(run_dir),
        "--broker.grpc-port",
        str(free_port()),
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=ENV, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert f"run finished: {NUM_STEPS} steps" in result.stdout, output[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer_rows = [r for r in rows if r["role"] == "trainer"]
    assert [r["step"] for r in trainer_rows] == list(range(1, NUM_STEPS + 1))  # every step trained, once
    kl = [r.get(telemetry.TRAIN_TEACHER_KL) for r in trainer_rows]
    assert all(value is not None and abs(value) > 1e-4 for value in kl), kl  # micro-batches carried teacher logprobs
    third = NUM_STEPS // 3
    first, last = sum(kl[:third]) / third, sum(kl[-third:]) / third
    assert last < first, f"teacher_kl did not fall: {kl}"
    # the teacher ran as its own primerl-infer, and the orchestrator asked it without an error
    assert (run_dir / "logs" / "teacher.log").stat().st_size > 0
    orchestrator_rows = [r for r in rows if r["role"] == "orchestrator"]
    assert sum(r.get("teacher/requests", 0) for r in orchestrator_rows) >= NUM_STEPS * 4, orchestrator_rows[-1]
    assert sum(r.get("teacher/errors", 0) for r in orchestrator_rows) == 0
    print(f"teacher_kl per step: {[round(v, 4) for v in kl]}\n{result.stdout[-2000:]}")


def load_demo():
    spec = importlib.util.spec_from_file_location("distill_demo", REPO_ROOT / "scripts" / "distill_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_report_gives_mean_and_spread_over_repeats(tmp_path):
    """scripts/distill_demo.py: repeat r = rollout r of every prompt; the report shows mean ± std of the repeats
    for teacher, student before and after, the gap closed and teacher_kl's first and last thirds."""
    demo = load_demo()
    results = tmp_path / "results.jsonl"
    rewards = {(0, 0): 0.5, (1, 0): 0.7, (0, 1): 0.6, (1, 1): 1.0}  # (example, repeat) -> reward
    results.write_text(
        "".join(
            json.dumps({"example_index": e, "rollout_index": r, "reward": v}) + "\n" for (e, r), v in rewards.items()
        )
    )
    stats = demo.repeat_stats(results)
    assert stats["repeat_means"] == pytest.approx([0.6, 0.8])
    assert stats["mean"] == pytest.approx(0.7) and stats["std"] == pytest.approx(0.1414, abs=1e-4)
    result = {
        "num_examples": 2,
        "repeats": 2,
        "distill_steps": 6,
        "teacher_kl": [0.3, 0.3, 0.2, 0.2, 0.1, 0.1],
        "eval": {
            "teacher": {"mean": 0.8, "std": 0.01},
            "before": {"mean": 0.5, "std": 0.02},
            "after": {"mean": 0.7, "std": 0.03},
        },
        "timings": {"distill_s": 90.0, "total_s": 200.0},
    }
    text = demo.report(result)
    assert "student before          0.500 ± 0.020" in text and "student after           0.700 ± 0.030" in text
    assert "gap to the teacher closed: 67%" in text
    assert "first 2 steps 0.3000, last 2 0.1000" in text and "distill 90 s, total 200 s" in text
