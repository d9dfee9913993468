"""Command-line entry points and commands. Heavy modules are imported lazily, inside the commands.

- the umbrella ``primerl`` (``main``) and its sub-commands: ``rl`` (the run itself: ``primerl.supervisor``; its
  config: ``primerl.configs.rl``), ``status`` and ``plot`` (shown and drawn by ``primerl.supervisor``: ``status_view``,
  ``run_series``, ``run_plots``), ``eval`` (``eval_console``, ``eval_server``), ``generate``, ``env`` (``env_v1``:
  verifiers v1 environments; ``v1_tools``: eval and sft-data on them), ``dashboard``, ``sft``, ``sft-data``
  (``sft_data``), ``init-tiny-model`` (``tiny_model``), ``certs``, ``slurm`` (a run as SLURM jobs:
  ``primerl.slurm``); ``command_args`` parses what they share;
- the role daemons ``primerl-broker``, ``primerl-trainer``, ``primerl-infer``, ``primerl-orchestrator``
  (``broker``, ``trainer``, ``infer``, ``orchestrator``: a few lines each over ``role_entry`` and the one stop-signal
  handler of ``role_signals``);
- ``preflight``: the checks of a config against this machine that `primerl rl` and each daemon run before starting.
"""
