"""Classic and verifiers v1 environments in one `primerl rl` run (issue 19): the env tables' `kind` (auto: asked of
the two env interpreters) and its errors, and a short run of examples/reverse_text_mixed_rl.toml through the real
daemons (broker, primerl-infer, trainer, orchestrator with a classic env worker and a v1 env server) that reports a
reward per environment and trains every step once.

Needs `.venv-envs` (reverse-text) and `.venv-envs-v1` (reverse-text-v1), which `make setup` builds; the tests that
use them are skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.configs.orchestrator import EnvConfig, OrchestratorConfig
from primerl.orchestrator.envs.factory import EnvClients, endpoint_version_fn
from primerl.orchestrator.envs.interpreters import EnvPython, find_v1_env_python
from primerl.orchestrator.envs.kinds import not_installed_message, resolve_env_kinds
from primerl.orchestrator.envs.v1 import sampling_params, task_prompt
from primerl.orchestrator.trajectory import SamplingParams
from primerl.proto import telemetry

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_mixed_rl.toml"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
RUN_TIMEOUT_S = 400
NUM_STEPS = 3
EVAL = (
    '{interval = 3, num_examples = 4, env = [{id = "reverse-text"}, {id = "reverse-text-v1", args = {split = "eval"}}]}'
)
"""An eval at the last step on both kinds (a v1 env's eval tasks are the ones its args give)."""


@pytest.fixture(scope="module")
def pythons() -> tuple[EnvPython, EnvPython]:
    """(classic, v1) env interpreters with reverse-text and reverse-text-v1 installed."""
    from primerl.orchestrator.envs.interpreters import probe_env_python

    v1 = find_v1_env_python()
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    if v1.source == "this_interpreter" or not Path(v1.path).exists():
        pytest.skip(f"no verifiers v1 env venv ({v1.path}): `make setup` creates .venv-envs-v1")
    if "reverse-text-v1" not in [env.id for env in probe_env_python(v1.path).envs]:
        pytest.skip(f"reverse-text-v1 is not installed in {v1.path}: `make setup` installs it")
    return EnvPython(ENV_PYTHON, "env_var"), v1


def orchestrator_config(envs: list[dict], **extra) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate({"model": {"name": "m"}, "env": envs, **extra})


# ------------------------------------------------------------------------------------------------ config
def test_env_tables_take_a_kind_and_a_v1_config():
    config = orchestrator_config(
        [
            {"id": "reverse-text"},
            {"id": "reverse-text-v1", "kind": "v1", "weight": 3, "v1_config": {"agent": {"harness": {"max_turns": 2}}}},
        ],
        env_v1_python="/x/python",
        v1_max_workers=2,
    )
    assert [env.kind for env in config.env] == ["auto", "v1"]
    assert config.env[1].v1_config == {"agent": {"harness": {"max_turns": 2}}}
    assert (str(config.env_v1_python), config.v1_max_workers) == ("/x/python", 2)
    assert orchestrator_config([{"id": "a"}]).v1_max_workers == 1


@pytest.mark.parametrize(
    "table, message",
    [
        (
            {"id": "t", "v1_config": {"taskset": {"id": "other"}}},
            "v1_config.taskset.id ('other') is not allowed: the "
            "taskset is the environment's `id` ('t'); remove taskset.id from v1_config",
        ),
        ({"id": "t", "kind": "classic", "v1_config": {"agent": {}}}, 'v1_config is set but kind = "classic"'),
        ({"id": "t", "kind": "v2"}, "Input should be 'auto', 'classic' or 'v1'"),
    ],
)
def test_env_table_mistakes_name_the_setting(table, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EnvConfig.model_validate(table)


def test_the_flat_shape_takes_kind_and_v1_config():
    from primerl.configs.rl_shapes import to_canonical

    canonical = to_canonical(
        {
            "model": "m",
            "env": [{"id": "reverse-text", "weight": 2}, {"id": "reverse-text-v1", "kind": "v1", "v1_config": {}}],
        }
    )
    assert canonical["orchestrator"]["env"][1] == {"id": "reverse-text-v1", "kind": "v1", "v1_config": {}}


def test_the_mixed_example_loads_as_a_run_config():
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config

    config = load_config(RLConfig, [EXAMPLE])
    assert [(env.id, env.kind, env.weight) for env in config.orchestrator.env] == [
        ("reverse-text", "auto", 1.0),
        ("reverse-text-v1", "auto", 1.0),
    ]


# ------------------------------------------------------------------------------------------ kind resolution
def test_auto_kinds_come_from_what_each_interpreter_has_installed(pythons):
    classic, v1 = pythons
    envs = [
        (f"orchestrator.env[{i}]", EnvConfig(id=env_id))
        for i, env_id in enumerate(["reverse-text", "reverse-text-v1", "no-such-env"])
    ]
    resolved = resolve_env_kinds(envs, classic=classic, v1=v1)
    assert [(r.kind, r.python, r.listed) for r in resolved] == [
        ("classic", classic.path, True),
        ("v1", v1.path, True),
        ("classic", classic.path, False),
    ]
    # an explicit kind is taken as written, whatever is installed
    explicit = resolve_env_kinds([("e", EnvConfig(id="reverse-text", kind="v1"))], classic=classic, v1=v1)
    assert (explicit[0].kind, explicit[0].python) == ("v1", v1.path)


def test_a_v1_package_installed_only_where_it_cannot_run_is_refused(pythons):
    classic, v1 = pythons
    # the v1 venv given as the classic interpreter, the classic venv as the v1 one
    with pytest.raises(
        ValueError,
        match=r'orchestrator\.env\[0\]\.id "reverse-text-v1" is a verifiers v1 environment, '
        r"installed only in the classic env interpreter .*primerl env install PATH",
    ):
        resolve_env_kinds(
            [("orchestrator.env[0]", EnvConfig(id="reverse-text-v1"))],
            classic=EnvPython(v1.path, "explicit"),
            v1=EnvPython(classic.path, "explicit"),
        )


def test_an_id_installed_nowhere_names_both_interpreters_and_the_install_command(pythons, tmp_path):
    classic, v1 = pythons
    config = orchestrator_config(
        [{"id": "reverse-text"}, {"id": "revers-text-v1"}],
        env_python=classic.path,
        env_v1_python=v1.path,
        output_dir=str(tmp_path),
    )
    workers: dict = {}
    try:
        with pytest.raises(ValueError) as raised:
            EnvClients(config, env_python=classic.path).start_all(config.env, "orchestrator.env", workers)
    finally:
        for worker in workers.values():
            worker.close()
    assert str(raised.value) == not_installed_message(
        "orchestrator.env[1]",
        "revers-text-v1",
        classic=EnvPython(classic.path, "explicit"),
        v1=EnvPython(v1.path, "explicit"),
    )
    assert classic.path in str(raised.value) and v1.path in str(raised.value)
    assert "`primerl env install PATH`" in str(raised.value) and "orchestrator.env[1].kind" in str(raised.value)


@pytest.mark.slow
def test_a_v1_env_asking_for_a_sandbox_stops_the_start_naming_the_setting(pythons, tmp_path):
    classic, v1 = pythons
    config = orchestrator_config(
        [{"id": "reverse-text-v1", "v1_config": {"agent": {"runtime": {"type": "prime"}}}}],
        env_python=classic.path,
        env_v1_python=v1.path,
        output_dir=str(tmp_path),
    )
    workers: dict = {}
    try:
        with pytest.raises(ValueError, match=r"^orchestrator\.env\[0\]: .*agent\.runtime"):
            EnvClients(config, env_python=classic.path).start_all(config.env, "orchestrator.env", workers)
    finally:
        for worker in workers.values():
            worker.close()
    assert not any(worker.is_alive() for worker in workers.values())


@pytest.mark.slow
def test_the_preflight_checks_both_kinds_and_names_the_v1_setting(pythons, tiny_model, tmp_path):
    """The preflight lists a v1 environment's first tasks in the v1 interpreter and measures their prompts; a v1
    id missing there, and a v1 environment asking for a sandbox, are one line each naming the setting."""
    from primerl.cli.preflight.envs import env_checks

    classic, v1 = pythons

    def findings(envs: list[dict], seq_len: int = 256) -> list[str]:
        config = orchestrator_config(envs, env_python=classic.path, env_v1_python=v1.path, seq_len=seq_len)
        return [
            f.message
            for f in env_checks(config, prefix="orchestrator.", tokenizer=str(tiny_model), max_model_len=None)()
        ]

    assert findings([{"id": "reverse-text"}, {"id": "reverse-text-v1"}]) == []
    [short] = findings([{"id": "reverse-text-v1"}], seq_len=8)
    assert short.startswith('orchestrator.env[0] "reverse-text-v1": prompts are up to ') and "(8 sampled)" in short
    [missing, sandbox] = findings(
        [
            {"id": "revers-text-v1", "kind": "v1"},
            {"id": "reverse-text-v1", "v1_config": {"agent": {"runtime": {"type": "prime"}}}},
        ]
    )
    assert missing.startswith(
        'orchestrator.env[0].id "revers-text-v1" is not installed in the verifiers v1 env '
        f"interpreter {v1.path}; Install yours with `primerl env install PATH`."
    ), missing
    assert missing.endswith("or set orchestrator.env[0].kind")
    assert sandbox.startswith(
        "orchestrator.env[1]: v1 env 'reverse-text-v1': role 'agent' asks for the 'prime' runtime (a sandbox)"
    ), sandbox
    assert sandbox.endswith("; fix orchestrator.env[1].args or orchestrator.env[1].v1_config")


def test_the_adapter_takes_the_schedulers_sampling_and_the_endpoints_versions():
    from primerl.orchestrator.endpoints import InferenceWorkers

    params = sampling_params(
        {
            "max_tokens": 24,
            "temperature": 0.7,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop": ["\n"],
            "seed": 5,
        }
    )
    assert params == SamplingParams(temperature=0.7, max_tokens=24, stop=("\n",), seed=5)
    inference = InferenceWorkers()
    inference.update({"w1": ("http://h:1/v1", 4), "w2": ("http://h:2/v1", 6)}, current_version=4)
    version_of = endpoint_version_fn(inference)
    assert (version_of("http://h:2/v1"), version_of("http://h:1"), version_of("http://h:3/v1")) == (6, 4, None)
    assert task_prompt({"prompt": "a b", "system_prompt": "Reverse."}) == [
        {"role": "system", "content": "Reverse."},
        {"role": "user", "content": "a b"},
    ]


def test_per_environment_rows_include_the_stale_groups_of_each_environment():
    """A v1 env's groups come out as any env's (`env/<id>/...`); a slow env's groups cancelled as stale are
    counted per env, so its under-representation shows."""
    from collections import Counter
    from types import SimpleNamespace

    from primerl.orchestrator.samples import Group, TrainingSample
    from primerl.orchestrator.step_metrics import batch_metrics

    def group(env_id: str, rewards: list[float]) -> Group:
        return Group(
            group_id=f"{env_id}:0",
            example_id=0,
            env_id=env_id,
            samples=[
                TrainingSample(
                    token_ids=[1, 2],
                    loss_mask=[False, True],
                    inference_logprobs=[0.0, -1.0],
                    temperatures=[1.0, 1.0],
                    policy_versions=[0, 0],
                    reward=reward,
                    env_id=env_id,
                    rollout_id=index,
                )
                for index, reward in enumerate(rewards)
            ],
        )

    batch = SimpleNamespace(
        groups=[group("reverse-text", [0.5, 1.0]), group("reverse-text-v1", [0.25, 0.25])], metrics={}
    )
    counters = Counter({"stale_groups_cancelled": 3, "stale_groups_cancelled/reverse-text-v1": 3})
    metrics = batch_metrics(batch, counters, Counter(), elapsed_s=1.0, tokens_per_s=1.0, multi_env=True)
    assert (metrics["env/reverse-text/reward"], metrics["env/reverse-text-v1/reward"]) == (0.75, 0.25)
    assert metrics["env/reverse-text-v1/stale_groups_cancelled"] == 3.0
    assert "env/reverse-text/stale_groups_cancelled" not in metrics
    single = batch_metrics(batch, counters, Counter(), elapsed_s=1.0, tokens_per_s=1.0, multi_env=False)
    assert not any(name.startswith("env/") for name in single)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_v1_client_serves_the_env_client_interface(pythons, infer_daemon, infer_http, tiny_model):
    """What the rollout scheduler calls, on a real env server and primerl-infer: groups per example on the chosen
    inference server with its policy version, a death failing the pending groups with EnvWorkerDied (and later
    submits with failed futures, not raises), a restart keeping the tasks, a cancel giving "cancelled"."""
    import signal

    from support.inference import TOKEN, model_name

    from primerl.orchestrator.envs.base import EnvRequestError, EnvWorkerDied
    from primerl.orchestrator.envs.v1 import V1EnvClient

    _, v1 = pythons
    worker = V1EnvClient(
        v1.path,
        "reverse-text-v1",
        {"num_examples": 30},
        api_key=TOKEN,
        renderer_model=str(tiny_model),
        version_of=lambda base_url: 7,
        request_timeout_s=120,
        max_restarts=1,
    )
    common = dict(
        num_rollouts=2,
        base_url=infer_daemon.url + "/v1",
        model=model_name(infer_http),
        sampling={"temperature": 1.0, "max_tokens": 8, "stop": [], "seed": 3},
    )
    try:
        info = worker.start()
        assert (info.num_examples, info.num_eval_examples) == (30, 30)
        assert [example.index for example in worker.examples("train", 28, 5)] == [28, 29]
        groups = [future.result(120) for future in worker.submit_rollouts([4, 29], **common)]
        assert [g.example_index for g in groups] == [4, 29]
        for group in groups:
            assert all(r.ok and r.turns[0].policy_version == 7 == r.turns[0].policy_version_end for r in group.rollouts)
        [out_of_range] = worker.submit_rollouts([30], **common)
        with pytest.raises(EnvRequestError, match="out of range"):
            out_of_range.result(1)
        pending = worker.submit_rollout(5, **{**common, "sampling": {"temperature": 1.0, "max_tokens": 64}})
        os.killpg(worker.pid, signal.SIGKILL)
        with pytest.raises(EnvWorkerDied):
            pending.result(30)
        [after] = worker.submit_rollouts([5], **common)
        with pytest.raises(EnvWorkerDied):
            after.result(1)
        assert worker.ensure_alive() is info and worker.num_restarts == 1 and worker.is_alive()
        assert all(r.ok for r in worker.submit_rollout(5, **common).result(120).rollouts)
        stale = worker.submit_rollout(6, **{**common, "sampling": {"temperature": 1.0, "max_tokens": 64}})
        worker.cancel(stale)
        with pytest.raises(EnvRequestError, match="cancelled"):
            stale.result(5)
    finally:
        worker.close()
    assert not worker.is_alive()


# ------------------------------------------------------------------------------------------ the mixed run
@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_mixing_a_classic_and_a_v1_environment_reports_a_reward_per_environment(pythons, tiny_model, tmp_path):
    """examples/reverse_text_mixed_rl.toml, shortened, with an eval of both kinds at the last step."""
    from support.probes import free_port

    classic, v1 = pythons
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PRIMERL_ENV_PYTHON": classic.path,
        "PRIMERL_ENV_V1_PYTHON": v1.path,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PRIMERL_RUN_TOKEN", None)
    args = [
        str(BIN / "primerl"),
        "rl",
        "@",
        str(EXAMPLE),
        "--model.name",
        str(tiny_model),
        "--output-dir",
        str(run_dir),
        "--broker.grpc-port",
        str(free_port()),
        "--max-steps",
        str(NUM_STEPS),
        "--orchestrator.batch-size",
        "16",
        "--orchestrator.rollouts-per-example",
        "4",
        "--orchestrator.sampling.max-tokens",
        "12",
        "--orchestrator.eval",
        EVAL,
    ]
    started_s = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=tmp_path)
    wall_s = time.monotonic() - started_s
    output = result.stdout + result.stderr
    orchestrator_log = run_dir / "logs" / "orchestrator.log"
    tail = orchestrator_log.read_text()[-4000:] if orchestrator_log.exists() else ""
    assert result.returncode == 0, output[-6000:] + tail
    assert f"run finished: {NUM_STEPS} steps" in result.stdout, output[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer = [r for r in rows if r["role"] == "trainer"]
    assert [r["step"] for r in trainer] == list(range(1, NUM_STEPS + 1))  # every step trained, once
    steps = [r for r in rows if r["role"] == "orchestrator" and telemetry.TRAIN_REWARD in r]
    assert [r["step"] for r in steps] == list(range(1, NUM_STEPS + 1))
    for env_id in ("reverse-text", "reverse-text-v1"):
        rewards = [r[f"env/{env_id}/reward"] for r in steps if f"env/{env_id}/reward" in r]
        assert rewards, f"no env/{env_id}/reward in any step: {steps}"
        assert all(0.0 <= reward <= 1.0 for reward in rewards)
    num_rollouts = {
        env_id: sum(r.get(f"env/{env_id}/num_rollouts", 0) for r in steps)
        for env_id in ("reverse-text", "reverse-text-v1")
    }
    assert sum(num_rollouts.values()) == NUM_STEPS * 16, num_rollouts
    assert sum(r[telemetry.ROLLOUT_ERRORS] for r in steps) == 0, steps
    evals = [r for r in rows if r["role"] == "orchestrator" and "eval/reverse-text-v1/reward" in r]
    assert len(evals) == 1 and evals[0]["step"] == NUM_STEPS, rows
    for env_id in ("reverse-text", "reverse-text-v1"):
        assert evals[0][f"eval/{env_id}/num_rollouts"] == 4 and evals[0][f"eval/{env_id}/errors"] == 0, evals
    log_text = orchestrator_log.read_text()
    assert "v1 env server ready" in log_text, log_text[-3000:]
    print(
        f"mixed classic + v1 run, {NUM_STEPS} steps: {wall_s:.1f} s wall; rollouts per env {num_rollouts}; "
        "rewards per step " + str([{k: round(v, 3) for k, v in r.items() if k.endswith("/reward")} for r in steps])
    )
