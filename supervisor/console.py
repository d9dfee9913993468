"""The terminal of `primerl rl`: lines said over a live progress line. On a terminal the progress line is redrawn
in place (``\\r``), so a line said clears it first, and a line that must stay visible ends it.

On a terminal the progress line and the closing summary render with rich (a bar, colours: ``show_progress``,
``show_summary``); otherwise the plain lines of ``Progress.line()`` and ``run_summary`` are printed unchanged
(logs and scripts read them)."""

from __future__ import annotations

import shutil
from typing import Any, TextIO

BAR_WIDTH = 20


class RunConsole:
    def __init__(self, out: TextIO) -> None:
        from primerl.runtime.terminal import is_terminal

        self.out = out
        self.is_tty = is_terminal(out)

    def say(self, text: str) -> None:
        if self.is_tty:
            text = "\r\x1b[K" + text
        print(text, file=self.out, flush=True)

    def end_progress_line(self) -> None:
        """Keep the progress line on screen: what follows starts on a line of its own."""
        if self.is_tty:
            self.out.write("\n")
            self.out.flush()

    def show_progress(self, progress: Any) -> None:
        """On a terminal: redraw the progress line in place, with rich (``progress_text``); else one plain line
        (``Progress.line()``)."""
        if not self.is_tty:
            print(progress.line(), file=self.out, flush=True)
            return
        from primerl.runtime.terminal import render_ansi

        width = max(20, shutil.get_terminal_size().columns - 1)
        self.out.write("\r\x1b[K" + render_ansi(progress_text(progress), width=width))
        self.out.flush()

    def show_summary(self, text: str) -> None:
        """The closing summary (``run_summary``'s text): a rich panel on a terminal, the plain lines otherwise."""
        if not self.is_tty:
            print(text, file=self.out, flush=True)
            return
        from primerl.runtime.terminal import rich_console

        console = rich_console(self.out, force=True)
        console.print(summary_renderable(text))
        self.out.flush()


def progress_text(progress: Any) -> Any:
    """The figures of ``Progress.line()`` as a rich Text with a bar: ``step 12/30 ━━━━━━━━╸━━━━ reward 0.512 ...``."""
    from rich.text import Text

    from primerl.supervisor.run_progress import duration

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    text = Text()
    text.append(f"step {progress.step}/{progress.max_steps or '?'} ", style="bold")
    if progress.max_steps:
        done = min(1.0, progress.step / progress.max_steps)
        filled = int(round(done * BAR_WIDTH))
        text.append("━" * filled, style="green")
        text.append("━" * (BAR_WIDTH - filled), style="grey37")
        text.append(" ")
    text.append(" reward ")
    text.append(progress.reward_text(), style="bold green")
    text.append("  loss ")
    text.append(number(progress.loss, ".4f"), style="cyan")
    text.append(f"  gen {number(progress.tokens_per_s, '.0f')} tok/s")
    served = "-" if progress.served_version is None else str(progress.served_version)
    lag = "-" if progress.served_version is None else str(max(0, progress.step - progress.served_version))
    text.append(f"  served v{served} (lag {lag})")
    if progress.num_interleave_fallbacks:
        text.append(f"  fallbacks {progress.num_interleave_fallbacks}", style="yellow")
    eta = progress.eta_s()
    text.append(f"  ETA {'-' if eta is None else duration(eta)}", style="magenta")
    return text


def summary_renderable(text: str) -> Any:
    """``run_summary``'s lines in a rich panel: the first line its title, the rest its body."""
    from rich.panel import Panel
    from rich.text import Text

    first, _, rest = text.partition("\n")
    return Panel(Text(rest), title=Text(first, style="bold green"), title_align="left", expand=False)
