"""primerl: asynchronous RL post-training for language models, as a mesh of daemons.

The role packages are ``primerl.broker``, ``primerl.trainer``, ``primerl.inference`` and
``primerl.orchestrator``; ``primerl.proto`` holds the wire contracts; ``primerl.runtime`` the pieces every
role shares (config loading, logging, sockets); ``primerl.cli`` the entry points.
"""

__version__ = "0.1.0"
