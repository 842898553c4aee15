"""LoRA (paratron.models.lora): TP-aware adapters, frozen base, adapter-only checkpoints, merge and
PEFT export.

* 3 AdamW steps of a LoRA run at TP2 and at TP2 x DP2 with SP and ZeRO-1 match one process to 1e-5
  (adapters' params and the losses), and the base weights stay bitwise what they were built as;
* only adapters have grads and optimizer state;
* after ``paratron convert lora-merge`` the logits equal the adapted model's within 1e-5;
* ``peft`` loads the ``--save-peft`` adapter onto the exported HF base (a tiny transformers
  LlamaForCausalLM with GQA) and its logits match paratron's within 1e-5;
* adapter-only checkpoints save and load onto a base from ``checkpoint.pretrained_checkpoint``;
* (slow) ``paratron train``: base run, LoRA fine-tune at TP2, resume.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from paratron.config import Config, ConfigError, ModelConfig
from paratron.rules import validate
from paratron.models.gpt import build_model_chunks, full_logits, gather_full_state, load_full_state
from paratron.models.lora import is_adapter_name, merge_lora_tensors
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

from helpers import assert_parity, perturb_1d_params_, train_for_parity

TOL = 1e-5
VOCAB, SEQ = 40, 8


def _model(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
                vocab_size=VOCAB, seq_length=SEQ, make_vocab_size_divisible_by=8, normalization="rmsnorm",
                norm_epsilon=1e-6, position_embedding_type="rope", activation="swiglu", add_bias_linear=False,
                tie_embeddings=False, lora_rank=4, lora_alpha=8.0)
    return ModelConfig(**{**base, **kw})


def _config(tp=1, dp=1, pp=1, sp=False, zero=0) -> Config:
    cfg = Config()
    cfg.model = _model()
    p, t, o = cfg.parallel, cfg.train, cfg.optimizer
    p.tensor, p.pipeline, p.sequence_parallel, p.zero, p.bucket_size_mb = tp, pp, sp, zero, 0.001
    t.micro_batch_size, t.global_batch_size, t.seed = 1, 4, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 1.0, "constant"
    return validate(cfg, tp * dp * pp)


def _initial_base(cfg: Config, ctx) -> dict[str, torch.Tensor]:
    """The frozen params as built (and perturbed) by train_for_parity, before any step."""
    from paratron.training.builders import build_model_and_optimizer

    torch.manual_seed(0)
    chunks, ddp, _, _ = build_model_and_optimizer(cfg, ctx)
    with ddp.full_params():
        perturb_1d_params_(chunks)
    return {p.meta.logical_name: p.meta.shard.valid(p).detach().clone() for c in chunks for p in c.parameters()
            if not p.requires_grad}


def _assert_base_unchanged(cfg, ctx, trained: dict) -> None:
    initial = _initial_base(cfg, ctx)
    assert initial and all(not is_adapter_name(n) for n in initial)
    for name, t in initial.items():
        assert torch.equal(trained[name][0], t), f"base param {name} changed"


def _rank(kw, world):
    cfg = _config(dp=world // (kw.get("tp", 1) * kw.get("pp", 1)), **kw)
    ctx = ParallelContext.build(tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline)
    out = train_for_parity(cfg, ctx, steps=3)
    _assert_base_unchanged(cfg, ctx, out["params"])
    return out


LAYOUTS = {"tp2": (2, dict(tp=2)), "tp2-sp-dp2-zero1": (4, dict(tp=2, sp=True, zero=1)),
           "pp2-dp2-zero3": (4, dict(pp=2, zero=3))}
SLOW = {"pp2-dp2-zero3"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_lora_matches_one_process(name):
    """Adapters (replicated A / sharded B on qkv and fc1, sharded A / replicated B on proj and
    fc2) after 3 steps, and the losses, match one process to 1e-5; the base is bitwise unchanged
    on every rank. Without the TP sum of the low-rank activation's grad the TP layouts drift."""
    world, kw = LAYOUTS[name]
    results = run_ranks(_rank, world, kw, world, timeout=300)
    cfg = _config()
    ref = train_for_parity(cfg, ParallelContext.single(), steps=3)
    _assert_base_unchanged(cfg, ParallelContext.single(), ref["params"])
    adapters = [n for n in ref["params"] if is_adapter_name(n)]
    assert len(adapters) == 2 * 4 * 2  # A and B of qkv, proj, fc1, fc2 in 2 layers
    assert all(ref["params"][n][0].abs().sum() > 0 for n in adapters), "every adapter factor trained"
    assert_parity(results, ref, TOL, name)


