"""Write data/shakespeare_chat.jsonl: 50 short two-turn conversations (question/answer pairs)
built from the speeches of data/shakespeare.jsonl, for the chat / SFT examples and tests.

Deterministic: the same corpus gives the same file. Each conversation takes one speech of a
scene: the user quotes its first line and asks who says it in which work; the assistant names
the speaker; the user asks how the speech goes on; the assistant gives its next line.

    python scripts/make_chat_data.py   # from the repository root
"""

from __future__ import annotations

import json
import string
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEAKER = re.compile(r"^([A-Z][A-Z' ]{1,30})\.\s*$")
COUNT = 50


def speeches(text: str):
    """``(speaker, first line, second line)`` of each speech of at least two lines."""
    lines = [x.strip() for x in text.splitlines()]
    for i, line in enumerate(lines[:-2]):
        m = SPEAKER.match(line)
        first, second = lines[i + 1], lines[i + 2]
        if m and first and second and not SPEAKER.match(first) and not SPEAKER.match(second) \
                and 20 <= len(first) <= 90 and 10 <= len(second) <= 90:
            yield string.capwords(m.group(1).lower()), first, second


def conversation(title: str, speaker: str, first: str, second: str) -> dict:
    return {"messages": [
        {"role": "user", "content": f"Who says \"{first}\" in {title}?"},
        {"role": "assistant", "content": f"{speaker} says it."},
        {"role": "user", "content": "And how does the speech go on?"},
        {"role": "assistant", "content": second},
    ]}


def main() -> None:
    docs = [json.loads(x) for x in (ROOT / "data" / "shakespeare.jsonl").read_text(encoding="utf-8").splitlines()]
    out = []
    for doc in docs[::5]:
        found = list(speeches(doc["text"]))
        if found:
            speaker, first, second = found[len(found) // 2]
            title = doc.get("title") or doc["text"].splitlines()[0].strip().title()
            out.append(conversation(string.capwords(title), speaker, first, second))
        if len(out) == COUNT:
            break
    assert len(out) == COUNT, len(out)
    path = ROOT / "data" / "shakespeare_chat.jsonl"
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in out), encoding="utf-8")
    print(f"wrote {len(out)} conversations to {path}")


if __name__ == "__main__":
    main()
