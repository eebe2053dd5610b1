#!/usr/bin/env bash
# Everything that needs the GPU, in device calls that fit the lease (see RESULTS.md):
#   bash benchmarks/gpu_all.sh checks   # GPU tests (every test marked or named cuda/gpu), FP8 op table + sweep
#   bash benchmarks/gpu_all.sh decode [decode.py flags]   # bf16 and fp8 engines vs peers, 8B shape
#   bash benchmarks/gpu_all.sh e2e      # speculative end to end (benchmarks/e2e.py), engine files
#   bash benchmarks/gpu_all.sh ops      # per-op table and the older sweeps
#   bash benchmarks/gpu_all.sh spec     # step-graph GPU tests + e2e parts (2) 8B + 1B draft and (3) buckets
#   bash benchmarks/gpu_all.sh final    # new kernels' GPU tests, 8B decode bf16 + fp8 (--profile), 1B decode, buckets
#   bash benchmarks/gpu_all.sh files    # GPU tests (no -x, failures listed) + engine files at 8B + 1B
#   bash benchmarks/gpu_all.sh early    # fused-quant GPU test failures in full, e2e part (2) 8B + 1B draft, step-graph GPU tests
#   bash benchmarks/gpu_all.sh bundled  # fused-quant GPU tests, e2e part (1): the bundled pair, peers, gamma 1..8 and auto
#   bash benchmarks/gpu_all.sh late     # new GPU tests (prefill graphs, step kernels, fused quant, step graphs), e2e (1) bundled + (3) buckets
#   bash benchmarks/gpu_all.sh lab      # fp32 CUDA-engine test tracebacks, candidate GEMV kernels (gemv_lab.py)
#   bash benchmarks/gpu_all.sh kernels  # split-K GEMV + one-launch attention GPU tests, attention sweep, multi-row GEMV lab
#   bash benchmarks/gpu_all.sh fused    # 8B bf16 + fp8 decode (--profile, HF eager + gpt-fast-style peers), 1B decode, new GPU tests
#   bash benchmarks/gpu_all.sh fused2   # 8B bf16 + fp8 decode (--profile), fp32 CUDA-engine tests
#   bash benchmarks/gpu_all.sh gpt-fast # the real gpt-fast (benchmarks/gpt_fast_peer.py; carry benchmarks/.gpt-fast) and fuser bf16
#   bash benchmarks/gpu_all.sh pending  # GPU tests not yet run (fp32 engines, draft kernels), several-row GEMV candidates
#   bash benchmarks/gpu_all.sh now      # pending GPU tests (fp32 engines, draft kernels, prefill attention), 8B bf16 + fp8 decode (--profile)
#   bash benchmarks/gpu_all.sh profile  # decode/verify/prefill per-op profiles at 4 layers of the 8B shape, FP8 prefill GEMM lab
#   bash benchmarks/gpu_all.sh prefill  # FP8 quant + prefill-graph GPU tests, 8B bf16 + fp8 decode (long prefills captured)
#   bash benchmarks/gpu_all.sh last     # flash prefill GPU tests + op timing, 4-layer 8B-shape prefill, bundled pair e2e (draft kernels)
#   bash benchmarks/gpu_all.sh seventh1 # bundled pair e2e (peers, gamma 1..8, auto) + buckets, FP8 accuracy on the GPU
#   bash benchmarks/gpu_all.sh seventh2 # PDL: GPU tests, GEMV chain lab, 8-layer decode with PDL off and on
#   bash benchmarks/gpu_all.sh eighth1  # PDL + resync GPU tests (PDL off if they fail), PDL lab, 8B bf16 + fp8 decode (--profile), 1B decode
#   bash benchmarks/gpu_all.sh eighth2  # bundled pair e2e (peers, gamma 1..8, auto, chunked resync), buckets, 8B + 1B draft
#   bash benchmarks/gpu_all.sh stream   # stream GEMV GPU tests + the 16-layer GEMV chain with its variants
#   bash benchmarks/gpu_all.sh ninth2   # rotary+attention GPU tests and sweep (its FP8_BITS lab variants are removed)
#   bash benchmarks/gpu_all.sh eleventh # swap-AB MMA lab (bf16), profiled bf16 decode 8B + 1B
#   bash benchmarks/gpu_all.sh eleventh2 # swapped MMA: GPU tests, 5-row chain, 8B decode, FP8 lab
#   bash benchmarks/gpu_all.sh eleventh3 # swapped layout kept to the store: tests, defaults, chain
#   bash benchmarks/gpu_all.sh shapes   # each 8B GEMV shape alone (shape_lab.py): stream configurations, unrolled FP8 loop
#   bash benchmarks/gpu_all.sh wide     # gate/up on 16 KB stream tiles: shape + chain labs, FP8 tiles and norm cost, 8B decode profiled
#   bash benchmarks/gpu_all.sh prologue # FP8 one-row norm prologue over the whole row; 5-row norm prologue chain; 8B decode + verify; engine tests
#   bash benchmarks/gpu_all.sh thirteenth # 8B decode + verify with and without PDL at several rows, chains, stream/PDL/argmax GPU tests
#   bash benchmarks/gpu_all.sh fourteenth # linear GPU tests, the chains without norms (what a norm fusion can reach), the engine's GPU tests
#   bash benchmarks/gpu_all.sh s16a     # FP8 rows all on e4m3 pieces (default "pieces"), EVEN_K: tests, rows lab, FP8 + bf16 decode
#   bash benchmarks/gpu_all.sh s17a     # one row's sums per thread (ONE_ROW_PARTIALS): tests, shape lab on/off, FP8 + bf16 decode
#   bash benchmarks/gpu_all.sh s17d     # FP8 one-row GPU tests, pipelined one-row loop, whole-K tiles (short)
#   bash benchmarks/gpu_all.sh s17c     # the sweep's tiles as defaults: FP8 one-row GPU tests, whole-K tiles, FP8 decode
#   bash benchmarks/gpu_all.sh s18a     # norm_stats: GPU tests, 8B decode bf16 (profiled) and FP8 with/without FP8 consumers
#   bash benchmarks/gpu_all.sh s18b     # norm_stats with g * h from the producer: GPU tests, 8B bf16 decode on/off, FP8 with its consumers
#   bash benchmarks/gpu_all.sh s18c     # norm_stats with its loads before the K loop: 8B bf16 decode on/off
#   bash benchmarks/gpu_all.sh s20b     # overlapped rounds: GPU tests, the bundled pair end to end overlapped, then standard
#   bash benchmarks/gpu_all.sh s26a     # (not yet run) #10: the pieces sweep with 16- and 32-row tiles (mma.sync), 8B FP8 decode on the fastest and as is
#   bash benchmarks/gpu_all.sh s25d     # #10: the 5-row FP8 GEMVs capped at 128 registers (four programs an SM): pieces_lab rows_r*, 8B FP8 decode capped with several-row PDL and without
#   bash benchmarks/gpu_all.sh s25c     # #10: the 5-row FP8 GEMVs' launch shapes on pieces swept (pieces_lab --sweep), 8B FP8 decode on the fastest and as is
#   bash benchmarks/gpu_all.sh s25a     # #10: the several-row FP8 GEMVs at 8 warps (no register spills): pieces_lab *_w8, spill-free one-row gate/up tiles (shape_lab), 8B FP8 decode --rows-warps 8 and as is
#   bash benchmarks/gpu_all.sh s25b     # #10: block_lab.py (each 8B op's row and block forms, and their parts), the FP8 speculative tests
#   bash benchmarks/gpu_all.sh s24d     # #10: block pieces with deeper stages: pieces_lab sweep, 8B FP8 decode as is and on block pieces, 8-layer block verify profiled
#   bash benchmarks/gpu_all.sh s24b     # #10: block-scaled pieces: pieces_lab.py, GPU tests, 8B FP8 decode with norm_stats on block pieces
#   bash benchmarks/gpu_all.sh s24a     # #10: one shared-memory carveout for every kernel: 8-layer FP8 verify profiled, 8B FP8 decode
#   bash benchmarks/gpu_all.sh s23e     # GPU tests: norm_stats ops (fp32 fix), test_pdl, CUDA engines (FP8 with a bf16 LM head too)
#   bash benchmarks/gpu_all.sh s23d     # #10: 8-layer FP8 verify profiled with several-row PDL on the GEMVs (early, late), all late
#   bash benchmarks/gpu_all.sh s23c     # (not yet run) #10: FUSER_PDL_ROWS=1 FUSER_PDL_LATE=1 FP8 decode, then with s23a's x2 consumers
#   bash benchmarks/gpu_all.sh s23b     # (not yet run) #10: several-row PDL (fixed prefetch step): FP8 decode + verify with FUSER_PDL_ROWS=1
#   bash benchmarks/gpu_all.sh s23a     # (not yet run) #10: norm_stats GPU tests, FP8 verify profiled, FP8 consumers on x2 pieces
#   bash benchmarks/gpu_all.sh s22b     # #12 part 1: the bundled pair, gammas 1..8 + auto, peers (one e2e.py run)
#   bash benchmarks/gpu_all.sh s22c     # #12 parts 2, 3: the 8B shape + random 1B draft, buckets; overlap lab after
#   bash benchmarks/gpu_all.sh s22a     # (not yet run) overlap lab (captured/uncaptured x fused/eager), then e2e.py in full at gammas 1..8
#   bash benchmarks/gpu_all.sh s21c     # GPU tests + the bundled pair end to end with the small-weight tile
#   bash benchmarks/gpu_all.sh s21b     # several-row tiles for the small weights of the bundled pair swept (step_lab.py)
#   bash benchmarks/gpu_all.sh s21a     # overlap race: serial branches / PDL off; the bundled step parts kernel by kernel (step_lab.py)
#   bash benchmarks/gpu_all.sh s20a     # (not yet run) the bundled pair's step parts alone (e2e.py), the 8B FP8 decode + verify profiled
#   bash benchmarks/gpu_all.sh s19g     # megakernel lab (the bundled pair's GEMV chain: launches vs persistent vs one program), FP8 decode --norm-stats fp8
#   bash benchmarks/gpu_all.sh s19e     # #11's run (both on by default): 8B bf16 profiled with peers, 1B profiled
#   bash benchmarks/gpu_all.sh s19f     # the fixed norm_stats op test, the CUDA engine tests s19d left
#   bash benchmarks/gpu_all.sh s19d     # aligned on the GPU: ops tests, 8B bf16 decode profiled, CUDA engine tests
#   bash benchmarks/gpu_all.sh s17b     # one-row FP8 tiles swept again (shape lab), FP8 decode on the fastest, engine GPU tests
#   bash benchmarks/gpu_all.sh s16b     # the engine's GPU tests (test_cuda.py with its FP8 speculative test, test_cuda_spec.py)
#   bash benchmarks/gpu_all.sh pieces   # several-row FP8 with x split outside, promoted or chained, vs the engine's paths
#   bash benchmarks/gpu_all.sh engine15 # the engine's GPU tests (test_cuda.py, test_cuda_spec.py)
#   bash benchmarks/gpu_all.sh x2       # several-row FP8 on the FP8 MMA (x in two pieces): tests, labs, FP8 decode
#   bash benchmarks/gpu_all.sh rstd2    # one row's norm, rstd after the sum vs the pass: GPU tests, shape + chain labs, 8B decode, FP8 rows lab
#   bash benchmarks/gpu_all.sh sixteenth  # (not yet run) unroll + 5-row chain labs, 8B decode profiled, engine GPU tests
#   bash benchmarks/gpu_all.sh fifteenth  # GPU tests with PDL at one row by default
#   bash benchmarks/gpu_all.sh twelfth  # fp16 MMA for FP8 rows; 8B decode + verify
#   bash benchmarks/gpu_all.sh ninth    # (not yet run) PDL-chain + resync GPU tests, PDL lab, 1B decode, 8B decode without --profile
#   bash benchmarks/gpu_all.sh fp8-accuracy [fp8_accuracy.py flags]   # FP8 vs bf16 on the bundled pair
# OUT=<dir for logs and JSON>
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fuser-out}
mkdir -p "$OUT"
what=${1:-checks}
shift || true
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)"
summary=()
# The 8B decode with its per-op profile, and the 1B-shape draft's decode step: several modes run
# them, each with its own timeout (seconds, the first argument).
decode_8b_profiled() {
  timeout "$1" python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers --profile 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|kernels|^sum|^graph|^GEMV|^GEMM|^attention|^rms|^rotary|^KV|^gated|^rope|^fp8 vs|^HBM|ceiling|fallback|Error|verify|prefill" | tail -60
}
decode_1b() {
  timeout "$1" python3 benchmarks/decode.py --preset llama-3.2-1b --precisions bf16 --skip-peers --profile \
    --skip-verify --out "$OUT/decode_1b.json" 2>&1 | tee "$OUT/decode_1b.log" | grep -v Warning \
    | grep -E "^\[|kernels|^sum|^graph|ceiling|fallback|Error" | tail -20
}
# The 8B decode + verify of one precision without peers, if what the budget (BUDGET, else the
# default given) leaves is more than 100 s: its tok/s, step and verify lines.
decode_8b() {  # precision, default budget in seconds, more decode.py flags (TAG: file names)
  local precision=$1 budget=$2 tag=${TAG:-$1}
  shift 2
  local left=$((${BUDGET:-$budget} - SECONDS))
  echo "== decode, 8B shape, $precision $* (${left} s left)"
  [ "$left" -gt 100 ] && timeout "$left" python3 benchmarks/decode.py \
    --out "$OUT/decode_$tag.json" --skip-peers --precisions "$precision" "$@" 2>&1 \
    | tee "$OUT/decode_$tag.log" | grep -v Warning \
    | grep -E "^\[$precision\] (fuser gen|target|prefill|per token)|tiles|verify|alike|Error" | tail -9
}
# The decode GEMV's GPU tests (every path of _linear_kernel against its reference).
linear_gpu_tests() {
  echo "== GPU tests: linear"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_linear.py \
    tests/test_ops_gated_linear.py tests/test_ops_norm_linear.py -k "gpu or cuda" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E |FAIL|Error|passed|failed" | head -20
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
}
if [ "$what" = checks ]; then
  echo "== GPU tests"
  python3 -m pytest -q -p no:cacheprovider -x tests -k "cuda or gpu or CUDA or GPU" \
    --ignore=tests/test_benchmarks.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== FP8 ops"
  python3 benchmarks/fp8_ops.py --out "$OUT/fp8_ops.json" 2>&1 | tee "$OUT/fp8_ops.log" | tail -40
