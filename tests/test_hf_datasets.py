"""Hugging Face ``datasets`` input (``data.hf_dataset``): local JSONL / Parquet / Arrow files
and ``save_to_disk`` folders, random access and streamed, and an exact resume.

The must-show: 6 steps straight against a stop at step 3 (a save), a resume in a new process
that stops at step 5 (a save), and a second resume to step 6; streamed and not. The samples of
every step (their ``[pass, row]`` ids, the debug record ``TrainingData.last_sample_ids``, and the
row each training row's tokens spell) are those of the uninterrupted run, and the losses are
bitwise equal. The 10-row dataset read 4 rows a step puts pass boundaries inside step 3 and at
the start of step 6, so both resumes cross or start at one.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from paratron.local_ranks import run_ranks
from test_flexpipe_resume import STOP_AT  # its StopAt callback stops the runs here

datasets = pytest.importorskip("datasets")

ROWS = 10
TINY = ["model.num_layers=2", "model.hidden_size=16", "model.num_attention_heads=4", "model.seq_length=16",
        "model.make_vocab_size_divisible_by=16", "model.hidden_dropout=0.1",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.train_iters=6", "train.eval_interval=0",
        "train.deterministic=true", "train.seed=3", "data.split=100,0,0", "logging.progress=false",
        "logging.tensorboard=false", "logging.log_interval=1", "train.callbacks=test_flexpipe_resume:StopAt"]


def _text(i: int) -> str:
    return f"r{i:02d} " + " ".join(["the quick brown fox", "jumps over", "the lazy dog"][: 1 + i % 3])


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    """rows.jsonl, rows.parquet, a save_to_disk folder and its .arrow file, and a small tokenizer."""
    from paratron.data.tokenizer import train_byte_level_bpe

    d = tmp_path_factory.mktemp("hf")
    rows = [{"id": i, "text": _text(i)} for i in range(ROWS)]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(d / "rows.parquet"))
    ds.save_to_disk(str(d / "saved"))
    tok = train_byte_level_bpe([r["text"] for r in rows] * 4, 300)
    tok.save(d / "tok.json")
    return d


def _data_cfg(hf_files, source, streaming=False):
    from paratron.rules import load_config

    return load_config(None, [f"data.hf_dataset={source}", f"data.streaming={str(streaming).lower()}",
                              f"data.cache_dir={hf_files / 'cache'}"]).data


def test_every_local_format_reads_the_same_rows(hf_files):
    from paratron.data.hf_datasets import load

    arrow = next((hf_files / "saved").glob("*.arrow"))
    for source in ("rows.jsonl", "rows.parquet", "saved", arrow):
        for streaming in (False, True):
            ds = load(_data_cfg(hf_files, hf_files / source, streaming))
            texts = [r["text"] for r in ds]
            assert texts == [_text(i) for i in range(ROWS)], (source, streaming)


def test_streaming_reads_shards_lazily(hf_files, tmp_path):
    """A folder of three JSONL shards whose last one is broken: streaming reads the first two
    without opening it (and writes no Arrow cache); loading it whole fails."""
    from paratron.data.hf_datasets import load, stream_records

    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(2):
        (folder / f"part{k}.jsonl").write_text("".join(json.dumps({"text": _text(5 * k + i)}) + "\n" for i in range(5)))
    (folder / "part2.jsonl").write_text("{not json\n")
    cfg = _data_cfg(hf_files, folder, streaming=True)
    cfg.cache_dir = str(tmp_path / "cache")
    records = stream_records(load(cfg))
    assert [records.record(p)["text"] for p in range(ROWS)] == [_text(i) for i in range(ROWS)]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.arrow"))
    with pytest.raises(Exception):
        load(cfg, streaming=False)


def test_stream_positions_seek_and_pass_length():
    """Run position p is row p mod N of pass p div N; a fresh reader seeks by reading on from the
    start; with the checkpointed pass length it reads only the current pass up to p."""
    from paratron.data.hf_datasets import StreamRecords

    rows = list(range(ROWS))
    reader = StreamRecords(lambda epoch: iter(rows))
    assert [reader.record(p) for p in range(25)] == [p % ROWS for p in range(25)]
    assert reader.row_id(23) == [2, 3] and reader.state_dict() == {"hf_stream_pass_length": ROWS}
    fresh = StreamRecords(lambda epoch: iter(rows))
    assert fresh.record(23) == 3 and fresh.records_read == 24
    resumed = StreamRecords(lambda epoch: iter(rows))
    resumed.load_state_dict(reader.state_dict())
    assert resumed.record(23) == 3 and resumed.records_read == 4
    assert resumed.record(5) == 5  # backwards: seeks again
    with pytest.raises(ValueError, match="holds no record"):
        StreamRecords(lambda epoch: iter([])).record(0)


def test_missing_datasets_names_the_extra(monkeypatch):
    from paratron.data.hf_datasets import require_datasets

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"paratron\[hf\]"):
        require_datasets()


def test_bad_split_and_bad_record_are_named(hf_files):
    from paratron.config import ConfigError
    from paratron.rules import load_config
    from paratron.training.preflight import prepare_data

    from paratron.data.hf_datasets import load

    bad = _data_cfg(hf_files, hf_files / "rows.jsonl")
    bad.hf_split = "nope"
    with pytest.raises(ValueError, match="data.hf_split='nope'"):
        load(bad)
    cfg = load_config(None, [f"data.hf_dataset={hf_files / 'rows.jsonl'}", "data.text_key=body",
                             f"data.cache_dir={hf_files / 'cache'}"])
    with pytest.raises(ConfigError, match="row 0: no string 'body' field"):
        prepare_data(cfg, progress=False)


def test_chat_records_from_a_dataset(hf_files, tmp_path):
    """data.format=chat over data.hf_dataset with another data.messages_key: each row's tokens and
    mask are the renderer's, and data.split cuts the rows into train and validation."""
    from paratron.config import ConfigError
    from paratron.rules import load_config, validate
    from paratron.data.chat import ChatRenderer, SIMPLE_TEMPLATE
    from paratron.data.records import first_prompt, record_splits
    from paratron.data.tokenizer import from_file

    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": _text(i)}] for i in range(ROWS)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"conv": c}) + "\n" for c in convs))
    cfg = load_config(None, ["data.format=chat", f"data.hf_dataset={tmp_path / 'chat.jsonl'}", "data.messages_key=conv",
                             "data.split=80,20,0", f"data.cache_dir={tmp_path / 'cache'}"])
    tok = from_file(hf_files / "tok.json")
    train, valid, _ = record_splits(cfg.data, tok, 16)
    assert (len(train), len(valid)) == (8, 2)
    render = ChatRenderer(SIMPLE_TEMPLATE, tok.encode, tok.eod, {})
    for docs, lo in ((train, 0), (valid, 8)):
        for i in range(len(docs)):
            tokens, mask = docs.document(i)
            want_tokens, want_mask = render(convs[lo + i])
            assert tokens.tolist() == want_tokens.tolist() and mask.tolist() == want_mask.tolist()
    assert first_prompt(cfg.data, tok, valid) == "<|user|>\nq8\n<|assistant|>\n"
    cfg.data.split = "train"
    with pytest.raises(ConfigError, match="is data.hf_split"):
        validate(cfg)


