"""Update rules on flat fp32 tensors: AdamW and SGD, written to match ``torch.optim``.

Each function takes lists of equally long 1-D fp32 tensors (one entry per owned range of a
gradient buffer) and updates them in place with ``torch._foreach`` kernels. Weight decay applies
only to the ``decay`` views (the params without ``no_weight_decay``), which are sub-views of
``params``.
"""

from __future__ import annotations

import math

import torch


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], decay: list[torch.Tensor], *, step: int, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step (Loshchilov & Hutter 2019, algorithm 2; the arithmetic of
    ``torch.optim.AdamW``'s single-tensor path, so results agree to rounding).

    ``p <- p * (1 - lr * wd)`` (decoupled, ``decay`` views only), then
    ``m <- lerp(m, g, 1 - b1)``, ``v <- b2 v + (1 - b2) g^2``,
    ``p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.

    Args:
        step: the 1-based step number ``t`` (bias correction).
    """
    if weight_decay and decay:
        torch._foreach_mul_(decay, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)


def sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor], momenta: list[torch.Tensor],
             decay: list[torch.Tensor], decay_grads: list[torch.Tensor], *, step: int, lr: float,
             momentum: float, weight_decay: float) -> None:
    """One SGD step with ``torch.optim.SGD``'s semantics (dampening 0, no Nesterov).

    Weight decay is L2 added to the grad (``g <- g + wd * p`` on the ``decay`` views; their grads
    are ``decay_grads``), as torch does. With momentum the buffer starts as the first grad:
    ``buf <- g`` at step 1, else ``buf <- momentum * buf + g``; then ``p <- p - lr * buf``.
    Grads are modified in place.
    """
    if weight_decay and decay:
        torch._foreach_add_(decay_grads, decay, alpha=weight_decay)
    if momentum:
        if step == 1:
            torch._foreach_copy_(momenta, grads)
        else:
            torch._foreach_mul_(momenta, momentum)
            torch._foreach_add_(momenta, grads)
        torch._foreach_add_(params, momenta, alpha=-lr)
    else:
        torch._foreach_add_(params, grads, alpha=-lr)


def fused_adamw_step(groups: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                        list[torch.Tensor], float]], step: torch.Tensor, *, lr: float,
                     beta1: float, beta2: float, eps: float, clip_coeff: float = 1.0) -> None:
    """One AdamW step with PyTorch's fused kernel (``torch._fused_adamw_``, the kernel behind
    ``torch.optim.AdamW(fused=True)``; CUDA and CPU), the same update as :func:`adamw_step`.

    Args:
        groups: ``(params, grads, exp_avgs, exp_avg_sqs, weight_decay)`` per weight-decay group;
            the four lists hold matching 1-D views (runs of the flat buffers).
        step: a 0-dim fp32 tensor on the params' device holding the 1-based step ``t`` (the
            kernel reads it on the device: no host sync).
        clip_coeff: the grad-clipping factor (``< 1``: clip): the kernel divides each grad by
            its ``grad_scale`` ``1 / clip_coeff`` as it reads it (and stores the clipped grad
            back), which saves the separate pass over the grads.
    """
    scale = None
    if clip_coeff < 1.0:
        scale = torch.full((), 1.0 / clip_coeff, dtype=torch.float32, device=step.device)
    for params, grads, exp_avgs, exp_avg_sqs, weight_decay in groups:
        if not params:
            continue
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params), lr=lr,
                            beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                            amsgrad=False, maximize=False, grad_scale=scale)
