"""Pretraining sampler: resume at consumed samples, epochs without repeats or gaps, DP slicing."""

import numpy as np
import pytest
import torch

from paratron.data.sampler import PretrainingSampler, batch_indices, collate, microbatches


def _run(sampler_per_rank, consumed, steps):
    """Sample ids per step, in global-batch order (microbatch-major, then DP rank)."""
    out = []
    for s in range(steps):
        per_rank = [smp.step(consumed + s * smp.global_batch_size) for smp in sampler_per_rank]
        ids = [mb for k in range(len(per_rank[0])) for r in range(len(per_rank)) for mb in per_rank[r][k]]
        out.append(np.asarray(ids))
    return out


@pytest.mark.parametrize("dp,mbs", [(1, 8), (2, 2), (4, 1)])
def test_resume_sees_the_same_samples(dp, mbs):
    total = 100  # not a multiple of the global batch: a step straddles the epoch boundary
    make = lambda: [PretrainingSampler(total, 8, mbs, r, dp, seed=11) for r in range(dp)]  # noqa: E731
    whole = np.concatenate(_run(make(), 0, 30))
    # Layout-free: any (dp, micro batch) reads the same global batches as one rank.
    np.testing.assert_array_equal(whole, np.concatenate(_run([PretrainingSampler(total, 8, 8, seed=11)], 0, 30)))
    resumed = np.concatenate(_run(make(), 40, 25))
    np.testing.assert_array_equal(resumed, whole[40:])
    # Epochs: each is a permutation of all samples, and the next one is reshuffled.
    assert sorted(whole[:total].tolist()) == list(range(total))
    assert sorted(whole[total:2 * total].tolist()) == list(range(total))
    assert not np.array_equal(whole[:total], whole[total:2 * total])


def test_dp_ranks_partition_each_step():
    samplers = [PretrainingSampler(1000, 16, 2, r, 4, seed=0) for r in range(4)]
    steps = [s.step(48) for s in samplers]
    assert all(len(mbs) == 2 and all(len(mb) == 2 for mb in mbs) for mbs in steps)
    ids = np.concatenate([mb for mbs in steps for mb in mbs])
    np.testing.assert_array_equal(np.sort(ids), np.sort(samplers[0].stream(48, 16)))
    # Megatron's layout: microbatch k of the step, rank r -> positions k*mbs*dp + r*mbs ...
    np.testing.assert_array_equal(steps[1][1], samplers[0].stream(48 + 1 * 8 + 1 * 2, 2))
    one = batch_indices(48, 16, dp_rank=1, dp_size=4, micro_batch_size=2, total_samples=1000)
    assert all(np.array_equal(a, b) for a, b in zip(one, steps[1]))


def test_unshuffled_order_and_errors():
    s = PretrainingSampler(10, 4, 2, 0, 1, shuffle=False)
    assert np.concatenate(s.step(8)).tolist() == [8, 9, 0, 1]
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by micro_batch_size\*"
                                         r"data_parallel_size = 2\*2"):
        PretrainingSampler(100, 10, 2, 0, 2)
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 must be in \[0, 2\)"):
        PretrainingSampler(100, 8, 2, 2, 2)
    with pytest.raises(ValueError, match="consumed_samples=-8 must be >= 0"):
        s.step(-8)


def test_microbatches_collate():
    data = [{"tokens": torch.full((5,), i), "labels": torch.full((5,), i + 1)} for i in range(20)]
    s = PretrainingSampler(20, 4, 2, 1, 2, shuffle=False)
    step = next(microbatches(data, s, consumed_samples=4))
    assert len(step) == 1 and step[0]["tokens"].shape == (2, 5)
    assert step[0]["tokens"][:, 0].tolist() == [6, 7] and step[0]["labels"][:, 0].tolist() == [7, 8]


def test_torch_dataloader_batch_sampler():
    data = [{"tokens": torch.full((3,), i), "labels": torch.full((3,), i)} for i in range(50)]
    s = PretrainingSampler(50, 8, 2, 1, 2, seed=3, consumed_samples=16)
    loader = torch.utils.data.DataLoader(data, batch_sampler=s, collate_fn=collate)
    got = [b["tokens"][:, 0] for _, b in zip(range(4), loader)]
    want = [torch.as_tensor(mb) for mbs in (s.step(16), s.step(24)) for mb in mbs]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
