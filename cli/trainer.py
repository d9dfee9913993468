"""`primerl-trainer`: one trainer rank (start N of them with
`torchrun --nproc-per-node N $(which primerl-trainer) ...`)."""

from __future__ import annotations

import argparse
import threading

from primerl.cli.role_entry import run_role
from primerl.cli.role_signals import STARTUP_EXIT_STATUS, StoppedWhileStarting, StopSignals
from primerl.proto import telemetry


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
    runner: TrainerRunner | None = None

    def set_up() -> bool:
        """Registered with the broker: from then on a stop lets the step in hand finish (publish, checkpoint,
        commit) and deregisters; before it (metrics, model, optimizer, connecting) a stop ends the start-up."""
        # the registration is kept after a deregistration
        return runner is not None and runner.control is not None and runner.control.registration is not None

    config.output_dir.mkdir(parents=True, exist_ok=True)
    # Until here SIGTERM's default action ends the process at once; from here StoppedWhileStarting is caught below.
    StopSignals(log, stop_event, set_up, stopping_message="stopping after the current step").install()
    try:
        runner = TrainerRunner(config, dist_info, objective=objective, stop_event=stop_event)
        return runner.run()
    except StoppedWhileStarting:
        return STARTUP_EXIT_STATUS
    except Exception as exc:
        return _exit_status_of(exc, log)
    finally:
        shutdown_distributed(dist_info)


def _exit_status_of(exc: Exception, log) -> int:
    """Faults with one clear line and a status that tells a restarter what to do (``primerl rl``, systemd):
    2 (do not restart) when a newer trainer took over the run's policy lineage, or for a config or data problem
    (a ``ValueError``); 1 when the broker stayed unreachable past ``broker.outage_s`` or a checkpoint found its
    disk full (a restart may heal it, once there is room: it resumes from the checkpoint kept). Anything else is
    raised (traceback)."""
    from primerl.client.broker_errors import BrokerLost, IncarnationSuperseded
    from primerl.client.outage import BrokerOutageExceeded
    from primerl.proto.weight_refusals import LineageSuperseded
    from primerl.trainer.checkpoint import CheckpointDiskFull

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, (LineageSuperseded, IncarnationSuperseded)):
            log.error(
                "a newer trainer publishes this run's policy; this one stops and must not be restarted",
                error=str(cause),
            )
            return 2
        if isinstance(cause, (BrokerLost, BrokerOutageExceeded)):
            log.error("trainer cannot continue: the broker is unreachable", error=str(cause))
            return 1
        if isinstance(cause, CheckpointDiskFull):
            log.error(telemetry.CHECKPOINT_DISK_FULL, error=str(cause))
            return 1
        cause = cause.__cause__
    if isinstance(exc, ValueError):  # a config or data problem the user must fix
        log.error("trainer cannot continue", error=str(exc))
        return 2
    raise exc


def main(argv: list[str] | None = None) -> int:
    from primerl.configs.trainer import TrainerConfig

    return run_role("primerl-trainer", "trainer", TrainerConfig, argv, example="--optim.lr 1e-5", serve=serve)


if __name__ == "__main__":
    raise SystemExit(main())
