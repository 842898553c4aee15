"""Fast single-device kernels against their plain paths, on the CPU (the same tests run on a GPU
where one is present: ``devices()`` adds ``cuda``, marked ``cuda``).

* fused AdamW (``torch._fused_adamw_`` on the flat fp32 buffers) vs the foreach rules and
  ``torch.optim.AdamW``;
* attention through SDPA with ``is_causal`` (flash-capable: no mask tensor) vs softmax attention
  with an explicit causal mask;
* per-phase timers: CUDA events on a GPU, ``perf_counter`` on the CPU;
* MFU's peak table and its override.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import accumulate_grad

from test_optim_dp import Toy, opt_cfg, torch_adamw


def devices() -> list:
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return out


def _train_toy(device: str, impl: str, dtype: torch.dtype, steps: int = 3):
    ctx = ParallelContext.single(device)
    model = Toy(dtype=dtype).to(device)
    ddp = DistributedDataParallel([model], ctx)
    opt = build_optimizer([model], ctx, opt_cfg(adam_impl=impl, clip_grad=0.5), ddp,
                          precision="bf16" if dtype == torch.bfloat16 else "fp32")
    assert (opt._fused is not None) == (impl == "fused")
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        for _, p in model.named_parameters():
            accumulate_grad(p, (torch.randn(p.shape, generator=g) * 0.1).to(device))
        finalize_grads([model], ctx, ddp)
        assert not opt.step().skipped
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}, opt


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_matches_foreach(device, dtype):
    """Same grads, 3 steps with clipping and decay/no-decay params: fused and foreach main
    weights agree to 1e-6 (fp32 arithmetic in a different order), bf16 params to one bf16 ulp."""
    fused, opt_f = _train_toy(device, "fused", dtype)
    plain, opt_p = _train_toy(device, "foreach", dtype)
    for n in plain:
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(fused[n], plain[n], rtol=tol, atol=tol, msg=n)
    for a, b in zip((s.main for s in opt_f.segments), (s.main for s in opt_p.segments)):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-6, atol=1e-6)


def test_fused_adamw_matches_torch_adamw():
    """The fused path against ``torch.optim.AdamW`` with a no-decay group, fp32, 3 steps."""
    ours, _ = _train_toy("cpu", "fused", torch.float32)
    ref = Toy()
    cfg = opt_cfg()
    tref = torch_adamw(ref, ref, cfg)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for _, q in ref.named_parameters():
            q.grad = torch.randn(q.shape, generator=g) * 0.1
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        tref.step()
    for n, q in ref.named_parameters():
        torch.testing.assert_close(ours[n], q.detach(), rtol=1e-5, atol=1e-6, msg=n)


def _masked_attention(q, k, v):
    """Plain softmax attention with a materialised causal mask; q/k/v ``[s, b, n, d]``, GQA
    by repeating K/V heads."""
    s, b, n, d = q.shape
    rep = n // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q.float(), k.float()) / d**0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bnst,tbnd->sbnd", probs, v.float()).reshape(s, b, n * d).to(q.dtype)


@pytest.mark.parametrize("device", devices())
def test_sdpa_is_causal_without_mask_matches_masked_softmax(device, monkeypatch):
    from paratron.models import attention

    calls = []
    real = F.scaled_dot_product_attention

    def spy(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 2, 4, 8, generator=g).to(device)
    k, v = (torch.randn(16, 2, 2, 8, generator=g).to(device) for _ in range(2))
    out = attention.attention_core(q, k, v, 0.0)
    assert calls and calls[0].get("is_causal") is True and calls[0].get("attn_mask") is None
    torch.testing.assert_close(out, _masked_attention(q, k, v), rtol=1e-5, atol=1e-5)


def _sdpa_reference(q, k, v):
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=k.shape[2] != q.shape[2])
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("s, n_q, n_kv, d, d_v", [
    (16, 4, 2, 8, 8),      # one block
    (128, 8, 4, 32, 32),   # the main job's shapes: 4 blocks of 32
    (37, 6, 2, 8, 12),     # a short last block; d_v != d (MLA)
    (300, 2, 1, 16, 16),   # blocks of 37, the last of 4 rows
])
def test_blocked_causal_attention_matches_sdpa(s, n_q, n_kv, d, d_v):
    """The composite form ``model.compile`` takes on the CPU against SDPA's causal kernel, output
    and the three input grads, in fp64 (1e-12)."""
    from paratron.models.attention import blocked_causal_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, 2, n_q, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, 2, n_kv, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, 2, n_kv, d_v, generator=g, dtype=torch.float64, requires_grad=True)
    out, ref = blocked_causal_attention(q, k, v), _sdpa_reference(q, k, v)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_attention_core_takes_the_blocked_form_only_while_compiling(monkeypatch):
    """Eagerly (and with dropout, past ``COMPOSITE_MAX_SEQ`` or without grad) SDPA runs; while
    compiling a training step on the CPU the blocked form does."""
    from paratron.models import attention

    taken = []
    monkeypatch.setattr(attention, "blocked_causal_attention", lambda q, k, v: taken.append(q.shape[0]) or q)
    q = torch.randn(16, 1, 2, 8)
    attention.attention_core(q, q, q, 0.0)
    assert taken == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    attention.attention_core(q, q, q, 0.0)
    long = torch.randn(attention.COMPOSITE_MAX_SEQ + 1, 1, 2, 8)
    attention.attention_core(long, long, long, 0.0)
    attention.attention_core(q, q, q, 0.1)
    assert taken == [16]
    with torch.no_grad():  # generation: lengths change every token
        attention.attention_core(q, q, q, 0.0)
    assert taken == [16]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_kernel_takes_paratron_attention():
    """With only the flash backend allowed, bf16 attention_core runs (no mask, causal, GQA) and
    matches the masked math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from paratron.models.attention import attention_core

    g = torch.Generator().manual_seed(0)
    q = torch.randn(256, 2, 8, 64, generator=g).cuda().bfloat16()
    k, v = (torch.randn(256, 2, 4, 64, generator=g).cuda().bfloat16() for _ in range(2))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = attention_core(q, k, v, 0.0)
    torch.testing.assert_close(out.float(), _masked_attention(q, k, v).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", devices())
def test_phase_timer_measures_each_phase(device):
    import time

    from paratron.training.timers import PhaseTimer

    timer = PhaseTimer(torch.device(device))
    assert timer.uses_events == (device == "cuda")
    for _ in range(2):
        with timer.phase("forward_backward"):
            time.sleep(0.02)
            x = torch.ones(64, 64, device=device)
            x = x @ x
        with timer.phase("optimizer"):
            pass
        timer.end_step()
        assert set(timer.last_host) == {"forward_backward", "optimizer"}  # host times, no wait
        assert timer.last_host["forward_backward"] >= 0.015
    got = timer.read()  # device seconds per phase of each step: read once per log interval
    assert len(got) == 2 and all(set(g) == {"forward_backward", "optimizer"} for g in got)
    assert all(g["forward_backward"] >= 0.0 and g["optimizer"] >= 0.0 for g in got)
    if device == "cpu":
        assert all(g["forward_backward"] >= 0.015 for g in got)
    assert timer.read() == []  # read drains


def test_mfu_peak_table_and_override(monkeypatch):
    from paratron.training import metrics

    for name, want in (("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                       ("NVIDIA A100-SXM4-80GB", 312e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        peak, src = metrics.peak_flops_per_device(None, torch.device("cuda", 0))
        assert peak == want and name in src
    peak, src = metrics.peak_flops_per_device(5e14, torch.device("cuda", 0))
    assert peak == 5e14 and src == "train.peak_flops_per_device"


def _train_layers(compile: bool, steps: int = 2, tp: int = 1):
    from paratron.rules import load_config
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs/llama-tiny.toml", [
        "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
        "model.vocab_size=96", "train.micro_batch_size=2", "train.global_batch_size=4",
        "model.hidden_dropout=0.0", "model.attention_dropout=0.0", f"model.compile={str(compile).lower()}",
        f"parallel.tensor={tp}", f"parallel.sequence_parallel={str(tp > 1).lower()}"])
    ctx = ParallelContext.single() if tp == 1 else ParallelContext.build(tp=tp)
    chunks, ddp, opt, _ = build_model_and_optimizer(cfg, ctx)
    g = torch.Generator().manual_seed(0)
    mbs = [{"tokens": torch.randint(0, 96, (2, 16), generator=g),
            "labels": torch.randint(0, 96, (2, 16), generator=g)} for _ in range(2)]
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, ddp=ddp).loss
        out.append((loss, opt.step().grad_norm))
    return out, chunks


