"""CPU thread budget of each role: how many threads its math libraries run, and that idle ones sleep.

On a CPU machine the roles share the cores; left alone, torch starts one OpenMP thread per core in every process and
GNU OpenMP threads spin at the end of each parallel region, so a descheduled sibling stalls every small region of a
training step by a scheduler time slice. The budget of a role (``ThreadsConfig``, the ``[<role>.threads]`` table):

- ``num_threads``: intra-op threads of torch and of the OpenMP / MKL / OpenBLAS pools;
- ``num_interop_threads``: torch's inter-op pool;
- ``wait_policy``: ``passive`` (default): ``OMP_WAIT_POLICY=PASSIVE``, ``KMP_BLOCKTIME=0`` (an idle thread sleeps);
- ``cpus``: CPU ids the role's compute threads are bound to (inference: vLLM's ``VLLM_CPU_OMP_THREADS_BIND``;
  the other roles: ``os.sched_setaffinity``).

Defaults (``default_budgets``), from the n CPUs of this process's affinity. On a CPU-only machine the run-level
``cpu_sharing`` picks how the roles share them:

- ``shared`` (default): every core is every compute role's. The trainer and vLLM each run n threads (vLLM bound to
  all n CPUs, one OpenMP thread each); with passive waits a role that waits for the other (for a batch, for new
  weights) sleeps, and the one with work uses every core instead of leaving half of them idle.
- ``split``: each role is held to its half of the cores: whichever finishes its phase first leaves its cores
  idle until the other is done (the earlier default; it gives steadier steps when trainer and vLLM compute at
  the same time on a busy machine).

===============  ==================================  ==================================  =========================
role             CPU-only, ``shared``                CPU-only, ``split``                 with GPUs (either)
===============  ==================================  ==================================  =========================
inference        all n CPUs, one vLLM OpenMP         the first max(1, n // 2) CPUs,      vLLM's own choice (no
                 thread on each                      one vLLM OpenMP thread on each      CPU binding set)
trainer          n threads, unbound (divided         max(1, n - n // 2) threads,         max(1, n // 2) threads
                 between its ranks)                  unbound (divided between ranks)     (divided between ranks)
orchestrator     1 thread (its env workers inherit)  1 thread                            1 thread
broker           1 thread                            1 thread                            1 thread
teacher          inference's CPUs and threads        inference's CPUs and threads        as inference
===============  ==================================  ==================================  =========================

Explicit ``[<role>.threads]`` values win over either. A standalone daemon with no budget set takes every CPU of its
affinity, still with the passive wait policy.
``primerl rl`` fills each role's unset fields with these defaults, writes them into the run's role configs and sets
the environment variables in each child (``role_env``) before any library loads; every daemon then applies its own
config at start (``apply_budget``). Imports neither torch nor vLLM at module level.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from pydantic import Field, field_validator

from primerl.runtime.config_base import BaseConfig

ROLES = ("broker", "trainer", "orchestrator", "inference", "teacher")
ENGINE_ROLES = ("inference", "teacher")
"""Roles that run a vLLM engine: ``cpus`` is vLLM's OpenMP binding, not the process affinity."""
THREAD_COUNT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Environment variables that size the math libraries' thread pools (read when the library loads)."""
VLLM_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
CpuSharing = Literal["shared", "split"]
"""How the roles of one CPU-only machine share its cores (``RLConfig.cpu_sharing``; module doc)."""
CPU_SHARING_DEFAULT: CpuSharing = "shared"


class ThreadsConfig(BaseConfig):
    """CPU thread budget of a role (see `primerl.runtime.cpu_budget`); unset fields take the role's default."""

    num_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads: torch, OpenMP, MKL, OpenBLAS (unset: the role's share of the "
        "CPUs; all of them for a standalone daemon).",
    )
    num_interop_threads: int | None = Field(None, ge=1, description="torch inter-op threads (unset: 1).")
    wait_policy: Literal["passive", "active"] = Field(
        "passive",
        description="OpenMP wait policy: `passive` idle threads sleep at once (right when roles share "
        "cores); `active` they spin (a dedicated machine may gain a little).",
    )
    cpus: list[int] | None = Field(
        None,
        description="CPU ids the role's compute threads are bound to (inference: vLLM's OpenMP binding, "
        "one thread per CPU; other roles: the process affinity). Unset: no binding (vLLM: its own).",
    )

    @field_validator("cpus")
    @classmethod
    def _check_cpus(cls, cpus: list[int] | None) -> list[int] | None:
        if cpus is None:
            return None
        if not cpus or any(c < 0 for c in cpus) or len(set(cpus)) != len(cpus):
            raise ValueError(f"cpus = {cpus} must list distinct CPU ids >= 0 (or be left unset)")
        return cpus


