"""Test-suite settings (one intra-op thread, so forked ranks are safe and do not oversubscribe)
and shared fixtures."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    # The default suite must stay under 15 minutes on 2 cores; slow tests run on request.
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> list[str]:
    """Overrides pointing at 40 documents of the bundled corpus, tokenized by `paratron preprocess`
    with a 512-token byte-level BPE trained on them (add a ``data.split`` of your own)."""
    d = tmp_path_factory.mktemp("tiny_corpus")
    lines = (ROOT / "data" / "shakespeare.jsonl").read_text().splitlines()[:40]
    corpus = d / "tiny.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    prefix = d / "tiny"
    r = subprocess.run([sys.executable, "-m", "paratron", "preprocess", "--input", str(corpus),
                        "--output-prefix", str(prefix), "--tokenizer-type", "ByteLevelBPE",
                        "--vocab-size", "512", "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    tok = next(d.glob("tiny*tokenizer.json"))
    return [f"data.data_path={prefix}", "data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={tok}"]
