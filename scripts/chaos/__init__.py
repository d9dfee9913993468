"""`make chaos`: seeded kill-and-restart runs of a real short primerl run, and their checks (docs/chaos.md).

Modules: ``plan`` (the seeded kills), ``procs`` (the systemd-like restarter, the scan for processes left),
``runs`` (the run's configs and the two modes), ``logs`` (the roles' JSON logs), ``driver`` (one run),
``checks`` (its verdict and summary), ``cli`` (the command line). Run it as `python scripts/chaos`.
"""
