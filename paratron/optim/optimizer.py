"""The mixed-precision (and optionally distributed, ZeRO-1) optimizer over DDP's grad buffers.

The optimizer never sees a model: it works on the flat ranges of
:class:`~paratron.optim.ddp.DistributedDataParallel`'s buffers that this rank owns (the whole
buffer, or with ZeRO-1 its shard of every bucket, Rajbhandari et al. 2020 section 5.1) and on
the param attributes of :func:`paratron.parallel.params.mark`.

State per owned range, all fp32: main weights (a view of the params themselves when they are
fp32, else an fp32 copy: Micikevicius et al. 2018, section 3.1), and the AdamW moments or the SGD
momentum. The grads must be final before :meth:`Optimizer.step` (the training step calls
:func:`~paratron.optim.finalize.finalize_grads` once: model-parallel all-reduces, then the DP
reduction); ``step()`` only updates, in order:

1. unscale by the loss scale (fp16);
2. one all-reduce over the world of ``[sum of owned squared grads, non-finite flag]``: the global
   grad norm (:mod:`paratron.optim.clip`) and one global decision whether any rank holds an inf
   or NaN grad, so every rank skips together (and updates the fp16 loss scale identically). A
   rank without params (an empty pipeline stage) joins with zeros;
3. on a non-finite step nothing changes (params, moments, step counter): the step is skipped;
4. else clip by the global norm, AdamW or SGD on the main weights, copy them into the params;
5. ZeRO-1: all-gather the updated params of every bucket over the DP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .clip import clip_coefficient, owns_for_norm, sum_of_squares
from .ddp import DistributedDataParallel
from .distributed_optimizer import gather_params
from .precision import precision_dtype
from .update_rules import adamw_step, fused_adamw_step, sgd_step
from .scaler import ConstantLossScaler, DynamicLossScaler
from .state_chunks import chunk_views, rectangles
from .zero import storage_bytes


@dataclass
class StepResult:
    """What one :meth:`Optimizer.step` did (the same on every rank).

    Attributes:
        skipped: the step was skipped (an inf or NaN grad on some rank: fp16 overflow or a
            non-finite grad in any precision); params, moments and the step counter unchanged.
        grad_norm: global L2 norm of the (unscaled, unclipped) grads; inf/nan when skipped.
        loss_scale: the loss scale for the *next* step (1.0 without fp16).
        clip_coeff: the factor the grads were multiplied by (1.0 when not clipped).
        nonfinite: the grads were non-finite and loss scaling cannot be the cure: always with
            fp32/bf16, and with fp16 only when the loss scale was already at its minimum (an
            ordinary fp16 overflow is the scaler's business: skipped, scale backed off).
    """

    skipped: bool
    grad_norm: float
    loss_scale: float
    clip_coeff: float
    nonfinite: bool = False
    read_along: list[float] | None = None
    """The values of ``step(read_along=...)``, brought to the host in the step's one read."""


@dataclass
class _Segment:
    """One owned flat range ``[start, end)`` of buffer ``buffer`` and its fp32 state views."""

    buffer: int
    start: int
    end: int
    grad: torch.Tensor
    main: torch.Tensor
    state: dict[str, torch.Tensor]
    param: torch.Tensor  # the model's storage of the range (a view, or a ZeRO-3 shard)


@dataclass
class _Piece:
    """The part of one param inside one segment: local flat range ``[lo, hi)`` of the param,
    at offset ``at`` of the segment."""

    param: torch.nn.Parameter
    segment: int
    lo: int
    hi: int
    at: int
    shape: tuple[int, ...]  # the param's local shape (its .data is empty between uses with ZeRO-3)


class Optimizer:
    """AdamW or SGD with fp32 main weights and grads, loss scaling, global clipping, ZeRO-1.

    Build with :func:`build_optimizer`. Per step: :meth:`zero_grad`, forward/backward of every
    microbatch (backward of :meth:`scale_loss` ``(loss)`` for fp16), then :meth:`step`.

    Args:
        ddp: the :class:`DistributedDataParallel` whose buffers hold the params and grads;
            ZeRO-1 when it was built with ``use_distributed_optimizer=True``.
        ctx: the parallel context.
        cfg: :class:`paratron.config.OptimizerConfig` (name, lr, weight_decay, betas, eps,
            sgd_momentum, clip_grad, loss-scale fields).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (fp16 gets a dynamic loss scaler).

    Raises:
        ValueError: unknown optimizer name or precision.
    """

    def __init__(self, ddp: DistributedDataParallel, ctx, cfg, *, precision: str = "fp32") -> None:
        precision_dtype(precision)  # validates the name
        if cfg.name not in ("adamw", "sgd"):
            raise ValueError(f"optimizer.name={cfg.name!r} must be 'adamw' or 'sgd'")
        self.ddp, self.ctx, self.cfg, self.precision = ddp, ctx, cfg, precision
        self.lr = float(cfg.lr)
        self.step_count = 0
        # The one device-to-host read of step(); a dry run on meta tensors, which hold no values,
        # replaces it (paratron.dryrun.rehearse: "what a dry run cannot see").
        self.host_values = _tolist
        if precision == "fp16":
            self.scaler = DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale,
                                            cfg.loss_scale_window, cfg.hysteresis)
        else:
            self.scaler = ConstantLossScaler(1.0)
        self.state_names = (("exp_avg", "exp_avg_sq") if cfg.name == "adamw"
                            else (("momentum",) if cfg.sgd_momentum else ()))
        self._allocated: dict[str, list[torch.Tensor]] = {n: [] for n in ("main_param",) + self.state_names}
        self.segments: list[_Segment] = []
        self.pieces: list[_Piece] = []
        self._build_state()
        self._build_views()

    # ---- construction ------------------------------------------------------------------------
    def _build_state(self) -> None:
        for i, buf in enumerate(self.ddp.buffers):
            ranges = self.ddp.owned_ranges(i)
            views = self.ddp.owned_params(i)
            total = sum(e - s for s, e, _ in ranges)
            dev = buf.device
            alias = buf.dtype == torch.float32
            main_flat = None if alias else torch.empty(total, dtype=torch.float32, device=dev)
            if main_flat is not None:
                self._allocated["main_param"].append(main_flat)
            flats = {n: torch.zeros(total, dtype=torch.float32, device=dev) for n in self.state_names}
            for n, t in flats.items():
                self._allocated[n].append(t)
            off = 0
            for (s, e, grad), pview in zip(ranges, views):
                n = e - s
                if alias:
                    main = pview
                else:
                    main = main_flat[off:off + n]
                    main.copy_(pview)
                seg = _Segment(i, s, e, grad, main, {k: v[off:off + n] for k, v in flats.items()},
                               pview)
                seg_id = len(self.segments)
                self.segments.append(seg)
                for p in buf.params:
                    ps, pe = buf.index[id(p)]
                    a, b = max(ps, s), min(pe, e)
                    if a < b:
                        self.pieces.append(_Piece(p, seg_id, a - ps, b - ps, a - s, tuple(buf.shapes[id(p)])))
                off += n

    def _runs(self, want) -> list[tuple[int, int, int]]:
        """Merge pieces with ``want(param)`` into ``(segment, start, end)`` runs of segment
        offsets. A run may span the zero padding between params (its grads and weights stay 0)."""
        runs: list[list[int]] = []
        last_seg, open_run = -1, False
        for pc in self.pieces:  # in segment, then offset order
            if pc.segment != last_seg:
                last_seg, open_run = pc.segment, False
            if want(pc.param):
                if open_run:
                    runs[-1][2] = pc.at + pc.hi - pc.lo
                else:
                    runs.append([pc.segment, pc.at, pc.at + pc.hi - pc.lo])
                    open_run = True
            else:
                open_run = False
        return [tuple(r) for r in runs]

    def _build_views(self) -> None:
        zero = self.ddp.use_distributed_optimizer
        groups = {i: buf.group for i, buf in enumerate(self.ddp.buffers)}
        seg_of = self.segments

        def owner(p) -> bool:
            i = self._buffer_of[id(p)]
            return owns_for_norm(p, self.ctx, dp_rank=max(groups[i].rank, 0), sharded=zero)

        self._buffer_of = {id(pc.param): seg_of[pc.segment].buffer for pc in self.pieces}
        self._norm_views = [seg_of[s].grad[a:b] for s, a, b in self._runs(owner)]
        decay_runs = self._runs(lambda p: not getattr(p, "no_weight_decay", False))
        self._decay_main = [seg_of[s].main[a:b] for s, a, b in decay_runs]
        self._decay_grad = [seg_of[s].grad[a:b] for s, a, b in decay_runs]
        self._grads = [s.grad for s in self.segments]
        self._mains = [s.main for s in self.segments]
        self._aliased = [buf.dtype == torch.float32 for buf in self.ddp.buffers]
        self._fused = self._fused_groups(decay_runs) if self._use_fused() else None

    def _use_fused(self) -> bool:
        impl = self.cfg.adam_impl
        if self.cfg.name != "adamw" or impl == "foreach":
            return False
        return impl == "fused" or self.ctx.device.type == "cuda"

    def _fused_groups(self, decay_runs) -> list:
        """``(mains, grads, exp_avgs, exp_avg_sqs, weight_decay)`` views of the decay and the
        no-decay runs, for :func:`~paratron.optim.update_rules.fused_adamw_step`."""
        plain_runs = self._runs(lambda p: getattr(p, "no_weight_decay", False))
        self._step_t = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        out = []
        for runs, wd in ((decay_runs, float(self.cfg.weight_decay)), (plain_runs, 0.0)):
            segs = [(self.segments[i], a, b) for i, a, b in runs]
            out.append(([s.main[a:b] for s, a, b in segs], [s.grad[a:b] for s, a, b in segs],
                        [s.state["exp_avg"][a:b] for s, a, b in segs],
                        [s.state["exp_avg_sq"][a:b] for s, a, b in segs], wd))
        return out

    # ---- per step ----------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless fp16)."""
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (the loss itself when the scale is 1)."""
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def set_lr(self, lr: float) -> None:
        """Learning rate of the following steps. Raises ValueError when negative."""
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.lr = float(lr)

    def zero_grad(self) -> None:
        """Zero the main grads (DDP's buffers) and start a new step."""
        self.ddp.zero_grad_buffer()

    def step(self, read_along: torch.Tensor | None = None) -> StepResult:
        """Unscale, decide globally whether the grads are finite, clip, update, copy back (and
        all-gather); a non-finite step changes nothing but the fp16 loss scale.

        The skip decision is the step's one device-to-host read (``[sum of squares, non-finite
        flag]`` after their all-reduce). ``read_along``: other device scalars, the same on every
        rank (e.g. the training step's global loss stats), brought to the host in the same
        transfer and returned in :attr:`StepResult.read_along`; a non-finite one skips the step
        like a non-finite grad.

        Returns:
            :class:`StepResult`, identical on every rank.

        Raises:
            RuntimeError: the grads of this step were not finalized (see
                :func:`~paratron.optim.finalize.finalize_grads`).
        """
        if not self.ddp.finalized:
            raise RuntimeError("Optimizer.step(): the grads of this step are not final; call "
                               "paratron.optim.finalize_grads(chunks, ctx, ddp) after the last "
                               "backward (the training step does it once per step)")
        scale = self.scaler.scale
        if scale != 1.0 and self._grads:
            torch._foreach_mul_(self._grads, 1.0 / scale)
        local = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        local[0] = sum_of_squares(self._norm_views)
        if self._grads:  # every local grad, owned for the norm or not: a replica may differ
            sums = torch.stack([g.sum() for g in self._grads])
            local[1] = (~torch.isfinite(sums)).any()
        self.ctx.world.all_reduce(local)
        if read_along is not None:  # a non-finite value there (the loss) skips the step too
            along_t = read_along.detach().to(local.dtype).reshape(-1)
            local[1] = torch.maximum(local[1], (~torch.isfinite(along_t)).any().to(local.dtype))
            local = torch.cat([local, along_t])
        sumsq, flag, *along = self.host_values(local)  # the step's one device-to-host sync
        along = along if read_along is not None else None
        found_inf = flag > 0 or not math.isfinite(sumsq)
        grad_norm = math.sqrt(sumsq) if sumsq >= 0 else float("nan")
        if found_inf:
            return replace(self.skip_step(grad_norm), read_along=along)
        self.scaler.update(False)

        coeff = clip_coefficient(grad_norm, float(self.cfg.clip_grad))
        if coeff < 1.0 and self._grads:
            torch._foreach_mul_(self._grads, coeff)
        self._apply()
        return StepResult(False, grad_norm, self.scaler.scale, coeff, read_along=along)

    def _apply(self) -> None:
        self.step_count += 1
        if self.segments:
            self._update()
        self._publish()

    def skip_step(self, grad_norm: float = float("nan")) -> StepResult:
        """Skip this step on this rank: nothing changes but the fp16 loss scale, which backs off
        as after an overflow. Call it on every rank with the same decision (e.g. a non-finite
        loss, which the training step already knows on every rank), or let :meth:`step` call it.
        """
        at_min = not self.scaler.dynamic or self.scaler.scale <= self.scaler.min_scale
        self.scaler.update(True)
        return StepResult(True, grad_norm, self.scaler.scale, 1.0, nonfinite=at_min)

    def first_nonfinite_param(self) -> str | None:
        """The logical name of the first param (in buffer order) whose local grad holds an inf
        or NaN, or None: for the error message of a stopped run (one pass over the grads)."""
        for pc in self.pieces:
            g = self.segments[pc.segment].grad[pc.at:pc.at + pc.hi - pc.lo]
            if not bool(torch.isfinite(g).all()):
                return pc.param.logical_name
        return None

    def _update(self) -> None:
        c = self.cfg
        st = [[s.state[n] for s in self.segments] for n in self.state_names]
        if self._fused is not None:
            self._step_t.fill_(self.step_count)  # a host-to-device write, no sync
            fused_adamw_step(self._fused, self._step_t, lr=self.lr, beta1=c.adam_beta1,
                             beta2=c.adam_beta2, eps=c.adam_eps)
        elif c.name == "adamw":
            adamw_step(self._mains, self._grads, st[0], st[1], self._decay_main, step=self.step_count,
                       lr=self.lr, beta1=c.adam_beta1, beta2=c.adam_beta2, eps=c.adam_eps,
                       weight_decay=c.weight_decay)
        else:
            sgd_step(self._mains, self._grads, st[0] if st else [], self._decay_main,
                     self._decay_grad, step=self.step_count, lr=self.lr, momentum=c.sgd_momentum,
                     weight_decay=c.weight_decay)

    def _publish(self) -> None:
        """Copy main weights into the params (cast) and, with ZeRO-1/2, all-gather them (ZeRO-3
        gathers each unit at its next use)."""
        for seg in self.segments:
            if not self._aliased[seg.buffer]:
                seg.param.copy_(seg.main)
        if self.ddp.zero in (1, 2):
            gather_params(self.ddp)

    def reload_model_params(self) -> None:
        """Copy the fp32 main weights into the model params (after loading a checkpoint into
        the views of :meth:`sharded_state_dict`); with ZeRO-1 also all-gathers them."""
        self._publish()

    # ---- checkpoints -------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, list[tuple[torch.Tensor, object]]]:
        """This rank's fp32 optimizer state as rectangles of each param's full logical tensor.

        Keys ``optimizer/<kind>/<logical_name>`` with kind ``main_param``, ``exp_avg``,
        ``exp_avg_sq`` (AdamW) or ``momentum`` (SGD with momentum). Each value lists
        ``(view, ShardSpec)``: the view is of the real state storage (fill it in place, then call
        :meth:`reload_model_params`); the ShardSpec places it in the param's global 2-D view
        ``[prod(shape[:-1]), shape[-1]]`` (1-D params as ``[1, n]``), vocab padding excluded (see
        :mod:`paratron.optim.state_chunks`). Replicated params (TP, DP without ZeRO, tied
        embedding copies) appear on every rank that holds them, with identical ShardSpecs.
        """
        out: dict[str, list] = {}
        for pc in self.pieces:
            p = pc.param
            rects = rectangles(pc.shape, p.shard, pc.lo, pc.hi, p.logical_name)
            if not rects:
                continue
            seg = self.segments[pc.segment]
            start = pc.at - pc.lo  # segment offset of the param's flat element 0
            kinds = {"main_param": seg.main, **seg.state}
            for kind, flat in kinds.items():
                views = chunk_views(flat[start + pc.lo:start + pc.hi], pc.lo, rects)
                out.setdefault(f"optimizer/{kind}/{p.logical_name}", []).extend(views)
        return out

    def scalar_state(self) -> dict:
        """Plain numbers: the step count, the lr and the loss scaler's state."""
        return {"step": self.step_count, "lr": self.lr, **self.scaler.state_dict()}

    def load_scalar_state(self, d: dict) -> None:
        """Restore :meth:`scalar_state` (missing keys keep their current values)."""
        self.step_count = int(d.get("step", self.step_count))
        self.lr = float(d.get("lr", self.lr))
        if "loss_scale" in d:
            self.scaler.load_state_dict(d)

    def allocated_state(self) -> dict[str, list[torch.Tensor]]:
        """The state tensors this optimizer allocated (main weights only when the params are
        not fp32), by kind: what its memory is made of."""
        return self._allocated

    def state_bytes(self) -> int:
        """Bytes of the storages behind :meth:`allocated_state`."""
        return storage_bytes(t for ts in self._allocated.values() for t in ts)


def _tolist(t: torch.Tensor) -> list[float]:
    return t.tolist()


def build_optimizer(chunks, ctx, opt_cfg, ddp: DistributedDataParallel | None = None, *,
                    precision: str = "fp32") -> Optimizer:
    """The optimizer for ``chunks``: AdamW or SGD (``opt_cfg.name``), ZeRO-1 when ``ddp`` was
    built with ``use_distributed_optimizer=True``.

    Args:
        chunks: the model chunks ``ddp`` wraps (a plain DDP with default settings is built when
            ``ddp`` is None).
        ctx: the parallel context.
        opt_cfg: :class:`paratron.config.OptimizerConfig`.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.

    Raises:
        ValueError: bad precision or optimizer name; params whose dtype is not ``precision``'s
            (norms kept in fp32 are allowed); main grads that are not fp32.
    """
    want = precision_dtype(precision)
    if ddp is None:
        ddp = DistributedDataParallel(chunks, ctx)
    if ddp.grad_dtype != torch.float32:
        raise ValueError(f"DistributedDataParallel(grad_dtype={ddp.grad_dtype}): the optimizer needs "
                         "fp32 main grads (grad_dtype=torch.float32)")
    for p in ddp.params:
        if p.dtype not in (want, torch.float32):
            raise ValueError(f"{p.logical_name}: dtype {p.dtype} does not match "
                             f"train.precision={precision!r}")
    return Optimizer(ddp, ctx, opt_cfg, precision=precision)