def available_cpus() -> list[int]:
    """The CPU ids this process may run on, sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def default_budgets(
    cpus: Sequence[int], *, gpus: bool, num_trainer_ranks: int = 1, sharing: CpuSharing = CPU_SHARING_DEFAULT
) -> dict[str, ThreadsConfig]:
    """The default budget of every role when all of them run on a machine with these CPUs (module table): on a
    CPU-only machine ``sharing`` says whether trainer and vLLM each get every core (``shared``) or half of them
    (``split``); the trainer's share is divided between its ``num_trainer_ranks`` ranks (each gets at least one
    thread)."""
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPU to split between the roles")
    if sharing not in ("shared", "split"):
        raise ValueError(f'cpu_sharing = {sharing!r}: use "shared" or "split"')
    n = len(cpus)
    half = max(1, n // 2)
    if gpus:
        inference = ThreadsConfig(num_threads=half)
        trainer = ThreadsConfig(num_threads=max(1, half // num_trainer_ranks))
    elif sharing == "shared":
        inference = ThreadsConfig(num_threads=n, cpus=list(cpus))
        trainer = ThreadsConfig(num_threads=max(1, n // num_trainer_ranks))
    else:
        inference = ThreadsConfig(num_threads=half, cpus=list(cpus[:half]))
        trainer = ThreadsConfig(num_threads=max(1, (n - n // 2) // num_trainer_ranks))
    single = ThreadsConfig(num_threads=1)
    return {
        "inference": inference,
        "trainer": trainer,
        "orchestrator": single,
        "broker": single.model_copy(),
        "teacher": inference.model_copy(deep=True),
    }


def fill_budget(explicit: ThreadsConfig | None, default: ThreadsConfig) -> ThreadsConfig:
    """``explicit`` with its unset fields (None, or the default wait policy) taken from ``default``."""
    if explicit is None:
        return default.model_copy()
    values = explicit.model_dump()
    for name, value in default.model_dump().items():
        if values.get(name) is None:
            values[name] = value
    return ThreadsConfig(**values)


def resolved(budget: ThreadsConfig | None, cpus: Sequence[int] | None = None) -> ThreadsConfig:
    """A standalone daemon's budget: unset thread counts become every CPU of its affinity (or of ``cpus``),
    shared by the ranks torchrun started on this machine (``LOCAL_WORLD_SIZE``)."""
    budget = budget or ThreadsConfig()
    num_cpus = len(budget.cpus or cpus or available_cpus())
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return fill_budget(budget, ThreadsConfig(num_threads=max(1, num_cpus // local_ranks), num_interop_threads=1))


def role_env(role: str, budget: ThreadsConfig) -> dict[str, str]:
    """Environment variables that give a child process this budget (set before it loads any math library)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {ROLES}")
    env: dict[str, str] = {}
    num_threads = budget.num_threads
    if role in ENGINE_ROLES and budget.cpus:
        num_threads = len(budget.cpus)  # vLLM runs one OpenMP thread per bound CPU
        env[VLLM_BIND_VAR] = ",".join(str(c) for c in budget.cpus)
    if num_threads is not None:
        env.update({name: str(num_threads) for name in THREAD_COUNT_VARS})
    if budget.wait_policy == "passive":
        env.update(OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    else:
        env.update(OMP_WAIT_POLICY="ACTIVE")
    return env


def apply_budget(
    role: str, budget: ThreadsConfig | None, *, environ: Mapping[str, str] | None = None, log=None
) -> ThreadsConfig:
    """Apply ``budget`` to this process (a daemon calls it first thing); returns the budget applied.

    Sets the environment variables of ``role_env`` (a value already in the environment wins: the launcher's or
    the user's), then, if torch is imported (or importable without vLLM's in-process engine), torch's pools; and
    the affinity for non-inference roles with ``cpus``. The OpenMP variables only take effect when libgomp has
    not been loaded yet, i.e. when this runs before ``import torch``: the launcher sets them in the child's
    environment for that reason.
    """
    # vLLM sizes its own pools (one OpenMP thread per bound CPU, its engine core down to 1 torch thread unless
    # OMP_NUM_THREADS is set): a standalone inference daemon passes on only what its config sets.
    applied = (budget or ThreadsConfig()) if role in ENGINE_ROLES else resolved(budget)
    target = os.environ if environ is None else environ
    for name, value in role_env(role, applied).items():
        if name not in target:
            target[name] = value  # type: ignore[index]
    if applied.cpus and role not in ENGINE_ROLES and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, applied.cpus)
    if role == "trainer" or "torch" in sys.modules:
        set_torch_threads(applied, log=log)
    if log is not None:
        log.info(
            "thread budget",
            role=role,
            num_threads=applied.num_threads,
            num_interop_threads=applied.num_interop_threads,
            wait_policy=applied.wait_policy,
            cpus=applied.cpus,
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        )
    return applied


def set_torch_threads(budget: ThreadsConfig, log=None) -> None:
    """torch's intra-op and inter-op pools to the budget (the inter-op size can only be set once, before any
    inter-op work: a later call keeps what is there and says so)."""
    import torch

    if budget.num_threads is not None:
        torch.set_num_threads(budget.num_threads)
    if budget.num_interop_threads is not None and torch.get_num_interop_threads() != budget.num_interop_threads:
        try:
            torch.set_num_interop_threads(budget.num_interop_threads)
        except RuntimeError as exc:
            if log is not None:
                log.warning(
                    "inter-op threads already started; keeping them",
                    threads=torch.get_num_interop_threads(),
                    error=str(exc),
                )


def describe(budgets: Mapping[str, ThreadsConfig], roles: Iterable[str] = ROLES) -> str:
    """One line per role (of ``roles`` that have a budget), for the launcher's start-up output."""
    parts = []
    for role in (r for r in roles if r in budgets):
        budget = budgets[role]
        where = f" on CPUs {','.join(map(str, budget.cpus))}" if budget.cpus else ""
        parts.append(f"{role} {budget.num_threads}{where}")
    return "threads: " + ", ".join(parts) + f" (OpenMP wait policy {budgets['trainer'].wait_policy})"
