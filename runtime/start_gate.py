"""The preflight's gate: under `primerl rl` the slow preflight checks (loading the environments, the tokenizer)
run while the roles start, so a role must not do what a failed preflight should have prevented before the
verdict. The launcher names a file in ``$PRIMERL_START_GATE`` for the orchestrator and creates it once the
checks pass; the orchestrator loads its environments meanwhile and waits for the file before its first rollout.
On a failed preflight the launcher stops every role instead, so no rollout is ever generated. Without the
variable (a daemon started on its own, `--no-preflight`, `--preflight-first`) nothing waits.

The environments' check is the orchestrator's own: ``$PRIMERL_ENV_CHECK`` (JSON: the report's path, the tokenizer
that measures the prompts, inference's ``max_model_len``) asks it to check the environments on the env workers it
starts for the run, and the tokenizer it loads for its sample rollouts, rather than the launcher loading them a
second time beside it; it writes the findings to the report (``EnvCheckReport``) before it waits at the gate, and
the launcher's verdict includes them.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

GATE_VAR = "PRIMERL_START_GATE"
GATE_FILE_NAME = "preflight.passed"
"""The launcher's gate file, in the run directory."""
POLL_S = 0.05
ENV_CHECK_VAR = "PRIMERL_ENV_CHECK"
ENV_CHECK_FILE_NAME = "preflight.environments.json"
"""The orchestrator's report of its environments' check, in the run directory."""


def gate_path() -> Path | None:
    value = os.environ.get(GATE_VAR, "").strip()
    return Path(value) if value else None


def open_gate(path: Path) -> None:
    """The launcher's side: the preflight passed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def wait_for_gate(stop_event: threading.Event, log=None) -> bool:
    """The role's side: True once the gate (if any) is open; False when ``stop_event`` is set first."""
    path = gate_path()
    if path is None or path.exists():
        return True
    if log is not None:
        log.info("waiting for the preflight", gate=str(path))
    while not path.exists():
        if stop_event.wait(POLL_S):
            return False
    if log is not None:
        log.info("preflight passed", gate=str(path))
    return True


@dataclass(frozen=True)
class EnvCheckRequest:
    """What the launcher asks of the orchestrator in ``$PRIMERL_ENV_CHECK``."""

    report_path: str
    tokenizer: str | None  # the trainer's tokenizer (None: prompt lengths are not measured)
    max_model_len: int | None  # inference's, which vLLM holds prompts + max_tokens to

    def to_env(self) -> dict[str, str]:
        return {ENV_CHECK_VAR: json.dumps(asdict(self))}


def env_check_request() -> EnvCheckRequest | None:
    """The launcher's request (None: not under `primerl rl`'s preflight, or its gate already opened: a restarted
    orchestrator does not check again)."""
    value = os.environ.get(ENV_CHECK_VAR, "").strip()
    gate = gate_path()
    if not value or (gate is not None and gate.exists()):
        return None
    fields = json.loads(value)
    return EnvCheckRequest(str(fields["report_path"]), fields.get("tokenizer"), fields.get("max_model_len"))


def write_env_check_report(path: str | Path, findings: list[dict]) -> None:
    """The orchestrator's side: its findings (``message``, ``error``, ``detail`` each), written whole at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"findings": findings}))
    os.replace(partial, path)


def read_env_check_report(path: str | Path) -> list[dict] | None:
    """The launcher's side: the findings, or None while the orchestrator has not written them."""
    try:
        return json.loads(Path(path).read_text())["findings"]
    except FileNotFoundError:
        return None
