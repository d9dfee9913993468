#!/usr/bin/env python
"""How much of a model one optimizer step changes, and what a DELTA of it costs: SPARSE and XOR_ZLIB against FULL.

    .venv/bin/python bench/delta_fraction.py [--models 100m,1b] [--lrs 1e-6,1e-5] [--dtypes bf16,fp32]
                                             [--encodings sparse,xor_zlib] [--repeats 3] [--pooled-max-gib 6]
                                             [--markdown PATH]

Models: one Qwen2 family (the tiny model's: 1088-token vocabulary, tied embeddings, head_dim 64), fp32 master
weights initialised as transformers does (seeded): ``100m`` = hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 3072 (~105M parameters, part e's 100M); ``1b`` = TinyLlama-1.1B's shape, hidden 2048, 22 layers, 32
heads, 4 KV heads, intermediate 5632 (~971M parameters, part e's 1B). Each model is built once, in memory.

The step: one AdamW step (the trainer's: ``OptimizerConfig`` defaults, weight decay 0.01 on matrices and
embeddings, none on biases and norms) of next-token loss on 16 random tokens, from the initial weights, as
``bench/weight_update.py``'s delta table does. To keep a 1B model within ~6 GB the step is taken inside the
backward pass, one parameter at a time as its gradient is ready (a post-accumulate-grad hook: the gradient is
freed right after, and so is the fp32 weight once it is stepped and cast: nothing reads it afterwards), on a copy,
once per learning rate. Each stepped tensor is cast to each dtype (bf16: what inference serves, cast from the
fp32 master; fp32: the master itself) and encoded against the initial weights cast the same way.

Two timings. Per tensor: ``encode_delta`` and ``decode_delta`` of one tensor at a time on one thread (checked
bit-exact), the sum over tensors of the fastest of ``--repeats`` runs each. Whole model: what the publisher and
a worker run, ``encode_delta`` of the whole state dict and ``decode_delta`` of its payload, with their default
thread pools (the tensors side by side on up to one thread per usable core), checked bit-exact; one untimed run
first (fresh memory: its times are shown apart), then ``--repeats`` timed runs, min / median / max. The whole-model
runs hold the new and base tensors of a point and one decoded copy (3 x the bf16 model); a point is measured so
only while they fit in ``--pooled-max-gib`` next to the points before it.

Columns: changed elements (bitwise, over all elements); FULL = the safetensors payload of every tensor (what a
FULL publish sends); each encoding's payload = its encoded tensors plus one safetensors header; break-even wire
rate = 2 x (FULL - delta) / (encode + decode), from the whole-model medians where measured (else the per-tensor
sums): the delta saves time when the trainer -> broker -> worker path moves fewer bytes per second than that (the
publisher's "auto" rule, ``trainer/publish.py``). Targets at lr 1e-6 on the 1B model in bf16: the SPARSE payload
<= 0.1 of FULL, and its whole-model encode + decode (median) <= 1.0 s.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Section, Stats, fmt, target_line  # noqa: E402

from primerl.proto.units import MiB  # noqa: E402

NUM_TRAIN_TOKENS = 16
TARGET_FRACTION = 0.1
TARGET_SECONDS = 1.0  # whole-model SPARSE encode + decode, median
TARGET_POINT = ("1b", "bf16", 1e-6)
ENCODINGS = {"sparse": "DELTA_ENCODING_SPARSE", "xor_zlib": "DELTA_ENCODING_XOR_ZLIB"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def model_specs() -> dict[str, Any]:
    from primerl.trainer.tiny_model import TinyModelSpec

    return {
        "100m": TinyModelSpec(
            hidden_size=768, num_layers=12, num_attention_heads=12, num_key_value_heads=4, intermediate_size=3072
        ),
        "1b": TinyModelSpec(
            hidden_size=2048, num_layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632
        ),
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@dataclass
class EncodingCost:
    data_bytes: int = 0
    specs: list = field(default_factory=list)  # every encoded TensorSpec, for the payload's one header
    encode_s: float = 0.0  # per tensor, one thread: the sum over tensors of each one's fastest run
    decode_s: float = 0.0
    forms: Counter = field(default_factory=Counter)
    # Whole model (module docstring): the untimed first run, then the timed ones.
    first_encode_s: float | None = None
    first_decode_s: float | None = None
    whole_encode_s: Stats = field(default_factory=Stats)
    whole_decode_s: Stats = field(default_factory=Stats)
    whole_total_s: Stats = field(default_factory=Stats)

    def payload_bytes(self) -> int:
        return self.data_bytes + header_bytes(self.specs)


@dataclass(eq=False)  # compared by identity: it holds tensors
class Point:
    """One (model, dtype, lr): the step's changes and each encoding's cost, summed over the tensors."""

    model: str
    num_params: int
    dtype: str
    lr: float
    num_elements: int = 0
    num_changed: int = 0
    full_specs: list = field(default_factory=list)
    full_data_bytes: int = 0
    costs: dict[str, EncodingCost] = field(default_factory=dict)
    # For the whole-model timings: the stepped and the base tensors, cast (empty when the point is not pooled).
    new: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=dict)

    @property
    def full_bytes(self) -> int:
        return self.full_data_bytes + header_bytes(self.full_specs, metadata={"format": "pt"})


def header_bytes(specs: list, metadata: dict[str, str] | None = None) -> int:
    """Length prefix + padded JSON header of a safetensors blob of tensors with these specs."""
    import torch

    from primerl.proto.tensor_frames import DTYPES as ST_DTYPES
    from primerl.trainer.payload_writer import safetensors_layout

    if not specs:
        return 16
    meta = {
        s.name: torch.empty(list(s.shape), dtype=getattr(torch, ST_DTYPES[s.dtype][2]), device="meta") for s in specs
    }
    prefix, _ = safetensors_layout(meta, metadata)
    return len(prefix)


def build_model(spec: Any, seed: int) -> Any:
    """The fp32 ``Qwen2ForCausalLM`` of ``spec``, initialised by transformers with ``seed``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from primerl.trainer.tiny_model import TOKENIZER_VOCAB_SIZE, VOCAB_MULTIPLE

    vocab_size = spec.vocab_size or -(-TOKENIZER_VOCAB_SIZE // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).to(torch.float32)


def raw_bits(tensor: Any) -> Any:
    import numpy as np
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[tensor.element_size()])


