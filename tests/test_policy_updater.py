"""`PolicyUpdater` (``inference/policy_updates.py``), the inference host's one checker of an update's order and
digest, driven against a fake engine: its refusals and their codes, lineages (rollbacks), which updates it holds
already, and the LoRA adapter bookkeeping. The same updater on a real engine: ``test_policy_updates.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from primerl.proto.tensor_frames import parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_delta import torch_dtype_name
from support.policy_updates import LORA, delta_update, full_update, perturbed, sha256


class FakeEngine:
    """`EngineOps` that records calls; the worker methods answer like the real extension would."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.manifest = {name: (torch_dtype_name(t.dtype), list(t.shape)) for name, t in weights.items()}
        self.calls: list[tuple[str, Any]] = []
        self.loras: dict[int, Any] = {}
        self.fail_add_lora = False

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append((method, len(args)))
        if method == "primerl_weight_manifest":
            return [self.manifest]
        if method in ("primerl_apply_delta", "primerl_apply_delta_file"):
            # what vLLM's multiprocess executor raises for a worker's WeightUpdateInvalid
            raise Exception("Call to collective_rpc method failed: Worker failed with error '[primerl:"
                            "ERROR_CODE_MALFORMED_HEADER] delta: corrupt', please check the stack trace above")
        return [{"apply_ms": 1.0}]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", 0))

    def add_lora(self, lora_request: Any) -> bool:
        if self.fail_add_lora:
            raise ValueError("cannot load adapter")
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None


def tiny_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=generator),
            "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=generator),
            "model.norm.weight": torch.ones(4)}


def fake_adapter(version: int, rank: int = 2) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    from safetensors.torch import save

    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    payload = save({f"{prefix}.lora_A.weight": torch.ones(rank, 4), f"{prefix}.lora_B.weight": torch.ones(8, rank)})
    return data_pb2.WeightUpdateHeader(
        policy_version=version, kind=LORA, digest=sha256(payload), tensors=specs_of(parse_header(payload)),
        adapter_config_json=json.dumps({"r": rank, "lora_alpha": rank, "target_modules": ["q_proj"]}),
    ), payload


def test_updater_checks_without_an_engine(tmp_path: Path) -> None:
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.update_checks import UpdateRefused

    weights = tiny_weights()
    engine = FakeEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4)
    assert updater.apply(*full_update(weights, 3)) > 0
    assert updater.policy_version == 3
    # The payload reaches the worker through the shared payload file: only its path crosses the RPC.
    assert [call for call, _ in engine.calls] == ["primerl_weight_manifest", "primerl_load_full_file",
                                                 "reset_prefix_cache"]
    assert set(updater.last_phases_ms) == {"check", "stage", "engine", "reset_cache"}

    header, payload = full_update(weights, 4)
    for mutate, code in [
        (lambda h: setattr(h, "digest", "00" * 32), common_pb2.ERROR_CODE_BAD_DIGEST),
        (lambda h: setattr(h, "payload_bytes", 12), common_pb2.ERROR_CODE_TRUNCATED),
        (lambda h: setattr(h, "policy_version", 3), common_pb2.ERROR_CODE_OUT_OF_ORDER),
        (lambda h: setattr(h, "kind", data_pb2.WEIGHT_UPDATE_KIND_UNSPECIFIED), common_pb2.ERROR_CODE_MALFORMED_HEADER),
        (lambda h: h.tensors[0].shape.append(1), common_pb2.ERROR_CODE_TENSOR_MISMATCH),
    ]:
        bad = data_pb2.WeightUpdateHeader()
        bad.CopyFrom(header)
        mutate(bad)
        with pytest.raises(UpdateRefused) as excinfo:
            updater.apply(bad, payload)
        assert excinfo.value.code == code, excinfo.value
    updater.apply(*full_update(weights, 4))
    with pytest.raises(UpdateRefused) as excinfo:
        updater.apply(*delta_update(perturbed(weights, seed=1), weights, 6, 3))
    assert excinfo.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and "v4 is served" in excinfo.value.message
    # A refusal raised inside the worker comes back as text in multiprocess mode and keeps its code.
    with pytest.raises(UpdateRefused) as excinfo:
        updater.apply(*delta_update(perturbed(weights, seed=1), weights, 5, 4))
    assert excinfo.value.code == common_pb2.ERROR_CODE_MALFORMED_HEADER
    assert excinfo.value.message == "delta: corrupt"
    assert updater.policy_version == 4


