"""train.keep_host_memory: after a warm-up, a step that frees and re-allocates the same large
buffers faults no fresh pages in, and ``paratron train`` applies the setting on a CPU rank."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import paratron.launch.runner as runner
from paratron.config import Config
from paratron.training import host_memory

ROOT = Path(__file__).resolve().parents[1]

# Eight 12 MiB buffers a step, all freed at its end: under glibc's defaults the freed top of
# the heap exceeds the (dynamic) trim threshold, so it is often handed back and faulted in again.
STEPS = textwrap.dedent("""
    import json, resource, sys, torch
    from paratron.training.host_memory import keep_freed_host_memory
    applied = keep_freed_host_memory() if sys.argv[1] == "keep" else None
    faults = []
    for _ in range(8):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffers = [torch.ones(3 << 20) for _ in range(8)]
        del buffers
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps({"applied": applied, "faults": faults}))
""")


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_faults_no_pages_in_after_warmup():
    kept = _faults("keep")
    if not kept["applied"]:
        pytest.skip("this C library has no mallopt (not glibc)")
    one_step_pages = 8 * (12 << 20) // 4096
    assert kept["faults"][0] > one_step_pages // 2  # the first step maps its buffers
    # Later steps reuse the kept heap: a few pages of Python objects at most.
    assert max(kept["faults"][3:]) < 256, kept


def test_the_key_applies_it_on_cpu_ranks_only(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_host_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(host_memory, "default_device", lambda: torch.device("cpu"))
    assert host_memory.keep_host_memory_if_cpu(True) is True
    assert host_memory.keep_host_memory_if_cpu(False) is False
    monkeypatch.setattr(host_memory, "default_device", lambda: torch.device("cuda", 0))
    assert host_memory.keep_host_memory_if_cpu(True) is False  # CUDA has its own caching allocator
    assert calls == [1]
    assert Config().train.keep_host_memory is True


class _Rendezvous(Exception):
    """Stops run_training where the process group would be created."""


@pytest.mark.parametrize("enabled", [True, False])
def test_run_training_applies_the_key_before_the_rendezvous(monkeypatch, enabled):
    seen = []
    monkeypatch.setattr(runner, "keep_host_memory_if_cpu", seen.append)

    def rendezvous(cfg):
        seen.append("rendezvous")
        raise _Rendezvous

    monkeypatch.setattr(runner, "join_world", rendezvous)
    cfg = Config()
    cfg.train.keep_host_memory = enabled
    with pytest.raises(_Rendezvous):
        runner.run_training(cfg)
    assert seen == [enabled, "rendezvous"]
