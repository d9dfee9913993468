#!/usr/bin/env python
"""Prometheus on a run: what being scraped costs the daemons, and how fast the broker's service discovery follows
workers that join and leave. Debian's ``prometheus`` with ``deploy/prometheus/prometheus.yml`` (scrape and discovery
refresh every ``--scrape-s``), against ``primerl rl`` of the tiny model.

    .venv/bin/python bench/prometheus_cost.py [--steps 60] [--pairs 2] [--scrape-s 5] [--model DIR]
        [--trainer-ranks 2] [--no-cost] [--no-discovery] [--quick]

Cost: runs alternate (off, on, off, on, ...); "on" has Prometheus scraping every daemon through ``/discovery``.
Figures per run, over trainer steps 10..N-10: the trainer's median ``perf/step_time_s``, the wall time per step, and
the CPU seconds per step of each role (its process and all its children: vLLM's engine, env workers) and of
Prometheus itself, read with psutil at both ends of the window.

Discovery: one run with Prometheus started first (so it sees every registration), ``--trainer-ranks`` trainer
ranks, and a second inference worker (``primerl-infer``) started mid-run and then stopped with SIGTERM. For each
target: its labels, the time from the worker's registration (``registered_unix_ms`` of ``primerl status --json``)
to its first successful scrape (``lastScrape`` of Prometheus' targets API, polled every 0.2 s), and for the
stopped worker the time from its exit to its leaving Prometheus' active targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil
import yaml
from cpu_info import cpu_phrase
from primerl_runs import OFFLINE_ENV, free_port

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
DEPLOY = REPO_ROOT / "deploy" / "prometheus"
FROM_STEP = 10
TAIL_STEPS = 10  # steps after the window: the per-scrape cost is measured while the run still goes


def child_env() -> dict[str, str]:
    env = {**os.environ, **OFFLINE_ENV}
    env.pop("PRIMERL_RUN_TOKEN", None)
    return env


def trainer_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("role") == "trainer":
            rows.append(row)
    return rows


def wait_for_step(run: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 900) -> float:
    deadline = time.monotonic() + timeout_s
    while max((r["step"] for r in trainer_rows(run_dir)), default=0) < step:
        if run.poll() is not None:
            raise SystemExit(f"primerl rl exited ({run.returncode}); see {run_dir / 'rl.out'}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no trainer step {step} within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic()


def cpu_by_pid(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid`` and of every descendant alive now, by pid."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    seen = {}
    for process in processes:
        try:
            times = process.cpu_times()
            seen[process.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return seen


class CpuMeter:
    """CPU seconds of process trees, sampled every 0.5 s so that a child that exits in the window (an env worker,
    vLLM's helpers) still counts with what it used until its last sample."""

    def __init__(self, roots: dict[str, int]):
        self.roots = roots
        self.last: dict[str, dict[int, float]] = {name: {} for name in roots}
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, dict[int, float]]:
        for name, pid in self.roots.items():
            self.last[name].update(cpu_by_pid(pid))
        return {name: dict(by_pid) for name, by_pid in self.last.items()}

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def used(start: dict[str, dict[int, float]], end: dict[str, dict[int, float]]) -> dict[str, float]:
        return {name: sum(v - start[name].get(pid, 0.0) for pid, v in end[name].items()) for name in end}


def scrape_cost_ms(targets: dict[str, dict], roots: dict[str, int], token: str, scrapes: int = 50) -> dict[str, float]:
    """CPU milliseconds one scrape of each daemon's /metrics costs that daemon (``scrapes`` in a row)."""
    costs = {}
    for target in targets.values():
        role = target["labels"]["role"]
        if role not in roots:
            continue
        before = sum(cpu_by_pid(roots[role]).values())
        try:
            for _ in range(scrapes):
                httpx.get(target["scrapeUrl"], headers={"Authorization": f"Bearer {token}"}, timeout=10)
        except httpx.HTTPError:
            continue  # the daemon is gone (the run ended): no figure for it
        costs[role] = (sum(cpu_by_pid(roots[role]).values()) - before) / scrapes * 1000
    return costs


def start_rl(model: Path, run_dir: Path, steps: int, metrics_port: int, *extra: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True)
    argv = [str(BIN / "primerl"), "rl", "@", str(EXAMPLE), "--model.name", str(model), "--output-dir", str(run_dir)]
    argv += ["--max-steps", str(steps), "--no-dashboard", "--broker.prometheus.port", str(metrics_port), *extra]
    out = open(run_dir / "rl.out", "w")
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=run_dir.parent)


