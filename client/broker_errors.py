"""The control plane's typed errors: what a call to the broker raises, by its gRPC status (``broker_error``).

``BrokerUnavailable`` can heal (retry later); ``IncarnationSuperseded`` never does; ``BrokerLost`` ends a worker
that waited through an outage longer than ``outage_s``."""

from __future__ import annotations

import grpc

from primerl.client.outage import BrokerOutageExceeded

# CANCELLED: a broker that shuts down (a restart) cancels the calls it is serving; this client cancels none of its
# unary calls, and a stream it cancels itself ends before this (``RunStatusStream``). Found by CI: an endpoint
# watcher's ListWorkers cancelled by the broker's restart stopped the orchestrator it should have waited in.
_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class BrokerError(RuntimeError):
    """The broker refused a call, or could not be reached. ``code`` is the ``grpc.StatusCode``."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN):
        super().__init__(message)
        self.code = code


class BrokerUnavailable(BrokerError):
    """The broker did not answer in time (down, restarting, wrong address, TLS mismatch). Can heal."""


class BrokerLost(BrokerUnavailable, BrokerOutageExceeded):
    """The broker stayed unreachable for longer than ``outage_s``: the worker should stop with this error."""


class NameHeld(BrokerError):
    """ALREADY_EXISTS at registration: the name is held, e.g. by this worker's previous incarnation until the
    broker expires it. A worker waits for that (within ``outage_s``)."""


class IncarnationSuperseded(BrokerError):
    """A newer trainer incarnation took over this run's policy lineage (it registered while this trainer was cut
    off or stuck): the broker refuses this one's registration and commits for good. The trainer must stop and
    must not be restarted."""


def broker_error(err: grpc.RpcError, what: str, address: str) -> BrokerError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code in _UNAVAILABLE_CODES:
        return BrokerUnavailable(f"{what}: broker at {address} unreachable ({code.name}: {details})", code)
    if code == grpc.StatusCode.ABORTED:
        return IncarnationSuperseded(f"{what}: {details}", code)
    return BrokerError(f"{what}: {code.name}: {details}", code)
