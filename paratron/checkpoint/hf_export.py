"""Export a trained paratron model as a Hugging Face folder, and check the export by generation.

:func:`export_hf` writes what ``transformers.AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load: ``config.json`` and ``model.safetensors`` (through
:func:`paratron.checkpoint.hf.paratron_to_hf`, the one name/layout mapping) and the run's
tokenizer (the source folder's tokenizer files when the run started from one with
``checkpoint.load_hf``, else the run's tokenizer as ``tokenizer.json`` with a minimal
``tokenizer_config.json``).

:func:`transformers_greedy` continues token ids greedily with the exported folder in
``transformers``; the training command compares it with paratron's own greedy continuation (the
"is my conversion broken?" check: a mapping bug changes the argmax within a few tokens, while a
correct export agrees token for token in fp32).

:func:`single_process_model` builds the one-process paratron model from full tensors (used by
``paratron generate`` and the check).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from paratron.data.prepare import build_tokenizer
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import load_full_

from .hf import paratron_to_hf

Tensors = dict[str, torch.Tensor]
# What transformers writes next to a tokenizer.json; copied as they are when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def export_hf(cfg, tensors: Tensors, out_dir: str | Path) -> Path:
    """Write the model and tokenizer of a run as a Hugging Face folder.

    Args:
        cfg: the run's :class:`~paratron.config.Config` (model and data sections are read).
        tensors: ``{logical name: full tensor}`` (unpadded vocab), e.g.
            :func:`paratron.checkpoint.io.load_model_full`'s.
        out_dir: created if missing.
    Returns: ``out_dir`` as a Path.
    Raises:
        ConfigError: no Hugging Face architecture computes this model (fields named).
        KeyError: a tensor the mapping needs is missing (named).
    """
    out = paratron_to_hf(cfg.model, tensors, out_dir)
    export_tokenizer(cfg, out)
    return out


def export_tokenizer(cfg, out: Path) -> str | None:
    """Write the run's tokenizer into ``out``; returns None, or why it could not (the export is
    still usable with token ids)."""
    src = getattr(cfg.checkpoint, "load_hf", None)
    if src and (Path(src) / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (Path(src) / name).is_file():
                shutil.copyfile(Path(src) / name, out / name)
        return None
    try:
        tok = build_tokenizer(cfg.data)
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    tok.save(out / "tokenizer.json")
    eod = tok.hf.id_to_token(tok.eod)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod, "model_max_length": cfg.model.seq_length},
        indent=2) + "\n")
    return None


def single_process_model(model_cfg, tensors: Tensors, seed: int = 0):
    """A one-process paratron model chunk (eval mode) holding ``tensors`` (any saved layout).

    Raises:
        ValueError: a parameter has no tensor (the first few named).
    """
    (chunk,) = build_model_chunks(model_cfg, ParallelContext.single(), seed=seed, sequence_parallel=False)
    missing = [p.meta.logical_name for p in chunk.parameters() if p.meta.logical_name not in tensors]
    if missing:
        raise ValueError(f"model tensors missing: {missing[:5]}")
    for p in chunk.parameters():
        load_full_(p, tensors[p.meta.logical_name].to(p.dtype))
    return chunk.eval()


@torch.no_grad()
def transformers_greedy(hf_dir: str | Path, ids: list[int], n: int) -> list[int]:
    """``ids`` followed by ``n`` greedy tokens of the folder's model in ``transformers`` (fp32;
    an explicit argmax loop, so an end-of-sequence token does not stop it early).

    Raises:
        ImportError: transformers is not installed (the ``hf`` extra).
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the HF export check needs transformers: pip install 'paratron[hf]'") from e
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([out])).logits[0, -1]
        out.append(int(torch.argmax(logits)))
    return out
