"""`primerl sft @ sft.toml [--data.path samples.jsonl ...]`: supervised fine-tuning on chat samples.

On a terminal, stdout shows a progress bar (rich: steps, the step's loss, elapsed time and ETA) over the log lines
(stderr); when stdout is not a terminal it carries only the ``weights: DIR`` line, as it always did.

Exit status: 0 when ``max_steps`` were trained (``weights: DIR`` on stdout); 2 for a config or data problem; 128 +
the signal number (130 SIGINT, 143 SIGTERM) when interrupted: the step reached is exported as
``weights/step_{N}`` (N < max_steps) and one line on stderr says so."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from primerl.cli.role_entry import run_role


class StderrNow:
    """``sys.stderr`` as it is at each write: the log handler keeps writing above the progress bar, which swaps
    ``sys.stderr`` for its own proxy while it is shown."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class SFTProgressBar:
    """The progress bar of `primerl sft` on a terminal: ``SFT ━━━━╸━━━ 412/1000 loss 0.5136 0:00:41 ETA 0:00:58``."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]SFT"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            redirect_stdout=False,
            redirect_stderr=sys.stderr.isatty(),  # the log lines print above the bar when they share the terminal
        )
        self.task: Any = None

    def on_step(self, step: int, max_steps: int, loss: float) -> None:
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("sft", total=max_steps, completed=step - 1, loss="-")
        self.progress.update(self.task, completed=step, loss=f"{loss:.4f}")

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()
            self.task = None


def serve(config, args: argparse.Namespace) -> int:
    from primerl.runtime.cpu_budget import apply_budget
    from primerl.runtime.log_setup import configure_logging
    from primerl.runtime.terminal import rich_console

    console = rich_console(sys.stdout)
    stream = StderrNow() if console is not None else None
    log = configure_logging("sft", "", level=config.log.level, fmt=config.log.format, stream=stream)
    apply_budget("trainer", config.threads, log=log)  # [threads]: before torch loads OpenMP

    from primerl.trainer.distributed import init_distributed, shutdown_distributed
    from primerl.trainer.sft_runner import run_sft

    dist_info = init_distributed()
    stop_event = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        if not signals:
            log.info("stopping after the current step", signal=signal.Signals(signum).name)
        signals.append(signum)
        stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    bar = SFTProgressBar(console) if console is not None and dist_info.is_main else None
    try:
        result = run_sft(config, dist_info, stop_event, on_step=bar.on_step if bar is not None else None)
    except (ValueError, FileNotFoundError) as exc:
        log.error("sft cannot continue", error=str(exc))
        return 2
    finally:
        if bar is not None:
            bar.close()
        shutdown_distributed(dist_info)
    if not result.finished:
        # Interrupted: 128 + the signal, as a shell reports a process the signal ended (130 SIGINT, 143 SIGTERM).
        signum = signals[0] if signals else signal.SIGTERM
        if dist_info.is_main:
            saved = (
                f"weights of step {result.last_step} in {result.weights_dir}" if result.weights_dir else "no weights"
            )
            print(
                f"primerl sft: interrupted by {signal.Signals(signum).name} after step {result.last_step} of "
                f"{result.max_steps}; {saved} (not the final model)",
                file=sys.stderr,
            )
        return 128 + int(signum)
    if dist_info.is_main:
        print(f"weights: {result.weights_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from primerl.configs.trainer import SFTConfig

    return run_role("primerl sft", "sft", SFTConfig, argv, example="--data.path samples.jsonl", serve=serve)


if __name__ == "__main__":
    raise SystemExit(main())
