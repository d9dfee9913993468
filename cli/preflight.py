"""The preflight: cheap checks of a run's config against this machine, before anything expensive starts.

`primerl rl` runs every check before it starts a role (vLLM takes 20-100 s to start; a typo in an environment id
should not cost that); each daemon started on its own runs the checks of its role (`run_role`). A check returns
`Finding`s: an error is one line saying what is wrong and how to fix it, and stops the start with exit status 2;
a warning is printed and the start goes on. Tracebacks and the env workers' output go to a log file only.

    checks                            primerl rl  broker  trainer/sft  orchestrator  inference
    env interpreter, environments          x                                 x
    prompt lengths (chat template)         x                                 *
    model and tokenizer paths              x                   x                         x
    W&B login (offline fallback)           x                   x             x
    fixed ports free                       x         x
    memory of the vLLM engines (CPU)       x
    teacher model and tokenizer            x
    * when its model name is a local directory (that tokenizer measures the prompts)

The checks run concurrently; loading the environments (an env worker each, ~2.3 s for reverse-text on an idle core)
and the tokenizer (importing transformers, ~3 s) dominate: 6.2 s in all for the example config on 2 cores under a
load average of 6. `primerl rl` sets
`$PRIMERL_SKIP_PREFLIGHT` for its roles, which it has checked already; a user may set it to skip the checks.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

SKIP_VAR = "PRIMERL_SKIP_PREFLIGHT"
CHECK_TIMEOUT_S = 120.0
"""A check still running after this is reported as a warning and the start goes on (env workers bound their
own start at `preflight_envs.ENV_START_TIMEOUT_S`, so this is a backstop)."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """What a check found. ``message`` is one line: what is wrong and how to fix it; ``detail`` (a traceback, an
    env worker's stderr) goes to the log only."""

    message: str
    error: bool = True
    detail: str = ""


def error(message: str, detail: str = "") -> Finding:
    return Finding(message, True, detail)


def warning(message: str, detail: str = "") -> Finding:
    return Finding(message, False, detail)


Check = Callable[[], list[Finding]]


@dataclasses.dataclass
class PreflightReport:
    findings: list[Finding]
    elapsed_s: float
    check_times_s: dict[str, float]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.error]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if not f.error]


def run_checks(checks: Mapping[str, Check], *, timeout_s: float = CHECK_TIMEOUT_S) -> PreflightReport:
    """Run the checks at once, each in a thread; findings come back in the order of ``checks``. A check that
    raises is a bug of the preflight, not of the config: it becomes a warning (traceback in the detail)."""
    started_s = time.monotonic()
    results: dict[str, list[Finding]] = {}
    times_s: dict[str, float] = {}

    def run(name: str, check: Check) -> None:
        check_started_s = time.monotonic()
        try:
            results[name] = list(check())
        except Exception as exc:  # noqa: BLE001 - reported as a warning with its traceback, never swallowed
            results[name] = [warning(f"the {name} check could not run ({type(exc).__name__}: {exc}); starting "
                                     "without it", traceback.format_exc())]
        times_s[name] = time.monotonic() - check_started_s

    threads = [threading.Thread(target=run, args=(name, check), name=f"preflight-{name}", daemon=True)
               for name, check in checks.items()]
    for thread in threads:
        thread.start()
    deadline_s = started_s + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline_s - time.monotonic()))
    findings: list[Finding] = []
    for name in checks:
        if name not in results:
            findings.append(warning(f"the {name} check did not finish within {timeout_s:g} s; starting without it"))
            continue
        findings.extend(results[name])
    return PreflightReport(findings, time.monotonic() - started_s, times_s)


def report(prog: str, result: PreflightReport, log_path: Path | None, err=None) -> int | None:
    """Print one line per finding (errors first), write the details to ``log_path``; 2 when there are errors."""
    err = err or sys.stderr
    for finding in result.errors + result.warnings:
        prefix = "" if finding.error else "warning: "
        print(f"{prog}: {prefix}{finding.message}", file=err, flush=True)
    if log_path is not None:
        _write_log(log_path, prog, result)
    if not result.errors:
        return None
    where = f"; details in {log_path}" if log_path is not None else ""
    count = len(result.errors)
    print(f"{prog}: the preflight found {count} problem{'s' * (count > 1)} in {result.elapsed_s:.1f} s; nothing "
          f"was started{where}", file=err, flush=True)
    return 2


