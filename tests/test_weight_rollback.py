"""A rollback through the real path: the broker daemon's weight plane over loopback, the trainer's
``PolicyPublisher`` on the tiny model, and an inference worker's ``WeightSubscriber`` + ``PolicyUpdater`` on a
real vLLM engine.

Trainer A publishes v1 (FULL) and the deltas v2, v3; the worker serves A's v3. Trainer A "dies" with only
checkpoint 2 on disk; trainer B resumes from it, trains step 3 again (other data) and publishes FULL v3. The broker
accepts it (a newer lineage), the worker loads B's v3 although it already serves a v3, and serves exactly B's
weights (digest of its host copy); the broker holds B's v3; A's late v4 is refused as superseded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engines import engine_for_test

from primerl.broker.service import BrokerService
from primerl.client.weights import WeightSubscriber
from primerl.configs.trainer import ModelConfig, OptimizerConfig
from primerl.inference.engine import EngineOptions
from primerl.inference.weight_tensors import weights_digest
from primerl.inference.worker_extension import WORKER_EXTENSION_CLS
from primerl.proto.weight_refusals import LineageSuperseded
from primerl.trainer.hf_state_dict import hf_state_dict
from primerl.trainer.model import load_model
from primerl.trainer.optim import build_optimizer
from primerl.trainer.publish import PolicyPublisher

pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")

CHUNK_BYTES = 1 << 20
RECEIVE_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    options = EngineOptions(
        model=model_dir,
        in_process=True,
        work_dir=tmp_path_factory.mktemp("work"),
        seed=0,
        worker_extension_cls=WORKER_EXTENSION_CLS,
    )
    with engine_for_test(options) as llm:
        yield llm


@pytest.fixture
def broker(make_broker) -> tuple[BrokerService, str]:
    harness = make_broker(stop_grace_s=0)
    return harness.service, harness.weight_endpoint


def train_step(model: torch.nn.Module, seed: int) -> None:
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.0))
    input_ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def host_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in hf_state_dict(model).items()}


class Worker:
    """An inference worker's weight path, as the daemon runs it: receive, ask the updater, apply, acknowledge."""

    def __init__(self, llm: Any, endpoint: str, work_dir: Path):
        from primerl.inference.policy_updates import PolicyUpdater

        self.updater = PolicyUpdater.for_llm(llm, work_dir, verify_digest=False)
        self.updater.prepare()
        self.subscriber = WeightSubscriber(endpoint, None, "infer-0", payload_buffer=self.updater.staging_buffer)
        self.subscriber.hello(self.updater.policy_version, lineage=self.updater.lineage)

    def step(self) -> tuple[int, int]:
        got = self.subscriber.receive(RECEIVE_S)
        assert got is not None, "the worker received no update"
        header, payload = got
        assert self.updater.wants(header), f"the updater does not want v{header.policy_version}"
        apply_ms = self.updater.apply(header, payload)
        self.subscriber.ack(header.policy_version, apply_ms=round(apply_ms), lineage=self.updater.lineage)
        return self.updater.policy_version, self.updater.lineage

    def close(self) -> None:
        self.subscriber.close()
        self.updater.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_resumed_trainer_republishes_v3_and_the_worker_serves_it(
    llm: Any, model_dir: Path, broker, tmp_path: Path
) -> None:
    service, endpoint = broker
    worker = Worker(llm, endpoint, tmp_path / "policy")
    publishers: list[PolicyPublisher] = []
    try:
        # Trainer A: steps 1..3, published v1 FULL then deltas; checkpoint 2 is the last one it wrote.
        model_a = load_model(ModelConfig(name=str(model_dir)))
        trainer_a = PolicyPublisher(
            endpoint, None, "trainer-a", CHUNK_BYTES, "delta", "tiny", delta_policy="always", lineage=1_000
        )
        publishers.append(trainer_a)
        checkpoint_2 = None
        for step in (1, 2, 3):
            train_step(model_a, seed=step)
            result = trainer_a.publish(model_a, step, timeout_s=RECEIVE_S)
            assert result.kind == ("full" if step == 1 else "delta")
            assert worker.step() == (step, 1_000)
            if step == 2:
                checkpoint_2 = {k: v.detach().clone() for k, v in model_a.state_dict().items()}
        a_v3 = host_weights(model_a)
        assert worker.updater.weight_digest() == weights_digest(a_v3)

        # Trainer B resumes from checkpoint 2 and trains step 3 on other data: a different v3.
        model_b = load_model(ModelConfig(name=str(model_dir)))
        model_b.load_state_dict(checkpoint_2)
        train_step(model_b, seed=33)
        b_v3 = host_weights(model_b)
        assert weights_digest(b_v3) != weights_digest(a_v3)
        trainer_b = PolicyPublisher(endpoint, None, "trainer-b", CHUNK_BYTES, "delta", "tiny", lineage=2_000)
        publishers.append(trainer_b)
        result = trainer_b.publish(model_b, 3, timeout_s=RECEIVE_S)
        assert result.kind == "full" and result.ack.lineage == 2_000

        # The broker holds B's v3 and says it rolled back; the worker loads it although it served a v3 already.
        status = service.weight_store.status()
        assert (status.latest_version, status.lineage, status.lineage_base_version, status.num_rollbacks) == (
            3,
            2_000,
            2,
            1,
        )
        from safetensors.torch import load as load_safetensors

        held = service.weight_store.latest()
        assert (held.policy_version, held.lineage) == (3, 2_000)
        assert weights_digest(load_safetensors(bytes(held.payload))) == weights_digest(b_v3)
        assert worker.step() == (3, 2_000)
        assert worker.updater.weight_digest() == weights_digest(b_v3)
        assert worker.updater.lineage_base_version == 2

        # A's late v4 is refused as superseded and reaches no worker; B goes on with deltas.
        train_step(model_a, seed=4)
        with pytest.raises(LineageSuperseded):
            trainer_a.publish(model_a, 4, timeout_s=RECEIVE_S)
        assert service.weight_store.latest_version == 3
        train_step(model_b, seed=4)
        assert trainer_b.publish(model_b, 4, timeout_s=RECEIVE_S).ack.lineage == 2_000
        assert worker.step() == (4, 2_000)
        assert worker.updater.weight_digest() == weights_digest(host_weights(model_b))
    finally:
        for publisher in publishers:
            publisher.close()
        worker.close()
