"""A synthetic corpus with lognormal document lengths (median 200, at most 4096 tokens), for the
token-balanced microbatch tests and benchmark (:mod:`paratron.data.token_batches`).

Generated from a seed, never stored: ``write_lognormal_dataset(prefix, ...)`` writes a
``.bin``/``.idx`` pair (no tokenizer record, so any tokenizer of at least ``vocab_size`` ids
reads it). Lengths are ``round(exp(N(ln median, sigma^2)))`` clipped to ``[min_tokens,
max_tokens]``; with ``sigma = 1`` about 0.13 % of documents reach the clip. Tokens are uniform
over ``[0, vocab_size)`` without ``eod``, and every document ends with ``eod``.

Command line: ``python -m paratron.data.lognormal --output-prefix /tmp/lognormal
--documents 2000 --vocab-size 512 --eod 0``.
"""

from __future__ import annotations

import argparse

import numpy as np

from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype

MEDIAN, SIGMA, MAX_TOKENS = 200, 1.0, 4096


def lognormal_lengths(num_documents: int, *, median: float = MEDIAN, sigma: float = SIGMA,
                      max_tokens: int = MAX_TOKENS, min_tokens: int = 2, seed: int = 0) -> np.ndarray:
    """Document lengths in tokens (end-of-document token included), int64 [num_documents]."""
    rng = np.random.default_rng([seed, 0])
    raw = np.exp(rng.normal(np.log(median), sigma, num_documents))
    return np.clip(np.rint(raw), min_tokens, max_tokens).astype(np.int64)


def write_lognormal_dataset(prefix: str, num_documents: int, vocab_size: int, eod: int, *, seed: int = 0,
                            median: float = MEDIAN, sigma: float = SIGMA, max_tokens: int = MAX_TOKENS):
    """Write the corpus to ``prefix.bin/.idx``; returns its :class:`IndexedDataset`.

    Raises:
        ValueError: ``vocab_size < 2`` or ``eod`` outside ``[0, vocab_size)``.
    """
    if vocab_size < 2 or not 0 <= eod < vocab_size:
        raise ValueError(f"vocab_size={vocab_size} must be >= 2 and eod={eod} in [0, vocab_size)")
    lengths = lognormal_lengths(num_documents, median=median, sigma=sigma, max_tokens=max_tokens, seed=seed)
    rng = np.random.default_rng([seed, 1])
    tokens = rng.integers(0, vocab_size - 1, int(lengths.sum()))
    tokens += tokens >= eod  # skip eod inside documents
    tokens[np.cumsum(lengths) - 1] = eod
    with IndexedDatasetWriter(prefix, optimal_dtype(vocab_size)) as w:
        w.add_flat(tokens, lengths)
    return IndexedDataset(prefix)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--documents", type=int, default=2000)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--eod", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    ds = write_lognormal_dataset(a.output_prefix, a.documents, a.vocab_size, a.eod, seed=a.seed)
    lengths = ds.document_lengths
    print(f"{a.output_prefix}: {ds.num_documents} documents, {int(lengths.sum())} tokens, median "
          f"{int(np.median(lengths))}, max {int(lengths.max())}")


if __name__ == "__main__":
    main()
