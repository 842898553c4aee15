"""First-use data preparation for a training run: turn ``data.corpus`` into indexed files.

The training loop calls :func:`ensure_dataset` on global rank 0, then on the other ranks after a
barrier. Preprocessing writes under temporary names and renames when complete, so the call is
idempotent and processes that race only duplicate work.
"""

from __future__ import annotations

import os
from pathlib import Path

from paratron.data import corpus, indexed, paths, preprocess, tokenizer


def parse_data_path(data_path: list[str]) -> list[tuple[float, str]]:
    """``["0.7", "a", "0.3", "b"]`` -> ``[(0.7, "a"), (0.3, "b")]``; unweighted prefixes get weight 1.

    Raises:
        ValueError: a mix of weighted and unweighted entries, or a weight that is not > 0.
    """
    items = [x for x in data_path if str(x).strip()]
    if not items:
        return []

    def number(x) -> bool:
        try:
            float(x)
            return True
        except ValueError:
            return False

    if not any(number(x) for x in items):
        return [(1.0, str(x)) for x in items]
    if len(items) % 2 or not all(number(items[i]) for i in range(0, len(items), 2)):
        raise ValueError(f"data.data_path={items}: give either prefixes, or weight-prefix pairs like "
                         "['0.7', 'a', '0.3', 'b']")
    pairs = [(float(items[i]), str(items[i + 1])) for i in range(0, len(items), 2)]
    for w, p in pairs:
        if not w > 0:
            raise ValueError(f"data.data_path: weight {w} of {p!r} must be > 0")
    return pairs


def tokenizer_tag(data_cfg) -> str:
    """Short name of the configured tokenizer for file names: gpt2, hf-<stem>, bpe<vocab>."""
    if data_cfg.tokenizer_type == "GPT2BPETokenizer":
        return "gpt2"
    if data_cfg.tokenizer_type == "HuggingFaceTokenizer":
        return f"hf-{Path(data_cfg.tokenizer_model or 'none').stem}"
    return f"bpe{data_cfg.tokenizer_vocab_size}"


def default_prefix(data_cfg) -> Path:
    """``<repo>/data/cache/<corpus stem>_<tokenizer tag>``, for a corpus without data.data_path."""
    stem = Path(data_cfg.corpus).name.split(".")[0]
    return paths.repo_root() / "data" / "cache" / f"{stem}_{tokenizer_tag(data_cfg)}"


def _prefixes(data_cfg) -> list[tuple[float, str]]:
    pairs = [(w, os.fspath(paths.locate(p))) for w, p in parse_data_path(data_cfg.data_path)]
    if pairs:
        return pairs
    if not data_cfg.corpus:
        raise ValueError("data.data_path is empty and data.corpus is not set; give indexed-dataset "
                         "prefixes or a corpus to preprocess")
    return [(1.0, os.fspath(default_prefix(data_cfg)))]


def byte_level_bpe_for(data_cfg) -> tokenizer.Tokenizer:
    """The ByteLevelBPE tokenizer of a run: ``PREFIX.tokenizer.json`` of the first prefix, trained
    on ``data.corpus`` (``data.tokenizer_vocab_size`` tokens) and saved there if missing.

    Raises:
        FileNotFoundError: no saved tokenizer and no corpus to train one on.
    """
    prefix = _prefixes(data_cfg)[0][1]
    path = tokenizer.trained_tokenizer_path(prefix)
    if path.is_file():
        return tokenizer.from_file(path)
    if not data_cfg.corpus:
        raise FileNotFoundError(f"data.tokenizer_type='ByteLevelBPE': {path} does not exist; set "
                                "data.tokenizer_model, or data.corpus to train one")
    source = paths.resolve_input(data_cfg.corpus, "data.corpus")
    tok = tokenizer.train_byte_level_bpe(corpus.iter_documents([source], data_cfg.json_key),
                                         data_cfg.tokenizer_vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


def ensure_dataset(data_cfg, seed: int, progress: bool = True) -> list[tuple[float, str]]:
    """The run's ``(weight, prefix)`` pairs, preprocessing ``data.corpus`` into its prefix first if
    that prefix does not exist yet.

    With ``data.corpus`` set, ``data.data_path`` names at most one prefix (default:
    :func:`default_prefix`). ``seed`` is accepted for the training loop's call; preprocessing is
    deterministic and does not use it.

    Raises:
        ValueError: a corpus with several prefixes, neither a corpus nor prefixes, or bad weights.
        FileNotFoundError: a prefix that does not exist and has no corpus to build it from.
        corpus.BadInputError: a bad line in the corpus (``FILE:LINE: reason``).
    """
    del seed
    pairs = _prefixes(data_cfg)
    if data_cfg.corpus:
        if len(pairs) != 1:
            raise ValueError(f"data.corpus={data_cfg.corpus!r} is preprocessed into one prefix, but "
                             f"data.data_path lists {len(pairs)}")
        prefix = pairs[0][1]
        if not indexed.exists(prefix):
            source = paths.resolve_input(data_cfg.corpus, "data.corpus")
            tok = tokenizer.build_tokenizer(data_cfg)
            preprocess.preprocess([os.fspath(source)], prefix, tok, keys=[data_cfg.json_key],
                                  workers=max(1, data_cfg.num_workers), progress=progress)
        return pairs
    for _, prefix in pairs:
        if not indexed.exists(prefix):
            raise FileNotFoundError(f"data.data_path: {prefix}.bin/.idx do not exist (and data.corpus "
                                    "is not set to build them)")
    return pairs
