"""`reverse-text-multiturn`: the reverse-text task with feedback. The model answers; the environment says
"correct" (and the rollout ends) or "try again" (and the model answers again), for up to `max_turns` model turns.

Reward: LCS-ratio similarity of the last answer; metrics: exact match of the last answer, solved on the first turn.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset
from reverse_text import SYSTEM_PROMPT, check_args, exact_match, lcs_reward, make_rows, normalize

CORRECT = "correct"
TRY_AGAIN = "try again"


class ReverseTextFeedbackEnv(vf.MultiTurnEnv):
    """Gives "correct" / "try again" after each answer."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        answer = self.parser.parse_answer(messages)
        if normalize(answer) == normalize(state["answer"]):
            state["final_env_response"] = [vf.UserMessage(content=CORRECT)]
            return state["final_env_response"]
        return [vf.UserMessage(content=TRY_AGAIN)]


def first_turn_exact(state, answer, parser: vf.Parser, **kwargs) -> float:
    """1.0 when the first answer was already right."""
    trajectory = state.get("trajectory") or []
    if not trajectory:
        return 0.0
    return float(normalize(parser.parse_answer(trajectory[0]["completion"])) == normalize(answer))


def load_environment(
    num_examples: int = 2000,
    num_eval_examples: int = 200,
    min_len: int = 3,
    max_len: int = 6,
    alphabet: str = "abcd",
    seed: int = 0,
    max_turns: int = 2,
    system_prompt: str = SYSTEM_PROMPT,
    **kwargs,
) -> vf.MultiTurnEnv:
    check_args(num_examples, min_len, max_len, alphabet)
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    train = make_rows(num_examples, min_len, max_len, alphabet, seed)
    evals = make_rows(num_eval_examples, min_len, max_len, alphabet, seed + 1_000_003)
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[lcs_reward, exact_match, first_turn_exact], weights=[1.0, 0.0, 0.0], parser=parser)
    return ReverseTextFeedbackEnv(
        dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(evals),
        system_prompt=system_prompt,
        parser=parser,
        rubric=rubric,
        max_turns=max_turns,
        **kwargs,
    )
