#!/usr/bin/env python
"""What applying a weight update costs an in-process vLLM engine, without the broker: ``PolicyUpdater.apply``
of FULL, DELTA and LORA updates on the tiny model.

    .venv/bin/python bench/policy_apply_times.py [--repeats 5]

Builds the tiny model (``build_tiny_model``, seed 0) in a temporary directory, starts one in-process engine with
the primerl worker extension and LoRA enabled (rank 8), then applies ``--repeats`` updates of each kind in turn:
FULL (all weights, seeded noise), DELTA (the same noise on a few tensors, XOR + zlib against the served
weights), LORA (a rank-8 adapter on q_proj of every layer). Prints the median and max milliseconds per kind and
the phases of the last update of each (``PolicyUpdater.last_phases_ms``). The measurement that
``tests/test_policy_updates.py`` used to print ("Not a check").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
from pathlib import Path

import torch


def _update(kind: int, version: int, payload: bytes, **fields):
    from primerl.proto.v1 import data_pb2

    return data_pb2.WeightUpdateHeader(
        policy_version=version,
        kind=kind,
        digest=hashlib.sha256(payload).hexdigest(),
        payload_bytes=len(payload),
        **fields,
    ), payload


def _noisy(weights: dict[str, torch.Tensor], seed: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.02 * torch.randn(t.shape, generator=generator) if names is None or name in names else t.clone()
        for name, t in weights.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="updates of each kind")
    args = parser.parse_args()

    from safetensors.torch import load_file, save

    from primerl.inference.engine import EngineOptions, create_llm, shutdown_llm
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.worker_extension import WORKER_EXTENSION_CLS
    from primerl.proto.tensor_frames import encode_tensors, parse_header, specs_of
    from primerl.proto.v1 import data_pb2
    from primerl.proto.weight_delta import encode_delta
    from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory(prefix="policy-apply-times-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny-model", TinyModelSpec(seed=0))
        llm = create_llm(
            EngineOptions(
                model=model_dir,
                in_process=True,
                work_dir=Path(tmp) / "work",
                seed=0,
                enable_lora=True,
                max_lora_rank=8,
                worker_extension_cls=WORKER_EXTENSION_CLS,
            )
        )
        try:
            updater = PolicyUpdater.for_llm(llm, Path(tmp) / "policy")
            updater.prepare()
            served = load_file(str(model_dir / "model.safetensors"))
            q_proj = sorted(name for name in served if name.endswith("self_attn.q_proj.weight"))
            times_ms: dict[str, list[float]] = {"full": [], "delta": [], "lora": []}
            phases_ms: dict[str, dict[str, float]] = {}
            for repeat in range(args.repeats):
                version = updater.policy_version + 1
                new = _noisy(served, seed=version)
                payload, specs = encode_tensors(new)
                times_ms["full"].append(
                    updater.apply(*_update(data_pb2.WEIGHT_UPDATE_KIND_FULL, version, payload, tensors=specs))
                )
                phases_ms["full"], served = dict(updater.last_phases_ms), new

                version += 1
                new = _noisy(served, seed=version, names=q_proj[:2])
                payload, specs, decoded = encode_delta(new, served)
                times_ms["delta"].append(
                    updater.apply(
                        *_update(
                            data_pb2.WEIGHT_UPDATE_KIND_DELTA,
                            version,
                            payload,
                            base_version=version - 1,
                            tensors=specs,
                            decoded_tensors=decoded,
                            delta_encoding=data_pb2.DELTA_ENCODING_XOR_ZLIB,
                        )
                    )
                )
                phases_ms["delta"], served = dict(updater.last_phases_ms), new

                version += 1
                generator = torch.Generator().manual_seed(version)
                adapter = {}
                for name in q_proj:
                    out_features, in_features = served[name].shape
                    prefix = "base_model.model." + name.removesuffix(".weight")
                    adapter[f"{prefix}.lora_A.weight"] = 0.01 * torch.randn(8, in_features, generator=generator)
                    adapter[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(out_features, 8, generator=generator)
                payload = save(adapter)
                config = {
                    "peft_type": "LORA",
                    "r": 8,
                    "lora_alpha": 16,
                    "target_modules": ["q_proj"],
                    "base_model_name_or_path": str(model_dir),
                }
                times_ms["lora"].append(
                    updater.apply(
                        *_update(
                            data_pb2.WEIGHT_UPDATE_KIND_LORA,
                            version,
                            payload,
                            tensors=specs_of(parse_header(payload)),
                            adapter_config_json=json.dumps(config),
                            policy_name="bench",
                        )
                    )
                )
                phases_ms["lora"] = dict(updater.last_phases_ms)
                print(f"round {repeat + 1}/{args.repeats}: served v{updater.policy_version}", flush=True)
        finally:
            shutdown_llm(llm)

    print(f"\n{'kind':<6} {'updates':>7} {'median ms':>10} {'max ms':>8}  phases of the last one (ms)")
    for kind, times in times_ms.items():
        phases = ", ".join(f"{name} {value:.1f}" for name, value in phases_ms.get(kind, {}).items())
        print(f"{kind:<6} {len(times):>7} {statistics.median(times):>10.1f} {max(times):>8.1f}  {phases}")


if __name__ == "__main__":
    main()
