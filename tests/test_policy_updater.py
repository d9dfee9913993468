"""`PolicyUpdater` (``inference/policy_updates.py``), the inference host's one checker of an update's order and
digest, driven against a fake engine: its refusals and their codes, lineages (rollbacks), which updates it holds
already, and the LoRA adapter bookkeeping. The same updater on a real engine: ``test_policy_updates.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.policy_updates import LORA, delta_update, full_update, perturbed, sha256

from primerl.proto.tensor_frames import parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_delta import torch_dtype_name


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
        if method == "primerl_stage_begin":
            return [{"staging": False, "reason": "a fake engine", "permanent": True}]
        if method in ("primerl_apply_delta", "primerl_apply_delta_file"):
            # what vLLM's multiprocess executor raises for a worker's WeightUpdateInvalid
            raise Exception(
                "Call to collective_rpc method failed: Worker failed with error '[primerl:"
                "ERROR_CODE_MALFORMED_HEADER] delta: corrupt', please check the stack trace above"
            )
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
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=generator),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=generator),
        "model.norm.weight": torch.ones(4),
    }


def fake_adapter(version: int, rank: int = 2) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    from safetensors.torch import save

    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    payload = save({f"{prefix}.lora_A.weight": torch.ones(rank, 4), f"{prefix}.lora_B.weight": torch.ones(8, rank)})
    return data_pb2.WeightUpdateHeader(
        policy_version=version,
        kind=LORA,
        digest=sha256(payload),
        tensors=specs_of(parse_header(payload)),
        adapter_config_json=json.dumps({"r": rank, "lora_alpha": rank, "target_modules": ["q_proj"]}),
    ), payload


def test_updater_checks_without_an_engine(tmp_path: Path) -> None:
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.update_checks import UpdateRefused

    weights = tiny_weights()
    engine = FakeEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, staging_dir=tmp_path)
    assert updater.apply(*full_update(weights, 3)) > 0
    assert updater.policy_version == 3
    # The payload reaches the worker through the shared payload file: only its path crosses the RPC. An engine that
    # cannot stage a load is asked once, then reloads in place.
    assert [call for call, _ in engine.calls] == [
        "primerl_weight_manifest",
        "primerl_stage_begin",
        "primerl_load_full_file",
        "reset_prefix_cache",
    ]
    assert set(updater.last_phases_ms) == {"check", "stage", "load", "engine", "reset_cache"}

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
    updater = PolicyUpdater(FakeEngine(weights), tmp_path, max_lora_rank=4, staging_dir=tmp_path)

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
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, policy_name="served", staging_dir=tmp_path)
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
    without_lora = PolicyUpdater(
        FakeEngine(tiny_weights()), tmp_path / "other", max_lora_rank=None, staging_dir=tmp_path
    )
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
    updater = PolicyUpdater(FakeEngine(weights), tmp_path, max_lora_rank=4, staging_dir=tmp_path)
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


# ---- staged loads: the daemon's side of the shared payload files' protocol ---------------------------------------


class StagingEngine(FakeEngine):
    """A fake engine whose worker "loads" a staged update the way the real extension reports it: through the shared
    payload file's control words (LOADING, then LOADED once the writer says the payload is complete, or FAILED);
    a commit makes the host copy view that file (HOST_VIEWS)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__(weights)
        self.stages: dict[int, tuple[str, int]] = {}
        self.refuse_next = ""  # a worker-side refusal of the next staged load
        self.fail_next = ""  # any other failure of the next staged load
        self.hosted: str | None = None
        self.committed: list[int] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        from primerl.inference.shared_payload import PayloadControl, map_control

        if method == "primerl_stage_begin":
            self.calls.append((method, len(args)))
            path, num_bytes, seq = args[0], args[1], args[2]
            control = map_control(path)
            control.write(PayloadControl.STAGE_STATE, PayloadControl.LOADING)
            control.write(PayloadControl.STAGE_SEQ, seq)
            self.stages[seq] = (path, num_bytes)
            self.finish_loads()  # a payload already complete is loaded at once
            return [{"staging": True}]
        if method == "primerl_stage_commit":
            self.calls.append((method, len(args)))
            path, _ = self.stages[args[0]]
            if self.hosted is not None and self.hosted != path:
                map_control(self.hosted).write(PayloadControl.HOST_VIEWS, 0)
            map_control(path).write(PayloadControl.HOST_VIEWS, 1)
            self.hosted = path
            self.committed.append(args[0])
            return [{"apply_ms": 1.0}]
        if method == "primerl_stage_result":
            self.calls.append((method, len(args)))
            path, _ = self.stages[args[0]]
            state = map_control(path).stage(args[0])
            if state in (PayloadControl.LOADING, PayloadControl.LOADED):
                return [{"state": "running" if state == PayloadControl.LOADING else "loaded"}]
            if self.refuse_next:
                return [{"state": "failed", "refusal": self.refuse_next}]
            return [{"state": "failed", "error": self.fail_next}]
        return super().collective_rpc(method, args)

    def finish_loads(self) -> None:
        """Report every staged load whose payload is complete as LOADED (or FAILED when told to fail)."""
        from primerl.inference.shared_payload import PayloadControl, map_control

        for seq, (path, _) in self.stages.items():
            control = map_control(path)
            if control.read(PayloadControl.SEQ) != seq or control.stage(seq) != PayloadControl.LOADING:
                continue
            if control.read(PayloadControl.WRITER_STATE) == PayloadControl.COMPLETE:
                failed = self.refuse_next or self.fail_next
                control.write(PayloadControl.STAGE_STATE, PayloadControl.FAILED if failed else PayloadControl.LOADED)


