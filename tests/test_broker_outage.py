"""The one way clients wait through a broker outage (``primerl.client.outage``), with a fake clock."""

from __future__ import annotations

import threading

import pytest

from primerl.client.outage import (
    BrokerOutageExceeded,
    OutageStopped,
    OutageWatch,
    retry_through_outage,
)
from primerl.proto import telemetry


class FakeClock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


class RecordingLogger:
    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []

    def _record(self, level):
        return lambda event, **fields: self.events.append((level, event, fields))

    def __getattr__(self, level):
        return self._record(level)


def test_a_watch_logs_at_once_then_every_interval_and_gives_up_past_the_budget():
    clock, logger = FakeClock(), RecordingLogger()
    watch = OutageWatch("CommitStep(3)", 10.0, worker="trainer-rank0", log_every_s=5.0, clock=clock, logger=logger)
    assert not watch.in_outage and watch.remaining_s() == 10.0
    for _ in range(10):  # 0..9 s
        watch.failed(ConnectionError("refused"))
        clock.sleep(1.0)
    waits = [fields["outage_s"] for level, event, fields in logger.events if event == telemetry.WAITING_FOR_THE_BROKER]
    assert waits == [0.0, 5.0]
    assert watch.in_outage and watch.remaining_s() == pytest.approx(0.0)
    clock.sleep(1.0)
    with pytest.raises(BrokerOutageExceeded, match=r"CommitStep\(3\).*broker.outage_s = 10 s.*refused"):
        watch.failed(ConnectionError("refused"))
    assert logger.events[-1][:2] == ("error", "broker outage exceeded the budget")


def test_ok_ends_an_outage_once_and_the_next_one_has_a_fresh_budget():
    clock, logger = FakeClock(), RecordingLogger()
    watch = OutageWatch("heartbeats", 10.0, clock=clock, logger=logger)
    watch.failed("down")
    clock.sleep(8.0)
    watch.ok()
    watch.ok()  # no outage: nothing logged
    assert [event for _, event, _ in logger.events] == [telemetry.WAITING_FOR_THE_BROKER, "broker back"]
    assert logger.events[-1][2]["outage_s"] == 8.0
    assert watch.num_outages == 1 and not watch.in_outage
    clock.sleep(100.0)
    watch.failed("down again")
    clock.sleep(9.0)
    watch.failed("still down")  # 9 s into the second outage: within budget
    assert watch.num_outages == 2


def test_retry_through_outage_retries_only_healable_errors_until_success():
    clock = FakeClock()
    watch = OutageWatch("ListWorkers", 30.0, clock=clock, logger=RecordingLogger())
    calls = []

    def flaky():
        calls.append(clock())
        if len(calls) < 4:
            raise ConnectionError("broker restarting")
        return "workers"

    seen = []
    assert (
        retry_through_outage(flaky, watch, (ConnectionError,), sleep=clock.sleep, on_failure=seen.append) == "workers"
    )
    assert len(calls) == 4 and len(seen) == 3
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps == sorted(gaps) and gaps[0] == pytest.approx(0.1)  # capped exponential backoff
    assert not watch.in_outage

    def refused():
        raise ValueError("bad request")

    with pytest.raises(ValueError):
        retry_through_outage(refused, watch, (ConnectionError,), sleep=clock.sleep)


def test_retry_through_outage_gives_up_past_the_budget_and_when_stopped():
    clock = FakeClock()

    def down():
        raise ConnectionError("down")

    watch = OutageWatch("Register", 5.0, clock=clock, logger=RecordingLogger())
    with pytest.raises(BrokerOutageExceeded):
        retry_through_outage(down, watch, (ConnectionError,), sleep=clock.sleep)
    assert 5.0 < clock() - 100.0 < 8.0

    stop = threading.Event()
    stop.set()
    with pytest.raises(OutageStopped):
        retry_through_outage(
            down, OutageWatch("Register", 5.0, logger=RecordingLogger()), (ConnectionError,), stop_event=stop
        )


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget_s"):
        OutageWatch("x", 0)


def test_a_call_the_broker_cancels_as_it_shuts_down_is_an_outage_to_wait_through():
    """Found by CI: a call that reaches a broker as it stops for a restart can end CANCELLED (details "CANCELLED"),
    not UNAVAILABLE (measured with real gRPC, 3 threads calling while a server stops with a 0.5 s grace: 12
    CANCELLED in 20 stops); an orchestrator's ListWorkers that ended so stopped the run instead of waiting for the
    broker. It is an outage like UNAVAILABLE; this client cancels none of its unary calls itself."""
    import grpc

    from primerl.client.broker_errors import BrokerError, BrokerUnavailable, broker_error

    class Ended(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return self._details

    cancelled = broker_error(Ended(grpc.StatusCode.CANCELLED, "CANCELLED"), "ListWorkers", "127.0.0.1:1")
    assert isinstance(cancelled, BrokerUnavailable) and "unreachable" in str(cancelled)
    refused = broker_error(Ended(grpc.StatusCode.PERMISSION_DENIED, "wrong run token"), "ListWorkers", "h:1")
    assert type(refused) is BrokerError  # a refusal is not an outage
    clock, results = FakeClock(), [cancelled, "workers"]

    def list_workers() -> str:
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    watch = OutageWatch("ListWorkers", 30.0, clock=clock, logger=RecordingLogger())
    assert retry_through_outage(list_workers, watch, (BrokerUnavailable,), sleep=clock.sleep) == "workers"
