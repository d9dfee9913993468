"""A reverse-text env whose extra reward function raises for every other rollout it scores: the orchestrator must
count those rollouts as errors, train on the others and keep running.

Every other call, not a property of the answer: a tiny untrained model can write answers alike enough that a rule on
the text (it used to be the answer's length) fails a whole step's worth of rollouts in a row, which the orchestrator
rightly treats as a broken environment."""

import itertools

from reverse_text import load_environment as load_reverse_text

_calls = itertools.count()


def sometimes_broken(completion, state, **kwargs) -> float:
    if next(_calls) % 2:
        raise ValueError("this reward function fails on every other rollout on purpose")
    return 0.0


def load_environment(**kwargs):
    env = load_reverse_text(**kwargs)
    env.rubric.add_reward_func(sometimes_broken, weight=0.0)
    return env
