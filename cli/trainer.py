"""`primerl-trainer`: one trainer rank (start N of them with `torchrun --nproc-per-node N $(which primerl-trainer) ...`)."""

from __future__ import annotations

import argparse
import signal
import threading

from primerl.cli.role_entry import run_role


def serve(config, args: argparse.Namespace, *, objective: str = "rl") -> int:
    from primerl.runtime.cpu_budget import apply_budget
    from primerl.runtime.log_setup import bind_context, configure_logging

    log = configure_logging("trainer", "", level=config.log.level, fmt=config.log.format)
    apply_budget("trainer", config.threads, log=log)  # before torch loads OpenMP: thread counts, wait policy

    from primerl.trainer.distributed import init_distributed, shutdown_distributed
    from primerl.trainer.runner import TrainerRunner

    dist_info = init_distributed()
    bind_context(rank=dist_info.rank)
    stop_event = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("stopping after the current step", signal=signal.Signals(signum).name)
        stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        return TrainerRunner(config, dist_info, objective=objective, stop_event=stop_event).run()
    except ValueError as exc:  # a config or data problem the user must fix
        log.error("trainer cannot continue", error=str(exc))
        return 2
    finally:
        shutdown_distributed(dist_info)


def main(argv: list[str] | None = None) -> int:
    from primerl.trainer.config import TrainerConfig

    return run_role("primerl-trainer", "trainer", TrainerConfig, argv, example="--optim.lr 1e-5", serve=serve)


if __name__ == "__main__":
    raise SystemExit(main())
