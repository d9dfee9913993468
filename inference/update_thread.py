"""The inference daemon's weight thread: it owns the ``WeightSubscriber`` (ZMQ sockets are single-threaded), says
HELLO again under each new registration, and applies each update with ``PolicyUpdater``, whose engine calls go to
the event loop (``AsyncEngineOps``).

An update: ``PolicyUpdater.preload`` (checks, waits for the staged load) -> pause generation -> ``apply`` -> point
the served policy name at the new adapter (LoRA) -> resume; then WEIGHT_ACK with ``apply_ms`` (from the update's
arrival to the resume). Pause to resume is the update's generation pause (``update_pause_ms``, logged with
``weight update live``). ``pause_mode`` is "keep" on GPUs (in-flight requests continue on the new weights) and
"wait" on CPU (they finish first: keep-mode pauses crash the CPU engine on requests with a per-request seed). A
refused update (``UpdateRefused``) is acknowledged with its error, remembered, and the previous version keeps
serving; any other failure leaves the engine in an unknown state: it is reported (``fatal_error``) and the thread
ends. An update holds the engine core while it is applied (``update_began_s``): the engine watchdog allows it
``UPDATE_BUSY_FACTOR`` times the longest of the last updates (`busy_limit_s`)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from primerl.inference.engine_ops import AsyncEngineOps, EngineCallCancelled, EngineCallTimeout
from primerl.inference.update_checks import UpdateRefused
from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import bind_context, get_logger

if TYPE_CHECKING:
    from primerl.client.control import ControlClient
    from primerl.client.weights import WeightSubscriber
    from primerl.configs.inference import InferenceConfig
    from primerl.inference.metrics import InferenceFamilies
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.server import InferenceServer

log = get_logger("primerl.inference")

DRAIN_TIMEOUT_S = 120.0
"""Longest wait for in-flight requests to finish before an update in "wait" pause mode; the update is then
refused (the broker sends it again)."""
_REFUSED = object()
"""What `WeightUpdateThread._in_engine` returns for an update it refused."""
UPDATE_BUSY_FACTOR = 4.0
UPDATE_BUSY_HISTORY = 16
"""An update holding the engine counts as a stall past ``UPDATE_BUSY_FACTOR`` x the longest of the last
``UPDATE_BUSY_HISTORY`` updates (at least one stall timeout): an engine stopped in the middle of an update is found
within a few update times, not after 10 stall timeouts (44 s at a 4 s timeout in the chaos run)."""
RECEIVE_POLL_S = 0.5
MAX_REMEMBERED_REFUSALS = 16
BROKER_ERROR_BACKOFF_S = 5.0


class WeightUpdateThread(threading.Thread):
    """See the module docstring. ``stop``: set when the daemon stops (the thread ends within ``RECEIVE_POLL_S``, or
    5 s when blocked sending to an absent broker); ``on_applied``: called after each update applied."""

    def __init__(
        self,
        config: InferenceConfig,
        control: ControlClient,
        updater: PolicyUpdater,
        ops: AsyncEngineOps,
        server: InferenceServer,
        metrics: InferenceFamilies,
        *,
        stop: threading.Event,
        on_applied: Callable[[], None],
    ):
        self.config, self.control, self.updater, self.ops = config, control, updater, ops
        self.server, self.metrics = server, metrics
        self._stopping, self._on_applied = stop, on_applied
        self.fatal_error: str | None = None
        self.update_began_s: float | None = None  # the update under way holds the engine core: not a stall
        self._update_seconds: collections.deque[float] = collections.deque(maxlen=UPDATE_BUSY_HISTORY)
        self._refused: collections.OrderedDict[tuple[int, str], Any] = collections.OrderedDict()
        self._served_adapter_name: str | None = None
        super().__init__(name="weights", daemon=True)

    def busy_limit_s(self, stall_timeout_s: float) -> float | None:
        """How long an update may hold the engine before its silence counts: a few times the longest of the
        last updates, at least one stall timeout; None before the first (the watchdog's own bound)."""
        if not self._update_seconds:
            return None
        return max(stall_timeout_s, UPDATE_BUSY_FACTOR * max(self._update_seconds))

    def _subscribe(self, subscriber: WeightSubscriber | None, worker_id: str, endpoint: str) -> WeightSubscriber:
        """``subscriber`` while it is the current registration's, else a new one that said HELLO."""
        from primerl.client.weights import WeightSubscriber

        if subscriber is not None and subscriber.worker_id == worker_id and subscriber.endpoint == endpoint:
            return subscriber
        if subscriber is not None:
            log.info(
                "registered again: resubscribing to weights",
                worker_id=worker_id,
                policy_version=self.updater.policy_version,
            )
            subscriber.close()
        # Chunked updates are written straight into the updater's shared payload files: the engine's worker reads
        # them there, with no further copy, and loads a FULL update as its chunks arrive.
        subscriber = WeightSubscriber(
            endpoint,
            self.config.broker.run_token,
            worker_id,
            payload_sink=self.updater,
            outage_s=self.config.broker.outage_s,
            limits=self.control.limits.frames,
            curve=self.control.curve,
            relay_host=self.config.weight_relay_host,
        )
        try:
            subscriber.hello(self.updater.policy_version, lineage=self.updater.lineage)
        except TimeoutError:
            pass  # the broker is away: receive() says HELLO again every few seconds
        return subscriber

    def run(self) -> None:
        from primerl.client.outage import BrokerOutageExceeded
        from primerl.client.weights import WeightPlaneError

        subscriber: WeightSubscriber | None = None
        unreachable_logged = False
        try:
            while not self._stopping.is_set():
                worker_id, registration = self.control.worker_id, self.control.registration
                if worker_id is None or registration is None:  # re-registering
                    self._stopping.wait(0.2)
                    continue
                subscriber = self._subscribe(subscriber, worker_id, registration.weight_endpoint)
                try:
                    update = subscriber.receive(RECEIVE_POLL_S)
                    unreachable_logged = False
                except TimeoutError as exc:  # could not send HELLO or ACK: the broker is away
                    if not unreachable_logged:
                        log.warning("weight plane unreachable; retrying", error=str(exc))
                        unreachable_logged = True
                    continue
                except BrokerOutageExceeded as exc:  # past broker.outage_s: one clear line, then exit non-zero
                    self.fatal_error = str(exc)
                    return
                except WeightPlaneError as exc:  # e.g. UNAUTHENTICATED: will not heal by itself
                    log.error("the broker's weight plane refused this worker", error=str(exc))
                    self.control.report_error(f"weight plane: {exc}")
                    subscriber.close()
                    subscriber = None
                    self._stopping.wait(BROKER_ERROR_BACKOFF_S)
                    continue
                if update is not None:
                    self.update_began_s = began_s = time.monotonic()
                    try:
                        self._handle_update(subscriber, *update)
                    finally:
                        self.update_began_s = None
                        self._update_seconds.append(time.monotonic() - began_s)
        except EngineCallCancelled:  # stopping while an update was being applied: it is not served; nothing to say
            log.info("weight update abandoned: the worker is stopping")
        except Exception as exc:  # a fault in this thread makes the worker useless: report and exit
            log.exception("weight thread failed")
            self.fatal_error = f"weight thread failed: {exc!r}"
        finally:
            if subscriber is not None:
                subscriber.close()

    def _handle_update(
        self, subscriber: WeightSubscriber, header: data_pb2.WeightUpdateHeader, payload: memoryview
    ) -> None:
        received_s = time.monotonic()
        version, kind = int(header.policy_version), data_pb2.WeightUpdateKind.Name(header.kind)
        if self._answered_at_once(subscriber, header):
            return
        log.info(telemetry.WEIGHT_UPDATE_RECEIVED, policy_version=version, kind=kind, payload_bytes=payload.nbytes)
        digest = subscriber.received_digest
        # Checks (the digest computed as the chunks arrived) and the load beside the served weights, which began with
        # the first chunk: generation goes on meanwhile.
        updater = self.updater
        preloaded = self._in_engine(lambda: updater.preload(header, payload, payload_digest=digest), subscriber, header)
        if preloaded is _REFUSED:
            return
        pause_start_s = time.monotonic()
        try:
            self.ops.pause(self.server.pause_mode, DRAIN_TIMEOUT_S)
        except EngineCallTimeout:
            self.ops.resume()
            self.updater.discard()
            message = f"requests in flight did not finish within {DRAIN_TIMEOUT_S:g} s; send the update again"
            self._refuse(
                subscriber, version, common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_INTERNAL, message=message)
            )
            return
        engine_wait_ms = (time.monotonic() - pause_start_s) * 1000.0
        try:
            engine_ms = self._in_engine(
                lambda: updater.apply(header, payload, payload_digest=digest), subscriber, header
            )
            if engine_ms is _REFUSED:
                return
            self.ops.run(self._route_policy_name())
        finally:
            self.ops.resume()
            pause_ms = (time.monotonic() - pause_start_s) * 1000.0
        apply_ms = (time.monotonic() - received_s) * 1000.0
        bind_context(policy_version=version)
        log.info(
            telemetry.WEIGHT_UPDATE_LIVE,
            policy_version=version,
            kind=kind,
            apply_ms=round(apply_ms, 1),
            engine_ms=round(engine_ms, 1),
            update_pause_ms=round(pause_ms, 1),
            engine_wait_ms=round(engine_wait_ms, 1),  # of the pause: waiting for the engine to pause (CPU: requests
            # in flight finish first), generation going on; the rest is the switch itself
        )
        # Served now. Off the pause: the replaced weights are freed and, read in place from a trainer's segment, the
        # host copy takes its own bytes before the acknowledgement, which lets the trainer write that segment again.
        settle_ms = self.updater.settle()
        subscriber.ack(version, applied=True, apply_ms=round(apply_ms), lineage=self.updater.lineage)
        self.metrics.updates_applied.inc()
        self.metrics.policy_version.set(version)
        self.metrics.last_update_ms.set(apply_ms)
        self.metrics.update_pause_ms.observe(pause_ms)
        phases_ms = {"wait_engine": engine_wait_ms, **self.updater.last_phases_ms, "settle": settle_ms}
        for phase, value in phases_ms.items():
            self.metrics.last_update_phase_ms.labels(phase=phase).set(value)
        self._on_applied()

    def _answered_at_once(self, subscriber: WeightSubscriber, header: data_pb2.WeightUpdateHeader) -> bool:
        """Acknowledge, without loading it, an update this worker holds or refused before (True)."""
        version = int(header.policy_version)
        if self.updater.holds(header):
            # Sent again (a refusal made the broker resend its snapshot), or an older lineage's: say what is served.
            # A newer lineage's FULL at or below the served version is not held: a rollback (PolicyUpdater.holds).
            self.updater.discard()
            subscriber.ack(self.updater.policy_version, lineage=self.updater.lineage)
            return True
        refusal = self._refused.get((version, header.digest))
        if refusal is not None:
            # The broker resends its latest snapshot after a refusal until the trainer publishes a good one:
            # answer without pausing the engine or checking the same bytes again.
            self.updater.discard()
            subscriber.ack(version, applied=False, error=refusal)
            return True
        return False

    def _in_engine(
        self, call: Callable[[], Any], subscriber: WeightSubscriber, header: data_pb2.WeightUpdateHeader
    ) -> Any:
        """``call()`` (the updater's preload or apply) and its result; `_REFUSED` once an `UpdateRefused` it raised
        was acknowledged. Any other failure is acknowledged as failed, reported (``fatal_error``) and raised."""
        version = int(header.policy_version)
        try:
            return call()
        except UpdateRefused as exc:  # remembered unless it may pass later: the same bytes are always refused
            self._refuse(subscriber, version, exc.detail())
            if exc.code != common_pb2.ERROR_CODE_OUT_OF_ORDER:
                self._refused[(version, header.digest)] = exc.detail()
                while len(self._refused) > MAX_REMEMBERED_REFUSALS:
                    self._refused.popitem(last=False)
            return _REFUSED
        except EngineCallCancelled:
            raise
        except Exception as exc:  # what the engine serves is unknown: reported, and the weight thread ends
            kind = data_pb2.WeightUpdateKind.Name(header.kind)
            self.fatal_error = f"applying {kind} v{version} failed; the served weights are unknown: {exc!r}"
            log.exception("weight update failed", policy_version=version, kind=kind)
            error = common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_INTERNAL, message=self.fatal_error)
            subscriber.ack(version, applied=False, error=error)
            raise

    def _refuse(self, subscriber: WeightSubscriber, version: int, detail: common_pb2.ErrorDetail) -> None:
        self.metrics.updates_refused.inc()
        code = common_pb2.ErrorCode.Name(detail.code)
        log.warning(
            "weight update refused; still serving the previous version",
            policy_version=version,
            code=code,
            error=detail.message,
            served_version=self.updater.policy_version,
        )
        self.control.report_error(f"refused weight update v{version}: {code}: {detail.message}")
        subscriber.ack(version, applied=False, error=detail)

    async def _route_policy_name(self) -> None:
        """Make requests for the served policy name use the current adapter (vLLM looks request.model up in
        `OpenAIServingModels.lora_requests`; /v1/models lists it), or drop it when full weights are served."""
        lora_requests = self.server.serving_models.lora_requests
        current = self.updater.lora_request()
        if self._served_adapter_name is not None and (
            current is None or current.lora_name != self._served_adapter_name
        ):
            lora_requests.pop(self._served_adapter_name, None)
            self._served_adapter_name = None
        if current is not None:
            lora_requests[current.lora_name] = current
            self._served_adapter_name = current.lora_name
