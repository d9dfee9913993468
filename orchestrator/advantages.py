"""Group-relative advantages and the truncation options, as prime-rl defines them.

For the rollouts i = 1..G of one group (one example), with reward r_i and L_i completion tokens (all turns):

    r'_i = r_i - length_penalty * L_i / max_tokens          (length penalty; `max_tokens` = sampling.max_tokens,
                                                              else seq_len; off when length_penalty = 0)
    A_i  = r'_i - mean(r')                                   (default)
    A_i  = (r'_i - mean(r')) / (std(r') + eps)               (std_normalize; population std, eps = 1e-6)

Every sample of rollout i (several with branching) gets A_i; each rollout counts once in the mean and std.
The length penalty changes advantages only: ``sample.reward`` keeps the environment's reward for metrics and for
difficulty filtering.

Truncated rollouts (they hit max_tokens or the context limit):
- ``zero_truncated_completions``: their reward becomes 0 before anything else uses it (filtering, advantages).
- ``mask_truncated_completions``: their loss mask is zeroed, so they give no gradient; they still count in the
  group's mean and std, like prime-rl.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from primerl.orchestrator.samples import Group

if TYPE_CHECKING:
    from primerl.configs.orchestrator import OrchestratorConfig

DEFAULT_STD_EPS = 1e-6


def group_advantages(
    rewards: Sequence[float] | np.ndarray, *, std_normalize: bool = False, eps: float = DEFAULT_STD_EPS
) -> np.ndarray:
    """Advantages (float64) of one group's rollout rewards: reward minus the group mean, optionally divided by
    the group's population standard deviation plus ``eps``."""
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"rewards of a group must be 1-D, got shape {values.shape}")
    if values.size == 0:
        return values.copy()
    centred = values - values.mean()
    if std_normalize:
        centred = centred / (values.std() + eps)
    return centred


def length_penalized_rewards(
    rewards: Sequence[float] | np.ndarray,
    completion_lengths: Sequence[int] | np.ndarray,
    *,
    length_penalty: float,
    max_tokens: int | None,
) -> np.ndarray:
    """``reward - length_penalty * completion_length / max_tokens`` (float64)."""
    values = np.asarray(rewards, dtype=np.float64)
    if length_penalty == 0:
        return values.copy()
    if length_penalty < 0:
        raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(f"a length penalty needs max_tokens >= 1 to scale lengths by, got {max_tokens}")
    lengths = np.asarray(completion_lengths, dtype=np.float64)
    if lengths.shape != values.shape:
        raise ValueError(f"completion_lengths has shape {lengths.shape}, rewards {values.shape}: one length per reward")
    return values - length_penalty * lengths / max_tokens


def apply_truncation_options(
    groups: Iterable[Group], *, mask_truncated_completions: bool, zero_truncated_completions: bool
) -> int:
    """Apply the two truncation options in place; returns the number of truncated rollouts seen."""
    num_truncated = 0
    for group in groups:
        for samples in group.rollouts().values():
            if not samples[0].truncated:
                continue
            num_truncated += 1
            for sample in samples:
                if zero_truncated_completions:
                    sample.reward = 0.0
                if mask_truncated_completions:
                    sample.loss_mask = [False] * sample.num_tokens
    return num_truncated


def compute_advantages(
    groups: Iterable[Group],
    *,
    std_normalize: bool = False,
    length_penalty: float = 0.0,
    max_tokens: int | None = None,
    eps: float = DEFAULT_STD_EPS,
) -> None:
    """Set ``sample.advantage`` of every sample of every group (see the module docstring for the formula)."""
    for group in groups:
        rollouts = list(group.rollouts().values())
        rewards = np.array([samples[0].reward for samples in rollouts], dtype=np.float64)
        lengths = np.array([sum(s.num_completion_tokens for s in samples) for samples in rollouts], dtype=np.int64)
        rewards = length_penalized_rewards(rewards, lengths, length_penalty=length_penalty, max_tokens=max_tokens)
        for samples, advantage in zip(rollouts, group_advantages(rewards, std_normalize=std_normalize, eps=eps)):
            for sample in samples:
                sample.advantage = float(advantage)


def prepare_groups(groups: Sequence[Group], config: OrchestratorConfig) -> int:
    """The orchestrator's order: truncation options, then advantages. Returns the number of truncated rollouts.
    Filtering (which reads rewards) should come after this, so that zeroed rewards count."""
    num_truncated = apply_truncation_options(
        groups,
        mask_truncated_completions=config.mask_truncated_completions,
        zero_truncated_completions=config.zero_truncated_completions,
    )
    compute_advantages(
        groups,
        std_normalize=config.advantage.std_normalize,
        length_penalty=config.advantage.length_penalty,
        max_tokens=config.sampling.max_tokens or config.seq_len,
    )
    return num_truncated
