"""How a weight update is refused on the inference host, and the checks of an update that need no served state.

`UpdateRefused` carries a wire ``ErrorCode``; `primerl.inference.policy_updates.PolicyUpdater` raises it (its
docstring lists which check gives which code) and the daemon sends it back as an ``ErrorDetail``. The helpers here
turn the other failures into one: `refusal_from_frame_error` for a payload that does not match its header's tensor
specs, `refusal_from_worker_error` for a `WeightUpdateInvalid` raised in a vLLM worker (it arrives as text), and
`check_lora_tensors` checks an adapter's tensors against the model's weight manifest and the engine's
``max_lora_rank``.
"""

from __future__ import annotations

import re
from typing import Any

from primerl.inference.worker_extension import REFUSAL_PREFIX
from primerl.proto.tensor_frames import TensorFrameError
from primerl.proto.v1 import common_pb2

__all__ = [
    "UpdateRefused",
    "check_lora_tensors",
    "refusal_from_frame_error",
    "refusal_from_worker_error",
]

# In multiprocess mode vLLM re-raises a worker's exception as text: "... Worker failed with error '<message>',
# please check the stack trace above for the root cause".
_REFUSAL_RE = re.compile(
    re.escape(REFUSAL_PREFIX) + r"(ERROR_CODE_[A-Z_]+)\]\s*(.*?)(?:', please check .*)?$", re.DOTALL
)
_LORA_NAME_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class UpdateRefused(Exception):
    """A weight update that was not applied; the engine still serves the previous policy."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{common_pb2.ErrorCode.Name(code)}: {message}")
        self.code = code
        self.message = message

    def detail(self) -> common_pb2.ErrorDetail:
        return common_pb2.ErrorDetail(code=self.code, message=self.message)


def refusal_from_frame_error(what: str, exc: TensorFrameError) -> UpdateRefused:
    """The refusal of a payload that does not match its header's tensor specs: TRUNCATED, TENSOR_MISMATCH or
    MALFORMED_HEADER, as `exc` says."""
    code = (
        common_pb2.ERROR_CODE_TRUNCATED
        if exc.truncated
        else common_pb2.ERROR_CODE_TENSOR_MISMATCH
        if exc.mismatch
        else common_pb2.ERROR_CODE_MALFORMED_HEADER
    )
    return UpdateRefused(code, f"{what}: {exc}")


def refusal_from_worker_error(exc: BaseException) -> UpdateRefused | None:
    """The `UpdateRefused` a worker's `WeightUpdateInvalid` stands for (its message survives process
    boundaries as text), or None when `exc` is not one."""
    match = _REFUSAL_RE.search(str(exc))
    if match is None:
        return None
    code = (
        common_pb2.ErrorCode.Value(match[1])
        if match[1] in common_pb2.ErrorCode.keys()
        else common_pb2.ERROR_CODE_TENSOR_MISMATCH
    )
    return UpdateRefused(code, match[2].strip())


def check_lora_tensors(
    what: str,
    adapter_config: dict[str, Any],
    shapes: dict[str, list[int]],
    manifest: dict[str, tuple[str, list[int]]],
    max_lora_rank: int,
) -> None:
    """Every tensor is a lora_A/lora_B of a 2-D weight of the model (``manifest``: name -> (dtype, shape)), with
    matching shapes and a rank of at most `max_lora_rank`; else `UpdateRefused` (TENSOR_MISMATCH)."""
    ranks = [adapter_config.get("r", 0), *dict(adapter_config.get("rank_pattern") or {}).values()]
    if not shapes:
        raise UpdateRefused(common_pb2.ERROR_CODE_TENSOR_MISMATCH, f"{what}: the adapter holds no tensors")
    for name, shape in shapes.items():
        match = _LORA_NAME_RE.match(name)
        base_name = f"{match['module']}.weight" if match else None
        if base_name not in manifest:
            raise UpdateRefused(
                common_pb2.ERROR_CODE_TENSOR_MISMATCH,
                f"{what}: {name!r} is not the lora_A/lora_B weight of a layer of the model",
            )
        base_shape = manifest[base_name][1]
        if len(shape) != 2 or len(base_shape) != 2:
            raise UpdateRefused(
                common_pb2.ERROR_CODE_TENSOR_MISMATCH,
                f"{what}: {name!r} is {shape}; LoRA weights of 2-D layers are 2-D",
            )
        out_features, in_features = base_shape
        rank, expected = (
            (shape[0], [shape[0], in_features]) if match["ab"] == "A" else (shape[1], [out_features, shape[1]])
        )
        if shape != expected:
            raise UpdateRefused(
                common_pb2.ERROR_CODE_TENSOR_MISMATCH,
                f"{what}: {name!r} is {shape} but {base_name} {base_shape} needs {expected}",
            )
        ranks.append(rank)
    rank = max(int(r) for r in ranks)
    if rank > max_lora_rank:
        raise UpdateRefused(
            common_pb2.ERROR_CODE_TENSOR_MISMATCH,
            f"{what}: adapter rank {rank} exceeds the engine's max_lora_rank "
            f"{max_lora_rank}; restart the engine with a larger max_lora_rank",
        )
