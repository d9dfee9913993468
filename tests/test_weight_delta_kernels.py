"""The SPARSE delta's whole-array kernels pinned bit-exactly: the gaps stream, the mask and the form of each tensor
equal those of a plain element-by-element reading of the module docstring, on the edges (gaps of 255, 256, 510,
511, long runs of no change, every element changed, the first and the last element, element counts that are not
a multiple of the 8-element words the positions are found in); payloads do not depend on the number of threads and
equal a golden digest (the wire format does not move); malformed streams still raise `DeltaError`, first in the
header's order whatever the threads."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from safetensors.torch import save

from primerl.proto import delta_sparse
from primerl.proto.delta_base import torch_dtype_name
from primerl.proto.delta_sparse import _changed_positions, _gaps_of, _positions_of
from primerl.proto.tensor_frames import parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_delta import DeltaError, decode_delta, encode_delta

SPARSE = data_pb2.DELTA_ENCODING_SPARSE
MALFORMED = common_pb2.ERROR_CODE_MALFORMED_HEADER
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def header_of(specs: list, decoded: list) -> data_pb2.WeightUpdateHeader:
    return data_pb2.WeightUpdateHeader(
        kind=data_pb2.WEIGHT_UPDATE_KIND_DELTA, tensors=specs, decoded_tensors=decoded, delta_encoding=SPARSE
    )


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def flipped(tensor: torch.Tensor, positions: list[int] | torch.Tensor) -> torch.Tensor:
    """``tensor`` with the lowest bit of the flat elements at ``positions`` flipped (a bitwise change)."""
    out = tensor.clone().reshape(-1)
    out.view(INT_OF_WIDTH[out.element_size()])[torch.as_tensor(positions, dtype=torch.int64)] ^= 1
    return out.reshape(tensor.shape)


# ---- a plain reading of the format, one element at a time -------------------------------------------------------


def reference_gaps(positions: list[int]) -> bytes:
    """The gaps stream as the module docstring words it: from -1, a 0 byte per 255 skipped, then the marker."""
    stream, previous = bytearray(), -1
    for position in positions:
        gap = position - previous
        while gap > 255:
            stream.append(0)
            gap -= 255
        stream.append(gap)
        previous = position
    return bytes(stream)


def reference_form(new: torch.Tensor, base: torch.Tensor) -> dict[str, bytes] | None:
    """{suffix: raw bytes} of one tensor's SPARSE form: the smallest of gaps / mask / whole (ties as the encoder
    breaks them), from element-by-element comparison."""
    width = new.element_size()
    new_raw, base_raw = bits(new), bits(base)
    numel = new.numel()
    positions = [
        i for i in range(numel) if new_raw[i * width : (i + 1) * width] != base_raw[i * width : (i + 1) * width]
    ]
    if not positions:
        return None
    values = b"".join(new_raw[i * width : (i + 1) * width] for i in positions)
    mask = bytearray(-(-numel // 8))
    for i in positions:
        mask[i // 8] |= 1 << (i % 8)
    gaps = reference_gaps(positions)
    whole_bytes, mask_bytes, gaps_bytes = numel * width, len(mask) + len(values), len(gaps) + len(values)
    if min(mask_bytes, len(positions) + len(values)) >= whole_bytes:
        return {"#values": new_raw}
    if mask_bytes > len(positions) + len(values) and gaps_bytes < min(mask_bytes, whole_bytes):
        return {"#gaps": gaps, "#values": values}
    if mask_bytes < whole_bytes:
        return {"#mask": bytes(mask), "#values": values}
    return {"#values": new_raw}


def encoded_forms(payload: bytes) -> dict[str, dict[str, bytes]]:
    """{tensor: {suffix: raw bytes}} of a SPARSE payload."""
    out: dict[str, dict[str, bytes]] = {}
    for name, entry in parse_header(payload).items():
        tensor, suffix = name.rsplit("#", 1)
        out.setdefault(tensor, {})["#" + suffix] = bytes(payload[entry.start : entry.end])
    return out


def assert_matches_reference(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor], num_threads: int = 1):
    payload, specs, decoded = encode_delta(new, base, encoding=SPARSE, num_threads=num_threads)
    expected = {name: reference_form(new[name], base[name]) for name in new}
    assert encoded_forms(payload) == {name: form for name, form in expected.items() if form is not None}
    assert [spec.name for spec in decoded] == [name for name in new if expected[name] is not None]
    out = decode_delta(payload, header_of(specs, decoded), base, num_threads=num_threads)
    assert {name: bits(t) for name, t in out.items()} == {name: bits(new[name]) for name in out}
    return payload


# ---- edges of the gaps stream ------------------------------------------------------------------------------------

GAP_EDGES = {
    "first element": [0],
    "gap 255": [254],
    "gap 256": [255],
    "gap 510": [509],
    "gap 511": [510],
    "gap 765 and 766": [764, 1530],
    "a marker right after a skip run": [255, 256, 257],
    "last element": [4999],
    "first and last": [0, 4999],
    "a long run of no change": [3, 4998],
    "neighbours": [100, 101, 102, 356, 357],
}


@pytest.mark.parametrize("case", list(GAP_EDGES))
def test_gaps_stream_edges_equal_the_reference(case: str) -> None:
    positions = GAP_EDGES[case]
    assert _gaps_of(np.array(positions, dtype=np.int64)).tobytes() == reference_gaps(positions)
    base = {"w": torch.randn(5000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    payload = assert_matches_reference({"w": flipped(base["w"], positions)}, base)
    assert set(encoded_forms(payload)["w"]) == {"#gaps", "#values"}


def test_gaps_of_one_change_at_the_end_of_a_large_tensor() -> None:
    """About 45,000 skip bytes before one marker: every byte but the last is 0."""
    numel = 11_534_336  # a 5632 x 2048 MLP matrix
    stream = _gaps_of(np.array([numel - 1], dtype=np.int64))
    assert stream.size == (numel - 1) // 255 + 1 and stream[-1] == numel - 255 * ((numel - 1) // 255)
    assert not stream[:-1].any()
    assert _positions_of("w", stream, numel, 1).tolist() == [numel - 1]


def test_positions_of_random_streams_equal_the_reference() -> None:
    """Streams with runs of skip bytes anywhere but at the end decode as the docstring reads them."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        stream = rng.integers(1, 256, int(rng.integers(1, 400)), dtype=np.uint8)
        stream[rng.random(stream.size) < float(rng.choice([0.0, 0.05, 0.5, 0.9]))] = 0
        stream[-1] = max(1, int(stream[-1]))
        expected, position = [], -1
        for byte in stream.tolist():
            position += byte or 255
            if byte:
                expected.append(position)
        assert _positions_of("w", stream, expected[-1] + 1, len(expected)).tolist() == expected


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.05, 0.099, 0.101, 0.3, 1.0])
def test_changed_positions_equal_flatnonzero(numel: int, fraction: float) -> None:
    """The word-wise search (below 1/10 changed) and numpy's own agree, tails that are not a whole word included."""
    rng = np.random.default_rng(numel)
    changed = rng.random(numel) < fraction
    changed[-1] = fraction > 0.05  # a change in the tail of the last word, or none
    expected = np.flatnonzero(changed)
    assert np.array_equal(_changed_positions(changed, int(changed.sum())), expected)
    offset = np.concatenate(([False], changed))[1:]  # the same mask, not aligned to 8 bytes
    assert np.array_equal(_changed_positions(offset, int(changed.sum())), expected)


