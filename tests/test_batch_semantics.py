"""Batch semantics (issue 29 items 1-3), driven through the real ``RolloutScheduler`` and ``BatchAssembler`` with
env workers that answer in simulated time (rounds) and a simulated trainer that publishes a version a few rounds
after each batch: constant batch size (every batch ``batch_size`` rollouts that carry signal; the bounded fill),
environment shares that follow the weights whatever the speeds, and the waste accounting of generated tokens."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from pathlib import Path

import pytest

from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.concurrency import FixedConcurrency
from primerl.orchestrator.dispatch_plan import groups_to_keep_in_flight
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.filtering import FILL_BOUND_ROUNDS, BatchAssembler, DifficultyFilter
from primerl.orchestrator.rollout_failures import RolloutFailures
from primerl.orchestrator.rollout_scheduler import RolloutScheduler
from primerl.orchestrator.samples import Group, TrainingSample
from primerl.orchestrator.step_metrics import DISCARD_REASONS, batch_metrics, token_metrics
from primerl.orchestrator.trajectory import Rollout, RolloutGroup, Turn

# -- simulated env workers and trainer ----------------------------------------------------------------------------


def make_rollout(index: int, reward: float, num_tokens: int, version: int) -> Rollout:
    completion = list(range(3, 3 + num_tokens))
    turn = Turn([1, 2], completion, [-0.5] * num_tokens, [1] * num_tokens, "stop", False, version, version)
    return Rollout(index, [turn], reward, {}, False, None, None, None, [], [], 0.1)


class TimedWorker:
    """An env worker whose groups finish ``rounds`` scheduler rounds after their request (``tick`` advances the
    clock); ``rewards(example_index, n)`` gives each group's rewards, every rollout ``num_tokens`` tokens made by
    the ``version`` served at the request."""

    def __init__(self, env_id: str, rounds: int, rewards=None, num_tokens: int = 4) -> None:
        self.env_id, self.rounds, self.num_tokens = env_id, rounds, num_tokens
        self.rewards = rewards or (lambda index, n: [float(i % 2) for i in range(n)])
        self.pending: list[tuple] = []  # (due, future, example, n, version)
        self.now = 0
        self.version = 0  # served by the inference worker (``run_steps`` publishes)
        self.num_requested = 0
        self.cancelled: list[concurrent.futures.Future] = []
        self.num_restarts, self.max_restarts = 0, 3

    def submit_rollouts(self, example_indices, *, num_rollouts, **kwargs):
        futures = []
        for index in example_indices:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self.pending.append((self.now + self.rounds, future, index, num_rollouts, self.version))
            futures.append(future)
            self.num_requested += 1
        return futures

    def tick(self) -> None:
        self.now += 1
        due = [p for p in self.pending if p[0] <= self.now]
        self.pending = [p for p in self.pending if p[0] > self.now]
        for _, future, index, n, version in due:
            if future in self.cancelled:
                continue
            rewards = self.rewards(index, n)
            future.set_result(
                RolloutGroup(
                    self.env_id,
                    "train",
                    index,
                    [make_rollout(i, rewards[i], self.num_tokens, version) for i in range(n)],
                )
            )

    def cancel(self, future) -> None:
        self.cancelled.append(future)

    def is_alive(self) -> bool:
        return True


class Watcher:
    def __init__(self, version: int = 0) -> None:
        self.version, self.generation = version, 1

    def publish(self, version: int) -> None:
        self.version, self.generation = version, self.generation + 1

    def check(self) -> None:
        pass

    def set_fast(self, fast: bool) -> None:
        pass

    def snapshot(self):
        return self.generation, {"w1": ("http://w1/v1", self.version)}


def make_config(**overrides) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "env": [{"id": "e"}],
            "batch_size": 8,
            "rollouts_per_example": 2,
            "max_steps": 100,
            "max_inflight": 16,
            "sampling": {"seed": 0},
            **overrides,
        }
    )


def make_scheduler(config: OrchestratorConfig, workers: dict[str, TimedWorker], weights: dict[str, float]):
    return RolloutScheduler(
        config,
        stop_event=threading.Event(),
        env_clients=workers,
        sampler=EnvSampler(dict.fromkeys(workers, 1000), weights, seed=0),
        failures=RolloutFailures(config.batch_size),
    )


def run_steps(scheduler: RolloutScheduler, workers, num_steps: int, *, train_rounds: int = 2, max_rounds=2000):
    """The runner's loop with a trainer that publishes version n ``train_rounds`` rounds after batch n (and
    never more than one step ahead of it, as the trainer trains batches in order). Returns the batches and the
    step reports."""
    watcher = Watcher()
    batches, reports = [], []
    publish_at: collections.deque[tuple[int, int]] = collections.deque()  # (round, version)
    rounds = 0
    for step in range(1, num_steps + 1):
        while (batch := scheduler.take_batch(step)) is None:
            rounds += 1
            assert rounds < max_rounds, f"step {step} never filled"
            while publish_at and publish_at[0][0] <= rounds:
                watcher.publish(publish_at.popleft()[1])
                for worker in workers.values():
                    worker.version = watcher.version
            scheduler.refresh_endpoints(watcher)
            scheduler.dispatch(step)
            for worker in workers.values():
                worker.tick()
            scheduler.collect(timeout_s=0.001)
            scheduler.cancel_stale(step)
        start = max(rounds, publish_at[-1][0] if publish_at else 0)
        publish_at.append((start + train_rounds, step))
        batches.append(batch)
        reports.append(scheduler.take_report())
    return batches, reports


# -- item 1: constant batch size ----------------------------------------------------------------------------------


def every_third_silent(index: int, n: int) -> list[float]:
    """Groups of examples divisible by 3 all get reward 1 (zero advantage); the others alternate 0 and 1."""
    return [1.0] * n if index % 3 == 0 else [float(i % 2) for i in range(n)]


def test_constant_batch_size_trains_batch_size_rollouts_with_signal_every_step():
    config = make_config()
    assert config.constant_trainer_batch_size  # prime-rl's default
    worker = TimedWorker("e", rounds=1, rewards=every_third_silent)
    scheduler = make_scheduler(config, {"e": worker}, {"e": 1.0})
    batches, _ = run_steps(scheduler, {"e": worker}, 12)
    for batch in batches:
        assert batch.num_rollouts == config.batch_size
        assert all(group.has_signal for group in batch.groups)
    dropped = sum(b.metrics["filter/zero_advantage"] for b in batches)
    assert dropped > 0  # the silent groups were there, and dropped before counting


def test_variable_batch_size_counts_zero_advantage_groups():
    config = make_config(constant_trainer_batch_size=False)
    worker = TimedWorker("e", rounds=1, rewards=every_third_silent)
    scheduler = make_scheduler(config, {"e": worker}, {"e": 1.0})
    batches, _ = run_steps(scheduler, {"e": worker}, 12)
    assert all(batch.num_rollouts == config.batch_size for batch in batches)
    silent = sum(not group.has_signal for batch in batches for group in batch.groups)
    assert silent > 0 and all(b.metrics["filter/zero_advantage"] == 0 for b in batches)


def test_a_step_that_cannot_be_filled_with_signal_is_filled_after_the_bound_with_a_warning(capsys, caplog):
    config = make_config()
    worker = TimedWorker("e", rounds=1, rewards=lambda index, n: [0.0] * n)  # never any signal
    scheduler = make_scheduler(config, {"e": worker}, {"e": 1.0})
    batches, _ = run_steps(scheduler, {"e": worker}, 2)
    groups_per_batch = config.batch_size // config.rollouts_per_example
    for batch in batches:
        assert batch.num_rollouts == config.batch_size
        assert batch.metrics["batch/filled_with_dropped_rollouts"] == config.batch_size
        assert batch.metrics["filter/zero_advantage"] >= FILL_BOUND_ROUNDS * groups_per_batch
    # the log line reaches stdout or, once an earlier test routed structlog through logging, the log records
    logged = capsys.readouterr().out + caplog.text
    assert logged.count("orchestrator.constant_trainer_batch_size = false") == 2  # one per step


def group(env_id: str, rewards, *, group_id=0, version=0, num_tokens=3, advantages=None) -> Group:
    samples = []
    for i, reward in enumerate(rewards):
        sample = TrainingSample(
            token_ids=[1] + [2] * num_tokens,
            loss_mask=[False] + [True] * num_tokens,
            inference_logprobs=[0.0] * (num_tokens + 1),
            temperatures=[1.0] * (num_tokens + 1),
            policy_versions=[version] * (num_tokens + 1),
            reward=reward,
            rollout_id=i,
            env_id=env_id,
            group_id=group_id,
        )
        sample.advantage = reward - sum(rewards) / len(rewards) if advantages is None else advantages[i]
        samples.append(sample)
    return Group(group_id=group_id, example_id=group_id, env_id=env_id, samples=samples)


def test_assembler_drops_zero_advantage_groups_before_counting_only_in_constant_mode():
    groups = [group("e", [1, 1], group_id=0), group("e", [0, 1], group_id=1), group("e", [1, 0], group_id=2)]
    constant = BatchAssembler(4, group_size=2, constant_batch_size=True)
    constant.add(groups)
    batch = constant.take()
    assert [g.group_id for g in batch.groups] == [1, 2] and batch.metrics["filter/zero_advantage"] == 1
    assert batch.discarded_tokens == {("filtered", "e"): 6}
    variable = BatchAssembler(4, group_size=2)
    variable.add(groups)
    assert [g.group_id for g in variable.take().groups] == [0, 1]


def test_the_difficulty_filter_and_the_zero_advantage_rule_add_up():
    assembler = BatchAssembler(
        4, difficulty_filter=DifficultyFilter(min_reward=0.2), group_size=2, constant_batch_size=True
    )
    result = assembler.add([group("e", [0, 0.2]), group("e", [0.5, 0.5]), group("e", [0.3, 0.9])])
    assert result.counts == {"too_hard": 1, "too_easy": 0, "low_variance": 1}
    # length-penalized advantages may be non-zero with equal rewards: the rule reads advantages, not rewards
    assembler = BatchAssembler(2, group_size=2, constant_batch_size=True)
    assembler.add([group("e", [0.5, 0.5], advantages=[0.1, -0.1])])
    assert assembler.take() is not None


# -- item 2: shares that follow the weights --------------------------------------------------------------------


def test_quotas_follow_uneven_shares_over_the_run_and_fill_every_batch():
    assembler = BatchAssembler(8, shares={"a": 1.0, "b": 2.0}, group_size=2)  # 4 groups: 4/3 and 8/3 per batch
    totals = collections.Counter()
    for _ in range(30):
        quotas = assembler.quotas()
        assert sum(quotas.values()) == 8 and all(q % 2 == 0 for q in quotas.values())
        totals.update(quotas)
        for env_id, rollouts in quotas.items():
            assembler.add([group(env_id, [0, 1]) for _ in range(rollouts // 2)])
        assert assembler.take() is not None
    assert totals["a"] == 80 and totals["b"] == 160  # 30 batches x 8 rollouts x 1/3 and 2/3, exactly


def test_a_fast_environment_waits_for_the_slow_ones_share():
    assembler = BatchAssembler(8, shares={"fast": 1.0, "slow": 1.0}, group_size=2)
    assembler.add([group("fast", [0, 1], group_id=i) for i in range(6)])
    assert assembler.take() is None  # 12 fast rollouts, but the slow environment's half is missing
    assembler.add([group("slow", [0, 1], group_id=10 + i) for i in range(2)])
    batch = assembler.take()
    assert collections.Counter(g.env_id for g in batch.groups) == {"fast": 2, "slow": 2}
    assert [g.group_id for g in batch.groups if g.env_id == "fast"] == [0, 1]  # oldest first


def test_mixed_shares_follow_the_weights_with_a_slow_environment_at_async_level_1():
    config = make_config(env=[{"id": "fast"}, {"id": "slow"}], max_async_level=1)
    workers = {"fast": TimedWorker("fast", rounds=1), "slow": TimedWorker("slow", rounds=6)}
    scheduler = make_scheduler(config, workers, {"fast": 1.0, "slow": 1.0})
    batches, reports = run_steps(scheduler, workers, 20)
    per_env = collections.Counter(g.env_id for batch in batches for g in batch.groups for _ in range(g.num_rollouts))
    assert per_env["slow"] / sum(per_env.values()) == pytest.approx(0.5, abs=0.05)
    assert all(collections.Counter(g.env_id for g in b.groups) == {"fast": 2, "slow": 2} for b in batches)
    assert sum(r.counters["stale_groups_cancelled"] for r in reports) <= 2  # no cancellation storm
    requested = workers["fast"].num_requested + workers["slow"].num_requested
    trained = sum(len(b.groups) for b in batches)
    assert requested - trained <= 8  # what is left in flight at the end, not groups generated to go stale


def test_weights_draw_in_proportion_even_when_both_environments_are_equally_fast():
    config = make_config(env=[{"id": "a"}, {"id": "b"}], batch_size=12, rollouts_per_example=2)
    workers = {"a": TimedWorker("a", rounds=2), "b": TimedWorker("b", rounds=2)}
    scheduler = make_scheduler(config, workers, {"a": 1.0, "b": 2.0})
    batches, _ = run_steps(scheduler, workers, 6)
    for batch in batches:
        assert collections.Counter(g.env_id for g in batch.groups) == {"a": 2, "b": 4}


def test_dispatch_reads_its_cap_from_the_inflight_limit():
    class Adjustable:
        def __init__(self) -> None:
            self.value = 16

        def limit(self) -> int:
            return self.value

    config = make_config()
    worker = TimedWorker("e", rounds=100)
    limit = Adjustable()
    scheduler = RolloutScheduler(
        config,
        stop_event=threading.Event(),
        env_clients={"e": worker},
        sampler=EnvSampler({"e": 100}, {"e": 1.0}, seed=0),
        failures=RolloutFailures(config.batch_size),
        inflight_limit=limit,
    )
    scheduler.refresh_endpoints(Watcher())
    limit.value = 6
    scheduler.dispatch(1)
    assert len(scheduler.inflight) == 3  # 6 rollouts / 2 per group
    assert FixedConcurrency(make_config(max_inflight=4)).limit() == 4  # the scheduler's default cap


def test_the_sampler_draws_the_asked_environments_examples_in_their_order():
    sampler = EnvSampler({"a": 5, "b": 3}, {"a": 1.0, "b": 3.0}, seed=1)
    assert sampler.shares() == {"a": 0.25, "b": 0.75}
    reference = EnvSampler({"a": 5, "b": 3}, {"a": 1.0, "b": 3.0}, seed=1)
    draws_b = [sampler.next("b")[1] for _ in range(3)]
    assert sorted(draws_b) == [0, 1, 2] and sampler.positions == {"a": 0, "b": 3}
    assert reference._order("b", 0) == draws_b
    with pytest.raises(KeyError, match="unknown environment 'c'"):
        sampler.next("c")


# -- item 3: waste accounting ----------------------------------------------------------------------------------------


def test_generated_tokens_are_trained_or_discarded_by_reason():
    config = make_config(env=[{"id": "fast"}, {"id": "slow"}], max_async_level=1)
    workers = {
        "fast": TimedWorker("fast", rounds=1, rewards=every_third_silent, num_tokens=5),
        "slow": TimedWorker("slow", rounds=3, num_tokens=7),
    }
    scheduler = make_scheduler(config, workers, {"fast": 1.0, "slow": 1.0})
    batches, reports = run_steps(scheduler, workers, 10)
    rows = [
        batch_metrics(b, r.counters, r.fallbacks, elapsed_s=1.0, tokens_per_s=1.0, multi_env=True)
        for b, r in zip(batches, reports)
    ]
    generated = sum(r["rollout/tokens_generated"] for r in rows)
    trained = sum(r["rollout/tokens_trained"] for r in rows)
    discarded = sum(r["rollout/tokens_discarded"] for r in rows)
    waiting = sum(g.num_completion_tokens for g in scheduler.assembler.pending_groups())
    assert trained == sum(g.num_completion_tokens for b in batches for g in b.groups) == 10 * (2 * 10 + 2 * 14)
    assert generated == trained + discarded + waiting  # nothing unaccounted (no group was cancelled here)
    assert sum(r["rollout/tokens_discarded/filtered"] for r in rows) > 0  # the silent "fast" groups
    for row in rows:
        assert row["rollout/tokens_discarded"] == sum(row[f"rollout/tokens_discarded/{w}"] for w in DISCARD_REASONS)
        assert row["env/fast/tokens_trained"] == 2 * 10 and row["env/slow/tokens_trained"] == 2 * 14
        assert 0 <= row["rollout/discarded_fraction"] <= 1


def test_cancelled_and_stale_groups_count_as_discarded():
    assembler = BatchAssembler(4, group_size=2)
    assembler.add([group("e", [0, 1], version=0, num_tokens=3), group("e", [0, 1], version=2, num_tokens=3)])
    assert assembler.take(min_policy_version=1) is None
    assembler.add([group("e", [0, 1], version=2, num_tokens=3)])
    batch = assembler.take(min_policy_version=1)
    assert batch.discarded_tokens == {("stale", "e"): 6}
    counters = collections.Counter(
        {"tokens_generated/e": 30, "tokens_discarded/cancelled/e": 8, "tokens_discarded/failed/e": 4}
    )
    metrics = token_metrics(batch, counters, multi_env=False)
    assert metrics["rollout/tokens_generated"] == 30 and metrics["rollout/tokens_trained"] == 12
    assert metrics["rollout/tokens_discarded"] == 18 and metrics["rollout/discarded_fraction"] == pytest.approx(0.6)
    assert (metrics["rollout/tokens_discarded/cancelled"], metrics["rollout/tokens_discarded/stale"]) == (8, 6)


def test_a_stale_cancelled_group_counts_its_estimated_tokens():
    config = make_config(max_async_level=0)
    worker = TimedWorker("e", rounds=1, num_tokens=5)
    scheduler = make_scheduler(config, {"e": worker}, {"e": 1.0})
    run_steps(scheduler, {"e": worker}, 1)  # tokens per rollout known: 5
    worker.rounds = 50
    watcher = Watcher()
    watcher.publish(1)
    scheduler.refresh_endpoints(watcher)
    assert scheduler.take_batch(2) is None  # the surplus of version 0 is too old for step 2
    scheduler.dispatch(2)
    num_inflight = len(scheduler.inflight)
    scheduler.cancel_stale(3)  # step 3 needs version 2
    assert scheduler.counters["stale_groups_cancelled"] == num_inflight > 0
    assert scheduler.counters["tokens_discarded/cancelled/e"] == num_inflight * 2 * 5


def one_in_sixteen_silent(index: int, n: int) -> list[float]:
    """About the demo's rate of groups without signal (its keep rate is 0.94-0.96)."""
    return [1.0] * n if index % 16 == 5 else [float(i % 2) for i in range(n)]


