"""Adaptive speculation on a stream of requests: the same requests served with adaptation ON
(runtime/adaptive_scheduler.py AdaptiveScheduler: suffix proposals, the draft distilled online) and OFF (the
plain Scheduler: the engine's own speculation), in this process, through the scheduler's API.

    python benchmarks/adapt.py --out $OUT/adapt                     # H200: about 5 minutes
    python benchmarks/adapt.py --workloads 8b --out $OUT/adapt8b     # the 8B shape alone
    python benchmarks/adapt.py --dry-run --out /tmp/adapt            # CPU, tiny: the plumbing

Workloads (--workloads, comma-separated):
  shifted     the bundled pair on text it never saw, found on this machine: C headers under
              /usr/include, .js/.rst/.yaml files under the Python installation, in sorted order,
              the kinds taken in turn, each file cut into 240-character prompts. --requests
              requests in windows of --window; the last window holds only files never sent
              before. Before and after the stream, --python-prompts held-out Python prompts
              (models/heldout_sample.txt, --python-tokens new tokens each).
  repetitive  the bundled pair on prompts whose answer repeats text they contain: a held-out
              Python function, "rewrite this function with a docstring", and its first line.
  8b          a Llama-3-8B-shape target with a random Llama-3.2-1B-shape draft (random bf16
              weights: nothing to learn, and nothing may be lost), the shifted stream's prompts.
Each workload is served OFF, then ON, --concurrency requests at a time, greedy, ignore_eos,
--max-tokens new tokens; between the two the engine's draft gets its built weights back.

Per window of --window requests (in order of completion) it prints output tok/s on and off,
acceptance per source (accepted / proposed tokens) and steps per source, and the draft updates
(accepted / rejected) so far; then the acceptance criteria of issue 44 with PASS / FAIL. It
writes adapt.json and adapt.png (tok/s and acceptance against requests served, on and off) to
--out. Per-source counts come from wrapping the controllers' `update` (ON) and the engine's
`record_step` (OFF) for the run: what the scheduler itself accounts.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

RESULTS: dict = {"workloads": {}, "criteria": []}
CHARS = 240  # characters per shifted-domain prompt
KINDS = ("h", "js", "rst", "yaml")  # the shifted domain's file kinds, taken in turn
MAX_CHUNKS_PER_FILE = 4  # a long file gives at most this many prompts (more files, more variety)


def log(message: str) -> None:
    print(message, flush=True)


# -- the prompts ----------------------------------------------------------------------------------


def _walk(root: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    """Files under root with one of these suffixes, in sorted order (directories too)."""
    if not root.is_dir():
        return
    for directory, subdirs, files in os.walk(root):
        subdirs.sort()
        for name in sorted(files):
            if name.endswith(suffixes):
                yield Path(directory) / name


def shifted_files() -> dict[str, list[Path]]:
    """This machine's files of each kind: C headers under /usr/include, then under the Python
    installation; .js, .rst and .yaml (.yml) under the Python installation (its prefixes, the
    standard library and the site-packages directories; a file found twice counts once)."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = sorted({Path(p) for p in (sys.prefix, sys.base_prefix, paths["stdlib"],
                                       paths["purelib"], paths["platlib"])})
    found: dict[str, list[Path]] = {}
    for kind, suffixes in (("h", (".h",)), ("js", (".js",)), ("rst", (".rst",)),
                           ("yaml", (".yaml", ".yml"))):
        paths: dict[str, Path] = {}
        for root in roots:
            for path in _walk(root, suffixes):
                paths.setdefault(str(path.resolve()), path)
        found[kind] = [paths[k] for k in sorted(paths)]
    # C headers: /usr/include first, then those of the Python installation (torch's, ...)
    system = {str(p.resolve()): p for p in _walk(Path("/usr/include"), (".h",))}
    found["h"] = [system[k] for k in sorted(system)] + [p for p in found["h"]
                                                        if str(p.resolve()) not in system]
    return found


def _chunks(path: Path) -> list[str]:
    """A file's text cut into CHARS-character prompts (at most MAX_CHUNKS_PER_FILE; chunks of
    mostly whitespace dropped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for start in range(0, len(text) - CHARS + 1, CHARS):
        chunk = text[start:start + CHARS]
        if len(chunk.split()) >= 8:
            out.append(chunk)
        if len(out) == MAX_CHUNKS_PER_FILE:
            break
    return out


def shifted_prompts(count: int, last_window: int, files: dict[str, list[Path]] | None = None
                    ) -> tuple[list[str], list[str]]:
    """(prompts, the source file of each): `count` distinct prompts, the kinds' files taken in
    turn; the last `last_window` prompts come only from files none of the earlier ones came
    from. files: {kind: paths} (default: `shifted_files()`)."""
    files = shifted_files() if files is None else files
    queues = {k: iter(files.get(k, [])) for k in KINDS}

    def next_file() -> Iterator[tuple[Path, list[str]]]:
        while queues:
            for kind in list(queues):
                for path in queues[kind]:
                    chunks = _chunks(path)
                    if chunks:
                        yield path, chunks
                        break
                else:
                    del queues[kind]

    sent: set[str] = set()

    def fresh(chunks: list[str]) -> list[str]:  # a text sent before (licence headers) once
        out = [c for c in chunks if c not in sent]
        sent.update(out)
        return out

    source = next_file()
    prompts: list[str] = []
    origins: list[str] = []
    for path, chunks in source:  # the stream before its last window: whole files
        take = fresh(chunks)[:count - last_window - len(prompts)]
        prompts += take
        origins += [str(path)] * len(take)
        if len(prompts) >= count - last_window:
            break
    seen = set(origins)
    for path, chunks in source:  # the last window: files never sent
        if str(path) in seen:
            continue
        take = fresh(chunks)[:count - len(prompts)]
        prompts += take
        origins += [str(path)] * len(take)
        if len(prompts) >= count:
            break
    if len(prompts) < count:
        raise SystemExit(f"only {len(prompts)} shifted-domain prompts found on this machine "
                         f"(/usr/include and the Python installation); --requests {count}")
    return prompts, origins


def python_prompts(count: int) -> list[str]:
    """Held-out Python (models/heldout_sample.txt): each file's first CHARS characters, then
    each file's second, ..."""
    from fuser.models.evaluate import heldout_files

    files = heldout_files()
    prompts: list[str] = []
    window = 0
    while len(prompts) < count:
        row = [t[window * CHARS:(window + 1) * CHARS] for t in files
               if len(t) >= (window + 1) * CHARS]
        if not row:
            raise SystemExit(f"the held-out sample has fewer than {count} Python prompts")
        prompts += row
        window += 1
    return prompts[:count]


