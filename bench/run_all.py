#!/usr/bin/env python
"""``make bench``: run every benchmark (parts a-i, cpu, prom and fleet) with a time limit each and
write bench/RESULTS.md.

    .venv/bin/python bench/run_all.py            # the full profile (what `make bench` runs)
    .venv/bin/python bench/run_all.py --quick    # fewer steps and repeats, for trying the harness
    .venv/bin/python bench/run_all.py --parts a,f --sft runs/demo/sft/weights/step_1000

Each part is a script in bench/ that takes ``--markdown PATH`` and writes its own section (command line, machine
load, min/median/max over repeats, ratios, met/missed):

====  ==========================  =========================================================================
part  script                      what
====  ==========================  =========================================================================
a     rl_vs_trl.py --part a       primerl rl vs TRL GRPOTrainer on the demo task (wall/step, start-up, reward)
b     trainer_step.py             trainer daemon step vs a bare loop on the same micro-batches
c     rollout_path.py             orchestrator rollouts/s vs a plain async HTTP client on one primerl-infer
d     broker_throughput.py        broker relay vs raw pyzmq; weight fan-out vs raw sends
d     broker_flood.py             the broker under a flood of rollout batches
e     weight_update.py            weight updates publish->applied (full / LoRA / delta; 100M-1B bf16) vs raw
                                  zmq and the filesystem hand-off; broker / worker peak RSS
f     async_levels.py             max_async_level 0 vs 1 vs 2: steps/s and reward
g     rl_vs_trl.py --part g       ~100M-parameter model: primerl vs TRL samples/s
h     v1_rollouts.py              verifiers v1 env server vs the classic env worker: rollouts/s, same task
i     batch_semantics.py          mixed-env shares at max_async_level 1, constant vs variable batch size, waste
cpu   cpu_per_process.py          CPU seconds per step of each process and the cores' idle time, per cpu_sharing
fleet fleet_sim.py                one broker under 10-1,000 simulated workers; a broker restart under 1,000
====  ==========================  =========================================================================

Part f runs twice: on the demo's SFT model (levels 0/1/2, reward) and on part g's ~100M model (levels 0/1).
With ``--keep-other-parts``, a part that is not run keeps its section: the part's section(s) in the current
``--output`` (RESULTS.md), in order, else the file an earlier run of this harness left under ``--work-dir``/sections.

The harness never hides a failure: a script that does not exist, fails, or runs past its limit gets a
"not run: <why>" section with the tail of its output; a script without ``--markdown`` gets its output quoted.
``--quick`` is passed on to a script only when its ``--help`` mentions it. Parts run one after another (they
would distort each other's timings otherwise); the time plan is printed first and the actual times go into
RESULTS.md. Parts a, f, h and i need the demo's SFT checkpoint: ``--sft`` if given, else
runs/bench/sft/weights/step_1000, else runs/demo/sft/weights/step_1000 (from ``make run``), else it is built in
runs/bench with the Makefile's commands (tiny model, sft-data, chatty data, ``primerl sft`` 1000 steps).
Outputs: bench/RESULTS.md, bench/plots/*.png; raw data and logs under runs/bench/ (not committed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from primerl_runs import BENCH_PYTHON, ENV_PYTHON, PRIMERL, ROOT, BenchRunError, child_env, run_child  # noqa: E402
from report import machine_load, markdown_table  # noqa: E402

BENCH = ROOT / "bench"
PYTHON = ROOT / ".venv" / "bin" / "python"
SFT_STEPS = 1000
QUICK_SFT_STEPS = 150


@dataclass
class Part:
    key: str  # a..g (d has two scripts)
    script: str
    args: list[str]
    full_limit_s: int
    quick_limit_s: int
    expected_full_s: int  # the plan: what the part should take on an idle 2-core machine
    needs_sft: bool = False
    needs_bench_venv: bool = False
    own: bool = False  # written by this harness's author: arguments known, --quick always understood
    tag: str = ""  # told apart from another entry of the same part and script (its section and log files)
    status: str = "planned"
    took_s: float = 0.0
    section: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def stem(self) -> str:
        """``<key>-<script stem>[-<tag>]``: the name of this entry's section, log and JSON files."""
        return f"{self.key}-{Path(self.script).stem}" + (f"-{self.tag}" if self.tag else "")

    @property
    def name(self) -> str:
        return f"{self.key}: {self.script} {' '.join(self.args)}".strip()


