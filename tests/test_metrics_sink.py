"""The run's metrics: `metrics.jsonl` rows (format, appends from several processes), a real offline W&B run read
back with wandb's own reader, and the Prometheus exporter scraped over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pydantic
import pytest
from support.probes import scrape_metrics as scrape

from primerl.runtime.config_common import PrometheusConfig, WandbConfig
from primerl.runtime.metrics_sink import MetricsSink, config_for_wandb
from primerl.runtime.prometheus import MetricsExporter, start_exporter

BIN = Path(sys.executable).parent


def read_rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ jsonl
def test_rows_have_step_role_time_and_only_finite_numbers(tmp_path):
    with MetricsSink("trainer", tmp_path / "out") as sink:
        sink.log(1, {"train/loss": 0.5, "train/kl_divergence": 0.01, "ckpt/saved": True})
        sink.log(
            2,
            {
                "train/loss": float("nan"),
                "train/grad_norm": float("inf"),
                "train/entropy": -float("inf"),
                "train/learning_rate": 1e-5,
                "note": "not a number",
            },
        )
    first, second = read_rows(tmp_path / "out")
    assert list(first)[:3] == ["step", "role", "time"]
    assert first["step"] == 1 and first["role"] == "trainer" and isinstance(first["time"], float)
    assert first["train/loss"] == 0.5 and first["train/kl_divergence"] == 0.01 and first["ckpt/saved"] == 1.0
    assert second == {"step": 2, "role": "trainer", "time": second["time"], "train/learning_rate": 1e-5}
    assert second["time"] >= first["time"]
    assert "NaN" not in (tmp_path / "out" / "metrics.jsonl").read_text()


def test_roles_share_one_file_and_append(tmp_path):
    with MetricsSink("orchestrator", tmp_path) as sink:
        sink.log(1, {"train/reward": 0.25})
    with MetricsSink("trainer", tmp_path) as sink:
        sink.log(1, {"train/loss": 0.5})
    with MetricsSink("orchestrator", tmp_path) as sink:  # a restart appends
        sink.log(2, {"train/reward": 0.5, "eval/reverse-text/reward": 0.4})
    assert [(r["role"], r["step"]) for r in read_rows(tmp_path)] == [
        ("orchestrator", 1),
        ("trainer", 1),
        ("orchestrator", 2),
    ]


def test_unknown_role_is_refused(tmp_path):
    with pytest.raises(ValueError, match="role must be one of"):
        MetricsSink("broker", tmp_path)


WRITER = textwrap.dedent("""
    import pathlib, sys, time
    from primerl.runtime.metrics_sink import MetricsSink

    role, output_dir, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), pathlib.Path(sys.argv[4])
    # ~6 KB lines: larger than a pipe buffer's atomic size, so interleaving would show if appends were not atomic
    names = [f"{role}/metric_with_a_long_name_{i:03d}" for i in range(150)]
    with MetricsSink(role, output_dir) as sink:
        go.with_name(role).touch()
        while not go.exists():  # both writers start together
            time.sleep(0.001)
        for step in range(count):
            sink.log(step, {name: step + i / 1000 for i, name in enumerate(names)})
