"""The GPU benchmarks' plumbing on CPU: dry runs of ops.py and fp8_ops.py, timing.py's
rotation arithmetic, the peers and the breakdown's grouping (the CUDA-graph timing itself needs
a GPU: benchmarks/gpu.sh)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINEAR_OP = importlib.util.find_spec("fuser.ops.linear") is not None


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(script: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"benchmarks/{script}", "--dry-run", "--out", str(out),
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_ops_benchmark_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    proc = run("ops.py", out)
    rows = json.loads(out.read_text())["rows"]
    linear = [r for r in rows if r["op"] == "linear"]
    assert len(linear) == 15  # five shapes x T = 1, 5, 9
    if LINEAR_OP:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert not [r for r in rows if r["errors"] or r["flagged"]]
    else:  # the op is missing: its rows fail at setup, the rest still runs clean
        assert all("not registered" in r["errors"].get("setup", "") for r in linear)
        assert not [r for r in rows if r["op"] not in ("linear", "gated_linear")
                    and (r["errors"] or r["flagged"])]
    # weights and caches come in copies (2 in the dry run), small ops' inputs do not
    assert {r["op"] for r in rows if r["copies"] > 1} == {
        "attention", "qkv_proj", "gate_up_proj", "o_proj", "down_proj", "lm_head", "linear",
        "gated_linear"}
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run on CPU")


def test_timing_rotation() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import timing
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert timing.copies_for(4_259_840) == 47     # K+V at ctx 1024: 2 * 1040 * 8 * 128 * 2 B
    assert timing.copies_for(33_554_432) == 6     # o_proj weight
    assert timing.copies_for(1_050_673_152) == 1  # lm_head weight
    fns, seq = timing._sequence([len, abs, id], 20)
    assert len(seq) == 21 and seq[:4] == [len, abs, id, len]  # every copy equally often
    assert len(timing._sequence([len] * 47, 20)[1]) == 47   # at least one call per copy
    assert len(timing._sequence(len, 20)[1]) == 20


def test_peers_generate_hugging_face_greedy_tokens() -> None:
    # The peers decode.py times must produce the tokens they claim to (on CPU: no compilation,
    # Hugging Face skips its auto-compile there and gpt-fast style runs its step eagerly).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import torch

        from peers import make_gpt_fast_style, make_hf_eager, make_hf_static_compile
        from tiny import tiny_model
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    model = tiny_model("llama", layers=2)
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    want = make_hf_eager(model, prompt, 10)()
    assert want.shape == (1, 10)
    assert torch.equal(make_hf_static_compile(model, prompt, 10)(), want)
    gpt_fast = make_gpt_fast_style(model, prompt, 10, compile=False)
    assert torch.equal(gpt_fast(), want) and torch.equal(gpt_fast(), want)  # reusable


def test_breakdown_groups_kernels_by_name() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from breakdown import group_of
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert group_of("_linear_kernel") == group_of("_stream_kernel") == "GEMV: fuser::linear"
    assert group_of("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT") == "GEMM (cuBLAS / CUTLASS)"
    assert group_of("_split_kernel") == group_of("_combine_kernel") == "attention: fuser split-K"
    # e4m3_pieces' kernels are not attention's (both once shared the name _split_kernel)
    assert group_of("_split_pieces_kernel") == group_of("_norm_pieces_kernel") == \
        "e4m3 pieces (norm, row split)"
    assert group_of("_rotary_split_kernel") == "attention: fuser split-K"  # rotary folded in
    assert group_of("triton_poi_fused_add_arange_index_put_permute_unsqueeze_3") == "KV cache write"
    assert group_of("_rms_norm_kernel") == "rms_norm / add_rms_norm"
    assert group_of("_rotary_kernel") == "rotary (+ KV cache write)"  # either rotary op
    assert group_of("triton_poi_fused__to_copy_bmm_cat_cos_mul_permute_rotary_sin_slice_view_5") \
        == "rope cos/sin (Inductor)"


def test_fp8_ops_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "fp8_ops.json"
    proc = run("fp8_ops.py", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    decode, prefill = result["decode"], result["prefill"]
    assert len(decode) == 9 and len(prefill) == 3  # three tiny shapes x M = 1, 5, 9; M = 24
    assert all(r["failed"] == 0 and r["flagged"] == 0 for r in decode + prefill)
    # the FP8 GEMV kernel and each swept config ran and were checked against the reference
    assert all(r["fp8"]["rel_err"] is not None and r["sweep"] for r in decode)
    assert all(c["rel_err"] is not None for r in decode for c in r["sweep"])
    assert {r["producer"] for r in prefill} == {"rms_norm", "gated_act"}
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run on CPU")


@pytest.mark.skipif(torch_cuda_available(), reason="the message is for machines without CUDA")
def test_decode_says_it_needs_a_gpu() -> None:
    """benchmarks/decode.py on a machine without CUDA: one line naming the problem, no
    traceback."""
    proc = subprocess.run([sys.executable, "benchmarks/decode.py", "--layers", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr

def _benchmark_module(name: str):
    """benchmarks/<name>.py, imported as the benchmarks import each other (their folder on the
    path)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _adapt_module():
    return _benchmark_module("adapt")


