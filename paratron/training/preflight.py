"""Checks and preparation that must pass before any process group exists.

Everything here runs on one process (the launcher, or each rank under a plain ``torchrun``) and
raises :class:`ConfigError` naming the field, file and rule, so a bad input is one clean line
instead of a traceback from every rank. Paths and data-path weights are read with the data
package's own parser and lookup (:mod:`paratron.data.prepare`, :mod:`paratron.data.paths`), so the
checks and the run agree on what a path means.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from paratron.checkpoint import storage
from paratron.checkpoint.io import resume_manifest
from paratron.checkpoint.items import CheckpointError
from paratron.config import Config, ConfigError
from paratron.config import model_shape as spec
from paratron.config.record_rules import record_based
from paratron.data import corpus, indexed, paths, prepare, records
from paratron.data.indexed import IndexedDataset
from paratron.data.prepare import split_data_argument
from paratron.data.split_plan import RUN_SPLITS, plan_splits
from paratron.training.callbacks import import_callback_module


def data_prefixes(cfg: Config) -> list[tuple[float, str]]:
    """``data.data_path`` as ``(weight, located prefix)`` pairs (Megatron's weights allowed).

    Raises:
        ConfigError: the rule :func:`paratron.data.prepare.parse_data_path` states.
    """
    try:
        pairs = prepare.parse_data_path(cfg.data.data_path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return [(w, os.fspath(paths.locate(p))) for w, p in pairs]


def _missing(value: str) -> bool:
    return not paths.locate(value).exists()


def check_paths(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the field and path when an input file is missing."""
    d = cfg.data
    if d.corpus is not None and _missing(d.corpus):
        raise ConfigError(f"data.corpus={d.corpus!r}: no such file or directory")
    for _, prefix in data_prefixes(cfg):
        if d.corpus is None and not indexed.exists(prefix):
            raise ConfigError(f"data.data_path: {prefix}.bin/.idx do not exist "
                              "(run `paratron preprocess`, or train with --data FILE.jsonl)")
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        v = getattr(d, name)
        if v is not None and _missing(v):
            raise ConfigError(f"data.{name}={v!r}: no such file")
    if cfg.checkpoint.load is not None and not Path(cfg.checkpoint.load).exists():
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load!r}: no such directory")


def apply_data_argument(cfg: Config, data: str | None, overrides: list[str]) -> None:
    """Let the command line's data replace the config file's.

    ``--data PATH`` names a corpus (tokenised on first use) or an existing ``.bin/.idx`` prefix;
    either replaces ``data.corpus`` and ``data.data_path``. ``--data-path`` (or ``--set
    data.data_path=...``) without a ``data.corpus`` override drops the config file's corpus;
    ``--set data.hf_dataset=...`` drops the config file's corpus and prefixes alike.
    """
    if data:
        kind, value = split_data_argument(data)
        cfg.data.corpus = value if kind == "corpus" else None
        cfg.data.data_path = [] if kind == "corpus" else [value]
        return
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if "data.data_path" in keys and "data.corpus" not in keys:
        cfg.data.corpus = None
    if "data.hf_dataset" in keys:
        cfg.data.corpus = None if "data.corpus" not in keys else cfg.data.corpus
        cfg.data.data_path = [] if "data.data_path" not in keys else cfg.data.data_path


def apply_run_dir_defaults(cfg: Config, run_dir: str | os.PathLike) -> None:
    """The run directory owns its outputs: checkpoints go to ``RUN_DIR/checkpoints`` unless
    ``checkpoint.save`` is set."""
    if cfg.checkpoint.save is None:
        cfg.checkpoint.save = os.fspath(Path(run_dir) / "checkpoints")


