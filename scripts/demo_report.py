"""Print the demo's before/after: held-out mean reward of the SFT checkpoint and of the RL run's final weights.

    python scripts/demo_report.py runs/demo/eval/sft runs/demo/eval/rl
    python scripts/demo_report.py --runs runs/demo runs/demo2 runs/demo3     # several runs: mean and spread

Each argument of the first form is a `primerl eval --output` directory (its summary.json). The demo's target:
RL raises the held-out mean reward by >= 0.1 over the SFT checkpoint, or to >= 0.9. With ``--runs``, each
argument is a demo's RUN_DIR (its eval/sft and eval/rl); one row per run, then mean, min-max and whether the
runs' figures are identical. On a terminal the before/after is a rich table; piped, the plain lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from primerl.runtime.terminal import rich_console

TARGET_GAIN = 0.1
TARGET_REWARD = 0.9


def _summary(directory: str) -> dict:
    path = Path(directory) / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"demo_report: cannot read {path}: {exc}") from None


def spread(run_dirs: list[str]) -> str:
    """One row per demo run (SFT, RL, gain held-out), then the mean and min-max of each column."""
    rows = []
    for run_dir in run_dirs:
        before, after = _summary(str(Path(run_dir) / "eval" / "sft")), _summary(str(Path(run_dir) / "eval" / "rl"))
        sft, rl = before["reward_mean"], after["reward_mean"]
        rows.append((run_dir, sft, rl, rl - sft))
    lines = [f"  {'run':<28}{'SFT':>14}{'RL':>14}{'gain':>14}"]
    lines += [f"  {name:<28}{sft:>14.3f}{rl:>14.3f}{gain:>+14.3f}" for name, sft, rl, gain in rows]
    columns = list(zip(*(row[1:] for row in rows)))
    lines.append(
        f"  {'mean':<28}"
        + "".join(
            f"{sum(c) / len(c):>+14.3f}" if i == 2 else f"{sum(c) / len(c):>14.3f}" for i, c in enumerate(columns)
        )
    )
    lines.append(f"  {'min-max':<28}" + "".join(f"{min(c):.3f}-{max(c):.3f}".rjust(14) for c in columns))
    for label, column in zip(("SFT", "RL"), columns[:2]):
        lines.append(f"  {label} held-out identical in every run: {'yes' if len(set(column)) == 1 else 'no'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--runs"]:
        if len(argv) < 2:
            print(__doc__, file=sys.stderr)
            return 2
        print(spread(argv[1:]))
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = (_summary(d) for d in argv)
    gain = after["reward_mean"] - before["reward_mean"]
    met = gain >= TARGET_GAIN or after["reward_mean"] >= TARGET_REWARD

    def row(label: str, s: dict) -> str:
        exact = s["metrics"].get("exact_match")
        extra = f"  exact match {exact:.3f}" if exact is not None else ""
        return f"  {label:<16}{s['reward_mean']:.3f} ± {s['reward_std']:.3f}{extra}   ({s['model']})"

    sampling = after["sampling"]
    title = (
        f"held-out mean reward: {after['env_id']} {after['split']} split, {after['num_examples']} prompts x "
        f"{after['rollouts_per_example']}, temperature {sampling['temperature']:g}"
    )
    console = rich_console(sys.stdout)
    if console is not None:  # a terminal: the same figures as a rich table
        console.print(report_table(title, before, after, gain, met))
        return 0
    print(
        f"{title}\n"
        f"{row('SFT checkpoint', before)}\n{row('after RL', after)}\n"
        f"  change          {gain:+.3f}   target: >= +{TARGET_GAIN} or >= {TARGET_REWARD}: "
        f"{'met' if met else 'NOT met'}"
    )
    return 0


def report_table(title: str, before: dict, after: dict, gain: float, met: bool):
    """The before/after as a rich table (what a terminal shows)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold cyan")
    for name, justify in (("", "left"), ("reward", "right"), ("± std", "right"), ("exact match", "right")):
        table.add_column(name, justify=justify)
    table.add_column("model", style="dim")
    for label, s in (("SFT checkpoint", before), ("after RL", after)):
        exact = s["metrics"].get("exact_match")
        table.add_row(
            label,
            f"{s['reward_mean']:.3f}",
            f"{s['reward_std']:.3f}",
            "-" if exact is None else f"{exact:.3f}",
            str(s["model"]),
        )
    verdict = "[green]met[/]" if met else "[bold red]NOT met[/]"
    table.add_row(
        "[bold]change",
        f"[bold]{gain:+.3f}",
        "",
        "",
        f"target: >= +{TARGET_GAIN} or >= {TARGET_REWARD}: {verdict}",
    )
    return table


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
