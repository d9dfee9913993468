"""Sample with vLLM keeping token ids and logprobs, and recompute those logprobs with transformers.

RL importance sampling compares the trainer's logprobs of the sampled tokens with the ones the inference
engine reported, so the two must mean the same thing. vLLM v1 returns, per `logprobs_mode`:

- ``raw_logprobs`` (vLLM's default): ``log_softmax(logits)``, before temperature, top-k/top-p and penalties;
- ``processed_logprobs`` (primerl's default, see `EngineOptions.logprobs_mode`): ``log_softmax(logits / T)``
  of the distribution actually sampled from (greedy requests, T < 1e-5, use T = 1).

`reference_logprobs(..., temperature=effective_temperature(mode, T))` computes the same quantity from a
transformers forward pass over prompt + completion; `max_abs_diff` compares them. Top-k/top-p are not
exposed here: with them the processed distribution is renormalised over the kept tokens.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import vllm
    from transformers import PreTrainedModel

_SAMPLING_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


@dataclass
class SampledCompletion:
    """One prompt's completion as vLLM produced it."""

    prompt: str | None
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    """Logprob of each sampled token, in the engine's `logprobs_mode`."""
    text: str
    finish_reason: str | None


@dataclass
class GenerationResult:
    samples: list[SampledCompletion]
    elapsed_s: float

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.completion_token_ids) for s in self.samples)

    @property
    def completion_tokens_per_s(self) -> float:
        return self.num_completion_tokens / self.elapsed_s if self.elapsed_s > 0 else math.inf


def effective_temperature(logprobs_mode: str, temperature: float) -> float:
    """The temperature by which logits were divided before the log_softmax whose values vLLM returned."""
    if logprobs_mode.startswith("raw") or temperature < _SAMPLING_EPS:
        return 1.0
    return temperature


def engine_logprobs_mode(llm: vllm.LLM) -> str:
    """The `logprobs_mode` the engine was started with."""
    return str(llm.llm_engine.model_config.logprobs_mode)


def generate_with_logprobs(
    llm: vllm.LLM,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int,
    seed: int | None = 0,
    temperature: float = 1.0,
    ignore_eos: bool = False,
    lora_request: Any = None,
) -> GenerationResult:
    """Sample one completion per prompt (text, or token ids used as they are) with the sampled-token logprobs.

    With an integer `seed`, prompt i is sampled with its own generator seeded seed + i: its tokens do not depend
    on the other requests in the batch. `lora_request` (a vLLM `LoRARequest`) applies an adapter to every prompt.
    """
    from vllm import SamplingParams

    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            logprobs=0,  # only the sampled token's logprob
            seed=None if seed is None else seed + i,
            ignore_eos=ignore_eos,
        )
        for i in range(len(prompts))
    ]
    inputs: list[Any] = [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_request)
    elapsed_s = time.perf_counter() - start

    samples = []
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError(f"vLLM returned no logprobs for request {output.request_id}")
        logprobs = [
            float(position[token_id].logprob) for token_id, position in zip(token_ids, completion.logprobs, strict=True)
        ]
        samples.append(
            SampledCompletion(
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(output.prompt_token_ids or []),
                completion_token_ids=token_ids,
                completion_logprobs=logprobs,
                text=completion.text,
                finish_reason=completion.finish_reason,
            )
        )
    return GenerationResult(samples=samples, elapsed_s=elapsed_s)


def load_reference_model(model_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load `model_dir` with transformers for reference logprobs (float32 and eval mode by default)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    progress_bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights 100%" on every call is noise
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or torch.float32)
    finally:
        if progress_bar_was_enabled:
            hf_logging.enable_progress_bar()
    model.eval()
    return model


def reference_logprobs(
    model: PreTrainedModel | str | os.PathLike[str],
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    *,
    temperature: float = 1.0,
    dtype: torch.dtype | None = None,
) -> list[float]:
    """Logprob of each completion token given everything before it, from a transformers forward pass.

    `temperature` divides the logits before the log_softmax: pass `effective_temperature(mode, T)` to match
    vLLM's logprobs. `model` is a loaded model or a directory (loaded in `dtype`, float32 by default).
    """
    import torch

    if not completion_ids:
        return []
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty: the first completion token needs a context")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if isinstance(model, str | os.PathLike):
        model = load_reference_model(model, dtype)
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[0].float()
    # logits[i] predicts token i + 1: the completion tokens are predicted by positions P-1 .. P+C-2.
    num_prompt = len(prompt_ids)
    predicting = logits[num_prompt - 1 : -1] / temperature
    logprobs = torch.log_softmax(predicting, dim=-1)
    targets = input_ids[0, num_prompt:].unsqueeze(-1)
    return logprobs.gather(-1, targets).squeeze(-1).tolist()


def max_abs_diff(engine_logprobs: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> float:
    """Largest |engine - reference| over all tokens of all samples (0.0 when there are no tokens)."""
    worst = 0.0
    for sample_engine, sample_reference in zip(engine_logprobs, reference, strict=True):
        if len(sample_engine) != len(sample_reference):
            raise ValueError(f"token counts differ: {len(sample_engine)} vs {len(sample_reference)}")
        for a, b in zip(sample_engine, sample_reference, strict=True):
            worst = max(worst, abs(a - b))
    return worst


def check_logprobs(
    model: PreTrainedModel | str | os.PathLike[str],
    samples: Sequence[SampledCompletion],
    *,
    logprobs_mode: str,
    temperature: float,
) -> float:
    """Max abs difference between the engine's logprobs of `samples` and a transformers recomputation."""
    if isinstance(model, str | os.PathLike):
        model = load_reference_model(model)
    reference_temperature = effective_temperature(logprobs_mode, temperature)
    reference = [
        reference_logprobs(model, s.prompt_token_ids, s.completion_token_ids, temperature=reference_temperature)
        for s in samples
    ]
    return max_abs_diff([s.completion_logprobs for s in samples], reference)
