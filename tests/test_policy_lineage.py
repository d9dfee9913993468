"""Policy lineages come from the broker, not from the trainer's clock.

Trainer rank 0 gets its lineage when it registers (``RegisterResponse.policy_lineage``): a counter in the broker's
durable run state, above every lineage handed out before and above the one the weight store holds. Through a real
in-process broker (``BrokerHarness``), the real ``ControlClient`` and ``PolicyPublisher`` on the tiny model: a
trainer restarted on a host whose clock is hours behind (or ahead of) the first one's supersedes it, and the old
incarnation's late publish is refused; a broker restart keeps the counter and the incarnation's own lineage; a run
dir from before the counter (time-based lineages) goes on above them. Plus fast unit tests of the registry's
counter and the run-state file."""

from __future__ import annotations

import json
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from primerl.broker.policy_lineage import MAX_POLICY_LINEAGE
from primerl.broker.registry import WorkerRegistry
from primerl.broker.registry_errors import IncarnationSuperseded, InvalidRequest
from primerl.broker.run_state import RUN_STATE_FILE, RunState, RunStateFile, RunStateSaver
from primerl.client.broker_errors import IncarnationSuperseded as IncarnationSupersededError
from primerl.client.control import ControlClient
from primerl.configs.trainer import ModelConfig
from primerl.proto.v1 import common_pb2, control_pb2, data_pb2
from primerl.proto.weight_refusals import LineageSuperseded, WeightUpdateRefused
from primerl.runtime.config_common import BrokerClientConfig
from primerl.trainer import publish as publish_module
from primerl.trainer.model import load_model
from primerl.trainer.publish import PolicyPublisher

pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")

CHUNK_BYTES = 1 << 20
HOURS_6_US = 6 * 3600 * 1_000_000
TIME_BASED_LINEAGE = 1_764_000_000_000_000  # what a trainer before the counter sent: unix microseconds (Nov 2025)


# ---------------------------------------------------------------------------------------------- helpers
def skew_trainer_clock(monkeypatch: pytest.MonkeyPatch, offset_us: int) -> None:
    """The trainer's publisher reads a clock ``offset_us`` away from the host's (the broker's is untouched)."""
    shim = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    shim.time_ns = lambda: time.time_ns() + offset_us * 1000
    shim.time = lambda: time.time() + offset_us / 1e6
    monkeypatch.setattr(publish_module, "time", shim)


class Trainer:
    """One trainer incarnation's rank 0, as ``TrainerRunner._connect`` wires it: register, then publish under the
    lineage the broker gave it."""

    def __init__(self, address: str, weight_endpoint: str):
        self.control = ControlClient(BrokerClientConfig(address=address, outage_s=30), "trainer", "trainer-rank0")
        self.registration = self.control.register()
        self.control.start_heartbeats(lambda: {})
        self.publisher = PolicyPublisher(
            weight_endpoint,
            None,
            "trainer-rank0",
            CHUNK_BYTES,
            "full",
            "tiny",
            lineage=self.registration.policy_lineage or None,
        )

    @property
    def lineage(self) -> int:
        return self.publisher.lineage

    def die(self) -> None:
        """Stops heartbeating without deregistering (a kill, a partition); its publisher stays open."""
        self.control.close()

    def close(self) -> None:
        self.control.close()
        self.publisher.close()


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    return load_model(ModelConfig(name=str(tiny_model)))


@pytest.fixture
def trainers() -> Iterator[list[Trainer]]:
    opened: list[Trainer] = []
    yield opened
    for trainer in opened:
        trainer.close()


def start_trainer(opened: list[Trainer], broker) -> Trainer:
    opened.append(Trainer(broker.grpc_address, broker.weight_endpoint))
    return opened[-1]


def bump(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 1e-3)


