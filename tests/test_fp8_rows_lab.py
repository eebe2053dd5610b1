"""benchmarks/fp8_rows_lab.py: the e4m3 -> fp16 bit conversion, its PTX, the lab's kernels.

On CPU: the formula over every e4m3fn code; the inline PTX's steps, evaluated from its own text;
the kernel's plain-Triton variants under TRITON_INTERPRET=1 (conftest.py sets it without a GPU;
inline asm does not run there); every variant compiled for sm_90 (a subprocess, no GPU). On a
GPU: every variant, the inline PTX included, against the float64 reference.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import fp8_rows_lab as lab  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CODES = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)])  # the e4m3fn NaNs left out


def bits_formula(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (ints) -> the fp16 bit patterns ((b & 0x80) << 8) | ((b & 0x7F) << 7), int32."""
    return ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)


def as_fp16(bits: torch.Tensor) -> torch.Tensor:
    """int32 holding 16-bit patterns -> fp16 of those bits."""
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)


def test_bit_formula_is_the_value_times_2_to_the_minus_8_for_every_code() -> None:
    exact = CODES.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16) * 2.0**-8
    got = as_fp16(bits_formula(CODES))
    # bit for bit (signed zero included): the scaling by 2^-8 is exact, subnormals too
    assert torch.equal(got.view(torch.int16), exact.view(torch.int16))
    # the 16 subnormal codes (exponent 0) land on fp16 subnormals (below 2^-14), the largest
    # 7 * 2^-9 * 2^-8, the smallest nonzero 2^-17: no flush, no rounding
    subnormal = (CODES & 0x78) == 0
    assert int(subnormal.sum()) == 16
    assert got[subnormal].abs().max().item() == 7 * 2.0**-17 < 2.0**-14
    assert got[subnormal].abs().unique().tolist() == [k * 2.0**-17 for k in range(8)]


def run_ptx(asm: str, word: int) -> list[int]:
    """Evaluate the lab's PTX block on one b32 ($2), from its own text: and / shr / shl / lop3 /
    prmt as the PTX ISA defines them. Returns [$0, $1]."""
    regs = {"$2": word}

    def val(operand: str) -> int:
        return regs[operand] if operand in regs else int(operand, 0)

    for line in asm.splitlines():
        m = re.match(r"\s*(\w+)\.[\w.]+\s+(.+);$", line)
        if not m or m.group(1) not in ("and", "shr", "shl", "lop3", "prmt"):
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        dst, src = args[0], [val(a) for a in args[1:]]
        if op == "and":
            out = src[0] & src[1]
        elif op == "shr":
            out = src[0] >> src[1]
        elif op == "shl":
            out = (src[0] << src[1]) & 0xFFFFFFFF
        elif op == "lop3":  # bit i of the result: lut[(a_i << 2) | (b_i << 1) | c_i]
            a, b, c, lut = src
            out = 0
            for i in range(32):
                index = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
                out |= ((lut >> index) & 1) << i
        else:  # prmt d, a, b, sel: byte j of d is byte sel[j] of {b, a} (a: 0-3, b: 4-7)
            a, b, sel = src
            pool = a | (b << 32)
            out = 0
            for j in range(4):
                out |= ((pool >> (8 * ((sel >> (4 * j)) & 0x7))) & 0xFF) << (8 * j)
        regs[dst] = out
    return [regs["$0"], regs["$1"]]


def test_ptx_steps_give_the_formula_for_every_code_at_every_byte() -> None:
    codes = CODES.tolist()
    n = len(codes)
    for start in range(0, n, 7):  # every code at each of the 4 byte positions, neighbours varied
        quad = [codes[(start + 61 * p) % n] for p in range(4)]
        for p in range(4):
            word_codes = quad[p:] + quad[:p]
            word = sum(c << (8 * i) for i, c in enumerate(word_codes))
            out0, out1 = run_ptx(lab._E4M3_TO_F16X2_ASM.value, word)
            halves = [out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16]
            assert halves == bits_formula(torch.tensor(word_codes)).tolist(), (hex(word), halves)


# --- the kernel: exact variants, and the a8 ones with the bound of their x quantization --------


