"""Suffix speculation: proposals copied from what came before, verified by the target.

Traffic that repeats itself (code edits that rewrite a file, templated answers, agent loops)
continues spans it has already seen. `SuffixIndex` finds the longest suffix of a request's
tokens (prompt and output) that occurred before, in the request itself or in recent outputs of
other requests, and proposes the tokens that followed it (prompt-lookup decoding; suffix-tree
decoding, Oliaro et al., "SuffixDecoding", with a hash table per n-gram length in place of the
tree). No model runs: a proposal costs a few dictionary lookups on the host.

The index. For every position i of a sequence and every n = min_ngram..max_ngram, the n-gram
ending at i is hashed (a polynomial over its tokens, each n's from the (n-1)-gram's ending one
token before: a new token costs max_ngram multiply-adds, and a request always holds the hashes
of its current suffixes, so a lookup hashes nothing) into a table that maps it to the latest
position where it ended (every length in one dict; every request's own n-grams in one dict,
keyed apart by a per-request salt). A request's own n-grams are indexed once the token after
them exists, so a match always has a continuation, and the suffix being matched never finds
itself. The per-step work is batched over rows: `extend` only appends, and the step's lookup
(`propose_many`) first hashes every row's new tokens in one numpy pass and inserts them in one
dict update (`flush`), then tests all rows' suffix hashes at once against a bit filter of
both tables' keys; only rows that may match read the dicts and check a hit token by token
(hashes may collide; a proposal is always a real continuation). benchmarks/suffix_index.py
measures the host time.

    own context:   a match ending at p continues with tokens[p + 1], tokens[p + 2], ...; past
                   the end it copies its own output (the span repeats with period len - 1 - p,
                   as LZ77 copies overlap), so a repeating pattern proposes max_tokens tokens;
    recent outputs: finished requests' outputs (their prompts too with keep_prompts), in one
                   pool of tables whose entries point to (sequence, position); the oldest
                   sequence is evicted (and its entries with it) beyond max_recent sequences or
                   max_recent_tokens tokens.
The longer match wins; on a tie the request's own context (what this request is doing now).

Verification (`suffix_step`) is the target's verify step over host-given proposals instead of
the draft's: greedy acceptance is unchanged (finish_greedy); for sampling, a proposal is a
draft whose distribution is a point mass, p = e_x, so Leviathan's rule accepts x with
probability min(1, q(x) / 1) = q(x) and at a rejection samples the residual
max(0, q - e_x) / (1 - q(x)): q with x removed, renormalised (`accept_proposals`). The output
follows q whatever is proposed, and rows with fewer proposals than gamma are padded with any
token: the target simply accepts or rejects them like any other.
"""

from __future__ import annotations

import collections
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fuser.ops.argmax import argmax
from fuser.runtime import speculative
from fuser.runtime.sampling import PURPOSE_RESIDUAL, acceptance_uniforms, accepted_prefix, \
    draw_keys, sample
from fuser.runtime.step_kernels import fused_by_default
from fuser.runtime.steps import DECODE, ModelSteps, verify as verify_kind

__all__ = ["Proposal", "SuffixIndex", "SuffixProposals", "accept_proposals", "add_verify_steps",
           "mixed_step", "proposals_tensor", "suffix_step"]

# Hashes wrap at 64 bits (uint64 arithmetic; a hit is checked token by token anyway).
_BASE = np.uint64(1_000_003)
_SEEN_BITS = 27  # the filter of keys in either table: one bit per value of 27 mixed bits
_SEEN_SHIFT = np.uint64(64 - _SEEN_BITS)
_SEEN_MIX = np.uint64(0x9E3779B97F4A7C15)  # the top bits of key * MIX (short n-grams' hashes
                                           # are small numbers: their own top bits are 0)


