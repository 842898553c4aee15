#!/usr/bin/env bash
# The main job: trains the default model on the bundled Shakespeare corpus.
# Extra arguments go to `paratron train` (e.g. --set train.train_iters=50).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
exec "$root/.venv/bin/paratron" train --config configs/default.toml --nproc-per-node 4 --run-dir runs/default "$@"
