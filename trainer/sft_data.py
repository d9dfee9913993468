"""SFT data: a JSONL file of chat samples, tokenized with the model's chat template and packed.

Each line is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": [...], "completion":
[...]}`` (verifiers' shape: the completion's messages follow the prompt's). Loss tokens are the assistant
messages' tokens (content and end-of-turn), never the prompt, the other roles or the
``<|im_start|>assistant`` header that the inference server adds itself. Samples are packed
first-fit-decreasing into micro-batches of at most ``seq_len`` tokens; the packed micro-batches of one
optimizer step are split round-robin over ranks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
            ):
                raise ValueError(f"{path}:{number}: messages must be a list of {{role, content}} objects with string values")
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
            _extend(input_ids, loss_mask, ids(header[len(rendered):]), False)
            rendered = header
        full = tokenizer.apply_chat_template(list(messages[: index + 1]), tokenize=False)
        if not full.startswith(rendered):
            raise ValueError("the chat template does not render conversations prefix by prefix; cannot mask per message")
        _extend(input_ids, loss_mask, ids(full[len(rendered):]), message["role"] == "assistant")
        rendered = full
    return TokenizedSample(input_ids, loss_mask)


def _extend(input_ids: list[int], loss_mask: list[bool], new_ids: list[int], is_loss: bool) -> None:
    input_ids.extend(new_ids)
    loss_mask.extend([is_loss] * len(new_ids))


def pack_samples(samples: Sequence[TokenizedSample], seq_len: int) -> list[MicroBatch]:
    """First-fit-decreasing into bins of at most ``seq_len`` tokens; a longer sample is truncated (its loss
    tokens beyond ``seq_len`` are lost, which is counted by the caller from the returned batches)."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    bins: list[list[TokenizedSample]] = []
    sizes: list[int] = []
    for index in order:
        sample = samples[index]
        if len(sample.input_ids) > seq_len:
            sample = TokenizedSample(sample.input_ids[:seq_len], sample.loss_mask[:seq_len])
        size = len(sample.input_ids)
        for slot, used in enumerate(sizes):
            if used + size <= seq_len:
                bins[slot].append(sample)
                sizes[slot] += size
                break
        else:
            bins.append([sample])
            sizes.append(size)
    return [_as_micro_batch(group) for group in bins]


def _as_micro_batch(group: Sequence[TokenizedSample]) -> MicroBatch:
    input_ids = np.concatenate([np.asarray(s.input_ids, np.int64) for s in group])
    n = len(input_ids)
    return MicroBatch.from_tensors({
        "input_ids": input_ids,
        "position_ids": np.concatenate([np.arange(len(s.input_ids), dtype=np.int64) for s in group]),
        "loss_mask": np.concatenate([np.asarray(s.loss_mask, bool) for s in group]),
        "advantages": np.zeros(n, np.float32),
        "inference_logprobs": np.zeros(n, np.float32),
        "temperatures": np.ones(n, np.float32),
    })
