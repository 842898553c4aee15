"""Chat / SFT records rendered to tokens with a loss mask on the assistant's tokens only
(``data.format = "chat"``, Megatron's ``--sft``).

A record is either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (the key is
``data.messages_key``) or a prompt/completion pair ``{"prompt": ..., "completion": ...}`` (read as
one user turn and one assistant turn). It is rendered with a Jinja chat template the way
Hugging Face ``transformers``' ``apply_chat_template`` renders one: a sandboxed jinja2
environment with ``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``, and a ``raise_exception`` function.

Which tokens are the assistant's comes from rendering prefixes of the conversation: for the
``i``-th message, the text from ``render(messages[:i])`` (with ``add_generation_prompt=True``
when message ``i`` is the assistant's, so its header stays on the prompt side) to
``render(messages[:i + 1])`` is that message's. Each span is tokenised on its own, so a token
never straddles a prompt and a reply; the assistant spans (the reply and whatever the template
closes it with) are the loss targets. The end-of-document token follows every conversation and
is a target when the conversation ends with the assistant (the model learns to stop).

The template is ``data.chat_template`` when set (a built-in name of :data:`BUILTIN_TEMPLATES` or
a ``.jinja`` file), else the tokenizer's own, beside ``data.tokenizer_model``
(``chat_template.jinja``, or the ``chat_template`` field of ``tokenizer_config.json``: transformers
writes one or the other), else the built-in ``"simple"`` one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

SIMPLE_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                   "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
BUILTIN_TEMPLATES = {"simple": SIMPLE_TEMPLATE, "chatml": CHATML_TEMPLATE}
"""Templates by name: ``simple`` writes ``<|role|>`` + newline + content + newline per message;
``chatml`` the ChatML layout of ``<|im_start|>role ... <|im_end|>``."""

ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(ValueError):
    """A record that is not a conversation, or a template whose renders are not prefixes of each
    other; the message names the record (``FILE:LINE`` or the dataset row) and the rule."""


def require_jinja2():
    """The jinja2 module, or an ImportError naming the ``paratron[hf]`` extra."""
    try:
        import jinja2.sandbox
    except ImportError:
        raise ImportError("data.format='chat' renders chat templates with jinja2, which is not installed: "
                          "pip install 'paratron[hf]' (or pip install jinja2)") from None
    return jinja2


def conversation(record: Any, messages_key: str = "messages", where: str = "record") -> list[dict]:
    """The messages of one record: ``record[messages_key]``, or a prompt/completion pair as a user
    and an assistant turn.

    Raises:
        ChatFormatError: neither form, a message without a string ``role``/``content``, an unknown
            role, or no assistant message (nothing to learn from); names ``where``.
    """
    if not isinstance(record, dict):
        raise ChatFormatError(f"{where}: a chat record must be a JSON object, got {type(record).__name__}")
    if messages_key in record:
        messages = record[messages_key]
    elif "prompt" in record and "completion" in record:
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["completion"]}]
    else:
        raise ChatFormatError(f"{where}: no {messages_key!r} list and no 'prompt'/'completion' pair "
                              f"(keys: {sorted(record)})")
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: {messages_key!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ChatFormatError(f"{where}: message {i} must be an object with string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatFormatError(f"{where}: message {i} has role {m['role']!r}; expected one of {ROLES}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError(f"{where}: no assistant message, so no token to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _special(config: dict, name: str) -> str:
    value = config.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else str(value)


def tokenizer_template(tokenizer_model: str | None) -> tuple[str | None, dict]:
    """The chat template shipped with a tokenizer (``chat_template.jinja``, else the
    ``chat_template`` field of ``tokenizer_config.json``, beside ``tokenizer_model``), and that
    config's ``bos_token``/``eos_token`` strings; ``(None, {...})`` when it has none."""
    if not tokenizer_model:
        return None, {}
    where = Path(tokenizer_model)
    folder = where if where.is_dir() else where.parent
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    specials = {k: _special(config, k) for k in ("bos_token", "eos_token")}
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), specials
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses "default"
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template, specials