def _check_compiled_parity():
    plain, _ = _train_layers(False)
    compiled, chunks = _train_layers(True)
    assert all(type(layer).__name__ != "OptimizedModule" and layer._compiled_call_impl is not None
               for c in chunks for layer in c.layers.values())
    for (la, na), (lb, nb) in zip(plain, compiled):
        assert abs(la - lb) < 1e-5 and abs(na - nb) < 1e-5, (plain, compiled)


def test_compile_per_layer_traces_and_keeps_parity(monkeypatch):
    """``model.compile``: every layer compiled in place (parameter names unchanged); dynamo and
    AOTAutograd (backend ``aot_eager``: the same graphs, no C++ code generation) give the eager
    losses and grad norms (1e-5)."""
    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",  # aot_eager takes no inductor options
                        lambda self, **k: real(self, backend="aot_eager", **{n: v for n, v in k.items() if n != "options"}))
    torch._dynamo.reset()
    _check_compiled_parity()


@pytest.mark.slow
def test_compile_per_layer_inductor_keeps_parity():
    """The same with the default inductor backend (~3 min on a loaded 2-core CPU: slow)."""
    torch._dynamo.reset()
    _check_compiled_parity()


def _losses_at_tp2(compile: bool):
    torch._dynamo.reset()
    return [(loss, norm) for loss, norm in _train_layers(compile, tp=2)[0]]


