"""Turning logits into tokens: HF-style logits processing, sampling, and speculative acceptance.

Every function here is a pure, batched tensor function with no host sync (no `.item()`,
`.tolist()`, boolean-mask indexing or data-dependent shapes), so that a whole speculative step can
run on the device and, on CUDA, be captured in one graph.

Notation (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023): q is the target's distribution, p the draft's, both after the same
temperature / top-k / top-p processing; x_1..x_gamma are the draft's tokens, x_i ~ p_i.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """Probabilities after Hugging Face's sampling warpers, in HF's order: float32 [..., V].

    1. temperature: logits / temperature.
    2. top-k: keep the tokens whose logit is >= the k-th largest (ties with it are kept, as in
       HF's TopKLogitsWarper); k is capped at V.
    3. top-p (HF's TopPLogitsWarper): sort ascending, drop the tokens whose cumulative
       probability is <= 1 - top_p; the most likely token is always kept. That keeps the
       smallest set of most likely tokens whose probability sums to >= top_p.
    Dropped tokens get probability exactly 0.
    """
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)  # [..., V]
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1] = False  # keep at least the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def process_logits_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """`process_logits` with per-row parameters held in device tensors (a captured CUDA graph
    freezes Python values, not tensor contents): float32 [B, ..., V].

    logits: [B, ..., V]. temperature: [B] float32 (> 0). top_k: [B] int64, a value >= V means
    no top-k filtering. top_p: [B] float32 in (0, 1], 1.0 means no top-p filtering.
    Same rules, in the same order, as `process_logits`; no host sync, no data-dependent shape.
    """
    V = logits.shape[-1]
    extra = (1,) * (logits.dim() - 1)  # broadcast a [B] parameter over [B, ..., V]
    scores = logits.float() / temperature.float().view(-1, *extra)
    # top-k: the k-th largest value per row, ties with it kept (k capped at V).
    ordered = torch.sort(scores, dim=-1, descending=True).values  # [B, ..., V]
    k = top_k.clamp(1, V).view(-1, *extra).expand(*scores.shape[:-1], 1)  # [B, ..., 1]
    kth = ordered.gather(-1, k - 1)  # [B, ..., 1]
    scores = scores.masked_fill(scores < kth, float("-inf"))
    # top-p (HF order: after top-k): drop ascending-sorted tokens whose cumulative probability
    # is <= 1 - top_p, always keeping the most likely.
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)  # [B, ..., V]
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    top_p = top_p.float().view(-1, *extra)
    drop_sorted = (cumulative <= 1 - top_p) & (top_p < 1)  # top_p = 1: no filtering at all
    drop_sorted[..., -1] = False  # keep at least the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


# -- per-row random numbers -------------------------------------------------------------------
#
# Sampling draws its randomness from counters, not from a generator's stream: row b's draw for
# the token at output index j (and a purpose: draft, accept, residual, target) is a hash of
# (seed[b], j, purpose). A row's tokens then depend on its own seed and history only, whatever
# else shares the batch, which continuous batching needs ("a seeded request returns the same
# tokens alone or with others"), and a captured CUDA graph replays them from device tensors.

PURPOSE_TARGET, PURPOSE_DRAFT, PURPOSE_ACCEPT, PURPOSE_RESIDUAL = 1, 2, 3, 4
_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, a bijection on [0, 2^32)) of int64 values in
    [0, 2^32); the constant is below 2^31, so no product leaves int64."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def draw_keys(seed: torch.Tensor, counter: torch.Tensor, purpose: int) -> torch.Tensor:
    """Per-draw keys: int64 in [0, 2^32) of the broadcast shape of seed and counter ([B] or
    [B, k]); seed: any int64, counter: the output index of the token being decided."""
    h = _mix(seed & _M32)
    h = _mix(h ^ ((seed >> 32) & _M32))
    h = _mix(h ^ ((purpose * 0x1000193) & _M32))
    return _mix(h ^ (counter & _M32))


def keyed_uniform(keys: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """float32 uniforms in [0, 1) (24 random bits): one per key, or with n, [..., n] per key
    (index v of the last dimension hashed in)."""
    if n is not None:
        index = torch.arange(n, device=keys.device)
        keys = _mix(_mix(keys[..., None] ^ index) ^ keys[..., None])  # [..., n]
    return (keys >> 8).float() * (1.0 / (1 << 24))


def sample(probs: torch.Tensor, rng: torch.Tensor | torch.Generator | None = None
           ) -> torch.Tensor:
    """One token per row of `probs` [..., V] (need not be normalised): LongTensor [...].

    rng: per-row keys (`draw_keys`, shape probs.shape[:-1]), or a torch.Generator (or None:
    the global one).
    Exponential race (the Gumbel-max trick in another form): with E_v ~ Exp(1) independent,
    argmax_v probs_v / E_v is distributed as probs / sum(probs). Unlike torch.multinomial it
    needs no normalisation and no validity check, so it never syncs with the host.
    """
    if isinstance(rng, torch.Tensor):
        u = keyed_uniform(rng, probs.shape[-1])  # [..., V] in [0, 1)
        race = -torch.log1p(-u)  # Exp(1)
    else:
        race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=rng)
    # E == 0 would make 0 / 0 = NaN for a zero-probability token; argmax treats NaN as the max.
    race = race.clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.argmax(probs.float() / race, dim=-1)


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of `accept` [B, gamma]: LongTensor [B]."""
    return torch.cumprod(accept.long(), dim=-1).sum(dim=-1)


def accept_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: (num_accepted [B], next_token [B]).

    draft_tokens: [B, gamma], x_1..x_gamma. target_tokens: [B, gamma + 1], the target's argmax
    at each verified position (t_i is the target's choice where x_{i+1} was proposed; t_gamma
    follows the last draft token).
    n = the longest prefix with x_{i+1} == t_i; next = t_n, the target's correction at the
    first disagreement, or the bonus token when all gamma drafts are accepted.
    """
    gamma = draft_tokens.shape[1]
    n = accepted_prefix(draft_tokens == target_tokens[:, :gamma])  # [B]
    next_token = target_tokens.gather(1, n[:, None])[:, 0]  # [B]
    return n, next_token


def acceptance_uniforms(B: int, gamma: int, device: torch.device,
                        generator: torch.Generator | None = None,
                        keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The uniforms [B, gamma] that test drafts x_1..x_gamma: from `generator`, or with keys =
    (seed [B], counter [B], the output index of x_1) per row, `draw_keys` at counter + i."""
    if keys is None:
        return torch.rand(B, gamma, device=device, generator=generator)
    seed, counter = keys
    offsets = torch.arange(gamma, device=device)  # [gamma]
    return keyed_uniform(draw_keys(seed[:, None], counter[:, None] + offsets, PURPOSE_ACCEPT))


def accept_sampling(draft_tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    generator: torch.Generator | None = None,
                    keys: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan / Chen): (num_accepted [B], next_token [B]).

    draft_tokens: [B, gamma], x_i sampled from p_i. p: [B, gamma, V], the draft's
    distributions. q: [B, gamma + 1, V], the target's at the same positions plus one.

    Draft token x_i is accepted with probability min(1, q_i(x_i) / p_i(x_i)), tested in order;
    n is the count accepted before the first rejection. At a rejection (n < gamma) the next
    token is drawn from the residual
        r(v) = max(0, q_n(v) - p_n(v)) / sum_w max(0, q_n(w) - p_n(w)),
    and when all gamma are accepted, from q_gamma (the bonus token). Each emitted token then
    has distribution q exactly: P(v) = min(p(v), q(v)) + (1 - sum_w min(p(w), q(w))) r(v) = q(v).

    keys: per-row random numbers instead of `generator`: (seed [B], counter [B]), the output
    index of x_1; the test of x_i and the draw at position n use `draw_keys` at counter + i.
    """
    B, gamma = draft_tokens.shape
    p, q = p.float(), q.float()
    p_x = p.gather(2, draft_tokens[:, :, None])[:, :, 0]  # [B, gamma] p_i(x_i)
    q_x = q[:, :gamma].gather(2, draft_tokens[:, :, None])[:, :, 0]  # [B, gamma] q_i(x_i)
    u = acceptance_uniforms(B, gamma, q.device, generator, keys)  # [B, gamma] U[0, 1)
    # u < q/p, written without the division: p_x > 0 because x_i was drawn from p_i.
    accept = u * p_x < q_x  # [B, gamma]
    n = accepted_prefix(accept)  # [B]

    # The distribution to draw the next token from: max(0, q_n - p_n), where p_gamma := 0 makes
    # position gamma (all accepted) the bonus draw from q_gamma.
    p_ext = torch.cat([p, p.new_zeros(B, 1, p.shape[2])], dim=1)  # [B, gamma + 1, V]
    index = n[:, None, None].expand(B, 1, q.shape[2])  # [B, 1, V]
    q_n = q.gather(1, index)[:, 0]  # [B, V]
    residual = (q_n - p_ext.gather(1, index)[:, 0]).clamp(min=0)  # [B, V], unnormalised
    # A rejection implies q(x) < p(x) somewhere, so some q(v) > p(v) and the residual has mass;
    # rounding can still leave it all zero when q == p: then q itself is the right answer.
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    residual = torch.where(has_mass, residual, q_n)
    rng = generator if keys is None else draw_keys(keys[0], keys[1] + n, PURPOSE_RESIDUAL)
    next_token = sample(residual, rng)  # `sample` normalises implicitly
    return n, next_token
