#!/usr/bin/env bash
# Everything that needs the GPU, in device calls that fit the lease (see RESULTS.md):
#   bash benchmarks/gpu_all.sh checks     # GPU tests, attention sweep, per-op table
#   bash benchmarks/gpu_all.sh decode [decode.py flags]   # end-to-end decode vs peers
# OUT=<dir for logs and JSON>
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fuser-out}
mkdir -p "$OUT"
what=${1:-checks}
shift || true
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)"
if [ "$what" = checks ]; then
  echo "== GPU tests"
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_ops_rmsnorm.py \
    tests/test_rope.py tests/test_gated_mlp.py tests/test_ops_attention.py tests/test_ops_linear.py -k "cuda or gpu or CUDA or GPU" \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -8
  echo "== attention sweep"
  python3 benchmarks/attention_sweep.py --out "$OUT/attention_sweep.json" 2>&1 | tee "$OUT/attention_sweep.log" | tail -6
  echo "== per-op table"
  python3 benchmarks/ops.py --out "$OUT/ops.json" 2>&1 | tee "$OUT/ops.log" | tail -40
  echo "== GEMV sweep"
  python3 benchmarks/linear_sweep.py --out "$OUT/linear_sweep.json" 2>&1 | tee "$OUT/linear_sweep.log" | tail -18
else
  echo "== decode benchmark"
  python3 benchmarks/decode.py --out "$OUT/decode.json" "$@" 2>&1 | tee "$OUT/decode.log" | grep -v Warning | tail -60
fi
