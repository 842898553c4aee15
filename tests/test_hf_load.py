"""``checkpoint.load_hf`` (``paratron train --from-hf``): each rank reads only its safetensors
slices, following the converter's recipes, and the result is the Hugging Face model.

* One process, every family the converter knows (Llama, GPT-2, Mixtral, Qwen2-MoE, Qwen3,
  Qwen3-MoE, DeepSeek-V3 dense and MoE): the sliced load gives bitwise the converter's tensors.
* TP2xPP2 (Llama, GQA) in one 4-rank launch, and EP2 (Mixtral, Qwen3-MoE), DP2 under ZeRO-3
  (Llama), TP2 (GPT-2, Qwen2-MoE, Qwen3, DeepSeek-V3 dense) and EP2 (DeepSeek-V3 MoE) in one
  2-rank launch: logits within 1e-5 of transformers' before any step, then
  3 AdamW steps with the same losses (1e-5) as the one-process load, through the real model
  builder (``skip_draws``) and ``load_hf_weights``.
* Memory: every tensor the safetensors slices return is counted from outside the loader
  (:class:`LiveBytes`: bytes in all, and the peak alive at once, freed tensors subtracted by a
  weakref finalizer), next to the loader's own :class:`LoadStats`. A rank reads exactly the bytes
  of its own shards, and holds at most one piece at a time, no larger than the largest tensor; so
  its peak during the load (its params, allocated before, plus the pieces alive) stays below its
  shard + the largest tensor (< 1.2x shard + largest), while at TP2xPP2 a full copy of the model
  would not. Index tensors of row numbers (8 bytes per row, not per element) are not counted.
"""

from __future__ import annotations

import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import train_for_parity  # noqa: E402
from paratron.checkpoint.hf import hf_to_paratron  # noqa: E402
from paratron.checkpoint.hf_load import (SafetensorsFolder, apply_load_hf, load_hf_slices,  # noqa: E402
                                         load_hf_weights)
from paratron.config import Config
from paratron.rules import validate  # noqa: E402
from paratron.models.gpt import build_model_chunks, full_logits  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402
from test_hf_deepseek import _make as make_deepseek  # noqa: E402
from test_hf_moe import _make as make_moe  # noqa: E402
from test_hf_parity import MAKERS, _perturb_  # noqa: E402
from test_hf_qwen3 import _hf_config as qwen3_config  # noqa: E402

