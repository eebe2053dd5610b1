"""The CPU compile path (fuser/compile_cpu.py): fused ops inlined for Inductor's C++ backend,
fixed-T steps compiled without Dynamo, greedy output still Hugging Face's, and engine files that
load their saved compiled code without compiling again."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from engine_dirs import ROOT
from engines import assert_greedy_matches, hf_greedy, perturbed, prompts
from fuser.build import CPU_INDUCTOR_MIN_PARAMETERS, compile_mode
from fuser.compile import CompiledStep as CpuStep
from fuser.ops import CPU_INLINE
from fuser.ops.attention import cache_attention_grouped, cache_attention_reference
from fuser.runtime.steps import DECODE, verify
from tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 160
SHAPE = dict(vocab=VOCAB, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2,
             init_range=0.3, bos=None, eos=None, pad=None)
GAMMA = 3


def attention_case(B, KV, rep, T, D, S, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, KV * rep, D, generator=g).to(dtype).transpose(1, 2)  # [B, H, T, D]
    k = torch.randn(B, S, KV, D, generator=g).to(dtype)
    v = torch.randn(B, S, KV, D, generator=g).to(dtype)
    seq_lens = torch.randint(0, S - T + 1, (B,), generator=g)
    starts = (torch.rand(B, generator=g) * (seq_lens + 1).float()).long()  # <= seq_lens
    return q, k, v, seq_lens, starts


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), KV=st.integers(1, 3), rep=st.integers(1, 4), T=st.integers(1, 9),
       D=st.sampled_from([16, 64, 80]), extra=st.integers(0, 40), window=st.sampled_from([0, 5]),
       softcap=st.sampled_from([0.0, 30.0]), seed=st.integers(0, 2**16))
def test_grouped_attention_is_the_reference(B, KV, rep, T, D, extra, window, softcap, seed):
    q, k, v, seq_lens, starts = attention_case(B, KV, rep, T, D, T + extra, seed)
    ref = cache_attention_reference(q, k, v, seq_lens, starts, D**-0.5, window, softcap)
    out = cache_attention_grouped(q, k, v, seq_lens, starts, D**-0.5, window, softcap)
    assert out.shape == ref.shape and out.is_contiguous()
    # The same fp32 math; only the GEMMs' blocking differs: a few ulps of max|v|.
    assert (out - ref).abs().max() <= 1e-6 * v.abs().max()


def test_inline_functions_compute_what_the_ops_compute_on_cpu():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 2, 48, generator=g), torch.randn(3, 2, 48, generator=g)
    w, eps = torch.randn(48, generator=g), 1e-6
    q, k = torch.randn(3, 4, 2, 16, generator=g), torch.randn(3, 2, 2, 16, generator=g)
    cos, sin = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    cases = {
        torch.ops.fuser.rms_norm.default: (x, w, eps),
        torch.ops.fuser.add_rms_norm.default: (x, r, w, eps),
        torch.ops.fuser.rotary.default: (q, k, cos, sin),
        torch.ops.fuser.gated_act.default: (torch.randn(3, 2, 64, generator=g), "silu"),
        torch.ops.fuser.linear.default: (x, torch.randn(40, 48, generator=g)),
    }
    for op, args in cases.items():
        want, got = op(*args), CPU_INLINE[op](*args)
        for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (want, got))):
            assert torch.equal(a, b) and b.is_contiguous(), op
    attention = attention_case(2, 2, 2, 3, 16, 20, seed=1)
    for op in (torch.ops.fuser.cache_attention.default, torch.ops.fuser.cache_attention_read.default):
        want, got = op(*attention, 0.25, 0, 0.0), CPU_INLINE[op](*attention, 0.25, 0, 0.0)
        assert torch.allclose(want, got, rtol=0, atol=1e-6), op


def test_auto_compiles_on_cpu_from_a_million_parameters():
    small = tiny_model("llama", **SHAPE)
    assert sum(p.numel() for p in small.parameters()) < CPU_INDUCTOR_MIN_PARAMETERS
    large = tiny_model("llama", vocab=4096, heads=4, kv_heads=2, head_dim=32, layers=2)
    assert sum(p.numel() for p in large.parameters()) >= CPU_INDUCTOR_MIN_PARAMETERS
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = fuser.FuserConfig()
    assert compile_mode(auto, cpu, small) == "fx" and compile_mode(auto, cpu, large) == "inductor"
    assert compile_mode(auto, cuda, small) == "inductor"
    assert compile_mode(fuser.FuserConfig(compile="fx"), cpu, large) == "fx"
    assert compile_mode(fuser.FuserConfig(compile="inductor"), cpu, small) == "inductor"


@pytest.fixture(scope="module")
def compiled():
    """A speculative engine on tiny models with every fixed-T step compiled for the CPU, and
    its HF target."""
    # One layer: the layer's ops are those of any other layer, and the C++ compiles of the
    # fixed-T steps take half as long as at two (CI time).
    target = tiny_model("llama", seed=0, **{**SHAPE, "layers": 1})
    # One batch bucket: each bucket's fixed-T steps are C++ compiles of their own (CI time).
    config = fuser.FuserConfig(max_seq_len=48, max_batch_size=3, gamma=GAMMA,
                               compile="inductor", batch_buckets=(3,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3), config=config)
    assert engine.report().fallbacks == []
    return engine, target


@torch.no_grad()
def test_fixed_steps_are_compiled_and_match_the_fx_graph(compiled):
    engine, _ = compiled
    for model in (engine.target, engine.draft):
        for kind, graph in model.steps.items():
            assert isinstance(graph.compiled, CpuStep) == kind.fixed, graph.name
    target = engine.target
    cache = target.cache
    B = cache.batch_size
    for kind in (DECODE, verify(GAMMA)):
        graph = target[kind]
        T = kind.tokens
        g = torch.Generator().manual_seed(T)
        tokens = torch.randint(0, VOCAB, (B, T), generator=g)
        lens = torch.tensor([5, 0, 17])
        positions = lens[:, None] + torch.arange(T)
        outs, written = [], []
        for step in (graph.rewritten, graph.compiled):  # the FX graph, then the compiled one
            for t in cache.k + cache.v:
                t.zero_()
            cache.seq_lens.copy_(lens)
            outs.append(step(tokens, positions, cache.seq_lens, cache.starts))
            written.append([t.clone() for t in cache.k + cache.v])
        cache.reset()
        error = (outs[1] - outs[0]).norm() / outs[0].norm()
        assert error < 1e-5, (graph.name, error)
        for a, b in zip(*written):  # the cache writes, in place, at slots lens .. lens + T - 1
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5) and b.abs().sum() > 0


def test_greedy_speculative_output_is_hugging_faces(compiled):
    engine, target = compiled
    ids, mask = prompts([4, 9, 6], seed=5)
    ref, near_tie = hf_greedy(target, ids, mask, 24)
    assert_greedy_matches(engine.generate(ids, 24, attention_mask=mask), ref, near_tie, ids, [])
    engine.fix_gamma(0)
    try:
        assert_greedy_matches(engine.generate(ids, 24, attention_mask=mask), ref, near_tie, ids, [])
    finally:
        engine.fix_gamma(None)


# The fresh process keeps torch's default thread count (the build ran with one thread): the
# compiled code must not depend on it.
LOAD = """
import json, sys, torch
import fuser
from fuser.compile import compile_count
engine = fuser.load(sys.argv[1])
ids, mask = torch.load(sys.argv[2])
out = engine.generate(ids, 16, attention_mask=mask)
print(json.dumps({"tokens": out.tolist(), "compiles": compile_count()}))
"""


def test_engine_file_loads_its_compiled_code_in_a_fresh_process(compiled, tmp_path):
    engine, _ = compiled
    engine.save(tmp_path / "engine")
    ids, mask = prompts([4, 9, 6], seed=6)
    torch.save((ids, mask), tmp_path / "inputs.pt")
    done = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "engine"),
                           str(tmp_path / "inputs.pt")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["compiles"] == 0, result  # nothing traced or compiled: the saved code runs
    assert torch.equal(torch.tensor(result["tokens"]), engine.generate(ids, 16, attention_mask=mask))
