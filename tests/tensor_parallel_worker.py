"""One rank of the tensor-parallel test (tests/test_tensor_parallel.py), and the step graphs it
shards.

    python tests/tensor_parallel_worker.py RANK WORLD_SIZE PORT OUT [cpu|cuda]

joins a process group at 127.0.0.1:PORT (gloo on the CPU; NCCL on cuda:RANK) and, for every
supported family's tiny model, runs a prefill step and DECODE_STEPS greedy decode steps twice:
through the unsharded step graphs, and through this rank's sharded ones
(passes/tensor_parallel.py, the collectives over the process group). Both sets of logits and
tokens go to OUT (torch.save) for the test to compare.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import tiny_model  # noqa: E402

BATCH, CACHE, PROMPT, DECODE_STEPS = 2, 16, 5, 3
# Per family: the tiny config of the test (Mistral with a sliding window, Qwen2 with tied
# embeddings and its q/k/v biases); 4 heads over 2 KV heads, intermediate 72: TP=2 splits all.
CONFIGS: dict[str, dict[str, object]] = {
    "llama": dict(heads=4, kv_heads=2, intermediate=72),
    "mistral": dict(heads=4, kv_heads=2, intermediate=72, sliding_window=4),
    "qwen2": dict(heads=4, kv_heads=2, intermediate=72, tie=True),
}


def step_graphs(family: str, batch: int, cache_len: int, prompt_len: int, seed: int = 0,
                decode_tokens: int = 1, device: str = "cpu", biases: bool = False,
                **config: object) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """(prefill graph at T = prompt_len, decode graph at T = decode_tokens) of a tiny model of
    `family`, unfused, as capture.export_step gives them, both over one KV cache.

    biases: Llama with a bias on every projection (attention_bias, mlp_bias), o_proj's and
    down_proj's included."""
    model = step_model(family, seed, biases, **config)
    return model_step_graphs(model, batch, cache_len, prompt_len, decode_tokens, device)


def step_model(family: str, seed: int = 0, biases: bool = False,
               **config: object) -> torch.nn.Module:
    """The tiny model of `family` that `step_graphs` exports (init_range 0.3; biases: Llama
    with a bias on every projection, drawn non-zero)."""
    from tiny import FAMILIES, tiny_config

    if not biases:
        return tiny_model(family, seed=seed, init_range=0.3, **config)
    cfg = tiny_config(family, init_range=0.3, **config)
    cfg.attention_bias = cfg.mlp_bias = True
    torch.manual_seed(seed)
    model = FAMILIES[family][1](cfg).eval()
    with torch.no_grad():  # HF initializes biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
    return model


def model_step_graphs(model: torch.nn.Module, batch: int, cache_len: int, prompt_len: int,
                      decode_tokens: int = 1, device: str = "cpu"
                      ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """`step_graphs` of a given model (over a zero cache of its own KV heads)."""
    from fuser.capture import StepModule, engine_view, export_step

    view = engine_view(model.to(device), torch.float32, torch.device(device))
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = (batch, cache_len, c.num_key_value_heads, head_dim)
    k = [torch.zeros(shape, device=device) for _ in range(c.num_hidden_layers)]
    v = [torch.zeros(shape, device=device) for _ in range(c.num_hidden_layers)]
    _, prefill = export_step(StepModule(view, k, v, prefill=True), batch, prompt_len, cache_len)
    _, decode = export_step(StepModule(view, k, v, prefill=False), batch, decode_tokens,
                            cache_len)
    return prefill, decode


def cache_of(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The graph's KV-cache tensors by name."""
    return {str(n.target): getattr(gm, str(n.target)) for n in gm.graph.find_nodes(op="get_attr")
            if str(n.target).startswith(("k_cache_", "v_cache_"))}


class Graphed:
    """A decode step replayed from one CUDA graph over static inputs, captured at the first call
    (after a warm-up on a side stream: NCCL's communicator, the kernels, the allocator), as the
    engine's CUDA graphs capture steps with their collectives inside."""

    def __init__(self, step: torch.fx.GraphModule) -> None:
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.inputs = [a.clone() for a in args]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(*self.inputs)  # writes the slot the replay writes again
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.output = self.step(*self.inputs)
        for static, a in zip(self.inputs, args):
            static.copy_(a)
        self.graph.replay()
        return self.output.clone()


def generate(prefill: torch.fx.GraphModule, decode: torch.fx.GraphModule, tokens: torch.Tensor,
             steps: int, cuda_graph: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Greedy decoding through the two step graphs: (logits of every step, tokens [B, steps+1]).
    cuda_graph: the decode steps replayed from a CUDA graph (`Graphed`)."""
    B, T = tokens.shape
    device = tokens.device
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    step = Graphed(decode) if cuda_graph else decode
    with torch.no_grad():
        logits = [prefill(tokens, torch.arange(T, device=device)[None].expand(B, T).contiguous(),
                          zeros, zeros)]
        out = [logits[-1][:, -1].argmax(-1)]
        for i in range(steps):
            at = T + i
            logits.append(step(out[-1][:, None], torch.full((B, 1), at, device=device),
                               torch.full((B,), at, device=device), zeros))
            out.append(logits[-1][:, -1].argmax(-1))
    return [x.cpu() for x in logits], torch.stack(out, 1).cpu()


def main(rank: int, world_size: int, port: int, out: str, device: str = "cpu") -> None:
    import torch.distributed as dist

    from fuser.passes.tensor_parallel import shard_graph

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if device != "cpu" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        results = {}
        for family, config in CONFIGS.items():
            prefill, decode = step_graphs(family, BATCH, CACHE, PROMPT, device=device,
                                          **config)
            shard_prefill = shard_graph(prefill, rank, world_size)
            shard_decode = shard_graph(decode, rank, world_size, cache=cache_of(shard_prefill))
            prompt = torch.randint(3, 160, (BATCH, PROMPT), generator=torch.Generator()
                                   .manual_seed(1)).to(device)
            results[family] = dict(
                reference=generate(prefill, decode, prompt, DECODE_STEPS),
                sharded=generate(shard_prefill, shard_decode, prompt, DECODE_STEPS),
                cache_shape=tuple(cache_of(shard_decode)["k_cache_0"].shape))
            if device != "cpu":  # again, the decode steps (all-reduces inside) as CUDA graphs
                results[family]["graphed"] = generate(shard_prefill, shard_decode, prompt,
                                                      DECODE_STEPS, cuda_graph=True)
        torch.save(results, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
