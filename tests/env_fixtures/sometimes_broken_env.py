"""A reverse-text env whose extra reward function raises for about half of the rollouts (by completion length):
the orchestrator must count those rollouts as errors, train on the others and keep running."""

from reverse_text import load_environment as load_reverse_text


def sometimes_broken(completion, state, **kwargs) -> float:
    text = completion[-1]["content"] if isinstance(completion, list) and completion else str(completion)
    if len(text) % 2:
        raise ValueError("this reward function fails on odd-length answers on purpose")
    return 0.0


def load_environment(**kwargs):
    env = load_reverse_text(**kwargs)
    env.rubric.add_reward_func(sometimes_broken, weight=0.0)
    return env
