"""SFT data: a JSONL file of chat samples, tokenized with the model's chat template and packed.

Each line is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": [...], "completion":
[...]}`` (verifiers' shape: the completion's messages follow the prompt's). Loss tokens are the assistant messages'
tokens (content and end-of-turn), never the prompt, the other roles or the ``<|im_start|>assistant`` header that the
inference server adds itself. One optimizer step's samples are packed by the packer of RL batches
(``primerl.proto.packing``): balanced over the ranks by tokens, then first-fit-decreasing into micro-batches of at most
``seq_len`` tokens, so that every rank gets its share (``pack_for_ranks``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primerl.proto.packing import pack_samples
from primerl.trainer.batch import MicroBatch


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[bool]


def read_chat_samples(path: Path) -> list[list[dict[str, str]]]:
    """The conversations of a JSONL file; a bad line is an error naming the line and what is wrong."""
    conversations = []
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if isinstance(record, dict) and "messages" in record:
                messages = record["messages"]
            elif isinstance(record, dict) and "prompt" in record and "completion" in record:
                messages = list(record["prompt"]) + list(record["completion"])
            else:
                raise ValueError(f"{path}:{number}: expected an object with `messages`, or `prompt` and `completion`")
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise ValueError(
                    f"{path}:{number}: messages must be a list of {{role, content}} objects with string values"
                )
            if not any(m["role"] == "assistant" for m in messages):
                raise ValueError(f"{path}:{number}: no assistant message, so nothing to learn")
            conversations.append(messages)
    if not conversations:
        raise ValueError(f"{path}: no samples")
    return conversations


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, str]]) -> TokenizedSample:
    """Tokens of the whole conversation and which of them are assistant output."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    input_ids: list[int] = []
    loss_mask: list[bool] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            header = tokenizer.apply_chat_template(list(messages[:index]), tokenize=False, add_generation_prompt=True)
            _extend(input_ids, loss_mask, ids(header[len(rendered) :]), False)
            rendered = header
        full = tokenizer.apply_chat_template(list(messages[: index + 1]), tokenize=False)
        if not full.startswith(rendered):
            raise ValueError(
                "the chat template does not render conversations prefix by prefix; cannot mask per message"
            )
        _extend(input_ids, loss_mask, ids(full[len(rendered) :]), message["role"] == "assistant")
        rendered = full
    return TokenizedSample(input_ids, loss_mask)


def _extend(input_ids: list[int], loss_mask: list[bool], new_ids: list[int], is_loss: bool) -> None:
    input_ids.extend(new_ids)
    loss_mask.extend([is_loss] * len(new_ids))


@dataclass(frozen=True)
class SupervisedSample:
    """A tokenized conversation in the packer's shape (``primerl.proto.packing.PackableSample``): the RL-only
    fields are neutral (zero advantage and logprobs, temperature 1, policy version 0)."""

    token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    advantage: float = 0.0
    teacher_logprobs: None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.loss_mask):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.loss_mask)} loss-mask entries")
        if not self.token_ids:
            raise ValueError("a sample needs at least one token")
        if self.loss_mask[0]:
            raise ValueError("the first token of a sample cannot be a loss token: nothing precedes it")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def inference_logprobs(self) -> list[float]:
        return [0.0] * self.num_tokens

    @property
    def temperatures(self) -> list[float]:
        return [1.0] * self.num_tokens

    @property
    def policy_versions(self) -> list[int]:
        return [0] * self.num_tokens

    @property
    def min_policy_version(self) -> int:
        return 0

    @property
    def max_policy_version(self) -> int:
        return 0


def as_training_samples(samples: Sequence[TokenizedSample]) -> list[SupervisedSample]:
    """The samples in the packer's shape."""
    return [SupervisedSample(token_ids=s.input_ids, loss_mask=s.loss_mask) for s in samples]


def pack_for_ranks(
    samples: Sequence[SupervisedSample], seq_len: int, num_ranks: int = 1, pad_token_id: int = 0
) -> list[list[MicroBatch]]:
    """One step's micro-batches for each rank (``primerl.proto.packing.pack_samples``): samples balanced over the
    ranks by tokens, then first-fit-decreasing into bins of at most ``seq_len`` tokens (a longer sample is
    truncated); a rank left without samples gets one padding micro-batch (a ``pad_token_id`` token, no loss), so
    every rank has its share of the step."""
    packed = pack_samples(samples, seq_len=seq_len, num_ranks=num_ranks, pad_token_id=pad_token_id)
    return [[MicroBatch.from_tensors(batch.tensors) for batch in batches] for batches in packed.per_rank]
