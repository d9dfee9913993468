"""The SPARSE weight delta: bit-exact round trips (every dtype, each of the three forms, nothing or everything
changed, NaN payloads, -0.0), its size against FULL for a small bf16 step, its estimate, and refusal of payloads
whose positions, values or names do not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save

from primerl.proto.delta_base import torch_dtype_name
from primerl.proto.tensor_frames import parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_delta import DeltaError, decode_delta, encode_delta, estimate_delta

SPARSE = data_pb2.DELTA_ENCODING_SPARSE
MISMATCH = common_pb2.ERROR_CODE_TENSOR_MISMATCH
MALFORMED = common_pb2.ERROR_CODE_MALFORMED_HEADER


def header_of(specs: list, decoded: list) -> data_pb2.WeightUpdateHeader:
    return data_pb2.WeightUpdateHeader(
        kind=data_pb2.WEIGHT_UPDATE_KIND_DELTA, tensors=specs, decoded_tensors=decoded, delta_encoding=SPARSE
    )


def encode(
    new: dict[str, torch.Tensor], base: dict[str, torch.Tensor], **kwargs
) -> tuple[bytes, data_pb2.WeightUpdateHeader]:
    payload, specs, decoded = encode_delta(new, base, encoding=SPARSE, **kwargs)
    return payload, header_of(specs, decoded)


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def forms(payload: bytes) -> dict[str, str]:
    """{tensor name: "gaps" | "mask" | "whole"} of a SPARSE payload."""
    names = set(parse_header(payload))
    out = {}
    for name in names:
        if name.endswith("#values"):
            tensor = name.removesuffix("#values")
            out[tensor] = "gaps" if tensor + "#gaps" in names else "mask" if tensor + "#mask" in names else "whole"
    return out


def assert_round_trip(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor], **kwargs) -> bytes:
    base_before = {name: bits(t) for name, t in base.items()}
    payload, header = encode(new, base, **kwargs)
    decoded = decode_delta(payload, header, base)
    changed = {name for name in new if bits(new[name]) != bits(base[name])}
    assert set(decoded) == (changed if kwargs.get("changed_only", True) else set(new))
    for name, tensor in decoded.items():
        assert tensor.dtype == new[name].dtype and tensor.shape == new[name].shape, name
        assert bits(tensor) == bits(new[name]), name
    assert {name: bits(t) for name, t in base.items()} == base_before  # the base is never modified
    return payload


def base_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(64, 48, generator=generator),
        "embed.bf16": torch.randn(96, 40, generator=generator).to(torch.bfloat16),
        "half": torch.randn(33, 7, generator=generator).to(torch.float16),
        "double": torch.randn(300, generator=generator, dtype=torch.float64),
        "steps.i64": torch.arange(1000, dtype=torch.int64) * 1_000_003,
        "counts.i32": torch.arange(-600, 600, dtype=torch.int32),
        "bytes.u8": torch.arange(200, dtype=torch.uint8),
        "mask": torch.arange(50) % 3 == 0,
        "scalar": torch.tensor(0.5),
        "empty": torch.zeros(0, 4),
    }


def changed_at(base: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``base`` with about ``fraction`` of each tensor's elements changed (bitwise), at random places."""
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in base.items():
        flat = tensor.clone().reshape(-1)
        where = torch.rand(flat.shape, generator=generator) < fraction
        if tensor.dtype == torch.bool:
            flat[where] = ~flat[where]
        else:
            flat[where] = flat[where] + 1
        new[name] = flat.reshape(tensor.shape)
    return new


@pytest.mark.parametrize("fraction", [0.002, 0.05, 0.3, 0.97, 1.0])
def test_round_trip_is_bit_exact_for_every_dtype(fraction: float) -> None:
    base = base_weights()
    assert_round_trip(changed_at(base, fraction, seed=1), base)


