"""Token dispatchers: move routed tokens to the ranks that hold their experts and back.

A dispatcher has two steps around the expert computation:

* ``dispatch(tokens [T, h], indices [T, k]) -> (expert_input [N, h], tokens_per_expert, plan)``:
  ``expert_input`` holds this rank's local experts' rows, expert-major (all rows of local expert
  0, then local expert 1, ...); ``tokens_per_expert`` lists the row counts.
* ``combine(expert_output [N, h], plan) -> [T, k, h]``: each (token, slot)'s expert output,
  back on the token's own rank, zero for dropped slots (expert id -1). The caller weights the
  slots by the router probabilities and sums them.

Experts are split over the EP group: group rank ``j`` holds global experts
``[j * E_local, (j + 1) * E_local)``. A rank whose experts get no token gets empty tensors and
its experts still produce (zero) grads.

Dispatchers are chosen by name through :func:`register_dispatcher` / :func:`get_dispatcher`
(``model.moe_token_dispatcher``), a registry that research code can extend (docs/DESIGN.md
principle 7).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from paratron.config.errors import ConfigError
from paratron.parallel.context import ParallelContext
from paratron.parallel.intervals import timed
from paratron.parallel.mappings import all_to_all, gather_along_dim, reduce_scatter_along_dim
from paratron.registry import Registry

from . import prefetch
from .collectives import finish_all_to_all, start_all_to_all


def _expert_major(indices: torch.Tensor, lo: int, hi: int):
    """Kept (token, slot) pairs routed to experts ``[lo, hi)``, sorted by (expert, token, slot).

    Returns:
        ``(slot_ids [R], experts [R])``: flat slot ids ``t * k + j`` and their expert ids.
    """
    flat = indices.reshape(-1)
    slot_ids = torch.nonzero((flat >= lo) & (flat < hi)).reshape(-1)
    experts = flat[slot_ids]
    order = torch.sort(experts, stable=True).indices
    return slot_ids[order], experts[order]


def source_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Permutation from rows grouped [source rank][local expert] to [local expert][source rank].

    Args:
        counts: ``[ep, E_local]`` rows from each source rank for each local expert.
    Returns:
        ``[N]`` int64: row ``i`` of the expert-major order is row ``perm[i]`` of the source-major one.
    """
    starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view_as(counts)
    c, s = counts.t().reshape(-1), starts.t().reshape(-1)
    offsets = torch.cumsum(c, 0) - c
    n = int(c.sum())
    return torch.arange(n, device=counts.device) + torch.repeat_interleave(s - offsets, c)


