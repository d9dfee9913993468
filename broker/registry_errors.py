"""The registry's refusals, each carrying the gRPC status the control service answers with, and what a commit
answers (``CommitResult``)."""

from __future__ import annotations

from typing import NamedTuple


class RegistryError(Exception):
    """A refused request. ``status_code`` names the ``grpc.StatusCode`` member the gRPC layer answers with."""

    status_code = "INTERNAL"


class InvalidRequest(RegistryError):
    status_code = "INVALID_ARGUMENT"


class WorkerNotFound(RegistryError):
    """Unknown, expired (LOST) or departed worker id: the worker must register again."""

    status_code = "NOT_FOUND"


class NameTaken(RegistryError):
    status_code = "ALREADY_EXISTS"


class StepOutOfOrder(RegistryError):
    status_code = "FAILED_PRECONDITION"


class IncarnationSuperseded(RegistryError):
    """A trainer whose policy lineage a newer trainer incarnation superseded (it registered while this one was cut
    off or stuck) registers again or commits: refused for good; the old trainer must stop, not retry."""

    status_code = "ABORTED"


class LimitReached(RegistryError):
    """A bound of the registry (workers, metric names) would be exceeded; the message says which."""

    status_code = "RESOURCE_EXHAUSTED"


class BrokerStopping(RegistryError):
    """The broker process is stopping (SIGTERM, a restart): the worker should retry, not stop."""

    status_code = "UNAVAILABLE"


class CommitFailed(RegistryError):
    """The ``on_commit`` callback (releasing spooled batches) failed; the step is not committed."""

    status_code = "INTERNAL"


class CommitResult(NamedTuple):
    """What ``commit_step`` answers: the run's last committed step, the batches this commit released, and
    whether the step was already committed (a retry: nothing released, nothing changed)."""

    last_committed_step: int
    num_batches_released: int
    already_committed: bool = False
