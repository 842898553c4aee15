"""The GPU path proven on the CPU: one whole training step with the model on an accelerator
(the ``auditgpu`` stand-in of :mod:`paratron.device_audit`, since a CPU build of PyTorch cannot
hold CUDA tensors), TP=2 x PP=2 x DP=2, ZeRO-1, sequence parallel, a MoE layer at EP=2, 8 gloo
ranks. Any op that mixes host and accelerator tensors, and any collective on a tensor off
``ctx.device``, fails the step; device-to-host syncs are counted per step.
"""

import pytest
import torch

from paratron.device_audit import AuditTensor, DeviceAudit, DeviceMixError, audit_device
from paratron.parallel.comm import Group
from paratron.testing import RankFailure, run_ranks


def _config(precision: str, moe: bool):
    from paratron.config import load_config
    from tests.conftest import ROOT

    over = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
            "model.vocab_size=96", "model.tie_embeddings=true", "model.hidden_dropout=0.1",
            "train.micro_batch_size=1", "train.global_batch_size=4", f"train.precision={precision}",
            "parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
            "parallel.zero=1", "parallel.schedule=1f1b", "optimizer.clip_grad=1.0"]
    if moe:
        over += ["model.num_experts=4", "model.moe_top_k=2", "model.moe_layer_freq=2",
                 "model.moe_ffn_hidden_size=32", "model.moe_aux_loss_coeff=0.01",
                 "model.moe_token_dispatcher=alltoall", "parallel.expert=2"]
    return load_config(ROOT / "configs/llama-tiny.toml", over)


def _microbatches(cfg, dp_rank: int, step: int) -> list[dict]:
    """This DP rank's microbatches on the host, as the data loader hands them over."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length)
    out = []
    for _ in range(m):
        labels = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        labels[0, :3] = -100
        out.append({"tokens": torch.randint(0, cfg.model.vocab_size, shape, generator=g), "labels": labels})
    return out


def _sanction_host_traffic(audit: DeviceAudit) -> None:
    """Group's host_* methods are the one sanctioned path for host tensors in collectives."""
    for name in ("host_all_reduce", "all_gather_object"):
        orig = getattr(Group, name)

        def wrapped(self, *a, _orig=orig, **k):
            with audit.allow_host():
                return _orig(self, *a, **k)

        setattr(Group, name, wrapped)


def _rank_step(precision: str, moe: bool, steps: int):
    from paratron.parallel.context import ParallelContext
    from paratron.training.runner import build_model_and_optimizer
    from paratron.training.trainer import train_step

    audit = DeviceAudit()
    _sanction_host_traffic(audit)
    cfg = _config(precision, moe)
    with audit:
        ctx = ParallelContext.build(tp=2, pp=2, ep=cfg.parallel.expert, device=audit_device())
        torch.manual_seed(0)
        chunks, ddp, opt, sched = build_model_and_optimizer(cfg, ctx)
        assert all(isinstance(p, AuditTensor) for c in chunks for p in c.parameters())
        per_step, losses = [], []
        for step in range(steps):
            audit.syncs, audit.sync_ops = 0, []
            out = train_step(cfg, ctx, chunks, opt, sched, _microbatches(cfg, ctx.dp.rank, step))
            per_step.append((audit.syncs, list(audit.sync_ops)))
            losses.append(out)
        # The log interval's one read of the on-device scalars.
        audit.syncs = 0
        logged = [o.read() for o in losses]
        log_syncs = audit.syncs
    return {"per_step": per_step, "logged": logged, "log_syncs": log_syncs,
            "host_collectives": [c for c in audit.collectives if c[1] == "host"]}


def test_one_step_tp2_pp2_dp2_zero1_moe_ep2_on_an_accelerator():
    outs = run_ranks(_rank_step, 8, "bf16", True, 1, timeout=300)
    for r, o in enumerate(outs):
        loss = o["logged"][0]["loss"]
        assert torch.isfinite(torch.tensor(loss)), (r, o["logged"])
    # Every rank reports the same global loss and grad norm.
    assert len({round(o["logged"][0]["loss"], 5) for o in outs}) == 1
    assert len({round(o["logged"][0]["grad_norm"], 5) for o in outs}) == 1


def _rank_dense_syncs(precision: str):
    return _rank_step(precision, False, 2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_host_syncs_per_step(precision):
    """bf16: no device->host sync in a dense training step; fp16: one (the skip decision). The
    logged scalars are read once per log interval, in one transfer."""
    outs = run_ranks(_rank_dense_syncs, 8, precision, timeout=300)
    allowed = 1 if precision == "fp16" else 0
    for r, o in enumerate(outs):
        for syncs, ops in o["per_step"]:
            assert syncs <= allowed, f"rank {r}: {syncs} syncs in one step: {ops}"
        assert o["log_syncs"] <= len(o["per_step"]), (r, o["log_syncs"])


def _rank_mixing(kind: str):
    audit = DeviceAudit()
    with audit:
        dev = audit_device()
        x = torch.ones(4, device=dev)
        if kind == "op":
            return x + torch.ones(4)  # a [4] host tensor in a device op
        if kind == "scalar":
            return (x + torch.tensor(2.0)).sum().item()  # a 0-dim host tensor is a scalar: fine
        import torch.distributed as dist

        dist.all_reduce(torch.ones(2))  # a host tensor in a device collective
        return None


def test_audit_catches_mixing_and_host_collectives():
    with pytest.raises(RankFailure, match="DeviceMixError"):
        run_ranks(_rank_mixing, 1, "op", timeout=60)
    with pytest.raises(RankFailure, match="DeviceMixError"):
        run_ranks(_rank_mixing, 2, "collective", timeout=60)
    assert run_ranks(_rank_mixing, 1, "scalar", timeout=60) == [12.0]


def test_group_rejects_tensor_off_its_device():
    from paratron.parallel.context import ParallelContext

    ctx = ParallelContext.single(device="meta")
    with pytest.raises(ValueError, match=r"all_reduce on group 'dp'.*cpu.*meta"):
        ctx.dp.all_reduce(torch.zeros(2))
    with pytest.raises(ValueError, match=r"host_all_reduce on group 'world'.*meta.*cpu"):
        ctx.world.host_all_reduce(torch.zeros(2, device="meta"))
    ctx.dp.all_reduce(torch.zeros(2, device="meta"))  # the right device passes
    assert DeviceMixError  # exported for callers that catch it
