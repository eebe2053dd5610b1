#!/usr/bin/env bash
# Everything that needs the GPU, in one device call (the lease is short; see RESULTS.md):
#   bash benchmarks/gpu_all.sh            # OUT=<dir for logs and JSON>
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fuser-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
echo "== GPU tests"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_ops_rmsnorm.py \
  $(ls tests/test_rope.py tests/test_gated_mlp.py tests/test_ops_attention.py 2>/dev/null) -k "cuda or gpu or CUDA or GPU" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -8
echo "== decode benchmark"
python3 benchmarks/decode.py --out "$OUT/decode.json" "$@" 2>&1 | tee "$OUT/decode.log" | grep -v Warning
