"""The shared payload files of an inference worker's updates, the transfer being received into them, and the
worker's staged load of it: `PolicyUpdater`'s collaborator (``primerl.inference.policy_updates``).

FULL and DELTA payloads are written as they arrive into shared-memory files (``primerl.inference.shared_payload``;
only a path crosses ``collective_rpc``), and the worker loads the update beside the served weights meanwhile
(``primerl.inference.staged_load``, started by `PayloadTransfers.start_load`). Two files are used in turn: a
transfer is always written into the one the worker's host copy does not view (``HOST_VIEWS``). On the same-host road
the payload lies in a trainer's segment instead, and the file carries only the control words (``payload_path``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.inference.shared_payload import PayloadControl, SharedPayload, remove_stale_files
from primerl.inference.update_checks import refusal_from_worker_error
from primerl.proto.v1 import data_pb2
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    from primerl.inference.engine_ops import EngineOps

log = get_logger("primerl.inference.policy_updates")

__all__ = ["STAGE_STALL_TIMEOUT_S", "STAGE_TIMEOUT_S", "PayloadTransfers", "Transfer"]

STAGE_STALL_TIMEOUT_S = 120.0
"""A staged load gives up when no byte of its payload arrived for this long (the daemon drops a stalled transfer
itself much sooner: ``WeightSubscriber.stall_timeout_s``)."""
STAGE_TIMEOUT_S = 600.0
"""Longest wait for a staged load once its payload is complete (as long as an engine call)."""
STAGE_POLL_S = 0.001
"""How often `preload` looks whether the staged load has finished (in the shared file's control words)."""
STAGE_PROBE_S = 1.0
"""How often, while it waits, `preload` asks the engine itself about the staged load (a dead engine raises)."""


@dataclass
class Transfer:
    """One payload in a shared file: its transfer number, and whether the worker loads it beside the served weights
    (``staged_header``: the serialized header it was staged for)."""

    file: SharedPayload
    seq: int
    view: memoryview
    complete: bool = False
    staged_header: bytes | None = None
    # The same-host road: the payload lies in this file (a trainer's shared segment; ``view`` maps it) and ``file``
    # carries only the control words. Empty: the payload is in ``file``.
    payload_path: str = ""

    @property
    def num_bytes(self) -> int:
        return self.view.nbytes

    @property
    def path(self) -> str:
        """The file the worker reads the payload from."""
        return self.payload_path or self.file.path

    def holds(self, view: memoryview) -> bool:
        """``view`` is this transfer's payload (its buffer: the shared file's mapping, or the trainer segment's)."""
        if self.payload_path:
            return isinstance(view, memoryview) and view.obj is self.view.obj
        return self.file.holds(view)

    def finish(self, complete: bool) -> None:
        self.complete = complete
        self.file.finish(complete)


class PayloadTransfers:
    """The files, the current transfer (`current`) and its staged load. Not thread-safe: the updater's lock
    serialises its calls."""

    def __init__(
        self,
        engine: EngineOps,
        staging_dir: str | Path | None,
        *,
        streaming: bool,
        stall_timeout_s: float,
        stage_timeout_s: float,
        engine_workers: Callable[[], int],
    ) -> None:
        """``streaming``: stage FULL and DELTA updates when the engine can (False: `apply` always reloads in place);
        ``engine_workers()``: how many workers share the engine (staging needs one)."""
        self.engine = engine
        self.staging_dir = staging_dir
        self.streaming = streaming
        self.stall_timeout_s = stall_timeout_s
        self.stage_timeout_s = stage_timeout_s
        self._engine_workers = engine_workers
        self.files: list[SharedPayload] = []
        self.current: Transfer | None = None
        self.unsupported: str | None = None
        """Why this engine cannot stage (None: it can, or it is not known yet)."""
        self._seq = 0

    def begin(self, num_bytes: int) -> Transfer:
        """A new transfer into a shared file the worker's host copy does not view (the current one's staged load is
        dropped, and the current transfer, if unfinished)."""
        if self.current is not None:
            self.discard_load()
            if self.current is not None and not self.current.complete:
                self.current.finish(complete=False)
        self.current = None
        file = next((f for f in self.files if not f.control.read(PayloadControl.HOST_VIEWS)), None)
        if file is None:
            if len(self.files) >= 2:  # only one file is ever viewed by the host copy: this is a bug
                log.warning(
                    "every shared payload file is in use by the worker's host copy; adding one",
                    num_files=len(self.files),
                )
            if not self.files:
                removed = remove_stale_files(self.staging_dir)
                if removed:
                    log.info("removed shared payload files of dead processes", paths=[str(p) for p in removed])
            file = SharedPayload(self.staging_dir)
            self.files.append(file)
        view = file.buffer(num_bytes)
        self._seq += 1
        file.begin(self._seq)
        self.current = Transfer(file, self._seq, view)
        return self.current

    def progress(self, num_bytes: int) -> None:
        """The first ``num_bytes`` of the current payload are in its buffer (the staged load may read them)."""
        if self.current is not None:
            self.current.file.publish(num_bytes)

    def end(self, complete: bool) -> None:
        """The current payload is complete, or was dropped (its staged load then stops by itself)."""
        transfer = self.current
        if transfer is not None:
            transfer.finish(complete)
            if not complete:
                self.current = None

    def holding(self, payload: Any) -> Transfer:
        """The complete transfer holding ``payload``: the one it was received into, else a new one it is copied
        into."""
        view = memoryview(payload)
        transfer = self.current
        if transfer is None or not transfer.holds(view) or transfer.num_bytes != view.nbytes:
            log.debug("payload copied into a shared file (it was not received there)", num_bytes=view.nbytes)
            transfer = self.begin(view.nbytes)
            transfer.file.write(view)
        if not transfer.complete:  # assembled through `staging_buffer`: no progress was published
            transfer.file.publish(transfer.num_bytes)
            transfer.finish(complete=True)
        return transfer

    def start_load(self, transfer: Transfer, header: data_pb2.WeightUpdateHeader) -> None:
        """Ask the worker to load ``transfer`` beside the served weights (`primerl_stage_begin`): it reads the shared
        file as the bytes arrive. Nothing happens when staging is off or the engine cannot stage (then `apply`
        reloads in place, generation paused for the whole load)."""
        if not self.streaming or self.unsupported is not None or transfer.staged_header is not None:
            return
        num_workers = self._engine_workers()
        if num_workers != 1:
            self.unsupported = f"{num_workers} workers share the engine"
        else:
            header_bytes = header.SerializeToString()
            try:
                results = self.engine.collective_rpc(
                    "primerl_stage_begin",
                    (
                        transfer.file.path,
                        transfer.num_bytes,
                        transfer.seq,
                        header_bytes,
                        self.stall_timeout_s,
                        transfer.payload_path,
                    ),
                )
            except Exception as exc:  # the engine's fault shows again, where it matters, when the update is applied
                log.warning("could not start a staged load; the update will be reloaded in place", error=repr(exc))
                return
            result = results[0]
            if result.get("staging"):
                transfer.staged_header = header_bytes
                return
            if not result.get("permanent"):
                log.warning("staged load not started; the update will be reloaded in place", reason=result["reason"])
                return
            self.unsupported = str(result["reason"])
        log.info(
            "weight updates are reloaded in place, with generation paused for the whole load",
            reason=self.unsupported,
        )

    def await_load(self, transfer: Transfer) -> None:
        """Until the worker's staged load of ``transfer`` has finished, bounded. `UpdateRefused` when the update does
        not fit the model; for any other failure the staged load is dropped (`apply` then reloads in place)."""
        now_s = time.monotonic()
        deadline_s, probe_s = now_s + self.stage_timeout_s, now_s + STAGE_PROBE_S
        state = None
        while now_s < deadline_s:
            state = transfer.file.control.stage(transfer.seq)
            if state in (PayloadControl.LOADED, PayloadControl.FAILED, PayloadControl.DISCARDED):
                break
            if now_s > probe_s:  # the engine answers (a dead one raises), and still has this load
                probe_s = now_s + STAGE_PROBE_S
                if self.engine.collective_rpc("primerl_stage_result", (transfer.seq,))[0]["state"] == "none":
                    break
            time.sleep(STAGE_POLL_S)
            now_s = time.monotonic()
        if state == PayloadControl.LOADED:
            return
        result = self.engine.collective_rpc("primerl_stage_result", (transfer.seq,))[0]
        if result.get("refusal"):
            refusal = refusal_from_worker_error(RuntimeError(result["refusal"]))
            if refusal is not None:
                raise refusal
        reason = (
            result.get("error")
            or result.get("refusal")
            or (
                f"not loaded within {self.stage_timeout_s:g} s"
                if state is None or state == PayloadControl.LOADING
                else "discarded"
            )
        )
        log.warning("staged load failed; the update is reloaded in place", transfer=transfer.seq, reason=reason)
        self.discard_load()
        transfer.staged_header = None

    def discard_load(self) -> None:
        """Drop the staged load of the current transfer (its thread in the worker stops)."""
        transfer = self.current
        if transfer is None or transfer.staged_header is None:
            return
        transfer.staged_header = None
        if transfer.file.control.stage(transfer.seq) in (PayloadControl.LOADING, None):
            transfer.finish(complete=False)  # the loading thread sees it and stops; the file is not reused before
            self.current = None
            return
        if not self.engine.collective_rpc("primerl_stage_discard")[0]:
            log.warning("the worker's staged load did not stop", transfer=transfer.seq)

    def close(self) -> None:
        """Remove the shared payload files (new ones are made on the next transfer)."""
        if self.current is not None:
            self.current.finish(complete=False)
            self.current = None
        for file in self.files:
            file.close()
        self.files = []