def repetitive_prompts(count: int) -> list[str]:
    """Prompts whose answer repeats text they contain: a held-out function (at most 600
    characters), then "rewrite this function with a docstring" and its first line."""
    from fuser.models.evaluate import heldout_files

    functions = []
    for text in heldout_files():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                source = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if 120 <= len(source) <= 600 and source.startswith("def "):
                    functions.append(source)
    if not functions:
        raise SystemExit("no held-out Python function for the repetitive stream")
    prompts = []
    for i in range(count):
        source = functions[i % len(functions)]
        first = source.splitlines()[0]
        prompts.append(f"{source}\n\n\n# Rewrite this function with a docstring.\n{first}\n")
    return prompts


class CharTokenizer:
    """Characters as ids in [3, vocab) (the dry run's tiny models have no tokenizer)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, text: str, **kwargs: object) -> dict:
        return {"input_ids": [3 + ord(c) % (self.vocab_size - 3) for c in text]}


def tokenize(tokenizer: Callable, texts: Sequence[str], max_len: int) -> list[list[int]]:
    """Token ids of each text (its last max_len, at least one)."""
    out = []
    for text in texts:
        ids = list(tokenizer(text, verbose=False)["input_ids"]) if not isinstance(
            tokenizer, CharTokenizer) else tokenizer(text)["input_ids"]
        out.append(ids[-max_len:] or [3])
    return out


# -- serving a stream -----------------------------------------------------------------------------


@dataclass
class Tally:
    """Steps, accepted and proposed tokens per source, as the scheduler accounts them."""

    counts: dict[str, list[int]] = field(default_factory=dict)  # source -> [steps, acc, prop]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, source: str, accepted: int, proposed: int) -> None:
        with self.lock:
            row = self.counts.setdefault(source, [0, 0, 0])
            row[0] += 1
            row[1] += accepted
            row[2] += proposed

    def copy(self) -> dict[str, list[int]]:
        with self.lock:
            return {s: list(v) for s, v in self.counts.items()}


def attach_tally(scheduler: object, engine: object) -> Callable[[], None]:
    """Count every step's source, accepted and proposed tokens into scheduler.tally; returns
    what undoes it. ON: each controller's `update(num_accepted, gamma, proposed=,
    row_sources=)`; OFF (no controllers): the engine's `record_step` (gamma 0: target-only,
    else the draft)."""
    tally = Tally()
    scheduler.tally = tally
    controllers = getattr(scheduler, "controllers", None)
    undo: list[Callable[[], None]] = []
    if controllers:
        for controller in controllers.values():
            original = controller.update

            def update(num_accepted: Sequence[int], gamma: int | None = None, *args: object,
                       proposed: Sequence[int] | None = None,
                       row_sources: Sequence[str] | None = None,
                       _original: Callable = original, **kwargs: object) -> object:
                # runtime/controller.py's update: a step mixes suffix rows and draft rows, so
                # tokens go to each row's source and the step to each source it used.
                g = gamma or 0
                props = list(proposed) if proposed is not None else [g] * len(num_accepted)
                sources = list(row_sources) if row_sources is not None else \
                    ["draft" if g else "target"] * len(num_accepted)
                if not g:
                    tally.add("target", 0, 0)
                for source in sorted(set(sources)) if g else ():
                    rows = [i for i, s in enumerate(sources) if s == source]
                    tally.add(str(source), sum(min(num_accepted[i], props[i]) for i in rows),
                              sum(props[i] for i in rows))
                return _original(num_accepted, gamma, *args, proposed=proposed,
                                 row_sources=row_sources, **kwargs)

            controller.update = update
            undo.append(lambda c=controller: c.__dict__.pop("update", None))
    else:
        original = engine.record_step

        def record_step(controller: object, num_accepted: list[int], was_active: list[bool],
                        gamma: int, *args: object, **kwargs: object) -> object:
            live = [n for n, a in zip(num_accepted, was_active) if a]
            tally.add("draft" if gamma else "target",
                      sum(min(n, gamma) for n in live), gamma * len(live))
            return original(controller, num_accepted, was_active, gamma, *args, **kwargs)

        engine.record_step = record_step
        undo.append(lambda: engine.__dict__.pop("record_step", None))
    return lambda: [u() for u in undo]


def serve(scheduler: object, prompts: Sequence[list[int]], max_tokens: int, concurrency: int,
          every: int | None = None) -> list[dict]:
    """Serve every prompt, `concurrency` at a time (one client thread each, in order): per
    request, in order of completion, its index, finish time, output tokens, the tally then and
    the draft updates then; every `every` completions also the controller's costs then
    (`costs_of`: ON only)."""
    from fuser.runtime.scheduler import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    lock = threading.Lock()
    state = {"next": 0}
    done: list[dict] = []
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                i = state["next"]
                state["next"] += 1
            if i >= len(prompts) or errors:
                return
            try:
                out = scheduler.submit(prompts[i], params).result(600.0)
            except BaseException as e:  # noqa: BLE001 -- reported after the run
                errors.append(e)
                return
            with lock:
                done.append({"index": i, "time": time.perf_counter(), "tokens": len(out),
                             "tally": scheduler.tally.copy(), "updates": updates_of(scheduler)})
                if every and len(done) % every == 0:
                    done[-1]["costs"] = costs_of(scheduler)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]!r}") from errors[0]
    for record in done:
        record["time"] -= start
    return done


PROFILE_KEPT = 60  # functions of each mode's host profile kept in adapt.json


@contextlib.contextmanager
def profiled_iterations(scheduler: object) -> Iterator[dict]:
    """cProfile around each of the scheduler's iterations, on its own thread; at exit the
    yielded dict holds the steps taken, the profiled own time a step (microseconds) with the
    waits for the device apart (`synchronize`: not host work), and the 12 functions of most
    own time a step, those waits left out. The profiler slows the loop: its shares, not its totals, say where the
    host's time goes."""
    import cProfile
    import pstats
    from collections import Counter

    profile = cProfile.Profile()
    original, first = scheduler._iteration, scheduler.steps

    def iteration() -> None:
        profile.enable()
        try:
            original()
        finally:
            profile.disable()

    scheduler._iteration = iteration  # (the loop calls self._iteration: this one now)
    out: dict = {}
    try:
        yield out
    finally:
        del scheduler._iteration
        steps = max(scheduler.steps - first, 1)
        own: Counter = Counter()
        for (file, line, name), (_, _, seconds, _, _) in pstats.Stats(profile).stats.items():
            own[f"{Path(file).name}:{line}({name})"] += seconds
        waits = {k: own.pop(k) for k in [k for k in own if "synchronize" in k]}
        out.update(steps=steps, host_us=1e6 * sum(own.values()) / steps,
                   wait_us=1e6 * sum(waits.values()) / steps,
                   top=[(k, 1e6 * v / steps) for k, v in own.most_common(12)],
                   own={k: 1e6 * v / steps for k, v in own.most_common(PROFILE_KEPT)})


def profile_difference(off: dict, on: dict, top: int = 12) -> str:
    """The functions whose own time a step ON exceeds OFF's most (microseconds a step, each
    mode's PROFILE_KEPT largest; a function absent from a mode's counts 0 there): where the
    adaptive loop's extra host time goes."""
    extra = {name: us - off["own"].get(name, 0.0) for name, us in on["own"].items()}
    largest = sorted(extra.items(), key=lambda item: -item[1])[:top]
    listed = ", ".join(f"{name} {us:+.1f}" for name, us in largest)
    return (f"  host profile, on - off: own time {on['host_us'] - off['host_us']:+.1f} us a "
            f"step; most extra (us a step): {listed}")


def profile_line(mode: str, requests: int, prof: dict) -> str:
    top = ", ".join(f"{name} {us:.1f}" for name, us in prof["top"])
    return (f"  {mode:>3} host profile: {requests} requests, {prof['steps']} steps, own time "
            f"{prof['host_us']:.1f} us a step beside {prof['wait_us']:.1f} us of device waits; "
            f"most own time (us a step): {top}")


def costs_of(scheduler: object) -> dict[str, object] | None:
    """ON: the largest bucket's controller now: its best arm, and per source the cheapest
    measured arm and its cost in ms per emitted token (the choice's inputs); OFF: None."""
    snapshot = getattr(scheduler, "snapshot", None)
    if snapshot is None:
        return None
    buckets = snapshot()["buckets"]
    bucket = buckets[max(buckets)]
    cheapest: dict[str, tuple[int, float]] = {}
    for arm, seconds in bucket["seconds_per_token"].items():
        source, gamma = arm.split(":")
        if seconds != float("inf") and (source not in cheapest
                                        or seconds < cheapest[source][1]):
            cheapest[source] = (int(gamma), seconds)
    return {"best": list(bucket["best"]),
            "cheapest": {s: [g, 1e3 * c] for s, (g, c) in cheapest.items()}}


def updates_of(scheduler: object) -> dict[str, int]:
    distiller = getattr(scheduler, "distiller", None)
    return dict(distiller.updates) if distiller is not None else {"accepted": 0, "rejected": 0}


def arms_of(scheduler: object) -> str:
    """ON: the controllers' steps per source so far (draft: the plain speculative step;
    suffix: the mixed step, the draft's rows beside the index's), the suffix index's lookups
    on the steps' path, each bucket's best arm with its measured ms per emitted token, and
    the draft update under way (its phase, and the seconds it worked in the wall clock's);
    OFF: ''."""
    snapshot = getattr(scheduler, "snapshot", None)
    if snapshot is None:
        return ""
    snap = snapshot()
    steps = " ".join(f"{s} {n}" for s, n in snap["steps"].items())
    best = []
    for size, b in snap["buckets"].items():
        if not b["chosen"]:
            continue
        source, gamma = b["best"]
        ms = b["seconds_per_token"].get(f"{source}:{gamma}")
        best.append(f"{size}: {source} {gamma}" + (f" {1e3 * ms:.3g} ms" if ms else ""))
    lookups = f", lookups {snap['lookups']}" if "lookups" in snap else ""
    flight = snap.get("update_in_flight")
    update = "" if flight is None else (
        f"; an update {flight['phase']} ({flight['labelled']} records labelled, "
        f"{flight['steps']} steps; worked {flight['worked_s']:.2f} s in "
        f"{flight['wall_s']:.1f} s)")
    return f", steps {steps}{lookups}; best {', '.join(best) or '-'}{update}"


def measured_of(scheduler: object, engine: object) -> dict[str, dict[str, dict[str, float]]]:
    """Per bucket with measured steps, its controller's `measured()` (ON: the adaptive
    scheduler's controllers; OFF: the engine's, gamma auto): per arm what its cost counted
    against the wall time between read-backs."""
    controllers = getattr(scheduler, "controllers", None) or {
        size: engine.controller(size) for size in engine.buckets}
    return {str(size): c.measured() for size, c in controllers.items()
            if c is not None and c.trace}


def measured_lines(mode: str, measured: dict[str, dict[str, dict[str, float]]],
                   min_steps: int = 1) -> list[str]:
    """One line per (bucket, arm) with at least `min_steps` measured steps: its steps, probes,
    switches (steps after one of another arm's policy: not averaged) and fallbacks (steps run
    for another arm, e.g. the suffix's where no row matched), the median counted seconds of
    all its steps and of its steady ones (neither), the read-back interval, the host's issuing
    time, the tokens per row, and the draft's catch-up seconds per step charged to it (the
    steps that did not run the draft: target-only, the long suffix arms) with the steps of
    its own that ran a catch-up first (not in their seconds)."""
    lines = []
    for size, arms in measured.items():
        for name, m in arms.items():
            if m["steps"] >= min_steps:
                lines.append(
                    f"  {mode:>3} measured bucket {size} {name}: {m['steps']} steps "
                    f"({m['probes']} probes, {m.get('switches', 0)} switches, "
                    f"{m.get('fallbacks', 0)} fallbacks), counted {1e3 * m['seconds']:.3g} ms "
                    f"(steady {1e3 * m.get('steady', float('nan')):.3g} ms), read-back "
                    f"interval {1e3 * m['interval']:.3g} ms, host {1e3 * m['host']:.3g} ms, "
                    f"tokens/row {m['tokens']:.2f}, catch-up {1e3 * m.get('catch_up', 0.0):.3g} "
                    f"ms a step charged, {m.get('resyncs', 0)} run first")
    return lines


def windows(records: list[dict], size: int) -> list[dict]:
    """Per window of `size` completions: output tok/s (tokens over the time since the previous
    window's last completion), per source acceptance and steps within the window, updates."""
    out = []
    previous_time, previous_tally = 0.0, {}
    for w in range(0, len(records), size):
        chunk = records[w:w + size]
        seconds = chunk[-1]["time"] - previous_time
        tally = chunk[-1]["tally"]
        sources = {}
        for source, (steps, accepted, proposed) in tally.items():
            s0, a0, p0 = previous_tally.get(source, (0, 0, 0))
            sources[source] = {"steps": steps - s0, "accepted": accepted - a0,
                               "proposed": proposed - p0,
                               "acceptance": (accepted - a0) / (proposed - p0)
                               if proposed > p0 else None}
        out.append({"requests": w + len(chunk), "seconds": seconds,
                    "tok_s": sum(r["tokens"] for r in chunk) / max(seconds, 1e-9),
                    "sources": sources, "updates": chunk[-1]["updates"],
                    "costs": chunk[-1].get("costs")})
        previous_time, previous_tally = chunk[-1]["time"], tally
    return out


def tok_s(records: list[dict]) -> float:
    return sum(r["tokens"] for r in records) / max(records[-1]["time"], 1e-9)


# -- the engines ----------------------------------------------------------------------------------


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def build(target: torch.nn.Module, draft: torch.nn.Module, tokenizer: object | None,
          args: argparse.Namespace, what: str) -> object:
    import fuser
    from fuser.pipeline import build_engine

    device, _ = device_and_dtype()
    buckets = "auto" if device.type == "cuda" else (1, args.concurrency)
    candidates = args.gamma_candidates or ((1, 2) if args.dry_run else None)
    # suffix_speculation: the target's verify steps at the long suffix gammas too (ON's long
    # suffix arms; OFF never runs them).
    config = fuser.FuserConfig(max_batch_size=args.concurrency, max_seq_len=args.max_seq_len,
                               batch_buckets=buckets, compile=args.compile,
                               suffix_speculation=True,
                               **({"gamma_candidates": candidates} if candidates else {}))
    log(f"building the {what} engine ({args.concurrency} rows, max_seq_len {args.max_seq_len}, "
        f"compile {args.compile}) ...")
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = build_engine(target, draft, config, tokenizer)
    RESULTS.setdefault("build_seconds", {})[what] = time.perf_counter() - start
    log(f"built in {time.perf_counter() - start:.1f} s")
    return engine


def bundled(args: argparse.Namespace) -> tuple[object, object]:
    """(engine of the bundled pair, tokenizer); the dry run: a tiny random pair, characters."""
    if args.dry_run:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tiny_models import tiny_pair

        target, draft, _ = tiny_pair(torch.device("cpu"))
        return build(target, draft, None, args, "tiny pair"), CharTokenizer(160)
    from fuser.launch import load_pair
    from fuser.models import bundled_pair

    pair = bundled_pair()
    if pair is None:
        raise SystemExit("the bundled pair is not installed (fuser.models TARGET_PATH)")
    target, draft, tokenizer, name = load_pair(str(pair[0]), str(pair[1]))
    return build(target, draft, tokenizer, args, name), tokenizer


def shape_8b(args: argparse.Namespace) -> object:
    """The 8B-shape target with a random 1B-shape draft (the dry run: two tiny random Llamas)."""
    import transformers

    from fuser.models import PRESETS

    device, dtype = device_and_dtype()
    names = ("tiny-random-llama", "tiny-random-llama") if args.dry_run else \
        ("llama-3-8b", "llama-3.2-1b")
    models = []
    for seed, name in enumerate(names):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                models.append(transformers.LlamaForCausalLM(
                    transformers.LlamaConfig(**PRESETS[name])).eval())
        finally:
            torch.set_default_dtype(torch.float32)
    return build(models[0], models[1], None, args, " + ".join(names))


def warm_up(engine: object, prompts: Sequence[list[int]], concurrency: int) -> None:
    """Serve one short request per distinct prompt length through a plain scheduler, so that
    neither mode pays the first capture of a prefill length inside its timing."""
    from fuser.runtime.scheduler import Scheduler

    lengths = {}
    for p in prompts:
        lengths.setdefault(len(p), p)
    scheduler = Scheduler(engine)
    scheduler.start()
    try:
        scheduler.tally = Tally()
        serve(scheduler, list(lengths.values()), 2, concurrency)
        scheduler.wait_idle(600.0)  # (the prefill graphs they ran uncaptured: captured now)
    finally:
        scheduler.close()


def make_scheduler(engine: object, on: bool, args: argparse.Namespace) -> object:
    import dataclasses

    from fuser.runtime.scheduler import Scheduler

    if not on:
        return Scheduler(engine, max_waiting=max(256, args.concurrency))
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.distill import DistillConfig

    given = {k: v for k, v in (("distill_every", args.distill_every),
                               ("distill_budget_s", args.distill_budget_s)) if v is not None}
    engine.config = dataclasses.replace(engine.config, **given)
    options: dict = {"batch_tokens": 256, "max_steps": 4} if args.dry_run else {}
    options.update({k: v for k, v in (("lr", args.lr), ("max_steps", args.distill_steps))
                    if v is not None})
    distill = DistillConfig(duty=args.distill_duty, **options)
    return AdaptiveScheduler(engine, max_waiting=max(256, args.concurrency), suffix=True,
                             adapt_draft=True, distill=distill)


def run_mode(engine: object, on: bool, phases: list[tuple[str, list[list[int]], int]],
             args: argparse.Namespace) -> dict:
    """Serve each phase (name, prompts, max_tokens) in turn on one scheduler (ON or OFF):
    per phase its records; ON ends with the draft's built weights back in the engine."""
    from fuser.runtime.distill import WeightSwap, draft_module

    mode = "on" if on else "off"
    original = {n: p.detach().clone() for n, p in draft_module(engine).named_parameters()} \
        if on else None
    start = time.perf_counter()
    scheduler = make_scheduler(engine, on, args)
    setup = time.perf_counter() - start
    undo = attach_tally(scheduler, engine)
    scheduler.start()
    out: dict = {"setup_seconds": setup}
    try:
        for name, prompts, max_tokens in phases:
            records = serve(scheduler, prompts, max_tokens, args.concurrency,
                            every=args.window)
            out[name] = records
            log(f"  {mode:>3} {name}: {len(records)} requests, {tok_s(records):,.0f} tok/s, "
                f"updates {updates_of(scheduler)}{arms_of(scheduler)}")
        out["measured"] = measured_of(scheduler, engine)
        for line in measured_lines(mode, out["measured"]):
            log(line)
        # Steps that ran uncaptured (a graph missing, or a bucket still being captured):
        # host-bound steps whose costs would mislead the controllers.
        out["uncaptured_runs"] = {
            str(size): {f"gamma {g} {'sample' if sample else 'greedy'}": n
                        for (g, sample), n in bucket.uncaptured_runs.items()}
            for size, bucket in engine.buckets.items() if bucket.uncaptured_runs}
        if out["uncaptured_runs"]:
            log(f"  {mode:>3} uncaptured steps (cumulative, both modes): "
                f"{out['uncaptured_runs']}")
        suffix_uncaptured = getattr(scheduler, "suffix_uncaptured", None)
        if suffix_uncaptured:
            log(f"  {mode:>3} suffix and mixed steps run uncaptured: "
                f"{scheduler.snapshot()['suffix_uncaptured']}")
        if on and getattr(scheduler, "snapshot", None) is not None:
            out["snapshot"] = json.loads(json.dumps(scheduler.snapshot(), default=str))
            out["update_reasons"] = [r.reason for r in getattr(scheduler, "update_results", [])]
    finally:
        undo()
        scheduler.close()
        if original is not None:  # the next run starts from the built draft
            WeightSwap.for_engine(engine).swap(original)
    return out


# -- the workloads --------------------------------------------------------------------------------


@contextlib.contextmanager
def own_scheduler(engine: object, on: bool, args: argparse.Namespace) -> Iterator[object]:
    """A started scheduler of its own for one mode (ON or OFF), closed after the block."""
    scheduler = make_scheduler(engine, on, args)
    scheduler.tally = Tally()
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.close()


def profile_mode(engine: object, on: bool, prompts: list[list[int]], max_tokens: int,
                 args: argparse.Namespace) -> dict:
    """`prompts` served by a scheduler of their own (ON or OFF), its loop profiled
    (`profiled_iterations`); -> the profile."""
    with own_scheduler(engine, on, args) as scheduler, \
            profiled_iterations(scheduler) as prof:
        serve(scheduler, prompts, max_tokens, args.concurrency)
    log(profile_line("on" if on else "off", len(prompts), prof))
    return prof


def trace_mode(engine: object, on: bool, prompts: list[list[int]], max_tokens: int,
               args: argparse.Namespace, stem: Path) -> dict:
    """`prompts` served by a scheduler of their own (ON or OFF) under torch.profiler
    (`timeline.profiled`): the timeline and the op tables at `stem`, the device's idle gaps
    with the host's ops in them logged; -> the gaps."""
    from timeline import profiled

    with own_scheduler(engine, on, args) as scheduler, profiled(stem) as summary:
        serve(scheduler, prompts, max_tokens, args.concurrency)
    log(f"  {'on' if on else 'off':>3} trace, {len(prompts)} requests: {summary['line']}")
    return summary["gaps"]


def on_off(engine: object, name: str, phases: list[tuple[str, list[list[int]], int]],
           args: argparse.Namespace) -> dict:
    warm_up(engine, [p for _, prompts, _ in phases for p in prompts], args.concurrency)
    out = {}
    _, longest, longest_tokens = max(phases, key=lambda phase: len(phase[1]))
    if args.profile_host:  # the longest phase's first prompts, each mode's loop profiled
        out["host_profile"] = {mode: profile_mode(engine, on, longest[:args.profile_host],
                                                  longest_tokens, args)
                               for mode, on in (("off", False), ("on", True))}
        log(profile_difference(out["host_profile"]["off"], out["host_profile"]["on"]))
    if args.trace:  # the same, under torch.profiler: where the device waited for the host
        out["trace"] = {mode: trace_mode(engine, on, longest[:args.trace], longest_tokens, args,
                                         Path(args.out) / f"trace_{name}_{mode}")
                        for mode, on in (("off", False), ("on", True))}
    out.update(off=run_mode(engine, False, phases, args), on=run_mode(engine, True, phases, args))
    return out


def window_table(name: str, off: list[dict], on: list[dict]) -> list[str]:
    lines = [f"--- {name}: per window (requests served; output tok/s; acceptance accepted/"
             "proposed and steps per source; draft updates accepted/rejected)",
             f"{'requests':>8} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7}  "
             f"{'off draft':>15}  {'on draft':>15}  {'on suffix':>15}  {'on target':>9}  "
             "updates  on's controller at the window's end: best; ms/token, cheapest arm "
             "of each source"]

    def cell(w: dict, source: str) -> str:
        s = w["sources"].get(source)
        if not s:
            return "-"
        acc = "-" if s["acceptance"] is None else f"{s['acceptance']:.3f}"
        return f"{acc} ({s['steps']})"

    for a, b in zip(off, on):
        lines.append(f"{b['requests']:>8} {a['tok_s']:>10,.0f} {b['tok_s']:>10,.0f} "
                     f"{b['tok_s'] / a['tok_s']:>7.2f}  {cell(a, 'draft'):>15}  "
                     f"{cell(b, 'draft'):>15}  {cell(b, 'suffix'):>15}  "
                     f"{b['sources'].get('target', {}).get('steps', 0):>9}  "
                     f"{b['updates']['accepted']}/{b['updates']['rejected']}{costs(b)}")
    return lines


def costs(window: dict) -> str:
    """`costs_of` at the window's end, as the table's last column ('' where not taken)."""
    c = window.get("costs")
    if not c:
        return ""
    cheapest = ", ".join(f"{s} {g} {ms:.3g}" for s, (g, ms) in sorted(c["cheapest"].items()))
    return f"     {c['best'][0]} {c['best'][1]}; {cheapest}"


def criterion(text: str, ok: bool | None, value: str) -> None:
    mark = "PASS" if ok else ("n/a" if ok is None else "FAIL")
    RESULTS["criteria"].append({"criterion": text, "pass": ok, "value": value})
    log(f"{mark:>4}  {text}: {value}")


def shifted(args: argparse.Namespace, engine: object, tokenizer: object) -> None:
    last = min(args.window, args.requests)
    texts, origins = shifted_prompts(args.requests, last)
    stream = tokenize(tokenizer, texts, args.max_seq_len - args.max_tokens)
    python = tokenize(tokenizer, python_prompts(args.python_prompts),
                      args.max_seq_len - args.python_tokens)
    kinds = {k: sum(o.endswith(f".{k}") or (k == "yaml" and o.endswith(".yml"))
                    for o in origins) for k in KINDS}
    log(f"shifted domain: {len(stream)} prompts ({kinds}), {len(python)} Python prompts")
    phases = [("python_before", python, args.python_tokens), ("stream", stream, args.max_tokens),
              ("python_after", python, args.python_tokens)]
    runs = on_off(engine, "shifted", phases, args)
    result = {"kinds": kinds, "last_window_files_new": len(set(origins[-last:]) & set(
        origins[:-last])) == 0}
    for mode in ("off", "on"):
        result[mode] = {"windows": windows(runs[mode]["stream"], args.window),
                        "tok_s": {p: tok_s(runs[mode][p]) for p, _, _ in phases},
                        "setup_seconds": runs[mode]["setup_seconds"],
                        "measured": runs[mode].get("measured")}
    result["on"]["snapshot"] = runs["on"].get("snapshot")
    result["on"]["update_reasons"] = runs["on"].get("update_reasons")
    result["host_profile"], result["trace"] = runs.get("host_profile"), runs.get("trace")
    RESULTS["workloads"]["shifted"] = result
    off_w, on_w = result["off"]["windows"], result["on"]["windows"]
    table = window_table("shifted domain", off_w, on_w)
    for p, _, _ in phases:
        a, b = result["off"]["tok_s"][p], result["on"]["tok_s"][p]
        table.append(f"{p}: off {a:,.0f} tok/s, on {b:,.0f} tok/s ({b / a:.2f}x)")
    RESULTS.setdefault("tables", []).append(table)
    log("\n".join(table))


def shifted_criteria() -> None:
    result = RESULTS["workloads"].get("shifted")
    if result is None:
        return
    off_w, on_w = result["off"]["windows"], result["on"]["windows"]
    ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(off_w, on_w)]
    criterion("shifted: every window on >= 0.95x off", min(ratios) >= 0.95,
              "lowest " + f"{min(ratios):.2f}x (window {ratios.index(min(ratios)) + 1})")
    criterion("shifted: last window (files never sent) on >= 1.25x off", ratios[-1] >= 1.25,
              f"{ratios[-1]:.2f}x")

    def draft_acceptance(w: dict) -> float | None:
        return (w["sources"].get("draft") or {}).get("acceptance")

    def rounded(x: float | None) -> float | None:
        return x if x is None else round(x, 3)

    # Learning, not window-to-window noise: the gain needs an accepted draft update behind it
    # (the rows the draft keeps vary with the suffix index's; OFF's windows for reference).
    first, last = draft_acceptance(on_w[0]), draft_acceptance(on_w[-1])
    accepted = on_w[-1]["updates"].get("accepted", 0)
    ok = None if first is None or last is None else last >= first + 0.15 and accepted > 0
    criterion("shifted: draft acceptance, last window >= first + 0.15, by accepted updates", ok,
              f"{rounded(first)} -> {rounded(last)}, {accepted} updates accepted (off "
              f"{rounded(draft_acceptance(off_w[0]))} -> {rounded(draft_acceptance(off_w[-1]))})")
    for phase in ("python_before", "python_after"):
        a, b = result["off"]["tok_s"][phase], result["on"]["tok_s"][phase]
        criterion(f"shifted: {phase.replace('_', ' ')} on >= 0.98x off", b >= 0.98 * a,
                  f"{b / a:.2f}x ({b:,.0f} / {a:,.0f} tok/s)")


def repetitive(args: argparse.Namespace, engine: object, tokenizer: object) -> None:
    prompts = tokenize(tokenizer, repetitive_prompts(args.repetitive_requests),
                       args.max_seq_len - args.repetitive_tokens)
    log(f"repetitive: {len(prompts)} prompts")
    runs = on_off(engine, "repetitive", [("stream", prompts, args.repetitive_tokens)], args)
    result = {m: {"windows": windows(runs[m]["stream"], args.window),
                  "tok_s": tok_s(runs[m]["stream"])} for m in ("off", "on")}
    result["host_profile"], result["trace"] = runs.get("host_profile"), runs.get("trace")
    RESULTS["workloads"]["repetitive"] = result
    table = window_table("repetitive", result["off"]["windows"], result["on"]["windows"])
    RESULTS.setdefault("tables", []).append(table)
    log("\n".join(table))
    a, b = result["off"]["tok_s"], result["on"]["tok_s"]
    RESULTS["workloads"]["repetitive"]["ratio"] = b / a


def repetitive_criteria() -> None:
    result = RESULTS["workloads"].get("repetitive")
    if result is not None:
        a, b = result["off"]["tok_s"], result["on"]["tok_s"]
        criterion("repetitive: on >= 2x off", b >= 2 * a, f"{b / a:.2f}x ({b:,.0f} / {a:,.0f})")


def eight_b(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from fuser.models import TARGET_PATH

    engine = shape_8b(args)
    tokenizer = CharTokenizer(engine.vocab_size) if args.dry_run else \
        AutoTokenizer.from_pretrained(str(TARGET_PATH))  # its ids are < the 8B vocabulary
    texts, _ = shifted_prompts(args.requests_8b, min(args.window, args.requests_8b))
    prompts = tokenize(tokenizer, texts, args.max_seq_len - args.max_tokens)
    log(f"8b: {len(prompts)} prompts")
    runs = on_off(engine, "8b", [("stream", prompts, args.max_tokens)], args)
    result = {m: {"windows": windows(runs[m]["stream"], args.window),
                  "tok_s": tok_s(runs[m]["stream"])} for m in ("off", "on")}
    result["on"]["update_reasons"] = runs["on"].get("update_reasons")
    result["trace"] = runs.get("trace")
    RESULTS["workloads"]["8b"] = result
    table = window_table("8B shape, random 1B-shape draft", result["off"]["windows"],
                         result["on"]["windows"])
    RESULTS.setdefault("tables", []).append(table)
    log("\n".join(table))
    del engine


def eight_b_criteria() -> None:
    result = RESULTS["workloads"].get("8b")
    if result is not None:
        a, b = result["off"]["tok_s"], result["on"]["tok_s"]
        criterion("8b: on >= 0.95x off", b >= 0.95 * a, f"{b / a:.2f}x ({b:,.0f} / {a:,.0f})")


# -- output ---------------------------------------------------------------------------------------


def save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapt.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def plot(out: Path) -> None:
    """adapt.png: per workload, output tok/s against requests served (on, off), and for the
    shifted stream the acceptance per source (on: draft, suffix; off: draft)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no adapt.png")
        return
    workloads = RESULTS["workloads"]
    panels = [(n, "tok_s") for n in workloads] + \
        ([("shifted", "acceptance")] if "shifted" in workloads else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, what) in zip(axes[0], panels):
        result = workloads[name]
        for mode, style in (("off", "--"), ("on", "-")):
            w = result[mode]["windows"]
            x = [v["requests"] for v in w]
            if what == "tok_s":
                ax.plot(x, [v["tok_s"] for v in w], style, marker="o", label=mode)
            else:
                for source in ("draft", "suffix"):
                    y = [(v["sources"].get(source) or {}).get("acceptance") for v in w]
                    if any(a is not None for a in y):
                        ax.plot(x, [float("nan") if a is None else a for a in y], style,
                                marker="o", label=f"{mode} {source}")
        ax.set_xlabel("requests served")
        ax.set_ylabel("output tok/s" if what == "tok_s" else "acceptance (accepted / proposed)")
        ax.set_title(f"{name}: {'throughput' if what == 'tok_s' else 'acceptance'}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "adapt.png", dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/fuser-out/adapt", help="where adapt.json and "
                   "adapt.png go (default: %(default)s)")
    p.add_argument("--workloads", default="shifted,repetitive,8b",
                   help="comma-separated: shifted, repetitive, 8b (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny random models on CPU, tiny sizes: the plumbing, not the numbers")
    p.add_argument("--concurrency", type=int, default=16,
                   help="requests at a time, and the engine's rows (default: %(default)s)")
    p.add_argument("--requests", type=int, default=2000,
                   help="shifted-domain requests (default: %(default)s)")
    p.add_argument("--window", type=int, default=200, help="requests per window")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per stream request")
    p.add_argument("--python-prompts", type=int, default=64,
                   help="held-out Python prompts before and after the shifted stream")
    p.add_argument("--python-tokens", type=int, default=128,
                   help="new tokens per Python prompt (default: %(default)s)")
    p.add_argument("--profile-host", type=int, default=0, metavar="N",
                   help="before the timed runs, serve the longest phase's first N prompts "
                        "with a scheduler of each mode's, its loop under cProfile, and print "
                        "where its host time goes (default 0: not)")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="before the timed runs, serve the longest phase's first N prompts with "
                        "a scheduler of each mode's under torch.profiler: trace_<workload>_"
                        "<mode>.trace.json and .txt in --out, and a line of the device's idle "
                        "gaps with the host's ops in them (default 0: not)")
    p.add_argument("--repetitive-requests", type=int, default=400)
    p.add_argument("--repetitive-tokens", type=int, default=128)
    p.add_argument("--requests-8b", type=int, default=400)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--compile", default="auto", help="FuserConfig.compile (default: auto)")
    p.add_argument("--gamma-candidates", default=None,
                   type=lambda text: tuple(int(g) for g in text.split(",")),
                   help="FuserConfig.gamma_candidates, comma-separated (default: the config's; "
                        "fewer build faster)")
    p.add_argument("--distill-every", type=int, default=None,
                   help="ON: finished requests between draft updates (default: "
                        "FuserConfig.distill_every, 200: one a window)")
    p.add_argument("--distill-budget-s", type=float, default=None,
                   help="ON: at most this many seconds of work per draft update (default: "
                        "FuserConfig.distill_budget_s)")
    p.add_argument("--distill-steps", type=int, default=None,
                   help="ON: training steps per draft update (default: DistillConfig.max_steps)")
    p.add_argument("--lr", type=float, default=None,
                   help="ON: the distiller's learning rate (default: DistillConfig.lr)")
    p.add_argument("--distill-duty", type=float, default=None,
                   help="ON: DistillConfig.duty, the share of the wall clock an update works "
                        "whatever the load (default: none; the adaptive scheduler's "
                        "SERVING_DUTY while requests run, unpaced while the server idles)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.concurrency, args.requests, args.window, args.max_tokens = 2, 12, 4, 4
        args.python_prompts, args.python_tokens = 2, 4
        args.repetitive_requests, args.repetitive_tokens = 4, 4
        args.requests_8b, args.max_seq_len, args.compile = 4, 160, "fx"
        args.distill_every, args.distill_budget_s = 4, 30.0
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - {"shifted", "repetitive", "8b"}
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)} (shifted, repetitive, 8b)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    RESULTS["args"] = {k: v for k, v in vars(args).items()}
    RESULTS["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if {"shifted", "repetitive"} & set(args.workloads):
        engine, tokenizer = bundled(args)
        if "shifted" in args.workloads:
            shifted(args, engine, tokenizer)
            save(out)
        if "repetitive" in args.workloads:
            repetitive(args, engine, tokenizer)
            save(out)
        del engine
    if "8b" in args.workloads:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        eight_b(args)
        save(out)
    log("")
    for table in RESULTS.get("tables", []):
        log("\n".join(table))
    log("--- criteria (issue 44)")
    shifted_criteria()
    repetitive_criteria()
    eight_b_criteria()
    save(out)
    plot(out)
    log(f"wrote {out / 'adapt.json'} and {out / 'adapt.png'}")
    if args.dry_run:
        log("dry run on CPU: tiny random models; the numbers mean nothing")


if __name__ == "__main__":
    main()
