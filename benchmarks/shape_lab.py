"""One decode GEMV shape at a time, launched back to back as the step launches them.

    python3 benchmarks/shape_lab.py [--dtypes bf16,fp8] [--shapes qkv,o,gate_up,down]
                                    [--variants "default;lk;2/sm 16K d2;..."] [--out f.json]
                                    [--best tiles.json]

benchmarks/pdl_lab.py times a layer's four GEMVs together; this lab times each 8B-shape GEMV
alone: 16 launches of it over distinct weights (16 copies: more than the L2 holds), captured in
one CUDA graph with whatever PDL the variant launches with, so a kernel's ramp and tail overlap
its neighbours' as they do in the step. qkv and gate/up run with the RMSNorm prologue (gate/up
gated, SiLU), as the engine runs them at one row. Prints microseconds per launch and the share of
the measured HBM read bandwidth that the weight bytes reach.

A variant is a list of words:
  default      what the engine runs (gemv_stream.CONFIG for bf16, _linear_kernel for FP8)
  lk           _linear_kernel (gemv_stream.CONFIG = None), its tuned tile, or as the words
               after it say: nN block_n, kN block_k, wN num_warps, sN num_stages, xN split_k
  cublas       torch's F.linear, without the norm or the activation (bf16: the plain GEMV's
               cost, a reference, not a candidate)
  N/sm NK dN wN
               the stream GEMV (fuser/ops/gemv_stream.py) with programs_per_sm, tile_bytes
               (KiB), depth and num_warps set; the rest as DEFAULT (without its wide and
               long_k configurations: the named tile at every shape)
  nonorm       (after any of the above) qkv and gate/up without the norm prologue: what the
               prologue costs
  nkN          (after any of the above) _linear_kernel's one-row prologue N columns a step
               (linear.ONE_ROW_NORM_K; a prologue pass)
  rstd         (after any of the above) the norm without the prologue pass: rstd multiplies
               the sums after the K loop (linear.NORM_RSTD_LAST), every shape
  pass         (after any of the above) the prologue pass at every shape (without either
               word: linear.rstd_last_for's choice, FP8's qkv after the sum)
  shuffle      (after any of the above) _linear_kernel's one-row sums reduced across threads
               every K step (linear.ONE_ROW_PARTIALS off), not once after the loop

--best writes, for each FP8 shape where an "lk" variant (with or without "shuffle") or
"default shuffle" beat every other, that tile as linear.FP8_ONE_ROW_TILES takes it
({"ROWSxK": [block_n, block_k, num_warps, split_k, partials]}; `load_tiles` reads it back), so
that `benchmarks/decode.py --one-row-tiles` runs the engine on what this GPU measured fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import graph_time_us, log, measure_read_bandwidth  # noqa: E402

from fuser.ops import gemv_stream  # noqa: E402
from fuser.ops import linear as linear_module  # noqa: E402
from fuser.ops.fp8 import quantize_weight  # noqa: E402
from fuser.ops.gemv_stream import StreamConfig  # noqa: E402
from fuser.ops.linear import linear_triton, rms_norm_linear_triton  # noqa: E402

HIDDEN, INTER = 4096, 14336
# name: (weight rows, K, the norm prologue, gated)
SHAPES = {"qkv": (6144, HIDDEN, True, False), "o": (HIDDEN, HIDDEN, False, False),
          "gate_up": (2 * INTER, HIDDEN, True, True), "down": (HIDDEN, INTER, False, False),
          "head": (128256, HIDDEN, True, False)}  # the LM head after the final norm
COPIES = 16
EPS = 1e-5


@dataclasses.dataclass
class Variant:
    name: str
    stream: StreamConfig | None   # gemv_stream.CONFIG while it runs
    overrides: dict[str, int] = dataclasses.field(default_factory=dict)  # _linear_kernel's
    cublas: bool = False
    norm: bool = True
    norm_k: int | None = None     # linear.ONE_ROW_NORM_K while it runs (None: as it is)
    rstd_last: bool | None = None  # linear.NORM_RSTD_LAST and FP8_PLAIN_RSTD_LAST while it
                                   # runs (None: as the module has them)
    partials: bool = True         # linear.ONE_ROW_PARTIALS while it runs


def parse_variant(name: str, fp8: bool) -> Variant:
    """A variant's words (the module docstring) -> what to set."""
    words = name.split()
    norm = "nonorm" not in words
    norm_k = next((int(word[2:]) for word in words if word.startswith("nk")), None)
    rstd_last = None if not {"rstd", "pass"} & set(words) and norm_k is None else \
        "rstd" in words and "pass" not in words and norm_k is None
    partials = "shuffle" not in words
    words = [word for word in words if word not in ("nonorm", "pass", "rstd", "shuffle")
             and not word.startswith("nk")]
    variant = _parse_kernel(name, words, norm)
    variant.norm_k, variant.rstd_last, variant.partials = norm_k, rstd_last, partials
    return variant


