"""Write a tiny random Hugging Face Llama folder for the fine-tuning example and tests.

The folder holds what ``paratron train --from-hf DIR`` and ``transformers`` read: ``config.json``
and ``model.safetensors`` (a ``transformers.LlamaForCausalLM`` with random weights, 2 layers,
hidden 64, grouped-query attention), ``tokenizer.json`` (a byte-level BPE trained on the
conversations of ``data/shakespeare_chat.jsonl``; ``<|endoftext|>``, which paratron takes as the
end-of-document token, is id 0 and the model's eos) and ``tokenizer_config.json`` with a chat
template (role header, content, ``<|endoftext|>`` after each assistant turn).

    python scripts/make_tiny_hf_llama.py OUT_DIR [--vocab-size 512] [--layers 2] [--hidden 64] [--seed 0]

Needs ``transformers`` (``pip install 'paratron[hf]'``). Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratron.data.tokenizer import EOD_TOKEN, train_byte_level_bpe  # noqa: E402

CHAT_DATA = ROOT / "data" / "shakespeare_chat.jsonl"
# Each message: "<|role|>", a newline, the content, a newline; an assistant turn also ends with
# the end-of-document token, so a fine-tuned model learns to stop. A generation prompt opens an
# assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% if message['role'] == 'assistant' %}" + EOD_TOKEN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_texts(path: Path = CHAT_DATA) -> list[str]:
    """Every message content of the chat file, plus the role headers the template writes."""
    texts = ["<|user|>\n", "<|assistant|>\n"]
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts += [m["content"] for m in json.loads(line)["messages"]]
    return texts


def build(out: Path, vocab_size: int = 512, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """Write the model and tokenizer folder ``out`` (created); returns it.

    Raises:
        ImportError: transformers is not installed (the ``hf`` extra).
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("make_tiny_hf_llama needs transformers: pip install 'paratron[hf]'") from e
    tok = train_byte_level_bpe(chat_texts(), vocab_size)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, eos_token=EOD_TOKEN, bos_token=EOD_TOKEN,
                                                unk_token=EOD_TOKEN, pad_token=EOD_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.eod, eos_token_id=tok.eod, pad_token_id=tok.eod)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: LlamaForCausalLM, {layers} layers, hidden {hidden}, vocab {tok.vocab_size}, "
          f"{n:,} params; tokenizer.json (eos {EOD_TOKEN} = {tok.eod}) with a chat template")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    build(a.out_dir, a.vocab_size, a.layers, a.hidden, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
