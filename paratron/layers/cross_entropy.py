"""Cross-entropy over vocab-parallel logits, without gathering the vocabulary (Shoeybi et al.
2019, section 3: "fuse the output of the parallel GEMM with the cross entropy loss", which
communicates ``b*s`` scalars instead of ``b*s*v`` logits).

Per token, each TP rank reduces its vocab slice to a max, a sum of exponentials, the target
logit (zero unless the label falls in its slice) and, for label smoothing, a sum of logits; two
small all-reduces (max, then one stacked sum) give every rank the same loss. Padded vocab columns
(at or past ``vocab_size``) never enter any of these sums and get exactly zero gradient. With one
TP rank the same loss comes from one fused ``log_softmax`` pass (no collective to split around).

:func:`fused_linear_cross_entropy` also does the output layer's GEMM ``X W^T`` and computes the
logits' gradient in the forward (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary
Language Models", and Liger-Kernel's fused linear cross-entropy fold the loss into the output
layer the same way): the ``[tokens, V/tp]`` logits buffer is turned in place into the softmax
and then into ``softmax - onehot``, which the backward uses as is. The per-token upstream grad
``g`` is a row scale, so the backward applies it to the two GEMMs' small operands and results
(``dX = diag(g) (G W)``, ``dW = G^T (diag(g) X)``) instead of to the ``[tokens, V/tp]`` grad:
the backward is the two GEMMs and nothing else of that size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.comm import Group
from ..parallel.context import ParallelContext
from ..parallel.mappings import copy_to_tp_region, gather_from_sequence_parallel_region
from .linear import _weight_grads

__all__ = ["vocab_parallel_cross_entropy", "fused_linear_cross_entropy"]


def _vocab_parallel_stats_(x, labels, group: Group, start: int, vocab_size: int, ignore_index: int,
                           label_smoothing: float, inplace: bool):
    """Per-token losses of this rank's fp32 logits ``x [T, n_valid]`` (any leading dims; its
    vocab slice starts at ``start``), and their softmax. ``inplace``: ``x`` (a buffer the caller
    owns) is shifted, exponentiated and normalised in place and becomes the softmax; else ``x``
    is left alone and the softmax is a new tensor. Either way, the same operations in the same
    order. Returns ``(loss, softmax, index, mine, valid)``: ``index`` the label's local column
    (0 where not ``mine``), ``mine`` where it falls in this slice, ``valid`` where it is not
    ``ignore_index``."""
    n_valid, lead = x.shape[-1], x.shape[:-1]
    gmax = x.amax(dim=-1) if n_valid else torch.full(lead, float("-inf"), device=x.device)
    group.all_reduce(gmax, op=dist.ReduceOp.MAX)
    shifted = x.sub_(gmax.unsqueeze(-1)) if inplace else x - gmax.unsqueeze(-1)

    valid = labels != ignore_index
    local_label = labels - start
    mine = valid & (local_label >= 0) & (local_label < n_valid)
    index = local_label.clamp(0, max(n_valid - 1, 0)).masked_fill(~mine, 0)
    if n_valid:
        target = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    else:
        target = torch.zeros(lead, device=x.device)
    parts = [None, target]
    if label_smoothing > 0:
        parts.append(shifted.sum(dim=-1))
    exp = shifted.exp_()  # shifted is ours (a new tensor or the caller's buffer)
    parts[0] = exp.sum(dim=-1)
    stats = torch.stack(parts)  # one all-reduce for every per-token sum
    group.all_reduce(stats)
    sum_exp = stats[0]
    log_z = sum_exp.log()  # log-sum-exp of the shifted logits
    loss = log_z - stats[1]
    if label_smoothing > 0:
        # PyTorch's definition: (1-eps) * nll + eps * mean_j(-log p_j) over the true vocab.
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab_size)
    loss = loss.masked_fill(~valid, 0.0)
    return loss, exp.div_(sum_exp.unsqueeze(-1)), index, mine, valid


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, labels, group: Group, vocab_size: int, ignore_index: int,
                label_smoothing: float):
        local_v = logits.shape[-1]
        start = group.rank * local_v
        n_valid = max(0, min(vocab_size - start, local_v))
        loss, softmax, index, mine, valid = _vocab_parallel_stats_(
            logits[..., :n_valid].float(), labels, group, start, vocab_size, ignore_index, label_smoothing,
            inplace=False)
        fctx.save_for_backward(softmax, index, mine, valid)
        fctx.meta = (local_v, n_valid, vocab_size, label_smoothing, logits.dtype)
        return loss

    @staticmethod
    def backward(fctx, grad_loss):
        softmax, index, mine, valid = fctx.saved_tensors
        local_v, n_valid, vocab_size, eps, dtype = fctx.meta
        grad = softmax  # saved only for this backward: safe to overwrite
        if n_valid:
            grad.scatter_add_(-1, index.unsqueeze(-1), -(1.0 - eps) * mine.unsqueeze(-1).to(grad.dtype))
            if eps > 0:
                grad.sub_(eps / vocab_size)
            grad.mul_((grad_loss.float() * valid).unsqueeze(-1))
        if n_valid == local_v:
            return grad.to(dtype), None, None, None, None, None
        full = torch.zeros(grad.shape[:-1] + (local_v,), dtype=dtype, device=grad.device)
        full[..., :n_valid] = grad
        return full, None, None, None, None, None


class _LocalCrossEntropy(torch.autograd.Function):
    """The TP=1 case: the whole (padded) vocabulary is local, so no statistic crosses ranks and
    the fused ``log_softmax`` kernel does the max, the sum of exponentials and the normalisation
    in one call. It keeps ``log p`` (one ``[tokens, V]`` tensor, as the general path keeps the
    softmax); the backward turns it into ``softmax - onehot`` in place."""

    @staticmethod
    def forward(fctx, logits, labels, vocab_size: int, ignore_index: int, label_smoothing: float):
        local_v = logits.shape[-1]
        n_valid = min(vocab_size, local_v)
        logp = torch.log_softmax(logits[..., :n_valid], dim=-1, dtype=torch.float32)
        valid = labels != ignore_index
        index = labels.masked_fill(~valid, 0).unsqueeze(-1)
        loss = logp.gather(-1, index).squeeze(-1).neg_()
        if label_smoothing > 0:
            smooth = logp.sum(dim=-1).div_(-n_valid)  # mean_j(-log p_j) over the true vocab
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss = loss.masked_fill_(~valid, 0.0)
        fctx.save_for_backward(logp, index, valid)
        fctx.meta = (local_v, n_valid, label_smoothing, logits.dtype)
        return loss

    @staticmethod
    def backward(fctx, grad_loss):
        logp, index, valid = fctx.saved_tensors
        local_v, n_valid, eps, dtype = fctx.meta
        grad = logp.exp_()  # softmax; logp is saved only for this backward: safe to overwrite
        grad.scatter_add_(-1, index, torch.full(index.shape, -(1.0 - eps), dtype=grad.dtype, device=grad.device))
        if eps > 0:
            grad.sub_(eps / n_valid)
        grad.mul_((grad_loss.float() * valid).unsqueeze(-1))
        if n_valid == local_v:
            return grad.to(dtype), None, None, None, None
        full = torch.zeros(grad.shape[:-1] + (local_v,), dtype=dtype, device=grad.device)
        full[..., :n_valid] = grad
        return full, None, None, None, None


def _local_softmax_stats_(x, labels, ignore_index: int, label_smoothing: float):
    """The TP=1 form of :func:`_vocab_parallel_stats_` for ``x [T, V]`` contiguous fp32 with no
    padding columns, always in place: one ``softmax`` kernel (the max, the exponentials and the
    normalisation in one call) and two cheap row maxima. The log-sum-exp comes from the largest
    probability: at the row's max logit ``m`` the kernel computes ``exp(0) / S = 1 / S``, so
    ``lse = m + log S = m - log(max_j p_j)``, accurate to a few fp32 ulps whatever the spread of
    the logits (the max probability is at least ``1 / V``, never an underflow)."""
    valid = labels != ignore_index
    index = labels.masked_fill(~valid, 0)
    target = x.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    m = x.amax(dim=-1)
    total = x.sum(dim=-1) if label_smoothing > 0 else None
    softmax = torch.softmax(x, dim=-1, out=x)
    lse = m - softmax.amax(dim=-1).log_()
    loss = lse - target
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - total / x.shape[-1])
    return loss.masked_fill_(~valid, 0.0), softmax, index, valid, valid


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token losses of ``x W^T`` (``x [T, h]`` inside the TP region, ``W [V_pad/tp, h]``).

    Forward: the logits GEMM into a fresh ``[T, V_pad/tp]`` buffer, the loss statistics, and the
    buffer turned in place into ``G = softmax - (1 - eps) onehot - eps / V`` (zero in padding
    columns): the logits' gradient for a unit upstream grad. Backward, with ``g = grad_loss *
    valid`` per token: ``dX = diag(g) (G W)`` and ``dW = G^T (diag(g) X)``, the same two GEMMs as
    the unfused output layer's backward, with the row scale moved to their small operands."""

    @staticmethod
    def forward(fctx, x, weight, labels, owner, group: Group, vocab_size: int, ignore_index: int,
                label_smoothing: float):
        local_v, start = weight.shape[0], group.rank * weight.shape[0]
        n_valid = max(0, min(vocab_size - start, local_v))
        logits = x.matmul(weight.t())
        if logits.dtype != torch.float32:
            logits = logits.float()
        if group.size == 1 and n_valid == local_v:
            loss, grad, index, mine, valid = _local_softmax_stats_(logits, labels, ignore_index, label_smoothing)
        else:
            loss, grad, index, mine, valid = _vocab_parallel_stats_(
                logits[..., :n_valid], labels, group, start, vocab_size, ignore_index, label_smoothing,
                inplace=True)
            logits[..., n_valid:] = 0.0  # padding columns: no loss, exactly zero grad
        if n_valid:
            grad.scatter_add_(-1, index.unsqueeze(-1), -(1.0 - label_smoothing) * mine.unsqueeze(-1).float())
            if label_smoothing > 0:
                grad.sub_(label_smoothing / vocab_size)
        grad = logits if x.dtype == torch.float32 else logits.to(x.dtype)
        # The weight itself, not a view of its data: ZeRO-3 swaps a param's storage in and out.
        fctx.save_for_backward(x, weight, grad, valid)
        fctx.owner = owner
        return loss

    @staticmethod
    def backward(fctx, grad_loss):
        x, weight, grad, valid = fctx.saved_tensors
        scale = (grad_loss.float() * valid).unsqueeze(-1).to(x.dtype)  # [T, 1]
        dx = grad.matmul(weight).mul_(scale) if fctx.needs_input_grad[0] else None
        dw = None
        if weight.requires_grad:
            x_scaled = x * scale
            if fctx.owner is not None:  # the linears' path: main grad, deferrable W action
                _weight_grads(fctx.owner, weight, None, grad, x_scaled)
            else:  # a tied embedding's weight: its grad flows through autograd
                dw = grad.reshape(-1, grad.shape[-1]).t().matmul(x_scaled.reshape(-1, x.shape[-1]))
        return dx, dw, None, None, None, None, None, None


