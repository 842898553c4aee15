"""Token-balanced microbatches (``data.microbatch_tokens``, :mod:`paratron.data.token_batches`):
the lognormal corpus, the plan (bounded, balanced, independent of the layout but for DP), no
document dropped or repeated over an epoch, the packed rows, and the config rules."""

from collections import Counter

import numpy as np
import pytest
import torch

from paratron.config import ConfigError
from paratron.rules import load_config, validate
from paratron.data.lognormal import lognormal_lengths, write_lognormal_dataset
from paratron.data.token_batches import (DocumentSource, Piece, TokenBudgetSampler, collate_pieces,
                                         document_pieces, plan_microbatches)

N, S, G = 1024, 512, 16


def test_lognormal_corpus(tmp_path):
    lengths = lognormal_lengths(20000, seed=3)
    assert 180 <= np.median(lengths) <= 220 and lengths.max() == 4096 and lengths.min() >= 2
    np.testing.assert_array_equal(lengths, lognormal_lengths(20000, seed=3))  # from the seed alone
    ds = write_lognormal_dataset(str(tmp_path / "ln"), 50, vocab_size=64, eod=5, seed=3)
    np.testing.assert_array_equal(ds.document_lengths, lognormal_lengths(50, seed=3))
    for d in range(ds.num_documents):
        doc = ds.get_document(d)
        assert doc[-1] == 5 and 5 not in doc[:-1].tolist() and doc.max() < 64


def _every_step(samplers, steps):
    """Per step, the microbatches of every DP rank (bin order: rank-interleaved)."""
    out = []
    for i in range(steps):
        per_rank = [s.step(i * G) for s in samplers]
        out.append([mb for k in range(len(per_rank[0])) for r in range(len(per_rank)) for mb in per_rank[r][k:k + 1]])
    return out


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_an_epoch_reads_every_document_once(dp):
    """Over one epoch (6 steps of 16 of 96 documents) every label of every document is in exactly
    one microbatch of one DP rank; each microbatch holds at most N positions, each rank the same
    count; the steps are those of one rank (dp=1), grouped differently."""
    lengths = lognormal_lengths(96, seed=1)
    samplers = [TokenBudgetSampler(lengths, G, N, S, r, dp, seed=7) for r in range(dp)]
    covered = Counter()
    for step, mbs in enumerate(_every_step(samplers, 6)):
        assert len(mbs) % dp == 0 and all(0 < sum(p.size for p in mb) <= N for mb in mbs)
        docs = {p.doc for mb in mbs for p in mb}
        assert docs == set(samplers[0].stream(step * G, G).tolist())
        for mb in mbs:
            for p in mb:
                covered.update((p.doc, i) for i in range(p.start, p.stop))
    want = Counter((d, i) for d in range(96) for i in range(int(lengths[d]) - 1))
    assert covered == want  # nothing dropped, nothing twice
    # the next epoch reads them all again, in another order
    nxt = [d for s in range(6, 12) for d in samplers[0].stream(s * G, G).tolist()]
    assert sorted(nxt) == list(range(96)) and nxt != samplers[0].stream(0, 96).tolist()


def test_plan_is_deterministic_and_balanced():
    lengths = lognormal_lengths(400, seed=2)
    a = TokenBudgetSampler(lengths, 64, 2048, S, 0, 2, seed=5)
    b = TokenBudgetSampler(lengths, 64, 2048, S, 0, 2, seed=5)
    assert a.global_plan(128) == b.global_plan(128)  # stateless: a resumed run forms the same batches
    loads = [sum(p.size for p in mb) for mb in a.global_plan(128)]
    assert max(loads) <= 2048 and max(loads) - min(loads) <= S  # LPT: within one piece of each other
    assert a.step(128) == a.global_plan(128)[0::2]


