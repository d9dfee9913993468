"""Where a role's metrics go: the run's ``metrics.jsonl``, Weights & Biases when configured, Prometheus gauges.

    sink = MetricsSink("trainer", config.output_dir, config.wandb, config, exporter=exporter)
    sink.log(step, {"train/loss": 0.41, "train/reward": 0.3})
    sink.close()

``{output_dir}/metrics.jsonl`` is the run-level file: the trainer, the orchestrator and ``primerl sft`` append
to it (under ``primerl rl`` trainer and orchestrator share one output_dir, hence one file). One line per
``log`` call, a JSON object:

    {"step": 12, "role": "trainer", "time": 1767225600.25, "train/loss": 0.41, "train/kl_divergence": 0.002, ...}

- ``step`` (int): the role's step (trainer: optimizer step = policy version; orchestrator: the step its batch
  is for; sft: optimizer step). Roles interleave, and one role may write several lines for a step (the
  orchestrator's training row and its eval row).
- ``role``: ``"trainer"``, ``"orchestrator"`` or ``"sft"``; ``time``: Unix seconds when the line was written.
- every other key is a metric with a finite float value; NaN and infinities are left out of the line (and out
  of W&B and Prometheus) rather than written as non-standard JSON.

Each line is written with one ``write()`` on a file opened with ``O_APPEND``, so lines of different
processes never interleave (POSIX appends are atomic with respect to each other on local file systems; a
line is a few KB at most). A reader of a running run may see a half-written last line.

Weights & Biases (``[wandb]`` in the role config): one W&B run per role, named ``{name}-{role}`` and grouped by
``name``, in ``{output_dir}/wandb``; ``offline = true`` logs to files only (``wandb sync`` uploads them later).
Without a W&B login on this machine (no ``$WANDB_API_KEY`` or ``$WANDB_IDENTITY_TOKEN_FILE``, no entry for the W&B
host in ``~/.netrc``, no key in wandb's settings file) an online run is logged offline instead, with a warning;
without the wandb package W&B is left off, with a warning (``wandb_plan``; the preflight prints the same line).
``$WANDB_MODE=offline`` or ``disabled`` wins over the config.
Every metric is plotted against ``{role}/step`` (logged with each row), not W&B's own step counter, so roles
at different steps and rows logged twice for a step never trip W&B's monotonic-step check. W&B prints
nothing and captures no console output (daemon logs stay clean). The keys users look for: ``train/reward``,
``train/loss``, ``train/learning_rate``, ``train/kl_divergence`` (trainer vs. inference policy on the sampled
tokens), ``rollout/mean_length``, ``rollout/generation_time``.
"""

from __future__ import annotations

import configparser
import json
import math
import netrc
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from primerl.runtime.config_common import WandbConfig
from primerl.runtime.log_setup import get_logger
from primerl.runtime.run_files import METRICS_FILE

ROW_FIELDS = ("step", "role", "time")
ROLES = ("trainer", "orchestrator", "sft")

log = get_logger("primerl.metrics")


