"""The pure dispatch plan: which environment each group goes to, on which inference worker, and which workers are
silent (``orchestrator/dispatch_plan.py``, ``orchestrator/silent_workers.py``), without a scheduler."""

import collections

from primerl.orchestrator.dispatch_plan import InflightGroup, neediest, plan_round
from primerl.orchestrator.endpoints import InferenceEndpoint
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.seeds import rollout_seed_base
from primerl.orchestrator.silent_workers import SILENCE_MIN_S, SilenceDeadline, silent_workers


def plan(deficits, *, usable, rescheduled=(), num_groups=10, seed=None):
    return plan_round(
        num_groups,
        usable=usable,
        deficits_for=lambda version: dict(deficits),
        shares={"a": 0.5, "b": 0.5},
        rescheduled=collections.deque(rescheduled),
        sampler=EnvSampler({"a": 100, "b": 100}, {"a": 1.0, "b": 1.0}, seed=0),
        seed=seed,
        group_size=2,
        first_group_id=5,
        lineage_epoch=3,
        now_s=1.0,
    )


def test_the_neediest_environment_is_furthest_behind_its_share_and_none_needs_nothing():
    assert neediest({"a": 2, "b": 3}, {"a": 0.2, "b": 0.8}) == "a"
    assert neediest({"a": 0, "b": -1}, {"a": 0.5, "b": 0.5}) is None
    assert neediest({"a": 4}, {"a": 0.0}) is None


def test_a_round_plans_the_deficits_spread_over_the_least_loaded_workers():
    w1, w2 = InferenceEndpoint("w1", "http://w1/v1", 0), InferenceEndpoint("w2", "http://w2/v1", 0, num_inflight=2)
    planned = plan({"a": 2, "b": 1}, usable=[w1, w2], seed=7)
    groups = [g for entries in planned.values() for g in entries]
    assert collections.Counter(g.env_id for g in groups) == {"a": 2, "b": 1}  # no group beyond the deficits
    assert w1.num_inflight == w2.num_inflight == 4  # reserved, the least loaded first
    assert {key[2] for key in planned} <= {rollout_seed_base(7, g, 2) for g in range(5, 8)}
    assert all(g.lineage_epoch == 3 and g.dispatched_version == 0 for g in groups)


def test_groups_to_dispatch_again_go_first_and_a_backing_off_worker_takes_none():
    backing_off = InferenceEndpoint("w1", "http://w1/v1", 0, retry_at_s=5.0)
    assert plan({"a": 1}, usable=[backing_off]) == {}
    worker = InferenceEndpoint("w2", "http://w2/v1", 0)
    planned = plan({"a": 0, "b": 0}, usable=[worker], rescheduled=[("b", 42, 1)])
    [(key, [group])] = planned.items()
    assert key == ("b", "w2", None) and (group.example_index, group.num_retries) == (42, 1)


def test_a_worker_is_silent_only_while_another_answers():
    now_s = 100.0
    silent, answering = InferenceEndpoint("s", "http://s/v1", 0), InferenceEndpoint("a", "http://a/v1", 0)
    answering.last_answer_s = now_s - 1
    inflight = [InflightGroup("e", 1, silent, 0, started_s=now_s - 30), InflightGroup("e", 2, answering, 0)]
    assert silent_workers(inflight, [silent, answering], now_s, 20.0) == [(silent, 30.0)]
    assert silent_workers(inflight, [silent], now_s, 20.0) == []  # nobody answers: the run is slow
    deadline = SilenceDeadline(None)
    for _ in range(8):
        deadline.group_done(0.5)
    assert deadline.timeout_s() == SILENCE_MIN_S and SilenceDeadline(0).timeout_s() is None