PARTS = [
    Part("a", "rl_vs_trl.py", ["--part", "a"], 1200, 600, 540, needs_sft=True, needs_bench_venv=True, own=True),
    Part("b", "trainer_step.py", [], 300, 180, 120),
    Part("c", "rollout_path.py", [], 300, 180, 120),
    Part("d", "broker_throughput.py", [], 300, 180, 120),
    Part("d", "broker_flood.py", [], 180, 120, 60),
    # Full: the tiny and 100M points of earlier runs, then 100M / 500M / 1B in bf16 (the scale table);
    # --quick: tiny fp32 + 100M bf16.
    Part("e", "weight_update.py", ["--models", "tiny:fp32,100m:fp32+bf16,500m:bf16,1b:bf16"], 1800, 480, 480),
    # What one AdamW step changes at 100M and 1B, bf16 and fp32, and the SPARSE / XOR_ZLIB deltas of it.
    Part("e", "delta_fraction.py", ["--models", "100m,1b"], 1200, 600, 500),
    # Issue 31: the demo's SFT model (levels 0/1/2, reward) with the default `cpu_sharing`, then the ~100M model of
    # part g (levels 0/1: the 1.3x target) in both modes (the default "shared" and the earlier "split") side by side.
    Part(
        "f",
        "async_levels.py",
        ["--cpu-sharing", "shared", "--steps", "8"],
        720,
        360,
        420,
        needs_sft=True,
        own=True,
    ),
    Part(
        "f",
        "async_levels.py",
        ["--model-100m", "--levels", "0,1", "--cpu-sharing", "shared,split", "--no-control", "--steps", "3"],
        1200,
        600,
        900,
        own=True,
        tag="100m",
    ),
    Part(
        "g",
        "rl_vs_trl.py",
        ["--part", "g", "--cpu-sharing", "shared,split"],
        1200,
        480,
        600,
        needs_bench_venv=True,
        own=True,
    ),
    Part("h", "v1_rollouts.py", [], 480, 240, 180, needs_sft=True, own=True),
    # Issue 31: CPU seconds per step by process and the cores' idle time, in both `cpu_sharing` modes.
    Part(
        "cpu",
        "cpu_per_process.py",
        ["--cpu-sharing", "shared,split", "--from-step", "4", "--steps", "10"],
        600,
        300,
        240,
        needs_sft=True,
        own=True,
    ),
    Part("i", "batch_semantics.py", [], 900, 420, 600, needs_sft=True, own=True),
    # Issue 47: Prometheus' discovery latency (2 trainer ranks, a second inference worker joining and leaving) and the
    # cost of being scraped every 5 s (runs with and without Prometheus, alternating). Needs Debian's prometheus.
    Part("prom", "prometheus_cost.py", [], 1500, 900, 1000),
    # Issue 48: one broker under a simulated fleet (N = 10, 100, 1000 inference workers, 64 trainer ranks,
    # 8 orchestrators), cost against N, and a SIGKILL + restart under 1,000 workers (the thundering herd).
    Part("fleet", "fleet_sim.py", [], 1500, 600, 900, own=True),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs for trying the harness (not for the numbers)")
    parser.add_argument(
        "--parts", default="a,b,c,d,e,f,g,h,i,cpu,prom,fleet", help="comma-separated parts to run (default: all)"
    )
    parser.add_argument("--sft", default=None, help="the demo's SFT checkpoint to start parts a and f from")
    parser.add_argument("--output", type=Path, default=BENCH / "RESULTS.md")
    parser.add_argument("--plots-dir", type=Path, default=BENCH / "plots")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="multiply every part's time limit")
    parser.add_argument(
        "--keep-other-parts",
        action="store_true",
        help="with --parts: keep the sections the other parts wrote in an earlier run (each says "
        "when it ran) instead of leaving them out of RESULTS.md",
    )
    return parser


