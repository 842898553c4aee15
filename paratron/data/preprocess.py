"""``paratron preprocess``: tokenise a JSONL or text corpus into Megatron ``.bin``/``.idx`` files.

Accepts the flags of Megatron-LM's ``tools/preprocess_data.py`` so that scripts carry over:
``--input --output-prefix --json-keys --tokenizer-type {GPT2BPETokenizer,HuggingFaceTokenizer}
--vocab-file --merge-file --tokenizer-model --append-eod --workers``. With ``--json-keys`` the
outputs are named as Megatron names them, ``PREFIX_<key>_document.{bin,idx}``; with paratron's
``--json-key`` (or neither) the output is ``PREFIX.{bin,idx}``. An end-of-document token is
appended after every document unless ``--no-append-eod`` (``--append-eod`` is accepted and is the
default). ``--tokenizer-type ByteLevelBPE --vocab-size N`` trains a byte-level BPE on the input
first and saves it as ``PREFIX.tokenizer.json``.

Bad input (malformed JSON, a missing key, non-UTF-8 bytes) stops with ``FILE:LINE: reason``;
``--skip-bad-lines`` skips such lines instead, and counts and reports them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from paratron import progress
from paratron.data import corpus, indexed, provenance
from paratron.data import tokenizer as tokenizers_
from paratron.data.workers import ordered_map


@dataclass
class Result:
    """Totals of one preprocessing run. ``outputs`` maps each JSON key to its output prefix."""
    outputs: dict[str, str]
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


class ChunkEncoder:
    """Parse and tokenise one :class:`corpus.Chunk`; runs in the worker processes.

    Returns ``(per_key, bad, nbytes)`` where ``per_key[k] = (tokens, lengths)``: every document's
    tokens (plus EOD) back to back as a ``dtype`` array, and the length of each document.
    """

    def __init__(self, tok: tokenizers_.Tokenizer, keys: Sequence[str], append_eod: bool, dtype):
        self.tok, self.keys, self.append_eod, self.dtype = tok, list(keys), append_eod, np.dtype(dtype)

    def __call__(self, chunk: corpus.Chunk):
        parsed = corpus.parse_chunk(chunk, self.keys)
        tail = [self.tok.eod] if self.append_eod else []
        per_key = []
        for texts in parsed.texts:
            ids = self.tok.encode_batch(texts) if texts else []
            lengths = np.fromiter((len(x) + len(tail) for x in ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter((t for x in ids for t in (x + tail if tail else x)), dtype=self.dtype,
                               count=int(lengths.sum()))
            per_key.append((flat, lengths))
        return per_key, parsed.bad, chunk.nbytes


def output_prefixes(output_prefix: str, keys: Sequence[str], megatron_names: bool) -> dict[str, str]:
    """Output prefix per key: ``PREFIX_<key>_document`` Megatron-style, else ``PREFIX`` (one key)."""
    if megatron_names:
        return {k: f"{output_prefix}_{k}_document" for k in keys}
    if len(keys) != 1:
        raise ValueError(f"several keys {list(keys)} need Megatron naming (--json-keys)")
    return {keys[0]: output_prefix}


def preprocess(inputs: Sequence[str], output_prefix: str, tok: tokenizers_.Tokenizer, *,
               keys: Sequence[str] = ("text",), megatron_names: bool = False, append_eod: bool = True,
               workers: int = 1, skip_bad_lines: bool = False, progress: bool = True,
               chunk_bytes: int = 1 << 18) -> Result:
    """Tokenise ``inputs`` into indexed datasets (see the module docstring for names and rules).

    Documents keep their input order whatever ``workers`` is, so the output is byte-identical
    for any number of workers. Outputs appear atomically when complete.

    Raises:
        corpus.BadInputError: the first bad line (``FILE:LINE: reason``) unless ``skip_bad_lines``.
        FileNotFoundError: a missing input.
        ValueError: the inputs hold no document (nothing is written).
    """
    files = corpus.input_files(inputs)
    total_bytes = sum(f.stat().st_size for f in files)
    dtype = indexed.optimal_dtype(tok.vocab_size)
    outs = output_prefixes(output_prefix, keys, megatron_names)
    result = Result(outputs=outs)
    writers = {k: indexed.IndexedDatasetWriter(p, dtype) for k, p in outs.items()}
    bar = _progress_bar(total_bytes, progress)
    start = time.perf_counter()
    encode = ChunkEncoder(tok, keys, append_eod, dtype)
    # closing(): stop the workers as soon as we stop reading, not when a traceback is freed.
    encoded = contextlib.closing(ordered_map(encode, corpus.chunks(files, chunk_bytes), workers))
    try:
        with encoded as stream:
            for per_key, bad, nbytes in stream:
                if bad and not skip_bad_lines:
                    raise corpus.BadInputError(bad[0])
                result.skipped.extend(bad)
                for k, (flat, lengths) in zip(keys, per_key):
                    writers[k].add_flat(flat, lengths)
                result.documents += len(per_key[0][1])
                result.tokens += sum(int(f.size) for f, _ in per_key)
                result.bytes += nbytes
                if bar is not None:
                    bar.update(nbytes)
                    rate = result.tokens / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix(docs=result.documents, tok_s=f"{rate:,.0f}", refresh=False)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    if result.documents == 0:  # an empty .bin cannot even be memory-mapped by the ranks later
        for w in writers.values():
            w.abort()
        raise ValueError(f"{', '.join(map(str, files))}: no documents (empty, or only blank lines"
                         f"{'; bad lines skipped: ' + str(len(result.skipped)) if result.skipped else ''})")
    for k, w in writers.items():
        w.finalize()
        provenance.write_record(outs[k], tok, json_keys=[k], source={"files": [str(f) for f in files]})
    result.seconds = time.perf_counter() - start
    return result


def _progress_bar(total: int, enabled: bool):
    if not progress.shows(quiet=not enabled):  # no TTY (a rank's log) or --quiet
        return None
    return progress.progress_bar(total, "preprocess", unit="B", unit_scale=True)


def build(args: argparse.Namespace) -> tokenizers_.Tokenizer:
    """The tokenizer the flags ask for; ByteLevelBPE is trained on the input now and saved as
    ``PREFIX.tokenizer.json``."""
    if args.tokenizer_type != "ByteLevelBPE":
        return tokenizers_.make_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file,
                                          args.tokenizer_model)
    if args.vocab_size is None:
        raise ValueError("--tokenizer-type ByteLevelBPE needs --vocab-size N")
    key = _keys(args)[0]
    tok = tokenizers_.train_byte_level_bpe(
        corpus.iter_documents(args.input, key, args.skip_bad_lines), args.vocab_size)
    path = tokenizers_.trained_tokenizer_path(args.output_prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


def _keys(args: argparse.Namespace) -> list[str]:
    return list(args.json_keys) if args.json_keys else [args.json_key or "text"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``paratron preprocess`` flags (Megatron's ``preprocess_data.py`` names, plus paratron's)."""
    g = parser.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True,
                   help="JSONL files (one object a line), text files (one document each), or directories")
    keys = g.add_mutually_exclusive_group()
    keys.add_argument("--json-key", default=None, help="key holding the text (default: text); output PREFIX.bin/.idx")
    keys.add_argument("--json-keys", nargs="+", default=None,
                      help="Megatron style: one output PREFIX_<key>_document.bin/.idx per key")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (bad JSON, missing key, non-UTF-8) and report how many")
    t = parser.add_argument_group("tokenizer")
    t.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=tokenizers_.TOKENIZER_TYPES)
    t.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: bundled data/gpt2-bpe)")
    t.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: bundled data/gpt2-bpe)")
    t.add_argument("--tokenizer-model", default=None, help="a tokenizer.json (HuggingFaceTokenizer)")
    t.add_argument("--vocab-size", type=int, default=None, help="vocab size of a trained ByteLevelBPE")
    t.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                   help="append an end-of-document token to each document (the default)")
    t.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    o = parser.add_argument_group("output")
    o.add_argument("--output-prefix", required=True, help="output path without .bin/.idx")
    o.add_argument("--workers", type=int, default=1, help="tokenising processes")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--log-interval", type=int, default=None, help=argparse.SUPPRESS)  # Megatron's; tqdm replaces it
    o.add_argument("--keep-sequential-samples", action="store_true", help=argparse.SUPPRESS)  # order is always kept
    o.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    o.add_argument("--partitions", type=int, default=1, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (1 on bad input, with ``FILE:LINE: reason``)."""
    try:
        if args.split_sentences:
            raise ValueError("--split-sentences is not supported (documents are not split into sentences)")
        if args.partitions != 1:
            raise ValueError(f"--partitions={args.partitions}: only 1 is supported; use --workers")
        if args.workers < 1:
            raise ValueError(f"--workers={args.workers} must be >= 1")
        tok = build(args)
        res = preprocess(args.input, args.output_prefix, tok, keys=_keys(args),
                         megatron_names=bool(args.json_keys), append_eod=args.append_eod,
                         workers=args.workers, skip_bad_lines=args.skip_bad_lines, progress=not args.quiet)
    except (corpus.BadInputError, FileNotFoundError, ValueError) as e:
        print(f"paratron preprocess: error: {e}", file=sys.stderr)
        return 1
    for prefix in res.outputs.values():
        print(f"wrote {prefix}.bin and {prefix}.idx")
    print(f"{res.documents} documents, {res.tokens} tokens ({tok!r}), {res.bytes / 1e6:.2f} MB in "
          f"{res.seconds:.2f} s ({res.mb_per_s:.2f} MB/s)")
    if res.skipped:
        print(f"skipped {len(res.skipped)} bad lines; first: {res.skipped[0]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paratron preprocess", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