def measure_tensor(point: Point, name: str, new: Any, base: Any, encodings: list[str], repeats: int) -> None:
    """Add one tensor's changes and encodings (timed, checked bit-exact) to ``point``."""
    import numpy as np

    from primerl.proto.tensor_frames import TensorFrameError, specs_of
    from primerl.proto.v1 import data_pb2
    from primerl.proto.weight_delta import decode_delta, encode_delta, torch_dtype_name

    new_bits, base_bits = raw_bits(new), raw_bits(base)
    num_changed = int(np.count_nonzero(new_bits != base_bits))
    point.num_elements += new_bits.size
    point.num_changed += num_changed
    point.full_specs.append(
        data_pb2.WeightUpdateHeader().tensors.add(name=name, dtype=torch_dtype_name(new.dtype), shape=list(new.shape))
    )
    point.full_data_bytes += new_bits.nbytes
    for label in encodings:
        encoding = data_pb2.DeltaEncoding.Value(ENCODINGS[label])
        cost = point.costs.setdefault(label, EncodingCost())
        best_encode = best_decode = math.inf
        for _ in range(repeats if label == "sparse" else 1):
            start = time.perf_counter()
            payload, specs, decoded = encode_delta({name: new}, {name: base}, encoding=encoding, num_threads=1)
            middle = time.perf_counter()
            header = data_pb2.WeightUpdateHeader(
                kind=data_pb2.WEIGHT_UPDATE_KIND_DELTA, delta_encoding=encoding, tensors=specs, decoded_tensors=decoded
            )
            out = decode_delta(payload, header, {name: base})
            end = time.perf_counter()
            best_encode, best_decode = min(best_encode, middle - start), min(best_decode, end - middle)
        if num_changed and not np.array_equal(raw_bits(out[name]), new_bits):
            raise AssertionError(f"{label}: {name} does not decode bit-exactly")
        if not num_changed and out:
            raise AssertionError(f"{label}: {name} did not change but is in the delta")
        from primerl.proto.tensor_frames import parse_header

        try:
            entries = parse_header(payload)
        except TensorFrameError as exc:  # encode_delta wrote it: a bug here
            raise AssertionError(f"{label}: {name}: unreadable payload ({exc})") from None
        cost.data_bytes += sum(e.end - e.start for e in entries.values())
        cost.specs.extend(specs_of(entries))
        cost.encode_s += best_encode
        cost.decode_s += best_decode
        if label == "sparse" and num_changed:
            names = set(entries)
            cost.forms["gaps" if name + "#gaps" in names else "mask" if name + "#mask" in names else "whole"] += 1