def _parse_kernel(name: str, words: list[str], norm: bool) -> Variant:
    """The kernel words of a variant (parse_variant without nonorm, nkN, rstd and pass)."""
    if words == ["default"]:
        return Variant(name, gemv_stream.DEFAULT, norm=norm)
    if words == ["cublas"]:
        return Variant(name, None, cublas=True)
    if words and words[0] == "lk":
        keys = {"n": "block_n", "k": "block_k", "w": "num_warps", "s": "num_stages",
                "x": "split_k"}
        return Variant(name, None, {keys[word[0]]: int(word[1:]) for word in words[1:]},
                       norm=norm)
    fields: dict[str, object] = {"fp8": True, "wide": None, "long_k": None}  # this tile alone
    for word in words:
        if word.endswith("/sm"):
            fields["programs_per_sm"] = int(word[:-3])
        elif word.endswith("K"):
            fields["tile_bytes"] = int(word[:-1]) * 1024
        elif word.startswith("d"):
            fields["depth"] = int(word[1:])
        elif word.startswith("w"):
            fields["num_warps"] = int(word[1:])
        else:
            raise ValueError(f"variant {name!r}: unknown word {word!r}")
    return Variant(name, dataclasses.replace(gemv_stream.DEFAULT, **fields), norm=norm)


def tile_of(variant: Variant, rows: int, K: int) -> list | None:
    """[block_n, block_k, num_warps, split_k, partials] that an FP8 variant runs at one row
    (linear.FP8_ONE_ROW_TILES' value; the tables fill what its words leave out), or None for
    one that is not _linear_kernel with the norm as the engine runs it."""
    if variant.cublas or not variant.norm or variant.norm_k is not None or \
            variant.rstd_last is not None or variant.stream not in (None, gemv_stream.DEFAULT):
        return None
    bn, bk, warps, _ = linear_module._default_fp8_config(1, rows, K)
    o = variant.overrides
    return [o.get("block_n", bn), o.get("block_k", bk), o.get("num_warps", warps),
            o.get("split_k", linear_module._default_split_k(1, rows, K, True)), variant.partials]


def best_tiles(rows_timed: list[dict]) -> dict[str, list]:
    """{"ROWSxK": tile} for each FP8 shape whose fastest variant has a tile_of other than the
    module's own choice (what --best writes)."""
    best: dict[str, list] = {}
    for shape in dict.fromkeys(r["shape"] for r in rows_timed if r["dtype"] == "fp8"):
        timed = [r for r in rows_timed if r["dtype"] == "fp8" and r["shape"] == shape]
        fastest = min(timed, key=lambda r: r["us"])
        if fastest.get("tile") is not None and fastest["variant"] != "default":
            rows, K, _, _ = SHAPES[shape]
            best[f"{rows}x{K}"] = fastest["tile"]
    return best


def load_tiles(path: Path) -> dict[tuple[int, int], tuple[int, int, int, int, bool]]:
    """A --best file as linear.FP8_ONE_ROW_TILES takes it."""
    tiles = {}
    for key, (bn, bk, warps, split, partials) in json.loads(path.read_text()).items():
        rows, K = (int(v) for v in key.split("x"))
        tiles[(rows, K)] = (int(bn), int(bk), int(warps), int(split), bool(partials))
    return tiles


