"""The relay-chain planner of the weight fan-out (``fanout="chain"``), pure: which members start an update together
and form a chain, which chains stalled, and which members a relay did not reach in time. ``WeightFanout`` applies
its answers under its lock.

Members that announced a relay endpoint in HELLO and start the same update at the same time (``begin``, or idle
members whose next planned update is the same) form one ``RelayChain``, in the order they joined: the plane sends
each chunk only to its head, and each member forwards what it received to the next (the chunks carry the chain,
``Envelope.relay_hops``). The others in the chain are sent nothing; once the head has had the last chunk they all
count as sent, each with ``relay_timeout_s`` to acknowledge. A member past that is planned again from what it
acknowledged, and the first of them in the chain (the one the rest waited on) relays nothing more until it
acknowledges an update: the rest form a new chain without it, and the broker, which holds the update, sends it
again. A head that leaves or makes no progress for ``relay_timeout_s`` dissolves its chain the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from primerl.broker.weight_store import StoredUpdate

if TYPE_CHECKING:
    from primerl.broker.weight_members import WeightMember

MAX_RELAY_ENDPOINT_CHARS = 256


def valid_relay_endpoint(endpoint: str) -> bool:
    """Whether ``endpoint`` (from a worker's HELLO) is a ZeroMQ tcp:// or ipc:// endpoint the broker may name."""
    return (
        0 < len(endpoint) <= MAX_RELAY_ENDPOINT_CHARS
        and endpoint.isprintable()
        and endpoint.startswith(("tcp://", "ipc://"))
    )


@dataclass(eq=False)
class RelayChain:
    """One update relayed through ``hops`` (worker ids, head first) to the ``endpoints`` they announced. ``messages``:
    the plane's chunk messages for this chain (``broker.weight_messages``)."""

    update: StoredUpdate
    number: int
    hops: tuple[str, ...]
    endpoints: tuple[str, ...]
    last_progress_s: float
    messages: list[list[Any]] = field(default_factory=list)
    # The members after its head were planned again (the head goes on with these chunks, relaying nothing new).
    dissolved: bool = False


def starting_together(
    member: WeightMember, members: Iterable[WeightMember], update: StoredUpdate
) -> list[WeightMember]:
    """``member`` starts its next planned ``update``: it and, when it relays, every idle member that relays and has
    the same update next, in the order they joined (its head may be another member)."""
    if not member.relays(update):
        return [member]
    return [
        other
        for other in members
        if other is member or (other.relays(update) and other.sending is None and other.queue[:1] == [update])
    ]


def stalled_chains(members: Iterable[WeightMember], now_s: float, relay_timeout_s: float) -> list[RelayChain]:
    """The live chains whose head took no chunk for ``relay_timeout_s``."""
    return [
        member.chain
        for member in members
        if member.chain is not None
        and not member.chain.dissolved
        and member.chain.hops[0] == member.worker_id
        and now_s - member.chain.last_progress_s > relay_timeout_s
    ]


def overdue(members: Iterable[WeightMember], now_s: float) -> list[WeightMember]:
    """Members a relay did not reach in time: a relayed update still unacknowledged past its deadline."""
    return [
        member
        for member in members
        if member.relay_deadline_s is not None and member.unacked and now_s > member.relay_deadline_s
    ]


def held_up(late: Iterable[WeightMember]) -> list[WeightMember]:
    """Per chain, the first of ``late`` in the chain's order: the one the rest waited on."""
    first: dict[int, WeightMember] = {}
    for member in late:
        chain_number, place = member.relay_place
        if chain_number not in first or place < first[chain_number].relay_place[1]:
            first[chain_number] = member
    return list(first.values())
