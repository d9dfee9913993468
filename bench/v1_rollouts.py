#!/usr/bin/env python
"""Part h: verifiers v1 rollouts/s against the classic path, side by side on the same primerl-infer.

    .venv/bin/python bench/v1_rollouts.py --sft runs/demo/sft/weights/step_1000 [--repeats 3] [--rounds 3]
        [--groups 8] [--rollouts 16] [--markdown PATH]

Starts an in-process broker and one ``primerl-infer`` daemon on the model (``--sft``: the demo's SFT checkpoint,
which answers the task; else a fresh tiny model, whose figures say little), then both env paths on the same task:

- **classic**: ``ClassicEnvClient`` (verifiers 0.3.1 in ``.venv-envs``) on ``reverse-text``;
- **v1**: ``V1ServerConnection`` (verifiers 0.4.0's own env server in ``.venv-envs-v1``, the in-process harness of
  ``examples/reverse_text_v1``) on ``reverse-text-v1``: the same rows (same arguments), the same LCS reward.

Each round hands ``--groups`` groups of ``--rollouts`` rollouts (the task's first training examples, max_tokens
24, temperature 1) to the path at once and waits for all of them; a warm-up round per path is not counted. In
every repeat both paths run ``--rounds`` rounds one after the other (their order alternates between repeats), so
the ratio v1 / classic is taken under the same load; the table shows min / median / max over repeats of
rollouts/s, the ratio, the mean reward and completion tokens, and the env process's CPU milliseconds per rollout
(its process tree, from ``/proc``). Every process started here is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Section, Stats, machine_load  # noqa: E402
from rollout_path import TOKEN, InferDaemon, start_broker  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
V1_ENV_PYTHON = os.environ.get("PRIMERL_ENV_V1_PYTHON", str(REPO_ROOT / ".venv-envs-v1" / "bin" / "python"))
CLASSIC_ID, V1_ID = "reverse-text", "reverse-text-v1"
MAX_TOKENS = 24
ROUND_TIMEOUT_S = 600.0


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (``/proc``)."""
    total, stack, seen = 0.0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for task in Path(f"/proc/{current}/task").iterdir():  # children of every thread
                stack += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


