#!/usr/bin/env bash
# Run the whole benchmark suite on a GPU machine (no network needed) and print a summary.
#
#   bash benchmarks/run_gpu.sh [RESULTS_DIR] [extra pytest arguments...]
#
# Writes RESULTS_DIR/bench.json (pytest-benchmark), memory.json (graph-memory table),
# pytest.log, summary.txt and, where matplotlib is installed, the two plots.
# Needs torch with CUDA, pytest-benchmark and this package installed (pip install -e .).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${1:-bench-results}
shift || true
mkdir -p "$RESULTS"

"$PYTHON" - <<'CHECK'
import importlib.util
import sys

wanted = ("torch", "pytest_benchmark", "pytest_graphmode")
missing = [m for m in wanted if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"{sys.executable} lacks {missing}: install torch (CUDA build), pytest-benchmark and "
             "this package (pip install -e '.[bench]'), or set PYTHON to an interpreter that has them")

import torch

if not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False: run this on a GPU machine with a CUDA build of torch")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
CHECK

# xdist would switch pytest-benchmark off; benchmarks always run in one process.
set +e
"$PYTHON" -m pytest benchmarks -p no:xdist -p no:randomly -p no:cacheprovider \
    --benchmark-only --graphmode-backend=cuda -rs \
    --benchmark-json="$RESULTS/bench.json" --graph-memory-json="$RESULTS/memory.json" \
    "$@" 2>&1 | tee "$RESULTS/pytest.log"
status=${PIPESTATUS[0]}
set -e

echo
echo "================ summary ================"
"$PYTHON" benchmarks/summary.py "$RESULTS/bench.json" | tee "$RESULTS/summary.txt"
if "$PYTHON" -c "import matplotlib" 2>/dev/null; then
    "$PYTHON" benchmarks/plot.py "$RESULTS/bench.json" --memory "$RESULTS/memory.json" --out "$RESULTS"
else
    echo "matplotlib not installed: no plots (run benchmarks/plot.py where it is)"
fi
exit "$status"
