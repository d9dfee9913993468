"""The preflight: cheap checks of a config against this machine before a command starts anything expensive.

``base`` holds what the checks share (findings, running and reporting them); ``envs``, ``model`` and ``system``
hold the checks and import only ``base``; ``roles`` picks the checks of `primerl rl` and of each daemon.
"""
