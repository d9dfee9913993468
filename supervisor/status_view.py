"""How `primerl status` shows a ``RunStatus``: ``render_status(status) -> str``, the plain text (an interface:
scripts read it), and on a terminal the same figures as rich tables (``status_renderable``, ``print_status``).

A run that has ended is shown the same way from what its run directory says (``primerl.runtime.run_outcome``):
``outcome`` given, the first line says how it ended (``run <id>    finished at step 30 / 30, policy v30 ...``),
the workers and queues are those last seen before the end, and ``run_state`` names its state for ``--json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TextIO

from primerl.supervisor.fleet_view import fleet_line

QUEUE_HEADER = ["QUEUE", "ITEMS", "BYTES", "BOUND"]
WORKER_HEADER = ["WORKER", "ROLE", "STATE", "ADDRESS", "PROGRESS", "HEARTBEAT", "METRICS"]


@dataclass
class StatusParts:
    """What both views show: the header lines, the queue and worker rows, the last metrics, advice and errors."""

    header: list[str]
    queue_rows: list[list[str]] = field(default_factory=list)
    worker_rows: list[list[str]] = field(default_factory=list)
    metrics_step: int = 0
    metrics: list[tuple[str, float]] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    no_workers: str = "no workers registered"


def render_status(status, outcome=None) -> str:
    """A readable multi-line view of a ``RunStatus``; ages are relative to the broker's own clock. Workers are one
    row each, with their role (``teacher``: the frozen model of online distillation, shown without a policy
    version). ``outcome``: the ``RunOutcome`` of a run that ended (``status`` is its last known one)."""
    parts = status_parts(status, outcome)
    lines = list(parts.header)
    if parts.queue_rows:
        lines.append("")
        lines += _table(QUEUE_HEADER, parts.queue_rows)
    lines.append("")
    if parts.worker_rows:
        lines += _table(WORKER_HEADER, parts.worker_rows)
    else:
        lines.append(parts.no_workers)
    if parts.metrics:
        lines += ["", f"last metrics (step {parts.metrics_step}):"]
        lines += [f"  {name:<32} {value:.6g}" for name, value in parts.metrics]
    if parts.advice:
        lines += ["", "advice:"] + [f"  {line}" for line in parts.advice]
    if parts.errors:
        lines += ["", "recent errors (newest last):"]
        lines += [f"  {error}" for error in parts.errors]
    return "\n".join(lines)


def status_renderable(status, outcome=None) -> Any:
    """The figures of ``render_status`` as rich tables, for a terminal."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = status_parts(status, outcome)
    items: list[Any] = [Text(line, style="bold" if i == 0 else "") for i, line in enumerate(parts.header)]

    def table(title: str, header: list[str], rows: list[list[str]]) -> Table:
        out = Table(title=title, title_justify="left", title_style="bold", header_style="bold cyan")
        for name in header:
            out.add_column(name)
        for row in rows:
            out.add_row(*row)
        return out

    if parts.queue_rows:
        items.append(table("queues", QUEUE_HEADER, parts.queue_rows))
    if parts.worker_rows:
        items.append(table("workers", WORKER_HEADER, parts.worker_rows))
    else:
        items.append(Text(parts.no_workers, style="yellow"))
    if parts.metrics:
        items.append(
            table(
                f"last metrics (step {parts.metrics_step})",
                ["METRIC", "VALUE"],
                [[name, f"{value:.6g}"] for name, value in parts.metrics],
            )
        )
    if parts.advice:
        items.append(Text("advice:", style="bold yellow"))
        items += [Text(f"  {line}", style="yellow") for line in parts.advice]
    if parts.errors:
        items.append(Text("recent errors (newest last):", style="bold red"))
        items += [Text(f"  {error}", style="red") for error in parts.errors]
    return Group(*items)


def print_status(status, out: TextIO, *, console: Any = None, outcome=None) -> None:
    """``status_renderable`` on a terminal (or ``console``), else ``render_status``'s plain lines."""
    from primerl.runtime.terminal import rich_console

    console = console if console is not None else rich_console(out)
    if console is None:
        out.write(render_status(status, outcome) + "\n")
    else:
        console.print(status_renderable(status, outcome))


def run_state(status, outcome=None) -> str:
    """The run's state for ``--json``: an ended run's outcome (``finished``, ``stopped``, ``failed``); else, its
    broker answering, ``finished`` once every step up to ``max_steps`` is committed (the broker then tells the
    workers to stop), else ``running``."""
    from primerl.runtime.run_outcome import FINISHED, RUNNING

    if outcome is not None and outcome.ended:
        return outcome.state
    return FINISHED if status.max_steps and status.last_committed_step >= status.max_steps else RUNNING


