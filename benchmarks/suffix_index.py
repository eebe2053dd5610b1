"""Host time of the suffix index (runtime/suffix_index.py) per decoding step: what the adaptive
scheduler spends on the host each step for `rows` running requests, measured on the CPU.

    lookup   `propose_arrays` over all rows (`propose_many` where a tree has none), for the
             scheduler's proposal width (max gamma 6: 13 tokens), as
             runtime/adaptive_scheduler.py calls it once a step;
    extend   each row's tokens of one step handed to the index (`tokens` a row) and indexed
             (`flush`: the n-grams they end hashed and inserted);
    step     the two together: the index's host time per decoding step;
    load     the step's proposals into the static buffer the captured step reads
             (`SuffixProposals.load_arrays`, or `load`; on a CPU buffer: the host side of the
             copy);
    finish   a request leaving for the recent pool (per request, amortised over its steps).

`--impl native|numpy` picks the index's implementation (default: native where it can be built,
as `SuffixIndex` picks it); the printed line says which ran.

A pool of `pool` finished outputs (random tokens over `vocab`, a shared span in each so that
lookups hit) is in place first. Prints one line per figure and writes JSON with --out.

    .venv/bin/python benchmarks/suffix_index.py --rows 64
    .venv/bin/python benchmarks/suffix_index.py --rows 64 --follow   # every lookup hits
    .venv/bin/python benchmarks/suffix_index.py --rows 64 --min-match 4   # the scheduler's
    .venv/bin/python benchmarks/suffix_index.py --rows 64 --min-match 4 --tokens 7 --vary
    .venv/bin/python benchmarks/suffix_index.py --rows 64 --min-match 4 --impl numpy
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from fuser.runtime.suffix import SuffixIndex

try:  # (an older tree has no buffer: nothing to load)
    from fuser.runtime.suffix import SuffixProposals
except ImportError:
    SuffixProposals = None


def measure(rows: int, pool: int, tokens: int, steps: int, vocab: int, width: int,
            seed: int = 0, follow: bool = False, min_match: int = 1, vary: bool = False,
            impl: str | None = None) -> dict[str, float]:
    """Median microseconds per step of the lookups, extends and loads for `rows` rows (process
    CPU time: on a shared machine, wall time also counts the others' work). follow: each row
    emits what followed in a pooled output (every lookup hits) instead of random tokens.
    min_match: the lookups' least match; above 1 the index is built as the adaptive scheduler
    builds it for that suffix_min_match (n-grams from min_match tokens). vary: each row emits
    1..tokens tokens a step (as acceptance varies), not `tokens`. impl: "native", "numpy" or
    None (the index's default; an older tree without the choice: its only one)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(32)]
    options = {} if impl is None else {"native": impl == "native"}
    if min_match > 1:
        options["min_ngram"] = min(min_match, 8)
    index = SuffixIndex(**options)
    outputs = []
    for r in range(pool):
        index.add_request(("pool", r), [rng.randrange(vocab) for _ in range(64)])
        outputs.append([rng.randrange(vocab) for _ in range(64)] + shared)
        index.extend(("pool", r), outputs[-1])
        index.finish(("pool", r))
    followed = [outputs[(r * 7) % pool][:64] for r in range(rows)]  # follow: what rows copy
    for r in range(rows):
        index.add_request(r, [rng.randrange(vocab) for _ in range(200)]
                          + (followed[r][:8] if follow else shared[:8]))
    lookups, extends, loads, hits = [], [], [], 0
    ids = list(range(rows))
    buffer = None if SuffixProposals is None else \
        SuffixProposals(rows, (width - 1) // 2, torch.device("cpu"))  # width K = 2g + 1
    anchors = [0] * rows
    at = [8] * rows  # follow: where each row is in its followed output
    arrays = getattr(index, "propose_arrays", None)
    batched = getattr(index, "propose_many", None)
    for step in range(steps):
        start = time.process_time()
        if arrays is not None:  # the scheduler's lookups of a step, as arrays
            found, counts = arrays(ids, width, min_match)
        elif batched is not None:  # (an older tree: lists)
            proposals = batched(ids, width, min_match)
        else:
            proposals = [p.tokens if p.match >= min_match else []
                         for p in (index.lookup(r, width) for r in ids)]
        lookups.append(time.process_time() - start)
        hits += int(counts.astype(bool).sum()) if arrays is not None else \
            sum(map(bool, proposals))
        if buffer is not None:
            start = time.process_time()
            if arrays is not None:
                buffer.load_arrays(found, counts, anchors=anchors)
            else:
                buffer.load(proposals, anchors=anchors)
            loads.append(time.process_time() - start)
        counts = [rng.randint(1, tokens) if vary else tokens for _ in range(rows)]
        if follow:  # the next tokens of the followed output, round and round (past its end
            # the span goes on from its start: the pool still has what follows)
            new = [[f[(a + i) % len(f)] for i in range(c)]
                   for f, a, c in zip(followed, at, counts)]
            at = [a + c for a, c in zip(at, counts)]
        else:
            new = [[rng.randrange(vocab) for _ in range(c)] for c in counts]
        start = time.process_time()
        for r in range(rows):
            index.extend(r, new[r])
        if hasattr(index, "flush"):  # index them now, not in the next lookup
            index.flush()
        extends.append(time.process_time() - start)
    start = time.process_time()
    for r in range(rows):
        index.finish(r)
    finish = (time.process_time() - start) / rows
    steps_us = [1e6 * (a + b) for a, b in zip(lookups, extends)]
    return {"rows": rows, "step_us": statistics.median(steps_us),
            "lookup_us": 1e6 * statistics.median(lookups),
            "extend_us": 1e6 * statistics.median(extends),
            "load_us": 1e6 * statistics.median(loads) if loads else float("nan"),
            "finish_us_per_request": 1e6 * finish,
            "hit_share": hits / (rows * steps),
            "impl": "native" if getattr(index, "native", False) else "numpy"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--pool", type=int, default=256, help="finished outputs in the pool")
    parser.add_argument("--tokens", type=int, default=2, help="tokens a row emits a step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=13, help="proposal tokens a lookup asks")
    parser.add_argument("--follow", action="store_true",
                        help="rows copy pooled outputs: every lookup hits")
    parser.add_argument("--min-match", type=int, default=1,
                        help="the lookups' least match (the adaptive scheduler's: 4), the "
                             "index built as the scheduler builds it")
    parser.add_argument("--vary", action="store_true",
                        help="each row emits 1..--tokens tokens a step, not --tokens")
    parser.add_argument("--impl", choices=["native", "numpy"], default=None,
                        help="the index's implementation (default: native where it can be "
                             "built)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.rows, args.pool, args.tokens, args.steps, args.vocab, args.width,
                     follow=args.follow, min_match=args.min_match, vary=args.vary,
                     impl=args.impl)
    emitted = f"1-{args.tokens}" if args.vary else f"{args.tokens}"
    print(f"suffix index ({result['impl']}), {args.rows} rows: step {result['step_us']:.0f} us, "
          f"lookup {result['lookup_us']:.0f} us/step, extend ({emitted} tokens a row) "
          f"{result['extend_us']:.0f} us/step, load {result['load_us']:.0f} us/step, finish "
          f"{result['finish_us_per_request']:.0f} us/request, hits {result['hit_share']:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