def prepare_data(cfg: Config, progress: bool = True):
    """Tokenise the corpus into the cache if needed (once, here, with a progress bar), check the
    tokenizer against the data's record and ``model.vocab_size`` (before tokenising: a too-small
    vocabulary is refused at once, not after the corpus is read), and validate every ``.bin/.idx``
    header and size.

    Returns:
        The run's tokenizer.

    Raises:
        ConfigError: bad input (``FILE:LINE: reason``), a tokenizer mismatch (both named), a missing
            file, a malformed or truncated dataset (the file named).
    """
    if cfg.data.tokenizer_type == "ByteLevelBPE" and not cfg.data.tokenizer_model:
        # a BPE trained here asks for data.tokenizer_vocab_size ids: refuse before training it
        check_vocab_fits(cfg, cfg.data.tokenizer_vocab_size, "data.tokenizer_vocab_size")
    try:
        vocab_fits = lambda tok: check_vocab_fits(cfg, tok.vocab_size)  # noqa: E731
        if record_based(cfg):  # records are tokenised on demand: check them and the tokenizer
            tok = prepare.build_tokenizer(cfg.data)
            vocab_fits(tok)
            records.check_records(cfg.data, tok, cfg.model.seq_length)
            return tok
        pairs, tok = prepare.prepare_run_data(cfg.data, progress=progress, check=vocab_fits)
        for _, prefix in pairs:
            check_dataset_files(prefix)
        notes = split_warnings(cfg, pairs)
    except (corpus.BadInputError, ValueError, FileNotFoundError, ImportError) as e:
        raise ConfigError(str(e)) from None
    for line in notes:
        print(f"paratron: warning: {line}", file=sys.stderr)
    os.environ[SPLITS_CHECKED_ENV] = "1"  # the ranks (inherited) do not repeat these warnings
    return tok


SPLITS_CHECKED_ENV = "PARATRON_SPLITS_CHECKED"
"""Set once :func:`prepare_data` has checked the splits and printed their warnings."""


def split_warnings(cfg: Config, pairs: list[tuple[float, str]]) -> list[str]:
    """The train and valid splits of every prefix (one, a blend, or the whole documents of
    ``data.microbatch_tokens``) under the rule every dataset path applies
    (:func:`paratron.data.split_plan.plan_splits`): the warnings of the parts left out.

    Raises:
        ValueError: a train split too small for one sample (the prefix and its tokens named).
    """
    indexed = [(w, IndexedDataset(prefix)) for w, prefix in pairs]
    return plan_splits(indexed, cfg.data.split, cfg.model.seq_length,
                       whole_documents=cfg.data.microbatch_tokens is not None, wanted=RUN_SPLITS)[1]


def check_dataset_files(prefix: str) -> None:
    """Open ``PREFIX.idx`` (header, version, dtype, counts) and require ``PREFIX.bin`` to hold
    exactly the bytes the index describes.

    Raises:
        ValueError: naming the file and both sizes.
    """
    ds = IndexedDataset(prefix)
    want = int(ds.sequence_lengths.sum(dtype="int64")) * ds.dtype.itemsize
    have = os.path.getsize(f"{prefix}.bin")
    if have != want:
        raise ValueError(f"{prefix}.bin: {have:,} bytes, but {prefix}.idx describes {want:,} "
                         f"({'truncated' if have < want else 'trailing bytes'}); rebuild the dataset")


def _optimizer_bytes_per_param(opt) -> int:
    """fp32 state saved per parameter: the main weight, plus two Adam moments or SGD's momentum."""
    if opt.name == "sgd":
        return 8 if opt.sgd_momentum else 4
    return 12


def _mlp_params(h: int, f: int, matrices: int, bias: bool) -> int:
    return matrices * h * f + (bias and (matrices - 1) * f + h)


def estimated_checkpoint_bytes(cfg: Config, vocab_size: int | None) -> int:
    """About the bytes of one checkpoint's tensors: every parameter in the training precision
    plus the optimizer's fp32 state (DCP's per-tensor records and the JSON files add a little).

    The count follows the model shape (:mod:`paratron.config.model_shape`): attention with GQA, a
    GELU or SwiGLU MLP (or the experts and the router), norms, biases, the embedding (and an
    untied output layer, a learned position table).
    """
    m = cfg.model
    h, d, bias = m.hidden_size, spec.head_dim(m), m.add_bias_linear
    q, kv = m.num_attention_heads * d, 2 * spec.query_groups(m) * d
    norm = h * (2 if m.normalization == "layernorm" else 1)
    attention = h * (q + kv) + q * h + (bias and q + kv + h)
    matrices = 3 if m.activation == "swiglu" else 2
    dense = _mlp_params(h, spec.ffn_size(m), matrices, bias)
    moe = (m.num_experts * (_mlp_params(h, spec.expert_ffn_size(m), matrices, bias) + h)
           + (_mlp_params(h, m.moe_shared_expert_ffn_hidden_size, matrices, bias)
              if m.moe_shared_expert_ffn_hidden_size else 0))
    layers = sum(2 * norm + attention + (moe if spec.is_moe_layer(m, i) else dense) for i in range(m.num_layers))
    vocab = m.vocab_size or vocab_size or 50257
    embedding = vocab * h * (1 if m.tie_embeddings else 2)
    if m.position_embedding_type == "learned":
        embedding += spec.max_positions(m) * h
    params = layers + embedding + norm
    width = 2 if cfg.train.precision in ("bf16", "fp16") else 4
    return params * (width + _optimizer_bytes_per_param(cfg.optimizer))


