#!/usr/bin/env bash
# The GPU benchmarks and tests, in named suites (benchmarks/README.md says what each measures):
#
#   bash benchmarks/gpu.sh SUITE [SUITE ...]
#
#   decode    8B shape, bf16 + FP8: fuser against the real gpt-fast, Hugging Face static cache +
#             torch.compile and Hugging Face eager (decode.py, gpt_fast_peer.py)      ~9 min
#   verify    8B shape, bf16 + FP8, fuser only: decode step, 5-token verify step replayed alike,
#             2048-token prefill (decode.py --skip-peers; PROFILE=1 adds the per-op breakdown)
#   spec      the bundled pair end to end: target-only, gammas 1,2,4,6, auto, HF peers (e2e.py)
#   fallback  the 8B shape with a never-agreeing 1B-shape draft, and batch buckets (e2e.py)
#   files     engine files: build, save and load of the 8B + 1B engine, then `fuser serve` of
#             it: launch -> /health (the median of SERVE_RUNS cold starts, default 2),
#             first-request TTFT, tokens (engine_files.py --serve; FILES_ARGS adds flags,
#             e.g. "--max-batch-size 4")
#   imports   fuser serve's launch up to its load, step by step, in fresh processes, and the
#             largest imports (serve_imports.py); -X importtime of the serve entry point  ~1 min
#   ops       per-op tables: bf16 ops (ops.py), FP8 GEMVs and prefill GEMMs (fp8_ops.py)
#   accuracy  FP8 against bf16 on the bundled pair, on the GPU (fp8_accuracy.py)
#   serve     the OpenAI-compatible server under load (serve.py --preset llama-3-8b;
#             SERVE_ARGS replaces that)
#   serve256  issue 45, the 8B shape, bf16, 256 rows, 128/128 prompts, c 1,16,64,128,256:
#             TPOT at c1, % of static batches, ITL p99/p50 at c64, tok/s at c256  ~8 min
#   serve256fp8  the same with --precision fp8
#   build256  where a 256-row build's time goes: the 8B shape, bf16, buckets 1..256, per bucket
#             and phase (build_profile.py), with empty Inductor/Triton caches         ~6 min
#   build256base  the same build as it ran before run_passes deferred its recompiles and the
#             build started Inductor's compile workers early (--baseline): the A/B
#   servepaged   the 8B shape, 256 rows, --max-seq-len 8192 on the paged cache (PAGED_ARGS):
#             the shared 1,024-token prefix with and without --no-prefix-caching (c 1, 16),
#             then prompts of 64..2,048 tokens at c256 (serve.py --cases shared-prefix,mixed)
#   serverate the bundled pair, 256 rows: the highest Poisson request rate held with TTFT
#             p99 <= 1 s and 0 errors, 32-token prompts, 32 new tokens (--cases rate)
#   servelong a 131,072-token request on the Llama-3.1-8B shape beside 16 streams of short
#             requests (PAGED_ARGS; --cases long-context)
#   adapt     adaptive speculation on and off over the same requests, the bundled pair: a
#             2,000-request shifted-domain stream with Python before and after, and a
#             repetitive stream (adapt.py; ADAPT_ARGS adds flags)                      ~6 min
#   adapt8b   the same, the 8B shape with a random 1B-shape draft (adapt.py --workloads 8b)
#   distill   one online draft update's learning curve on the bundled pair, and its seconds:
#             updates of 2-20 steps, then updates as served, every 200 requests
#             (distill_curve.py)
#   paged     paged against contiguous decode/verify attention at the 8B shape
#             (paged_attention.py; fails above 1.05x), the paged kernels', engine's and
#             scheduler's GPU tests
#   flashprefill  the prefill's flash attention with the key range split over programs
#             against unsplit, 8B shape, bf16: a prefix hit's 128-token chunk over 1,152 keys,
#             512 over 2,048 (paged), 2,048- and 1,024-token prefills (flash_prefill.py), the
#             kernel's GPU tests                                                        ~2 min
#   prefix    prefix caching through the scheduler, 8B shape, bf16: TTFT p50 of requests
#             sharing a 1,024-token opening with the cache and without (prefix_cache.py;
#             fails above 0.25x), and whether their tokens agree (PREFIX_ARGS adds flags,
#             e.g. "--profile DIR": one request more under torch.profiler)
#   allreduce NCCL against the one-shot peer-to-peer all-reduce in a CUDA graph, 8 KiB to
#             8 MiB (all_reduce.py; 2+ GPUs: nvidia-h200-x2), and the 2-GPU collective tests
#   tp        tensor parallel over 2 GPUs (a 2-GPU kind): its GPU tests (NCCL), then decode at
#             the 8B shape, tp=1 against tp=2 (tensor_parallel.py; TP_SIZES, default 1,2;
#             TP_ONE_SHOT=1 adds the one-shot all-reduce rows)
#   tests     the GPU tests: pytest -k "gpu or cuda" over TESTS (default: tests), JOBS workers
#   suffix    the suffix index's C core (runtime/suffix_native.c) on this machine's host: its
#             tests, compiled with this host's C compiler (a native case skipped fails the suite),
#             then the host time of a step for 64 rows (suffix_index.py --min-match 4)  ~1 min
#
# BYTECODE=1: before the suites, compile the cached bytecode of the installed packages that `fuser
# serve` imports where the install left none (as pip does at install time: fuser/bytecode.py
# says why a cold start without it pays seconds); it prints what it compiled.
#
# Each suite writes its full logs and JSON under $OUT/<suite>/ and ends with a short table; the
# tables of every suite come again at the end. Environment: OUT (default /tmp/fuser-out),
# BUDGET (seconds for the whole command, default 580: one device call is 600 s), PAGED_ARGS
# (serve.py flags that page the KV cache; default --config kv_block_size=16 --config
# kv_memory_fraction=0.9), INSTALL=0 to skip `pip install -e .`, WHEELS=0 to leave the wheels
# in .whl/ uninstalled (`bash benchmarks/gpu_wheels.sh` downloads them here: the server's and
# the openai client's, which the GPU machine lacks; carry .whl). The real gpt-fast runs from a
# checkout in the git-ignored benchmarks/.gpt-fast (carry it to the GPU machine); without one
# its row says so.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuser-out}
BUDGET=${BUDGET:-580}
SUITES="decode verify spec fallback files imports ops accuracy serve serve256 serve256fp8 build256 build256base servepaged serverate servelong adapt adapt8b distill paged flashprefill prefix allreduce tp suffix tests"
PAGED_ARGS=${PAGED_ARGS---config kv_block_size=16 --config kv_memory_fraction=0.9}
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,/^set -o/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
for suite in "$@"; do
  case " $SUITES " in *" $suite "*) ;; *) echo "gpu.sh: unknown suite '$suite' (one of: $SUITES)" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
