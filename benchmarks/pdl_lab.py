"""The chain of one layer's decode GEMVs, layer after layer, on the GPU: PDL and the stream GEMV.

    python3 benchmarks/pdl_lab.py [--layers 32] [--rows 1,5] [--dtypes bf16,fp8]
                                  [--variants "off;stream default;..."] [--out f.json]

The weight-streaming kernels of a Llama-3-8B-shape decode step, layer after layer as the step
runs them (norm + qkv, o_proj, norm + gate/up with the activation, down_proj; the norms inside
the GEMVs at one row, add_rms_norm kernels at several; the attention between them left out),
captured in one CUDA graph and replayed, once per variant (VARIANTS at one row, ROWS_VARIANTS at
several): `_linear_kernel` with PDL off (FUSER_PDL=0, "off") or on
with a prefetched tile; the stream GEMV (fuser/ops/gemv_stream.py) in several configurations
(`gemv_stream.CONFIG` / `ROWS_CONFIG`; "stream default" is what the engine runs). Prints the
chain's time per layer, its read bandwidth against the measured HBM read bandwidth, and whether
each variant's output equals "off"'s bit for bit, else their relative difference (summation
order, amplified by 16 random layers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import log, measure_read_bandwidth, replay_median_ms  # noqa: E402

from fuser.ops import gemv_stream  # noqa: E402
from fuser.ops import linear as linear_module  # noqa: E402
from fuser.ops.fp8 import quantize_weight  # noqa: E402
from fuser.ops.gemv_stream import StreamConfig  # noqa: E402
from fuser.ops.linear import linear_triton, rms_norm_linear_triton  # noqa: E402
from fuser.ops.rmsnorm import add_rms_norm_triton  # noqa: E402

HIDDEN, HEADS_OUT, INTER = 4096, 6144, 14336  # Llama-3-8B: qkv 6144 x 4096, gate/up 2 x 14336
EPS = 1e-5
# (name, FUSER_PDL, _linear_kernel's prefetch, the stream GEMV's configuration or None)
VARIANTS = (("off", "0", None, None), ("pdl, 1 tile", "1", 1, None),
            ("stream default", "0", None, gemv_stream.DEFAULT),
            ("stream d3", "0", None, StreamConfig()),
            ("stream pdl d3", "1", None, StreamConfig()),
            ("stream pdl d4", "1", None, StreamConfig(depth=4)),
            ("stream pdl d2 32K", "1", None, StreamConfig(tile_bytes=32768, depth=2)),
            ("stream pdl 2/sm 8K", "1", None, StreamConfig(programs_per_sm=2, tile_bytes=8192)),
            ("stream pdl d4 8K", "1", None, StreamConfig(tile_bytes=8192, depth=4)),
            ("stream pdl 2/sm 8K d4", "1", None, StreamConfig(programs_per_sm=2,
                                                              tile_bytes=8192, depth=4)),
            ("stream pdl 2/sm 4K d4 w4", "1", None, StreamConfig(programs_per_sm=2,
                                                                 tile_bytes=4096, depth=4,
                                                                 num_warps=4)),
            ("stream pdl 4/sm 4K d3 w4", "1", None, StreamConfig(programs_per_sm=4,
                                                                 tile_bytes=4096, num_warps=4)),
            # the engine's launches (PDL on), the norms as add_rms_norm kernels instead of
            # inside qkv and gate/up (what FP8's per-program norm prologue costs against)
            ("norm kernels", "1", None, gemv_stream.DEFAULT),
            # the engine's launches with the norm inside the GEMVs as a prologue pass over x
            # (the default), or with rstd multiplying the sums (linear.NORM_RSTD_LAST)
            ("norm pass", "1", None, gemv_stream.DEFAULT),
            ("rstd last", "1", None, gemv_stream.DEFAULT),
            ("no norms", "1", None, gemv_stream.DEFAULT))
# Several rows (the verify step's MMA path; PDL is one row's): the stream GEMV's ROWS_CONFIG
ROWS_VARIANTS = (("off", "0", None, None),
                 ("stream d1 st3", "0", None, StreamConfig(depth=1, num_stages=3)),
                 ("stream d3", "0", None, StreamConfig()),
                 ("stream 2/sm d2 8K st2", "0", None, StreamConfig(programs_per_sm=2,
                                                                    tile_bytes=8192, depth=2,
                                                                    num_stages=2)),
                 ("stream d2 32K", "0", None, StreamConfig(tile_bytes=32768, depth=2)),
                 # FP8 weights on an fp16 MMA or the FP8 MMA with x in two pieces
                 # (linear.FP8_ROWS_MMA "f16", "x2"; bf16 rows: unchanged)
                 ("f16 mma", "0", None, None),
                 ("x2 mma", "0", None, None),
                 # the norms inside the qkv and gate/up GEMVs (their per-row prologue) instead
                 # of add_rms_norm kernels (linear.NORM_PROLOGUE_MAX_ROWS)
                 ("norm prologue", "0", None, None),
                 ("no norms", "0", None, None))


def make_layers(n: int, fp8: bool, device: torch.device) -> list[dict]:
    """Random weights of n layers (std 0.02; FP8: quantized per output channel)."""
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(n):
        layer = {}
        for name, shape in (("qkv", (HEADS_OUT, HIDDEN)), ("o", (HIDDEN, HIDDEN)),
                            ("gate_up", (2 * INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
            w = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
            layer[name] = quantize_weight(w) if fp8 else (w, None)
        layer["g1"] = 1 + 0.1 * torch.randn(HIDDEN, device=device, dtype=torch.bfloat16,
                                            generator=gen)
        layer["g2"] = 1 + 0.1 * torch.randn(HIDDEN, device=device, dtype=torch.bfloat16,
                                            generator=gen)
        layers.append(layer)
    return layers


def chain(layers: list[dict], h: torch.Tensor, r: torch.Tensor, prefetch: int | None,
          prologue: bool = False, norm_kernels: bool = False, no_norms: bool = False
          ) -> torch.Tensor:
    """The layers' GEMVs in step order with the norms as the engine runs them: inside the GEMVs
    at one row, add_rms_norm kernels before qkv and gate_up at several rows (until the eleventh
    session several rows left them out, and the chain's values overflowed to NaN by the sixth
    layer: its bit-equality columns said nothing there). `prologue`: the norms inside the GEMVs
    at several rows too; `norm_kernels`: norm kernels at one row too; `no_norms`: the GEMVs
    alone, no norm anywhere (what any fusion of the norms can reach at best; values are not
    kept in range, so its equality column says nothing)."""
    kw = {} if prefetch is None else {"prefetch": prefetch}
    one_row = (h.shape[0] == 1 and not norm_kernels) or prologue
    for layer in layers:
        w, s = layer["qkv"]
        if no_norms:
            qkv = linear_triton(h, w, weight_scale=s, **kw)
        elif one_row:
            qkv, r = rms_norm_linear_triton(h, r, layer["g1"], EPS, w, weight_scale=s, **kw)
        else:
            normed, r = add_rms_norm_triton(h, r, layer["g1"], EPS)
            qkv = linear_triton(normed, w, weight_scale=s, **kw)
        w, s = layer["o"]
        o = linear_triton(qkv[:, :HIDDEN], w, weight_scale=s, **kw)
        w, s = layer["gate_up"]
        if no_norms:
            act = linear_triton(o, w, weight_scale=s, activation="silu", **kw)
        elif one_row:
            act, r = rms_norm_linear_triton(o, r, layer["g2"], EPS, w, weight_scale=s,
                                            activation="silu", **kw)
        else:
            normed, r = add_rms_norm_triton(o, r, layer["g2"], EPS)
            act = linear_triton(normed, w, weight_scale=s, activation="silu", **kw)
        w, s = layer["down"]
        h = linear_triton(act, w, weight_scale=s, **kw)
    return h


def rel_diff(out: torch.Tensor, base: torch.Tensor) -> float:
    """||out - base|| / ||base|| in fp64 (NaN anywhere: inf)."""
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - base.double()).norm() / base.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--variants", default="",
                        help="names separated by ';' (default all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("pdl_lab.py needs a CUDA GPU; nothing to do")
        return
    device = torch.device("cuda")
    bandwidth = measure_read_bandwidth()
    log(f"HBM read bandwidth {bandwidth / 1e12:.2f} TB/s, {args.layers} layers")
    rows = []
    rows_default, rstd_default = linear_module.FP8_ROWS_MMA, linear_module.NORM_RSTD_LAST
    plain_default = linear_module.FP8_PLAIN_RSTD_LAST
    for dtype in args.dtypes.split(","):
        layers = make_layers(args.layers, dtype == "fp8", device)
        weight_bytes = sum(w.numel() * w.element_size() for layer in layers
                           for w, _ in (layer[k] for k in ("qkv", "o", "gate_up", "down")))
        for M in (int(m) for m in args.rows.split(",")):
            gen = torch.Generator(device=device).manual_seed(M)
            h = torch.randn(M, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
            r = torch.randn(M, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
            base_ms, base_out = None, None
            for name, flag, prefetch, stream in VARIANTS if M == 1 else ROWS_VARIANTS:
                if args.variants and name not in args.variants.split(";"):
                    continue
                os.environ["FUSER_PDL"] = flag
                gemv_stream.CONFIG, gemv_stream.ROWS_CONFIG = (stream, None) if M == 1 else \
                    (None, stream)
                # "off" (and the rest): the bf16 MMA; "no norms" as the engine (fp16)
                linear_module.FP8_ROWS_MMA = {"f16 mma": "f16", "no norms": "f16",
                                              "x2 mma": "x2"}.get(name)
                linear_module.NORM_RSTD_LAST = name == "rstd last"
                if name == "norm pass":  # the prologue pass at every shape
                    linear_module.FP8_PLAIN_RSTD_LAST = False
                try:
                    ms, out = replay_median_ms(
                        lambda: chain(layers, h, r, prefetch, name == "norm prologue",
                                      name == "norm kernels", name == "no norms"))
                except Exception as error:  # noqa: BLE001  (a variant that does not compile)
                    log(f"{dtype:4s} M={M:2d} {name:17s} failed: {type(error).__name__}: "
                        f"{str(error)[:200]}")
                    continue
                finally:
                    gemv_stream.CONFIG, gemv_stream.ROWS_CONFIG = gemv_stream.DEFAULT, None
                    linear_module.FP8_ROWS_MMA = rows_default
                    linear_module.NORM_RSTD_LAST = rstd_default
                    linear_module.FP8_PLAIN_RSTD_LAST = plain_default
                if base_ms is None:
                    base_ms, base_out = ms, out
                row = dict(dtype=dtype, rows=M, variant=name, ms=ms,
                           us_per_layer=1e3 * ms / args.layers,
                           pct_bandwidth=100 * weight_bytes / (ms / 1e3) / bandwidth,
                           speedup=base_ms / ms, equal=bool(torch.equal(out, base_out)),
                           rel_diff=rel_diff(out, base_out))
                rows.append(row)
                log(f"{dtype:4s} M={M:2d} {name:19s} {ms:7.3f} ms ({row['us_per_layer']:6.1f} "
                    f"us/layer, {row['pct_bandwidth']:4.1f}% of bandwidth) {row['speedup']:.3f}x "
                    f"{'equal' if row['equal'] else 'rel diff %.1e' % row['rel_diff']}")
        del layers
        torch.cuda.empty_cache()
    os.environ.pop("FUSER_PDL", None)
    if args.out:
        args.out.write_text(json.dumps(dict(bandwidth=bandwidth, layers=args.layers, rows=rows),
                                       indent=1))


if __name__ == "__main__":
    main()
