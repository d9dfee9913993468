"""`primerl eval` and `primerl sft-data` on a verifiers v1 environment (examples/reverse_text_v1) through the real
CLI: the v1 env interpreter's bootstrap lists the tasks, verifiers' own env server runs the rollouts against the
vLLM server eval starts (`primerl.cli.v1_tools`).

Needs `.venv-envs-v1` with reverse-text-v1 installed (`make setup` builds it); skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from difflib import SequenceMatcher
from pathlib import Path

import pytest

from primerl.cli.v1_tools import V1ToolError, sft_row
from primerl.orchestrator.envs.interpreters import find_v1_env_python, probe_env_python

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
ENV_ID = "reverse-text-v1"
ROWS = '{"num_examples": 40, "num_eval_examples": 10, "min_len": 3, "max_len": 5}'


@pytest.fixture(scope="module")
def v1_python() -> str:
    python = find_v1_env_python()
    if python.source == "this_interpreter" or not Path(python.path).exists():
        pytest.skip(f"no verifiers v1 env venv ({python.path}): `make setup` creates .venv-envs-v1")
    if ENV_ID not in [env.id for env in probe_env_python(python.path).envs]:
        pytest.skip(f"{ENV_ID} is not installed in {python.path}: `make setup` installs it")
    return python.path


def primerl(*argv: object, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRIMERL_ENV_PYTHON": ENV_PYTHON, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [str(BIN / "primerl"), *map(str, argv)], capture_output=True, text=True, timeout=timeout, env=env
    )


def lcs_ratio(reply: str, answer: str) -> float:
    """The reverse-text reward (examples/reverse_text), recomputed here."""
    return SequenceMatcher(None, " ".join(reply.split()).split(" "), answer.split(" "), autojunk=False).ratio()


def test_an_sft_sample_needs_a_text_answer() -> None:
    row = sft_row({"idx": 0, "prompt": "a b", "system_prompt": "S", "answer": "b a"}, "x")
    assert row == {
        "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "a b"}],
        "completion": [{"role": "assistant", "content": "b a"}],
    }
    with pytest.raises(V1ToolError, match=r"no text `answer` \(its task data hold: idx, prompt\).*primerl eval x"):
        sft_row({"idx": 3, "prompt": "hi", "answer": None}, "x")


@pytest.mark.slow  # each command starts the v1 interpreter's bootstrap (~5-15 s: verifiers.v1 imports)
def test_sft_data_of_the_v1_example_equals_the_classic_one(v1_python: str, tmp_path: Path) -> None:
    v1 = primerl("sft-data", ENV_ID, "-o", tmp_path / "v1.jsonl", "-a", ROWS, "-n", 20)
    assert v1.returncode == 0, v1.stderr
    assert f"wrote 20 samples of {ENV_ID} (v1 env, train)" in v1.stdout
    rows = [json.loads(line) for line in (tmp_path / "v1.jsonl").read_text().splitlines()]
    assert len(rows) == 20
    for row in rows:
        (system, user), (reply,) = row["prompt"], row["completion"]
        assert system["role"] == "system" and user["role"] == "user" and reply["role"] == "assistant"
        assert reply["content"] == " ".join(reversed(user["content"].split(" ")))
        assert 3 <= len(user["content"].split(" ")) <= 5
    held_out = primerl("sft-data", ENV_ID, "-o", tmp_path / "eval.jsonl", "-a", ROWS, "--split", "eval")
    assert held_out.returncode == 0 and "wrote 10 samples" in held_out.stdout, held_out.stderr
    assert (tmp_path / "eval.jsonl").read_text().splitlines()[:3] != [json.dumps(r) for r in rows[:3]]
    bad = primerl("sft-data", ENV_ID, "-o", tmp_path / "bad.jsonl", "-a", '{"num_examples": 0}')
    assert bad.returncode == 1 and "num_examples" in bad.stderr and not (tmp_path / "bad.jsonl").exists()
    if Path(ENV_PYTHON).exists():  # same rows and prompts as the classic environment's, for the same arguments
        classic = primerl("sft-data", "reverse-text", "-o", tmp_path / "classic.jsonl", "-a", ROWS, "-n", 20)
        assert classic.returncode == 0, classic.stderr
        assert (tmp_path / "classic.jsonl").read_text() == (tmp_path / "v1.jsonl").read_text()


def test_a_v1_kind_without_the_id_or_interpreter_is_refused(tmp_path: Path) -> None:
    missing = primerl("eval", ENV_ID, "-m", tmp_path, "--kind", "v1", "--env-v1-python", tmp_path / "no" / "python")
    assert missing.returncode == 2 and "--env-v1-python" in missing.stderr and "does not exist" in missing.stderr


@pytest.mark.slow
@pytest.mark.vllm
def test_eval_of_the_v1_example_serves_the_model_and_scores_every_rollout(
    v1_python: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    result = primerl(
        "eval", ENV_ID, "-m", tiny_model, "-a", ROWS, "-n", 3, "-r", 2, "-t", 8, "--seed", 5, "-o", out, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env_kind"] == "v1" and summary["split"] == "eval" and summary["num_examples"] == 3
    assert summary["num_rollouts"] + summary["num_errors"] == 6 and summary["num_errors"] == 0, summary["errors"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    indices = sorted((r["example_index"], r["rollout_index"]) for r in rows)
    assert indices == [(i, j) for i in range(3) for j in range(2)]
    for row in rows:
        letters = row["prompt"][-1]["content"]
        reply = row["completion"][-1]["content"] or ""
        assert row["reward"] == pytest.approx(lcs_ratio(reply, " ".join(reversed(letters.split(" ")))))
        assert "exact_match" in row["metrics"] and 1 <= row["num_completion_tokens"] <= 8
    assert summary["reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 6)
    assert f"{ENV_ID} (v1 env, eval, 3 examples x 2)" in result.stdout
    assert f"reward: mean {summary['reward_mean']:.4f}" in result.stdout and "exact_match" in result.stdout
    console = (result.stdout + result.stderr).strip().splitlines()
    assert len(console) == 6 and not any("WARNING" in line for line in console), console
    assert f"(its log: {out / 'eval.log'})" in result.stderr
