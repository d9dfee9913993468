"""`reverse-text`: reverse a short string of letters written with spaces between them ("a c b d" -> "d b c a").

A verifiers environment (classic API) the tiny model can learn: each spaced letter is one token of its tokenizer,
so reversing is a pure copy-in-reverse task. Reward: LCS-ratio similarity between the parsed answer and the
reversed string (0..1). Metric: exact match (weight 0).

    [[orchestrator.env]]
    id = "reverse-text"
    args = { num_examples = 2000, min_len = 3, max_len = 6, alphabet = "abcd" }
"""

from __future__ import annotations

import random
from difflib import SequenceMatcher

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Reverse the letters. Answer with the letters only, separated by spaces."
EVAL_SEED_OFFSET = 1_000_003  # the eval split draws from another stream than the train split


def normalize(text: str | None) -> str:
    """Letters separated by single spaces; anything else the model wrote around them is dropped."""
    return " ".join((text or "").split())


def make_rows(num_examples: int, min_len: int, max_len: int, alphabet: str, seed: int) -> list[dict[str, str]]:
    """`num_examples` rows {question, answer}, the same for the same arguments."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        letters = [rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len))]
        rows.append({"question": " ".join(letters), "answer": " ".join(reversed(letters))})
    return rows


def check_args(num_examples: int, min_len: int, max_len: int, alphabet: str) -> None:
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if not alphabet or any(ch.isspace() for ch in alphabet) or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must be distinct non-space characters, got {alphabet!r}")


def lcs_reward(completion, answer, parser: vf.Parser, **kwargs) -> float:
    """Similarity of the answer to the reversed string: difflib's ratio over the letter sequences (0..1)."""
    parsed = normalize(parser.parse_answer(completion)).split(" ")
    return SequenceMatcher(None, parsed, normalize(answer).split(" "), autojunk=False).ratio()


def exact_match(completion, answer, parser: vf.Parser, **kwargs) -> float:
    """1.0 when the answer is exactly the reversed string (spacing aside), else 0.0."""
    return float(normalize(parser.parse_answer(completion)) == normalize(answer))


def load_environment(
    num_examples: int = 2000,
    num_eval_examples: int = 200,
    min_len: int = 3,
    max_len: int = 6,
    alphabet: str = "abcd",
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
    **kwargs,
) -> vf.SingleTurnEnv:
    check_args(num_examples, min_len, max_len, alphabet)
    train = make_rows(num_examples, min_len, max_len, alphabet, seed)
    evals = make_rows(num_eval_examples, min_len, max_len, alphabet, seed + EVAL_SEED_OFFSET)
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[lcs_reward, exact_match], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(evals),
        system_prompt=system_prompt,
        parser=parser,
        rubric=rubric,
        **kwargs,
    )