def test_updater_follows_lineages_without_an_engine(tmp_path: Path) -> None:
    """A FULL of a newer lineage is applied even at (or below) the served version (a rollback); an older
    lineage's update and a delta across lineages are refused; `wants` says the same before any payload check."""
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.update_checks import UpdateRefused

    weights = tiny_weights()
    updater = PolicyUpdater(FakeEngine(weights), tmp_path, max_lora_rank=4)

    def with_lineage(update, lineage, base=0):
        update[0].lineage, update[0].lineage_base_version = lineage, base
        return update

    updater.apply(*with_lineage(full_update(weights, 3), 10))
    assert (updater.policy_version, updater.lineage) == (3, 10)
    same_version = with_lineage(full_update(perturbed(weights, seed=2), 3), 10)
    assert not updater.wants(same_version[0])  # a resend of the served version, same lineage
    rollback = with_lineage(full_update(perturbed(weights, seed=3), 3), 20, base=2)
    assert updater.wants(rollback[0])
    updater.apply(*rollback)
    assert (updater.policy_version, updater.lineage, updater.lineage_base_version) == (3, 20, 2)
    further_back = with_lineage(full_update(weights, 2), 30, base=1)  # resumed from checkpoint 1: v2 again
    updater.apply(*further_back)
    assert (updater.policy_version, updater.lineage) == (2, 30)
    for update, text in [
        (with_lineage(full_update(weights, 9), 20), "older than the served"),
        (with_lineage(delta_update(perturbed(weights, seed=4), weights, 3, 2), 40), "new lineage starts with a FULL"),
    ]:
        assert not updater.wants(update[0])
        with pytest.raises(UpdateRefused) as excinfo:
            updater.apply(*update)
        assert excinfo.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and text in excinfo.value.message
    assert (updater.policy_version, updater.lineage) == (2, 30)


def test_updater_swaps_lora_adapters_under_new_ids(tmp_path: Path) -> None:
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.update_checks import UpdateRefused

    engine = FakeEngine(tiny_weights())
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, policy_name="served")
    requests = []
    for version in (1, 2, 3):
        updater.apply(*fake_adapter(version))
        requests.append(updater.lora_request())
        assert set(engine.loras) == {requests[-1].lora_int_id}  # the previous id was removed
        assert (Path(requests[-1].lora_path) / "adapter_config.json").is_file()
    assert len({r.lora_int_id for r in requests}) == 3 and {r.lora_name for r in requests} == {"served"}
    # The previous adapter's files stay (requests in flight may reload them), older ones go.
    assert [Path(r.lora_path).is_dir() for r in requests] == [False, True, True]

    engine.fail_add_lora = True
    with pytest.raises(UpdateRefused, match="could not load the adapter"):
        updater.apply(*fake_adapter(4))
    assert updater.lora_request() == requests[-1] and updater.policy_version == 3
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [Path(r.lora_path).name for r in requests[1:]]
    engine.fail_add_lora = False
    with pytest.raises(UpdateRefused, match="rank 8 exceeds"):
        updater.apply(*fake_adapter(4, rank=8))
    without_lora = PolicyUpdater(FakeEngine(tiny_weights()), tmp_path / "other", max_lora_rank=None)
    with pytest.raises(UpdateRefused, match="without LoRA"):
        without_lora.apply(*fake_adapter(1))

    updater.apply(*full_update(tiny_weights(), 4))
    assert updater.lora_request() is None and engine.loras == {}


def test_the_updater_says_which_updates_it_holds_already(tmp_path: Path) -> None:
    """What the daemon acknowledges with the served version instead of applying (the subscriber passes every
    update on): resends and older versions of the served lineage, any update of an older lineage; not a
    rollback's FULL, and not a newer DELTA, even one on the wrong base (that one is refused: out of order)."""
    from primerl.inference.policy_updates import PolicyUpdater

    weights = tiny_weights()
    updater = PolicyUpdater(FakeEngine(weights), tmp_path, max_lora_rank=4)
    updater.apply(*full_update(weights, 3))
    assert updater.holds(full_update(weights, 3)[0]) and updater.holds(full_update(weights, 2)[0])
    assert not updater.holds(full_update(weights, 4)[0])
    assert updater.holds(delta_update(perturbed(weights, seed=1), weights, 3, 2)[0])
    assert not updater.holds(delta_update(perturbed(weights, seed=1), weights, 5, 4)[0])  # refused by apply instead
    rollback = full_update(perturbed(weights, seed=2), 2)
    rollback[0].lineage, rollback[0].lineage_base_version = 20, 1
    assert not updater.holds(rollback[0]) and updater.wants(rollback[0])
    updater.apply(*rollback)
    older_lineage = full_update(weights, 9)
    older_lineage[0].lineage = 10
    assert updater.holds(older_lineage[0]) and not updater.wants(older_lineage[0])