def test_random_tensors_round_trip_whatever_changed() -> None:
    """Random dtypes, shapes, fractions and clusters, seeded: decode(encode(new, base), base) == new bitwise."""
    rng = np.random.default_rng(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]
    for _ in range(40):
        numel = int(rng.integers(1, 5000))
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        base_bits = rng.integers(0, 256, numel * torch.empty(0, dtype=dtype).element_size(), dtype=np.uint8)
        base = torch.from_numpy(base_bits.copy()).view(dtype)
        new_bits = base_bits.copy().reshape(numel, -1)
        fraction = float(rng.choice([0.0, 0.001, 0.01, 0.1, 0.2, 0.5, 1.0]))
        where = rng.random(numel) < fraction
        if rng.random() < 0.3:  # a cluster: a run of changed elements
            begin = int(rng.integers(numel))
            where[begin : begin + int(rng.integers(1, 300))] = True
        new_bits[where, 0] ^= np.uint8(1 + rng.integers(255))
        new = torch.from_numpy(new_bits.reshape(-1)).view(dtype)
        assert_round_trip({"t": new}, {"t": base})


def test_each_form_is_chosen_by_its_size() -> None:
    base = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    for fraction, form in ((0.02, "gaps"), (0.3, "mask"), (0.99, "whole")):
        payload = assert_round_trip(changed_at(base, fraction, seed=2), base)
        assert forms(payload) == {"w": form}, fraction
        assert len(payload) < 4096 * 2 * min(1.0, 1.5 * fraction + 0.1) + 300


@pytest.mark.parametrize(
    "positions",
    [
        [0],
        [4095],
        [0, 4095],
        [255],
        [256],
        [254, 509, 765],
        [510, 1021],
        [0, 1, 2, 3],
        list(range(0, 4096, 600)),
        [100, 3000, 3001],
    ],
)
def test_gaps_with_long_jumps_round_trip(positions: list[int]) -> None:
    """Gaps of 255 (the last one-byte gap), 256 (one skip byte), 510/511 and past the end of a skip run."""
    base = {"w": torch.zeros(4096, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][positions] = 1.0
    payload = assert_round_trip(new, base)
    assert forms(payload) == {"w": "gaps"}


def test_nothing_changed_gives_an_empty_delta_unless_asked() -> None:
    base = base_weights()
    payload, header = encode({k: v.clone() for k, v in base.items()}, base)
    assert list(header.tensors) == [] and list(header.decoded_tensors) == []
    assert decode_delta(payload, header, base) == {}

    payload = assert_round_trip({k: v.clone() for k, v in base.items()}, base, changed_only=False)
    assert len(parse_header(payload)) == 2 * len(base)  # an empty gaps stream and no values each


def test_nan_payloads_and_signed_zeros_are_kept_bit_exactly() -> None:
    nan_bits = torch.tensor([0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, 0x0000, 0x8000, 0x3F80, 0x7F80], dtype=torch.int32)
    base = {"w": nan_bits.to(torch.int16).view(torch.bfloat16).repeat(64)}
    new = {"w": base["w"].clone()}
    flat = new["w"].view(torch.int16)
    flat[0] = 0x7FC2  # another quiet NaN payload
    flat[2] = 0x7FC0  # negative NaN to positive NaN
    flat[4] = -0x8000  # +0.0 -> -0.0
    flat[13] = 0x0000  # -0.0 -> +0.0
    flat[100] = 0x7FC0  # a number -> NaN
    assert_round_trip(new, base)
    f32 = {"w": torch.tensor([0.0, -0.0, float("nan"), 1.0] * 100)}
    f32_new = {"w": f32["w"].clone()}
    f32_new["w"].view(torch.int32)[2] = 0x7FC00001  # NaN payload
    f32_new["w"][0] = -0.0
    assert_round_trip(f32_new, f32)


def test_decoded_tensors_own_their_memory() -> None:
    base = {"w": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(8)}
    new = {"w": base["w"].clone(), "b": torch.ones(8)}
    new["w"][7] = 2.0
    payload, header = encode(new, base)
    buffer = bytearray(payload)
    decoded = decode_delta(buffer, header, base)
    buffer[:] = bytes(len(buffer))  # a reused receive buffer
    decoded["w"][0] = 5.0
    assert decoded["w"][7] == 2.0 and torch.equal(decoded["b"], torch.ones(8))
    assert not base["w"].any()


def test_a_small_bf16_step_is_a_small_fraction_of_full() -> None:
    """fp32 master weights moved by an Adam-sized step of 1e-6, served in bf16: a few % of the elements change."""
    generator = torch.Generator().manual_seed(0)
    master = 0.02 * torch.randn(512, 512, generator=generator)
    step = 1e-6 * torch.sign(torch.randn(512, 512, generator=generator))
    base, new = {"w": master.to(torch.bfloat16)}, {"w": (master + step).to(torch.bfloat16)}
    payload = assert_round_trip(new, base)
    assert len(payload) < 0.1 * 512 * 512 * 2
    estimate = estimate_delta(new, base, encoding=SPARSE)
    assert estimate.encoding == SPARSE and estimate.full_bytes == 512 * 512 * 2
    assert 0.5 * len(payload) < estimate.delta_bytes < 2 * len(payload)
    assert 0 < estimate.changed_bytes < 0.1 * estimate.full_bytes
    assert estimate.encode_s > 0 and estimate.decode_s > 0


def test_estimate_of_an_unchanged_model_is_empty() -> None:
    base = base_weights()
    estimate = estimate_delta({k: v.clone() for k, v in base.items()}, base, encoding=SPARSE)
    assert (estimate.delta_bytes, estimate.changed_bytes, estimate.encode_s) == (0, 0, 0.0)


def test_encode_refuses_tensors_that_do_not_match_the_base_and_unknown_encodings() -> None:
    base = base_weights()
    with pytest.raises(DeltaError, match="not in the base"):
        encode_delta({"other": torch.zeros(2)}, base, encoding=SPARSE)
    with pytest.raises(DeltaError, match="the base has"):
        encode_delta({"half": base["half"].float()}, base, encoding=SPARSE)
    with pytest.raises(ValueError, match="encoding"):
        encode_delta(base, base, encoding=data_pb2.DELTA_ENCODING_UNSPECIFIED)
    with pytest.raises(ValueError, match="encoding"):
        estimate_delta(base, base, encoding=7)


# ---- malformed payloads -----------------------------------------------------------------------------------------


def hand_made(
    base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], decoded_names: list[str] | None = None
) -> tuple[bytes, data_pb2.WeightUpdateHeader]:
    """A SPARSE payload of ``tensors`` (encoded names) decoding to ``decoded_names`` (default: the names before
    the suffixes), with a header that matches the payload."""
    payload = save(tensors)
    names = decoded_names if decoded_names is not None else sorted({n.rsplit("#", 1)[0] for n in tensors})
    decoded = [
        common_pb2.TensorSpec(name=n, dtype=torch_dtype_name(base[n].dtype), shape=list(base[n].shape)) for n in names
    ]
    return payload, header_of(specs_of(parse_header(payload)), decoded)


