"""ZeRO-1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5.1, P_os): the optimizer-state partition and the parameter
all-gather.

Each DP rank owns a contiguous 1/N_d slice of every bucket of every grad buffer
(:meth:`paratron.optim.grad_buffer.Bucket.shard_range`; a slice may start or end inside a param).
DDP reduce-scatters each bucket so rank r receives the summed grads of its slice; the optimizer
keeps fp32 main weights and moments for that slice only and updates it; then every bucket's
params are all-gathered back into place. Communication equals one all-reduce: a reduce-scatter
plus an all-gather each move (N_d - 1)/N_d of the bucket per rank (section 7.2.1).
"""

from __future__ import annotations


def gather_params(ddp) -> None:
    """All-gather, bucket by bucket over each buffer's DP group, the updated param slices into
    every rank's param buffer (async launches, then one wait each).

    Args:
        ddp: a :class:`~paratron.optim.ddp.DistributedDataParallel` built with
            ``zero=1`` (or above) whose owned slices already hold the new params.
    """
    handles = []
    for buf in ddp.buffers:
        g = buf.group
        if g.size == 1:
            continue
        for b in buf.buckets:
            s, e = b.shard_range(g.rank, g.size)
            # A copy of the own slice: the output range contains the input, and gloo's
            # all-gather is not documented to allow aliasing.
            mine = buf.param_data[s:e].clone()
            handles.append(g.all_gather_into(buf.param_data[b.start:b.end], mine, async_op=True))
    for h in handles:
        if h is not None:
            h.wait()

