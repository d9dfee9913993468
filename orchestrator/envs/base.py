"""`EnvClient`: the orchestrator's handle of one environment that runs in another interpreter, and the errors
every client raises. The rollout scheduler, the runner, the evals and the commands drive both kinds
(`classic.ClassicEnvClient`, `v1.V1EnvClient`) through this interface only.

Invariants of every client: each request has a deadline; a dead process fails every pending request with
`EnvWorkerDied` (whose message ends with the process's last stderr lines); `ensure_alive()` starts a dead one
again, at most `max_restarts` times; `close()` ends only the client's own process.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from primerl.orchestrator.trajectory import EnvInfo, Example, RolloutGroup, SamplingParams, Split


class EnvWorkerError(RuntimeError):
    """Base of the environment errors."""


class EnvWorkerDied(EnvWorkerError):
    """The environment's process exited (or could not be started); the message holds its last stderr lines."""


class EnvRequestError(EnvWorkerError):
    """The environment answered a request with an error (`error_type`: bad_request, cancelled, or an exception
    name)."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type


class EnvRequestTimeout(EnvWorkerError):
    """No answer within the request's deadline; the request was cancelled in the environment's process."""


@dataclass(frozen=True)
class RolloutRequest:
    """What the groups of one `submit_rollouts` call share."""

    num_rollouts: int
    base_url: str
    model: str
    split: Split = "train"
    api_key: str = "EMPTY"
    sampling: SamplingParams | Mapping[str, Any] | None = None
    max_concurrent: int | None = None
    timeout_s: float | None = None


class EnvClient(Protocol):
    """One environment (`env_id`) served by a process in another interpreter, seen from the orchestrator."""

    env_id: str
    info: EnvInfo | None

    @property
    def num_restarts(self) -> int:
        """Restarts so far (`ensure_alive`)."""
        ...

    @property
    def max_restarts(self) -> int:
        """Restarts allowed before `ensure_alive` gives up."""
        ...

    def start(self) -> EnvInfo:
        """Spawn the process, load the environment; its `EnvInfo`."""
        ...

    def examples(self, split: Split = "train", start: int = 0, count: int = 1) -> list[Example]:
        """Examples `start .. start+count` of `split`."""
        ...

    def submit_rollouts(
        self, example_indices: Sequence[int], **request: Any
    ) -> list[concurrent.futures.Future[RolloutGroup]]:
        """One group of `num_rollouts` rollouts per example on the inference server `base_url` (``request``: the
        fields of `RolloutRequest`); the futures in the order of `example_indices` (a group that cannot be sent
        gets a failed future)."""
        ...

    def submit_rollout(self, example_index: int, **kwargs: Any) -> concurrent.futures.Future[RolloutGroup]:
        """`submit_rollouts` of one example."""
        ...

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Cancel a submitted group in the process; its future fails with `EnvRequestError` "cancelled"."""
        ...

    def is_alive(self) -> bool:
        """Whether the process runs and can take requests."""
        ...

    def ensure_alive(self) -> EnvInfo:
        """Restart a dead process; `EnvWorkerDied` once `max_restarts` restarts are used up."""
        ...

    def num_pending(self) -> int:
        """Requests sent and not answered yet."""
        ...

    def stderr_tail(self) -> str:
        """The last lines the process wrote to stderr."""
        ...

    def close(self, timeout_s: float = 10.0) -> int | None:
        """End the process (politely, then by signal); its exit code. Pending requests fail with `EnvWorkerDied`."""
        ...


class OneExampleCalls(abc.ABC):
    """`submit_rollouts`, `submit_rollout` and `rollout` of an `EnvClient`, written once over its `submit_groups`
    and `cancel`."""

    def submit_rollouts(
        self, example_indices: Sequence[int], **request: Any
    ) -> list[concurrent.futures.Future[RolloutGroup]]:
        """See `EnvClient.submit_rollouts`."""
        return self.submit_groups(example_indices, RolloutRequest(**request))

    @abc.abstractmethod
    def submit_groups(
        self, example_indices: Sequence[int], request: RolloutRequest
    ) -> list[concurrent.futures.Future[RolloutGroup]]:
        """`submit_rollouts` with its request built."""

    @abc.abstractmethod
    def cancel(self, future: concurrent.futures.Future) -> None:
        """See `EnvClient.cancel`."""

    def submit_rollout(self, example_index: int, **kwargs: Any) -> concurrent.futures.Future[RolloutGroup]:
        """`submit_rollouts` of one example: a future of its `RolloutGroup` (errors per rollout inside)."""
        return self.submit_rollouts([example_index], **kwargs)[0]

    async def rollout(self, example_index: int, **kwargs: Any) -> RolloutGroup:
        """`submit_rollout` for asyncio; cancelling the awaiting task cancels the request in the process."""
        future = self.submit_rollout(example_index, **kwargs)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.cancel(future)
            raise
