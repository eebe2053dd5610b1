"""Tensor parallelism on the CPU: the sharding pass (passes/tensor_parallel.py) and the
collective ops (fuser/ops/collectives.py).

Two gloo processes run every supported family's sharded prefill and decode steps
(tests/tensor_parallel_worker.py) against the unsharded graphs; in one process, hypothesis
shards graphs over configs and world sizes 2 and 4 and runs the world_size rank graphs in
lockstep, summing (or concatenating) at each collective as the process group would.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from fuser.ops.collectives import all_gather_reference, all_reduce_reference
from fuser.passes.tensor_parallel import SOURCE, add_collectives, shard_cache, shard_graph
from fuser.rank_model import ModuleWeights, rank_model
from ranks import free_port, run_ranks
from tensor_parallel_worker import (CACHE, CONFIGS, DECODE_STEPS, cache_of, model_step_graphs,
                                    step_graphs, step_model)

WORKER = Path(__file__).parent / "tensor_parallel_worker.py"
TIMEOUT_S = 240  # a hung collective fails the test instead of blocking CI
ALL_REDUCE = torch.ops.fuser.all_reduce.default
ALL_GATHER = torch.ops.fuser.all_gather.default


def _attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value  # type: ignore[return-value]


def lockstep(gms: list[torch.fx.GraphModule], args: tuple) -> list[torch.Tensor]:
    """Run the rank graphs of one step node by node, together: at fuser::all_reduce every rank
    gets the sum of the ranks' inputs, at fuser::all_gather their concatenation (what the
    process group computes). Returns every rank's output."""
    envs: list[dict] = [{} for _ in gms]
    for group in zip(*(g.graph.nodes for g in gms)):
        first = group[0]
        assert all(n.op == first.op and n.target == first.target for n in group)
        if first.op == "output":  # export's graphs return (logits,), their modules logits
            return [torch.fx.map_arg(n.args[0][0] if isinstance(n.args[0], (tuple, list))
                                     else n.args[0], env.__getitem__)
                    for n, env in zip(group, envs)]
        if first.target in (ALL_REDUCE, ALL_GATHER):
            combine = all_reduce_reference if first.target is ALL_REDUCE else all_gather_reference
            total = combine([env[n.args[0]] for n, env in zip(group, envs)])
            for n, env in zip(group, envs):
                env[n] = total.clone()
            continue
        for gm, n, env in zip(gms, group, envs):
            if n.op == "placeholder":
                env[n] = args[len([m for m in env if m.op == "placeholder"])]
            elif n.op == "get_attr":
                env[n] = _attr(gm, str(n.target))
            elif n.op == "call_module":  # export's input guards
                env[n] = None
            else:
                env[n] = n.target(*torch.fx.map_arg(n.args, env.__getitem__),
                                  **torch.fx.map_arg(n.kwargs, env.__getitem__))
    raise AssertionError("graph without output")


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")]),
])
def test_two_processes_equal_the_unsharded_model(tmp_path: Path, device: str) -> None:
    """2 ranks (gloo on the CPU, NCCL on 2 GPUs): every family's prefill and decode logits
    equal the unsharded step's within 1e-5 (fp32), greedy tokens are equal, and each rank's
    cache holds its KV heads."""
    world_size, port = 2, free_port()
    # NVLink multicast off (NVLS, symmetric memory): not available on the machines we test on
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    if sys.platform == "linux":  # gloo over loopback, whether or not the hostname resolves
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    outs = [tmp_path / f"rank{r}.pt" for r in range(world_size)]
    run_ranks([[sys.executable, str(WORKER), str(r), str(world_size), str(port), str(outs[r]),
                device] for r in range(world_size)], env, TIMEOUT_S)
    results = [torch.load(o) for o in outs]
    assert set(results[0]) == set(CONFIGS)
    for family in CONFIGS:
        for r, res in enumerate(results):
            res = res[family]
            ref_logits, ref_tokens = res["reference"]
            runs = ["sharded", "graphed"] if device == "cuda" else ["sharded"]
            for run in runs:  # graphed: the decode steps replayed from CUDA graphs
                logits, tokens = res[run]
                assert len(logits) == DECODE_STEPS + 1
                for step, (out, ref) in enumerate(zip(logits, ref_logits)):
                    torch.testing.assert_close(
                        out, ref, atol=1e-5, rtol=1e-5,
                        msg=lambda m: f"{family} rank {r} {run} step {step}: {m}")
                assert torch.equal(tokens, ref_tokens), (family, r, run)
            assert res["cache_shape"] == (2, CACHE, CONFIGS[family]["kv_heads"] // world_size,
                                          16)


