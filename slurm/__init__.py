"""`primerl slurm`: a run as SLURM jobs, from the same config as `primerl rl`.

``plan`` (what was decided for a run, kept in ``RUN_DIR/slurm/plan.json``), ``scripts`` (the batch scripts of the
two shapes: a job per role, requeued alone, or one fate-sharing job), ``submit`` (the run's files, `sbatch`,
`add-inference`), ``step`` (one role's daemon inside a job step: node address, token, broker address) and
``settle`` (what a job does once its step ended: requeue, finish the run, or nothing after a `scancel`).
"""
