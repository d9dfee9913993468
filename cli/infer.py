"""`primerl-infer`: the inference daemon (a vLLM OpenAI-compatible server that joins the broker's mesh); with
`--role teacher`, the frozen teacher of online distillation (no weight updates)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil

from primerl.cli.role_entry import run_role
from primerl.cli.role_signals import StopSignals
from primerl.proto.ready_file import write_ready_file

STOP_GRACE_S = 10.0
SHUTDOWN_GRACE_S = 4.0
"""When the broker ends the run: in-flight requests get this long, so the daemon is gone within 10 s."""


async def _serve(config, args: argparse.Namespace, log) -> int:
    from primerl.inference.service import InferenceService

    stop_event = asyncio.Event()
    service = InferenceService(config)
    started = False

    def remove_work_dir() -> None:
        # vLLM's start-up (10-40 s on CPU) blocks the event loop for seconds at a time, so a signal would wait
        # for it. Nothing is served or owed yet: leave at once. The engine core dies with this process
        # (`parent_death`); the work directory goes now.
        if service._own_work_dir:
            shutil.rmtree(service.work_dir, ignore_errors=True)

    signals = StopSignals(
        log,
        stop_event,
        set_up=lambda: started,
        exit_while_starting=remove_work_dir,
        log_fields=lambda: {"policy_version": service.policy_version},
    )
    signals.install()
    try:
        address = await service.start()
    except Exception as exc:  # engine that cannot start, broker unreachable, port in use
        log.error("inference worker cannot start", error=f"{type(exc).__name__}: {exc}")
        return 1
    started = True
    signals.install(asyncio.get_running_loop())  # the loop serves now: its handler sets the event between tasks
    try:
        if args.ready_file is not None:
            write_ready_file(
                args.ready_file,
                config.role,
                {
                    "http_port": address.port,
                    "base_url": address.base_url,
                    "advertised_url": address.advertised_url,
                    "worker_id": service.control.worker_id,
                },
            )
        return await service.serve_until(stop_event)
    finally:
        await service.stop(grace_s=SHUTDOWN_GRACE_S if service.stopped_by_broker else STOP_GRACE_S)


def serve(config, args: argparse.Namespace) -> int:
    from primerl.inference.vllm_plugin import INFER_PID_ENV
    from primerl.runtime.cpu_budget import apply_budget
    from primerl.runtime.log_setup import configure_logging
    from primerl.runtime.parent_death import install_fork_hook

    log = configure_logging(config.role, level=config.log.level, fmt=config.log.format)  # role=inference|teacher
    # vLLM's engine core (forked on CPU, spawned on GPU) and what it starts end with this daemon, even SIGKILLed.
    install_fork_hook()
    os.environ[INFER_PID_ENV] = str(os.getpid())
    apply_budget(config.role, config.threads, log=log)  # before vLLM starts: its CPU binding, the wait policy
    return asyncio.run(_serve(config, args, log))


def main(argv: list[str] | None = None) -> int:
    from primerl.configs.inference import InferenceConfig

    return run_role(
        "primerl-infer",
        "inference",
        InferenceConfig,
        argv,
        example="--model.max-model-len 4096 (a teacher: --role teacher)",
        serve=serve,
    )


if __name__ == "__main__":
    raise SystemExit(main())
