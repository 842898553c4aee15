"""scripts/gpu_check.sh's training comparison (benchmarks/bench_gpu.py) in its --tiny mode, on
whatever device there is: paratron train and the plain PyTorch loop both run, and the report
holds every figure the GPU check prints."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_bench_gpu_tiny_reports_both_runs(tmp_path):
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text("\n".join((ROOT / "data/shakespeare.jsonl").read_text().splitlines()[:40]) + "\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_gpu.py"), "--tiny", "--steps", "3",
                        "--warmup", "1", "--corpus", str(corpus), "--out", str(out), "--peak", "1e11"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    for label in ("tokens/s", "TFLOP/s per device", "MFU", "peak memory (GiB)"):
        assert label in r.stdout, r.stdout
    rep = json.loads((out / "gpu_check.json").read_text())
    for run in ("paratron", "plain_pytorch"):
        assert rep[run]["tokens_per_second"] > 0 and rep[run]["peak_memory_gib"] > 0
        assert 0 < rep[run]["mfu"] < 1 and rep[run]["tflops_per_device"] > 0
    assert rep["peak_flops"] == 1e11 and rep["peak_source"] == "train.peak_flops_per_device"
    assert rep["ratio_tokens_per_second"] > 0
