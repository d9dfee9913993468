"""The supervisor behind ``primerl rl``: starts the daemons of a run, restarts them by policy, stops them.

``launcher`` runs one run (its order of starts, progress, the end); ``restarts`` owns the restart bookkeeping and
pins a restarted role where the others look for it; ``process_supervisor`` and ``process_reaper`` own the child
processes (nothing outlives the launcher); ``restart_policy``, ``role_configs`` (the role files it writes),
``role_logs``, ``run_progress``, ``run_file`` (``run.json``, read by ``primerl status``), ``console``, ``tmux``;
``preflight_gate`` and ``broker_links`` serve the launcher, which records how the run ended in ``run_end.json``
(``primerl.runtime.run_outcome``). What shows a run from outside: ``status_view`` (``primerl status``, a run that
ended included) with ``fleet_view`` (what each worker is doing: serving, lost since when, gone), ``run_series`` and
``run_plots`` (``primerl plot``).
"""