@pytest.mark.parametrize("rounds, train_rounds", [(1, 2), (3, 2)])  # the trainer the slower; inference the slower
def test_constant_batch_size_at_async_level_1_generates_no_group_to_go_stale(rounds, train_rounds):
    # At max_async_level = 1 each batch is made of groups that can go into it and no later one: a group dispatched
    # on the chance that another is filtered is discarded as stale whenever none was (7 % of the tokens before).
    config = make_config(batch_size=64, rollouts_per_example=8, max_inflight=128, max_async_level=1)
    worker = TimedWorker("e", rounds=rounds, rewards=one_in_sixteen_silent)
    scheduler = make_scheduler(config, {"e": worker}, {"e": 1.0})
    batches, reports = run_steps(scheduler, {"e": worker}, 40, train_rounds=train_rounds)
    assert all(batch.num_rollouts == 64 and all(g.has_signal for g in batch.groups) for batch in batches)
    discarded = collections.Counter()
    for batch, report in zip(batches, reports):
        for (reason, _), tokens in batch.discarded_tokens.items():
            discarded[reason] += tokens
        discarded["cancelled"] += sum(v for k, v in report.counters.items() if k.startswith("tokens_discarded/canc"))
    assert discarded["filtered"] > 0  # the silent groups were generated and dropped
    assert discarded["stale"] + discarded["surplus"] + discarded["cancelled"] == 0


