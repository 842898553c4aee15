"""The mixed-precision (and optionally distributed, ZeRO-1) optimizer over DDP's grad buffers.

The optimizer never sees a model: it works on the flat ranges of
:class:`~paratron.optim.ddp.DistributedDataParallel`'s buffers that this rank owns (the whole
buffer, or with ZeRO-1 its shard of every bucket, Rajbhandari et al. 2020 section 5.1) and on
the param attributes of :func:`paratron.parallel.params.mark`.

State per owned range: fp32 main weights (a view of the params themselves when they are
fp32, else an fp32 copy: Micikevicius et al. 2018, section 3.1), and the AdamW moments or the SGD
momentum (fp32, or bf16 with ``optimizer.exp_avg_dtype`` / ``exp_avg_sq_dtype``: stored in bf16,
stepped in fp32). Under Muon (:mod:`paratron.optim.muon`) its matrices hold a momentum and the
other params the AdamW moments, each allocated over its own params' runs only. The grads must be final before :meth:`Optimizer.step` (the training step calls
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

from ..parallel.context import ParallelContext
from .clip import clip_coefficient, owns_for_norm, sum_of_squares
from .ddp import DistributedDataParallel
from .distributed_optimizer import gather_params
from .precision import precision_dtype
from .muon import MuonStep, uses_muon
from .offload import copy_grads_to_host, offload_plan
from .update_rules import adamw_step, fused_adamw_step, sgd_step
from .scaler import ConstantLossScaler, DynamicLossScaler
from .state_chunks import chunk_views, copy_param_into_views, rectangles
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
    aliased: bool = False  # main is the param itself (fp32 params, not offloaded)
    host_grad: torch.Tensor | None = None  # offloaded: the host copy of grad the step reads


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
    """AdamW, SGD or Muon with fp32 main weights and grads, loss scaling, global clipping, ZeRO-1.

    Build with :func:`build_optimizer`. Per step: :meth:`zero_grad`, forward/backward of every
    microbatch (backward of :meth:`scale_loss` ``(loss)`` for fp16), then :meth:`step`.

    Args:
        ddp: the :class:`DistributedDataParallel` whose buffers hold the params and grads;
            ZeRO-1 when it was built with ``zero=1``.
        ctx: the parallel context.
        cfg: :class:`paratron.config.OptimizerConfig` (name, lr, weight_decay, betas, eps,
            sgd_momentum, clip_grad, loss-scale fields).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (fp16 gets a dynamic loss scaler).

    Raises:
        ValueError: unknown optimizer name or precision.
    """

    def __init__(self, ddp: DistributedDataParallel, ctx: ParallelContext, cfg, *,
                 precision: str = "fp32") -> None:
        precision_dtype(precision)  # validates the name
        if cfg.name not in ("adamw", "sgd", "muon"):
            raise ValueError(f"optimizer.name={cfg.name!r} must be 'adamw', 'sgd' or 'muon'")
        self._state_dtypes = {"exp_avg": state_dtype(cfg, "exp_avg_dtype"),
                              "exp_avg_sq": state_dtype(cfg, "exp_avg_sq_dtype")}
        self._state_dtypes["momentum"] = self._state_dtypes["exp_avg"]
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
        kinds = _state_kinds(cfg)
        self.state_names = tuple(k for k, want in kinds.items() if want is None)  # segment-wide
        self._allocated: dict[str, list[torch.Tensor]] = {n: [] for n in ("main_param",) + tuple(kinds)}
        self.segments: list[_Segment] = []
        self.pieces: list[_Piece] = []
        self._offload = offload_plan(ddp, cfg)
        self._build_state()
        self._run_state = {k: self._allocate_runs(k, want) for k, want in kinds.items() if want is not None}
        self._runs_by_segment = {}
        for kind, runs in self._run_state.items():
            for s, a, b, view in runs:
                self._runs_by_segment.setdefault(s, []).append((kind, a, b, view))
        self._piece_state = [self._state_of_piece(pc) for pc in self.pieces]
        self._build_views()
        self._muon = (MuonStep(self, {id(pc): st["momentum"] for pc, st in zip(self.pieces, self._piece_state)
                                      if "momentum" in st}) if cfg.name == "muon" else None)

    # ---- construction ------------------------------------------------------------------------
    def _build_state(self) -> None:
        for i, buf in enumerate(self.ddp.buffers):
            ranges = self.ddp.owned_ranges(i)
            views = self.ddp.owned_params(i)
            host = [self._offload.pop(0) for _ in ranges]
            pools = {h: self._pool(buf, sum(e - s for (s, e, _), hh in zip(ranges, host) if hh == h), h)
                     for h in set(host)}
            offs = dict.fromkeys(pools, 0)
            for (s, e, grad), pview, h in zip(ranges, views, host):
                n, off = e - s, offs[h]
                main_flat, flats, grad_flat = pools[h]
                main = pview if main_flat is None else main_flat[off:off + n]
                if main_flat is not None:
                    main.copy_(pview)
                seg = _Segment(i, s, e, grad, main, {k: v[off:off + n] for k, v in flats.items()}, pview,
                               aliased=main_flat is None,
                               host_grad=grad_flat[off:off + n] if grad_flat is not None else None)
                seg_id = len(self.segments)
                self.segments.append(seg)
                for p in buf.params:
                    ps, pe = buf.index[id(p)]
                    a, b = max(ps, s), min(pe, e)
                    if a < b:
                        self.pieces.append(_Piece(p, seg_id, a - ps, b - ps, a - s, tuple(buf.shapes[id(p)])))
                offs[h] += n

    def _pool(self, buf, total: int, host: bool):
        """``(main weights or None when they alias fp32 params, {kind: state}, host grads or
        None)``: flat storage for ``total`` owned elements of ``buf``, on its device or, offloaded,
        in (pinned, on CUDA) host memory."""
        dev = torch.device("cpu") if host else buf.device
        pin = host and buf.device.type == "cuda"

        def new(dtype, zero=True):
            t = torch.empty(total, dtype=dtype, device=dev, pin_memory=pin)
            return t.zero_() if zero else t

        main = None if buf.dtype == torch.float32 and not host else new(torch.float32, zero=False)
        if main is not None:
            self._allocated["main_param"].append(main)
        flats = {n: new(self._state_dtypes[n]) for n in self.state_names}
        for n, t in flats.items():
            self._allocated[n].append(t)
        return main, flats, (new(torch.float32, zero=False) if host else None)

    def _allocate_runs(self, kind: str, want) -> list[tuple[int, int, int, torch.Tensor]]:
        """State ``kind`` for the params with ``want(param)`` only (Muon's momentum, its AdamW
        params' moments): one flat tensor over their runs; ``(segment, start, end, view)`` per run."""
        runs = self._runs(want)
        flat = torch.zeros(sum(b - a for _, a, b in runs), dtype=self._state_dtypes[kind], device=self.ctx.device)
        self._allocated[kind].append(flat)
        out, off = [], 0
        for seg, a, b in runs:
            out.append((seg, a, b, flat[off:off + b - a]))
            off += b - a
        return out

    def _state_of_piece(self, pc: _Piece) -> dict[str, torch.Tensor]:
        """The 1-D state views of one piece (``hi - lo`` long) by kind, main weights included."""
        seg, n = self.segments[pc.segment], pc.hi - pc.lo
        out = {"main_param": seg.main[pc.at:pc.at + n]}
        out.update({k: v[pc.at:pc.at + n] for k, v in seg.state.items()})
        for kind, a, b, view in self._runs_by_segment.get(pc.segment, ()):
            if a <= pc.at < b:
                out[kind] = view[pc.at - a:pc.at - a + n]
        return out

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
        zero = self.ddp.zero >= 1
        groups = {i: buf.group for i, buf in enumerate(self.ddp.buffers)}
        seg_of = self.segments

        def owner(p) -> bool:
            i = self._buffer_of[id(p)]
            return owns_for_norm(p, self.ctx, dp_rank=max(groups[i].rank, 0), sharded=zero)

        self._buffer_of = {id(pc.param): seg_of[pc.segment].buffer for pc in self.pieces}
        self._norm_views = [seg_of[s].grad[a:b] for s, a, b in self._runs(owner)]
        # When the norm reads every local grad, a finite sum of squares already says that every
        # grad is finite: the separate non-finite pass over the grads is only for replicas.
        self._check_replicas = not all(owner(pc.param) for pc in self.pieces)
        decay_runs = self._runs(lambda p: not p.meta.no_weight_decay)
        self._decay_main = [seg_of[s].main[a:b] for s, a, b in decay_runs]
        self._grads = [s.grad for s in self.segments]
        self._places = self._place_views(decay_runs)
        self._fused = self._fused_groups(decay_runs) if self._use_fused() else None
        if self.cfg.name == "muon":
            self._build_muon_adamw_views()

    def _place_views(self, decay_runs) -> list[dict]:
        """The update's views per place (device segments, then offloaded ones): ``mains``,
        ``grads`` (the host copies when offloaded), ``state`` (per state name), ``decay`` and
        ``decay_grads``. One foreach call never mixes host and device tensors."""
        out = []
        for host in (False, True):
            segs = [(k, sg) for k, sg in enumerate(self.segments) if (sg.host_grad is not None) == host]
            if not segs:
                continue
            grad = {k: (sg.host_grad if host else sg.grad) for k, sg in segs}
            decay = [(k, a, b) for k, a, b in decay_runs if k in grad]
            out.append({"mains": [sg.main for _, sg in segs], "grads": [grad[k] for k, _ in segs],
                        "state": [[sg.state[n] for _, sg in segs] for n in self.state_names],
                        "decay": [self.segments[k].main[a:b] for k, a, b in decay],
                        "decay_grads": [grad[k][a:b] for k, a, b in decay]})
        return out

    def _build_muon_adamw_views(self) -> None:
        """Under Muon, AdamW steps the runs of the other params (:func:`muon.uses_muon`)."""
        seg_of, runs = self.segments, self._run_state
        self._adam_lists = ([seg_of[s].main[a:b] for s, a, b, _ in runs["exp_avg"]],
                            [seg_of[s].grad[a:b] for s, a, b, _ in runs["exp_avg"]],
                            [v for *_, v in runs["exp_avg"]], [v for *_, v in runs["exp_avg_sq"]])
        decay = self._runs(lambda p: not uses_muon(p) and not p.meta.no_weight_decay)
        self._decay_main = [seg_of[s].main[a:b] for s, a, b in decay]

    def _use_fused(self) -> bool:
        impl = self.cfg.adam_impl
        if self.cfg.name != "adamw" or impl == "foreach" or self._low_precision_state() \
                or any(sg.host_grad is not None for sg in self.segments):
            return False
        # auto: fused on every device: on the CPU too, one pass over the four flat buffers runs
        # about 3.5x faster than the foreach chain (benchmarks/README.md, the layout-(1) step).
        return True

    def _fused_groups(self, decay_runs) -> list:
        """``(mains, grads, exp_avgs, exp_avg_sqs, weight_decay)`` views of the decay and the
        no-decay runs, for :func:`~paratron.optim.update_rules.fused_adamw_step`."""
        plain_runs = self._runs(lambda p: p.meta.no_weight_decay)
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
        if self._grads and self._check_replicas:  # the grads the norm skips: a replica may differ
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
        if coeff < 1.0 and self._grads and self._fused is None:
            torch._foreach_mul_(self._grads, coeff)  # the fused kernel clips as it reads the grads
        self._apply(coeff)
        return StepResult(False, grad_norm, self.scaler.scale, coeff, read_along=along)

    def _apply(self, clip_coeff: float = 1.0) -> None:
        self.step_count += 1
        if self.segments:
            self._update(clip_coeff)
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
                return pc.param.meta.logical_name
        return None

    def _low_precision_state(self) -> bool:
        return any(d != torch.float32 for d in self._state_dtypes.values())

    def _update(self, clip_coeff: float = 1.0) -> None:
        """The update rule on the owned ranges; ``clip_coeff`` < 1: the grads are not yet
        clipped (the fused path multiplies them as it reads them), else already are."""
        c = self.cfg
        if self._fused is not None:
            self._step_t.fill_(self.step_count)  # a host-to-device write, no sync
            fused_adamw_step(self._fused, self._step_t, lr=self.lr, beta1=c.adam_beta1,
                             beta2=c.adam_beta2, eps=c.adam_eps, clip_coeff=clip_coeff)
            return
        if c.name == "muon":
            self._adamw(*self._adam_lists, self._decay_main)
            self._muon.step(self.lr)
            return
        copy_grads_to_host(self.segments)
        for pl in self._places:
            if c.name == "adamw":
                self._adamw(pl["mains"], pl["grads"], *pl["state"], pl["decay"])
            else:
                sgd_step(pl["mains"], pl["grads"], pl["state"][0] if pl["state"] else [], pl["decay"],
                         pl["decay_grads"], step=self.step_count, lr=self.lr, momentum=c.sgd_momentum,
                         weight_decay=c.weight_decay)

    def _adamw(self, mains, grads, exp_avgs, exp_avg_sqs, decay) -> None:
        """AdamW on matching views, decaying ``decay`` (sub-views of ``mains``). Moments stored in bf16
        (``optimizer.exp_avg_dtype`` / ``exp_avg_sq_dtype``, Megatron's precision-aware optimizer)
        are stepped in fp32, one view at a time (so the fp32 copies are one bucket shard at most),
        and rounded back to their dtype."""
        c = self.cfg
        if c.weight_decay and decay:
            torch._foreach_mul_(decay, 1.0 - self.lr * c.weight_decay)
        kw = dict(step=self.step_count, lr=self.lr, beta1=c.adam_beta1, beta2=c.adam_beta2, eps=c.adam_eps,
                  weight_decay=0.0)
        if not self._low_precision_state():
            adamw_step(mains, grads, exp_avgs, exp_avg_sqs, [], **kw)
            return
        for main, grad, m, v in zip(mains, grads, exp_avgs, exp_avg_sqs):
            m32, v32 = m.float(), v.float()
            adamw_step([main], [grad], [m32], [v32], [], **kw)
            m.copy_(m32)
            v.copy_(v32)

    def _publish(self) -> None:
        """Copy main weights into the params (cast) and, with ZeRO-1/2, all-gather them (ZeRO-3
        gathers each unit at its next use)."""
        for seg in self.segments:
            if not seg.aliased:  # host to device when offloaded, overlapping the next copies
                seg.param.copy_(seg.main, non_blocking=seg.host_grad is not None)
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
        for pc, kinds in zip(self.pieces, self._piece_state):
            p = pc.param
            rects = rectangles(pc.shape, p.meta.shard, pc.lo, pc.hi, p.meta.logical_name)
            if not rects:
                continue
            for kind, flat in kinds.items():
                views = chunk_views(flat, pc.lo, rects)
                out.setdefault(f"optimizer/{kind}/{p.meta.logical_name}", []).extend(views)
        return out

    def copy_params_into_main(self, params) -> None:
        """Set the fp32 main weights from the model ``params`` (an iterable of the chunks'
        params, just loaded).

        Used when loading weights without optimizer state: the main weights were initialised from
        the params at construction, before the load. Each main-weight view of
        :meth:`sharded_state_dict` (``optimizer/main_param/<logical_name>``) is a rectangle of the
        param's 2-D view ``[prod(shape[:-1]), shape[-1]]`` (:mod:`paratron.optim.state_chunks`).
        """
        by_name = {p.meta.logical_name: p for p in params}
        prefix = "optimizer/main_param/"
        for key, views in self.sharded_state_dict().items():
            if key.startswith(prefix):
                copy_param_into_views(by_name[key[len(prefix):]], views)

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


STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def state_dtype(cfg, field: str) -> torch.dtype:
    """The storage dtype of a moment (``optimizer.exp_avg_dtype`` or ``exp_avg_sq_dtype``).

    Raises:
        ValueError: not ``fp32`` or ``bf16``, naming the field.
    """
    name = getattr(cfg, field, "fp32")
    if name not in STATE_DTYPES:
        raise ValueError(f"optimizer.{field}={name!r} must be one of {sorted(STATE_DTYPES)}")
    return STATE_DTYPES[name]


def _state_kinds(cfg) -> dict:
    """State kind -> which params hold it: None for every param (segment-wide flats), else a
    predicate (Muon: momentum for its matrices, AdamW moments for the rest)."""
    if cfg.name == "adamw":
        return {"exp_avg": None, "exp_avg_sq": None}
    if cfg.name == "sgd":
        return {"momentum": None} if cfg.sgd_momentum else {}

    def adam(p) -> bool:
        return not uses_muon(p)

    return {"exp_avg": adam, "exp_avg_sq": adam, "momentum": uses_muon}


def build_optimizer(chunks, ctx: ParallelContext, opt_cfg, ddp: DistributedDataParallel | None = None, *,
                    precision: str = "fp32") -> Optimizer:
    """The optimizer for ``chunks``: AdamW or SGD (``opt_cfg.name``), ZeRO-1 when ``ddp`` was
    built with ``zero=1``.

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
            raise ValueError(f"{p.meta.logical_name}: dtype {p.dtype} does not match "
                             f"train.precision={precision!r}")
    return Optimizer(ddp, ctx, opt_cfg, precision=precision)