def test_only_adapters_have_grads_and_optimizer_state():
    from paratron.training.builders import build_model_and_optimizer

    cfg = _config()
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ParallelContext.single())
    params = [p for c in chunks for p in c.parameters()]
    trainable = {p.meta.logical_name for p in params if p.requires_grad}
    assert trainable == {p.meta.logical_name for p in params if is_adapter_name(p.meta.logical_name)}
    assert {p.meta.logical_name for p in ddp.params} == trainable
    kinds = {k.split("/", 2)[1] for k in optimizer.sharded_state_dict()}
    assert kinds == {"main_param", "exp_avg", "exp_avg_sq"}
    assert {k.split("/", 2)[2] for k in optimizer.sharded_state_dict()} == trainable
    attn = chunks[0].layers["0"].attention
    assert attn.qkv.lora.lora_A.shape == (4, 16) and attn.qkv.lora.lora_B.shape == ((4 + 2 * 2) * 4, 4)
    assert attn.proj.lora.lora_A.shape == (4, 16) and attn.proj.lora.lora_B.shape == (16, 4)
    assert torch.count_nonzero(attn.qkv.lora.lora_B) == 0  # B starts at zero: the base model


@pytest.mark.parametrize("field,value,message", [
    ("lora_targets", ["q_proj"], "Hugging Face module name.*'qkv'"),
    ("lora_targets", ["attn"], "unknown target 'attn'"),
    ("lora_rank", -1, "lora_rank=-1"),
    ("lora_dropout", 1.0, "lora_dropout=1.0"),
])
def test_bad_lora_config_is_refused(field, value, message):
    cfg = _config()
    setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)


def test_save_peft_without_lora_is_refused():
    cfg = _config()
    cfg.model.lora_rank, cfg.checkpoint.save_peft = 0, "peft_out"
    with pytest.raises(ConfigError, match=r"checkpoint.save_peft=peft_out \(--save-peft\) needs a LoRA run"):
        validate(cfg, 1)