def template_source(chat_template: str | None, tokenizer_model: str | None) -> tuple[str, dict, str]:
    """``(template text, special-token strings, description)`` of a run (see the module docstring).

    Raises:
        FileNotFoundError: ``data.chat_template`` is neither a built-in name nor a file.
    """
    if chat_template in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[chat_template], {}, f"built-in {chat_template!r}"
    if chat_template:
        path = Path(chat_template)
        if not path.is_file():
            raise FileNotFoundError(f"data.chat_template={chat_template!r} is neither a built-in template "
                                    f"({', '.join(BUILTIN_TEMPLATES)}) nor a file")
        return path.read_text(encoding="utf-8"), {}, str(path)
    text, specials = tokenizer_template(tokenizer_model)
    if text:
        return text, specials, f"the tokenizer's ({tokenizer_model})"
    return SIMPLE_TEMPLATE, specials, "built-in 'simple' (the tokenizer has none)"


@dataclass
class ChatRenderer:
    """Renders conversations to ``(tokens, mask)`` with one template and tokenizer.

    Args:
        template: Jinja source.
        encode: ``text -> list[int]`` (no special tokens added).
        eod: the end-of-document id appended to every conversation.
        specials: extra template variables (``bos_token``, ``eos_token``).
    """

    template: str
    encode: Callable[[str], list[int]]
    eod: int
    specials: dict

    def __post_init__(self):
        jinja2 = require_jinja2()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters.setdefault("tojson", lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw))
        self._compiled = env.from_string(self.template)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``."""
        specials = {"bos_token": "", "eos_token": "", **self.specials}
        return self._compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **specials)

    def spans(self, messages: Sequence[dict], where: str = "record") -> list[tuple[str, bool]]:
        """The rendered text cut into ``(text, is_assistant)`` spans (see the module docstring).

        Raises:
            ChatFormatError: a render that does not extend the previous one (the template rewrites
                earlier turns, so prompt and reply cannot be told apart by prefixes).
        """
        out, done = [], ""
        for i, m in enumerate(messages):
            cuts = [(self.render(messages[:i], add_generation_prompt=True), False)] if m["role"] == "assistant" else []
            cuts.append((self.render(messages[:i + 1]), m["role"] == "assistant"))
            for text, assistant in cuts:
                if not text.startswith(done):
                    raise ChatFormatError(f"{where}: the chat template's text for the first {i + 1} messages does "
                                          f"not extend its text for fewer; prompt and reply tokens cannot be "
                                          "separated (use data.chat_template='simple' or another template)")
                out.append((text[len(done):], assistant))
                done = text
        return [(t, a) for t, a in out if t]

    def __call__(self, messages: Sequence[dict], where: str = "record") -> tuple[np.ndarray, np.ndarray]:
        """``tokens`` int64 ``[L]`` and ``mask`` bool ``[L]`` (True: a loss target) of a
        conversation, the end-of-document token last."""
        toks, mask = [], []
        for text, assistant in self.spans(messages, where):
            ids = self.encode(text)
            toks.extend(ids)
            mask.extend([assistant] * len(ids))
        toks.append(self.eod)
        mask.append(messages[-1]["role"] == "assistant")
        return np.asarray(toks, dtype=np.int64), np.asarray(mask, dtype=bool)


def build_renderer(data_cfg, tok) -> tuple[ChatRenderer, str]:
    """The run's :class:`ChatRenderer` and a description of its template (for the log)."""
    text, specials, desc = template_source(data_cfg.chat_template, data_cfg.tokenizer_model)
    return ChatRenderer(text, tok.encode, tok.eod, specials), desc


def read_jsonl(path: str | Path) -> list[tuple[str, Any]]:
    """``(FILE:LINE, record)`` of every non-blank line of a JSONL file.

    Raises:
        ChatFormatError: a line that is not JSON (``FILE:LINE: reason``).
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ChatFormatError(f"{path}:{n}: not JSON ({e.msg})") from None
    if not out:
        raise ChatFormatError(f"{path}: no conversation (the file is empty or blank)")
    return out
