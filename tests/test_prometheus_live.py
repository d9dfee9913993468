"""A real Prometheus (Debian's ``prometheus`` package) scrapes a running ``primerl rl`` through the broker's service
discovery with the shipped ``deploy/prometheus`` config and rules: every daemon is a target and up; an orchestrator
SIGKILLed mid-run shows down, leaves the targets once the broker marks it lost, and ``PrimerlRoleLost`` fires for
it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from support.probes import free_port
from test_rl_launcher import ENV_PYTHON, _run_output, _start_rl, _wait_for_step

from primerl.supervisor.run_file import read_run_file

REPO_ROOT = Path(__file__).resolve().parents[1]
DEPLOY = REPO_ROOT / "deploy" / "prometheus"
PROMETHEUS = shutil.which("prometheus")
TIMEOUT_S = 300


def prometheus_config(directory: Path, broker_metrics_port: int, token: str) -> Path:
    """The shipped config, pointed at this run's broker, scraping and evaluating every second."""
    shutil.copytree(DEPLOY / "rules", directory / "rules")
    (directory / "run-token").write_text(token)
    (directory / "run-token").chmod(0o600)
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
    [job] = config["scrape_configs"]
    [sd] = job["http_sd_configs"]
    sd["url"] = f"http://127.0.0.1:{broker_metrics_port}/discovery"
    sd["refresh_interval"] = "1s"
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def api(port: int, path: str) -> dict:
    answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=15)
    answer.raise_for_status()
    return answer.json()["data"]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(interval_s)


def targets_by_role(port: int) -> dict[str, list[dict]]:
    roles: dict[str, list[dict]] = {}
    for target in api(port, "targets?state=active")["activeTargets"]:
        roles.setdefault(target["labels"]["role"], []).append(target)
    return roles


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary: apt-get install prometheus (.ci/run does)")
def test_prometheus_finds_every_daemon_and_a_killed_role_fires_the_role_lost_alert(tiny_model, tmp_path):
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    run_dir, broker_metrics_port, prometheus_port = tmp_path / "run", free_port(), free_port()
    rl = _start_rl(
        tiny_model,
        run_dir,
        "--max-steps",
        "200",
        "--broker.prometheus.port",
        str(broker_metrics_port),
        "--restart-delay-s",
        "120",
        "--restart-delay-max-s",
        "120",
    )
    prometheus = None
    try:
        _wait_for_step(rl, run_dir, 1, TIMEOUT_S)
        token = read_run_file(run_dir).run_token
        config = prometheus_config(tmp_path / "prometheus", broker_metrics_port, token)
        prometheus = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "prometheus.log", "w"),
        )
        started_s = time.monotonic()

        def all_up():
            roles = targets_by_role(prometheus_port)
            healthy = {"broker", "trainer", "orchestrator", "inference"} <= set(roles) and all(
                t["health"] == "up" for ts in roles.values() for t in ts
            )
            return roles if healthy else None

        roles = wait_until(all_up, 60, "every daemon a target and up")
        up_s = time.monotonic() - started_s
        for role, targets in roles.items():
            for target in targets:
                labels = target["labels"]
                assert labels["run_id"] and labels["worker"] and labels["host"], labels
        [inference] = roles["inference"]  # vLLM's /metrics behind the run token: scraped with it
        assert inference["scrapeUrl"].endswith("/metrics"), inference

        orchestrator = json.loads((run_dir / "pids.json").read_text())["orchestrator"]
        os.killpg(orchestrator, signal.SIGKILL)
        killed_s = time.monotonic()

        def role_lost_firing():
            alerts = api(prometheus_port, "alerts")["alerts"]
            return [
                a
                for a in alerts
                if a["labels"]["alertname"] == "PrimerlRoleLost"
                and a["labels"]["role"] == "orchestrator"
                and a["state"] == "firing"
            ]

        # Scraped every second, it is down well before the broker marks it lost (5 heartbeats) and the discovery
        # drops it; then it leaves the targets.
        wait_until(
            lambda: [t for t in targets_by_role(prometheus_port).get("orchestrator", []) if t["health"] == "down"],
            30,
            "the killed orchestrator's target down",
            interval_s=0.2,
        )
        wait_until(
            lambda: "orchestrator" not in targets_by_role(prometheus_port), 60, "the lost orchestrator's target gone"
        )
        [alert] = wait_until(role_lost_firing, 90, "PrimerlRoleLost firing for the orchestrator")
        fired_s = time.monotonic() - killed_s
        assert alert["annotations"]["action"].startswith("`primerl status RUN_DIR`"), alert
        print(f"every target up {up_s:.1f} s after Prometheus started; PrimerlRoleLost firing {fired_s:.1f} s after")
    except AssertionError:
        print(_run_output(run_dir))
        if prometheus is not None:
            try:
                print(json.dumps(api(prometheus_port, "targets"), indent=1)[-6000:])
            except httpx.HTTPError as exc:
                print(f"Prometheus' targets unreadable: {exc!r}")
        if (tmp_path / "prometheus.log").exists():
            print((tmp_path / "prometheus.log").read_text()[-3000:])
        raise
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        if rl.poll() is None:
            rl.send_signal(signal.SIGINT)
            rl.wait(120)