def help_text(script: Path) -> str:
    try:
        out = subprocess.run(
            [str(PYTHON), str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env()
        )
        return out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        return ""


def find_or_build_sft(args: argparse.Namespace, log) -> str:
    """The SFT checkpoint: given, reused, or built with the Makefile's commands (see the module doc)."""
    steps = QUICK_SFT_STEPS if args.quick else SFT_STEPS
    if args.sft:
        if not (Path(args.sft) / "config.json").is_file():
            raise BenchRunError(f"--sft {args.sft}: no config.json there")
        return args.sft
    run_dir = args.work_dir / "sft-quick" if args.quick else args.work_dir
    candidates = [
        args.work_dir / "sft" / "weights" / f"step_{SFT_STEPS}",
        ROOT / "runs" / "demo" / "sft" / "weights" / f"step_{SFT_STEPS}",
    ]
    if args.quick:  # a full checkpoint if there is one, else a short SFT (quick runs are for trying the harness)
        candidates.append(run_dir / "sft" / "weights" / f"step_{steps}")
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            log(f"SFT checkpoint: reusing {candidate}")
            return str(candidate)
    log(f"SFT checkpoint: building it in {run_dir} ({steps} SFT steps, the Makefile's commands) ...")
    started = time.time()
    tiny, sft = run_dir / "tiny-model", run_dir / "sft"
    if sft.exists():
        import shutil

        shutil.rmtree(sft)
    sft.mkdir(parents=True)
    commands = [
        [str(PRIMERL), "init-tiny-model", str(tiny)],
        [str(PRIMERL), "sft-data", "reverse-text", "-o", str(sft / "clean.jsonl")],
        [str(PYTHON), "examples/reverse_text/chatty_sft_data.py", str(sft / "clean.jsonl"), str(sft / "data.jsonl")],
        [
            str(PRIMERL),
            "sft",
            "@",
            "examples/reverse_text_sft.toml",
            "--model.name",
            str(tiny),
            "--tokenizer.name",
            str(tiny),
            "--data.path",
            str(sft / "data.jsonl"),
            "--output-dir",
            str(sft),
            "--max-steps",
            str(steps),
        ],
    ]
    for index, command in enumerate(commands):
        # One OpenMP thread: the build is not measured, and on a shared machine 2 spinning threads ran the SFT
        # 3-25x slower (0.36 s a step with one thread against 1-9 s with two, under a load of ~10).
        run_child(
            command,
            run_dir / f"sft-build-{index}.log",
            1800,
            f"building the SFT checkpoint ({command[1]})",
            extra_env={"OMP_NUM_THREADS": "1"},
        )
    checkpoint = sft / "weights" / f"step_{steps}"
    if not (checkpoint / "config.json").is_file():
        raise BenchRunError(f"the SFT run ended without {checkpoint}")
    log(f"SFT checkpoint built in {time.time() - started:.0f} s: {checkpoint}")
    return str(checkpoint)


def run_part(part: Part, args: argparse.Namespace, sft: str | None, sections: Path, log) -> None:
    script = BENCH / part.script
    part.section = sections / f"{part.stem}.md"
    if part.section.exists():
        part.section.unlink()
    limit_s = int((part.quick_limit_s if args.quick else part.full_limit_s) * args.limit_scale)
    if not script.exists():
        part.status = f"not run: bench/{part.script} does not exist (yet)"
        return
    if part.needs_bench_venv and not BENCH_PYTHON.exists():
        part.status = f"not run: {BENCH_PYTHON.relative_to(ROOT)} is missing (`make bench` builds it)"
        return
    if part.needs_sft and sft is None:
        part.status = "not run: no SFT checkpoint (see the SFT line above)"
        return
    cmd = [str(PYTHON), str(script), *part.args]
    help_ = "--markdown --quick --sft --work-dir --plots-dir --json" if part.own else help_text(script)
    has_markdown = "--markdown" in help_
    if has_markdown:
        cmd += ["--markdown", str(part.section)]
    else:
        part.notes.append("the script has no --markdown yet: its output is quoted")
    if "--plots-dir" in help_ and not part.own:
        cmd += ["--plots-dir", str(args.plots_dir)]
    if args.quick:
        if "--quick" in help_:
            cmd.append("--quick")
        else:
            part.notes.append("the script has no --quick: ran its default profile")
    if part.own:
        cmd += [
            "--work-dir",
            str(args.work_dir),
            "--plots-dir",
            str(args.plots_dir),
            "--json",
            str(sections / f"{part.stem}.json"),
            "--budget-s",
            str(int(limit_s * 0.8)),
        ]
        if part.needs_sft:
            cmd += ["--sft", sft]
    log_path = sections / f"{part.stem}.log"
    log(
        f"[{part.key}] {' '.join(os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd)} "
        f"(limit {limit_s} s) ..."
    )
    started = time.time()
    try:
        run_child(cmd, log_path, limit_s, f"bench/{part.script}")
        part.status = "ok"
    except BenchRunError as error:
        part.status = f"not run: {str(error).splitlines()[0]}"
        part.notes.append("output tail:\n\n```\n" + "\n".join(str(error).splitlines()[1:]) + "\n```")
    part.took_s = time.time() - started
    if part.status == "ok" and not has_markdown:
        output = log_path.read_text(errors="replace")
        part.section.write_text(
            f"### {part.key}. bench/{part.script}\n\nCommand: `{' '.join(cmd)}`\n\n```\n{output[-6000:]}\n```\n"
        )
    log(f"[{part.key}] {part.status} in {part.took_s:.0f} s")


def sections_of(results: Path) -> dict[str, list[str]]:
    """The sections of an earlier RESULTS.md by part key (``### f. ...`` -> "f"; ``### e (delta sizes). ...`` and
    ``## (c) ...`` -> "e", "c"), in order; "not run" placeholders and the notes of earlier keeps are left out."""
    if not results.exists():
        return {}
    out: dict[str, list[str]] = {}
    for chunk in re.split(r"\n(?=#{2,3} )", results.read_text())[1:]:
        title = chunk.split(maxsplit=1)[1] if len(chunk.split(maxsplit=1)) > 1 else ""
        key = re.match(r"\(?([a-z]+)", title)
        if key is None:
            continue
        lines = [line for line in chunk.rstrip().splitlines() if not line.startswith("_kept from an earlier run")]
        if "**not run:" in chunk and len(lines) < 8:
            continue
        out.setdefault(key.group(1), []).append("\n".join(lines).rstrip() + "\n")
    return out


def count_verdicts(text: str) -> tuple[int, int]:
    lowered = text.lower()
    return lowered.count("**met**") + lowered.count("| met"), lowered.count("**missed**") + lowered.count("| missed")


def write_results(
    args: argparse.Namespace, parts: list[Part], plan_lines: list[str], started: float, sft_line: str, commit: str
) -> None:
    rows, bodies = [], []
    for part in parts:
        text = part.section.read_text() if part.section and part.section.exists() else ""
        met, missed = count_verdicts(text)
        status = part.status if part.status != "ok" or text else "not run: the script wrote no section"
        rows.append(
            [
                part.key,
                f"`bench/{part.script} {' '.join(part.args)}`".replace(" `", "`"),
                status,
                f"{part.took_s:.0f}",
                str(met),
                str(missed),
            ]
        )
        if text:
            bodies.append(text + ("\n" + "\n".join(f"_{n}_" for n in part.notes) + "\n" if part.notes else ""))
        else:
            notes = "\n\n".join(part.notes)
            bodies.append(f"### {part.key}. bench/{part.script}\n\n**{status}**\n\n{notes}\n")
    profile = "quick (short runs, for trying the harness; not for the numbers)" if args.quick else "full"
    header = [
        "# primerl benchmarks (issue 12)",
        "",
        f"Written by `{os.path.relpath(PYTHON, ROOT)} bench/run_all.py{' --quick' if args.quick else ''}` "
        f"(`make bench`{' BENCH_ARGS=--quick' if args.quick else ''}) at commit `{commit}`, profile **{profile}**, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}; took {time.time() - started:.0f} s. "
        f"Machine: {machine_load()} at the end. Every figure is a ratio measured side by side in one run; "
        "each part's section gives its command line and the load when it ran.",
        "",
        sft_line,
        "",
        markdown_table(["part", "script", "status", "took, s", "met", "missed"], rows),
        "",
        "<details><summary>Time plan</summary>",
        "",
        "```",
        *plan_lines,
        "```",
        "",
        "</details>",
        "",
    ]
    text = "\n".join(header) + "\n" + "\n".join(bodies)
    # Sections link their plots relative to where they were written; RESULTS.md sits in bench/.
    sections_rel = os.path.relpath(args.plots_dir, args.work_dir / "sections")
    text = text.replace(f"]({sections_rel}/", f"]({os.path.relpath(args.plots_dir, args.output.parent)}/")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(args.output)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wanted = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = wanted - {p.key for p in PARTS}
    if unknown:
        raise SystemExit(
            f"--parts: unknown part(s) {sorted(unknown)}; choose from {','.join(sorted({p.key for p in PARTS}))}"
        )
    parts = [p for p in PARTS if p.key in wanted]
    kept = [p for p in PARTS if p.key not in wanted] if args.keep_other_parts else []
    sections = args.work_dir / "sections"
    sections.mkdir(parents=True, exist_ok=True)
    args.plots_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def log(message: str) -> None:
        print(f"[bench {time.time() - started:6.0f} s] {message}", flush=True)

    for path, what in ((PYTHON, "make setup"), (ENV_PYTHON, "make setup")):
        if not Path(path).exists():
            raise SystemExit(f"{path} is missing: run `{what}` first")
    plan = [
        f"profile: {'quick' if args.quick else 'full'}; parts run one at a time; limit = the most a part may take",
        f"{'part':<28} {'expected, s':>11} {'limit, s':>9}",
    ]
    needs_sft = any(p.needs_sft for p in parts)
    if needs_sft and not args.sft:
        plan.append(f"{'SFT checkpoint (if absent)':<28} {'~180':>11} {'1800':>9}")
    for part in parts:
        limit = int((part.quick_limit_s if args.quick else part.full_limit_s) * args.limit_scale)
        expected = part.expected_full_s if not args.quick else part.quick_limit_s // 2
        plan.append(f"{part.key + ': ' + part.script:<28} {expected:>11} {limit:>9}")
    total_expected = sum(p.expected_full_s if not args.quick else p.quick_limit_s // 2 for p in parts)
    plan.append(
        f"{'total (parts)':<28} {total_expected:>11} "
        f"{sum(int((p.quick_limit_s if args.quick else p.full_limit_s) * args.limit_scale) for p in parts):>9}"
    )
    plan.append("from a fresh clone add `make setup` (~3 min), the bench venv (~2 min) and the SFT checkpoint (~3 min)")
    print("\n".join(plan), flush=True)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    commit = commit + (" (with uncommitted changes)" if dirty else "")
    sft = None
    sft_line = "SFT checkpoint: not needed by the parts run."
    if needs_sft:
        try:
            sft = find_or_build_sft(args, log)
            sft_line = f"SFT checkpoint (start of parts a, f and h): `{os.path.relpath(sft, ROOT)}`."
        except BenchRunError as error:
            sft_line = f"SFT checkpoint: **not available: {error}**".replace("\n", "  \n")
            log(sft_line)
    previous = sections_of(args.output) if kept else {}
    for part in kept:
        part.section = sections / f"{part.stem}.md"
        if previous.get(part.key):  # the section in the RESULTS.md this run replaces, else an earlier run's file
            part.section.write_text(previous[part.key].pop(0))
        if part.section.exists():
            part.status = "ok"
            part.notes.append(
                f"kept from an earlier run (`--keep-other-parts`): written "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(part.section.stat().st_mtime))}"
            )
        else:
            part.status = "not run: not selected, and no earlier section to keep"
    everything = [p for p in PARTS if p in parts or p in kept]
    try:
        for part in parts:
            run_part(part, args, sft, sections, log)
            write_results(args, everything, plan, started, sft_line, commit)  # partial results survive an interruption
    finally:
        write_results(args, everything, plan, started, sft_line, commit)
    log(f"wrote {os.path.relpath(args.output, ROOT)} in {time.time() - started:.0f} s")
    return 0 if all(p.status == "ok" for p in parts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
