"""``EngineOps``: what ``PolicyUpdater`` needs from a vLLM engine, and its two implementations.

``LLMEngineOps`` wraps an offline ``vllm.LLM``. ``AsyncEngineOps`` serves the weight thread: vLLM's `AsyncLLM` lives
on the HTTP server's event loop, and the thread that applies weight updates (``primerl.inference.update_thread``)
hands each call to that loop and waits for it, bounded in time. When the worker stops, the calls under way are
cancelled at once (``cancel_pending``): a pause waiting for requests to drain, or any call on an engine that is
already gone, would otherwise hold the stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any, Protocol

from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    import vllm
    from vllm.lora.request import LoRARequest

log = get_logger("primerl.inference")

ENGINE_CALL_TIMEOUT_S = 600.0
"""Longest wait for one engine call made from the weight thread (a full reload of a large model)."""


class EngineOps(Protocol):
    """What `PolicyUpdater` needs from an engine. Every call returns when the engine has done it."""

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Run a worker-extension method on every worker; one result per worker."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def add_lora(self, lora_request: LoRARequest) -> bool: ...

    def remove_lora(self, lora_id: int) -> bool: ...


class LLMEngineOps:
    """`EngineOps` of an offline `vllm.LLM`."""

    def __init__(self, llm: vllm.LLM, *, timeout_s: float | None = 600.0):
        self.llm = llm
        self.timeout_s = timeout_s

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm.llm_engine.remove_lora(lora_id)


def engine_max_lora_rank(vllm_config: Any) -> int | None:
    """The engine's ``max_lora_rank``, or None when it was started without LoRA (``llm.llm_engine.vllm_config``,
    ``async_llm.vllm_config``)."""
    lora_config = getattr(vllm_config, "lora_config", None)
    return None if lora_config is None else int(lora_config.max_lora_rank)


class EngineCallTimeout(TimeoutError):
    """An engine call did not complete in time (it was cancelled on the event loop)."""


class EngineCallCancelled(RuntimeError):
    """The worker is stopping: its engine calls under way were cancelled (``AsyncEngineOps.cancel_pending``)."""


class AsyncEngineOps:
    """`EngineOps` of vLLM's `AsyncLLM` (the server's engine client), for a thread other than the
    event loop's: every call runs on `loop` and blocks the calling thread until it completes (bounded)."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, *, timeout_s: float = ENGINE_CALL_TIMEOUT_S):
        self.engine = engine
        self.loop = loop
        self.timeout_s = timeout_s
        self._pending: set[concurrent.futures.Future] = set()
        self._pending_lock = threading.Lock()
        self._closed = False

    def run(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Run `coro` on the event loop and return its result; `EngineCallTimeout` (after cancelling it)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("AsyncEngineOps blocks: call it from a thread, not from the event loop")
        with self._pending_lock:
            if self._closed:
                coro.close()
                raise EngineCallCancelled("the worker is stopping: engine calls are cancelled")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._pending.add(future)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EngineCallTimeout(f"engine call did not complete within {timeout_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise EngineCallCancelled("the worker is stopping: engine calls are cancelled") from None
        finally:
            with self._pending_lock:
                self._pending.discard(future)

    def cancel_pending(self) -> None:
        """The worker is stopping: cancel the engine calls under way (a pause waits up to DRAIN_TIMEOUT_S, and on
        an engine that is already gone it never completes) and refuse new ones; their callers get
        ``EngineCallCancelled`` at once."""
        with self._pending_lock:
            self._closed = True
            pending = list(self._pending)
        for future in pending:
            future.cancel()

    # ---- EngineOps ---------------------------------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self.run(self.engine.collective_rpc(method, timeout=self.timeout_s, args=tuple(args)))

    def reset_prefix_cache(self) -> None:
        if not self.run(self.engine.reset_prefix_cache()):
            # Only with requests running (keep-mode pause): their blocks stay; new requests recompute.
            log.warning("prefix cache not fully reset: requests hold cached blocks")

    def add_lora(self, lora_request: Any) -> bool:
        return bool(self.run(self.engine.add_lora(lora_request)))

    def remove_lora(self, lora_id: int) -> bool:
        return bool(self.run(self.engine.remove_lora(lora_id)))

    # ---- pausing -----------------------------------------------------------------------------------------------
    def pause(self, mode: str, timeout_s: float) -> None:
        self.run(self.engine.pause_generation(mode=mode, clear_cache=False), timeout_s)

    def resume(self) -> None:
        self.run(self.engine.resume_generation(), 30.0)
