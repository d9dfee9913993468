"""The XOR+zlib weight delta: bit-exact round trips for every dtype, omitted unchanged tensors, and refusal of
deltas that do not fit their header or base, or whose compressed data is corrupt."""

from __future__ import annotations

import zlib

import pytest
import torch
from safetensors.torch import save

from primerl.proto.delta_base import torch_dtype_name
from primerl.proto.tensor_frames import parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_delta import DeltaError, decode_delta, encode_delta

MISMATCH = common_pb2.ERROR_CODE_TENSOR_MISMATCH
MALFORMED = common_pb2.ERROR_CODE_MALFORMED_HEADER


def header_of(specs: list, decoded: list) -> data_pb2.WeightUpdateHeader:
    return data_pb2.WeightUpdateHeader(
        kind=data_pb2.WEIGHT_UPDATE_KIND_DELTA,
        tensors=specs,
        decoded_tensors=decoded,
        delta_encoding=data_pb2.DELTA_ENCODING_XOR_ZLIB,
    )


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def base_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(16, 8, generator=generator),
        "layer.bias": torch.randn(16, generator=generator),
        "embed.bf16": torch.randn(32, 4, generator=generator).to(torch.bfloat16),
        "half": torch.randn(5, 3, generator=generator).to(torch.float16),
        "double": torch.randn(7, generator=generator, dtype=torch.float64),
        "steps.i64": torch.arange(10, dtype=torch.int64) * 1_000_003,
        "counts.i32": torch.arange(-6, 6, dtype=torch.int32),
        "bytes.u8": torch.arange(200, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(0.5),
        "empty": torch.zeros(0, 4),
    }


def perturbed(base: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in base.items():
        if tensor.is_floating_point():
            noise = 1e-3 * torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            new[name] = (tensor.float() + noise).to(tensor.dtype)
        elif tensor.dtype == torch.bool:
            new[name] = ~tensor
        else:
            new[name] = tensor + 1
    return new


def test_round_trip_is_bit_exact_for_every_dtype() -> None:
    base = base_weights()
    new = perturbed(base)
    new["layer.weight"][0, 0] = float("nan")  # any bit pattern survives, NaN and -0.0 included
    new["layer.weight"][0, 1] = -0.0
    base_before = {name: bits(t) for name, t in base.items()}

    payload, specs, decoded_specs = encode_delta(new, base)
    decoded = decode_delta(payload, header_of(specs, decoded_specs), base)

    assert set(decoded) == set(new) - {"empty"}  # a tensor without elements never changes
    for name, tensor in decoded.items():
        assert tensor.dtype == new[name].dtype and tensor.shape == new[name].shape
        assert bits(tensor) == bits(new[name]), name
    assert {name: bits(t) for name, t in base.items()} == base_before  # the base is never modified
    assert [s.name for s in specs] == [s.name for s in decoded_specs]
    assert all(s.dtype == "U8" and len(s.shape) == 1 for s in specs)
    by_name = {s.name: s for s in decoded_specs}
    assert by_name["embed.bf16"].dtype == "BF16" and list(by_name["embed.bf16"].shape) == [32, 4]


def test_unchanged_tensors_are_omitted_unless_asked() -> None:
    base = base_weights()
    new = dict(base)
    new["layer.bias"] = base["layer.bias"].clone()
    new["layer.bias"][3] += 1.0
    payload, specs, decoded_specs = encode_delta(new, base)
    assert [s.name for s in specs] == ["layer.bias"]
    assert torch.equal(decode_delta(payload, header_of(specs, decoded_specs), base)["layer.bias"], new["layer.bias"])

    payload, specs, decoded_specs = encode_delta(new, base, changed_only=False)
    assert {s.name for s in specs} == set(base)
    decoded = decode_delta(payload, header_of(specs, decoded_specs), base)
    assert all(bits(decoded[name]) == bits(new[name]) for name in base)


def test_nothing_changed_gives_an_empty_delta() -> None:
    base = base_weights()
    payload, specs, decoded_specs = encode_delta({k: v.clone() for k, v in base.items()}, base)
    assert specs == [] and decoded_specs == []
    assert decode_delta(payload, header_of(specs, decoded_specs), base) == {}


def test_a_small_step_compresses_well() -> None:
    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(256, 256, generator=generator)}
    new = {"w": base["w"] + 1e-6 * torch.randn(256, 256, generator=generator)}
    payload, _, _ = encode_delta(new, base)
    assert len(payload) < 0.6 * base["w"].numel() * 4


def test_encode_refuses_tensors_that_do_not_match_the_base() -> None:
    base = base_weights()
    with pytest.raises(DeltaError, match="not in the base"):
        encode_delta({"other": torch.zeros(2)}, base)
    with pytest.raises(DeltaError, match="the base has"):
        encode_delta({"layer.bias": torch.zeros(17)}, base)
    with pytest.raises(DeltaError, match="the base has"):
        encode_delta({"layer.bias": base["layer.bias"].double()}, base)
    with pytest.raises(ValueError, match="level"):
        encode_delta(base, base, level=10)


