"""`tool-echo`: a ToolEnv with one tool, `echo(text)`, for tests of `primerl env install` and of `primerl eval` on
tool environments (its requests carry `tools`, which vLLM refuses unless auto tool choice is on).

Reward: 1.0 when the final answer contains the word, else 0.0 (a tiny model rarely earns it; the tests look at
whether rollouts run, not at the reward).
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

WORDS = ("apple", "river", "stone", "cloud", "green", "seven")


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: the text to echo
    """
    return text


def contains_word(completion, answer, **kwargs) -> float:
    last = completion[-1] if completion else None
    content = getattr(last, "content", None) if not isinstance(last, dict) else last.get("content")
    return float(answer in str(content or ""))


def load_environment(num_examples: int = 6, max_turns: int = 2, **kwargs) -> vf.ToolEnv:
    rows = [
        {
            "question": f"Use the echo tool on the word {WORDS[i % len(WORDS)]}, then say it.",
            "answer": WORDS[i % len(WORDS)],
        }
        for i in range(num_examples)
    ]
    return vf.ToolEnv(
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        tools=[echo],
        rubric=vf.Rubric(funcs=[contains_word]),
        max_turns=max_turns,
        **kwargs,
    )