def measure_model(model_name: str, spec: Any, args: argparse.Namespace) -> list[Point]:
    """Build the model once, take the step inside one backward pass (module docstring), measure every point."""
    import torch

    from primerl.configs.trainer import OptimizerConfig
    from primerl.trainer.optim import no_weight_decay

    start = time.perf_counter()
    model = build_model(spec, args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"[{model_name}] built: {num_params / 1e6:.0f}M parameters in {time.perf_counter() - start:.1f} s", flush=True
    )
    points = {(dtype, lr): Point(model_name, num_params, dtype, lr) for lr in args.lrs for dtype in args.dtypes}
    pooled = pooled_points(list(points.values()), args.pooled_max_gib * 2**30)
    names = {param: name for name, param in model.named_parameters()}
    progress = {"done": 0}

    def step_and_measure(param: torch.nn.Parameter) -> None:
        name = names[param]
        base32 = param.detach()
        weight_decay = 0.0 if no_weight_decay(name, param) else OptimizerConfig().weight_decay
        for lr in args.lrs:
            config = OptimizerConfig(lr=lr)
            stepped = torch.nn.Parameter(base32.clone())
            stepped.grad = param.grad
            torch.optim.AdamW([stepped], lr=lr, betas=(config.betas1, config.betas2), weight_decay=weight_decay).step()
            for dtype in args.dtypes:
                torch_dtype = getattr(torch, DTYPES[dtype])
                point = points[(dtype, lr)]
                new, base = stepped.detach().to(torch_dtype), base32.to(torch_dtype)
                if point in pooled:
                    point.new[name], point.base[name] = new, base
                measure_tensor(point, name, new, base, args.encodings, args.repeats)
        param.grad = None  # freed as soon as used: no model-sized gradient or optimizer state
        param.data = torch.empty(0)  # every use of the weight is behind us once its gradient is complete
        progress["done"] += 1
        if progress["done"] % 20 == 0:
            print(
                f"[{model_name}] {progress['done']}/{len(names)} tensors measured "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )

    handles = [param.register_post_accumulate_grad_hook(step_and_measure) for param in model.parameters()]
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, model.config.vocab_size, (1, NUM_TRAIN_TOKENS), generator=generator)
    model.train()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    for handle in handles:
        handle.remove()
    missing = [name for param, name in names.items() if param.grad is not None]
    if progress["done"] != len(names) or missing:
        raise RuntimeError(f"[{model_name}] {len(names) - progress['done']} parameters got no gradient: {missing}")
    del model
    for point in pooled:
        for label in args.encodings:
            measure_whole(point, label, args.repeats)
        point.new.clear()
        point.base.clear()
    print(f"[{model_name}] done in {time.perf_counter() - start:.1f} s", flush=True)
    return list(points.values())


def pooled_points(points: list[Point], max_bytes: float) -> list[Point]:
    """The points whose whole-model runs fit in ``max_bytes``: all of them hold their new and base tensors until
    the end of the backward pass, and one at a time a decoded copy (module docstring)."""
    pooled: list[Point] = []
    for point in points:
        size = point.num_params * (2 if point.dtype == "bf16" else 4)
        held = sum(2 * p.num_params * (2 if p.dtype == "bf16" else 4) for p in [*pooled, point])
        largest = max([size, *(p.num_params * (2 if p.dtype == "bf16" else 4) for p in pooled)])
        if held + largest <= max_bytes:
            pooled.append(point)
    return pooled