def _delta() -> tuple[dict[str, torch.Tensor], bytes, list, list]:
    base = base_weights()
    payload, specs, decoded_specs = encode_delta(perturbed(base), base)
    return base, payload, specs, decoded_specs


@pytest.mark.parametrize("change", ["shape", "dtype", "missing"])
def test_decode_refuses_a_base_that_does_not_fit(change: str) -> None:
    base, payload, specs, decoded_specs = _delta()
    if change == "shape":
        base["layer.weight"] = torch.zeros(8, 16)
    elif change == "dtype":
        base["layer.weight"] = base["layer.weight"].double()
    else:
        del base["layer.weight"]
    with pytest.raises(DeltaError, match="layer.weight") as excinfo:
        decode_delta(payload, header_of(specs, decoded_specs), base)
    assert excinfo.value.code == MISMATCH


def test_decode_refuses_a_header_that_does_not_fit_the_payload() -> None:
    base, payload, specs, decoded_specs = _delta()
    with pytest.raises(DeltaError, match="same names in the same order"):
        decode_delta(payload, header_of(specs, list(reversed(decoded_specs))), base)
    with pytest.raises(DeltaError, match="encoded tensors"):
        decode_delta(payload, header_of(specs, decoded_specs[:-1]), base)
    with pytest.raises(DeltaError, match="missing"):
        decode_delta(payload, header_of(specs[:-1], decoded_specs[:-1]), base)
    wrong_shape = [
        common_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=[3, 5]) if s.name == "half" else s
        for s in decoded_specs
    ]
    with pytest.raises(DeltaError, match="decodes to F16\\[3, 5\\]"):
        decode_delta(payload, header_of(specs, wrong_shape), base)
    header = header_of(specs, decoded_specs)
    header.delta_encoding = data_pb2.DELTA_ENCODING_UNSPECIFIED
    with pytest.raises(DeltaError, match="delta_encoding") as excinfo:
        decode_delta(payload, header, base)
    assert excinfo.value.code == MALFORMED


def test_decode_refuses_encoded_tensors_that_are_not_bytes() -> None:
    base = base_weights()
    payload = save({"layer.bias": torch.zeros(16)})
    decoded = [common_pb2.TensorSpec(name="layer.bias", dtype="F32", shape=[16])]
    with pytest.raises(DeltaError, match="must be 1-D U8"):
        decode_delta(payload, header_of(specs_of(parse_header(payload)), decoded), base)


def _single(base: dict[str, torch.Tensor], name: str, stream: bytes) -> tuple[bytes, data_pb2.WeightUpdateHeader]:
    """A hand-made delta of one tensor whose compressed stream is `stream`."""
    payload = save({name: torch.frombuffer(bytearray(stream), dtype=torch.uint8)})
    decoded = [common_pb2.TensorSpec(name=name, dtype=torch_dtype_name(base[name].dtype), shape=list(base[name].shape))]
    return payload, header_of(specs_of(parse_header(payload)), decoded)


@pytest.mark.parametrize("corruption", ["garbage", "truncated", "too_long", "too_short", "trailing", "bomb"])
def test_decode_refuses_corrupt_compressed_data(corruption: str) -> None:
    base = base_weights()
    expected_bytes = base["layer.bias"].numel() * 4
    streams = {
        "garbage": lambda: b"\x00not zlib at all" * 4,
        "truncated": lambda: zlib.compress(bytes(range(64)))[:-6],
        "too_long": lambda: zlib.compress(bytes(expected_bytes + 1)),
        "too_short": lambda: zlib.compress(bytes(expected_bytes - 4)),
        "trailing": lambda: zlib.compress(bytes(expected_bytes)) + b"extra",
        # 16 MiB of zeros in ~16 KiB: decompression stops after expected + 1 bytes
        "bomb": lambda: zlib.compress(bytes(16 << 20), 9),
    }
    stream = streams[corruption]()
    payload, header = _single(base, "layer.bias", stream)
    with pytest.raises(DeltaError, match="layer.bias") as excinfo:
        decode_delta(payload, header, base)
    assert excinfo.value.code == MALFORMED


def test_decode_refuses_a_flipped_byte_or_a_cut_payload() -> None:
    base, payload, specs, decoded_specs = _delta()
    header = header_of(specs, decoded_specs)
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 2] ^= 0xFF
    with pytest.raises(DeltaError):  # zlib notices (bad data or adler-32) or the size is off
        decode_delta(bytes(corrupted), header, base)
    with pytest.raises(DeltaError, match="delta payload"):
        decode_delta(payload[:-10], header, base)