@st.composite
def tp_cases(draw: st.DrawFn) -> dict[str, object]:
    world_size = draw(st.sampled_from([2, 4]))
    kv_heads = world_size * draw(st.sampled_from([1, 2]))
    return dict(
        family=draw(st.sampled_from(sorted(CONFIGS))),
        world_size=world_size,
        kv_heads=kv_heads,
        heads=kv_heads * draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([8, 12])),
        intermediate=world_size * draw(st.sampled_from([10, 18])),
        tie=draw(st.booleans()),
        lm_head=draw(st.sampled_from(["vocab", "replicated"])),
        biases=draw(st.booleans()),
    )


def assert_ranks_equal_unsharded(ranks: list, decode: torch.fx.GraphModule,
                                 g: torch.Generator, B: int, T: int) -> None:
    """The ranks' decode graphs, run in lockstep on random tokens, each give the unsharded
    graph's logits (fp32, within 1e-5)."""
    lens = torch.tensor([3, 5])
    args = (torch.randint(3, 160, (B, T), generator=g), lens[:, None] + torch.arange(T), lens,
            torch.tensor([0, 1]))
    with torch.no_grad():
        ref = decode(*args)
        outs = lockstep(ranks, args)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=8, deadline=None, derandomize=True,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking: minutes
@given(case=tp_cases())
def test_sharding_over_configs(case: dict[str, object]) -> None:
    """Each weight's slice, each reshape's per-rank head count, the collectives' count, and the
    ranks' decode logits (collectives emulated in one process) against the unsharded graph,
    over a random cache."""
    ws, heads, kv_heads, head_dim = (case["world_size"], case["heads"], case["kv_heads"],
                                     case["head_dim"])
    B, S, T, layers = 2, 8, 2, 1
    family = "llama" if case["biases"] else case["family"]  # biases: Llama's own options
    _, decode = step_graphs(family, B, S, 3, decode_tokens=T, layers=layers, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim,
                            intermediate=case["intermediate"], tie=case["tie"],
                            biases=case["biases"])
    g = torch.Generator().manual_seed(0)
    for t in cache_of(decode).values():
        t.copy_(torch.randn(t.shape, generator=g))
    ranks = [shard_graph(decode, r, ws, lm_head=case["lm_head"]) for r in range(ws)]

    # weights: rank r holds the r-th chunk along the sliced dim; together they are the weight
    sliced = {}
    for r, gm in enumerate(ranks):
        for node in gm.graph.find_nodes(op="get_attr"):
            if SOURCE in node.meta:
                sliced.setdefault(node.meta[SOURCE], []).append(_attr(gm, str(node.target)))
    names = {target.rsplit(".", 2)[-2] for target, _ in sliced}
    column = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    # (a tied head is exported under lm_head's name, the embedding reading it too)
    assert names == column | {"o_proj", "down_proj"} | (
        {"lm_head"} if case["lm_head"] == "vocab" else set())
    for (target, dim), parts in sliced.items():
        whole = _attr(decode, target)
        assert dim == (1 if target.rsplit(".", 2)[-2] in ("o_proj", "down_proj") else 0)
        assert all(p.shape[dim] * ws == whole.shape[dim] for p in parts)
        assert torch.equal(torch.cat(parts, dim), whole)

    # reshapes: attention runs on the rank's heads over its KV heads; its cache is its slice
    for r, gm in enumerate(ranks):
        (attn, *_) = [n for n in gm.graph.nodes if n.target is torch.ops.fuser.cache_attention
                      .default]
        q, k = attn.args[0].meta["val"], attn.args[1].meta["val"]
        assert tuple(q.shape) == (B, heads // ws, T, head_dim)
        assert tuple(k.shape) == (B, S, kv_heads // ws, head_dim)
        n = kv_heads // ws
        (embedding,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding
                                           .default)
        assert SOURCE not in embedding.args[0].meta  # the whole table, tied or not
        assert torch.equal(gm.k_cache_0, decode.k_cache_0[:, :, r * n:(r + 1) * n])
        count = {op: sum(1 for x in gm.graph.nodes if x.target is op)
                 for op in (ALL_REDUCE, ALL_GATHER)}
        assert count == {ALL_REDUCE: 2 * layers, ALL_GATHER: int(case["lm_head"] == "vocab")}

    assert_ranks_equal_unsharded(ranks, decode, g, B, T)


@settings(max_examples=4, deadline=None, derandomize=True,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # an export per rank: seconds
@given(case=tp_cases())
def test_rank_models_over_configs(case: dict[str, object]) -> None:
    """The engine's path (fuser/build.py `build_shard`): each rank's decode graph exported from
    its share of the model (fuser/rank_model.py) over its KV heads' slice of the cache, with
    `add_collectives`: 2 all-reduces a layer and one all-gather, and the ranks' logits
    (collectives emulated in one process) equal the unsharded graph's, over a random cache."""
    ws = case["world_size"]
    B, S, T, layers = 2, 8, 2, 1
    family = "llama" if case["biases"] else case["family"]
    model = step_model(family, biases=case["biases"], layers=layers, heads=case["heads"],
                       kv_heads=case["kv_heads"], head_dim=case["head_dim"],
                       intermediate=case["intermediate"], tie=case["tie"])
    _, decode = model_step_graphs(model, B, S, 3, decode_tokens=T)
    g = torch.Generator().manual_seed(0)
    cache = cache_of(decode)
    for t in cache.values():
        t.copy_(torch.randn(t.shape, generator=g))
    ranks = []
    for r in range(ws):
        share = rank_model(type(model), model.config, ModuleWeights(model), r, ws,
                           torch.float32, torch.device("cpu"))
        _, gm = model_step_graphs(share, B, S, 3, decode_tokens=T)
        for name, t in cache_of(gm).items():
            t.copy_(shard_cache(cache[name], r, ws))
        ranks.append(add_collectives(gm, ws))
        count = {op: sum(1 for x in gm.graph.nodes if x.target is op)
                 for op in (ALL_REDUCE, ALL_GATHER)}
        assert count == {ALL_REDUCE: 2 * layers, ALL_GATHER: 1}
    assert_ranks_equal_unsharded(ranks, decode, g, B, T)


def test_refuses_a_world_size_that_does_not_divide_the_heads() -> None:
    _, decode = step_graphs("llama", 1, 8, 3, layers=1, heads=6, kv_heads=3, intermediate=42)
    with pytest.raises(ValueError, match=r"KV heads 3 not divisible by 2"):
        shard_graph(decode, 0, 2)
    with pytest.raises(ValueError, match=r"attention heads 6, KV heads 3, intermediate size 42 "
                                         r"not divisible by 4"):
        shard_graph(decode, 0, 4, lm_head="replicated")
    with pytest.raises(ValueError, match=r"vocabulary size .* not divisible by 3"):
        shard_graph(decode, 0, 3)
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        shard_graph(decode, 2, 2)


def test_collectives_without_a_process_group() -> None:
    """One rank: all_reduce is a copy (a new tensor), all_gather of world size 1 too; the fake
    implementations give the shapes."""
    x = torch.randn(3, 4)
    y = torch.ops.fuser.all_reduce(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    assert torch.equal(torch.ops.fuser.all_gather(x, 1), x)
    with pytest.raises(ValueError, match="world size 2"):
        torch.ops.fuser.all_gather(x, 2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(3, 4)
        assert torch.ops.fuser.all_gather(fake, 4).shape == (3, 16)
        assert torch.ops.fuser.all_reduce(fake).shape == (3, 4)


@pytest.mark.parametrize("value, message", [
    (0, "tensor_parallel=0 must be a positive int"),
    (True, "tensor_parallel=True must be a positive int"),
    (1.5, "tensor_parallel=1.5 must be a positive int"),
])
def test_config_refuses_tensor_parallel_engines(value: object, message: str) -> None:
    import fuser

    with pytest.raises(ValueError, match=message):
        fuser.FuserConfig(tensor_parallel=value)
    assert fuser.FuserConfig(tensor_parallel=1).tensor_parallel == 1
    assert fuser.FuserConfig(tensor_parallel=2).tensor_parallel == 2


def test_fusion_passes_run_on_the_sharded_graph() -> None:
    """The sharded graph goes through run_passes as captured graphs do: every fusion the
    unsharded graph gets matches on each rank too (the collectives stay between the fused
    ops), and the ranks' logits still equal the unsharded step's."""
    from fuser.passes import run_passes
    from fuser.passes.fx import count_fuser_ops
    from tiny import pass_context

    B, S, T = 1, 8, 1
    _, decode = step_graphs("qwen2", B, S, 3, decode_tokens=T, layers=1)
    g = torch.Generator().manual_seed(0)
    for t in cache_of(decode).values():
        t.copy_(torch.randn(t.shape, generator=g))
    ranks = [shard_graph(decode, r, 2) for r in range(2)]
    fused = shard_graph(decode, 0, 1)  # a copy, world size 1: no collectives
    expected = run_passes(fused, pass_context("target.decode"))
    assert not expected.errors
    for gm in ranks:
        result = run_passes(gm, pass_context("target.decode"))
        assert not result.errors and result.matches == expected.matches
        assert count_fuser_ops(gm) == {**count_fuser_ops(fused), "all_reduce": 2,
                                       "all_gather": 1}
    lens = torch.tensor([3])
    args = (torch.randint(3, 160, (B, T), generator=g), lens[:, None] + torch.arange(T), lens,
            torch.tensor([0]))
    with torch.no_grad():
        ref = decode(*args)
        outs = lockstep(ranks, args)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prefill_sharded_with_t_symbolic() -> None:
    """Prefill's export (T dynamic, as the engine builds it) shards as one graph: the views
    keep T symbolic, and at two prompt lengths the ranks (collectives emulated) equal the
    unsharded graph within 1e-5, as does each rank's cache slice."""
    from fuser.capture import StepModule, engine_view, export_step
    from tiny import tiny_model

    B, S = 2, 16
    model = tiny_model("qwen2", seed=0, init_range=0.3, heads=4, kv_heads=2, tie=True)
    view = engine_view(model, torch.float32, torch.device("cpu"))
    k = [torch.zeros(B, S, 2, 16) for _ in range(2)]
    v = [torch.zeros(B, S, 2, 16) for _ in range(2)]
    _, prefill = export_step(StepModule(view, k, v, prefill=True), B, None, S)
    ranks = [shard_graph(prefill, r, 2) for r in range(2)]
    for gm in ranks:
        (tokens, *_) = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert not isinstance(tokens.meta["val"].shape[1], int)  # T stays symbolic
        for node in gm.graph.nodes:  # static dims stay ints (an engine file stores the args)
            values: list = []
            torch.fx.node.map_aggregate((node.args, node.kwargs), values.append)
            assert not any(isinstance(x, torch.SymInt) for x in values), node.format_node()
        for node in gm.graph.find_nodes(op="get_attr"):  # and in the shapes passes read
            assert all(isinstance(d, int) for d in node.meta["val"].shape), node.format_node()
    g = torch.Generator().manual_seed(0)
    for T in (3, 7):
        zeros = torch.zeros(B, dtype=torch.long)
        args = (torch.randint(3, 160, (B, T), generator=g),
                torch.arange(T)[None].expand(B, T).contiguous(), zeros, zeros)
        with torch.no_grad():
            ref = prefill(*args)  # [B, T, V]
            outs = lockstep(ranks, args)
        for r, (gm, out) in enumerate(zip(ranks, outs)):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gm.k_cache_1, prefill.k_cache_1[:, :, r:r + 1],
                                       atol=1e-5, rtol=1e-5)
