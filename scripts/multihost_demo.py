"""`make multihost`: one RL run over seven "hosts" on this machine (network namespaces joined by a bridge when this
process may make them, else the loopback addresses 127.0.0.2...), the scenario of tests/test_multihost.py:

  a  primerl-broker (run token, bound to a's address) + primerl-orchestrator
  b  trainer rank (torchrun --nnodes=2, c10d rendezvous on b)     c  the other trainer rank
  d  primerl-infer, stopped (SIGTERM) mid-run                      e  primerl-infer
  f  primerl-infer that joins after d left                         g  `primerl status` at the end

Prints the roles and addresses, workers joined and left, rollouts retried, steps completed and how long the
joining worker took to serve the current version; exits 1 when the run got something wrong.

  python scripts/multihost_demo.py [--run-dir runs/multihost] [--model runs/demo/tiny-model] [--max-steps 40]
                                   [--mode auto|netns|loopback] [--encrypted]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))

from support.multihost import BIN, MultihostRun  # noqa: E402 (tests/ is on the path only now)
from support.netns import Hosts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multihost_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "multihost")
    parser.add_argument(
        "--model",
        type=Path,
        default=REPO_ROOT / "runs" / "demo" / "tiny-model",
        help="a model directory (built with `primerl init-tiny-model` when missing)",
    )
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument(
        "--stop-at-step",
        type=int,
        default=1,
        help="stop host d's worker once this step is done and it has requests in flight (30 s at most)",
    )
    parser.add_argument("--mode", choices=["auto", "netns", "loopback"], default="auto")
    parser.add_argument(
        "--subnet",
        default=None,
        help="the hosts' /24 (default: the first free one of 10.231.0.0/24, 10.231.1.0/24 ...)",
    )
    parser.add_argument(
        "--encrypted",
        action="store_true",
        help="mutual TLS on gRPC and CURVE on the ZeroMQ planes, credentials from `primerl certs`",
    )
    parser.add_argument(
        "--stop-signal",
        choices=["TERM", "KILL"],
        default="TERM",
        help="how host d's worker is stopped: TERM (it finishes its requests and deregisters) or KILL "
        "(it vanishes mid-request; the broker declares it lost after heartbeat_liveness beats)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)

    if not (args.model / "config.json").exists():
        subprocess.run([str(BIN / "primerl"), "init-tiny-model", str(args.model)], check=True, timeout=300)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    with Hosts.create(["a", "b", "c", "d", "e", "f", "g"], subnet=args.subnet, mode=args.mode) as hosts:
        run = MultihostRun(
            hosts,
            args.run_dir.resolve(),
            args.model.resolve(),
            max_steps=args.max_steps,
            stop_at_step=args.stop_at_step,
            timeout_s=args.timeout_s,
            encrypted=args.encrypted,
            stop_signal=args.stop_signal,
            say=lambda line: print(line, flush=True),
        )
        report = run.run()
    print(report.summary())
    problems = report.problems()
    print("\n" + ("\n".join(f"PROBLEM: {p}" for p in problems) if problems else "multihost run: OK"))
    print(f"logs and configs: {args.run_dir}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
