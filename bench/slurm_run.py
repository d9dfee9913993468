#!/usr/bin/env python
"""The scheduler's overhead: a `primerl slurm` run on a local SLURM cluster (4 network-namespace nodes, Debian's
slurm-wlm: ``tests/support/slurm_cluster.py``) beside the same run under `primerl rl` on this host, alternately,
``--repeats`` times each. The SLURM run is tests/test_slurm.py's scenario (``tests/support/slurm_run.py``):
add-inference mid-run and cancelled, the broker's node lost (drained, its step killed) and its job requeued
onto another node.

    .venv/bin/python bench/slurm_run.py [--repeats 3] [--max-steps 40] [--model runs/demo/tiny-model]
    .venv/bin/python bench/slurm_run.py --add-cycles 3      # add-inference -> serving with nothing else going on

Prints, per run and as median [min-max]: launch -> step 1 done, the median step time, add-inference -> the new
worker serving, the broker's node lost -> the broker ready on another node, and -> every role with it and a step
done. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_info import cpu_phrase  # noqa: E402
from support.slurm_cluster import SlurmCluster, slurm_available  # noqa: E402 (tests/ is on the path only now)
from support.slurm_run import BIN, add_inference_cycles, jobs_scenario, local_run  # noqa: E402


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]" if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slurm_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "demo" / "tiny-model")
    parser.add_argument(
        "--add-cycles",
        type=int,
        default=0,
        metavar="N",
        help="instead: one long run, N times add-inference (timed until the worker serves) and scancel of it",
    )
    args = parser.parse_args(argv)
    ok, why = slurm_available()
    if not ok:
        print(f"slurm_run: cannot run a local SLURM cluster here: {why}", file=sys.stderr)
        return 2
    if not (args.model / "config.json").exists():
        subprocess.run([str(BIN / "primerl"), "init-tiny-model", str(args.model)], check=True, timeout=300)
    print(f"CPU: {cpu_phrase()}", flush=True)
    if args.add_cycles:
        return add_cycles(args.model.resolve(), args.add_cycles)
    rows: dict[str, list] = {"slurm": [], "primerl rl": []}
    for repeat in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="prl-slurm-bench-"))
        work.chmod(0o755)  # munged wants every directory above its socket searchable
        try:
            local = local_run(args.model.resolve(), work / "local", args.max_steps)
            rows["primerl rl"].append(local)
            print(f"[{repeat + 1}] primerl rl: launch -> step 1 {local.first_step_s:.1f} s; step {local.step_s:.2f} s")
            with SlurmCluster.create(["n1", "n2", "n3", "n4"], work / "cluster") as cluster:
                report = jobs_scenario(cluster, args.model.resolve(), work / "slurm", args.max_steps)
            rows["slurm"].append(report)
            print(f"[{repeat + 1}] slurm: {report.summary()}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    header = [
        "run",
        "launch -> step 1 s",
        "step s (median)",
        "add-inference -> serving s",
        "node lost -> broker back s",
    ]
    print("\n| " + " | ".join([*header, "-> roles back, a step s"]) + " |")
    print("|---|---|---|---|---|---|")
    for name, reports in rows.items():
        cells = [spread([getattr(r, key) for r in reports]) for key in ("first_step_s", "step_s")]
        if name == "slurm":
            cells += [spread([r.add_serving_s for r in reports]), spread([r.broker_back_s for r in reports])]
            cells += [spread([r.roles_back_s for r in reports])]
        else:
            cells += ["-", "-", "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


def add_cycles(model: Path, cycles: int) -> int:
    work = Path(tempfile.mkdtemp(prefix="prl-slurm-bench-"))
    work.chmod(0o755)  # munged wants every directory above its socket searchable
    try:
        with SlurmCluster.create(["n1", "n2", "n3", "n4"], work / "cluster") as cluster:
            times = add_inference_cycles(cluster, model, work / "run", cycles)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"add-inference -> serving (s): {', '.join(f'{t:.1f}' for t in times)}; median {spread(times)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