# ---- exact resume ---------------------------------------------------------------------------------
def _rows_in(mb: dict, tok) -> list[int]:
    """The dataset row each document of a training microbatch spells (``rNN`` starts its text)."""
    starts = [(b, int(c)) for b in range(mb["tokens"].shape[0])
              for c in (mb["cu_seqlens"][b, :-1] if "cu_seqlens" in mb else [0])]
    out = []
    for b, c in starts:
        m = re.match(r"r(\d\d)", tok.decode(mb["tokens"][b, c:c + 6].tolist()))
        if m:
            out.append(int(m.group(1)))
    return out


def _runs(runs: list[tuple[list[str], str, int]]) -> list[dict]:
    """Runs in this process, one after another: ``(overrides, run_dir, stop_at)`` each; returns
    per run the exit code, each step's sample ids and spelled rows, and its losses."""
    import torch.distributed as dist

    from paratron.rules import load_config
    from paratron.launch import runner
    from paratron.training.data_iter import TrainingData

    out = []
    for overrides, run_dir, stop_at in runs:
        os.environ[STOP_AT] = str(stop_at)
        if not dist.is_initialized():  # run_training ends the process group: a new one per run
            world = int(os.environ["WORLD_SIZE"])
            dist.init_process_group("gloo", store=dist.FileStore(f"{run_dir}.store", world),
                                    rank=int(os.environ["RANK"]), world_size=world)
        seen = []
        real = TrainingData.train_microbatches

        def spy(self, consumed, counts=None):
            known = getattr(self.train_ds.records, "pass_length", None)  # before this step's reads
            mbs = real(self, consumed, counts)
            seen.append({"consumed": consumed, "ids": self.last_sample_ids, "pass_length": known,
                         "rows": [r for mb in mbs for r in _rows_in(mb, self.tokenizer)]})
            return mbs

        TrainingData.train_microbatches = spy  # this forked rank only
        try:
            code = runner.run_training(load_config(None, overrides), run_dir)
        finally:
            TrainingData.train_microbatches = real
        records = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
        out.append({"code": code, "seen": seen, "losses": {r["iteration"]: r["loss"] for r in records if "loss" in r}})
    return out


