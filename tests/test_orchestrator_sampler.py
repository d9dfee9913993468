"""Drawing examples from several environments by weight, and resuming the draw exactly."""

from __future__ import annotations

import collections

from primerl.orchestrator.env_sampler import EnvSampler


def test_environments_are_drawn_by_weight_and_every_example_once_per_epoch():
    sampler = EnvSampler({"math": 10, "wiki": 5}, {"math": 0.75, "wiki": 0.25}, seed=3)
    draws = [sampler.next() for _ in range(4000)]
    counts = collections.Counter(env for env, _ in draws)
    assert abs(counts["math"] / 4000 - 0.75) < 0.03
    wiki = [index for env, index in draws if env == "wiki"]
    for epoch_start in range(0, len(wiki) - 5, 5):  # each epoch is a permutation of the examples
        assert sorted(wiki[epoch_start : epoch_start + 5]) == list(range(5))


def test_sampler_state_resumes_the_same_sequence():
    first = EnvSampler({"a": 7, "b": 3}, {"a": 1.0, "b": 2.0}, seed=0)
    for _ in range(11):
        first.next()
    state = first.state()
    expected = [first.next() for _ in range(20)]
    resumed = EnvSampler({"a": 7, "b": 3}, {"a": 1.0, "b": 2.0}, seed=0)
    resumed.restore(state)
    assert [resumed.next() for _ in range(20)] == expected
