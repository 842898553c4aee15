"""The GPU path proven on the CPU: one whole training step with the model on an accelerator
(the ``auditgpu`` stand-in of :mod:`paratron.device_audit`, since a CPU build of PyTorch cannot
hold CUDA tensors), TP=2 x PP=2 x DP=2, ZeRO-1, sequence parallel, a MoE layer at EP=2, 8 gloo
ranks. Any op that mixes host and accelerator tensors, and any collective on a tensor off
``ctx.device``, fails the step; device-to-host syncs are counted per step.
"""

import math

import pytest
import torch

from paratron.device_audit import AuditTensor, DeviceAudit, DeviceMixError, audit_device
from paratron.parallel.comm import Group
from paratron.local_ranks import RankFailure, run_ranks

AUDIT_BACKEND = "cpu:gloo,auditgpu:gloo"  # gloo serves the stand-in device's (unwrapped) tensors
FRESH = "forkserver"  # ranks forked from a fresh interpreter: autograd's device threads must start there


def _config(precision: str, moe: bool, tp: int = 2, pp: int = 2):
    from paratron.rules import load_config
    from tests.conftest import ROOT

    over = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
            "model.vocab_size=96", "model.tie_embeddings=true", "model.hidden_dropout=0.1",
            "train.micro_batch_size=1", "train.global_batch_size=4", f"train.precision={precision}",
            f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.sequence_parallel={str(tp > 1).lower()}",
            "parallel.zero=1", "parallel.schedule=1f1b", "optimizer.clip_grad=1.0"]
    if moe:
        over += ["model.num_experts=4", "model.moe_top_k=2", "model.moe_layer_freq=2",
                 "model.moe_ffn_hidden_size=32", "model.moe_aux_loss_coeff=0.01",
                 "model.moe_token_dispatcher=alltoall", "parallel.expert=2"]
    return load_config(ROOT / "configs/llama-tiny.toml", over)


def _microbatches(cfg, ctx, step: int) -> list[dict]:
    """This DP rank's microbatches on the host, as the data loader hands them over."""
    g = torch.Generator().manual_seed(1000 * step + ctx.dp.rank)
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * ctx.dp.size)
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


def _rank_step(precision: str, moe: bool, steps: int, tp: int = 2, pp: int = 2):
    from types import SimpleNamespace

    from paratron.parallel.context import ParallelContext
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step_log import StepLog
    from paratron.training.timers import PhaseTimer
    from paratron.training.trainer import agree_to_stop, train_batch

    audit = DeviceAudit()
    _sanction_host_traffic(audit)
    cfg = _config(precision, moe, tp, pp)
    with audit:
        ctx = ParallelContext.build(tp=tp, pp=pp, ep=cfg.parallel.expert, device=audit_device())
        torch.manual_seed(0)
        chunks, ddp, opt, sched = build_model_and_optimizer(cfg, ctx)
        assert all(isinstance(p, AuditTensor) for c in chunks for p in c.parameters())
        timer = PhaseTimer(ctx.device)
        log = StepLog(cfg, ctx, float("nan"), "test", timer=timer)
        state = SimpleNamespace(iteration=0, consumed_train_samples=0)
        per_step, log_syncs, records = [], [], []
        for step in range(steps):
            audit.syncs, audit.sync_ops = 0, []
            out, result, lr = train_batch(cfg, ctx, chunks, ddp, opt, sched, _microbatches(cfg, ctx, step),
                                          timer=timer)
            agree_to_stop(ctx, False)
            per_step.append((audit.syncs, list(audit.sync_ops)))
            audit.syncs, audit.sync_ops = 0, []
            state.iteration += 1
            records.append(log.record(state, out, result, lr, 1.0))  # the record and console line
            log.console(records[-1])
            log_syncs += audit.sync_ops
    return {"per_step": per_step, "logged": records, "log_syncs": log_syncs,
            "host_collectives": [c for c in audit.collectives if c[1] == "host"]}


MOE_DISPATCH = "models/moe/dispatcher.py"  # its all-to-all splits must be host integers


