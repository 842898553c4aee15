#!/usr/bin/env bash
# Creates .venv on first use and installs paratron with its pinned torch.
# torch is pinned to 2.13.0 here: its CPU wheel is on these machines' local disk,
# while an unpinned torch would download a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.paratron-installed"
if [[ ! -f "$stamp" || "$root/pyproject.toml" -nt "$stamp" ]]; then
  echo "[paratron] setting up $venv (first use)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$root[dev]"
  touch "$stamp"
fi