def test_adapt_benchmark_streams_and_windows(tmp_path: Path) -> None:
    """benchmarks/adapt.py's prompts: the shifted stream takes the kinds in turn, in sorted
    order, and its last window only files never sent before; the repetitive prompts hold the
    text their answer repeats; windows count tokens and per-source steps between completions."""
    adapt = _adapt_module()
    files: dict[str, list[Path]] = {}
    for kind in adapt.KINDS:
        files[kind] = []
        for i in range(3):
            path = tmp_path / f"{kind}{i}.{kind}"
            path.write_text(" ".join(f"{kind}{i}w{j}" for j in range(400)))
            files[kind].append(path)
    prompts, origins = adapt.shifted_prompts(20, 6, files)
    assert (prompts, origins) == adapt.shifted_prompts(20, 6, files)  # deterministic
    assert len(prompts) == len(set(prompts)) == 20
    assert all(len(p) == adapt.CHARS for p in prompts)
    assert not set(origins[-6:]) & set(origins[:-6])  # the last window: new files only
    assert [Path(o).suffix for o in origins[:5]] == [".h"] * 4 + [".js"]  # whole files in turn
    with pytest.raises(SystemExit, match="only"):
        adapt.shifted_prompts(100, 6, files)
    for prompt in adapt.repetitive_prompts(3):
        function, rest = prompt.split("\n\n\n# Rewrite this function with a docstring.\n")
        assert rest == function.splitlines()[0] + "\n" and function.startswith("def ")
    records = [{"index": i, "time": 1.0 + i, "tokens": 10,
                "tally": {"draft": [2 * (i + 1), i + 1, 4 * (i + 1)]},
                "updates": {"accepted": 0, "rejected": 0}} for i in range(4)]
    w = adapt.windows(records, 2)
    assert [x["requests"] for x in w] == [2, 4]
    assert w[0]["tok_s"] == 20 / 2.0 and w[1]["tok_s"] == 20 / 2.0
    assert w[1]["sources"]["draft"] == {"steps": 4, "accepted": 2, "proposed": 8,
                                        "acceptance": 0.25}


@pytest.mark.slow  # builds two tiny engines and serves each workload on and off (~90 s)
def test_adapt_benchmark_dry_run(tmp_path: Path) -> None:
    proc = run("adapt.py", tmp_path, "--profile-host", "4", "--trace", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "adapt.json").read_text())
    assert set(result["workloads"]) == {"shifted", "repetitive", "8b"}
    shifted = result["workloads"]["shifted"]
    assert shifted["last_window_files_new"]
    assert len(shifted["on"]["windows"]) == len(shifted["off"]["windows"]) == 3
    arms = next(iter(shifted["on"]["measured"].values()))  # the controller's costs, taken apart
    assert sum(m["steps"] for m in arms.values()) > 0
    assert all(m["seconds"] >= 0 and m["tokens"] >= 1 for m in arms.values())
    assert len(result["criteria"]) == 7
    for mode in ("off", "on"):  # each mode's loop profiled over 4 requests of its own
        profile = shifted["host_profile"][mode]
        assert profile["steps"] > 0 and profile["host_us"] > 0 and len(profile["top"]) == 12
        assert f"{mode:>3} host profile: 4 requests, {profile['steps']} steps" in proc.stdout
        assert 12 <= len(profile["own"]) <= 60
        # and under torch.profiler over 2 requests: the timeline, the tables, the gaps' line
        assert (tmp_path / f"trace_shifted_{mode}.trace.json").is_file()
        assert (tmp_path / f"trace_repetitive_{mode}.txt").is_file()
        assert shifted["trace"][mode]["gaps"] == 0  # (CPU: no device events)
        assert f"{mode:>3} trace, 2 requests: trace_shifted_{mode}: device busy" in proc.stdout
    assert "host profile, on - off: own time" in proc.stdout
    assert (tmp_path / "adapt.png").is_file()
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("dry run on CPU")
    assert sum(line.lstrip().startswith(("PASS", "FAIL", "n/a")) for line in lines) == 7


