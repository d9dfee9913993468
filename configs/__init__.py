"""The configuration of every role and of a whole run, in one package.

``broker``, ``trainer``, ``inference`` and ``orchestrator`` hold each daemon's config model; the run-config
composition of ``primerl rl`` builds on them. The shared machinery (``BaseConfig``, loading TOML and CLI flags,
the common sub-configs) lives in ``primerl.runtime``, which every package may import.
"""
