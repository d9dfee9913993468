"""The weight thread's engine calls (``primerl.inference.engine_ops``): bounded, and cancelled at once when the
worker stops. A stop that arrived while an update waited for the engine used to wait out the weight thread's
10 s join (the engine core was already gone, so the pause never completed), and `primerl rl`'s Ctrl-C then
killed the inference worker after 30 s. The engine here is a small asyncio object with the two methods used; the
real vLLM path is covered by the inference and launcher tests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from primerl.inference.engine_ops import AsyncEngineOps, EngineCallCancelled, EngineCallTimeout


class NeverDrains:
    """An engine whose pause never completes (requests that never finish, or an engine core that is gone)."""

    def __init__(self) -> None:
        self.resumed = 0

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        await asyncio.Event().wait()

    async def resume_generation(self) -> None:
        self.resumed += 1


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _pause_in_thread(ops: AsyncEngineOps, timeout_s: float) -> tuple[threading.Thread, list]:
    outcome: list = []

    def call() -> None:
        started = time.monotonic()
        try:
            ops.pause("wait", timeout_s)
            outcome.append(("returned", time.monotonic() - started))
        except Exception as exc:  # noqa: BLE001 - the test looks at which one
            outcome.append((type(exc).__name__, time.monotonic() - started))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, outcome


def test_a_call_past_its_bound_is_cancelled_and_says_so(loop):
    ops = AsyncEngineOps(NeverDrains(), loop)
    with pytest.raises(EngineCallTimeout, match="did not complete within 0.2 s"):
        ops.pause("wait", 0.2)


def test_stopping_cancels_a_call_under_way_at_once_and_refuses_new_ones(loop):
    engine = NeverDrains()
    ops = AsyncEngineOps(engine, loop)
    thread, outcome = _pause_in_thread(ops, timeout_s=120.0)
    deadline = time.monotonic() + 5
    while not ops._pending and time.monotonic() < deadline:  # the pause is under way on the loop
        time.sleep(0.01)
    assert ops._pending
    ops.cancel_pending()
    thread.join(5)
    assert not thread.is_alive()
    [(kind, waited_s)] = outcome
    assert kind == "EngineCallCancelled" and waited_s < 5, outcome  # not the 120 s bound
    with pytest.raises(EngineCallCancelled):
        ops.resume()  # nothing new reaches the engine once the worker stops
    assert engine.resumed == 0 and not ops._pending
