"""The GPU benchmarks' plumbing on CPU: dry runs of ops.py and the sweeps, and timing.py's
rotation arithmetic (the CUDA-graph timing itself needs a GPU: benchmarks/gpu_all.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
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


def test_attention_sweep_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "attention_sweep.json"
    proc = run("attention_sweep.py", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["errors"] == 0 and r["flagged"] == 0 for r in rows)
    assert all(res.get("rel_err") is not None for r in rows for res in r["all"])
    assert all(r["fused"].get("rel_err") is not None for r in rows)  # rotary_cache_attention
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run on CPU")


@pytest.mark.skipif(not LINEAR_OP, reason="fuser/ops/linear.py is not there yet")
def test_linear_sweep_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "linear_sweep.json"
    proc = run("linear_sweep.py", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["flagged"] == 0 and "error" not in r["default"] for r in rows)
    # block_n 8 is refused on the MMA path (M > 1) and recorded, not fatal
    assert all(r["errors"] == (r["M"] > 1) for r in rows)
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
    # e4m3_pieces' kernels are not attention's (the twenty-third session's table counted the row
    # split there by its old name, _split_kernel)
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


@pytest.mark.skipif(torch_cuda_available(), reason="checks the message a CPU machine gets")
def test_prefill_lab_says_it_needs_a_gpu() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/prefill_lab.py", "--tokens", "64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(torch_cuda_available(), reason="checks the message a CPU machine gets")
@pytest.mark.parametrize("script", ["shape_lab.py", "argmax_lab.py"])
def test_labs_say_they_need_a_gpu(script: str) -> None:
    proc = subprocess.run([sys.executable, f"benchmarks/{script}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "needs a CUDA GPU" in proc.stdout + proc.stderr, proc.stderr


def test_shape_lab_variant_words() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from shape_lab import parse_variant

    from fuser.ops import gemv_stream

    assert parse_variant("default", False).stream is gemv_stream.DEFAULT
    lk = parse_variant("lk n64 k512 w8 s4 nonorm", True)
    assert lk.stream is None and not lk.norm and lk.norm_k is None
    assert parse_variant("default nk2048", True).norm_k == 2048
    assert lk.overrides == dict(block_n=64, block_k=512, num_warps=8, num_stages=4)
    stream = parse_variant("2/sm 16K d2 w16", False).stream
    assert (stream.programs_per_sm, stream.tile_bytes, stream.depth, stream.num_warps,
            stream.fp8) == (2, 16384, 2, 16, True)
    assert stream.wide is None and stream.long_k is None  # the named tile at every shape
    assert parse_variant("cublas", False).cublas
    # the norm's switches: as the module has them, after the sum everywhere, the pass everywhere
    assert parse_variant("default", True).rstd_last is None
    assert parse_variant("default rstd", True).rstd_last is True
    assert parse_variant("default pass", True).rstd_last is False
    assert parse_variant("default nk1024", True).rstd_last is False
    # the one-row sums: partials per thread (the module's default), or shuffled every K step
    assert parse_variant("default", True).partials
    assert not parse_variant("lk shuffle", True).partials
    with pytest.raises(ValueError, match="unknown word"):
        parse_variant("2/sm 16K q3", False)


def test_shape_lab_best_tiles_round_trip(tmp_path) -> None:
    """--best keeps, per FP8 shape, the fastest variant's tile where it is not the default,
    the tables filling the words it leaves out; decode.py's --one-row-tiles reads it back."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from shape_lab import SHAPES, best_tiles, load_tiles, parse_variant, tile_of

    from fuser.ops.linear import _default_fp8_config, _default_split_k

    rows, K, _, _ = SHAPES["down"]
    lk = tile_of(parse_variant("lk n16 w8 shuffle x2", True), rows, K)
    assert lk == [16, _default_fp8_config(1, rows, K)[1], 8, 2, False]
    assert tile_of(parse_variant("lk", True), rows, K)[3] == _default_split_k(1, rows, K, True)
    assert tile_of(parse_variant("lk nonorm", True), rows, K) is None  # not as the engine runs
    timed = [dict(dtype="fp8", shape="down", variant="default", us=17.2,
                  tile=tile_of(parse_variant("default", True), rows, K)),
             dict(dtype="fp8", shape="down", variant="lk n16 w8 shuffle x2", us=16.9, tile=lk),
             dict(dtype="fp8", shape="qkv", variant="default", us=9.6, tile=None),
             dict(dtype="fp8", shape="qkv", variant="lk n16", us=9.9, tile=[16, 1024, 4, 1, True])]
    best = best_tiles(timed)
    assert best == {f"{rows}x{K}": lk}  # qkv: the default was fastest
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(best))
    assert load_tiles(path) == {(rows, K): (16, lk[1], 8, 2, False)}


