"""``paratron generate``: sample text from a checkpoint on one process, whatever layout saved it.

The checkpoint is layout-free (every tensor stored with its global shape), so it loads into a
single-process model (tp = pp = 1). Sampling: greedy when ``--temperature 0``, else softmax with
temperature over the ``--top-k`` most likely tokens. Padded vocabulary entries are never sampled.
"""

from __future__ import annotations

import argparse
import sys

import torch

from paratron.checkpoint.adapters import with_base
from paratron.checkpoint.hf_export import single_process_model, transformers_greedy
from paratron.checkpoint.io import load_model_full
from paratron.data.prepare import build_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (its latest step, or a step_N dir)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 means the whole vocabulary")
    p.add_argument("--seed", type=int, default=0)


@torch.no_grad()
def sample(chunk, ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
           vocab_size: int, seq_length: int, generator: torch.Generator | None = None) -> list[int]:
    """Extend ``ids`` by ``max_new_tokens`` tokens.

    Args:
        chunk: a single-stage model (pre- and post-process) whose ``forward(tokens [b, s])`` returns
            logits ``[s, b, V_pad]``.
        vocab_size: the real vocabulary; logit columns ``>= vocab_size`` are padding, masked out.
        seq_length: the longest context fed to the model (older tokens are dropped).

    Raises:
        ValueError: empty prompt, negative temperature or top_k.
    """
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    if temperature < 0 or top_k < 0:
        raise ValueError(f"--temperature={temperature} and --top-k={top_k} must be >= 0")
    out = list(ids)
    device = next(chunk.parameters()).device  # a training run's own model may live on a GPU
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-seq_length:]], dtype=torch.long, device=device)
        logits = chunk(context)[-1, 0, :].float().cpu()  # [V_pad] at the last position (a CPU generator draws)
        logits[vocab_size:] = float("-inf")
        if temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, vocab_size)).values[-1]
                logits[logits < kth] = float("-inf")
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        out.append(nxt)
    return out


def load_single_process_model(checkpoint_dir: str):
    """(config, model chunk on one process) from any saved layout."""
    cfg, tensors = load_model_full(checkpoint_dir)
    tensors = with_base(cfg, tensors, where=str(checkpoint_dir))  # a LoRA run's adapter-only checkpoint
    try:
        return cfg, single_process_model(cfg.model, tensors, seed=cfg.train.seed)
    except ValueError as e:
        raise ValueError(f"checkpoint {checkpoint_dir}: {e}") from None


HF_CHECK_TOKENS = 8


def hf_export_check(model_cfg, tensors: dict, hf_dir, ids: list[int], n: int = HF_CHECK_TOKENS) -> str:
    """One line saying whether paratron (``tensors`` on one process) and ``transformers`` (the
    exported folder ``hf_dir``) continue ``ids`` with the same ``n`` greedy tokens; when they do
    not, the first differing position and both continuations. Only the last
    ``seq_length - n`` tokens of ``ids`` are used."""
    # Both sides must see the whole context: :func:`sample` drops tokens past seq_length,
    # transformers does not, so the prompt leaves room for the n new tokens.
    ids = ids[-max(1, model_cfg.seq_length - n):]
    chunk = single_process_model(model_cfg, tensors)
    ours = sample(chunk, ids, max_new_tokens=n, temperature=0, top_k=0, vocab_size=model_cfg.vocab_size,
                  seq_length=model_cfg.seq_length)[len(ids):]
    try:
        theirs = transformers_greedy(hf_dir, ids, n)[len(ids):]
    except ImportError as e:
        return f"HF export check skipped: {e}"
    if ours == theirs:
        return f"HF export check: paratron and transformers agree on {n} greedy tokens"
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    return (f"HF export check: paratron and transformers DISAGREE from greedy token {k + 1} of {n} "
            f"(paratron {ours}, transformers {theirs}): the export or its config mapping is wrong")


def generate_text(checkpoint_dir: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
                  top_k: int = 40, seed: int = 0) -> str:
    """Load a checkpoint and continue ``prompt``; returns prompt + continuation as text."""
    cfg, chunk = load_single_process_model(checkpoint_dir)
    return continue_text(chunk, cfg.model, build_tokenizer(cfg.data), prompt, max_new_tokens, temperature,
                         top_k, seed)


def continue_text(chunk, model_cfg, tok, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                  seed: int) -> str:
    """``prompt`` and its continuation by ``chunk`` (a whole model on one process, in eval mode),
    encoded and decoded by the tokenizer ``tok``."""
    g = torch.Generator().manual_seed(seed)
    ids = sample(chunk, tok.encode(prompt), max_new_tokens=max_new_tokens, temperature=temperature,
                 top_k=top_k, vocab_size=model_cfg.vocab_size, seq_length=model_cfg.seq_length, generator=g)
    return tok.decode(ids)


def run(args: argparse.Namespace) -> int:
    try:
        text = generate_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                             args.top_k, args.seed)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # CheckpointError is a RuntimeError
        print(f"paratron generate: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
