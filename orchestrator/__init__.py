"""Orchestrator (``primerl-orchestrator``): environments, async rollouts, advantages, filtering, packing; it sends
each step's micro-batches to the broker.

One RL step, in the order a reader follows it:
- ``runner``: ``OrchestratorRunner``, the wiring and the daemon's life (the step loop, send, report, evals, stop);
  ``startup`` its set-up (broker link, worker watchers, environments); it hands the collaborators to the scheduler.
- ``rollout_scheduler``: ``RolloutScheduler`` (no sockets): groups in flight on which environment and inference
  endpoint, and what their results become; it answers with ``types.StepReport``. ``dispatch_plan`` (which group
  goes where), ``group_results`` (what a finished group becomes), ``step_batches`` (taking a step's batch),
  ``silent_workers``. ``types``: the values and interfaces the components hand each other.
- ``envs``: the environment clients (classic and verifiers v1) behind one interface, and what runs in their
  interpreters; ``env_sampler``: which example comes next; ``seeds``: per-rollout sampling seeds;
  ``env_preflight``: the preflight's check of the environments, on the run's own env workers (under `primerl rl`).
- ``endpoints``: the inference workers, read from the broker in a thread of their own.
- ``trajectory``: the environments' answers, typed and checked; ``samples``: what a rollout becomes for training.
- ``teacher_stage`` (groups waiting for the teacher), ``teacher_scoring`` and ``teacher_client`` (a teacher's
  logprobs of every sample: online distillation).
- ``advantages``, ``filtering`` (difficulty filter, batch assembly), ``async_bound`` (how far rollouts may run
  ahead of training), ``lineage`` (policy rollbacks), ``rollout_failures`` (failed rollouts, never silent).
- ``packing``: a packed step as the broker's batch messages (the packer: ``primerl.proto.packing``).
- ``batch_sender`` (the send thread), ``step_send`` (one step through broker outages, the ``step sent`` line).
- ``step_metrics`` (the metrics of a step), ``step_reporter`` (a step's row, advice, fallbacks), ``throughput``.
- ``concurrency``: how many rollouts stay in flight; ``rollout_samples``: a few rollouts of each step for people.
- ``evaluation``: eval groups and their summary (``primerl eval`` and the periodic evals).

The config is ``primerl.configs.orchestrator.OrchestratorConfig`` (imports neither torch, vLLM nor verifiers).
"""
