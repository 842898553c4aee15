"""Helpers shared by the test files (imported as ``from helpers import ...``; pytest puts
``tests/`` on the path, as for the ``from test_x import ...`` imports)."""

from __future__ import annotations

import torch

from paratron.config import Config, ModelConfig


def gpt2_config(**sizes) -> ModelConfig:
    """A GPT-2-style model (LayerNorm, learned positions, GELU, biases, tied embeddings) of the
    given sizes (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``vocab_size``,
    ``seq_length``, and any other ``ModelConfig`` field to override)."""
    style = dict(normalization="layernorm", position_embedding_type="learned", activation="gelu",
                 add_bias_linear=True, tie_embeddings=True)
    return ModelConfig(**{**style, **sizes})


def config_with(**fields) -> Config:
    """The default :class:`Config` with ``section__key=value`` fields set (``model__num_experts=4``)."""
    cfg = Config()
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def perturb_1d_params_(chunks, seed: int = 11) -> None:
    """Norm weights start at 1 and biases at 0 on every layout: add ``0.1 * N(0, 1)`` to every 1-D
    parameter, drawn from its full tensor by logical name (so every layout gets the same values),
    so that their grads and the bias paths are exercised."""
    for chunk in chunks:
        for p in chunk.parameters():
            if p.dim() == 1:
                g = torch.Generator().manual_seed(seed + sum(map(ord, p.meta.logical_name)))
                full = 0.1 * torch.randn(p.meta.shard.global_shape, generator=g)
                with torch.no_grad():
                    p.add_(full[p.meta.shard.slices()].to(p.dtype))


def train_for_parity(cfg: Config, ctx, steps: int, seed: int = 50, prepare=None) -> dict:
    """Train ``cfg`` through the real stack (DDP / ZeRO, the pipeline runtime, the training step)
    for ``steps`` steps, each on a fresh random global batch of ``train.global_batch_size`` samples
    of which this rank takes its DP share in microbatches of ``train.micro_batch_size``; the same
    samples on every layout. Norm weights and biases are perturbed first
    (:func:`perturb_1d_params_`). Returns ``{"params": {logical name: (this rank's slice, its
    index in the full tensor)}, "losses": [one per step]}`` for a comparison against one process.
    ``prepare(chunks, ddp, optimizer)``, when given, replaces the perturbation (it must set the
    optimizer's main weights itself)."""
    from paratron.checkpoint.items import iter_params
    from paratron.training.data_iter import microbatch_preparer
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    torch.manual_seed(0)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    if prepare is not None:
        prepare(chunks, ddp, optimizer)
    else:
        # Under ZeRO-3 the params are whole only inside full_params, and the shards keep the
        # change only with writeback.
        with ddp.full_params(writeback=True):
            perturb_1d_params_(chunks)
            optimizer.copy_params_into_main(iter_params(chunks))
    gbs, mbs, m = cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.model
    rows, r = gbs // ctx.dp.size, ctx.dp.rank
    losses = []
    prepare = microbatch_preparer(cfg, ctx, eod=0)  # this CP rank's chunks of each sequence
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        ids = torch.randint(0, m.vocab_size, (gbs, m.seq_length + 1), generator=g)[r * rows:(r + 1) * rows]
        microbatches = [prepare({"tokens": ids[i:i + mbs, :-1], "labels": ids[i:i + mbs, 1:]})
                        for i in range(0, rows, mbs)]
        optimizer.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, microbatches, forward_only=False,
                               loss_scale=optimizer.loss_scale, ddp=ddp)
        optimizer.step()
        losses.append(out.loss)
    params = {}
    with ddp.full_params():
        for c in chunks:
            for p in c.parameters():
                params[p.meta.logical_name] = (p.meta.shard.valid(p).detach().clone(), p.meta.shard.slices())
    return {"params": params, "losses": losses}


def assert_parity(results: list[dict], ref: dict, tol: float, name: str) -> None:
    """Every rank's params of :func:`train_for_parity` match one process's ``ref`` to ``tol``
    (absolute and relative), the losses too, and together the ranks hold every param of ``ref``."""
    seen = set()
    for res in results:
        for n, (p, slices) in res["params"].items():
            torch.testing.assert_close(p, ref["params"][n][0][slices], rtol=tol, atol=tol,
                                       msg=lambda m: f"{name} param {n}: {m}")
            seen.add(n)
        for loss, want in zip(res["losses"], ref["losses"], strict=True):
            assert abs(loss - want) <= tol * max(1.0, abs(want)), f"{name}: loss {loss} vs {want}"
    assert seen == set(ref["params"]), f"{name}: params held by no rank: {set(ref['params']) - seen}"
