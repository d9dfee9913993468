"""primerl's vLLM plugin (entry point group ``vllm.general_plugins``): loaded by vLLM in each of its processes.

It changes vLLM only when primerl-infer asked for it through the environment (any other use of vLLM in the same
environment is left alone); primerl-infer sets the first three on CPU (``primerl.inference.engine``):

- ``PRIMERL_VLLM_BUSY_LOOP_S``: how long vLLM's shared-memory message queues spin (``sched_yield``) after a read
  before they sleep on their notification socket (vLLM: 1 s, no setting; primerl-infer: 0.05 s, so that the idle
  engine leaves the cores to the trainer). 0 is worse: a reader that always sleeps sometimes misses its
  notification and waits for vLLM's 5 s re-check.
- ``PRIMERL_VLLM_CPU_EXECUTOR=uni``: a CPU engine with one worker runs it inside the engine-core process (vLLM's
  "uni" executor) instead of a third process: each decode step is a call, not two queue hops. The worker's own
  OpenMP set-up, the reason vLLM forces a separate process, is already done by ``primerl.runtime.cpu_budget``.
- ``PRIMERL_VLLM_CPU_START_METHOD=fork`` (with "uni" only): the engine core is forked from primerl-infer instead of
  spawned, so it does not import vLLM and torch again; ``spawn`` goes back to vLLM's choice.
- ``PRIMERL_INFER_PID``: a vLLM process spawned by that daemon ends with SIGKILL when the daemon dies (a forked one
  is covered by ``primerl.runtime.parent_death.install_fork_hook``).
"""

from __future__ import annotations

import logging
import os

BUSY_LOOP_ENV = "PRIMERL_VLLM_BUSY_LOOP_S"
EXECUTOR_ENV = "PRIMERL_VLLM_CPU_EXECUTOR"
START_METHOD_ENV = "PRIMERL_VLLM_CPU_START_METHOD"
INFER_PID_ENV = "PRIMERL_INFER_PID"

logger = logging.getLogger("primerl.inference.vllm_plugin")


def register() -> None:
    """vLLM calls this in every process it starts (API server, engine core, workers) before their queues exist."""
    die_with_the_daemon()
    if os.environ.get(EXECUTOR_ENV) == "uni":
        keep_uniproc_executor_on_cpu()
    value = os.environ.get(BUSY_LOOP_ENV)
    if value is None or value == "":
        return
    try:
        busy_loop_s = float(value)
        if not busy_loop_s >= 0:
            raise ValueError
    except ValueError:
        logger.warning("%s=%r is not a number of seconds >= 0; vLLM's default is kept", BUSY_LOOP_ENV, value)
        return
    set_queue_busy_loop(busy_loop_s)


def die_with_the_daemon() -> bool:
    """In a process spawned by primerl-infer (``PRIMERL_INFER_PID`` is its parent): end with it. Returns True
    when armed."""
    value = os.environ.get(INFER_PID_ENV, "")
    if not value.isdigit() or int(value) == os.getpid() or int(value) != os.getppid():
        return False
    from primerl.runtime.parent_death import die_with_parent

    die_with_parent(int(value))
    return True


def set_queue_busy_loop(busy_loop_s: float) -> bool:
    """Make vLLM's shared-memory queue readers created from now on spin for ``busy_loop_s`` after a read.
    Returns False (and changes nothing) if this vLLM has no such parameter."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    init = getattr(getattr(shm_broadcast, "SpinCondition", None), "__init__", None)
    defaults = getattr(init, "__defaults__", None)
    code = getattr(init, "__code__", None)
    names = code.co_varnames[: code.co_argcount] if code is not None else ()
    if not defaults or not names or names[-1] != "busy_loop_s":
        logger.warning(
            "this vLLM has no SpinCondition(busy_loop_s=...) as its last parameter: %s is ignored", BUSY_LOOP_ENV
        )
        return False
    init.__defaults__ = defaults[:-1] + (busy_loop_s,)
    return True


def keep_uniproc_executor_on_cpu() -> bool:
    """Let a one-worker CPU engine run its worker inside the engine-core process ("uni" executor).

    vLLM's CPU platform turns "uni" into "mp" whenever the engine core has its own process, so each step's
    scheduler output crosses a shared-memory queue to a third process and both sides spin on it. With the worker
    in the engine core the step is a function call. Returns False (and changes nothing) if this vLLM's CPU
    platform has no ``check_and_update_config``."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return False
    original = CpuPlatform.__dict__.get("check_and_update_config")
    if original is None or getattr(original, "__primerl_uniproc__", False):
        return original is not None
    original_fn = original.__func__

    def check_and_update_config(cls, vllm_config):  # type: ignore[no-untyped-def]
        parallel = vllm_config.parallel_config
        wanted_uni = parallel.distributed_executor_backend in (None, "uni") and parallel.world_size == 1
        original_fn(cls, vllm_config)
        if wanted_uni and parallel.distributed_executor_backend == "mp":
            parallel.distributed_executor_backend = "uni"
            if os.environ.get(START_METHOD_ENV) == "fork":
                # vLLM's CPU platform sets spawn for the multiprocess executor's workers; with none, the engine
                # core may be forked from this process: no second import of vLLM and torch (~5 s on 2 cores).
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config.__primerl_uniproc__ = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True