elif [ "$what" = lab ]; then
  # Fifth session, first call: the fp32 CUDA-engine test failures in full, then candidate GEMV
  # kernels (benchmarks/gemv_lab.py) against the current one.
  echo "== failing GPU tests, tracebacks"
  timeout 200 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -x \
    tests/test_prefill_graphs.py tests/test_generate_speculative.py -k "gpu or syncs" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -40
  echo "== GEMV lab"
  timeout 150 python3 benchmarks/gemv_lab.py --out "$OUT/lab_fp8.json" --only qkv,o_proj,down,gate_up \
    --dtypes fp8 --rows 1,5 --budget 140 2>&1 | tee "$OUT/lab_fp8.log" | grep -v Warning
  timeout 100 python3 benchmarks/gemv_lab.py --out "$OUT/lab_bf16.json" --only qkv,o_proj,down \
    --dtypes bf16 --rows 1,5 --budget 90 2>&1 | tee "$OUT/lab_bf16.log" | grep -v Warning
elif [ "$what" = kernels ]; then
  # Fifth session: GPU tests of the one-launch split-K kernels (GEMV, attention), the fp32 CUDA
  # engines, the attention sweep (fused vs two-kernel merge), the multi-row GEMV lab.
  echo "== GPU tests"
  timeout 200 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_ops_linear.py tests/test_ops_attention.py tests/test_ops_gated_linear.py \
    tests/test_ops_fp8.py tests/test_prefill_graphs.py tests/test_generate_speculative.py \
    -k "gpu or cuda or syncs or sm90" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -25
  echo "== attention sweep"
  timeout 120 python3 benchmarks/attention_sweep.py --out "$OUT/attention_sweep.json" 2>&1 \
    | tee "$OUT/attention_sweep.log" | grep -v Warning | tail -20
  echo "== GEMV lab, several rows"
  timeout 130 python3 benchmarks/gemv_lab.py --out "$OUT/lab_rows.json" --only qkv,o_proj,down,gate_up \
    --dtypes fp8 --rows 5,9 --budget 120 2>&1 | tee "$OUT/lab_rows.log" | grep -v Warning
elif [ "$what" = fused ]; then
  # Fifth session: the decode step with norms folded into the GEMVs, split-K down/o_proj and
  # one-launch decode attention: 8B bf16 + fp8 beside HF eager and the gpt-fast-style peer,
  # the 1B shape, then the new GPU tests.
  echo "== decode, 8B shape, bf16 + fp8, peers"
  timeout 400 python3 benchmarks/decode.py --out "$OUT/decode.json" --profile --skip-hf-compile 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|kernels|^sum|^graph|^GEMV|^GEMM|^attention|^rms|^rotary|^KV|^gated|^rope|^fp8 vs|^HBM|ceiling|fallback|Error|verify|prefill|peer|tok/s" | tail -70
  echo "== decode, 1B shape, bf16"
  timeout 75 python3 benchmarks/decode.py --preset llama-3.2-1b --precisions bf16 --skip-peers --profile \
    --out "$OUT/decode_1b.json" 2>&1 | tee "$OUT/decode_1b.log" | grep -v Warning \
    | grep -E "^\[|kernels|^sum|^graph|^GEMV|^GEMM|^attention|^rms|^rotary|^rope|fallback|Error|verify" | tail -20
  echo "== GPU tests"
  timeout 100 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_ops_norm_linear.py tests/test_ops_attention.py tests/test_ops_linear.py \
    tests/test_prefill_graphs.py tests/test_generate_speculative.py -k "gpu or cuda or syncs" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -25
elif [ "$what" = fused2 ]; then
  # Fifth session, last call: the 8B decode after keeping the norm prologue to one row and
  # attention's two-kernel merge; then the GPU tests that did not finish in the call before.
  echo "== decode, 8B shape, bf16 + fp8"
  timeout 330 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers --profile 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|kernels|^sum|^graph|^GEMV|^GEMM|^attention|^rms|^rotary|^KV|^gated|^rope|^fp8 vs|^HBM|ceiling|fallback|Error|verify|prefill" | tail -60
  echo "== GPU tests"
  timeout 75 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_prefill_graphs.py tests/test_generate_speculative.py -k "gpu or syncs" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -15
elif [ "$what" = gpt-fast ]; then
  # The real gpt-fast (a checkout in the git-ignored benchmarks/.gpt-fast; run with
  # carry=["benchmarks/.gpt-fast"]) at the 8B shape, then fuser's bf16 decode in the same call.
  echo "== gpt-fast"
  timeout 240 python3 benchmarks/gpt_fast_peer.py --out "$OUT/gpt_fast.json" 2>&1 | grep -v Warning | tail -5
  echo "== fuser decode, 8B shape, bf16"
  timeout 240 python3 benchmarks/decode.py --out "$OUT/decode.json" --precisions bf16 --skip-peers 2>&1 \
    | tee "$OUT/decode.log" | grep -E "^\[|ceiling|verify|fallback|Error" | tail -20
elif [ "$what" = pending ]; then
  # What the fifth session could not run: the GPU tests of the fp32 shared-memory fix and of
  # runtime/draft_kernels.py, then the several-row GEMV candidates (hand-pipelined, FP8 widened
  # in registers three ways). Follow with `decode --profile --skip-hf-compile` (the tree's 8B
  # figures) and `bundled` (the draft kernels in the bundled pair's iterations).
  echo "== GPU tests"
  timeout 300 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_draft_kernels.py tests/test_step_kernels.py tests/test_ops_norm_linear.py \
    tests/test_ops_linear.py tests/test_prefill_graphs.py tests/test_generate_speculative.py \
    tests/test_cuda_spec.py -k "gpu or cuda or syncs" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -25
  echo "== GEMV lab, several rows"
  timeout 200 python3 benchmarks/gemv_lab.py --out "$OUT/lab_rows.json" --only qkv,o_proj,down,gate_up \
    --dtypes fp8,bf16 --rows 5 --budget 190 2>&1 | tee "$OUT/lab_rows.log" | grep -v Warning
elif [ "$what" = now ]; then
  # Sixth session, first call: the GPU tests the fifth session could not run, then the tree's
  # 8B figures (bf16 + fp8, per-op profile, verify and prefill rows).
  echo "== GPU tests"
  timeout 220 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_draft_kernels.py tests/test_step_kernels.py tests/test_ops_norm_linear.py \
    tests/test_ops_linear.py tests/test_prefill_graphs.py tests/test_generate_speculative.py \
    tests/test_ops_attention.py tests/test_cuda.py -k "gpu or cuda or syncs" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -25
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== decode, 8B shape, bf16 + fp8"
  timeout 330 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers --profile 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|kernels|^sum|^graph|^GEMV|^GEMM|^attention|^rms|^rotary|^KV|^gated|^rope|^fp8 vs|^HBM|ceiling|fallback|Error|verify|prefill" | tail -60
elif [ "$what" = profile ]; then
  # Sixth session: where the verify step's and the prefill's time goes (ops by shape), at 4
  # layers of the 8B shape (per-layer rows do not depend on the layer count), and the FP8
  # prefill GEMMs against bf16 (benchmarks/prefill_lab.py).
  echo "== prefill lab"
  timeout 150 python3 benchmarks/prefill_lab.py --out "$OUT/prefill_lab.json" "$@" 2>&1 \
    | tee "$OUT/prefill_lab.log" | grep -v Warning
  echo "== decode, 4 layers of the 8B shape, profiles"
  timeout 300 python3 benchmarks/decode.py --layers 4 --out "$OUT/decode_profile.json" --skip-peers \
    --profile 2>&1 | tee "$OUT/decode_profile.log" | grep -v Warning | grep -E "^\[|^  fuser::|^  aten|kernels|^sum|^graph|^GEMV|^GEMM|^attention|^rms|^rotary|^KV|^gated|^rope|^other|verify|prefill|Error" | tail -120
elif [ "$what" = prefill ]; then
  # Sixth session: the FP8 prefill was host-bound (99.5 ms against ~42 ms of kernels); long
  # prompts now replay captured graphs and o_proj's input quantizes in one kernel.
  echo "== GPU tests"
  timeout 120 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_ops_fp8.py tests/test_prefill_graphs.py -k "gpu or cuda or quantize_rows" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -12
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== decode, 8B shape, bf16 + fp8"
  timeout 400 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers "$@" 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|kernels|^sum|^graph|ceiling|fallback|Error|verify|prefill" | tail -40
elif [ "$what" = last ]; then
  # Sixth session, last call (~7 device minutes left), steps by priority, each with its timeout.
  echo "== GPU tests: flash prefill attention"
  timeout 70 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_ops_attention.py -k "gpu_flash" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -6
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== prefill attention, 8B shape"
  timeout 40 python3 benchmarks/prefill_lab.py --attention-only --out "$OUT/prefill_attention.json" 2>&1 \
    | tee "$OUT/prefill_attention.log" | grep -v Warning
  echo "== decode, 4 layers of the 8B shape, bf16 + fp8 (prefill through the flash kernel)"
  timeout 100 python3 benchmarks/decode.py --layers 4 --out "$OUT/decode4.json" --skip-peers --skip-verify 2>&1 \
    | tee "$OUT/decode4.log" | grep -v Warning | grep -E "^\[|fallback|Error|prefill" | tail -8
  echo "== speculative end to end: the bundled pair"
  timeout 170 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-8b --skip-buckets --skip-peers \
    --gammas 2,3,4 2>&1 | tee "$OUT/e2e.log" | grep -v Warning | tail -12
elif [ "$what" = seventh1 ]; then
  # Seventh session, call 1: the bundled pair end to end with every peer, gamma 1..8 and auto
  # (auto after the resync fix), batch buckets, then FP8 accuracy on the GPU (issue #10).
  echo "== speculative end to end: the bundled pair, buckets"
  timeout 380 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-8b --gammas 1,2,3,4,5,6,7,8 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | tail -24
  echo "== FP8 accuracy (bundled pair, on the GPU)"
  timeout 160 python3 benchmarks/fp8_accuracy.py --device cuda --prompts 128 --out "$OUT/fp8_accuracy.json" 2>&1 \
    | tee "$OUT/fp8_accuracy.log" | grep -v Warning | tail -40