class EnvPath:
    """One env path: how to submit a group, and the process whose CPU is counted."""

    def __init__(self, name: str, submit, pid: int, tasks: list[Any]):
        self.name, self.submit, self.pid, self.tasks = name, submit, pid, tasks

    def round(self, groups: int, rollouts: int) -> list[Any]:
        futures = [self.submit(index, rollouts) for index in range(groups)]
        return [future.result(timeout=ROUND_TIMEOUT_S) for future in futures]

    def measure(self, rounds: int, groups: int, rollouts: int) -> dict[str, float]:
        cpu_before, started = tree_cpu_s(self.pid), time.monotonic()
        done = []
        for _ in range(rounds):
            done += self.round(groups, rollouts)
        elapsed, cpu = time.monotonic() - started, tree_cpu_s(self.pid) - cpu_before
        results = [r for g in done for r in g.rollouts]
        failed = [r for r in results if not r.ok]
        if failed:
            raise RuntimeError(
                f"{self.name}: {len(failed)} of {len(results)} rollouts failed, first: "
                f"{failed[0].error_type}: {failed[0].error}"
            )
        return {
            "rollouts_per_s": len(results) / elapsed,
            "reward": statistics.mean(r.reward for r in results),
            "tokens": statistics.mean(r.num_completion_tokens for r in results),
            "cpu_ms": 1000 * cpu / len(results),
            "elapsed_s": elapsed,
        }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sft", type=Path, default=None, help="model dir (the demo's SFT checkpoint); default: a fresh tiny model"
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats of both measurements (>= 1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per path and repeat (>= 1)")
    parser.add_argument("--groups", type=int, default=8, help="groups per round (examples; >= 1)")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per group (>= 1)")
    parser.add_argument("--quick", action="store_true", help="2 repeats of 1 round (for trying the harness)")
    parser.add_argument("--markdown", type=Path, default=None, help="write the section (markdown) to this file")
    # what bench/run_all.py passes to its own parts
    parser.add_argument("--work-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plots-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="write the raw repeats (JSON) to this file")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting repeats past this many seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.rounds = 2, 1
    if min(args.repeats, args.rounds, args.groups, args.rollouts) < 1:
        parser.error("--repeats, --rounds, --groups and --rollouts must be >= 1")
    return args


def report(results: list[dict[str, Any]], args: argparse.Namespace, model: str, load_before: str) -> Section:
    section = Section("h. verifiers v1 env server vs the classic env worker: rollouts/s", argv=sys.argv)
    section.line(f"Machine: {load_before} before the set-up, {machine_load()} after the repeats  ")
    section.line(
        f"Model: `{model}`; one primerl-infer; per round {args.groups} groups x {args.rollouts} rollouts "
        f"handed over at once (max_tokens {MAX_TOKENS}, temperature 1), {args.rounds} round(s) per path and "
        f"repeat after a warm-up round, {len(results)} repeats, order alternating; classic `{CLASSIC_ID}` "
        f"(verifiers 0.3.1, env worker) vs v1 `{V1_ID}` (verifiers 0.4.0 env server, in-process harness): "
        "same rows, same reward."
    )
    section.line("")
    stats = {
        key: {name: Stats([r[name][key] for r in results]) for name in ("classic", "v1")}
        for key in ("rollouts_per_s", "reward", "tokens", "cpu_ms")
    }
    ratio = Stats([r["v1"]["rollouts_per_s"] / r["classic"]["rollouts_per_s"] for r in results])
    rows = [
        [
            label,
            stats[key]["classic"].cell(),
            stats[key]["v1"].cell(),
            Stats([r["v1"][key] / r["classic"][key] for r in results]).cell(),
        ]
        for label, key in (
            ("rollouts/s", "rollouts_per_s"),
            ("mean reward", "reward"),
            ("mean completion tokens", "tokens"),
            ("env process CPU ms per rollout", "cpu_ms"),
        )
    ]
    section.table(["quantity (median (min–max, n))", "classic env worker", "v1 env server", "v1 / classic"], rows)
    section.line("")
    section.line(f"v1 / classic rollouts/s: **{ratio.cell(2)}** (no target: measured for issue 19).")
    return section


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
        os.environ.setdefault(variable, "1")
    for python, what in ((ENV_PYTHON, "classic env"), (V1_ENV_PYTHON, "v1 env")):
        if not Path(python).exists():
            print(f"no {what} interpreter at {python}: run `make setup`", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from primerl.orchestrator.envs.classic import ClassicEnvClient
    from primerl.orchestrator.envs.v1_server import V1ServerConnection
    from primerl.orchestrator.trajectory import SamplingParams

    started_s, load_before = time.monotonic(), machine_load()
    work_dir = Path(tempfile.mkdtemp(prefix="v1-rollouts-bench-"))
    broker = daemon = worker = server = None
    try:
        model_dir = args.sft.resolve() if args.sft is not None else None  # the daemons run elsewhere
        if model_dir is None:
            from primerl.trainer.tiny_model import build_tiny_model

            model_dir = build_tiny_model(work_dir / "tiny-model")
        broker = start_broker(work_dir / "spool")
        daemon = InferDaemon(work_dir / "infer", model_dir, f"127.0.0.1:{broker.endpoints.grpc_port}")
        model = str(model_dir)
        worker = ClassicEnvClient(ENV_PYTHON, CLASSIC_ID, {})
        worker.start()
        server = V1ServerConnection(
            V1_ENV_PYTHON,
            V1_ID,
            {},
            base_url=daemon.base_url,
            api_key=TOKEN,
            renderer_model=model,
            start_timeout_s=180,
            request_timeout_s=ROUND_TIMEOUT_S,
        )
        server.start()
        v1_tasks = server.tasks(0, args.groups)
        classic_examples = worker.examples("train", 0, args.groups)
        classic_prompts = [e.prompt[-1]["content"] for e in classic_examples]
        if [t["prompt"] for t in v1_tasks] != classic_prompts:
            raise RuntimeError(
                f"the two paths' tasks differ: classic {classic_prompts[:3]}, v1 {[t['prompt'] for t in v1_tasks][:3]}"
            )
        sampling = {"temperature": 1.0, "max_tokens": MAX_TOKENS}
        paths = {
            "classic": EnvPath(
                "classic",
                lambda i, n: worker.submit_rollout(
                    i, num_rollouts=n, base_url=daemon.base_url, model=model, api_key=TOKEN, sampling=sampling
                ),
                worker.pid,
                classic_examples,
            ),
            "v1": EnvPath(
                "v1",
                lambda i, n: server.submit_group(
                    v1_tasks[i], example_index=i, num_rollouts=n, model=model, sampling=SamplingParams(**sampling)
                ),
                server.pid,
                v1_tasks,
            ),
        }
        for path in paths.values():
            path.round(args.groups, args.rollouts)  # warm-up: connections, first-request work
        results = []
        for repeat in range(args.repeats):
            if args.budget_s is not None and results and time.monotonic() - started_s > args.budget_s * 0.6:
                print(f"budget: stopping after {repeat} repeats", flush=True)
                break
            order = ["classic", "v1"] if repeat % 2 == 0 else ["v1", "classic"]
            result = {name: paths[name].measure(args.rounds, args.groups, args.rollouts) for name in order}
            results.append(result)
            print(
                f"repeat {repeat + 1}: classic {result['classic']['rollouts_per_s']:.1f}/s, v1 "
                f"{result['v1']['rollouts_per_s']:.1f}/s (ratio "
                f"{result['v1']['rollouts_per_s'] / result['classic']['rollouts_per_s']:.3f}); reward classic "
                f"{result['classic']['reward']:.3f}, v1 {result['v1']['reward']:.3f}; CPU ms/rollout classic "
                f"{result['classic']['cpu_ms']:.1f}, v1 {result['v1']['cpu_ms']:.1f}; {machine_load()}",
                flush=True,
            )
        section = report(results, args, os.path.relpath(model, REPO_ROOT), load_before)
        print()
        print(section.text())
        if args.markdown is not None:
            section.write(args.markdown)
        if args.json is not None:
            import json

            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {"model": model, "args": {k: str(v) for k, v in vars(args).items()}, "repeats": results}, indent=2
                )
            )
        return 0
    finally:
        for thing in (server, worker):
            if thing is not None:
                thing.close()
        if daemon is not None:
            daemon.stop()
        if broker is not None:
            broker.stop(grace_s=1.0)
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
