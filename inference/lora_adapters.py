"""The LoRA adapters an engine serves as its policy: each LORA update written to a directory of its own and added to
the engine under a new int id (an id reused with new files serves the old weights), the previous one removed, and
the last ``keep`` directories kept on disk for requests still in flight on them.

``LoraAdapters`` is `PolicyUpdater`'s collaborator (``primerl.inference.policy_updates``): it checks a LORA update
against the engine (``max_lora_rank``) and the model's weight manifest and refuses it with ``UpdateRefused``
(nothing changed), or serves it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.inference.update_checks import UpdateRefused, check_lora_tensors, refusal_from_frame_error
from primerl.proto.tensor_frames import TensorFrameError, check_tensor_frame
from primerl.proto.v1 import common_pb2, data_pb2

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from primerl.inference.engine_ops import EngineOps

__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "LoraAdapters"]

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


class LoraAdapters:
    """The served adapter (`request`; None: the base weights) and the directories of the last ``keep``."""

    def __init__(
        self, engine: EngineOps, directory: Path, *, max_lora_rank: int | None, policy_name: str, keep: int
    ) -> None:
        """``directory``: where adapter directories are written; ``max_lora_rank``: the engine's (None: started
        without LoRA, every LORA update is refused); ``policy_name``: the adapter's name when a header has none."""
        self.engine = engine
        self.directory = directory
        self.max_lora_rank = max_lora_rank
        self.policy_name = policy_name
        self.keep = keep
        self.request: LoRARequest | None = None
        self._next_id = 1
        self._dirs: list[Path] = []

    def apply(
        self,
        header: data_pb2.WeightUpdateHeader,
        payload: Any,
        manifest: Callable[[], dict[str, tuple[str, list[int]]]],
    ) -> None:
        """Serve the adapter of the LORA update ``header``/``payload``; ``manifest()``: the model's weights (name ->
        dtype, shape) the adapter must fit. `UpdateRefused` (nothing changed) when it does not."""
        from vllm.lora.request import LoRARequest

        what = f"LORA v{header.policy_version}"
        if self.max_lora_rank is None:
            raise UpdateRefused(
                common_pb2.ERROR_CODE_TENSOR_MISMATCH, f"{what}: the engine was started without LoRA (enable_lora)"
            )
        try:
            adapter_config = json.loads(header.adapter_config_json)
        except ValueError as exc:
            raise UpdateRefused(
                common_pb2.ERROR_CODE_MALFORMED_HEADER, f"{what}: adapter_config_json is not JSON ({exc})"
            ) from None
        if not isinstance(adapter_config, dict):
            raise UpdateRefused(common_pb2.ERROR_CODE_MALFORMED_HEADER, f"{what}: adapter_config_json is not an object")
        try:
            entries = check_tensor_frame(payload, header.tensors)
        except TensorFrameError as exc:
            raise refusal_from_frame_error(what, exc) from None
        check_lora_tensors(
            what, adapter_config, {n: list(e.shape) for n, e in entries.items()}, manifest(), self.max_lora_rank
        )

        lora_id = self._next_id
        adapter_dir = self._write(header.policy_version, lora_id, payload, header.adapter_config_json)
        request = LoRARequest(
            lora_name=header.policy_name or self.policy_name, lora_int_id=lora_id, lora_path=str(adapter_dir)
        )
        try:
            added = self.engine.add_lora(request)
        except Exception as exc:  # vLLM raises ValueError and others for an adapter it cannot load
            shutil.rmtree(adapter_dir, ignore_errors=True)
            raise UpdateRefused(
                common_pb2.ERROR_CODE_TENSOR_MISMATCH, f"{what}: the engine could not load the adapter: {exc}"
            ) from None
        if not added:
            shutil.rmtree(adapter_dir, ignore_errors=True)
            raise UpdateRefused(common_pb2.ERROR_CODE_INTERNAL, f"{what}: the engine did not add the adapter")
        self._next_id += 1
        previous, self.request = self.request, request
        if previous is not None:
            self.engine.remove_lora(previous.lora_int_id)
        self.engine.reset_prefix_cache()
        self._dirs.append(adapter_dir)
        while len(self._dirs) > self.keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)

    def forget(self) -> None:
        """Full weights replaced the served adapter (vLLM's reload already dropped it inside the worker): tell the
        engine too."""
        if self.request is not None:
            self.engine.remove_lora(self.request.lora_int_id)
            self.request = None

    def _write(self, policy_version: int, lora_id: int, payload: Any, adapter_config_json: str) -> Path:
        """Write the adapter to a new directory, atomically (a temporary name, renamed when complete)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"v{policy_version:08d}-id{lora_id}"
        tmp = self.directory / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.mkdir()
        (tmp / ADAPTER_WEIGHTS_FILE).write_bytes(memoryview(payload))
        (tmp / ADAPTER_CONFIG_FILE).write_text(adapter_config_json)
        tmp.rename(final)
        return final