TOL = 1e-5
SEQ, BATCH = 12, 2
FAMILIES = ["llama", "gpt2", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_dense"]


def _make(family: str, path):
    """A tiny random model of ``family`` saved with ``save_pretrained`` into ``path`` (norms and
    biases randomised), in eval mode."""
    if family in MAKERS:
        return MAKERS[family](path)
    if family in ("mixtral", "qwen2_moe"):
        return make_moe(family, path)
    if family.startswith("deepseek_v3"):  # MoE with query compression; dense without it
        return make_deepseek(path, 16, True) if family == "deepseek_v3" else make_deepseek(path, None, False)
    cfg, cls = qwen3_config(family)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    _perturb_(model, 4)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """``{family: (folder, transformers model)}``, made once for the module."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (str(path), _make(family, path))
    return out


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_sliced_load_equals_the_converter(hf_dirs, family):
    """One process: every param holds bitwise the converter's full tensor, the loader read each
    param's bytes once, and the logits are transformers'."""
    path, model = hf_dirs[family]
    cfg, tensors = hf_to_paratron(path)
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
    stats = load_hf_slices([chunk], path, cfg)
    for p in chunk.parameters():
        assert torch.equal(p.meta.shard.valid(p), tensors[p.meta.logical_name]), p.meta.logical_name
    assert stats.read == stats.params == sum(t.numel() * t.element_size() for t in tensors.values())
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        ours = full_logits(chunk.eval()(ids), ParallelContext.single(), cfg.vocab_size)
    assert (ours - _hf_logits(model, ids)).abs().max().item() < TOL


def test_sharded_folder_loads_the_same(hf_dirs, tmp_path):
    """A folder saved in several safetensors files (``model.safetensors.index.json``)."""
    path, model = hf_dirs["qwen3_moe"]
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    cfg, tensors = hf_to_paratron(path)
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
    load_hf_slices([chunk], tmp_path, cfg)
    for p in chunk.parameters():
        assert torch.equal(p.meta.shard.valid(p), tensors[p.meta.logical_name]), p.meta.logical_name


# ---- through the run's model builder, at several layouts ----------------------------------
def _config(path: str, tp=1, pp=1, ep=1, zero=0, world=1) -> Config:
    cfg = Config()
    cfg.checkpoint.load_hf = path
    cfg.model.seq_length = SEQ
    apply_load_hf(cfg, [])
    p, t, o = cfg.parallel, cfg.train, cfg.optimizer
    p.tensor, p.pipeline, p.expert, p.zero, p.bucket_size_mb = tp, pp, ep, zero, 0.001
    t.micro_batch_size, t.global_batch_size, t.seed = 1, 4, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 1.0, "constant"
    return validate(cfg, world)


def _pipeline_logits(chunks, ctx, ids, vocab: int, hidden: int):
    """Logits ``[b, s, V]`` of one forward through the stages (last stage; None elsewhere)."""
    (chunk,) = chunks
    x = ids
    if not ctx.is_first_stage:
        x = torch.empty(ids.shape[1], ids.shape[0], hidden)
        for w in ctx.pp.batch_isend_irecv([ctx.pp.p2p_op("recv", x, ctx.pp.rank - 1)]):
            w.wait()
    with torch.no_grad():
        out = chunk(x)
    if not ctx.is_last_stage:
        for w in ctx.pp.batch_isend_irecv([ctx.pp.p2p_op("send", out.contiguous(), ctx.pp.rank + 1)]):
            w.wait()
        return None
    return full_logits(out, ctx, vocab)


def _load_and_train(cfg: Config, ctx) -> dict:
    """The run's builder (params the folder fills are not drawn), the sliced load, the logits
    before any step, then 3 AdamW steps (:func:`helpers.train_for_parity`)."""
    seen = {}

    def prepare(chunks, ddp, optimizer):
        seen["stats"] = load_hf_weights(cfg, chunks, optimizer)
        with ddp.full_params():
            seen["logits"] = _pipeline_logits(chunks, ctx, _ids(cfg.model.vocab_size), cfg.model.vocab_size,
                                              cfg.model.hidden_size)

    out = train_for_parity(cfg, ctx, steps=3, prepare=prepare)
    return {"losses": out["losses"], **seen}


class LiveBytes:
    """Counts, outside the loader, the tensors its safetensors slices return: ``total`` bytes, and
    the ``peak`` bytes alive at once (each tensor counted until it is freed, by a weakref
    finalizer; a view such as ``.t()`` keeps its base alive)."""

    def __init__(self) -> None:
        self.total = self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def count(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.total, self.live = self.total + n, self.live + n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)
        return t

    def wrap(self, sl):
        counter = self

        class Counted:
            def __getitem__(self, index):
                return counter.count(sl[index])

            def get_shape(self):
                return sl.get_shape()

        return Counted()


def _layout_rank(cases):
    counter, plain = LiveBytes(), SafetensorsFolder.slice
    SafetensorsFolder.slice = lambda self, name: counter.wrap(plain(self, name))  # this rank process only
    results = []
    for path, kw in cases:
        cfg = _config(path, world=torch.distributed.get_world_size(), **kw)
        p = cfg.parallel
        ctx = ParallelContext.build(tp=p.tensor, pp=p.pipeline, ep=p.expert)
        counter.total = counter.peak = 0
        results.append(_load_and_train(cfg, ctx))
        results[-1].update(counted=counter.total, peak=counter.peak)
    return results


def _check(results: list[dict], path: str, model, name: str, split: bool = False) -> None:
    """Logits, losses and the memory accounting of each rank of one layout against transformers
    and the one-process load; ``split``: the layout splits the model enough that a full copy
    would break the memory bound."""
    ref = _load_and_train(_config(path), ParallelContext.single())
    want = _hf_logits(model, _ids(model.config.vocab_size))
    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert logits, f"{name}: no rank computed logits"
    for got in logits + [ref["logits"]]:
        assert (got - want).abs().max().item() < TOL, name
    sizes = [t.numel() * t.element_size() for t in hf_to_paratron(path)[1].values()]
    for r in results:
        for loss, expected in zip(r["losses"], ref["losses"], strict=True):
            assert abs(loss - expected) <= TOL * max(1.0, abs(expected)), f"{name}: loss {loss} vs {expected}"
        s = r["stats"]
        # Read exactly its shards, one piece at a time, none larger than the largest tensor: the
        # peak during the load is at most shard + one piece.
        assert s.read == s.params == r["counted"], f"{name}: read {r['counted']} bytes for {s.params} bytes of shards"
        assert r["peak"] <= s.largest <= max(sizes), name
        assert s.params + r["peak"] < 1.2 * s.params + max(sizes), name
        # ... and a full copy of the model would not fit under that bound at this layout.
        assert not split or sum(sizes) > 1.2 * s.params + max(sizes), f"{name}: a full copy would fit too"


def test_from_hf_at_tp2_pp2(hf_dirs):
    path, model = hf_dirs["llama"]
    (results,) = zip(*run_ranks(_layout_rank, 4, [(path, dict(tp=2, pp=2))], timeout=400))
    _check(list(results), path, model, "llama tp2xpp2", split=True)


def test_from_hf_at_ep2_zero3_and_tp2(hf_dirs):
    """One 2-rank launch: Mixtral and Qwen3-MoE at EP2, Llama at DP2 under ZeRO-3 (the load fills
    the gathered TP/PP-local params and writes the DP shards back), and the other families at TP2
    (GPT-2's transposed Conv1D weights read by columns, its tied head; Qwen2-MoE's shared
    expert; Qwen3's QK-norm; DeepSeek-V3's MLA with its RoPE rows reordered), DeepSeek-V3's MoE
    model at EP2."""
    cases = [("mixtral", dict(ep=2)), ("qwen3_moe", dict(ep=2)), ("llama", dict(zero=3)), ("gpt2", dict(tp=2)),
             ("qwen2_moe", dict(tp=2)), ("qwen3", dict(tp=2)), ("deepseek_v3", dict(ep=2)),
             ("deepseek_v3_dense", dict(tp=2))]
    names = ["mixtral ep2", "qwen3_moe ep2", "llama dp2 zero3", "gpt2 tp2", "qwen2_moe tp2", "qwen3 tp2",
             "deepseek_v3 ep2", "deepseek_v3_dense tp2"]
    per_rank = run_ranks(_layout_rank, 2, [(hf_dirs[f][0], kw) for f, kw in cases], timeout=600)
    for i, (family, kw) in enumerate(cases):
        path, model = hf_dirs[family]
        _check([r[i] for r in per_rank], path, model, names[i])