def u8(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


BASE = {"w": torch.zeros(20, dtype=torch.bfloat16), "v": torch.zeros(3, 4)}
VALS = torch.ones(2, dtype=torch.bfloat16)

MALFORMED_CASES = {
    # gaps: positions out of range, count != values, a trailing skip byte
    "gap past the end": ({"w#gaps": u8([5, 16]), "w#values": VALS}, "out of range"),
    "skip past the end": ({"w#gaps": u8([1, 0, 1]), "w#values": VALS}, "out of range"),
    "fewer positions": ({"w#gaps": u8([3]), "w#values": VALS}, "1 positions but 2 values"),
    "more positions": ({"w#gaps": u8([1, 1, 1]), "w#values": VALS}, "3 positions but 2 values"),
    "trailing skip": ({"w#gaps": u8([1, 1, 0]), "w#values": VALS}, "ends with a skip"),
    # mask: wrong length, bits past the end, count != values
    "short mask": ({"w#mask": u8([3, 0]), "w#values": VALS}, "mask of 2 bytes for 20 elements"),
    "long mask": ({"w#mask": u8([3, 0, 0, 0]), "w#values": VALS}, "mask of 4 bytes"),
    "mask padding": ({"w#mask": u8([3, 0, 0x10]), "w#values": VALS}, "past its 20 elements"),
    "mask count": ({"w#mask": u8([7, 0, 0]), "w#values": VALS}, "marks 3 elements but there are 2 values"),
    # whole: wrong count
    "whole too short": ({"w#values": torch.ones(19, dtype=torch.bfloat16)}, "19 values for a whole tensor of 20"),
}
MISMATCH_CASES = {
    "values of another dtype": ({"w#gaps": u8([1, 1]), "w#values": torch.ones(2)}, "values must be 1-D BF16"),
    "values not 1-D": ({"w#gaps": u8([1, 1]), "w#values": VALS.reshape(1, 2)}, "values must be 1-D BF16"),
    "gaps not U8": ({"w#gaps": torch.tensor([1, 1], dtype=torch.int32), "w#values": VALS}, "must be 1-D U8"),
    "mask not U8": ({"w#mask": torch.tensor([3, 0, 0], dtype=torch.int16), "w#values": VALS}, "must be 1-D U8"),
    "gaps and mask": ({"w#gaps": u8([1, 1]), "w#mask": u8([3, 0, 0]), "w#values": VALS}, "both"),
    "no values": ({"w#gaps": u8([1, 1])}, "no 'w#values'"),
    "an unclaimed tensor": ({"w#values": torch.ones(20, dtype=torch.bfloat16), "x#values": VALS}, "no decoded"),
}


@pytest.mark.parametrize("case", list(MALFORMED_CASES))
def test_decode_refuses_positions_that_do_not_fit(case: str) -> None:
    tensors, message = MALFORMED_CASES[case]
    payload, header = hand_made(BASE, tensors, ["w"])
    with pytest.raises(DeltaError, match=message) as excinfo:
        decode_delta(payload, header, BASE)
    assert excinfo.value.code == MALFORMED and "'w'" in str(excinfo.value)


@pytest.mark.parametrize("case", list(MISMATCH_CASES))
def test_decode_refuses_tensors_that_do_not_fit(case: str) -> None:
    tensors, message = MISMATCH_CASES[case]
    payload, header = hand_made(BASE, tensors, ["w"])
    with pytest.raises(DeltaError, match=message) as excinfo:
        decode_delta(payload, header, BASE)
    assert excinfo.value.code == MISMATCH


def test_decode_refuses_a_header_or_base_that_does_not_fit() -> None:
    new = {"w": BASE["w"].clone(), "v": BASE["v"] + 1}
    new["w"][3] = 1.0
    payload, header = encode(new, BASE)

    twice = header_of(list(header.tensors), [*header.decoded_tensors, header.decoded_tensors[0]])
    with pytest.raises(DeltaError, match="listed twice"):
        decode_delta(payload, twice, BASE)
    with pytest.raises(DeltaError, match="missing") as excinfo:
        decode_delta(payload, header_of(list(header.tensors)[:-1], list(header.decoded_tensors)), BASE)
    assert excinfo.value.code == MISMATCH
    wrong_shape = [
        common_pb2.TensorSpec(name="v", dtype="F32", shape=[4, 3]) if s.name == "v" else s
        for s in header.decoded_tensors
    ]
    with pytest.raises(DeltaError, match="decodes to F32\\[4, 3\\]"):
        decode_delta(payload, header_of(list(header.tensors), wrong_shape), BASE)
    for base in ({"w": BASE["w"]}, {"w": BASE["w"].float(), "v": BASE["v"]}):
        with pytest.raises(DeltaError) as excinfo:
            decode_delta(payload, header, base)
        assert excinfo.value.code == MISMATCH
    unknown = header_of(list(header.tensors), list(header.decoded_tensors))
    unknown.delta_encoding = 9
    with pytest.raises(DeltaError, match="delta_encoding 9") as excinfo:
        decode_delta(payload, unknown, BASE)
    assert excinfo.value.code == MALFORMED
    with pytest.raises(DeltaError, match="delta payload"):
        decode_delta(payload[:-3], header, BASE)


def test_a_flipped_byte_never_decodes_silently_out_of_bounds() -> None:
    """Any single corrupted byte of a payload's data either decodes (to other values: the digest guards those)
    or raises DeltaError; never an IndexError or a crash."""
    base = {"w": torch.zeros(3000, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][[5, 600, 2999]] = 1.0
    payload, header = encode(new, base)
    start = 8 + int.from_bytes(payload[:8], "little")
    for offset in range(start, len(payload)):
        for flip in (0x01, 0x80, 0xFF):
            corrupted = bytearray(payload)
            corrupted[offset] ^= flip
            try:
                decode_delta(bytes(corrupted), header, base)
            except DeltaError:
                pass
