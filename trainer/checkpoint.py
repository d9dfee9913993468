"""Trainer checkpoints: model, optimizer, scheduler, RNG and progress, written atomically (prime-rl layout).

A checkpoint is `{root}/step_{N}/`; it exists only once its `STABLE` marker does (`primerl.trainer.committed_dir`:
everything is written into `step_{N}.tmp-<pid>` next to it, each file fsynced, `STABLE` written and fsynced last,
the directory fsynced, renamed to `step_{N}` and the parent fsynced). A process killed at any point leaves the
previous checkpoints as they were plus a temp directory that the next save or load (rank 0) removes.

Layout of `step_{N}/` (replicated model: single rank or DDP; rank 0 writes the shared files):

    model.safetensors        full state dict, or only the trainable (adapter) parameters of a peft model
    optimizer.pt             optimizer.state_dict() (tensors and plain values; loaded with weights_only=True)
    scheduler.pt             scheduler.state_dict()
    extra_state.json         the caller's `extra_state` (step, policy_version, data positions...)
    meta.json                format version, step, world size, model kind, peft base model
    rank{r}_rng.safetensors  RNG states of rank r: python `random`, numpy, torch CPU and the current CUDA device
    STABLE                   written last

The Hugging Face weights exported beside each checkpoint are `primerl.trainer.weights_export`'s.

A full disk (ENOSPC, EDQUOT, however the writer reports it) fails the save with `CheckpointDiskFull`, which names the
directory and the checkpoint kept: the partial `step_{N}.tmp-*` is removed (single rank; with more ranks the next
save or load removes it), the previous checkpoints stay as they were, and the caller commits nothing for the step.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from primerl.proto import telemetry
from primerl.runtime.durable_files import fsync_dir
from primerl.runtime.log_setup import get_logger
from primerl.trainer.committed_dir import (
    STABLE_FILE,
    commit_dir,
    fsync_file,
    remove_leftovers,
    temp_dir_of,
    write_new_file,
)
from primerl.trainer.distributed import replicated_model
from primerl.trainer.model import is_peft_model

log = get_logger("primerl.trainer.checkpoint")

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
EXTRA_STATE_FILE = "extra_state.json"
META_FILE = "meta.json"

_STEP_DIR = re.compile(r"^step_(\d+)$")

MODEL_KIND_FULL = "full"
MODEL_KIND_PEFT = "peft_trainable"


class CheckpointNotFoundError(FileNotFoundError):
    """No committed (STABLE) checkpoint of the requested step."""


class CheckpointDiskFull(OSError):
    """A checkpoint could not be written for lack of space; the previous checkpoints are kept."""


_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "(os error 28)", "(os error 122)")


def is_disk_full_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a filesystem out of space or quota. torch.save reports it
    as a RuntimeError raised while handling the OSError; safetensors as a SafetensorError naming the OS error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(current) for text in _DISK_FULL_TEXT):
            return True
        current = current.__cause__ or current.__context__
    return False


def _disk_full(root: Path, step: int, exc: BaseException) -> CheckpointDiskFull:
    kept = latest_checkpoint(root)
    return CheckpointDiskFull(
        errno.ENOSPC,
        f"cannot write the checkpoint of step {step} under {root}: no space left on the device ({exc}). "
        + (f"The previous checkpoint step_{kept} is kept" if kept is not None else "No earlier checkpoint exists")
        + f" and step {step} is not committed to the broker; free space on that filesystem (or lower ckpt.keep_last, "
        "or point the checkpoint directory at a larger disk) and restart the trainer: it resumes from "
        + (f"step_{kept}" if kept is not None else "the start"),
    )


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """`{root}/step_{step}`: where the checkpoint of `step` lives once committed."""
    return Path(root) / f"step_{step}"


def rng_file(rank: int) -> str:
    return f"rank{rank}_rng.safetensors"


# ---------------------------------------------------------------------------------------------------- listing


def list_checkpoints(root: str | os.PathLike[str]) -> list[int]:
    """Steps of the committed checkpoints under `root` (those with a `STABLE` marker), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / STABLE_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(root: str | os.PathLike[str]) -> int | None:
    """Step of the newest committed checkpoint under `root`, or None."""
    steps = list_checkpoints(root)
    return steps[-1] if steps else None


