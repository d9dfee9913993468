"""The broker's clients, used by every role and by ``primerl status``. Imports nothing of the broker daemon
(``primerl.broker``): what both ends must agree on lives in ``primerl.proto``.

- ``control``: ``ControlClient`` (gRPC): register, heartbeat in a thread, report metrics, commit steps, run status;
  keeps the last ``RegisterResponse``, whose ``limits`` (``ControlClient.limits``) size the ZeroMQ clients.
- ``broker_errors``: the control plane's typed errors (``BrokerError``, ``BrokerUnavailable``, ...).
- ``channel``: the gRPC channel to the broker (TLS, the run token on every call, reconnect and keepalive settings).
- ``dealer``: ``DealerClient``, the one DEALER socket under every ZeroMQ client: sizes from the broker's limits,
  bounded waits, reply checks, auth, re-opening the socket.
- ``rollouts``: ``RolloutProducer`` (orchestrator: push micro-batches, durable acks) and ``RolloutConsumer`` (a
  trainer rank: fetch a step's micro-batches); ``pack_batch``.
- ``weight_publisher``: ``WeightPublisher`` (trainer: publish one update in chunks); ``weights``:
  ``WeightSubscriber`` (inference worker: receive and acknowledge updates); ``weight_transfer``: a chunked update
  received in place.
- ``outage``: riding through a broker restart (``OutageWatch``, ``retry_through_outage``).
"""