def check_checkpoint_dir(cfg: Config, vocab_size: int | None = None, room: bool = True) -> None:
    """``checkpoint.save`` must be writable and (with ``room``) hold one more checkpoint (10%
    margin); stale temporaries of dead writers there are removed first.

    Raises:
        ConfigError: naming the directory, and for space the bytes needed and free.
    """
    save = cfg.checkpoint.save
    if not save:
        return
    try:
        storage.check_writable(save)
        storage.remove_stale_temporaries(save)
        if room:
            storage.check_space(save, math.ceil(1.1 * estimated_checkpoint_bytes(cfg, vocab_size)))
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.save: {e}") from None


def check_checkpoint_load(cfg: Config, vocab_size: int | None = None) -> None:
    """What a resume from ``checkpoint.load`` would refuse that its plain files show: ``latest``
    or ``checkpoint.load_step`` naming a step that does not exist, a missing or corrupt manifest,
    a checkpoint of another model, no optimizer state under ``checkpoint.load_optimizer``; the
    rules of the load itself (:func:`paratron.checkpoint.io.resume_manifest`). Tensor files are
    not read here (the ranks verify each block they read).

    Args:
        vocab_size: the tokenizer's, when ``model.vocab_size`` is unset (the ranks fill it so).

    Raises:
        ConfigError: naming the file and the rule, and listing the steps there are.
    """
    c = cfg.checkpoint
    if not c.load:
        return
    model = cfg.to_dict()["model"]
    if model.get("vocab_size") is None:
        model["vocab_size"] = vocab_size
    try:
        resume_manifest(c.load, c.load_step, model, bool(c.load_optimizer) and not c.finetune)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.load={c.load}: {e}") from None


def check_vocab_fits(cfg: Config, tokenizer_vocab: int | None, source: str | None = None) -> None:
    """Refuse a set ``model.vocab_size`` below the tokenizer's vocabulary: ids at or past it
    would index past the embedding table on every rank (padding only ever adds rows). ``source``
    names where the size comes from when it is not the tokenizer itself (a BPE not trained yet).

    Raises:
        ConfigError: naming ``model.vocab_size``, the tokenizer and both sizes.
    """
    m = cfg.model.vocab_size
    if m is None or tokenizer_vocab is None or m >= tokenizer_vocab:
        return
    name = source or cfg.data.tokenizer_model or cfg.data.tokenizer_type
    raise ConfigError(f"model.vocab_size={m} is smaller than the tokenizer's vocabulary ({tokenizer_vocab} ids, "
                      f"{name}): it must be at least that (leave it unset to take the tokenizer's)")


def import_plugins(cfg: Config) -> None:
    """Import the modules named in ``train.callbacks``, so that the schedules, dispatchers and
    blocks they register exist before the config is checked against the registries."""
    for spec in cfg.train.callbacks:
        import_callback_module(spec)


def prepare_training(cfg: Config, run_dir: str | os.PathLike, *, launching: bool) -> None:
    """What ``paratron train`` does after validating and before any rank starts: default the
    outputs into the run directory, tokenise and check the data (and its splits), check the
    checkpoint to resume from, and the checkpoint directory. Inside a rank (a plain
    ``torchrun``, or the ranks the launcher started) only the checks every rank answers alike
    run: global rank 0 prepares the data after launch, and each save checks its exact size (:class:`paratron.checkpoint.dcp_planners.ChunkSavePlanner`).
    ``launching`` says which: True outside torchrun (the launcher, or one process alone;
    :func:`paratron.launch.mode.started`).

    Raises:
        ConfigError: as :func:`prepare_data`, :func:`check_checkpoint_load` and
            :func:`check_checkpoint_dir`.
    """
    apply_run_dir_defaults(cfg, run_dir)
    tok = prepare_data(cfg, progress=cfg.logging.progress) if launching else None
    vocab = tok.vocab_size if tok is not None else None
    check_vocab_fits(cfg, vocab)
    check_checkpoint_load(cfg, vocab)
    check_checkpoint_dir(cfg, vocab, room=launching)
