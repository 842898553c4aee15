"""``paratron convert``: Hugging Face folders to paratron checkpoints and back.

    paratron convert hf-to-paratron SRC_DIR DST_DIR [--config run.toml] [--set section.key=value ...]
    paratron convert paratron-to-hf SRC_DIR DST_DIR [--step N] [--base DIR] [--save-peft DIR]
    paratron convert lora-merge SRC_DIR DST_DIR [--step N] [--base DIR] [--save-peft DIR]

``hf-to-paratron`` reads a ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM``, ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` folder (config.json and
safetensors) and writes a layout-free paratron checkpoint directory (loadable under any TP/PP
layout); the run sections other than ``[model]`` come from ``--config`` (default: the defaults),
with ``--set`` overrides on top. A ``tokenizer.json`` next to the weights is copied and selected
as the run's tokenizer. ``paratron-to-hf`` writes config.json and model.safetensors that
``transformers`` loads (and copies the run's tokenizer.json, if it has one).

LoRA checkpoints (``model.lora_rank > 0``): ``lora-merge`` writes a paratron checkpoint whose
target weights hold ``W + (alpha/r) B A`` and no adapters (``model.lora_rank = 0``);
``paratron-to-hf`` of a LoRA checkpoint exports the merged weights, or, with ``--save-peft DIR``,
the base weights plus a PEFT adapter folder in ``DIR`` (:mod:`paratron.checkpoint.peft_export`).
``--base DIR`` supplies the base weights of an adapter-only checkpoint.

On a terminal a progress bar names the stage running (read, write, tokenizer) and its size
(``--quiet``: none; never in a log).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from paratron.checkpoint.adapters import with_base
from paratron.checkpoint.hf import hf_architecture_for, hf_to_paratron, paratron_to_hf
from paratron.checkpoint.hf_moe import FAMILIES
from paratron.checkpoint.hf_qwen3 import FAMILIES as QWEN3_FAMILIES
from paratron.checkpoint.io import load_model_full, resolve, save_model_full
from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.peft_export import save_peft
from paratron.config import ConfigError, apply_overrides
from paratron.data.prepare import build_tokenizer
from paratron.models.lora import adapter_names, merge_lora_tensors
from paratron.progress import progress_bar
from paratron.rules import load_config, validate

DIRECTIONS = ("hf-to-paratron", "paratron-to-hf", "lora-merge")
STAGES = 3
"""Read, write, tokenizer: the steps of the progress bar, either way."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("direction", choices=DIRECTIONS, help="which way to convert")
    p.add_argument("src", help="source directory (a Hugging Face folder, or a paratron checkpoint)")
    p.add_argument("dst", help="destination directory (created; must not hold a checkpoint)")
    p.add_argument("--config", default=None,
                   help="hf-to-paratron: a run TOML giving the non-model sections of the saved config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="hf-to-paratron: override a config value (repeatable)")
    p.add_argument("--step", type=int, default=None,
                   help="paratron-to-hf: the step to export when SRC is a checkpoint root (default: latest)")
    p.add_argument("--base", default=None,
                   help="paratron-to-hf, lora-merge: a checkpoint with the base weights of an adapter-only SRC "
                        "(default: the checkpoint.pretrained_checkpoint its config names)")
    p.add_argument("--save-peft", dest="save_peft", default=None, metavar="DIR",
                   help="paratron-to-hf, lora-merge: also write SRC's LoRA adapters as a PEFT folder "
                        "(adapter_model.safetensors, adapter_config.json); paratron-to-hf then exports the "
                        "base weights unmerged")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _stage(bar, name: str, done: bool = True) -> None:
    """Count the previous stage ``done`` on the bar and name the next one. Drawn at once: tqdm's
    ``update`` draws only after ``mininterval``, so a stage quicker than that went unseen."""
    bar.set_description_str(f"convert: {name}", refresh=False)
    if done:
        bar.update()
    bar.refresh()


def _gb(tensors) -> str:
    return f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9:.2f} GB"


def _hf_to_paratron(args, bar) -> str:
    shards = sorted(Path(args.src).glob("*.safetensors"))
    _stage(bar, f"reading {len(shards)} safetensors file(s), "
                f"{sum(f.stat().st_size for f in shards) / 1e9:.2f} GB", done=False)
    model_cfg, tensors = hf_to_paratron(args.src)
    cfg = load_config(args.config)
    cfg.model = model_cfg
    tokenizer = Path(args.src) / "tokenizer.json"
    if tokenizer.is_file():
        cfg.data.tokenizer_type = "HuggingFaceTokenizer"
        cfg.data.tokenizer_model = str(Path(args.dst).resolve() / "tokenizer.json")
    apply_overrides(cfg, args.overrides)
    validate(cfg)
    _stage(bar, f"writing {len(tensors)} tensors, {_gb(tensors)}")
    save_model_full(args.dst, cfg, tensors)
    _stage(bar, "tokenizer")
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, Path(args.dst) / "tokenizer.json")
    n = sum(t.numel() for t in tensors.values())
    return f"{len(tensors)} tensors, {n / 1e6:.2f}M parameters"