def clean_leftovers(root: str | os.PathLike[str]) -> list[str]:
    """Remove temp and trash directories left by an interrupted save or prune; returns their names."""
    removed = remove_leftovers(Path(root), r"step_\d+")
    if removed:
        log.info("removed leftovers of interrupted checkpoint writes", root=str(root), dirs=removed)
    return removed


# ---------------------------------------------------------------------------------------------------- save


def save_checkpoint(
    directory_root: str | os.PathLike[str],
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    extra_state: dict[str, Any],
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Write the checkpoint of `step` to `{directory_root}/step_{step}` atomically and return that path.

    Every rank calls this with the same `step`; with `world_size > 1`, `barrier` (e.g.
    `torch.distributed.barrier`) is required. The model must be replicated (single rank or DDP): rank 0 writes
    model, optimizer, scheduler and `extra_state`, every rank its RNG state. When this returns on any rank the
    checkpoint is committed. An existing `step_{step}` is replaced.
    """
    _check_rank(rank, world_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if world_size > 1 and barrier is None:
        raise ValueError("save_checkpoint with world_size > 1 needs barrier= (e.g. torch.distributed.barrier)")
    sync = barrier or (lambda: None)
    root = Path(directory_root)
    final_dir = step_dir(root, step)
    model = replicated_model(model)

    extra_json = ""
    if rank == 0:
        # Serialise the small parts first: a non-JSON extra_state fails before anything is written.
        extra_json = json.dumps(extra_state, indent=2, sort_keys=True, allow_nan=True)
        root.mkdir(parents=True, exist_ok=True)
        clean_leftovers(root)
        tmp_dir = temp_dir_of(final_dir)
        tmp_dir.mkdir()
    sync()
    if rank != 0:
        candidates = sorted(root.glob(f"{final_dir.name}.tmp-*"))
        if len(candidates) != 1:
            raise RuntimeError(
                f"rank {rank} expected exactly one temp dir {final_dir.name}.tmp-* from rank 0 under {root}, "
                f"found {[p.name for p in candidates]}"
            )
        tmp_dir = candidates[0]

    try:
        _write_rank_files(tmp_dir, step, model, optimizer, scheduler, extra_json, rank, world_size)
    except BaseException as exc:
        if world_size == 1:  # with more ranks, others may still be writing: the next save or load cleans up
            shutil.rmtree(tmp_dir, ignore_errors=True)
        if is_disk_full_error(exc):
            raise _disk_full(root, step, exc) from exc
        raise
    sync()

    if rank == 0:
        try:
            write_new_file(tmp_dir / STABLE_FILE, b"")
            commit_dir(tmp_dir, final_dir)
        except OSError as exc:
            if not is_disk_full_error(exc):
                raise
            if not (final_dir / STABLE_FILE).is_file():
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise _disk_full(root, step, exc) from exc
        log.info(telemetry.CHECKPOINT_SAVED, step=step, path=str(final_dir))
    sync()
    return final_dir


def _write_rank_files(
    tmp_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    extra_json: str,
    rank: int,
    world_size: int,
) -> None:
    """This rank's files of the checkpoint of ``step`` into ``tmp_dir``: its RNG state, and on rank 0 the rest."""
    if rank == 0:
        tensors, metadata = _model_state(model)
        _write_safetensors(tmp_dir / MODEL_FILE, tensors, metadata)
        del tensors
        if optimizer is not None:
            _write_torch(tmp_dir / OPTIMIZER_FILE, optimizer.state_dict())
        if scheduler is not None:
            _write_torch(tmp_dir / SCHEDULER_FILE, scheduler.state_dict())
        write_new_file(tmp_dir / EXTRA_STATE_FILE, extra_json.encode())
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "model_kind": metadata["model_kind"],
            "peft_base_model": metadata.get("peft_base_model"),
            "has_optimizer": optimizer is not None,
            "has_scheduler": scheduler is not None,
        }
        write_new_file(tmp_dir / META_FILE, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    rng_tensors, rng_metadata = _rng_state()
    _write_safetensors(tmp_dir / rng_file(rank), rng_tensors, rng_metadata)


# ---------------------------------------------------------------------------------------------------- load


def load_checkpoint(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    rank: int = 0,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG states from the checkpoint of `step` (default:
    the newest) and return its `extra_state`.

    `model`, `optimizer` and `scheduler` must be built as for the run that saved it; a None optimizer or
    scheduler is left out. Raises CheckpointNotFoundError, listing the available steps, when there is none.
    """
    root = Path(root)
    if rank == 0:
        clean_leftovers(root)
    available = list_checkpoints(root)
    if step is None:
        if not available:
            raise CheckpointNotFoundError(f"no checkpoint (step_N/ with a {STABLE_FILE} marker) under {root}")
        step = available[-1]
    elif step not in available:
        raise CheckpointNotFoundError(
            f"no checkpoint of step {step} under {root}; available steps: {available or 'none'}"
        )
    ckpt_dir = step_dir(root, step)
    meta = json.loads((ckpt_dir / META_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{ckpt_dir} has checkpoint format {meta.get('format_version')}, this trainer reads {FORMAT_VERSION}"
        )

    _load_model_state(replicated_model(model), ckpt_dir / MODEL_FILE)
    if optimizer is not None:
        if not meta["has_optimizer"]:
            raise ValueError(f"{ckpt_dir} holds no optimizer state; pass optimizer=None to load without one")
        optimizer.load_state_dict(_read_torch(ckpt_dir / OPTIMIZER_FILE))
    if scheduler is not None:
        if not meta["has_scheduler"]:
            raise ValueError(f"{ckpt_dir} holds no scheduler state; pass scheduler=None to load without one")
        scheduler.load_state_dict(_read_torch(ckpt_dir / SCHEDULER_FILE))

    rng_path = ckpt_dir / rng_file(rank)
    if rng_path.is_file():
        _set_rng_state(rng_path)
    else:
        log.warning(
            "checkpoint has no RNG state for this rank; random streams are not restored and the run will not "
            "repeat the uninterrupted one exactly",
            step=step,
            rank=rank,
            saved_world_size=meta["world_size"],
        )
    log.info("checkpoint loaded", step=step, path=str(ckpt_dir))
    return json.loads((ckpt_dir / EXTRA_STATE_FILE).read_text())


# ---------------------------------------------------------------------------------------------------- retention


def steps_to_prune(steps: list[int], *, keep_last: int | None, keep_interval: int | None) -> list[int]:
    """The steps retention deletes: all but the newest `keep_last` (None: keep all) and the multiples of
    `keep_interval`; never the newest."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_interval is not None and keep_interval < 1:
        raise ValueError(f"keep_interval must be >= 1 or None, got {keep_interval}")
    if keep_last is None or not steps:
        return []
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:])
    if keep_interval is not None:
        keep.update(step for step in ordered if step % keep_interval == 0)
    return [step for step in ordered if step not in keep]


