#!/usr/bin/env python
"""One broker for a fleet: a real `primerl-broker` process under N simulated inference workers, M trainer ranks and
K orchestrators (``tests/support/fleet.py``: the project's own clients, in a few processes), at several N; then a
SIGKILL and restart of the broker under N = 1,000 (the thundering herd).

    .venv/bin/python bench/fleet_sim.py                       # N = 10, 100, 1000 (M = 64, K = 8), 120 s each, herd
    .venv/bin/python bench/fleet_sim.py --quick               # N = 10, 100 for 20 s, herd at 100
    .venv/bin/python bench/fleet_sim.py --points 1000 --fanout star --hold-s 60 --no-herd

Per scale point, while every member heartbeats (1 s) and a step is taken every ``--step-s`` (trainer rank 0, here:
commit, metrics, publish a small FULL update that every inference worker acknowledges): the broker's CPU (cores)
and RSS (psutil on its pid), the simulator's CPU, heartbeat round trips p50/p99 (as the members' heartbeat threads
saw them), ``GetRunStatus`` latency and size (one caller, as `primerl status`), four status streams (as
`primerl status --watch`), the dashboard's ``/api/workers`` body (in process, over ``BrokerSource``), LOST marks of
members that were heartbeating, and the time from publish to the last of the N acknowledgements.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import psutil  # noqa: E402
from cpu_info import cpu_phrase  # noqa: E402
from report import command_line, machine_load, markdown_table, save_curves  # noqa: E402
from support.fleet import Fleet, FleetBroker, RunDriver, fleet_members  # noqa: E402

from primerl.runtime.log_setup import configure_logging  # noqa: E402

NUM_WATCHERS = 4


def fmt_s(seconds: float | None) -> str:
    return "not all within 60 s" if seconds is None else f"{seconds:.2f}"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Driver(RunDriver):
    """The run (``RunDriver``) plus what reads the status: the status streams and the dashboard's source."""

    def __init__(self, broker: FleetBroker, num_trainer_ranks: int):
        super().__init__(broker, num_trainer_ranks)
        self.stop = threading.Event()
        self.watch_messages = 0
        self.watchers = [threading.Thread(target=self._watch, daemon=True) for _ in range(NUM_WATCHERS)]
        for watcher in self.watchers:
            watcher.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                stream = self.observer.watch_run_status(min_interval_ms=500, timeout_s=30)
                for _ in stream:
                    self.watch_messages += 1
                    if self.stop.is_set():
                        stream.cancel()
            except Exception:
                self.stop.wait(1.0)

    def status_probe(self) -> tuple[float, int]:
        started = time.monotonic()
        status = self.observer.get_run_status(timeout_s=10)
        return time.monotonic() - started, status.ByteSize()

    def dashboard_probe(self) -> float:
        """One ``/api/workers`` body from a dashboard whose cache is empty (it asks the broker), over the
        observer's channel."""
        from primerl.dashboard.server import Dashboard
        from primerl.dashboard.sources import BrokerSource

        started = time.monotonic()
        Dashboard(broker=BrokerSource(self.observer)).api("/api/workers", {})
        return time.monotonic() - started

    def close(self) -> None:
        self.stop.set()
        super().close()