@pytest.mark.slow
def test_compile_inductor_at_tp2_with_sp_keeps_parity():
    """Two ranks, TP=2 with sequence parallelism (gloo all-to-alls traced into the layers):
    inductor compiles them (with its Python wrapper; its C++ one cannot call those collectives)
    and the losses and grad norms match the eager run's (1e-5). ~2 min: slow."""
    from paratron.local_ranks import run_ranks

    eager = run_ranks(_losses_at_tp2, 2, False, timeout=300)[0]
    compiled = run_ranks(_losses_at_tp2, 2, True, timeout=900)[0]
    for (la, na), (lb, nb) in zip(eager, compiled):
        assert abs(la - lb) < 1e-5 and abs(na - nb) < 1e-5, (eager, compiled)


def test_inductor_options_use_the_cpp_wrapper_in_one_cpu_process_only():
    """``model.compile`` in a one-process CPU run uses inductor's C++ wrapper; with more ranks
    (collectives traced into the layers, which that wrapper cannot call) and on other devices,
    torch's defaults."""
    from types import SimpleNamespace

    from paratron.models.gpt import inductor_options

    assert inductor_options(ParallelContext.single()) == {"cpp_wrapper": True}
    assert inductor_options(SimpleNamespace(device=torch.device("cpu"), world_size=2)) is None
    assert inductor_options(SimpleNamespace(device=torch.device("cuda", 0), world_size=1)) is None


@pytest.mark.parametrize("zero", [0, 3])
def test_embedding_grad_under_ddp_adds_looked_up_rows_into_the_main_grad(zero, monkeypatch):
    """Under DDP the word embedding's lookup grad is sparse (its rows only) and DDP adds those
    rows into the main grad, repeated ids summed, over two microbatches; the result equals the
    dense grad. Without DDP the lookup's grad is a dense ``.grad``."""
    from paratron.layers import VocabParallelEmbedding

    ctx = ParallelContext.single()
    sparse_flags = []
    real = F.embedding
    monkeypatch.setattr(F, "embedding", lambda *a, **k: sparse_flags.append(k.get("sparse")) or real(*a, **k))
    plain = VocabParallelEmbedding(50, 8, ctx, logical_name="embedding.word", seed=0)
    plain(torch.tensor([[1, 2]])).sum().backward()
    assert sparse_flags == [False] and not plain.weight.grad.is_sparse
    emb = VocabParallelEmbedding(50, 8, ctx, logical_name="embedding.word", seed=0)
    ddp = DistributedDataParallel([emb], ctx, zero=zero)
    ddp.zero_grad_buffer()
    g = torch.Generator().manual_seed(0)
    want = torch.zeros(emb.padded_vocab_size, 8)  # ZeRO-3 leaves the param itself empty between uses
    for ids in (torch.tensor([[1, 3, 3, 7], [7, 0, 3, 1]]), torch.tensor([[49, 3, 0, 0], [2, 2, 2, 5]])):
        grad_out = torch.randn(4, 2, 8, generator=g)  # [s, b, h]
        emb(ids).backward(grad_out)
        want.index_add_(0, ids.t().reshape(-1), grad_out.reshape(-1, 8))
    assert sparse_flags[1:] == [True, True] and emb.weight.grad is None
    ddp.finish_grad_sync()
    got = emb.weight.meta.main_grad if zero == 0 else ddp.shard_grads[0][0]
    torch.testing.assert_close(got.reshape(-1)[:want.numel()].view_as(want), want, rtol=0, atol=1e-6)
