"""A small vision-language model: a ViT encoder over patch embeddings, a projector, and the GPT
(LLaVA's layout, Liu et al. 2023, section 4.1; the ViT of Dosovitskiy et al. 2021, section 3.1).

* :class:`VisionEncoder`: patches ``[b, n, c*p*p]`` -> linear patch embedding + learned
  positions -> ``encoder_layers`` blocks of ``model.block = "vit"`` (registered here in
  :data:`~paratron.models.blocks.BLOCKS`: pre-norm, *bidirectional* attention, GELU MLP) ->
  final LayerNorm -> projector (linear, GELU, linear) to the GPT's hidden size. Output
  ``[n, b, h_llm]``, the GPT's ``[s, b, h]`` layout. The encoder is replicated (no tensor
  parallelism): under the Optimus placement every pipeline rank holds a copy
  (:mod:`paratron.pipeline.encoder_schedule`), and :func:`reduce_encoder_grads` sums its grads.
* :class:`VLMFirstStage`: the GPT's stage 0 for image + text: the image tokens (the encoder's
  output) come first, then the text's word embeddings; the concatenated ``[n + t, b, h]`` goes
  through the stage's layers. The loss is on the text tokens only (labels are ``-100`` at the
  image positions; :func:`vlm_labels`).

Every parameter is drawn from ``(seed, its name)`` (:func:`paratron.layers.init.init_shard_`), so
replicas on different ranks, and one process, start equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig
from paratron.layers.init import init_shard_, normal_
from paratron.parallel.params import ShardSpec, mark

from .blocks import BLOCKS, register_block
from .embedding import Embedding
from .gpt import GPTChunk


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes of the vision encoder. ``patch_dim = channels * patch_size**2``; ``num_patches`` is
    the image's ``(image_size / patch_size)**2``; ``projector_hidden`` defaults to the GPT's hidden."""

    num_patches: int
    patch_dim: int
    hidden_size: int = 16
    num_layers: int = 2
    num_attention_heads: int = 2
    init_method_std: float = 0.02


def _param(shape, name: str, seed: int, std: float | None, fill: float = 0.0) -> nn.Parameter:
    t = torch.empty(shape)
    if std is None:
        t.fill_(fill)
    else:
        t = init_shard_(t, normal_(std), ShardSpec.replicated(tuple(shape)), seed, name)
    return mark(nn.Parameter(t), name, no_weight_decay=t.dim() == 1)


class ViTBlock(nn.Module):
    """One pre-norm ViT block over ``[s, b, h]``: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``
    with bidirectional softmax attention (no mask) and a 4h GELU MLP. Parameters are named
    ``{prefix}layers.{layer_number}.*``."""

    def __init__(self, cfg: ModelConfig, ctx=None, *, layer_number: int, seed: int, prefix: str = "", **_):
        super().__init__()
        h, base = cfg.hidden_size, f"{prefix}layers.{layer_number}."
        self.heads = cfg.num_attention_heads
        std = cfg.init_method_std
        shapes = {"norm1": (h,), "qkv": (3 * h, h), "proj": (h, h), "norm2": (h,), "fc1": (4 * h, h), "fc2": (h, 4 * h)}
        for name, shape in shapes.items():
            norm = name.startswith("norm")
            setattr(self, f"{name}_w", _param(shape, f"{base}{name}.weight", seed, None if norm else std, 1.0))
            setattr(self, f"{name}_b", _param(shape[:1], f"{base}{name}.bias", seed, None))

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        s, b, h = x.shape
        y = F.layer_norm(x, (h,), self.norm1_w, self.norm1_b)
        q, k, v = F.linear(y, self.qkv_w, self.qkv_b).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=False)  # [b, heads, s, d]
        x = x + F.linear(att.permute(2, 0, 1, 3).reshape(s, b, h), self.proj_w, self.proj_b)
        y = F.layer_norm(x, (h,), self.norm2_w, self.norm2_b)
        return x + F.linear(F.gelu(F.linear(y, self.fc1_w, self.fc1_b)), self.fc2_w, self.fc2_b)


register_block("vit", ViTBlock)


