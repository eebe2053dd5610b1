"""Online distillation of the draft on served traffic (Liu et al., "Online Speculative Decoding").

Three pieces, used in this order by whatever serves requests (runtime/scheduler.py):

1. `Distiller.add`: a finished request's tokens go into a bounded buffer, with the target's
   choice at every generated position as its label. Under greedy decoding the emitted tokens are
   the target's argmax after a verified prefix, so they are exact labels that cost nothing to
   collect; with sampling they are draws from the target's distribution q (cross-entropy on
   draws is an unbiased estimate of the forward KL's gradient). Where a step can read back the
   target's top-k probabilities (`topk_targets` on a verification step's logits), a record
   carries them instead: soft labels, more information per token.
2. `Distiller.update(time_budget_s)`: fine-tunes a trainable fp32 copy of the draft (full
   fine-tuning) on the buffer with the forward KL against the target's distribution,
       loss = sum_x q(x) (log q(x) - log p(x))     over the top-k of q (renormalised), or
            = -log p(y)                            for a hard label y (q = e_y),
   within a time budget, then evaluates the candidate on a held-out slice of the most recent
   records that no candidate has trained on and accepts it only on a gain that noise cannot
   explain (`gate`): the lower confidence bound of the paired difference in agreement with
   the target (greedy top-1 agreement: the acceptance rate of greedy speculation per
   position), candidate minus current draft over the same held-out positions, with the
   records as clusters (positions of one sequence are not independent), must exceed
   min_gain, AND the held-out forward KL to the target must be no worse. The accepted weights
   stay bit for bit until a candidate is accepted. A rejected candidate that is no worse (a
   point gain >= 0, a KL no higher, finite weights) keeps training in the next update, with its
   optimizer's moments: a real gain smaller than what one update's held-out records can bound
   (+0.015-0.03 agreement an update, measured on the bundled pair on the CPU) adds up instead
   of being thrown away. A worse one is dropped (the student back to the accepted weights). Each update is logged on the "fuser"
   logger: steps, loss, agreement and KL before and after, and the decision with its reason.
   Where a target module is given (`target=`), the update first labels the buffered records
   that carry only tokens with the target's top-k distribution at each generated position
   (one forward of the target over each record, in the update's own background pass):
   what the target's verify steps computed, without reading it back from the steps.
3. `Distiller.swap_into(swap)`: the accepted weights go into the tensors the engine's compiled
   draft graphs read, in place (`WeightSwap`): the captured graphs stay valid because they are
   the same tensors. The new values are staged first, outside the lock (casts, merged
   projections concatenated, FP8 weights re-quantized), then copied under `WeightSwap.lock`,
   which a step holds while it runs (CPU) or is issued (CUDA: the copies then queue on the same
   stream as the steps, so the device runs them between two steps). A step therefore sees all
   old or all new weights, never a mix.

Which tensors the draft's graphs read (`draft_weight_targets`). The engine's copy of the draft
(fuser/capture.py `engine_view`) shares the user's parameters when dtype and device match, and
export keeps them by object, so most get_attr tensors of a draft graph are the module's
parameters themselves. passes/projections.py concatenates q/k/v and gate/up into new tensors
and makes the parameters views into them, so writing the parameters writes the merged weights
too. passes/fp8.py's codes and scales are new tensors computed from a weight: they are
recomputed (`fuser.ops.fp8.quantize_weight`, as at build time) and written as well. Every other
get_attr tensor must be the KV cache or a module buffer (rotary frequencies), else
`draft_weight_targets` raises: a swap never leaves a tensor stale silently.

A loaded engine (`fuser.load`) keeps no module: its graphs' tensors are resolved by name.
`rebuild_draft` makes the draft module again from the engine directory's draft config and
copies of those tensors (merged projections split by rows, FP8 weights dequantized), for the
distiller to train and the swap to map; `rebuild_target` makes the target over the loaded
tensors themselves (no copy), for the top-k labels.

Full fine-tuning rather than low-rank adapters merged at swap time: a merged adapter changes
every element of the matrices it touches, so the swap costs the same either way (every merged
and quantized tensor is rewritten); the draft is the small model of the pair, so an fp32 copy
with Adam's moments (16 bytes a parameter: 8 GB for a 0.5B draft) fits beside it on the GPU;
and no adapter has to be threaded through the captured graphs. The held-out check guards
against the extra capacity overfitting a small buffer.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fuser.capture import ATTENTION
from fuser.ops.fp8 import quantize_weight
from fuser.passes.fp8 import CODES_PREFIX, SCALE_PREFIX
from fuser.passes.projections import MERGED_PREFIX

__all__ = ["SERVING_DUTY", "DistillConfig", "Distiller", "Evaluation", "Gate", "Pacer", "Record",
           "UpdateResult", "WeightSwap", "WeightTarget", "draft_weight_targets", "gate",
           "rebuild_draft", "rebuild_target", "target_module", "topk_targets"]

log = logging.getLogger("fuser")

# The share of wall time a draft update works beside serving under load (the adaptive
# scheduler's default; DistillConfig.duty overrides it). On an H100 the bundled pair's adaptive
# serving was at its slowest (0.61-0.69x of without) in the windows an unpaced 5 s update most
# likely overlapped (benchmarks/RESULTS.md, "Adaptive speculation"). Paced, updates that follow
# one another take at most this share of the host and the GPU from serving: issue 44 asks every
# window of its stream to keep 0.95x of serving without adaptation. An update of
# DistillConfig.max_steps steps is small work (5 steps of 39 GFLOP on the bundled draft, the
# target's labelling of the records since the last update, two held-out evaluations: about 1
# TFLOP, docs/performance-notes.md), taking its work / SERVING_DUTY of wall clock under load.
SERVING_DUTY = 0.05


# -- the tensors the compiled draft reads -------------------------------------------------------


StateDict = Mapping[str, torch.Tensor]


@dataclass
class WeightTarget:
    """Live tensors that compiled graphs read, and how to compute them from a draft state dict.

    live: the tensors written in place (one parameter, or an FP8 weight's codes and scale).
    compute: state dict (the draft module's parameter names) -> their new values, in order.
    """

    name: str
    live: tuple[torch.Tensor, ...]
    compute: Callable[[StateDict], tuple[torch.Tensor, ...]]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) element offsets of `t` in its storage."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset(), last + 1


def _attr(root: nn.Module, target: str) -> torch.Tensor:
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


class _Parameters:
    """The live module's parameters, indexed by storage, and recipes for tensors made of them."""

    def __init__(self, module: nn.Module) -> None:
        self.named = dict(module.named_parameters())  # (tied parameters once)
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, p in self.named.items():
            self.by_storage.setdefault(_storage(p), []).append((name, p))
        self.buffers = {_storage(b) for b in module.buffers()}
        self.buffer_names = {name for name, _ in module.named_buffers()}
        self.merged = _merged_names(self.named)
        # A graph's attribute name -> the module's parameter name, plain and flattened
        # (passes/fp8.py names a quantized weight by its attribute with "." -> "__").
        self.by_attr = {GRAPH_PREFIX + n: n for n in self.named}
        self.by_flat = {(GRAPH_PREFIX + n).replace(".", "__"): n for n in self.named}

    def by_name(self, attr: str) -> Callable[[StateDict], torch.Tensor] | str | None:
        """A graph tensor's value by its attribute name: a parameter, a merged projection
        (named as passes/projections.py names them), "constant" for a module buffer, None
        when the name says nothing. What resolves a loaded engine's tensors, which share no
        memory with any module."""
        name = self.by_attr.get(attr) or self.by_flat.get(attr)
        if name is not None:
            return lambda sd: sd[name]
        if attr.removeprefix(GRAPH_PREFIX) in self.buffer_names:
            return "constant"
        names = self.merged.get(attr)
        if names is not None:
            return lambda sd: torch.cat([sd[n] for n in names], dim=0)
        return None

    def members(self, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Parameters inside t's storage span, by offset."""
        first, end = _span(t)
        inside = [(n, p) for n, p in self.by_storage.get(_storage(t), [])
                  if first <= _span(p)[0] and _span(p)[1] <= end]
        return sorted(inside, key=lambda item: item[1].storage_offset())

    def covered(self, t: torch.Tensor) -> bool:
        """Whether every element of t lies in some parameter (writing those writes t)."""
        first, end = _span(t)
        spans = sorted(_span(p) for _, p in self.by_storage.get(_storage(t), []))
        for a, b in spans:
            if a <= first < b:
                first = b
            if first >= end:
                return True
        return first >= end

    def recipe(self, t: torch.Tensor) -> Callable[[StateDict], torch.Tensor] | None:
        """t's value from a state dict: a parameter itself, or parameters concatenated along
        rows (a merged projection); None when t is neither."""
        members = self.members(t)
        if len(members) == 1:
            name, p = members[0]
            if p.shape == t.shape and p.stride() == t.stride() \
                    and p.storage_offset() == t.storage_offset():
                return lambda sd: sd[name]
        if not members or not t.is_contiguous():
            return None
        offset = t.storage_offset()
        for _, p in members:  # consecutive row blocks that tile t exactly
            if not p.is_contiguous() or p.storage_offset() != offset or p.shape[1:] != t.shape[1:]:
                return None
            offset += p.numel()
        if offset != t.storage_offset() + t.numel():
            return None
        names = [n for n, _ in members]
        return lambda sd: torch.cat([sd[n] for n in names], dim=0)


# The step module (fuser/capture.py StepModule) holds the model as `.model`: a graph's
# attribute for the module's parameter "model.norm.weight" is "model.model.norm.weight".
GRAPH_PREFIX = "model."


def _merged_names(named: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Every name passes/projections.py would give a merged projection of this module's
    parameters -> the parameters, in row order: each run of two or more sibling linears'
    weights (or biases), the children of one module in their order (q, k, v; gate, up)."""
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for name in named:
        parent, _, rest = name.rpartition(".")  # "...self_attn.q_proj", "weight"
        grand, _, child = parent.rpartition(".")
        if grand:
            groups.setdefault((grand, rest), []).append((child, name))
    merged = {}
    for (grand, leaf), children in groups.items():
        for i in range(len(children)):
            for j in range(i + 2, len(children) + 1):
                run = children[i:j]
                # projections._register: MERGED_PREFIX, the attributes' common path with "."
                # as "_", "__", the leaves' own paths joined by "_", "__", the last part.
                head = (GRAPH_PREFIX + grand).replace(".", "_")
                leaves = "_".join(child for child, _ in run)
                merged[f"{MERGED_PREFIX}{head}__{leaves}__{leaf}"] = [n for _, n in run]
    return merged


def _draft_steps(source: object) -> list[object]:
    """The draft ModelSteps of an Engine (every batch bucket's), or the given ones."""
    if hasattr(source, "buckets"):
        found = [b.draft for b in source.buckets.values() if b.draft is not None]
        if getattr(source, "draft", None) is not None:
            found.append(source.draft)
    elif hasattr(source, "steps") and hasattr(source, "cache"):
        found = [source]
    else:
        found = list(source)
    unique = {id(s): s for s in found}
    if not unique:
        raise ValueError("no draft steps: the engine has no compiled draft to adapt")
    return list(unique.values())


def _module_of(all_steps: Iterable[object]) -> nn.Module | None:
    """The module some ModelSteps' graphs were exported from (None: a loaded engine's)."""
    for steps in all_steps:
        for graph in steps.steps.values():
            model = getattr(graph.eager, "model", None)
            if isinstance(model, nn.Module):
                return model
    return None


def draft_module(source: object) -> nn.Module:
    """The engine's own copy of the draft (the module its step graphs were exported from)."""
    model = _module_of(_draft_steps(source))
    if model is None:
        raise ValueError("the draft's steps keep no module (a loaded engine): give the module "
                         "whose parameters the graphs were built from")
    return model


def rebuild_draft(engine: object, directory: str | Path) -> nn.Module:
    """The draft as a Hugging Face module, rebuilt for an engine loaded from `directory` (its
    steps keep no module): the architecture from the directory's draft config
    (engine_io.DRAFT_CONFIG), every parameter a copy of what the loaded draft graphs read,
    found by name: a parameter itself, the rows of a merged projection, or an FP8 weight
    dequantized (codes x scale: the distillation starts from what the engine computes). The
    config is kept on the engine (`engine.draft_config`) so that saving it again keeps it.
    Raises ValueError when the directory has no draft config or a parameter is not found."""
    from fuser.engine_io import DRAFT_CONFIG

    module, config = _rebuild(_draft_steps(engine), Path(directory) / DRAFT_CONFIG, share=False)
    engine.draft_config = config
    return module


def rebuild_target(engine: object, directory: str | Path) -> nn.Module | None:
    """The target as a Hugging Face module for an engine loaded from `directory`, its
    parameters sharing the loaded tensors (views of merged projections: no copy): what labels
    records with the target's top-k. None (with a warning) where the directory has no target
    config (engine_io.TARGET_CONFIG), a parameter is not found, or the target is FP8 (that
    would take a dequantized copy of it)."""
    from fuser.engine_io import TARGET_CONFIG

    steps = [b.target for b in getattr(engine, "buckets", {}).values() if b.target is not None]
    try:
        module, config = _rebuild(steps, Path(directory) / TARGET_CONFIG, share=True)
    except ValueError as e:
        log.warning("fuser: the target's top-k labels are off for %s (%s): the draft learns "
                    "from the emitted tokens", directory, e)
        return None
    engine.target_config = config
    return module


def _rebuild(all_steps: Sequence[object], config_path: Path, share: bool
             ) -> tuple[nn.Module, object]:
    """(module, its config) from a saved Hugging Face config and the tensors the loaded steps'
    graphs read (see rebuild_draft); share: parameters are the loaded tensors (or views of
    them) where dtype and device allow, else copies."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    if not config_path.is_file():
        raise ValueError(f"{config_path.parent} keeps no {config_path.name} (an engine saved "
                         "without it): rebuild it with fuser build")
    if not all_steps:
        raise ValueError("the engine has no steps for that model")
    fields = json.loads(config_path.read_text(encoding="utf-8"))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    dtype, device = all_steps[0].cache.k[0].dtype, all_steps[0].cache.k[0].device
    with torch.device("meta" if share else device):
        module = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    params = _Parameters(module)
    buffer_attrs = {GRAPH_PREFIX + n: n for n in params.buffer_names}
    buffer_attrs.update({k.replace(".", "__"): v for k, v in buffer_attrs.items()})
    found: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for steps in all_steps:
        for graph in steps.steps.values():
            gm = graph.rewritten
            if gm is None:
                continue
            for node in gm.graph.find_nodes(op="get_attr"):
                name = str(node.target)
                if name.startswith(SCALE_PREFIX):
                    continue  # read with its codes
                value = _attr(gm, name)
                if not isinstance(value, torch.Tensor):
                    continue
                if name in buffer_attrs:
                    buffers.setdefault(buffer_attrs[name], value)
                    continue
                if name.startswith(CODES_PREFIX):
                    if share:
                        raise ValueError("FP8 weights: labelling would need a dequantized copy "
                                         "of the model")
                    suffix = name.removeprefix(CODES_PREFIX)
                    scale = getattr(gm, SCALE_PREFIX + suffix)
                    name = suffix
                    value = (value.float() * scale.float()[:, None]).to(dtype)
                names = [params.by_attr.get(name) or params.by_flat.get(name)]
                if names[0] is None:
                    names = params.merged.get(name, [])
                rows = [params.named[n].shape[0] for n in names]
                if not names or value.dim() == 0 or sum(rows) != value.shape[0]:
                    continue  # the KV cache, a buffer, or nothing of the module's
                for n, part in zip(names, value.split(rows, dim=0)):
                    found.setdefault(n, part)
    missing = sorted(set(params.named) - set(found))
    if missing:
        raise ValueError(f"the loaded graphs hold no tensor for {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}: the module cannot be rebuilt")
    for n, p in params.named.items():
        if tuple(found[n].shape) != tuple(p.shape):
            raise ValueError(f"{n}: the loaded graphs hold shape {tuple(found[n].shape)} for a "
                             f"parameter of shape {tuple(p.shape)}")
    if share:  # parameters over the loaded memory, buffers (rotary frequencies) the graphs'
        new = {id(p): nn.Parameter(found[n].to(device=device, dtype=dtype), requires_grad=False)
               for n, p in params.named.items()}
        for prefix, sub in module.named_modules():
            for k, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[k] = new[id(p)]  # (tied parameters stay one object)
            if any(b is not None and b.is_meta for b in sub._buffers.values()) \
                    and not sub._parameters and hasattr(sub, "config"):
                with torch.device(device):  # (rotary frequencies: computed from the config)
                    fresh = type(sub)(sub.config)
                for k, b in fresh.named_buffers(recurse=False):
                    sub._buffers[k] = b
            for k, b in list(sub._buffers.items()):
                n = f"{prefix}.{k}" if prefix else k
                if n in buffers:
                    sub._buffers[k] = buffers[n].to(device)
                elif b is not None and b.is_meta:
                    raise ValueError(f"the buffer {n} cannot be rebuilt")
    else:
        with torch.no_grad():
            for n, p in params.named.items():
                p.copy_(found[n])
    return module, config


def target_module(engine: object) -> nn.Module | None:
    """The engine's own copy of the target (what labels records with the target's top-k in
    `Distiller.update`), or None where its steps keep no module (a loaded engine)."""
    steps = [b.target for b in getattr(engine, "buckets", {}).values()]
    return _module_of(steps)


def draft_weight_targets(source: object, module: nn.Module | None = None) -> list[WeightTarget]:
    """Every tensor the compiled draft graphs read that depends on the draft's weights, with
    how to compute it from a state dict of the draft (see the module docstring).

    source: an Engine (every batch bucket's draft steps), one ModelSteps, or a list of them.
    module: the module the graphs were built from (default: the engine's copy of the draft,
    which `engine_view` gives parameters shared with the user's draft when dtype and device
    match). Raises ValueError for a tensor that is neither the KV cache (a paged one's block
    table included), a module buffer, a (view of a) parameter, a merged projection of
    parameters nor an FP8 weight of one.
    """
    all_steps = _draft_steps(source)
    module = module if module is not None else draft_module(all_steps)
    params = _Parameters(module)
    targets, shared = [], False
    seen: set[int] = set()
    for steps in all_steps:
        cache = {_storage(t) for t in (*steps.cache.k, *steps.cache.v)}
        if steps.cache.block_table is not None:  # a paged cache's table (runtime/blocks.py)
            cache.add(_storage(steps.cache.block_table))
        dtype = steps.cache.k[0].dtype  # the engine's dtype: what quantized weights were in
        for graph in steps.steps.values():
            gm = graph.rewritten
            if gm is None:
                continue
            for node in gm.graph.find_nodes(op="get_attr"):
                t = _attr(gm, node.target)
                if id(t) in seen or not isinstance(t, torch.Tensor):
                    continue
                seen.add(id(t))
                name = str(node.target)
                where = f"{graph.name}: {name}"
                if name.startswith(CODES_PREFIX) or name.startswith(SCALE_PREFIX):
                    targets += _fp8_target(gm, name, params, dtype, where, seen)
                    continue
                if _storage(t) in cache or _storage(t) in params.buffers:
                    continue  # the KV cache; rotary frequencies and other constants
                if params.covered(t):
                    shared = True  # the module's parameters themselves (written below)
                    continue
                recipe = params.by_name(name)
                if recipe is None:
                    raise ValueError(f"{where} is not made of the draft's parameters: a swap "
                                     "could not update it")
                if recipe != "constant":
                    targets.append(WeightTarget(where, (t,), lambda sd, r=recipe: (r(sd),)))
    if shared:  # graphs read the module's parameters (a built engine): write them all
        targets = [WeightTarget(name, (p,), lambda sd, name=name: (sd[name],))
                   for name, p in params.named.items()] + targets
    return targets


def _fp8_target(gm: torch.fx.GraphModule, name: str, params: _Parameters,
                dtype: torch.dtype, where: str, seen: set[int]) -> list[WeightTarget]:
    """The (codes, scale) pair of one FP8 weight, recomputed from its source weight (found by
    memory in a built engine, by name in a loaded one, which keeps only the codes)."""
    suffix = name.removeprefix(CODES_PREFIX).removeprefix(SCALE_PREFIX)
    codes, scale = getattr(gm, CODES_PREFIX + suffix), getattr(gm, SCALE_PREFIX + suffix)
    seen.update((id(codes), id(scale)))
    attrs = {n.replace(".", "__"): t for n, t in (*gm.named_parameters(), *gm.named_buffers())}
    weight = attrs.get(suffix)
    recipe = params.recipe(weight) if weight is not None else None
    if recipe is None:
        recipe = params.by_name(suffix)
    if recipe is None or recipe == "constant":
        raise ValueError(f"{where}: the weight it quantizes is not made of the draft's "
                         "parameters: a swap could not update it")
    device = codes.device

    def compute(sd: StateDict) -> tuple[torch.Tensor, ...]:
        # As at build time: the weight in the engine's dtype, then quantized.
        return quantize_weight(recipe(sd).to(device=device, dtype=dtype))

    return [WeightTarget(where, (codes, scale), compute)]


class WeightSwap:
    """Swaps new draft weights into the live tensors, atomically with respect to steps.

    `lock`: whoever runs (on CUDA: issues) a step that reads the draft holds it for the step;
    `apply` takes it for its copies, so they land between two steps. On CUDA the copies queue
    on `stream`, which must be the stream the steps run on (default: the device's default
    stream, where the scheduler's thread issues them), whatever thread applies.
    """

    def __init__(self, targets: Sequence[WeightTarget], stream: object | None = None) -> None:
        self.targets = list(targets)
        self.lock = threading.Lock()
        self.swaps = 0
        self.stream = stream
        devices = {t.device for t in self.live if t.device.type == "cuda"}
        if stream is None and devices:
            self.stream = torch.cuda.default_stream(next(iter(devices)))

    @classmethod
    def for_engine(cls, engine: object, module: nn.Module | None = None,
                   stream: object | None = None) -> WeightSwap:
        return cls(draft_weight_targets(engine, module), stream)

    @property
    def live(self) -> list[torch.Tensor]:
        return [t for target in self.targets for t in target.live]

    @torch.no_grad()
    def stage(self, state_dict: StateDict) -> list[torch.Tensor]:
        """Every live tensor's new value (own memory, the live dtype and device), computed
        without the lock. On CUDA the staging stream is synchronised: the values are complete
        before `apply` copies them from another stream."""
        staged = []
        for target in self.targets:
            values = target.compute(state_dict)
            for live, value in zip(target.live, values, strict=True):
                if value.shape != live.shape:
                    raise ValueError(f"{target.name}: new value of shape {tuple(value.shape)} "
                                     f"for a live tensor of shape {tuple(live.shape)}")
                value = value.detach().to(device=live.device, dtype=live.dtype, copy=True)
                staged.append(value)
        for device in {t.device for t in staged if t.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()
        return staged

    @torch.no_grad()
    def apply(self, staged: Sequence[torch.Tensor]) -> None:
        """Copy staged values into the live tensors, under the lock (waits for a running step)."""
        live = self.live
        if len(staged) != len(live):
            raise ValueError(f"{len(staged)} staged values for {len(live)} live tensors")
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with self.lock, on_stream:
            torch._foreach_copy_(live, list(staged))
            self.swaps += 1

    def swap(self, state_dict: StateDict) -> None:
        """stage, then apply."""
        self.apply(self.stage(state_dict))


# -- labels from verification steps -------------------------------------------------------------


def topk_targets(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k at each verified position: (ids [..., k] int64, probs [..., k] fp32),
    from logits [..., V] (a verification step's, after the same temperature the request samples
    with, if any). Device code, no host sync: a collecting step reads these back with its
    tokens."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, k, dim=-1)
    return top.indices, top.values


# -- the buffer and the update ------------------------------------------------------------------


@dataclass
class Record:
    """One served sequence: tokens [L] (prompt then output) and labels for positions
    start..L-1: the token there (hard), or the target's top-k there (ids and probs, [L - start,
    k], soft)."""

    tokens: torch.Tensor
    start: int
    topk_ids: torch.Tensor | None = None
    topk_probs: torch.Tensor | None = None
    trained: bool = False  # some candidate trained on it: never held out again

    @property
    def labeled(self) -> int:
        return self.tokens.shape[0] - self.start


class Pacer:
    """Work spread over the wall clock: each `piece()` of work is timed, then followed by a
    sleep long enough that the work is at most `duty` of the time since the pacer began.
    `worked`: the work's seconds so far; `stopped`: whether `stop` (an event) was set, after
    which the work should end. A distillation update runs beside the serving thread; its sleeps
    give that thread the host (the GIL) and the GPU back. `idle` (optional): a piece begun
    while it returns True (no request running or waiting) is not paced: no sleep follows it,
    and the first piece under load after it is on schedule (the work under load is `duty` of
    the wall clock under load, with no unpaced burst spending the idle time)."""

    def __init__(self, duty: float, clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None,
                 stop: threading.Event | None = None,
                 idle: Callable[[], bool] | None = None) -> None:
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"duty={duty!r} must be in (0, 1]")
        self.duty = duty
        self.clock = clock or time.perf_counter
        self.stop = stop
        # (a stop event ends a sleep at once: a closing scheduler does not wait out the pacing)
        self.sleep = sleep or (stop.wait if stop is not None else time.sleep)
        self.idle = idle
        self.worked = 0.0
        self._paced = 0.0  # the work of pieces begun under load
        self._after_idle = False  # the last piece was begun while idle
        self.began = self.clock()

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    @contextmanager
    def piece(self) -> Iterator[None]:
        unpaced = self.idle is not None and self.idle()
        start = self.clock()
        if self._after_idle and not unpaced:  # on schedule: the idle time is no slack
            self.began = start - self._paced / self.duty
        self._after_idle = unpaced
        try:
            yield
        finally:
            took = self.clock() - start
            self.worked += took
            if not unpaced:
                self._paced += took
                if self.duty < 1.0 and not self.stopped:
                    wait = self.began + self._paced / self.duty - self.clock()
                    if wait > 0:
                        self.sleep(wait)


@dataclass(frozen=True)
class DistillConfig:
    """Settings of a `Distiller`.

    Attributes:
        lr: AdamW's learning rate.
        weight_decay: AdamW's decoupled weight decay.
        batch_tokens: tokens per training batch (at least one record a batch).
        max_context: a record longer than this trains and evaluates on its last max_context
            tokens.
        max_records, max_tokens: the buffer keeps the newest records within both bounds.
        holdout_fraction: the newest share of the buffer held out of training and used to
            decide (at least min_holdout records). How much a few steps gain differs from
            one served document to the next (on the bundled pair's shifted domain, +0.02 on
            average with a spread of 0.08-0.1 from record to record): bounding such a gain at
            99% takes ~90-150 held-out records, so the held-out share is large (0.4: 160 records
            at the second update of 200 requests each), while the training share still holds
            about what max_steps steps of batch_tokens use (5 x 4096 tokens: ~130 records of
            160 tokens; 120 at the first update, 240 at the second).
        min_holdout: the fewest held-out records (at least 2: the gate's bound needs two
            clusters); an update needs min_holdout + 1 records.
        min_gain: a candidate is accepted only when the lower confidence bound of its gain in
            the held-out criterion over the current draft's exceeds this (`gate`).
        confidence: the one-sided confidence of that bound (Student's t over the held-out
            records as clusters).
        max_kl_increase: a candidate whose held-out KL to the target exceeds the current
            draft's by more than this is rejected, whatever its agreement (0: no worse).
        soft_labels: with a target module given to the Distiller, label records that carry
            only tokens with the target's top-k distribution (a target forward per record,
            once, inside the update's time budget).
        criterion: "agreement" (greedy top-1 agreement with the target: the acceptance rate
            of greedy speculation) or "acceptance" (sum_x min(p, q) over the labels' top-k:
            speculative sampling's acceptance; needs soft labels to mean that).
        topk: label width kept per position (soft labels are cut to it).
        max_steps: at most this many optimizer steps per update (None: the time budget
            only). Few steps move the bundled draft most: at lr 1e-4 and 4096-token batches,
            2 steps raise its agreement with the target on shifted-domain documents never
            trained on by +0.014, 5 by +0.018, 20 by +0.022 while its agreement on held-out
            Python falls 1.2% (800 requests: docs/performance-notes.md,
            `benchmarks/distill_curve.py`); an
            accepted or carried candidate trains on in the next update, so small updates add
            up. One step over 4096 tokens is 39 GFLOP on the bundled draft.
        seed: minibatch order.
        duty: the share of wall time an update works (labelling, training steps and the
            held-out evaluations, each followed by a sleep: `Pacer`); the time budget counts
            the work, so an update takes about its work / duty seconds. None: 1.0 (unpaced)
            for an update called directly; where the adaptive scheduler runs it beside
            serving, SERVING_DUTY while requests run or wait (serving needs the same host, the
            GIL, and GPU: the share an update takes under load is throughput lost) and
            unpaced while none does. Set to pace it at that share whatever the load.
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    batch_tokens: int = 4096
    max_context: int = 512
    max_records: int = 4096
    max_tokens: int = 1 << 21
    holdout_fraction: float = 0.4
    min_holdout: int = 2
    min_gain: float = 0.0
    confidence: float = 0.99
    max_kl_increase: float = 0.0
    soft_labels: bool = True
    criterion: str = "agreement"
    topk: int = 8
    max_steps: int | None = 5
    seed: int = 0
    duty: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch_tokens", "max_context", "max_records", "max_tokens", "min_holdout",
                     "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(
                self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps={self.max_steps!r} must be None or a positive int")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.duty is not None and not 0.0 < self.duty <= 1.0:
            raise ValueError(f"duty={self.duty!r} must be None or in (0, 1]")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction={self.holdout_fraction!r} must be in (0, 1)")
        if not self.min_gain >= 0:
            raise ValueError(f"min_gain={self.min_gain!r} must be >= 0")
        if self.min_holdout < 2:
            raise ValueError(f"min_holdout={self.min_holdout!r} must be at least 2 (the gate's "
                             "confidence bound needs two held-out records)")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence={self.confidence!r} must be in [0.5, 1)")
        if not self.max_kl_increase >= 0:
            raise ValueError(f"max_kl_increase={self.max_kl_increase!r} must be >= 0")
        if self.criterion not in ("agreement", "acceptance"):
            raise ValueError(f"criterion={self.criterion!r} must be 'agreement' or 'acceptance'")


@dataclass
class Evaluation:
    """A draft against the labels of some records: mean loss (forward KL; cross-entropy for
    hard labels), top-1 agreement and expected acceptance sum_x min(p, q), per position.
    per_record: [records, 4] float64 (labelled positions, and the sums of loss, agreement and
    acceptance over them), in the records' order: what `gate` pairs two evaluations by."""

    loss: float
    agreement: float
    acceptance: float
    positions: int
    per_record: torch.Tensor | None = None

    def metric(self, criterion: str) -> float:
        return self.agreement if criterion == "agreement" else self.acceptance


_COLUMN = {"loss": 1, "agreement": 2, "acceptance": 3}  # Evaluation.per_record's columns


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile: the x with P(T <= x) = p for dof degrees of freedom (p >= 0.5),
    by bisection on the CDF integrated with Simpson's rule (no scipy at run time)."""
    if not 0.5 <= p < 1.0 or dof < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and dof >= 1 (got {p}, {dof})")
    c = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def cdf(x: float, n: int = 2000) -> float:
        h = x / n
        f = [c * (1 + (i * h) ** 2 / dof) ** (-(dof + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Gate:
    """The decision on a candidate (`gate`): gain, the mean paired difference of the criterion
    per held-out position (candidate minus current), and its lower confidence bound; the
    held-out KL of both; accepted and why."""

    gain: float
    lower: float
    kl_before: float
    kl_after: float
    accepted: bool
    reason: str


def gate(before: Evaluation, after: Evaluation, criterion: str = "agreement",
         confidence: float = 0.99, min_gain: float = 0.0, max_kl_increase: float = 0.0,
         finite: bool = True) -> Gate:
    """Accept a candidate only on a gain that noise cannot explain and a KL no worse.

    The two evaluations are of the same held-out records (`per_record`, in one order). Per
    record r with n_r positions, d_r = the sum over its positions of (candidate's criterion -
    current's): the gain is sum d_r / N (N = sum n_r), and its standard error treats records as
    clusters (positions of one sequence are correlated): se^2 = R / (R - 1) * sum_r (d_r - n_r
    gain)^2 / N^2. The lower bound is gain - t(confidence, R - 1) se. Accepted when the bound
    exceeds min_gain, the held-out KL (mean loss) rose by at most max_kl_increase, and the
    candidate's weights are finite.
    """
    if before.per_record is None or after.per_record is None:
        raise ValueError("gate needs evaluations with per_record sums (Distiller.evaluate)")
    if before.per_record.shape != after.per_record.shape or not torch.equal(
            before.per_record[:, 0], after.per_record[:, 0]):
        raise ValueError("gate pairs two evaluations of the same records")
    col = _COLUMN[criterion]
    counts = before.per_record[:, 0]
    total = float(counts.sum())
    records = counts.shape[0]
    d = (after.per_record[:, col] - before.per_record[:, col]).double()
    gain = float(d.sum()) / max(total, 1.0)
    if records >= 2 and total > 0:
        spread = float(((d - counts * gain) ** 2).sum()) * records / (records - 1)
        lower = gain - t_quantile(confidence, records - 1) * math.sqrt(spread) / total
    else:
        lower = -math.inf
    kl_before, kl_after = before.loss, after.loss
    words = (f"held-out {criterion} {before.metric(criterion):.4f} -> "
             f"{after.metric(criterion):.4f} (gain {gain:+.4f}, {confidence:.0%} lower bound "
             f"{lower:+.4f} over {records} records), KL {kl_before:.4f} -> {kl_after:.4f}")
    if not finite:
        return Gate(gain, lower, kl_before, kl_after, False,
                    f"rejected (non-finite weights): {words}")
    if not lower > min_gain:
        why = "one held-out record bounds nothing" if records < 2 else \
            f"the gain's lower bound is not above {min_gain:g}"
        return Gate(gain, lower, kl_before, kl_after, False, f"rejected ({why}): {words}")
    if not kl_after <= kl_before + max_kl_increase:
        return Gate(gain, lower, kl_before, kl_after, False,
                    f"rejected (the KL to the target rose): {words}")
    return Gate(gain, lower, kl_before, kl_after, True, f"accepted: {words}")


@dataclass
class UpdateResult:
    """What one `Distiller.update` did. accepted: the candidate replaced the draft's weights
    (swap_into will copy them into the engine). before/after: the held-out evaluation of the
    current draft and of the candidate (None when the update did not run)."""

    accepted: bool
    reason: str
    steps: int = 0
    seconds: float = 0.0
    train_records: int = 0
    holdout_records: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    before: Evaluation | None = None
    after: Evaluation | None = None
    losses: list[float] = field(default_factory=list)
    gate: Gate | None = None
    labelled: int = 0  # records given the target's top-k by this update


def _trainable_copy(module: nn.Module, device: torch.device | None) -> nn.Module:
    """An fp32 copy of `module` with parameters in memory of their own (the engine's may be
    views into merged projections), gradients on; ties between parameters are kept."""
    student = copy.deepcopy(module)
    for p in student.parameters():  # (tied parameters are one object: done once each)
        p.data = p.data.to(device=device, dtype=torch.float32, copy=True).contiguous()
        p.requires_grad_(True)
    for b in student.buffers():
        b.data = b.data.to(device=device)
    # The engine's copy attends through the engine's cache ("fuser"): train with PyTorch's.
    for sub in student.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "_attn_implementation", None) == ATTENTION:
            config._attn_implementation = "sdpa"
    return student.eval()  # no dropout; gradients flow in eval mode


def _labelling_view(module: nn.Module) -> nn.Module:
    """A copy of `module` that shares its parameters and buffers (no extra memory) but attends
    with PyTorch's SDPA (the engine's copy attends through the engine's cache)."""
    shared = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    view = copy.deepcopy(module, memo=shared)
    for sub in view.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "_attn_implementation", None) == ATTENTION:
            config._attn_implementation = "sdpa"
    return view.eval()


class Distiller:
    """Keeps served records and distils the draft on them; see the module docstring.

    Thread use: `add` from the serving thread; `update` and `swap_into` from one background
    thread (or between steps). `add` and `update` share the buffer under a lock of their own.

    Args:
        draft: the draft module (the user's, or the engine's copy: `draft_module(engine)`); it
            is copied, never trained in place.
        vocab_size: the vocabulary the labels index (the pair's common one; default: the
            draft's).
        config: DistillConfig.
        device: where training runs (default: the draft's device).
        target: the target module (the engine's copy: `target_module(engine)`), never trained;
            with config.soft_labels, records that carry only tokens get its top-k as labels.
    """

    def __init__(self, draft: nn.Module, vocab_size: int | None = None,
                 config: DistillConfig | None = None, device: torch.device | str | None = None,
                 target: nn.Module | None = None) -> None:
        self.config = config or DistillConfig()
        self._target: nn.Module | None = None
        self.label_with(target)
        first = next(draft.parameters())
        self.device = torch.device(device) if device is not None else first.device
        self.student = _trainable_copy(draft, self.device)
        draft_vocab = getattr(getattr(draft, "config", None), "vocab_size", None)
        self.vocab_size = vocab_size or draft_vocab
        if self.vocab_size is None:
            raise ValueError("vocab_size: the draft has no config.vocab_size; give it")
        self._params = dict(self.student.named_parameters())
        self._accepted = {n: p.detach().clone() for n, p in self._params.items()}
        self.carried = False  # the student holds a rejected, no-worse candidate
        # The update under way (`progress`): its phase, records labelled, steps, and pacer
        self._progress: dict[str, object] | None = None
        self._optimizer = self._new_optimizer()
        self._records: deque[Record] = deque()
        self._tokens = 0
        self._buffer_lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._rng = random.Random(self.config.seed)
        self.requests_seen = 0
        self._requests_at_update = 0
        self.version = 0  # accepted updates so far
        self.swapped_version = 0  # the version the engine's live weights hold
        self.updates = {"accepted": 0, "rejected": 0}
        self.update_seconds = 0.0
        self.last_result: UpdateResult | None = None

    def label_with(self, target: nn.Module | None) -> None:
        """Label records that carry only tokens with this target module's top-k from the next
        update on (None: tokens only); ignored when config.soft_labels is off."""
        self._target = _labelling_view(target) if target is not None \
            and self.config.soft_labels else None

    @property
    def labels_from_target(self) -> bool:
        """Whether updates label records with a target module's top-k."""
        return self._target is not None

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._params.values(), lr=self.config.lr,
                                 weight_decay=self.config.weight_decay)

    # -- the buffer ------------------------------------------------------------------------------

    def add(self, tokens: Sequence[int] | torch.Tensor, start: int = 1,
            topk_ids: torch.Tensor | None = None, topk_probs: torch.Tensor | None = None
            ) -> None:
        """Buffer one served sequence: tokens (prompt then output) with labels from `start`
        (the prompt's length: the output's positions) on; hard labels (the tokens) unless the
        target's top-k [len(tokens) - start, k] ids and probs are given."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten().cpu()
        length = tokens.shape[0]
        if not 1 <= start <= length:
            raise ValueError(f"start={start} must be in 1..len(tokens)={length}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"tokens must be ids in [0, {self.vocab_size})")
        if (topk_ids is None) != (topk_probs is None):
            raise ValueError("topk_ids and topk_probs come together")
        if topk_ids is not None:
            shape = (length - start, topk_ids.shape[-1])
            if tuple(topk_ids.shape) != shape or tuple(topk_probs.shape) != shape:
                raise ValueError(f"topk_ids and topk_probs must be [len(tokens) - start, k] = "
                                 f"{list(shape)}")
            k = min(shape[1], self.config.topk)
            topk_ids = topk_ids[:, :k].long().cpu()
            topk_probs = topk_probs[:, :k].float().cpu()
        self.requests_seen += 1
        if length == start:
            return  # nothing generated: no label
        record = Record(tokens, start, topk_ids, topk_probs)
        with self._buffer_lock:
            self._records.append(record)
            self._tokens += length
            while self._records and (len(self._records) > self.config.max_records
                                     or self._tokens > self.config.max_tokens):
                self._tokens -= self._records.popleft().tokens.shape[0]

    @property
    def records(self) -> int:
        return len(self._records)

    @property
    def buffered_tokens(self) -> int:
        return self._tokens

    # -- batches ---------------------------------------------------------------------------------

    def _window(self, record: Record) -> Record:
        """The record cut to its last max_context tokens (labels before the cut dropped)."""
        cut = record.tokens.shape[0] - self.config.max_context
        if cut <= 0:
            return record
        start = max(record.start, cut + 1)  # position p is predicted from p - 1 >= cut
        drop = start - record.start
        soft = record.topk_ids is not None
        return Record(record.tokens[cut:], start - cut,
                      record.topk_ids[drop:] if soft else None,
                      record.topk_probs[drop:] if soft else None)

    def _batch(self, records: Sequence[Record]) -> tuple[torch.Tensor, ...]:
        """(ids [b, T], mask [b, T], label ids [b, T, k], label probs [b, T, k], labeled [b, T])
        with row i's logits at t scored against the labels of position t + 1."""
        windows = [self._window(r) for r in records]
        b, T, k = len(windows), max(r.tokens.shape[0] for r in windows), self.config.topk
        ids = torch.zeros(b, T, dtype=torch.long)
        mask = torch.zeros(b, T, dtype=torch.long)
        label_ids = torch.zeros(b, T, k, dtype=torch.long)
        label_probs = torch.zeros(b, T, k)
        labeled = torch.zeros(b, T, dtype=torch.bool)
        for i, r in enumerate(windows):
            L = r.tokens.shape[0]
            ids[i, :L] = r.tokens
            mask[i, :L] = 1
            rows = slice(r.start - 1, L - 1)  # logits at p - 1 predict position p
            labeled[i, rows] = True
            if r.topk_ids is None:  # a hard label: q = e_y
                label_ids[i, rows, 0] = r.tokens[r.start:]
                label_probs[i, rows, 0] = 1.0
            else:
                w = r.topk_ids.shape[1]
                label_ids[i, rows, :w] = r.topk_ids
                label_probs[i, rows, :w] = r.topk_probs
        return tuple(t.to(self.device) for t in (ids, mask, label_ids, label_probs, labeled))

    def _batches(self, records: Sequence[Record]) -> Iterable[list[Record]]:
        """Consecutive groups of at most batch_tokens (windowed) tokens, one record at least."""
        group, tokens = [], 0
        for r in records:
            length = min(r.tokens.shape[0], self.config.max_context)
            if group and tokens + length > self.config.batch_tokens:
                yield group
                group, tokens = [], 0
            group.append(r)
            tokens += length
        if group:
            yield group

    def _scores(self, records: Sequence[Record]) -> tuple[torch.Tensor, ...]:
        """Forward the student over a batch: (per-position loss, agreement, acceptance, labeled
        mask), each [b, T]."""
        ids, mask, label_ids, label_probs, labeled = self._batch(records)
        logits = self.student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits[..., : self.vocab_size].float(), dim=-1)  # [b, T, V]
        q = label_probs / label_probs.sum(-1, keepdim=True).clamp_min(1e-30)  # top-k renormalised
        logp_labels = logp.gather(-1, label_ids)  # [b, T, k]
        # forward KL over the top-k: sum q (log q - log p) (q = 0 terms contribute 0)
        loss = (q * (torch.log(q.clamp_min(1e-30)) - logp_labels)).sum(-1)  # [b, T]
        top_label = label_ids.gather(-1, q.argmax(-1, keepdim=True))[..., 0]  # [b, T]
        agreement = (logp.argmax(-1) == top_label).float()
        acceptance = torch.minimum(logp_labels.exp(), label_probs).sum(-1)
        return loss, agreement, acceptance, labeled

    @torch.no_grad()
    def evaluate(self, records: Sequence[Record]) -> Evaluation:
        """The student's current weights against the records' labels (with per-record sums,
        in the records' order)."""
        rows = []
        for group in self._batches(records):
            loss, agreement, acceptance, labeled = self._scores(group)
            keep = labeled.double()
            rows.append(torch.stack([keep.sum(1)] + [(v.double() * keep).sum(1) for v in
                                                      (loss, agreement, acceptance)], dim=1))
        per_record = torch.cat(rows).cpu() if rows else torch.zeros(0, 4, dtype=torch.float64)
        positions = int(per_record[:, 0].sum())
        means = (per_record[:, 1:].sum(0) / max(positions, 1)).tolist()
        return Evaluation(means[0], means[1], means[2], positions, per_record)

    @torch.no_grad()
    def tokens_per_step(self, records: Sequence[Record], gamma: int) -> float:
        """Tokens a greedy verify step at `gamma` would yield over the records' labelled
        positions with the student as the draft: from each position the student proposes
        gamma tokens, the run of them that agree with the target's top-1 is accepted and the
        target adds one (each record's positions walked in such steps; its last step may be
        cut short). Teacher-forced agreement is exact here: an accepted proposal is the
        target's own token, so the next proposal sees the prefix the target saw."""
        if gamma < 1:
            raise ValueError(f"gamma={gamma!r} must be >= 1")
        positions = steps = 0
        for group in self._batches(records):
            _, agreement, _, labeled = self._scores(group)
            for row, keep in zip(agreement.bool().cpu(), labeled.cpu()):
                agrees = row[keep].tolist()
                i = 0
                while i < len(agrees):
                    run = 0
                    while run < gamma and i + run < len(agrees) and agrees[i + run]:
                        run += 1
                    i += run + 1
                    steps += 1
                positions += len(agrees)
        return positions / max(steps, 1)

    @torch.no_grad()
    def _label(self, records: Sequence[Record], pacer: Pacer, limit: float) -> int:
        """Give records that carry only tokens the target's top-k at each labelled position
        (one target forward per batch of records, each a piece of `pacer`'s work), until the
        pacer has worked `limit` seconds; how many were labelled."""
        todo = [r for r in records if r.topk_ids is None]
        if self._target is None or not todo:
            return 0
        device = next(self._target.parameters()).device
        done = 0
        for group in self._batches(todo):
            if pacer.worked >= limit or pacer.stopped:
                break
            with pacer.piece():
                self._label_group(group, device)
            done += len(group)
            self._note(labelled=done)
        return done

    def _note(self, **changes: object) -> None:
        """The update under way moved on (`progress`)."""
        progress = self._progress
        if progress is not None:
            progress.update(changes)

    def progress(self) -> dict[str, object] | None:
        """Where the update under way is (None: none runs), read from any thread: its phase
        ("labelling", "evaluating before", "training", "evaluating after"), the records the
        target labelled, the training steps taken, the seconds it worked (`Pacer.worked`) and
        the wall-clock seconds since it began: an update paced under load may take many times
        its work."""
        progress = self._progress
        if progress is None:
            return None
        pacer = progress["pacer"]
        return {"phase": progress["phase"], "labelled": progress["labelled"],
                "steps": progress["steps"], "worked_s": pacer.worked,
                "wall_s": time.perf_counter() - progress["began"]}

    def _label_group(self, group: list[Record], device: torch.device) -> None:
        """`_label` for one batch of records."""
        length = max(r.tokens.shape[0] for r in group)
        ids = torch.zeros(len(group), length, dtype=torch.long)
        mask = torch.zeros(len(group), length, dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, :r.tokens.shape[0]] = r.tokens
            mask[i, :r.tokens.shape[0]] = 1
        logits = self._target(input_ids=ids.to(device), attention_mask=mask.to(device),
                              use_cache=False).logits[..., : self.vocab_size]
        top_ids, top_probs = topk_targets(logits, self.config.topk)  # [b, T, k]
        top_ids, top_probs = top_ids.cpu(), top_probs.cpu()
        for i, r in enumerate(group):  # logits at p - 1 predict position p
            rows = slice(r.start - 1, r.tokens.shape[0] - 1)
            r.topk_ids, r.topk_probs = top_ids[i, rows].clone(), top_probs[i, rows].clone()


    # -- the update ------------------------------------------------------------------------------

    def update(self, time_budget_s: float, max_steps: int | None = None,
               stream: object | None = None, duty: float | None = None,
               stop: threading.Event | None = None,
               idle: Callable[[], bool] | None = None) -> UpdateResult:
        """Fine-tune a candidate on the buffer for at most time_budget_s seconds of work (and
        at most max_steps optimizer steps; default: the config's), then accept it only if it
        agrees better with the target on the held-out newest records (see the module
        docstring). stream: a CUDA stream to train on (default: the current one). duty: the
        share of wall time it works (`DistillConfig.duty`; default: the config's, else 1.0).
        stop: an event that ends the labelling and training early (a closing scheduler); the
        candidate trained so far is still evaluated and gated. idle: a piece of work
        (labelling a batch, a training step, an evaluation) begun while it returns True is
        not paced (`Pacer`)."""
        if not time_budget_s > 0:
            raise ValueError(f"time_budget_s={time_budget_s!r} must be > 0")
        if max_steps is None:
            max_steps = self.config.max_steps
        with self._update_lock:
            start = time.perf_counter()
            self._requests_at_update = self.requests_seen
            context = torch.cuda.stream(stream) if stream is not None else nullcontext()
            with context:
                duty = duty if duty is not None else self.config.duty
                pacer = Pacer(duty or 1.0, stop=stop, idle=idle)
                self._progress = {"phase": "labelling", "labelled": 0, "steps": 0,
                                  "pacer": pacer, "began": start}
                try:
                    result = self._update(time_budget_s, max_steps, pacer)
                finally:
                    self._progress = None
            result.seconds = time.perf_counter() - start
            self.update_seconds += result.seconds
            if result.before is not None:
                self.updates["accepted" if result.accepted else "rejected"] += 1
            self.last_result = result
            log.info("draft update %d (%.1f s, %d records labelled by the target): %s",
                     sum(self.updates.values()), result.seconds, result.labelled, result.reason)
            return result

    def _update(self, budget: float, max_steps: int | None, pacer: Pacer) -> UpdateResult:
        """`update`'s work: `budget` seconds of it (labelling, then training), paced."""
        cfg = self.config
        with self._buffer_lock:
            records = list(self._records)
        held = max(cfg.min_holdout, int(len(records) * cfg.holdout_fraction))
        if len(records) <= held:
            return UpdateResult(False, f"too few records ({len(records)}) to hold "
                                f"{held} out and train on the rest")
        labelled = self._label(records, pacer, budget / 2)  # at most half the budget
        if self._target is not None:  # train and decide on labels of one kind
            records = [r for r in records if r.topk_ids is not None]
            # The split is of the records labelled so far (labelling may lag behind the
            # buffer): a share of all records would hold out most of the labelled ones.
            held = max(cfg.min_holdout, int(len(records) * cfg.holdout_fraction))
            if len(records) <= held:
                return UpdateResult(False, f"too few records labelled by the target "
                                    f"({len(records)}) to hold {held} out", labelled=labelled)
        # Held out: the newest records no candidate has trained on (a carried candidate, or
        # the accepted weights, may have trained on older ones).
        fresh = [r for r in records if not r.trained]
        held = min(held, len(fresh))
        if held < cfg.min_holdout:
            return UpdateResult(False, f"too few records no candidate trained on ({len(fresh)})"
                                f" to hold {cfg.min_holdout} out", labelled=labelled)
        holdout = fresh[-held:]
        kept = {id(r) for r in holdout}
        train = [r for r in records if id(r) not in kept]
        self._note(phase="evaluating before")
        with pacer.piece():
            before = self._evaluate_accepted(holdout)
        self._note(phase="training")
        result = UpdateResult(False, "", train_records=len(train), holdout_records=len(holdout),
                              before=before, labelled=labelled)
        order: list[Record] = []
        while pacer.worked < budget and not pacer.stopped and (
                max_steps is None or result.steps < max_steps):
            if not order:
                order = list(train)
                self._rng.shuffle(order)
            group = next(iter(self._batches(order)))
            del order[: len(group)]
            for r in group:
                r.trained = True
            with pacer.piece():
                loss, _, _, labeled = self._scores(group)
                mean = loss[labeled].mean()
                self._optimizer.zero_grad(set_to_none=True)
                mean.backward()
                self._optimizer.step()
                result.losses.append(float(mean.detach()))  # (waits for the step's kernels)
            result.steps += 1
            self._note(steps=result.steps)
        if result.losses:
            result.first_loss, result.last_loss = result.losses[0], result.losses[-1]
        self._note(phase="evaluating after")
        with pacer.piece():
            after = self.evaluate(holdout)
        result.after = after
        finite = all(bool(torch.isfinite(p).all()) for p in self._params.values())
        decision = gate(before, after, cfg.criterion, cfg.confidence, cfg.min_gain,
                        cfg.max_kl_increase, finite)
        result.gate = decision
        result.accepted = decision.accepted
        losses = (f"loss {result.first_loss:.4f} -> {result.last_loss:.4f}"
                  if result.losses else "no training step")
        result.reason = (f"{decision.reason}; {result.steps} steps ({losses}) on "
                         f"{len(train)} records")
        if decision.accepted:
            with torch.no_grad():
                for name, p in self._params.items():
                    self._accepted[name].copy_(p)
            self.version += 1
            self.carried = False
        elif finite and decision.gain >= 0 and after.loss <= before.loss + cfg.max_kl_increase \
                and result.steps:
            self.carried = True  # no worse: it trains on in the next update
            result.reason += "; the candidate trains on"
        else:
            self._restore()
        return result

    @torch.no_grad()
    def _evaluate_accepted(self, records: Sequence[Record]) -> Evaluation:
        """`evaluate` of the accepted weights (the student may carry a candidate: it is put
        aside and back)."""
        if not self.carried:
            return self.evaluate(records)
        candidate = {name: p.detach().clone() for name, p in self._params.items()}
        for name, p in self._params.items():
            p.copy_(self._accepted[name])
        try:
            return self.evaluate(records)
        finally:
            for name, p in self._params.items():
                p.copy_(candidate[name])

    @torch.no_grad()
    def _restore(self) -> None:
        """The student back to the accepted weights, with a fresh optimizer (its moments
        followed the rejected candidate)."""
        for name, p in self._params.items():
            p.copy_(self._accepted[name])
        self._optimizer = self._new_optimizer()
        self.carried = False

    # -- the accepted weights --------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The accepted weights (fp32), by the draft module's parameter names."""
        return dict(self._accepted)

    def due(self, every: int) -> bool:
        """Whether `every` requests have been added since the last update began
        (FuserConfig.distill_every)."""
        return self.requests_seen - self._requests_at_update >= every

    def swap_into(self, swap: WeightSwap) -> bool:
        """Copy the accepted weights into the engine's live draft tensors (stage, then apply
        under the swap's lock); False when they are there already."""
        with self._update_lock:
            if self.version == self.swapped_version:
                return False
            staged = swap.stage(self._accepted)
            version = self.version
        swap.apply(staged)
        self.swapped_version = version
        return True