def _mark(seen: np.ndarray, keys: np.ndarray) -> None:
    """Set the filter's bits of `keys` (uint64): sorted, so that the bits of each byte are
    or-ed together before the byte is written (cheaper than `np.bitwise_or.at`)."""
    if not len(keys):
        return
    top = np.sort((keys * _SEEN_MIX) >> _SEEN_SHIFT)
    byte = top >> np.uint64(3)
    bits = np.left_shift(np.uint8(1), (top & np.uint64(7)).astype(np.uint8))
    first = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))
    seen[byte[first]] |= np.bitwise_or.reduceat(bits, first)


def _marked(seen: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Whether the filter's bit of each key (uint64) is set (a key in a table always is)."""
    top = (keys * _SEEN_MIX) >> _SEEN_SHIFT
    return (seen[top >> np.uint64(3)] >> (top & np.uint64(7)).astype(np.uint8)) & 1


def _ngram_hashes(tokens: np.ndarray, hi: int) -> np.ndarray:
    """hashes[e, n - 1]: the hash of the n-gram ending at position e, n = 1..hi (garbage where
    n > e + 1): g_1 = token + 1, g_n(e) = g_{n-1}(e - 1) * BASE + token_e + 1 (a polynomial
    over the n-gram's tokens in order, so the same tokens hash alike wherever they occur).
    tokens: int64 [m] -> uint64 [m, hi]."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    out = np.zeros((len(t), hi), np.uint64)
    out[:, 0] = t
    for n in range(1, hi):
        out[1:, n] = out[:-1, n - 1] * _BASE + t[1:]
    return out


@dataclass(frozen=True)
class Proposal:
    """What `SuffixIndex.lookup` found: the proposed tokens, where ("own", "recent" or "" for
    nothing) and the matched suffix's length."""

    tokens: list[int]
    source: str
    match: int


@dataclass
class _Request:
    tokens: list[int]
    prompt_length: int
    slot: int  # its row of SuffixIndex._hashes
    salt: int  # its n-grams' keys in the shared own table: hash ^ salt
    hashed: int = 0  # tokens already hashed and indexed (the rest wait for `flush`)


class SuffixIndex:
    """Proposals from the longest earlier occurrence of a request's suffix (module docstring).

    The layout (all rows of a step in one numpy pass, the tables plain dicts filled and read
    in bulk):
        _hashes  uint64 [slots, max_ngram]: per request, the hashes of the n-grams ending at its
                 last indexed token (column n - 1);
        _own     every request's own n-grams in one dict: (hash ^ the request's salt) -> the
                 latest end position (salts keep requests apart; a 64-bit coincidence is
                 caught by the token-by-token check of a hit);
        _pool    the recent outputs' n-grams: hash -> sequence id << 32 | end position;
        _seen    bits [2**27]: 1 where some key in either table has these 27 bits (set
                 on insert, rebuilt from the tables once removals pile up): a lookup reads
                 the dicts only for the rows with a key that may be there.
    `extend` only appends tokens; the next lookup (or finish) hashes and indexes every
    request's new tokens at once (`flush`). `propose_many` looks up all rows of a step at
    once.

    Args:
        max_ngram: the longest suffix matched (and indexed): memory and time per token grow
            with max_ngram - min_ngram + 1.
        min_ngram: the shortest match that proposes anything (1-token matches are mostly
            noise).
        max_recent: finished sequences kept in the recent pool.
        max_recent_tokens: tokens kept in the recent pool, all sequences together.
        keep_prompts: pool a finished request's prompt with its output (default: the output).
    """

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2, max_recent: int = 256,
                 max_recent_tokens: int = 1 << 18, keep_prompts: bool = False) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram),
                            ("max_recent", max_recent), ("max_recent_tokens", max_recent_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram={min_ngram} must be <= max_ngram={max_ngram}")
        if max_recent_tokens >= 1 << 32:
            raise ValueError(f"max_recent_tokens={max_recent_tokens} must be < 2**32")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_recent, self.max_recent_tokens = max_recent, max_recent_tokens
        self.keep_prompts = keep_prompts
        self._requests: dict[Hashable, _Request] = {}
        self._dirty: dict[Hashable, _Request] = {}  # extended since the last flush
        self._recent: OrderedDict[int, list[int]] = OrderedDict()  # sequence id -> tokens
        self._recent_tokens = 0
        self._next_id = 0
        self._own: dict[int, int] = {}
        self._pool: dict[int, int] = {}
        self._hashes = np.zeros((8, max_ngram), np.uint64)
        self._salts = np.zeros(8, np.uint64)
        self._free = list(range(7, -1, -1))
        self._rng = np.random.default_rng(0)
        self._seen = np.zeros(1 << (_SEEN_BITS - 3), np.uint8)
        self._stale = 0  # keys removed from the tables since _seen was built
        self._last: tuple[list[Hashable], np.ndarray, list[_Request]] | None = None
        # The lookup's columns: n = max_ngram .. min_ngram (longest first).
        self._lengths = list(range(max_ngram, min_ngram - 1, -1))

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """Start indexing a request from its prompt."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already indexed")
        if not self._free:
            size = len(self._salts)
            self._hashes = np.concatenate([self._hashes, np.zeros_like(self._hashes)])
            self._salts = np.concatenate([self._salts, np.zeros_like(self._salts)])
            self._free = list(range(2 * size - 1, size - 1, -1))
        slot = self._free.pop()
        self._last = None
        salt = int(self._rng.integers(0, 1 << 63, dtype=np.int64))
        self._hashes[slot] = 0
        self._salts[slot] = salt
        self._requests[request_id] = _Request([], len(prompt_ids), slot, salt)
        self.extend(request_id, prompt_ids)

    def extend(self, request_id: Hashable, new_ids: Sequence[int]) -> None:
        """Append tokens the request emitted (indexed at the next lookup, all rows at once)."""
        request = self._requests[request_id]
        request.tokens.extend(map(int, new_ids))
        self._dirty[request_id] = request

    def flush(self) -> None:
        """Hash and index every request's tokens appended since the last flush (the next
        lookup or finish does it otherwise): one numpy pass over all rows (a step per new
        token of the longest row), one dict update."""
        if not self._dirty:
            return
        requests = list(self._dirty.values())
        self._dirty.clear()
        news = [r.tokens[r.hashed:] for r in requests]
        starts = np.fromiter((r.hashed for r in requests), np.int64, len(requests))
        for r in requests:
            r.hashed = len(r.tokens)
        counts = np.fromiter(map(len, news), np.int64, len(requests))
        width = int(counts.max())
        if not width:
            return
        flat = np.fromiter(itertools.chain.from_iterable(news), np.int64, int(counts.sum()))
        uniform = bool((counts == width).all())
        if uniform:
            new = flat.reshape(len(requests), width)
        else:
            new = np.zeros((len(requests), width), np.int64)
            new[np.arange(width) < counts[:, None]] = flat  # row-major: each row's tokens
        new = new.astype(np.uint64) + np.uint64(1)
        slots = np.fromiter((r.slot for r in requests), np.intp, len(requests))
        hashes = self._hashes[slots]  # [R, hi]
        salts = self._salts[slots][:, None]  # [R, 1]
        lengths = np.arange(self.min_ngram, self.max_ngram + 1)  # the indexed n, ascending
        keys, values = [], []
        length = starts
        # Every row as many new tokens, and long enough that all lengths are indexed: no masks.
        full = uniform and int(starts.min()) >= self.max_ngram
        for j in range(width):
            if full:
                keys.append(hashes[:, self.min_ngram - 1:] ^ salts)  # [R, L]
                values.append(length - 1)  # [R]
                rolled = np.empty_like(hashes)
                rolled[:, 0] = new[:, j]
                rolled[:, 1:] = hashes[:, :-1] * _BASE + new[:, j, None]
                hashes, length = rolled, length + 1
                continue
            active = None if uniform else counts > j
            # The n-grams ending at the last token now have a continuation: n <= its position+1.
            ok = (length[:, None] >= lengths) if active is None else \
                active[:, None] & (length[:, None] >= lengths)
            keys.append((hashes[:, self.min_ngram - 1:] ^ salts)[ok])
            values.append(np.broadcast_to((length - 1)[:, None], ok.shape)[ok])
            rolled = np.empty_like(hashes)
            rolled[:, 0] = new[:, j]
            rolled[:, 1:] = hashes[:, :-1] * _BASE + new[:, j, None]
            if active is None:
                hashes, length = rolled, length + 1
            else:
                hashes = np.where(active[:, None], rolled, hashes)
                length = length + active
        self._hashes[slots] = hashes
        # j-major: a row's later position comes later, so the latest occurrence wins.
        if full:  # [width, R, L] and [width, R] in the same (j, row, n) order
            keys = np.stack(keys).ravel()
            values = np.repeat(np.stack(values).ravel(), self.max_ngram - self.min_ngram + 1)
        else:
            keys, values = np.concatenate(keys), np.concatenate(values)
        _mark(self._seen, keys)
        self._own.update(zip(keys.tolist(), values.tolist()))

    def _own_keys(self, request: _Request) -> list[int]:
        """The own-table keys of every n-gram the request has indexed."""
        ends = request.hashed - 1  # n-grams ending at 0 .. hashed - 2 are indexed
        if ends < 1:
            return []
        hashes = _ngram_hashes(np.asarray(request.tokens[:ends], np.int64), self.max_ngram)
        ok = np.arange(ends)[:, None] + 1 >= np.arange(self.min_ngram, self.max_ngram + 1)
        return (hashes[:, self.min_ngram - 1:] ^ np.uint64(request.salt))[ok].tolist()

    def _forget(self, request_id: Hashable) -> _Request | None:
        """Remove a request and its own n-grams."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self._dirty.pop(request_id, None)
        self._last = None
        own, keys = self._own, self._own_keys(request)
        collections.deque(map(own.pop, keys, itertools.repeat(None)), 0)
        self._free.append(request.slot)
        self._removed(len(keys))
        return request

    def _removed(self, count: int) -> None:
        """`count` keys left the tables: rebuild _seen once they outnumber those left."""
        self._stale += count
        if self._stale > max(1 << 16, len(self._own) + len(self._pool)):
            self._seen[:] = 0
            for table in (self._own, self._pool):
                keys = np.fromiter(table.keys(), np.uint64, len(table))
                _mark(self._seen, keys)
            self._stale = 0

    def _pool_entries(self, tokens: list[int], sequence: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of a pooled sequence's n-grams, by end position (the last token has
        no continuation to index)."""
        ends = len(tokens) - 1
        hashes = _ngram_hashes(np.asarray(tokens[:ends], np.int64), self.max_ngram)
        ok = np.arange(ends)[:, None] + 1 >= np.arange(self.min_ngram, self.max_ngram + 1)
        values = np.broadcast_to((np.arange(ends, dtype=np.int64) | (sequence << 32))[:, None],
                                 ok.shape)
        return hashes[:, self.min_ngram - 1:][ok], values[ok]

    def finish(self, request_id: Hashable) -> None:
        """The request is done: its output (with its prompt, keep_prompts) joins the recent
        pool, and its own tables are dropped."""
        self.flush()
        request = self._forget(request_id)
        if request is None:
            raise KeyError(request_id)
        tokens = request.tokens if self.keep_prompts else request.tokens[request.prompt_length:]
        tokens = tokens[-self.max_recent_tokens:]
        if len(tokens) < 2:
            return
        sequence = self._next_id
        self._next_id += 1
        self._recent[sequence] = tokens
        self._recent_tokens += len(tokens)
        keys, values = self._pool_entries(tokens, sequence)
        _mark(self._seen, keys)
        self._pool.update(zip(keys.tolist(), values.tolist()))
        while len(self._recent) > self.max_recent or self._recent_tokens > self.max_recent_tokens:
            self._evict()

    def drop(self, request_id: Hashable) -> None:
        """Forget a request without pooling it (cancelled, failed)."""
        self._forget(request_id)

    def _evict(self) -> None:
        sequence, tokens = self._recent.popitem(last=False)
        self._recent_tokens -= len(tokens)
        pool, removed = self._pool, 0
        keys, values = self._pool_entries(tokens, sequence)
        for key, value in zip(keys.tolist(), values.tolist()):
            if pool.get(key) == value:
                del pool[key]
                removed += 1
        self._removed(removed)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def tokens(self, request_id: Hashable) -> list[int]:
        """The request's tokens so far (prompt, then output); a copy."""
        return list(self._requests[request_id].tokens)

    @property
    def recent_tokens(self) -> int:
        return self._recent_tokens

    @property
    def recent_sequences(self) -> int:
        return len(self._recent)

    @property
    def pool_entries(self) -> int:
        return len(self._pool)

    # -- proposals -------------------------------------------------------------------------------

    def propose(self, request_id: Hashable, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the longest earlier occurrence of the
        request's suffix; empty when no suffix of min_ngram tokens or more occurred."""
        return self.lookup(request_id, max_tokens).tokens

    def lookup(self, request_id: Hashable, max_tokens: int) -> Proposal:
        """`propose`, saying where the proposal comes from and how long the match was."""
        found = self._search([request_id], max_tokens)
        return Proposal(*found[0]) if found else Proposal([], "", 0)

    def lookup_many(self, request_ids: Sequence[Hashable], max_tokens: int) -> list[Proposal]:
        """`lookup` for each request, all in one pass."""
        out = [Proposal([], "", 0) for _ in request_ids]
        for row, found in self._search(request_ids, max_tokens).items():
            out[row] = Proposal(*found)
        return out

    def propose_many(self, request_ids: Sequence[Hashable], max_tokens: int,
                     min_match: int = 1) -> list[list[int]]:
        """Per request, `propose`'s tokens where the match has at least min_match tokens
        (else []): all rows of a step in one pass (the scheduler's per-step call)."""
        out: list[list[int]] = [[] for _ in request_ids]
        for row, (tokens, _, match) in self._search(request_ids, max_tokens).items():
            if match >= min_match:
                out[row] = tokens
        return out

    def _search(self, request_ids: Sequence[Hashable], max_tokens: int
                ) -> dict[int, tuple[list[int], str, int]]:
        """{row: (tokens, source, match)} for the rows whose suffix matched. One numpy pass
        over all rows' suffix hashes through _seen; only rows that may have an entry read the
        dicts and check their entries token by token (longest first), in Python."""
        self.flush()
        if self._last is not None and self._last[0] == request_ids:
            _, slots, requests = self._last  # the same rows as the last lookup (a step's)
        else:
            requests = [self._requests[i] for i in request_ids]
            slots = np.fromiter((r.slot for r in requests), np.intp, len(requests))
            self._last = (list(request_ids), slots, requests)
        if max_tokens < 1 or not requests:
            return {}
        hashes = self._hashes[slots][:, self.min_ngram - 1:]  # [R, L] n = min..max_ngram
        salted = hashes ^ self._salts[slots][:, None]
        maybe = _marked(self._seen, salted) | _marked(self._seen, hashes)
        rows = np.flatnonzero(maybe.any(axis=1))
        found: dict[int, tuple[list[int], str, int]] = {}
        if not len(rows):
            return found
        own_get, pool_get, recent = self._own.get, self._pool.get, self._recent
        lengths = self._lengths  # max_ngram .. min_ngram
        for row, own_keys, pool_keys in zip(rows.tolist(), salted[rows, ::-1].tolist(),
                                            hashes[rows, ::-1].tolist()):
            # Longest first: the latest own occurrence, then a longer one in the pool.
            tokens = requests[row].tokens
            size = len(tokens)
            match = own_end = 0
            for n, key in zip(lengths, own_keys):
                if n <= size:
                    end = own_get(key)
                    if end is not None and tokens[end - n + 1:end + 1] == tokens[size - n:]:
                        match, own_end = n, end
                        break
            for n, key in zip(lengths, pool_keys):
                if n <= match:
                    break
                value = pool_get(key) if n <= size else None
                if value is not None:
                    sequence, end = recent[value >> 32], value & 0xFFFFFFFF
                    if sequence[end - n + 1:end + 1] == tokens[size - n:]:
                        found[row] = sequence[end + 1:end + 1 + max_tokens], "recent", n
                        match = 0
                        break
            if match:  # copy on from own_end + 1; past the end, from what is being copied
                # (overlapping): the span repeats with period size - 1 - own_end
                span = tokens[own_end + 1:]
                found[row] = (span * (max_tokens // len(span) + 1))[:max_tokens], "own", match
        return found


def proposals_tensor(proposals: Sequence[Sequence[int]], gamma: int, batch: int | None = None,
                     device: torch.device | str | None = None, fill: int = 0
                     ) -> torch.Tensor:
    """Row b's proposals, cut to gamma and padded with `fill` (the target rejects what does
    not match, padding included): LongTensor [batch, gamma]; rows past len(proposals) (a
    bucket's dummy rows) are all padding."""
    batch = len(proposals) if batch is None else batch
    out = torch.full((batch, gamma), fill, dtype=torch.long)
    for b, row in enumerate(proposals):
        row = list(row)[:gamma]
        if row:
            out[b, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out if device is None else out.to(device)


# -- verification on the device -----------------------------------------------------------------


def accept_proposals(proposals: torch.Tensor, q: torch.Tensor,
                     generator: torch.Generator | None = None,
                     keys: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of point-mass drafts (p_i = e_{x_i}): (num_accepted [B],
    next_token [B]).

    proposals: [B, gamma], x_1..x_gamma. q: [B, gamma + 1, V], the target's distributions
    there and one past. x_i is accepted with probability q_i(x_i) (min(1, q/p) at p = 1),
    in order; at the first rejection (n < gamma) the next token is drawn from
        r(v) = max(0, q_n(v) - e_{x_n}(v)) / sum_w (...) = q_n(v) [v != x_n] / (1 - q_n(x_n)),
    after gamma acceptances from q_gamma. Each emitted token then follows q:
    P(v) = q(x) [v = x] + (1 - q(x)) r(v) = q(v). The same draws, in the same order, as
    `sampling.accept_sampling` with one-hot p: the same tokens, without the [B, gamma, V] p.
    keys: per-row random numbers instead of `generator`, as accept_sampling takes them.
    """
    B, gamma = proposals.shape
    q = q.float()
    q_x = q[:, :gamma].gather(2, proposals[:, :, None])[:, :, 0]  # [B, gamma] q_i(x_i)
    u = acceptance_uniforms(B, gamma, q.device, generator, keys)  # [B, gamma] U[0, 1)
    n = accepted_prefix(u < q_x)  # [B]
    index = n[:, None, None].expand(B, 1, q.shape[2])  # [B, 1, V]
    q_n = q.gather(1, index)[:, 0]  # [B, V]
    # x_n's mass removed where a proposal was rejected (n < gamma); the bonus keeps q_gamma.
    padded = torch.cat([proposals, proposals.new_zeros(B, 1)], dim=1)  # [B, gamma + 1]
    rejected = padded.gather(1, n[:, None])  # [B, 1]
    residual = torch.where(n[:, None] < gamma, q_n.scatter(1, rejected, 0.0), q_n)
    # All of q on the rejected token (q(x) = 1 can still be rejected by rounding): q itself.
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    residual = torch.where(has_mass, residual, q_n)
    rng = generator if keys is None else draw_keys(keys[0], keys[1] + n, PURPOSE_RESIDUAL)
    return n, sample(residual, rng)


def suffix_step(target: ModelSteps, state: speculative.DecodeState, proposals: torch.Tensor,
                vocab_size: int, do_sample: bool, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """The target verifies host-given proposals [B, gamma] (on the device) in one forward,
    accepts on the device and advances: the speculative step with the suffix index as the
    draft. Returns the packed result [B, gamma + 2], as `speculative.speculative_step`.

    Needs the target's verify step for gamma (`add_verify_steps` for an engine without a
    draft). The draft model is not run: where there is one, its cache falls behind by up to
    gamma + 1 tokens a row (`speculative.resync_draft` catches it up); `mixed_step` keeps it
    in step instead.
    Sampling draws from `generator`, or (None) the state's per-row keys, as speculative_step.
    """
    fused = not do_sample and fused_by_default(target.cache.seq_lens.device)
    logits = speculative.verify(target, state, proposals, vocab_size, fused)  # [B, g + 1, V]
    if not do_sample:  # the argmax in the logits' dtype: see speculative.choose
        return speculative.finish_greedy(target, state, proposals, argmax(logits)).packed()
    q = speculative.probs(state, logits.float())  # [B, gamma + 1, V]
    keys = None if generator is not None else (state.seed, state.generated)
    n, next_token = accept_proposals(proposals, q, generator, keys)
    result = speculative._emit(proposals, n, next_token)
    speculative._advance(target, state, result, speculative._new_last(state, proposals, n))
    return result.packed()


class SuffixProposals:
    """The static device buffer a captured suffix or mixed iteration reads its proposals from,
    filled by one host-to-device copy per step (`load`), and read relative to where each row
    is when the step runs (`aligned`), so that a step can be queued before the one before it
    is read back.

    Per row b: tokens[b, :length[b]], the index's continuation of the row's tokens as the host
    knew them when it made the proposal, the first for output index anchor[b] (the host's
    count of the row's output tokens then; -1: "wherever the row is when the step runs").
    Layout: one int64 buffer [B, K + 2]: tokens [B, K], then length, then anchor.
    """

    def __init__(self, batch: int, max_gamma: int, device: torch.device,
                 lookahead: int | None = None) -> None:
        """lookahead: tokens the steps in flight may emit before this one runs (default:
        max_gamma + 1, one step's most): the buffer keeps max_gamma + lookahead a row."""
        self.max_gamma = max_gamma
        self.width = max_gamma + (max_gamma + 1 if lookahead is None else lookahead)  # K
        self.packed = torch.zeros(batch, self.width + 2, dtype=torch.long, device=device)
        self.buffer = self.packed[:, :self.width]  # [B, K]
        self.length = self.packed[:, self.width]  # [B]
        self.anchor = self.packed[:, self.width + 1]  # [B]
        self.anchor.fill_(-1)

    def load(self, proposals: Sequence[Sequence[int]], gamma: int | None = None, fill: int = 0,
             anchors: Sequence[int] | None = None) -> None:
        """Row b proposes proposals[b] (cut to the buffer's width; rows past them and missing
        ones propose nothing), anchored at anchors[b] (default -1: where the row is when the
        step runs). gamma: unused (the step's gamma cuts at run time), kept for callers that
        give it. On CUDA the copy is queued from pinned memory of its own (PyTorch's host
        allocator keeps it until the copy has run), so the host does not wait; queued on the
        step's stream, it lands after the steps queued before it have read the buffer."""
        B, K = self.buffer.shape
        host = torch.full((B, K + 2), fill, dtype=torch.long)
        host[:, K] = 0
        host[:, K + 1] = -1
        for b, row in enumerate(proposals):
            row = list(row)[:K]
            if row:
                host[b, :len(row)] = torch.tensor(row, dtype=torch.long)
            host[b, K] = len(row)
            if anchors is not None:
                host[b, K + 1] = int(anchors[b])
        cuda = self.packed.device.type == "cuda"
        self.packed.copy_(host.pin_memory() if cuda else host, non_blocking=cuda)

    def aligned(self, target: ModelSteps, state: speculative.DecodeState, gamma: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The proposals for the step that runs now: (use [B, gamma] bool, tokens [B, gamma],
        count [B] = use.sum(1)), on the device, nothing read on the host.

        Row b is at output index G = state.generated[b] (pending is index G - 1, at cache
        slot L). Since the anchor A the device emitted j = G - A tokens the host had not seen,
        at slots L - j + 1 .. L of `state.history`; they must equal the proposal's first j
        tokens (else the proposal continued something that did not happen: none for the row).
        The step then proposes tokens[j : j + gamma], as many as remain.
        """
        B, K = self.buffer.shape
        device = self.buffer.device
        L = target.cache.seq_lens  # [B]
        j = torch.where(self.anchor >= 0, state.generated - self.anchor, 0).clamp(0, K)  # [B]
        i = torch.arange(K, device=device)[None]  # [1, K]
        slots = (L[:, None] - j[:, None] + 1 + i).clamp(0, state.history.shape[1] - 1)
        seen = state.history.gather(1, slots)  # [B, K]
        agrees = ((seen == self.buffer) | (i >= j[:, None])).all(dim=1)  # [B]
        remaining = torch.where(agrees, (self.length - j).clamp(min=0), 0)  # [B]
        count = remaining.clamp(max=gamma)  # [B]
        at = (j[:, None] + i[:, :gamma]).clamp(max=K - 1)  # [B, gamma]
        tokens = self.buffer.gather(1, at)  # [B, gamma]
        use = i[:, :gamma] < count[:, None]  # [B, gamma]
        return use, torch.where(use, tokens, 0), count

    def iteration(self, target: ModelSteps, state: speculative.DecodeState, gamma: int,
                  vocab_size: int, do_sample: bool) -> Callable[[], torch.Tensor]:
        """The target verifying the aligned proposals alone (no draft; a row without any
        verifies padding): () -> packed [B, gamma + 3], tokens, the row's proposal count, n."""
        def step() -> torch.Tensor:
            _, tokens, count = self.aligned(target, state, gamma)
            packed = suffix_step(target, state, tokens, vocab_size, do_sample)
            return _with_counts(packed, count)
        return step

    def mixed_iteration(self, target: ModelSteps, draft: ModelSteps,
                        state: speculative.DecodeState, gamma: int, vocab_size: int,
                        do_sample: bool) -> Callable[[], torch.Tensor]:
        """`mixed_step` over this buffer: () -> packed [B, gamma + 3]."""
        return lambda: mixed_step(target, draft, state, self, gamma, vocab_size, do_sample)


def mixed_step(target: ModelSteps, draft: ModelSteps, state: speculative.DecodeState,
               proposals: SuffixProposals, gamma: int, vocab_size: int, do_sample: bool
               ) -> torch.Tensor:
    """One speculative step with per-row sources: a row with suffix proposals verifies them
    (the rest of its gamma positions the draft's), the others the draft's, in one verify.

    The draft runs for every row, fed the tokens that will be verified
    (`speculative.draft`'s `given`): its cache stays in step with the target's whatever each
    row's source, so no resync follows. Greedy acceptance is `finish_greedy`'s; sampling is
    speculative sampling with point-mass drafts at the suffix's positions (accept_proposals'
    rule), so each emitted token follows the target's distribution.
    Returns packed [B, gamma + 3]: tokens [gamma + 1], the row's suffix proposals used, n.
    """
    use, tokens, count = proposals.aligned(target, state, gamma)
    packed = speculative.speculative_step(target, draft, state, gamma, vocab_size, do_sample,
                                          given=(use, tokens))
    return _with_counts(packed, count)


def _with_counts(packed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[B, g + 2] (tokens, n) -> [B, g + 3] (tokens, count, n): the host reads tokens from
    the front and n from the back, as ever."""
    return torch.cat([packed[:, :-1], count[:, None], packed[:, -1:]], dim=1)


def add_verify_steps(target: ModelSteps, gammas: Sequence[int], config: object,
                     device: torch.device) -> list[int]:
    """Build the target's verify step for each gamma it lacks (an engine built without a
    draft has none), over the same model and cache; -> the gammas added. Where the model's
    steps were not exported (eager fallback), nothing can be added."""
    from fuser.build import add_step

    missing = [g for g in sorted(set(gammas)) if verify_kind(g) not in target]
    if not missing:
        return []
    view = getattr(target[DECODE].eager, "model", None)
    if view is None:
        raise ValueError(f"the target has no verify step for gamma {missing} and its steps "
                         "keep no module (a loaded engine): build the engine with those "
                         "gammas")
    for gamma in missing:
        add_step(target, view, verify_kind(gamma), config, device)
    return missing