""")


def test_two_processes_appending_at_once_never_interleave(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    count = 2000
    go = tmp_path / "go"
    writers = [
        subprocess.Popen(
            [sys.executable, str(script), role, str(tmp_path / "out"), str(count), str(go)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("trainer", "orchestrator")
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / role).exists() for role in ("trainer", "orchestrator")):
        assert time.monotonic() < deadline and all(w.poll() is None for w in writers), "writers did not start"
        time.sleep(0.01)
    go.touch()
    for writer in writers:
        _, stderr = writer.communicate(timeout=120)
        assert writer.returncode == 0, stderr
    rows = read_rows(tmp_path / "out")  # every line parses: none was cut by another process's write
    for role in ("trainer", "orchestrator"):
        mine = [r for r in rows if r["role"] == role]
        assert [r["step"] for r in mine] == list(range(count))
        assert all(len(r) == 153 and r[f"{role}/metric_with_a_long_name_149"] == r["step"] + 0.149 for r in mine)
    roles_in_order = [r["role"] for r in rows]
    switches = sum(a != b for a, b in zip(roles_in_order, roles_in_order[1:]))
    print(f"\n{len(rows)} rows, {switches} switches between the two writers")
    assert switches > 1, "the writers did not overlap: nothing was tested"


# ------------------------------------------------------------------------------------------------ W&B
def wandb_records(run_dir: Path) -> list[dict]:
    """The records of an offline run's .wandb file, decoded by wandb's own reader (`wandb leet inspect`)."""
    result = subprocess.run(
        [str(BIN / "wandb"), "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_wandb_offline_run_holds_every_row_against_the_roles_step(tmp_path, capfd):
    run_config = {"max_steps": 3, "broker": {"address": "127.0.0.1:50051", "run_token": "do-not-upload"}}
    wandb_config = WandbConfig(project="primerl-test", name="demo", offline=True)
    with MetricsSink("orchestrator", tmp_path, wandb_config, run_config) as sink:
        for step in (1, 2, 3):
            sink.log(
                step,
                {
                    "train/reward": step / 10,
                    "rollout/mean_length": 10.0 + step,
                    "rollout/generation_time": 0.5,
                    "rollout/nan": float("nan"),
                },
            )
        sink.log(2, {"eval/reverse-text/reward": 0.75})  # a second row for an earlier step: no step warning
    output = capfd.readouterr()
    assert "wandb:" not in output.out + output.err  # silent: daemon logs stay clean

    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1 and list(run_dirs[0].glob("run-*.wandb"))
    records = wandb_records(run_dirs[0])
    run = next(r["run"] for r in records if r["type"] == "run")
    assert (
        run["project"] == "primerl-test" and run["display_name"] == "demo-orchestrator" and run["run_group"] == "demo"
    )
    assert run["config"]["update"]["broker"] == {"address": "127.0.0.1:50051"}  # the run token never leaves
    assert "do-not-upload" not in json.dumps(records)
    metrics = [r["metric"] for r in records if r["type"] == "metric"]
    assert {
        "glob_name": "*",
        "options": {"defined": True, "step_sync": True},
        "step_metric": "orchestrator/step",
    } in metrics
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["orchestrator/step"], h.get("train/reward")) for h in history] == [
        (1, 0.1),
        (2, 0.2),
        (3, pytest.approx(0.3)),
        (2, None),
    ]
    assert [h.get("rollout/mean_length") for h in history[:3]] == [11.0, 12.0, 13.0]
    assert history[3]["eval/reverse-text/reward"] == 0.75
    assert not any("rollout/nan" in h for h in history)
    assert next(r for r in records if r["type"] == "exit")["exit"]["exit_code"] == 0  # finished by close()
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 2]


def test_wandb_missing_leaves_wandb_off_with_a_warning(tmp_path, monkeypatch, capfd):
    from primerl.runtime.log_setup import configure_logging

    configure_logging("trainer", level="info")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with MetricsSink("trainer", tmp_path, WandbConfig(offline=True)) as sink:
        sink.log(1, {"train/loss": 0.5})
    assert [r["train/loss"] for r in read_rows(tmp_path)] == [0.5]  # the run goes on: metrics.jsonl has them
    assert "wandb package is not installed" in capfd.readouterr().err
    assert not (tmp_path / "wandb").exists()


def test_wandb_plan_online_without_a_login_is_offline_with_the_fix(no_wandb_login, tmp_path, monkeypatch):
    from primerl.runtime.metrics_sink import WandbPlan, wandb_login_source, wandb_plan

    config = WandbConfig(name="demo")
    plan = wandb_plan(config, tmp_path / "run")
    assert plan.mode == "offline"
    assert "no W&B login" in plan.note and f"logging offline to {tmp_path / 'run' / 'wandb'}" in plan.note
    assert "`wandb login`" in plan.note and "wandb sync" in plan.note
    assert wandb_plan(WandbConfig(offline=True), tmp_path) == WandbPlan("offline")  # asked for: no note
    # a login in ~/.netrc (what `wandb login` writes), or a key in the environment: online as configured
    (no_wandb_login / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (no_wandb_login / ".netrc").chmod(0o600)
    assert wandb_login_source() == str(no_wandb_login / ".netrc")
    assert wandb_plan(config, tmp_path).mode == "online"
    (no_wandb_login / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_plan(config, tmp_path).mode == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment wins over the config
    assert wandb_plan(config, tmp_path).mode == "disabled"


def test_wandb_online_without_a_login_logs_offline(no_wandb_login, tmp_path, capfd):
    """The vf-rl example's `run_name` turns W&B on; on a machine without a login the role logs offline instead of
    stopping (it stopped with `UsageError: No API key configured` after vLLM's start-up)."""
    from primerl.runtime.log_setup import configure_logging

    configure_logging("orchestrator", level="info")
    with MetricsSink("orchestrator", tmp_path, WandbConfig(project="primerl-test", name="demo")) as sink:
        sink.log(1, {"train/reward": 0.25})
    assert "no W&B login" in capfd.readouterr().err
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    history = [r["history"]["item"] for r in wandb_records(run_dirs[0]) if r["type"] == "history"]
    assert [(h["orchestrator/step"], h["train/reward"]) for h in history] == [(1, 0.25)]


def test_config_for_wandb_drops_secrets_at_any_depth():
    from primerl.configs.trainer import TrainerConfig

    config = TrainerConfig(model={"name": "m"}, broker={"run_token": "t0p-secret"})
    data = config_for_wandb(config)
    assert data["model"]["name"] == "m" and "run_token" not in data["broker"]
    assert "t0p-secret" not in json.dumps(data)


# ------------------------------------------------------------------------------------------- Prometheus
def test_sink_rows_reach_prometheus_over_http(tmp_path):
    exporter = start_exporter("trainer", PrometheusConfig())
    try:
        assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics" and exporter.port > 0
        with MetricsSink("trainer", tmp_path, exporter=exporter) as sink:
            sink.log(1, {"train/loss": 0.5})
            sink.log(2, {"train/loss": 0.25, "train/kl_divergence": float("nan")})
        samples = scrape(exporter.url)
        assert samples[("primerl_step", (("role", "trainer"),))] == 2
        assert samples[("primerl_metric", (("name", "train/loss"), ("role", "trainer")))] == 0.25
        assert not any(dict(labels).get("name") == "train/kl_divergence" for _, labels in samples)
    finally:
        exporter.stop()


def test_disabled_exporter_is_none():
    assert start_exporter("broker", PrometheusConfig(enabled=False)) is None


def test_port_out_of_range_is_a_config_error():
    with pytest.raises(pydantic.ValidationError, match="less than or equal to 65535"):
        PrometheusConfig(port=70000)


def test_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            ValueError,
            match=f"cannot serve Prometheus metrics on 127.0.0.1:{port}: Address already "
            "in use. Set prometheus.port to a free port",
        ):
            MetricsExporter("trainer", PrometheusConfig(port=port)).start()


def test_wildcard_host_is_named_by_the_host_name():
    exporter = start_exporter("broker", PrometheusConfig(host="0.0.0.0"))
    try:
        assert exporter.url == f"http://{socket.gethostname()}:{exporter.port}/metrics"
        assert "primerl_step" in httpx.get(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).text
    finally:
        exporter.stop()