def test_step_lab_variant_words_set_and_restore_the_switches() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_lab import apply

    from fuser.ops import linear, pdl

    before = (linear._default_config, linear._default_split_k, linear.pdl_launch, pdl.pdl_launch)
    rows_pdl = os.environ.get("FUSER_PDL_ROWS")
    restore = apply(["rows:32/64/2/3/3", "pdl"])
    try:
        assert pdl.pdl_rows_enabled()
        assert linear._default_config(3, 640, 384) == (32, 64, 2, 3)
        assert linear._default_split_k(3, 640, 384, False) == 3      # 3 * 64 divides 384
        assert linear._default_split_k(3, 384, 960, False) == 3      # 960 = 5 * 192
        assert linear._default_split_k(3, 384, 1000, False) == 1     # does not divide
        assert linear._default_config(1, 640, 384) == before[0](1, 640, 384)  # one row kept
        assert linear._default_config(3, 6144, 4096) == before[0](3, 6144, 4096)  # large K kept
    finally:
        restore()
    assert (linear._default_config, linear._default_split_k, linear.pdl_launch,
            pdl.pdl_launch) == before
    assert os.environ.get("FUSER_PDL_ROWS") == rows_pdl
    with pytest.raises(SystemExit, match="unknown variant word"):
        apply(["rows16"])


@pytest.mark.skipif(torch_cuda_available(), reason="checks the message a CPU machine gets")
@pytest.mark.parametrize("script", ["step_lab.py", "overlap_lab.py"])
def test_step_labs_say_they_need_a_gpu(script: str) -> None:
    proc = subprocess.run([sys.executable, f"benchmarks/{script}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stderr, proc.stderr[-2000:]


def test_gap_lab_dry_run(tmp_path: Path) -> None:
    """benchmarks/gap_lab.py's three kernels run once on CPU (the interpreter)."""
    proc = run("gap_lab.py", tmp_path / "gap.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run")


@pytest.mark.parametrize("script", ["pieces_lab.py", "pieces_lab.py --sweep", "block_lab.py"])
def test_pieces_labs_dry_run(tmp_path: Path, script: str) -> None:
    """benchmarks/pieces_lab.py's GEMV variants (and its --sweep of launch shapes) and
    block_lab.py's op forms run once on CPU (small shapes, the interpreter)."""
    proc = run(*script.split()[:1], tmp_path / "pieces.json", *script.split()[1:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run")


@pytest.mark.skipif(torch_cuda_available(), reason="the message is for machines without CUDA")
def test_decode_says_it_needs_a_gpu() -> None:
    """benchmarks/decode.py on a machine without CUDA: one line naming the problem, no
    traceback."""
    proc = subprocess.run([sys.executable, "benchmarks/decode.py", "--layers", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_pieces_lab_best_tiles_round_trip(tmp_path: Path) -> None:
    """pieces_lab.py --sweep --best keeps a shape's fastest launch shape only where it beats
    the default by BEST_MARGIN, keyed by the weight's rows (gated: both halves), and
    load_pieces_tiles reads it back as linear.FP8_PIECES_TILES takes it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pieces_lab import SHAPES, best_pieces_tiles, load_pieces_tiles

    results = {"qkv": {"default": 10.0, "n64 k256 s2 p4": 9.5, "n64 k128 s4 p3": 9.9},
               "o_proj": {"default": 8.0, "n64 k128 s8 p6": 7.9},        # within the margin
               "gate_up": {"default": 31.6, "n128 k128 s1 p3": 30.0},
               "down": {"default": 18.0, "n64 k256 s7 p4": 18.5}}
    best = best_pieces_tiles(results, SHAPES)
    assert best == {"6144x4096": [64, 256, 2, 4], "28672x4096": [128, 128, 1, 3]}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(best))
    assert load_pieces_tiles(path) == {(6144, 4096): (64, 256, 2, 4),
                                       (28672, 4096): (128, 128, 1, 3)}


def test_sass_lab_finds_spills_in_loops() -> None:
    """benchmarks/sass_lab.py's SASS reading: spill loads between a backward branch's target
    and the branch count as in a loop; forward branches make no loop."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sass_lab import sass_counts

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;      /* 0x00000a0000017a02 */",
        "        /*0010*/               @P0 BRA 0x0060 ;                /* 0x0000004000000947 */",
        "        /*0020*/                   LDL R2, [R1] ;              /* 0x0000000001027983 */",
        "        /*0030*/                   STL [R1+0x4], R3 ;          /* 0x0000040301007387 */",
        "        /*0040*/                   LDL.64 R4, [R1+0x8] ;       /* 0x0000080001047983 */",
        "        /*0050*/              @!P1 BRA 0x0020 ;                /* 0xfffffffc00f09947 */",
        "        /*0060*/                   LDL R6, [R1+0x10] ;         /* 0x0000100001067983 */",
        "        /*0070*/                   EXIT ;                      /* 0x000000000000794d */",
    ])
    assert sass_counts(sass) == {"instructions": 8, "STL": 1, "STL_in_loops": 1, "LDL": 3,
                                 "LDL_in_loops": 2}


def test_sass_lab_compiles_for_sm90() -> None:
    """benchmarks/sass_lab.py on one case: the launch recorded through the launcher, compiled for
    sm_90 and its registers read (or SKIP where this Triton has no CUDA tools)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "benchmarks/sass_lab.py", "--cases", "qkv_row",
                           "--warps", "8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    if last.startswith("SKIP"):
        pytest.skip(last)
    assert last.startswith("qkv_row w8") and " registers, stack " in last, proc.stdout