def _adapted_state(cfg: ModelConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    """Full tensors of a LoRA model whose adapters (B included) are random, so the update is not
    zero and every row of the fused B shows."""
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
    state = gather_full_state([chunk], ParallelContext.single())
    g = torch.Generator().manual_seed(seed)
    for name in sorted(state):
        if is_adapter_name(name):
            state[name] = 0.3 * torch.randn(state[name].shape, generator=g)
    return state


def _logits(cfg: ModelConfig, state, ids) -> torch.Tensor:
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
    load_full_state([chunk], state)
    chunk.eval()
    with torch.no_grad():
        return full_logits(chunk(ids), ParallelContext.single(), cfg.vocab_size)


def _ids(vocab=VOCAB, seq=SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


def _convert(direction, src, dst, **kw):
    from paratron import convert

    p = argparse.ArgumentParser()
    convert.add_arguments(p)
    args = p.parse_args([direction, str(src), str(dst), "--quiet"])
    for k, v in kw.items():
        setattr(args, k, v)
    assert convert.run(args) == 0


def test_lora_merge_gives_the_adapted_logits(tmp_path):
    from paratron.checkpoint.io import load_model_full, save_model_full

    cfg = Config()
    cfg.model = _model()
    state = _adapted_state(cfg.model)
    ids = _ids()
    adapted = _logits(cfg.model, state, ids)
    base = _logits(cfg.model, {k: (torch.zeros_like(v) if k.endswith("lora_B.weight") else v)
                               for k, v in state.items()}, ids)
    assert (adapted - base).abs().max() > 1e-2, "the adapters change the logits"
    save_model_full(tmp_path / "lora", cfg, state)
    _convert("lora-merge", tmp_path / "lora", tmp_path / "merged")
    merged_cfg, merged = load_model_full(tmp_path / "merged")
    assert merged_cfg.model.lora_rank == 0 and not any(is_adapter_name(n) for n in merged)
    torch.testing.assert_close(_logits(merged_cfg.model, merged, ids), adapted, rtol=TOL, atol=TOL)
    # The same fold on tensors in memory.
    torch.testing.assert_close(merge_lora_tensors(cfg.model, state)["layers.1.mlp.fc1.weight"],
                               merged["layers.1.mlp.fc1.weight"], rtol=0, atol=0)


def test_peft_loads_the_exported_adapter(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from paratron.checkpoint.hf import hf_to_paratron
    from paratron.checkpoint.io import save_model_full

    hf_cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    model_cfg, base = hf_to_paratron(tmp_path / "hf")
    cfg = Config()
    cfg.model = dataclasses.replace(model_cfg, lora_rank=4, lora_alpha=8.0)
    state = {**_adapted_state(cfg.model), **base}
    ids = _ids(97, 12)
    ours = _logits(cfg.model, state, ids)
    save_model_full(tmp_path / "lora", cfg, state)
    _convert("paratron-to-hf", tmp_path / "lora", tmp_path / "export", save_peft=str(tmp_path / "peft"))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        assert (hf(ids).logits - ours).abs().max() > 1e-2, "the export is the base, without the adapters"
        tuned = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
        torch.testing.assert_close(tuned(ids).logits.float(), ours, rtol=TOL, atol=TOL)
    # Exported without --save-peft, the adapters are merged into the HF weights.
    _convert("paratron-to-hf", tmp_path / "lora", tmp_path / "merged-hf")
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged-hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits.float(), ours, rtol=TOL, atol=TOL)


def _lora_run(tmp_path, **ckpt):
    from paratron.checkpoint.manager import CheckpointManager
    from paratron.training.builders import build_model_and_optimizer

    cfg = _config()
    for k, v in ckpt.items():
        setattr(cfg.checkpoint, k, str(v))
    ctx = ParallelContext.single()
    chunks, _, optimizer, scheduler = build_model_and_optimizer(cfg, ctx)
    manager = CheckpointManager(cfg.checkpoint, ctx, cfg)
    return chunks, optimizer, scheduler, manager, manager.load(chunks, optimizer, scheduler)


def test_adapter_only_checkpoints(tmp_path):
    """A LoRA run's checkpoint holds the adapters and their optimizer state only; it loads onto
    the base from checkpoint.pretrained_checkpoint, and is refused without one."""
    from paratron.checkpoint.io import load_tensors_full, read_json, resolve, save_model_full
    from paratron.checkpoint.items import CheckpointError
    from paratron.checkpoint.items import iter_params

    base_cfg = Config()
    base_cfg.model = _model(lora_rank=0)
    (chunk,) = build_model_chunks(base_cfg.model, ParallelContext.single(), seed=7)  # not the run's seed
    base = gather_full_state([chunk], ParallelContext.single())
    save_model_full(tmp_path / "base", base_cfg, base)

    chunks, optimizer, scheduler, manager, extra = _lora_run(tmp_path, pretrained_checkpoint=tmp_path / "base",
                                                             save=tmp_path / "ckpt")
    assert extra is None
    params = {p.meta.logical_name: p for c in chunks for p in c.parameters()}
    for name, t in base.items():
        assert torch.equal(params[name].meta.shard.valid(params[name]), t), f"{name} not loaded from the base"
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in params.items():
            if is_adapter_name(name):
                p.copy_(torch.randn(p.shape, generator=g))
    optimizer.copy_params_into_main(iter_params(chunks))
    manager.save(3, chunks, optimizer, scheduler, {"iteration": 3})
    saved = load_tensors_full(tmp_path / "ckpt", "model/")
    assert set(saved) == {n for n in params if is_adapter_name(n)}
    assert set(load_tensors_full(tmp_path / "ckpt", "optimizer/exp_avg/")) == set(saved)
    assert read_json(resolve(tmp_path / "ckpt") / "paratron.json")["adapter_only"] is True

    chunks2, optimizer2, _, _, extra = _lora_run(tmp_path, pretrained_checkpoint=tmp_path / "base",
                                                 load=tmp_path / "ckpt")
    assert extra == {"iteration": 3}
    for name, p in ((p.meta.logical_name, p) for c in chunks2 for p in c.parameters()):
        assert torch.equal(p.meta.shard.valid(p), p.meta.shard.valid(params[name]).detach()), name
    for key, pieces in optimizer2.sharded_state_dict().items():
        for (got, _), (want, _) in zip(pieces, optimizer.sharded_state_dict()[key]):
            assert torch.equal(got, want), key
    with pytest.raises(CheckpointError, match="only LoRA adapters"):
        _lora_run(tmp_path, load=tmp_path / "ckpt")
    # One process (paratron generate, the end-of-run sample) finds the base in the saved config.
    from paratron.training.generate import load_single_process_model

    _, one = load_single_process_model(str(tmp_path / "ckpt"))
    for p in one.parameters():
        assert torch.equal(p.meta.shard.valid(p), p.meta.shard.valid(params[p.meta.logical_name]).detach()), p.meta.logical_name
    _convert("lora-merge", tmp_path / "ckpt", tmp_path / "merged")  # no --base needed either
    # A full checkpoint as checkpoint.load is the base of a new fine-tune: step 0, fresh adapters.
    chunks3, _, _, _, extra = _lora_run(tmp_path, load=tmp_path / "base")
    assert extra is None
    for p in (p for c in chunks3 for p in c.parameters()):
        if not is_adapter_name(p.meta.logical_name):
            assert torch.equal(p.meta.shard.valid(p), base[p.meta.logical_name]), p.meta.logical_name


def test_lora_dropout_is_on_the_adapter_input_only():
    """Dropout draws on the adapter's input in training and is off in eval: with B = 0 the
    output is the base's either way; with B != 0 two training forwards differ."""
    cfg = _model(lora_dropout=0.5)
    ctx = ParallelContext.single()
    (chunk,) = build_model_chunks(cfg, ctx, seed=0)
    fc1 = chunk.layers["0"].mlp.fc1
    x = torch.randn(SEQ, 2, cfg.hidden_size)
    with torch.no_grad():
        base = torch.nn.functional.linear(x, fc1.weight)
        torch.testing.assert_close(fc1(x), base, rtol=0, atol=0)  # B = 0
        fc1.lora.lora_B.normal_()
        chunk.eval()
        want = base + 2.0 * (x @ fc1.lora.lora_A.t()) @ fc1.lora.lora_B.t()
        torch.testing.assert_close(fc1(x), want, rtol=1e-5, atol=1e-5)
        chunk.train()
        a, b = fc1(x), fc1(x)
    assert not torch.allclose(a, b) and not torch.allclose(a, want)


def _train(argv):
    from paratron.cli import main

    return main(argv)


@pytest.mark.slow
def test_paratron_train_lora_end_to_end(tmp_path, tiny_corpus):
    """``paratron train``: a base run, a LoRA fine-tune of it at TP2 (adapter-only checkpoint, the
    end-of-run sample generated from it), and a resume onto checkpoint.pretrained_checkpoint."""
    import json

    from paratron.checkpoint.io import load_tensors_full

    from test_e2e_train import TINY

    def run(name, world, *sets):
        argv = ["train", "--run-dir", str(tmp_path / name)]
        for o in TINY + tiny_corpus + ["data.split=90,10,0", "train.train_iters=2", "train.sample_tokens=4",
                                       *sets]:
            argv += ["--set", o]
        assert run_ranks(_train, world, argv, timeout=300) == [0] * world
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    run("base", 1)
    base = str(tmp_path / "base" / "checkpoints")
    lora = ["model.lora_rank=4", "model.lora_alpha=8"]
    run("lora", 2, *lora, "parallel.tensor=2", f"checkpoint.load={base}")
    saved = load_tensors_full(tmp_path / "lora" / "checkpoints", "model/")
    assert saved and all(is_adapter_name(n) for n in saved)
    records = run("resumed", 1, *lora, f"checkpoint.pretrained_checkpoint={base}", "train.train_iters=3",
                  f"checkpoint.load={tmp_path / 'lora' / 'checkpoints'}")
    assert [r["iteration"] for r in records if "loss" in r] == [3]


@pytest.mark.slow
def test_from_hf_lora_sft_exports_hf_and_peft_at_end(tmp_path, capfd):
    """The README's fine-tune at tiny size: ``scripts/make_tiny_hf_llama.py``'s random Llama,
    ``paratron train --from-hf DIR --sft`` on data/shakespeare_chat.jsonl with LoRA at TP2 (2
    ranks), ``--save-hf OUT --save-peft PEFT``. The checkpoint holds only adapters; the merged
    export (transformers) and the PEFT adapter on its exported base (peft) both give the logits of
    paratron's final checkpoint to 1e-5, and differ from the untrained model's."""
    import importlib.util
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from paratron.checkpoint.io import load_tensors_full
    from paratron.training.generate import load_single_process_model

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_tiny_hf_llama", root / "scripts" / "make_tiny_hf_llama.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    path = maker.build(tmp_path / "tiny-llama", hidden=32)
    out, adapter, run = tmp_path / "hf_out", tmp_path / "peft", tmp_path / "run"
    argv = ["train", "--from-hf", str(path), "--data", str(root / "data" / "shakespeare_chat.jsonl"), "--sft",
            "--save-hf", str(out), "--save-peft", str(adapter), "--run-dir", str(run)]
    for o in ["parallel.tensor=2", "parallel.pipeline=1", "data.split=90,10,0", "model.seq_length=64",
              "train.micro_batch_size=2", "train.global_batch_size=4", "train.train_iters=2",
              "train.eval_interval=0", "train.eval_iters=1", "train.sample_tokens=0", "optimizer.lr=1e-2",
              "logging.tensorboard=false", "model.lora_rank=4", "model.lora_alpha=8"]:
        argv += ["--set", o]
    assert run_ranks(_train, 2, argv, timeout=400) == [0, 0]
    printed = capfd.readouterr().out
    assert all(is_adapter_name(n) for n in load_tensors_full(run / "checkpoints", "model/"))
    cfg, chunk = load_single_process_model(str(run / "checkpoints"))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = full_logits(chunk(ids), ParallelContext.single(), cfg.model.vocab_size)
        merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        tuned = peft.AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(ids).logits
        start = transformers.AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
    torch.testing.assert_close(merged, ours, rtol=TOL, atol=TOL)
    torch.testing.assert_close(tuned, ours, rtol=TOL, atol=TOL)
    assert (start - merged).abs().max().item() > 1e-4, "the export holds the trained adapters"
    assert "HF export check: paratron and transformers agree on 8 greedy tokens" in printed, printed[-2000:]
    assert f"PEFT export: {adapter}" in printed, printed[-2000:]
