"""`primerl sft @ sft.toml [--data.path samples.jsonl ...]`: supervised fine-tuning on chat samples.

Exit status: 0 when ``max_steps`` were trained (``weights: DIR`` on stdout); 2 for a config or data problem; 128 +
the signal number (130 SIGINT, 143 SIGTERM) when interrupted: the step reached is exported as
``weights/step_{N}`` (N < max_steps) and one line on stderr says so."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from primerl.cli.role_entry import run_role


def serve(config, args: argparse.Namespace) -> int:
    from primerl.runtime.cpu_budget import apply_budget
    from primerl.runtime.log_setup import configure_logging

    log = configure_logging("sft", "", level=config.log.level, fmt=config.log.format)
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
    try:
        result = run_sft(config, dist_info, stop_event)
    except (ValueError, FileNotFoundError) as exc:
        log.error("sft cannot continue", error=str(exc))
        return 2
    finally:
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
