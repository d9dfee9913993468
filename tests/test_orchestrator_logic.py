"""Pure orchestrator logic: advantages, difficulty filtering, the async bound, packing (samples from trajectories:
`test_orchestrator_samples.py`)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primerl.orchestrator.advantages import (
    apply_truncation_options,
    compute_advantages,
    group_advantages,
    length_penalized_rewards,
    prepare_groups,
)
from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.filtering import (
    BatchAssembler,
    DifficultyFilter,
    filter_groups,
    filter_reason,
)
from primerl.orchestrator.packing import to_broker_batches
from primerl.orchestrator.samples import Group, TrainingSample
from primerl.proto import telemetry
from primerl.proto.packing import balance_across_ranks, first_fit_decreasing, pack_samples


def make_sample(
    num_tokens=6, *, reward=0.0, num_prompt=2, rollout_id=0, version=0, truncated=False, token_base=0, group_id=0
):
    return TrainingSample(
        token_ids=[token_base + p for p in range(num_tokens)],
        loss_mask=[p >= num_prompt for p in range(num_tokens)],
        inference_logprobs=[-0.5 if p >= num_prompt else 0.0 for p in range(num_tokens)],
        temperatures=[1.0] * num_tokens,
        policy_versions=[version] * num_tokens,
        reward=reward,
        truncated=truncated,
        rollout_id=rollout_id,
        group_id=group_id,
    )


def make_group(rewards, *, group_id=0, version=0, completion_lengths=None, truncated=None):
    samples = []
    for rollout_id, reward in enumerate(rewards):
        completion = completion_lengths[rollout_id] if completion_lengths else 4
        samples.append(
            make_sample(
                2 + completion,
                reward=reward,
                rollout_id=rollout_id,
                version=version,
                truncated=bool(truncated and truncated[rollout_id]),
                group_id=group_id,
            )
        )
    return Group(group_id=group_id, example_id=group_id, env_id="env", samples=samples)


# -- advantages ------------------------------------------------------------------------------------------------


def test_advantages_by_hand():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert group_advantages([2.0, 2.0]) == pytest.approx([0.0, 0.0])
    # std-normalised: mean 0.5, population std 0.5
    assert group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True) == pytest.approx([1, -1, -1, 1], abs=1e-5)
    # equal rewards: std 0, eps keeps it finite
    assert group_advantages([3.0, 3.0, 3.0], std_normalize=True) == pytest.approx([0, 0, 0])
    assert group_advantages([0.0, 1.0, 2.0], std_normalize=True) == pytest.approx(
        np.array([-1.0, 0.0, 1.0]) / (np.sqrt(2 / 3) + 1e-6)
    )


def test_length_penalty_formula():
    penalized = length_penalized_rewards([1.0, 1.0], [100, 50], length_penalty=0.2, max_tokens=100)
    assert penalized == pytest.approx([0.8, 0.9])
    group = make_group([1.0, 1.0], completion_lengths=[100, 50])
    compute_advantages([group], length_penalty=0.2, max_tokens=100)
    assert [s.advantage for s in group.samples] == pytest.approx([-0.05, 0.05])  # mean of 0.8 and 0.9 is 0.85
    assert [s.reward for s in group.samples] == [1.0, 1.0]  # rewards untouched
    with pytest.raises(ValueError, match="max_tokens"):
        length_penalized_rewards([1.0], [3], length_penalty=0.1, max_tokens=None)


def test_branching_rollouts_count_once_in_the_group():
    # rollout 0 has two samples (two turns), rollout 1 one: the mean is over rollouts (0.5), not samples
    samples = [
        make_sample(reward=1.0, rollout_id=0),
        make_sample(reward=1.0, rollout_id=0),
        make_sample(reward=0.0, rollout_id=1),
    ]
    group = Group(group_id=0, example_id=0, env_id="env", samples=samples)
    assert group.num_rollouts == 2 and group.mean_reward == 0.5
    compute_advantages([group])
    assert [s.advantage for s in samples] == pytest.approx([0.5, 0.5, -0.5])


def test_truncation_options():
    group = make_group([1.0, 1.0, 0.0], truncated=[True, False, False])
    assert apply_truncation_options([group], mask_truncated_completions=False, zero_truncated_completions=True) == 1
    assert [s.reward for s in group.samples] == [0.0, 1.0, 0.0]
    assert group.samples[0].num_loss_tokens == 4

    group = make_group([1.0, 1.0, 0.0], truncated=[True, False, False])
    apply_truncation_options([group], mask_truncated_completions=True, zero_truncated_completions=False)
    assert group.samples[0].num_loss_tokens == 0 and group.samples[0].reward == 1.0
    assert group.samples[0].num_completion_tokens == 4  # the length penalty still sees the real length
    compute_advantages([group])
    assert [s.advantage for s in group.samples] == pytest.approx([1 / 3, 1 / 3, -2 / 3])  # still in the mean


def test_prepare_groups_reads_the_config():
    from primerl.configs.orchestrator import OrchestratorConfig

    config = OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "env": [{"id": "e"}],
            "batch_size": 4,
            "rollouts_per_example": 2,
            "zero_truncated_completions": True,
            "advantage": {"std_normalize": True},
        }
    )
    group = make_group([1.0, 1.0], truncated=[True, False])
    assert prepare_groups([group], config) == 1
    assert [s.advantage for s in group.samples] == pytest.approx([-1.0, 1.0], abs=1e-5)


# -- filtering -------------------------------------------------------------------------------------------------


def test_filter_reasons():
    bounds = dict(min_reward=0.2, max_reward=0.8, min_reward_variance=0.01)
    assert filter_reason(make_group([0.0, 0.0, 0.1, 0.2]), **bounds) == "too_hard"
    assert filter_reason(make_group([1.0, 1.0, 0.9, 0.7]), **bounds) == "too_easy"
    assert filter_reason(make_group([0.5, 0.5, 0.55, 0.45]), **bounds) == "low_variance"  # var 0.00125
    assert filter_reason(make_group([0.0, 1.0, 0.5, 0.5]), **bounds) is None
    assert filter_reason(make_group([0.2, 0.2, 0.2, 0.2]), min_reward=0.2) == "low_variance"  # bound inclusive
    assert filter_reason(make_group([0.0, 0.4]), min_reward=0.2, max_reward=0.2) is None  # mean 0.2 == both bounds
    # all-equal rewards are dropped even with min_reward_variance = 0; float noise does not hide them
    assert filter_reason(make_group([0.1 + 0.2] * 3)) == "low_variance"
    assert filter_reason(make_group([0.0, 1e-9])) is None


def test_filter_counts_and_switch():
    groups = [make_group(r, group_id=i) for i, r in enumerate([[0, 0], [1, 1], [0, 1], [0.5, 0.5], [0, 0.1], [0.9, 1]])]
    result = filter_groups(groups, min_reward=0.1, max_reward=0.9)
    assert result.counts == {"too_hard": 2, "too_easy": 2, "low_variance": 1}
    assert [g.group_id for g in result.kept] == [2]
    assert result.num_groups == 6 and result.num_filtered == 5
    assert len(DifficultyFilter(enabled=False)(groups).kept) == 6
    from primerl.configs.orchestrator import BufferConfig

    config_filter = DifficultyFilter.from_config(BufferConfig(type="online-difficulty", min_reward=0.1))
    assert config_filter(groups).counts == {"too_hard": 2, "too_easy": 0, "low_variance": 2}


def test_assembler_fills_batches_and_keeps_a_bounded_surplus():
    assembler = BatchAssembler(4, difficulty_filter=DifficultyFilter(), max_surplus_rollouts=2)
    assert assembler.add([make_group([0, 1], group_id=0), make_group([1, 1], group_id=1)]).num_filtered == 1
    assert assembler.take() is None and assembler.num_pending_rollouts == 2
    assembler.add([make_group([0, 1], group_id=i) for i in (2, 3, 4, 5)])
    batch = assembler.take()
    assert [g.group_id for g in batch.groups] == [0, 2] and batch.num_rollouts == 4
    assert batch.metrics["filter/num_groups"] == 6 and batch.metrics["filter/low_variance"] == 1
    assert batch.metrics["filter/filtered_fraction"] == pytest.approx(1 / 6)
    # groups 3, 4, 5 were left (6 rollouts); the bound keeps 2 rollouts: the newest group
    assert batch.metrics["buffer/num_surplus_groups_dropped"] == 2 and assembler.num_pending_rollouts == 2
    assembler.add([make_group([0, 1], group_id=6)])
    batch = assembler.take()
    assert [g.group_id for g in batch.groups] == [5, 6]
    assert batch.metrics["filter/num_groups"] == 1 and batch.metrics["filter/filtered_fraction"] == 0
    assert assembler.take() is None


def test_assembler_partial_groups_and_stale_drop():
    assembler = BatchAssembler(4)
    assembler.add([make_group([0, 1, 1], group_id=0, version=0), make_group([0, 1, 1], group_id=1, version=2)])
    assert assembler.drop_stale(min_policy_version=1) == 1
    assembler.add([make_group([0, 1, 1], group_id=2, version=2)])
    batch = assembler.take()
    assert [g.group_id for g in batch.groups] == [1, 2] and batch.num_rollouts == 6  # groups are never split
    assert batch.metrics["buffer/num_stale_groups_dropped"] == 1


# -- async bound -----------------------------------------------------------------------------------------------


def test_async_bound_dispatch_and_freshness():
    bound = AsyncBound(1)  # trainer steps from 1; it starts step n holding version n - 1
    assert bound.min_policy_version(1) == 0 and bound.min_policy_version(5) == 3
    assert bound.may_dispatch(2, 0)  # one step ahead of the trainer: fine
    assert not bound.may_dispatch(3, 0)  # two steps ahead: wait for version 1
    assert bound.may_dispatch(3, 1)
    assert bound.is_fresh(3, 5) and not bound.is_fresh(2, 5)
    on_policy = AsyncBound(0)
    assert on_policy.may_dispatch(1, 0) and not on_policy.may_dispatch(2, 0)  # level 0 never deadlocks at step 1
    literal = AsyncBound(1, first_step=0)  # 0-based steps: versions >= n - max_async_level
    assert literal.min_policy_version(5) == 4 and not literal.may_dispatch(5, 3)
    with pytest.raises(ValueError):
        AsyncBound(-1)


def test_stale_groups_and_lag():
    bound = AsyncBound(2)
    inflight = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert bound.stale_groups(inflight, 4) == ["a"]  # step 4 needs >= 4 - 1 - 2 = 1
    assert bound.stale_groups(inflight, 6) == ["a", "b", "c"]
    metrics = bound.lag_metrics(5, [4, 4, 3, 2])  # trainer holds version 4
    assert metrics == {
        telemetry.ASYNC_OFF_POLICY_LAG_MEAN: 0.75,
        telemetry.ASYNC_OFF_POLICY_LAG_MAX: 2.0,
        telemetry.ASYNC_OFF_POLICY_LAG_MIN: 0.0,
    }
    assert bound.lag_metrics(5, [])[telemetry.ASYNC_OFF_POLICY_LAG_MAX] == 0.0


# -- packing ---------------------------------------------------------------------------------------------------


def test_first_fit_decreasing_and_lpt():
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError):
        first_fit_decreasing([9], 8)
    assert balance_across_ranks([5, 3, 4, 2, 6], 2) == [[4, 1, 3], [0, 2]]


def random_sample(index, length, rng, *, version_range=(0, 3), teacher=False):
    num_prompt = int(rng.integers(1, length + 1))
    loss_mask = [p >= num_prompt and bool(rng.integers(0, 4)) for p in range(length)]
    return TrainingSample(
        token_ids=[index * 100_000 + p for p in range(length)],
        loss_mask=loss_mask,
        inference_logprobs=[-float(rng.random()) if m else 0.0 for m in loss_mask],
        temperatures=[0.5 + 0.1 * (index % 5)] * length,
        policy_versions=[int(rng.integers(*version_range))] * length,
        advantage=float(rng.standard_normal()),
        teacher_logprobs=[-1.0] * length if teacher else None,
    )


DTYPES = {
    "input_ids": np.int64,
    "position_ids": np.int64,
    "loss_mask": np.bool_,
    "advantages": np.float32,
    "inference_logprobs": np.float32,
    "temperatures": np.float32,
    "policy_versions": np.int64,
}


def check_packing(samples, seq_len, num_ranks, overlong):
    packed = pack_samples(samples, seq_len=seq_len, num_ranks=num_ranks, overlong=overlong)
    assert len(packed.per_rank) == num_ranks
    kept = [i for i, s in enumerate(samples) if overlong == "truncate" or s.num_tokens <= seq_len]
    lengths = {i: min(samples[i].num_tokens, seq_len) for i in kept}
    seen: Counter = Counter()
    rank_tokens, loss_tokens = [], 0
    for batches in packed.per_rank:
        assert batches, "every rank gets a micro-batch"
        tokens = 0
        for batch in batches:
            t = batch.tensors
            assert set(t) == set(DTYPES)
            for name, dtype in DTYPES.items():
                assert t[name].dtype == dtype and t[name].shape == (batch.num_tokens,), name
            assert 1 <= batch.num_tokens <= seq_len
            starts = np.flatnonzero(t["position_ids"] == 0)
            assert starts[0] == 0 and not t["loss_mask"][starts].any(), "a sample's first token is never a loss token"
            if batch.is_padding:
                assert batch.num_loss_tokens == 0 and len(kept) < num_ranks
                continue
            ends = list(starts[1:]) + [batch.num_tokens]
            assert len(starts) == batch.num_samples
            for index, start, end in zip(batch.sample_indices, starts, ends):
                sample = samples[index]
                assert end - start == lengths[index]
                assert np.array_equal(t["position_ids"][start:end], np.arange(end - start))
                assert list(t["input_ids"][start:end]) == list(sample.token_ids[: end - start])
                assert list(t["loss_mask"][start:end]) == list(sample.loss_mask[: end - start])
                assert np.allclose(t["inference_logprobs"][start:end], sample.inference_logprobs[: end - start])
                assert np.all(t["advantages"][start:end] == np.float32(sample.advantage))
                assert np.all(t["policy_versions"][start:end] == sample.policy_versions[0])
                seen.update((index, int(p)) for p in t["position_ids"][start:end])
            assert batch.min_policy_version == t["policy_versions"].min()
            assert batch.max_policy_version == t["policy_versions"].max()
            assert batch.num_loss_tokens == int(t["loss_mask"].sum())
            loss_tokens += batch.num_loss_tokens
            tokens += batch.num_tokens
        rank_tokens.append(tokens)
    # no token lost or duplicated
    assert seen == Counter((i, p) for i in kept for p in range(lengths[i]))
    assert packed.num_loss_tokens_global == loss_tokens
    # rank balance within one largest sample; every rank has a real micro-batch when there are enough samples
    assert max(rank_tokens) - min(rank_tokens) <= max(lengths.values())
    if len(kept) >= num_ranks:
        assert packed.num_padding_micro_batches == 0
    # equal micro-batch counts unless a rank cannot split further (all its bins hold one sample)
    most = max(len(b) for b in packed.per_rank)
    for batches in packed.per_rank:
        if len(batches) < most:
            assert all(batch.num_samples <= 1 for batch in batches)
    overlong_count = sum(s.num_tokens > seq_len for s in samples)
    assert (packed.num_overlong_truncated if overlong == "truncate" else packed.num_overlong_rejected) == overlong_count
    return packed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq_len=st.integers(1, 48),
    num_ranks=st.integers(1, 6),
    length_fractions=st.lists(st.floats(0.0, 1.25), min_size=1, max_size=40),
    overlong=st.sampled_from(["truncate", "reject"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_packing_invariants(seq_len, num_ranks, length_fractions, overlong, seed):
    rng = np.random.default_rng(seed)
    lengths = [max(1, int(round(f * seq_len))) for f in length_fractions]
    if overlong == "reject" and all(length > seq_len for length in lengths):
        lengths[0] = seq_len
    samples = [random_sample(i, length, rng) for i, length in enumerate(lengths)]
    check_packing(samples, seq_len, num_ranks, overlong)


def test_packing_pads_ranks_without_samples_and_equalizes_counts():
    rng = np.random.default_rng(0)
    packed = check_packing([random_sample(0, 5, rng)], seq_len=8, num_ranks=3, overlong="truncate")
    assert packed.num_padding_micro_batches == 2 and [len(b) for b in packed.per_rank] == [1, 1, 1]
    # 8 short samples on 2 ranks fit one bin each; the ranks split bins to get as many micro-batches as the other
    samples = [random_sample(i, length, rng) for i, length in enumerate([10, 10, 10, 2, 2, 2, 2, 2])]
    packed = check_packing(samples, seq_len=16, num_ranks=2, overlong="truncate")
    assert len(packed.per_rank[0]) == len(packed.per_rank[1])
    # rank 0 gets [10] and [3]; rank 1 gets 5 + 5 in one bin and splits it to match
    samples = [random_sample(i, length, rng) for i, length in enumerate([10, 5, 5, 3])]
    packed = check_packing(samples, seq_len=10, num_ranks=2, overlong="truncate")
    assert [[b.sample_indices for b in batches] for batches in packed.per_rank] == [[[0], [3]], [[1], [2]]]
    assert packed.metrics()["packing/num_micro_batches"] == sum(len(b) for b in packed.per_rank)


def test_packing_errors_and_teacher_logprobs():
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="no samples"):
        pack_samples([], seq_len=8)
    with pytest.raises(ValueError, match="rejected"):
        pack_samples([random_sample(0, 9, rng)], seq_len=8, overlong="reject")
    mixed = [random_sample(0, 4, rng, teacher=True), random_sample(1, 4, rng)]
    with pytest.raises(ValueError, match="teacher_logprobs"):
        pack_samples(mixed, seq_len=8)
    packed = pack_samples([random_sample(0, 4, rng, teacher=True)], seq_len=8, num_ranks=2)
    assert all(b[0].tensors["teacher_logprobs"].dtype == np.float32 for b in packed.per_rank)


def test_to_broker_batches_headers_and_payloads():
    from primerl.proto.tensor_frames import decode_tensors

    rng = np.random.default_rng(2)
    samples = [random_sample(i, length, rng, version_range=(3, 6)) for i, length in enumerate([7, 5, 4, 3, 3, 2])]
    packed = pack_samples(samples, seq_len=8, num_ranks=2)
    messages = to_broker_batches(9, packed)
    assert len(messages) == sum(len(b) for b in packed.per_rank)
    position = 0
    for rank, batches in enumerate(packed.per_rank):
        for index, batch in enumerate(batches):
            header, payload = messages[position]
            position += 1
            assert (header.step, header.rank, header.micro_batch_index, header.num_micro_batches) == (
                9,
                rank,
                index,
                len(batches),
            )
            assert header.num_samples == batch.num_samples and header.num_tokens == batch.num_tokens
            assert (header.min_policy_version, header.max_policy_version) == (
                batch.min_policy_version,
                batch.max_policy_version,
            )
            assert header.num_loss_tokens_global == packed.num_loss_tokens_global
            decoded = decode_tensors(payload, header.tensors)
            for name, array in batch.tensors.items():
                assert np.array_equal(np.asarray(decoded[name]), array)
    assert len(to_broker_batches(9, packed.per_rank)) == len(messages)
    with pytest.raises(ValueError, match="no micro-batch"):
        to_broker_batches(9, [packed.per_rank[0], []])


def test_a_batch_filled_by_an_earlier_surplus_never_holds_stale_groups():
    # Step n's surplus (version 3) already fills step n+1's batch; with max_async_level 0 step n+1 needs version 4.
    assembler = BatchAssembler(4)
    assembler.add([make_group([0, 1], group_id=i, version=3) for i in range(2)])
    assert assembler.is_full()
    assert assembler.take(min_policy_version=4) is None and assembler.num_pending_rollouts == 0
    assembler.add([make_group([0, 1], group_id=i, version=4) for i in (2, 3)])
    batch = assembler.take(min_policy_version=4)
    assert [g.group_id for g in batch.groups] == [2, 3]
    assert batch.metrics["buffer/num_stale_groups_dropped"] == 2