def receive(
    updater: Any, header: data_pb2.WeightUpdateHeader, payload: bytes, *, chunk_bytes: int = 64, complete: bool = True
) -> memoryview:
    """What the weight subscriber does with an update's chunks: the payload written into the updater's buffer."""
    view = updater.begin_payload(header, len(payload))
    end = len(payload) if complete else len(payload) // 2
    for start in range(0, end, chunk_bytes):
        stop = min(start + chunk_bytes, end)
        view[start:stop] = payload[start:stop]
        updater.payload_progress(stop)
    updater.end_payload(complete)
    return view


def test_a_staged_update_is_loaded_while_it_arrives_and_switched_to_in_apply(tmp_path: Path) -> None:
    """The staged load starts with the first chunk; `preload` waits for it; `apply` only commits it. Each update is
    written into a shared file the worker's host copy does not view (two files, used in turn)."""
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.shared_payload import PayloadControl, map_control

    weights = tiny_weights()
    engine = StagingEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, staging_dir=tmp_path)
    paths = []
    for version in (1, 2, 3):
        header, payload = full_update(perturbed(weights, seed=version), version)
        view = receive(updater, header, payload)
        path, num_bytes = engine.stages[max(engine.stages)]
        control = map_control(path)
        assert control.read(PayloadControl.WRITER_STATE) == PayloadControl.COMPLETE
        assert control.read(PayloadControl.BYTES_READY) == num_bytes == len(payload)
        engine.finish_loads()
        updater.preload(header, view)
        assert engine.committed == list(range(1, version))  # nothing switched before apply
        updater.apply(header, view)
        assert updater.policy_version == version and engine.committed[-1] == max(engine.stages)
        assert set(updater.last_phases_ms) == {"check", "stage", "load", "engine", "reset_cache"}
        paths.append(path)
    assert paths[0] == paths[2] != paths[1]  # never the file the host copy views
    assert [call for call, _ in engine.calls].count("primerl_load_full_file") == 0


def test_a_staged_update_with_a_bad_digest_is_refused_and_never_switched_to(tmp_path: Path) -> None:
    """The broker forwards chunks before it checked the digest: the updater compares the digest the subscriber
    computed on the way (or computes it itself) and refuses a mismatch before anything is switched."""
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.update_checks import UpdateRefused
    from primerl.proto.digests import payload_digest

    weights = tiny_weights()
    engine = StagingEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, staging_dir=tmp_path)
    header, payload = full_update(weights, 1)
    header.digest = payload_digest(payload)  # the publishers' XXH3-128
    view = receive(updater, header, payload)
    engine.finish_loads()
    with pytest.raises(UpdateRefused) as excinfo:
        updater.preload(header, view, payload_digest=payload_digest(payload + b"x"))
    assert excinfo.value.code == common_pb2.ERROR_CODE_BAD_DIGEST
    corrupt = bytearray(payload)
    corrupt[-1] ^= 1
    view = receive(updater, header, bytes(corrupt))
    engine.finish_loads()
    with pytest.raises(UpdateRefused) as excinfo:
        updater.apply(header, view)  # no digest given: computed over the payload
    assert excinfo.value.code == common_pb2.ERROR_CODE_BAD_DIGEST
    assert engine.committed == [] and updater.policy_version == 0
    view = receive(updater, header, payload)
    engine.finish_loads()
    updater.apply(header, view, payload_digest=payload_digest(payload))
    assert updater.policy_version == 1 and len(engine.committed) == 1