def launches(shape: str, fp8: bool, variant: Variant, device: torch.device) -> list:
    """COPIES callables, one launch each over its own weight copy."""
    rows, K, norm, gated = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, K, device=device, dtype=torch.bfloat16, generator=gen)
    r = torch.randn(1, K, device=device, dtype=torch.bfloat16, generator=gen)
    g = 1 + 0.1 * torch.randn(K, device=device, dtype=torch.bfloat16, generator=gen)
    fns = []
    for _ in range(COPIES):
        w = torch.randn(rows, K, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        w, s = quantize_weight(w) if fp8 else (w, None)
        if variant.cublas:
            fns.append(lambda w=w: F.linear(x, w))
        elif norm and variant.norm:
            fns.append(lambda w=w, s=s: rms_norm_linear_triton(
                x, r, g, EPS, w, weight_scale=s, activation="silu" if gated else None,
                **variant.overrides))
        else:
            fns.append(lambda w=w, s=s: linear_triton(
                x, w, weight_scale=s, activation="silu" if gated else None,
                **variant.overrides))
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--variants", default="default;lk;cublas")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--best", type=Path, help="write the fastest FP8 tiles (see above)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("shape_lab.py needs a CUDA GPU; nothing to do")
        return
    device = torch.device("cuda")
    bandwidth = measure_read_bandwidth()
    log(f"HBM read bandwidth {bandwidth / 1e12:.2f} TB/s; {COPIES} launches per shape")
    saved = (gemv_stream.CONFIG, linear_module.ONE_ROW_NORM_K, linear_module.NORM_RSTD_LAST,
             linear_module.FP8_PLAIN_RSTD_LAST, linear_module.ONE_ROW_PARTIALS)
    results = []
    for dtype in args.dtypes.split(","):
        fp8 = dtype == "fp8"
        for shape in args.shapes.split(","):
            rows, K, _, _ = SHAPES[shape]
            nbytes = rows * K * (1 if fp8 else 2)
            for name in args.variants.split(";"):
                variant = parse_variant(name, fp8)
                if variant.cublas and fp8:
                    continue
                gemv_stream.CONFIG = variant.stream
                linear_module.ONE_ROW_NORM_K = variant.norm_k or saved[1]
                linear_module.ONE_ROW_PARTIALS = variant.partials
                if variant.rstd_last is not None:  # "rstd": every shape; "pass": none
                    linear_module.NORM_RSTD_LAST = variant.rstd_last
                    linear_module.FP8_PLAIN_RSTD_LAST = variant.rstd_last
                try:
                    us = graph_time_us(launches(shape, fp8, variant, device), calls=COPIES)
                except Exception as error:  # noqa: BLE001  (a variant that does not compile)
                    log(f"{dtype:4s} {shape:7s} {name:22s} failed: {type(error).__name__}: "
                        f"{str(error)[:160]}")
                    continue
                finally:
                    (gemv_stream.CONFIG, linear_module.ONE_ROW_NORM_K,
                     linear_module.NORM_RSTD_LAST, linear_module.FP8_PLAIN_RSTD_LAST,
                     linear_module.ONE_ROW_PARTIALS) = saved
                    torch.cuda.empty_cache()
                pct = 100 * nbytes / (us * 1e-6) / bandwidth
                results.append(dict(dtype=dtype, shape=shape, variant=name, us=us, pct=pct,
                                    tile=tile_of(variant, rows, K) if fp8 else None))
                log(f"{dtype:4s} {shape:7s} {name:22s} {us:7.2f} us  {pct:5.1f}% of bandwidth "
                    f"(bytes' time {1e6 * nbytes / bandwidth:6.2f} us)")
    if args.out:
        args.out.write_text(json.dumps(dict(bandwidth=bandwidth, rows=results), indent=1))
    if args.best:
        best = best_tiles(results)
        args.best.write_text(json.dumps(best))
        log(f"fastest FP8 tiles where not the module's: {best or 'none'}")


if __name__ == "__main__":
    main()
