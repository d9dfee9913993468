"""The dashboard in a real headless Chromium, as a person sees it after the JavaScript ran: a live `primerl rl` run
of the tiny model (the page updates without a reload, the workers table shows the inference worker at the version
it serves, the reward curve has a point per step), stopped with Ctrl-C once the page showed all that, then the
stopped run served from its directory by `primerl dashboard RUN_DIR` (every step's point; a completion holding HTML
shows as text, nothing injected).

The run's ``max_steps`` is far more than the live checks need, and the test stops it: a run of a fixed few steps
can end before the page has shown everything (on an idle machine 4 steps take ~10 s), and then the live checks
race the run's end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.browser import Browser, chromium_path
from support.probes import free_port

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
MAX_STEPS = 10_000  # never reached: the test stops the run with SIGINT once the live checks passed
STOP_TIMEOUT_S = 90
XSS = '<script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'"><b>bold</b>'
SCREENSHOT_ENV = "PRIMERL_DASHBOARD_SCREENSHOT"  # also save the live screenshot there (docs/images/dashboard.png)

pytestmark = pytest.mark.skipif(chromium_path() is None, reason="no chromium: `apt-get install -y chromium`")

REWARD_POINTS = (
    "Number((document.querySelector('polyline[data-metric=\"train/reward\"]') || {dataset: {points: 0}})"
    ".dataset.points)"
)
WORKERS = "[...document.querySelectorAll('#workers-table tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
QUEUES = WORKERS.replace("#workers-table", "#queues-table")


def run_env() -> dict[str, str]:
    env = {
        **os.environ,
        "PRIMERL_ENV_PYTHON": ENV_PYTHON,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PRIMERL_RUN_TOKEN", None)
    return env


def wait_for_line(path: Path, pattern: str, process: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, path.read_text() if path.exists() else "")
        if match:
            return match
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in the output:\n{path.read_text()[-4000:] if path.exists() else ''}")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_live_run_and_then_its_directory_in_a_real_browser(tiny_model, tmp_path):
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup`")
    run_dir = tmp_path / "run"
    out = tmp_path / "rl.out"
    argv = [
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
        str(MAX_STEPS),
    ]
    with out.open("w") as sink:
        rl = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=run_env(), cwd=tmp_path)
    try:
        url = wait_for_line(out, r"dashboard: (http://127\.0\.0\.1:\d+/\?token=\S+)", rl, 120)[1]
        with Browser() as browser:
            browser.open(url)
            browser.wait_for("document.body.dataset.polls >= 1", 30)
            browser.eval("window.loadedOnce = 'yes'")  # gone if the page ever reloads
            # live: a step the page showed, then a later one, in the same page
            first = int(browser.wait_for("Number(document.body.dataset.step) >= 1 && document.body.dataset.step", 150))
            later = browser.wait_for(f"Number(document.body.dataset.step) > {first} && document.body.dataset.step", 90)
            assert browser.eval("window.loadedOnce") == "yes" and int(later) > first
            seen = browser.eval("document.body.dataset.stepsSeen").split(",")
            assert len(seen) >= 2 and seen == sorted(seen, key=int), seen
            assert browser.eval("document.getElementById('run-state').textContent") == "training"
            # the workers table lists the inference worker, alive, at the version it serves
            serving = f"(rows => rows.some(r => r[1] === 'inference' && Number(r[4]) >= 1) && rows)({WORKERS})"
            rows = browser.wait_for(serving, 30)
            inference = [r for r in rows if r[1] == "inference"]
            assert len(inference) == 1 and inference[0][3] == "alive", rows
            served, lag = int(inference[0][4]), int(inference[0][5])
            latest = int(browser.eval("document.getElementById('run-version').textContent").removeprefix("policy v"))
            assert served >= 1 and 0 <= lag <= latest, (rows, latest)
            assert {"orchestrator", "trainer"} <= {r[1] for r in rows}, rows
            # the queues table: sizes in binary units, capacities as items and bytes
            queues = browser.eval(QUEUES)
            assert queues and all(
                re.fullmatch(r"\d+ items / \d+\.\d\d (KiB|MiB|GiB|TiB)|\d+ items / \d+ B", q[3]) for q in queues
            ), queues
            # the reward curve: one point per orchestrator step reported so far
            points = browser.wait_for(f"{REWARD_POINTS} >= 2 && {REWARD_POINTS}", 60)
            done = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert points <= len([r for r in done if r["role"] == "orchestrator" and "train/reward" in r])
            # sample rollouts are shown
            browser.wait_for("document.querySelectorAll('#rollout-list .rollout .tok').length > 0", 60)
            shot = browser.screenshot(tmp_path / "dashboard-live.png")
            assert shot.stat().st_size > 10_000
            if os.environ.get(SCREENSHOT_ENV):
                Path(os.environ[SCREENSHOT_ENV]).write_bytes(shot.read_bytes())
            assert not [line for line in browser.console if "exception" in line], browser.console
        assert rl.poll() is None, f"the run ended before the test stopped it:\n{out.read_text()[-4000:]}"
        rl.send_signal(signal.SIGINT)  # a person's Ctrl-C: the run stops gracefully, 128 + SIGINT
        assert rl.wait(STOP_TIMEOUT_S) == 128 + signal.SIGINT, out.read_text()[-4000:]
    finally:
        if rl.poll() is None:
            rl.send_signal(signal.SIGINT)
            rl.wait(60)

    # The finished run from its directory alone, with an untrusted completion that holds HTML.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewarded = sorted({r["step"] for r in rows if r["role"] == "orchestrator" and "train/reward" in r})
    last_trained = max(r["step"] for r in rows if r["role"] == "trainer")
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    sampled = sorted({r["step"] for r in records})
    assert rewarded == list(range(1, len(rewarded) + 1)) and len(rewarded) >= 2, rewarded
    assert sampled and set(sampled) <= set(rewarded) and sampled == list(range(1, len(sampled) + 1)), sampled
    evil = {**records[-1], "prompt": XSS, "tokens": [[XSS, -0.25, True], [" tail", -3.0, True]]}
    with (run_dir / "rollouts.jsonl").open("a") as handle:
        handle.write(json.dumps(evil) + "\n")
    serve_out = tmp_path / "dashboard.out"
    with serve_out.open("w") as sink:
        served = subprocess.Popen(
            [str(BIN / "primerl"), "dashboard", str(run_dir), "--no-broker"], stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        url = wait_for_line(serve_out, r"at (http://127\.0\.0\.1:\d+/\?token=\S+)", served, 60)[1]
        with Browser() as browser:
            browser.open(url.replace("token=", "token=wrong"))  # a wrong token shows nothing of the run
            browser.wait_for("document.body && document.body.innerText.includes('wrong login token')", 20)
            browser.open(url)
            browser.wait_for("document.body.dataset.polls >= 1", 30)
            assert browser.eval("document.body.dataset.state") == "stopped"  # no broker, before max_steps
            assert browser.eval(REWARD_POINTS) == len(rewarded)
            assert browser.eval("document.body.dataset.step") == str(last_trained)
            cards = browser.eval("[...document.querySelectorAll('#rollout-list .rollout')].map(c => c.textContent)")
            assert any(XSS in card for card in cards), cards  # shown as the text it is
            injected = "document.querySelectorAll('#rollout-list script, #rollout-list img, #rollout-list b').length"
            assert browser.eval(injected) == 0
            assert browser.eval("document.title") == "primerl dashboard"
            assert "max_steps" in browser.eval("document.getElementById('config-text').textContent")
    finally:
        served.send_signal(signal.SIGINT)  # it stops on it even where it inherited SIGINT ignored (CI's case)
        try:
            assert served.wait(30) == 0, serve_out.read_text()[-2000:]
        finally:
            if served.poll() is None:
                served.kill()
                served.wait(10)
