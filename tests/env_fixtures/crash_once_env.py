"""A reverse-text env whose env-worker process dies (exit code 3) the first time it scores a rollout, and never
again (a marker file, `marker` in the env args, remembers it): the orchestrator must restart the env worker,
dispatch the lost groups again, and finish its steps."""

import os

from reverse_text import load_environment as load_reverse_text

CRASH_EXIT_CODE = 3


def load_environment(marker: str, **kwargs):
    env = load_reverse_text(**kwargs)

    def crash_once(completion, state, **_kwargs) -> float:
        if not os.path.exists(marker):
            with open(marker, "w") as handle:
                handle.write(str(os.getpid()))
            os._exit(CRASH_EXIT_CODE)  # the whole env-worker process, at once, as a segfault or OOM kill would
        return 0.0

    env.rubric.add_reward_func(crash_once, weight=0.0)
    return env
