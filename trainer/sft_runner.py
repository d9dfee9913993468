"""`primerl sft`: supervised fine-tuning from a JSONL file of chat samples, without the broker.

Each optimizer step takes the next ``data.batch_size`` samples (shuffled per epoch with ``data.seed``),
packs them into micro-batches of ``seq_len`` tokens, gives rank r every N-th micro-batch, and minimises the
masked cross-entropy of the assistant tokens. Checkpoints follow ``[ckpt]``; the final weights are exported
in Hugging Face format to ``{output_dir}/weights/step_{N}`` (what vLLM and RL runs start from). Rank 0
appends each step's ``sft/...`` metrics to ``{output_dir}/metrics.jsonl`` (role ``sft``; W&B with ``[wandb]``)
and serves them on its Prometheus endpoint (``[prometheus]``).
"""

from __future__ import annotations

import math
import random
import threading
import time
from pathlib import Path

import torch

from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.metrics_sink import MetricsSink
from primerl.runtime.prometheus import start_exporter
from primerl.trainer.config import SFTConfig
from primerl.trainer.distributed import DistInfo, barrier, unwrap_model, wrap_model
from primerl.trainer.sft_data import pack_samples, read_chat_samples, tokenize_conversation
from primerl.trainer.train_step import TrainStep, sft_objective

log = get_logger("primerl.trainer.sft")


def run_sft(config: SFTConfig, dist_info: DistInfo, stop_event: threading.Event | None = None) -> Path:
    """Train; returns the directory of the exported final weights."""
    from primerl.trainer.runner import warn_unused_options

    warn_unused_options(config)
    exporter = start_exporter("sft", config.prometheus) if dist_info.is_main else None
    sink = None
    try:
        if dist_info.is_main:  # first: a bad [wandb] fails before the model loads
            sink = MetricsSink("sft", config.output_dir, config.wandb, config, exporter=exporter)
        return _train(config, dist_info, stop_event, sink)
    finally:
        if sink is not None:
            sink.close()
        if exporter is not None:
            exporter.stop()


def _train(config: SFTConfig, dist_info: DistInfo, stop_event: threading.Event | None,
           sink: MetricsSink | None) -> Path:
    from transformers import AutoTokenizer

    from primerl.trainer.checkpoint import export_hf_weights, latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
    from primerl.trainer.model import load_model
    from primerl.trainer.optim import build_optimizer, build_scheduler

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer.name)
    samples = [tokenize_conversation(tokenizer, messages) for messages in read_chat_samples(config.data.path)]
    steps_per_epoch = math.ceil(len(samples) / config.data.batch_size)
    max_steps = config.max_steps or steps_per_epoch * config.data.epochs
    torch.manual_seed(config.data.seed)
    model = wrap_model(load_model(config.model), config.model.parallel, dist_info)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps)
    step_fn = TrainStep(model, optimizer, scheduler, sft_objective, dist_info, max_grad_norm=config.optim.max_norm)
    start_step = 1
    if config.ckpt is not None:
        resume = config.ckpt.resume_step or latest_checkpoint(config.checkpoint_dir)
        if resume is not None:
            start_step = load_checkpoint(config.checkpoint_dir, resume, model=unwrap_model(model), optimizer=optimizer,
                                         scheduler=scheduler, rank=dist_info.rank)["step"] + 1
    log.info("sft starting", num_samples=len(samples), max_steps=max_steps, start_step=start_step)
    for step in range(start_step, max_steps + 1):
        if stop_event is not None and stop_event.is_set():
            break
        bind_context(step=step)
        started_s = time.monotonic()
        batch = _step_samples(samples, step, config.data.batch_size, config.data.seed)
        micro_batches = pack_samples(batch, config.seq_len)
        mine = micro_batches[dist_info.rank :: dist_info.world_size]
        stats = step_fn.step(step, mine)
        if sink is not None:
            sink.log(step, stats.as_metrics("sft"))
        log.info("sft step", loss=round(stats.loss, 5), tokens=stats.num_loss_tokens,
                 step_s=round(time.monotonic() - started_s, 3))
        ckpt = config.ckpt
        if ckpt is not None and (step == max_steps or (ckpt.interval and step % ckpt.interval == 0)):
            save_checkpoint(config.checkpoint_dir, step, model=unwrap_model(model), optimizer=optimizer,
                            scheduler=scheduler, extra_state={"step": step}, rank=dist_info.rank,
                            world_size=dist_info.world_size, barrier=lambda: barrier(dist_info))
            if dist_info.is_main:
                prune_checkpoints(config.checkpoint_dir, keep_last=ckpt.keep_last, keep_interval=ckpt.keep_interval)
    final_dir = config.output_dir / "weights" / f"step_{max_steps}"
    if dist_info.is_main:
        export_hf_weights(unwrap_model(model), tokenizer, final_dir)
        log.info("sft weights exported", path=str(final_dir))
    barrier(dist_info)
    return final_dir


def _step_samples(samples: list, step: int, batch_size: int, seed: int) -> list:
    """The samples of optimizer step ``step`` (1-based): consecutive slices of a per-epoch shuffle."""
    steps_per_epoch = math.ceil(len(samples) / batch_size)
    epoch, offset = divmod(step - 1, steps_per_epoch)
    order = list(range(len(samples)))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return [samples[i] for i in order[offset * batch_size : (offset + 1) * batch_size]]
