#!/usr/bin/env python
"""What the dashboard's run history costs the broker in memory: RSS added, against its bound.

    .venv/bin/python bench/broker_history_rss.py [--steps 2000] [--history-mib 16] [--metrics 120] [--rollout-kib 16]

Two fresh ``primerl-broker`` processes, side by side, get the same load over gRPC from one orchestrator client:
per step one ``ReportMetrics`` of ``--metrics`` metrics (what a step of the orchestrator and the trainer reports)
and two ``ReportRollouts`` records of ``--rollout-kib`` KiB (the dashboard's sample rollouts). One keeps the run
history at ``broker.history_max_bytes = --history-mib`` MiB, the other at 0 (a history of one item per list: the
baseline). The table shows each broker's RSS (``/proc/PID/status`` VmRSS) before and after, the history's bytes
(``primerl_broker_history_bytes``, read through ``GetRunHistory``) and the RSS added over the baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
MiB = 1 << 20
TOKEN = "bench-history-token"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_broker(work: Path, history_bytes: int) -> tuple[subprocess.Popen, dict]:
    ready = work / "ready.json"
    log = (work / "broker.log").open("w")
    proc = subprocess.Popen(
        [
            str(BIN / "primerl-broker"),
            "--grpc-port", "0", "--rollout-port", "0", "--weight-port", "0",
            "--spool-dir", str(work / "spool"),
            "--run-token", TOKEN,
            "--prometheus.enabled", "false",
            "--history-max-bytes", str(history_bytes),
            "--ready-file", str(ready),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the broker did not start: {(work / 'broker.log').read_text()[-2000:]}")
        time.sleep(0.05)
    time.sleep(0.3)
    return proc, json.loads(ready.read_text())


def load(address: str, args: argparse.Namespace) -> int:
    from primerl.client.control import ControlClient
    from primerl.runtime.config_common import BrokerClientConfig

    client = ControlClient(BrokerClientConfig(address=address, run_token=TOKEN), "orchestrator", "bench-orchestrator")
    client.register()
    metrics = {f"bench/metric_{i:03d}": float(i) for i in range(args.metrics)}
    pad = "x" * (args.rollout_kib * 1024 - 200)
    for step in range(1, args.steps + 1):
        client.report_metrics(step, metrics)
        records = [json.dumps({"step": step, "env_id": "bench", "rollout_id": i, "prompt": pad}) for i in range(2)]
        client.report_rollouts(step, records)
    history_bytes = client.get_run_history(args.steps + 1, 1 << 30, args.steps * 2 + 1).num_bytes
    client.close()
    return history_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--history-mib", type=int, default=16)
    parser.add_argument("--metrics", type=int, default=120)
    parser.add_argument("--rollout-kib", type=int, default=16)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="primerl-history-bench-") as tmp:
        for name, bound in (("history off (0)", 0), (f"history {args.history_mib} MiB", args.history_mib * MiB)):
            work = Path(tmp) / str(bound)
            work.mkdir()
            proc, ready = start_broker(work, bound)
            try:
                before = rss_bytes(proc.pid)
                started = time.monotonic()
                held = load(f"127.0.0.1:{ready['grpc_port']}", args)
                seconds = time.monotonic() - started
                after = rss_bytes(proc.pid)
            finally:
                proc.terminate()
                proc.wait(30)
            rows.append((name, before, after, held, seconds))
    load_avg = Path("/proc/loadavg").read_text().split()[:3]
    print(f"{args.steps} steps: {args.metrics} metrics + 2 x {args.rollout_kib} KiB sample rollouts each; "
          f"load {' '.join(load_avg)}")  # fmt: skip
    print(f"{'broker':<20} {'RSS before MiB':>15} {'RSS after MiB':>14} {'history MiB':>12} {'load s':>7}")
    for name, before, after, held, seconds in rows:
        print(f"{name:<20} {before / MiB:>15.1f} {after / MiB:>14.1f} {held / MiB:>12.2f} {seconds:>7.1f}")
    base, full = rows
    added = (full[2] - full[1]) - (base[2] - base[1])
    print(f"RSS added by the history: {added / MiB:.1f} MiB for {full[3] / MiB:.2f} MiB held "
          f"(bound {args.history_mib} MiB): {added / max(full[3], 1):.2f} x its bytes")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