def _read_lora_aware(args, bar, merge: bool):
    """SRC's config and full tensors (``--base`` filling the base weights of adapter-only ones);
    with LoRA adapters: writes ``--save-peft``, then merges them when ``merge`` (the config then
    says ``lora_rank = 0``)."""
    import dataclasses

    _stage(bar, "reading and verifying the checkpoint", done=False)
    cfg, tensors = load_model_full(resolve(args.src, args.step))
    tensors = with_base(cfg, tensors, args.base, where=str(args.src))
    if not adapter_names(tensors):
        if args.save_peft or args.direction == "lora-merge":
            raise ValueError(f"{args.src} holds no LoRA adapters (model.lora_rank = {cfg.model.lora_rank})")
        return cfg, tensors
    if args.save_peft:
        save_peft(cfg.model, tensors, args.save_peft, base_model=str(Path(args.dst).resolve()))
    if merge:
        tensors = merge_lora_tensors(cfg.model, tensors)
    else:
        tensors = {k: v for k, v in tensors.items() if k not in set(adapter_names(tensors))}
    cfg.model = dataclasses.replace(cfg.model, lora_rank=0)
    return cfg, tensors


def _lora_merge(args, bar) -> str:
    cfg, tensors = _read_lora_aware(args, bar, merge=True)
    _stage(bar, f"writing {len(tensors)} tensors, {_gb(tensors)}")
    save_model_full(args.dst, cfg, tensors)
    _stage(bar, "tokenizer")
    return f"{len(tensors)} tensors with the adapters folded in" + _peft_note(args)


def _peft_note(args) -> str:
    return (f"; PEFT adapter in {args.save_peft} (load it with peft.PeftModel.from_pretrained; "
            "pip install 'paratron[hf]')") if args.save_peft else ""


def _paratron_to_hf(args, bar) -> str:
    cfg, tensors = _read_lora_aware(args, bar, merge=not args.save_peft)
    _stage(bar, f"writing {len(tensors)} tensors, {_gb(tensors)}")
    out = paratron_to_hf(cfg.model, tensors, args.dst)
    _stage(bar, "tokenizer")
    _export_tokenizer(cfg, out)

    arch = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "deepseek_v3": "DeepseekV3ForCausalLM",
            **FAMILIES, **QWEN3_FAMILIES}[hf_architecture_for(cfg.model)]
    return f"{len(tensors)} tensors as a {cfg.model.num_layers}-layer {arch}" + _peft_note(args)


def _export_tokenizer(cfg, out: Path) -> None:
    """Write the run's tokenizer (GPT-2 BPE, a tokenizer.json, or the BPE trained on the corpus)
    as ``tokenizer.json``, so that an export -> import round trip keeps the same token ids.

    A tokenizer with ids beyond the model's ``vocab_size`` is not the model's (a checkpoint
    imported from a folder without tokenizer.json records the default GPT-2 one): it is left out
    with a warning rather than written beside a model its ids would index past."""
    try:
        tok = build_tokenizer(cfg.data)
    except (ValueError, FileNotFoundError) as e:
        print(f"paratron convert: warning: tokenizer not exported ({e})", file=sys.stderr)
        return
    if cfg.model.vocab_size is not None and tok.vocab_size > cfg.model.vocab_size:
        print(f"paratron convert: warning: tokenizer not exported (data.tokenizer_type="
              f"{cfg.data.tokenizer_type} has {tok.vocab_size} tokens, more than the model's "
              f"model.vocab_size={cfg.model.vocab_size})", file=sys.stderr)
        return
    tok.save(out / "tokenizer.json")


def run(args) -> int:
    """Convert; print one summary line. Returns 0, or 1 with the reason on stderr."""
    try:
        with progress_bar(STAGES, "convert", quiet=args.quiet, unit="stage",
                          bar_format="{desc} [{n_fmt}/{total_fmt} stages, {elapsed}]") as bar:
            summary = {"hf-to-paratron": _hf_to_paratron, "paratron-to-hf": _paratron_to_hf,
                       "lora-merge": _lora_merge}[args.direction](args, bar)
            _stage(bar, "done")
    except (ConfigError, CheckpointError, FileNotFoundError, KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"paratron convert {args.direction}: {msg}", file=sys.stderr)
        return 1
    print(f"paratron convert {args.direction}: {args.src} -> {args.dst}: {summary}")
    return 0
