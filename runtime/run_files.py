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
RUN_FILE = "run.json"
"""Where a `primerl rl` run's broker answers, its token and the launcher's pid (``primerl.supervisor.run_file``
writes it once the broker is ready, mode 0600)."""
RUN_END_FILE = "run_end.json"
"""How the run ended and what was last known of it (``primerl.runtime.run_outcome``: the launcher writes it once
every role stopped and removes a former run's as a new run starts)."""
BROKER_RUN_STATE_FILE = "run_state.json"
"""The broker's run facts in its spool directory (``primerl.broker.run_state``), read back for a run that left no
``run_end.json``."""
BROKER_RUN_HISTORY_FILE = "run_history.json"
"""The broker's bounded run history in its spool directory (``primerl.broker.run_history``): its worker events."""
BROKER_RUN_STATE_FORMAT = "primerl.run_state/1"
"""The ``format`` of ``run_state.json`` (written by ``primerl.broker.run_state``)."""
BROKER_RUN_HISTORY_FORMAT = "primerl.run_history/1"
"""The ``format`` of ``run_history.json`` (written by ``primerl.broker.run_history``)."""
