"""Multi-token prediction (MTP; DeepSeek-AI 2024, "DeepSeek-V3", section 2.2).

``D = model.mtp_num_layers`` sequential modules sit after the main model, in the post-process
chunk (the last pipeline stage). Module ``k`` (1-based) at position ``i`` predicts token
``t[i + k + 1]``:

    h^0     = the main model's last hidden state (before its final norm)
    h'^k_i  = M_k [RMSNorm(Emb(t[i + k])); RMSNorm(h^{k-1}_i)]      M_k: [h, 2h]
    h^k     = TRM_k(h'^k)                                           one transformer layer
    P^k     = OutHead(FinalNorm_k(h^k))                             the shared output layer

(the paper writes the two halves the other way round; the order here is that of DeepSeek-V3's
released weights and Megatron-LM, so a converted ``eh_proj`` needs no permutation). ``Emb`` is
the model's word embedding, ``OutHead`` its output layer; both are shared with the main model.
The loss of module ``k`` is the token mean of its cross-entropy over the global batch (over its
own valid targets); the training loss adds ``lambda / D * sum_k L^k`` (``lambda =
model.mtp_loss_scaling_factor``) and the log shows ``mtp_loss = mean_k L^k``. Generation and
Hugging Face export ignore the modules (the chunk runs them only when given MTP targets).

Targets (:func:`add_mtp_targets`) are built on the whole row before the context-parallel split
(``mtp_tokens`` / ``mtp_labels`` ``[b, s, D]``: the tokens and labels shifted left by ``k``),
so every CP rank gets the shifted tokens of its own positions without communication. A target
past the end of the row, or (packed documents, ``cu_seqlens``) in another document than
position ``i``, is ignored (-100).

Parameters of module ``k`` (0-based here) are named ``layers.{num_layers + k}.*`` (as DeepSeek-V3
numbers its MTP layer after the main layers): ``enorm.weight``, ``hnorm.weight``,
``eh_proj.weight`` ``[h, 2h]`` (replicated over TP; marked ``sequence_parallel`` under SP),
``final_norm.weight``, and the transformer layer's own. Under pipeline parallelism the
last stage holds a copy of the word embedding (or uses its tied output layer), marked
``shared_embedding`` so that its grads are summed with the first stage's (like a tied embedding).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from paratron.config import ModelConfig
from paratron.layers.init import normal_
from paratron.parallel.context import ParallelContext

from .blocks import BLOCKS
from .norms import make_norm
from .mla import ReplicatedLinear

MTP_KEYS = ("mtp_tokens", "mtp_labels")
"""Microbatch fields of the MTP targets, ``[b, s, D]`` each."""

IGNORE_INDEX = -100


def add_mtp_targets(mb: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """``mb`` with ``mtp_tokens`` and ``mtp_labels`` ``[b, s, depth]`` added (see the module
    docstring); ``mb`` holds ``tokens`` and ``labels`` ``[b, s]`` and, for packed documents,
    ``cu_seqlens`` ``[b, D + 1]``. ``depth = 0`` returns ``mb`` unchanged."""
    if depth == 0:
        return mb
    tokens, labels = mb["tokens"], mb["labels"]
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device)
    doc = None
    if "cu_seqlens" in mb:
        cu = mb["cu_seqlens"].to(tokens.device)
        doc = torch.searchsorted(cu[:, 1:].contiguous(), pos.expand(b, -1).contiguous(), right=True)
    toks, labs = [], []
    for k in range(1, depth + 1):
        src = (pos + k).clamp(max=s - 1)
        keep = (pos + k < s).expand(b, -1)
        if doc is not None:
            keep = keep & (doc.gather(1, src.expand(b, -1)) == doc)
        toks.append(torch.where(keep, tokens[:, src], torch.zeros_like(tokens)))
        labs.append(torch.where(keep, labels[:, src], torch.full_like(labels, IGNORE_INDEX)))
    return {**mb, "mtp_tokens": torch.stack(toks, dim=-1), "mtp_labels": torch.stack(labs, dim=-1)}


def count_mtp_tokens(microbatches: list[dict], ctx: ParallelContext) -> torch.Tensor:
    """Valid MTP targets per module over this rank's microbatches, summed over DP x CP: fp64
    ``[D]`` on ``ctx.device`` (each at least 1, so an all-ignored module gives loss 0)."""
    local = torch.stack([(mb["mtp_labels"] != IGNORE_INDEX).sum(dim=(0, 1)) for mb in microbatches]).sum(0)
    t = local.to(device=ctx.device, dtype=torch.float64)
    ctx.dp_cp.all_reduce(t)
    return t.clamp(min=1.0)


def mtp_loss(per_token: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """This microbatch's share of ``mean_k L^k``: ``per_token`` ``[D, s, b]`` fp32 losses (0 at
    ignored targets), ``counts`` ``[D]`` from :func:`count_mtp_tokens`; 0-dim fp32."""
    return (per_token.sum(dim=(1, 2)) / counts.float()).mean()


class MTPModule(nn.Module):
    """MTP module ``depth`` (0-based): ``forward(h, ids, labels, ...)`` maps the previous depth's
    hidden ``[s, b, h]`` (``[s/tp, b, h]`` under SP) and this depth's input ids / labels ``[b, s]``
    to ``(its hidden, per-token losses [s, b])``."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, depth: int, seed: int, sequence_parallel: bool,
                 params_dtype: torch.dtype, rng_tracker=None):
        super().__init__()
        number = cfg.num_layers + depth
        prefix = f"layers.{number}"

        def norm(name):
            return make_norm(cfg, ctx, f"{prefix}.{name}", sequence_parallel, params_dtype)

        self.enorm, self.hnorm, self.final_norm = norm("enorm"), norm("hnorm"), norm("final_norm")
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, ctx, logical_name=f"{prefix}.eh_proj",
                                        seed=seed, sequence_parallel=sequence_parallel,
                                        init_method=normal_(cfg.init_method_std), params_dtype=params_dtype)
        self.layer = BLOCKS.get(cfg.block)(cfg, ctx, layer_number=number, seed=seed,
                                           sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                                           rng_tracker=rng_tracker)

    def forward(self, h, ids, labels, embed: Callable, run_layer: Callable, head: Callable):
        x = self.eh_proj(torch.cat([self.enorm(embed(ids)), self.hnorm(h)], dim=-1))
        x = run_layer(self.layer, x)
        return x, head(self.final_norm(x), labels)


