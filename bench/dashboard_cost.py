#!/usr/bin/env python
"""What watching a run on its dashboard costs the run: `primerl rl` of the tiny model with `--no-dashboard`
against the same run with the dashboard served and polled as an open page polls it, side by side.

    .venv/bin/python bench/dashboard_cost.py [--steps 10] [--pairs 2] [--model runs/demo/tiny-model]

Runs alternate (off, on, off, on, ...). "on": the dashboard `primerl rl` serves, read by a poller in this process
that fetches every route the page fetches (`/api/run`, `metrics`, `workers`, `queues`, `events`, `rollouts`)
every 2 s, as the page does, for the whole run. Figures per run: the trainer's median `perf/step_time_s` over
steps 2..N and the wall time from the first to the last trainer step (`metrics.jsonl`). The ratio on / off of
the medians over the pairs is printed with the machine's load: on a shared machine, look at the spread of the
"off" runs before reading anything into the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
ROUTES = ("/api/run", "/api/metrics", "/api/workers", "/api/queues", "/api/events", "/api/rollouts")
POLL_S = 2.0


def poll(url: str, stop: threading.Event, counts: list, errors: list[str]) -> None:
    """What an open page fetches every 2 s: every route, metrics and rollouts from the index it has."""
    base, token = url.split("/?token=")
    since = {"/api/metrics": 0, "/api/rollouts": 0}
    while not stop.wait(POLL_S):
        for route in ROUTES:
            path = f"{route}?since={since[route]}" if route in since else route
            request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    data = json.loads(response.read())
                if route in since:
                    since[route] = data["next"]
                counts[0] += 1
            except OSError as err:
                counts[1] += 1
                if len(errors) < 5:
                    errors.append(f"{route}: {err}")


def one_run(model: Path, work: Path, steps: int, dashboard: bool) -> dict:
    run_dir = work / "run"
    out = work / "rl.out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PRIMERL_RUN_TOKEN", None)
    argv = [str(BIN / "primerl"), "rl", "@", str(EXAMPLE), "--model.name", str(model), "--output-dir", str(run_dir)]
    argv += ["--max-steps", str(steps), *([] if dashboard else ["--no-dashboard"])]
    stop = threading.Event()
    counts = [0, 0]
    errors: list[str] = []
    with out.open("w") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=work)
    poller = None
    try:
        while dashboard and poller is None and process.poll() is None:
            match = re.search(r"dashboard: (http://\S+)", out.read_text())
            if match:
                poller = threading.Thread(target=poll, args=(match[1], stop, counts, errors), daemon=True)
                poller.start()
            time.sleep(0.2)
        if process.wait(1800) != 0:
            raise SystemExit(f"the run failed:\n{out.read_text()[-3000:]}")
    finally:
        stop.set()
        if process.poll() is None:
            process.terminate()
            process.wait(60)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer = [r for r in rows if r["role"] == "trainer"]
    step_times = [r["perf/step_time_s"] for r in trainer if r["step"] >= 2 and "perf/step_time_s" in r]
    return {
        "median_step_s": statistics.median(step_times),
        "wall_s": trainer[-1]["time"] - trainer[0]["time"],
        "requests": counts[0],
        "failed": counts[1],
        "errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "runs" / "demo" / "tiny-model")
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {False: [], True: []}
    loads = []
    with tempfile.TemporaryDirectory(prefix="primerl-dashboard-cost-") as tmp:
        for pair in range(args.pairs):
            for dashboard in (False, True):
                work = Path(tmp) / f"{pair}-{'on' if dashboard else 'off'}"
                work.mkdir()
                loads.append(Path("/proc/loadavg").read_text().split()[0])
                result = one_run(args.model.resolve(), work, args.steps, dashboard)
                results[dashboard].append(result)
                state = "on " if dashboard else "off"
                print(f"pair {pair} dashboard {state}: median step {result['median_step_s']:.2f} s, steps 1.."
                      f"{args.steps} in {result['wall_s']:.1f} s, {result['requests']} API requests"
                      f" ({result['failed']} failed{': ' if result['errors'] else ''}{'; '.join(result['errors'])}),"
                      f" load {loads[-1]}", flush=True)  # fmt: skip
    off = statistics.median(r["median_step_s"] for r in results[False])
    on = statistics.median(r["median_step_s"] for r in results[True])
    spread = [r["median_step_s"] for r in results[False]]
    print(f"median trainer step: off {off:.2f} s, on {on:.2f} s, on/off {on / off:.3f}; off runs ranged "
          f"{min(spread):.2f}-{max(spread):.2f} s; 1-min load at the starts: {', '.join(loads)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
