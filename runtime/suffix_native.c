/* The suffix index's per-step work in C (runtime/suffix_index.py holds the design; this file
 * is its compiled core, built and loaded by runtime/native.py).
 *
 * Plain C99, no Python API: one shared library serves every Python version. Every array is
 * owned by the Python side (numpy), which passes their addresses in `sfx_ctx` and makes room
 * before each call (the token rows, the table): no function here allocates, and none writes
 * outside what the context and its arguments give it.
 *
 * The data, as SuffixIndex lays it out:
 *   arena   uint64: every request's tokens + 1, each in a region of its own; slot s's tokens
 *           are arena[start[s] .. end[s]), its region ends at limit[s];
 *   salt    uint64 per slot: added to its own keys;
 *   store   uint64: the recent pool's tokens + 1, outputs one after another; the global
 *           offset g is store[g - base], and ends[g - base] is where its output ends (global);
 *   table   the hash table, 1 << bits places of open addressing (linear probing), each a key
 *           and its value side by side (one cache line holds both; key 0: an empty place).
 *           Own keys (hash + salt) map to the n-gram's end position in its request, pooled
 *           keys (hash ^ POOL) to POOLED + the global offset of its end.
 *
 * A key: the n-gram of n tokens ending at e hashes to MIX * sum_{i<n} (t_{e-i} + 1) BASE^i mod
 * 2**64, `powers[i]` = BASE^i MIX, the same numbers as the numpy index. A key keeps its largest
 * (latest) value; a removal removes a key only where it holds the value given. Only n-grams of
 * min_ngram..max_ngram tokens that lie within their sequence and have a next token are keys. */

#include <stdint.h>
#include <string.h>

#define SFX_POOL 0x5851F42D4C957F2DULL   /* pooled keys: hash ^ POOL */
#define SFX_POOLED ((int64_t)1 << 62)    /* a pooled key's value: POOLED + global offset */
#define SFX_MAX_NGRAM 64

typedef struct {
    uint64_t *arena;
    int64_t *start, *end, *limit; /* per slot */
    uint64_t *salt;               /* per slot */
    uint64_t *store;              /* the pool's tokens + 1 */
    int64_t *ends;                /* per store place: its output's end (global offset) */
    int64_t base;                 /* the global offset of store[0] */
    int64_t store_size;           /* places in store (and ends) */
    int64_t *table;               /* [1 << bits][2]: key (as int64; 0: empty), value */
    int64_t bits;
    int64_t count;                /* keys held */
    int64_t max_count;            /* flush stops before an entry could take count past this */
    int64_t max_ngram, min_ngram;
    uint64_t powers[SFX_MAX_NGRAM];  /* [max_ngram] BASE^i MIX */
    int64_t resume;               /* sfx_flush: the first token of the entry it stopped at */
} sfx_ctx;

/* -- the table ---------------------------------------------------------------------------- */

static inline uint64_t fix(uint64_t key) { return key ? key : 1; }  /* 0 marks a free place */

static inline uint64_t home(const sfx_ctx *c, uint64_t key) {
    key ^= key >> 31;  /* keys come mixed; this spreads them once more, cheaply */
    return (key * 0x9E3779B97F4A7C15ULL) >> (64 - c->bits);
}

#define KEY(c, i) ((uint64_t)(c)->table[2 * (i)])
#define VALUE(c, i) ((c)->table[2 * (i) + 1])

/* Ask for the line of key's home place ahead of its probe (the table is far larger than the
 * caches: each probe is a miss, and a batch of them overlaps). */
static inline void prefetch(const sfx_ctx *c, uint64_t key) {
#if defined(__GNUC__)
    __builtin_prefetch(c->table + 2 * home(c, key));
#else
    (void)c; (void)key;
#endif
}

/* The place holding `key`, or -1. */
static int64_t find(const sfx_ctx *c, uint64_t key) {
    uint64_t mask = ((uint64_t)1 << c->bits) - 1;
    for (uint64_t i = home(c, key);; i = (i + 1) & mask) {
        uint64_t k = KEY(c, i);
        if (k == key) return (int64_t)i;
        if (!k) return -1;
    }
}

