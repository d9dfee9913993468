"""The broker's clients, used by every role and by ``primerl status``: ``control`` (gRPC: register, heartbeat, run
status), ``rollouts`` (ZeroMQ: push and fetch rollout batches), ``weights`` (ZeroMQ: publish and subscribe to weight
updates), and ``outage`` (riding through a broker restart). Imports nothing of the broker daemon (``primerl.broker``):
what both ends must agree on lives in ``primerl.proto``."""
