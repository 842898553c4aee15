"""GPT/Llama pipeline model chunks (Radford et al. 2019; Touvron et al. 2023), built from
paratron's tensor-parallel layers.

A rank holds one :class:`GPTChunk` per virtual pipeline stage (Narayanan et al. 2021, section 2.2:
interleaved model chunks). The chunk with the first layers holds the embedding
(``pre_process``), the chunk with the last layers holds the final norm and the output layer
(``post_process``); a chunk may hold zero transformer layers.

Tied input/output embeddings under pipeline parallelism: the last stage keeps its own copy of
``embedding.word_embeddings.weight`` drawn from the same full tensor, and both copies are marked
``shared_embedding=True`` so their grads are summed over the ``embedding`` group (Narayanan et
al. 2021 do the same); when both ends of the model sit on one rank they share one parameter.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratron.config import ConfigError, ModelConfig, model_shape
from paratron.pipeline import partition
from paratron.layers import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_logits
from paratron.layers.cross_entropy import fused_linear_cross_entropy
from paratron.layers.init import normal_
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import attach_weight_grad_store
from paratron.parallel.random import RNGStatesTracker

from .embedding import WORD_EMBEDDINGS, Embedding
from .lora import apply_lora
from .low_rank import residual_stream
from .moe.layer import link_moe_layers, moe_layers
from .blocks import BLOCKS
from .norms import make_norm
from .offload import check_layers, start_session
from .recompute import checkpointed
from .context_parallel import sequence_layout
from .rope import rope_tables, rope_tables_at
from .state import gather_full_state, load_full_state
from .mtp import MultiTokenPrediction

__all__ = ["GPTChunk", "build_model_chunks", "model_order", "full_logits",
           "load_full_state", "gather_full_state", "StageLayers"]

StageLayers = dict[tuple[int, int], tuple[int, int]]
"""(pp_rank, chunk) -> (first global layer, layer count)."""


def inductor_options(ctx: ParallelContext) -> dict | None:
    """Inductor options for ``model.compile`` (None: torch's defaults).

    A one-process CPU run compiles the layers with inductor's C++ wrapper (``cpp_wrapper``): the
    default wrapper is Python that allocates each buffer and calls each kernel one at a time
    (about 1 % of the main job's layout-(1) step; docs/ARCHITECTURE.md, "The layout-(1) step's
    non-GEMM work"). With more ranks the defaults stay: dynamo traces collectives into the layers
    (the gloo all-to-alls of sequence parallelism, all2all context parallelism, the MoE
    dispatcher), and torch 2.13's C++ wrapper cannot call ``_c10d_functional::all_to_all_single``
    (its group argument is typed ``Any``). On GPUs the defaults stay, as they were tested there."""
    return {"cpp_wrapper": True} if ctx.device.type == "cpu" and ctx.world_size == 1 else None


class GPTChunk(nn.Module):
    """One pipeline model chunk of a GPT-2/Llama-style transformer.

    Args:
        cfg: the model config (``vocab_size`` must be set).
        ctx: the :class:`~paratron.parallel.context.ParallelContext`.
        seed: the run's seed; every parameter's full tensor is drawn from (seed, logical name).
        layer_ids: the global indices of the transformer layers in this chunk (may be empty).
        pre_process: holds the embedding; ``forward`` then takes token ids.
        post_process: holds the final norm and the output layer.
        sequence_parallel: activations between TP regions are split along the sequence.
        params_dtype: parameter (and compute) dtype: fp32, bf16 or fp16.
        rng_tracker: the :class:`paratron.parallel.random.RNGStatesTracker` for dropout inside TP
            regions (may be None when dropout is 0 and TP is 1).
        embedding_weight: for a tied post-process chunk on the rank that also holds the
            embedding: that embedding's weight, shared instead of copied.
        embedding_module: for a post-process chunk with MTP modules on the rank that also holds
            the embedding: that ``VocabParallelEmbedding``, shared instead of copied.
        context_algorithm: ``parallel.context_algorithm`` (``"ring"`` or ``"all2all"``), used when
            ``ctx.cp`` has more than one rank.

    Raises:
        ConfigError: ``model.block`` is not registered; raised before any collective. The model's
            shape rules (:func:`paratron.config.model_shape.check_model`) are checked once, by
            :func:`build_model_chunks` (and before that by the config rules), not per chunk.

    The layers are built by the block registered as ``model.block`` (:mod:`paratron.models.blocks`).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, seed: int, layer_ids: range, pre_process: bool,
                 post_process: bool, sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 rng_tracker=None, embedding_weight: nn.Parameter | None = None, context_algorithm: str = "ring",
                 embedding_module: nn.Module | None = None):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.context_algorithm = context_algorithm
        self.layer_ids = range(layer_ids.start, layer_ids.stop) if isinstance(layer_ids, range) else layer_ids
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and ctx.tp.size > 1
        self.rng_tracker = rng_tracker
        self.recompute = cfg.recompute
        # Set by the pipeline runtime while it runs a microbatch whose backward will be split at
        # layer boundaries (an FB pair's backward half): ``h = layer_boundary(h)`` before each
        # layer and before the head. None: the graph is left whole.
        self.layer_boundary = None
        self.embedding = (Embedding(cfg, ctx, seed=seed, sequence_parallel=sequence_parallel,
                                    params_dtype=params_dtype, rng_tracker=rng_tracker)
                          if pre_process else None)
        block = BLOCKS.get(cfg.block)
        # Keys are global layer indices, so module paths match the logical names.
        self.layers = nn.ModuleDict({
            str(i): block(cfg, ctx, layer_number=i, seed=seed, sequence_parallel=sequence_parallel,
                          params_dtype=params_dtype, rng_tracker=rng_tracker)
            for i in self.layer_ids})
        check_layers(cfg.activation_offload, self.layers.values())
        # (enter, exit) of a layer-owned stream layout (the low-rank bottleneck plan), or None.
        self.stream = residual_stream(cfg, ctx) if len(self.layers) else None
        link_moe_layers(self.layers)  # each MoE layer's predecessor (the prefetch dispatcher's predictor)
        if cfg.compile:
            # Per layer (as torchtitan does): layers share one compiled code object, and the
            # embedding, loss and pipeline plumbing around them stay eager.
            options = inductor_options(ctx)
            for layer in self.layers.values():
                layer.compile(options=options)
        self.final_norm = None
        self.output_layer = None
        if post_process:
            self.final_norm = make_norm(cfg, ctx, "final_norm", sequence_parallel, params_dtype)
            self._build_output(cfg, ctx, seed, params_dtype, embedding_weight)
        self.mtp = (self._build_mtp(cfg, ctx, seed, params_dtype, embedding_module)
                    if post_process and cfg.mtp_num_layers else None)
        if (cfg.tie_embeddings or cfg.mtp_num_layers) and pre_process and not post_process:
            self.embedding.word_embeddings.weight.meta.shared_embedding = True

    def _build_output(self, cfg, ctx: ParallelContext, seed, params_dtype, embedding_weight):
        if not cfg.tie_embeddings:
            self.output_layer = ParallelLMHead(
                cfg.vocab_size, cfg.hidden_size, ctx, logical_name="output_layer", seed=seed,
                make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                sequence_parallel=self.sequence_parallel, init_method=normal_(cfg.init_method_std),
                params_dtype=params_dtype)
        elif embedding_weight is None and not self.pre_process:
            # The last stage's copy of the tied embedding: same logical name, same full tensor.
            self.output_layer = ParallelLMHead(
                cfg.vocab_size, cfg.hidden_size, ctx, logical_name=WORD_EMBEDDINGS, seed=seed,
                make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                sequence_parallel=self.sequence_parallel, init_method=normal_(cfg.init_method_std),
                params_dtype=params_dtype)
            self.output_layer.weight.meta.shared_embedding = True
        else:
            self._tied_weight = [embedding_weight]  # a list: not registered twice as a parameter

    def _build_mtp(self, cfg, ctx: ParallelContext, seed, params_dtype, embedding_module):
        """The MTP modules (:mod:`paratron.models.mtp`), with the word embedding they share: this
        chunk's, the given one (same rank), or a copy drawn from the same full tensor (its own
        ``shared_embedding`` parameter, or the tied output layer's)."""
        shared = self.embedding.word_embeddings if self.pre_process else embedding_module
        if shared is None:
            shared = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ctx, logical_name=WORD_EMBEDDINGS, seed=seed,
                make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                sequence_parallel=self.sequence_parallel, init_method=normal_(cfg.init_method_std),
                params_dtype=params_dtype)
            if self.output_layer is not None and cfg.tie_embeddings:
                shared.weight = self.output_layer.weight  # one copy on this stage, already shared
            shared.weight.meta.shared_embedding = True
        head = self.output_weight()  # applied once more per MTP module in each forward (DDP's grad_uses)
        head.meta.grad_uses += cfg.mtp_num_layers
        return MultiTokenPrediction(cfg, ctx, seed=seed, sequence_parallel=self.sequence_parallel,
                                    params_dtype=params_dtype, rng_tracker=self.rng_tracker, embedding=shared,
                                    owned=shared is not embedding_module and not self.pre_process)

    def output_weight(self) -> torch.Tensor:
        """The ``[V_pad/tp, h]`` weight the logits are computed with (post-process chunks)."""
        if self.output_layer is not None:
            return self.output_layer.weight
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self._tied_weight[0]

    # ---- the pipeline runtime's chunk interface (paratron.pipeline.chunk.PipelineChunk) ----
    def use_weight_grad_store(self, store) -> None:
        """Queue the weight grads of this chunk's linears and experts in ``store`` (a
        :class:`~paratron.parallel.grads.WeightGradStore`) while it is deferring."""
        attach_weight_grad_store(self, store)

    @contextmanager
    def layer_boundaries(self, cut):
        """While inside: ``h = cut(h)`` before each layer and before the head."""
        self.layer_boundary = cut
        try:
            yield
        finally:
            self.layer_boundary = None

    @contextmanager
    def in_flight_hook(self, hook):
        """While inside: each MoE layer's dispatcher calls ``hook(what, wait)`` after launching
        an all-to-all asynchronously (:class:`~paratron.models.moe.dispatcher.TokenDispatcher`)."""
        layers = moe_layers(self)
        for layer in layers:
            layer.while_in_flight = hook
        try:
            yield
        finally:
            for layer in layers:
                layer.while_in_flight = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None, mtp_labels: torch.Tensor | None = None):
        """Run this chunk.

        Under context parallelism (``parallel.context = C``) ``s`` below is this rank's ``s / C``
        tokens, in the order of :func:`paratron.models.context_parallel.chunk_ids`.

        Args:
            x: token ids ``[b, s]`` (int64) when ``pre_process``, else hidden ``[s, b, h]``
                (``[s/tp, b, h]`` under sequence parallelism).
            labels: ``[b, s]`` target ids (``-100`` ignored), post-process chunks only.
            position_ids: ``[b, s]`` positions restarting at each packed document
                (``data.reset_position_ids``); None: global positions.
            cu_seqlens: ``[b, D + 1]`` start of each packed document in the full sequence, then the
                full length (``data.reset_attention_mask``); None: one document per sample.
            mtp_tokens, mtp_labels: ``[b, s, D]`` multi-token-prediction inputs and targets
                (:func:`paratron.models.mtp.add_mtp_targets`), post-process chunks with MTP
                modules only; None: the modules are not run (generation, evaluation of logits).
        Returns:
            hidden ``[s, b, h]`` (``[s/tp, b, h]`` with SP) when not ``post_process``; else per-token
            losses ``[s, b]`` fp32 (0 at ignored labels) when ``labels`` is given; else the
            vocab-parallel logits ``[s, b, V_pad/tp]``; with ``labels`` and MTP targets, the pair
            ``(losses [s, b], MTP losses [D, s, b])``.
        """
        if self.pre_process:
            b, seq = x.shape
        else:
            seq, b = x.shape[0] * (self.ctx.tp.size if self.sequence_parallel else 1), x.shape[1]
        layout, positions = sequence_layout(self.ctx, self.context_algorithm, b, seq, position_ids, cu_seqlens,
                                            x.device)
        h = self.embedding(x, positions) if self.pre_process else x
        rope = None
        if self.cfg.position_embedding_type == "rope" and len(self.layers):
            dim = model_shape.rope_dim(self.cfg)
            rope = (rope_tables(seq, dim, self.cfg.rope_theta, device=h.device) if positions is None
                    else rope_tables_at(positions, dim, self.cfg.rope_theta))
        # The layout reaches the blocks only when it matters, so plain blocks keep forward(x, rope).
        args = (rope, layout) if layout.needs_custom_attention else (rope,)
        cut = self.layer_boundary or (lambda t: t)
        offload = start_session(self.cfg.activation_offload, h.device, self.training)  # per microbatch
        h = self.stream[0](h) if self.stream else h
        for layer in self.layers.values():
            h = self._run_layer(layer, cut(h), args, offload)
        h = self.stream[1](h) if self.stream else h
        if not self.post_process:
            return h
        h = cut(h)
        losses = self._head(self.final_norm(h), labels)
        if self.mtp is None or labels is None or mtp_tokens is None:
            return losses
        return losses, self.mtp(h, mtp_tokens, mtp_labels, lambda layer, t: self._run_layer(layer, t, args),
                                self._head)

    def _run_layer(self, layer: nn.Module, h: torch.Tensor, args: tuple, offload=None) -> torch.Tensor:
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            return checkpointed(layer, h, *args, rng_tracker=self.rng_tracker)
        if offload is None:
            return layer(h, *args)
        with offload.layer(layer, args):  # model.activation_offload (paratron/models/offload.py)
            out = layer(h, *args)
        return offload.boundary(out)

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Logits (or per-token losses against ``labels``) of the normed hidden ``h``. The losses
        come from the output GEMM and the loss fused (:func:`fused_linear_cross_entropy`): no
        logits tensor, no pass over ``[s, b, V/tp]`` in the backward."""
        if labels is not None:
            return fused_linear_cross_entropy(h, self.output_weight(), labels.t().contiguous(), self.ctx,
                                              self.cfg.vocab_size, sequence_parallel=self.sequence_parallel,
                                              owner=self.output_layer)
        if self.output_layer is not None:
            return self.output_layer(h)
        return vocab_parallel_logits(h, self.output_weight(), self.ctx, self.sequence_parallel)


def model_order(stage_layers: StageLayers, num_layers: int) -> list[tuple[int, int]]:
    """The (pp_rank, chunk) keys in model order (by layer range; an empty stage at a boundary comes
    before the stage that starts there; empty stages at the same boundary keep the mapping's
    insertion order, so build the mapping in model order).

    Raises:
        ValueError: the ranges overlap, leave gaps, or do not cover ``[0, num_layers)``.
    """
    order = sorted(stage_layers, key=lambda k: (stage_layers[k][0], stage_layers[k][0] + stage_layers[k][1]))
    pos = 0
    for key in order:
        first, count = stage_layers[key]
        if count < 0 or first != pos:
            raise ValueError(f"stage_layers: stage {key} holds layers [{first}, {first + count}) but the "
                             f"previous stages end at layer {pos} (ranges must tile [0, {num_layers}))")
        pos = first + count
    if pos != num_layers:
        raise ValueError(f"stage_layers cover layers [0, {pos}), not model.num_layers={num_layers}")
    return order


def build_model_chunks(cfg: ModelConfig, ctx: ParallelContext, *, seed: int, sequence_parallel: bool = False,
                       params_dtype: torch.dtype = torch.float32, stage_layers: StageLayers | None = None,
                       virtual_pipeline: int = 1, rng_tracker=None, context_algorithm: str = "ring"
                       ) -> list[GPTChunk]:
    """This rank's model chunks, in chunk order.

    Args:
        cfg, seed, sequence_parallel, params_dtype, context_algorithm: as in :class:`GPTChunk`.
        ctx: the parallel context (its ``pp`` group gives this rank's stage).
        stage_layers: (pp_rank, chunk) -> (first layer, count), e.g. from
            ``paratron.pipeline.partition``; default: its even split
            (:func:`paratron.pipeline.partition.stage_layers` in the loop placement). The first stage in
            model order holds the embedding, the last the output layer.
        virtual_pipeline: chunks per rank for the default split.
        rng_tracker: shared by all chunks (``chunk.rng_tracker``). Default: when the config has
            dropout, a new ``RNGStatesTracker(seed, ctx)``. This function leaves PyTorch's global
            generators alone: the caller seeds the default stream (``chunk.rng_tracker.
            seed_default_stream()``, as the training setup does) so that every TP rank draws the
            same masks on replicated activations.

    Raises:
        ConfigError: the config does not fit the layout (before any collective).
        ValueError: ``stage_layers`` does not tile the layers.
    """
    model_shape.check_model(cfg, ctx.tp.size)
    pp = ctx.pp.size
    if stage_layers is None:  # the even split, chunk c of rank r holding virtual stage c * pp + r
        try:
            stage_layers = partition.stage_layers(cfg.num_layers, pp, virtual_pipeline)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    order = model_order(stage_layers, cfg.num_layers)
    ranks = {k[0] for k in stage_layers}
    if ranks != set(range(pp)):
        raise ValueError(f"stage_layers names pipeline ranks {sorted(ranks)}; the layout has parallel.pipeline={pp}")
    if rng_tracker is None and (cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
                                or (cfg.lora_rank > 0 and cfg.lora_dropout > 0)):
        rng_tracker = RNGStatesTracker(seed, ctx)
    mine = sorted(k for k in stage_layers if k[0] == ctx.pp.rank)
    chunks: list[GPTChunk] = []
    first_embedding = first_module = None
    for key in mine:
        first, count = stage_layers[key]
        pre, post = key == order[0], key == order[-1]
        shared = first_embedding if (post and not pre and cfg.tie_embeddings) else None
        chunk = GPTChunk(cfg, ctx, seed=seed, layer_ids=range(first, first + count), pre_process=pre,
                         post_process=post, sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                         rng_tracker=rng_tracker, embedding_weight=shared, context_algorithm=context_algorithm,
                         embedding_module=first_module if post and not pre else None)
        if pre:
            first_module = chunk.embedding.word_embeddings
            first_embedding = first_module.weight
        chunks.append(chunk)
    if first_embedding is not None and any(c.post_process for c in chunks):
        # Both ends on one rank share one tensor: nothing to keep in sync across stages.
        first_embedding.meta.shared_embedding = False
    apply_lora(chunks, cfg, ctx, seed=seed, rng_tracker=rng_tracker)  # model.lora_rank > 0 only
    return chunks


def full_logits(logits: torch.Tensor, ctx: ParallelContext, vocab_size: int) -> torch.Tensor:
    """Gather vocab-parallel logits ``[s, b, V_pad/tp]`` over TP and drop the padding: ``[b, s, V]``.

    For evaluation and tests (not differentiable across ranks).
    """
    full = ctx.tp.all_gather(logits.detach().contiguous(), dim=-1)
    return full[..., :vocab_size].transpose(0, 1)

