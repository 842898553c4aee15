"""One training (or evaluation) step over a global batch, through the pipeline schedule.

Loss normalisation: the global batch's loss is the token mean over every valid label of every
microbatch on every DP rank, ``sum(token losses) / sum(valid tokens)``. Each microbatch's loss is
divided by that global count *before* backward, so gradients are summed (not averaged) across
microbatches and DP ranks and equal the single-device gradient whatever the split.

No host sync: the token count, the loss sum and the aux loss stay on ``ctx.device`` as one
tensor (:attr:`StepOutput.stats`); reading a value (:meth:`StepOutput.read`, or the ``loss``,
``num_tokens``, ``aux_loss`` properties) is the one device-to-host transfer, which the training
loop makes once per log interval for all the steps since the last one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from paratron.models.moe.layer import set_aux_loss_scale, update_expert_bias
from paratron.models.moe.seq_aux import count_global_sequences
from paratron.models.mtp import MTP_KEYS, count_mtp_tokens, mtp_loss
from paratron.optim import finalize_grads, precision_dtype
from paratron.pipeline.overlap import overlap_fb
from paratron.pipeline.registry import build_schedule, config_options
from paratron.pipeline.runtime import run_pipeline

IGNORE_INDEX = -100


@dataclass
class StepOutput:
    """One global batch's results, the same on every rank.

    Attributes:
        stats: fp64 ``[4]`` on the device: global token-mean LM loss, the MoE aux loss (summed
            over MoE layers and stages for the last microbatch, averaged over DP; 0 without
            MoE), valid tokens of the global batch, the multi-token-prediction loss (mean over
            the MTP modules of each one's token mean, without ``mtp_loss_scaling_factor``; 0
            without MTP).
        has_aux: the model has MoE layers (``aux_loss`` is None otherwise).
        timings: host seconds (``forward_backward``; launch time on a GPU).
        has_mtp: the model has MTP modules (``mtp_loss`` is None otherwise).
    """

    stats: torch.Tensor
    has_aux: bool
    timings: dict[str, float]
    _read: list[float] | None = None
    has_mtp: bool = False

    def read(self) -> dict:
        """``{"loss", "num_tokens", "aux_loss", "mtp_loss"}`` as Python numbers (one device-to-host copy,
        cached)."""
        if self._read is None:
            self._read = self.stats.tolist()
        return self.values_from(self._read)

    def values_from(self, row: list[float]) -> dict:
        """The values of :meth:`read` from ``stats.tolist()`` read elsewhere (e.g. many steps'
        stats stacked into one transfer)."""
        self._read = list(row)
        return {"loss": row[0], "num_tokens": int(row[2]), "aux_loss": row[1] if self.has_aux else None,
                "mtp_loss": row[3] if self.has_mtp else None}

    @property
    def loss(self) -> float:
        """Global-batch token-mean LM loss."""
        return self.read()["loss"]

    @property
    def num_tokens(self) -> int:
        """Valid tokens in the global batch."""
        return self.read()["num_tokens"]

    @property
    def aux_loss(self) -> float | None:
        return self.read()["aux_loss"]

    @property
    def mtp_loss(self) -> float | None:
        """Multi-token-prediction loss (see ``stats``), or None without MTP modules."""
        return self.read()["mtp_loss"]


def count_global_tokens(microbatches: list[dict], ctx) -> torch.Tensor:
    """Valid labels over this rank's microbatches, summed over DP x CP (each CP rank holds its own
    tokens of the same sequences): fp64 ``[1]`` on ``ctx.device`` (counted where the labels are,
    then copied: no host sync)."""
    local = torch.stack([(mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches]).sum()
    t = local.to(device=ctx.device, dtype=torch.float64).reshape(1)
    ctx.dp_cp.all_reduce(t)
    return t


def rank_actions(cfg, ctx, num_microbatches: int, microbatch_time: float | None = None) -> list:
    """This rank's action list of the configured pipeline schedule (build once, reuse every step),
    with the keywords the schedule takes from the config (``1f1b-delay``: the link latencies of
    ``parallel.pipeline_link_latency_ms``) and ``microbatch_time`` (s, measured; see
    :func:`paratron.pipeline.registry.config_options`)."""
    p = cfg.parallel
    options = config_options(p.schedule, p, microbatch_time) or {}
    lists = build_schedule(p.schedule, ctx.pp.size, num_microbatches, p.virtual_pipeline, **options)
    if p.overlap_moe_expert_parallel_comm:
        lists = overlap_fb(lists)  # F/B pairs (DeepSeek-V3 DualPipe overlap of the MoE all-to-alls)
    return lists[ctx.pp.rank]


def needs_microbatch_time(cfg) -> bool:
    """The configured schedule needs a measured microbatch time (``1f1b-delay`` with link
    latencies but no ``parallel.pipeline_microbatch_time_ms``): the first step is recorded."""
    return config_options(cfg.parallel.schedule, cfg.parallel) is None


def run_global_batch(cfg, ctx, chunks, microbatches: list[dict], *, forward_only: bool,
                     loss_scale: float = 1.0, actions: list | None = None, ddp=None, timeline=None) -> StepOutput:
    """Run forward (and backward unless ``forward_only``) of every microbatch of one global batch.

    With backward, the grads are final on return (:func:`paratron.optim.finalize_grads`, once):
    the schedule tells ``ddp`` which backward is the last of each chunk, so its buckets are
    reduced while the rest of the schedule runs.

    Args:
        microbatches: this DP rank's microbatches, each ``{"tokens": [b, s], "labels": [b, s]}``
            (``s`` may differ between microbatches: token-balanced rows, ``b = 1``).
        loss_scale: multiplies the loss fed to backward (fp16 dynamic loss scaling).
        actions: this rank's schedule (:func:`rank_actions`); built here when None.
        ddp: the chunks' :class:`~paratron.optim.ddp.DistributedDataParallel` (None: plain ``.grad``).
        timeline: a list: the pipeline runtime appends one event per action to it (``run_pipeline``).

    Returns: :class:`StepOutput` with the global-batch loss, known on every rank.
    """
    t0 = time.perf_counter()
    global_tokens = count_global_tokens(microbatches, ctx)
    # fp32 0-dim (exact up to 2^24 tokens); an all-ignored batch gives loss 0, not NaN.
    denom = global_tokens[0].clamp(min=1.0).float()
    lm_losses: list[torch.Tensor] = []
    mtp = _MTPLoss(cfg, ctx, microbatches)

    def forward_step(chunk_id, chunk, input_tensor, mb):
        x = mb["tokens"].to(ctx.device) if chunk.pre_process else input_tensor
        # Packed documents (data.reset_position_ids / reset_attention_mask): every chunk needs them.
        packed = {k: mb[k].to(ctx.device) for k in ("position_ids", "cu_seqlens") if k in mb}
        if not chunk.post_process:
            return chunk(x, **packed)
        out = chunk(x, labels=mb["labels"].to(ctx.device), **packed, **mtp.inputs(mb))
        losses, mtp_losses = out if isinstance(out, tuple) else (out, None)  # [s, b] fp32, 0 where ignored
        loss = losses.sum() / denom
        lm_losses.append(loss.detach())
        loss = mtp.add(loss, mtp_losses)
        return loss * loss_scale if loss_scale != 1.0 else loss

    if cfg.model.num_experts > 0:
        _scale_aux_losses(cfg, ctx, chunks, microbatches, loss_scale)
    if actions is None:
        actions = rank_actions(cfg, ctx, len(microbatches))
    shapes = [_activation_shape(cfg, ctx, mb) for mb in microbatches]
    varied = any(shape != shapes[0] for shape in shapes)  # token-balanced rows (data.microbatch_tokens)
    run_pipeline(actions, chunks, ctx, microbatches, forward_step, tensor_shape=shapes[0],
                 tensor_shapes=shapes if varied else None,
                 dtype=precision_dtype(cfg.train.precision), forward_only=forward_only, grad_sync=ddp,
                 timeline=timeline)
    if not forward_only:
        finalize_grads(chunks, ctx, ddp)
        update_expert_bias(chunks, ctx)  # DeepSeek-V3 router bias; no-op without one
    t1 = time.perf_counter()

    stats = _global_stats(ctx, chunks, lm_losses, global_tokens, mtp.values)
    return StepOutput(stats, _has_aux(cfg, chunks), {"forward_backward": t1 - t0}, has_mtp=mtp.depth > 0)


def _has_aux(cfg, chunks) -> bool:
    return cfg.model.num_experts > 0 or any(getattr(mod, "last_aux_loss", None) is not None
                                            for c in chunks for mod in c.modules())


class _MTPLoss:
    """The multi-token-prediction term of the loss (:mod:`paratron.models.mtp`): its inputs per
    microbatch, ``lambda *`` its value added to the LM loss, and the values for the log."""

    def __init__(self, cfg, ctx, microbatches: list[dict]):
        self.depth, self.scale, self.device = cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor, ctx.device
        self.counts = count_mtp_tokens(microbatches, ctx) if self.depth else None
        self.values: list[torch.Tensor] = []

    def inputs(self, mb: dict) -> dict:
        return {k: mb[k].to(self.device) for k in MTP_KEYS if k in mb} if self.depth else {}

    def add(self, loss: torch.Tensor, per_token: torch.Tensor | None) -> torch.Tensor:
        if per_token is None:
            return loss

        value = mtp_loss(per_token, self.counts)
        self.values.append(value.detach())
        return loss + self.scale * value


def _activation_shape(cfg, ctx, mb: dict) -> tuple[int, int, int]:
    """``[s, b, h]`` (``[s/tp, b, h]`` under SP) of the activations a microbatch sends between
    pipeline stages; every stage holds the microbatch, so each knows every shape (no header)."""
    b, seq = mb["tokens"].shape
    return (seq // ctx.tp.size if cfg.parallel.sequence_parallel else seq, b, cfg.model.hidden_size)


def _scale_aux_losses(cfg, ctx, chunks, microbatches: list[dict], loss_scale: float) -> None:
    """MoE aux-loss grads: coeff x the mean over every microbatch (or, for the sequence-level
    loss, every sequence) of the global batch, scaled like the LM loss (see
    :mod:`paratron.models.moe.layer`)."""
    if cfg.model.moe_aux_loss_type == "seq":
        set_aux_loss_scale(chunks, loss_scale / count_global_sequences(microbatches, ctx))
    else:
        # Every DP rank's count of the global batch (the split may be uneven: TrainState.dp_microbatches).
        set_aux_loss_scale(chunks, loss_scale / (cfg.train.global_batch_size // cfg.train.micro_batch_size))


def _global_stats(ctx, chunks, lm_losses: list[torch.Tensor], global_tokens: torch.Tensor,
                  mtp_losses: list[torch.Tensor]) -> torch.Tensor:
    """``[LM loss, MoE aux loss, valid tokens, MTP loss]`` of the global batch, fp64 on ``ctx.device`` (no
    host read), the same on every rank.

    The loss lives on the last stage of each pipeline; it is summed over pp (others add 0), dp
    and cp (each CP rank holds its tokens' share; the aux values, summed over MoE layers and
    stages for the last microbatch, are the same on every CP rank and averaged over DP x CP).
    """
    stats = torch.zeros(4, dtype=torch.float64, device=ctx.device)
    if lm_losses:
        stats[0] = torch.stack(lm_losses).double().sum()
    if mtp_losses:
        stats[3] = torch.stack(mtp_losses).double().sum()
    aux = _aux_loss(chunks)
    if aux is not None:
        stats[1] = aux
    ctx.pp.all_reduce(stats)
    ctx.dp_cp.all_reduce(stats)
    stats[1] /= ctx.dp_cp.size
    stats[2] = global_tokens[0]
    return stats


def _aux_loss(chunks) -> torch.Tensor | None:
    """Sum of the MoE layers' load-balancing losses seen in the last forward passes (a device
    tensor: no sync), or None without MoE layers."""
    found = [getattr(mod, "last_aux_loss", None) for chunk in chunks for mod in chunk.modules()]
    found = [torch.as_tensor(v).double() for v in found if v is not None]
    return torch.stack(found).sum() if found else None
