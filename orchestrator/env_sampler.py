"""Which (environment, example) the orchestrator rolls out next: an environment (the one the scheduler asks for, else
one drawn by weight), then the next example of that environment's shuffled order (a new shuffle each epoch).
Deterministic for a seed; its state (positions and RNG) is saved with the orchestrator's state after each step, so
a restart draws the same examples it would have.
"""

from __future__ import annotations

import random
from typing import Any


class EnvSampler:
    """Draws (env, example) pairs: an env by weight, then the next example of its shuffled order."""

    def __init__(self, env_sizes: dict[str, int], weights: dict[str, float], seed: int):
        self.env_ids = list(env_sizes)
        self.weights = [weights[env_id] for env_id in self.env_ids]
        self.sizes = env_sizes
        self.rng = random.Random(seed)
        self.positions = {env_id: 0 for env_id in self.env_ids}
        self.seed = seed

    def _order(self, env_id: str, epoch: int) -> list[int]:
        order = list(range(self.sizes[env_id]))
        random.Random(f"{self.seed}:{env_id}:{epoch}").shuffle(order)
        return order

    def shares(self) -> dict[str, float]:
        """Each environment's weight over the sum of the weights: its share of every step's batch."""
        total = sum(self.weights)
        return {env_id: weight / total for env_id, weight in zip(self.env_ids, self.weights)}

    def next(self, env_id: str | None = None) -> tuple[str, int]:
        """The next (env, example): of ``env_id`` when given (the scheduler picks the environment by what the
        batches still need), else of an environment drawn by weight."""
        if env_id is None:
            env_id = self.rng.choices(self.env_ids, weights=self.weights)[0]
        elif env_id not in self.sizes:
            raise KeyError(f"unknown environment {env_id!r}; known: {', '.join(self.env_ids)}")
        position = self.positions[env_id]
        self.positions[env_id] = position + 1
        epoch, offset = divmod(position, self.sizes[env_id])
        return env_id, self._order(env_id, epoch)[offset]

    def state(self) -> dict[str, Any]:
        return {"positions": dict(self.positions), "rng": _encode_rng(self.rng.getstate())}

    def restore(self, state: dict[str, Any]) -> None:
        self.positions.update(state["positions"])
        self.rng.setstate(_decode_rng(state["rng"]))


def _encode_rng(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_rng(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


__all__ = ["EnvSampler"]
