"""fp32 forward+backward of one transformer layer at TP=2: paratron against megatron-core
(``--compare megatron``, the default), or paratron's SwiGLU MLP with the fused ``[gate; up]``
column-parallel weight against the same MLP with two separate gate and up linears
(``--compare gate-up``, sequence parallelism on: counts the all-gathers too).

Both layers are the same pre-norm block (LayerNorm, fused QKV column-parallel linear, causal
SDPA on the local heads, row-parallel output projection, LayerNorm, column fc1, GELU, row fc2),
built from each framework's ColumnParallelLinear/RowParallelLinear with biases; megatron-core
uses ``use_cpu_initialization=True``. Two gloo ranks, one thread each (forked by
``paratron.local_ranks.run_ranks``). Timed with ``pairing.time_paired`` (the order reversed every
other iteration, the slower rank's time, ``--iters`` >= 30 timed after ``--warmup``); printed as
JSON: median ms per variant and the paired ratio (median of per-iteration ratios, interquartile
range, min-max), load average before and after.

Sizes (``--size``): ``large`` (the default, the size every earlier table used) is s=256, b=4,
h=512, 8 heads, ffn 2048 (3.15M params in the layer; h >= 512, the GEMMs dominate); ``small`` is
h=128, 4 heads, ffn 512 (0.20M params, 1/16: overhead-bound). ``--hidden`` etc. override.

megatron-core allocates SP buffers with ``torch.cuda.current_device()``; on a CPU-only torch this
script points that at ``"cpu"`` (benchmark only) so that the SP path can run too.

Usage: .venv/bin/python benchmarks/bench_tp_layer.py [--size small|large] [--iters 30]
       .venv/bin/python benchmarks/bench_tp_layer.py --compare gate-up
Needs (``--compare megatron`` only): pip install megatron-core --no-deps (torch stays pinned).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from paratron.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.parallel.grads import allreduce_sequence_parallel_grads  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402
from pairing import MIN_TIMED_STEPS, add_size_arg, load, summarize, time_paired  # noqa: E402

SIZES = {"small": {"hidden": 128, "heads": 4, "ffn": 512}, "large": {"hidden": 512, "heads": 8, "ffn": 2048}}


class _Block(nn.Module):
    """Pre-norm attention + MLP from the given linear classes (``make_col``/``make_row``)."""

    def __init__(self, make_col, make_row, make_norm, h, heads, ffn, tp):
        super().__init__()
        self.ln1, self.ln2 = make_norm("ln1"), make_norm("ln2")
        self.qkv, self.proj = make_col("qkv", h, 3 * h), make_row("proj", h, h)
        self.fc1, self.fc2 = make_col("fc1", h, ffn), make_row("fc2", ffn, h)
        self.local_heads, self.head_dim = heads // tp, h // heads

    @staticmethod
    def _out(y):
        return y[0] if isinstance(y, tuple) else y

    def forward(self, x):
        qkv = self._out(self.qkv(self.ln1(x)))
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self._out(self.proj(o.permute(2, 0, 1, 3).reshape(s, b, -1)))
        return x + self._out(self.fc2(nn.functional.gelu(self._out(self.fc1(self.ln2(x))))))


def _paratron_block(ctx, args, sp):
    col = lambda n, i, o: ColumnParallelLinear(i, o, ctx, logical_name=n, seed=1, sequence_parallel=sp)  # noqa: E731
    row = lambda n, i, o: RowParallelLinear(i, o, ctx, logical_name=n, seed=1, sequence_parallel=sp)  # noqa: E731
    norm = lambda n: LayerNorm(args.hidden, ctx, logical_name=n, sequence_parallel=sp)  # noqa: E731
    return _Block(col, row, norm, args.hidden, args.heads, args.ffn, ctx.tp.size)


def _megatron_block(args, sp, tp):
    from megatron.core import ModelParallelConfig
    from megatron.core import tensor_parallel as mtp

    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                              use_cpu_initialization=True, params_dtype=torch.float32)
    init = lambda w: nn.init.normal_(w, 0.0, 0.02)  # noqa: E731
    col = lambda n, i, o: mtp.ColumnParallelLinear(i, o, config=cfg, init_method=init, bias=True,  # noqa: E731
                                                   gather_output=False)
    row = lambda n, i, o: mtp.RowParallelLinear(i, o, config=cfg, init_method=init, bias=True,  # noqa: E731
                                                input_is_parallel=True, skip_bias_add=False)

    def norm(n):
        ln = nn.LayerNorm(args.hidden)
        ln.weight.sequence_parallel = sp
        ln.bias.sequence_parallel = sp
        return ln

    return _Block(col, row, norm, args.hidden, args.heads, args.ffn, tp)


def _megatron_sp_grads(model, tp_group):
    # megatron-core's finalize step all-reduces SP grads the same way (one flat buffer).
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _sp_modes(args):
    return {"both": (False, True), "off": (False,), "on": (True,)}[args.sp]


def _bench_rank(args_dict):
    args = argparse.Namespace(**args_dict)
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # megatron-core SP buffers; see docstring
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, create_gloo_process_groups=False)
    mtp_group = parallel_state.get_tensor_model_parallel_group()
    ctx = ParallelContext.build(tp=args.tp)
    out = {}
    for sp in _sp_modes(args):
        torch.manual_seed(0)
        ours = _paratron_block(ctx, args, sp)
        theirs = _megatron_block(args, sp, args.tp)
        s_local = args.seq // args.tp if sp else args.seq
        x = torch.randn(s_local, args.batch, args.hidden)

        def step_ours():
            xi = x.clone().requires_grad_(True)
            ours(xi).sum().backward()
            if sp:
                allreduce_sequence_parallel_grads(ours.parameters(), ctx)

        def step_theirs():
            xi = x.clone().requires_grad_(True)
            theirs(xi).sum().backward()
            if sp:
                _megatron_sp_grads(theirs, mtp_group)

        fns = {"megatron": step_theirs, "paratron": step_ours}

        def run(name, _step):
            fns[name]()
            (ours if name == "paratron" else theirs).zero_grad(set_to_none=True)

        sync = ctx.tp.barrier
        out[sp] = time_paired(list(fns), args.iters, run, warmup=args.warmup, sync=sync)
    parallel_state.destroy_model_parallel()
    return out


class _SeparateGateUp(nn.Module):
    """The SwiGLU MLP as paratron built it before the fusion: gate and up as two column-parallel
    linears (each all-gathers the sequence-parallel input), then the row-parallel fc2."""

    def __init__(self, ctx, h, ffn):
        super().__init__()
        col = lambda n: ColumnParallelLinear(h, ffn, ctx, logical_name=n, seed=1, sequence_parallel=True)  # noqa: E731
        self.gate, self.up = col("gate"), col("up")
        self.fc2 = RowParallelLinear(ffn, h, ctx, logical_name="fc2", seed=1, sequence_parallel=True)

    def forward(self, x):
        return self.fc2(nn.functional.silu(self.gate(x)) * self.up(x))


def _gate_up_rank(args_dict):
    from paratron.config import ModelConfig
    from paratron.models.mlp import MLP

    args = argparse.Namespace(**args_dict)
    ctx = ParallelContext.build(tp=args.tp)
    cfg = ModelConfig(hidden_size=args.hidden, activation="swiglu", add_bias_linear=True, vocab_size=8)
    models = {"separate": _SeparateGateUp(ctx, args.hidden, args.ffn),
              "fused": MLP(cfg, ctx, logical_name="mlp", ffn=args.ffn, seed=1, sequence_parallel=True,
                           params_dtype=torch.float32)}
    x = torch.randn(args.seq // args.tp, args.batch, args.hidden)
    out = {"gathers": {}, "times": {k: [] for k in models}}

    def step(name):
        xi = x.clone().requires_grad_(True)
        models[name](xi).sum().backward()
        allreduce_sequence_parallel_grads(models[name].parameters(), ctx)
        models[name].zero_grad(set_to_none=True)

    for name in models:
        with ctx.ledger.recording():
            step(name)
            out["gathers"][name] = ctx.ledger.total("all_gather", "tp").calls
    out["times"] = time_paired(list(models), args.iters, lambda name, _i: step(name), warmup=args.warmup,
                               sync=ctx.tp.barrier)
    return out


def _report_gate_up(args, res, before) -> None:
    print(f"SwiGLU MLP fwd+bwd, fp32, TP={args.tp} with SP, s={args.seq} b={args.batch} h={args.hidden} "
          f"ffn={args.ffn}, per rank, slower rank:")
    print(json.dumps({"config": vars(args), "load_before": before, "load_after": load(),
                      "all_gathers_per_step": res[0]["gathers"], **summarize(res[0]["times"], base="separate")},
                     indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    add_size_arg(p, default="large")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--iters", type=int, default=MIN_TIMED_STEPS)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--sp", choices=("both", "off", "on"), default="both",
                   help="sequence parallelism modes to run (megatron-core needs TP > 1 for SP)")
    p.add_argument("--compare", choices=("megatron", "gate-up"), default="megatron")
    args = p.parse_args(argv)
    for k, v in SIZES[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(1)
    before = load()
    if args.compare == "gate-up":
        _report_gate_up(args, run_ranks(_gate_up_rank, args.tp, vars(args), timeout=1800), before)
        return 0
    res = run_ranks(_bench_rank, args.tp, vars(args), timeout=1800)
    report = {"config": vars(args), "load_before": before, "load_after": load()}
    for sp in _sp_modes(args):
        # time_paired already reports the slower rank, so rank 0's lists stand for both.
        report[f"sp={sp}"] = summarize(res[0][sp], base="megatron")
    print(f"one transformer layer fwd+bwd, fp32, TP={args.tp}, s={args.seq} b={args.batch} "
          f"h={args.hidden} ffn={args.ffn}, per rank, slower rank:")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