class TokenDispatcher(ABC):
    """Base class. Args: ``ctx`` (parallel context), ``num_experts``, ``capacity`` (slots per
    expert, None: dropless), ``pad_to_capacity`` (fill every expert's rows to ``capacity``, so
    shapes are static; dropped pairs must already be marked -1). The capacity counts the whole
    microbatch, so under sequence parallelism each TP rank pads its own rows to it. The
    arguments obey :func:`paratron.config.model_shape.check_moe` (the MoE layer runs it).

    ``while_in_flight`` (None, or set by the MoE layer from the pipeline runtime for the forward
    half of an ``FB`` pair): ``hook(what, wait)`` with ``what`` ``"dispatch"`` or ``"combine"``.
    The all-to-all dispatcher then launches each row exchange asynchronously and calls the hook,
    which runs other work (another microbatch's backward) and then ``wait()``; the rows and
    their grads are the synchronous exchange's.
    """

    while_in_flight = None
    overlaps_microbatches = False
    """True for a dispatcher whose all-to-alls call ``while_in_flight`` (config validation
    refuses ``parallel.overlap_moe_expert_parallel_comm`` with any other)."""

    def __init__(self, ctx: ParallelContext, num_experts: int, *, capacity: int | None = None,
                 pad_to_capacity: bool = False):
        ep = ctx.ep.size
        self.ctx, self.group = ctx, ctx.ep
        self.num_experts, self.num_local = num_experts, num_experts // ep
        self.first_expert = self.group.rank * self.num_local
        self.capacity, self.pad_to_capacity = capacity, pad_to_capacity

    @abstractmethod
    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor):
        """Send each routed token row to the rank of its expert: ``tokens [T, h]``, ``indices
        [T, k]`` -> ``(expert_input [N, h], tokens_per_local_expert, plan)``."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, plan) -> torch.Tensor:
        """Bring expert outputs ``[N, h]`` back to their tokens' ranks: ``[T, k, h]``."""

    def run(self, tokens: torch.Tensor, indices: torch.Tensor, experts) -> torch.Tensor:
        """Dispatch, run ``experts(rows, tokens_per_expert)``, combine: ``[T, k, h]``. A
        dispatcher that overlaps communication with the experts overrides this."""
        expert_input, tokens_per_expert, plan = self.dispatch(tokens, indices)
        return self.combine(self._experts(experts, expert_input, tokens_per_expert), plan)

    def _experts(self, experts, rows: torch.Tensor, tokens_per_expert: list[int], chunk: int | None = None):
        """``experts(rows, tokens_per_expert)``, recorded as ``"experts"`` (and its backward as
        ``"experts_grad"``) when ``ctx.ledger.intervals`` is set."""
        return timed(self.group.ledger, "experts", experts, rows, tokens_per_expert, chunk=chunk)

    @classmethod
    def options(cls, cfg) -> dict:
        """Extra constructor keywords this dispatcher takes from the model config (none here)."""
        return {}

    @classmethod
    def expert_calls(cls, cfg) -> int:
        """How many times :meth:`run` calls the experts per forward (each call gives every local
        expert weight one grad event in backward; DDP is told through ``param.meta.grad_uses``)."""
        return 1

    @classmethod
    def check_config(cls, cfg) -> None:
        """Rules this dispatcher puts on the model config (``cfg``: a ModelConfig with experts),
        run by config validation before any process group and by the MoE layer. None here.

        Raises:
            ConfigError: naming the fields and the rule.
        """


@dataclass
class _Sorted:
    """This rank's rows of a dispatch, sorted by expert (see :meth:`AllToAllDispatcher._sort`)."""

    num_slots: int
    k: int
    slot_ids: torch.Tensor
    real_rows: torch.Tensor
    buf: torch.Tensor            # every row to send, own block included, in expert order
    send_counts: torch.Tensor    # [ep, E_local] rows for each rank's local experts


@dataclass
class _Pending:
    """A dispatch up to its row all-to-all (see :meth:`AllToAllDispatcher._start`)."""

    num_slots: int
    k: int
    slot_ids: torch.Tensor
    real_rows: torch.Tensor
    buf: torch.Tensor            # every row to send, own block included, in expert order
    send: torch.Tensor           # buf without the own block
    local_range: tuple[int, int]
    in_splits: list[int]
    out_splits: list[int]
    recv_counts: torch.Tensor    # [ep, E_local]


@dataclass
class _AllToAllPlan:
    num_slots: int
    k: int
    row_slots: torch.Tensor      # [R_real] slot id of each real row (send order)
    real_rows: torch.Tensor      # [R_real] position of each real row in the (padded) send buffer
    in_splits: list[int]         # rows sent to each EP rank (0 for this rank: kept local)
    out_splits: list[int]        # rows received from each EP rank (0 for this rank)
    local_range: tuple[int, int] # this rank's own block in the send buffer
    recv_local_at: int           # where the own block goes among received rows
    to_expert_major: torch.Tensor  # [N] permutation: source-major rows -> expert-major rows


