"""A multi-turn env whose env_response raises after the first model turn."""

import verifiers as vf
from datasets import Dataset


class BrokenResponseEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("env_response is broken on purpose")


def load_environment(**kwargs):
    rows = [{"question": "a b c", "answer": "c b a"}, {"question": "b d", "answer": "d b"}]
    rubric = vf.Rubric(funcs=[lambda completion, **kw: 1.0])
    return BrokenResponseEnv(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=3, **kwargs)
