"""Run the encoder actions of a pipeline rank's list (:mod:`.encoder_schedule`): ``EF``/``EB``
on this rank's encoder replica and the encoder messages to and from stage 0's rank.

:func:`~paratron.pipeline.runtime.run_pipeline` hands every step whose actions are encoder kinds
to its ``encoder=`` (an :class:`EncoderRun`) in list order; the stage messages never see them.

* ``EF(mb, k)`` runs ``encoder(inputs[mb][k])`` with autograd and keeps the output and its graph
  for ``EB``. On stage 0's rank the output becomes a leaf (its ``.grad`` is what stage 0's
  backward leaves for the encoder); elsewhere it is sent.
* Stage 0's forward step takes the image tokens of a microbatch from :meth:`EncoderRun.features`:
  the parts' leaves (local or received), concatenated along the batch (``[n, b, h]``, dim 1).
* ``EB(mb, k)`` backpropagates the grad of its output (its leaf's ``.grad`` on stage 0's rank,
  else the received one) into the encoder's ``.grad``. Sum the replicas' grads afterwards
  (:func:`paratron.models.vlm.reduce_encoder_grads`).
* Encoder messages go over the pipeline group with their own tag (:data:`ENCODER_TAG`), so they
  match in order among themselves and apart from the stage messages (the validator's second
  channel), whatever the order in which either side's receives are posted. A batch's sends are
  waited for in :meth:`EncoderRun.finish` (the runtime calls it at the end of the list).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .actions import Action

ENCODER_TAG = 7


class EncoderRun:
    """The encoder side of one :func:`run_pipeline` call on one rank.

    Args:
        encoder: this rank's encoder replica (None on a rank that owns no part, e.g. every rank
            but stage 0's under the ``stage0`` placement).
        inputs: ``inputs[mb][k]``: part ``k`` of microbatch ``mb``'s encoder input (e.g. patches
            ``[b_k, n, patch_dim]``); every rank holds them.
        out_shape: ``out_shape(mb, k)``: the encoder output's shape (``[n, b_k, h]``), for the
            receive buffers.
        ctx: the parallel context (messages over ``ctx.pp``).
        dtype: the outputs' dtype.
    """

    def __init__(self, encoder, inputs: Sequence[Sequence[Any]], out_shape: Callable[[int, int], Sequence[int]],
                 ctx, dtype: torch.dtype = torch.float32):
        self.encoder, self.inputs, self.out_shape, self.ctx, self.dtype = encoder, inputs, out_shape, ctx, dtype
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # EF's output with its graph
        self.leaves: dict[tuple[int, int], torch.Tensor] = {}   # stage 0's rank: the tokens it reads
        self.grads: dict[tuple[int, int], torch.Tensor] = {}    # received grads of outputs
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.device = torch.device(ctx.device)
        self.forward_only = False

    def features(self, mb: int) -> torch.Tensor:
        """Microbatch ``mb``'s encoder output ``[n, b, h]`` on stage 0's rank (every part)."""
        parts = sorted(k for m, k in self.leaves if m == mb)
        return torch.cat([self.leaves.pop((mb, k)) if self.forward_only else self.leaves[(mb, k)] for k in parts],
                         dim=1)

    def run(self, step: Sequence[Action]) -> None:
        """One step of the list: an ``EF``/``EB`` alone, or a batch of encoder messages."""
        a = step[0]
        if a.kind == "EF":
            self._forward(a)
        elif a.kind == "EB":
            self._backward(a)
        else:
            self._exchange(step)

    def _forward(self, a: Action) -> None:
        key = (a.microbatch, a.part)
        with torch.set_grad_enabled(not self.forward_only):
            out = self.encoder(self.inputs[a.microbatch][a.part])
        if not self.forward_only:
            self.outputs[key] = out
        self.leaves[key] = out.detach().requires_grad_(not self.forward_only)

    def _backward(self, a: Action) -> None:
        key = (a.microbatch, a.part)
        out = self.outputs.pop(key)
        grad = self.grads.pop(key, None)
        if grad is None:  # the part is on stage 0's rank: its leaf holds the grad
            leaf = self.leaves.pop(key)
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        torch.autograd.backward(out, grad_tensors=grad)

    def _exchange(self, step: Sequence[Action]) -> None:
        pp, ops = self.ctx.pp, []
        for a in step:
            key = (a.microbatch, a.part)
            if a.kind == "SEND_E":
                t = self.leaves.pop(key).detach().contiguous()
            elif a.kind == "SEND_EG":
                leaf = self.leaves.pop(key)
                t = (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).contiguous()
            else:
                t = torch.empty(tuple(self.out_shape(*key)), dtype=self.dtype, device=self.device)
            op = pp.p2p_op("send" if a.kind.startswith("SEND") else "recv", t, a.peer)
            op.tag = ENCODER_TAG  # their own stream: see the module docstring
            ops.append(op)
        works = pp.batch_isend_irecv(ops)
        for a, op, work in zip(step, ops, works):
            t = op.tensor
            if a.kind.startswith("SEND"):
                self.pending.append((work, t))
            else:
                work.wait()
                key = (a.microbatch, a.part)
                if a.kind == "RECV_E":
                    self.leaves[key] = t.requires_grad_(not self.forward_only)
                else:
                    self.grads[key] = t

    def finish(self) -> None:
        """Wait for the sends; every output must have had its backward (unless forward only)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        if self.outputs and not self.forward_only:
            raise RuntimeError(f"encoder parts {sorted(self.outputs)} ran forward but no backward")
