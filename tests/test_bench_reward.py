"""The TRL side of `make bench` (bench/trl_grpo.py) scores completions exactly as the reverse-text environment does.

bench/trl_grpo.py re-implements the environment's `lcs_reward` because the bench's interpreter has no verifiers;
this test scores the same completions with both (the environment's in its own interpreter, .venv-envs) and
requires equal floats. It also checks that the bench's prompt order is the orchestrator's EnvSampler order.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
from support.bench import load_bench_module

ROOT = Path(__file__).resolve().parent.parent
ENV_PYTHON = ROOT / ".venv-envs" / "bin" / "python"


def _cases() -> list[tuple[object, str]]:
    rng = random.Random(12)
    letters = "abcd"
    cases: list[tuple[object, str]] = [
        ("d c b a", "d c b a"),
        ("", "a b"),
        ("   ", "a"),
        ("a  b\tc\n", "c b a"),
        ("Sure! d c b a", "d c b a"),
        ([{"role": "assistant", "content": "b a"}], "b a"),
        ([{"role": "assistant", "content": None}], "a"),
        ([], "a b"),
        ([{"role": "user", "content": "a b"}], "a b"),
        ([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "a b c"}], "c b a"),
        ([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "a b"),
    ]
    for _ in range(300):
        answer = " ".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))
        words = [rng.choice(letters + "xyz") for _ in range(rng.randint(0, 9))]
        text = rng.choice(["", "Here you go: ", "Reversed:\n"]) + rng.choice([" ", "  ", "\n"]).join(words)
        cases.append(([{"role": "assistant", "content": text}] if rng.random() < 0.7 else text, answer))
    return cases


_ENV_SCORER = """
import json, sys
import verifiers as vf
import reverse_text
parser = vf.Parser()
cases = json.load(sys.stdin)
print(json.dumps([reverse_text.lcs_reward(c, a, parser) for c, a in cases]))
"""


@pytest.mark.skipif(not ENV_PYTHON.exists(), reason="the environments' venv (.venv-envs) is not built")
def test_bench_reward_equals_the_environments():
    trl_grpo = load_bench_module("trl_grpo")
    cases = _cases()
    result = subprocess.run(
        [str(ENV_PYTHON), "-c", _ENV_SCORER],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    expected = json.loads(result.stdout.strip().splitlines()[-1])
    got = [trl_grpo.lcs_reward_text(c, a) for c, a in cases]
    mismatches = [(c, a, e, g) for (c, a), e, g in zip(cases, expected, got) if e != g]
    assert not mismatches, mismatches[:5]
    assert len(set(got)) > 10  # the cases cover many reward values, not one


def test_bench_prompt_order_is_the_orchestrators(tmp_path):
    primerl_runs = load_bench_module("primerl_runs")
    from primerl.orchestrator.env_sampler import EnvSampler

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": f"a{i}"} for i in range(7)]
    (tmp_path / "train_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = primerl_runs.write_prompts(tmp_path / "prompts.jsonl", 20, tmp_path)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    sampler = EnvSampler({"reverse-text": 7}, {"reverse-text": 1.0}, seed=0)
    assert written == [rows[sampler.next()[1]] for _ in range(20)]
    assert sorted(r["answer"] for r in written[:7]) == sorted(r["answer"] for r in rows)  # one epoch = a permutation