def test_groups_in_flight_cover_what_is_missing_without_passing_the_expected_keep():
    assert groups_to_keep_in_flight(8, 0.94) == 8  # 8.5 expected: the ninth would go stale 6 times in 10
    assert groups_to_keep_in_flight(8, 0.5) == 16
    assert groups_to_keep_in_flight(8, 1.0) == 8
    assert groups_to_keep_in_flight(0.25, 0.9) == 1  # a group short of rollouts still gets one in flight
    assert groups_to_keep_in_flight(0, 0.5) == 0
    assert groups_to_keep_in_flight(2, 0.0) == 40  # a pool that kept nothing yet: 1 / 0.05 per group missing


def test_the_run_summary_adds_up_the_tokens():
    from primerl.supervisor.run_progress import Progress, run_summary

    rows = [
        {"role": "orchestrator", "step": s, "train/reward": 0.5, "rollout/tokens_generated": 100.0}
        | {"rollout/tokens_trained": 90.0, "rollout/tokens_discarded": 10.0, "rollout/tokens_discarded/stale": 10.0}
        for s in (1, 2)
    ]
    text = run_summary(rows, Progress(), [], 1.0, Path("r"))
    assert "tokens: 200 generated, 180 trained, 20 discarded (10.0%; stale 20)" in text


