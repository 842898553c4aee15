"""Expert prefetch with a per-expert choice between moving tokens and moving weights.

Source: PopFetcher (USENIX ATC'25, "PopFetcher: Towards Accelerated Mixture-of-Experts Training
via Popularity Based Expert-Wise Prefetch"): the experts a layer's tokens will pick are predicted
from the routing of the layer before it (section 3: adjacent layers' expert popularity is
correlated), their weights are fetched while the attention of the layer runs, and each remote
expert is served either by sending the tokens to it (push, the all-to-all of GShard) or by
fetching the expert to the tokens (pull), whichever moves fewer bytes (section 4). paratron's
version, ``model.moe_token_dispatcher = "prefetch"``, is a plugin of the dispatcher registry
(docs/popfetcher.md):

* **Prediction.** Each MoE layer keeps a sliding window (``model.moe_prefetch_window``
  forwards) of its routing: the ``[E, E]`` affinity counts of (expert at the layer before,
  expert here) over the tokens of each forward, and its own per-expert counts. Before the
  attention of layer ``L``, this rank's predicted pairs per expert of ``L`` are the previous
  layer's pairs of this microbatch, mapped through the windowed affinity
  (``pred[j] = sum_i c[i] * M[i, j] / sum_j' M[i, j']``); a layer with no MoE layer before it in
  its model chunk predicts its own windowed mean counts; an empty window predicts nothing.
* **Choice.** This rank pulls remote expert ``e`` when ``pred[e] * h > P`` (``h``: the hidden
  size, ``P``: the expert's parameter count): the rows it would push (``h`` values per pair)
  outweigh the weights it would fetch. ``model.moe_prefetch_policy = "pull" | "push"`` forces
  one side for every remote expert (tests; ``"push"`` is the all-to-all dispatcher plus the
  prefetch's empty exchanges).
* **Fetch.** The choices are all-gathered over EP (``E`` int64 per rank), then one asynchronous
  uneven all-to-all sends each owner's pulled experts, flattened, to the ranks that pull them
  (interval ``"prefetch"``). It is launched from :meth:`PrefetchState.before_attention`, which
  the transformer layer calls before its attention, and waited on in :meth:`PrefetchDispatcher.run`
  before any expert runs.
* **Compute.** Pairs routed to pulled experts run here on the fetched copies; the rest go through
  the all-to-all dispatcher (pairs of this rank's own experts never leave it). Every pair passes
  the same expert function as under all-to-all, so the math is the all-to-all dispatcher's; the
  results differ only in fp32 summation order (tests: 1e-6).
* **Grads.** The backward of the fetch is the swapped all-to-all: each pulled copy's weight grad
  returns to its owner (interval ``"prefetch_grad"``, launched when the pulled experts' backward is
  done, waited on when autograd reaches the point the fetch was launched, i.e. after the attention
  backward) and is added to the owner's grads through
  :func:`~paratron.parallel.grads.accumulate_grad`. Every local expert param gets this second grad
  event every forward (zeros when nobody pulled it), so ``expert_calls`` is 2 and DDP's
  ``grad_uses`` is static.

Bytes per step (fp32, forward + backward) for ``n`` pairs of one rank bound for one remote expert:
push ``4 * n * h * 4`` (dispatch, combine and their grads), pull ``2 * P * 4`` (weights and their
grads), plus ``E * 8 * ep`` bytes of choices per layer. Not supported: ``model.moe_pad_to_capacity``,
``model.recompute = "full"`` (the recompute would fetch every pulled expert again),
``parallel.expert_tensor > 1`` and the microbatch-overlapped FB pairs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from paratron.config.errors import ConfigError
from paratron.parallel.grads import accumulate_grad, run_or_defer

from .collectives import InFlight, finish_all_to_all, start_all_to_all

POLICIES = ("auto", "pull", "push")


def _pair_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``indices [T, k]`` (-1: dropped) -> ``[T, E]`` fp32: how many of token t's slots chose e."""
    keep = (indices >= 0).unsqueeze(-1)
    one_hot = F.one_hot(indices.clamp(min=0), num_experts) * keep
    return one_hot.sum(dim=1).float()


