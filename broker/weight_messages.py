"""The chunk messages the weight plane sends for a stored update: forwarded chunk for chunk as the update arrived
(cut-through, no pass over the payload), cut into ``chunk_bytes`` pieces once whole (an update reloaded from disk,
or received in larger chunks), and the same frames addressed to a relay chain. Built once per update (per chain),
as its chunks arrive, and kept in ``StoredUpdate.transit.forward`` (the chain's in ``RelayChain.messages``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from primerl.broker.stored_update import StoredUpdate
from primerl.broker.weight_intake import ReceivedChunks
from primerl.broker.weight_relay import RelayChain
from primerl.proto import framing
from primerl.proto.v1 import data_pb2

__all__ = ["ForwardMessages", "chunk_messages", "relayed_messages"]


@dataclass
class ForwardMessages:
    """The chunk messages of one update as the plane sends them (to every worker: one transfer id)."""

    transfer_id: str
    num_chunks: int
    received: ReceivedChunks | None
    messages: list[list[Any]] = field(default_factory=list)


def chunk_messages(update: StoredUpdate, chunk_bytes: int, envelope: dict[str, str]) -> tuple[list[list[Any]], int]:
    """The chunk messages of ``update`` that can be sent now (payloads are the stored segments or zero-copy
    slices of them), and how many the update has in all; built once per update, as its chunks arrive.

    An update received in chunks no larger than ``chunk_bytes`` is forwarded chunk for chunk as it
    arrived, with the header bytes and verified checksums it came with (``framing.encode_raw``): no pass over
    the payload at all, and each chunk can go out while later ones are still on their way (cut-through).
    Others (larger chunks, or an update reloaded from disk) are cut into chunks of ``chunk_bytes`` once whole,
    with one XXH3-64 checksum pass each."""
    transit = update.transit
    forward = transit.forward
    if forward is None:
        received = transit.received
        if received is not None and (received.num_chunks == 1 or received.checksums[0][1] <= chunk_bytes):
            forward = ForwardMessages(uuid.uuid4().hex, received.num_chunks, received)
        else:
            forward = ForwardMessages(uuid.uuid4().hex, 0, None)
            forward.messages = _rechunked(update, forward.transfer_id, chunk_bytes, envelope)
            forward.num_chunks = len(forward.messages)
        transit.forward = forward
    received = forward.received
    if received is not None:
        available = min(len(update.segments), len(received.checksums))
        if received.digest_follows and available == forward.num_chunks and not update.header.digest:
            available -= 1  # the last chunk carries the digest, known once the update is stored
        header_bytes = received.header_bytes
        for index in range(len(forward.messages), available):
            checksum, _ = received.checksums[index]
            last = index == forward.num_chunks - 1
            forward.messages.append(
                framing.encode_raw(
                    data_pb2.WEIGHT_UPDATE,
                    header_bytes,
                    [update.segments[index]],
                    checksum=checksum,
                    chunk=data_pb2.Chunk(
                        transfer_id=forward.transfer_id,
                        index=index,
                        count=forward.num_chunks,
                        total_bytes=received.total_bytes,
                        payload_digest=update.header.digest if last and received.digest_follows else "",
                    ),
                    **envelope,
                )
            )
    return forward.messages, forward.num_chunks


def relayed_messages(messages: list[list[Any]], update: StoredUpdate, chain: RelayChain) -> list[list[Any]]:
    """``messages`` (the star fan-out's, as far as they exist) as ``chain`` receives them: the same frames, the
    envelope carrying the chain and a transfer id of the chain's own. Built once per chain, as chunks arrive."""
    relayed = chain.messages
    if len(relayed) < len(messages):
        forward = update.transit.forward
        assert forward is not None, "relayed_messages follows chunk_messages"
        suffix = data_pb2.Envelope(
            chunk=data_pb2.Chunk(transfer_id=f"{forward.transfer_id}.r{chain.number}"),
            relay_hops=[
                data_pb2.RelayHop(worker_id=worker_id, endpoint=endpoint)
                for worker_id, endpoint in zip(chain.hops, chain.endpoints, strict=True)
            ],
        ).SerializeToString()
        for frames in messages[len(relayed) :]:
            relayed.append([frames[0], frames[1], bytes(frames[2]) + suffix, *frames[3:]])
    return relayed


def _rechunked(update: StoredUpdate, transfer_id: str, chunk_bytes: int, envelope: dict[str, str]) -> list[list[Any]]:
    pieces = [
        segment[start : start + chunk_bytes]
        for segment in update.segments
        for start in range(0, max(1, segment.nbytes), chunk_bytes)
    ]
    header_bytes = update.header.SerializeToString(deterministic=True)
    total = update.num_bytes
    return [
        framing.encode_raw(
            data_pb2.WEIGHT_UPDATE,
            header_bytes,
            [piece],
            checksum_kind=framing.XXH3_64,
            chunk=data_pb2.Chunk(transfer_id=transfer_id, index=index, count=len(pieces), total_bytes=total),
            **envelope,
        )
        for index, piece in enumerate(pieces)
    ]