def test_the_bound_knows_the_last_step_a_version_can_train_in():
    bound = AsyncBound(1)
    assert bound.last_step(0) == 2 and bound.is_fresh(0, 2) and not bound.is_fresh(0, 3)


def test_a_ready_step_waits_briefly_for_a_group_in_flight_that_no_later_step_could_take():
    from primerl.orchestrator.dispatch_plan import InflightGroup
    from primerl.orchestrator.endpoints import InferenceEndpoint

    config = make_config(batch_size=4)  # 2 groups of 2; max_async_level 1: step 3 takes versions >= 1
    scheduler = make_scheduler(config, {"e": TimedWorker("e", rounds=1)}, {"e": 1.0})
    scheduler.assembler.add([group("e", [0, 1], group_id=i, version=2) for i in range(2)])  # fills step 3 or 4
    future: concurrent.futures.Future = concurrent.futures.Future()
    endpoint = InferenceEndpoint("w1", "http://w1/v1", 1)
    scheduler.inflight[future] = InflightGroup("e", 7, endpoint, dispatched_version=1)  # step 3 or never
    assert scheduler.take_batch(3) is None  # held: the version-1 group can only go into step 3
    del scheduler.inflight[future]
    scheduler.assembler.add([group("e", [1, 0], group_id=7, version=1)])
    batch = scheduler.take_batch(3)
    assert sorted(g.group_id for g in batch.groups) == [0, 7]  # the oldest version first; group 1 waits for step 4
    # the hold is bounded in time: a straggler that never comes holds a ready step no longer than it took to get ready
    scheduler.assembler.add([group("e", [0, 1], group_id=9, version=3)])
    scheduler.inflight[future] = InflightGroup("e", 8, endpoint, dispatched_version=2)  # step 4 or never
    assert scheduler.take_batch(4) is None
    scheduler.step_batches._full_since_s -= 60.0
    assert sorted(g.group_id for g in scheduler.take_batch(4).groups) == [1, 9]
