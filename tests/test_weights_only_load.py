"""A weights-only load (``checkpoint.load_optimizer=false``, the fine-tuning path) under every
precision x ZeRO level x DP size in {1, 2, 3}: the params and the optimizer's fp32 main weights
equal the checkpoint's values exactly, on a layout whose ZeRO shard boundaries cut rows of the
embedding and of a linear weight (the test checks that they do). In fp32 the main weights are
the params' own storage, so filling them is a copy of a tensor onto itself; it must not be
refused as an overlapping copy. One launch per DP size, every case inside it."""

from __future__ import annotations

import pytest
import torch

from paratron.checkpoint.io import save_model_full
from paratron.checkpoint.manager import CheckpointManager, full_params
from paratron.config import CheckpointConfig
from paratron.models.gpt import build_model_chunks
from paratron.optim import DistributedDataParallel, build_optimizer, precision_dtype
from paratron.optim.state_chunks import copy_aliased_
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks
from test_checkpoint_reshard import targets, tiny_config

PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_LEVELS = (0, 1, 2, 3)


def weights_config():
    """Two layers, hidden 32, vocab 500 (padded to 512): 0.002 MiB buckets (524 fp32 elements)
    and shards of a third or a half of a bucket end inside rows of 32 or 96."""
    cfg = tiny_config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 500
    return cfg


def _load_case(root: str, precision: str, zero: int) -> dict:
    """Build this rank's model (another seed than the checkpoint's), load weights only; return
    the number of params and main-weight pieces checked and of pieces that are part of a row."""
    cfg = weights_config()
    ctx = ParallelContext.build() if torch.distributed.is_initialized() else ParallelContext.single()
    dtype = precision_dtype(precision)
    chunks = build_model_chunks(cfg.model, ctx, seed=3, params_dtype=dtype)
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, zero=zero)
    opt = build_optimizer(chunks, ctx, cfg.optimizer, ddp, precision=precision)
    CheckpointManager(CheckpointConfig(load=root, load_optimizer=False), ctx, cfg).load(chunks, opt, None)
    # What the run trains from: the saved values in the param dtype, in fp32 for the main weights.
    want = {k: v.to(dtype) for k, v in targets(cfg).items()}
    params = 0
    with full_params(opt):
        for c in chunks:
            for p in c.parameters():
                assert torch.equal(p.meta.shard.valid(p.detach()), want[p.meta.logical_name][p.meta.shard.slices()]), \
                    (precision, zero, p.meta.logical_name)
                params += 1
    pieces = part_rows = 0
    for key, chunk_views in opt.sharded_state_dict().items():
        if not key.startswith("optimizer/main_param/"):
            continue
        t = want[key.split("/", 2)[2]].float()
        t2d = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
        for view, spec in chunk_views:
            assert torch.equal(view, t2d[spec.slices()]), (precision, zero, key, spec)
            pieces += 1
            part_rows += t.dim() > 1 and spec.local_shape[1] < t2d.shape[1]
    assert opt.step_count == 0
    return {"params": params, "pieces": pieces, "part_rows": part_rows}


def _all_cases(root: str) -> dict:
    return {(precision, zero): _load_case(root, precision, zero)
            for precision in PRECISIONS for zero in ZERO_LEVELS}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("weights") / "ck"
    cfg = weights_config()
    save_model_full(root, cfg, targets(cfg))
    return str(root)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_weights_only_load_under_every_precision_and_zero_level(weights, dp):
    results = _all_cases(weights) if dp == 1 else run_ranks(_all_cases, dp, weights, timeout=300)
    results = [results] if dp == 1 else results
    for case in results[0]:
        got = [r[case] for r in results]
        assert all(g["params"] > 0 and g["pieces"] > 0 for g in got), (dp, case, got)
        if dp > 1 and case[1] >= 1:  # the overlap the fix is about: a shard boundary inside a row
            assert sum(g["part_rows"] for g in got) > 0, (dp, case, got)


def test_copy_aliased_handles_every_overlap():
    """The same elements through views of other strides: nothing to do; a shifted overlap: the
    values of ``src`` before the copy; separate tensors: a plain copy."""
    base = torch.arange(12.0)
    row = base[2:6].view(1, 4)
    other = base.view(3, 4)[0:1, 2:]  # shape [1, 2], row stride 4
    copy_aliased_(base[2:4].view(1, 2), other)
    assert torch.equal(base, torch.arange(12.0))
    copy_aliased_(base[1:5], row.reshape(4))  # shifted by one: must read src before writing
    assert torch.equal(base[:6], torch.tensor([0.0, 2, 3, 4, 5, 5]))
    dst = torch.zeros(1, 4)
    copy_aliased_(dst, row)
    assert torch.equal(dst, base[2:6].view(1, 4))