def status_parts(status, outcome=None) -> StatusParts:
    """The figures of a ``RunStatus``, formatted, for either view; ``outcome``: a run that ended (see the module
    docstring)."""
    from primerl.proto.v1 import common_pb2, control_pb2
    from primerl.runtime.run_outcome import FINISHED

    ended = outcome is not None and outcome.ended
    max_steps = str(status.max_steps) if status.max_steps else "-"
    finished = "    run finished" if run_state(status, outcome) == FINISHED else ""
    if status.num_rollbacks:
        finished += (
            f"    rolled back {status.num_rollbacks}x (now from v{status.lineage_base_version}, "
            f"lineage {status.policy_lineage})"
        )
    parts = StatusParts(
        header=[
            f"run {status.run_id}    broker up {_duration(status.updated_unix_ms - status.broker_started_unix_ms)}",
            f"trainer step {status.trainer_step} (committed {status.last_committed_step}) / {max_steps}    "
            f"policy version {status.latest_policy_version}    orchestrator step {status.orchestrator_step}{finished}",
            f"rollouts {status.rollout_batches_per_s:.2f} batches/s, {_bytes(status.rollout_bytes_per_s)}/s    "
            f"weights {_bytes(status.weight_bytes_per_s)}/s",
        ]
    )
    if ended:  # no broker to ask: how the run ended, and what was last seen of it
        parts.header[0] = f"run {status.run_id or '-'}    {outcome.summary()}"
        parts.header[2] = f"ended (read from {outcome.source}); workers and queues as last seen before the end"
        parts.no_workers = "no workers recorded"
    fleet = fleet_line(status)
    if fleet:
        parts.header.append(f"workers    {fleet}")
    parts.queue_rows = [_queue_row(q) for q in status.queues]
    rows = parts.worker_rows
    for w in status.workers:
        progress = []
        if w.HasField("trainer_step"):
            progress.append(f"step {w.trainer_step}")
        if w.HasField("orchestrator_step"):
            progress.append(f"step {w.orchestrator_step}")
        if w.HasField("policy_version"):
            progress.append(f"policy v{w.policy_version}")
        if w.role == common_pb2.ROLE_TEACHER:  # online distillation: a fixed model, never updated
            progress.append("frozen teacher")
        if w.num_inflight:
            progress.append(f"{w.num_inflight} in flight")
        age_ms = max(0, status.updated_unix_ms - w.last_heartbeat_unix_ms)
        rows.append(
            [
                w.name,
                common_pb2.Role.Name(w.role).removeprefix("ROLE_").lower(),
                control_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower(),
                w.address or "-",
                ", ".join(progress) or "-",
                f"{age_ms / 1000:.1f}s ago",
                w.capabilities.get("metrics_url") or "-",
            ]
        )
    parts.metrics_step = status.last_metrics_step
    parts.metrics = sorted(status.last_metrics.items())
    parts.advice = [] if ended else _advice_lines(status.last_metrics)
    parts.errors = list(status.recent_errors)
    return parts


def _advice_lines(last_metrics) -> list[str]:
    """The advice lines in force (``primerl.runtime.advice``), from the flags in the run's latest metrics."""
    from primerl.proto import telemetry
    from primerl.runtime.advice import status_lines

    return status_lines(last_metrics, telemetry.ADVICE)


# Queues whose capacity bounds only part of what they hold: the broker's rollout spool keeps every batch until
# the trainer commits its step, while ``max_batches`` / ``max_bytes`` bound only the batches of steps no trainer
# asked for yet (how far the orchestrator runs ahead). "10/8" would read as a queue over its capacity.
SPOOL_QUEUES = {"rollouts"}


def _queue_row(queue) -> list[str]:
    """NAME, ITEMS, BYTES of one queue; a spool's bound is shown as the bound on what is ahead of the trainer."""
    if queue.name in SPOOL_QUEUES and (queue.capacity_items or queue.capacity_bytes):
        return [
            f"{queue.name} (spooled until committed)",
            str(queue.num_items),
            _bytes(queue.num_bytes),
            f"at most {queue.capacity_items} batches / {_bytes(queue.capacity_bytes)} ahead of the trainer",
        ]
    return [
        queue.name,
        f"{queue.num_items}/{queue.capacity_items}" if queue.capacity_items else str(queue.num_items),
        (
            f"{_bytes(queue.num_bytes)}/{_bytes(queue.capacity_bytes)}"
            if queue.capacity_bytes
            else _bytes(queue.num_bytes)
        ),
        "",
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]


def _bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def _duration(ms: int) -> str:
    seconds = max(0, ms) // 1000
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"