def test_flash_prefill_benchmark_dry_run(tmp_path: Path) -> None:
    """benchmarks/flash_prefill.py's plumbing: the four cases, splits 1, 2, 4 and the default
    with either mask_all, each checked against the reference (interpreted, fp32)."""
    out = tmp_path / "flash_prefill.json"
    proc = run("flash_prefill.py", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cases = {"hit128", "chunk512", "prefill", "prefill1k"}
    assert {r["case"] for r in rows} == cases
    assert all(r["rel_err"] < 1e-5 for r in rows)
    for case in cases:
        splits = {r["splits"] for r in rows if r["case"] == case}
        assert {1, 2, 4} <= splits and sum(r["default"] for r in rows if r["case"] == case) == 2
    assert proc.stdout.strip().splitlines()[-1].endswith("0 flagged (rel err > 0.02)")


def test_all_reduce_dry_run(tmp_path: Path) -> None:
    """benchmarks/all_reduce.py's plumbing: 2 gloo processes, one row per size."""
    out = tmp_path / "all_reduce.json"
    proc = run("all_reduce.py", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and [r["bytes"] for r in result["rows"]] == [8192, 32768]
    assert "one-shot: not available" in proc.stdout  # gloo: NCCL's path only


@pytest.mark.slow  # builds a paged engine of the tiny random Llama (~60 s on a 2-core CPU)
def test_prefix_cache_benchmark_dry_run(tmp_path: Path) -> None:
    proc = run("prefix_cache.py", tmp_path / "prefix.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "prefix.json").read_text())
    assert result["same_tokens"] == 4 and result["results"]["off"]["prefix_hits"] == 0
    # the warm-up's second request of the opening, then 4 + 4 timed ones: 48 cached tokens each
    assert result["results"]["on"]["prefix_hits"] == (1 + 4 + 4) * 48
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run on CPU")


def test_build_profile_times_each_bucket(tmp_path: Path) -> None:
    out = tmp_path / "build.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/build_profile.py", "--layers", "1", "--heads", "2",
         "--kv-heads", "1", "--head-dim", "8", "--intermediate", "24", "--vocab", "64",
         "--buckets", "1,2", "--max-batch-size", "2", "--max-seq-len", "16", "--compile", "fx",
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    passes = {r["rows"] for r in rows if r["phase"] == "passes" and r["graph"] == "target.decode1"}
    assert passes == {"1", "2"}  # the decode step rewritten once per bucket
    assert {r["rows"] for r in rows if r["phase"] == "warm_up"} == {"1", "2"}
    assert "fallbacks: none" in proc.stdout


def test_serve_imports_times_the_launch_before_the_load(tmp_path: Path) -> None:
    """benchmarks/serve_imports.py on CPU: every phase of `fuser serve`'s launch up to the load
    timed in a fresh process, the largest imports listed, and no compiler module imported
    before the load (sympy, Dynamo, Inductor, transformers)."""
    out = tmp_path / "serve_imports.json"
    proc = subprocess.run([sys.executable, "benchmarks/serve_imports.py", "--runs", "1", "--top",
                           "5", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["phases"]) == [
        "interpreter start", "import fuser.cli", "parser, threads",
        "fastapi, uvicorn, prometheus_client", "app, runner imports",
        "bind, app, HTTP server start", "open_engine's imports"]
    assert all(seconds >= 0 for seconds in result["phases"].values())
    assert len(result["imports"]) == 5 and ["torch", "fuser.config"] == \
        [row for row in result["imports"] if row[0] == "torch"][0][::2]
    assert result["compiler_modules"] == []


@pytest.mark.parametrize("accepted", [0, 1])
def test_adapt_acceptance_criterion_needs_an_accepted_update(accepted: int) -> None:
    """benchmarks/adapt.py's acceptance criterion: a rise of 0.15 with no accepted draft update
    is window-to-window noise (the rows the draft keeps follow the suffix index), not a pass."""
    adapt = _adapt_module()

    def window(acceptance: float, updates: int) -> dict:
        return {"tok_s": 100.0, "sources": {"draft": {"acceptance": acceptance}},
                "updates": {"accepted": updates, "rejected": 0}}

    saved = dict(adapt.RESULTS)
    try:
        adapt.RESULTS.clear()
        adapt.RESULTS.update(criteria=[], workloads={"shifted": {
            "off": {"windows": [window(0.47, 0), window(0.57, 0)],
                    "tok_s": {"python_before": 1.0, "python_after": 1.0}},
            "on": {"windows": [window(0.39, 0), window(0.57, accepted)],
                   "tok_s": {"python_before": 1.0, "python_after": 1.0}}}})
        adapt.shifted_criteria()
        (row,) = [c for c in adapt.RESULTS["criteria"] if "draft acceptance" in c["criterion"]]
        assert row["pass"] is bool(accepted), row
        assert f"{accepted} updates accepted (off 0.47 -> 0.57)" in row["value"]
    finally:
        adapt.RESULTS.clear()
        adapt.RESULTS.update(saved)


def test_device_gaps_and_the_host_ops_inside_them() -> None:
    """benchmarks/timeline.py: the device's busy time is the union of its events (an overlap
    counted once), an idle span counts as a gap from MIN_GAP_US, and each host op is credited
    with its overlap with the gaps only (a long op that began well before a gap too)."""
    timeline = _benchmark_module("timeline")

    def ev(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [ev("kernel", "a", 100, 50), ev("kernel", "b", 120, 50),  # busy 100-170
              ev("gpu_memcpy", "copy", 180, 10),  # a 10 us pause: no gap
              ev("kernel", "c", 400, 100),  # a 210 us gap before it
              ev("kernel", "d", 530, 20),  # a 30 us gap before it
              ev("cpu_op", "aten::copy_", 0, 250),  # overlaps the first gap by 60 us
              ev("cuda_runtime", "cudaGraphLaunch", 250, 150),  # inside it: 150 us
              ev("cpu_op", "aten::zeros", 505, 30),  # overlaps the second gap by 25 us
              ev("overhead", "Activity Buffer Request", 190, 200),  # the profiler's own
              {"ph": "i", "cat": "kernel", "name": "instant", "ts": 300}]
    gaps = timeline.device_gaps(events)
    assert gaps["busy_us"] == 70 + 10 + 100 + 20
    assert gaps["span_us"] == 450
    assert gaps["gaps"] == 2 and gaps["gap_us"] == 240
    assert gaps["longest"] == [(210.0, "c"), (30.0, "d")]
    assert gaps["host_in_gaps"] == [("cudaGraphLaunch", 150.0), ("aten::copy_", 60.0),
                                    ("aten::zeros", 25.0)]
    line = timeline.gaps_line("trace", gaps)
    assert line.startswith("trace: device busy 0.20 of 0.45 ms; 2 idle gaps")
    assert "cudaGraphLaunch 0.15" in line
    empty = timeline.device_gaps([ev("cpu_op", "aten::add", 0, 5)])
    assert empty["busy_us"] == 0 and empty["gaps"] == 0


def test_profiled_writes_the_timeline_and_the_tables(tmp_path: Path) -> None:
    """benchmarks/timeline.py `profiled`: on CPU the timeline and the op tables are written
    beside each other, and the summary holds the gaps (none: no device events) and its line."""
    import torch

    timeline = _benchmark_module("timeline")
    with timeline.profiled(tmp_path / "out" / "profile_x") as summary:
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert (tmp_path / "out" / "profile_x.trace.json").is_file()
    text = (tmp_path / "out" / "profile_x.txt").read_text()
    assert text.startswith("profile_x: device busy 0.00 of 0.00 ms; 0 idle gaps")
    assert "aten::mm" in text
    assert summary["gaps"]["gaps"] == 0 and summary["line"] == text.splitlines()[0]


def test_the_host_profiles_difference_names_what_on_adds() -> None:
    """benchmarks/adapt.py `profile_difference`: per function, ON's own time a step less OFF's
    (0 where OFF lacks it), largest first."""
    adapt = _adapt_module()
    off = {"host_us": 100.0, "own": {"a": 50.0, "b": 30.0, "c": 20.0}}
    on = {"host_us": 160.0, "own": {"a": 55.0, "b": 20.0, "lookup": 40.0, "c": 45.0}}
    line = adapt.profile_difference(off, on, top=3)
    assert line == ("  host profile, on - off: own time +60.0 us a step; most extra (us a "
                    "step): lookup +40.0, c +25.0, a +5.0")