def measure_whole(point: Point, label: str, repeats: int) -> None:
    """Time ``encode_delta`` of the whole state dict and ``decode_delta`` of its payload, as the publisher and a
    worker run them (default threads): one untimed run, then ``repeats`` timed ones (XOR_ZLIB: one timed run),
    each checked bit-exact."""
    import gc

    import torch

    from primerl.proto.v1 import data_pb2
    from primerl.proto.weight_delta import decode_delta, encode_delta

    encoding = data_pb2.DeltaEncoding.Value(ENCODINGS[label])
    cost = point.costs[label]
    changed = {name for name, new in point.new.items() if not torch.equal(bits_of(new), bits_of(point.base[name]))}
    first_runs = 1 if label == "sparse" else 0  # XOR_ZLIB: one run, timed (zlib takes tens of seconds at 1B)
    for run in range(first_runs + (repeats if label == "sparse" else 1)):
        gc.collect()
        start = time.perf_counter()
        payload, specs, decoded = encode_delta(point.new, point.base, encoding=encoding)
        middle = time.perf_counter()
        header = data_pb2.WeightUpdateHeader(
            kind=data_pb2.WEIGHT_UPDATE_KIND_DELTA, delta_encoding=encoding, tensors=specs, decoded_tensors=decoded
        )
        out = decode_delta(payload, header, point.base)
        end = time.perf_counter()
        if set(out) != changed:
            raise AssertionError(f"{label}: the whole-model delta decodes {len(out)} tensors, {len(changed)} changed")
        for name, tensor in out.items():
            if not torch.equal(bits_of(tensor), bits_of(point.new[name])):
                raise AssertionError(f"{label}: {name} does not decode bit-exactly (whole model)")
        if run < first_runs:
            cost.first_encode_s, cost.first_decode_s = middle - start, end - middle
        else:
            cost.whole_encode_s.add(middle - start)
            cost.whole_decode_s.add(end - middle)
            cost.whole_total_s.add(end - start)
        del payload, out