def _check_loss_args(lead: torch.Size, labels: torch.Tensor, padded: int, vocab_size: int, ignore_index: int,
                     label_smoothing: float) -> None:
    """The argument rules shared by both entry points (see their Raises)."""
    if lead != labels.shape:
        raise ValueError(f"logits {tuple(lead)} + (V/tp,) and labels {tuple(labels.shape)} must share "
                         "their leading dims ([s, b, V/tp] and [s, b])")
    if not 0 < vocab_size <= padded:
        raise ValueError(f"model.vocab_size={vocab_size} must be in [1, padded vocab {padded}]")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if labels.device.type != "cpu":  # no host sync on an accelerator: an asynchronous device assert
        torch._assert_async(~bad.any(), f"labels must lie in [0, model.vocab_size={vocab_size}) or "
                                        f"equal ignore_index={ignore_index}")
    elif bool(bad.any()):
        raise ValueError(f"labels must lie in [0, model.vocab_size={vocab_size}) or equal "
                         f"ignore_index={ignore_index}; found {int(labels[bad][0])}")


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ctx: ParallelContext, vocab_size: int,
                                 ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy of vocab-parallel logits, computed in fp32.

    Args:
        logits: ``[s, b, V_pad/tp]`` (any leading dims), this rank's slice of the padded vocab
            (rank r holds columns ``[r*V_pad/tp, (r+1)*V_pad/tp)``), any float dtype.
        labels: ``[s, b]`` int64 (the same leading dims), in ``[0, vocab_size)`` or
            ``ignore_index``; identical on every TP rank.
        ctx: the parallel context (its ``tp`` group).
        vocab_size: the true (unpadded) vocab size; columns at or past it are padding.
        ignore_index: label value that contributes zero loss and zero grad.
        label_smoothing: epsilon in ``[0, 1)``, as ``torch.nn.functional.cross_entropy``
            defines it (Szegedy et al. 2016, section 7), over the ``vocab_size`` true classes.
    Returns: losses ``[s, b]`` fp32, 0 at ignored positions, identical on every TP rank. The
        caller sums them and divides by the global number of valid tokens.
    Raises:
        ValueError: shape mismatch, ``vocab_size`` larger than the padded vocab, a label outside
            ``[0, vocab_size)`` that is not ``ignore_index``, or ``label_smoothing`` out of range.
    """
    _check_loss_args(logits.shape[:-1], labels, logits.shape[-1] * ctx.tp.size, vocab_size, ignore_index,
                     label_smoothing)
    if ctx.tp.size == 1:
        return _LocalCrossEntropy.apply(logits, labels, int(vocab_size), int(ignore_index),
                                        float(label_smoothing))
    return _VocabParallelCrossEntropy.apply(logits, labels, ctx.tp, int(vocab_size), int(ignore_index),
                                            float(label_smoothing))


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ctx: ParallelContext,
                               vocab_size: int, *, sequence_parallel: bool = False, owner: nn.Module | None = None,
                               ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """The output layer and the cross-entropy in one step: the per-token losses of
    ``vocab_parallel_cross_entropy(vocab_parallel_logits(hidden, weight, ...), labels, ...)``
    without the logits as a tensor of their own (see the module docstring).

    The same loss and grads as that composition within fp32 rounding: at one TP rank the
    log-sum-exp comes from a ``softmax`` kernel instead of ``log_softmax``, and the upstream grad
    scales the GEMMs' operands instead of the logits' grad; the TP>1 statistics are the same
    operations in the same order (the same losses, bitwise).

    Args:
        hidden: ``[s, b, h]`` (``[s/tp, b, h]`` with SP), replicated over TP; any float dtype
            (the statistics are fp32, the GEMMs in ``hidden``'s dtype).
        weight: ``[V_pad/tp, h]``, this rank's rows of the padded output weight (a
            :class:`~paratron.layers.ParallelLMHead`'s or a tied embedding's).
        labels: ``[s, b]`` int64 (the full sequence under SP), as for
            :func:`vocab_parallel_cross_entropy`.
        ctx: the parallel context (its ``tp`` group).
        vocab_size, ignore_index, label_smoothing: as for :func:`vocab_parallel_cross_entropy`.
        sequence_parallel: ``hidden`` is sequence-sharded (all-gathered here; its grad is
            reduce-scattered).
        owner: the module whose weight this is: its grad takes the linears' path
            (:func:`~paratron.parallel.grads.accumulate_grad`, deferred while
            ``owner.weight_grad_store`` is deferring); None: through autograd into ``.grad``.
    Returns: losses ``[s, b]`` fp32, 0 at ignored positions, identical on every TP rank.
    Raises:
        ValueError: ``hidden`` and ``weight`` widths differ, or as
            :func:`vocab_parallel_cross_entropy`.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden width {hidden.shape[-1]} does not match the output weight "
                         f"width {weight.shape[-1]}")
    tp = ctx.tp
    if sequence_parallel and tp.size > 1:
        x = gather_from_sequence_parallel_region(hidden, tp)
    else:
        x = copy_to_tp_region(hidden, tp)
    _check_loss_args(x.shape[:-1], labels, weight.shape[0] * tp.size, vocab_size, ignore_index, label_smoothing)
    h = x.shape[-1]
    loss = _LinearCrossEntropy.apply(x.reshape(-1, h), weight, labels.reshape(-1), owner, tp, int(vocab_size),
                                     int(ignore_index), float(label_smoothing))
    return loss.view(labels.shape)
