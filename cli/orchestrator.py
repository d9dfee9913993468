"""`primerl-orchestrator`: environments, rollouts, advantages, filtering and packing for one run."""

from __future__ import annotations

import argparse
import os
import threading

from primerl.cli.role_entry import run_role
from primerl.cli.role_signals import STARTUP_EXIT_STATUS, StoppedWhileStarting, StopSignals
from primerl.orchestrator.envs.interpreters import ENV_PYTHON_VAR, resolve_env_python  # noqa: F401 (re-exported)
from primerl.proto import telemetry

GC_FREEZE_ENV = "PRIMERL_ORCHESTRATOR_GC_FREEZE"
"""``0``: the daemon does not freeze its start-up heap (for before/after benches)."""


def env_python(config) -> str:
    """The env workers' interpreter: `env_python`, else the default (``primerl.orchestrator.envs.interpreters``)."""
    return resolve_env_python(config.env_python)


def freeze_heap_wanted() -> bool:
    """`GC_FREEZE_ENV` is not ``0``: the daemon freezes its start-up heap (``OrchestratorRunner.freeze_heap``)."""
    return os.environ.get(GC_FREEZE_ENV, "1").strip() != "0"


def serve(config, args: argparse.Namespace) -> int:
    from primerl.orchestrator.runner import OrchestratorRunner
    from primerl.runtime.cpu_budget import apply_budget
    from primerl.runtime.log_setup import configure_logging

    log = configure_logging("orchestrator", "", level=config.log.level, fmt=config.log.format)
    apply_budget("orchestrator", config.threads, log=log)  # env workers inherit its environment
    stop_event = threading.Event()
    runner: OrchestratorRunner | None = None

    def set_up() -> bool:
        """Registered and its training environments loaded (``runner.started``): a stop then ends the step loop
        gracefully; before it (connecting, loading environments) it ends the start-up at once."""
        return runner is not None and runner.started.is_set()

    from primerl.client.broker_errors import BrokerError
    from primerl.client.outage import BrokerOutageExceeded
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.rollout_failures import RolloutsFailing

    # Until here SIGTERM's default action ends the process at once; from here StoppedWhileStarting is caught below.
    StopSignals(log, stop_event, set_up, stopping_message=telemetry.STOPPING).install()
    try:
        runner = OrchestratorRunner(
            config, env_python=env_python(config), stop_event=stop_event, freeze_heap=freeze_heap_wanted()
        )
        return runner.run()
    except StoppedWhileStarting:
        return STARTUP_EXIT_STATUS
    except ValueError as exc:
        log.error(telemetry.ORCHESTRATOR_CANNOT_CONTINUE, error=str(exc))
        return 2
    except RolloutsFailing as exc:  # e.g. seq_len shorter than the prompts: a restart would fail the same way
        log.error(telemetry.ORCHESTRATOR_CANNOT_CONTINUE, error=str(exc), error_type=type(exc).__name__)
        return 2
    except (BrokerOutageExceeded, BrokerError, EnvWorkerError, TimeoutError) as exc:
        # faults that make this process useless but that a restart may get past: one clear line, exit 1
        log.error(telemetry.ORCHESTRATOR_CANNOT_CONTINUE, error=str(exc), error_type=type(exc).__name__)
        return 1


def main(argv: list[str] | None = None) -> int:
    from primerl.configs.orchestrator import OrchestratorConfig

    return run_role(
        "primerl-orchestrator", "orchestrator", OrchestratorConfig, argv, example="--batch-size 64", serve=serve
    )


if __name__ == "__main__":
    raise SystemExit(main())
