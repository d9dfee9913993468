"""What every preflight check shares: a check is a callable that returns `Finding`s; an error finding stops the
start with exit status 2, a warning is printed and the start goes on. `run_checks` runs checks concurrently, each
bounded by `CHECK_TIMEOUT_S`; `report` prints one line per finding and writes the details to a log file.
`$PRIMERL_SKIP_PREFLIGHT` skips the checks (`primerl rl` sets it for its roles, which it checked already).
The check modules (`envs`, `model`, `system`) import this module and not each other's internals; `Finding` (with
`error` and `warning`) lives in `primerl.runtime.findings`, where the orchestrator's environment checks reach it.
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

from primerl.runtime.findings import Finding, error, warning  # noqa: F401 - error: re-exported for the checks

SKIP_VAR = "PRIMERL_SKIP_PREFLIGHT"
CHECK_TIMEOUT_S = 150.0
"""A check still running after this is reported as a warning and the start goes on (env workers bound their
own start at `preflight_envs.ENV_START_TIMEOUT_S`, so this is a backstop)."""


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
            results[name] = [
                warning(
                    f"the {name} check could not run ({type(exc).__name__}: {exc}); starting without it",
                    traceback.format_exc(),
                )
            ]
        times_s[name] = time.monotonic() - check_started_s

    threads = [
        threading.Thread(target=run, args=(name, check), name=f"preflight-{name}", daemon=True)
        for name, check in checks.items()
    ]
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


def report(
    prog: str, result: PreflightReport, log_path: Path | None, err=None, stopped: list[str] | None = None
) -> int | None:
    """Print one line per finding (errors first), write the details to ``log_path``; 2 when there are errors.
    ``stopped``: the roles that had started meanwhile and were stopped (the checks ran beside the start)."""
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
    print(
        f"{prog}: the preflight found {count} problem{'s' * (count > 1)} in {result.elapsed_s:.1f} s; "
        f"{_what_started(stopped)}{where}",
        file=err,
        flush=True,
    )
    return 2


def _what_started(stopped: list[str] | None) -> str:
    if not stopped:
        return "nothing was started"
    return f"stopped {', '.join(stopped)} (started meanwhile) before any rollout"


def _write_log(log_path: Path, prog: str, result: PreflightReport) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    times = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in result.check_times_s.items())
    lines = [
        f"{_utc_stamp()} {prog} preflight: {result.elapsed_s:.2f} s ({times}); "
        f"{len(result.errors)} errors, {len(result.warnings)} warnings"
    ]
    for finding in result.findings:
        lines.append(f"{'error' if finding.error else 'warning'}: {finding.message}")
        if finding.detail:
            lines.extend("    " + line for line in finding.detail.rstrip().splitlines())
    with open(log_path, "a") as log:
        log.write("\n".join(lines) + "\n")


def _utc_stamp() -> str:
    """Now as the roles' logs stamp their lines (ISO 8601, UTC, microseconds), so the logs line up."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def skipped() -> bool:
    return os.environ.get(SKIP_VAR, "").strip().lower() in ("1", "true", "yes")
