"""Scripts run by the env interpreters (`.venv-envs`: verifiers 0.3; `.venv-envs-v1`: verifiers 0.4), started by
file path; primerl imports none of them. They reach primerl only through `primerl.proto.env_protocol` and each
other, loaded by path (`classic_worker.import_primerl_by_path`), never through primerl's installed package.
"""
