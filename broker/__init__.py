"""The broker daemon (``primerl-broker``): the hub every role connects to. Nothing outside this package and
``primerl.cli`` imports it; the roles reach it through ``primerl.client`` and the contracts in ``primerl.proto``.

- ``service``: the process: the gRPC control plane and the two ZeroMQ planes wired together (its config:
  ``primerl.configs.broker``).
- Control plane: ``control_service`` (gRPC layer, auth; its status streams share one status, ``status_cache``)
  over ``registry`` (workers and run status, no sockets), which keeps ``worker_record``s (indexed by
  ``worker_table``), the run's position (``run_progress``), its last metrics (``run_metrics``), the
  trainer lineages (``policy_lineage``), who the run's end stops (``run_end``, pure) and the status parts that
  are not its own (``run_status``), on ``watched_state``; refusals in ``registry_errors``; ``run_state`` keeps
  what status shows across a broker restart, ``run_history`` what the dashboard draws of a live run.
- Rollout stream: ``rollout_plane`` (the ROUTER socket; replies in ``rollout_replies``) over ``rollout_queue``
  (the lock, the spool and the commit), which decides with ``rollout_admission`` (the admission law, pure),
  indexes with ``rollout_steps`` and serves the trainer ranks' ``rollout_sessions`` (outcomes in
  ``rollout_results``), over ``spool`` (one fsynced file a batch; its format in ``spool_format``);
  ``connection_gate`` bounds the peers at the handshake.
- Weights: ``weight_plane`` (the ROUTER socket; ``weight_subscribers`` the worker side, ``weight_replies`` the
  replies, ``weight_messages`` the chunk messages) with ``weight_intake`` (the trainer's updates in, acks out),
  ``weight_store`` (the latest snapshot and the deltas since, each a ``stored_update``; ``weight_durable`` on
  disk; ``shared_updates`` and ``weight_segments`` the same-host shared-memory road) and ``weight_fanout``, the one
  owner of the policy version: the latest, and which version each inference worker (``weight_members``) holds;
  ``weight_relay`` plans the relay chains.
- Shared by both planes: ``plane_lifecycle`` (start, bind, serve, stop), ``log_limits`` (rate-limited refusal
  logs); ``metrics``: the broker's Prometheus families; ``metrics_discovery``: their targets for Prometheus' HTTP
  service discovery (``/discovery``); ``memory``: large buffers in mappings of their own.
"""
