"""How a weight update is refused on the inference host, and the checks of an update that need no engine.

`UpdateRefused` carries a wire ``ErrorCode``; `primerl.inference.policy_updates.PolicyUpdater` raises it (its
docstring lists which check gives which code) and the daemon sends it back as an ``ErrorDetail``. The helpers here
turn the other failures into one: `refusal_from_frame_error` for a payload that does not match its header's tensor
specs, `refusal_from_worker_error` for a `WeightUpdateInvalid` raised in a vLLM worker (it arrives as text), and
`check_lora_tensors` checks an adapter's tensors against the model's weight manifest and the engine's
``max_lora_rank``; `check_payload` a payload against its header, and `order_refusal` (a pure law) an update's
version and lineage against what is served.
"""

from __future__ import annotations

import hmac
import re
from typing import Any

from primerl.inference.weight_tensors import REFUSAL_PREFIX
from primerl.proto.digests import hasher_for
from primerl.proto.tensor_frames import TensorFrameError
from primerl.proto.v1 import common_pb2, data_pb2

__all__ = [
    "UpdateRefused",
    "check_lora_tensors",
    "check_payload",
    "order_refusal",
    "refusal_from_frame_error",
    "refusal_from_worker_error",
]

# In multiprocess mode vLLM re-raises a worker's exception as text: "... Worker failed with error '<message>',
# please check the stack trace above for the root cause".
_REFUSAL_RE = re.compile(
    re.escape(REFUSAL_PREFIX) + r"(ERROR_CODE_[A-Z_]+)\]\s*(.*?)(?:', please check .*)?$", re.DOTALL
)
FULL, LORA, DELTA = (
    data_pb2.WEIGHT_UPDATE_KIND_FULL,
    data_pb2.WEIGHT_UPDATE_KIND_LORA,
    data_pb2.WEIGHT_UPDATE_KIND_DELTA,
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


def check_payload(
    header: data_pb2.WeightUpdateHeader, payload: Any, payload_digest: str | None, *, verify_digest: bool
) -> None:
    """The header's kind, the payload's size and (``verify_digest``) its digest: else `UpdateRefused`
    (MALFORMED_HEADER, TRUNCATED, BAD_DIGEST). ``payload_digest``: as the payload's receiver computed it; None:
    computed here."""
    if header.kind not in (FULL, LORA, DELTA):
        raise UpdateRefused(
            common_pb2.ERROR_CODE_MALFORMED_HEADER, f"weight update kind {header.kind} is not FULL, LORA or DELTA"
        )
    size = memoryview(payload).nbytes
    if header.payload_bytes and header.payload_bytes != size:
        raise UpdateRefused(
            common_pb2.ERROR_CODE_TRUNCATED,
            f"the payload has {size} bytes but the header says {header.payload_bytes}",
        )
    if verify_digest:
        if payload_digest is None:
            hasher = hasher_for(header.digest)
            hasher.update(memoryview(payload))
            payload_digest = hasher.hexdigest()
        if not hmac.compare_digest(payload_digest.lower(), header.digest.lower()):
            raise UpdateRefused(
                common_pb2.ERROR_CODE_BAD_DIGEST,
                f"payload digest is {payload_digest} but the header says {header.digest or '(none)'}",
            )


def order_refusal(
    header: data_pb2.WeightUpdateHeader, *, served_version: int, served_lineage: int, adapter_served: bool
) -> str | None:
    """Why ``header`` is out of order for what is served (OUT_OF_ORDER), or None. The law: an older lineage's update
    never applies; a DELTA applies only on the served version, of the same lineage, with no adapter served; a FULL
    or LORA applies when newer than the served version or of a newer lineage (a rollback)."""
    version, served, lineage = header.policy_version, served_version, header.lineage
    name = data_pb2.WeightUpdateKind.Name(header.kind)
    if lineage and served_lineage and lineage < served_lineage:
        return (
            f"{name} v{version} is of lineage {lineage}, older than the served v{served}'s lineage "
            f"{served_lineage}: a replaced trainer's update"
        )
    if header.kind == DELTA:
        if adapter_served:
            return f"DELTA v{version} needs full weights but a LoRA adapter (v{served}) is served; send a FULL update"
        if lineage != served_lineage and lineage and served_lineage:
            return (
                f"DELTA v{version} is of lineage {lineage} but v{served} of lineage {served_lineage} is "
                "served; a new lineage starts with a FULL update"
            )
        if header.base_version != served:
            return f"DELTA v{version} applies to v{header.base_version} but v{served} is served"
        if version <= header.base_version:
            return f"DELTA v{version} is not newer than its base v{header.base_version}"
        return None
    if version <= served and not lineage > served_lineage:
        return f"{name} v{version} is not newer than the served v{served}"
    return None
