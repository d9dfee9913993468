"""A reverse-text env with an extra reward function that always raises."""

import verifiers as vf
from reverse_text import load_environment as load_reverse_text


def flaky_reward(completion, answer, parser, **kwargs) -> float:
    raise ValueError("this reward function is broken on purpose")


def load_environment(**kwargs):
    env = load_reverse_text(**kwargs)
    env.rubric.add_reward_func(flaky_reward, weight=1.0)
    return env


__all__ = ["load_environment", "vf"]
