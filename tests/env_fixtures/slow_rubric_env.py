"""A reverse-text env with an extra reward function that burns ~20 ms of CPU per call (over the env worker's
limit for scoring on its event loop) and raises for example 1."""

import time

import verifiers as vf
from reverse_text import load_environment as load_reverse_text


def slow_reward(completion, answer, parser, state=None, **kwargs) -> float:
    deadline = time.thread_time() + 0.02
    while time.thread_time() < deadline:
        pass
    if state is not None and state.get("example_id") == 1:
        raise ValueError("this reward function is broken for example 1")
    return 0.0


def load_environment(**kwargs):
    env = load_reverse_text(**kwargs)
    env.rubric.add_reward_func(slow_reward, weight=0.0)
    return env


__all__ = ["load_environment", "vf"]
