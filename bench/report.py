"""Small helpers the benches share to write their RESULTS.md section and PNG plots (no primerl imports).

A section is plain markdown: a ``###`` title, the command line that produced it, the machine's load, then tables.
Every figure a bench reports is a ratio measured side by side in one run; ``Stats`` keeps the raw repeats so a
table shows min / median / max and the number of repeats, never a lone number.

    from report import Stats, Section, target_line
    section = Section("a. primerl rl vs TRL GRPOTrainer", argv=sys.argv)
    section.table(["quantity", "primerl", "TRL", "ratio"], rows)
    section.line(target_line("wall per step", ratio, "<=", 3.0))
    section.write(path)

Matplotlib is imported only inside ``save_*`` (the Agg backend), so importing this module is cheap.
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def machine_load() -> str:
    """The 1/5/15-minute load averages and the number of cores this process may use, as one phrase."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load unknown"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on {cores} cores"


def command_line(argv: Sequence[str] | None = None) -> str:
    """How to re-run this: the interpreter-relative command line, quoted for a shell."""
    argv = list(sys.argv if argv is None else argv)
    python = os.path.relpath(sys.executable) if sys.executable else "python"
    return " ".join(shlex.quote(part) for part in [python, *argv])


@dataclass
class Stats:
    """Repeated measurements of one quantity (seconds, samples/s, ...)."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"a measurement must be finite, got {value}")
        self.values.append(float(value))

    def __len__(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def min(self) -> float:
        return min(self.values) if self.values else math.nan

    @property
    def max(self) -> float:
        return max(self.values) if self.values else math.nan

    def cell(self, digits: int = 3) -> str:
        """``median (min-max, n=N)``; a single value is shown alone with n=1; none is an em dash."""
        if not self.values:
            return "—"
        if len(self.values) == 1:
            return f"{fmt(self.values[0], digits)} (n=1)"
        return f"{fmt(self.median, digits)} ({fmt(self.min, digits)}–{fmt(self.max, digits)}, n={len(self.values)})"


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (no exponent for ordinary magnitudes); None/NaN as a dash."""
    if value is None or not math.isfinite(value):
        return "—"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:.{decimals}f}"


def verdict(value: float | None, op: str, target: float) -> str:
    """ "met" / "missed" / "not measured" for ``value op target`` with op in ``<=``, ``>=``."""
    if value is None or not math.isfinite(value):
        return "not measured"
    if op == "<=":
        return "met" if value <= target else "missed"
    if op == ">=":
        return "met" if value >= target else "missed"
    raise ValueError(f"op must be '<=' or '>=', got {op!r}")


def target_line(name: str, value: float | None, op: str, target: float, note: str = "") -> str:
    """One bullet: ``- **met** name: 1.92 (target <= 3.0) note``."""
    tail = f" {note}" if note else ""
    return f"- **{verdict(value, op, target)}** {name}: {fmt(value)} (target {op} {fmt(target)}){tail}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row!r} has {len(row)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


class Section:
    """A RESULTS.md section, built line by line and written once (atomically) at the end."""

    def __init__(self, title: str, argv: Sequence[str] | None = None):
        self.lines = [
            f"### {title}",
            "",
            f"Command: `{command_line(argv)}`  ",
            f"Run at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, machine {machine_load()} at the start.",
            "",
        ]

    def line(self, text: str = "") -> None:
        self.lines.append(text)

    def table(self, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        self.lines.extend([markdown_table(header, rows), ""])

    def image(self, path: Path, relative_to: Path, alt: str) -> None:
        self.lines.extend([f"![{alt}]({os.path.relpath(path, relative_to)})", ""])

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"

    def write(self, path: Path) -> None:
        self.lines.append(f"_Machine {machine_load()} at the end._")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.text())
        tmp.replace(path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_curves(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    curves: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    log_scale: bool = False,
) -> Path:
    """One line per curve (label -> (x, y)) in a PNG; ``log_scale``: both axes logarithmic (a cost against a
    size that grows by decades, where a straight line of slope 1 is linear growth)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in curves.items():
        ax.plot(list(xs), list(ys), marker=".", label=label)
    if log_scale:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_bars(
    path: Path,
    title: str,
    ylabel: str,
    bars: dict[str, Stats],
    reference: float | None = None,
    reference_label: str = "",
) -> Path:
    """Bars at the median with min-max whiskers, one per label; an optional horizontal reference line."""
    plt = _pyplot()
    labels = list(bars)
    medians = [bars[k].median for k in labels]
    lower = [bars[k].median - bars[k].min for k in labels]
    upper = [bars[k].max - bars[k].median for k in labels]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, medians, yerr=[lower, upper], capsize=4, color="tab:blue", alpha=0.8)
    if reference is not None:
        ax.axhline(reference, color="tab:red", linestyle="--", label=reference_label or f"{reference}")
        ax.legend()
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