def make(N: int, K: int, M: int = 5, seed: int = 0):
    """x [M, K] bf16 (rows of different magnitudes), w_fp8 [N, K] holding every code, scale [N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.tensor([1.0, 300.0, 1e-3, 7.0, 0.05][:M])[:, None]
    codes = CODES[torch.randint(0, len(CODES), (N, K), generator=g)]
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    ws = torch.rand(N, generator=g) * 1e-2 + 1e-3
    return x.to(torch.bfloat16), w, ws


def x_error_bound(x: torch.Tensor, variant: str) -> torch.Tensor:
    """Elementwise bound on |x - x the kernel multiplies| (float64), from e4m3's rounding: half
    an ulp is 2^-4 of |v| for a normal code, 2^-10 (times the row's scale) in the subnormal range;
    fp32's own roundings (the division by the scale, the residual) add < 2^-20 |x|.
    a8: 2^-4 |x| + 2^-10 s. a8x2: the residual r = x - hi s_hi is within the a8 bound, and lo
    rounds it again: 2^-4 (2^-4 |x| + 2^-10 s_hi) + 2^-10 s_lo. x2 pieces: exact but for
    values on e4m3's subnormal grid, half its step, 2^-10 2^-t. Exact variants: 0."""
    mode = lab.VARIANTS[variant][1]
    x64 = x.double().abs()
    if mode not in ("a8", "a8x2", "x2p", "x2c"):
        return torch.zeros_like(x64)
    _, _, xs = lab.prepare_x(x, mode)
    if mode in ("x2p", "x2c"):  # exact down to e4m3's subnormal step 2^-9 (times 2^-t)
        return 2.0**-10 * xs.double()[0][:, None] + 0 * x64
    s_hi, s_lo = xs.double()[0][:, None], xs.double()[1][:, None]
    if mode == "a8":
        return 2.0**-4 * x64 + 2.0**-10 * s_hi + 2.0**-20 * x64
    return 2.0**-8 * x64 + 2.0**-14 * s_hi + 2.0**-10 * s_lo + 2.0**-20 * x64


def check(variant: str, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
          out_rounding: float) -> None:
    """|out - ref| <= x_error_bound @ |W| + (2^-16 + out_rounding) (|x| @ |W|) elementwise, W =
    w_fp8 * scale in float64: products of fp16 or e4m3 values are exact in fp32 and only the
    fp32 sums round (< 2^-16 of the sum of |products| at these K), then the output's rounding.
    A wrong code, byte order or factor 256 is off by the size of a product or more."""
    ref = lab.reference(x, w, ws)
    W = (w.double() * ws.double()[:, None]).abs()
    bound = x_error_bound(x, variant) @ W.T + (2.0**-16 + out_rounding) * (x.double().abs() @ W.T)
    err = (out.double().cpu() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), f"{variant}: max err/bound {(err / bound).max().item():.3g}"


CPU_VARIANTS = [v for v, (weight, _) in lab.VARIANTS.items() if weight != "asm"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's run")
@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_variant_under_the_interpreter(variant: str) -> None:
    # 80 rows: a full and a masked column block of 64; K = 512: 2 splits of 2 steps of 128
    x, w, ws = make(80, 512)
    fn = lab.RowsGemv(80, 512, variant, 64, 128, 2, 3, device="cpu")
    out = fn(lab.prepare_x(x, lab.VARIANTS[variant][1]), w, ws,
             torch.full((5, 80), float("nan")))
    check(variant, out, x, w, ws, out_rounding=0.0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's run")
@pytest.mark.parametrize("variant", list(lab.ENGINE_VARIANTS))
def test_engine_variant_under_the_interpreter(variant: str) -> None:
    """The lab's calls of the engine's kernel (linear_triton, linear_pieces_triton) with its
    tiles: exact variants, within the fp32 sum's bound and their bf16 output's rounding."""
    x, w, ws = make(80, 512)
    fn = lab.make_gemv(80, 512, variant, (64, 128, 2, 3), "cpu")
    out = fn(lab.prepare_x(x, "shift"), w, ws, torch.full((5, 80), float("nan")))
    check("f16 cvt", out, x, w, ws, out_rounding=2.0**-8)


def test_a8_bounds_are_tight_enough_to_mean_something() -> None:
    """The a8x2 bound is ~16x the a8 one smaller, and the a8 error does exceed the a8x2 bound
    (so a kernel that dropped the lo piece would fail the a8x2 check)."""
    x, w, ws = make(64, 512)
    ref = lab.reference(x, w, ws)
    W = (w.double() * ws.double()[:, None]).T
    hi, lo, xs = lab.prepare_x(x, "a8x2")
    x_a8 = hi.double() * xs.double()[0][:, None]
    x_a8x2 = x_a8 + lo.double() * xs.double()[1][:, None]
    assert ((x.double() - x_a8x2).abs() <= x_error_bound(x, "a8 x2")).all()
    assert ((x.double() - x_a8).abs() <= x_error_bound(x, "a8 ceiling")).all()
    bound_x2 = x_error_bound(x, "a8 x2") @ W.abs() + 2.0**-16 * (x.double().abs() @ W.abs())
    assert ((x_a8 @ W - ref).abs() > bound_x2).any()
    assert (x_error_bound(x, "a8 x2") < x_error_bound(x, "a8 ceiling") / 12).all()


def test_x2_pieces_are_the_engines_split_of_x() -> None:
    """The lab's "x2 pieces" are exact (hi + lo = x 2^t for x within 2^9 of its row's max), and
    the same pieces as the engine's _x2_step forms (here one power of two per row; there per K
    step): the identity-weight GEMV through the engine's path returns x too."""
    g = torch.Generator().manual_seed(5)
    mantissa = 1 + torch.randint(0, 128, (5, 256), generator=g) / 128
    spread = torch.randint(-9, 1, (5, 256), generator=g).double()
    x = (mantissa * torch.exp2(spread + 3)).to(torch.bfloat16)
    hi, lo, xs = lab.prepare_x(x, "x2p")
    back = (hi.double() + lo.double()) * xs.double()[0][:, None]
    assert torch.equal(back, x.double())
    assert hi.dtype == lo.dtype == torch.float8_e4m3fn and (hi.float().abs() < 256).all()


# --- compiled for sm_90 (no GPU needed) ------------------------------------------------------


def test_every_variant_compiles_for_sm90(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    variants = ["f16 cvt", "f16 bits asm", "a8 x2"]
    done = subprocess.run([sys.executable, str(BENCHMARKS / "fp8_rows_lab.py"), "--compile-only",
                           "--variants", ",".join(variants), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("no ptxas for sm_90 in this Triton installation")
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(out.read_text())
    assert set(counts) == set(variants), done.stdout
    # Triton's conversion is there, and the inline PTX replaced it; both on the fp16 wgmma
    assert counts["f16 cvt"]["F2FP.E4M3"] > 0 and counts["f16 cvt"]["HGMMA"] > 0
    asm = counts["f16 bits asm"]
    assert asm["F2FP.E4M3"] == 0 and asm["PRMT"] > 0 and asm["LOP3"] > 0 and asm["HGMMA"] > 0
    # FP8 x FP8: the weight goes from shared memory to the wgmma, no shared-memory loads of it
    assert counts["a8 x2"]["QGMMA"] > 0 and counts["a8 x2"]["LDS.U16"] == 0
    assert all(c["registers"] and c["registers"] > 0 for c in counts.values())


# --- on a GPU --------------------------------------------------------------------------------


# "x2 pieces chained" sums in the FP8 MMA's own accumulator over all of K, which keeps fewer
# bits than fp32 on an H100/H200: its error is what the lab measures, not bounded here.
@needs_cuda
@pytest.mark.parametrize("variant", [v for v in lab.VARIANTS if v != "x2 pieces chained"])
def test_gpu_variant(variant: str) -> None:
    x, w, ws = make(1024, 4096)
    fn = lab.RowsGemv(1024, 4096, variant, 64, 128, 2, 4, device="cuda")
    out = torch.empty(5, 1024, device="cuda", dtype=torch.bfloat16)
    out = fn(lab.prepare_x(x.cuda(), lab.VARIANTS[variant][1]), w.cuda(), ws.cuda(), out)
    check(variant, out, x, w, ws, out_rounding=2.0**-8)  # bf16: half an ulp is 2^-9 of |out|
