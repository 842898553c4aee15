"""Hugging Face ``DeepseekV3ForCausalLM`` (multi-head latent attention; dense SwiGLU layers, and
DeepSeek-V3 MoE layers after ``first_k_dense_replace``): tiny random models built from
transformers' own ``DeepseekV3Config`` (interleaved RoPE; with and without query compression; an
MoE model with one dense layer first, 4 routed experts in 2 groups, a shared expert, the
score-correction bias and the routed scaling factor), imported into paratron at TP=1 and TP=2;
logits match transformers to 1e-5 (fp32). Exported back (dense: gathered from TP=2),
transformers reloads the folder as ``DeepseekV3ForCausalLM`` with the same logits, and import ->
export -> import is exact.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.hf import hf_to_paratron, paratron_to_hf  # noqa: E402
from paratron.checkpoint.hf_deepseek import deepseek_config  # noqa: E402
from paratron.config import ConfigError  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402
from paratron.models.gpt import build_model_chunks, full_logits, gather_full_state, load_full_state  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402

TOL = 1e-5
VOCAB, SEQ, BATCH = 61, 10, 2


MOE = dict(first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=12,
           num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def _make(path, q_lora_rank, moe: bool) -> torch.nn.Module:
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_interleave=True, **(MOE if moe else dict(first_k_dense_replace=2)))
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms start at 1, the expert bias at 0: randomise them so a mis-mapped one shows
        for name, p in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=[(16, False), (None, False), (16, True)], ids=["q_lora", "q_full", "moe"])
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek")
    return path, _make(path, *request.param)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _paratron_logits(hf_dir, ids, tp: int, export_dir=None) -> torch.Tensor:
    cfg, tensors = hf_to_paratron(hf_dir)
    ctx = ParallelContext.single() if tp == 1 else ParallelContext.build(tp=tp)
    chunks = build_model_chunks(cfg, ctx, seed=0)
    load_full_state(chunks, tensors)
    chunks[0].eval()
    with torch.no_grad():
        logits = full_logits(chunks[0](ids), ctx, cfg.vocab_size)
    if export_dir is not None:
        # Expert params are not gathered by gather_full_state: export the MoE model's imported tensors.
        state = gather_full_state(chunks, ctx) if not cfg.num_experts else tensors
        if ctx.rank == 0:
            paratron_to_hf(cfg, state, export_dir)
    return logits


def test_logits_match_tp1_and_roundtrip_exact(hf_model, tmp_path):
    path, model = hf_model
    ids = _ids()
    assert (_paratron_logits(path, ids, 1) - _hf_logits(model, ids)).abs().max().item() < TOL
    cfg, tensors = hf_to_paratron(path)
    assert cfg.multi_latent_attention and cfg.kv_lora_rank == 12 and cfg.v_head_dim == 6
    assert cfg.num_experts == (4 if model.config.first_k_dense_replace == 1 else 0)
    paratron_to_hf(cfg, tensors, tmp_path / "out")
    cfg2, tensors2 = hf_to_paratron(tmp_path / "out")
    assert cfg2 == cfg and tensors2.keys() == tensors.keys()
    for k in tensors:
        assert torch.equal(tensors[k], tensors2[k]), k


def _tp_rank(hf_dir, ids, export_dir):
    return _paratron_logits(hf_dir, ids, 2, export_dir)


def test_logits_match_tp2_and_export_reloads(hf_model, tmp_path):
    path, model = hf_model
    ids = _ids()
    ref = _hf_logits(model, ids)
    out = tmp_path / "export"
    for ours in run_ranks(_tp_rank, 2, str(path), ids, str(out), timeout=240):
        assert (ours - ref).abs().max().item() < TOL
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(reloaded, transformers.DeepseekV3ForCausalLM)
    assert (_hf_logits(reloaded, ids) - ref).abs().max().item() < TOL


def test_unsupported_named():
    base = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, intermediate_size=40, vocab_size=61,
                kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=16)
    with pytest.raises(ConfigError, match="rms_norm_eps=1e-05"):
        deepseek_config(dict(base, first_k_dense_replace=4, rms_norm_eps=1e-5), "c.json")
    with pytest.raises(ConfigError, match="'yarn'"):
        deepseek_config(dict(base, first_k_dense_replace=4, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                        "c.json")


def _train_converted(path, pp: int, ep: int) -> list[tuple[float, float]]:
    """A converted MoE DeepSeek-V3 model with one MTP module added (drawn fresh, layout-free),
    2 AdamW steps on a fixed batch: (LM loss, MTP loss) per step."""
    from paratron.config import Config
    from paratron.rules import validate
    from paratron.checkpoint.items import iter_params
    from paratron.parallel.params import load_full_, unique_params
    from paratron.training.data_iter import microbatch_preparer
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    cfg = Config()
    cfg.model, tensors = hf_to_paratron(path)
    cfg.model.seq_length, cfg.model.mtp_num_layers, cfg.model.make_vocab_size_divisible_by = SEQ, 1, 8
    cfg.parallel.pipeline, cfg.parallel.expert, cfg.parallel.bucket_size_mb = pp, ep, 0.001
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 4
    cfg.optimizer.lr, cfg.optimizer.clip_grad, cfg.optimizer.adam_eps = 1e-2, 0.0, 1e-5
    cfg = validate(cfg, pp * ep)
    ctx = ParallelContext.build(pp=pp, ep=ep) if pp * ep > 1 else ParallelContext.single()
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    for p in unique_params(chunks):
        if p.meta.logical_name in tensors:  # the MTP module keeps its own draw
            load_full_(p, tensors[p.meta.logical_name])
    optimizer.copy_params_into_main(iter_params(chunks))
    prepare, rows = microbatch_preparer(cfg, ctx, eod=0), 4 // ctx.dp.size
    ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))
    mine = ids[ctx.dp.rank * rows:(ctx.dp.rank + 1) * rows]
    out = []
    for _step in range(2):
        mbs = [prepare({"tokens": mine[i:i + 1, :-1], "labels": mine[i:i + 1, 1:]}) for i in range(rows)]
        optimizer.zero_grad()
        res = run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, ddp=ddp)
        optimizer.step()
        out.append((res.loss, res.mtp_loss))
    return out


@pytest.mark.slow
def test_converted_moe_model_with_mtp_trains_at_ep2_pp2(tmp_path):
    """The converted MoE model plus one MTP module, 2 AdamW steps at EP=2 x PP=2 (4 ranks): the LM
    and MTP losses match one process to 1e-5."""
    _make(tmp_path, 16, True)
    want = _train_converted(str(tmp_path), 1, 1)
    assert want[1][0] < want[0][0]
    for got in run_ranks(_train_converted, 4, str(tmp_path), 2, 2, timeout=600):
        for (loss, mtp), (wl, wm) in zip(got, want):
            assert loss == pytest.approx(wl, rel=1e-5) and mtp == pytest.approx(wm, rel=1e-5)