elif [ "$what" = seventh2 ]; then
  # Seventh session, call 2: programmatic dependent launch (fuser/ops/pdl.py): its GPU tests,
  # the GEMV chain with PDL off / on (benchmarks/pdl_lab.py), 8 layers of the 8B decode step
  # with PDL off, then on.
  echo "== GPU tests: PDL, the kernels it touches"
  timeout 110 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf tests/test_pdl.py \
    tests/test_ops_attention.py tests/test_rotary_cache.py -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -v Warning | tail -12
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== PDL lab: 8B-shape GEMV chain"
  timeout 120 python3 benchmarks/pdl_lab.py --layers 16 --out "$OUT/pdl_lab.json" 2>&1 \
    | tee "$OUT/pdl_lab.log" | grep -v Warning
  for pdl in 0 1; do
    echo "== decode, 8 layers of the 8B shape, FUSER_PDL=$pdl"
    FUSER_PDL=$pdl timeout 120 python3 benchmarks/decode.py --layers 8 --out "$OUT/decode8_pdl$pdl.json" \
      --skip-peers 2>&1 | tee "$OUT/decode8_pdl$pdl.log" | grep -v Warning \
      | grep -E "^\[|ceiling|fallback|Error|verify|prefill" | tail -12
  done
elif [ "$what" = eighth1 ]; then
  # Eighth session, call 1: the seventh session's PDL (never run on a GPU) and the draft's
  # chunked resync: their GPU tests; PDL is switched off for the rest if any fails. Then the PDL
  # lab, the 8B decode in both precisions with the per-op profile, and the 1B-shape draft's step.
  echo "== GPU tests: PDL, resync, the kernels PDL touches"
  timeout 150 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf tests/test_pdl.py \
    tests/test_resync.py tests/test_ops_gated_linear.py tests/test_ops_attention.py tests/test_rotary_cache.py \
    -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | grep -E "^E |FAIL|Error|passed|failed" | head -30
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  if ! tail -1 "$OUT/gpu_tests.log" | grep -q passed || tail -1 "$OUT/gpu_tests.log" | grep -q failed; then
    export FUSER_PDL=0; summary+=("PDL switched off for the benchmarks: a GPU test failed")
  fi
  echo "== PDL lab: 8B-shape GEMV chain, 16 layers"
  timeout 80 python3 benchmarks/pdl_lab.py --layers 16 --out "$OUT/pdl_lab.json" 2>&1 \
    | tee "$OUT/pdl_lab.log" | grep -v Warning | tail -14
  echo "== decode, 8B shape, bf16 + fp8 (FUSER_PDL=${FUSER_PDL:-1})"
  decode_8b_profiled 290
  echo "== decode, 1B shape, bf16"
  decode_1b 55
elif [ "$what" = eighth2 ]; then
  # Eighth session, call 2: the draft's chunked resync on the GPU (its no-sync test), then
  # gamma="auto" end to end on the bundled pair (it ran at 0.70x target-only when each resync
  # was an uncaptured re-prefill) with buckets, and the 8B + 1B non-agreeing pair (>= 95%).
  echo "== GPU test: resync without a host sync"
  timeout 80 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf tests/test_resync.py \
    -k "cuda" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | grep -E "^E |FAIL|Error|passed|failed" | head -20
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== speculative end to end: the bundled pair, buckets"
  timeout 230 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-8b --skip-peers --gammas 1,2,3,4,6 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | tail -16
  echo "== speculative end to end: 8B + 1B draft"
  timeout 240 python3 benchmarks/e2e.py --out "$OUT/e2e8b" --skip-bundled --skip-buckets 2>&1 \
    | tee "$OUT/e2e8b.log" | grep -v Warning | tail -16
elif [ "$what" = ninth ]; then
  # For the next session's first call (written in the eighth, not yet run): the GPU tests the
  # eighth session's calls could not finish (PDL's dependent chain, the resync without a sync),
  # the PDL lab, the 1B-shape draft's decode step (issue #11), the 8B decode without --profile
  # (the profiled run outlasts 290 s), then the bundled pair with its peers.
  echo "== GPU tests: PDL chains, resync"
  timeout 170 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf tests/test_pdl.py \
    tests/test_resync.py -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning \
    | grep -E "^E |FAIL|Error|passed|failed" | head -30
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== PDL lab, 16 layers"
  timeout 80 python3 benchmarks/pdl_lab.py --layers 16 --out "$OUT/pdl_lab.json" 2>&1 \
    | tee "$OUT/pdl_lab.log" | grep -v Warning | tail -17
  echo "== decode, 1B shape, bf16"
  decode_1b 90
  echo "== decode, 8B shape, bf16 + fp8"
  timeout 240 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|ceiling|fallback|Error|verify|prefill|fp8 vs" | tail -20
elif [ "$what" = stream ]; then
  # Ninth session, first call: the stream GEMV (fuser/ops/gemv_stream.py) on the GPU for the
  # first time: its GPU tests, then the 16-layer GEMV chain with every variant (pdl_lab.py).
  echo "== GPU tests: stream GEMV, PDL"
  timeout 150 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_ops_gemv_stream.py tests/test_pdl.py -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -v Warning | grep -E "^E |FAIL|Error|passed|failed" | head -30
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== GEMV chain lab, 16 layers"
  timeout 300 python3 benchmarks/pdl_lab.py --layers 16 --out "$OUT/pdl_lab.json" "$@" 2>&1 \
    | tee "$OUT/pdl_lab.log" | grep -v Warning | tail -40
elif [ "$what" = ninth2 ]; then
  # Ninth session: the fused rotary + KV write + attention kernel's GPU tests and timing, then the
  # FP8 one-row conversion by integer operations (linear.FP8_BITS) in the 16-layer GEMV chain.
  # FP8_BITS and the packed FP8 words measured slower and were removed after this call, so the
  # lab step below now finds only its "off" variant.
  echo "== GPU tests: rotary_cache_attention"
  timeout 150 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rfE \
    tests/test_rotary_attention.py tests/test_ops_attention.py tests/test_ops_gemv_stream.py -k gpu 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -v Warning | grep -E "^E |FAIL|Error|passed|failed" | head -30
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== attention sweep (fused vs two ops)"
  timeout 60 python3 benchmarks/attention_sweep.py --out "$OUT/attention_sweep.json" 2>&1 \
    | tee "$OUT/attention_sweep.log" | grep -v Warning | tail -12
  echo "== GEMV chain lab, FP8, 16 layers"
  timeout 150 python3 benchmarks/pdl_lab.py --layers 16 --rows 1 --dtypes fp8 --out "$OUT/pdl_lab.json" \
    --variants "off;off bits;pdl, 1 tile bits;stream pdl 2/sm 8K d4 bytes bits;stream pdl d4 8K bytes bits;stream pdl 3/sm 4K d4 bytes bits;stream pdl 2/sm 8K d4 fp8" 2>&1 \
    | tee "$OUT/pdl_lab.log" | grep -v Warning | tail -12
elif [ "$what" = eleventh ]; then
  # Tenth session: the weight tile as the MMA's A operand at several rows (bf16; FP8 ran in the
  # session's second call), then the profiled bf16 decode at the 8B shape and the 1B-shape draft
  # (issue #11: fixed cost, kernels per step, verify ratio). ~8 minutes.
  echo "== swap-AB MMA lab, bf16"
  timeout 150 python3 benchmarks/fp8_mma_lab.py --dtypes bf16 --rows 5,1 --skip-a8 \
    --out "$OUT/bf16_swap_lab.json" 2>&1 | grep -v Warning | tail -24
  echo "== decode, 8B shape, bf16, profiled"
  timeout 260 python3 benchmarks/decode.py --precisions bf16 --out "$OUT/decode.json" --skip-peers \
    --profile 2>&1 | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|kernels|^sum|^graph|^GEMV|^GEMM|^attention|^rms|^rotary|^KV|^gated|^rope|^HBM|ceiling|fallback|Error|verify|prefill" | tail -40
  echo "== decode, 1B shape, bf16"
  decode_1b 150
elif [ "$what" = eleventh2 ]; then
  # Tenth session, last call: the swapped MMA (linear._default_swap) at several rows on the GPU:
  # its tests, the 16-layer chain at 5 rows, the 8B decode and verify steps; then the FP8
  # swapped tiles over more shapes of tile. ~8 minutes.
  linear_gpu_tests
  echo "== GEMV chain lab, 16 layers, 5 rows"
  timeout 100 python3 benchmarks/pdl_lab.py --layers 16 --rows 5 --dtypes bf16,fp8 --variants "off" \
    --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -4
  echo "== decode, 8B shape"
  timeout 300 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | tail -24
  echo "== swap-AB MMA lab, FP8, 5 rows"
  timeout 100 python3 benchmarks/fp8_mma_lab.py --dtypes fp8 --rows 5 --skip-a8 \
    --out "$OUT/fp8_swap_lab.json" 2>&1 | grep -v Warning | tail -12
elif [ "$what" = eleventh3 ]; then
  # Tenth session: the swapped MMA keeps its layout through the split sum and the store (as the
  # lab's kernel does): the GEMV GPU tests, the defaults alone, the 5-row chain. ~3 minutes.
  linear_gpu_tests
  echo "== _linear_kernel defaults, 5 rows"
  timeout 90 python3 benchmarks/fp8_mma_lab.py --dtypes fp8,bf16 --rows 5 --default-only \
    --out "$OUT/defaults.json" 2>&1 | grep -v Warning | tail -16
  echo "== GEMV chain lab, 16 layers, 5 rows"
  timeout 60 python3 benchmarks/pdl_lab.py --layers 16 --rows 5 --dtypes bf16,fp8 --variants "off" \
    --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -4
elif [ "$what" = shapes ]; then
  # Twelfth session, first call: each 8B-shape GEMV alone, 16 launches back to back (gate/up's
  # stream tile reads each row 64 bytes a step), the stream configurations against
  # _linear_kernel and cuBLAS; FP8's unrolled one-row loop; then the one-row chain with it.
  # (As run then: the variant words runN, p2 and lk uN, and the unrolled loop, were removed
  # after this call's figures.)
  echo "== shape lab, bf16"
  timeout 240 python3 benchmarks/shape_lab.py --dtypes bf16 --out "$OUT/shape_lab_bf16.json" \
    --variants "default;lk;cublas;2/sm 16K d2;2/sm 16K d3;2/sm 8K d4 run128;2/sm 8K d2 run256;\
2/sm 8K d4 p2;4/sm 8K d2 w4;4/sm 8K d3 w4;1/sm 32K d2;2/sm 8K d3 run128 w16" 2>&1 \
    | grep -v Warning | tee "$OUT/shape_lab_bf16.log"
  echo "== shape lab, fp8"
  timeout 150 python3 benchmarks/shape_lab.py --dtypes fp8 --out "$OUT/shape_lab_fp8.json" \
    --variants "default;lk u2;lk u4;2/sm 8K d4;2/sm 16K d2;4/sm 8K d2 w4;2/sm 8K d2 run256" \
    2>&1 | grep -v Warning | tee "$OUT/shape_lab_fp8.log"
  echo "== GEMV chain lab, 16 layers, 1 row: _linear_kernel's K loop with 2 or 4 tiles in flight"
  timeout 90 python3 benchmarks/pdl_lab.py --layers 16 --rows 1 --dtypes fp8,bf16 \
    --variants "stream default;pdl, 1 tile;pdl unroll 2;pdl unroll 4" \
    --out "$OUT/pdl_lab_unroll.json" 2>&1 | grep -v Warning | tail -9