def test_long_documents_are_split_and_bins_never_empty():
    assert document_pieces(3, 1201, 512) == [Piece(3, 0, 512), Piece(3, 512, 1024), Piece(3, 1024, 1200)]
    assert document_pieces(4, 1, 512) == []  # a lone end-of-document token predicts nothing
    pieces = [Piece(0, 0, 900), Piece(1, 0, 10)]
    assert plan_microbatches(pieces, 1000, 2) == [[pieces[0]], [pieces[1]]]  # K = dp, not empty
    with pytest.raises(ValueError, match="fewer than the 2 data-parallel ranks"):
        plan_microbatches(pieces[:1], 1000, 2)


def test_packed_row():
    tokens = np.arange(100, 130)
    src = lambda doc, a, b: tokens[10 * doc + a:10 * doc + b]  # noqa: E731  (docs of 10 tokens)
    mb = collate_pieces([Piece(0, 0, 9), Piece(2, 0, 4)], src, multiple_of=4)
    assert mb["tokens"].tolist() == [list(range(100, 109)) + [120, 121, 122, 123] + [0, 0, 0]]
    assert mb["labels"].tolist() == [list(range(101, 110)) + [121, 122, 123, 124] + [-100] * 3]
    assert mb["position_ids"].tolist() == [list(range(9)) + [0, 1, 2, 3] + [0, 1, 2]]
    assert mb["cu_seqlens"].tolist() == [[0, 9, 13, 16]]
    assert collate_pieces([Piece(0, 0, 9)], src)["cu_seqlens"].tolist() == [[0, 9]]


def test_document_source_reads_split_documents(tmp_path):
    ds = write_lognormal_dataset(str(tmp_path / "ln"), 10, vocab_size=64, eod=0, seed=1)
    src = DocumentSource(ds, np.arange(4, 10))
    np.testing.assert_array_equal(src.lengths, ds.document_lengths[4:])
    np.testing.assert_array_equal(src.read(1, 2, 5), ds.get_document(5)[2:5])
    mb = collate_pieces([Piece(1, 0, int(src.lengths[1]) - 1)], src.read)
    assert torch.equal(mb["labels"][0, :-1], mb["tokens"][0, 1:])


BASE = ["model.seq_length=512", "parallel.pipeline=2", "model.num_layers=4"]


@pytest.mark.parametrize("overrides,world,msg", [
    (["data.microbatch_tokens=0"], 2, r"data.microbatch_tokens=0 must be a positive integer"),
    (["data.microbatch_tokens=256"], 2, r"data.microbatch_tokens=256 is below model.seq_length=512"),
    (["data.microbatch_tokens=512", "model.attention_dropout=0.1"], 2, r"model.attention_dropout=0.1"),
    (["data.microbatch_tokens=512", "model.num_experts=4", "model.moe_capacity_factor=1.0"], 2,
     r"moe_capacity_factor=1.0.*dropless"),
    (["data.microbatch_tokens=512", "model.num_experts=4", "model.moe_aux_loss_coeff=0.01"], 2,
     r"moe_aux_loss_coeff=0.01 / moe_z_loss_coeff=0.0: the router losses"),
    (["data.microbatch_tokens=512", 'data.data_path=["0.5", "a", "0.5", "b"]'], 2, r"2 data.data_path prefixes"),
    (["data.microbatch_tokens=512", "parallel.schedule=interleaved", "parallel.virtual_pipeline=2"], 2,
     r"varies per step, but parallel.schedule='interleaved'.*refuses 1 microbatches"),
    (["data.microbatch_tokens=512", "train.global_batch_size=1", "parallel.pipeline=1"], 2,
     r"train.global_batch_size=1 documents is below the data-parallel size 2"),
])
def test_config_rules(overrides, world, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(load_config(None, BASE + overrides), world)


def test_config_accepts_token_balanced_runs():
    # global_batch_size counts documents: no divisibility by micro_batch_size * dp
    cfg = validate(load_config(None, BASE + ["data.microbatch_tokens=2048", "train.global_batch_size=7"]), 4)
    assert cfg.data.microbatch_tokens == 2048
    with pytest.raises(ConfigError, match="not divisible"):
        validate(load_config(None, BASE + ["train.global_batch_size=7"]), 4)
