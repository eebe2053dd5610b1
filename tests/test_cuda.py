"""The engine on a CUDA device: Inductor-compiled steps replayed as CUDA graphs (skips on CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fuser
from engines import assert_greedy_matches
from fuser.numerics import NEAR_TIE
from tiny import random_prompts, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_same_greedy(plain: fuser.Engine, spec: fuser.Engine, lengths: list[int], seed: int,
                       new_tokens: int, fp8_model: torch.nn.Module | None = None,
                       fp8_lm_head: bool = True) -> None:
    """Greedy output of `spec` (with its draft) equals `plain`'s (target only) on random ragged
    prompts, and the verify graph was replayed.

    Same kernels (bf16, fp16): token for token. FP8 (fp8_model, the target): verify (pieces on
    the FP8 MMA) and decode (one row) sum in other orders, so, as DESIGN.md's numerics contract
    says, tokens are compared up to each row's first near-tie of the reference, here the target
    with FP8 emulated (fp8_reference_logits, near_ties); after it the two may legitimately
    differ."""
    vocab = plain.vocab_size
    ids, mask = random_prompts(len(lengths), lengths, vocab, seed=seed)
    ids, mask = ids.cuda(), mask.cuda()
    a = plain.generate(ids, new_tokens, attention_mask=mask, eos_token_id=[vocab - 1])
    b = spec.generate(ids, new_tokens, attention_mask=mask, eos_token_id=[vocab - 1])
    if fp8_model is None:
        assert torch.equal(a, b), divergence(plain.logits(a, attention_mask=extended(mask, a)),
                                             a, b, mask)
    else:
        logits = fp8_reference_logits(fp8_model, a, mask, fp8_lm_head)
        try:
            assert_greedy_matches(b.cpu(), a.cpu(), near_ties(logits, mask.shape[1]).cpu(),
                                  ids.cpu(), [vocab - 1])
        except AssertionError:
            raise AssertionError(divergence(logits, a, b, mask)) from None
    assert spec.report().graph_replays["target.verify"] > 0


def extended(mask: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The prompt's attention mask extended over a's generated tokens."""
    return torch.cat([mask, torch.ones_like(a[:, mask.shape[1]:])], dim=1)


def fp8_reference_logits(model: torch.nn.Module, a: torch.Tensor, mask: torch.Tensor,
                         fp8_lm_head: bool) -> torch.Tensor:
    """The logits [B, S, V] that an FP8 engine approximates over sequences a (left-padded
    prompts of mask's width, then generated tokens): `model` with FP8 emulated, the prompt's
    positions as prefill (per-token activation round trip), the rest as decode."""
    from fuser.ops.fp8 import emulated_fp8

    full = extended(mask, a)
    positions = (full.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), emulated_fp8(model, lm_head=fp8_lm_head, prefill_tokens=mask.shape[1]):
        return model(input_ids=a, attention_mask=full, position_ids=positions).logits.float()


def near_ties(logits: torch.Tensor, T: int) -> torch.Tensor:
    """[B, n] bool: where the logits that chose each of the n new tokens (positions T - 1 ..
    S - 2) have top-2 within NEAR_TIE (DESIGN.md, numerics contract)."""
    top2 = logits[:, T - 1:-1].topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]) < NEAR_TIE


def divergence(logits: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> str:
    """Where target-only output a and speculative output b first differ, per row, with the
    top-2 of the reference logits over a there: tells a flip between (near-)tied logits from a
    wrong value."""
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} against {tuple(b.shape)}"
    T = mask.shape[1]
    lines = []
    for row in range(a.shape[0]):
        differ = (a[row] != b[row]).nonzero()
        if len(differ):
            i = int(differ[0])
            top = logits[row, i - 1].topk(2)
            lines.append(f"row {row}: new token {i - T} is {int(a[row, i])} target-only, "
                         f"{int(b[row, i])} speculative; reference top-2 there "
                         f"{top.indices.tolist()} = {top.values.tolist()}")
    return "; ".join(lines)


def test_fp32_greedy_equals_hugging_face_and_decode_replays() -> None:
    model = tiny_model("llama", layers=2).to("cuda")
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_seq_len=64))
    ids, _ = random_prompts(1, [9], model.config.vocab_size, seed=0)
    ids = ids.cuda()
    out = engine.generate(ids, 16, eos_token_id=[model.config.vocab_size - 1])
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0,
                         eos_token_id=model.config.vocab_size - 1)
    assert torch.equal(out.cpu(), ref.cpu())
    assert engine.report().graph_replays["target.decode"] >= 15


