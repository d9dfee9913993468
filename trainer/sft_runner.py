"""`primerl sft`: supervised fine-tuning from a JSONL file of chat samples, without the broker.

Each optimizer step takes the next ``data.batch_size`` samples (shuffled per epoch with ``data.seed``), packs
them as RL batches are packed (``primerl.trainer.sft_data.pack_for_ranks``: every rank gets its share, a
padding micro-batch when there are fewer samples than ranks), and minimises the masked cross-entropy of the
assistant tokens. Checkpoints follow ``[ckpt]``; the final weights are exported in Hugging Face format to
``{output_dir}/weights/step_{max_steps}`` (what vLLM and RL runs start from). Rank 0 appends each step's
``sft/...`` metrics to ``{output_dir}/metrics.jsonl`` (role ``sft``; W&B with ``[wandb]``) and serves them on its
Prometheus endpoint (``[prometheus]``).

Reproducible: ``data.seed`` seeds the sample order and every random stream of the run (Python, NumPy, torch: the
initialisation of a LoRA adapter, dropout), so the same data, config and thread count give the same weights.

Several ranks (torchrun) replicate the model (``model.parallel`` unset or ``ddp``); an explicit ``fsdp2`` with
several ranks is refused before anything loads: sharded weights cannot be checkpointed or exported yet.

Interrupted (SIGINT/SIGTERM, ``stop_event``): the ranks agree to stop at the same step boundary (one all-reduce
per step with several ranks), the last step trained is checkpointed when ``[ckpt]`` is set (a re-run resumes
there) and its weights are exported to ``weights/step_{N}`` with N the step reached, never ``max_steps``: nothing
that looks final. ``SFTResult.finished`` is false, and ``primerl sft`` exits 128 + the signal number.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from primerl.configs.trainer import SFTConfig
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.metrics_sink import MetricsSink
from primerl.runtime.prometheus import start_exporter
from primerl.trainer.distributed import DistInfo, all_reduce_sum, barrier, resolve_parallel, unwrap_model
from primerl.trainer.sft_data import as_training_samples, pack_for_ranks, read_chat_samples, tokenize_conversation
from primerl.trainer.train_step import sft_objective
from primerl.trainer.training_setup import (
    build_training,
    resume_from_checkpoint,
    save_training_checkpoint,
    warn_unused_options,
)

log = get_logger("primerl.trainer.sft")


@dataclass(frozen=True)
class SFTResult:
    """What a run of ``run_sft`` did."""

    weights_dir: Path | None
    """The exported weights (``weights/step_{last_step}``); None when stopped before any step."""
    last_step: int
    """The last optimizer step trained (or resumed from)."""
    max_steps: int

    @property
    def finished(self) -> bool:
        return self.last_step >= self.max_steps


StepCallback = Callable[[int, int, float], None]
"""Called on rank 0 after each optimizer step with (step, max_steps, loss): ``primerl sft``'s progress bar."""


