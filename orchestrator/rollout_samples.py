"""A few sample rollouts of each step, for people to read (the dashboard's Rollouts view): picked per environment,
decoded, bounded, appended to ``{output_dir}/rollouts.jsonl`` off the orchestrator's loop.

Per step and environment the rollout with the highest and the one with the lowest reward are kept (``per_env``
in all; distinct rollouts). One record (one JSON line) per sample rollout::

    {"step": 3, "env_id": "reverse-text", "example_id": 17, "rollout_id": 2, "reward": 0.8, "advantage": 0.21,
     "policy_version": 2, "truncated": false, "prompt": "<|im_start|>user ...",
     "tokens": [["Hello", -0.01, true], [" world", -2.3, true], ...], "tokens_dropped": 0, "time": 1795809128.9}

``tokens``: every token after the prompt as ``[text, logprob, is_model_token]`` (``false``: a tool or user turn
inside a multi-turn rollout, logprob 0). Bounded: the prompt keeps its last ``MAX_PROMPT_CHARS`` characters, the
completion its first ``MAX_TOKENS`` tokens (``tokens_dropped`` says how many more there were), and a record stays
under ``max_record_bytes``. The text comes from the model's tokenizer (``model.name``, loaded on the writer thread
from the local files only, or the one the preflight's environment check loaded); without one, tokens show as
``<id>``.

The hand-off never blocks a step: ``add`` queues the step's samples and returns; a full queue (a slow disk) drops
the step's samples with one warning. A write error is logged once and never stops the orchestrator.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from primerl.orchestrator.samples import TrainingSample
from primerl.runtime.log_setup import get_logger
from primerl.runtime.run_files import ROLLOUTS_FILE

log = get_logger("primerl.orchestrator.rollout_samples")

DEFAULT_PER_ENV = 2
MAX_PROMPT_CHARS = 4000
MAX_TOKENS = 1024
DEFAULT_MAX_RECORD_BYTES = 64 << 10
QUEUE_STEPS = 8

Decoder = Callable[[Sequence[int]], list[str]]


def pick(samples: Sequence[TrainingSample], per_env: int) -> list[TrainingSample]:
    """Per environment, the highest- and the lowest-reward rollouts (alternately, ``per_env`` in all), each the
    first sample of its rollout; in order of environment, then pick."""
    by_env: dict[str, dict[tuple, TrainingSample]] = {}
    for sample in samples:
        rollouts = by_env.setdefault(sample.env_id, {})
        rollouts.setdefault((sample.group_id, sample.rollout_id), sample)
    picked: list[TrainingSample] = []
    for env_id in sorted(by_env):
        ranked = sorted(by_env[env_id].values(), key=lambda s: s.reward, reverse=True)
        order, low, high = [], 0, len(ranked) - 1
        while low <= high:
            order.append(ranked[low])
            if low != high:
                order.append(ranked[high])
            low, high = low + 1, high - 1
        picked.extend(order[:per_env])
    return picked


def to_record(step: int, sample: TrainingSample, decode: Decoder, max_record_bytes: int) -> dict[str, Any]:
    """One sample rollout as a JSON-ready record (see the module doc), at most ``max_record_bytes`` serialized."""
    mask = list(sample.loss_mask)
    first = mask.index(True) if True in mask else len(mask)
    token_ids = list(sample.token_ids)
    completion_ids = token_ids[first : first + MAX_TOKENS]
    texts = decode(token_ids[:first] + completion_ids)
    prompt = "".join(texts[:first])[-MAX_PROMPT_CHARS:]
    logprobs = list(sample.inference_logprobs)
    tokens = [
        [text, _finite(logprobs[first + i]) if mask[first + i] else 0.0, bool(mask[first + i])]
        for i, text in enumerate(texts[first:])
    ]
    versions = [v for v, m in zip(sample.policy_versions, mask, strict=True) if m] or list(sample.policy_versions)
    record = {
        "step": int(step),
        "env_id": sample.env_id,
        "example_id": sample.example_id if isinstance(sample.example_id, (int, str)) else str(sample.example_id),
        "rollout_id": int(sample.rollout_id),
        "reward": _finite(sample.reward),
        "advantage": _finite(sample.advantage),
        "policy_version": int(max(versions)) if versions else 0,
        "truncated": bool(sample.truncated),
        "prompt": prompt,
        "tokens": tokens,
        "tokens_dropped": len(token_ids) - first - len(completion_ids),
        "time": round(time.time(), 3),
    }
    while len(json.dumps(record).encode()) > max_record_bytes and (record["tokens"] or record["prompt"]):
        if len(record["prompt"]) > 200:
            record["prompt"] = record["prompt"][-(len(record["prompt"]) // 2) :]
            continue
        keep = len(record["tokens"]) // 2
        record["tokens_dropped"] += len(record["tokens"]) - keep
        record["tokens"] = record["tokens"][:keep]
        if not keep:
            record["prompt"] = ""
    return record


def _finite(value: float) -> float:
    value = float(value)
    return round(value, 5) if math.isfinite(value) else 0.0


def tokenizer_decoder(model_name: str, loading: concurrent.futures.Future | None = None) -> Decoder:
    """Each token's text through the model's tokenizer (local files only; ``loading``: the (tokenizer, traceback)
    of one loaded elsewhere, used when it loaded); token ids as ``<id>`` without one."""
    if loading is not None:
        loaded, _ = loading.result()
        if loaded is not None:
            return lambda ids: [loaded.decode([token_id]) for token_id in ids]
    try:
        from primerl.runtime.tokenizer_files import FileTokenizer

        tokenizer = FileTokenizer.load(model_name)  # the directory's tokenizer.json: no transformers import
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_name, local_files_only=True)
    except Exception as err:  # no local tokenizer (a served name that is not a path): ids will do
        log.info("sample rollouts show token ids: no local tokenizer", model=model_name, reason=str(err)[:200])
        return lambda ids: [f"<{token_id}>" for token_id in ids]
    return lambda ids: [tokenizer.decode([token_id]) for token_id in ids]


class RolloutSamples:
    """Picks, decodes and appends each step's sample rollouts on a writer thread of its own; ``on_records`` (if
    given) also gets each step's records there, e.g. to send them to the broker."""

    def __init__(
        self,
        output_dir: str | Path,
        model_name: str,
        *,
        per_env: int = DEFAULT_PER_ENV,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        on_records: Callable[[int, list[dict]], None] | None = None,
        decoder: Decoder | None = None,
        tokenizer_loading: concurrent.futures.Future | None = None,
    ):
        self.path = Path(output_dir) / ROLLOUTS_FILE
        self.per_env = per_env
        self.max_record_bytes = max_record_bytes
        self._model_name = model_name
        self._decode = decoder
        self._tokenizer_loading = tokenizer_loading  # of model_name, loaded elsewhere: (tokenizer, traceback)
        self._on_records = on_records
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_STEPS)
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()

    def add(self, step: int, samples: Sequence[TrainingSample]) -> None:
        """Queue the step's samples (the pick happens here: a few references, not the batch)."""
        if self.per_env <= 0:
            return
        chosen = pick(samples, self.per_env)
        if not chosen:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-samples", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((step, chosen))
        except queue.Full:
            self._warn_once("full", "sample rollouts dropped: the writer is behind", step=step)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (within ``timeout_s``) and stop the writer."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, chosen = item
            try:
                self._write(step, chosen)
            except Exception as err:  # never fatal: the samples are for reading, training goes on
                self._warn_once(type(err).__name__, "sample rollouts not written", error=str(err)[:300])

    def _write(self, step: int, chosen: list[TrainingSample]) -> None:
        if self._decode is None:
            self._decode = tokenizer_decoder(self._model_name, self._tokenizer_loading)
        records = [to_record(step, sample, self._decode, self.max_record_bytes) for sample in chosen]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        if self._on_records is not None:
            self._on_records(step, records)

    def _warn_once(self, key: str, message: str, **fields: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, path=str(self.path), **fields)