def test_tp2_pp2_dp2_zero1_moe_ep2_steps_on_an_accelerator():
    """Two whole steps at TP=2 x PP=2 x DP=2, ZeRO-1, SP, a MoE layer at EP=2, bf16, with every
    op and collective audited; the only host syncs of a step are the MoE dispatcher's (its
    all-to-all splits) and the optimizer's one read (its skip decision, which brings the grad
    norm and the step's loss stats along); writing the record reads nothing more."""
    outs = run_ranks(_rank_step, 8, "bf16", True, 2, timeout=300, pg_backend=AUDIT_BACKEND,
                     start_method=FRESH)
    for r, o in enumerate(outs):
        assert [rec["iteration"] for rec in o["logged"]] == [1, 2]
        assert all(math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]) for rec in o["logged"])
        for syncs, ops in o["per_step"]:
            rest = [op for op in ops if MOE_DISPATCH not in op]
            assert len(rest) == 1 and "optim/optimizer.py" in rest[0], f"rank {r}: {rest}"
        assert o["log_syncs"] == [], (r, o["log_syncs"])  # the record reads nothing more
        # The stop flag is the one host collective of a step (gloo: the device never waits).
        assert o["host_collectives"] == [("c10d.allreduce_.default", "host")] * 2, o["host_collectives"]
    # Every rank reports the same global loss, aux loss and grad norm.
    for key in ("loss", "aux_loss", "grad_norm"):
        assert len({tuple(round(rec[key], 6) for rec in o["logged"]) for o in outs}) == 1, key
    # The ranks holding the MoE layer (first stage: layer 0) also sync for its token splits.
    moe_ranks = [o for o in outs if any(MOE_DISPATCH in op for _, ops in o["per_step"] for op in ops)]
    assert len(moe_ranks) == 4


def _rank_fp16_syncs():
    return _rank_step("fp16", False, 2, tp=1, pp=2)


def test_fp16_step_syncs_once():
    """fp16 (dense, PP=2 x DP=2): one device->host sync per step, the optimizer's skip decision
    (which brings the grad norm), as in bf16 (the test above)."""
    outs = run_ranks(_rank_fp16_syncs, 4, timeout=300, pg_backend=AUDIT_BACKEND, start_method=FRESH)
    for r, o in enumerate(outs):
        for syncs, ops in o["per_step"]:
            assert syncs == 1 and "optim/optimizer.py" in ops[0], f"rank {r}: {ops}"
        assert o["log_syncs"] == [], (r, o["log_syncs"])


def _rank_mixing():
    import torch.distributed as dist

    def outcome(fn):
        try:
            return fn()
        except DeviceMixError as e:
            return f"DeviceMixError: {e}"

    audit = DeviceAudit()
    with audit:
        x = torch.ones(4, device=audit_device())
        return [outcome(lambda: x + torch.ones(4)),  # a [4] host tensor in a device op
                outcome(lambda: (x + torch.tensor(2.0)).sum().item()),  # 0-dim host: a scalar, fine
                outcome(lambda: dist.all_reduce(torch.ones(2))),  # a host tensor in a collective
                outcome(lambda: dist.all_reduce(x)), audit.syncs]


def test_audit_catches_mixing_and_host_collectives():
    mixed, scalar, host_coll, device_coll, syncs = run_ranks(_rank_mixing, 1, timeout=60,
                                                             pg_backend=AUDIT_BACKEND, start_method=FRESH)[0]
    assert mixed.startswith("DeviceMixError") and "shapes [(4,)]" in mixed
    assert scalar == 12.0 and syncs == 1  # the .item()
    assert host_coll.startswith("DeviceMixError") and "host tensor" in host_coll
    assert device_coll is None


def test_group_rejects_tensor_off_its_device():
    from paratron.parallel.context import ParallelContext

    ctx = ParallelContext.single(device="meta")
    with pytest.raises(ValueError, match=r"all_reduce on group 'dp'.*cpu.*meta"):
        ctx.dp.all_reduce(torch.zeros(2))
    with pytest.raises(ValueError, match=r"host_all_reduce on group 'world'.*meta.*cpu"):
        ctx.world.host_all_reduce(torch.zeros(2, device="meta"))
    ctx.dp.all_reduce(torch.zeros(2, device="meta"))  # the right device passes
    assert DeviceMixError  # exported for callers that catch it
