"""The relay chains of the weight fan-out (``fanout="chain"``): which members start an update together and form a
chain, and the healing of chains that stalled or did not reach a member in time. ``RelayChains`` runs under
``WeightFanout``'s lock and answers with the members to plan again.

Members that announced a relay endpoint in HELLO and start the same update at the same time (``begin``, or idle members
whose next planned update is the same) form ``RelayChain``s of at most ``max_hops``, in the order they joined: the plane
sends each chunk only to their heads, and each member forwards what it received to the next (the chunks carry the chain,
``Envelope.relay_hops``). The others in a chain are sent nothing; once the head has had the last chunk they all count as
sent, each with ``relay_timeout_s`` to acknowledge. A member past that is planned again from what it acknowledged, and
the first of them in the chain (the one the rest waited on) relays nothing more until it acknowledges an update: the
rest form a new chain without it, and the broker, which holds the update, sends it again. A head that leaves or makes no
progress for ``relay_timeout_s`` dissolves its chain the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from primerl.broker.stored_update import StoredUpdate
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    from primerl.broker.weight_members import WeightMember

log = get_logger(__name__)

MAX_RELAY_ENDPOINT_CHARS = 256
DEFAULT_MAX_HOPS = 32
"""Workers in one relay chain at most (``broker.weight_relay_max_hops``). A hop holds one chunk before passing it on
and every chunk carries the chain's hops, so a chain of a thousand adds a thousand chunk-times and ~60 KB to each
chunk; chains of at most 32 cost the broker ceil(N / 32) sends of each chunk instead of N."""


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


class RelayChains:
    """The chains of one fan-out (``enabled``: in chain mode, else every member is sent its updates directly) and
    their healing, with the counts the plane's status shows. Called under ``WeightFanout``'s lock."""

    def __init__(
        self, enabled: bool, relay_timeout_s: float, clock: Callable[[], float], max_hops: int = DEFAULT_MAX_HOPS
    ):
        if max_hops < 2:
            raise ValueError(f"a relay chain has at least 2 hops, got max_hops={max_hops}")
        self.enabled = enabled
        self.max_hops = max_hops
        self.relay_timeout_s = relay_timeout_s
        self._clock = clock
        self.num_chains = 0
        self.num_heals = 0
        """Members sent an update again because their relay did not reach them in time."""

    def start(self, members: list[WeightMember], update: StoredUpdate) -> None:
        """``members`` (in the order they joined) start receiving ``update`` now; in chain mode, those that can relay
        form chains of at most ``max_hops``, the longest-standing first (a last one left alone is sent it directly,
        as are the members that cannot relay)."""
        chained = [member for member in members if member.relays(update)] if self.enabled else []
        for member in members:
            member.sending, member.next_chunk, member.chain = update, 0, None
            member.relay_deadline_s = None
        num_chains = -(-len(chained) // self.max_hops)
        for number in range(num_chains):  # even lengths: ceil(n / max_hops) chains of n / num_chains hops or one more
            part = chained[number::num_chains]
            if len(part) < 2:
                continue
            self.num_chains += 1
            hops = tuple(member.worker_id for member in part)
            endpoints = tuple(member.relay_endpoint for member in part)
            chain = RelayChain(update, self.num_chains, hops, endpoints, self._clock())
            log.debug("weight relay chain planned", policy_version=update.policy_version, hops=list(chain.hops))
            for member in part:
                member.chain = chain

    def heal(self, members: Mapping[str, WeightMember], now_s: float) -> list[WeightMember]:
        """Dissolve the chains whose head stalled; a member a relay did not reach in time counts as sent nothing (the
        first of them in its chain relays no more until it acknowledges). Returns the members to plan again."""
        stalled = [
            member.chain
            for member in members.values()
            if member.chain is not None
            and not member.chain.dissolved
            and member.chain.hops[0] == member.worker_id
            and now_s - member.chain.last_progress_s > self.relay_timeout_s
        ]
        replan = []
        for chain in stalled:  # its head goes on alone
            replan += self.dissolve(chain, members, reason="its first worker took no chunk in time")
        late = [
            m for m in members.values() if m.relay_deadline_s is not None and m.unacked and now_s > m.relay_deadline_s
        ]
        first_late: dict[int, WeightMember] = {}  # per chain, the first member the relay did not reach: it held it up
        for member in late:
            chain_number, place = member.relay_place
            if chain_number not in first_late or place < first_late[chain_number].relay_place[1]:
                first_late[chain_number] = member
        for member in first_late.values():
            member.relay_ok = False
        for member in late:
            self.num_heals += 1
            log.warning(
                "weight relay did not reach a worker in time; the broker sends it the update",
                worker_id=member.worker_id,
                awaited_version=member.unacked[-1][0],
                relays_again=member.relay_ok,
            )
            member.relay_deadline_s = None
            member.resend_from_acked()
            member.last_progress_s = now_s
        return replan + late

    def dissolve(self, chain: RelayChain, members: Mapping[str, WeightMember], *, reason: str) -> list[WeightMember]:
        """The members after ``chain``'s head stop waiting for it (its head, if still a member, goes on receiving the
        update alone). Returns them: to plan again."""
        chain.dissolved = True
        stopped = [
            member for hop in chain.hops[1:] if (member := members.get(hop)) is not None and member.chain is chain
        ]
        for member in stopped:
            self.num_heals += 1
            member.stop_sending()
        log.warning(
            "weight relay chain dissolved; the broker sends its workers the update",
            policy_version=chain.update.policy_version,
            hops=list(chain.hops),
            reason=reason,
        )
        return stopped


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