def test_bf16_speculative_equals_target_only_and_replays() -> None:
    target = tiny_model("qwen2", layers=2, dtype=torch.bfloat16).to("cuda")
    draft = tiny_model("qwen2", layers=1, seed=1, dtype=torch.bfloat16).to("cuda")
    config = fuser.FuserConfig(max_seq_len=64, max_batch_size=2, gamma=4)
    plain = fuser.optimize(target, config=config)
    spec = fuser.optimize(target, draft=draft, config=config)
    # DESIGN.md: bf16 speculative greedy == fuser's own target-only greedy
    assert_same_greedy(plain, spec, [7, 4], seed=1, new_tokens=24)
    assert spec.report().graph_replays["draft.decode"] > 0


def test_fused_attention_engine_agrees_with_eager_and_speculates() -> None:
    # fuser::rotary_cache_attention's Triton kernels (the split-K attention with rotary and the
    # cache write folded in) in the decode, verify and catch-up graphs,
    # replayed as CUDA graphs: the engine's own self-check against eager Hugging Face must pass
    # (no fallback), and bf16 speculative greedy must equal target-only greedy.
    target = tiny_model("llama", layers=2, dtype=torch.bfloat16).to("cuda")
    draft = tiny_model("llama", layers=1, seed=1, dtype=torch.bfloat16).to("cuda")
    config = fuser.FuserConfig(max_seq_len=96, max_batch_size=2, gamma=4, fused_attention=True)
    plain = fuser.optimize(target, config=config)
    spec = fuser.optimize(target, draft=draft, config=config)
    assert plain.report().fallbacks == [] and spec.report().fallbacks == []
    graphs = spec.report().graphs
    assert graphs["target.verify"]["rotary_cache_attention"] == target.config.num_hidden_layers
    assert_same_greedy(plain, spec, [9, 5], seed=3, new_tokens=40)


def test_decode_gemv_in_every_fixed_step_and_no_fallback() -> None:
    # fuser::linear's Triton kernel in the decode and verify CUDA graphs (tiny shapes: cuBLAS is
    # preferred for none of them): the engine's self-check against eager must pass.
    target = tiny_model("mistral", layers=2, dtype=torch.bfloat16).to("cuda")
    draft = tiny_model("mistral", layers=1, seed=1, dtype=torch.bfloat16).to("cuda")
    engine = fuser.optimize(target, draft=draft,
                            config=fuser.FuserConfig(max_seq_len=64, max_batch_size=2, gamma=3))
    report = engine.report()
    assert report.fallbacks == []
    layers = target.config.num_hidden_layers
    for name in ("target.decode", "target.verify"):
        fused = report.graphs[name]
        if "linear_residual" in fused:
            # several rows (norm_stats): o_proj and down_proj add the residual and sum the
            # squares; qkv, gate_up (with its activation) and the LM head after them take rstd
            # from those sums
            assert fused["linear_residual"] == fused["stats_rms_norm_linear"] == 2 * layers
            assert "linear" not in fused and "add_rms_norm_linear" not in fused, name
        else:
            # o_proj, down_proj per layer; qkv, gate_up (with its activation) and the LM head
            # behind their norms, in one kernel each (norm_linear)
            assert fused["linear"] == 2 * layers, name
            assert fused["add_rms_norm_linear"] == 2 * layers, name
        assert fused["rms_norm_linear"] == 1, name
        assert "gated_linear" not in report.graphs[name], name
        assert "gated_act" not in report.graphs[name], name
    assert "linear" not in report.graphs["target.prefill"]
    assert "gated_linear" not in report.graphs["target.prefill"]
    ids, mask = random_prompts(2, [6, 9], target.config.vocab_size, seed=5)
    out = engine.generate(ids.cuda(), 12, attention_mask=mask.cuda(),
                          eos_token_id=[target.config.vocab_size - 1])
    assert out.shape == (2, ids.shape[1] + 12)


