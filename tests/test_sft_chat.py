"""Chat / SFT data (``data.format = "chat"``): rendering with a chat template, the loss mask on
the assistant's tokens, and the loss through the real data path and training step.

The must-show: on hand-built two-turn conversations the loss paratron computes equals the mean
cross-entropy over the assistant tokens alone, computed here from the model's logits and spans
written out by hand (not by the renderer); the same with fixed-length rows, token-balanced packed
rows, packing + CP=2 (ring) and PP=2. fp32, 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from paratron.config import ConfigError
from paratron.rules import load_config, validate
from paratron.config.aliases import megatron_overrides
from paratron.rules import build_config
from paratron.data.chat import ChatFormatError, ChatRenderer, SIMPLE_TEMPLATE, conversation, template_source
from paratron.data.tokenizer import gpt2_bpe
from paratron.local_ranks import run_ranks

pytest.importorskip("jinja2")

# Hand-built two-turn conversations (user, assistant, user, assistant).
TURNS = [
    ("What is the capital of France?", "Paris.", "And of Italy?", "Rome, on the Tiber."),
    ("Name a colour of the sky.", "Blue, on a clear day.", "At night?", "Black."),
    ("How many legs has a spider?", "Eight.", "An ant?", "Six legs."),
    ("Say hello.", "Hello!", "Say goodbye.", "Goodbye, and good luck."),
]
SEQ = 96
MODEL = ["model.num_layers=2", "model.hidden_size=16", "model.num_attention_heads=4", "model.num_query_groups=2",
         f"model.seq_length={SEQ}", "model.make_vocab_size_divisible_by=64", "model.hidden_dropout=0.0",
         "model.attention_dropout=0.0", "train.seed=5", "train.global_batch_size=4", "train.micro_batch_size=2",
         "train.train_iters=1", "data.split=100,0,0", "data.tokenizer_type=HuggingFaceTokenizer", "data.format=chat",
         "logging.progress=false", "logging.tensorboard=false"]


def _messages(q1, a1, q2, a2):
    return [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
            {"role": "user", "content": q2}, {"role": "assistant", "content": a2}]


def _by_hand(tok, q1, a1, q2, a2):
    """Tokens and target flags of the built-in 'simple' layout, spelled out here."""
    pieces = [(f"<|user|>\n{q1}\n<|assistant|>\n", False), (f"{a1}\n", True),
              (f"<|user|>\n{q2}\n<|assistant|>\n", False), (f"{a2}\n", True)]
    ids, target = [], []
    for text, is_reply in pieces:
        t = tok.encode(text)
        ids += t
        target += [is_reply] * len(t)
    return ids + [tok.eod], target + [True]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """The conversations as chat JSONL, and a small byte-level BPE trained on them beside it
    (``tok.json``: a small vocabulary keeps the model tiny)."""
    from paratron.data.tokenizer import train_byte_level_bpe

    d = tmp_path_factory.mktemp("chat")
    path = d / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": _messages(*t)}) + "\n" for t in TURNS))
    train_byte_level_bpe([" ".join(t) + " <|user|> <|assistant|>" for t in TURNS] * 4, 300).save(d / "tok.json")
    return path


def _tok(chat_file):
    from paratron.data.tokenizer import from_file

    return from_file(chat_file.parent / "tok.json")


def test_renderer_masks_only_the_assistant_replies():
    tok = gpt2_bpe()
    render = ChatRenderer(SIMPLE_TEMPLATE, tok.encode, tok.eod, {})
    for turns in TURNS:
        tokens, mask = render(_messages(*turns))
        ids, target = _by_hand(tok, *turns)
        assert tokens.tolist() == ids and mask.tolist() == target
        assert tok.decode(tokens[mask]) == f"{turns[1]}\n{turns[3]}\n<|endoftext|>"


def test_prompt_completion_and_bad_records(tmp_path):
    assert conversation({"prompt": "Q", "completion": "A"}) == [{"role": "user", "content": "Q"},
                                                                  {"role": "assistant", "content": "A"}]
    with pytest.raises(ChatFormatError, match="f.jsonl:3: no 'messages' list"):
        conversation({"text": "x"}, where="f.jsonl:3")
    with pytest.raises(ChatFormatError, match="no assistant message"):
        conversation({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ChatFormatError, match="role 'bot'"):
        conversation({"messages": [{"role": "bot", "content": "x"}]})


def test_missing_jinja2_names_the_extra(monkeypatch):
    import sys

    from paratron.data.chat import require_jinja2

    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ImportError, match=r"paratron\[hf\]"):
        require_jinja2()


def test_template_comes_from_the_tokenizer(tmp_path):
    """tokenizer_config.json's chat_template, chat_template.jinja over it, else 'simple'."""
    (tmp_path / "tokenizer.json").write_text("{}")
    tmpl = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tmpl, "eos_token": "</s>"}))
    text, specials, _ = template_source(None, str(tmp_path / "tokenizer.json"))
    assert text == tmpl and specials["eos_token"] == "</s>"
    tok = gpt2_bpe()
    spans = ChatRenderer(text, tok.encode, tok.eod, specials).spans(_messages(*TURNS[0]))
    assert spans[:3] == [("[user]What is the capital of France?</s>", False), ("[assistant]", False),
                         ("Paris.</s>", True)]
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert template_source(None, str(tmp_path))[0].startswith("{% for m in messages %}{{ m['content']")
    assert template_source(None, None)[0] == SIMPLE_TEMPLATE
    with pytest.raises(FileNotFoundError, match="data.chat_template='nope'"):
        template_source("nope", None)


