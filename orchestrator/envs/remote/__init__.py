"""Scripts run by the env interpreters (`.venv-envs`: verifiers 0.3; `.venv-envs-v1`: verifiers 0.4), started by
file path; primerl imports none of them. They reach primerl only through `primerl.proto.env_protocol` and each
other, loaded by path (`classic_worker.import_primerl_by_path`), never through primerl's installed package.

- ``classic_worker``: serves one verifiers 0.3 environment over JSON lines; ``classic_rollouts``: its verifiers
  glue (model clients that keep the policy-version headers); ``lean_trims``: its per-request speed trims.
- ``v1_bootstrap``: serves one verifiers v1 environment; ``probe``: what an env interpreter has installed.
"""
