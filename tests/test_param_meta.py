"""Typed parameter metadata: ``params.mark`` attaches one ``ParamMeta`` as ``param.meta`` and
nothing else; no module of paratron reads the old loose attributes with a silent default."""

import re
from pathlib import Path

import torch

from paratron.parallel.params import ParamMeta, ShardSpec, is_marked, mark, meta_of

OLD_ATTRS = ("logical_name", "shard", "partition_dim", "tensor_parallel", "sequence_parallel", "is_expert",
             "shared_embedding", "no_weight_decay", "grad_uses", "main_grad", "grad_ready_hook",
             "acquire_main_grad", "qkv_split")


def test_mark_attaches_one_typed_meta():
    p = torch.nn.Parameter(torch.zeros(4, 6))
    before = set(vars(p))
    spec = ShardSpec((8, 6), (4, 0), (4, 6))
    assert mark(p, "w", spec, partition_dim=0, sequence_parallel=True, no_weight_decay=True) is p
    assert set(vars(p)) - before == {"meta"}
    m = p.meta
    assert isinstance(m, ParamMeta) and is_marked(p)
    assert (m.logical_name, m.shard, m.partition_dim, m.tensor_parallel) == ("w", spec, 0, True)
    assert m.sequence_parallel and m.no_weight_decay and not m.is_expert and not m.shared_embedding
    assert (m.grad_uses, m.qkv_split, m.main_grad, m.grad_ready_hook, m.acquire_main_grad) == (1, None, None, None, None)
    replicated = mark(torch.nn.Parameter(torch.zeros(3)), "b").meta
    assert replicated.shard == ShardSpec.replicated((3,)) and not replicated.tensor_parallel


def test_meta_of_an_unmarked_param_is_the_plain_default():
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert not is_marked(p)
    m = meta_of(p)
    assert m.shard == ShardSpec.replicated((2, 3)) and not m.tensor_parallel and m.main_grad is None
    m.shared_embedding = True  # a fresh default each call: nothing sticks to the param
    assert not meta_of(p).shared_embedding and not hasattr(p, "meta")


def test_no_module_reads_the_old_param_attributes_with_a_default():
    """``getattr(p, "main_grad", None)`` and the like would now silently read the default: every
    read goes through ``param.meta`` (or ``meta_of``)."""
    root = Path(__file__).resolve().parents[1] / "paratron"
    old = "|".join(a for a in OLD_ATTRS if a != "logical_name")  # modules have a logical_name too
    pattern = re.compile(rf"""\b(getattr|hasattr|setattr)\(\s*[\w.\[\]]+\s*,\s*["']({old})["']""")
    hits = [f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
            for path in sorted(root.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "read param metadata through param.meta / params.meta_of:\n" + "\n".join(hits)