def prune_checkpoints(root: str | os.PathLike[str], *, keep_last: int | None, keep_interval: int | None) -> list[int]:
    """Delete committed checkpoints per `steps_to_prune` (call it on rank 0 only, after a save); returns the
    deleted steps.

    Each one is first renamed to `step_N.trash-<pid>` (atomic, so a kill never leaves a half-deleted
    `step_N`), then removed.
    """
    root = Path(root)
    deleted = []
    for step in steps_to_prune(list_checkpoints(root), keep_last=keep_last, keep_interval=keep_interval):
        path = step_dir(root, step)
        trash = root / f"{path.name}.trash-{os.getpid()}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:  # another trainer of the run (one it superseded, say) pruned it first
            continue
        fsync_dir(root)
        shutil.rmtree(trash)
        deleted.append(step)
    if deleted:
        log.info("pruned checkpoints", root=str(root), steps=deleted)
    return deleted


# ---------------------------------------------------------------------------------------------------- model state


def _model_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to save (CPU, tied duplicates stored once) and safetensors metadata describing them."""
    metadata = {"format": "pt"}
    if is_peft_model(model):
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        source = {name: t for name, t in model.state_dict().items() if name in trainable}
        metadata["model_kind"] = MODEL_KIND_PEFT
        configs = getattr(model, "peft_config", {})
        bases = {str(cfg.base_model_name_or_path) for cfg in configs.values()}
        metadata["peft_base_model"] = ",".join(sorted(bases))
    else:
        source = model.state_dict()
        metadata["model_kind"] = MODEL_KIND_FULL
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in source.items():
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().to("cpu").contiguous()
    metadata["aliases"] = json.dumps(aliases, sort_keys=True)
    return tensors, metadata


def _load_model_state(model: torch.nn.Module, path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    state = load_file(str(path))
    for alias, name in json.loads(metadata.get("aliases", "{}")).items():
        state[alias] = state[name]
    kind = metadata.get("model_kind")
    expected = MODEL_KIND_PEFT if is_peft_model(model) else MODEL_KIND_FULL
    if kind != expected:
        raise ValueError(f"{path} holds a {kind!r} model state but the model to load into is {expected!r}")
    if kind == MODEL_KIND_FULL:
        model.load_state_dict(state, strict=True)
        return
    saved_base = metadata.get("peft_base_model", "")
    base = ",".join(sorted({str(cfg.base_model_name_or_path) for cfg in model.peft_config.values()}))
    if saved_base != base:
        log.warning("checkpoint adapter was trained on another base model", saved=saved_base, current=base)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    unexpected = sorted(set(state) - set(model.state_dict()))
    missing = sorted(trainable - set(state))
    if unexpected or missing:
        raise ValueError(
            f"{path} does not match the model's trainable parameters: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} (is the LoRA config the same as in the run that saved it?)"
        )
    model.load_state_dict(state, strict=False)


# ---------------------------------------------------------------------------------------------------- RNG


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    version, mt_state, gauss_next = random.getstate()
    tensors = {"torch_cpu": torch.random.get_rng_state(), "python_mt": torch.tensor(mt_state, dtype=torch.int64)}
    info: dict[str, Any] = {"python_version": version, "python_gauss_next": gauss_next}
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    info["numpy"] = {
        "bit_generator": bit_generator,
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)
        info["cuda_device"] = device
    return tensors, {"format": "pt", "rng": json.dumps(info)}


def _set_rng_state(path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        info = json.loads((handle.metadata() or {})["rng"])
    tensors = load_file(str(path))
    random.setstate(
        (info["python_version"], tuple(int(v) for v in tensors["python_mt"].tolist()), info["python_gauss_next"])
    )
    torch.random.set_rng_state(tensors["torch_cpu"])
    if "numpy" in info:
        numpy_info = info["numpy"]
        np.random.set_state(
            (
                numpy_info["bit_generator"],
                tensors["numpy_keys"].numpy().astype(np.uint32),
                numpy_info["pos"],
                numpy_info["has_gauss"],
                numpy_info["cached_gaussian"],
            )
        )
    if "torch_cuda" in tensors:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["torch_cuda"], torch.cuda.current_device())
        else:
            log.warning("checkpoint has a CUDA RNG state but CUDA is not available; it is not restored")


# ---------------------------------------------------------------------------------------------------- files


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def _write_torch(path: Path, obj: Any) -> None:
    with open(path, "xb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _read_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    fsync_file(path)
