"""Which preflight checks run where: every check under `primerl rl`, a daemon started on its own the checks of its
role (`run_role`). Under `primerl rl` the fast checks (paths, ports, memory, W&B: milliseconds) run before any
role starts; the slow ones (``BESIDE_THE_START``: the environments, the teacher's tokenizer, the LoRA targets) run
while the roles start (vLLM's import alone takes ~7 s), and the orchestrator waits for their verdict before its first
rollout (``runtime.start_gate``); a finding stops every role, with the same lines and exit status 2. The
environments are checked by the orchestrator itself there, on the env workers and the tokenizer it loads for the
run (``orchestrator.env_preflight``; loading them twice cost ~3 s of a 2-core start), when it starts with the other
roles (not with evals or a teacher, when it waits for inference). ``--preflight-first`` and
``--check`` run them all here before anything starts. Tracebacks and the env workers' output go to a log file
only; the console shows the findings.

    checks                            primerl rl  broker  trainer/sft  orchestrator  inference
    env interpreter, environments          x                                 x
    prompt lengths (chat template)         x                                 *
    model and tokenizer paths              x                   x                         x
    W&B login (offline fallback)           x                   x             x
    fixed ports free                       x         x
    memory of the vLLM engines (CPU)       x
    teacher model and tokenizer            x
    LoRA target modules of the model       x
    * when its model name is a local directory (that tokenizer measures the prompts)

The checks run concurrently; loading the environments (an env worker each, ~2.3 s for reverse-text on an idle core)
and the tokenizer (importing transformers, ~3 s) dominate: 4.3 s wall, 6.7 CPU-s for the example config on 2
cores (`primerl rl --check`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from primerl.cli.preflight.base import Check, PreflightReport, report, run_checks, skipped
from primerl.runtime.run_files import LOGS_DIR


def rl_checks(config) -> dict[str, Check]:
    """The checks of a whole `primerl rl` run (an `RLConfig`)."""
    from primerl.cli.preflight.envs import env_checks
    from primerl.cli.preflight.model import lora_targets_check, model_checks, teacher_tokenizer_check
    from primerl.cli.preflight.system import engine_memory_check, port_check, rl_ports, wandb_check
    from primerl.supervisor.role_configs import has_gpus

    trainer, orchestrator, inference, teacher = config.trainer, config.orchestrator, config.inference, config.teacher
    names = {
        "trainer.model.name": (trainer.model.name, "model"),
        "trainer.tokenizer.name": (trainer.tokenizer.name, "tokenizer"),
        "inference.model.name": (inference.model.name, "model"),
    }
    engines = {"inference": inference}
    checks = {}
    if teacher is not None:
        names["teacher.model.name"] = (teacher.model.name, "model")
        engines["teacher"] = teacher
        checks["teacher"] = teacher_tokenizer_check(teacher.model.name, trainer.tokenizer.name)
    if trainer.model.lora is not None:
        checks["lora_targets"] = lora_targets_check(
            "trainer.model.lora.target_modules", trainer.model.name, trainer.model.lora.target_modules
        )
    return {
        "environments": env_checks(
            orchestrator,
            prefix="orchestrator.",
            tokenizer=trainer.tokenizer.name,
            max_model_len=inference.model.max_model_len,
        ),
        "model": model_checks(names, shared_name=config.model.name),
        "wandb": wandb_check({"trainer": trainer, "orchestrator": orchestrator}),
        "ports": port_check(rl_ports(config.with_free_broker_ports())),
        "memory": engine_memory_check(engines, gpus=has_gpus()),
        **checks,
    }


def role_checks(role: str, config) -> dict[str, Check]:
    """The checks of one daemon started on its own, with its role config."""
    from primerl.cli.preflight.envs import env_checks
    from primerl.cli.preflight.model import model_checks
    from primerl.cli.preflight.system import broker_ports, port_check, wandb_check

    if role == "broker":
        return {"ports": port_check(broker_ports(config, prefix=""))}
    if role == "inference":
        return {"model": model_checks({"model.name": (config.model.name, "model")})}
    if role in ("trainer", "sft"):  # `primerl sft` is a trainer with a data file
        return {
            "model": model_checks(
                {
                    "model.name": (config.model.name, "model"),
                    "tokenizer.name": (config.tokenizer.name or config.model.name, "tokenizer"),
                },
                shared_name=config.model.name,
                local_only=frozenset({"model.name"}),
            ),
            "wandb": wandb_check({"trainer": config}),
        }
    if role == "orchestrator":
        # Its model name is the served name: a tokenizer to measure prompts with only when it is a local directory.
        tokenizer = config.model.name if Path(config.model.name).is_dir() else None
        return {
            "environments": env_checks(config, prefix="", tokenizer=tokenizer, max_model_len=None),
            "wandb": wandb_check({"orchestrator": config}),
        }
    return {}


def role_preflight(prog: str, role: str, config) -> int | None:
    """The preflight of a daemon started on its own; None to go on, 2 to stop. Skipped under `primerl rl`."""
    if skipped():
        return None
    checks = role_checks(role, config)
    if not checks:
        return None
    output_dir = getattr(config, "output_dir", None)
    log_path = Path(output_dir) / LOGS_DIR / f"preflight-{role}.log" if output_dir is not None else None
    with _logging_to(log_path):
        result = run_checks(checks)
    return report(prog, result, log_path)


BESIDE_THE_START = frozenset({"environments", "teacher", "lora_targets"})
"""The slow checks (an env worker per environment, importing transformers for a tokenizer or a model on the meta
device: seconds) that `primerl rl` runs while the roles start (`BackgroundPreflight`). The others take
milliseconds and run before anything starts; the port and memory checks must: the roles bind those ports and vLLM
takes that memory."""


def rl_preflight(config, log_path: Path) -> int | None:
    """The whole preflight of `primerl rl` (``--check``, ``--preflight-first``); None to go on, 2 to stop."""
    with _logging_to(log_path):
        result = run_checks(rl_checks(config))
    return report("primerl rl", result, log_path)


def rl_fast_preflight(config, log_path: Path) -> int | None:
    """The checks of `primerl rl` that run before any role starts (all but ``BESIDE_THE_START``); when one finds
    a problem the slow ones run too, so that every mistake gets its line at once, as nothing has started yet.
    None to go on (then ``BackgroundPreflight`` runs the rest), 2 to stop."""
    checks = rl_checks(config)
    with _logging_to(log_path):
        result = run_checks({name: check for name, check in checks.items() if name not in BESIDE_THE_START})
        if result.errors:
            result = run_checks(checks)
    return report("primerl rl", result, log_path)


BACKGROUND_NICE = 10
"""The niceness of the checks run beside the start: they use the CPU that vLLM's import (the longest path to the
first rollout) leaves idle, rather than slowing it (2 cores: measured in bench/startup_timeline.py)."""


class BackgroundPreflight:
    """The slow part of `primerl rl`'s preflight (``BESIDE_THE_START``), in a thread while the roles start.

    ``start`` runs the checks (their log records and env workers' output go to ``log_path``, as before the
    start); ``done`` says whether they finished; ``verdict(stopped)``, once done, prints one line per finding
    (the same lines as the preflight before the start) and returns None to go on or 2, in which case the caller
    has stopped the roles named in ``stopped`` first (the orchestrator waits for ``runtime.start_gate`` before
    its first rollout, so none was generated).

    With ``env_report`` the environments are checked by the orchestrator, on the env workers and the tokenizer it
    loads for the run (``orchestrator.env_preflight``), instead of a second time here: the launcher gives it
    ``orchestrator_env()`` and the check waits for its report at ``env_report``, or until
    ``orchestrator_ended()`` says it ended without one (its failure then speaks for itself)."""

    def __init__(self, config, log_path: Path, env_report: Path | None = None) -> None:
        from primerl.runtime.start_gate import EnvCheckRequest

        self.checks = {name: check for name, check in rl_checks(config).items() if name in BESIDE_THE_START}
        self.log_path = log_path
        self.result: PreflightReport | None = None
        self._thread: threading.Thread | None = None
        self._orchestrator_ended = threading.Event()
        self.env_request: EnvCheckRequest | None = None
        if env_report is not None and "environments" in self.checks:
            from primerl.cli.preflight.envs import usable_tokenizer

            self.env_request = EnvCheckRequest(
                str(env_report), usable_tokenizer(config.trainer.tokenizer.name), config.inference.model.max_model_len
            )
            self.checks["environments"] = _orchestrator_report(env_report, self._orchestrator_ended)

    def orchestrator_env(self) -> dict[str, str]:
        """The orchestrator's environment variables that ask it to check its environments (none: checked here)."""
        return self.env_request.to_env() if self.env_request is not None else {}

    def orchestrator_ended(self) -> None:
        """The orchestrator's process ended: its report, if it wrote none, will not come."""
        self._orchestrator_ended.set()

    def start(self) -> BackgroundPreflight:
        self._thread = threading.Thread(target=self._run, name="preflight", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:  # Linux: this thread only, and what it starts (its check threads, the env workers)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except OSError:
            pass
        with _logging_to(self.log_path):
            self.result = run_checks(self.checks)

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.done()

    def verdict(self, stopped: list[str] | None = None) -> int | None:
        assert self.result is not None, "verdict() before the checks finished"
        return report("primerl rl", self.result, self.log_path, stopped=stopped)


REPORT_POLL_S = 0.05


def _orchestrator_report(path: Path, ended: threading.Event) -> Check:
    """The environments' findings from the orchestrator's report at ``path`` (``runtime.start_gate``), waited for;
    a warning when the orchestrator ended without writing one."""

    def check() -> list:
        from primerl.runtime.findings import Finding, warning
        from primerl.runtime.start_gate import read_env_check_report

        while True:
            findings = read_env_check_report(path)
            if findings is not None:
                return [Finding(f["message"], bool(f["error"]), f.get("detail", "")) for f in findings]
            if ended.is_set():
                return [
                    warning(
                        "the environments were not checked: the orchestrator ended before it loaded them "
                        "(logs/orchestrator.log says why)"
                    )
                ]
            ended.wait(REPORT_POLL_S)

    return check


class _logging_to:
    """Route this process's log records (the env workers' stderr lines) to ``log_path`` (or nowhere) while the
    checks run, so that the console shows only the findings; the previous handlers come back afterwards."""

    def __init__(self, log_path: Path | None) -> None:
        self.log_path = log_path

    def __enter__(self) -> None:
        import logging

        import structlog

        from primerl.runtime.log_setup import configure_logging

        root = logging.getLogger()
        self.saved = (list(root.handlers), root.level, structlog.get_config(), structlog.contextvars.get_contextvars())
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.stream = open(self.log_path, "a")
        else:
            self.stream = open(os.devnull, "w")
        configure_logging("preflight", level="info", stream=self.stream)

    def __exit__(self, *exc_info: object) -> None:
        import logging

        import structlog

        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        handlers, level, structlog_config, context = self.saved
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        structlog.configure(**structlog_config)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**context)
        self.stream.close()
