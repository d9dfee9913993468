"""The registry's refusals, each carrying the gRPC status the control service answers with, and what a commit
answers (``CommitResult``)."""

from __future__ import annotations

from typing import NamedTuple


class RegistryError(Exception):
    """A refused request. ``status_code`` names the ``grpc.StatusCode`` member the gRPC layer answers with; a
    subclass names its own among its bases (``class NameTaken(RegistryError, status_code="ALREADY_EXISTS")``)."""

    status_code = "INTERNAL"

    def __init_subclass__(cls, status_code: str = "", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.status_code = status_code or cls.status_code


class InvalidRequest(RegistryError, status_code="INVALID_ARGUMENT"):
    pass


class WorkerNotFound(RegistryError, status_code="NOT_FOUND"):
    """Unknown, expired (LOST) or departed worker id: the worker must register again."""


class NameTaken(RegistryError, status_code="ALREADY_EXISTS"):
    pass


class StepOutOfOrder(RegistryError, status_code="FAILED_PRECONDITION"):
    pass


class IncarnationSuperseded(RegistryError, status_code="ABORTED"):
    """A trainer whose policy lineage a newer trainer incarnation superseded (it registered while this one was cut
    off or stuck) registers again or commits: refused for good; the old trainer must stop, not retry."""


class LimitReached(RegistryError, status_code="RESOURCE_EXHAUSTED"):
    """A bound of the registry (workers, metric names) would be exceeded; the message says which."""


class BrokerStopping(RegistryError, status_code="UNAVAILABLE"):
    """The broker process is stopping (SIGTERM, a restart): the worker should retry, not stop."""


class CommitFailed(RegistryError, status_code="INTERNAL"):
    """The ``on_commit`` callback (releasing spooled batches) failed; the step is not committed."""


class CommitResult(NamedTuple):
    """What ``commit_step`` answers: the run's last committed step, the batches this commit released, and
    whether the step was already committed (a retry: nothing released, nothing changed)."""

    last_committed_step: int
    num_batches_released: int
    already_committed: bool = False
