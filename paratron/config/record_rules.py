"""Config rules of record-based data: chat / SFT records (``data.format = "chat"``) and Hugging
Face ``datasets`` input (``data.hf_dataset``), read through :mod:`paratron.data.records`. Run by
:func:`paratron.rules.validate` before any process group exists; each raises
:class:`ConfigError` naming the fields and the rule."""

from __future__ import annotations

from .errors import ConfigError
from .sections import Config


def record_based(cfg: Config) -> bool:
    """Whether the run reads records (chat, or a Hugging Face dataset) instead of an indexed corpus
    (the one test of the mode)."""
    return cfg.data.format == "chat" or cfg.data.hf_dataset is not None


def check_records(cfg: Config, world: int | None = None) -> None:
    d = cfg.data
    if d.streaming and d.hf_dataset is None:
        raise ConfigError("data.streaming=true streams a Hugging Face dataset; set data.hf_dataset")
    if not record_based(cfg):
        return
    if d.hf_dataset is not None and (d.corpus or d.data_path):
        raise ConfigError(f"data.hf_dataset={d.hf_dataset!r} with data.corpus / data.data_path: a run reads "
                          "one source; unset the others (paratron train --data sets data.corpus)")
    if d.hf_dataset is None and not d.corpus:
        raise ConfigError("data.format='chat' reads conversations from a JSONL file (data.corpus, or paratron train "
                          "--data FILE.jsonl) or from data.hf_dataset; an indexed .bin/.idx dataset holds no "
                          "roles (data.data_path)")
    if d.tokenizer_type == "ByteLevelBPE" and not d.tokenizer_model:
        raise ConfigError(f"data.tokenizer_type='ByteLevelBPE' with {'data.hf_dataset' if d.hf_dataset else 'chat data'}:"
                          " a tokenizer is trained only on a text corpus; give data.tokenizer_model (a tokenizer.json"
                          " with data.tokenizer_type='HuggingFaceTokenizer') or use 'GPT2BPETokenizer'")
