"""The Hugging Face export. In process (default suite): ``export_hf`` loads in transformers
(model and tokenizer) with paratron's logits within 1e-5, the check line agrees, and the check
reports a broken export. ``paratron train --from-hf DIR --save-hf OUT`` end to end (slow: one
process, the real command): the run starts from a tiny random Llama with a byte-level BPE
tokenizer, trains 2 steps, exports, prints the HF export check line, and transformers loads the
export with logits within 1e-5 of paratron's final checkpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.hf import hf_to_paratron, paratron_to_hf  # noqa: E402
from paratron.data.tokenizer import from_file  # noqa: E402
from paratron.models.gpt import full_logits  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.training.generate import hf_export_check, load_single_process_model  # noqa: E402
from test_hf_parity import _perturb_  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_llama(tiny_corpus, tmp_path_factory):
    """A tiny random Llama folder whose tokenizer.json is the tiny corpus's 512-token BPE."""
    path = tmp_path_factory.mktemp("llama_tok")
    tok = next(Path(o.split("=", 1)[1]) for o in tiny_corpus if o.startswith("data.tokenizer_model="))
    cfg = transformers.LlamaConfig(vocab_size=from_file(tok).vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _perturb_(model, 5)
    model.save_pretrained(path, safe_serialization=True)
    shutil.copyfile(tok, path / "tokenizer.json")
    data = next(o for o in tiny_corpus if o.startswith("data.data_path="))
    return path, data


def test_export_hf_loads_in_transformers(hf_llama, tmp_path):
    """In process: ``export_hf`` of changed weights (so not a copy of the source folder) loads in
    transformers, model and tokenizer, with paratron's logits to 1e-5, and the check agrees."""
    from paratron.checkpoint.hf_export import export_hf, single_process_model
    from paratron.checkpoint.hf_load import apply_load_hf
    from paratron.config import Config

    path, _ = hf_llama
    cfg = Config()
    cfg.checkpoint.load_hf = str(path)
    apply_load_hf(cfg, [])
    _, tensors = hf_to_paratron(path)
    g = torch.Generator().manual_seed(2)
    tensors = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}
    out = export_hf(cfg, tensors, tmp_path / "out")
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        ours = full_logits(single_process_model(cfg.model, tensors)(ids), ParallelContext.single(), cfg.model.vocab_size)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert (ours - theirs).abs().max().item() < TOL
    assert transformers.AutoTokenizer.from_pretrained(out).encode("ROMEO:", add_special_tokens=False)
    line = hf_export_check(cfg.model, tensors, out, [5, 9, 3])
    assert line == "HF export check: paratron and transformers agree on 8 greedy tokens"


@pytest.mark.slow
def test_from_hf_train_save_hf_end_to_end(hf_llama, tmp_path):
    path, data = hf_llama
    out, run = tmp_path / "hf_out", tmp_path / "run"
    sets = [data, "data.split=90,10,0", "model.seq_length=16", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.train_iters=2", "train.eval_interval=0", "train.sample_tokens=0",
            "optimizer.lr=1e-2", "logging.tensorboard=false", "logging.log_interval=1"]
    cmd = [sys.executable, "-m", "paratron", "train", "--from-hf", str(path), "--save-hf", str(out),
           "--run-dir", str(run)] + [a for s in sets for a in ("--set", s)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "HF export check: paratron and transformers agree on 8 greedy tokens" in r.stdout, r.stdout[-2000:]
    assert f"loaded {path} (Hugging Face)" in r.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    # The exported weights are the trained ones (not the start): transformers computes the final
    # checkpoint's logits.
    cfg, chunk = load_single_process_model(str(run / "checkpoints"))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = full_logits(chunk(ids), ParallelContext.single(), cfg.model.vocab_size)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        start = transformers.AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
    assert (ours - theirs).abs().max().item() < TOL
    assert (start - theirs).abs().max().item() > 1e-3, "the export holds the untrained weights"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("ROMEO: hello", add_special_tokens=False) == \
        transformers.AutoTokenizer.from_pretrained(path).encode("ROMEO: hello", add_special_tokens=False)


def test_export_check_prompt_leaves_room_in_seq_length(hf_llama):
    """A prompt near ``seq_length``: paratron's generation would drop its first tokens while
    transformers keeps them, so the check keeps only the prompt's last seq_length - 8 tokens."""
    import dataclasses

    path, _ = hf_llama
    cfg, tensors = hf_to_paratron(path)
    ids = torch.randint(0, cfg.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    line = hf_export_check(dataclasses.replace(cfg, seq_length=10), tensors, path, ids)
    assert line.endswith("agree on 8 greedy tokens"), line


def test_export_check_reports_a_broken_export(hf_llama, tmp_path):
    """Rows of lm_head swapped in the export (a mapping bug): the check line says they disagree."""
    path, _ = hf_llama
    cfg, tensors = hf_to_paratron(path)
    assert hf_export_check(cfg, tensors, path, [5, 9, 3]).endswith("agree on 8 greedy tokens")
    bad = dict(tensors)
    bad["output_layer.weight"] = tensors["output_layer.weight"].flip(0)
    paratron_to_hf(cfg, bad, tmp_path / "bad")
    line = hf_export_check(cfg, tensors, tmp_path / "bad", [5, 9, 3])
    assert "DISAGREE from greedy token 1 of 8" in line, line


def test_from_hf_config_overrides_and_errors(hf_llama, tmp_path, capsys):
    """The folder's model config with ``model.*`` overrides on top and its tokenizer; a folder
    without config.json is refused before any process group, naming the key."""
    from paratron.checkpoint.hf_load import apply_load_hf
    from paratron.cli import main
    from paratron.config import Config

    path, _ = hf_llama
    cfg = Config()
    cfg.checkpoint.load_hf = str(path)
    apply_load_hf(cfg, ["model.seq_length=8", "train.seed=3"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_query_groups) == (2, 32, 2)
    assert cfg.model.seq_length == 8
    assert cfg.data.tokenizer_model == str(path / "tokenizer.json")
    assert main(["train", "--from-hf", str(tmp_path)]) == 2
    assert f"checkpoint.load_hf={tmp_path}: no config.json" in capsys.readouterr().err