class AllToAllDispatcher(TokenDispatcher):
    """All-to-all dispatch and combine (GShard, Lepikhin et al. 2020, section 2.2).

    Dispatch: sort this rank's (token, slot) pairs by expert, exchange the per-expert counts
    (one all-to-all of ``E`` int64 per rank, skipped when padding to capacity makes them
    static), send each block to the rank of its experts with one uneven all-to-all, and reorder
    the received rows from source-major to expert-major. Combine runs the same steps backwards.

    Rows meant for this rank's own experts never enter the all-to-all (their split is 0), so the
    ledger's all-to-all bytes are exactly the off-rank volume: per MoE layer and direction,
    ``h * itemsize`` per off-rank row, plus ``E * 8`` bytes of counts.
    """

    overlaps_microbatches = True

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """``send_counts`` [ep, E_local] rows for each rank's local experts -> the same from
        every source rank for this rank's experts, [ep, E_local]."""
        if self.pad_to_capacity:
            return torch.full_like(send_counts, self.capacity)
        recv = torch.empty_like(send_counts)
        self.group.all_to_all(recv, send_counts.contiguous())
        return recv

    def _sort(self, tokens: torch.Tensor, indices: torch.Tensor) -> "_Sorted":
        """This rank's side of a dispatch: (token, slot) rows sorted by expert, padded to
        capacity when asked, and the rows bound for each rank's local experts."""
        T, k = indices.shape
        h = tokens.shape[-1]
        E = self.num_experts
        slot_ids, experts = _expert_major(indices, 0, E)
        counts = torch.bincount(experts, minlength=E)
        rows = tokens.index_select(0, torch.div(slot_ids, k, rounding_mode="floor"))
        if self.pad_to_capacity:
            # Static shapes: every expert gets exactly `capacity` rows, real rows first.
            if int(counts.max()) > self.capacity:
                raise ValueError(f"an expert got {int(counts.max())} rows, over its capacity "
                                 f"{self.capacity}: drop over-capacity tokens before dispatch")
            starts = torch.cumsum(counts, 0) - counts
            within = torch.arange(experts.numel(), device=experts.device) - starts[experts]
            real_rows = experts * self.capacity + within
            send_counts = torch.full((E,), self.capacity, dtype=torch.int64, device=tokens.device)
            buf = rows.new_zeros(E * self.capacity, h).index_copy(0, real_rows, rows)
        else:
            real_rows = torch.arange(experts.numel(), device=experts.device)
            send_counts = counts
            buf = rows
        return _Sorted(T * k, k, slot_ids, real_rows, buf, send_counts.view(self.group.size, self.num_local))

    def _plan(self, s: "_Sorted", recv_counts: torch.Tensor) -> "_Pending":
        """The splits of the row all-to-all, given the counts this rank receives [ep, E_local]."""
        me = self.group.rank
        per_rank = s.send_counts.sum(dim=1).tolist()
        lo = sum(per_rank[:me])
        local_range = (lo, lo + per_rank[me])
        in_splits = list(per_rank)
        in_splits[me] = 0
        out_splits = recv_counts.sum(dim=1).tolist()
        out_splits[me] = 0
        send = torch.cat([s.buf[:local_range[0]], s.buf[local_range[1]:]])
        return _Pending(s.num_slots, s.k, s.slot_ids, s.real_rows, s.buf, send, local_range, in_splits, out_splits,
                        recv_counts)

    def _start(self, tokens: torch.Tensor, indices: torch.Tensor) -> "_Pending":
        """Everything before the row all-to-all: sort by expert, pad, exchange the counts."""
        s = self._sort(tokens, indices)
        return self._plan(s, self._exchange_counts(s.send_counts))

    def _finish(self, p: "_Pending", received: torch.Tensor):
        """Everything after the row all-to-all: own rows back in, source-major -> expert-major."""
        at = sum(p.out_splits[:self.group.rank])
        lo, hi = p.local_range
        source_major = torch.cat([received[:at], p.buf[lo:hi], received[at:]])
        # Rows arrive as [source rank][local expert]; experts run on [local expert][source rank].
        # On the counts' device (the host under the dry run's stand-in, see paratron/dryrun/).
        to_expert_major = source_to_expert_major(p.recv_counts).to(source_major.device)
        expert_input = source_major.index_select(0, to_expert_major)
        plan = _AllToAllPlan(p.num_slots, p.k, p.slot_ids, p.real_rows, p.in_splits, p.out_splits, p.local_range,
                             at, to_expert_major)
        return expert_input, p.recv_counts.sum(dim=0).tolist(), plan

    def _exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], what: str) -> torch.Tensor:
        """The row all-to-all; with :attr:`while_in_flight` set, launched async around the hook."""
        if self.while_in_flight is None:
            return all_to_all(x, self.group, out_splits, in_splits, kind=what)
        flight = start_all_to_all(x, self.group, out_splits, in_splits, kind=what)
        self.while_in_flight(what, flight.arrive)
        return finish_all_to_all(flight)

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor):
        p = self._start(tokens, indices)
        return self._finish(p, self._exchange(p.send, p.out_splits, p.in_splits, "dispatch"))

    @staticmethod
    def _split_back(expert_output: torch.Tensor, plan: _AllToAllPlan):
        """Expert-major output rows -> (rows of this rank's own tokens, rows to send back)."""
        source_major = expert_output.new_zeros(expert_output.shape).index_copy(
            0, plan.to_expert_major, expert_output)
        at, n_own = plan.recv_local_at, plan.local_range[1] - plan.local_range[0]
        return source_major[at:at + n_own], torch.cat([source_major[:at], source_major[at + n_own:]])

    @staticmethod
    def _to_slots(returned: torch.Tensor, own: torch.Tensor, plan: _AllToAllPlan) -> torch.Tensor:
        """Rows back from the other ranks and the own rows -> ``[T, k, h]`` per (token, slot)."""
        h = own.shape[-1]
        lo = plan.local_range[0]
        buf = torch.cat([returned[:lo], own, returned[lo:]])
        rows = buf.index_select(0, plan.real_rows)
        slots = rows.new_zeros(plan.num_slots, h).index_copy(0, plan.row_slots, rows)
        return slots.view(plan.num_slots // plan.k, plan.k, h)

    def combine(self, expert_output: torch.Tensor, plan: _AllToAllPlan) -> torch.Tensor:
        own, back = self._split_back(expert_output, plan)
        return self._to_slots(self._exchange(back, plan.in_splits, plan.out_splits, "combine"), own, plan)


@dataclass
class _AllGatherPlan:
    num_slots: int
    k: int
    row_slots: torch.Tensor  # [N] slot id (in the EP-gathered slot space) of each expert row


class AllGatherDispatcher(TokenDispatcher):
    """All-gather dispatch, reduce-scatter combine (Megatron-LM's all-gather token dispatcher).

    Every EP rank all-gathers the tokens and expert ids of the whole EP group, runs its local
    experts on the rows routed to them, and the per-slot outputs are summed back to their owners
    with one reduce-scatter. Moves ``ep`` times more data than all-to-all, but has no
    data-dependent splits. ``pad_to_capacity`` is not used here (shapes are already static).
    The EP ranks must hold the same number of tokens.
    """

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor):
        T, k = indices.shape
        lo, hi = self.first_expert, self.first_expert + self.num_local
        all_tokens = gather_along_dim(tokens, self.group, 0, grad_is_partial=True)  # [ep*T, h]
        all_indices = self.group.all_gather(indices.contiguous(), 0)        # [ep*T, k]
        slot_ids, experts = _expert_major(all_indices, lo, hi)
        counts = torch.bincount(experts - lo, minlength=self.num_local)
        expert_input = all_tokens.index_select(0, torch.div(slot_ids, k, rounding_mode="floor"))
        return expert_input, counts.tolist(), _AllGatherPlan(all_indices.numel(), k, slot_ids)

    def combine(self, expert_output: torch.Tensor, plan: _AllGatherPlan) -> torch.Tensor:
        h = expert_output.shape[-1]
        slots = expert_output.new_zeros(plan.num_slots, h).index_copy(0, plan.row_slots, expert_output)
        mine = reduce_scatter_along_dim(slots, self.group, 0)
        return mine.view(mine.shape[0] // plan.k, plan.k, h)


class ChunkedAllToAllDispatcher(AllToAllDispatcher):
    """All-to-all dispatch and combine in ``num_chunks`` (``model.moe_dispatch_chunks``, k)
    chunks of tokens, with the exchanges of
    one chunk in flight while another chunk's experts compute, forward and backward (the chunked
    EP overlap of Megatron-LM / DeepSpeed; FarSkip-Collective and DeepSeek-V3 overlap across
    microbatches instead).

    Forward, for chunks ``j = 0 .. k-1`` (launches are ``Group`` async all-to-alls):

    * chunk ``j+1``'s dispatch is launched before chunk ``j``'s experts run;
    * chunk ``j``'s combine is launched right after its experts, and waited for after chunk
      ``j+1``'s experts.

    So during chunk ``j``'s experts the dispatch of ``j+1`` and the combine of ``j-1`` are in
    flight; only chunk 0's dispatch and the last chunk's combine are exposed. Every rank issues
    the same sequence (D0, D1, C0, D2, C1, ...), which the process group needs.

    Backward: each landed exchange's backward launches the swapped all-to-all asynchronously and
    the gradient waits for it only when autograd reaches the start of that exchange
    (:func:`~.collectives.start_all_to_all`). Autograd runs the ready node created last first, so
    the backward runs: combine-grads of chunks k-1 and k-2 launched, chunk k-1's expert backward
    (combine-grad of k-2 in flight), its dispatch-grad launched, chunk k-2's expert backward
    (dispatch-grad of k-1 in flight), ...; the dispatch-grads are waited for last.

    The per-expert counts of all chunks go in one small all-to-all before the first launch. Per
    token the result is the plain dispatcher's: the experts see the same rows in smaller groups,
    so the grads match it up to fp32 summation order (tests: 1e-6). ``pad_to_capacity`` is
    refused (:meth:`check_config`): per-chunk padding would change the shapes.
    """

    overlaps_microbatches = False  # its own run() launches and waits; it never calls the hook

    def __init__(self, ctx: ParallelContext, num_experts: int, *, capacity: int | None = None,
                 pad_to_capacity: bool = False,
                 num_chunks: int = 2):
        self._check(pad_to_capacity, num_chunks)
        super().__init__(ctx, num_experts, capacity=capacity, pad_to_capacity=False)
        self.num_chunks = num_chunks

    @staticmethod
    def _check(pad_to_capacity: bool, num_chunks: int) -> None:
        if pad_to_capacity:
            raise ConfigError("model.moe_token_dispatcher=alltoall_chunked does not take "
                              "model.moe_pad_to_capacity=true (each chunk would be padded to the "
                              "microbatch's capacity); use moe_token_dispatcher=alltoall to pad")
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise ConfigError(f"model.moe_dispatch_chunks={num_chunks} must be an integer >= 1 "
                              "(model.moe_token_dispatcher=alltoall_chunked)")

    @classmethod
    def options(cls, cfg) -> dict:
        return {"num_chunks": cfg.moe_dispatch_chunks}

    @classmethod
    def expert_calls(cls, cfg) -> int:
        return cfg.moe_dispatch_chunks

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse ``model.moe_pad_to_capacity`` (see the class docstring) and a chunk count
        ``model.moe_dispatch_chunks`` below 1.

        Raises:
            ConfigError: naming the field and the rule.
        """
        cls._check(bool(cfg.moe_pad_to_capacity), cfg.moe_dispatch_chunks)

    def _chunks(self, tokens: torch.Tensor, indices: torch.Tensor) -> list[_Pending]:
        """Sort each chunk (the same chunks on every EP rank), exchange all their counts at once."""
        n = -(-tokens.shape[0] // self.num_chunks)  # ceil
        bounds = [(min(j * n, tokens.shape[0]), min((j + 1) * n, tokens.shape[0])) for j in range(self.num_chunks)]
        sorted_ = [self._sort(tokens[a:b], indices[a:b]) for a, b in bounds]
        recv = self._exchange_counts(torch.stack([c.send_counts for c in sorted_], dim=1))  # [ep, k, E_local]
        return [self._plan(c, recv[:, j]) for j, c in enumerate(sorted_)]

    def run(self, tokens: torch.Tensor, indices: torch.Tensor, experts) -> torch.Tensor:
        pending = self._chunks(tokens, indices)
        group = self.group
        dispatches = [start_all_to_all(pending[0].send, group, pending[0].out_splits, pending[0].in_splits,
                                       kind="dispatch", chunk=0)]
        combines, outs = [], []
        for j, p in enumerate(pending):
            if j + 1 < len(pending):  # in flight while chunk j computes
                q = pending[j + 1]
                dispatches.append(start_all_to_all(q.send, group, q.out_splits, q.in_splits, kind="dispatch",
                                                   chunk=j + 1))
            expert_input, tokens_per_expert, plan = self._finish(p, finish_all_to_all(dispatches[j]))
            own, back = self._split_back(self._experts(experts, expert_input, tokens_per_expert, j), plan)
            combines.append((start_all_to_all(back, group, plan.in_splits, plan.out_splits, kind="combine",
                                              chunk=j), own, plan))
            if j:  # chunk j-1's combine was in flight during chunk j's experts
                outs.append(self._land(*combines[j - 1]))
        outs.append(self._land(*combines[-1]))
        return torch.cat(outs)

    def _land(self, flight, own: torch.Tensor, plan: _AllToAllPlan) -> torch.Tensor:
        return self._to_slots(finish_all_to_all(flight), own, plan)


class PrefetchDispatcher(AllToAllDispatcher):
    """PopFetcher's push/pull dispatcher (PopFetcher, USENIX ATC'25; the machinery, the choice
    rule and the byte counts are in :mod:`.prefetch`, the guide in docs/popfetcher.md).

    ``run(tokens [T, h], indices [T, k], experts) -> [T, k, h]``, as the all-to-all dispatcher:
    it waits for the layer's weight fetch (launched before attention by
    :meth:`~.prefetch.PrefetchState.before_attention`, or here by a standalone MoE layer), sends
    the pairs of pushed experts (and keeps this rank's own) through the all-to-all path, runs the
    pairs of pulled experts on the fetched copies here, and adds the two disjoint slot sets.
    ``state``: the layer's :class:`~.prefetch.PrefetchState` (from :meth:`layer_state`, kept by
    the MoE layer across forwards).
    """

    overlaps_microbatches = False

    def __init__(self, ctx, num_experts: int, *, capacity: int | None = None, pad_to_capacity: bool = False,
                 state: "prefetch.PrefetchState"):
        super().__init__(ctx, num_experts, capacity=capacity, pad_to_capacity=False)
        self.state = state

    @classmethod
    def layer_state(cls, cfg, ctx, experts) -> "prefetch.PrefetchState":
        """What one MoE layer keeps for this dispatcher (:func:`.prefetch.new_state`)."""
        return prefetch.new_state(cfg, ctx, experts)

    @classmethod
    def expert_calls(cls, cfg) -> int:
        return 2  # the local experts' own backward, and the pulled copies' grads coming home

    @classmethod
    def check_config(cls, cfg) -> None:
        """See :func:`.prefetch.check_config`."""
        prefetch.check_config(cfg)

    def run(self, tokens: torch.Tensor, indices: torch.Tensor, experts) -> torch.Tensor:
        fetch = self.state.take()
        fetch.land()  # waited on before any expert runs
        push, pulled = prefetch.split_pulled(indices, fetch, self.group.rank)
        slots = super().run(tokens, push, experts) + prefetch.run_pulled(tokens, indices, pulled, fetch, self.state)
        self.state.observe(indices, pulled, len(fetch.mine))
        return slots


DISPATCHERS: Registry[Callable[..., TokenDispatcher]] = Registry("token dispatcher",
                                                                "model.moe_token_dispatcher")
DISPATCHERS.register("alltoall", AllToAllDispatcher)
DISPATCHERS.register("allgather", AllGatherDispatcher)
DISPATCHERS.register("alltoall_chunked", ChunkedAllToAllDispatcher)
DISPATCHERS.register("prefetch", PrefetchDispatcher)


def register_dispatcher(name: str, cls: Callable[..., TokenDispatcher]) -> None:
    """Make ``cls`` selectable as ``model.moe_token_dispatcher = name``.

    ``cls(ctx, num_experts, *, capacity, pad_to_capacity, **cls.options(cfg))`` must return an
    object with the ``dispatch``/``combine`` contract of this module. Optional classmethods (see
    :class:`TokenDispatcher`): ``options(cfg)``, ``expert_calls(cfg)``, ``check_config(cfg)``.

    Raises:
        ValueError: ``name`` is already registered to another class.
    """
    DISPATCHERS.register(name, cls)


def check_dispatcher_config(cfg) -> None:
    """Run the ``check_config`` rules of the dispatcher ``cfg.moe_token_dispatcher`` names (a
    registered class without that method has none). Called by config validation, before any
    process group, and by the MoE layer.

    Raises:
        ConfigError: an unknown dispatcher name, or a rule of that dispatcher.
    """
    check = getattr(get_dispatcher(cfg.moe_token_dispatcher), "check_config", None)
    if check is not None:
        check(cfg)


def get_dispatcher(name: str) -> Callable[..., TokenDispatcher]:
    """The dispatcher class registered as ``name``.

    Raises:
        ConfigError: unknown name (with did-you-mean and the registered ones).
    """
    return DISPATCHERS.get(name)