@pytest.mark.parametrize("numel", [8, 9, 15, 64, 70_001])
@pytest.mark.parametrize("fraction", [0.02, 0.09, 0.2, 0.9, 1.0])
def test_random_changes_equal_the_reference(numel: int, fraction: float) -> None:
    """Every form, bf16 and fp32, with counts on both sides of the word-wise search's 1/10 and the forms' limits."""
    generator = torch.Generator().manual_seed(numel)
    where = torch.rand(numel, generator=generator) < fraction
    where[0] = where[-1] = True
    positions = torch.nonzero(where).reshape(-1)
    base = {
        "bf16": torch.randn(numel, generator=generator).to(torch.bfloat16),
        "f32": torch.randn(numel, generator=generator),
    }
    assert_matches_reference({name: flipped(t, positions) for name, t in base.items()}, base)


def test_every_element_changed_is_sent_whole() -> None:
    base = {"w": torch.randn(3, 100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    payload = assert_matches_reference({"w": base["w"] + 1}, base)
    assert set(encoded_forms(payload)["w"]) == {"#values"}


def test_signed_zeros_and_nan_payloads_are_positions_like_any_bits() -> None:
    """-0.0 == +0.0 and NaN != NaN as numbers; the kernels compare bits: only bit changes are sent, all of them."""
    patterns = torch.tensor([0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, 0x3F80, 0x7F80], dtype=torch.int32)
    base_bits = patterns.to(torch.int16).repeat(200)
    new_bits = base_bits.clone()
    new_bits[0::8] = -0x8000  # +0.0 -> -0.0
    new_bits[1::8] = 0x0000  # -0.0 -> +0.0
    new_bits[3::16] = 0x7FC2  # one NaN payload -> another
    new_bits[1592] = 0x7FC0  # NaN -> the same NaN: no change
    base, new = {"w": base_bits.view(torch.bfloat16)}, {"w": new_bits.view(torch.bfloat16)}
    payload = assert_matches_reference(new, base)
    assert set(encoded_forms(payload)["w"]) == {"#mask", "#values"}


def test_empty_and_unchanged_tensors() -> None:
    base = {"empty": torch.zeros(0, 4), "same": torch.arange(100.0), "one": torch.zeros(1, dtype=torch.bfloat16)}
    new = {"empty": torch.zeros(0, 4), "same": torch.arange(100.0), "one": torch.ones(1, dtype=torch.bfloat16)}
    payload = assert_matches_reference(new, base)
    assert set(encoded_forms(payload)) == {"one"}
    payload, specs, decoded = encode_delta(new, base, encoding=SPARSE, changed_only=False)
    out = decode_delta(payload, header_of(specs, decoded), base)
    assert set(out) == set(new) and out["empty"].shape == (0, 4)
    assert all(bits(out[name]) == bits(new[name]) for name in new)


# ---- threads and the wire format ---------------------------------------------------------------------------------


def golden_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Tensors of every form and dtype, with the gap edges, seeded."""
    generator = torch.Generator().manual_seed(1234)
    base: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}

    def add(name: str, tensor: torch.Tensor, positions: torch.Tensor | list[int]) -> None:
        base[name], new[name] = tensor, flipped(tensor, positions)

    numel = 70_001
    edges = [0, 255, 511, 1021, 1022, 1022 + 766, 40_000, numel - 1]
    add("gaps.bf16", torch.randn(numel, generator=generator).to(torch.bfloat16), edges)
    sparse = torch.randperm(numel, generator=generator)[: numel // 25].sort().values
    add("random.bf16", torch.randn(7, numel // 7 + 1, generator=generator).to(torch.bfloat16), sparse)
    add(
        "mask.f32",
        torch.randn(1000, generator=generator),
        torch.randperm(1000, generator=generator)[:300].sort().values,
    )
    add("whole.f16", torch.randn(33, generator=generator).to(torch.float16), list(range(33)))
    add("same.i64", torch.arange(10, dtype=torch.int64), [])
    add("scalar", torch.tensor(0.5), [0])
    return new, base


# sha256 and length of golden_pair's SPARSE payload, as the element-by-element encoder before the whole-array kernels
# wrote it: a change here is a change of the wire format.
GOLDEN_PAYLOAD = ("df06df58de783a7eb7ef500d653428262a7c8c97204ca26db9166538b8c75a7c", 10698)


@pytest.mark.parametrize("num_threads", [1, 2, 3, 8])
def test_payload_is_the_same_whatever_the_threads_and_equals_the_golden_one(num_threads: int) -> None:
    new, base = golden_pair()
    payload = assert_matches_reference(new, base, num_threads=num_threads)
    assert (hashlib.sha256(payload).hexdigest(), len(payload)) == GOLDEN_PAYLOAD


def test_many_tensors_on_threads_round_trip() -> None:
    """More tensors than threads, of very different sizes (the largest start first): each decodes to its own."""
    generator = torch.Generator().manual_seed(5)
    base = {f"t{i}": torch.randn(1 + 997 * (i % 7) * i, generator=generator).to(torch.bfloat16) for i in range(40)}
    new = {
        name: flipped(t, torch.nonzero(torch.rand(t.numel(), generator=generator) < 0.05).reshape(-1))
        for name, t in base.items()
    }
    for num_threads in (1, 4):
        payload, specs, decoded = encode_delta(new, base, encoding=SPARSE, num_threads=num_threads)
        out = decode_delta(payload, header_of(specs, decoded), base, num_threads=num_threads)
        assert {name: bits(t) for name, t in out.items()} == {name: bits(new[name]) for name in out}


@pytest.mark.parametrize("scan_bytes", [8, 48, 1000, 4096])
def test_chunked_scan_gives_the_same_payload_whatever_the_chunk_size(
    scan_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder compares each tensor in chunks (``_SCAN_BYTES``; 2 MiB in production, so the tensors here
    are one chunk): with small chunks, positions and values of sparse chunks, the bits of dense ones and the
    gaps that cross chunk boundaries stitch to the same payload."""
    monkeypatch.setattr(delta_sparse, "_SCAN_BYTES", scan_bytes)
    new, base = golden_pair()
    payload = assert_matches_reference(new, base, num_threads=2)
    assert (hashlib.sha256(payload).hexdigest(), len(payload)) == GOLDEN_PAYLOAD


@pytest.mark.parametrize("scan_bytes", [8, 64, 1000])
def test_chunks_both_sparse_and_dense_in_one_tensor_equal_the_reference(
    scan_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sparse stretches, dense clusters and untouched runs in the same tensor, so that its chunks take every path
    of the scan, for each form the tensor as a whole ends up in."""
    monkeypatch.setattr(delta_sparse, "_SCAN_BYTES", scan_bytes)
    generator = torch.Generator().manual_seed(scan_bytes)
    numel = 6001
    base = {
        "bf16": torch.randn(numel, generator=generator).to(torch.bfloat16),
        "f32": torch.randn(numel, generator=generator),
    }
    for sparse, cluster in ((0.01, 200), (0.03, 900), (0.2, 2000), (0.5, 5000), (0.97, 6001)):
        where = torch.rand(numel, generator=generator) < sparse
        start = int(torch.randint(0, numel - cluster + 1, (1,), generator=generator))
        where[start : start + cluster] |= torch.rand(cluster, generator=generator) < 0.9
        where[1000:1700] = False  # a run of no change longer than a gap byte reaches
        positions = torch.nonzero(where).reshape(-1)
        assert_matches_reference({name: flipped(t, positions) for name, t in base.items()}, base, num_threads=2)


# ---- malformed streams -------------------------------------------------------------------------------------------

BASE = {name: torch.zeros(600, dtype=torch.bfloat16) for name in ("a", "b", "c")}
TWO = torch.ones(2, dtype=torch.bfloat16)


def u8(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def hand_made(tensors: dict[str, torch.Tensor], names: list[str]) -> tuple[bytes, data_pb2.WeightUpdateHeader]:
    payload = save({name: t.clone() for name, t in tensors.items()})
    decoded = [
        common_pb2.TensorSpec(name=n, dtype=torch_dtype_name(BASE[n].dtype), shape=list(BASE[n].shape)) for n in names
    ]
    return payload, header_of(specs_of(parse_header(payload)), decoded)


MALFORMED_STREAMS = {
    # skip bytes: 0 advances 255, so [0, 0, 91] reaches 600 (one past the last element)
    "skips past the end": ([0, 0, 90, 1], "position 600 is out of range"),
    "skips then too few markers": ([0, 5], "1 positions but 2 values"),
    "skips then too many markers": ([0, 5, 1, 1], "3 positions but 2 values"),
    "a run of skips at the end": ([5, 5, 0, 0], "ends with a skip"),
    "only skips": ([0, 0], "ends with a skip"),
}


@pytest.mark.parametrize("case", list(MALFORMED_STREAMS))
@pytest.mark.parametrize("num_threads", [1, 2])
def test_malformed_gaps_with_skip_bytes_are_refused(case: str, num_threads: int) -> None:
    stream, message = MALFORMED_STREAMS[case]
    payload, header = hand_made({"a#gaps": u8(stream), "a#values": TWO}, ["a"])
    with pytest.raises(DeltaError, match=message) as excinfo:
        decode_delta(payload, header, BASE, num_threads=num_threads)
    assert excinfo.value.code == MALFORMED


@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_the_first_bad_tensor_in_the_header_is_reported_whatever_the_threads(num_threads: int) -> None:
    good = {"a#gaps": u8([1, 1]), "a#values": TWO}
    bad_b = {"b#gaps": u8([1, 1, 1]), "b#values": TWO}  # 3 positions, 2 values
    bad_c = {"c#mask": u8([3] + [0] * 74 + [1]), "c#values": TWO}  # 3 bits set, 2 values
    payload, header = hand_made({**good, **bad_b, **bad_c}, ["a", "b", "c"])
    with pytest.raises(DeltaError, match="'b'") as excinfo:
        decode_delta(payload, header, BASE, num_threads=num_threads)
    assert excinfo.value.code == MALFORMED
    payload, header = hand_made({**good, **bad_b, **bad_c}, ["c", "a", "b"])
    with pytest.raises(DeltaError, match="'c'"):
        decode_delta(payload, header, BASE, num_threads=num_threads)