def sim_cpu_s(fleet: Fleet) -> float:
    total = 0.0
    for process in fleet.processes:
        try:
            times = psutil.Process(process.pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def hold(driver: Driver, fleet: Fleet, hold_s: float, step_s: float, names: set[str]) -> dict:
    """Measure for `hold_s` (see the module docstring)."""
    fleet.take_heartbeats()
    cpu0, sim0, t0, unix0 = driver.broker.cpu_s(), sim_cpu_s(fleet), time.monotonic(), time.time()
    rss, status_s, sizes, dash_s, ack_s = [], [], [], [], []
    next_step = t0 + 2.0
    registrations0 = dict(fleet.registrations)
    while time.monotonic() - t0 < hold_s:
        tick = time.monotonic()
        fleet.drain(1.0)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))  # one probe a second
        fleet.drain()
        rss.append(driver.broker.rss_bytes())
        latency, size = driver.status_probe()
        status_s.append(latency)
        sizes.append(size)
        dash_s.append(driver.dashboard_probe())
        if time.monotonic() >= next_step:
            try:
                took = driver.take_step(fleet, names)
            except Exception as err:  # an overloaded broker: the step failed; the table says so
                print(f"step {driver.step} failed: {err!r}"[:300], flush=True)
                took = None
            ack_s.append(float("inf") if took is None else took)
            next_step = time.monotonic() + step_s
    elapsed = time.monotonic() - t0
    fleet.drain(0.5)
    heartbeats, probed = fleet.take_heartbeats()
    again = sum(max(0, n - registrations0.get(name, n)) for name, n in fleet.registrations.items())
    return {
        "broker_cores": (driver.broker.cpu_s() - cpu0) / elapsed,
        "sim_cores": (sim_cpu_s(fleet) - sim0) / elapsed,
        "rss_mib": max(rss) / 2**20,
        "hb_p50_ms": 1000 * (pct(heartbeats, 0.5) or 0),
        "hb_p99_ms": 1000 * (pct(heartbeats, 0.99) or 0),
        "num_heartbeats": len(heartbeats),
        "probe_p50_ms": 1000 * (pct(probed, 0.5) or 0),
        "probe_p99_ms": 1000 * (pct(probed, 0.99) or 0),
        "status_p50_ms": 1000 * pct(status_s, 0.5),
        "status_max_ms": 1000 * max(status_s),
        "status_bytes": max(sizes),
        "dashboard_p50_ms": 1000 * pct(dash_s, 0.5),
        "ack_all_s": ack_s,
        "lost": len(driver.lost_events(unix0)),
        "reregistered": again,
        "watch_messages_per_s": 0.0,
        "seconds": elapsed,
    }


