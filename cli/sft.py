"""`primerl sft @ sft.toml [--data.path samples.jsonl ...]`: supervised fine-tuning on chat samples."""

from __future__ import annotations

import argparse
import signal
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
    signal.signal(signal.SIGTERM, lambda *_: stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: stop_event.set())
    config.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        final_dir = run_sft(config, dist_info, stop_event)
    except (ValueError, FileNotFoundError) as exc:
        log.error("sft cannot continue", error=str(exc))
        return 2
    finally:
        shutdown_distributed(dist_info)
    if dist_info.is_main:
        print(f"weights: {final_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from primerl.trainer.config import SFTConfig

    return run_role("primerl sft", "sft", SFTConfig, argv, example="--data.path samples.jsonl", serve=serve)


if __name__ == "__main__":
    raise SystemExit(main())
