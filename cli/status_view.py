"""How `primerl status` shows a ``RunStatus`` as text: ``render_status(status) -> str``."""

from __future__ import annotations


def render_status(status) -> str:
    """A readable multi-line view of a ``RunStatus``; ages are relative to the broker's own clock. Workers are one
    row each, with their role (``teacher``: the frozen model of online distillation, shown without a policy
    version)."""
    from primerl.proto.v1 import common_pb2, control_pb2

    max_steps = str(status.max_steps) if status.max_steps else "-"
    # Every step up to max_steps checkpointed: the run is complete (the broker then tells workers to stop).
    finished = "    run finished" if status.max_steps and status.last_committed_step >= status.max_steps else ""
    if status.num_rollbacks:
        finished += (
            f"    rolled back {status.num_rollbacks}x (now from v{status.lineage_base_version}, "
            f"lineage {status.policy_lineage})"
        )
    lines = [
        f"run {status.run_id}    broker up {_duration(status.updated_unix_ms - status.broker_started_unix_ms)}",
        f"trainer step {status.trainer_step} (committed {status.last_committed_step}) / {max_steps}    "
        f"policy version {status.latest_policy_version}    orchestrator step {status.orchestrator_step}{finished}",
        f"rollouts {status.rollout_batches_per_s:.2f} batches/s, {_bytes(status.rollout_bytes_per_s)}/s    "
        f"weights {_bytes(status.weight_bytes_per_s)}/s",
    ]
    if status.queues:
        lines.append("")
        lines += _table(
            ["QUEUE", "ITEMS", "BYTES", "BOUND"],
            [_queue_row(q) for q in status.queues],
        )
    lines.append("")
    if status.workers:
        rows = []
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
        lines += _table(["WORKER", "ROLE", "STATE", "ADDRESS", "PROGRESS", "HEARTBEAT", "METRICS"], rows)
    else:
        lines.append("no workers registered")
    if status.last_metrics:
        lines += ["", f"last metrics (step {status.last_metrics_step}):"]
        lines += [f"  {name:<32} {value:.6g}" for name, value in sorted(status.last_metrics.items())]
    advice = _advice_lines(status.last_metrics)
    if advice:
        lines += ["", "advice:"] + [f"  {line}" for line in advice]
    if status.recent_errors:
        lines += ["", "recent errors (newest last):"]
        lines += [f"  {error}" for error in status.recent_errors]
    return "\n".join(lines)


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
