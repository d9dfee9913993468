"""The file format of one spooled rollout batch (``<sha256(batch_id)[:40]>.rbatch``; the layout is drawn in
``spool``'s docstring): its name, its 24-byte prefix (magic, header length, payload length, CRC-32), and the
checked read of a whole file. A file that fails a check raises ``DamagedBatchFile`` saying why; the spool
quarantines it."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from primerl.proto.framing import compute_checksum
from primerl.proto.units import MiB
from primerl.proto.v1 import data_pb2

MAGIC = b"PRMLRB01"
PREFIX = struct.Struct("<8sIQI")  # magic, header_len, payload_len, crc32
PREFIX_BYTES = PREFIX.size  # 24
BATCH_SUFFIX = ".rbatch"
MAX_HEADER_BYTES = 16 * MiB


class DamagedBatchFile(Exception):
    """A batch file that is torn or damaged; the message says what is wrong with it."""


def batch_file_name(batch_id: str) -> str:
    """Fixed-length, filesystem-safe name of a batch's file (the batch id itself is inside the file)."""
    return hashlib.sha256(batch_id.encode()).hexdigest()[:40] + BATCH_SUFFIX


def read_batch_file(path: Path, *, verify: bool) -> tuple[data_pb2.RolloutBatchHeader, bytes, memoryview, int, int]:
    """(header, header bytes, payload, crc32, file bytes) of the batch file at ``path``, its lengths checked
    and, with ``verify``, its CRC-32. Raises ``DamagedBatchFile``, or ``OSError`` when it cannot be read."""
    with open(path, "rb", buffering=0) as handle:
        file_bytes = os.fstat(handle.fileno()).st_size
        if file_bytes < PREFIX_BYTES:
            raise DamagedBatchFile(f"file of {file_bytes} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
        magic, header_len, payload_len, crc = PREFIX.unpack(handle.read(PREFIX_BYTES))
        if magic != MAGIC:
            raise DamagedBatchFile(f"magic {magic!r} is not {MAGIC!r}")
        if header_len > MAX_HEADER_BYTES or PREFIX_BYTES + header_len + payload_len != file_bytes:
            raise DamagedBatchFile(
                f"lengths (header {header_len}, payload {payload_len}) do not add up to the file size {file_bytes}"
            )
        buffer = bytearray(header_len + payload_len)
        view = memoryview(buffer)
        filled = 0
        while filled < len(buffer):
            num = handle.readinto(view[filled:])
            if not num:
                raise DamagedBatchFile("file ended early")
            filled += num
    header_bytes = bytes(view[:header_len])
    payload = view[header_len:]
    if verify and compute_checksum(data_pb2.ROLLOUT_BATCH, header_bytes, [payload]) != crc:
        raise DamagedBatchFile("CRC-32 does not match (torn or damaged write)")
    header = parse_header(header_bytes)
    if header is None or not header.batch_id:
        raise DamagedBatchFile("header is not a RolloutBatchHeader with a batch id")
    return header, header_bytes, payload, crc, file_bytes


def parse_header(header_bytes: bytes) -> data_pb2.RolloutBatchHeader | None:
    header = data_pb2.RolloutBatchHeader()
    try:
        header.ParseFromString(header_bytes)
    except DecodeError:
        return None
    return header


def as_byte_view(data: Any) -> memoryview:
    """A flat view of bytes of ``data`` (bytes, a memoryview, a zmq Frame), without a copy."""
    view = memoryview(getattr(data, "buffer", data))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