/* key -> value, keeping the larger where it is held: 1 if it was not. The caller keeps
 * count below the table's size (max_count). */
static int insert(sfx_ctx *c, uint64_t key, int64_t value) {
    uint64_t mask = ((uint64_t)1 << c->bits) - 1;
    for (uint64_t i = home(c, key);; i = (i + 1) & mask) {
        uint64_t k = KEY(c, i);
        if (k == key) {
            if (value > VALUE(c, i)) VALUE(c, i) = value;
            return 0;
        }
        if (!k) {
            c->table[2 * i] = (int64_t)key;
            VALUE(c, i) = value;
            c->count++;
            return 1;
        }
    }
}

/* Keys waiting to be inserted, each prefetched as it came: inserted in batches, so that
 * the misses of a batch overlap. (Values only grow, so the order of inserts is free.) */
#define BATCH 256
typedef struct {
    int64_t n;
    uint64_t keys[BATCH];
    int64_t values[BATCH];
} batch_t;

static int64_t drain(sfx_ctx *c, batch_t *b) {
    int64_t added = 0;
    for (int64_t j = 0; j < b->n; j++) added += insert(c, b->keys[j], b->values[j]);
    b->n = 0;
    return added;
}

static inline int64_t put(sfx_ctx *c, batch_t *b, uint64_t key, int64_t value) {
    int64_t added = b->n == BATCH ? drain(c, b) : 0;
    prefetch(c, key);
    b->keys[b->n] = key;
    b->values[b->n++] = value;
    return added;
}

/* Remove `key` where it holds `value`: 1 if it did. The places after it that would no
 * longer be reached from their home move back into the gap (no tombstones). */
static int erase(sfx_ctx *c, uint64_t key, int64_t value) {
    uint64_t mask = ((uint64_t)1 << c->bits) - 1;
    int64_t at = find(c, key);
    if (at < 0 || VALUE(c, at) != value) return 0;
    uint64_t gap = (uint64_t)at;
    for (uint64_t i = (gap + 1) & mask;; i = (i + 1) & mask) {
        uint64_t k = KEY(c, i);
        if (!k) break;
        uint64_t h = home(c, k);
        /* k may fill the gap where its home is not within (gap, i] (cyclically) */
        if (((i - h) & mask) >= ((i - gap) & mask)) {
            c->table[2 * gap] = (int64_t)k;
            VALUE(c, gap) = VALUE(c, i);
            gap = i;
        }
    }
    c->table[2 * gap] = 0;
    VALUE(c, gap) = 0;
    c->count--;
    return 1;
}

/* Move every key into a new table of 1 << bits places (zeros, as the caller made it),
 * which becomes the table. The caller gives room for count keys. */
void sfx_rehash(sfx_ctx *c, int64_t *table, int64_t bits) {
    const int64_t *old = c->table;
    int64_t size = (int64_t)1 << c->bits;
    c->table = table;
    c->bits = bits;
    c->count = 0;
    for (int64_t i = 0; i < size; i++)
        if (old[2 * i]) insert(c, (uint64_t)old[2 * i], old[2 * i + 1]);
}

/* -- hashing -------------------------------------------------------------------------------- */

/* The hashes h[n - 1] (n = 1..m) of the n-grams ending at tokens[e]; the caller keeps
 * m <= e + 1 (within the sequence) and m <= max_ngram. */
