#!/usr/bin/env bash
# The GPU check: run on one GPU machine (no internet needed), from a copy of this repository.
#
#   scripts/gpu_check.sh            # PYTHON=python3 by default; OUT_DIR=/tmp/paratron-gpu-check
#
# It uses the python it is given as it is (torch must be there already; nothing is installed) and
# puts paratron on PYTHONPATH. Steps, each under its own time limit (about 7 minutes in all on an
# H200):
#   1. the environment: torch, CUDA, the GPU, and which optional packages are present;
#   2. the CUDA-marked tests (single-process kernel tests parametrised over the device: fused
#      AdamW, flash SDPA, CUDA-event timers), by pytest when it is installed, else directly;
#   3. benchmarks/bench_gpu.py: ~1.2B Llama (configs/llama-1b.toml: 16 layers, h=2048, GQA 16/8,
#      SwiGLU, seq 4096, bf16) for 30 steps at layout (1) through `paratron train`, then the same
#      model and batch in a plain PyTorch loop (SDPA, fused AdamW); prints tokens/s, TFLOP/s, MFU
#      and peak memory of both and their ratio, and writes OUT_DIR/gpu_check.json.
#   4. benchmarks/bench_fp8.py on the GPU: one 4096->16384 column-parallel linear, 8192 tokens,
#      forward+backward in FP8 (tensorwise, then rowwise) against bf16: the FP8 / bf16 time ratio.
# Multi-rank NCCL is not exercised here (one GPU; NCCL refuses two ranks on one device): the
# device audit test (tests/test_device_audit.py) covers it on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-/tmp/paratron-gpu-check}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
status=0

echo "== 1/4 environment"
"$PY" - <<'EOF'
import importlib.util, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("no CUDA device: this script is for a GPU machine (tests/test_device_audit.py is the CPU proof)")
print("GPU:", torch.cuda.get_device_name(0), "| devices:", torch.cuda.device_count())
for mod in ("numpy", "tokenizers", "safetensors", "tomllib", "tomli", "matplotlib", "tensorboard", "tqdm", "pytest"):
    print(f"  {mod}: {'yes' if importlib.util.find_spec(mod) else 'no'}")
EOF

echo "== 2/4 CUDA-marked tests"
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 100 "$PY" -m pytest -m cuda -o addopts="" -p no:cacheprovider -q tests/test_kernels.py || status=1
else
    echo "(pytest not installed: running the CUDA checks directly)"
    timeout 100 "$PY" - <<'EOF' || status=1
import sys, types
sys.path.insert(0, "tests")
sys.path.insert(0, ".")


class _Marks:  # just enough of pytest's decorators for the test modules to import
    def __getattr__(self, name):
        def mark(*a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else (lambda f: f)
        return mark


stub = types.ModuleType("pytest")
stub.mark, stub.param, stub.approx = _Marks(), (lambda *a, **k: a[0] if len(a) == 1 else a), (lambda x, **k: x)
sys.modules["pytest"] = stub
import torch
import test_kernels as k
k.test_fused_adamw_matches_foreach("cuda", torch.float32)
k.test_fused_adamw_matches_foreach("cuda", torch.bfloat16)
k.test_flash_kernel_takes_paratron_attention()
k.test_phase_timer_measures_each_phase("cuda")
print("CUDA checks passed: fused AdamW (fp32, bf16), flash SDPA, CUDA-event timers")
EOF
fi

echo "== 3/4 training: paratron vs plain PyTorch (~1.2B Llama, bf16, seq 4096, 30 steps)"
timeout 360 "$PY" benchmarks/bench_gpu.py --steps 30 --warmup 5 --out "$OUT" || status=1

echo "== 4/4 FP8 linear (torch._scaled_mm, e4m3 x e4m3 forward, e5m2 grads) against bf16, forward+backward"
timeout 120 "$PY" benchmarks/bench_fp8.py --device cuda --tokens 8192 --hidden 4096 --out-features 16384 \
    --iters 20 || status=1
timeout 120 "$PY" benchmarks/bench_fp8.py --device cuda --tokens 8192 --hidden 4096 --out-features 16384 \
    --iters 20 --scaling rowwise || status=1

echo "== done (exit $status); figures in $OUT/gpu_check.json, paratron's log in $OUT/paratron/"
exit $status
