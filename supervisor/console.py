"""The terminal of `primerl rl`: lines said over a live progress line. On a terminal the progress line is redrawn
in place (``\\r``), so a line said clears it first, and a line that must stay visible ends it."""

from __future__ import annotations

from typing import TextIO


class RunConsole:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.is_tty = out.isatty()

    def say(self, text: str) -> None:
        if self.is_tty:
            text = "\r\x1b[K" + text
        print(text, file=self.out, flush=True)

    def end_progress_line(self) -> None:
        """Keep the progress line on screen: what follows starts on a line of its own."""
        if self.is_tty:
            self.out.write("\n")
            self.out.flush()
