"""The orchestrator's environments, each running in its own interpreter and reached through one interface.

- ``base``: ``EnvClient``, the orchestrator's handle of one environment, and the errors every client raises.
- ``supervision``: the child process (spawn, stderr tail, liveness, stop) and the pending requests, shared by both
  clients.
- ``classic``: ``ClassicEnvClient``, a verifiers 0.3 environment (``load_environment``) served by the classic env
  worker over JSON lines.
- ``v1``, ``v1_server``, ``v1_spec``, ``v1_wire``, ``v1_traces``: ``V1EnvClient``, a verifiers 0.4 "v1" environment
  (a Taskset/Harness package) served by verifiers' own env server over ZeroMQ + msgpack. In this package "v1"
  always means verifiers' v1 API, never a primerl protocol version.
- ``interpreters``: which interpreter runs the environments and what it has installed; ``kinds``: classic or v1 for
  each env table; ``factory``: ``EnvClients``, which builds and starts the right client for each table.
- ``checks``: what the preflight checks of the environments (they load, have examples, their prompts fit).
- ``remote/``: the scripts that run inside the env interpreters; run by file path, never imported by primerl.
"""
