"""Export paratron's LoRA adapters as a PEFT adapter folder (``adapter_model.safetensors`` +
``adapter_config.json``) that ``peft.PeftModel.from_pretrained`` loads onto the Hugging Face base
model written by :func:`paratron.checkpoint.hf.paratron_to_hf`.

Module mapping (``config.model_shape.LORA_TARGETS``), Llama naming, for layer ``i``:

==========================  ===============================================================
paratron                    PEFT (``base_model.model.model.layers.{i}.``...)
==========================  ===============================================================
``attention.qkv``           ``self_attn.q_proj``, ``self_attn.k_proj``, ``self_attn.v_proj``
``attention.proj``          ``self_attn.o_proj``
``mlp.fc1`` (SwiGLU)        ``mlp.gate_proj``, ``mlp.up_proj``
``mlp.fc2``                 ``mlp.down_proj``
==========================  ===============================================================

A fused target has one ``A`` for all its parts and one ``B`` whose rows follow the fused weight's
(per KV group ``[q heads, k, v]``; ``[gate; up]``). The export gives each part the same ``A`` and
its rows of ``B`` (split exactly as :mod:`paratron.checkpoint.hf` splits the weight), so
``B_q A`` is the q rows of ``B A``: the exported update is the trained one exactly. ``lora_A``
is ``[r, in]`` and ``lora_B`` ``[out, r]``, PEFT's ``nn.Linear`` layouts; PEFT's scale
``lora_alpha / r`` is paratron's.

transformers and peft are not needed to write the folder (safetensors and JSON), so paratron
never imports them; loading it needs ``pip install 'paratron[hf]'`` (both).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from paratron.config import ConfigError, ModelConfig, model_shape

from .hf import hf_architecture_for, split_qkv

_ADAPTED = re.compile(r"^layers\.(\d+)\.(attention\.qkv|attention\.proj|mlp\.fc1|mlp\.fc2)\.lora_([AB])\.weight$")
_HF_PARENT = {"attention.qkv": "self_attn", "attention.proj": "self_attn", "mlp.fc1": "mlp", "mlp.fc2": "mlp"}
PEFT_FAMILIES = ("llama", "qwen3")
"""Architectures whose HF modules carry the Llama names above (dense layers only)."""


def _parts(cfg: ModelConfig, module: str, factor: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF module name (``q_proj``, ...) -> its ``lora_A`` / ``lora_B`` for one paratron factor."""
    names = model_shape.LORA_TARGETS[module.split(".")[1]]
    if len(names) == 1 or factor == "A":  # a fused target's parts share A
        return {n: t for n in names}
    if module == "attention.qkv":
        pieces = split_qkv(t, cfg.num_attention_heads, model_shape.query_groups(cfg))
    else:
        pieces = t.chunk(2, dim=0)  # [gate; up]
    return dict(zip(names, pieces))


def peft_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's adapter state dict from paratron's full tensors (adapters only are read).

    Raises:
        ConfigError: no adapters; an adapter outside the dense attention/MLP linears (MoE shared
            experts); an architecture without Llama module names.
    """
    family = hf_architecture_for(cfg)
    if family not in PEFT_FAMILIES:
        raise ConfigError(f"PEFT export supports the Llama module names ({', '.join(PEFT_FAMILIES)}); this model "
                          f"exports as {family!r}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.endswith((".lora_A.weight", ".lora_B.weight")):
            continue
        m = _ADAPTED.match(name)
        if m is None:
            raise ConfigError(f"PEFT export: adapter {name} has no Hugging Face module (only the attention and dense "
                              "MLP linears export)")
        layer, module, factor = m.groups()
        for hf_name, piece in _parts(cfg, module, factor, t).items():
            key = f"base_model.model.model.layers.{layer}.{_HF_PARENT[module]}.{hf_name}.lora_{factor}.weight"
            out[key] = piece.detach().to("cpu").contiguous().clone()
    if not out:
        raise ConfigError("PEFT export: the checkpoint holds no LoRA adapters (model.lora_rank = 0?)")
    return out


def adapter_config(cfg: ModelConfig, base_model: str | None = None) -> dict:
    """``adapter_config.json`` for ``peft.LoraConfig``: rank, alpha, dropout, the HF target modules."""
    targets = sorted({h for t in cfg.lora_targets for h in model_shape.LORA_TARGETS[t]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(cfg.lora_rank),
            "lora_alpha": float(cfg.lora_alpha), "lora_dropout": float(cfg.lora_dropout),
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "base_model_name_or_path": base_model, "modules_to_save": None, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False}


def save_peft(cfg: ModelConfig, tensors: dict[str, torch.Tensor], out_dir: str | Path,
              base_model: str | None = None) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``out_dir`` (created).

    Args:
        cfg: the model config (``lora_*`` fields, sizes).
        tensors: full logical tensors (a checkpoint's), adapters included; base weights ignored.
        base_model: recorded as ``base_model_name_or_path`` (e.g. the HF export's folder).
    Returns: ``out_dir`` as a Path.
    Raises:
        ConfigError: see :func:`peft_tensors`.
    """
    from safetensors.torch import save_file

    state = peft_tensors(cfg, tensors)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")
    return out

