"""Publish the policy to the broker after each optimizer step: full weights, a LoRA adapter, or a lossless delta.

What goes on the wire (``WeightUpdateHeader`` + one safetensors payload):

- FULL: every tensor as ``save_pretrained`` writes ``model.safetensors`` (``primerl.trainer.hf_state_dict``: Hugging
  Face names, tied weights once, a LoRA-trained model merged), cast to the serving dtype when one is set; the bytes
  equal the file the trainer exports (``primerl.trainer.weights_export``), so a receiver may write them as is.
- LORA: the adapter as peft's ``save_pretrained`` writes ``adapter_model.safetensors``, in its training dtype, with
  ``adapter_config_json`` as it writes ``adapter_config.json``.
- DELTA: ``encode_delta`` (bit-exact, ``primerl.proto.weight_delta``) of the FULL tensors against the last version
  published (a host copy). The first publish of a run, the one after the broker asks for ``full_required`` or
  refuses a delta, and the one after a failed publish are FULL. ``delta_encoding="auto"``: SPARSE when most bytes
  are 16-bit floats, XOR_ZLIB otherwise. ``delta_policy="auto"``: a delta is sent as FULL when it would not pay
  (``fallback`` says why): ``estimate_delta`` times encoding and decoding a slice of every tensor, and the delta
  pays when that time is less than its saved bytes take on the wire's ``WIRE_HOPS`` hops, at the rate of this
  publisher's last ``send`` (payload bytes over the time from the start of ``send`` to the broker's ack;
  ``DEFAULT_WIRE_BYTES_PER_S`` until one was measured). A delta built larger than ``BUILT_DELTA_MAX_FRACTION`` of
  FULL goes as FULL too. ``delta_policy="always"`` skips both checks.

``publish`` = ``build`` (it reads the parameters: in the trainer daemon on its IO thread, before the next optimizer
step may change them) + ``send`` (socket I/O: a ``PreparedUpdate`` owns its bytes, in ``PayloadMemory``). FULL
payloads are written into pooled buffers (``payload_writer``); a buffer goes back to the pool once the broker
acknowledged the update, so ``PreparedUpdate.payload`` is valid until ``send`` returns. The content digest
(XXH3-128, ``primerl.proto.digests``) is computed once, here, over the finished payload. A streamed FULL
(``stream``; by default when the weights are on a GPU) is the exception: ``build`` only lays out its header and
starts ``payload_stream.PayloadStream`` writing the tensors, ``send`` cuts each chunk once its bytes are written,
and the digest, computed in the pass of each chunk's checksum, follows in the last chunk (``Chunk.payload_digest``).

Lineage: every update carries ``lineage`` (one per trainer incarnation: the ``policy_lineage`` the broker gave
trainer rank 0 when it registered, ``RegisterResponse.policy_lineage``) and ``lineage_base_version`` (the version
the trainer resumed from). The broker hands lineages out from a counter in its durable run state, each above every
one before, so a restarted trainer's lineage supersedes its predecessors' whatever the hosts' clocks say. A trainer
resumed from an older checkpoint re-publishes versions under a newer lineage: the broker accepts its first FULL even
at a version it holds and drops the rolled-back updates; a replaced incarnation's next update is refused with
``LineageSuperseded``, which ends it. Only without a lineage from the broker (a broker before
``policy_lineage``) does a publisher take the unix microseconds of its start, ordered by the hosts' clocks.

Broker outages: ``send`` retries a publish lost to a missing connection or ack through
``primerl.client.outage.retry_through_outage`` until the role's ``broker.outage_s``; a resend is safe (the broker
acknowledges an update it already stored). ``PublishResult.phases_ms``: ``read``, ``snapshot``, ``estimate``,
``encode``, ``digest``, ``send``; a streamed FULL: ``read``, ``layout``, ``send`` (its copies overlap the send).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from primerl.client.outage import OutageWatch, retry_through_outage
from primerl.client.weight_publisher import WeightPublisher, WeightPublishTimeout
from primerl.proto import telemetry
from primerl.proto.digests import new_hasher, payload_digest
from primerl.proto.shared_segment import Segment, SegmentPool
from primerl.proto.tensor_frames import encode_tensors, parse_header, specs_of
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import LineageSuperseded, WeightUpdateRefused
from primerl.runtime.config_common import DEFAULT_OUTAGE_S
from primerl.runtime.log_setup import get_logger
from primerl.trainer.hf_state_dict import (
    SAFETENSORS_METADATA,
    hf_state_dict,
    lora_adapter_config_json,
    lora_state_dict,
)
from primerl.trainer.payload_writer import PayloadPool, payload_tensors, safetensors_layout, write_safetensors

if TYPE_CHECKING:
    import torch

    from primerl.trainer.payload_stream import PayloadStream

__all__ = ["PolicyPublisher", "PreparedUpdate", "PublishKind", "PublishResult"]

log = get_logger(__name__)

PublishKind = Literal["full", "lora", "delta"]
Transport = Literal["auto", "socket"]
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


@dataclass(eq=False)
class PayloadMemory:
    """Where a prepared payload lies, each part given back once: the pooled ``buffer`` (None: the payload owns its
    bytes, or it went back) and the shared-memory ``segment`` (the same-host road; None: none, or it went back)."""

    buffer: bytearray | None = None
    segment: Segment | None = None

    def take_buffer(self) -> bytearray | None:
        """The buffer, once: later calls return None."""
        buffer, self.buffer = self.buffer, None
        return buffer

    def take_segment(self) -> Segment | None:
        """The segment, once: later calls return None."""
        segment, self.segment = self.segment, None
        return segment


@dataclass(frozen=True)
class PreparedUpdate:
    """A built update: ``header`` (digest and sizes set) and ``payload``; ``snapshot`` is the full host state
    it encodes (FULL/DELTA of a delta publisher), kept as the base of the next delta once this one is stored."""

    kind: PublishKind
    header: data_pb2.WeightUpdateHeader
    payload: bytes | memoryview
    build_ms: float
    snapshot: dict[str, torch.Tensor] | None = None
    # The pooled buffer and the shared segment under ``payload``: back to the pool (or the writer) once stored.
    memory: PayloadMemory = field(default_factory=PayloadMemory)
    phases_ms: dict[str, float] = field(default_factory=dict)
    fallback: str | None = None
    # ``snapshot`` views ``buffer`` (a FULL of a delta publisher): the buffer lives as long as that base.
    owns_snapshot: bool = False
    # A streamed FULL (``payload_stream``): ``payload`` is still being written; the header has no digest (it follows
    # in the last chunk).
    stream: PayloadStream | None = None

    @property
    def policy_version(self) -> int:
        return self.header.policy_version


@dataclass(frozen=True)
class PublishResult:
    """What one ``publish`` did. ``kind`` is what was sent (a delta publisher sends "full" when it must);
    ``fallback`` says why it sent FULL instead of DELTA (None when it sent what was asked)."""

    ack: data_pb2.WeightAck
    kind: PublishKind
    policy_version: int
    base_version: int
    payload_bytes: int
    num_tensors: int
    build_ms: float
    send_ms: float
    fallback: str | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    # How its bytes went: "shared_memory" (a segment the broker and same-host workers read) or "socket".
    transport: str = "socket"


class PolicyPublisher:
    """Sends the policy of each step to the broker's weight plane. One per trainer (rank 0).

    Not thread-safe: ``build`` and ``send`` may run on different threads (the trainer daemon runs both on its IO
    thread), but a delta's ``build`` needs the previous ``send`` to have finished (its result is the delta's base)."""

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None,
        sender: str,
        chunk_bytes: int,
        kind: PublishKind,
        policy_name: str,
        *,
        serving_dtype: torch.dtype | None = None,
        delta_level: int = 1,
        delta_policy: DeltaPolicy = "auto",
        delta_encoding: DeltaEncodingChoice = "auto",
        publisher: WeightPublisher | None = None,
        outage_s: float = DEFAULT_OUTAGE_S,
        stop_event: threading.Event | None = None,
        lineage: int | None = None,
        curve: Any = None,
        stream: bool | None = None,
        transport: Transport = "auto",
        run_id: str = "",
    ):
        """``serving_dtype``: cast floating-point FULL/DELTA tensors to this dtype (None: the model's own).
        ``delta_level``: zlib level of XOR_ZLIB deltas. ``delta_policy``: "auto" sends FULL when a delta would not
        pay (module docstring), "always" sends every possible delta. ``delta_encoding``: "sparse", "xor_zlib", or
        "auto" (SPARSE for mostly 16-bit float weights, else XOR_ZLIB). ``publisher``: an existing ``WeightPublisher``
        to use (tests). ``outage_s``: how long a publish waits through a broker outage (the role's
        ``broker.outage_s``); ``stop_event``: ends that wait early (``OutageStopped``). ``lineage``: this trainer
        incarnation's lineage, the broker's ``RegisterResponse.policy_lineage`` (None: now, in unix microseconds:
        for a broker that hands out none; tests pass their own). ``stream``: send a FULL update of a "full"
        publisher larger than one chunk while it is still written (``payload_stream``; its digest follows in the
        last chunk); False: write and hash the whole payload first; None: stream when the weights are on a GPU.
        ``transport``: "auto" hands each update over in shared memory (``proto.shared_segment``, segments named
        after ``run_id``) while the broker can map it (a broker on this host), else as bytes; "socket": always
        bytes. An encrypted (CURVE) wire always sends bytes."""
        if outage_s <= 0:
            raise ValueError(f"outage_s must be > 0, got {outage_s}")
        if kind not in _KIND_TO_WIRE:
            raise ValueError(f'kind must be "full", "lora" or "delta", got {kind!r}')
        if delta_policy not in ("auto", "always"):
            raise ValueError(f'delta_policy must be "auto" or "always", got {delta_policy!r}')
        if delta_encoding not in ("auto", *_ENCODING_OF_CHOICE):
            raise ValueError(f'delta_encoding must be "auto", "sparse" or "xor_zlib", got {delta_encoding!r}')
        if not policy_name:
            raise ValueError("policy_name must not be empty")
        if transport not in ("auto", "socket"):
            raise ValueError(f'transport must be "auto" or "socket", got {transport!r}')
        self.kind: PublishKind = kind
        self.policy_name = policy_name
        self.serving_dtype = serving_dtype
        self.delta_level = delta_level
        self.delta_policy: DeltaPolicy = delta_policy
        self.delta_encoding: DeltaEncodingChoice = delta_encoding
        self.stream = stream
        self.chunk_bytes = chunk_bytes
        self._pool = PayloadPool()
        # The same-host road: payloads written into shared-memory segments (None: bytes over the socket).
        self._segments: SegmentPool | None = (
            SegmentPool(run_id or sender) if transport == "auto" and curve is None else None
        )
        self.transport: str = "socket" if self._segments is None else "shared_memory"
        self._last_transport = self.transport  # how the last update went
        self._spare_snapshot: dict[str, torch.Tensor] | None = None
        self._wire_bytes_per_s: float | None = None
        self._base_buffer: bytearray | None = None  # the pooled payload buffer the base views, if any
        # ``curve``: CURVE credentials (``BrokerClientConfig.curve_client()``) for a broker that encrypts its planes.
        self._publisher = publisher or WeightPublisher(endpoint, auth_token, sender, chunk_bytes, curve=curve)
        # Base of the next delta: the host copy of the last version the broker stored, and its version.
        self._base: dict[str, torch.Tensor] | None = None
        self._base_version: int | None = None
        self._full_required = False
        self.outage_s = outage_s
        self.sender = sender
        self._stop_event = stop_event
        self.lineage = time.time_ns() // 1000 if lineage is None else lineage
        if self.lineage <= 0:
            raise ValueError(f"lineage must be > 0, got {self.lineage}")
        # The version this incarnation resumed from: its first published version - 1 (set by the first build).
        self.lineage_base_version: int | None = None

    @property
    def base_version(self) -> int | None:
        """The version the next delta would apply to (None: the next update is FULL)."""
        return None if self._base is None or self._full_required else self._base_version

    def publish(self, model: torch.nn.Module, version: int, timeout_s: float = 120.0) -> PublishResult:
        """Build and send ``model`` as ``version``; returns once the broker stored it.

        Raises ``WeightUpdateRefused`` with the broker's error (e.g. OUT_OF_ORDER for a version not newer than
        the latest it holds) and ``WeightPublishTimeout``; after any failure the next publish is FULL.
        """
        fallback = None
        kind = self.kind
        if kind == "delta" and self.base_version is None:
            fallback = "full required by the broker" if self._full_required else "no base version yet"
            kind = "full"
        prepared = self.build(model, version, kind=kind)
        fallback = prepared.fallback or fallback
        try:
            ack, send_ms = self.send(prepared, timeout_s)
        except WeightUpdateRefused as exc:
            if (
                isinstance(exc, LineageSuperseded)
                or prepared.kind != "delta"
                or not (exc.full_required or exc.code == common_pb2.ERROR_CODE_OUT_OF_ORDER)
            ):
                raise
            fallback = f"delta refused: {exc}"
            log.warning("delta refused; sending the version as FULL", policy_version=version, error=str(exc))
            assert prepared.snapshot is not None
            prepared = self._build_from_snapshot("full", version, prepared.snapshot, prepared.build_ms)
            ack, send_ms = self.send(prepared, timeout_s)
        header = prepared.header
        num_tensors = len(header.decoded_tensors) if prepared.kind == "delta" else len(header.tensors)
        return PublishResult(
            ack=ack,
            kind=prepared.kind,
            policy_version=version,
            base_version=header.base_version,
            payload_bytes=header.payload_bytes,
            num_tensors=num_tensors,
            build_ms=prepared.build_ms,
            send_ms=send_ms,
            fallback=fallback,
            phases_ms={**prepared.phases_ms, "send": send_ms},
            transport=self._last_transport,
        )

    def build(self, model: torch.nn.Module, version: int, *, kind: PublishKind | None = None) -> PreparedUpdate:
        """Read the model and encode one update of ``kind`` (default: this publisher's kind; "delta" needs a
        base, and may come back as FULL when it would not pay, with ``fallback`` set). Runs on the training
        thread, between optimizer steps."""
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
        if kind == "full" and not sharded:
            # Cast (when a serving dtype is set) in the one copy into the payload buffer: no snapshot of the model.
            live = {k: v.detach() for k, v in state.items()}
            return self._build_delta_or_full(kind, version, live, phases, start_s, snapshot_is_copy=False)
        if sharded or self.serving_dtype is not None:
            # Gathered / cast host copies first (the general path).
            mark = time.perf_counter()
            snapshot = _host_copy(state, self.serving_dtype, reuse=self._take_spare())
            phases["snapshot"] = _elapsed_ms(mark)
            return self._build_delta_or_full(kind, version, snapshot, phases, start_s, snapshot_is_copy=True)
        # The parameters themselves are read: encoding copies them into the payload (FULL) or the delta base.
        live = {k: v.detach() for k, v in state.items()}
        return self._build_delta_or_full(kind, version, live, phases, start_s, snapshot_is_copy=False)

    def _build_delta_or_full(
        self,
        kind: PublishKind,
        version: int,
        tensors: dict[str, torch.Tensor],
        phases: dict[str, float],
        start_s: float,
        *,
        snapshot_is_copy: bool,
    ) -> PreparedUpdate:
        fallback = None
        encoding = self._encoding_for(tensors)
        if kind == "delta" and self.delta_policy == "auto":
            mark = time.perf_counter()
            fallback = self._delta_would_not_pay(tensors, encoding)
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
            prepared = self._encode_full(kind, version, tensors, phases, start_s)
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

    def _delta_would_not_pay(self, tensors: dict[str, torch.Tensor], encoding: int) -> str | None:
        """None when a delta against the base pays (module docstring), else why not, with the numbers."""
        from primerl.proto.weight_delta import estimate_delta

        assert self._base is not None
        estimate = estimate_delta(tensors, self._base, encoding=encoding, level=self.delta_level)
        rate = self._wire_bytes_per_s or DEFAULT_WIRE_BYTES_PER_S
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
        import torch

        from primerl.trainer.payload_stream import PayloadStream

        mark = time.perf_counter()
        live = {name: tensor.detach() for name, tensor in state.items()}
        cast = self.serving_dtype
        shapes = {
            name: torch.empty(
                t.shape, dtype=cast if cast is not None and t.is_floating_point() else t.dtype, device="meta"
            )
            for name, t in live.items()
        }
        prefix, spans = safetensors_layout(shapes, SAFETENSORS_METADATA)
        total = spans[-1][2] if spans else len(prefix)
        if total <= self.chunk_bytes:
            return None
        buffer = self._pool.acquire(total, pinned=any(t.device.type == "cuda" for t in live.values()))
        try:
            stream = PayloadStream(live, cast, buffer, prefix, spans)
            specs = specs_of(parse_header(prefix, total_bytes=total))
            header = self._header(version, "full", None, specs, payload_bytes=total)
        except BaseException:
            self._pool.release(buffer)
            raise
        phases["layout"] = _elapsed_ms(mark)
        return PreparedUpdate(
            "full", header, stream.view, _elapsed_ms(start_s), None, PayloadMemory(buffer), phases, stream=stream
        )

    def _encode_full(
        self,
        kind: PublishKind,
        version: int,
        tensors: dict[str, torch.Tensor],
        phases: dict[str, float],
        start_s: float,
    ) -> PreparedUpdate:
        """A FULL payload written into a pooled buffer, and its header (digest computed once, here)."""
        import torch

        mark = time.perf_counter()
        cast = self.serving_dtype
        if cast is not None and any(t.is_floating_point() and t.dtype != cast for t in tensors.values()):
            shapes = {
                name: torch.empty(t.shape, dtype=cast if t.is_floating_point() else t.dtype, device="meta")
                for name, t in tensors.items()
            }
        else:
            cast, shapes = None, tensors
        prefix, spans = safetensors_layout(shapes, SAFETENSORS_METADATA)
        total = spans[-1][2] if spans else len(prefix)
        # The same-host road: written straight into a shared segment, the one write of the payload on this host
        # (not for a delta publisher: its next base views the payload's buffer).
        segment = self._acquire_segment(total) if self.kind != "delta" else None
        buffer = self._pool.acquire(total) if segment is None else None
        try:
            destination = segment.view(total) if segment else buffer
            hasher = new_hasher()  # each tensor hashed right after its copy: no second pass over the payload
            payload = write_safetensors(tensors, destination, prefix, spans, dtype=cast, hasher=hasher)
            phases["encode"] = _elapsed_ms(mark)
            mark = time.perf_counter()
            specs = specs_of(parse_header(payload))
            header = self._header(version, kind, None, specs, payload_bytes=total)
            header.digest = hasher.hexdigest()
            phases["digest"] = _elapsed_ms(mark)
        except BaseException:
            self._release(
                PreparedUpdate(kind, data_pb2.WeightUpdateHeader(), b"", 0.0, None, PayloadMemory(buffer, segment))
            )
            raise
        return PreparedUpdate(kind, header, payload, _elapsed_ms(start_s), None, PayloadMemory(buffer, segment), phases)

    def _acquire_segment(self, num_bytes: int) -> Segment | None:
        """A drained shared segment for a payload of ``num_bytes`` (None: updates go as bytes). Logs the segments the
        pool retired because their readers did not drain in time."""
        if self._segments is None:
            return None
        segment = self._segments.acquire(num_bytes)
        for path in self._segments.retired:
            log.warning(
                "a shared weight segment was not released in time; a new one replaces it",
                path=path,
                drain_timeout_s=self._segments.drain_timeout_s,
            )
        self._segments.retired.clear()
        return segment

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
        prepared = self._encode_full(kind, version, snapshot, phases, start_s)
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

    def send(self, prepared: PreparedUpdate, timeout_s: float = 120.0) -> tuple[data_pb2.WeightAck, float]:
        """Send a built update; returns (ack, send ms). Keeps the delta base in step with what the broker holds:
        a stored update becomes the base; a failed send leaves none (the next publish is FULL)."""
        start_s = time.perf_counter()
        previous_base, previous_buffer = self._base, self._base_buffer
        # Until the broker answers, nothing is known to be held: a failed send leaves the next publish FULL.
        self._base, self._base_version, self._base_buffer, self._full_required = None, None, None, False
        try:
            try:
                shared = self._shared_descriptor(prepared)
                try:
                    ack = self._publish_through_outage(prepared, timeout_s, shared)
                except WeightUpdateRefused as exc:
                    if shared is None or exc.code != common_pb2.ERROR_CODE_NOT_FOUND:
                        raise
                    self._leave_shared_memory(str(exc))
                    shared = None
                    ack = self._publish_through_outage(prepared, timeout_s, None)
            finally:
                _settle_stream(prepared)
        except WeightUpdateRefused as exc:
            self._release(prepared, read=False)  # refused: the broker holds none of it (the pooled buffer aside)
            if not prepared.owns_snapshot:
                self._release(prepared)  # nothing else reads it
            if isinstance(exc, LineageSuperseded):
                log.error(
                    "policy lineage superseded: a newer trainer incarnation publishes; this one must stop",
                    policy_version=prepared.policy_version,
                    lineage=self.lineage,
                    broker_lineage=exc.broker_lineage,
                )
            raise
        except Exception:
            # Any other failure, e.g. a timeout, may leave the payload referenced by the socket (never reused) or
            # its segment read by the broker and its workers (written again once drained).
            segment = prepared.memory.take_segment()
            if segment is not None and self._segments is not None:
                self._segments.give_back(segment)
            raise
        send_ms = _elapsed_ms(start_s)
        self._last_transport = "shared_memory" if shared is not None else "socket"
        if send_ms > 0:
            self._wire_bytes_per_s = prepared.header.payload_bytes / (send_ms / 1000.0)
        if prepared.snapshot is not None:
            self._base, self._base_version = prepared.snapshot, prepared.policy_version
            if prepared.owns_snapshot:  # the base views this buffer: it goes back when the base is replaced
                self._base_buffer = prepared.memory.take_buffer()
            # The base replaced is read by nothing now: its memory serves the next snapshot or payload.
            if previous_buffer is not None:
                self._pool.release(previous_buffer)
            elif previous_base is not None and previous_base is not prepared.snapshot:
                self._spare_snapshot = previous_base
        self._release(prepared)
        self._full_required = ack.full_required
        log.info(
            telemetry.POLICY_PUBLISHED,
            policy_version=prepared.policy_version,
            kind=prepared.kind,
            base_version=prepared.header.base_version or None,
            payload_bytes=prepared.header.payload_bytes,
            build_ms=round(prepared.build_ms, 2),
            send_ms=round(send_ms, 2),
            full_required=ack.full_required,
            transport=self._last_transport,
            reason=prepared.fallback,
        )
        if self._segments is not None and self.transport == "socket":  # left the same-host road during this send
            self._segments.close()
            self._segments = None
        return ack, send_ms

    def _shared_descriptor(self, prepared: PreparedUpdate) -> data_pb2.SharedSegment | None:
        """The descriptor of ``prepared``'s payload in a shared segment, copied there first when it was built
        elsewhere (a LoRA adapter, a delta, a FULL the next delta's base views); None: it goes as bytes."""
        if self._segments is None or self.transport != "shared_memory" or prepared.stream is not None:
            return None
        source = memoryview(prepared.payload).cast("B")
        segment = prepared.memory.segment
        if segment is None:
            segment = self._acquire_segment(source.nbytes)
            assert segment is not None
            segment.view(source.nbytes)[:] = source
            prepared.memory.segment = segment
        return segment.publish(source.nbytes)

    def _leave_shared_memory(self, reason: str) -> None:
        """The broker cannot map this trainer's segments (another host, another /dev/shm): bytes from now on."""
        log.warning("the broker cannot read this trainer's shared memory; weight updates go as bytes", error=reason)
        self.transport = "socket"

    def _publish_through_outage(
        self, prepared: PreparedUpdate, timeout_s: float, shared: data_pb2.SharedSegment | None = None
    ) -> data_pb2.WeightAck:
        """One publish, sent again while the broker is unreachable or lost (within ``outage_s``)."""
        watch = OutageWatch(f"the broker to store policy v{prepared.policy_version}", self.outage_s, worker=self.sender)
        return retry_through_outage(
            lambda: self._publisher.publish(
                prepared.header,
                prepared.payload,
                timeout_s,
                ready=None if prepared.stream is None else prepared.stream.wait_for,
                shared=shared,
            ),
            watch,
            (WeightPublishTimeout,),
            stop_event=self._stop_event,
        )

    def _release(self, prepared: PreparedUpdate, *, read: bool = True) -> None:
        """Give back ``prepared``'s shared segment (``read``: it was handed out, and is written again only once its
        readers drained) and, with ``read``, its pooled buffer."""
        segment = prepared.memory.take_segment()
        if segment is not None:
            if self._segments is not None:
                self._segments.give_back(segment, read=read)
        if not read:
            return
        _settle_stream(prepared)  # the writer must be finished with the buffer before it is reused
        buffer = prepared.memory.take_buffer()  # released once, even if send is called again
        if buffer is not None:
            self._pool.release(buffer)

    def close(self) -> None:
        self._publisher.close()
        if self._segments is not None:
            self._segments.close()
            self._segments = None

    def __enter__(self) -> PolicyPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settle_stream(prepared: PreparedUpdate) -> None:
    """A streamed payload's writer is done reading the parameters (whatever came of the send): the optimizer may
    change them once ``send`` returns. Its failure, if any, was raised to the sender already."""
    if prepared.stream is not None:
        try:
            prepared.stream.done()
        except Exception:  # noqa: BLE001 - raised from wait_for during the send; the buffer is then never reused
            prepared.memory.take_buffer()


def _elapsed_ms(start_s: float) -> float:
    return (time.perf_counter() - start_s) * 1000.0