# ------------------------------------------------------------------------------- through a real broker
@pytest.mark.parametrize(
    ("first_skew_us", "second_skew_us"),
    [(HOURS_6_US, -HOURS_6_US), (-HOURS_6_US, HOURS_6_US)],
    ids=["restarted-on-a-host-6h-behind", "restarted-on-a-host-6h-ahead"],
)
def test_a_restarted_trainer_supersedes_whatever_its_clock_says(
    make_broker, model, trainers, monkeypatch, first_skew_us, second_skew_us
):
    broker = make_broker(stop_grace_s=0, heartbeat_interval_s=0.2, heartbeat_liveness=2)
    skew_trainer_clock(monkeypatch, first_skew_us)
    # The override is what a publisher without a broker lineage would read: proof that the clock is skewed.
    unanchored = PolicyPublisher(broker.weight_endpoint, None, "probe", CHUNK_BYTES, "full", "tiny")
    unanchored.close()
    assert abs(unanchored.lineage - (time.time_ns() // 1000 + first_skew_us)) < 60_000_000

    first = start_trainer(trainers, broker)
    assert first.lineage == first.registration.policy_lineage >= 1
    for version in (1, 2, 3):
        bump(model, version)
        assert first.publisher.publish(model, version, timeout_s=30).ack.lineage == first.lineage
    first.die()

    # The trainer comes back on a host whose clock is 12 h away from the first one's, resumed from checkpoint 1.
    skew_trainer_clock(monkeypatch, second_skew_us)
    second = start_trainer(trainers, broker)  # waits (ALREADY_EXISTS) until the broker expired the first
    assert second.lineage > first.lineage
    bump(model, 20)
    result = second.publisher.publish(model, 2, timeout_s=30)
    assert result.ack.lineage == second.lineage
    store = broker.service.weight_store
    assert (store.latest_version, store.lineage) == (2, second.lineage)
    heartbeat = second.control.heartbeat()
    assert (heartbeat.policy_lineage, heartbeat.lineage_base_version) == (second.lineage, 1)

    # The first incarnation's late publish (it was only partitioned) is refused, and ends it.
    bump(model, 4)
    with pytest.raises(LineageSuperseded) as refused:
        first.publisher.publish(model, 4, timeout_s=30)
    assert refused.value.broker_lineage == second.lineage
    assert (store.latest_version, store.lineage) == (2, second.lineage)


def test_a_cut_off_trainer_learns_it_was_superseded_and_stops_heartbeating(make_broker, model, trainers):
    """The broker forgets trainer A (as after a partition longer than its liveness window) and B registers under
    the same name. A's heartbeat thread, back in touch, registers again naming its lineage: refused for good, it
    stops heartbeating and ``check_broker()`` raises; A's commit and publish are refused too."""
    broker = make_broker(stop_grace_s=0, heartbeat_interval_s=0.2, heartbeat_liveness=2)
    first = start_trainer(trainers, broker)
    bump(model, 1)
    first.publisher.publish(model, 1, timeout_s=30)
    # the broker's view after a partition longer than the liveness window
    broker.service.registry.deregister(first.control.worker_id, "cut off")
    second = start_trainer(trainers, broker)
    assert second.lineage > first.lineage
    deadline = time.monotonic() + 20
    while first.control.superseded is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(IncarnationSupersededError, match=f"lineage {second.lineage} superseded it"):
        first.control.check_broker()
    with pytest.raises(IncarnationSupersededError):
        first.control.commit_step(1)
    bump(model, 2)
    with pytest.raises(LineageSuperseded) as refused:  # before B has published anything
        first.publisher.publish(model, 2, timeout_s=30)
    assert refused.value.broker_lineage == second.lineage
    assert [w.name for w in second.control.list_workers("trainer")] == ["trainer-rank0"]
    assert second.control.commit_step(1).last_committed_step == 1


def test_the_counter_and_an_incarnations_lineage_survive_a_broker_restart(make_broker, model, trainers):
    broker = make_broker(stop_grace_s=0, heartbeat_interval_s=0.2, heartbeat_liveness=2)
    first = start_trainer(trainers, broker)
    lineage = first.lineage
    first.publisher.publish(model, 1, timeout_s=30)
    state = json.loads((broker.config.spool_dir / RUN_STATE_FILE).read_text())
    assert state["policy_lineage"] == lineage  # durable before the answer

    broker.restart()
    # The same process re-registers (the broker forgot it) and keeps its lineage: its next publish is accepted.
    before = first.control.num_registrations
    deadline = time.monotonic() + 20
    while first.control.num_registrations == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.control.num_registrations > before, "the trainer did not register again with the new broker"
    assert first.control.registration.policy_lineage == lineage
    bump(model, 2)
    assert first.publisher.publish(model, 2, timeout_s=30).ack.lineage == lineage

    # A new incarnation after the restart gets a lineage above it, not one the old broker handed out.
    first.die()
    second = start_trainer(trainers, broker)
    assert second.lineage > lineage


def test_a_run_dir_with_time_based_lineages_goes_on_above_them(make_broker, model, trainers):
    """A broker of this run before the counter: its weights were published under a unix-microsecond lineage and
    its run_state.json has no ``policy_lineage``. The next trainer's lineage is above the one held."""
    broker = make_broker(stop_grace_s=0, heartbeat_interval_s=0.2, heartbeat_liveness=2)
    old = PolicyPublisher(
        broker.weight_endpoint, None, "trainer-rank0", CHUNK_BYTES, "full", "tiny", lineage=TIME_BASED_LINEAGE
    )
    try:
        old.publish(model, 1, timeout_s=30)
    finally:
        old.close()
    broker.stop()
    path = broker.config.spool_dir / RUN_STATE_FILE
    state = json.loads(path.read_text())
    del state["policy_lineage"]
    path.write_text(json.dumps(state))

    broker.start()
    assert broker.service.weight_store.lineage == TIME_BASED_LINEAGE  # the durable chain came back
    trainer = start_trainer(trainers, broker)
    assert trainer.lineage == TIME_BASED_LINEAGE + 1
    bump(model, 2)
    assert trainer.publisher.publish(model, 1, timeout_s=30).ack.lineage == trainer.lineage  # supersedes it


# ---------------------------------------------------------------------------------------- unit tests
def register(registry: WorkerRegistry, name: str, role=common_pb2.ROLE_TRAINER, rank: int = 0, lineage: int = 0):
    request = control_pb2.RegisterRequest(role=role, name=name, rank=rank, world_size=2, policy_lineage=lineage)
    return registry.register(request)


def test_only_trainer_rank_0_gets_a_lineage_and_each_new_one_is_larger(tmp_path):
    store = RunStateFile(tmp_path)
    registry = WorkerRegistry("run", 1.0, 3, persist=lambda revision, state: store.write(state, revision))
    assert register(registry, "trainer-rank1", rank=1).policy_lineage == 0
    assert register(registry, "orch", role=common_pb2.ROLE_ORCHESTRATOR).policy_lineage == 0
    assert register(registry, "infer-0", role=common_pb2.ROLE_INFERENCE).policy_lineage == 0
    first = register(registry, "a").policy_lineage
    second = register(registry, "b").policy_lineage
    assert 1 <= first < second
    assert store.load().policy_lineage == second  # written before the answer
    # A re-registration naming its lineage keeps it; an older one is superseded; one above the counter raises it.
    assert register(registry, "c", lineage=second).policy_lineage == second
    with pytest.raises(IncarnationSuperseded, match=f"policy lineage {first} registers again, but lineage {second}"):
        register(registry, "c2", lineage=first)
    assert register(registry, "d", lineage=second + 100).policy_lineage == second + 100
    assert register(registry, "e").policy_lineage == second + 101
    with pytest.raises(InvalidRequest, match="policy_lineage"):
        register(registry, "f", lineage=MAX_POLICY_LINEAGE)
    assert register(registry, "g").policy_lineage == second + 102


def test_a_superseded_trainer_can_neither_commit_nor_publish_before_its_successor_does():
    """Split brain: trainer A is cut off (it never left); B registers and gets a newer lineage. Before B has
    published anything, A's commit and A's next weight update are refused, and so is A's re-registration."""
    registry = WorkerRegistry("run", 1.0, 3)
    store = registry.policy.store
    old = register(registry, "trainer-a")
    store.check_header(full_header(1, old.policy_lineage))  # A publishes as usual
    new = register(registry, "trainer-b")
    assert new.policy_lineage > old.policy_lineage and store.lineage == 0  # B has published nothing yet
    with pytest.raises(WeightUpdateRefused, match="a newer trainer incarnation registered") as refused:
        store.check_header(full_header(2, old.policy_lineage))
    assert refused.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and store.newest_lineage == new.policy_lineage
    with pytest.raises(IncarnationSuperseded, match="commits step 1, but lineage"):
        registry.commit_step(old.worker_id, 1)
    with pytest.raises(IncarnationSuperseded, match="must stop"):
        register(registry, "trainer-a2", lineage=old.policy_lineage)
    assert registry.commit_step(new.worker_id, 1).last_committed_step == 1
    store.check_header(full_header(1, new.policy_lineage))  # B's own updates go through, from any version
    # Workers without a lineage (orchestrator, inference, other ranks) are not concerned.
    assert register(registry, "trainer-rank1", rank=1).policy_lineage == 0


def test_a_restored_broker_refuses_lineages_older_than_its_counter():
    registry = WorkerRegistry("run", 1.0, 3)
    registry.restore(RunState(run_id="run", policy_lineage=41))
    with pytest.raises(WeightUpdateRefused, match="lineage 40, which lineage 41 superseded"):
        registry.policy.store.check_header(full_header(5, 40))
    registry.policy.store.check_header(full_header(5, 41))


def full_header(version: int, lineage: int) -> data_pb2.WeightUpdateHeader:
    return data_pb2.WeightUpdateHeader(policy_version=version, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, lineage=lineage)


def test_the_counter_is_restored_and_stays_above_the_weight_stores_lineage(tmp_path):
    registry = WorkerRegistry("run", 1.0, 3)
    registry.restore(RunState(run_id="run", policy_lineage=41))
    assert register(registry, "a").policy_lineage == 42
    assert registry.run_state()[1].policy_lineage == 42


def test_a_lineage_that_cannot_be_written_yet_is_handed_out_and_saved_later(tmp_path):
    """A full spool disk must not keep the trainer out: its commits are what free the spool."""
    disk_full = [True]
    saved: list[RunState] = []

    def persist(revision: int, state: RunState) -> None:
        if disk_full[0]:
            raise OSError(28, "No space left on device")
        saved.append(state)

    registry = WorkerRegistry("run", 1.0, 3, persist=persist)
    assert register(registry, "trainer-rank0").policy_lineage == 1
    errors = list(registry.run_status().recent_errors)
    assert any("policy lineage 1 handed out but not saved yet" in e and "No space left" in e for e in errors), errors
    disk_full[0] = False
    saver = RunStateSaver(registry.run_state, RunStateFile(tmp_path), interval_s=10)
    assert saver.save_once()  # the periodic saver writes it once the disk takes it
    assert RunStateFile(tmp_path).load().policy_lineage == 1
    assert register(registry, "trainer-rank0-again").policy_lineage == 2 and saved[-1].policy_lineage == 2


def test_run_state_reads_a_file_without_the_counter_and_refuses_a_bad_one():
    state = RunState(run_id="run", policy_lineage=7)
    assert RunState.from_json(state.to_json(0)) == state
    raw = json.loads(state.to_json(0))
    del raw["policy_lineage"]
    assert RunState.from_json(json.dumps(raw).encode()).policy_lineage == 0
    raw["policy_lineage"] = -1
    with pytest.raises(ValueError, match="policy_lineage"):
        RunState.from_json(json.dumps(raw).encode())