class MetricsSink:
    """Appends one row per ``log`` to ``{output_dir}/metrics.jsonl``; mirrors it to W&B and Prometheus."""

    def __init__(
        self,
        role: str,
        output_dir: str | os.PathLike[str],
        wandb_config: WandbConfig | None = None,
        run_config: Any = None,
        *,
        exporter: Any = None,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.exporter = exporter
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / METRICS_FILE
        self._wandb_run = None
        if wandb_config is not None:  # first: a W&B refusal stops the role at start
            self._wandb_run = start_wandb_run(role, wandb_config, output_dir, run_config)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        reserved = [name for name in metrics if name in ROW_FIELDS or name == f"{self.role}/step"]
        assert not reserved, f"metric names {reserved} are reserved for the row itself"
        if self._fd is None:
            raise RuntimeError("the metrics sink is closed")
        values = finite_values(metrics)
        line = json.dumps({"step": int(step), "role": self.role, "time": round(time.time(), 3), **values}) + "\n"
        data = line.encode()
        written = os.write(self._fd, data)  # one append: never interleaved with another process's line
        if written != len(data):
            raise OSError(f"short write to {self.path} ({written} of {len(data)} bytes): is the disk full?")
        if self.exporter is not None:
            self.exporter.record_row(self.role, step, values)
        if self._wandb_run is not None:
            self._wandb_run.log({f"{self.role}/step": int(step), **values})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            run.finish()

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def finite_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics as floats, without NaN, infinities and values that are not numbers."""
    values = {}
    for name, value in metrics.items():
        if isinstance(value, (bool, int, float)) and math.isfinite(value):
            values[name] = float(value)
    return values


def config_for_wandb(run_config: Any) -> dict[str, Any]:
    """The role config as a plain dict for W&B, with every secret (``run_token``) removed."""
    if run_config is None:
        return {}
    from primerl.runtime.config_loader import SECRET_KEYS, config_to_dict

    data = config_to_dict(run_config) if not isinstance(run_config, Mapping) else dict(run_config)

    def without_secrets(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: without_secrets(v) for k, v in value.items() if k not in SECRET_KEYS}
        if isinstance(value, list):
            return [without_secrets(v) for v in value]
        return value

    return without_secrets(data)


WandbMode = Literal["online", "offline", "disabled", "off"]
DEFAULT_WANDB_HOST = "https://api.wandb.ai"


@dataclass(frozen=True)
class WandbPlan:
    """How W&B will run for a ``[wandb]`` config on this machine. ``mode`` "off": no W&B run at all (no wandb
    package); ``note``: the warning line when the plan differs from the config (None when it does not)."""

    mode: WandbMode
    note: str | None = None


def wandb_login_source() -> str | None:
    """Where wandb would find an API key on this machine (read from files, no network), or None."""
    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(variable):
            return f"${variable}"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or DEFAULT_WANDB_HOST).hostname or ""
    netrc_path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(str(netrc_path)).authenticators(host) if netrc_path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        entry = None
    if entry and entry[2]:
        return str(netrc_path)
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    settings = configparser.ConfigParser()
    try:
        settings.read(config_dir / "settings")
    except configparser.Error:
        return None
    if settings.get("default", "api_key", fallback=None):
        return str(config_dir / "settings")
    return None


def wandb_plan(config: WandbConfig, output_dir: str | os.PathLike[str]) -> WandbPlan:
    """Online when configured and logged in; offline (with a note) when there is no login; off (with a note)
    without the wandb package. ``$WANDB_MODE`` = offline / disabled wins over the config."""
    import importlib.util

    wandb_dir = Path(output_dir) / "wandb"
    if importlib.util.find_spec("wandb") is None:
        return WandbPlan(
            "off",
            "[wandb] is set but the wandb package is not installed: metrics go to "
            f"{Path(output_dir) / METRICS_FILE} only (pip install 'primerl[wandb]' to log "
            "to W&B)",
        )
    forced = os.environ.get("WANDB_MODE", "").strip().lower()
    if forced in ("offline", "dryrun", "disabled"):
        return WandbPlan("disabled" if forced == "disabled" else "offline")
    if config.offline:
        return WandbPlan("offline")
    if wandb_login_source() is None:
        host = urlparse(os.environ.get("WANDB_BASE_URL") or DEFAULT_WANDB_HOST).hostname
        return WandbPlan(
            "offline",
            f"W&B is on ([wandb], or run_name in a vf-rl config) but this machine has no "
            f"W&B login (no $WANDB_API_KEY, no {host} in ~/.netrc): logging offline to "
            f"{wandb_dir}; `wandb login` then `wandb sync {wandb_dir}/offline-run-*` "
            "uploads it (set [wandb] offline = true to silence this)",
        )
    return WandbPlan("online")


def start_wandb_run(role: str, config: WandbConfig, output_dir: Path, run_config: Any = None) -> Any:
    """``wandb.init`` for one role as ``wandb_plan`` says (None when it says "off"); ``ValueError`` with the fix
    when W&B refuses to start."""
    plan = wandb_plan(config, output_dir)
    if plan.note:
        log.warning(plan.note, role=role)
    if plan.mode == "off":
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    mode = plan.mode
    try:
        run = wandb.init(
            project=config.project,
            name=f"{config.name}-{role}" if config.name else None,
            group=config.name,
            entity=config.entity,
            dir=str(output_dir),
            mode=mode,
            config=config_for_wandb(run_config),
            settings=wandb.Settings(console="off", silent=True, show_info=False, show_warnings=False),
            reinit="create_new",
        )
    except Exception as exc:  # wandb's errors (a refused key, no network, bad entity) have no common base class
        hint = "check the login (`wandb login`, or WANDB_API_KEY), " if mode == "online" else ""
        raise ValueError(
            f"W&B could not start the {role} run ({type(exc).__name__}: {exc}); {hint}"
            "set [wandb] offline = true to log to files only, or remove [wandb] (in a vf-rl config: "
            "[trainer.args] run_name)"
        ) from None
    run.define_metric(f"{role}/step", hidden=True)
    run.define_metric("*", step_metric=f"{role}/step")
    log.info(
        "logging to Weights & Biases",
        mode=mode,
        project=config.project,
        run_name=run.name,
        run_dir=str(Path(run.dir).parent),
    )
    return run