def test_a_staged_load_that_fails_is_refused_or_reloaded_in_place(tmp_path: Path) -> None:
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.update_checks import UpdateRefused

    weights = tiny_weights()
    engine = StagingEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, staging_dir=tmp_path)
    header, payload = full_update(weights, 1)
    engine.refuse_next = (
        "[primerl:ERROR_CODE_TENSOR_MISMATCH] full update: tensor 'x' is F32[2] but the model's is F32[3]"
    )
    view = receive(updater, header, payload)
    engine.finish_loads()
    with pytest.raises(UpdateRefused) as excinfo:
        updater.preload(header, view)
    assert excinfo.value.code == common_pb2.ERROR_CODE_TENSOR_MISMATCH and "F32[3]" in excinfo.value.message
    engine.refuse_next, engine.fail_next = "", "AttributeError: vLLM changed"
    view = receive(updater, header, payload)
    engine.finish_loads()
    updater.apply(header, view)  # the staged load failed: reloaded in place instead
    calls = [call for call, _ in engine.calls]
    assert calls[-2:] == ["primerl_load_full_file", "reset_prefix_cache"] and engine.committed == []
    assert updater.policy_version == 1


def test_an_update_dropped_midway_is_never_served(tmp_path: Path) -> None:
    """A transfer whose chunks stop (the subscriber drops it) tells the worker's staged load to stop (ABORTED), and
    the next update starts afresh; `discard` drops a staged load that will not be applied."""
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.shared_payload import PayloadControl, map_control

    weights = tiny_weights()
    engine = StagingEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, staging_dir=tmp_path)
    header, payload = full_update(weights, 1)
    receive(updater, header, payload, complete=False)
    path, _ = engine.stages[1]
    assert map_control(path).read(PayloadControl.WRITER_STATE) == PayloadControl.ABORTED
    engine.finish_loads()
    assert map_control(path).stage(1) == PayloadControl.LOADING  # never reported loaded: its payload never completed
    view = receive(updater, header, payload)
    engine.finish_loads()
    updater.preload(header, view)
    updater.discard()  # e.g. the daemon learnt it was refused before: nothing switched
    assert engine.committed == [] and updater.policy_version == 0
    assert [call for call, _ in engine.calls][-1] == "primerl_stage_discard"  # it was loaded: the worker frees it
    updater.apply(header, view)  # loaded again from the start
    assert engine.committed == [2] and updater.policy_version == 1
    view = receive(updater, *full_update(weights, 2))
    engine.finish_loads()
    receive(updater, *full_update(weights, 3))  # the next update comes before v2 was applied: v2's load is freed
    assert [call for call, _ in engine.calls][-2:] == ["primerl_stage_discard", "primerl_stage_begin"]


def test_a_staged_load_that_does_not_finish_in_time_is_dropped_and_reloaded_in_place(tmp_path: Path) -> None:
    """Bounded: `preload` waits ``stage_timeout_s`` for the worker's load (asking the engine itself now and then),
    then drops it (the worker's thread sees the transfer ABORTED) and `apply` reloads in place."""
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.shared_payload import PayloadControl, map_control

    weights = tiny_weights()
    engine = StagingEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, staging_dir=tmp_path, stage_timeout_s=1.5)
    header, payload = full_update(weights, 1)
    view = receive(updater, header, payload)  # the fake worker never reports this load done
    updater.apply(header, view)
    calls = [call for call, _ in engine.calls]
    assert "primerl_stage_result" in calls and calls[-2:] == ["primerl_load_full_file", "reset_prefix_cache"]
    path, _ = engine.stages[1]
    assert map_control(path).read(PayloadControl.WRITER_STATE) == PayloadControl.ABORTED
    assert engine.committed == [] and updater.policy_version == 1
