"""The run directory's file names that tools and operators read: one definition each (the step-metric keys and
log events are in ``primerl.proto.telemetry``; these live here because ``runtime`` writes them and imports
nothing of ``proto``)."""

from __future__ import annotations

METRICS_FILE = "metrics.jsonl"
"""One JSON object per role and step under each role's ``output_dir`` (``metrics_sink`` writes, ``run_metrics``
reads)."""
ROLLOUTS_FILE = "rollouts.jsonl"
"""A few sample rollouts of each step (``primerl.orchestrator.rollout_samples``); the dashboard shows them."""
RUN_CONFIG_FILE = "rl.toml"
"""The run's resolved config as `primerl rl` starts it (the run token never written in it)."""
LOGS_DIR = "logs"
"""``logs/<role>.log``: each daemon's log under `primerl rl`; ``logs/preflight*.log``: the preflight's."""
