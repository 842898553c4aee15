"""Frames are attributed to paratron by the package's real location, not by "paratron" in a path:
in a clone named ``paratron`` with its ``.venv`` inside, torch's files sit under
``.../paratron/.venv/lib/...`` and must not be taken for paratron's (the device audit's host-sync
sites, the failure summary's ``file:line``)."""

from __future__ import annotations

import os
import traceback

import paratron.device_audit as device_audit
import paratron.launch.rankproc as rankproc
from paratron.where import PACKAGE_DIR, package_relpath

# A torch file of a venv inside a clone named paratron (the path need not exist).
CLONE_TORCH = "/x/paratron/.venv/lib/python3.12/site-packages/torch/_tensor.py"
OURS = os.path.join(PACKAGE_DIR, "optim", "optimizer.py")


def test_package_relpath_judges_by_the_real_package_directory():
    assert package_relpath(OURS) == os.path.join("optim", "optimizer.py")
    assert package_relpath(CLONE_TORCH) is None
    assert package_relpath(PACKAGE_DIR + "-other/x.py") is None  # a sibling folder sharing the prefix


def _frames(*names):
    return [traceback.FrameSummary(n, i + 1, "f") for i, n in enumerate(names)]


def test_device_audit_attributes_a_sync_to_paratron_not_to_torch_in_a_clone(monkeypatch):
    """The innermost frame is torch's, under .../paratron/.venv: the sync is paratron's optimizer's."""
    stack = _frames(OURS, CLONE_TORCH, device_audit.__file__)
    monkeypatch.setattr(device_audit.traceback, "extract_stack", lambda: stack)
    assert device_audit._caller() == "optim/optimizer.py:1"


def test_failure_location_skips_library_frames_under_a_paratron_folder(monkeypatch):
    library = CLONE_TORCH.rsplit("torch/", 1)[0]
    monkeypatch.setattr(rankproc, "_LIBRARY_DIRS", rankproc._LIBRARY_DIRS + (library,))
    monkeypatch.setattr(rankproc.traceback, "extract_tb", lambda tb: _frames(OURS, CLONE_TORCH))
    assert rankproc.error_location(None).startswith(os.path.relpath(OURS) + ":1 ")
