"""The broker daemon (``primerl-broker``): the hub every role connects to. Nothing outside this package and
``primerl.cli`` imports it; the roles reach it through ``primerl.client`` and the contracts in ``primerl.proto``.

- ``service``: the process: the gRPC control plane and the two ZeroMQ planes wired together (its config:
  ``primerl.configs.broker``).
- Control plane: ``control_service`` (gRPC layer, auth) over ``registry`` (workers and run status, no sockets),
  which keeps ``worker_record``s, the run's position (``run_progress``), its last metrics (``run_metrics``) and
  the status parts that are not its own (``run_status``), on ``watched_state``; refusals in ``registry_errors``;
  ``run_state`` keeps what status shows across a broker restart.
- Rollout stream: ``rollout_plane`` (the ROUTER socket; replies in ``rollout_replies``) over ``rollout_queue``
  (which batch goes to which trainer session; outcomes in ``rollout_results``) over ``spool`` (one fsynced file
  a batch; its format in ``spool_format``); ``connection_gate`` bounds the peers at the handshake.
- Weights: ``weight_plane`` (the ROUTER socket) with ``weight_intake`` (the trainer's updates in, acks out),
  ``weight_store`` (the latest snapshot and the deltas since, ``weight_durable`` on disk) and ``weight_fanout``,
  the one owner of the policy version: the latest, and which version each inference worker holds.
- Shared by both planes: ``plane_lifecycle`` (start, bind, serve, stop), ``log_limits`` (rate-limited refusal
  logs); ``metrics``: the broker's Prometheus families.
"""
