"""The reverse-text taskset (rows and reward as in `examples/reverse_text/reverse_text/__init__.py`)."""

from __future__ import annotations

import random
from difflib import SequenceMatcher
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

SYSTEM_PROMPT = "Reverse the letters. Answer with the letters only, separated by spaces."
EVAL_SEED_OFFSET = 1_000_003  # the eval split draws from another stream than the train split (as the classic env)


def normalize(text: str | None) -> str:
    """Letters separated by single spaces; anything else the model wrote around them is dropped."""
    return " ".join((text or "").split())


def lcs_ratio(reply: str | None, answer: str) -> float:
    """Similarity of the reply to the reversed string: difflib's ratio over the letter sequences (0..1)."""
    return SequenceMatcher(None, normalize(reply).split(" "), normalize(answer).split(" "), autojunk=False).ratio()


def make_rows(num_examples: int, min_len: int, max_len: int, alphabet: str, seed: int) -> list[dict[str, str]]:
    """`num_examples` rows {question, answer}, the same for the same arguments (the classic env's rows)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        letters = [rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len))]
        rows.append({"question": " ".join(letters), "answer": " ".join(reversed(letters))})
    return rows


class ReverseTextData(vf.TaskData):
    """One row: the spaced letters (the prompt) and their reversal."""

    answer: str = ""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward(weight=1.0)
    async def lcs_reward(self, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply, self.data.answer)

    @vf.metric
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(normalize(trace.last_reply) == normalize(self.data.answer))


class ReverseTextConfig(vf.TasksetConfig):
    """The rows: the classic environment's `load_environment` arguments, plus the split."""

    num_examples: int = Field(2000, ge=1)
    """Rows of the train split."""
    num_eval_examples: int = Field(200, ge=1)
    """Rows of the eval split."""
    min_len: int = Field(3, ge=1)
    max_len: int = Field(6, ge=1)
    alphabet: str = "abcd"
    seed: int = 0
    split: Literal["train", "eval"] = "train"
    system_prompt_text: str = SYSTEM_PROMPT
    """The system prompt of every task."""

    @model_validator(mode="after")
    def _check(self) -> "ReverseTextConfig":
        if self.min_len > self.max_len:
            raise ValueError(f"need min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        alphabet = self.alphabet
        if not alphabet or any(ch.isspace() for ch in alphabet) or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet must be distinct non-space characters, got {alphabet!r}")
        return self


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> list[ReverseTextTask]:
        config = self.config
        eval_split = config.split == "eval"
        rows = make_rows(
            config.num_eval_examples if eval_split else config.num_examples,
            config.min_len,
            config.max_len,
            config.alphabet,
            config.seed + (EVAL_SEED_OFFSET if eval_split else 0),
        )
        return [
            ReverseTextTask(
                ReverseTextData(prompt=row["question"], answer=row["answer"], system_prompt=config.system_prompt_text),
                config.task,
            )
            for row in rows
        ]
