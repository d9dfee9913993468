"""torch.distributed for the trainer: one process per rank, started by torchrun (gloo on CPU, nccl on GPU).

The model is replicated (DDP) or sharded (FSDP2, ``fully_shard`` per decoder layer). A single process
without torchrun's environment is world size 1 and needs no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.trainer.distributed")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float = 300.0) -> DistInfo:
    """Join the process group torchrun described in the environment (RANK, WORLD_SIZE, MASTER_ADDR...)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1:
        return DistInfo(0, 1, 0, None)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    log.info("process group ready", rank=rank, world_size=world_size, backend=backend)
    return DistInfo(rank, world_size, local_rank, backend)


def shutdown_distributed(info: DistInfo, peer_wait_s: float = 10.0) -> None:
    """Leave the process group. Ranks first wait for each other (at most ``peer_wait_s``): gloo aborts a process
    (SIGABRT, "terminate called without an active exception") that tears its group down while a peer is still
    talking to it, as rank 0 gathering a full state dict can be. A peer that already exited only costs the wait."""
    if not (info.enabled and dist.is_initialized()):
        return
    try:
        if info.backend == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=peer_wait_s), wait_all_ranks=True)
        else:
            dist.barrier()
    except Exception as exc:  # a peer that stopped first or died: leaving is all that is left to do
        log.warning("ranks did not meet before leaving the process group", rank=info.rank, error=str(exc))
    dist.destroy_process_group()


FSDP2_SEVERAL_RANKS = (
    'model.parallel = "fsdp2" with {world_size} ranks: publishing, checkpointing and exporting sharded weights '
    'are not built yet; set model.parallel = "ddp" ([trainer.model] parallel = "ddp" under `primerl rl`, '
    "[model] under `primerl sft` and `primerl-trainer`), or leave it unset"
)
"""What a trainer or SFT run with several ranks and an explicit FSDP2 is told at start-up (``{world_size}``)."""


def resolve_parallel(parallel: str | None, world_size: int) -> str:
    """The ``model.parallel`` a run with ``world_size`` ranks uses: unset means ``ddp`` (the only layout whose
    weights are published, checkpointed and exported; with one rank the model is not wrapped at all). An explicit
    ``fsdp2`` with several ranks is a ``ValueError`` (``FSDP2_SEVERAL_RANKS``), raised before anything loads."""
    if parallel is None:
        return "ddp"
    if parallel == "fsdp2" and world_size > 1:
        raise ValueError(FSDP2_SEVERAL_RANKS.format(world_size=world_size))
    return parallel


def wrap_model(model: torch.nn.Module, parallel: str, info: DistInfo) -> torch.nn.Module:
    """DDP or FSDP2 around ``model`` when there are several ranks; the model itself otherwise."""
    if not info.enabled:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [info.local_rank] if torch.cuda.is_available() else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(f"parallel must be 'ddp' or 'fsdp2', got {parallel!r}")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (FSDP2 shards in place: the module is itself)."""
    return getattr(model, "module", model)


def replicated_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP, for what reads the whole model on one rank (checkpoints, weight export); a model with
    sharded (FSDP2 / DTensor) parameters is a ``ValueError``."""
    model = unwrap_model(model)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support has no sharded models either
        return model
    if any(isinstance(param, DTensor) for param in model.parameters()):
        raise ValueError(
            "the model has sharded (FSDP2 / DTensor) parameters; these checkpoints handle replicated models "
            "(one rank or DDP) only"
        )
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (through a peft wrapper if any)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def all_reduce_sum(value: float | int, info: DistInfo) -> float:
    """Sum of ``value`` over all ranks (the value itself with one rank)."""
    if not info.enabled:
        return float(value)
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor.item())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
