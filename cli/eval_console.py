"""The console of `primerl eval`: its own lines on the terminal, everything else the process writes in a log file.

vLLM writes to this process's stdout and stderr from many places: its loggers, the engine-core process it
spawns (which inherits the file descriptors), C++ libraries (NUMA, torch), progress bars, and the interpreter's
exit (`Exception ignored in AsyncLLM.__del__`, nanobind's leak report, both after `main` has returned). Only
moving file descriptors 1 and 2 reaches them all: `divert(log_path)` points them at the log file for the rest of
the process's life, and eval's own lines go to copies of the original descriptors (`out`, `err`).

On a terminal the examples' progress is a rich progress bar and the summary a rich table (`EvalProgress`,
`print_summary`); otherwise the summary is the plain lines of `summary_text` (an interface) and no progress.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO


class Console:
    """Where eval's own output goes: `out` (results) and `err` (progress, errors); the terminal until and after
    `divert`, which sends everything else the process writes to `log_path`."""

    def __init__(self) -> None:
        self.out: TextIO = sys.stdout
        self.err: TextIO = sys.stderr
        self.log_path: Path | None = None

    def divert(self, log_path: Path) -> None:
        """From now on file descriptors 1 and 2 (this process and the processes it starts) write to `log_path`;
        `out` and `err` keep writing to the terminal. Not undone: the interpreter's exit writes too."""
        assert self.log_path is None, "already diverted"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        self.err = os.fdopen(os.dup(2), "w", buffering=1)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
        finally:
            os.close(log_fd)
        self.log_path = log_path


class EvalProgress:
    """Examples done, on ``stream`` when it is a terminal: a rich progress bar with the count and ETA (elsewhere
    nothing, as before)."""

    def __init__(self, stream: TextIO, total: int, *, console: Any = None) -> None:
        from primerl.runtime.terminal import rich_console

        self.console = console if console is not None else rich_console(stream)
        self.progress: Any = None
        if self.console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("  examples"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self.task = self.progress.add_task("eval", total=total)
            self.progress.start()

    def advance(self, done: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=done)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def summary_text(
    env_id: str, what: str, count: int, rollouts_per_example: int, model: str, summary: Any, elapsed_s: float, output
) -> str:
    """The plain summary of `primerl eval` (an interface: scripts and tests read these lines)."""
    metrics = "  ".join(f"{name} {value:.3f}" for name, value in summary.metrics.items())
    return (
        f"primerl eval: {env_id} ({what}, {count} examples x {rollouts_per_example}) on {model}\n"
        f"  reward: mean {summary.reward_mean:.4f}  std {summary.reward_std:.4f}  "
        f"over {summary.num_rollouts} rollouts ({summary.num_errors} failed)\n"
        f"  metrics: {metrics or '-'}\n"
        f"  completion tokens: mean {summary.mean_completion_tokens:.1f}, truncated {summary.truncation_rate:.1%}\n"
        f"  {elapsed_s:.1f} s; results in {output}"
    )


def summary_renderable(
    env_id: str, what: str, count: int, rollouts_per_example: int, model: str, summary: Any, elapsed_s: float, output
) -> Any:
    """The same summary as a rich table, for a terminal."""
    from rich.table import Table

    table = Table(
        title=f"primerl eval: {env_id} ({what}, {count} examples x {rollouts_per_example}) on {model}",
        title_justify="left",
        show_header=False,
        box=None,
        padding=(0, 2),
    )
    table.add_column(style="bold")
    table.add_column()
    failed = f" [red]({summary.num_errors} failed)[/red]" if summary.num_errors else " (0 failed)"
    table.add_row(
        "reward",
        f"mean [bold green]{summary.reward_mean:.4f}[/]  std {summary.reward_std:.4f}  "
        f"over {summary.num_rollouts} rollouts{failed}",
    )
    for name, value in summary.metrics.items():
        table.add_row(name, f"{value:.3f}")
    table.add_row(
        "completion tokens", f"mean {summary.mean_completion_tokens:.1f}, truncated {summary.truncation_rate:.1%}"
    )
    table.add_row("time", f"{elapsed_s:.1f} s")
    table.add_row("results", str(output))
    return table


def print_summary(out: TextIO, *args: Any, console: Any = None) -> None:
    """``summary_renderable`` on a terminal (or ``console``), else ``summary_text``'s lines; same arguments."""
    from primerl.runtime.terminal import rich_console

    console = console if console is not None else rich_console(out)
    if console is None:
        print(summary_text(*args), file=out, flush=True)
    else:
        console.print(summary_renderable(*args))
        out.flush()