static inline void hashes(const sfx_ctx *c, const uint64_t *tokens, int64_t e, int64_t m,
                          uint64_t *h) {
    uint64_t sum = 0;
    for (int64_t i = 0; i < m; i++) {
        sum += tokens[e - i] * c->powers[i];
        h[i] = sum;
    }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* -- the per-step work ---------------------------------------------------------------------- */

/* Append each entry's tokens to its row and index the n-grams that now have a next token.
 * Entry i (from `first` on, whose tokens start at tokens[t]) brings counts[i] tokens to
 * slot slots[i]; entries of one slot follow each other in order. Each n-gram ending at a
 * position p before a new token (min_ngram <= n <= min(max_ngram, p + 1)) is inserted as
 * an own key -> p. Stops before an entry whose tokens would pass its region's limit or whose
 * keys could take the table past max_count: -> the entry it stopped at (c->resume: its first
 * token), or n when all are in. */
int64_t sfx_flush(sfx_ctx *c, int64_t n, const int64_t *slots, const int64_t *counts,
                  const int64_t *tokens, int64_t first, int64_t t) {
    const int64_t G = c->max_ngram, lo = c->min_ngram, L = G - lo + 1;
    uint64_t h[SFX_MAX_NGRAM];
    batch_t b;
    b.n = 0;
    for (int64_t i = first; i < n; i++) {
        const int64_t s = slots[i], m = counts[i];
        const int64_t start = c->start[s], old = c->end[s];
        if (old + m > c->limit[s] || c->count + b.n + m * L > c->max_count) {
            drain(c, &b);
            c->resume = t;
            return i;
        }
        uint64_t *row = c->arena;
        for (int64_t k = 0; k < m; k++) row[old + k] = (uint64_t)tokens[t + k] + 1;
        t += m;
        c->end[s] = old + m;
        const uint64_t salt = c->salt[s];
        for (int64_t e = old - 1; e < old + m - 1; e++) {  /* ends before each new token */
            const int64_t p = e - start, top = min64(G, p + 1);
            if (p < 0 || top < lo) continue;
            hashes(c, row, e, top, h);
            for (int64_t k = lo - 1; k < top; k++) put(c, &b, fix(h[k] + salt), p);
        }
    }
    drain(c, &b);
    c->resume = t;
    return n;
}

/* One row's proposal (sfx_search), from the hashes h of its suffix. */
static void propose(const sfx_ctx *c, int64_t s, const uint64_t *h, int64_t K, int64_t lo,
                    int64_t *out, int64_t *count, int64_t *score) {
    const int64_t start = c->start[s], stop = c->end[s], len = stop - start;
    const int64_t top = min64(c->max_ngram, len);
    *count = *score = 0;
    if (K < 1) return;
    memset(out, 0, (size_t)K * sizeof(int64_t));
    if (top < lo) return;
    const uint64_t salt = c->salt[s];
    int64_t at = -1, n = 0, own = 0;
    /* probe length m, own then pooled: the place of the first hit (-1: none) */
#define PROBE(m) \
    do { \
        at = find(c, fix(h[(m) - 1] + salt)); own = 1; \
        if (at < 0) { at = find(c, fix(h[(m) - 1] ^ SFX_POOL)); own = 0; } \
        n = (m); \
    } while (0)
    PROBE(top);
    if (at < 0 && top > lo) {
        PROBE(lo);
        if (at >= 0) {  /* the shortest matched: the longest between that does */
            const int64_t at_lo = at, own_lo = own;
            for (int64_t m = top - 1; m > lo; m--) {
                PROBE(m);
                if (at >= 0) break;
            }
            if (at < 0) { at = at_lo; own = own_lo; n = lo; }
        }
    }
#undef PROBE
    if (at < 0) return;
    const int64_t v = VALUE(c, at);
    /* (A value that cannot be the kind probed comes only from two keys sharing a hash,
     * ~2**-64 a probe: no proposal rather than a read outside the arrays.) */
    if (own) {  /* from p + 1 on; past the end, what is being copied (period len - 1 - p) */
        if (v < 0 || v > len - 2) return;
        const int64_t period = len - 1 - v;
        const uint64_t *from = c->arena + stop - period;
        for (int64_t k = 0, j = 0; k < K; k++, j = j + 1 == period ? 0 : j + 1)
            out[k] = (int64_t)(from[j] - 1);
        *count = K;
    } else {  /* what followed in that output, up to its end */
        const int64_t g = v - SFX_POOLED, i = g - c->base;
        if (v < SFX_POOLED || i < 0 || i >= c->store_size) return;
        const int64_t m = min64(c->ends[i] - g - 1, K);
        for (int64_t k = 0; k < m; k++) out[k] = (int64_t)(c->store[i + 1 + k] - 1);
        *count = m;
    }
    *score = 2 * n + own;
}

/* Proposals for `R` rows (slots rows[r]): the tokens that followed the latest occurrence of
 * the row's longest suffix of at least lo tokens (lo >= min_ngram) found among its own keys
 * or the pool's (own first on a tie): tokens[r, 0 .. counts[r]) (K a row; 0 past the count),
 * and score[r] = 2 n + (own) for a match of n tokens (0: none).
 *   own match ending at p in a row of `len` tokens: the tokens from p + 1 on, copied past the
 *           row's end from what is being copied (period len - 1 - p): K tokens;
 *   pooled match ending at global offset g: what followed in that output, up to its end.
 * A suffix that never occurred has no longer one that did: the longest and the shortest
 * length settle most rows, the lengths between are probed only where the shortest hit. */
void sfx_search(sfx_ctx *c, int64_t R, const int64_t *rows, int64_t K, int64_t lo,
                int64_t *tokens, int64_t *counts, int64_t *score) {
    enum { CHUNK = 32 };  /* rows whose first probes are prefetched together */
    const int64_t G = c->max_ngram;
    uint64_t h[CHUNK][SFX_MAX_NGRAM];
    if (lo < c->min_ngram) lo = c->min_ngram;
    for (int64_t r0 = 0; r0 < R; r0 += CHUNK) {
        const int64_t r1 = min64(R, r0 + CHUNK);
        for (int64_t r = r0; r < r1; r++) {  /* the suffixes' hashes; the first probes asked */
            const int64_t s = rows[r], stop = c->end[s], top = min64(G, stop - c->start[s]);
            if (top < lo || K < 1) continue;
            hashes(c, c->arena, stop - 1, top, h[r - r0]);
            const uint64_t salt = c->salt[s];
            prefetch(c, fix(h[r - r0][top - 1] + salt));
            prefetch(c, fix(h[r - r0][top - 1] ^ SFX_POOL));
            prefetch(c, fix(h[r - r0][lo - 1] + salt));
            prefetch(c, fix(h[r - r0][lo - 1] ^ SFX_POOL));
        }
        for (int64_t r = r0; r < r1; r++)
            propose(c, rows[r], h[r - r0], K, lo, tokens + r * K, counts + r, score + r);
    }
}

/* Remove the own keys of slot s (every n-gram of its tokens with a next token, mapped to
 * its end): -> how many were held. */
int64_t sfx_remove_own(sfx_ctx *c, int64_t s) {
    const int64_t G = c->max_ngram, lo = c->min_ngram, start = c->start[s], stop = c->end[s];
    const uint64_t salt = c->salt[s];
    uint64_t h[SFX_MAX_NGRAM];
    int64_t removed = 0;
    for (int64_t e = start; e < stop - 1; e++) {
        const int64_t p = e - start, top = min64(G, p + 1);
        if (top < lo) continue;
        hashes(c, c->arena, e, top, h);
        for (int64_t k = lo - 1; k < top; k++) removed += erase(c, fix(h[k] + salt), p);
    }
    return removed;
}

/* The pooled keys of the output of `size` tokens at global offset g (in the store): each
 * n-gram with a next token -> POOLED + the global offset of its end. insert: put them in
 * (-> how many were not held; the caller made room for (size - 1) (max - min + 1) keys);
 * else remove those that still map there (-> how many). */
int64_t sfx_pool(sfx_ctx *c, int64_t g, int64_t size, int insert_them) {
    const int64_t G = c->max_ngram, lo = c->min_ngram;
    const uint64_t *out = c->store + (g - c->base);
    uint64_t h[SFX_MAX_NGRAM];
    int64_t changed = 0;
    batch_t b;
    b.n = 0;
    for (int64_t p = 0; p < size - 1; p++) {
        const int64_t top = min64(G, p + 1), value = SFX_POOLED + g + p;
        if (top < lo) continue;
        hashes(c, out, p, top, h);
        for (int64_t k = lo - 1; k < top; k++) {
            const uint64_t key = fix(h[k] ^ SFX_POOL);
            changed += insert_them ? put(c, &b, key, value) : erase(c, key, value);
        }
    }
    return changed + drain(c, &b);
}