class RoutingWindow:
    """The last ``size`` forwards of one MoE layer's routing on this rank.

    ``counts``: ``[E]`` pairs per expert of each forward; ``affinity``: ``[E, E]`` pair counts of
    (expert i at the layer before, expert j here) over the same tokens, when the layer before ran
    on this rank in the same forward (PopFetcher, section 3).
    """

    def __init__(self, num_experts: int, size: int):
        self.num_experts = num_experts
        self.counts: deque[torch.Tensor] = deque(maxlen=size)
        self.affinity: deque[torch.Tensor] = deque(maxlen=size)

    def observe(self, indices: torch.Tensor, previous: torch.Tensor | None) -> None:
        """Record a forward's ``indices [T, k]`` (and the layer before's ``[T, k']``, or None)."""
        here = _pair_counts(indices, self.num_experts)
        self.counts.append(here.sum(dim=0))
        if previous is not None and previous.shape[0] == indices.shape[0]:
            self.affinity.append(_pair_counts(previous, self.num_experts).t() @ here)

    def predict(self, previous: torch.Tensor | None) -> torch.Tensor:
        """Predicted pairs per expert ``[E]`` fp32 for the next forward, given the layer before's
        routing of that forward ``[T, k']`` (None: not known here); zeros with an empty window."""
        if previous is not None and self.affinity:
            m = torch.stack(list(self.affinity)).sum(dim=0)
            share = m / m.sum(dim=1, keepdim=True).clamp(min=1.0)
            return _pair_counts(previous, self.num_experts).sum(dim=0) @ share
        if self.counts:
            return torch.stack(list(self.counts)).mean(dim=0)
        return torch.zeros(self.num_experts)


