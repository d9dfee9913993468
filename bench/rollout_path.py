#!/usr/bin/env python
"""Part c: the orchestrator's rollouts/s against a plain async HTTP client, same primerl-infer.

    .venv/bin/python bench/rollout_path.py [--repeats 3] [--steps 6] [--model DIR] [--markdown PATH]

Starts an in-process broker (``BrokerService``, ports 0, a queue large enough that nothing consumes the
batches) and one ``primerl-infer`` daemon subprocess on the tiny model (``build_tiny_model``, or ``--model``:
the demo's SFT checkpoint gives shorter answers), then, in every repeat, side by side under the same load:

- **plain client**: one ``httpx.AsyncClient``, 64 concurrent ``POST /v1/completions`` (the reverse-text env's
  first 8 training prompts, chat template applied, 8 times each; ``max_tokens`` 24, temperature 1, ``logprobs``
  and ``return_token_ids`` on: the same work the server does for a rollout), ``--rounds`` rounds back to back;
  completions/s over all rounds;
- **env worker alone**: ``ClassicEnvClient`` (verifiers 0.3.1 in ``.venv-envs``) with the same 8 examples x 8 rollouts
  handed over at once (``submit_rollouts``), ``--rounds`` rounds; rollouts/s, and the env worker's CPU seconds
  per rollout (from ``/proc``);
- **orchestrator**: the real ``primerl-orchestrator`` daemon (env worker + scoring + advantages + packing +
  sending to the broker, as in ``primerl rl``) with ``batch_size`` 64 (8 x 8), ``--steps`` + 1 steps (each
  repeat resumes the run where the previous one stopped) and
  ``max_async_level`` high enough that no trainer is needed and ``constant_trainer_batch_size = false`` (every
  rollout generated is counted, as for the plain client; part i measures the constant batch size); rollouts/s =
  64 x steps / (time of the last batch sent - time of the first, from its ``metrics.jsonl``), so start-up (env
  load) is not counted. The daemon is used rather than the runner's pieces in process because what is slow is
  the daemon's loop itself.

With ``--compare-lean``, every repeat also measures the env worker alone with the per-request trims off
(``PRIMERL_ENV_WORKER_LEAN=0``: the worker as it was before them, see
``primerl.orchestrator.envs.remote.lean_trims.LEAN_ENV``) beside the default one, in alternating order, and
reports both workers' CPU per rollout and rollouts/s with the paired ratios.

The ratio orchestrator / plain client is taken per repeat (both measured minutes apart at most), then
min/median/max over repeats; target (c) is met when the median ratio is >= 0.7. The orchestrator's mean
``perf/...`` phase times over the measured steps are printed too. Every process started here is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from primerl.orchestrator.envs.remote.lean_trims import LEAN_ENV
from primerl.proto import telemetry

TOKEN = "bench-token"
TARGET_RATIO = 0.7
NUM_EXAMPLES = 8
ROLLOUTS_PER_EXAMPLE = 8
MAX_TOKENS = 24
MAX_MODEL_LEN = 512
START_TIMEOUT_S = 400.0
ORCHESTRATOR_TIMEOUT_S = 600.0
BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))


def start_broker(spool_dir: Path) -> Any:
    from primerl.broker.service import BrokerService
    from primerl.configs.broker import BrokerConfig

    config = BrokerConfig(
        host="127.0.0.1",
        grpc_port=0,
        rollout_port=0,
        weight_port=0,
        spool_dir=spool_dir,
        run_token=TOKEN,
        run_id="rollout-bench",
        max_queue_batches=100_000,
        max_queue_bytes=16 << 30,
    )
    service = BrokerService(config)
    service.start()
    return service


class InferDaemon:
    """One ``primerl-infer`` child process joined to the broker; stopped only by this script."""

    def __init__(self, work_dir: Path, model_dir: Path, grpc_address: str):
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / "infer.log"
        ready_file = work_dir / "infer-ready.json"
        self.log_file = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            [
                str(BIN / "primerl-infer"),
                "--model.name",
                str(model_dir),
                "--model.max-model-len",
                str(MAX_MODEL_LEN),
                "--server.port",
                "0",
                "--broker.address",
                grpc_address,
                "--broker.connect-timeout-s",
                "60",
                "--ready-file",
                str(ready_file),
            ],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN},
            cwd=work_dir,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"primerl-infer did not start:\n{self.log_tail()}")
            time.sleep(0.2)
        self.base_url = json.loads(ready_file.read_text())["base_url"].rstrip("/") + "/v1"

    def log_tail(self, num_chars: int = 4000) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log_file.close()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------------ the three paths


async def plain_rounds(base_url: str, model: str, prompts: list[str], rounds: int) -> tuple[float, float]:
    """``rounds`` x len(prompts) concurrent completions; returns (completions/s, mean completion tokens)."""
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=None)) as client:

        async def one(prompt: str) -> int:
            response = await client.post(
                f"{base_url}/completions",
                headers=headers,
                json={
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                },
            )
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        await one(prompts[0])  # connections and the server's first-request work are not counted
        started = time.monotonic()
        tokens = []
        for _ in range(rounds):
            tokens += await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.monotonic() - started
    return len(tokens) / elapsed, statistics.mean(tokens)


def env_worker_rounds(worker: Any, base_url: str, model: str, rounds: int) -> tuple[float, float, float]:
    """``rounds`` x 8 groups of 8 rollouts handed over at once; (rollouts/s, mean tokens, worker CPU s/rollout)."""

    def one_round() -> list[Any]:
        kwargs = dict(
            num_rollouts=ROLLOUTS_PER_EXAMPLE,
            base_url=base_url,
            model=model,
            api_key=TOKEN,
            sampling={"temperature": 1.0, "max_tokens": MAX_TOKENS},
        )
        if hasattr(worker, "submit_rollouts"):
            futures = worker.submit_rollouts(list(range(NUM_EXAMPLES)), **kwargs)
        else:
            futures = [worker.submit_rollout(i, **kwargs) for i in range(NUM_EXAMPLES)]
        return [f.result(timeout=300) for f in futures]

    one_round()  # warm-up: the worker's HTTP connections
    cpu_before, started = process_cpu_s(worker.pid), time.monotonic()
    groups = []
    for _ in range(rounds):
        groups += one_round()
    elapsed, cpu = time.monotonic() - started, process_cpu_s(worker.pid) - cpu_before
    rollouts = [r for g in groups for r in g.rollouts]
    errors = [r.error for r in rollouts if not r.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} env-worker rollouts failed, first: {errors[0]}")
    return len(rollouts) / elapsed, statistics.mean(r.num_completion_tokens for r in rollouts), cpu / len(rollouts)


def orchestrator_run(work_dir: Path, model_dir: Path, broker_address: str, steps: int, repeat: int) -> dict[str, Any]:
    """One ``primerl-orchestrator`` run of ``steps`` + 1 steps; rollouts/s over the last ``steps`` of them.

    Repeats resume the same run (same output dir: the broker holds the earlier steps), each one ``steps`` + 1
    steps further."""
    output_dir = work_dir / "orchestrator"
    log_path = work_dir / f"orchestrator-{repeat}.log"
    first_step, last_step = repeat * (steps + 1) + 1, (repeat + 1) * (steps + 1)
    args = [
        str(BIN / "primerl-orchestrator"),
        "--model.name",
        str(model_dir),
        "--env",
        '[{id = "reverse-text"}]',
        "--batch-size",
        str(NUM_EXAMPLES * ROLLOUTS_PER_EXAMPLE),
        "--rollouts-per-example",
        str(ROLLOUTS_PER_EXAMPLE),
        "--max-steps",
        str(last_step),
        "--seq-len",
        "256",
        "--sampling.max-tokens",
        str(MAX_TOKENS),
        "--sampling.temperature",
        "1.0",
        "--max-async-level",
        "1000000",
        # every rollout generated counts, as for the plain client: the path's cost, not batch semantics (part i).
        # With a constant batch size an untrained model's zero-advantage groups would be generated and dropped.
        "--constant-trainer-batch-size",
        "false",
        "--broker.address",
        broker_address,
        "--output-dir",
        str(output_dir),
        "--env-python",
        ENV_PYTHON,
        "--prometheus.enabled",
        "false",
    ]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN}
        )
        try:
            code = process.wait(ORCHESTRATOR_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
            raise RuntimeError(f"primerl-orchestrator ran past {ORCHESTRATOR_TIMEOUT_S} s") from None
    if code != 0:
        raise RuntimeError(f"primerl-orchestrator exited {code}:\n{log_path.read_text()[-4000:]}")
    from primerl.runtime.run_metrics import read_metrics_file

    rows = read_metrics_file(output_dir / "metrics.jsonl").rows
    rows = sorted(
        (r for r in rows if telemetry.TRAIN_REWARD in r and first_step <= r["step"] <= last_step),
        key=lambda r: r["step"],
    )
    if [r["step"] for r in rows] != list(range(first_step, last_step + 1)):
        raise RuntimeError(
            f"expected orchestrator rows of steps {first_step}..{last_step}, got {[r['step'] for r in rows]}"
        )
    measured = rows[1:]
    elapsed = measured[-1]["time"] - rows[0]["time"]
    perf = {k: statistics.mean(r.get(k, 0.0) for r in measured) for k in sorted(measured[-1]) if k.startswith("perf/")}
    return {
        "rollouts_per_s": NUM_EXAMPLES * ROLLOUTS_PER_EXAMPLE * steps / elapsed,
        "mean_length": statistics.mean(r[telemetry.ROLLOUT_MEAN_LENGTH] for r in measured),
        "generation_time": [r[telemetry.ROLLOUT_GENERATION_TIME] for r in measured],
        "perf": perf,
    }


# ------------------------------------------------------------------------------------------------------ report


def stats(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def ratio_stats(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def report(results: list[dict[str, Any]], args: argparse.Namespace, load_before: str, load_after: str) -> str:
    plain = [r["plain"] for r in results]
    env = [r["env"] for r in results]
    with_orch = all("orch" in r for r in results)
    orch = [r["orch"]["rollouts_per_s"] for r in results] if with_orch else []
    env_ratio = [e / p for e, p in zip(env, plain)]
    orch_ratio = [o / p for o, p in zip(orch, plain)]
    met = with_orch and statistics.median(orch_ratio) >= TARGET_RATIO
    lean_lines = []
    if results and "env_before" in results[0]:
        cpu_ratio = [r["env_cpu"] / r["env_before_cpu"] for r in results]
        rate_ratio = [r["env"] / r["env_before"] for r in results]
        lean_lines = [
            "",
            "Env worker with the per-request trims (default) vs without (`PRIMERL_ENV_WORKER_LEAN=0`), same rounds,",
            "alternating order (min / median / max):",
            "",
            "| env worker | rollouts/s | CPU ms per rollout |",
            "|---|---|---|",
            f"| trims off (before) | {stats([r['env_before'] for r in results])} | "
            f"{stats([1000 * r['env_before_cpu'] for r in results])} |",
            f"| trims on (default) | {stats(env)} | {stats([1000 * r['env_cpu'] for r in results])} |",
            f"| ratio on / off | {ratio_stats(rate_ratio)} | {ratio_stats(cpu_ratio)} |",
            "",
        ]
    lines = [
        "## (c) Rollout path: orchestrator vs a plain async HTTP client on the same primerl-infer",
        "",
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`  ",
        f"Machine: {os.cpu_count()} CPUs; load average before {load_before}, after {load_after}  ",
        f"Work: {NUM_EXAMPLES} reverse-text prompts x {ROLLOUTS_PER_EXAMPLE} = 64 completions of up to {MAX_TOKENS} "
        f"tokens per round/step; {args.repeats} repeats (min / median / max); mean completion tokens: plain "
        f"{statistics.mean(r['plain_tokens'] for r in results):.1f}, env worker "
        f"{statistics.mean(r['env_tokens'] for r in results):.1f}"
        + (f", orchestrator {statistics.mean(r['orch']['mean_length'] for r in results):.1f}" if with_orch else ""),
        "",
        "| path | rollouts/s (min / median / max) | ratio to plain client | target |",
        "|---|---|---|---|",
        f"| plain async HTTP client (httpx, 64-way, `/v1/completions`) | {stats(plain)} | 1 | |",
        f"| env worker alone (verifiers 0.3.1, 8 groups x 8 at once) | {stats(env)} | {ratio_stats(env_ratio)} | |",
        *(
            [
                f"| orchestrator daemon (env worker, scoring, advantages, packing, send) | {stats(orch)} | "
                f"{ratio_stats(orch_ratio)} | >= {TARGET_RATIO}: **{'met' if met else 'missed'}** |"
            ]
            if with_orch
            else ["| orchestrator daemon | not run (`--no-orchestrator`) | | |"]
        ),
        "",
        f"Env worker CPU per rollout: {stats([1000 * r['env_cpu'] for r in results])} ms.  ",
        *lean_lines,
    ]
    perf = (
        {k: statistics.mean(r["orch"]["perf"][k] for r in results) for k in results[-1]["orch"]["perf"]}
        if with_orch
        else {}
    )
    if perf:
        lines.append(
            "Orchestrator phase times (mean per step over the measured steps): "
            + ", ".join(f"`{k}` {v:.4g}" for k, v in perf.items())
        )
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="Repeats of the three measurements (>= 1).")
    parser.add_argument("--rounds", type=int, default=4, help="Rounds of 64 per plain/env-worker measurement.")
    parser.add_argument("--steps", type=int, default=6, help="Measured orchestrator steps of 64 per repeat.")
    parser.add_argument("--model", type=Path, default=None, help="Model dir (default: a fresh tiny model).")
    parser.add_argument("--markdown", type=Path, default=None, help="Write the section (markdown) to this file.")
    parser.add_argument(
        "--compare-lean",
        action="store_true",
        help="Also measure the env worker alone without its per-request trims (PRIMERL_ENV_WORKER_LEAN=0).",
    )
    parser.add_argument("--no-orchestrator", action="store_true", help="Skip the orchestrator daemon's runs.")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1 or args.steps < 1:
        parser.error("--repeats, --rounds and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if not Path(ENV_PYTHON).exists():
        print(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup`", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from transformers import AutoTokenizer

    from primerl.orchestrator.envs.classic import ClassicEnvClient

    load_before = loadavg()
    work_dir = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    broker = daemon = worker = worker_before = None
    try:
        model_dir = args.model
        if model_dir is None:
            from primerl.trainer.tiny_model import build_tiny_model

            model_dir = build_tiny_model(work_dir / "tiny-model")
        broker = start_broker(work_dir / "spool")
        broker_address = f"127.0.0.1:{broker.endpoints.grpc_port}"
        daemon = InferDaemon(work_dir / "infer", model_dir, broker_address)
        model = str(model_dir)
        worker = ClassicEnvClient(ENV_PYTHON, "reverse-text", {})
        worker.start()
        if args.compare_lean:
            worker_before = ClassicEnvClient(ENV_PYTHON, "reverse-text", {}, extra_env={LEAN_ENV: "0"})
            worker_before.start()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        examples = worker.examples("train", 0, NUM_EXAMPLES)
        texts = [tokenizer.apply_chat_template(e.prompt, add_generation_prompt=True, tokenize=False) for e in examples]
        prompts = [t for t in texts for _ in range(ROLLOUTS_PER_EXAMPLE)]
        results = []
        for repeat in range(args.repeats):
            plain, plain_tokens = asyncio.run(plain_rounds(daemon.base_url, model, prompts, args.rounds))
            result: dict[str, Any] = {"plain": plain, "plain_tokens": plain_tokens}
            if worker_before is not None and repeat % 2 == 0:
                result["env_before"], _, result["env_before_cpu"] = env_worker_rounds(
                    worker_before, daemon.base_url, model, args.rounds
                )
            result["env"], result["env_tokens"], result["env_cpu"] = env_worker_rounds(
                worker, daemon.base_url, model, args.rounds
            )
            if worker_before is not None and repeat % 2 == 1:
                result["env_before"], _, result["env_before_cpu"] = env_worker_rounds(
                    worker_before, daemon.base_url, model, args.rounds
                )
            if not args.no_orchestrator:
                result["orch"] = orchestrator_run(work_dir, model_dir, broker_address, args.steps, repeat)
            results.append(result)
            line = (
                f"repeat {repeat + 1}: plain {plain:.1f}/s, env worker {result['env']:.1f}/s "
                f"({1000 * result['env_cpu']:.2f} ms CPU per rollout)"
            )
            if "env_before" in result:
                line += (
                    f", env worker without the trims {result['env_before']:.1f}/s "
                    f"({1000 * result['env_before_cpu']:.2f} ms CPU per rollout)"
                )
            if "orch" in result:
                orch_rate = result["orch"]["rollouts_per_s"]
                line += f", orchestrator {orch_rate:.1f}/s (ratio {orch_rate / plain:.2f})"
            print(f"{line}; load {loadavg()}", flush=True)
        section = report(results, args, load_before, loadavg())
        print()
        print(section)
        if args.markdown is not None:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(section)
        return 0
    finally:
        for env_worker in (worker, worker_before):
            if env_worker is not None:
                env_worker.close()
        if daemon is not None:
            daemon.stop()
        if broker is not None:
            broker.stop(grace_s=1.0)
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
