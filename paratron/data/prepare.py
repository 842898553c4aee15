"""First-use data preparation for a training run: turn a corpus into indexed files once, and the
run's tokenizer.

A corpus (``data.corpus``, or ``paratron train --data FILE``) is tokenised into the data cache
(``data.cache_dir``, else ``<repo>/data/cache``) under a prefix keyed by the corpus's content hash,
the JSON key and the tokenizer, so a later run on the same text with the same tokenizer reuses it
and any change makes a new one. The launcher calls :func:`prepare_run_data` once before the ranks
start (errors and the progress bar appear once); in the ranks, global rank 0 calls it first and
the others after a barrier. Preprocessing writes under temporary names and renames when complete,
so the call is idempotent and processes that race only duplicate work.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from paratron.data import corpus, indexed, paths, preprocess, provenance, tokenizer
from paratron.data.split_plan import split_ranges


def parse_data_path(data_path: list[str]) -> list[tuple[float, str]]:
    """``["0.7", "a", "0.3", "b"]`` -> ``[(0.7, "a"), (0.3, "b")]``; unweighted prefixes get weight 1.

    The one parser of Megatron's ``--data-path`` (the pre-launch checks use it too).

    Raises:
        ValueError: a mix of weighted and unweighted entries (``["a", "0.5", "b"]``), or a weight
            that is not > 0.
    """
    items = [str(x) for x in data_path if str(x).strip()]
    if not items:
        return []

    def number(x: str) -> bool:
        try:
            float(x)
            return True
        except ValueError:
            return False

    if not any(number(x) for x in items):
        return [(1.0, x) for x in items]
    if len(items) % 2 or not all(number(items[i]) for i in range(0, len(items), 2)):
        raise ValueError(f"data.data_path={items}: give either prefixes, or weight-prefix pairs like "
                         "['0.7', 'a', '0.3', 'b']")
    pairs = [(float(items[i]), items[i + 1]) for i in range(0, len(items), 2)]
    for w, p in pairs:
        if not w > 0:
            raise ValueError(f"data.data_path: weight {w} of {p!r} must be > 0")
    return pairs


def split_data_argument(path: str) -> tuple[str, str]:
    """What ``paratron train --data PATH`` names: ``("prefix", P)`` for an existing ``P.bin/.idx``
    pair (``PATH`` may end in ``.bin`` or ``.idx``), else ``("corpus", PATH)`` (a JSONL/JSON/text
    file or a directory of them, tokenised on first use)."""
    stem = path[:-4] if path.endswith((".bin", ".idx")) else path
    located = paths.locate(stem)
    if indexed.exists(located):
        return "prefix", os.fspath(located)
    return "corpus", path


def tokenizer_tag(data_cfg) -> str:
    """Short name of the configured tokenizer for file names: gpt2, hf-<stem>, bpe<vocab>."""
    if data_cfg.tokenizer_type == "GPT2BPETokenizer":
        return "gpt2"
    if data_cfg.tokenizer_type == "HuggingFaceTokenizer":
        return f"hf-{Path(data_cfg.tokenizer_model or 'none').stem}"
    return f"bpe{data_cfg.tokenizer_vocab_size}"


def file_digest(path: Path, memo: Path | None = None) -> str:
    """32 hex digits of blake2b over the file's bytes. With ``memo`` (a directory) the digest is
    remembered under the file's absolute path, size and modification time, so the ranks of a run
    and later runs do not read a large corpus again (as ``make`` and ``rsync``, a rewrite that keeps
    size and mtime is not noticed)."""
    st = path.stat()
    stamp = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    entry = memo / f"{hashlib.blake2b(stamp, digest_size=10).hexdigest()}.digest" if memo else None
    if entry is not None and entry.is_file():
        return entry.read_text().strip()
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        tmp.write_text(digest + "\n")
        os.replace(tmp, entry)
    return digest


def cache_key(data_cfg) -> str:
    """16 hex digits naming a corpus's tokenised form: the corpus files' bytes (in order), the JSON
    key, and the tokenizer (its files' bytes, or the vocab size of one trained on the corpus).
    File digests are remembered in ``<cache>/.digests`` (:func:`file_digest`).

    Raises:
        FileNotFoundError: the corpus or a tokenizer file is missing (the field named).
    """
    source = paths.resolve_input(data_cfg.corpus, "data.corpus")
    memo = cache_root(data_cfg) / ".digests"
    h = hashlib.blake2b(digest_size=8)
    for f in corpus.input_files([source]) + _tokenizer_files(data_cfg):
        h.update(f"{f.stat().st_size}:{file_digest(f, memo)}\0".encode())
    h.update(f"key={data_cfg.json_key}\0tok={data_cfg.tokenizer_type}\0".encode())
    if data_cfg.tokenizer_type == "ByteLevelBPE" and not data_cfg.tokenizer_model:
        h.update(f"trained{data_cfg.tokenizer_vocab_size}".encode())
    return h.hexdigest()


def _tokenizer_files(data_cfg) -> list[Path]:
    """The files that define the configured tokenizer (none for a BPE still to be trained)."""
    d = data_cfg

    def given_or_bundled(value, field: str, bundled: str) -> Path:
        return paths.resolve_input(value, f"data.{field}") if value else paths.bundled(bundled)

    if d.tokenizer_type == "GPT2BPETokenizer":
        return [given_or_bundled(d.vocab_file, "vocab_file", "gpt2-bpe/vocab.json"),
                given_or_bundled(d.merge_file, "merge_file", "gpt2-bpe/merges.txt")]
    return [paths.resolve_input(d.tokenizer_model, "data.tokenizer_model")] if d.tokenizer_model else []


def cache_root(data_cfg) -> Path:
    """The data cache: ``data.cache_dir``, else ``<repo>/data/cache``."""
    return Path(data_cfg.cache_dir) if data_cfg.cache_dir else paths.repo_root() / "data" / "cache"


def default_prefix(data_cfg) -> Path:
    """``<cache>/<corpus stem>_<tokenizer tag>-<cache key>``, for a corpus without data.data_path."""
    stem = Path(data_cfg.corpus).name.split(".")[0]
    return cache_root(data_cfg) / f"{stem}_{tokenizer_tag(data_cfg)}-{cache_key(data_cfg)}"


def _prefixes(data_cfg) -> list[tuple[float, str]]:
    pairs = [(w, os.fspath(paths.locate(p))) for w, p in parse_data_path(data_cfg.data_path)]
    if pairs:
        return pairs
    if not data_cfg.corpus:
        raise ValueError("data.data_path is empty and data.corpus is not set; give indexed-dataset "
                         "prefixes or a corpus to preprocess (paratron train --data PATH)")
    return [(1.0, os.fspath(default_prefix(data_cfg)))]


def byte_level_bpe_for(data_cfg, prefix: str | None = None) -> tokenizer.Tokenizer:
    """The ByteLevelBPE tokenizer of a run: ``PREFIX.tokenizer.json`` of the first prefix, trained
    on ``data.corpus`` (``data.tokenizer_vocab_size`` tokens) and saved there if missing.

    Raises:
        FileNotFoundError: no saved tokenizer and no corpus to train one on.
    """
    prefix = prefix or _prefixes(data_cfg)[0][1]
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


def build_tokenizer(data_cfg, prefix: str | None = None) -> tokenizer.Tokenizer:
    """The tokenizer of a run, from :class:`paratron.config.DataConfig`.

    GPT2BPETokenizer uses ``vocab_file``/``merge_file`` (default: the bundled GPT-2 files);
    HuggingFaceTokenizer loads ``tokenizer_model``. ByteLevelBPE loads ``tokenizer_model`` when set,
    else the ``PREFIX.tokenizer.json`` saved next to the first dataset prefix (``prefix`` when
    given); when that does not exist yet and ``corpus`` is set it is trained on the corpus now and
    saved there (atomically, so ranks that race produce the same file).

    Raises:
        ValueError, FileNotFoundError: a bad type or missing file, naming the ``data.*`` field.
    """
    if data_cfg.tokenizer_type != "ByteLevelBPE" or data_cfg.tokenizer_model:
        return tokenizer.make_tokenizer(data_cfg.tokenizer_type, data_cfg.vocab_file, data_cfg.merge_file,
                                        data_cfg.tokenizer_model)
    return byte_level_bpe_for(data_cfg, prefix)


def ensure_dataset(data_cfg, seed: int = 0, progress: bool = True) -> list[tuple[float, str]]:
    """The run's ``(weight, prefix)`` pairs, preprocessing ``data.corpus`` into its prefix first if
    that prefix does not exist yet (see :func:`prepare_run_data`, which also checks the tokenizer)."""
    del seed  # preprocessing is deterministic
    return _ensure(data_cfg, progress)[0]


def _ensure(data_cfg, progress: bool, check=None) -> tuple[list[tuple[float, str]], tokenizer.Tokenizer | None]:
    pairs = _prefixes(data_cfg)
    if not data_cfg.corpus:
        for _, prefix in pairs:
            if not indexed.exists(prefix):
                raise FileNotFoundError(f"data.data_path: {prefix}.bin/.idx do not exist (and data.corpus "
                                        "is not set to build them)")
        return pairs, None
    if len(pairs) != 1:
        raise ValueError(f"data.corpus={data_cfg.corpus!r} is preprocessed into one prefix, but "
                         f"data.data_path lists {len(pairs)}")
    prefix = pairs[0][1]
    if indexed.exists(prefix):
        _say(progress, f"reusing the tokenised corpus {prefix}.bin/.idx")
        return pairs, None
    source = paths.resolve_input(data_cfg.corpus, "data.corpus")
    tok = build_tokenizer(data_cfg, prefix)
    if check is not None:  # before the (long) tokenisation, not after it
        check(tok)
    _say(progress, f"tokenising {source} into {prefix}.bin/.idx with {tok.describe()}")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    preprocess.preprocess([os.fspath(source)], prefix, tok, keys=[data_cfg.json_key],
                          workers=max(1, data_cfg.num_workers), progress=progress)
    return pairs, tok


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[paratron] {message}", file=sys.stderr, flush=True)


def prepare_run_data(data_cfg, progress: bool = True, check=None) -> tuple[list[tuple[float, str]], tokenizer.Tokenizer]:
    """The run's ``(weight, prefix)`` pairs and tokenizer: the corpus tokenised into the cache if
    not there yet, then every prefix checked against the tokenizer that built it. ``check(tok)``,
    when given, is called with the tokenizer as soon as it exists, before any tokenisation (a
    check of the model against the tokenizer, say, that should not wait for the corpus).

    Raises:
        ValueError: a corpus with several prefixes, neither a corpus nor prefixes, bad weights, an
            empty corpus or an empty prefix.
        FileNotFoundError: a prefix that does not exist and has no corpus to build it from.
        corpus.BadInputError: a bad line in the corpus (``FILE:LINE: reason``).
        provenance.TokenizerMismatchError: a prefix built by another tokenizer (both named).
    """
    pairs, tok = _ensure(data_cfg, progress, check)
    if tok is None:
        try:
            tok = build_tokenizer(data_cfg, pairs[0][1])
        except FileNotFoundError as e:
            built = provenance.read_record(pairs[0][1])
            if built is None:
                raise
            raise provenance.TokenizerMismatchError(
                f"{pairs[0][1]}.bin/.idx were built with {provenance.describe_record(built['tokenizer'])}, "
                f"but this run asks for data.tokenizer_type={data_cfg.tokenizer_type!r} ({e})") from None
    for _, prefix in pairs:
        provenance.check_tokenizer(prefix, tok)
        if indexed.IndexedDataset(prefix).num_documents == 0:
            raise ValueError(f"{prefix}.bin/.idx hold no document; rebuild them from a non-empty corpus")
    return pairs, tok


def validation_prompt(pairs: list[tuple[float, str]], split: str, tok: tokenizer.Tokenizer,
                      num_tokens: int = 8) -> str | None:
    """The first ``num_tokens`` tokens of the first validation document of the first prefix (of the
    first training document when there is no validation split), decoded: a sample prompt that
    belongs to the corpus. None for an empty dataset."""
    ds = indexed.IndexedDataset(pairs[0][1])
    if ds.num_documents == 0:
        return None
    (train_lo, _), (valid_lo, valid_hi) = split_ranges(ds.num_documents, split)[:2]
    doc = valid_lo if valid_hi > valid_lo else train_lo
    ids = [int(t) for t in ds.get_document(doc)[:num_tokens] if int(t) != tok.eod]
    return tok.decode(ids) if ids else None
