"""The thread of a vLLM worker that loads one staged update: it reads the update from the shared payload file as its
bytes become final (the file's control words) into a `StagedLoad` beside the running model, and records LOADED,
FAILED or DISCARDED there; `PolicyWorkerExtension.primerl_stage_commit` then switches the model to it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from primerl.inference.shared_payload import PayloadControl, map_control, map_shared
from primerl.inference.weight_tensors import WeightUpdateInvalid, check_against, entry_tensor, full_update_invalid
from primerl.proto.tensor_frames import TensorFrameError, parse_header
from primerl.proto.v1 import data_pb2

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

STAGE_POLL_S = 0.001
"""How often a staged load looks for newly arrived bytes."""


class StageAborted(Exception):
    """The transfer a staged load reads was abandoned, replaced, or stalled; or the load was discarded."""


class StagedUpdate(threading.Thread):
    """One staged load of transfer ``seq``: a FULL update tensor by tensor as its bytes arrive, a DELTA (decoded with
    ``decode_delta`` and completed with ``with_siblings``, the worker's) once complete. Its outcome goes into the
    file's control words (stage_seq, stage_state) and ``error``."""

    def __init__(
        self,
        model: torch.nn.Module,
        manifest: Mapping[str, tuple[str, list[int]]],
        decode_delta: Callable[[memoryview, bytes], dict[str, torch.Tensor]],
        with_siblings: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
        header: data_pb2.WeightUpdateHeader,
        path: str,
        payload_path: str,
        num_bytes: int,
        seq: int,
        stall_timeout_s: float,
    ):
        super().__init__(name=f"primerl-stage-{seq}", daemon=True)
        self.model, self.manifest = model, manifest
        self.decode_delta, self.with_siblings = decode_delta, with_siblings
        self.header, self.path, self.payload_path = header, path, payload_path
        self.num_bytes, self.seq, self.stall_timeout_s = num_bytes, seq, stall_timeout_s
        self.control = map_control(path)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.load: Any = None
        self.host_entries: dict[str, torch.Tensor] = {}
        self.host_source: str | None = None
        self.load_ms = 0.0
        self.control.write(PayloadControl.STAGE_STATE, PayloadControl.LOADING)
        self.control.write(PayloadControl.STAGE_SEQ, seq)

    def run(self) -> None:
        from primerl.inference.staged_load import StagedLoad

        start = time.perf_counter()
        try:
            self.load = StagedLoad(self.model)
            if self.header.kind == data_pb2.WEIGHT_UPDATE_KIND_FULL:
                self.load.load(self._full_tensors())
                self.host_source = self.payload_path
            else:
                self._wait_for(self.num_bytes)
                payload = map_shared(self.payload_path, self.num_bytes)
                changed = self.decode_delta(payload, self.header.SerializeToString())
                self.load.load(iter(list(self.with_siblings(changed).items())))
                self.host_entries = changed
            state = PayloadControl.LOADED
        except BaseException as exc:  # reported to the daemon (primerl_stage_result), which refuses or reloads
            self.error = exc
            state = PayloadControl.DISCARDED if isinstance(exc, StageAborted) else PayloadControl.FAILED
            if not isinstance(exc, (StageAborted, WeightUpdateInvalid)):
                logger.warning("staged load of transfer %d failed: %r", self.seq, exc, exc_info=True)
            self.release()
        self.load_ms = (time.perf_counter() - start) * 1000.0
        self.control.write(PayloadControl.STAGE_STATE, state)

    def release(self) -> None:
        """Free the shadow and the tensors this load holds."""
        if self.load is not None:
            self.load.release()
        self.load, self.host_entries = None, {}

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor viewing the file) of a FULL payload, each once its bytes are final, in payload order."""
        self._wait_for(8)
        payload = map_shared(self.payload_path, self.num_bytes)
        header_len = int.from_bytes(payload[:8], "little")
        self._wait_for(min(8 + header_len, self.num_bytes))
        try:
            entries = parse_header(payload[: 8 + header_len], total_bytes=self.num_bytes)
        except TensorFrameError as exc:
            raise full_update_invalid(exc) from None
        check_against(
            {n: (e.dtype, list(e.shape)) for n, e in entries.items()},
            self.manifest,
            require_all=True,
            what="full update",
        )
        for entry in sorted(entries.values(), key=lambda e: e.start):
            self._wait_for(entry.end)
            tensor = entry_tensor(payload, entry)
            self.host_entries[entry.name] = tensor
            yield entry.name, tensor

    def _wait_for(self, num_bytes: int) -> None:
        """Until ``num_bytes`` of the payload are final. `StageAborted` when the transfer is abandoned or replaced,
        when no byte arrived for ``stall_timeout_s``, or when the load is discarded."""
        control = self.control
        ready = -1
        deadline_s = 0.0
        while True:
            if self.stop.is_set():
                raise StageAborted(f"transfer {self.seq}: the staged load was discarded")
            if control.read(PayloadControl.SEQ) != self.seq:
                raise StageAborted(f"transfer {self.seq}: replaced by another transfer")
            state = control.read(PayloadControl.WRITER_STATE)
            now_ready = control.read(PayloadControl.BYTES_READY)
            if now_ready >= num_bytes:
                return
            if state == PayloadControl.ABORTED:
                raise StageAborted(f"transfer {self.seq}: abandoned at {now_ready} of {self.num_bytes} bytes")
            now_s = time.monotonic()
            if now_ready != ready:
                ready, deadline_s = now_ready, now_s + self.stall_timeout_s
            elif now_s > deadline_s:
                raise StageAborted(f"transfer {self.seq}: no byte for {self.stall_timeout_s:g} s")
            time.sleep(STAGE_POLL_S)
