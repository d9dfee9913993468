"""The environments' preflight check run by the orchestrator on the env workers it starts (`orchestrator.env_preflight`,
under `primerl rl`): the same findings as the launcher's check in env workers of its own, written to the report
the launcher's verdict waits for; and the launcher's side of that report."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.env_preflight import EnvPreflight
from primerl.orchestrator.envs.checks import check_environments, env_plan
from primerl.orchestrator.envs.factory import EnvClients
from primerl.runtime.start_gate import (
    ENV_CHECK_VAR,
    GATE_VAR,
    EnvCheckRequest,
    env_check_request,
    read_env_check_report,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "env_fixtures"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))


@pytest.fixture(scope="module")
def env_python() -> str:
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    return ENV_PYTHON


def test_the_request_travels_in_the_environment_and_a_restart_after_the_gate_does_not_check_again(
    monkeypatch, tmp_path
):
    monkeypatch.delenv(ENV_CHECK_VAR, raising=False)
    monkeypatch.delenv(GATE_VAR, raising=False)
    assert env_check_request() is None and EnvPreflight.requested(object()) is None  # a daemon on its own
    request = EnvCheckRequest(str(tmp_path / "report.json"), "some/tokenizer", 512)
    monkeypatch.setenv(ENV_CHECK_VAR, request.to_env()[ENV_CHECK_VAR])
    assert env_check_request() == request
    gate = tmp_path / "preflight.passed"
    monkeypatch.setenv(GATE_VAR, str(gate))
    assert env_check_request() == request
    gate.touch()  # the preflight passed: an orchestrator restarted later has nothing to report
    assert env_check_request() is None


def test_the_orchestrator_finds_what_the_launchers_check_finds_on_the_workers_it_starts(
    env_python, tiny_model, monkeypatch, tmp_path
):
    """An environment whose load_environment raises and one whose prompts do not fit seq_len: the orchestrator's
    report holds the findings the launcher's own check (env workers of its own) gives, line for line, and the
    env workers it checked are the run's (started once, by `EnvClients`)."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))  # the env workers inherit it
    monkeypatch.delenv(GATE_VAR, raising=False)
    report = tmp_path / "preflight.environments.json"
    monkeypatch.setenv(ENV_CHECK_VAR, EnvCheckRequest(str(report), str(tiny_model), 24).to_env()[ENV_CHECK_VAR])
    config = OrchestratorConfig.model_validate(
        {
            "model": {"name": str(tiny_model)},
            "env": [{"id": "reverse-text"}, {"id": "broken_load_env", "args": {"level": 3}}],
            "env_python": env_python,
            "seq_len": 256,
            "sampling": {"max_tokens": 24},
        }
    )
    preflight = EnvPreflight.requested(config)
    assert preflight is not None
    preflight.start()
    clients: dict = {}
    outcomes: dict = {}
    try:
        with pytest.raises(Exception, match="missing_setting"):
            try:
                EnvClients(config, env_python=env_python, probe=preflight.probe).start_groups(
                    [(config.env, "orchestrator.env", clients)], outcomes
                )
            finally:
                preflight.report(outcomes)
        assert set(outcomes) == {"orchestrator.env[0]", "orchestrator.env[1]"}
        assert isinstance(outcomes["orchestrator.env[1]"][1], BaseException)
    finally:
        for client in clients.values():
            client.close()
    found = read_env_check_report(report)
    assert found is not None and all(f["error"] for f in found)
    messages = [f["message"] for f in found]
    assert messages[0] == (
        'orchestrator.env[1] "broken_load_env": load_environment(level=3) raised KeyError: '
        "'missing_setting: load_environment is broken on purpose'; fix the environment or its "
        "args (orchestrator.env[1].args); the traceback is in the log"
    )
    assert "Traceback" in found[0]["detail"]  # the worker's stderr, for the launcher's log
    assert messages[1].startswith('orchestrator.env[0] "reverse-text": prompts are up to ')
    assert "> inference.model.max_model_len = 24: vLLM would refuse them" in messages[1]

    uses, python, plan_findings = env_plan(config, "orchestrator.")
    assert plan_findings == []
    launchers = check_environments(
        uses,
        python.path,
        python.describe(),
        setting="orchestrator.env_python",
        tokenizer=str(tiny_model),
        seq_len=256,
        max_model_len=24,
        max_tokens=24,
        prefix="orchestrator.",
    )
    assert [f.message for f in launchers] == messages