class _PackExperts(torch.autograd.Function):
    """Flatten the local experts ``order`` (with repeats, one per destination) into one 1-D send
    buffer. Backward: each param gets the sum of its copies' grads through
    :func:`accumulate_grad` (on ``owner``'s W path), zeros for a param nobody pulled, so every
    local expert param gets exactly one grad event here per forward."""

    @staticmethod
    def forward(fctx, order: list[int], owner, per_expert: int, *params):
        fctx.order, fctx.owner, fctx.per_expert, fctx.params = order, owner, per_expert, params
        fctx.shapes = [p.shape for p in params]  # ZeRO-3 may have freed the params by backward
        experts = [params[i * per_expert:(i + 1) * per_expert] for i in range(len(params) // per_expert)]
        flat = [p.reshape(-1) for local in order for p in experts[local]]
        return torch.cat(flat) if flat else params[0].new_zeros(0)

    @staticmethod
    def backward(fctx, grad):
        params, n = fctx.params, fctx.per_expert
        sums = [grad.new_zeros(shape) for shape in fctx.shapes]
        at = 0
        for local in fctx.order:
            for s in sums[local * n:(local + 1) * n]:
                s += grad[at:at + s.numel()].view_as(s)
                at += s.numel()
        run_or_defer(fctx.owner, lambda: [accumulate_grad(p, s) for p, s in zip(params, sums)])
        return (None, None, None) + (None,) * len(params)


@dataclass
class Fetch:
    """One forward's weight fetch: ``pulled [ep, E]`` bool (group rank r pulls expert e),
    ``mine`` the experts this rank pulls (ascending global ids), the flight, and after
    :meth:`land` the fetched weights ``[len(mine) * P]``."""

    pulled: torch.Tensor
    mine: list[int]
    flight: InFlight
    weights: torch.Tensor | None = None

    def land(self) -> torch.Tensor:
        """Wait for the fetch (once); the fetched flat weights, differentiable."""
        if self.weights is None:
            self.weights = finish_all_to_all(self.flight)
        return self.weights


@dataclass
class PrefetchState:
    """What one MoE layer's prefetch dispatcher keeps across forwards: the routing window, the
    MoE layer before it in the model chunk (``previous``, set by
    :func:`~paratron.models.moe.layer.link_moe_layers`), its last routing, the fetch launched
    before attention, and ``last_stats`` of the last forward (``pairs``: kept (token, slot)
    pairs, ``own``: pairs of this rank's experts, ``pulled``: pairs run on fetched experts,
    ``pulled_experts``: how many experts this rank fetched)."""

    ctx: object
    experts: object
    hidden: int
    policy: str
    window: RoutingWindow
    previous: "PrefetchState | None" = None
    last_indices: torch.Tensor | None = None
    pending: Fetch | None = None
    last_stats: dict = field(default_factory=dict)

    def __post_init__(self):
        first = self.experts.local[0]
        self.layout = [(name, p.shape) for name, p in first.named_parameters()]
        self.per_expert = sum(p.numel() for p in first.parameters())

    def link(self, previous: "PrefetchState | None") -> None:
        self.previous = previous

    def before_attention(self) -> None:
        """Predict this layer's hot experts and launch the fetch (the transformer layer calls
        this before its attention; collective over EP)."""
        self.pending = self._start()

    def take(self) -> Fetch:
        """The fetch launched before attention, or one launched now (a standalone MoE layer)."""
        fetch, self.pending = self.pending or self._start(), None
        return fetch

    def _choose(self, predicted: torch.Tensor) -> torch.Tensor:
        """``[E]`` bool: the remote experts this rank pulls (see the module docstring)."""
        g, n = self.ctx.ep, len(self.experts.local)
        remote = torch.ones(self.window.num_experts, dtype=torch.bool)
        remote[g.rank * n:(g.rank + 1) * n] = False
        if self.policy == "pull":
            return remote
        if self.policy == "push":
            return torch.zeros_like(remote)
        return remote & (predicted * self.hidden > self.per_expert)

    def _start(self) -> Fetch:
        g, n, P = self.ctx.ep, len(self.experts.local), self.per_expert
        prev = self.previous.last_indices if self.previous is not None else None
        want = self._choose(self.window.predict(None if prev is None else prev.cpu()))
        device = self.ctx.device
        pulled = g.all_gather(want.to(device=device, dtype=torch.int64).view(1, -1), 0).bool().cpu()
        rows = pulled[:, g.rank * n:(g.rank + 1) * n].clone()  # [ep, E_local]: who pulls my experts
        rows[g.rank] = False  # (never set: a rank does not pull its own experts)
        order = [local for r in range(g.size) for local in range(n) if rows[r, local]]
        in_splits = (rows.sum(dim=1) * P).tolist()
        mine = torch.nonzero(pulled[g.rank]).view(-1).tolist()
        out_splits = [P * sum(1 for e in mine if e // n == j) for j in range(g.size)]
        params = [p for expert in self.experts.local for p in expert.parameters()]
        flat = _PackExperts.apply(order, self.experts, len(self.layout), *params)
        flight = start_all_to_all(flat, g, out_splits, in_splits, kind="prefetch")
        return Fetch(pulled, mine, flight)

    def observe(self, indices: torch.Tensor, pulled: torch.Tensor, pulled_experts: int) -> None:
        """After a forward: record its routing ``indices [T, k]`` in the window (with the layer
        before's) and its ``last_stats`` (``pulled [T, k]``: the pairs run on fetched experts)."""
        prev = self.previous.last_indices if self.previous is not None else None
        self.last_indices = indices.detach()
        self.window.observe(self.last_indices.cpu(), None if prev is None else prev.cpu())
        n = len(self.experts.local)
        lo = self.ctx.ep.rank * n
        self.last_stats = {"pairs": int((indices >= 0).sum()), "own": int(((indices >= lo) & (indices < lo + n)).sum()),
                           "pulled": int(pulled.sum()), "pulled_experts": pulled_experts}


def new_state(cfg, ctx, experts) -> PrefetchState:
    """The state one MoE layer keeps for the prefetch dispatcher across forwards (``experts``:
    its :class:`~paratron.models.moe.experts.LocalExperts`).

    Raises:
        ConfigError: ``parallel.expert_tensor > 1`` (fetched copies would be slices of experts).
    """
    check_expert_tensor(ctx.expert_tp.size)
    return PrefetchState(ctx, experts, cfg.hidden_size, cfg.moe_prefetch_policy,
                         RoutingWindow(cfg.num_experts, cfg.moe_prefetch_window))


def check_expert_tensor(size: int) -> None:
    """The prefetch dispatcher's rule on ``parallel.expert_tensor`` (checked by config validation
    before launch and again when a layer builds its state).

    Raises:
        ConfigError: ``size > 1`` (fetched copies would be slices of experts).
    """
    if size > 1:
        raise ConfigError("model.moe_token_dispatcher=prefetch fetches whole experts; it does not take "
                          f"parallel.expert_tensor={size} (use 1)")


def check_config(cfg) -> None:
    """The prefetch dispatcher's rules on the model config: no padding to capacity, no full
    recompute, a known ``moe_prefetch_policy``, ``moe_prefetch_window >= 1``.

    Raises:
        ConfigError: naming the field and the rule.
    """
    name = "model.moe_token_dispatcher=prefetch"
    if cfg.moe_pad_to_capacity:
        raise ConfigError(f"{name} does not take model.moe_pad_to_capacity=true (pulled experts run "
                          "their pairs unpadded); use moe_token_dispatcher=alltoall to pad")
    if cfg.recompute == "full":
        raise ConfigError(f"{name} does not take model.recompute='full': the recompute would fetch "
                          "every pulled expert again in the backward; use 'selective' or 'none'")
    if cfg.moe_prefetch_policy not in POLICIES:
        raise ConfigError(f"model.moe_prefetch_policy={cfg.moe_prefetch_policy!r} must be one of {POLICIES}")
    if not isinstance(cfg.moe_prefetch_window, int) or cfg.moe_prefetch_window < 1:
        raise ConfigError(f"model.moe_prefetch_window={cfg.moe_prefetch_window} must be an integer >= 1")


def split_pulled(indices: torch.Tensor, fetch: Fetch, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``indices [T, k]`` -> ``(push_indices [T, k], pulled [T, k] bool)``: the pairs of the
    experts this rank (EP group rank ``rank``) fetched are -1 in ``push_indices``."""
    here = fetch.pulled[rank].to(indices.device)
    pulled = (indices >= 0) & here[indices.clamp(min=0)]
    return torch.where(pulled, torch.full_like(indices, -1), indices), pulled


def run_pulled(tokens: torch.Tensor, indices: torch.Tensor, pulled: torch.Tensor, fetch: Fetch,
               state: PrefetchState) -> torch.Tensor:
    """The pulled pairs on the fetched experts: ``tokens [T, h]``, ``indices [T, k]``,
    ``pulled [T, k]`` -> ``[T, k, h]``, zeros at the other pairs."""
    T, k = indices.shape
    h, flat, weights = tokens.shape[-1], indices.reshape(-1), fetch.land()
    slot_ids = torch.nonzero(pulled.reshape(-1)).view(-1)
    slot_ids = slot_ids[torch.sort(flat[slot_ids], stable=True).indices]  # expert-major
    counts = torch.bincount(flat[slot_ids], minlength=state.window.num_experts).tolist()
    rows = torch.split(tokens.index_select(0, torch.div(slot_ids, k, rounding_mode="floor")),
                       [counts[e] for e in fetch.mine])
    P, sizes = state.per_expert, [shape.numel() for _, shape in state.layout]
    outs = []
    for i, part in enumerate(rows):
        views = torch.split(weights[i * P:(i + 1) * P], sizes)
        w = {name: v.view(shape) for (name, shape), v in zip(state.layout, views)}
        outs.append(state.experts.local[0].with_weights(part, w))
    out = torch.cat(outs) if outs else tokens.new_zeros(0, h)
    slots = tokens.new_zeros(T * k, h).index_copy(0, slot_ids, out.to(tokens.dtype))
    # Keeps the fetch in every rank's graph (also where nothing was pulled), so that every rank
    # runs its backward: the swapped all-to-all that returns the pulled experts' grads.
    return (slots + weights[:0].sum()).view(T, k, h)