def scale_point(args, n: int, fanout: str, tmp: Path) -> dict:
    broker = FleetBroker(tmp, "--weight-fanout", fanout, "--max-weight-connections", "8192")
    members = fleet_members(n, args.trainers, args.orchestrators)
    names = {m.name for m in members if m.role == "inference"}
    fleet = Fleet(
        members,
        min(args.processes, max(1, len(members) // 8)),
        address=broker.address,
        run_token=broker.run_token,
        relay=fanout == "chain",
        start_spread_s=min(10.0, len(members) / 100),
        probe=True,
        nice=args.sim_nice,
    )
    driver = Driver(broker, args.trainers)
    try:
        took = driver.wait_registered(fleet, len(members) + 1, 120)
        if took is None:
            raise RuntimeError(f"the fleet did not register within 120 s ({driver.num_alive()} of {len(members) + 1})")
        time.sleep(3)  # the subscribers say HELLO
        watch0, w0 = driver.watch_messages, time.monotonic()
        result = hold(driver, fleet, args.hold_s, args.step_s, names)
        result["watch_messages_per_s"] = (driver.watch_messages - watch0) / (time.monotonic() - w0)
        result.update(n=n, m=args.trainers, k=args.orchestrators, fanout=fanout, register_s=took)
        result["sim_errors"] = len(fleet.errors)
        result["interval_s"] = driver.trainer.heartbeat_interval_s
        result["sim_nice"] = args.sim_nice
        return result
    finally:
        driver.close()
        fleet.close()
        broker.stop()


def herd(args, n: int, tmp: Path) -> dict:
    """SIGKILL the broker under a running fleet of `n`, restart it on the same ports and spool; who comes back."""
    broker = FleetBroker(tmp, "--weight-fanout", "chain", "--max-weight-connections", "8192")
    members = fleet_members(n, args.trainers, args.orchestrators)
    names = {m.name for m in members if m.role == "inference"}
    fleet = Fleet(
        members,
        args.processes,
        address=broker.address,
        run_token=broker.run_token,
        relay=True,
        start_spread_s=10,
        nice=args.sim_nice,
    )
    driver = Driver(broker, args.trainers)
    try:
        if driver.wait_registered(fleet, len(members) + 1, 120) is None:
            raise RuntimeError("the fleet did not register")
        time.sleep(3)
        before = driver.take_step(fleet, names)
        broker.kill()
        killed = time.monotonic()
        broker.start()
        restarted_s = time.monotonic() - killed
        rss = []
        back = None
        while time.monotonic() - killed < 120:
            fleet.drain(0.5)
            rss.append(broker.rss_bytes())
            if driver.num_alive() >= len(members) + 1:
                back = time.monotonic() - killed
                break
        recovered_unix = time.time()
        cpu0 = broker.cpu_s()
        watch_s = 60.0 if not args.quick else 20.0
        time.sleep(watch_s)
        fleet.drain(1.0)
        after = driver.take_step(fleet, names)
        once_more = [name for name, count in fleet.registrations.items() if count > 2]
        never = [name for name, count in fleet.registrations.items() if count < 2]
        return {
            "n": n,
            "restart_s": restarted_s,
            "all_registered_s": back,
            "lost_after": len(driver.lost_events(recovered_unix)),
            "registered_more_than_twice": len(once_more),
            "never_back": len(never),
            "peak_rss_mib": max(rss) / 2**20 if rss else 0.0,
            "cores_after": (broker.cpu_s() - cpu0) / watch_s,
            "ack_before_s": before,
            "ack_after_s": after,
            "step_after": driver.step,
        }
    finally:
        driver.close()
        fleet.close()
        broker.stop()


def markdown(args, results: list[dict], herds: list[dict]) -> str:
    lines = [
        f"### fleet. One broker for a fleet: cost against N, and a broker restart under a thundering herd — "
        f"{cpu_phrase()}, {time.strftime('%Y-%m-%d')}",
        "",
        f"`{command_line()}`; {machine_load()}. Heartbeats every 1 s (liveness 5), a step every {args.step_s:g} s "
        f"(commit, metrics, a 1 KiB FULL update acknowledged by every inference worker), {NUM_WATCHERS} status "
        "streams, `GetRunStatus` and the dashboard's `/api/workers` once a second.",
        "",
    ]
    header = [
        "N", "M", "K", "fanout", "held s", "broker cores", "sim cores", "broker RSS MiB", "interval s",
        "hb p50/p99 ms (members)", "hb p50/p99 ms (lone probe)",
        "status p50/max ms", "status bytes", "dashboard ms", "ack all N s (each step)", "false LOST", "re-registered",
    ]  # fmt: skip
    rows = [
        [
            r["n"], r["m"], r["k"], r["fanout"], f"{r['seconds']:.0f}", f"{r['broker_cores']:.3f}",
            f"{r['sim_cores']:.2f}", f"{r['rss_mib']:.0f}", f"{r['interval_s']:.2f}",
            f"{r['hb_p50_ms']:.1f}/{r['hb_p99_ms']:.0f}", f"{r['probe_p50_ms']:.1f}/{r['probe_p99_ms']:.0f}",
            f"{r['status_p50_ms']:.0f}/{r['status_max_ms']:.0f}", r["status_bytes"], f"{r['dashboard_p50_ms']:.0f}",
            " ".join(f"{s:.2f}" for s in r["ack_all_s"]), r["lost"], r["reregistered"],
        ]
        for r in results
    ]  # fmt: skip
    lines += [markdown_table(header, rows), ""]
    if herds:
        header = ["N", "broker restart s", "all registered s", "LOST after", "registered > 2x", "never back",
                  "peak RSS MiB", "cores after", "ack all N before / after s", "step after"]  # fmt: skip
        rows = [
            [h["n"], f"{h['restart_s']:.1f}", h["all_registered_s"] and f"{h['all_registered_s']:.1f}", h["lost_after"],
             h["registered_more_than_twice"], h["never_back"], f"{h['peak_rss_mib']:.0f}", f"{h['cores_after']:.3f}",
             f"{fmt_s(h['ack_before_s'])} / {fmt_s(h['ack_after_s'])}", h["step_after"]]
            for h in herds
        ]  # fmt: skip
        lines += ["Herd (SIGKILL with the run in progress, restart on the same ports and spool):", ""]
        lines += [markdown_table(header, rows), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 10, 100 for 20 s; herd at 100")
    parser.add_argument("--points", default=None, help="comma-separated N (default 10,100,1000)")
    parser.add_argument("--trainers", type=int, default=64, help="M trainer ranks")
    parser.add_argument("--orchestrators", type=int, default=8, help="K orchestrators")
    parser.add_argument("--fanout", default="chain", help="comma-separated: star, chain")
    parser.add_argument("--hold-s", type=float, default=None, help="seconds per scale point (default 120)")
    parser.add_argument("--step-s", type=float, default=15.0)
    parser.add_argument("--processes", type=int, default=4, help="simulator processes")
    parser.add_argument(
        "--sim-nice",
        type=int,
        default=0,
        help="niceness of the simulated members' processes (e.g. 10: they yield the CPU to the broker, the driver "
        "and the latency probe, as a fleet on other machines would; default %(default)s)",
    )
    parser.add_argument("--herd", type=int, default=None, help="N of the restart test (default 1000; 0: none)")
    parser.add_argument("--no-herd", action="store_true")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--plots", type=Path, default=ROOT / "bench" / "plots", help="where the cost-against-N plots go (PNG)"
    )
    args = parser.parse_args()
    configure_logging("bench", "fleet", level="warning")
    points = [int(p) for p in (args.points or ("10,100" if args.quick else "10,100,1000")).split(",")]
    args.hold_s = args.hold_s or (20.0 if args.quick else 120.0)
    herd_n = 0 if args.no_herd else (args.herd if args.herd is not None else (100 if args.quick else 1000))
    results, herds = [], []
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        for fanout in args.fanout.split(","):
            for n in points:
                point_dir = Path(tmp) / f"{fanout}-{n}"
                point_dir.mkdir()
                results.append(scale_point(args, n, fanout, point_dir))
                print(json.dumps(results[-1]), flush=True)
        if herd_n:
            herd_dir = Path(tmp) / "herd"
            herd_dir.mkdir()
            herds.append(herd(args, herd_n, herd_dir))
            print(json.dumps(herds[-1]), flush=True)
    text = markdown(args, results, herds)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"points": results, "herds": herds}, indent=1))
    for path in plot_points(results, args.plots):
        print(f"plot: {path}")
    return 0