def run_sft(
    config: SFTConfig,
    dist_info: DistInfo,
    stop_event: threading.Event | None = None,
    on_step: StepCallback | None = None,
) -> SFTResult:
    """Train to ``max_steps`` or until ``stop_event`` is set; see ``SFTResult``."""
    parallel = resolve_parallel(config.model.parallel, dist_info.world_size)  # first: before anything loads
    warn_unused_options(config)
    exporter = start_exporter("sft", config.prometheus) if dist_info.is_main else None
    sink = None
    try:
        if dist_info.is_main:  # first: a bad [wandb] fails before the model loads
            sink = MetricsSink("sft", config.output_dir, config.wandb, config, exporter=exporter)
        return _train(config, dist_info, parallel, stop_event or threading.Event(), sink, on_step)
    finally:
        if sink is not None:
            sink.close()
        if exporter is not None:
            exporter.stop()


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's random streams from ``seed``."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _train(
    config: SFTConfig,
    dist_info: DistInfo,
    parallel: str,
    stop_event: threading.Event,
    sink: MetricsSink | None,
    on_step: StepCallback | None = None,
) -> SFTResult:
    from primerl.trainer.checkpoint import prune_checkpoints
    from primerl.trainer.weights_export import export_hf_weights

    seed_everything(config.data.seed)
    tokenizer, samples, pad_token_id = _load_samples(config)
    steps_per_epoch = math.ceil(len(samples) / config.data.batch_size)
    max_steps = config.max_steps or steps_per_epoch * config.data.epochs
    training = build_training(config, parallel, dist_info, max_steps, sft_objective)
    resumed = resume_from_checkpoint(config, training, dist_info.rank)
    start_step = 1 if resumed is None else resumed["step"] + 1
    log.info(
        "sft starting",
        num_samples=len(samples),
        max_steps=max_steps,
        start_step=start_step,
        world_size=dist_info.world_size,
    )

    def checkpoint(step: int) -> None:
        save_training_checkpoint(config, training, step, {"step": step}, dist_info)
        if dist_info.is_main:
            prune_checkpoints(
                config.checkpoint_dir, keep_last=config.ckpt.keep_last, keep_interval=config.ckpt.keep_interval
            )

    last_step = start_step - 1
    saved_step = None
    for step in range(start_step, max_steps + 1):
        if _stop_agreed(stop_event, dist_info):
            break
        bind_context(step=step)
        started_s = time.monotonic()
        batch = _step_samples(samples, step, config.data.batch_size, config.data.seed)
        mine = pack_for_ranks(batch, config.seq_len, dist_info.world_size, pad_token_id)[dist_info.rank]
        stats = training.step_fn.step(step, mine)
        last_step = step
        if sink is not None:
            sink.log(step, stats.as_metrics("sft"))
        log.info(
            "sft step",
            loss=round(stats.loss, 5),
            tokens=stats.num_loss_tokens,
            step_s=round(time.monotonic() - started_s, 3),
        )
        if on_step is not None and dist_info.is_main:
            on_step(step, max_steps, stats.loss)
        ckpt = config.ckpt
        if ckpt is not None and (step == max_steps or (ckpt.interval and step % ckpt.interval == 0)):
            checkpoint(step)
            saved_step = step
    result = SFTResult(None, last_step, max_steps)
    if not result.finished:
        log.warning(
            "sft interrupted: the weights of the step reached are exported, not the final model",
            step=last_step,
            max_steps=max_steps,
        )
        if last_step < start_step:  # nothing trained in this run: nothing new to save
            return result
        if config.ckpt is not None and saved_step != last_step:
            checkpoint(last_step)  # a re-run resumes here
    weights_dir = config.output_dir / "weights" / f"step_{last_step}"
    if dist_info.is_main:
        export_hf_weights(unwrap_model(training.model), tokenizer, weights_dir)
        log.info("sft weights exported", path=str(weights_dir), final=result.finished)
    barrier(dist_info)
    return SFTResult(weights_dir, last_step, max_steps)


def _load_samples(config: SFTConfig) -> tuple[Any, list, int]:
    """The tokenizer, the tokenized samples of ``config.data`` and the id that pads them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer.name)
    samples = as_training_samples(
        [tokenize_conversation(tokenizer, messages) for messages in read_chat_samples(config.data.path)]
    )
    pad_token_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    return tokenizer, samples, pad_token_id


def _stop_agreed(stop_event: threading.Event, dist_info: DistInfo) -> bool:
    """Whether to stop before the next step; with several ranks, true on all of them once any rank's event is set
    (a signal may reach the ranks at different steps: stopping alone would leave the others in a collective)."""
    return all_reduce_sum(float(stop_event.is_set()), dist_info) > 0


def _step_samples(samples: list, step: int, batch_size: int, seed: int) -> list:
    """The samples of optimizer step ``step`` (1-based): consecutive slices of a per-epoch shuffle."""
    steps_per_epoch = math.ceil(len(samples) / batch_size)
    epoch, offset = divmod(step - 1, steps_per_epoch)
    order = list(range(len(samples)))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return [samples[i] for i in order[offset * batch_size : (offset + 1) * batch_size]]
