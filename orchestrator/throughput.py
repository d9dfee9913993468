"""Generation throughput for ``rollout/tokens_per_s``: completion tokens of the rollout groups that finished in a
trailing window of wall time, divided by that window.

A step's batch may come entirely from groups finished during the previous step (surplus), and a step may take a
few milliseconds; tokens over "this step's time" then reads 0 or a division by a near-zero interval. Here the
figure does not depend on where step boundaries fall: it is the rate at which generated tokens came back over
the last ``window_s`` seconds (or since generation began, when that is shorter). When fewer than ``min_groups``
groups finished in the window (rollouts slower than the window), it is the latest ``min_groups`` groups' tokens
over the time since the first of them was dispatched, so slow generation shows its rate instead of 0.
Generation that stopped shows as a rate that decays towards 0.

Cost per finished group: one deque append; per report: one pass over the groups kept (bounded by ``max_groups``).
"""

from __future__ import annotations

import collections

DEFAULT_WINDOW_S = 30.0


class ThroughputWindow:
    """``add(dispatched_s, finished_s, num_tokens)`` per finished group; ``tokens_per_s(now_s)`` over the window.

    Times are ``time.monotonic()`` seconds (any clock, as long as it is the same one)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, *, min_groups: int = 1, max_groups: int = 4096):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if not 1 <= min_groups <= max_groups:
            raise ValueError(f"need 1 <= min_groups <= max_groups, got {min_groups} and {max_groups}")
        self.window_s = window_s
        self.min_groups = min_groups
        # (dispatched_s, finished_s, num_tokens) in finishing order
        self._groups: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=max_groups)
        self._first_dispatched_s: float | None = None

    def add(self, dispatched_s: float, finished_s: float, num_tokens: int) -> None:
        self._groups.append((dispatched_s, finished_s, num_tokens))
        if self._first_dispatched_s is None or dispatched_s < self._first_dispatched_s:
            self._first_dispatched_s = dispatched_s

    def tokens_per_s(self, now_s: float) -> float:
        """Tokens of the groups finished in ``(now_s - span, now_s]`` over ``span``: ``window_s``, or the time
        since the first dispatch when shorter. When fewer than ``min_groups`` groups finished in it: the latest
        ``min_groups`` groups' tokens over the time since the earliest dispatch among them. 0.0 before any
        group finished."""
        if not self._groups or self._first_dispatched_s is None:
            return 0.0
        span_s = min(self.window_s, now_s - self._first_dispatched_s)
        cutoff_s = now_s - span_s
        latest = list(self._groups)[-self.min_groups :]
        while len(self._groups) > self.min_groups and self._groups[0][1] <= cutoff_s:  # out of the window
            self._groups.popleft()
        if latest[0][1] <= cutoff_s:  # too few groups in the window: the latest ones, from their dispatch
            span_s = now_s - min(dispatched_s for dispatched_s, _, _ in latest)
            num_tokens = sum(tokens for _, _, tokens in latest)
        else:
            num_tokens = sum(tokens for _, finished_s, tokens in self._groups if finished_s > cutoff_s)
        return num_tokens / span_s if span_s > 0 else 0.0