elif [ "$what" = wide ]; then
  # Twelfth session, second call: gemv_stream.DEFAULT.wide (16 KB tiles, 2 deep) for the bf16
  # gate/up; more stream configurations for down_proj and gate/up; FP8's _linear_kernel tiles
  # and what its norm prologue costs ("nonorm"); the one-row chain; the 8B decode, profiled.
  echo "== GPU tests: stream GEMV"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_gemv_stream.py \
    -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^E  |FAIL|Error|passed|failed" | head
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== shape lab, bf16"
  timeout 120 python3 benchmarks/shape_lab.py --dtypes bf16 --shapes gate_up,down,qkv \
    --out "$OUT/shape_lab_bf16.json" --variants "default;2/sm 16K d2 w16;4/sm 8K d2 w4;\
4/sm 16K d2 w8;2/sm 8K d3 w16;2/sm 8K d4 w16;2/sm 16K d3 w16" 2>&1 | grep -v Warning \
    | tee "$OUT/shape_lab_bf16.log"
  echo "== shape lab, fp8"
  timeout 130 python3 benchmarks/shape_lab.py --dtypes fp8 --out "$OUT/shape_lab_fp8.json" \
    --variants "default;default nonorm;lk n16 k1024 w4 s4;lk n64 k512 w8 s4;lk n128 k256 w8 s4;\
lk n16 k512 w4 s4;lk n32 k1024 w8 s3" 2>&1 | grep -v Warning | tee "$OUT/shape_lab_fp8.log"
  echo "== GEMV chain lab, 16 layers, 1 row"
  timeout 60 python3 benchmarks/pdl_lab.py --layers 16 --rows 1 --dtypes bf16 \
    --variants "pdl, 1 tile;stream default" --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -3
  echo "== decode, 8B shape"
  timeout 330 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers --profile 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|verify|ceiling|fp8 vs|per token|parts|\
Error|fallback|kernels|^sum|^graph|^GEMV|^attention|^rope|^other|^iteration|^  [a-z_]" | tail -70
elif [ "$what" = prologue ]; then
  # Twelfth session, third call: _linear_kernel's one-row norm prologue over the whole row
  # (ONE_ROW_NORM_K) against its cost measured in the second call; the 5-row chain with the
  # norms inside the GEMVs (the verify step's candidate); the 8B decode with its verify step,
  # unprofiled; then the engine's GPU tests in what time is left.
  echo "== GPU tests: PDL chain with the wide tile, norm prologue"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_gemv_stream.py \
    tests/test_ops_norm_linear.py tests/test_ops_argmax.py -k "pdl_chain or through_linear or llama3 or vocabulary or fall_back" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E  |FAIL|Error|passed|failed" | head
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== shape lab, fp8: the norm prologue's cost"
  timeout 60 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes qkv,gate_up \
    --variants "default;default nonorm" --out "$OUT/shape_lab_fp8.json" 2>&1 | grep -v Warning
  echo "== GEMV chain lab, 16 layers, 5 rows: norms inside the GEMVs"
  timeout 60 python3 benchmarks/pdl_lab.py --layers 16 --rows 5 --dtypes bf16 \
    --variants "off;norm prologue" --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -3
  echo "== decode, 8B shape"
  timeout 400 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|verify|ceiling|fp8 vs|per token|\
parts|Error|fallback" | tail -30
  left=$((585 - SECONDS))
  echo "== GPU tests: the engine (${left} s left)"
  [ "$left" -gt 30 ] && timeout "$left" python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_cuda.py 2>&1 | tee "$OUT/gpu_tests_engine.log" | grep -E "^E  |FAIL|Error|passed|failed" | head
elif [ "$what" = thirteenth ]; then
  # Run as the thirteenth session's first call (commit ccdfc22, RESULTS.md): the twelfth's
  # untimed changes (FP8 gate/up on 128 x 256 tiles, bf16 down_proj on 16 warps, the two-kernel
  # argmax) in the 8B decode and verify steps; the one-row chain with norm kernels instead of
  # FP8's per-program prologue; FP8's prologue at 1024 and 2048 columns a step; stream, PDL and
  # argmax GPU tests. It then also timed several-row PDL (--verify-pdl-rows, the "pdl rows"
  # variant), which that run removed: the mode now runs without them.
  echo "== decode, 8B shape"
  timeout 400 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers \
    2>&1 | tee "$OUT/decode.log" | grep -v Warning \
    | grep -E "^\[|verify|ceiling|fp8 vs|per token|parts|Error|fallback" | tail -32
  echo "== GEMV chain lab, 16 layers: FP8's norm prologue against norm kernels; 5 rows"
  timeout 90 python3 benchmarks/pdl_lab.py --layers 16 --rows 1,5 --dtypes fp8,bf16 \
    --variants "pdl, 1 tile;stream default;norm kernels;off;f16 mma" \
    --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -13
  echo "== shape lab, fp8: the one-row prologue's step width (linear.ONE_ROW_NORM_K)"
  timeout 60 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes qkv,gate_up \
    --variants "default;default nk1024;default nk2048;default nonorm" \
    --out "$OUT/shape_lab_fp8.json" 2>&1 | grep -v Warning
  left=$((585 - SECONDS))
  echo "== GPU tests: stream, PDL, argmax (${left} s left)"
  [ "$left" -gt 30 ] && timeout "$left" python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_ops_gemv_stream.py tests/test_pdl.py tests/test_ops_argmax.py \
    -k "pdl_chain or through_linear or gpu_dependent or gpu_pdl or vocabulary" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E  |FAIL|Error|passed|failed" | head
elif [ "$what" = fourteenth ]; then
  # Written in the twelfth session, run in the thirteenth's last call: the linear GPU tests
  # (FP8 gate/up's new tile, FP8's 2048-column norm prologue), the 16-layer chains at 1 and 5
  # rows with their norms as the engine runs them and with none at all (the bound for fusing
  # the norms into the GEMVs), then the engine's GPU tests in the time left.
  linear_gpu_tests
  echo "== GEMV chain lab, 16 layers: the norms as the engine runs them, and none"
  timeout 100 python3 benchmarks/pdl_lab.py --layers 16 --rows 1,5 --dtypes fp8,bf16 \
    --variants "pdl, 1 tile;stream default;f16 mma;off;no norms" \
    --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -12
  left=$((585 - SECONDS))
  echo "== GPU tests: the engine (${left} s left)"
  [ "$left" -gt 30 ] && timeout "$left" python3 -m pytest -v -p no:cacheprovider -rf \
    tests/test_cuda.py tests/test_cuda_spec.py 2>&1 | tee "$OUT/gpu_tests_engine.log" \
    | grep -E "^E  |PASSED|FAILED|ERROR|passed|failed" | cut -c1-150 | tail -30
elif [ "$what" = s16a ]; then
  # Sixteenth session, call 2: FP8_ROWS_MMA = "pieces" (the default now: the norm kernel splits
  # x for qkv, gate/up and the LM head, split_pieces_triton for o_proj and down_proj) and
  # EVEN_K (no column masks in the several-row K loop): the GPU tests of the GEMVs, the rows lab
  # (the engine's pieces GEMV with x split outside, with the split kernel timed in, and the fp16
  # path), then the 8B decode + verify, FP8 then bf16, in what the budget leaves.
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_e4m3_pieces.py \
    tests/test_ops_linear.py tests/test_ops_norm_linear.py tests/test_ops_gated_linear.py \
    -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^E |FAIL|Error|passed|failed" | head
  summary+=("GPU tests, pieces + linear: $(tail -1 "$OUT/gpu_tests.log")")
  timeout 150 python3 benchmarks/fp8_rows_lab.py --out "$OUT/fp8_rows_lab.json" \
    --variants "default,engine f16,engine pieces,engine split pieces,x2 pieces" \
    2>&1 | grep -v Warning | tail -30
  decode_8b fp8 560
  decode_8b bf16 560
elif [ "$what" = s16b ]; then
  # Sixteenth session, call 3: the engine's GPU tests on the tree's defaults, FP8 speculative
  # on e4m3 pieces among them; then the bf16 decode + verify in what the budget leaves.
  echo "== GPU tests: the engine"
  timeout "${BUDGET:-320}" python3 -m pytest -v -p no:cacheprovider -rf tests/test_cuda.py \
    tests/test_cuda_spec.py 2>&1 | tee "$OUT/gpu_tests_engine.log" \
    | grep -E "^E  |PASSED|FAILED|ERROR|passed|failed" | cut -c1-150 | tail -30
  decode_8b bf16 320
elif [ "$what" = s16c ]; then
  # Sixteenth session, call 3 (s16b did not fit what was left): the GPU tests the default
  # "pieces" touches (the ops, the engine's FP8 and bf16 speculative tests), in the budget.
  timeout "${BUDGET:-250}" python3 -m pytest -v -p no:cacheprovider -rf \
    tests/test_e4m3_pieces.py tests/test_ops_norm_linear.py -k "gpu or speculative" \
    "tests/test_cuda.py::test_fp8_speculative_on_e4m3_pieces_equals_target_only" \
    "tests/test_cuda.py::test_bf16_speculative_equals_target_only_and_replays" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E  |PASSED|FAILED|ERROR|passed|failed" \
    | cut -c1-150 | tail -30
elif [ "$what" = s17a ]; then
  # Seventeenth session, call 1: one row's sums kept per thread (linear.ONE_ROW_PARTIALS, one
  # reduction across threads after the K loop): the GEMVs' GPU tests, each 8B shape alone with
  # and without it (shape_lab.py "shuffle"), the 8B decode FP8 then bf16, then the engine's
  # GPU tests that s16c was to run, in what the budget leaves.
  linear_gpu_tests
  timeout 120 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes qkv,o,gate_up,down,head \
    --variants "default;default shuffle" --out "$OUT/shape_lab_fp8.json" 2>&1 | grep -v Warn | tail -12
  timeout 90 python3 benchmarks/shape_lab.py --dtypes bf16 --shapes qkv,o,down,head \
    --variants "default;lk;lk shuffle" --out "$OUT/shape_lab_bf16.json" 2>&1 | grep -v Warn | tail -14
  decode_8b fp8 560
  decode_8b bf16 560
elif [ "$what" = s17d ]; then
  # Seventeenth session, last call (the lease's last minutes): the FP8 one-row GPU tests on
  # the new default tiles, then the one-row K loop software-pipelined (commit dfaa782's
  # linear.ONE_ROW_PIPELINE, removed after this call: slower) and whole-K tiles.
  timeout 75 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_fp8.py \
    tests/test_ops_norm_linear.py -k "gpu_fp8_linear_llama3 or gpu_llama3_qkv" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E |FAIL|Error|passed|failed" | head
  timeout 70 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes o,qkv,down,gate_up \
    --variants "default;lk s3 pipe;lk s4 pipe" 2>&1 | grep -v Warn | tail -13
  timeout 30 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes o,qkv \
    --variants "default;lk n8 k4096 w8;lk n4 k4096 w8" 2>&1 | grep -v Warn | tail -7
elif [ "$what" = s17c ]; then
  # Seventeenth session, call 3: call 2's fastest one-row FP8 tiles as the module's defaults:
  # the FP8 GEMVs' GPU tests at the 8B shapes on them (plain, norm + qkv/gate-up); then whole-K
  # tiles (one K step: with PDL a program loads its whole slice of the weight before its wait)
  # at o_proj and qkv against the defaults, and the 8B FP8 decode if the lease leaves time.
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_fp8.py \
    tests/test_ops_norm_linear.py -k "gpu_fp8_linear_llama3 or gpu_llama3_qkv" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E |FAIL|Error|passed|failed" | head
  summary+=("GPU tests, FP8 one row: $(tail -1 "$OUT/gpu_tests.log")")
  timeout 60 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes o,qkv \
    --variants "default;lk n8 k4096 w8;lk n4 k4096 w8;lk n16 k4096 w8" 2>&1 | grep -v Warn | tail -9
  decode_8b fp8 300
elif [ "$what" = s18a ]; then
  # Eighteenth session, call 1: norm_stats (passes/norm_stats.py: at several rows the residual
  # norm moves into the GEMVs around it): its GPU tests and the CUDA engine tests, then the 8B
  # decode in bf16 (profiled: the verify breakdown), FP8 with its consumers rewritten too
  # (--norm-stats fp8: the fp16 MMA after the norm) and FP8 as before (this run's baseline).
  echo "== GPU tests: norm_stats ops, CUDA engines"
  timeout 170 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_norm_stats.py \
    tests/test_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^E  |FAILED|ERROR|passed|failed" | cut -c1-150 | tail -20
  decode_8b bf16 590 --profile --norm-stats on
  TAG=fp8_stats decode_8b fp8 590 --norm-stats fp8
  decode_8b fp8 590