def _write_log(log_path: Path, prog: str, result: PreflightReport) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    times = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in result.check_times_s.items())
    lines = [f"{time.strftime('%Y-%m-%d %H:%M:%S')} {prog} preflight: {result.elapsed_s:.2f} s ({times}); "
             f"{len(result.errors)} errors, {len(result.warnings)} warnings"]
    for finding in result.findings:
        lines.append(f"{'error' if finding.error else 'warning'}: {finding.message}")
        if finding.detail:
            lines.extend("    " + line for line in finding.detail.rstrip().splitlines())
    with open(log_path, "a") as log:
        log.write("\n".join(lines) + "\n")


def skipped() -> bool:
    return os.environ.get(SKIP_VAR, "").strip().lower() in ("1", "true", "yes")


# ------------------------------------------------------------------------------------------------ the runs


def rl_checks(config) -> dict[str, Check]:
    """The checks of a whole `primerl rl` run (an `RLConfig`)."""
    from primerl.cli.preflight_envs import env_checks
    from primerl.cli.preflight_model import model_checks
    from primerl.cli.preflight_model import teacher_tokenizer_check
    from primerl.cli.preflight_system import engine_memory_check, port_check, rl_ports, wandb_check
    from primerl.cli.role_configs import has_gpus

    trainer, orchestrator, inference, teacher = config.trainer, config.orchestrator, config.inference, config.teacher
    names = {"trainer.model.name": (trainer.model.name, "model"),
             "trainer.tokenizer.name": (trainer.tokenizer.name, "tokenizer"),
             "inference.model.name": (inference.model.name, "model")}
    engines = {"inference": inference}
    checks = {}
    if teacher is not None:
        names["teacher.model.name"] = (teacher.model.name, "model")
        engines["teacher"] = teacher
        checks["teacher"] = teacher_tokenizer_check(teacher.model.name, trainer.tokenizer.name)
    return {
        "environments": env_checks(orchestrator, prefix="orchestrator.", tokenizer=trainer.tokenizer.name,
                                   max_model_len=inference.model.max_model_len),
        "model": model_checks(names, shared_name=config.model.name),
        "wandb": wandb_check({"trainer": trainer, "orchestrator": orchestrator}),
        "ports": port_check(rl_ports(config.with_free_broker_ports())),
        "memory": engine_memory_check(engines, gpus=has_gpus()),
        **checks,
    }


def role_checks(role: str, config) -> dict[str, Check]:
    """The checks of one daemon started on its own, with its role config."""
    from primerl.cli.preflight_envs import env_checks
    from primerl.cli.preflight_model import model_checks
    from primerl.cli.preflight_system import broker_ports, port_check, wandb_check

    if role == "broker":
        return {"ports": port_check(broker_ports(config, prefix=""))}
    if role == "inference":
        return {"model": model_checks({"model.name": (config.model.name, "model")})}
    if role in ("trainer", "sft"):  # `primerl sft` is a trainer with a data file
        return {"model": model_checks({"model.name": (config.model.name, "model"),
                                       "tokenizer.name": (config.tokenizer.name or config.model.name, "tokenizer")},
                                      shared_name=config.model.name, local_only=frozenset({"model.name"})),
                "wandb": wandb_check({"trainer": config})}
    if role == "orchestrator":
        # Its model name is the served name: a tokenizer to measure prompts with only when it is a local directory.
        tokenizer = config.model.name if Path(config.model.name).is_dir() else None
        return {"environments": env_checks(config, prefix="", tokenizer=tokenizer, max_model_len=None),
                "wandb": wandb_check({"orchestrator": config})}
    return {}


def role_preflight(prog: str, role: str, config) -> int | None:
    """The preflight of a daemon started on its own; None to go on, 2 to stop. Skipped under `primerl rl`."""
    if skipped():
        return None
    checks = role_checks(role, config)
    if not checks:
        return None
    output_dir = getattr(config, "output_dir", None)
    log_path = Path(output_dir) / "logs" / f"preflight-{role}.log" if output_dir is not None else None
    with _logging_to(log_path):
        result = run_checks(checks)
    return report(prog, result, log_path)


def rl_preflight(config, log_path: Path) -> int | None:
    """The preflight of `primerl rl`; None to go on, 2 to stop."""
    with _logging_to(log_path):
        result = run_checks(rl_checks(config))
    return report("primerl rl", result, log_path)


class _logging_to:
    """Route this process's log records (the env workers' stderr lines) to ``log_path`` (or nowhere) while the
    checks run, so that the console shows only the findings; the previous handlers come back afterwards."""

    def __init__(self, log_path: Path | None) -> None:
        self.log_path = log_path

    def __enter__(self) -> None:
        import logging

        from primerl.runtime.log_setup import configure_logging

        import structlog

        root = logging.getLogger()
        self.saved = (list(root.handlers), root.level, structlog.get_config(),
                      structlog.contextvars.get_contextvars())
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
