"""The pipeline runtime's parts: the frozen plan of one rank's list, the chunk interface, and the
link delay as a wrapper group (no delay code in the runtime's p2p path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.pipeline.actions import BW, FB, F
from paratron.pipeline.chunk import ModuleChunk, PipelineChunk, as_pipeline_chunk
from paratron.pipeline.delay import DelayedGroup, LinkDelay
from paratron.pipeline.plan import plan_run
from paratron.pipeline.registry import build_schedule

from test_pipeline_runtime import _cfg


def test_plan_of_a_1f1b_list():
    actions = build_schedule("1f1b", 2, 4)[0]
    plan = plan_run(actions, 1, 2, 4)
    assert dataclasses.is_dataclass(plan) and plan.last_stage == 1 and dict(plan.local) == {0: 0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.forward_only = True
    p2p = [i for i, step in enumerate(plan.steps) if step[0].is_p2p]
    assert plan.first_p2p == p2p[0] and dict(plan.next_p2p) == dict(zip(p2p, p2p[1:]))
    assert plan.last_backward[0] == BW(3, 0) and plan.is_last_backward(BW(3, 0)) == [0]
    assert plan.is_last_backward(BW(2, 0)) == [] and not plan.recomputed and not plan.segmented
    evaluation = plan_run(actions, 1, 2, 4, forward_only=True)
    assert all(a.kind in ("F", "SEND_F", "RECV_F") for step in evaluation.steps for a in step)
    assert not evaluation.last_backward
    with pytest.raises(ValueError, match="2 model chunks"):
        plan_run(actions, 2, 2, 4)
    with pytest.raises(ValueError, match="only 3 microbatches"):
        plan_run(actions, 1, 2, 3)


def test_plan_marks_the_backward_half_of_a_pair_segmented():
    plan = plan_run([F(0, 0), FB(F(1, 0), BW(0, 0)), BW(1, 0)], 1, 1, 2)
    assert plan.segmented == {(0, 0)} and plan.last_backward[0] == BW(1, 0)


def test_gpt_chunk_implements_the_chunk_interface():
    (chunk,) = build_model_chunks(_cfg(2), ParallelContext.single(), seed=1)
    assert isinstance(chunk, PipelineChunk) and as_pipeline_chunk(chunk) is chunk
    plain = as_pipeline_chunk(torch.nn.Linear(2, 2))
    assert isinstance(plain, ModuleChunk) and plain.rng_tracker is None


class _Op:
    def __init__(self, kind, t, peer):
        self.kind, self.t, self.peer = kind, t, peer


class _Work:
    def wait(self):
        return True


class _Group:
    """A pipeline group that records what is posted (rank 1 of 3)."""

    rank, size = 1, 3

    def __init__(self):
        self.posted = []

    def p2p_op(self, kind, t, peer):
        return _Op(kind, t, peer)

    def batch_isend_irecv(self, ops):
        self.posted.append([(op.kind, op.peer, tuple(op.t.shape), op.t.dtype) for op in ops])
        return [_Work() for _ in ops]


def test_delayed_group_stamps_only_the_delayed_link():
    inner = _Group()
    group = DelayedGroup(inner, LinkDelay((1, 2), 0.0))
    assert group.size == 3  # everything else is the wrapped group's
    x = torch.zeros(4)
    works = group.batch_isend_irecv([group.p2p_op("send", x, 2), group.p2p_op("recv", x, 0),
                                     group.p2p_op("recv", x, 2)])
    assert len(works) == 3  # one work per op given
    assert [(k, p) for k, p, _, _ in inner.posted[0]] == [("send", 2), ("send", 2), ("recv", 0), ("recv", 2),
                                                          ("recv", 2)]
    assert inner.posted[0][1][2:] == ((1,), torch.float64) and inner.posted[0][4][2:] == ((1,), torch.float64)
    works[0].wait()  # the message's send and its stamp's (a receive's stamp never arrives here)
    assert type(works[1]) is _Work and type(works[2]).__name__ == "Delayed"
