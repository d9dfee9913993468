"""The wire contracts: what two processes must agree on, one source of truth each.

- ``primerl/v1/*.proto`` and their generated modules ``primerl.proto.v1`` (``make proto``): the gRPC control
  plane and the headers of the ZeroMQ data plane.
- ``framing`` (the only code that reads and writes data-plane messages), ``chunked_transfer`` (a payload split
  into the messages of one transfer, and their bounded reassembly) and ``tensor_frames`` (tensors as
  safetensors frames); ``weight_delta``: the lossless delta encodings, one module per codec
  (``delta_sparse``, ``delta_xor_zlib``) over ``delta_base``; ``shared_segment``: payloads handed over in shared
  memory on one host, between processes that ``host_identity`` says share it.
- One module per contract that is not a protobuf message: ``micro_batch`` (the training micro-batch's tensors)
  and ``packing`` (samples packed into those micro-batches, balanced over the trainer ranks: RL and SFT alike),
  ``telemetry`` (the metric keys, Prometheus names and log events that tools read),
  ``env_protocol`` (the env-worker JSON-lines protocol and the policy-version HTTP headers; standard library only),
  ``ready_file`` (a daemon's ``--ready-file`` JSON), ``step_digest`` (the digest of a step's data),
  ``data_plane_limits`` (the broker's limits, sent to every worker at registration), ``batch_ids``, ``digests``
  (a weight payload's digest), ``roles``, ``weight_refusals``, ``units``.

Imports nothing of the roles, the broker or ``primerl.runtime``.
"""