def test_template_that_rewrites_history_is_refused():
    tok = gpt2_bpe()
    tmpl = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatFormatError, match="does not extend"):
        ChatRenderer(tmpl, tok.encode, tok.eod, {})(_messages(*TURNS[0]), "row 0")


def test_config_rules_and_aliases(tmp_path):
    overrides, rest = megatron_overrides(["--sft"])
    assert not rest and build_config(None, overrides).data.format == "chat"
    assert load_config(None, ["data.text_key=body"]).data.json_key == "body"
    with pytest.raises(ConfigError, match="indexed .bin/.idx dataset holds no roles"):
        validate(load_config(None, ["data.format=chat", "data.data_path=['x']"]))
    with pytest.raises(ConfigError, match="data.streaming=true streams a Hugging Face dataset"):
        validate(load_config(None, ["data.streaming=true"]))
    with pytest.raises(ConfigError, match="a tokenizer is trained only on a text corpus"):
        validate(load_config(None, ["data.format=chat", "data.corpus=c.jsonl", "data.tokenizer_type=ByteLevelBPE"]))


# ---- the loss is the mean over the assistant tokens ---------------------------------------------
def _reference_loss(cfg, tok, every_token: bool = False) -> float:
    """Each conversation alone through one process's model; cross-entropy of the logits at the
    positions whose next token is an assistant token, averaged over all of them (``every_token``:
    over every position, the loss without a mask)."""
    from paratron.models.gpt import build_model_chunks
    from paratron.parallel.context import ParallelContext

    (model,) = build_model_chunks(cfg.model, ParallelContext.single(), seed=cfg.train.seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for turns in TURNS:
            ids, target = _by_hand(tok, *turns)
            assert len(ids) <= SEQ + 1
            logits = model(torch.tensor([ids[:-1]]))[:, 0, :tok.vocab_size]  # [s, V]
            ce = F.cross_entropy(logits.double(), torch.tensor(ids[1:]), reduction="none")
            keep = torch.tensor(target[1:]) | every_token
            total, count = total + float(ce[keep].sum()), count + int(keep.sum())
    return total / count


def _paratron_loss(cfg, ctx) -> float:
    from paratron.training.data_iter import TrainingData
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import rank_actions, run_global_batch

    cfg.model.vocab_size = None
    data = TrainingData.build(cfg, ctx)
    cfg.model.vocab_size = data.tokenizer.vocab_size
    chunks, _, _, _ = build_model_and_optimizer(cfg, ctx)
    mbs = data.train_microbatches(0)
    with torch.no_grad():
        out = run_global_batch(cfg, ctx, chunks, mbs, forward_only=True, actions=rank_actions(cfg, ctx, len(mbs)))
    return out.loss


def _config(chat_file, extra):
    return load_config(None, MODEL + [f"data.corpus={chat_file}", f"data.tokenizer_model={chat_file.parent / 'tok.json'}"]
                       + extra)


def _layouts(chat_file, layouts):
    from paratron.parallel.context import ParallelContext

    out = []
    for extra, sizes in layouts:
        cfg = _config(chat_file, extra)
        validate(cfg, 2)
        out.append(_paratron_loss(cfg, ParallelContext.build(**sizes)))
    return out


def test_loss_is_the_mean_over_assistant_tokens_one_process(chat_file):
    from paratron.parallel.context import ParallelContext

    cfg, tok = _config(chat_file, []), _tok(chat_file)
    cfg.model.vocab_size = tok.vocab_size
    want = _reference_loss(cfg, tok)
    for extra in ([], ["data.microbatch_tokens=192"]):
        got = _paratron_loss(_config(chat_file, extra), ParallelContext.single())
        assert got == pytest.approx(want, rel=1e-5), (extra, got, want)
    unmasked = _reference_loss(cfg, tok, every_token=True)
    assert abs(unmasked - want) > 1e-4 * want, (unmasked, want)  # 10x the tolerance: the mask shows


def test_loss_is_the_mean_over_assistant_tokens_cp2_pp2(chat_file):
    """Packing + CP=2 (ring), PP=2 (fixed rows and packed), DP=2 (fixed rows and packed: the
    conversations differ in their assistant token counts), on 2 ranks each, against the same
    hand-computed mean."""
    cfg, tok = _config(chat_file, []), _tok(chat_file)
    cfg.model.vocab_size = tok.vocab_size
    want = _reference_loss(cfg, tok)
    layouts = [(["data.microbatch_tokens=192", "parallel.context=2", "parallel.tensor=1"], {"cp": 2}),
               (["parallel.pipeline=2"], {"pp": 2}),
               (["data.microbatch_tokens=192", "parallel.pipeline=2"], {"pp": 2}),
               ([], {}), (["data.microbatch_tokens=192"], {})]  # DP=2: the count of targets is global
    for rank, losses in enumerate(run_ranks(_layouts, 2, chat_file, layouts, timeout=240)):
        for (extra, _), got in zip(layouts, losses):
            assert got == pytest.approx(want, rel=1e-5), (rank, extra, got, want)