def bits_of(tensor: Any) -> Any:
    """The tensor's bits as an integer tensor of its width (NaNs compare equal to themselves)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.reshape(-1).view(width)


def rows_of(points: list[Point], encodings: list[str]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "params", "dtype", "lr", "changed elements", "FULL MiB"]
    for label in encodings:
        name = label.upper()
        header += [f"{name} MiB", f"{name} / FULL"]
        if label == "sparse":
            header.append("forms gaps / mask / whole")
        header += [
            f"{name} encode s, per tensor",
            f"{name} decode s, per tensor",
            f"{name} encode s, whole model",
            f"{name} decode s, whole model",
            f"{name} encode + decode s, whole model (first run)",
            f"{name} break-even wire GB/s",
        ]
    rows = []
    for p in points:
        row = [
            p.model,
            f"{p.num_params / 1e6:.0f}M",
            p.dtype,
            f"{p.lr:g}",
            f"{p.num_changed / p.num_elements:.2%}",
            fmt(p.full_bytes / MiB, 4),
        ]
        for label in encodings:
            cost = p.costs[label]
            delta = cost.payload_bytes()
            row += [fmt(delta / MiB, 3), f"{delta / p.full_bytes:.3f}"]
            if label == "sparse":
                row.append(f"{cost.forms['gaps']} / {cost.forms['mask']} / {cost.forms['whole']}")
            seconds = cost.whole_total_s.median if len(cost.whole_total_s) else cost.encode_s + cost.decode_s
            break_even = 2 * max(0, p.full_bytes - delta) / seconds / 1e9 if seconds > 0 else math.inf
            first = (
                f" ({fmt(cost.first_encode_s + cost.first_decode_s)})"
                if cost.first_encode_s is not None and cost.first_decode_s is not None
                else ""
            )
            row += [
                fmt(cost.encode_s),
                fmt(cost.decode_s),
                spread(cost.whole_encode_s),
                spread(cost.whole_decode_s),
                spread(cost.whole_total_s) + first,
                fmt(break_even),
            ]
        rows.append(row)
    return header, rows


def spread(stats: Stats) -> str:
    """``min / median / max`` of repeated runs; one run alone; none: a dash."""
    if len(stats) <= 1:
        return fmt(stats.median)
    return f"{fmt(stats.min)} / {fmt(stats.median)} / {fmt(stats.max)}"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="100m,1b", help="comma-separated: 100m, 1b")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    parser.add_argument("--encodings", default="sparse,xor_zlib", help="comma-separated: sparse, xor_zlib")
    parser.add_argument(
        "--repeats", type=int, default=3, help="SPARSE encode/decode runs per tensor (fastest kept) and whole model"
    )
    parser.add_argument(
        "--pooled-max-gib",
        type=float,
        default=6.0,
        help="memory for the whole-model runs' tensors (module docstring); 0: per-tensor timings only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, default=None, help="write the markdown section here")
    args = parser.parse_args(argv)
    specs = model_specs()
    models = args.models.split(",")
    args.lrs = [float(lr) for lr in args.lrs.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.encodings = args.encodings.split(",")
    for values, known, what in (
        (models, specs, "model"),
        (args.dtypes, DTYPES, "dtype"),
        (args.encodings, ENCODINGS, "encoding"),
    ):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"unknown {what} {unknown}; choose from {sorted(known)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.pooled_max_gib < 0:
        parser.error("--pooled-max-gib must be >= 0")

    section = Section("Sparse deltas: what one AdamW step changes, and what it costs to send", argv)
    cpu = cpu_name()
    points = []
    for model_name in models:
        points += measure_model(model_name, specs[model_name], args)
    header, rows = rows_of(points, args.encodings)
    section.line(
        f"CPU: {cpu}, {usable_cores()} usable cores. Per tensor: one tensor at a time on one thread; whole model: "
        "the whole state dict at once, as the publisher and a worker run it (`encode_delta` / `decode_delta` with "
        "their default thread pools)."
    )
    section.line()
    section.line(
        "One AdamW step (weight decay 0.01, 16 tokens) from transformers' initial weights, fp32 master "
        "weights; bf16 = the stepped and the initial weights cast to bf16 (what inference serves). "
        "Payload sizes are exact (one safetensors header for all encoded tensors); encode / decode per tensor: "
        f"the sum over tensors, each the fastest of {args.repeats} runs for SPARSE, one run for XOR_ZLIB; whole "
        f"model: min / median / max of {args.repeats} runs after an untimed first one (in brackets: that first "
        "run, into fresh memory) for SPARSE, one run for XOR_ZLIB; a dash: not measured (memory). Break-even wire "
        "rate: the delta saves time while the trainer -> broker -> worker path moves fewer bytes/s than "
        "2 x (FULL - delta) / (encode + decode), whole-model median where measured. `bench/delta_fraction.py` "
        "(module docstring) says how."
    )
    section.line()
    section.table(header, rows)
    target = next((p for p in points if (p.model, p.dtype, p.lr) == TARGET_POINT and "sparse" in p.costs), None)
    if target is not None:
        fraction = target.costs["sparse"].payload_bytes() / target.full_bytes
        section.line(
            target_line(
                "1B bf16 SPARSE DELTA payload / FULL at lr 1e-6",
                fraction,
                "<=",
                TARGET_FRACTION,
                f"({target.num_changed / target.num_elements:.2%} of the elements changed)",
            )
        )
    else:
        section.line("- **not measured** 1B bf16 SPARSE DELTA payload / FULL at lr 1e-6 (target <= 0.1)")
    seconds = target.costs["sparse"].whole_total_s if target is not None else Stats()
    section.line(
        target_line(
            "1B bf16 SPARSE encode + decode at lr 1e-6, whole model, median",
            seconds.median,
            "<=",
            TARGET_SECONDS,
            f"(min / median / max {spread(seconds)} s over {len(seconds)} runs; {cpu}, {usable_cores()} cores)",
        )
    )
    section.line()
    if args.markdown:
        section.write(args.markdown)
    print(section.text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