def start_prometheus(directory: Path, metrics_port: int, scrape_s: float, token: str | None) -> tuple:
    """Debian's prometheus with the shipped config and rules, pointed at the broker; the token file may be filled
    later (``token=None``: Prometheus retries discovery until it is)."""
    directory.mkdir(parents=True)
    shutil.copytree(DEPLOY / "rules", directory / "rules")
    (directory / "run-token").write_text(token or "")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    interval = f"{scrape_s:g}s"
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    [sd] = config["scrape_configs"][0]["http_sd_configs"]
    sd.update(url=f"http://127.0.0.1:{metrics_port}/discovery", refresh_interval=interval)
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(directory / "prometheus.log", "w"),
    )
    return process, port


def run_token(run_dir: Path, run: subprocess.Popen, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "run.json").exists():
        if run.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"no run.json; see {run_dir / 'rl.out'}")
        time.sleep(0.1)
    return json.loads((run_dir / "run.json").read_text())["run_token"]


def stop(process: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 120) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


# -- cost ----------------------------------------------------------------------------------------------------------


def cost_run(model: Path, work: Path, steps: int, scrape_s: float, scraped: bool) -> dict:
    run_dir, metrics_port = work / "run", free_port()
    run = start_rl(model, run_dir, steps, metrics_port)
    prometheus, meter, per_scrape = None, None, {}
    try:
        token = run_token(run_dir, run)
        if scraped:
            prometheus, prometheus_port = start_prometheus(work / "prometheus", metrics_port, scrape_s, token)
        wait_for_step(run, run_dir, FROM_STEP)
        pids = json.loads((run_dir / "pids.json").read_text())
        meter = CpuMeter({**pids, **({"prometheus": prometheus.pid} if prometheus else {})})
        start, started_s = meter.sample(), time.monotonic()
        wait_for_step(run, run_dir, steps - TAIL_STEPS)
        end, ended_s = meter.sample(), time.monotonic()
        if scraped:
            per_scrape = scrape_cost_ms(active_targets(prometheus_port), pids, token)
        if run.wait(600) != 0:
            raise SystemExit(f"the run failed; see {run_dir / 'rl.out'}")
    finally:
        if meter is not None:
            meter.stop()
        stop(run)
        if prometheus is not None:
            stop(prometheus, signal.SIGTERM)
    window = steps - TAIL_STEPS - FROM_STEP
    step_times = [r["perf/step_time_s"] for r in trainer_rows(run_dir) if FROM_STEP < r["step"] <= steps - TAIL_STEPS]
    used = CpuMeter.used(start, end)
    return {
        "median_step_s": statistics.median(step_times),
        "wall_per_step_s": (ended_s - started_s) / window,
        "cpu_per_step_s": {name: value / window for name, value in used.items()},
        "cpu_ms_per_scrape": per_scrape,
    }


def measure_cost(args: argparse.Namespace, model: Path, tmp: Path) -> None:
    results: dict[bool, list[dict]] = {False: [], True: []}
    for pair in range(args.pairs):
        for scraped in (False, True):
            load = Path("/proc/loadavg").read_text().split()[0]
            result = cost_run(model, tmp / f"cost-{pair}-{int(scraped)}", args.steps, args.scrape_s, scraped)
            results[scraped].append(result)
            cpu = ", ".join(f"{name} {value:.3f}" for name, value in sorted(result["cpu_per_step_s"].items()))
            per_scrape = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(result["cpu_ms_per_scrape"].items()))
            print(
                f"pair {pair} scraped {'on ' if scraped else 'off'}: median step {result['median_step_s']:.3f} s, "
                f"wall {result['wall_per_step_s']:.3f} s/step, CPU s/step: {cpu} (load {load})"
                + (f"; CPU ms per scrape of /metrics: {per_scrape}" if per_scrape else ""),
                flush=True,
            )
    print("\n| role | CPU s/step off (runs) | on (runs) | on/off (medians) |\n|---|---|---|---|")
    roles = sorted(results[True][0]["cpu_per_step_s"])
    for role in roles:
        off = [r["cpu_per_step_s"].get(role) for r in results[False] if role in r["cpu_per_step_s"]]
        on = [r["cpu_per_step_s"][role] for r in results[True]]
        ratio = f"{statistics.median(on) / statistics.median(off):.3f}" if off else "-"
        print(
            f"| {role} | {', '.join(f'{v:.3f}' for v in off) or '-'} | {', '.join(f'{v:.3f}' for v in on)} | {ratio} |"
        )
    for key, label in (("median_step_s", "trainer median step s"), ("wall_per_step_s", "wall s per step")):
        off = [r[key] for r in results[False]]
        on = [r[key] for r in results[True]]
        print(
            f"| {label} | {', '.join(f'{v:.3f}' for v in off)} | {', '.join(f'{v:.3f}' for v in on)} | "
            f"{statistics.median(on) / statistics.median(off):.3f} |"
        )


# -- discovery -----------------------------------------------------------------------------------------------------


def active_targets(port: int) -> dict[str, dict]:
    answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets?state=active", timeout=10).json()
    return {t["labels"]["worker"]: t for t in answer["data"]["activeTargets"]}


