"""Validation during training: when to evaluate, and the token-mean validation loss.

The :class:`Evaluator` owns the evaluation interval rule: every ``train.eval_interval`` steps and
after the last step (once, also when the two coincide; never after a stop request). Each
evaluation reads the *next* ``train.eval_iters`` global batches of the validation split, as
Megatron does, so successive validation losses are measured on different text.
"""

from __future__ import annotations

import math

import torch

from paratron.training.step import run_global_batch


class Evaluator:
    """Evaluates ``chunks`` on the validation split of ``data``.

    Args:
        cfg: the run's config (``train.eval_interval``, ``train.eval_iters``,
            ``train.global_batch_size``).
        ctx: the parallel context.
        chunks: this rank's model chunks.
        data: the :class:`~paratron.training.data_iter.TrainingData`.
        actions_for: ``m -> `` this rank's pipeline action list for ``m`` microbatches (the
            forward-only part is run; token-balanced batches vary ``m``).
    """

    def __init__(self, cfg, ctx, chunks, data, actions_for) -> None:
        self.cfg, self.ctx, self.chunks, self.data, self.actions_for = cfg, ctx, chunks, data, actions_for
        self.interval = int(cfg.train.eval_interval or 0)
        self.last_loss: float | None = None

    @property
    def enabled(self) -> bool:
        return self.data.has_validation and self.cfg.train.eval_iters >= 1

    def due(self, iteration: int, *, last: bool) -> bool:
        """Whether to evaluate after step ``iteration`` (``last``: the run's final step)."""
        return self.enabled and (last or bool(self.interval and iteration % self.interval == 0))

    @torch.no_grad()
    def run(self, state) -> dict:
        """Token-mean validation loss over ``train.eval_iters`` global batches, from
        ``state.consumed_valid_samples`` on (advanced). Returns the record
        ``{"iteration", "val_loss", "val_ppl"}`` (loss in nats/token), the same on every rank."""
        for c in self.chunks:
            c.eval()
        total, tokens = 0.0, 0
        for _ in range(self.cfg.train.eval_iters):
            mbs = self.data.valid_microbatches(state.consumed_valid_samples)
            out = run_global_batch(self.cfg, self.ctx, self.chunks, mbs, forward_only=True,
                                   actions=self.actions_for(len(mbs)))
            total += out.loss * out.num_tokens
            tokens += out.num_tokens
            state.consumed_valid_samples += self.cfg.train.global_batch_size
        for c in self.chunks:
            c.train()
        val = total / max(tokens, 1)
        self.last_loss = val
        return {"iteration": state.iteration, "val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