# Wheels carried in .whl/ (benchmarks/gpu_wheels.sh downloads them where pip works): installed
# into a directory of their own, first on PYTHONPATH for the suites; again only when .whl/
# changed (a warm machine keeps them, and their compiled bytecode).
if [ "${WHEELS:-1}" != 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
  SITE=${WHEEL_SITE:-/tmp/fuser-wheels}
  listing=$(ls .whl)
  if [ "$(cat "$SITE/.wheels" 2>/dev/null)" != "$listing" ]; then
    if installed=$(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .whl/*.whl 2>&1); then
      echo "$listing" > "$SITE/.wheels"
    else
      echo "gpu.sh: the wheels in .whl/ did not install: $(echo "$installed" | tail -n 1)" >&2
      exit 2
    fi
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "wheels: $(echo "$listing" | wc -l) from .whl/ on PYTHONPATH ($SITE)"
fi
if [ "${INSTALL:-1}" != 0 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
fi
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" \
  | tee "$OUT/versions.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/versions.txt"
if [ "${BYTECODE:-0}" = 1 ]; then
  # The directories come from a process that imported what `fuser serve` imports; compileall
  # runs in a process of its own (its worker pool cannot start from a script read on stdin
  # once torch's imports have chosen another start method for subprocesses).
  found=$(python3 - <<'PY'
import torch, torch._inductor.codecache, torch._inductor.standalone_compile  # noqa: F401
import transformers, fuser.server.cli, fuser.engine  # noqa: F401
from fuser.bytecode import uncached_modules
found = uncached_modules()
print(f"{found.total} imported modules had none ({dict(sorted(found.counts.items(), key=lambda kv: -kv[1])[:6])})")
for dirs in found.directories.values():
    print("\n".join(dirs))
PY
)
  start_s=$SECONDS
  # shellcheck disable=SC2046  # the directories, one a line
  python3 -m compileall -q -j 0 $(echo "$found" | tail -n +2) > /dev/null 2>&1
  rc=$?
  echo "bytecode: $(echo "$found" | head -n 1); compiled their directories in $((SECONDS - start_s)) s (exit status $rc)" \
    | tee -a "$OUT/versions.txt"
fi
TABLES=()

# step NAME SECONDS CMD...: run CMD with its output in $DIR/NAME.log, for at most SECONDS and
# never past the BUDGET; prints the log's warnings-free tail as it goes.
step() {
  local name=$1 limit=$2 left=$((BUDGET - SECONDS))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "== $name: skipped (${left} s of the budget left)" | tee "$DIR/$name.log"
    return 124
  fi
  echo "== $name (at most ${limit} s): $*"
  # At its limit the step's processes get SIGABRT (SIGKILL 15 s later): with
  # PYTHONFAULTHANDLER each Python process of the group prints every thread's stack into the
  # log first, so a cut run says where it was. (No core files.)
  ( ulimit -c 0; PYTHONFAULTHANDLER=1 timeout -s ABRT -k 15 "$limit" "$@" ) \
    > "$DIR/$name.log" 2>&1
  local rc=$?
  [ "$rc" = 124 ] && echo "(stopped by its ${limit} s limit; the stacks it was in are above)" \
    >> "$DIR/$name.log"
  grep -v -i warn "$DIR/$name.log" | tail -n 3
  return "$rc"
}

# table TITLE LINES...: one suite's short table, printed now and again at the end.
table() {
  local text
  text=$(printf '%s\n' "--- $1" "${@:2}")
  echo "$text"
  TABLES+=("$text")
}

for suite in "$@"; do
  DIR="$OUT/$suite"
  mkdir -p "$DIR"
  echo "==== $suite"
  case $suite in
    decode)
      # The real gpt-fast replaces the gpt-fast-style peer where its checkout is here.
      real=; [ -f benchmarks/.gpt-fast/model.py ] && real=1
      step decode 560 python3 benchmarks/decode.py ${real:+--skip-gpt-fast} --out "$DIR/decode.json"
      gpt="gpt-fast: no checkout in benchmarks/.gpt-fast (not run)"
      if [ -n "$real" ]; then
        step gpt_fast 220 python3 benchmarks/gpt_fast_peer.py --out "$DIR/gpt_fast.json"
        gpt=$(grep -E '^gpt-fast' "$DIR/gpt_fast.log" | tail -1)
      fi
      table "decode: 8B shape, batch 1, 128-token prompt, 256 new tokens" \
        "$(sed -n '/^system /,$p' "$DIR/decode.log")" "${gpt:-gpt-fast: see $DIR/gpt_fast.log}" ;;
    verify)
      step verify 560 python3 benchmarks/decode.py --skip-peers ${PROFILE:+--profile} \
        --out "$DIR/decode.json"
      table "verify: 8B shape, fuser only" \
        "$(grep -E '^\[(bf16|fp8)\] [0-9.]+ tok/s =|^steps replayed alike|^fp8 vs bf16' "$DIR/verify.log")" ;;
    spec)
      step e2e_pair 560 python3 benchmarks/e2e.py --out "$DIR" --skip-8b --skip-buckets --gammas 1,2,4,6
      table "spec: the bundled pair, 4 held-out prompts x 128 tokens, 128 new tokens" \
        "$(sed -n '/^part /,$p' "$DIR/e2e_pair.log")" ;;
    fallback)
      step e2e_8b 560 python3 benchmarks/e2e.py --out "$DIR" --skip-bundled
      table "fallback: 8B shape with a never-agreeing 1B-shape draft; batch buckets" \
        "$(grep -E '^\[(8b|buckets)\]|^8B-shape iteration' "$DIR/e2e_8b.log")" ;;
    files)
      # The engine directory (17 GiB) goes under $OUT: fuser serve reads it in a new process.
      # The loading process and the server start with empty kernel caches of their own: every
      # kernel binary must come from the engine directory.
      # FILES_ARGS adds flags (--max-batch-size 4: batch buckets 1, 2, 4, the last two captured
      # in the background after the load returns).
      step engine_files 560 python3 benchmarks/engine_files.py --gamma auto --runs 2 --serve \
        --serve-runs "${SERVE_RUNS:-2}" --engine-dir "$DIR/engine" \
        --out "$DIR/engine_files.json" ${FILES_ARGS:-}
      rm -rf "$DIR/engine"
      table "files: 8B + 1B-draft engine directory, load and fuser serve" \
        "$(grep -v -i warn "$DIR/engine_files.log" | grep -v '^\[engine_files\]' | tail -n 40)" ;;
    imports)
      step serve_imports 240 python3 benchmarks/serve_imports.py --runs 3 \
        --out "$DIR/serve_imports.json"
      step importtime 60 bash -c 'python3 -X importtime -c "import fuser.server.cli" 2>&1 | tail -1'
      table "imports: fuser serve before its load (median of 3 fresh processes)" \
        "$(grep -v -i warn "$DIR/serve_imports.log")" \
        "-X importtime, import fuser.server.cli (us): $(tail -n 1 "$DIR/importtime.log")" ;;
    ops)
      step ops 300 python3 benchmarks/ops.py --out "$DIR/ops.json"
      step fp8_ops 240 python3 benchmarks/fp8_ops.py --out "$DIR/fp8_ops.json"
      table "ops: per call, CUDA-graph replay (full tables in the logs)" \
        "$(grep -E 'cases|failed' "$DIR/ops.log" "$DIR/fp8_ops.log" | tail -n 4)" ;;
    accuracy)
      step fp8_accuracy 560 python3 benchmarks/fp8_accuracy.py --device cuda --prompts 128 \
        --out "$DIR/fp8_accuracy.json"
      table "accuracy: FP8 against bf16, the bundled pair" \
        "$(grep -E 'perplexity|acceptance' "$DIR/fp8_accuracy.log" | tail -n 8)" ;;
    serve)
      if [ -f benchmarks/serve.py ]; then
        # SERVE_ARGS (default: the 8B shape) is word-split on purpose; SERVE_ARGS= for the
        # script's own defaults.
        # shellcheck disable=SC2086
        step serve 560 python3 benchmarks/serve.py --out "$DIR" --json "$DIR/serve.json" \
          ${SERVE_ARGS---preset llama-3-8b}
        table "serve: benchmarks/serve.py" "$(grep -v -i warn "$DIR/serve.log" | tail -n 15)"
      else
        table "serve" "benchmarks/serve.py is missing: nothing to run"
      fi ;;
    serve256|serve256fp8)
      precision=bf16; [ "$suite" = serve256fp8 ] && precision=fp8
      step "$suite" 560 python3 benchmarks/serve.py --preset llama-3-8b --precision "$precision" \
        --max-batch-size 256 --max-seq-len 512 --concurrency 1,16,64,128,256 --prompt-len 128 \
        --output-len 128 --runs 1 --no-hf --out "$DIR"
      table "$suite: 8B shape, $precision, 256 rows, 128/128 (issue 45's bars)" \
        "$(grep -E '(PASS|FAIL)$|^errors|^build' "$DIR/$suite.log")" \
        "$(sed -n '/^system /,$p' "$DIR/$suite.log")" ;;
    build256|build256base)
      cache="$DIR/cache"  # empty caches: a build on a bare machine
      flag=; [ "$suite" = build256base ] && flag=--baseline
      TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton" \
        step "$suite" 560 python3 benchmarks/build_profile.py --preset llama-3-8b \
        --device cuda --dtype bfloat16 --max-batch-size 256 --max-seq-len 512 \
        --compile inductor $flag --json "$DIR/$suite.json"
      rm -rf "$cache"
      table "$suite: 8B shape, bf16, buckets 1..256, empty kernel caches (seconds per phase)" \
        "$(grep -E '^(inductor|warm_up|prepare|totals:|cpu totals:|build) ' "$DIR/$suite.log")" ;;
    servepaged|servelong)
      if [ "$suite" = servepaged ]; then
        what="8B shape, 256 rows, max_seq_len 8192, paged: shared prefix, mixed lengths"
        flags="--preset llama-3-8b --max-batch-size 256 --max-seq-len 8192 --output-len 128"
        flags="$flags --cases shared-prefix,mixed --concurrency 256 --prefix-concurrency 1,16"
      else
        what="Llama-3.1-8B shape, paged: one 131,072-token request beside 16 short streams"
        flags="--preset llama-3.1-8b --max-batch-size 32 --cases long-context"
        flags="$flags --long-len 131072 --long-clients 16 --prompt-len 128 --output-len 256"
      fi
      # shellcheck disable=SC2086  # flags and PAGED_ARGS: word-split on purpose
      step "$suite" 560 python3 benchmarks/serve.py $flags $PAGED_ARGS --json "$DIR/serve.json"
      table "$suite: $what" "$(grep -v -i warn "$DIR/$suite.log" | tail -n 30)" ;;
    serverate)
      step serverate 560 python3 benchmarks/serve.py --draft --max-batch-size 256 --cases rate \
        --json "$DIR/serve.json"
      table "serverate: the bundled pair, Poisson arrivals, 32/32 non-streamed" \
        "$(sed -n '/^request rate: highest held/,$p' "$DIR/serverate.log")" \
        "$(grep -E '(PASS|FAIL)$' "$DIR/serverate.log")" ;;
    adapt|adapt8b)
      workloads=shifted,repetitive; [ "$suite" = adapt8b ] && workloads=8b
      # shellcheck disable=SC2086  # ADAPT_ARGS: flags, word-split on purpose
      step "$suite" 560 python3 benchmarks/adapt.py --workloads "$workloads" --out "$DIR" \
        ${ADAPT_ARGS-}
      table "$suite: benchmarks/adapt.py --workloads $workloads (on / off; criteria of issue 44)" \
        "$(grep -E '^(python_|stream:)' "$DIR/$suite.log" | sort -u)" \
        "$(grep -E '^ +on [a-z_]+: .*steps ' "$DIR/$suite.log")" \
        "$(grep -E '^ +(on|off) measured ' "$DIR/$suite.log" | head -n 16)" \
        "$(grep -E '^ +((on|off) host profile: |host profile, on - off: )' "$DIR/$suite.log")" \
        "$(grep -E '^ +(on|off) trace, ' "$DIR/$suite.log")" \
        "$(sed -n '/^--- criteria/,$p' "$DIR/$suite.log" | grep -E '^ *(PASS|FAIL|n/a) ')" ;;
    distill)
      step distill_curve 280 python3 benchmarks/distill_curve.py --requests 800,200 \
        --steps 2,5,10,20 --cache "$DIR/records.pt" --out "$DIR/curve.json"
      step distill_served 200 python3 benchmarks/distill_curve.py --requests 800 --every 200 \
        --cache "$DIR/records.pt" --out "$DIR/served.json"
      table "distill: one draft update's learning curve, the bundled pair (distill_curve.py)" \
        "$(grep -E '^(one step|requests|  +[0-9]+ )' "$DIR/distill_curve.log")" \
        "$(grep -E '^ +[0-9]+ ' "$DIR/distill_served.log")" ;;
    paged)
      step paged_tests 300 python3 -m pytest -q -p no:cacheprovider -rf tests/test_paged_attention.py \
        tests/test_paged_engine.py tests/test_paged_scheduler.py -k "gpu"
      step paged_attention 270 python3 benchmarks/paged_attention.py --out "$DIR/paged_attention.json"
      table "paged: paged / contiguous attention, 8B shape, bf16, 16-slot blocks (scattered)" \
        "$(grep -E '^(FAILED|ERROR)|passed|failed' "$DIR/paged_tests.log" | tail -n 4)" \
        "$(grep -v -i warn "$DIR/paged_attention.log" | tail -n 14)" ;;
    flashprefill)
      step flashprefill_tests 150 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/test_ops_attention.py tests/test_paged_attention.py -k "gpu_flash_prefill"
      step flash_prefill 420 python3 benchmarks/flash_prefill.py --out "$DIR/flash_prefill.json"
      table "flashprefill: split / unsplit flash prefill attention, 8B shape, bf16 (us per call)" \
        "$(grep -E '^(FAILED|ERROR)|passed|failed' "$DIR/flashprefill_tests.log" | tail -n 4)" \
        "$(grep -v -i warn "$DIR/flash_prefill.log" | grep -E '^\||rows' | tail -n 44)" ;;
    prefix)
      # shellcheck disable=SC2086  # PREFIX_ARGS: flags, word-split on purpose
      step prefix 560 python3 benchmarks/prefix_cache.py --out "$DIR/prefix.json" ${PREFIX_ARGS-}
      table "prefix: TTFT with and without the prefix cache, 8B shape, bf16" \
        "$(grep -v -i warn "$DIR/prefix.log" | tail -n 5)" ;;
    allreduce)
      step allreduce_tests 300 python3 -m pytest -q -p no:cacheprovider -rfs \
        tests/test_p2p_all_reduce.py -k "cuda"
      step all_reduce 240 python3 benchmarks/all_reduce.py --out "$DIR/all_reduce.json"
      table "allreduce: NCCL against one-shot P2P, bf16, in a CUDA graph (us per all-reduce)" \
        "$(grep -E '^(FAILED|ERROR|SKIPPED)|passed|failed' "$DIR/allreduce_tests.log" | tail -n 4)" \
        "$(grep -v -i warn "$DIR/all_reduce.log" | tail -n 8)" ;;
    tp)
      # NVLink multicast off (NVLS, multicast symmetric memory): the engine sets these for its
      # ranks too.
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
      step tp_tests 240 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/test_tensor_parallel.py tests/test_tensor_parallel_cuda.py -k "gpu or cuda"
      step tp_decode 330 python3 benchmarks/tensor_parallel.py --sizes "${TP_SIZES:-1,2}" \
        ${TP_ONE_SHOT:+--one-shot} --out "$DIR/tp.json"
      table "tp: tensor parallel, NCCL; decode at the 8B shape, batch 1, bf16" \
        "$(grep -E '^(FAILED|ERROR)|passed|failed' "$DIR/tp_tests.log" | tail -n 6)" \
        "$(sed -n '/^system /,$p' "$DIR/tp_decode.log")"
      if [ -n "${TP70_SIZES:-}" ]; then  # the 70B shape: random weights made per rank
        step tp70_decode 590 python3 benchmarks/tensor_parallel.py --preset llama-3-70b \
          --sizes "$TP70_SIZES" --out "$DIR/tp70.json"
        table "tp: the 70B shape (random weights per rank), batch 1, bf16" \
          "$(sed -n '/^system /,$p' "$DIR/tp70_decode.log")"
      fi ;;
    suffix)
      export FUSER_CACHE_DIR=${FUSER_CACHE_DIR:-$DIR/cache}
      step suffix_tests 120 python3 -m pytest -q -p no:cacheprovider -rs \
        tests/test_suffix_native.py tests/test_suffix.py tests/test_suffix_batched.py
      if grep -q "^SKIPPED" "$DIR/suffix_tests.log"; then  # (none skips where the C builds)
        echo "FAILED: native cases skipped (the C core did not build here)" >> "$DIR/suffix_tests.log"
      fi
      for case in "" "--follow" "--tokens 7 --vary"; do
        # shellcheck disable=SC2086  # case: flags, word-split on purpose
        python3 benchmarks/suffix_index.py --rows 64 --min-match 4 $case 2>&1 | tail -n 1 \
          >> "$DIR/suffix_index.log"
      done
      table "suffix: the suffix index's C core on this host (tests; 64 rows, --min-match 4: none, --follow, --tokens 7 --vary)" \
        "$(grep -E '^FAILED|passed|failed' "$DIR/suffix_tests.log" | tail -n 4)" \
        "$(cat "$DIR/suffix_index.log")" ;;
    tests)
      # shellcheck disable=SC2086  # TESTS: paths, word-split on purpose
      # JOBS pytest-xdist workers share the one GPU (default 8 of the machine's 16 cores: the
      # tests are compile-bound; no GPU test times anything).
      step gpu_tests 560 python3 -m pytest -q -p no:cacheprovider -rf ${TESTS:-tests} \
        -n "${JOBS:-8}" --dist loadgroup \
        -k "gpu or cuda or GPU or CUDA" --ignore=tests/test_benchmarks.py
      table "tests: GPU tests (${TESTS:-tests})" \
        "$(grep -E '^(FAILED|ERROR)|passed|failed' "$DIR/gpu_tests.log" | tail -n 12)" ;;
  esac
done

echo
echo "==== summary ($(head -1 "$OUT/versions.txt"); logs under $OUT)"
for text in "${TABLES[@]}"; do echo "$text"; done
