"""Tokenizers on Hugging Face ``tokenizers``: GPT-2 BPE files, a ``tokenizer.json``, or a byte-level
BPE trained on a corpus.

Every kind is wrapped in :class:`Tokenizer`, which the rest of paratron codes against:
``encode(text) -> list[int]``, ``encode_batch(texts)``, ``decode(ids) -> str``, ``vocab_size``
(the largest token id + 1, added and special tokens included, so ids with gaps still fit the
embedding and the ``.bin`` dtype) and ``eod`` (the end-of-document id appended after
every document; ``<|endoftext|>`` = 50256 for GPT-2). ``fingerprint`` identifies the tokenizer by its
content, so a dataset can record which tokenizer built it. Encoding never adds special tokens of its own (no BOS), so the
only special token in a preprocessed corpus is the EOD the preprocessor appends.

Sources: byte-level BPE as in Radford et al. 2019 (GPT-2), section 2.2; the tokenizer types and
their flags follow Megatron-LM's ``tools/preprocess_data.py``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Optional

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from paratron.data import paths

EOD_TOKEN = "<|endoftext|>"
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
"""End-of-document tokens looked up, in order, in a ``tokenizer.json``."""

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelBPE")


class Tokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with a known end-of-document id.

    Args:
        hf: the underlying tokenizer.
        eod: end-of-document token id.
        name: a short tag for file names and logs (``gpt2``, ``hf-<stem>``, ``bpe<vocab>``).
        kind: the Megatron-style type name (one of :data:`TOKENIZER_TYPES`).
        source: the file it was loaded from, for messages (None when built in memory).
    """

    def __init__(self, hf: HFTokenizer, eod: int, name: str, kind: str = "HuggingFaceTokenizer",
                 source: str | None = None):
        self.hf = hf
        self.eod = int(eod)
        self.name = name
        self.kind = kind
        self.source = source
        self.vocab_size = max_token_id(hf) + 1

    @property
    def fingerprint(self) -> str:
        """16 hex digits of the sha256 of the tokenizer's serialised form (vocabulary, merges,
        added tokens, pre-tokenizer): equal for the same tokenizer however it was loaded."""
        return hashlib.sha256(self.hf.to_str().encode("utf-8")).hexdigest()[:16]

    def describe(self) -> str:
        """``ByteLevelBPE bpe512 (data/x.tokenizer.json), vocab 512, fingerprint 0123...``."""
        where = f" ({self.source})" if self.source else ""
        return f"{self.kind} {self.name}{where}, vocab {self.vocab_size}, fingerprint {self.fingerprint}"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (the library tokenises the batch on several threads)."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens included."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write a ``tokenizer.json`` atomically (temporary file, then rename)."""
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        self.hf.save(tmp)
        os.replace(tmp, path)
        self.source = os.fspath(path)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name}, vocab_size={self.vocab_size}, eod={self.eod})"


def max_token_id(hf: HFTokenizer) -> int:
    """The largest id of the vocabulary, added and special tokens included (-1 when empty).

    A ``tokenizer.json`` may leave gaps in its ids (1,001 tokens whose largest id is 70,000), so the
    token count is not a bound on the ids: the ``.bin`` dtype and the embedding size use this + 1.
    """
    return max(hf.get_vocab(with_added_tokens=True).values(), default=-1)


def gpt2_bpe(vocab_file: str | os.PathLike | None = None,
             merge_file: str | os.PathLike | None = None) -> Tokenizer:
    """The GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (default: the bundled
    ``data/gpt2-bpe``). "Hello world" encodes to ``[15496, 995]``; ``eod`` is 50256.

    Raises:
        FileNotFoundError: a missing vocab or merges file (named).
        ValueError: a vocabulary without ``<|endoftext|>``.
    """
    vocab = paths.resolve_input(vocab_file, "vocab_file") if vocab_file else paths.bundled("gpt2-bpe/vocab.json")
    merges = paths.resolve_input(merge_file, "merge_file") if merge_file else paths.bundled("gpt2-bpe/merges.txt")
    hf = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    eod = hf.token_to_id(EOD_TOKEN)
    if eod is None:
        raise ValueError(f"vocab_file={vocab}: has no {EOD_TOKEN!r} token, which GPT2BPETokenizer "
                         "uses as end of document")
    hf.add_special_tokens([EOD_TOKEN])
    return Tokenizer(hf, eod, "gpt2", kind="GPT2BPETokenizer", source=str(vocab))


def from_file(tokenizer_model: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` (or a directory holding one).

    Raises:
        FileNotFoundError: no such file.
        ValueError: none of :data:`EOD_CANDIDATES` is in its vocabulary.
    """
    path = paths.resolve_input(tokenizer_model, "tokenizer_model")
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer_model={tokenizer_model}: directory has no tokenizer.json")
    hf = HFTokenizer.from_file(str(path))
    # PREFIX.tokenizer.json is what preprocessing trains; name it by size like a fresh one.
    trained = path.name.endswith(".tokenizer.json")
    name = f"bpe{hf.get_vocab_size(with_added_tokens=True)}" if trained else f"hf-{path.stem}"
    kind = "ByteLevelBPE" if trained else "HuggingFaceTokenizer"
    for candidate in EOD_CANDIDATES:
        eod = hf.token_to_id(candidate)
        if eod is not None:
            return Tokenizer(hf, eod, name, kind=kind, source=str(path))
    raise ValueError(f"tokenizer_model={path}: no end-of-document token; looked for "
                     f"{', '.join(EOD_CANDIDATES)}")


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, length: Optional[int] = None) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` = id 0 included).

    Raises:
        ValueError: vocab_size below 257 (the 256 byte symbols plus the EOD token).
    """
    if vocab_size < 257:
        raise ValueError(f"tokenizer_vocab_size={vocab_size} must be >= 257 (256 bytes + {EOD_TOKEN})")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer, length=length)
    return Tokenizer(hf, hf.token_to_id(EOD_TOKEN), f"bpe{vocab_size}", kind="ByteLevelBPE")


def trained_tokenizer_path(prefix: str | os.PathLike) -> Path:
    """Where a byte-level BPE trained for ``prefix`` is saved: ``PREFIX.tokenizer.json``."""
    return Path(f"{os.fspath(prefix)}.tokenizer.json")


def make_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None, tokenizer_model=None) -> Tokenizer:
    """A tokenizer by Megatron type name; ``ByteLevelBPE`` loads an already trained ``tokenizer_model``.

    Raises:
        ValueError: an unknown type, or ByteLevelBPE without tokenizer_model.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("tokenizer_type='HuggingFaceTokenizer' needs tokenizer_model (a tokenizer.json)")
        return from_file(tokenizer_model)
    if tokenizer_type == "ByteLevelBPE":
        if not tokenizer_model:
            raise ValueError("tokenizer_type='ByteLevelBPE' needs tokenizer_model: the PREFIX.tokenizer.json "
                             "that preprocessing trained")
        return from_file(tokenizer_model)
    raise ValueError(f"tokenizer_type={tokenizer_type!r} must be one of {', '.join(TOKENIZER_TYPES)}")
