"""Cross-entropy over vocab-parallel logits, without gathering the vocabulary (Shoeybi et al.
2019, section 3: "fuse the output of the parallel GEMM with the cross entropy loss", which
communicates ``b*s`` scalars instead of ``b*s*v`` logits).

Per token, each TP rank reduces its vocab slice to a max, a sum of exponentials, the target
logit (zero unless the label falls in its slice) and, for label smoothing, a sum of logits; two
small all-reduces (max, then one stacked sum) give every rank the same loss. Padded vocab columns
(at or past ``vocab_size``) never enter any of these sums and get exactly zero gradient. With one
TP rank the same loss comes from one fused ``log_softmax`` pass (no collective to split around).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.comm import Group
from ..parallel.context import ParallelContext

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, labels, group: Group, vocab_size: int, ignore_index: int,
                label_smoothing: float):
        local_v = logits.shape[-1]
        start = group.rank * local_v
        n_valid = max(0, min(vocab_size - start, local_v))
        x = logits[..., :n_valid].float()
        lead = logits.shape[:-1]

        gmax = x.amax(dim=-1) if n_valid else torch.full(lead, float("-inf"), device=logits.device)
        group.all_reduce(gmax, op=dist.ReduceOp.MAX)
        shifted = x - gmax.unsqueeze(-1)
        exp = shifted.exp()

        valid = labels != ignore_index
        local_label = labels - start
        mine = valid & (local_label >= 0) & (local_label < n_valid)
        index = local_label.clamp(0, max(n_valid - 1, 0)).masked_fill(~mine, 0)
        if n_valid:
            target = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        else:
            target = torch.zeros(lead, device=logits.device)
        parts = [exp.sum(dim=-1), target]
        if label_smoothing > 0:
            parts.append(shifted.sum(dim=-1))
        stats = torch.stack(parts)  # one all-reduce for every per-token sum
        group.all_reduce(stats)
        sum_exp = stats[0]
        log_z = sum_exp.log()  # log-sum-exp of the shifted logits
        loss = log_z - stats[1]
        if label_smoothing > 0:
            # PyTorch's definition: (1-eps) * nll + eps * mean_j(-log p_j) over the true vocab.
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab_size)
        loss = loss.masked_fill(~valid, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
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
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must share "
                         "their leading dims ([s, b, V/tp] and [s, b])")
    padded = logits.shape[-1] * ctx.tp.size
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
    if ctx.tp.size == 1:
        return _LocalCrossEntropy.apply(logits, labels, int(vocab_size), int(ignore_index),
                                        float(label_smoothing))
    return _VocabParallelCrossEntropy.apply(logits, labels, ctx.tp, int(vocab_size), int(ignore_index),
                                            float(label_smoothing))
