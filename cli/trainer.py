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
    except Exception as exc:
        return _exit_status_of(exc, log)
    finally:
        shutdown_distributed(dist_info)


def _exit_status_of(exc: Exception, log) -> int:
    """Faults with one clear line and a status that tells a restarter what to do (``primerl rl``, systemd):
    2 (do not restart) when a newer trainer took over the run's policy lineage, 1 when the broker stayed
    unreachable past ``broker.outage_s`` (a restart may heal it). Anything else is raised (traceback)."""
    from primerl.broker.control_client import BrokerLost
    from primerl.broker.weight_store import LineageSuperseded
    from primerl.runtime.broker_outage import BrokerOutageExceeded

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, LineageSuperseded):
            log.error("a newer trainer publishes this run's policy; this one stops and must not be restarted",
                      error=str(cause))
            return 2
        if isinstance(cause, (BrokerLost, BrokerOutageExceeded)):
            log.error("trainer cannot continue: the broker is unreachable", error=str(cause))
            return 1
        cause = cause.__cause__
    raise exc


def main(argv: list[str] | None = None) -> int:
    from primerl.trainer.config import TrainerConfig

    return run_role("primerl-trainer", "trainer", TrainerConfig, argv, example="--optim.lr 1e-5", serve=serve)


if __name__ == "__main__":
    raise SystemExit(main())