def plot_points(results: list[dict], out_dir: Path) -> list[Path]:
    """Cost against N, one PNG per unit, both axes logarithmic (slope 1: linear growth); one line per fan-out mode.
    Nothing with fewer than two scale points."""
    by_fanout: dict[str, list[dict]] = {}
    for point in results:
        by_fanout.setdefault(point["fanout"], []).append(point)
    series = {fanout: sorted(points, key=lambda p: p["n"]) for fanout, points in by_fanout.items() if len(points) > 1}
    if not series:
        return []

    def curves(fields: dict[str, str]) -> dict[str, tuple[list[float], list[float]]]:
        return {
            f"{label} ({fanout})": ([p["n"] for p in points], [max(p[field], 1e-3) for p in points])
            for fanout, points in series.items()
            for field, label in fields.items()
        }

    xlabel = "N inference workers (+ M trainer ranks, K orchestrators)"
    cpu = cpu_phrase()
    return [
        save_curves(
            out_dir / "fleet_broker_cost.png",
            f"broker cost against the fleet, {cpu}",
            xlabel,
            "cores / MiB",
            curves(
                {"broker_cores": "broker CPU, cores", "sim_cores": "simulator CPU, cores", "rss_mib": "broker RSS, MiB"}
            ),
            log_scale=True,
        ),
        save_curves(
            out_dir / "fleet_latency.png",
            f"control-plane latency against the fleet, {cpu}",
            xlabel,
            "ms",
            curves(
                {
                    "hb_p99_ms": "heartbeat p99 (members)",
                    "probe_p99_ms": "heartbeat p99 (lone probe)",
                    "status_p50_ms": "GetRunStatus p50",
                    "dashboard_p50_ms": "dashboard /api p50",
                }
            ),
            log_scale=True,
        ),
        save_curves(
            out_dir / "fleet_status_bytes.png",
            f"run status size against the fleet, {cpu}",
            xlabel,
            "bytes",
            curves({"status_bytes": "GetRunStatus bytes"}),
            log_scale=True,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
