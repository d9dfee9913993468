"""Command-line entry points and what only they use. Heavy modules are imported lazily, inside the commands.

- the umbrella ``primerl`` (``main``) and its sub-commands: ``rl`` (``rl_config``, ``config_shapes``, ``rl_teacher``:
  the ``[teacher]`` role of a run, ``dotted_keys``: dotted keys into a raw config dict; the run itself: ``launcher`` and ``launcher_restarts``, ``process_supervisor``, ``process_reaper``, ``restart_policy``, ``role_logs``,
  ``run_progress``, ``run_file``), ``status`` (``status_view``), ``plot`` (``run_series``, ``run_plots``),
  ``eval`` (``eval_console``), ``generate``, ``env`` (``env_v1``: verifiers v1 environments), ``sft``, ``sft_data``, ``env_args``, ``tiny_model``, and the
  ``preflight`` (``preflight_model``, ``preflight_envs``, ``preflight_system``);
- the role daemons ``primerl-broker``, ``primerl-trainer``, ``primerl-infer``, ``primerl-orchestrator``
  (``broker``, ``trainer``, ``infer``, ``orchestrator``: a few lines each over ``role_entry`` and
  ``role_signals``).
"""