@pytest.mark.parametrize("fp8_lm_head", [True, False])
def test_fp8_speculative_on_e4m3_pieces_equals_target_only(fp8_lm_head: bool) -> None:
    # precision="fp8": the verify graph's FP8 GEMVs take x as e4m3 pieces (the norm kernel
    # splits before qkv, gate/up and the LM head, the split kernel before down_proj, here before
    # o_proj too), captured into the graph (the spies see the calls at capture); greedy
    # speculative output equals FP8 target-only greedy, and the engine's
    # self-check passes (no fallback). fp8_lm_head=False: a bf16 LM head, whose norm then moves
    # into the last down_proj (norm_stats' producer, on that row's e4m3 pieces).
    from unittest import mock

    from fuser.ops import fp8_linear, norm_linear

    # init_range 0.3: logits that rarely nearly tie (tests/tiny.py). At 0.02 the bf16 LM head's
    # run diverged on the H200 at new token 19 of row 1, where the FP8-emulated target's top-2
    # tie exactly (margin 0.0): compared up to near-ties since then.
    target = tiny_model("llama", layers=2, dtype=torch.bfloat16, init_range=0.3).to("cuda")
    draft = tiny_model("llama", layers=1, seed=1, dtype=torch.bfloat16, init_range=0.3).to("cuda")
    config = fuser.FuserConfig(max_seq_len=64, max_batch_size=2, gamma=4, precision="fp8",
                               fp8_lm_head=fp8_lm_head)
    plain = fuser.optimize(target, config=config)
    norm_spy = mock.Mock(wraps=norm_linear.add_rms_norm_pieces_triton)
    split_spy = mock.Mock(wraps=fp8_linear.split_pieces_triton)
    with mock.patch.object(norm_linear, "add_rms_norm_pieces_triton", norm_spy), \
            mock.patch.object(fp8_linear, "split_pieces_triton", split_spy), \
            mock.patch.object(fp8_linear, "SPLIT_PIECES_MIN_K", 0):  # tiny rows split too
        spec = fuser.optimize(target, draft=draft, config=config)
    assert norm_spy.call_count > 0 and split_spy.call_count > 0
    assert plain.report().fallbacks == [] and spec.report().fallbacks == []
    assert_same_greedy(plain, spec, [7, 4], seed=2, new_tokens=24, fp8_model=target,
                       fp8_lm_head=fp8_lm_head)


FAILED_CAPTURE = """
import torch
from fuser.runtime.cuda_graphs import capture_graph

device = torch.device("cuda")
pool = torch.cuda.graph_pool_handle()
x = torch.ones(4, device=device)
try:  # a device-wide sync inside the capture invalidates it, and its end fails
    capture_graph(torch.cuda.CUDAGraph(), lambda: (x * 2, torch.cuda.synchronize()), pool, device)
except Exception as e:
    print("capture failed:", type(e).__name__)
else:
    raise SystemExit("the capture did not fail")
print("random numbers:", torch.randn(8, device=device).abs().sum().item() > 0)
graph = torch.cuda.CUDAGraph()  # the next capture into the same pool
y = capture_graph(graph, lambda: x * 3, pool, device)
x.fill_(2.0)
graph.replay()
print("same pool again:", y.tolist() == [6.0] * 4)
"""

# Captured graphs left in reference cycles just before a capture whose function makes enough
# cyclic garbage for Python's collector to run on its own: a collection mid-capture would
# destroy the old graphs inside the new capture. (The cycles are made right after a full
# collection, young: the first automatic collection would free them.)
GARBAGE_IN_CAPTURE = """
import gc
import torch
from fuser.runtime.cuda_graphs import capture_graph

device = torch.device("cuda")
pool = torch.cuda.graph_pool_handle()
x = torch.ones(4, device=device)
graphs = [torch.cuda.CUDAGraph() for _ in range(4)]
for old in graphs:
    capture_graph(old, lambda: x + 1, pool, device)


class Holder:
    pass


gc.collect()
for old in graphs:
    holder = Holder()
    holder.graph, holder.me = old, holder
del graphs, old, holder


def garbage():
    for _ in range(20000):
        a = []
        a.append(a)
    return x * 5


graph = torch.cuda.CUDAGraph()
y = capture_graph(graph, garbage, pool, device)
graph.replay()
print("captured beside garbage:", y.tolist() == [5.0] * 4)
"""


def test_a_failed_capture_leaves_the_random_numbers_and_its_pool_working() -> None:
    """A capture that fails leaves the default CUDA generator out of capture mode (random
    numbers drawn afterwards work: runtime/cuda_graphs.py `release_generator`; without it they
    raise "Offset increment outside graph capture encountered unexpectedly", which broke a
    later test's Inductor autotuning on the same xdist worker), and the next capture given the
    same pool handle able to record (into a new pool, `live_pool`: without `_release_capture`
    it fails with "beginAllocateToPool: already recording to mempool_id", as every suffix step
    after one failed shape did). In a fresh process: a broken generator or pool would break
    every test after this one."""
    done = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "capture failed:" in done.stdout and "random numbers: True" in done.stdout
    assert "same pool again: True" in done.stdout, done.stdout + done.stderr


def test_a_capture_survives_the_garbage_collector_freeing_old_graphs() -> None:
    """Old captured graphs in reference cycles and a captured function that makes cyclic
    garbage: the collector does not run inside the capture (`capture_graphs` holds it off), so
    no old graph is destroyed mid-capture and the capture holds. In a fresh process."""
    done = subprocess.run([sys.executable, "-c", GARBAGE_IN_CAPTURE], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "captured beside garbage: True" in done.stdout, done.stdout + done.stderr


