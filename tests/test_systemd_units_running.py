"""The units' command lines run the way systemd runs them (their environment, user, umask, directories, a
read-only / and a private /tmp), without systemd, which does not run here: in private mount, network and pid
namespaces (support.systemd_units.run_like_systemd)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from support.systemd_units import (
    BIN,
    ENV_VENV,
    REPO_ROOT,
    VENV,
    WAIT_FOR,
    can_unshare_mounts,
    run_install,
    run_like_systemd,
    start_like_the_unit,
)

needs_sandbox = pytest.mark.skipif(
    not can_unshare_mounts() or shutil.which("setpriv") is None or shutil.which("ip") is None,
    reason="needs root, unshare -m -n, setpriv and ip",
)


@needs_sandbox
def test_broker_unit_serves_as_its_unit_runs_it(tmp_path):
    """The broker started the way its unit starts it (installed config, environment file, user, directories): it
    serves `primerl status`, writes its ready file and spool where the unit says, and stops with status 0 on
    SIGTERM well within TimeoutStopSec."""
    shadow = tmp_path / "shadow"
    run_install("--root", str(shadow), "--venv", str(VENV), "--token", "t0ken")
    start, broker = start_like_the_unit(shadow, "primerl-broker.service")
    out = run_like_systemd(
        tmp_path,
        "",
        f"""{WAIT_FOR}
{start}
pid=$!
wait_for /run/primerl-broker/ready.json $pid 60
PRIMERL_RUN_TOKEN=t0ken timeout 60 {BIN}/primerl status --broker 127.0.0.1:50051 --json >/dev/null && echo STATUS_OK
stop $pid
stat -c 'SPOOL %U %a' /var/lib/primerl/spool
""",
        timeout_s=180,
    )
    print(out)
    assert '"role": "broker"' in out and "STATUS_OK" in out and "SPOOL primerl 750" in out, out
    exit_status, stop_s = re.search(r"EXIT=(\d+) STOP_S=(\d+)", out).groups()
    assert exit_status == "0" and int(stop_s) < int(broker["TimeoutStopSec"]), out


@pytest.mark.slow
@needs_sandbox
def test_a_run_under_the_units(tmp_path, tiny_model):
    """All four roles started as their units start them (broker, primerl-infer@0, trainer, orchestrator; role
    configs from `primerl rl ... --dry-run --write`, as deploy/README.md says) run the tiny model to max_steps: the
    trainer and orchestrator end with status 0 (no restart), checkpoints and weights land in /var/lib/primerl; the
    inference worker (vLLM with / read-only but for its directories: caches in /var/cache/primerl, its work
    directory in the private /tmp) serves on the port its instance file gives (8000) and stops with status 0."""
    configs = tmp_path / "cfg"
    written = subprocess.run(
        [
            str(BIN / "primerl"),
            "rl",
            "@",
            str(REPO_ROOT / "examples/reverse_text_rl.toml"),
            "--model.name",
            "/var/lib/primerl/model",
            "--max-steps",
            "2",
            "--broker.host",
            "0.0.0.0",
            "--broker.run-token",
            "t0ken",
            "--dry-run",
            "--write",
            str(configs),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert written.returncode == 0, written.stderr
    for config in configs.glob("*.toml"):  # as deploy/README.md says: the units give the token (primerl.env)
        config.write_text(re.sub(r"^run_token = .*\n", "", config.read_text(), flags=re.MULTILINE))
    shadow = tmp_path / "shadow"
    run_install(
        "--root",
        str(shadow),
        "--venv",
        str(VENV),
        "--env-venv",
        str(ENV_VENV),
        "--token",
        "t0ken",
        "--infer-workers",
        "1",
    )
    ask = (
        "import httpx; r = httpx.post('http://127.0.0.1:8000/v1/completions', timeout=60, headers={'Authorization': "
        "'Bearer t0ken'}, json={'model': '/var/lib/primerl/model', 'prompt': 'ab', 'max_tokens': 2}); "
        "print('COMPLETION', r.status_code)"
    )
    starts = {
        name: start_like_the_unit(shadow, f"primerl-{name}.service")[0]
        for name in ("broker", "infer@0", "trainer", "orchestrator")
    }
    setup = (
        f"cp -r {tiny_model} /var/lib/primerl/model && chown -R primerl:primerl /var/lib/primerl/model\n"
        f"cp {configs}/broker.toml {configs}/trainer.toml {configs}/orchestrator.toml {configs}/inference.toml "
        f"/etc/primerl/"
    )
    out = run_like_systemd(
        tmp_path,
        setup,
        f"""{WAIT_FOR}
{starts["broker"]}
broker=$!
wait_for /run/primerl-broker/ready.json $broker 60
{starts["infer@0"]}
infer=$!
{starts["trainer"]}
trainer=$!
{starts["orchestrator"]}
orchestrator=$!
set +e
wait $trainer; echo "TRAINER_EXIT=$?"
wait $orchestrator; echo "ORCHESTRATOR_EXIT=$?"
set -e
PRIMERL_RUN_TOKEN=t0ken timeout 60 {BIN}/primerl status --broker 127.0.0.1:50051 --json > /run/status.json
{BIN}/python -c "import json; print('COMMITTED', json.load(open('/run/status.json'))['last_committed_step'])"
cat /run/primerl-infer-0/ready.json; echo
{BIN}/python -c "{ask}"
stop $infer
stop $broker
ls /var/lib/primerl/trainer
""",
        timeout_s=540,
    )
    print(out)
    assert "TRAINER_EXIT=0" in out and "ORCHESTRATOR_EXIT=0" in out, out
    assert "COMMITTED 2" in out, out
    assert '"http_port": 8000' in out and "COMPLETION 200" in out, out
    assert re.findall(r"EXIT=(\d+) STOP_S=\d+", out) == ["0", "0"], out  # the inference worker, the broker
    assert {"checkpoints", "weights"} <= set(out.splitlines()), out
