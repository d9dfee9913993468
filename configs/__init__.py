"""The configuration of every role and of a whole run, in one package.

``broker``, ``trainer``, ``inference`` and ``orchestrator`` hold each daemon's config model. The run config of
``primerl rl`` builds on them: ``rl`` (``RLConfig``), ``rl_shapes`` (the lab and vf-rl file shapes), ``rl_teacher``,
``dotted_keys`` and ``lora_support``. The shared machinery (``BaseConfig``, loading TOML and CLI flags, the common
sub-configs) lives in ``primerl.runtime``, which every package may import; ``configs`` imports only it and ``proto``.
"""
