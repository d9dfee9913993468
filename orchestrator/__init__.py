"""Orchestrator (``primerl-orchestrator``): environments, async rollouts, advantages, filtering, packing; it sends
each step's micro-batches to the broker.

The daemon:
- ``runner``: ``OrchestratorRunner``, the daemon's life (set-up, the step loop, sending, reporting, evals, stop).
- ``rollout_scheduler``: which rollout groups are in flight on which env worker and inference endpoint, and what
  their results become (no sockets); ``endpoints``: the inference workers, read from the broker in a thread.
- ``config``: ``OrchestratorConfig`` (imports neither torch, vLLM nor verifiers).

Environments, in their own interpreter (verifiers; the protocol is ``primerl.proto.env_protocol``):
- ``env_client``: ``EnvWorker``, the orchestrator's side of an env-worker process.
- ``env_worker`` (run as a script by the env interpreter) and ``env_rollouts`` (its verifiers glue); they import
  nothing of primerl but ``proto/env_protocol.py`` and each other.
- ``env_python``: which interpreter runs the environments; ``env_probe``: what that interpreter has (run by it).
- ``env_sampler``: which example comes next; ``seeds``: per-rollout sampling seeds.
- verifiers v1 environments (their own env server, in their own interpreter): ``v1_env_client`` (``V1EnvServer``:
  the server's supervision and groups of runs), ``v1_env_spec`` (its settings and one-shot runs),
  ``v1_env_bootstrap`` (run by the v1 interpreter), ``v1_wire`` (msgpack frames), ``v1_traces`` (traces to turns),
  ``v1_env_worker`` (``V1EnvWorker``: a ``V1EnvServer`` with ``EnvWorker``'s shape).
- both kinds in one run: ``env_kinds`` (an env table's kind: classic or v1, ``kind = "auto"`` asks the
  interpreters), ``env_clients`` (``EnvClients``: builds and starts every environment of a config, side by side).

From rollouts to micro-batches:
- ``trajectory``: the env worker's answers, typed and checked; ``samples``: what a rollout becomes for training.
- ``advantages``, ``filtering`` (difficulty filter, batch assembly), ``async_bound`` (how far rollouts may run
  ahead of training), ``lineage`` (policy rollbacks).
- ``teacher_client`` and ``teacher_scoring``: a teacher's logprobs of every sample (online distillation).
- ``packing``: samples into micro-batches per trainer rank (the schema: ``primerl.proto.micro_batch``).

Sending and reporting:
- ``batch_sender`` (the send thread), ``step_send`` (one step through broker outages, the ``step sent`` line).
- ``step_metrics`` (the metrics of a step), ``throughput``, ``rollout_failures`` (failed rollouts, never silent).
- ``evaluation``: eval groups and their summary (``primerl eval`` and the periodic evals).
"""