def _resume_check(tmp_path, base: list[str], world: int, modes: dict[str, list[str]]) -> dict:
    """Straight 6 steps, and 3 + 2 + 1 steps over two resumes (each in a new process), per mode."""
    def run(phase, mode, stop, load):
        ck = tmp_path / f"ck_{mode}"
        extra = [f"checkpoint.save={ck}"] + ([f"checkpoint.load={ck}"] if load else [])
        return (base + modes[mode] + extra, str(tmp_path / f"{mode}_{phase}"), stop)

    phases = [[run("straight", m, 0, False) for m in modes] + [run("a", m, 3, False) for m in modes],
              [run("b", m, 5, True) for m in modes], [run("c", m, 0, True) for m in modes]]
    results = [run_ranks(_runs, world, p, timeout=300) for p in phases]
    found = {}
    for k, mode in enumerate(modes):
        for rank in range(world):
            straight, a = results[0][rank][k], results[0][rank][len(modes) + k]
            b, c = results[1][rank][k], results[2][rank][k]
            assert [straight["code"], a["code"], b["code"], c["code"]] == [0] * 4
            assert [sorted(x["losses"]) for x in (a, b, c)] == [[1, 2, 3], [4, 5], [6]], mode
            pieced = a["seen"] + b["seen"] + c["seen"]
            assert [s["consumed"] for s in pieced] == [s["consumed"] for s in straight["seen"]] == [0, 4, 8, 12, 16, 20]
            for i, (got, want) in enumerate(zip(pieced, straight["seen"])):
                assert got == want, f"{mode} rank {rank} step {i + 1}: {got} vs {want}"
            assert {**a["losses"], **b["losses"], **c["losses"]} == straight["losses"], mode
            found[(mode, rank)] = straight["seen"]
    return found


def _passes(seen: list[dict]) -> list[list[int]]:
    """The rows read, per pass, from each step's ``[pass, row, ...]`` ids (streamed data)."""
    out: dict[int, list[int]] = {}
    for s in seen:
        for mb in s["ids"]:
            for sample in mb:
                out.setdefault(sample[0], []).append(sample[1])
    return [out[k] for k in sorted(out)]


def _base(hf_files, source: str) -> list[str]:
    return TINY + [f"data.hf_dataset={hf_files / source}", f"data.cache_dir={hf_files / 'cache'}",
                   "data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={hf_files / 'tok.json'}"]


def test_streamed_resume_twice_reads_on_exactly(hf_files, tmp_path):
    """One rank, streamed Parquet: 3 steps, a resume to step 5, a second resume to step 6, each in
    a new process. Step k reads run positions 4k-4 .. 4k-1, i.e. rows p mod 10: the first resume
    starts inside the second pass, the second at the start of the third; the ids and the rows the
    tokens spell both say so."""
    runs = [(_base(hf_files, "rows.parquet") + ["data.streaming=true", f"checkpoint.save={tmp_path / 'ck'}"]
             + ([f"checkpoint.load={tmp_path / 'ck'}"] if phase else []), str(tmp_path / f"run{phase}"), stop)
            for phase, stop in enumerate((3, 5, 0))]
    parts = [run_ranks(_runs, 1, [r], timeout=300)[0][0] for r in runs]
    assert [sorted(p["losses"]) for p in parts] == [[1, 2, 3], [4, 5], [6]]
    seen = [s for p in parts for s in p["seen"]]
    assert [s["consumed"] for s in seen] == [0, 4, 8, 12, 16, 20]
    assert _passes(seen) == [list(range(ROWS)), list(range(ROWS)), [0, 1, 2, 3]]
    assert [r for s in seen for r in s["rows"]] == [p % ROWS for p in range(24)]
    # the pass length learnt in step 3 came back with both resumes (from the checkpoint, not re-read)
    assert [s["pass_length"] for s in seen] == [None, None, None, ROWS, ROWS, ROWS]


@pytest.mark.slow
def test_exact_resume_twice_through_pass_boundaries(hf_files, tmp_path):
    """One rank, fixed-length rows, against an uninterrupted run: streamed (passes in the
    dataset's order) and random access (each epoch shuffled)."""
    found = _resume_check(tmp_path, _base(hf_files, "rows.parquet"), 1,
                          {"stream": ["data.streaming=true"], "map": ["data.streaming=false"]})
    stream, shuffled = found[("stream", 0)], found[("map", 0)]
    assert _passes(stream) == [list(range(ROWS)), list(range(ROWS)), [0, 1, 2, 3]]
    assert [r for s in stream for r in s["rows"]] == [p % ROWS for p in range(24)]  # what the tokens spell
    rows = [sample[1] for s in shuffled for mb in s["ids"] for sample in mb]  # random access: [0, row]
    first, second = rows[:ROWS], rows[ROWS:2 * ROWS]
    assert sorted(first) == sorted(second) == list(range(ROWS)) and first != second
    assert [r for s in shuffled for r in s["rows"]] == rows


@pytest.mark.slow
def test_exact_resume_dp2_token_balanced_stream(hf_files, tmp_path):
    """DP=2 with token-balanced packed rows (data.microbatch_tokens) over a streamed JSONL file."""
    base = _base(hf_files, "rows.jsonl") + ["data.microbatch_tokens=16"]
    found = _resume_check(tmp_path, base, 2, {"stream": ["data.streaming=true"]})
    rows = sorted(r for rank in range(2) for s in found[("stream", rank)] for r in s["rows"])
    assert rows == sorted(p % ROWS for p in range(24))