def scrape_time(target: dict) -> float:
    return datetime.fromisoformat(target["lastScrape"].replace("Z", "+00:00")).timestamp()


def registrations(run_dir: Path) -> dict[str, float]:
    status = subprocess.run(
        [str(BIN / "primerl"), "status", str(run_dir), "--json"], capture_output=True, text=True, timeout=60
    )
    workers = json.loads(status.stdout).get("workers", [])
    return {w["name"]: int(w["registered_unix_ms"]) / 1000 for w in workers if w.get("state") == "WORKER_STATE_ALIVE"}


def watch_targets(port: int, first_up: dict[str, float], seen: dict[str, dict], until) -> None:
    while not until():
        try:
            for name, target in active_targets(port).items():
                seen[name] = target
                if target["health"] == "up" and name not in first_up:
                    first_up[name] = scrape_time(target)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def measure_discovery(args: argparse.Namespace, model: Path, tmp: Path) -> None:
    run_dir, metrics_port = tmp / "discovery" / "run", free_port()
    prometheus, port = start_prometheus(tmp / "discovery" / "prometheus", metrics_port, args.scrape_s, None)
    ranks = ["--trainer-gpu-ids", json.dumps(list(range(1, args.trainer_ranks + 1)))]
    run = start_rl(model, run_dir, 100_000, metrics_port, *ranks)
    extra = None
    try:
        (tmp / "discovery" / "prometheus" / "run-token").write_text(run_token(run_dir, run))
        first_up: dict[str, float] = {}
        seen: dict[str, dict] = {}
        wait_for_step(run, run_dir, 3)
        deadline = time.monotonic() + 60
        watch_targets(port, first_up, seen, lambda: len(first_up) >= 4 or time.monotonic() > deadline)
        env = {**child_env(), "PRIMERL_RUN_TOKEN": run_token(run_dir, run)}
        broker = json.loads((run_dir / "run.json").read_text())["broker_address"]
        extra_log = open(run_dir / "extra-inference.log", "w")
        extra = subprocess.Popen(
            [str(BIN / "primerl-infer"), "@", str(run_dir / "inference.toml"), "--server.port", "0"]
            + ["--broker.address", broker],
            stdout=extra_log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=run_dir,
        )
        deadline = time.monotonic() + 300
        names = set(first_up)
        watch_targets(port, first_up, seen, lambda: len(set(first_up) - names) >= 1 or time.monotonic() > deadline)
        registered = registrations(run_dir)
        [joined] = sorted(set(first_up) - names) or [None]
        if joined is None:
            raise SystemExit(f"the second inference worker never became a target; see {run_dir}/extra-inference.log")
        extra.send_signal(signal.SIGTERM)
        extra.wait(120)
        left_s = time.time()
        while joined in active_targets(port):
            if time.time() - left_s > 120:
                raise SystemExit("the stopped worker stayed a target for 120 s")
            time.sleep(0.2)
        gone_s = time.time() - left_s
        print(f"\nscrape interval and discovery refresh: {args.scrape_s:g} s; trainer ranks: {args.trainer_ranks}")
        print("| target | role | host | run_id | registered -> first scrape up (s) |\n|---|---|---|---|---|")
        for name, target in sorted(seen.items(), key=lambda item: item[1]["labels"]["role"]):
            labels = target["labels"]
            delay = first_up[name] - registered[name] if name in registered and name in first_up else None
            print(
                f"| {name} | {labels['role']} | {labels['host']} | {labels['run_id']} | "
                f"{'-' if delay is None else f'{delay:.2f}'} |"
            )
        print(f"\n{joined} stopped (SIGTERM, deregistered): gone from Prometheus' active targets {gone_s:.2f} s later")
    finally:
        if extra is not None:
            stop(extra, signal.SIGTERM)
        stop(run)
        stop(prometheus, signal.SIGTERM)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--scrape-s", type=float, default=5.0)
    parser.add_argument("--trainer-ranks", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="a tiny model (default: one built by init-tiny-model)")
    parser.add_argument("--no-cost", action="store_true")
    parser.add_argument("--no-discovery", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one pair of 30-step runs (for trying the harness)")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps = 1, 30
    if shutil.which("prometheus") is None:
        raise SystemExit("no prometheus binary: apt-get install prometheus")
    with tempfile.TemporaryDirectory(prefix="primerl-prometheus-cost-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model
        if model is None:
            model = tmp / "tiny-model"
            subprocess.run([str(BIN / "primerl"), "init-tiny-model", str(model)], check=True, capture_output=True)
        print(f"CPU: {cpu_phrase()}; 1-min load at start {Path('/proc/loadavg').read_text().split()[0]}")
        if not args.no_discovery:
            measure_discovery(args, model.resolve(), tmp)
        if not args.no_cost:
            measure_cost(args, model.resolve(), tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
