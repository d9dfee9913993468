"""The inference worker (``primerl-infer``): one vLLM engine that serves rollouts over vLLM's OpenAI-compatible
HTTP API and applies weight updates in flight.

- ``service``: the daemon: registers with the broker, subscribes to weight updates, serves until told to stop.
- ``server``: vLLM's HTTP server in this process, with run-token auth, the route allowlist and the
  policy-version headers (names in ``primerl.proto.env_protocol``).
- ``engine``: a vLLM engine with this project's defaults and the CPU build's quirks; ``config``.
- ``policy_updates``: the one checker of an update's order and digest on this host, and how FULL, LORA and DELTA
  updates reach the engine; ``worker_extension``: the methods mixed into vLLM's worker that change the weights;
  ``shared_payload``: a payload handed to that worker through one shared-memory file.
- ``vllm_plugin``: loaded by vLLM in each of its processes; ``metrics``: primerl's families on vLLM's /metrics;
  ``logprob_check``: vLLM's logprobs against a transformers pass (tests and benchmarks).
"""
