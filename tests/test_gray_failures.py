"""Gray failures, fast: the engine watchdog's clock and probe loop, /health while stalled, the broker keeping a
worker's `serving: false` as state, and the orchestrator's worker list taking it out of rotation and back, through
a real in-process broker over gRPC (the daemons end to end: `test_gray_failures_e2e.py`)."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from support.broker import BrokerHarness
from support.probes import wait_until

from primerl.broker.registry import WorkerRegistry
from primerl.client.broker_errors import BrokerUnavailable
from primerl.client.control import ControlClient
from primerl.inference.engine_watchdog import BUSY_LIMIT_FACTOR, EngineWatchdog, StallClock, probe_interval_s
from primerl.inference.server import StalledHealthMiddleware
from primerl.orchestrator.endpoints import EndpointWatcher, InferenceWorkers
from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2, control_pb2
from primerl.runtime.config_common import BrokerClientConfig

TOKEN = "gray-failures-token"


# ------------------------------------------------------------------------------------------------ watchdog
def test_the_stall_clock_stalls_once_past_the_timeout_and_recovers_on_the_answer():
    clock = StallClock(stall_timeout_s=5.0)
    assert clock.check(100.0) is None  # nothing sent yet
    clock.sent(100.0)
    assert clock.check(104.9) is None
    assert clock.check(105.0) == pytest.approx(5.0)
    assert clock.check(110.0) is None  # one transition per stall
    assert clock.answered(112.0) == pytest.approx(7.0)
    assert clock.stalled_since is None and clock.answered(113.0) is None


def test_time_spent_busy_is_never_a_stall():
    clock = StallClock(stall_timeout_s=5.0)
    clock.sent(0.0)
    for now in range(1, 30):  # a weight update holding the engine core for 29 s
        clock.busy(float(now))
        assert clock.check(float(now)) is None
    assert clock.check(33.0) is None and clock.check(34.0) == pytest.approx(5.0)  # 5 s after the update


def test_an_engine_that_stops_in_the_middle_of_an_update_is_found_after_the_busy_limit():
    """Found by the chaos run: a weight update that never returns (its engine core stopped) held the stall clock
    forever. A busy spell stops the clock for at most BUSY_LIMIT_FACTOR stall timeouts."""
    clock = StallClock(stall_timeout_s=4.0)
    limit = BUSY_LIMIT_FACTOR * 4.0
    clock.sent(0.0)
    now = 0.0
    while now < limit + 4.0 - 0.5:
        now += 0.5
        clock.busy(now)
        assert clock.check(now) is None, now
    now += 0.5
    clock.busy(now)
    assert clock.check(now) == pytest.approx(4.0)  # busy_limit + stall_timeout after the update began
    assert clock.answered(now + 2.0) == pytest.approx(2.0)
    # a new busy spell after an answer gets its whole limit again
    clock.sent(100.0)
    clock.busy(100.0)
    clock.idle()
    for second in range(120, 120 + int(limit)):  # a second spell of nearly the whole limit: no stall
        clock.busy(float(second))
        assert clock.check(float(second)) is None, second


def test_an_engine_already_stopped_when_an_update_comes_is_found_after_the_stall_timeout():
    """Found by the chaos run: the engine core stopped, then a weight update came; the update excused the
    unanswered probe, and the stall was reported after the busy limit plus the timeout (44 s at a 4 s timeout).
    The engine core takes its input in order, so only a probe sent after the update began is excused."""
    clock = StallClock(stall_timeout_s=4.0)
    clock.sent(0.0)  # unanswered: the engine core stopped before the update
    for now in (1.0, 2.0, 3.0, 3.9):
        clock.busy(now, since=1.0)
        assert clock.check(now) is None
    clock.busy(4.0, since=1.0)
    assert clock.check(4.0) == pytest.approx(4.0)  # the probe's own timeout, update or not
    # a probe sent during the update (queued behind it) is excused for the spell, up to the busy limit
    healthy = StallClock(stall_timeout_s=4.0)
    healthy.sent(2.0)
    for now in range(3, 30):
        healthy.busy(float(now), since=1.0)
        assert healthy.check(float(now)) is None, now
    healthy.idle()
    assert healthy.check(32.9) is None and healthy.check(33.0) == pytest.approx(4.0)
    # the spell's limit counts from when it began, not from when the watchdog first saw it
    late = StallClock(stall_timeout_s=1.0)
    late.sent(5.0)
    for now in (5.0, 7.0, 9.5, 10.0, 10.5):  # first seen at 5; the 10 s limit of a spell that began at 0 ends at 10
        late.busy(now, since=0.0)
    assert late.check(10.4) is None and late.check(10.5) == pytest.approx(1.0)  # not at 15 + 1


def test_a_busy_spell_lasts_at_most_the_limit_it_is_given():
    """The daemon gives a limit learnt from its recent updates (4 x the longest, at least the stall timeout):
    an engine stopped in the middle of an update is found about a timeout after that, not after 10 timeouts."""
    clock = StallClock(stall_timeout_s=4.0)
    clock.sent(10.5)  # during an update that began at 10
    now = 10.5
    while now < 10.0 + 4.0:  # the limit: the updates took 0.15 s, so max(4, 4 x 0.15) = 4 s
        clock.busy(now, since=10.0, limit_s=4.0)
        assert clock.check(now) is None, now
        now += 0.5
    while clock.check(now) is None:
        clock.busy(now, since=10.0, limit_s=4.0)
        now += 0.5
        assert now < 30.0
    assert now <= 10.0 + 4.0 + 4.0 + 0.5  # found one timeout after the limit (the old bound: 10 + 40 + 4)
    # a limit above the watchdog's own bound is held to it
    capped = StallClock(stall_timeout_s=1.0)
    capped.sent(0.0)
    for now in (0.0, 5.0, 9.5, 10.0):
        capped.busy(now, since=0.0, limit_s=1000.0)
    assert capped.check(10.4) is None and capped.check(10.5) == pytest.approx(1.0)


def test_bad_settings_are_refused_and_the_interval_is_bounded():
    with pytest.raises(ValueError, match="stall_timeout_s must be > 0"):
        StallClock(0)
    assert probe_interval_s(0.5) == 0.1 and probe_interval_s(5) == 0.5 and probe_interval_s(600) == 2.0


def test_the_watchdog_finds_a_hung_engine_within_its_bound_and_sees_it_recover():
    """The probe hangs (an engine core that stopped) for 1.5 s with a timeout of 0.4 s: one stall found within
    the timeout plus one interval, then its recovery once the probe answers; an answering probe never stalls."""
    changes: list[tuple[bool, float, float]] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        frozen = asyncio.Event()
        frozen.set()
        started = loop.time()

        async def probe() -> bool:
            await frozen.wait()
            return False

        watchdog = EngineWatchdog(
            probe,
            stall_timeout_s=0.4,
            on_change=lambda stalled, s: changes.append((stalled, s, loop.time() - started)),
        )
        stop = asyncio.Event()
        task = loop.create_task(watchdog.run(stop))
        await asyncio.sleep(0.6)
        assert changes == [] and watchdog.stalled_for_s is None
        frozen.clear()
        hung_at = loop.time() - started
        await asyncio.sleep(1.5)
        assert watchdog.stalled_for_s is not None
        frozen.set()
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(task, 2.0)
        assert watchdog.num_stalls == 1
        (stalled, unanswered_s, at_s), (recovered, stalled_s, back_s) = changes
        assert stalled and not recovered
        assert 0.4 <= unanswered_s <= 0.4 + 2 * watchdog.interval_s
        assert at_s - hung_at <= 0.4 + 3 * watchdog.interval_s  # the bound: timeout + a probe interval (+ slack)
        assert 0.8 <= stalled_s <= 1.5
        assert back_s - (hung_at + 1.5) < 0.3

    asyncio.run(scenario())


def test_a_failing_probe_is_an_answer_and_stop_cancels_a_hung_probe():
    async def scenario() -> None:
        async def failing() -> None:
            raise RuntimeError("engine dead")

        changes: list[bool] = []
        watchdog = EngineWatchdog(failing, stall_timeout_s=0.2, on_change=lambda s, _: changes.append(s))
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(watchdog.run(stop))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task, 2.0)
        assert changes == []

        hung = asyncio.Event()
        watchdog = EngineWatchdog(hung.wait, stall_timeout_s=0.2, on_change=lambda s, _: changes.append(s))
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(watchdog.run(stop))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task, 2.0)  # does not wait for the hung probe
        assert changes == [True]

    asyncio.run(scenario())


def test_health_answers_503_with_the_reason_while_stalled():
    reason: list[str | None] = [None]
    calls: list[str] = []

    async def app(scope, receive, send) -> None:
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def request(path: str) -> tuple[int, bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        middleware = StalledHealthMiddleware(app, lambda: reason[0])
        await middleware({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    assert asyncio.run(request("/health"))[0] == 200
    reason[0] = "inference engine stalled: the engine core did not answer a probe for 3.0 s"
    status, body = asyncio.run(request("/health"))
    assert status == 503 and b"did not answer a probe" in body and b'"serving":false' in body
    assert asyncio.run(request("/v1/models"))[0] == 200  # the rest passes (a client may still wait on it)
    assert calls == ["/health", "/v1/models"]


# ------------------------------------------------------------------------------------------------ broker
def test_the_registry_keeps_serving_false_as_state_not_as_errors():
    registry = WorkerRegistry("run-1", heartbeat_interval_s=1.0, liveness=3)
    request = control_pb2.RegisterRequest(
        role=common_pb2.ROLE_INFERENCE, name="infer-0", address="http://h:1", capabilities={"role": "inference"}
    )
    worker_id = registry.register(request).worker_id
    reason = "inference engine stalled: no answer for 3.0 s"

    def beat(*errors: str, not_serving: str = "") -> control_pb2.WorkerInfo:
        request = control_pb2.HeartbeatRequest(worker_id=worker_id, recent_errors=list(errors), not_serving=not_serving)
        registry.heartbeat(request)
        return registry.get_worker(worker_id)

    assert telemetry.SERVING_CAPABILITY not in beat().capabilities
    for _ in range(3):  # sent with every heartbeat while it holds: one line in the errors
        info = beat(not_serving=reason)
    assert info.capabilities[telemetry.SERVING_CAPABILITY] == "false" and info.capabilities["role"] == "inference"
    assert beat("some other error", not_serving=reason).capabilities[telemetry.SERVING_CAPABILITY] == "false"
    assert telemetry.SERVING_CAPABILITY not in beat().capabilities
    errors = list(registry.run_status().recent_errors)
    assert [e for e in errors if "rotation" in e or "stalled" in e] == [
        "infer-0: out of rotation: inference engine stalled: no answer for 3.0 s",
        "infer-0: back in rotation: serving again",
    ], errors
    assert "infer-0: some other error" in errors


def test_inference_workers_drop_a_worker_out_of_rotation_and_take_it_back():
    workers = InferenceWorkers()
    a, b = ("http://a/v1", 3), ("http://b/v1", 3)
    workers.update({"A": a, "B": b}, current_version=3)
    left = workers.update({"B": b}, current_version=3)  # A's snapshot entry is gone while it is out of rotation
    assert [e.worker_id for e in left] == ["A"] and [e.worker_id for e in workers.ready()] == ["B"]
    workers.update({"A": ("http://a/v1", 3), "B": b}, current_version=3)
    assert sorted(e.worker_id for e in workers.ready()) == ["A", "B"]  # same version: serving at once
    workers.update({"B": b}, current_version=4)
    workers.update({"A": ("http://a/v1", 3), "B": ("http://b/v1", 4)}, current_version=4)
    assert [e.worker_id for e in workers.ready()] == ["B"]  # missed an update while stalled: catches up first


# ------------------------------------------------------------------------------------ through a real broker
@pytest.fixture
def broker(tmp_path):
    broker = BrokerHarness(
        tmp_path / "spool", stop_grace_s=0.5, run_token=TOKEN, heartbeat_interval_s=0.2, run_id="gray-test"
    )
    try:
        yield broker
    finally:
        broker.stop()


@pytest.mark.parametrize("role", ["inference", "teacher"])
def test_a_worker_whose_heartbeats_say_not_serving_goes_out_of_rotation_and_back(broker, role):
    """A worker heartbeating `serving: false` (what primerl-infer does while its engine is stalled) leaves the
    orchestrator's snapshot within a heartbeat and a list interval, and comes back once its heartbeats stop
    saying so; the other worker stays throughout. The same for the teacher list."""
    stalled = [""]
    clients = [
        ControlClient(
            BrokerClientConfig(address=broker.grpc_address, run_token=TOKEN),
            role,
            f"{role}-{i}",
            address=f"http://h{i}:1/",
        )
        for i in range(2)
    ]
    orchestrator = broker.client("orchestrator", "orchestrator")
    role_id = common_pb2.ROLE_TEACHER if role == "teacher" else common_pb2.ROLE_INFERENCE
    watcher = EndpointWatcher(
        lambda: orchestrator.list_workers(role_id),
        outage_s=10,
        healable=(BrokerUnavailable,),
        interval_s=0.1,
        what=f"{role} workers",
    )
    logs = []
    try:
        for client in clients:
            client.wait_ready(10)
            client.register()
        orchestrator.wait_ready(10)
        orchestrator.register()
        clients[0].start_heartbeats(lambda: {"not_serving": stalled[0]})
        clients[1].start_heartbeats(lambda: {})
        watcher.start()
        with structlog.testing.capture_logs() as logs:
            wait_until(lambda: len(watcher.snapshot()[1]) == 2, 10, "both workers listed")
            stalled[0] = "inference engine stalled: the engine core did not answer for 3.0 s"
            names = wait_until(
                lambda: (s := watcher.snapshot()[1]) and len(s) == 1 and [w.name for w in s.values()],
                5,
                "the stalled worker out of rotation",
            )
            assert names == [f"{role}-1"]
            stalled[0] = ""
            wait_until(lambda: len(watcher.snapshot()[1]) == 2, 5, "the worker back in rotation")
    finally:
        watcher.stop()
        for client in clients:
            client.close()
        orchestrator.close()
    events = [e["event"] for e in logs]
    assert events.count(f"{role} worker out of rotation") == 1, events
    assert events.count(f"{role} worker back in rotation") == 1, events
    assert watcher.num_out_of_rotation == 1
