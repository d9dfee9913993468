"""A reverse-text env that prints to stdout while loading and scoring (the worker must keep its protocol clean)."""

from reverse_text import load_environment as load_reverse_text


def load_environment(**kwargs):
    print("hello from load_environment on stdout")
    env = load_reverse_text(**kwargs)

    def chatty_metric(completion, **kw) -> float:
        print("scoring, on stdout", flush=True)
        return 0.5

    env.rubric.add_metric(chatty_metric)
    return env
