"""``paratron convert`` both ways: a tiny random Hugging Face Llama -> paratron checkpoint (loaded into
a model, logits match transformers to 1e-5) -> Hugging Face folder that transformers reloads with
the same logits; and clear errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.hf import hf_to_paratron  # noqa: E402
from paratron.checkpoint.io import load_model_full, load_model_into  # noqa: E402
from paratron.cli import main  # noqa: E402
from paratron.models.gpt import build_model_chunks, full_logits  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402

VOCAB = 89


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-llama")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_convert_roundtrip_through_a_paratron_checkpoint(llama_dir, tmp_path, capsys):
    src, hf_model = llama_dir
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf-out"
    assert main(["convert", "hf-to-paratron", str(src), str(ckpt), "--set", "train.seed=7"]) == 0
    cfg, tensors = load_model_full(ckpt)
    assert cfg.train.seed == 7 and cfg.model.num_query_groups == 1 and cfg.model.tie_embeddings
    _, direct = hf_to_paratron(src)
    assert tensors.keys() == direct.keys() and all(torch.equal(tensors[k], direct[k]) for k in direct)

    # The checkpoint loads into a model whose logits are transformers' logits.
    (model,) = build_model_chunks(cfg.model, ParallelContext.single(), seed=0)
    load_model_into(ckpt, [model], config=cfg)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(ids).logits
        ours = full_logits(model.eval()(ids), ParallelContext.single(), VOCAB)
    assert (ours - ref).abs().max().item() < 1e-5

    assert main(["convert", "paratron-to-hf", str(ckpt), str(out)]) == 0
    printed = capsys.readouterr()
    assert "LlamaForCausalLM" in printed.out
    # The source folder had no tokenizer.json: the default GPT-2 one (50257 ids) is not the
    # model's (89), so none is written beside it.
    assert not (out / "tokenizer.json").exists()
    assert f"more than the model's model.vocab_size={VOCAB}" in printed.err
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (reloaded(ids).logits - ref).abs().max().item() < 1e-5


def test_convert_errors_name_the_problem(tmp_path, capsys):
    assert main(["convert", "hf-to-paratron", str(tmp_path / "missing"), str(tmp_path / "d")]) == 1
    assert "config.json" in capsys.readouterr().err
    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    assert main(["convert", "hf-to-paratron", str(bad), str(tmp_path / "d2")]) == 1
    err = capsys.readouterr().err
    assert "model_type='bert'" in err and "LlamaForCausalLM" in err


def test_sharded_safetensors_index_is_read(llama_dir, tmp_path):
    """A folder with model.safetensors.index.json and several shards imports like a single file."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, _ = llama_dir
    whole = load_file(str(src / "model.safetensors"))
    names = sorted(whole)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: whole[k] for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copyfile(src / "config.json", tmp_path / "config.json")
    cfg_a, a = hf_to_paratron(src)
    cfg_b, b = hf_to_paratron(tmp_path)
    assert cfg_a == cfg_b and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A tensor the mapping does not know is an error, not silently dropped.
    second = {k: whole[k] for k in names[half:]} | {"model.layers.0.extra.weight": torch.zeros(2)}
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        hf_to_paratron(tmp_path)
    # And a missing one names itself.
    save_file({k: whole[k] for k in names[half:] if k != "model.norm.weight"},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    del index["weight_map"]["model.layers.0.extra.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model.norm.weight" in names[half:]
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf_to_paratron(tmp_path)


def test_original_gpt2_layout_without_prefix_and_with_mask_buffers(tmp_path):
    """The original GPT-2 files name tensors without ``transformer.`` and carry causal-mask buffers
    (``h.N.attn.bias``); they import to the same tensors as transformers' own save."""
    from safetensors.torch import load_file, save_file

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "new", safe_serialization=True)
    saved = load_file(str(tmp_path / "new" / "model.safetensors"))
    old = {k.removeprefix("transformer."): v for k, v in saved.items() if k != "lm_head.weight"}
    old["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
    (tmp_path / "old").mkdir()
    save_file(old, str(tmp_path / "old" / "model.safetensors"))
    (tmp_path / "old" / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    cfg_new, new_t = hf_to_paratron(tmp_path / "new")
    cfg_old, old_t = hf_to_paratron(tmp_path / "old")
    assert cfg_new == cfg_old and cfg_old.activation == "gelu_tanh" and cfg_old.tie_embeddings
    assert new_t.keys() == old_t.keys() and all(torch.equal(new_t[k], old_t[k]) for k in new_t)
