"""Build each weight update from the model (into ``PayloadPlaces``), and keep the base of the next delta.

What goes on the wire (``WeightUpdateHeader`` + one safetensors payload):

- FULL: every tensor as ``save_pretrained`` writes ``model.safetensors`` (``primerl.trainer.hf_state_dict``: Hugging
  Face names, tied weights once, a LoRA-trained model merged), cast to the serving dtype when one is set; the bytes
  equal the file the trainer exports (``primerl.trainer.weights_export``), so a receiver may write them as is.
- LORA: the adapter as peft's ``save_pretrained`` writes ``adapter_model.safetensors``, in its training dtype, with
  ``adapter_config_json`` as it writes ``adapter_config.json``.
- DELTA: ``encode_delta`` (bit-exact, ``primerl.proto.weight_delta``) of the FULL tensors against the last version
  stored (a host copy). The first update of a run, the one after the broker asks for ``full_required`` or
  refuses a delta, and the one after a failed send are FULL. ``delta_encoding="auto"``: SPARSE when most bytes
  are 16-bit floats, XOR_ZLIB otherwise. ``delta_policy="auto"``: a delta is sent as FULL when it would not pay
  (``fallback`` says why): ``estimate_delta`` times encoding and decoding a slice of every tensor, and the delta
  pays when that time is less than its saved bytes take on the wire's ``WIRE_HOPS`` hops, at the publisher's last
  measured rate (``DEFAULT_WIRE_BYTES_PER_S`` until one was measured). A delta built larger than
  ``BUILT_DELTA_MAX_FRACTION`` of FULL goes as FULL too. ``delta_policy="always"`` skips both checks.

FULL payloads are written into pooled buffers (``payload_writer``), or straight into a shared-memory segment on the
same-host road; a buffer goes back to the pool once the broker acknowledged the update. The content digest
(XXH3-128, ``primerl.proto.digests``) is computed once, here, over the finished payload. A streamed FULL is the
exception: ``build`` only lays out its header and starts ``payload_stream.PayloadStream`` writing the tensors, and
the digest, computed in the pass of each chunk's checksum, follows in the last chunk (``Chunk.payload_digest``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from primerl.proto.digests import new_hasher, payload_digest
from primerl.proto.tensor_frames import encode_tensors, parse_header, specs_of
from primerl.proto.units import MiB
from primerl.proto.v1 import data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.trainer.hf_state_dict import SAFETENSORS_METADATA, hf_state_dict, lora_adapter_config_json, lora_state_dict
from primerl.trainer.payload_writer import payload_tensors, safetensors_layout, write_safetensors
from primerl.trainer.prepared_update import PayloadMemory, PayloadPlaces, PreparedUpdate, PublishKind

if TYPE_CHECKING:
    import torch

    LostBase = tuple[dict[str, torch.Tensor] | None, bytearray | None]  # a base `lose_base` forgot, and its buffer

__all__ = ["UpdateBuilder", "serving_dtype"]

log = get_logger(__name__)

DeltaPolicy = Literal["auto", "always"]
DeltaEncodingChoice = Literal["auto", "sparse", "xor_zlib"]
_ENCODING_OF_CHOICE = {"sparse": data_pb2.DELTA_ENCODING_SPARSE, "xor_zlib": data_pb2.DELTA_ENCODING_XOR_ZLIB}
DEFAULT_WIRE_BYTES_PER_S = 1e9
"""Assumed publish rate (bytes/s from send to the broker's ack) until one was measured."""
WIRE_HOPS = 2
"""Times a saved byte is not moved: trainer -> broker, broker -> each worker (in parallel)."""
BUILT_DELTA_MAX_FRACTION = 0.9
"""A delta that turns out larger than this fraction of FULL once built (changes the estimate's samples missed) goes
as FULL: its encode is spent, but saving < 10 % of the bytes on two hops is worth less than decoding it on every
worker (SPARSE decodes at ~1-2 GB/s of FULL bytes here, about the speed of one hop)."""
_KIND_TO_WIRE = {
    "full": data_pb2.WEIGHT_UPDATE_KIND_FULL,
    "lora": data_pb2.WEIGHT_UPDATE_KIND_LORA,
    "delta": data_pb2.WEIGHT_UPDATE_KIND_DELTA,
}
SERVING_DTYPES = ("bfloat16", "float16", "float32")


def serving_dtype(name: str) -> torch.dtype | None:
    """``WeightBroadcastConfig.dtype`` as the publisher's ``serving_dtype`` ("auto": None, the model's own)."""
    import torch

    if name == "auto":
        return None
    if name not in SERVING_DTYPES:
        raise ValueError(f"weight_broadcast.dtype must be auto, {', '.join(SERVING_DTYPES)}; got {name!r}")
    return getattr(torch, name)


def _host_copy(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None, reuse: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies (gathered when sharded), cast to ``dtype`` when given: a snapshot the next
    optimizer step cannot change. Tensors of ``reuse`` (a snapshot nothing reads any more) with the same dtype
    and shape are written in place (no fresh memory)."""
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2): every rank must build
            tensor = tensor.full_tensor()
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        spare = None if reuse is None else reuse.get(name)
        if spare is not None and spare.dtype == cast and spare.shape == tensor.shape and spare.is_contiguous():
            out[name] = spare.copy_(tensor)
        else:
            out[name] = tensor.to(device="cpu", dtype=cast, copy=True).contiguous()
    return out


def _full_layout(
    tensors: dict[str, torch.Tensor], cast: torch.dtype | None
) -> tuple[bytes, list[tuple[str, int, int]], int]:
    """(prefix, spans, total bytes) of a FULL payload of ``tensors``, floating ones cast to ``cast`` when set."""
    import torch

    shapes = tensors
    if cast is not None:
        shapes = {
            name: torch.empty(t.shape, dtype=cast if t.is_floating_point() else t.dtype, device="meta")
            for name, t in tensors.items()
        }
    prefix, spans = safetensors_layout(shapes, SAFETENSORS_METADATA)
    return prefix, spans, spans[-1][2] if spans else len(prefix)


@dataclass(eq=False, repr=False)
class UpdateBuilder:
    """Builds the updates of one publisher (module docstring) into ``places``, and keeps the delta base (the host
    copy of the last version stored) in step with what the broker holds (`lose_base`, `stored`). Fields as
    ``PolicyPublisher``'s arguments."""

    kind: PublishKind
    policy_name: str
    lineage: int
    chunk_bytes: int
    serving_dtype: torch.dtype | None
    delta_level: int
    delta_policy: DeltaPolicy
    delta_encoding: DeltaEncodingChoice
    stream: bool | None
    places: PayloadPlaces
    # The version this incarnation resumed from: its first published version - 1 (set by the first build).
    lineage_base_version: int | None = field(default=None, init=False)
    _spare_snapshot: dict[str, torch.Tensor] | None = field(default=None, init=False)
    # Base of the next delta: the host copy of the last version the broker stored, its version, and the pooled
    # payload buffer it views, if any.
    _base: dict[str, torch.Tensor] | None = field(default=None, init=False)
    _base_version: int | None = field(default=None, init=False)
    _base_buffer: bytearray | None = field(default=None, init=False)
    _full_required: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.kind not in _KIND_TO_WIRE:
            raise ValueError(f'kind must be "full", "lora" or "delta", got {self.kind!r}')
        if self.delta_policy not in ("auto", "always"):
            raise ValueError(f'delta_policy must be "auto" or "always", got {self.delta_policy!r}')
        if self.delta_encoding not in ("auto", *_ENCODING_OF_CHOICE):
            raise ValueError(f'delta_encoding must be "auto", "sparse" or "xor_zlib", got {self.delta_encoding!r}')
        if not self.policy_name:
            raise ValueError("policy_name must not be empty")
        if self.lineage <= 0:
            raise ValueError(f"lineage must be > 0, got {self.lineage}")

    @property
    def base_version(self) -> int | None:
        """The version the next delta would apply to (None: the next update is FULL)."""
        return None if self._base is None or self._full_required else self._base_version

    def why_full(self) -> str | None:
        """Why the next update cannot be a delta (None: it can)."""
        if self.base_version is not None:
            return None
        return "full required by the broker" if self._full_required else "no base version yet"

    def build(
        self, model: torch.nn.Module, version: int, *, kind: PublishKind | None = None, wire_bytes_per_s: float | None
    ) -> PreparedUpdate:
        """Read the model and encode one update of ``kind`` (default: this publisher's kind; "delta" needs a
        base, and may come back as FULL when it would not pay at ``wire_bytes_per_s``, with ``fallback`` set)."""
        kind = kind or self.kind
        start_s = time.perf_counter()
        if kind == "lora":
            tensors = lora_state_dict(model)
            payload, specs = encode_tensors(tensors, metadata=SAFETENSORS_METADATA)
            header = self._header(version, kind, payload, specs)
            header.adapter_config_json = lora_adapter_config_json(model)
            return PreparedUpdate(kind, header, payload, _elapsed_ms(start_s))
        state = hf_state_dict(model)
        phases = {"read": _elapsed_ms(start_s)}
        sharded = any(hasattr(t, "full_tensor") for t in state.values())
        on_device = any(t.device.type == "cuda" for t in state.values())
        wanted = on_device if self.stream is None else self.stream
        if wanted and kind == "full" and self.kind == "full" and not sharded:
            streamed = self._stream_full(version, state, phases, start_s)
            if streamed is not None:
                return streamed
        if sharded or (kind != "full" and self.serving_dtype is not None):
            # Gathered / cast host copies first (the general path).
            mark = time.perf_counter()
            snapshot = _host_copy(state, self.serving_dtype, reuse=self._take_spare())
            phases["snapshot"] = _elapsed_ms(mark)
            return self._build_delta_or_full(kind, version, snapshot, phases, start_s, wire_bytes_per_s, True)
        # The parameters themselves are read: encoding copies them into the payload (FULL, cast in that one copy
        # when a serving dtype is set) or the delta base.
        live = {k: v.detach() for k, v in state.items()}
        return self._build_delta_or_full(kind, version, live, phases, start_s, wire_bytes_per_s, False)

    def full_of(self, prepared: PreparedUpdate) -> PreparedUpdate:
        """The FULL update of a delta the broker refused, from the snapshot it encodes."""
        assert prepared.snapshot is not None
        return self._build_from_snapshot("full", prepared.policy_version, prepared.snapshot, prepared.build_ms)

    def _build_delta_or_full(
        self,
        kind: PublishKind,
        version: int,
        tensors: dict[str, torch.Tensor],
        phases: dict[str, float],
        start_s: float,
        wire_bytes_per_s: float | None,
        snapshot_is_copy: bool,
    ) -> PreparedUpdate:
        fallback = None
        encoding = self._encoding_for(tensors)
        if kind == "delta" and self.delta_policy == "auto":
            mark = time.perf_counter()
            fallback = self._delta_would_not_pay(tensors, encoding, wire_bytes_per_s or DEFAULT_WIRE_BYTES_PER_S)
            phases["estimate"] = _elapsed_ms(mark)
            if fallback is not None:
                kind = "full"
                log.info("sending FULL: the delta would not pay", policy_version=version, reason=fallback)
        if kind == "delta":
            snapshot = tensors
            if not snapshot_is_copy:
                mark = time.perf_counter()
                snapshot = _host_copy(tensors, None, reuse=self._take_spare())
                phases["snapshot"] = _elapsed_ms(mark)
            prepared = self._build_from_snapshot(
                "delta", version, snapshot, 0.0, start_s=start_s, phases=phases, encoding=encoding
            )
            full_bytes = sum(t.numel() * t.element_size() for t in snapshot.values())
            fraction = prepared.header.payload_bytes / max(1, full_bytes)
            if self.delta_policy == "auto" and fraction > BUILT_DELTA_MAX_FRACTION:
                fallback = (
                    f"delta built is {fraction:.2f} of FULL ({prepared.header.payload_bytes / MiB:.1f} of "
                    f"{full_bytes / MiB:.1f} MiB; the estimate missed changes)"
                )
                log.info("sending FULL: the delta would not pay", policy_version=version, reason=fallback)
                phases["encode_delta"] = phases.pop("encode")
                prepared = self._build_from_snapshot("full", version, snapshot, prepared.build_ms, phases=phases)
        else:
            prepared = self._encode_full(version, tensors, phases, start_s)
            if self.kind == "delta":
                # The payload's own tensor bytes are the next delta's base: no separate host copy.
                prepared = replace(prepared, snapshot=payload_tensors(prepared.payload), owns_snapshot=True)
        return replace(prepared, fallback=fallback)

    def _take_spare(self) -> dict[str, torch.Tensor] | None:
        spare, self._spare_snapshot = self._spare_snapshot, None
        return spare

    def _encoding_for(self, tensors: dict[str, torch.Tensor]) -> int:
        """The ``DeltaEncoding`` of a delta of ``tensors`` (``delta_encoding``; module docstring)."""
        if self.delta_encoding != "auto":
            return _ENCODING_OF_CHOICE[self.delta_encoding]
        total = sixteen_bit = 0
        for tensor in tensors.values():
            size = tensor.numel() * tensor.element_size()
            total += size
            sixteen_bit += size if tensor.is_floating_point() and tensor.element_size() == 2 else 0
        return data_pb2.DELTA_ENCODING_SPARSE if 2 * sixteen_bit > total else data_pb2.DELTA_ENCODING_XOR_ZLIB

    def _delta_would_not_pay(self, tensors: dict[str, torch.Tensor], encoding: int, rate: float) -> str | None:
        """None when a delta against the base pays at ``rate`` bytes/s (module docstring), else why not."""
        from primerl.proto.weight_delta import estimate_delta

        assert self._base is not None
        estimate = estimate_delta(tensors, self._base, encoding=encoding, level=self.delta_level)
        saved_s = WIRE_HOPS * max(0, estimate.full_bytes - estimate.delta_bytes) / rate
        cost_s = estimate.encode_s + estimate.decode_s
        if cost_s < saved_s:
            return None
        name = data_pb2.DeltaEncoding.Name(encoding).removeprefix("DELTA_ENCODING_")
        return (
            f"delta would not pay: {name} ~{estimate.delta_bytes / MiB:.1f} of {estimate.full_bytes / MiB:.1f} MiB "
            f"({estimate.changed_bytes / max(1, estimate.full_bytes):.0%} of the bytes changed), encode + decode "
            f"~{cost_s * 1000:.0f} ms vs ~{saved_s * 1000:.0f} ms saved on the wire at {rate / MiB:.0f} MiB/s"
        )

    def _stream_full(
        self, version: int, state: dict[str, torch.Tensor], phases: dict[str, float], start_s: float
    ) -> PreparedUpdate | None:
        """A FULL update whose payload is written (cast, copied from the device) while ``send`` sends its first
        chunks (``payload_stream``); None when it fits in one chunk (nothing to overlap: built as usual)."""
        from primerl.trainer.payload_stream import PayloadStream

        mark = time.perf_counter()
        live = {name: tensor.detach() for name, tensor in state.items()}
        prefix, spans, total = _full_layout(live, self.serving_dtype)
        if total <= self.chunk_bytes:
            return None
        buffer = self.places.buffer(total, pinned=any(t.device.type == "cuda" for t in live.values()))
        try:
            stream = PayloadStream(live, self.serving_dtype, buffer, prefix, spans)
            specs = specs_of(parse_header(prefix, total_bytes=total))
            header = self._header(version, "full", None, specs, payload_bytes=total)
        except BaseException:
            self.places.give_back_buffer(buffer)
            raise
        phases["layout"] = _elapsed_ms(mark)
        return PreparedUpdate(
            "full", header, stream.view, _elapsed_ms(start_s), None, PayloadMemory(buffer), phases, stream=stream
        )

    def _encode_full(
        self, version: int, tensors: dict[str, torch.Tensor], phases: dict[str, float], start_s: float
    ) -> PreparedUpdate:
        """A FULL payload written into a pooled buffer, and its header (digest computed once, here)."""
        mark = time.perf_counter()
        cast = self.serving_dtype
        if cast is not None and not any(t.is_floating_point() and t.dtype != cast for t in tensors.values()):
            cast = None
        prefix, spans, total = _full_layout(tensors, cast)
        # The same-host road: written straight into a shared segment, the one write of the payload on this host
        # (not for a delta publisher: its next base views the payload's buffer).
        segment = self.places.segment(total) if self.kind != "delta" else None
        buffer = self.places.buffer(total) if segment is None else None
        try:
            destination = segment.view(total) if segment else buffer
            hasher = new_hasher()  # each tensor hashed right after its copy: no second pass over the payload
            payload = write_safetensors(tensors, destination, prefix, spans, dtype=cast, hasher=hasher)
            phases["encode"] = _elapsed_ms(mark)
            mark = time.perf_counter()
            specs = specs_of(parse_header(payload))
            header = self._header(version, "full", None, specs, payload_bytes=total)
            header.digest = hasher.hexdigest()
            phases["digest"] = _elapsed_ms(mark)
        except BaseException:
            self.places.release(
                PreparedUpdate("full", data_pb2.WeightUpdateHeader(), b"", 0.0, None, PayloadMemory(buffer, segment))
            )
            raise
        return PreparedUpdate(
            "full", header, payload, _elapsed_ms(start_s), None, PayloadMemory(buffer, segment), phases
        )

    def _build_from_snapshot(
        self,
        kind: PublishKind,
        version: int,
        snapshot: dict[str, torch.Tensor],
        spent_ms: float,
        *,
        start_s: float | None = None,
        phases: dict[str, float] | None = None,
        encoding: int | None = None,
    ) -> PreparedUpdate:
        start_s = time.perf_counter() if start_s is None else start_s
        phases = {} if phases is None else phases
        keep = snapshot if self.kind == "delta" else None
        if kind == "delta":
            from primerl.proto.weight_delta import encode_delta

            if self.base_version is None or self._base is None:
                raise ValueError("a delta needs a base: publish a FULL update first")
            encoding = self._encoding_for(snapshot) if encoding is None else encoding
            mark = time.perf_counter()
            payload, specs, decoded = encode_delta(
                snapshot, self._base, encoding=encoding, changed_only=True, level=self.delta_level
            )
            phases["encode"] = _elapsed_ms(mark)
            mark = time.perf_counter()
            header = self._header(version, kind, payload, specs)
            phases["digest"] = _elapsed_ms(mark)
            header.base_version = self.base_version
            header.delta_encoding = encoding
            header.decoded_tensors.extend(decoded)
            return PreparedUpdate(kind, header, payload, spent_ms + _elapsed_ms(start_s), keep, PayloadMemory(), phases)
        prepared = self._encode_full(version, snapshot, phases, start_s)
        return replace(prepared, build_ms=spent_ms + prepared.build_ms, snapshot=keep)

    def _header(
        self, version: int, kind: PublishKind, payload: Any, specs: list, *, payload_bytes: int | None = None
    ) -> data_pb2.WeightUpdateHeader:
        """The update's header; ``payload`` None (a streamed payload, ``payload_bytes`` long): no digest (it follows
        in the last chunk)."""
        if version < 1:
            raise ValueError(f"policy versions start at 1 (the first optimizer step), got {version}")
        if self.lineage_base_version is None:
            self.lineage_base_version = version - 1
            log.info("policy lineage", lineage=self.lineage, lineage_base_version=self.lineage_base_version)
        return data_pb2.WeightUpdateHeader(
            policy_version=version,
            kind=_KIND_TO_WIRE[kind],
            tensors=specs,
            digest=payload_digest(payload) if payload is not None else "",
            payload_bytes=len(payload) if payload is not None else payload_bytes,
            policy_name=self.policy_name,
            lineage=self.lineage,
            lineage_base_version=self.lineage_base_version,
        )

    def lose_base(self) -> LostBase:
        """Forget the base while an update is sent: until the broker answers, nothing is known to be held (a failed
        send leaves the next update FULL). Returns the base lost (and its buffer), for `stored`."""
        lost = self._base, self._base_buffer
        self._base, self._base_version, self._base_buffer, self._full_required = None, None, None, False
        return lost

    def stored(self, prepared: PreparedUpdate, full_required: bool, lost: LostBase) -> None:
        """The broker stored ``prepared``: its snapshot becomes the base, and the base it replaces (``lost``) is read
        by nothing now: its memory serves the next snapshot or payload."""
        previous_base, previous_buffer = lost
        if prepared.snapshot is not None:
            self._base, self._base_version = prepared.snapshot, prepared.policy_version
            if prepared.owns_snapshot:  # the base views this buffer: it goes back when the base is replaced
                self._base_buffer = prepared.memory.take_buffer()
            if previous_buffer is not None:
                self.places.give_back_buffer(previous_buffer)
            elif previous_base is not None and previous_base is not prepared.snapshot:
                self._spare_snapshot = previous_base
        self._full_required = full_required


def _elapsed_ms(start_s: float) -> float:
    return (time.perf_counter() - start_s) * 1000.0
