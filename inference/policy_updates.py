"""Apply weight updates (FULL, LORA, DELTA) to a running vLLM engine: the logic, without sockets.

``PolicyUpdater`` holds the policy version the engine serves and applies a ``(WeightUpdateHeader, payload)`` to it
through ``EngineOps`` (``primerl.inference.engine_ops``), a small synchronous view of the engine: ``LLMEngineOps``
for an offline ``vllm.LLM``, ``AsyncEngineOps`` for the server's ``AsyncLLM``.

This is the one place on the inference host that checks an update's order and digest; checks come first, and a
refused update (``UpdateRefused`` with a wire ``ErrorCode``, ``primerl.inference.update_checks``) changes nothing:

- BAD_DIGEST / TRUNCATED: the digest the subscriber computed as the chunks arrived is not ``header.digest``, or
  ``payload_bytes`` disagrees (the broker forwards before it has checked: cut-through). Only with ``verify_digest``;
- OUT_OF_ORDER: a FULL or LORA update not newer than the served version unless of a newer lineage; any update of an
  older lineage; a DELTA whose ``base_version`` or lineage is not the served one, or while a LoRA adapter is served;
- TENSOR_MISMATCH / MALFORMED_HEADER: unknown, missing or misshapen tensors, an unreadable payload or delta, an
  adapter whose rank exceeds the engine's ``max_lora_rank``.

FULL and DELTA payloads are written as they arrive into shared-memory files, and the worker stages the update beside
the served weights meanwhile (``primerl.inference.payload_transfers``). ``preload`` checks a whole update and waits
for that load while generation runs; ``apply`` then only switches the model (a few ms) and resets the prefix cache.
An update is never switched to before its last chunk arrived and its digest matched; one that stops midway or is
refused is dropped (``discard``).
An engine that cannot stage (``staged_load.unsupported_reason``) reloads in place in ``apply``.
LORA goes to a new directory under ``work_dir``/adapters under a new int id each version, ``keep_adapter_versions``
kept for requests still in flight (``primerl.inference.lora_adapters``).

Lineage: a FULL or LORA update of a newer ``header.lineage`` (a trainer rolled back) is applied whatever its version.
``wants(header)``: would be applied; ``holds(header)``: the engine serves it or something newer (acknowledge, do not
pause). Requests in flight keep generating during ``apply`` (pausing around it is the server's job). Receiving,
``preload`` and ``apply`` are for one thread, serialised by one lock; ``policy_version`` and ``lora_request()`` may
be read from any thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.inference.engine_ops import EngineOps, LLMEngineOps, engine_max_lora_rank
from primerl.inference.lora_adapters import LoraAdapters
from primerl.inference.payload_transfers import (
    STAGE_STALL_TIMEOUT_S,
    STAGE_TIMEOUT_S,
    PayloadTransfers,
    Transfer,
)
from primerl.inference.update_checks import (
    DELTA,
    FULL,
    LORA,
    UpdateRefused,
    check_payload,
    order_refusal,
    refusal_from_frame_error,
    refusal_from_worker_error,
)
from primerl.inference.weight_tensors import WeightUpdateInvalid, check_against
from primerl.proto import telemetry
from primerl.proto.tensor_frames import TensorFrameError, check_tensor_frame
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    import vllm
    from vllm.lora.request import LoRARequest

log = get_logger(__name__)

__all__ = ["PolicyUpdater"]


DEFAULT_POLICY_NAME = "policy"


class PolicyUpdater:
    """The policy an engine serves, and the one way to change it. See the module docstring."""

    def __init__(
        self,
        engine: EngineOps,
        work_dir: str | Path,
        *,
        max_lora_rank: int | None,
        policy_name: str = DEFAULT_POLICY_NAME,
        policy_version: int = 0,
        keep_adapter_versions: int = 2,
        verify_digest: bool = True,
        staging_dir: str | Path | None = None,
        streaming: bool = True,
        stage_stall_timeout_s: float = STAGE_STALL_TIMEOUT_S,
        stage_timeout_s: float = STAGE_TIMEOUT_S,
    ):
        """`max_lora_rank`: the engine's (None: started without LoRA, LORA updates are refused).
        `policy_name`: the adapter name when a LORA header has none. `policy_version`: what the engine serves
        now (0: the checkpoint it was started from). `keep_adapter_versions`: adapter directories kept on disk,
        the served one included (>= 2, so requests still on the previous adapter can reload it).
        `verify_digest`: check each payload's digest against the header (see the module docstring).
        `staging_dir`: where the shared payload files live (None: /dev/shm when writable). `streaming`: load FULL and
        DELTA updates beside the served weights (staged) when the engine can; False: always reload in place.
        `stage_stall_timeout_s`: a staged load gives up when no byte of its payload arrived for this long.
        `stage_timeout_s`: longest wait for a staged load to finish once its payload is complete."""
        if keep_adapter_versions < 2:
            raise ValueError(f"keep_adapter_versions must be >= 2, got {keep_adapter_versions}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        self.engine = engine
        self.work_dir = Path(work_dir)
        self.adapters = LoraAdapters(
            engine,
            self.work_dir / "adapters",
            max_lora_rank=max_lora_rank,
            policy_name=policy_name,
            keep=keep_adapter_versions,
        )
        self._policy_version = policy_version
        self._lineage = 0
        self._lineage_base_version = 0
        self._manifest: dict[str, tuple[str, list[int]]] | None = None
        self._lock = threading.Lock()
        self.verify_digest = verify_digest
        self.streaming = streaming
        self.transfers = PayloadTransfers(
            engine,
            staging_dir,
            streaming=streaming,
            stall_timeout_s=stage_stall_timeout_s,
            stage_timeout_s=stage_timeout_s,
            engine_workers=self._engine_workers,
        )
        self._preloaded: _Preloaded | None = None
        self._num_engine_workers = 0
        # A trainer's segment the worker's host copy may still view (after an update read in place from it).
        self._foreign_host_path: str | None = None
        self.last_phases_ms: dict[str, float] = {}
        """Milliseconds of each phase of the last applied update. FULL and DELTA: ``check`` (header, digest, tensor
        specs), ``stage`` (payload into a shared file; 0 when it was received there), ``load`` (waiting for the
        staged load beside the served weights, once the payload was complete), ``engine`` (the switch to the staged
        load, or the worker's reload in place), ``reset_cache``; all but ``engine`` and ``reset_cache`` happen in
        `preload`. LORA: ``check``, ``engine`` (write + add the adapter)."""

    @classmethod
    def for_llm(cls, llm: vllm.LLM, work_dir: str | Path, **kwargs: Any) -> PolicyUpdater:
        """A `PolicyUpdater` of an offline `vllm.LLM` started with the primerl worker extension."""
        return cls(
            LLMEngineOps(llm), work_dir, max_lora_rank=engine_max_lora_rank(llm.llm_engine.vllm_config), **kwargs
        )

    # ---- what is served ----------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The policy version the engine serves (0: the weights it started with)."""
        return self._policy_version

    @property
    def lineage(self) -> int:
        """The lineage of the served version (``WeightUpdateHeader.lineage``; 0: the start weights or unknown)."""
        return self._lineage

    @property
    def lineage_base_version(self) -> int:
        """The version the served lineage resumed from: an older lineage's versions above it were rolled back."""
        return self._lineage_base_version

    def wants(self, header: data_pb2.WeightUpdateHeader) -> bool:
        """Whether ``header`` would pass the version and lineage checks of `apply` (not the payload's): a newer
        version of the served lineage, a FULL or LORA of a newer lineage (a rollback included), or a DELTA on the
        served version. False for a resend of what is served and for an older lineage's update."""
        return self._order_refusal(header) is None

    def holds(self, header: data_pb2.WeightUpdateHeader) -> bool:
        """Whether what is served already covers ``header``: an update of an older lineage than the served one, or
        one not newer than the served version (a FULL or LORA of a newer lineage excepted: a rollback). Such an
        update is acknowledged with the served version and not applied; any other that `apply` refuses is
        refused (OUT_OF_ORDER: it is newer, but cannot apply to what is served)."""
        lineage, served_lineage = header.lineage, self._lineage
        if lineage and served_lineage and lineage < served_lineage:
            return True
        rollback = lineage > served_lineage and header.kind != DELTA
        return header.policy_version <= self._policy_version and not rollback

    @property
    def kind(self) -> str:
        """ "lora" while an adapter is served, else "full"."""
        return "full" if self.adapters.request is None else "lora"

    @property
    def reload_in_place_reason(self) -> str | None:
        """Why FULL and DELTA updates are reloaded in place, generation paused for the whole load (None: they are
        loaded beside the served weights, or it is not known yet: before the first update)."""
        return "streaming is off" if not self.streaming else self.transfers.unsupported

    def lora_request(self) -> LoRARequest | None:
        """The `LoRARequest` requests must carry to get the served policy; None while full weights are served."""
        return self.adapters.request

    def prepare(self) -> None:
        """Read the model's weight names and shapes from the worker (which loads its host copy of the weights
        then). `apply` does it on first use; call it at start-up to keep that time out of the first update."""
        with self._lock:
            self._weight_manifest()

    def weight_digest(self) -> str:
        """SHA-256 of the worker's host copy of the full weights (for tests and diagnostics; not cheap)."""
        digests = set(self.engine.collective_rpc("primerl_weight_digest"))
        if len(digests) != 1:
            raise RuntimeError(f"workers hold different weights: {sorted(digests)}")
        return digests.pop()

    # ---- receiving: the weight subscriber's payload sink --------------------------------------------------------

    def begin_payload(self, header: data_pb2.WeightUpdateHeader, num_bytes: int) -> memoryview:
        """`PayloadSink` (``primerl.client.weight_transfer``): a writable buffer of ``num_bytes`` in a shared payload
        file for the update ``header`` announces. When it would be applied (`wants`) and is FULL or DELTA, the
        worker's staged load of it starts now: a FULL update tensor by tensor as its bytes arrive, a DELTA once it
        is complete. The view is passed to `preload` / `apply` as is, with no further copy."""
        with self._lock:
            transfer = self._begin_transfer(num_bytes)
            if header.kind in (FULL, DELTA) and header.payload_bytes in (0, num_bytes) and self.wants(header):
                self.transfers.start_load(transfer, header)
            return transfer.view

    def adopt_payload(self, header: data_pb2.WeightUpdateHeader, path: str, payload: memoryview) -> memoryview:
        """`PayloadSink`, the same-host road: the payload lies whole and final in the file ``path`` (a trainer's
        shared segment: a control page, then the payload, as this updater's files), mapped read-only as
        ``payload``. Nothing is copied: the worker stages (or reloads) the update reading that file, and one of this
        updater's files carries the control words only. Returns ``payload``; the caller checks its digest (passed
        to `preload`) and keeps the mapping until the next update. Once applied, `settle` must run before
        the update is acknowledged."""
        with self._lock:
            transfer = self._begin_transfer(0)
            transfer.view, transfer.payload_path = payload, path
            transfer.file.publish(payload.nbytes)
            transfer.finish(complete=True)
            if header.kind in (FULL, DELTA) and header.payload_bytes in (0, payload.nbytes) and self.wants(header):
                self.transfers.start_load(transfer, header)
            return payload

    def settle(self) -> float:
        """After `apply`, with generation running again, before acknowledging: the worker frees the weights the
        switch replaced (kept out of the pause), and after an update read in place from a trainer's segment its host
        copy copies the tensors that view it (the trainer writes that segment again once the update is
        acknowledged). Returns its milliseconds."""
        with self._lock:
            path, self._foreign_host_path = self._foreign_host_path, None
            start = time.perf_counter()
            self.engine.collective_rpc("primerl_settle", (path or "",))
            return _ms_since(start)

    def payload_progress(self, num_bytes: int) -> None:
        """`PayloadSink`: the first ``num_bytes`` of the payload are in its buffer (the staged load may read them)."""
        self.transfers.progress(num_bytes)

    def end_payload(self, complete: bool) -> None:
        """`PayloadSink`: the payload is complete, or was dropped (its staged load then stops by itself)."""
        self.transfers.end(complete)

    def staging_buffer(self, num_bytes: int) -> memoryview:
        """A writable view of ``num_bytes`` in a shared payload file, to assemble a payload in place (no staged load
        starts before `preload` / `apply`); passed to `apply` as is, it is not copied again. Valid until the next
        call (one update at a time)."""
        with self._lock:
            return self._begin_transfer(num_bytes).view

    def _begin_transfer(self, num_bytes: int) -> Transfer:
        """A new transfer (`PayloadTransfers.begin`); an update preloaded from the current one is dropped."""
        if self.transfers.current is not None:
            self._preloaded = None
        return self.transfers.begin(num_bytes)

    def _engine_workers(self) -> int:
        self._weight_manifest()
        return self._num_engine_workers

    # ---- applying ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the shared payload files (the updater can still be used: it makes new ones)."""
        with self._lock:
            self._preloaded = None
            self.transfers.close()

    def preload(
        self,
        header: data_pb2.WeightUpdateHeader,
        payload: bytes | bytearray | memoryview,
        *,
        payload_digest: str | None = None,
    ) -> None:
        """Everything of `apply` that leaves the served policy as it is: the checks (digest included), and for FULL
        and DELTA the load beside the served weights (the worker's staged load, started as the payload arrived or
        now). Call it before pausing generation; `apply` of the same update then only switches to it (a few ms),
        or reloads in place when the engine cannot stage. ``payload_digest``: the payload's digest as its receiver
        computed it (``WeightSubscriber.received_digest``), saving a pass over the payload; None: computed here.
        Raises `UpdateRefused` (nothing changed; nothing stays loaded)."""
        with self._lock:
            self._preload(header, payload, payload_digest)

    def discard(self) -> None:
        """Drop what `begin_payload` / `preload` loaded for an update that will not be applied (frees its memory)."""
        with self._lock:
            self._discard()

    def apply(
        self,
        header: data_pb2.WeightUpdateHeader,
        payload: bytes | bytearray | memoryview,
        *,
        payload_digest: str | None = None,
    ) -> float:
        """Apply one update (`preload` first, unless it was preloaded); returns the milliseconds it took, checks and
        preload included. Raises `UpdateRefused` (nothing changed). Any other exception is a fault of the engine:
        what it serves is then unknown."""
        start = time.perf_counter()
        with self._lock:
            preloaded = self._preloaded
            if preloaded is None or not preloaded.is_for(header, payload):
                self._preload(header, payload, payload_digest)
                preloaded = self._preloaded
            assert preloaded is not None
            self._preloaded = None
            phases = dict(preloaded.phases_ms)
            mark = time.perf_counter()
            if header.kind == LORA:
                self.adapters.apply(header, payload, self._weight_manifest)
                phases["engine"] = _ms_since(mark)
            else:
                self._switch_weights(header, preloaded.transfer, phases)
            rolled_back_from = self._policy_version if header.policy_version <= self._policy_version else None
            self._policy_version = int(header.policy_version)
            if header.lineage:
                self._lineage, self._lineage_base_version = int(header.lineage), int(header.lineage_base_version)
            self.last_phases_ms = phases
        apply_ms = _ms_since(start) + (preloaded.preload_ms if preloaded.done_s < start else 0.0)
        if rolled_back_from is not None:
            log.warning(
                "served policy rolled back",
                policy_version=header.policy_version,
                rolled_back_from=rolled_back_from,
                lineage=header.lineage,
                lineage_base_version=header.lineage_base_version,
            )
        log.info(
            telemetry.WEIGHT_UPDATE_APPLIED,
            policy_version=header.policy_version,
            lineage=header.lineage or None,
            kind=data_pb2.WeightUpdateKind.Name(header.kind),
            apply_ms=round(apply_ms, 2),
            staged=preloaded.transfer is not None and preloaded.transfer.staged_header is not None,
            **{f"{name}_ms": round(value, 1) for name, value in phases.items()},
        )
        return apply_ms

    def _preload(self, header: data_pb2.WeightUpdateHeader, payload: Any, payload_digest: str | None) -> None:
        self._preloaded = None
        start = time.perf_counter()
        phases: dict[str, float] = {}
        transfer = None
        try:
            self._check_common(header, payload, payload_digest)
            if header.kind != LORA:
                self._check_weights(header, payload)
            phases["check"] = _ms_since(start)
            if header.kind != LORA:
                mark = time.perf_counter()
                transfer = self.transfers.holding(payload)
                phases["stage"] = _ms_since(mark)
                mark = time.perf_counter()
                if transfer.staged_header is not None and transfer.staged_header != header.SerializeToString():
                    self._discard()  # staged for another header: start again
                    transfer = self.transfers.holding(payload)
                self.transfers.start_load(transfer, header)
                if transfer.staged_header is not None:
                    self.transfers.await_load(transfer)
                phases["load"] = _ms_since(mark)
        except UpdateRefused:
            self._discard()
            raise
        self._preloaded = _Preloaded(
            header.SerializeToString(), payload, transfer, phases, _ms_since(start), time.perf_counter()
        )

    def _discard(self) -> None:
        """Drop the preloaded update and the staged load of the current transfer."""
        self._preloaded = None
        self.transfers.discard_load()

    def _switch_weights(
        self, header: data_pb2.WeightUpdateHeader, transfer: Transfer | None, phases: dict[str, float]
    ) -> None:
        """FULL or DELTA: commit the staged load, else reload in place through the shared payload file."""
        assert transfer is not None
        mark = time.perf_counter()
        if transfer.staged_header is not None:
            results = self._rpc("primerl_stage_commit", transfer.seq)
        elif header.kind == FULL:
            results = self._rpc("primerl_load_full_file", transfer.path, transfer.num_bytes)
        else:
            results = self._rpc(
                "primerl_apply_delta_file", transfer.path, transfer.num_bytes, header.SerializeToString()
            )
        phases["engine"] = _ms_since(mark)
        self.transfers.current = None
        if transfer.payload_path:
            self._foreign_host_path = transfer.payload_path
        mark = time.perf_counter()
        self.engine.reset_prefix_cache()
        phases["reset_cache"] = _ms_since(mark)
        self.adapters.forget()
        log.debug("worker applied weights", results=results)

    def _check_common(self, header: data_pb2.WeightUpdateHeader, payload: Any, payload_digest: str | None) -> None:
        check_payload(header, payload, payload_digest, verify_digest=self.verify_digest)
        refusal = self._order_refusal(header)
        if refusal is not None:
            raise UpdateRefused(common_pb2.ERROR_CODE_OUT_OF_ORDER, refusal)

    def _order_refusal(self, header: data_pb2.WeightUpdateHeader) -> str | None:
        return order_refusal(
            header,
            served_version=self._policy_version,
            served_lineage=self._lineage,
            adapter_served=self.adapters.request is not None,
        )

    def _weight_manifest(self) -> dict[str, tuple[str, list[int]]]:
        if self._manifest is None:
            manifests = self.engine.collective_rpc("primerl_weight_manifest")
            self._num_engine_workers = len(manifests)
            self._manifest = {name: (dtype, list(shape)) for name, (dtype, shape) in manifests[0].items()}
        return self._manifest

    def _check_weights(self, header: data_pb2.WeightUpdateHeader, payload: Any) -> None:
        """FULL or DELTA: the payload's tensors match the header, and the header's the model."""
        manifest = self._weight_manifest()
        what = f"{data_pb2.WeightUpdateKind.Name(header.kind)} v{header.policy_version}"
        try:
            check_tensor_frame(payload, header.tensors)
            if header.kind == FULL:
                check_against(
                    {s.name: (s.dtype, list(s.shape)) for s in header.tensors}, manifest, require_all=True, what=what
                )
            else:
                if header.delta_encoding not in (data_pb2.DELTA_ENCODING_SPARSE, data_pb2.DELTA_ENCODING_XOR_ZLIB):
                    raise UpdateRefused(
                        common_pb2.ERROR_CODE_MALFORMED_HEADER,
                        f"{what}: delta_encoding {header.delta_encoding} is not SPARSE or XOR_ZLIB",
                    )
                check_against(
                    {s.name: (s.dtype, list(s.shape)) for s in header.decoded_tensors},
                    manifest,
                    require_all=False,
                    what=what,
                )
        except TensorFrameError as exc:
            raise refusal_from_frame_error(what, exc) from None
        except WeightUpdateInvalid as exc:
            raise UpdateRefused(exc.code, exc.reason) from None

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        try:
            return self.engine.collective_rpc(method, args)
        except Exception as exc:
            refusal = refusal_from_worker_error(exc)
            if refusal is None:
                raise
            raise refusal from None


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


@dataclass
class _Preloaded:
    """An update `preload` checked and loaded, waiting for `apply`."""

    header_bytes: bytes
    payload: Any
    transfer: Transfer | None
    phases_ms: dict[str, float]
    preload_ms: float
    done_s: float

    def is_for(self, header: data_pb2.WeightUpdateHeader, payload: Any) -> bool:
        return payload is self.payload and header.SerializeToString() == self.header_bytes