class MultiTokenPrediction(nn.Module):
    """The ``D`` MTP modules of a post-process chunk.

    Args:
        embedding: the word embedding to look the shifted tokens up in (a
            :class:`~paratron.layers.VocabParallelEmbedding`); held, not registered, when it
            belongs to another module of the model (``owned=False``).

    ``forward(h, mtp_tokens, mtp_labels, run_layer, head)``: ``h`` the main hidden before the
    final norm; ``mtp_tokens`` / ``mtp_labels`` ``[b, s, D]`` (this CP rank's positions);
    ``run_layer(layer, x)`` runs a transformer layer as the chunk does (recompute, rope,
    layout); ``head(x_normed, labels [b, s])`` gives per-token losses ``[s, b]``. Returns the
    losses of every module, ``[D, s, b]`` fp32.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, seed: int, sequence_parallel: bool,
                 params_dtype: torch.dtype,
                 rng_tracker=None, embedding: nn.Module, owned: bool):
        super().__init__()
        self.depths = nn.ModuleList([
            MTPModule(cfg, ctx, depth=k, seed=seed, sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                      rng_tracker=rng_tracker) for k in range(cfg.mtp_num_layers)])
        if owned:
            self.embedding = embedding
        else:
            self._shared = [embedding]  # a list: registered where it belongs

    @property
    def word_embedding(self) -> nn.Module:
        """The word embedding the modules look the shifted tokens up in (owned or shared)."""
        return self.embedding if hasattr(self, "embedding") else self._shared[0]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.word_embedding(ids)

    def forward(self, h, mtp_tokens, mtp_labels, run_layer: Callable, head: Callable) -> torch.Tensor:
        losses = []
        for k, module in enumerate(self.depths):
            h, loss = module(h, mtp_tokens[..., k], mtp_labels[..., k], self._embed, run_layer, head)
            losses.append(loss)
        return torch.stack(losses)