def test_a_clean_start_reports_no_findings_and_lends_its_tokenizer_to_the_sample_rollouts(
    env_python, tiny_model, monkeypatch, tmp_path
):
    from transformers import AutoTokenizer

    from primerl.orchestrator.rollout_samples import tokenizer_decoder

    monkeypatch.delenv(GATE_VAR, raising=False)
    report = tmp_path / "report.json"
    monkeypatch.setenv(ENV_CHECK_VAR, EnvCheckRequest(str(report), str(tiny_model), None).to_env()[ENV_CHECK_VAR])
    config = OrchestratorConfig.model_validate(
        {"model": {"name": str(tiny_model)}, "env": [{"id": "reverse-text"}], "env_python": env_python}
    )
    preflight = EnvPreflight.requested(config)
    preflight.start()
    clients: dict = {}
    outcomes: dict = {}
    try:
        EnvClients(config, env_python=env_python, probe=preflight.probe).start_groups(
            [(config.env, "orchestrator.env", clients)], outcomes
        )
        preflight.report(outcomes)
        assert clients["reverse-text"].is_alive()  # the run goes on with the worker that was checked
    finally:
        for client in clients.values():
            client.close()
    assert json.loads(report.read_text()) == {"findings": []}
    loading = preflight.tokenizer_of(str(tiny_model))
    assert loading is not None and preflight.tokenizer_of("another-model") is None
    ids = AutoTokenizer.from_pretrained(str(tiny_model))("a b c<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer_decoder(str(tiny_model), loading)(ids) == tokenizer_decoder(str(tiny_model))(ids)


def test_the_launcher_waits_for_the_report_or_for_the_orchestrator_to_end(tmp_path):
    from primerl.cli.preflight.roles import _orchestrator_report
    from primerl.runtime.start_gate import write_env_check_report

    ended = threading.Event()
    path = tmp_path / "report.json"
    check = _orchestrator_report(path, ended)
    writer = threading.Timer(0.3, write_env_check_report, args=(path, [{"message": "m", "error": True, "detail": "d"}]))
    started_s = time.monotonic()
    writer.start()
    [finding] = check()
    assert time.monotonic() - started_s >= 0.25 and (finding.message, finding.error, finding.detail) == ("m", True, "d")
    writer.join()
    path.unlink()
    threading.Timer(0.2, ended.set).start()
    [finding] = check()  # the orchestrator died before its environments loaded: its own failure speaks
    assert not finding.error and "the orchestrator ended before it loaded them" in finding.message


def test_only_an_orchestrator_that_starts_with_the_others_is_asked(tiny_model, tmp_path):
    """With evals (or a teacher) the orchestrator starts once inference serves, too late for the verdict: the
    launcher's preflight then loads the environments itself, as before."""
    from primerl.cli.preflight.roles import BackgroundPreflight
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config
    from primerl.supervisor.launcher import orchestrator_starts_early

    example = REPO_ROOT / "examples" / "reverse_text_rl.toml"
    plain = load_config(RLConfig, [example], {"model.name": str(tiny_model), "output_dir": str(tmp_path / "a")})
    evals = load_config(
        RLConfig,
        [example],
        {
            "model.name": str(tiny_model),
            "output_dir": str(tmp_path / "b"),
            "orchestrator.eval": {"env": [{"id": "reverse-text"}], "interval": 2},
        },
    )
    assert orchestrator_starts_early(plain) and not orchestrator_starts_early(evals)
    asked = BackgroundPreflight(plain, tmp_path / "p.log", env_report=tmp_path / "r.json")
    request = json.loads(asked.orchestrator_env()[ENV_CHECK_VAR])
    assert request == {
        "report_path": str(tmp_path / "r.json"),
        "tokenizer": str(tiny_model),
        "max_model_len": plain.inference.model.max_model_len,
    }
    not_asked = BackgroundPreflight(evals, tmp_path / "p.log", env_report=None)
    assert not_asked.orchestrator_env() == {} and "environments" in not_asked.checks