elif [ "$what" = s18b ]; then
  # Eighteenth session, call 2: norm_stats' second form (s18a's consumer normalised x's tiles in
  # its K loop: verify 1.112x in bf16, 2.845x in FP8): the producer writes g * h too, the
  # consumer's K loop is a plain GEMV's and rstd scales its sums. GPU tests, then the 8B bf16
  # decode with and without it (the same run's baseline), then FP8 with its consumers on it.
  echo "== GPU tests: norm_stats ops, CUDA engines"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda.py \
    "tests/test_ops_norm_stats.py::test_gpu_llama3_shapes" \
    "tests/test_ops_norm_stats.py::test_gpu_ops_compute_what_they_replace" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E  |FAILED|ERROR|passed|failed" | cut -c1-150 | tail -20
  decode_8b bf16 590 --profile --norm-stats on
  TAG=bf16_off decode_8b bf16 590 --norm-stats off
  TAG=fp8_stats decode_8b fp8 590 --norm-stats fp8
elif [ "$what" = s18c ]; then
  # Eighteenth session, call 3 (the lease's last minutes): norm_stats with its loads before the
  # K loop (rstd's sums in the consumer, the residual and norm weight tiles in the producer),
  # the 8B bf16 decode with it and without it.
  echo "== GPU tests: norm_stats ops at the 8B shapes"
  timeout 80 python3 -m pytest -q -p no:cacheprovider -rf \
    "tests/test_ops_norm_stats.py::test_gpu_llama3_shapes" \
    "tests/test_ops_norm_stats.py::test_gpu_ops_compute_what_they_replace" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E  |FAILED|ERROR|passed|failed" | cut -c1-150 | tail -20
  decode_8b bf16 400 --norm-stats on
  TAG=bf16_off decode_8b bf16 400 --norm-stats off
elif [ "$what" = s23b ]; then
  # Written in the twenty-second session for the next (issue #10): several-row PDL again, now
  # that the prefetched tiles take their path's own step (fuser/ops/pdl.py; s23a runs
  # tests/test_pdl.py, whose 5-row FP8 chain with FUSER_PDL_ROWS=1 must give the ordinary bits).
  # The 8B FP8 decode + verify with every several-row launch on PDL (the verify step's gaps).
  export FUSER_PDL_ROWS=1
  TAG=fp8_pdl_rows decode_8b fp8 570
elif [ "$what" = s23c ]; then
  # (for the next session, issue #10) several-row PDL with the GEMVs letting the next kernel
  # launch after their K loop (FUSER_PDL_LATE=1), then that with s23a's x2 consumers.
  export FUSER_PDL_ROWS=1 FUSER_PDL_LATE=1
  TAG=fp8_pdl_late decode_8b fp8 290
  TAG=fp8_pdl_late_x2 decode_8b fp8 580 --norm-stats fp8 --stats-fp8-mma x2
elif [ "$what" = s26a ]; then
  # Written in the twenty-fifth session for the next (issue #10): s25c's sweep found the 5-row
  # tiles at their optimum among 64- and 128-row tiles on the wgmma. Below 64 rows Triton
  # compiles mma.sync on fp16-widened pieces (pieces_lab.SMALL_TILES): more, smaller programs.
  # Their values first (the bf16 MMA's), then the sweep with them, then the 8B FP8 decode +
  # verify on whatever wins.
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_e4m3_pieces.py \
    -k small_tiles 2>&1 | grep -E "^E  |FAILED|passed|failed" | cut -c1-200 | tail -4
  timeout 240 python3 benchmarks/pieces_lab.py --sweep --best "$OUT/pieces_tiles.json" \
    --out "$OUT/pieces_sweep.json" 2>&1 | grep -v Warn | tail -6
  if [ -s "$OUT/pieces_tiles.json" ] && [ "$(cat "$OUT/pieces_tiles.json")" != "{}" ]; then
    TAG=fp8_tiles decode_8b fp8 590 --pieces-tiles "$OUT/pieces_tiles.json"
    TAG=fp8 decode_8b fp8 590
  fi
elif [ "$what" = s25d ]; then
  # Twenty-fifth session (issue #10): the 5-row FP8 programs take all 255 registers, so two
  # share an SM; at 8 warps (one an SM) every GEMV was slower (s25a), so programs per SM may be
  # what they lack, and several-row PDL lost (twenty-third session) perhaps because the next
  # kernel's programs had no room beside the running ones. A register cap of 128 (four an SM,
  # more spills): pieces_lab's rows_r128/r168, then the 8B FP8 decode + verify capped with
  # several-row PDL on the GEMVs, then capped alone.
  timeout 200 python3 benchmarks/pieces_lab.py --out "$OUT/pieces_lab.json" 2>&1 | grep -v Warn \
    | sed -E 's/, (blocks64|blocks128|blocks_w8|f16_w8)[^,]*//g' | tail -5
  FUSER_PDL_ROWS=gemv TAG=fp8_r128_pdl decode_8b fp8 590 --rows-maxnreg 128
  [ $((${BUDGET:-590} - SECONDS)) -gt 170 ] && TAG=fp8_r128 decode_8b fp8 590 --rows-maxnreg 128
elif [ "$what" = s25c ]; then
  # Twenty-fifth session (issue #10): s25a put 8 warps and the spill-free tiles behind the
  # defaults everywhere, so the spills are not what the 5-row GEMVs lose. Their launch shapes on
  # the pieces (split-K, stages, K step) were never swept: qkv and o_proj stream at ~45-55% of
  # the bandwidth at 5 rows. pieces_lab --sweep, then the 8B FP8 decode + verify on the fastest
  # tiles (--pieces-tiles) and as is on the same machine; o_proj on pieces if time is left.
  timeout 240 python3 benchmarks/pieces_lab.py --sweep --best "$OUT/pieces_tiles.json" \
    --out "$OUT/pieces_sweep.json" 2>&1 | grep -v Warn | tail -6
  if [ -s "$OUT/pieces_tiles.json" ] && [ "$(cat "$OUT/pieces_tiles.json")" != "{}" ]; then
    TAG=fp8_tiles decode_8b fp8 590 --pieces-tiles "$OUT/pieces_tiles.json"
    TAG=fp8 decode_8b fp8 590
    [ $((${BUDGET:-590} - SECONDS)) -gt 170 ] && TAG=fp8_tiles_o decode_8b fp8 590 --pieces-tiles "$OUT/pieces_tiles.json" \
      --split-pieces-min-k 2048
  fi
elif [ "$what" = s25a ]; then
  # Written in the twenty-fourth session for the next (issue #10): the several-row FP8 GEMVs at
  # 8 warps. Compiled for sm_90 with Triton 3.6 on the CPU (benchmarks/sass_lab.py), the 4-warp
  # programs use 255 registers and spill (down_proj's 64 x 256 tile reloads 116 values a K
  # step); at 8 warps the 64 x 128 tiles spill nothing. Every several-row sweep so far tried 4
  # warps only. pieces_lab's *_w8 variants per 8B shape, then the 8B FP8 decode + verify at 8
  # warps and as is (same machine).
  timeout 200 python3 benchmarks/pieces_lab.py --out "$OUT/pieces_lab.json" 2>&1 | grep -v Warn | tail -5
  # Decode's gate/up (one row, 128 x 256 tiles, 8 warps) spills too (278 spill loads in its K
  # loop, sass_lab.py); these tiles compile without any spill.
  timeout 90 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes gate_up \
    --variants "default;lk n32 k512 w8;lk n16 k1024 w8;lk n64 k128 w8;lk n32 k256 w8;lk n32 k512 w16" \
    --out "$OUT/shape_gate_up.json" 2>&1 | grep -E "^fp8" | tail -6
  TAG=fp8_w8 decode_8b fp8 420 --rows-warps 8
  TAG=fp8 decode_8b fp8 585
