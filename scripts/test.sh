#!/usr/bin/env bash
# Runs the whole test suite (unit, distributed, end-to-end). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
export OMP_NUM_THREADS=1
exec "$root/.venv/bin/python" -m pytest tests "$@"