class VisionEncoder(nn.Module):
    """Patches ``[b, n, patch_dim]`` (fp32) -> image tokens ``[n, b, llm_hidden]``; parameters
    named ``encoder.*`` (layers built by the ``"vit"`` block of the block registry) and
    ``projector.*``."""

    def __init__(self, ecfg: EncoderConfig, llm_hidden: int, *, seed: int):
        super().__init__()
        h, std = ecfg.hidden_size, ecfg.init_method_std
        self.patch_w = _param((h, ecfg.patch_dim), "encoder.patch_embed.weight", seed, std)
        self.patch_b = _param((h,), "encoder.patch_embed.bias", seed, None)
        self.positions = _param((ecfg.num_patches, h), "encoder.position_embeddings", seed, std)
        block_cfg = ModelConfig(num_layers=ecfg.num_layers, hidden_size=h, num_attention_heads=ecfg.num_attention_heads,
                                init_method_std=std)
        block = BLOCKS.get("vit")
        self.layers = nn.ModuleList(block(block_cfg, None, layer_number=i, seed=seed, prefix="encoder.")
                                    for i in range(ecfg.num_layers))
        self.norm_w = _param((h,), "encoder.final_norm.weight", seed, None, 1.0)
        self.norm_b = _param((h,), "encoder.final_norm.bias", seed, None)
        self.proj1_w = _param((llm_hidden, h), "projector.fc1.weight", seed, std)
        self.proj1_b = _param((llm_hidden,), "projector.fc1.bias", seed, None)
        self.proj2_w = _param((llm_hidden, llm_hidden), "projector.fc2.weight", seed, std)
        self.proj2_b = _param((llm_hidden,), "projector.fc2.bias", seed, None)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = F.linear(patches, self.patch_w, self.patch_b) + self.positions  # [b, n, h]
        x = x.transpose(0, 1)  # [n, b, h]
        for layer in self.layers:
            x = layer(x)
        x = F.layer_norm(x, (x.shape[-1],), self.norm_w, self.norm_b)
        return F.linear(F.gelu(F.linear(x, self.proj1_w, self.proj1_b)), self.proj2_w, self.proj2_b)


class VLMFirstStage(nn.Module):
    """Stage 0 of the VLM's GPT: ``forward(ids [b, t], image_tokens [n, b, h], labels)``; the
    text embedding and ``chunk`` (a :class:`~paratron.models.gpt.GPTChunk` built without its own
    embedding). Returns what ``chunk`` returns (hidden ``[n + t, b, h]``, or per-token losses
    ``[n + t, b]`` on a one-stage model given ``labels``)."""

    def __init__(self, cfg: ModelConfig, ctx, *, seed: int, chunk: GPTChunk):
        super().__init__()
        self.embedding = Embedding(cfg, ctx, seed=seed, sequence_parallel=False, params_dtype=torch.float32)
        self.chunk = chunk
        self.post_process = chunk.post_process

    def forward(self, ids: torch.Tensor, image_tokens: torch.Tensor, labels: torch.Tensor | None = None):
        h = torch.cat([image_tokens, self.embedding(ids)], dim=0)
        return self.chunk(h, labels) if self.post_process else self.chunk(h)


def check_vlm_config(cfg: ModelConfig) -> None:
    """The GPT of the VLM: rotary positions (the image tokens take the first positions, so a
    learned table would have to cover them too) and untied embeddings (the text embedding sits
    beside stage 0's chunk, not in it). Raises ValueError naming the field."""
    if cfg.position_embedding_type != "rope":
        raise ValueError(f"the VLM needs model.position_embedding_type='rope', got {cfg.position_embedding_type!r}")
    if cfg.tie_embeddings:
        raise ValueError("the VLM needs model.tie_embeddings=false (its text embedding is outside stage 0's chunk)")


def build_vlm_chunks(cfg: ModelConfig, ctx, *, seed: int, layers_per_stage: list[int]) -> list[nn.Module]:
    """This pipeline rank's GPT chunk of the VLM (one stage per rank): stage 0 is a
    :class:`VLMFirstStage`, the others plain :class:`GPTChunk`'s over hidden input.
    ``layers_per_stage[s]`` layers on stage ``s``. The encoder is built separately
    (:class:`VisionEncoder`), where the placement puts it."""
    check_vlm_config(cfg)
    s = ctx.pp.rank
    first = sum(layers_per_stage[:s])
    chunk = GPTChunk(cfg, ctx, seed=seed, layer_ids=range(first, first + layers_per_stage[s]), pre_process=False,
                     post_process=s == ctx.pp.size - 1)
    return [VLMFirstStage(cfg, ctx, seed=seed, chunk=chunk) if s == 0 else chunk]


def vlm_labels(text: torch.Tensor, num_image_tokens: int) -> torch.Tensor:
    """Next-token labels ``[b, n + t]`` for image + text ``[b, t]``: ``-100`` at the image
    positions and at the last text position, the next text token elsewhere."""
    b, t = text.shape
    labels = torch.full((b, num_image_tokens + t), -100, dtype=torch.long)
    labels[:, num_image_tokens:num_image_tokens + t - 1] = text[:, 1:]
    return labels


def reduce_encoder_grads(encoder: nn.Module, groups) -> None:
    """Sum the encoder's grads over ``groups`` (:class:`~paratron.parallel.comm.Group`'s, e.g.
    ``[ctx.pp, ctx.dp]`` under the Optimus placement: every replica computed the grads of its own
    parts; ``[ctx.dp]`` on stage 0's rank under ``stage0``), one flat all-reduce per group. A
    param without grad counts as zero."""
    params = list(encoder.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    for g in groups:
        if g.size > 1:
            g.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