elif [ "$what" = s25b ]; then
  # Written in the twenty-fourth session for the next (issue #10): where block pieces' GEMVs
  # lose what they save (benchmarks/block_lab.py: each 8B layer op at 5 rows in its row and
  # block forms and the parts between), then the FP8 speculative tests, now compared up to the
  # FP8-emulated target's near-ties (the numerics contract): does fp8_lm_head=False still
  # differ away from a tie?
  timeout 200 python3 benchmarks/block_lab.py --out "$OUT/block_lab.json" 2>&1 | grep -v Warn | tail -5
  timeout $((${BUDGET:-590} - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_cuda.py -k "fp8_speculative" 2>&1 | tee "$OUT/cuda_fp8.log" \
    | grep -E "^E  |FAILED|passed|failed" | cut -c1-400 | tail -6
elif [ "$what" = s24d ]; then
  # Twenty-fourth session (issue #10): s24b's block pieces took the 8B FP8 verify to 1.517x,
  # down_proj's 64-column K steps at 3 stages costing twice the row-piece GEMV (pieces_lab).
  # The launcher now keeps the table's bytes in flight for a shorter K step (_deeper_stages):
  # the lab with a stage sweep, the 8B FP8 decode as is and on block pieces, then the 8-layer
  # block verify kernel by kernel.
  timeout 150 python3 benchmarks/pieces_lab.py --out "$OUT/pieces_lab.json" 2>&1 | grep -v Warn | tail -5
  TAG=fp8 decode_8b fp8 330
  TAG=fp8_block decode_8b fp8 520 --norm-stats fp8 --stats-fp8-mma block
  echo "== FP8 verify profiled, 8 layers, block pieces"
  timeout $((${BUDGET:-590} - SECONDS)) python3 benchmarks/decode.py --out "$OUT/prof_block.json" \
    --skip-peers --precisions fp8 --layers 8 --profile --norm-stats fp8 --stats-fp8-mma block \
    2>&1 | tee "$OUT/prof_block.log" | grep -A9 "verify breakdown" \
    | grep -E "GEMV|attention|pieces|other|graph|sum"
  grep -E "^\[fp8\] [0-9.]+ tok/s|replayed alike" "$OUT/prof_block.log" | tail -2
elif [ "$what" = s24b ]; then
  # Written in the twenty-third session for the next (issue #10): the 5-row FP8 GEMV on
  # block-scaled pieces (a power of two per K step, linear_pieces_triton scale_block) against
  # row-scaled pieces and the fp16 path, per 8B shape (benchmarks/pieces_lab.py): with block
  # pieces attention's combine and the GEMV epilogues write every FP8 GEMV's pieces themselves
  # (no norm-pieces or split kernel, no launch, no gap; passes/norm_stats.py, "block").
  timeout 120 python3 benchmarks/pieces_lab.py --out "$OUT/pieces_lab.json" 2>&1 | grep -v Warn | tail -5
  # norm_stats' FP8 consumers on block pieces (no norm kernel, no split kernel at 5 rows): the
  # ops' GPU tests, the 8B FP8 decode + verify on them, then the engine's greedy against
  # target-only with the time left.
  timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/test_e4m3_pieces.py \
    tests/test_ops_norm_stats.py tests/test_rotary_attention.py -k "block" 2>&1 \
    | grep -E "^E  |FAILED|passed|failed" | cut -c1-200 | tail -6
  TAG=fp8_block decode_8b fp8 400 --norm-stats fp8 --stats-fp8-mma block
  timeout $((${BUDGET:-590} - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_cuda.py::test_fp8_speculative_with_norms_on_block_pieces_equals_target_only \
    2>&1 | grep -E "^E  |FAILED|passed|failed" | cut -c1-300 | tail -6
elif [ "$what" = s24a ]; then
  # Written in the twenty-third session for the next (issue #10): one shared-memory carveout for
  # every Triton kernel (fuser/ops/carveout.py): does the 5-row verify step lose its 1.67 us
  # between kernels (and PDL at several rows start to pay) when no SM has to change its L1 /
  # shared split between kernels? The 8-layer FP8 verify profiled: as is (this machine's
  # baseline), carveout 100%, carveout 100% with PDL on the several-row GEMVs; then the full 8B
  # FP8 decode + verify with the carveout. First benchmarks/gap_lab.py (a kernel boundary's
  # cost between small kernels and the 5-row GEMV), without and with the carveout.
  for flags in "" "--smem-carveout 100"; do
    timeout 60 python3 benchmarks/gap_lab.py $flags 2>&1 | grep -v Warn | tail -11
  done
  echo "== gap_lab with the GEMV on several-row PDL (FUSER_PDL_ROWS=gemv), carveout 100"
  FUSER_PDL_ROWS=gemv timeout 60 python3 benchmarks/gap_lab.py --smem-carveout 100 2>&1 \
    | grep -v Warn | tail -11
  for variant in base:0 c100:0 c100:gemv; do
    name=${variant%:*}; rows=${variant#*:}
    flags=""; [ "$name" = c100 ] && flags="--smem-carveout 100"
    echo "== FP8 verify profiled, 8 layers, $name, FUSER_PDL_ROWS=$rows"
    FUSER_PDL_ROWS=$rows timeout 150 python3 benchmarks/decode.py --out "$OUT/prof_${name}_${rows}.json" \
      --skip-peers --precisions fp8 --layers 8 --profile $flags 2>&1 | tee "$OUT/prof_${name}_${rows}.log" \
      | grep -A9 "verify breakdown" | grep -E "GEMV|attention|pieces|other|graph|sum"
    grep -E "^\[fp8\] [0-9.]+ tok/s" "$OUT/prof_${name}_${rows}.log"
  done
  TAG=fp8_c100 decode_8b fp8 580 --smem-carveout 100
elif [ "$what" = s23e ]; then
  # Twenty-third session, call 4: the fixes on the GPU: the norm_stats ops (the fp32 residual
  # epilogue's scale product kept out of an FMA), tests/test_pdl.py (its split-K case), the
  # CUDA engines (the FP8 speculative test now with fp8_lm_head=False too).
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_norm_stats.py \
    tests/test_pdl.py 2>&1 | tee "$OUT/ops_tests.log" | grep -E "^FAILED|passed|failed" | cut -c1-200
  timeout $((${BUDGET:-580} - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log" | grep -E "^FAILED|passed|failed" | cut -c1-200
elif [ "$what" = s23d ]; then
  # Twenty-third session, call 3 (issue #10): s23b's several-row PDL made the FP8 verify step
  # slower (3.178 ms, 1.396x); which launches cost it. The 8-layer FP8 verify profiled with PDL
  # on the several-row GEMVs only (FUSER_PDL_ROWS=gemv), then with their late launch
  # (FUSER_PDL_LATE=1), then every several-row launch late; s23a's profile is the baseline.
  # First the fp32-x FP8-weight diagnostic (tests/test_ops_norm_stats.py failed on the GPU).
  timeout 60 python3 benchmarks/diag_fp32_fp8.py 2>&1 | grep -v Warn | tail -4
  FUSER_PDL_ROWS=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py \
    -k "dependent or case2" 2>&1 | tail -2
  for rows_late in gemv:0 gemv:1 1:1; do
    echo "== FP8 verify profiled, 8 layers, FUSER_PDL_ROWS=${rows_late%:*} FUSER_PDL_LATE=${rows_late#*:}"
    FUSER_PDL_ROWS=${rows_late%:*} FUSER_PDL_LATE=${rows_late#*:} timeout 150 python3 \
      benchmarks/decode.py --out "$OUT/decode_fp8_prof_${rows_late/:/_}.json" --skip-peers \
      --precisions fp8 --layers 8 --profile 2>&1 | tee "$OUT/decode_fp8_prof_${rows_late/:/_}.log" \
      | grep -A8 "verify breakdown" | grep -E "GEMV|attention|other|graph|sum"
    grep -E "^\[fp8\] [0-9.]+ tok/s" "$OUT/decode_fp8_prof_${rows_late/:/_}.log"
  done
elif [ "$what" = s23a ]; then
  # Written in the twenty-second session for the next (issue #10, the FP8 verify step at
  # 1.290x the decode step against 1.1x): the norm_stats ops' GPU tests (the x2 consumer too),
  # the FP8 verify kernel by kernel (8 layers: per-layer rows), then the full 8B FP8 decode
  # with norm_stats' FP8 consumers on the FP8 MMA over x2 pieces (no norm kernel before qkv
  # and gate/up at several rows; linear.STATS_FP8_MMA).
  echo "== GPU tests: norm_stats ops"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_ops_norm_stats.py tests/test_pdl.py 2>&1 \
    | tee "$OUT/norm_stats_tests.log" | tail -3
  echo "== FP8 decode + verify profiled, 8 layers"
  timeout 200 python3 benchmarks/decode.py --out "$OUT/decode_fp8_prof.json" --skip-peers \
    --precisions fp8 --layers 8 --profile 2>&1 | tee "$OUT/decode_fp8_prof.log" | grep -v Warn \
    | grep -E "breakdown|^GEMV|^attention|^rms|^rotary|^rope|^gated|^other|^sum|^graph|verify|alike" | tail -30
  TAG=fp8_stats_x2 decode_8b fp8 570 --norm-stats fp8 --stats-fp8-mma x2
elif [ "$what" = s22b ]; then
  # Twenty-second session (issue #12's run, part 1): the bundled pair at gammas 1..8 and auto,
  # with the Hugging Face peers, in one e2e.py run.
  echo "== e2e bundled, gammas 1..8 + auto, peers"
  timeout $((${BUDGET:-580} - SECONDS)) python3 benchmarks/e2e.py --out "$OUT/e2e_bundled" \
    --skip-8b --skip-buckets --gammas 1,2,3,4,5,6,7,8 2>&1 | tee "$OUT/e2e_bundled.log" \
    | grep -v Warn | tail -40
elif [ "$what" = s22c ]; then
  # Twenty-second session (issue #12's run, parts 2 and 3): the 8B shape with the 1B-shape
  # random draft (costs per gamma, auto against target-only, the projected curve), the buckets;
  # then the overlap lab if time is left.
  echo "== controller replay over the GPU's bf16 agreement (candidates 1..8, then 1,2,4,6)"
  for cands in 1,2,3,4,5,6,7,8 1,2,4,6; do
    timeout 100 python3 benchmarks/controller_replay.py --device cuda --dtype bfloat16 \
      --auto-gammas $cands 2>&1 | tee -a "$OUT/controller_replay.log" | grep -v Warn | tail -11
  done
  echo "== e2e 8B part + buckets"
  timeout $((${BUDGET:-580} - SECONDS - 60)) python3 benchmarks/e2e.py --out "$OUT/e2e_8b" \
    --skip-bundled 2>&1 | tee "$OUT/e2e_8b.log" | grep -v Warn | tail -40
  left=$((${BUDGET:-580} - SECONDS))
  echo "== overlap lab (${left} s left)"
  timeout "$left" python3 benchmarks/overlap_lab.py 2>&1 | tee "$OUT/overlap_lab.log" | grep -v Warn | tail -8
elif [ "$what" = s22a ]; then
  # Written in the twenty-first session for the next: the overlapped step on CUDA taken apart
  # (benchmarks/overlap_lab.py: captured or not, fused glue or eager), then the whole
  # end-to-end benchmark (issue #12: gammas 1..8 and auto with the peers, the 8B part, buckets).
  echo "== overlap lab"
  timeout 200 python3 benchmarks/overlap_lab.py 2>&1 | tee "$OUT/overlap_lab.log" | grep -v Warn | tail -8
  left=$((${BUDGET:-590} - SECONDS))
  echo "== e2e (${left} s left)"
  timeout "$left" python3 benchmarks/e2e.py --out "$OUT/e2e" --gammas 1,2,3,4,5,6,7,8 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warn | tail -30
elif [ "$what" = s21c ]; then
  # Twenty-first session (issue #12): the outer_product pass and the small-weight several-row
  # tile (linear.SMALL_ROWS_TILE) by default. GPU tests (step graphs, speculative == target-only,
  # the linear op), then the bundled pair end to end.
  echo "== GPU tests"
  timeout 220 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_cuda_spec.py \
    tests/test_ops_linear.py tests/test_cuda.py -k "not overlapped and (gpu or step_graph or sampling_through or bf16_speculative)" \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warn | tail -6
  left=$((${BUDGET:-590} - SECONDS))
  echo "== bundled pair end to end (${left} s left)"
  timeout "$left" python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-8b --skip-peers --skip-buckets \
    --gammas 1,2,3 2>&1 | tee "$OUT/e2e.log" | grep -v Warn \
    | grep -E "iteration ms|parts|^\[bundled\]|^bundled|Error|Traceback" | tail -16
elif [ "$what" = s21b ]; then
  # Twenty-first session (issue #12): several-row tiles for the bundled pair's small weights
  # (K <= 2048), swept over the verify and catch-up steps; the outer_product pass in base.
  timeout "${BUDGET:-590}" python3 benchmarks/step_lab.py --out "$OUT/step_lab.json" --gammas 2,3 \
    --variants "base;rows:32/128/4/3/1;rows:16/128/4/3/1;rows:32/64/4/3/1;rows:16/64/4/3/1;rows:16/64/2/3/1;rows:64/64/4/3/1;rows:32/64/4/3/3;rows:16/64/4/2/3;rows:16/32/4/2/3;rows:16/32/2/2/3" \
    2>&1 | tee "$OUT/step_lab.log" | grep -v Warn | grep -v "^      " | tail -90
elif [ "$what" = s21a ]; then
  # Twenty-first session (issue #12): is the overlapped step graph's wrong output a race between
  # its branches (FUSER_BRANCHES=serial) or PDL across them (FUSER_PDL=0)? Then the bundled
  # pair's step parts kernel by kernel, with tile / split / PDL variants (benchmarks/step_lab.py).
  for env in FUSER_BRANCHES=serial FUSER_PDL=0; do
    echo "== overlapped step graph test with $env (XPASS(strict) = it passed)"
    env "$env" timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=line -rfxX \
      tests/test_cuda_spec.py -k overlapped 2>&1 | tee "$OUT/overlap_$env.log" | grep -v Warn | tail -4
  done
  left=$((${BUDGET:-590} - SECONDS))
  echo "== step lab (${left} s left)"
  timeout "$left" python3 benchmarks/step_lab.py --out "$OUT/step_lab.json" --gammas 1,2,3 \
    --variants "base;split1;bn32;split1 bn32;pdl;split1 pdl" 2>&1 | tee "$OUT/step_lab.log" \
    | grep -v Warn | tail -120
elif [ "$what" = s20b ]; then
  # Twentieth session: FuserConfig(overlap=True) (runtime/speculative.py `overlapped_step`, the
  # draft's branch beside the target's in one step graph; issue #12). GPU tests, then the
  # bundled pair end to end with overlapped rounds (target-only in the same run), then the
  # standard step at gamma 2 for a same-machine comparison.
  echo "== GPU tests: overlapped step"
  timeout 200 python3 -m pytest -q -p no:logging -p no:cacheprovider --tb=short -rf \
    tests/test_overlap.py tests/test_cuda_spec.py -k "kernel or examples or step_graph or sampling_through" \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -12
  echo "== bundled pair end to end, overlapped"
  timeout 300 python3 benchmarks/e2e.py --out "$OUT/e2e_overlap" --skip-8b --skip-peers \
    --skip-buckets --overlap --gammas 1,2,3 2>&1 | tee "$OUT/e2e_overlap.log" | grep -v Warn \
    | grep -E "iteration ms|parts|^\[bundled\]|^bundled|Error|Traceback" | tail -16
  left=$((${BUDGET:-590} - SECONDS))
  echo "== bundled pair end to end, standard step (${left} s left)"
  [ "$left" -gt 120 ] && timeout "$left" python3 benchmarks/e2e.py --out "$OUT/e2e_std" --skip-8b \
    --skip-peers --skip-buckets --gammas 2,3 2>&1 | tee "$OUT/e2e_std.log" | grep -v Warn \
    | grep -E "iteration ms|^\[bundled\]|^bundled|Error" | tail -10
elif [ "$what" = s20a ]; then
  # Written in the nineteenth session for the next (~9 minutes): where the bundled pair's
  # speculative step spends its time beyond the target-only iteration (e2e.py now logs each
  # part alone: draft catch-up, draft decode, target verify, target decode; issue #12), then the
  # 8B FP8 decode and verify profiled (issue #10: which kernels the verify step adds).
  echo "== speculative end to end: the bundled pair, parts"
  timeout 300 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-8b --skip-peers --skip-buckets \
    --gammas 1,2,3,4 2>&1 | tee "$OUT/e2e.log" | grep -v Warn \
    | grep -E "parts|iteration ms|^bundled|Error" | tail -16
  left=$((${BUDGET:-590} - SECONDS))
  echo "== decode, 8B shape, fp8, profiled (${left} s left)"
  [ "$left" -gt 100 ] && timeout "$left" python3 benchmarks/decode.py --out "$OUT/decode_fp8.json" \
    --skip-peers --precisions fp8 --profile 2>&1 | tee "$OUT/decode_fp8.log" | grep -v Warning \
    | grep -E "^\[fp8\] (fuser gen|target|prefill)|kernels|^sum|^GEMV|^  fuser::|verify|alike|Error" | tail -40
elif [ "$what" = s19g ]; then
  # Nineteenth session, call 4 (the lease's last minutes): a chain of the bundled pair's GEMVs
  # as launches, as one persistent kernel with grid barriers, as one program
  # (benchmarks/megakernel_lab.py: is a one-kernel decode step worth building for #12?), then
  # the 8B FP8 decode with norm_stats on FP8 consumers (never measured on its current form).
  echo "== megakernel lab"
  timeout 120 python3 benchmarks/megakernel_lab.py --out "$OUT/megakernel_lab.json" 2>&1 \
    | tee "$OUT/megakernel_lab.log" | grep -v Warn | tail -24
  TAG=fp8_stats decode_8b fp8 290 --norm-stats fp8
elif [ "$what" = s19e ]; then
  # Nineteenth session, call 2: issue #11's run with norm_stats and ONE_ROW_NORM_AFTER on by
  # default: the 8B bf16 decode profiled beside the peers, then the 1B-shape draft profiled.
  echo "== decode, 8B shape, bf16, profiled, with the peers"
  timeout 470 python3 benchmarks/decode.py --out "$OUT/decode.json" --precisions bf16 \
    --profile 2>&1 | tee "$OUT/decode.log" | grep -v Warning \
    | grep -E "^\[bf16\] (fuser gen|target|prefill)|kernels/step|alike|tok/s|fallback|Error" | tail -20
  left=$((${BUDGET:-590} - SECONDS))
  echo "== decode, 1B shape, bf16, profiled (${left} s left)"
  [ "$left" -gt 40 ] && timeout "$left" python3 benchmarks/decode.py --out "$OUT/decode_1b.json" \
    --preset llama-3.2-1b --precisions bf16 --skip-peers --profile 2>&1 \
    | tee "$OUT/decode_1b.log" | grep -v Warning \
    | grep -E "^\[bf16\] (fuser gen|target|prefill)|kernels/step|verify|alike|Error" | tail -12
elif [ "$what" = s19f ]; then
  # Nineteenth session, call 3: the norm_stats op test that call 1 failed (stats_rms_norm_linear
  # at one row now falls back to add_rms_norm_linear's bits), then the CUDA engine tests call 1
  # left unrun, with the defaults (both on).
  timeout 400 python3 -m pytest -v -p no:cacheprovider -rf \
    "tests/test_ops_norm_stats.py::test_gpu_ops_compute_what_they_replace" \
    tests/test_cuda.py::test_decode_gemv_in_every_fixed_step_and_no_fallback \
    tests/test_cuda.py::test_fp8_speculative_on_e4m3_pieces_equals_target_only \
    tests/test_cuda.py::test_bf16_speculative_equals_target_only_and_replays 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E  |PASSED|FAILED|ERROR|passed|failed" | cut -c1-150 | tail -30
elif [ "$what" = s19d ]; then
  # Nineteenth session, call 1: norm_stats + ONE_ROW_NORM_AFTER ("aligned") on the GPU for the
  # first time: the ops' GPU tests, the 8B bf16 decode profiled aligned, then the CUDA engines'
  # tests aligned (speculative greedy == target-only) in the time left.
  echo "== GPU tests: norm_stats and the one-row GEMVs, aligned"
  FUSER_TEST_NORM_STATS=aligned timeout 120 python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_ops_norm_stats.py tests/test_ops_norm_linear.py tests/test_ops_gemv_stream.py \
    -k "gpu or one_row" 2>&1 | tee "$OUT/gpu_tests_ops.log" \
    | grep -E "^E  |FAILED|ERROR|passed|failed" | cut -c1-150 | tail -10
  echo "== decode, 8B shape, bf16, aligned, profiled"
  timeout 260 python3 benchmarks/decode.py --out "$OUT/decode_aligned.json" --skip-peers \
    --precisions bf16 --profile --norm-stats aligned 2>&1 | tee "$OUT/decode_aligned.log" \
    | grep -v Warning | grep -E "^\[bf16\] (fuser gen|target|prefill|per token)|kernels|^sum|^GEMV|other|verify|alike|fallback|Error" | tail -16
  left=$((${BUDGET:-590} - SECONDS))
  echo "== GPU tests: CUDA engines, aligned (${left} s left)"
  [ "$left" -gt 40 ] && FUSER_TEST_NORM_STATS=aligned timeout "$left" python3 -m pytest -v \
    -p no:cacheprovider -rf tests/test_cuda_spec.py tests/test_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^E  |PASSED|FAILED|ERROR|passed|failed" | cut -c1-150 | tail -30
elif [ "$what" = s17b ]; then
  # Seventeenth session, call 2: with ONE_ROW_PARTIALS (call 1: FP8 419.3 tok/s), the one-row
  # FP8 tiles again at qkv, o_proj, down_proj and gate/up (shape_lab.py "lk" words: nN block_n,
  # kN block_k, wN warps, xN split_k); the 8B FP8 decode on the fastest (--best files, read by
  # decode.py --one-row-tiles), then the engine's GPU tests that s16c was to run.
  sweep() {  # shape, variants
    timeout 150 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes "$1" --variants "$2" \
      --out "$OUT/sweep_$1.json" --best "$OUT/best_$1.json" 2>&1 | grep -v Warn | tail -12
  }
  sweep qkv "default;lk n16 k512 w4;lk n16 k1024 w4;lk n16 k1024 w8;lk n32 k512 w8;lk n8 k512 w4;lk n8 k2048 w8;lk n4 k1024 w4;lk n4 k2048 w4"
  sweep o "default;lk n8 k512 w4;lk n4 k1024 w4;lk n16 k512 w4;lk n16 k1024 w8;lk n8 k1024 w4 x2;lk n16 k1024 w4 x2;lk n8 k2048 w8;lk n4 k2048 w4"
  sweep down "default;default shuffle;lk n8 k512 w4 x4;lk n16 k1024 w4 x2;lk n16 k512 w4 x2;lk n8 k2048 w8 x1;lk n8 k1024 w4 x1;lk n4 k1024 w4 x2;lk n8 k1024 w8 x2;lk n4 k2048 w4 x1"
  sweep gate_up "default;lk n64 k256 w4;lk n128 k512 w8;lk n256 k256 w8;lk n64 k512 w8;lk n32 k1024 w8"
  decode_8b fp8 560 --one-row-tiles "$OUT"/best_*.json
  left=$((${BUDGET:-560} - SECONDS))
  echo "== GPU tests: the engine's, s16c's (${left} s left)"
  [ "$left" -gt 60 ] && timeout "$left" python3 -m pytest -v -p no:cacheprovider -rf \
    tests/test_e4m3_pieces.py tests/test_ops_norm_linear.py -k "gpu or speculative" \
    "tests/test_cuda.py::test_fp8_speculative_on_e4m3_pieces_equals_target_only" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E  |PASSED|FAILED|ERROR|passed|failed" \
    | cut -c1-150 | tail -30
elif [ "$what" = pieces ]; then
  # Sixteenth session, call 1 (written in the fifteenth; ~5 minutes): is x handed to
  # the several-row FP8 GEMV already split in two e4m3 pieces worth a producer that splits it?
  # fp8_rows_lab.py's "x2 pieces" (the engine's split, made outside, promoted to fp32 every K
  # step) and "x2 pieces chained" (no promotion) against "a8 x2", the engine's in-kernel "x2"
  # and its fp16 MMA, at every 8B shape; then the lab's GPU tests.
  # "engine pieces" is linear_pieces_triton (X2_PIECES) on x split outside; the decode then
  # runs the engine with the norm kernel splitting x for qkv and gate/up ("norm pieces").
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_fp8_rows_lab.py \
    tests/test_e4m3_pieces.py -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^E |FAIL|Error|passed|failed" | head
  summary+=("GPU tests, rows lab + pieces: $(tail -1 "$OUT/gpu_tests.log")")
  timeout 240 python3 benchmarks/fp8_rows_lab.py --out "$OUT/fp8_rows_lab.json" \
    --variants "default,engine f16,engine x2,engine pieces,a8 x2,x2 pieces,x2 pieces chained" \
    2>&1 | grep -v Warning | tail -40
  left=$((${BUDGET:-590} - SECONDS))
  echo "== decode, 8B shape, FP8, --fp8-rows 'norm pieces' (${left} s left)"
  [ "$left" -gt 60 ] && timeout "$left" python3 benchmarks/decode.py --out "$OUT/decode.json" \
    --skip-peers --precisions fp8 --fp8-rows "norm pieces" 2>&1 | tee "$OUT/decode.log" \
    | grep -v Warning | grep -E "^\[fp8\] (fuser gen|target|prefill)|verify|alike|Error" | tail -8
elif [ "$what" = engine15 ]; then
  # Fifteenth session, call 3 (call 2, `merge`, is in git history at e8dd772): the engine's GPU
  # tests on the tree's defaults (FP8 qkv with rstd after the sum), in what the lease has left.
  echo "== GPU tests: the engine"
  timeout "${BUDGET:-320}" python3 -m pytest -v -p no:cacheprovider -rf tests/test_cuda.py \
    tests/test_cuda_spec.py 2>&1 | tee "$OUT/gpu_tests_engine.log" \
    | grep -E "^E  |PASSED|FAILED|ERROR|passed|failed" | cut -c1-150 | tail -30
elif [ "$what" = x2 ]; then
  # Fifteenth session, call 1: the several-row FP8 GEMVs on the FP8 MMA with x in two e4m3
  # pieces (linear.FP8_ROWS_MMA = "x2") against the fp16 MMA: GPU tests, the engine's kernel
  # swept over tiles at each 8B shape (fp8_rows_lab.py "engine x2" / "engine f16"), the 5-row
  # chain; one row: rstd after the sum for FP8 qkv and the LM head (FP8_PLAIN_RSTD_LAST, the
  # default now) against the pass; then the 8B FP8 decode + verify with x2 if time is left.
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_linear.py \
    tests/test_ops_norm_linear.py -k "gpu or cuda or fp8_mma_pieces" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^E |FAIL|Error|passed|failed" | head
  summary+=("GPU tests, linear + norm linear: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== several-row FP8 lab: the engine's kernel, fp16 MMA or FP8 MMA with x in two pieces"
  timeout 200 python3 benchmarks/fp8_rows_lab.py --out "$OUT/fp8_rows_lab.json" \
    --variants "default,engine f16,engine x2" 2>&1 | grep -v Warning | tail -24
  echo "== GEMV chain lab, 16 layers, 5 rows"
  timeout 80 python3 benchmarks/pdl_lab.py --layers 16 --rows 5 --dtypes fp8 \
    --variants "f16 mma;x2 mma;no norms" --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning \
    | tail -4
  echo "== shape lab, FP8 one row: qkv and the LM head, rstd after the sum (default) or the pass"
  timeout 100 python3 benchmarks/shape_lab.py --dtypes fp8 --shapes qkv,head \
    --variants "default;default pass;lk n16 k1024;lk n32 k512 w8" --out "$OUT/shape_lab.json" \
    2>&1 | grep -v Warning | tail -9
  left=$((${BUDGET:-590} - 20 - SECONDS))
  echo "== decode, 8B shape, FP8, --fp8-rows x2 (${left} s left)"
  [ "$left" -gt 60 ] && timeout "$left" python3 benchmarks/decode.py --out "$OUT/decode.json" \
    --skip-peers --precisions fp8 --fp8-rows x2 2>&1 | tee "$OUT/decode.log" \
    | grep -v Warning | grep -E "^\[|verify|alike|ceiling|Error|fallback" | tail -12
elif [ "$what" = rstd2 ]; then
  # Fourteenth session, call 2 (call 1, `rstd`, is in git history at 8b93114): one row's norm
  # with rstd after the sum (linear.NORM_RSTD_LAST, the labs' word/variant "rstd") against the
  # prologue pass and no norm, each shape alone and in the 16-layer chains; the 8B decode with
  # whichever the FP8 chain found faster; then the several-row FP8 lab. As it ran (4fc8873) the
  # module default was rstd after the sum and the 5-row chains also timed FP8_F16_PREPASS
  # ("f16 step"; reverted since); the words below ask for each path explicitly.
  timeout 80 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_norm_linear.py \
    tests/test_ops_linear.py -k "gpu_llama3_qkv or gpu_fp16" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^E |FAIL|Error|passed|failed" | head
  summary+=("GPU tests, linear + norm linear: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== shape lab: rstd after the sum against the prologue pass and no norm"
  timeout 90 python3 benchmarks/shape_lab.py --dtypes fp8,bf16 --shapes qkv,gate_up \
    --variants "default rstd;default pass;default nonorm" --out "$OUT/shape_lab.json" 2>&1 \
    | grep -v Warning | tail -13
  echo "== GEMV chain lab, 16 layers, 1 and 5 rows"
  timeout 120 python3 benchmarks/pdl_lab.py --layers 16 --rows 1,5 --dtypes fp8,bf16 \
    --variants "rstd last;stream default;norm pass;no norms;off;f16 mma" \
    --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -14
  rstd=$(python3 -c "
import json; rows = json.load(open('$OUT/pdl_lab.json'))['rows']
ms = {r['variant']: r['ms'] for r in rows if r['dtype'] == 'fp8' and r['rows'] == 1}
print('--rstd-last' if ms['rstd last'] < ms['norm pass'] else '')" 2>/dev/null)
  echo "== decode, 8B shape ${rstd:-(the norm as a prologue pass)}"
  timeout $((${BUDGET:-590} - 30 - SECONDS)) python3 benchmarks/decode.py --out "$OUT/decode.json" \
    --skip-peers $rstd 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|verify|alike|ceiling|fp8 vs|\
Error|fallback" | tail -24
  left=$((${BUDGET:-590} - SECONDS))
  echo "== several-row FP8 lab (${left} s left)"
  [ "$left" -gt 30 ] && timeout "$left" python3 benchmarks/fp8_rows_lab.py \
    --out "$OUT/fp8_rows_lab.json" --shapes gate_up,down \
    --variants "default,f16 cvt,f16 cvt prepass,f16 bits asm,a8 ceiling,a8 x2" \
    2>&1 | grep -v Warning | tail -40
elif [ "$what" = sixteenth ]; then
  # For the next session's first call (written in the eleventh, not yet run; ~15 minutes): the
  # one-row chain with linear.ONE_ROW_UNROLL 2 and 4 (if FP8 gains, set it and re-run the
  # decode); the 5-row chain with its norms (now finite, so the equality column means
  # something) for the fp16 MMA; the 8B decode, both precisions, profiled; last, the engine's
  # GPU tests with PDL at one row by default (the eleventh's last call ran 3 of them in 210 s).
  echo "== GEMV chain lab, 16 layers, 1 row: _linear_kernel's K loop with 2 or 4 tiles in flight"
  timeout 90 python3 benchmarks/pdl_lab.py --layers 16 --rows 1 --dtypes fp8,bf16 \
    --variants "stream default;pdl, 1 tile;pdl unroll 2;pdl unroll 4" \
    --out "$OUT/pdl_lab_unroll.json" 2>&1 | grep -v Warning | tail -9
  echo "== GEMV chain lab, 16 layers, 5 rows with norms: FP8 on the bf16 or the fp16 MMA"
  timeout 80 python3 benchmarks/pdl_lab.py --layers 16 --rows 5 --dtypes fp8,bf16 \
    --variants "off;f16 mma" --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -5
  echo "== decode, 8B shape"
  timeout 360 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers --profile 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|verify|ceiling|fp8 vs|per token|parts|\
Error|fallback|kernels|^sum|^graph|^GEMV|^attention|^rope|^other|^iteration|^  [a-z_]" | tail -70
  echo "== GPU tests: the engine with PDL at one row by default (engine builds: minutes)"
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda.py tests/test_cuda_spec.py \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^E  |FAIL|Error|passed|failed" | head -30
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
elif [ "$what" = fifteenth ]; then
  # Eleventh session, the last few device minutes: PDL on by default at one row. The engine's
  # GPU tests (greedy against Hugging Face, speculative against target-only, the fused
  # attention), then the PDL chains and the rotary attention's GPU tests. ~4 minutes.
  echo "== GPU tests, PDL at one row by default"
  timeout 210 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda.py tests/test_pdl.py \
    tests/test_rotary_attention.py -k "gpu or cuda or greedy or speculative or engine or decode_gemv" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^E  |FAIL|Error|passed|failed" | head -30
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
elif [ "$what" = twelfth ]; then
  # For the next session's first call (written in the tenth, not yet run): the 8B decode and
  # verify steps after the swapped MMA kept its layout to the store (its 5-row chain: FP8 -6%),
  # with decode.py's new per-token line (generate against the target-only iteration graph);
  # before it, the fp16 MMA for FP8 weights at several rows (off by default: its GPU tests and
  # the 5-row chain; if it wins, turn it on and re-run the decode). ~8 minutes.
  echo "== GPU tests: the fp16 MMA for FP8 weights (linear.FP8_F16_MMA), the swapped MMA"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ops_linear.py \
    -k "gpu or cuda or fp16_mma or swapped" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^E |FAIL|Error|passed|failed" | head -20
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== GEMV chain lab, 16 layers, 5 rows: FP8 on the bf16 or the fp16 MMA"
  timeout 80 python3 benchmarks/pdl_lab.py --layers 16 --rows 5 --dtypes fp8 \
    --variants "off;f16 mma" --out "$OUT/pdl_lab.json" 2>&1 | grep -v Warning | tail -3
  echo "== decode, 8B shape"
  timeout 320 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning \
    | grep -E "^\[|verify|ceiling|fp8 vs|per token|Error|fallback" | tail -24
elif [ "$what" = decode ]; then
  echo "== decode benchmark"
  python3 benchmarks/decode.py --out "$OUT/decode.json" "$@" 2>&1 | tee "$OUT/decode.log" | grep -v Warning | tail -80
elif [ "$what" = session ]; then
  # One call for a short lease: GPU tests of the new kernels and step graphs, bf16 and fp8
  # decode at the 8B shape (no peers), and the bundled pair end to end.
  echo "== GPU tests"
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_ops_fp8.py tests/test_cuda_spec.py \
    tests/test_cuda.py -k "cuda or gpu or CUDA or GPU" 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== decode benchmark"
  timeout 330 python3 benchmarks/decode.py --out "$OUT/decode.json" --skip-peers --profile 2>&1 \
    | tee "$OUT/decode.log" | grep -v Warning | grep -E "^\[|^kernel|^GEMV|^GEMM|^attention|^rms|^rotary|^KV|^gated|^rope|^sum|^graph|^fp8 vs|^HBM|ceiling|fallback|Error" | tail -60
  echo "== speculative end to end (bundled pair)"
  timeout 240 python3 benchmarks/e2e.py --out "$OUT" --skip-8b --skip-buckets --gammas 1,2,4,6 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | tail -30
elif [ "$what" = final ]; then
  # One ~9-minute call: every step has its own timeout, and logs land in $OUT as they go.
  echo "== GPU tests: fused kernels, step graphs"
  timeout 110 python3 -m pytest -q -rf -p no:cacheprovider --durations=5 tests/test_rotary_cache.py \
    tests/test_ops_gated_linear.py tests/test_ops_linear.py tests/test_ops_fp8.py tests/test_cuda_spec.py \
    tests/test_generate_speculative.py -k "cuda or gpu or sm90 or syncs" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -v Warning | tail -25
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== decode, 8B shape, bf16 + fp8"
  decode_8b_profiled 290
  echo "== decode, 1B shape, bf16"
  decode_1b 75
  echo "== batch buckets"
  timeout 90 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-bundled --skip-8b 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | grep buckets | tail -6
elif [ "$what" = early ]; then
  echo "== fused norm/act + quant GPU tests (full failure output)"
  timeout 80 python3 -m pytest -q -rf -p no:cacheprovider tests/test_ops_fp8.py -k "fused_quant and gpu" \
    2>&1 | tee "$OUT/fused_quant.log" | grep -v Warning | grep -E "^E |Error|assert|passed|failed|mismatch" | head -40
  echo "== speculative end to end: 8B + 1B draft"
  timeout 320 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-bundled --skip-buckets 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | tail -14
  echo "== step-graph GPU tests"
  timeout 140 python3 -m pytest -q -rf -p no:cacheprovider --durations=8 tests/test_cuda_spec.py \
    tests/test_generate_speculative.py -k "cuda or gpu or syncs" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -v Warning | tail -20
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
elif [ "$what" = bundled ]; then
  echo "== fused norm/act + quant GPU tests"
  timeout 60 python3 -m pytest -q -rf -p no:cacheprovider tests/test_ops_fp8.py -k "fused_quant and gpu" \
    2>&1 | tee "$OUT/fused_quant.log" | grep -v Warning | grep -E "^E |passed|failed" | head -20
  summary+=("fused-quant GPU tests: $(tail -1 "$OUT/fused_quant.log")")
  echo "== speculative end to end: the bundled pair"
  timeout 500 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-8b --skip-buckets "$@" 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | tail -30
elif [ "$what" = late ]; then
  echo "== GPU tests"
  timeout 170 python3 -m pytest -v -rf -p no:cacheprovider --durations=6 tests/test_prefill_graphs.py \
    $(ls tests/test_step_kernels.py 2>/dev/null) tests/test_generate_speculative.py tests/test_cuda_spec.py \
    tests/test_ops_fp8.py -k "gpu or cuda or syncs" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning \
    | grep -E "PASS|FAIL|ERROR|^E |passed|failed|s call|s setup" | head -45
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== speculative end to end: the bundled pair"
  timeout 230 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-8b --skip-buckets 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | tail -16
  echo "== batch buckets"
  timeout 170 python3 benchmarks/e2e.py --out "$OUT/e2e_buckets" --skip-bundled --skip-8b 2>&1 \
    | tee "$OUT/e2e_buckets.log" | grep -v Warning | grep -E "buckets|Error" | tail -6
elif [ "$what" = spec ]; then
  echo "== step-graph GPU tests"
  timeout 170 python3 -m pytest -q -rf -p no:cacheprovider --durations=8 tests/test_cuda_spec.py \
    tests/test_generate_speculative.py -k "cuda or gpu or syncs" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -v Warning | tail -30
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== speculative end to end: 8B + 1B draft, buckets"
  timeout 400 python3 benchmarks/e2e.py --out "$OUT/e2e" --skip-bundled "$@" 2>&1 \
    | tee "$OUT/e2e.log" | grep -v Warning | tail -30
elif [ "$what" = files ]; then
  echo "== GPU tests"
  timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests -k "cuda or gpu or CUDA or GPU" \
    --ignore=tests/test_benchmarks.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning | tail -40
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
  echo "== engine files (8B + 1B draft)"
  timeout 370 python3 benchmarks/engine_files.py --out "$OUT/engine_files.json" 2>&1 \
    | tee "$OUT/engine_files.log" | grep -v Warning | tail -25
elif [ "$what" = fp8-accuracy ]; then
  echo "== FP8 accuracy (bundled pair)"
  timeout 540 python3 benchmarks/fp8_accuracy.py --device cuda --out "$OUT/fp8_accuracy.json" "$@" 2>&1 \
    | tee "$OUT/fp8_accuracy.log" | grep -v Warning | tail -90
elif [ "$what" = e2e ]; then
  echo "== speculative end to end"
  python3 benchmarks/e2e.py --out "$OUT" "$@" 2>&1 | tee "$OUT/e2e.log" | grep -v Warning | tail -60
  echo "== engine files"
  python3 benchmarks/engine_files.py --out "$OUT/engine_files.json" 2>&1 | tee "$OUT/engine_files.log" | grep -v Warning | tail -20
else
  echo "== attention sweep"
  python3 benchmarks/attention_sweep.py --out "$OUT/attention_sweep.json" 2>&1 | tee "$OUT/attention_sweep.log" | tail -6
  echo "== per-op table"
  python3 benchmarks/ops.py --out "$OUT/ops.json" 2>&1 | tee "$OUT/ops.log" | tail -40
  echo "== GEMV sweep"
  python3 benchmarks/linear_sweep.py --out "$OUT/linear_sweep.json" 2>&1 | tee "$OUT/linear_sweep.log" | tail -18
fi
for line in "${summary[@]}"; do echo "$line"; done
