/*
 * CPU paged attention for pdserve (decode and chunked prefill in one call).
 *
 * Layouts (all row-major, contiguous):
 *   q, out        [T, Hq, D]        float32 or bfloat16 (uint16_t bits), one dtype for both
 *   k_pool,v_pool [N, Hkv, P, D]    float32 or bfloat16, one dtype for both (HND pages)
 *   block_tables  [S, max_pages]    int32 page ids
 *   query_start   [S + 1]           int32 row offsets into q
 *   context_lens  [S]               int32 tokens in the cache, including this step's queries
 *
 * Query i of sequence s (q_len = query_start[s+1] - query_start[s]) sits at absolute position
 * p = context_lens[s] - q_len + i and attends causally to key positions 0..p, or, with a sliding
 * window W > 0, to positions max(0, p - W + 1)..p. Query head h uses kv head h / G with
 * G = Hq / Hkv.
 *
 * Sliding window: pages wholly before the window of a work item's first query are neither read
 * nor validated (a sliding-window allocator recycles them and points their table entries at a
 * padding page); the partial page at the window's start is masked per row. With W == 0 the
 * kernel takes the full-attention path, whose per-page work has no window test at all.
 *
 * Work is split into items (sequence, kv head, tile of query rows); each item holds the G query
 * heads of its rows together ("rows" below are (query, head-in-group) pairs, M = n_queries * G),
 * so every K/V row read from a page is used M times. Pages are read in place. Softmax is the
 * streaming (online) form in float32, one page at a time. Items run in parallel with OpenMP
 * (dynamic schedule, largest first). Long decode contexts with too few items for the threads are
 * split along the keys (flash-decoding) and merged with their log-sum-exp.
 *
 * Prefetch: decode reads each K/V page block once, from DRAM, as scattered runs of P * D
 * elements (4 KiB for float32 at P = 16, D = 64), so the kernel prefetches the next page's K and
 * V blocks itself while it computes the current page. Issued in bursts, prefetches stall on the
 * core's few outstanding-miss slots and memory then idles while the page is computed, so they
 * are spread out: for decode items over float32 pools one line per inner iteration of the
 * score and PV loops (pf_one, ~100 sites per page at G = 3), a quarter of the lines before the
 * softmax, and the rest at the end of the page; for prefill tiles and bfloat16 pools (half the lines, more arithmetic per line) a
 * few lines before each 8-key block of scores and PV and before the softmax (pf_step). A thread
 * claims its next item before running the current one, so that the current item's last page
 * prefetches the next item's first page. (Batch-32 decode at context 320, 30 layers' pools, 2
 * threads, paired runs: the per-block steps beat one burst per page (bench/results/engine/attention_kernels.md);
 * the per-iteration lines helped float32 further, bfloat16 unchanged (commit 87f134d).)
 *
 * Dtypes (q/out, K/V pools): (f32, f32), (bf16, bf16) and (f32, bf16), the last for a float32
 * model with a bfloat16 KV cache (half the bytes read per key). All math is float32 whatever the
 * dtypes: queries are converted (and scaled) into a float32 scratch once per item, K/V elements
 * are widened bf16 -> f32 exactly (8 at a time, in registers) where the score / PV loops load
 * them, and the output is rounded to bf16 only when q is bf16. (bf16 q, f32 K/V) is refused.
 *
 * Vector code uses GCC vector extensions (8 x float), which compile to AVX2/AVX-512/SSE as the
 * -march flags allow; there is no scalar-only path to keep in sync. D must be a multiple of 8.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "paged_attention.h"

#include "vec8.h" /* pdserve/kernels/csrc: v8f, load8, splat8, hsum8_fold_adjacent, ... */

typedef uint16_t v8h_u __attribute__((vector_size(16), aligned(2)));

#ifdef PA_PROFILE
#define PROF_NOINLINE __attribute__((noinline))
#define PAGE_STAGE __attribute__((noinline))
#else
#define PROF_NOINLINE
/* Per-page stages (scores, softmax) stay inlined in the page loop even though run_item exists
 * twice (full and windowed): left to itself, GCC then calls them out of line (more work: commit
 * 5a3bd23). */
#define PAGE_STAGE inline __attribute__((always_inline))
#endif

/* Query tile: about this many rows (queries x G) per work item for prefill. */
#define TARGET_ROWS 32
/* Split a decode item along its keys only when it has at least this many pages per split. */
#define MIN_PAGES_PER_SPLIT 8
/* Software prefetch: pages ahead (0 = off) and the locality hint of __builtin_prefetch. */
#ifndef PA_PREFETCH_DIST
#define PA_PREFETCH_DIST 1
#endif
#ifndef PA_PREFETCH_HINT
#define PA_PREFETCH_HINT 3
#endif

/* bf16 bits -> float32 (exact: bf16 is the top half of an fp32). */
#if defined(__AVX2__)
#include <immintrin.h>
ALWAYS_INLINE v8f bf16x8_to_f32(const uint16_t *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); /* one vpmovzxwd */
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
#else
ALWAYS_INLINE v8f bf16x8_to_f32(const uint16_t *p) {
    v8h_u h = *(const v8h_u *)p;
    v8u u = __builtin_convertvector(h, v8u) << 16;
    return (v8f)u;
}
#endif

#include "bf16.h" /* pdserve/kernels/csrc: f32_to_bf16 */
#include "exp8.h" /* pdserve/kernels/csrc: exp8 (x = score - running max <= 0 here) */

/* ------------------------------------------------------------------------------------------ */
/* Scores: S[r, j] = Q[r, :] . K[j, :] for M rows and nk keys (keys padded to a multiple of 8).  */

#if defined(__AVX__)
#include <immintrin.h>
/* [sum(a0), ..., sum(a7)]: transposing reduction with horizontal adds. */
ALWAYS_INLINE v8f reduce8x8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_permute2f128_ps(u0, u1, 0x20) + _mm256_permute2f128_ps(u0, u1, 0x31);
}
/* Writes sum(a0..a3) to s[0..3]. */
ALWAYS_INLINE void reduce4x8(v8f a0, v8f a1, v8f a2, v8f a3, float *s) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(s, _mm256_castps256_ps128(u) + _mm256_extractf128_ps(u, 1));
}
#else
ALWAYS_INLINE v8f reduce8x8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
    return (v8f){hsum8_fold_adjacent(a0), hsum8_fold_adjacent(a1), hsum8_fold_adjacent(a2),
                 hsum8_fold_adjacent(a3), hsum8_fold_adjacent(a4), hsum8_fold_adjacent(a5),
                 hsum8_fold_adjacent(a6), hsum8_fold_adjacent(a7)};
}
ALWAYS_INLINE void reduce4x8(v8f a0, v8f a1, v8f a2, v8f a3, float *s) {
    s[0] = hsum8_fold_adjacent(a0);
    s[1] = hsum8_fold_adjacent(a1);
    s[2] = hsum8_fold_adjacent(a2);
    s[3] = hsum8_fold_adjacent(a3);
}
#endif

/*
 * Spread prefetch of one page (see "Prefetch" above): the 2 * n cache lines of its K block
 * (lines 0..n-1) then its V block (lines n..2n-1), issued `per` at a time by pf_step or one at a
 * time by pf_one. Nothing to prefetch: k == NULL and n == 0.
 */
typedef struct {
    const char *k, *v; /* the K and V blocks */
    int n;             /* lines per block */
    int per;           /* lines per step */
    int next;          /* next line of the 2 * n */
} pf_plan;

/* One line of the plan, if any is left (a plan with nothing to prefetch has n == 0). */
ALWAYS_INLINE void pf_one(pf_plan *pf) {
    if (pf->next < 2 * pf->n) {
        const int l = pf->next++;
        __builtin_prefetch(l < pf->n ? pf->k + 64 * (size_t)l : pf->v + 64 * (size_t)(l - pf->n), 0,
                           PA_PREFETCH_HINT);
    }
}

/* 8 K/V elements at element index idx of a float32 or bf16 (compile-time flag) array. */
ALWAYS_INLINE v8f ldkv(const void *base, size_t idx, const int bf16) {
    return bf16 ? bf16x8_to_f32((const uint16_t *)base + idx) : load8((const float *)base + idx);
}

/* One row x 8 keys (8 independent FMA chains). */
ALWAYS_INLINE void score_1x8(const float *Q, int D, const void *K, float *S, const int bf16, pf_plan *pf) {
    v8f a[8];
    for (int k = 0; k < 8; k++) a[k] = splat8(0.0f);
    for (int d = 0; d < D; d += 8) {
        if (pf) pf_one(pf);
        v8f qv = load8(Q + d);
        for (int k = 0; k < 8; k++) a[k] += qv * ldkv(K, (size_t)k * D + d, bf16);
    }
    store8(S, reduce8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
}

/* Two rows x 4 keys (8 chains; each K load feeds 2 FMAs). */
ALWAYS_INLINE void score_2x4(const float *Q, int D, const void *K, float *S, int ldS,
                             const int bf16, pf_plan *pf) {
    v8f a[4], b[4];
    for (int k = 0; k < 4; k++) a[k] = b[k] = splat8(0.0f);
    for (int d = 0; d < D; d += 8) {
        if (pf) pf_one(pf);
        v8f q0 = load8(Q + d), q1 = load8(Q + D + d);
        for (int k = 0; k < 4; k++) {
            v8f kv = ldkv(K, (size_t)k * D + d, bf16);
            a[k] += q0 * kv;
            b[k] += q1 * kv;
        }
    }
    reduce4x8(a[0], a[1], a[2], a[3], S);
    reduce4x8(b[0], b[1], b[2], b[3], S + ldS);
}

/* Three rows x 4 keys (12 chains; each K load feeds 3 FMAs): the decode shape of G = 3 groups. */
ALWAYS_INLINE void score_3x4(const float *Q, int D, const void *K, float *S, int ldS,
                             const int bf16, pf_plan *pf) {
    v8f a[4], b[4], c[4];
    for (int k = 0; k < 4; k++) a[k] = b[k] = c[k] = splat8(0.0f);
    for (int d = 0; d < D; d += 8) {
        if (pf) pf_one(pf);
        v8f q0 = load8(Q + d), q1 = load8(Q + D + d), q2 = load8(Q + 2 * D + d);
        for (int k = 0; k < 4; k++) {
            v8f kv = ldkv(K, (size_t)k * D + d, bf16);
            a[k] += q0 * kv;
            b[k] += q1 * kv;
            c[k] += q2 * kv;
        }
    }
    reduce4x8(a[0], a[1], a[2], a[3], S);
    reduce4x8(b[0], b[1], b[2], b[3], S + ldS);
    reduce4x8(c[0], c[1], c[2], c[3], S + 2 * ldS);
}

/* Single score (only for keys past a page whose size is not a multiple of 8). */
ALWAYS_INLINE float score_1x1(const float *Q, int D, const void *K, size_t k0, const int bf16) {
    v8f a = splat8(0.0f);
    for (int d = 0; d < D; d += 8) a += load8(Q + d) * ldkv(K, k0 + d, bf16);
    return hsum8_fold_adjacent(a);
}

/*
 * S[r, j] for r < M, j < round8(nk). Keys nk..round8(nk) are read from the page's own rows
 * (their scores are garbage and get masked) when the page has room for them (kcap >= round8);
 * otherwise the tail is computed key by key.
 */
ALWAYS_INLINE void scores(const float *Q, int M, int D, const void *K, int nk, int kcap,
                          float *S, int ldS, const int bf16, pf_plan *pf) {
    int nk8 = (nk + 7) & ~7;
    int full = nk8 <= kcap ? nk8 : (nk & ~7);
    for (int j = 0; j < full; j += 8) {
        const size_t esz = bf16 ? 2 : 4;
        const char *Kj = (const char *)K + (size_t)j * D * esz;
        const char *Kj4 = Kj + 4 * (size_t)D * esz;
        int r = 0;
        for (; r + 3 <= M; r += 3) {
            score_3x4(Q + (size_t)r * D, D, Kj, S + r * ldS + j, ldS, bf16, pf);
            score_3x4(Q + (size_t)r * D, D, Kj4, S + r * ldS + j + 4, ldS, bf16, pf);
        }
        for (; r + 2 <= M; r += 2) {
            score_2x4(Q + (size_t)r * D, D, Kj, S + r * ldS + j, ldS, bf16, pf);
            score_2x4(Q + (size_t)r * D, D, Kj4, S + r * ldS + j + 4, ldS, bf16, pf);
        }
        if (r < M) score_1x8(Q + (size_t)r * D, D, Kj, S + r * ldS + j, bf16, pf);
    }
    for (int j = full; j < nk; j++)
        for (int r = 0; r < M; r++)
            S[r * ldS + j] = score_1x1(Q + (size_t)r * D, D, K, (size_t)j * D, bf16);
}

static PAGE_STAGE void scores_f32(const float *Q, int M, int D, const void *K, int nk,
                                     int kcap, float *S, int ldS) {
    scores(Q, M, D, K, nk, kcap, S, ldS, 0, NULL);
}

/* ... issuing one line of `pf` per inner iteration (float32 decode items) */
static PAGE_STAGE void scores_f32_pf(const float *Q, int M, int D, const void *K, int nk,
                                        int kcap, float *S, int ldS, pf_plan *pf) {
    scores(Q, M, D, K, nk, kcap, S, ldS, 0, pf);
}

static PAGE_STAGE void scores_bf16(const float *Q, int M, int D, const void *K, int nk,
                                      int kcap, float *S, int ldS) {
    scores(Q, M, D, K, nk, kcap, S, ldS, 1, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* Accumulate: O[r, :] += sum_j Pm[r, j] * V[j, :] for M rows and nk keys.                      */

/* R rows x C columns (R * C / 8 <= 8 accumulators), compile-time R and C. */
ALWAYS_INLINE void pv_block(const int R, const int C, const float *Pm, int ldP, const void *V,
                            int d0, int nk, int D, float *O, const int bf16, pf_plan *pf) {
    v8f acc[8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C / 8; c++) acc[r * (C / 8) + c] = load8(O + (size_t)r * D + 8 * c);
    for (int j = 0; j < nk; j++) {
        if (pf) pf_one(pf);
        v8f v[8];
        for (int c = 0; c < C / 8; c++) v[c] = ldkv(V, (size_t)j * D + d0 + 8 * c, bf16);
        for (int r = 0; r < R; r++) {
            float p = Pm[r * ldP + j];
            for (int c = 0; c < C / 8; c++) acc[r * (C / 8) + c] += p * v[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C / 8; c++) store8(O + (size_t)r * D + 8 * c, acc[r * (C / 8) + c]);
}

ALWAYS_INLINE void pv(const float *Pm, int ldP, int M, const void *V, int nk, int D, float *O,
                      const int bf16, pf_plan *pf) {
    int r = 0;
    for (; r + 3 <= M; r += 3) { /* 6 accumulators: each V load feeds 3 rows */
        const float *Pr = Pm + r * ldP;
        float *Or = O + (size_t)r * D;
        int d = 0;
        for (; d + 16 <= D; d += 16) pv_block(3, 16, Pr, ldP, V, d, nk, D, Or + d, bf16, pf);
        for (; d < D; d += 8) pv_block(3, 8, Pr, ldP, V, d, nk, D, Or + d, bf16, pf);
    }
    for (; r + 2 <= M; r += 2) {
        const float *Pr = Pm + r * ldP;
        float *Or = O + (size_t)r * D;
        int d = 0;
        for (; d + 32 <= D; d += 32) pv_block(2, 32, Pr, ldP, V, d, nk, D, Or + d, bf16, pf);
        for (; d < D; d += 8) pv_block(2, 8, Pr, ldP, V, d, nk, D, Or + d, bf16, pf);
    }
    if (r < M) {
        const float *Pr = Pm + r * ldP;
        float *Or = O + (size_t)r * D;
        int d = 0;
        for (; d + 64 <= D; d += 64) pv_block(1, 64, Pr, ldP, V, d, nk, D, Or + d, bf16, pf);
        for (; d + 32 <= D; d += 32) pv_block(1, 32, Pr, ldP, V, d, nk, D, Or + d, bf16, pf);
        for (; d < D; d += 8) pv_block(1, 8, Pr, ldP, V, d, nk, D, Or + d, bf16, pf);
    }
}

static PROF_NOINLINE void pv_f32(const float *Pm, int ldP, int M, const void *V, int nk, int D,
                                 float *O) {
    pv(Pm, ldP, M, V, nk, D, O, 0, NULL);
}

static PROF_NOINLINE void pv_f32_pf(const float *Pm, int ldP, int M, const void *V, int nk, int D,
                                    float *O, pf_plan *pf) {
    pv(Pm, ldP, M, V, nk, D, O, 0, pf);
}

static PROF_NOINLINE void pv_bf16(const float *Pm, int ldP, int M, const void *V, int nk, int D,
                                  float *O) {
    pv(Pm, ldP, M, V, nk, D, O, 1, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* Work items and per-thread scratch.                                                          */

typedef struct {
    int seq;       /* sequence index */
    int head;      /* kv head */
    int q0;        /* first query (within the sequence) of the tile */
    int nq;        /* queries in the tile */
    int split;     /* key split index (0 when not split) */
    int nsplit;    /* number of key splits of this (seq, head, tile); 1 when not split */
    int64_t cost;  /* rough work estimate for ordering */
} work_item;

typedef struct {
    float *q;    /* [Mmax, D] scaled queries */
    float *o;    /* [Mmax, D] unnormalized output */
    float *s;    /* [Mmax, ldS] scores / probabilities for one page */
    float *m;    /* [Mmax] running max */
    float *l;    /* [Mmax] running sum */
    int *lim;    /* [Mmax] number of visible keys per row (keys 0..lim-1) */
    int *lo;     /* [Mmax] first visible key per row (0 without a sliding window) */
} scratch;

static int cmp_cost_desc(const void *a, const void *b) {
    int64_t ca = ((const work_item *)a)->cost, cb = ((const work_item *)b)->cost;
    return (ca < cb) - (ca > cb);
}

typedef struct {
    const void *q;
    const void *k_pool;
    const void *v_pool;
    const int32_t *block_tables;
    const int32_t *query_start;
    const int32_t *context_lens;
    int max_pages, hq, hkv, P, D, G, ldS;
    int q_bf16;  /* q and out hold bf16 bits (else float32) */
    int kv_bf16; /* k_pool and v_pool hold bf16 bits (else float32) */
    int window; /* sliding window in tokens, 0 = full attention */
    float scale;
    /* split-K partial results: [n_partials, G, D] outputs and [n_partials, G] max / sum */
    float *part_o;
    float *part_m;
    float *part_l;
} params;

/* Base of the [P, D] block of kv head h in page `page` of a pool (float32 or bf16 elements). */
ALWAYS_INLINE const void *page_block(const params *pr, const void *pool, int32_t page, int h) {
    size_t base = ((size_t)page * pr->hkv + h) * pr->P * pr->D;
    return pr->kv_bf16 ? (const void *)((const uint16_t *)pool + base)
                       : (const void *)((const float *)pool + base);
}

static void prefetch_page(const params *pr, const void *pool, int32_t page, int h) {
    size_t elt = pr->kv_bf16 ? 2 : 4;
    const char *p = (const char *)pool + ((size_t)page * pr->hkv + h) * pr->P * pr->D * elt;
    size_t bytes = (size_t)pr->P * pr->D * elt;
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, PA_PREFETCH_HINT);
}

/* The next `per` lines of the plan (fewer at its end). */
ALWAYS_INLINE void pf_step(pf_plan *pf) {
    if (!pf->k) return;
    const int a = pf->next, b = a + pf->per < 2 * pf->n ? a + pf->per : 2 * pf->n;
    const int ke = b < pf->n ? b : pf->n, vs = a > pf->n ? a : pf->n;
#pragma GCC unroll 8
    for (int l = a; l < ke; l++) __builtin_prefetch(pf->k + 64 * (size_t)l, 0, PA_PREFETCH_HINT);
#pragma GCC unroll 8
    for (int l = vs; l < b; l++)
        __builtin_prefetch(pf->v + 64 * (size_t)(l - pf->n), 0, PA_PREFETCH_HINT);
    pf->next = b;
}

/*
 * Streaming-softmax step for one page: masks keys outside each row's visible range [lo, lim)
 * (lo only when `windowed`, a compile-time constant), updates the running max / sum, rescales
 * the output rows when the max grows, and turns scores into probabilities (columns
 * nk..round8(nk) and masked keys become 0).
 */
ALWAYS_INLINE void softmax_page_impl(scratch *sc, int M, int D, int ldS, int t0, int nk,
                                     const int windowed) {
    const int nk8 = (nk + 7) & ~7;
    for (int r = 0; r < M; r++) {
        float *sr = sc->s + (size_t)r * ldS;
        int vis = sc->lim[r] - t0; /* keys of this page visible to row r: [first, vis) */
        if (vis > nk) vis = nk;
        int first = 0;
        if (windowed) {
            first = sc->lo[r] - t0;
            if (first < 0) first = 0;
        }
        if (vis <= first) { /* fully masked row on this page: probabilities are all 0 */
            memset(sr, 0, sizeof(float) * nk8);
            continue;
        }
        for (int j = vis; j < nk8; j++) sr[j] = -INFINITY;
        if (windowed)
            for (int j = 0; j < first; j++) sr[j] = -INFINITY;
        v8f mv = splat8(-INFINITY);
        for (int j = 0; j < nk8; j += 8) mv = max8(mv, load8(sr + j));
        const float mblk = hmax8(mv);
        const float mold = sc->m[r];
        if (mblk > mold) {
            const float alpha = expf(mold - mblk); /* 0 on the first page (mold = -inf) */
            float *o = sc->o + (size_t)r * D;
            for (int d = 0; d < D; d += 8) store8(o + d, load8(o + d) * alpha);
            sc->l[r] *= alpha;
            sc->m[r] = mblk;
        }
        const v8f mnew = splat8(sc->m[r]);
        v8f sum = splat8(0.0f);
        for (int j = 0; j < nk8; j += 8) {
            v8f p = exp8(load8(sr + j) - mnew);
            store8(sr + j, p);
            sum += p;
        }
        sc->l[r] += hsum8_fold_adjacent(sum);
    }
}

static PAGE_STAGE void softmax_page(scratch *sc, int M, int D, int ldS, int t0, int nk) {
    softmax_page_impl(sc, M, D, ldS, t0, nk, 0);
}

static PAGE_STAGE void softmax_page_window(scratch *sc, int M, int D, int ldS, int t0,
                                              int nk) {
    softmax_page_impl(sc, M, D, ldS, t0, nk, 1);
}

/* First key a query at absolute position p sees: 0, or p - W + 1 with a sliding window W. */
ALWAYS_INLINE int first_key(int p, int window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* Key pages [*lo, *hi) an item reads: from the page of the first key its first row sees (0
 * without a window) to the page of its last row's last key, or its split's share of them. */
static inline void item_pages(const params *pr, const work_item *it, int *lo, int *hi) {
    const int s = it->seq, P = pr->P;
    const int q_len = pr->query_start[s + 1] - pr->query_start[s];
    const int p0 = pr->context_lens[s] - q_len + it->q0; /* position of the tile's first query */
    const int n_pages = (p0 + it->nq + P - 1) / P;
    const int first_page = first_key(p0, pr->window) / P;
    *lo = first_page;
    *hi = n_pages;
    if (it->nsplit > 1) {
        int per = (n_pages - first_page + it->nsplit - 1) / it->nsplit;
        *lo = first_page + it->split * per;
        *hi = *lo + per < n_pages ? *lo + per : n_pages;
    }
}

/*
 * Runs one item: rows (query i of the tile, head g of the group) over key pages
 * [page_lo, page_hi). Writes either the final output (nsplit == 1) or a partial result.
 * `windowed` is a compile-time constant (see run_item): the full-attention instance has no
 * window arithmetic at all. `next` (or NULL) is the item this thread runs next: the last page
 * prefetches its first page.
 */
ALWAYS_INLINE void run_item_impl(const params *pr, const work_item *it, const work_item *next,
                                 int64_t part_index, scratch *sc, void *out, const int windowed) {
    const int D = pr->D, G = pr->G, P = pr->P, ldS = pr->ldS;
    const int s = it->seq, h = it->head;
    const int32_t qs = pr->query_start[s];
    const int q_len = pr->query_start[s + 1] - qs;
    const int ctx = pr->context_lens[s];
    const int M = it->nq * G;

    /* Rows: r = i * G + g -> token qs + q0 + i, head h * G + g (G heads of a token are adjacent). */
    for (int i = 0; i < it->nq; i++) {
        size_t tok = (size_t)qs + it->q0 + i;
        int lim = ctx - q_len + it->q0 + i + 1;
        for (int g = 0; g < G; g++) {
            int r = i * G + g;
            size_t off = (tok * pr->hq + (size_t)h * G + g) * D;
            float *dst = sc->q + (size_t)r * D;
            if (pr->q_bf16) {
                const uint16_t *src = (const uint16_t *)pr->q + off;
                for (int d = 0; d < D; d += 8) store8(dst + d, bf16x8_to_f32(src + d) * pr->scale);
            } else {
                const float *src = (const float *)pr->q + off;
                for (int d = 0; d < D; d += 8) store8(dst + d, load8(src + d) * pr->scale);
            }
            sc->lim[r] = lim;
            if (windowed) sc->lo[r] = first_key(lim - 1, pr->window);
            sc->m[r] = -INFINITY;
            sc->l[r] = 0.0f;
        }
    }
    memset(sc->o, 0, sizeof(float) * (size_t)M * D);

    const int kmax = sc->lim[M - 1]; /* last row sees the most */
    int page_lo, page_hi;
    item_pages(pr, it, &page_lo, &page_hi);
    const int32_t *bt = pr->block_tables + (size_t)s * pr->max_pages;
    int next_lo = 0, next_hi = 0;
    if (next) item_pages(pr, next, &next_lo, &next_hi);

    for (int pg = page_lo; pg < page_lo + PA_PREFETCH_DIST && pg < page_hi; pg++) {
        prefetch_page(pr, pr->k_pool, bt[pg], h);
        prefetch_page(pr, pr->v_pool, bt[pg], h);
    }
    const size_t esz = pr->kv_bf16 ? 2 : 4;
    /* a full page's work has 2 * ceil(P / 8) + 1 prefetch steps (pf_step calls, below) */
    const int pf_lines = (int)(((size_t)P * D * esz + 63) / 64);
    const int pf_steps = 2 * ((P + 7) / 8) + 1;
    /* per-iteration prefetch lines: float32 decode items, through the *_pf instances (prefill
     * tiles compute far longer per page than its lines take to arrive; a per-iteration test in
     * their loops slowed them: commit 87f134d) */
    const int fine = !pr->kv_bf16 && it->nq == 1;
    for (int pg = page_lo; pg < page_hi; pg++) {
        const int t0 = pg * P;
        const int nk = kmax - t0 < P ? kmax - t0 : P;
        const int32_t page = bt[pg];

        /* the page PA_PREFETCH_DIST ahead: in this item, else in the next one */
        pf_plan pf = {NULL, NULL, 0, fine ? pf_lines / 2 : (2 * pf_lines + pf_steps - 1) / pf_steps, 0};
        const int ahead = pg + PA_PREFETCH_DIST - page_hi; /* >= 0: index into the next item */
        if (PA_PREFETCH_DIST > 0 && ahead < 0) {
            pf.k = (const char *)page_block(pr, pr->k_pool, bt[pg + PA_PREFETCH_DIST], h);
            pf.v = (const char *)page_block(pr, pr->v_pool, bt[pg + PA_PREFETCH_DIST], h);
            pf.n = pf_lines;
        } else if (PA_PREFETCH_DIST > 0 && next && next_lo + ahead < next_hi) {
            const int32_t np = pr->block_tables[(size_t)next->seq * pr->max_pages + next_lo + ahead];
            pf.k = (const char *)page_block(pr, pr->k_pool, np, next->head);
            pf.v = (const char *)page_block(pr, pr->v_pool, np, next->head);
            pf.n = pf_lines;
        }

        /* scores and PV in blocks of 8 keys; float32 pools prefetch one line per inner iteration
         * (pf_one inside the kernels), bfloat16 ones a step before each block; both a step
         * before the softmax and whatever is left at the end of the page */
        const int nkb = (nk + 7) / 8;
        const char *K = (const char *)page_block(pr, pr->k_pool, page, h);
        for (int b = 0; b < nkb; b++) {
            if (!fine) pf_step(&pf);
            const int nkk = nk - 8 * b < 8 ? nk - 8 * b : 8;
            const char *Kb = K + (size_t)8 * b * D * esz;
            if (pr->kv_bf16)
                scores_bf16(sc->q, M, D, Kb, nkk, P - 8 * b, sc->s + 8 * b, ldS);
            else if (fine)
                scores_f32_pf(sc->q, M, D, Kb, nkk, P - 8 * b, sc->s + 8 * b, ldS, &pf);
            else
                scores_f32(sc->q, M, D, Kb, nkk, P - 8 * b, sc->s + 8 * b, ldS);
        }

        pf_step(&pf);
        if (windowed)
            softmax_page_window(sc, M, D, ldS, t0, nk);
        else
            softmax_page(sc, M, D, ldS, t0, nk);

        const char *V = (const char *)page_block(pr, pr->v_pool, page, h);
        for (int b = 0; b < nkb; b++) {
            if (!fine) pf_step(&pf);
            const int nkk = nk - 8 * b < 8 ? nk - 8 * b : 8;
            const char *Vb = V + (size_t)8 * b * D * esz;
            if (pr->kv_bf16)
                pv_bf16(sc->s + 8 * b, ldS, M, Vb, nkk, D, sc->o);
            else if (fine)
                pv_f32_pf(sc->s + 8 * b, ldS, M, Vb, nkk, D, sc->o, &pf);
            else
                pv_f32(sc->s + 8 * b, ldS, M, Vb, nkk, D, sc->o);
        }
        pf.per = 2 * pf.n;
        pf_step(&pf); /* whatever the fine sites left */
    }

    if (it->nsplit > 1) {
        /* Partial result for the merge pass (decode only: nq == 1, M == G). */
        memcpy(pr->part_o + (size_t)part_index * G * D, sc->o, sizeof(float) * (size_t)G * D);
        memcpy(pr->part_m + (size_t)part_index * G, sc->m, sizeof(float) * G);
        memcpy(pr->part_l + (size_t)part_index * G, sc->l, sizeof(float) * G);
        return;
    }
    for (int i = 0; i < it->nq; i++) {
        size_t tok = (size_t)qs + it->q0 + i;
        for (int g = 0; g < G; g++) {
            int r = i * G + g;
            size_t off = (tok * pr->hq + (size_t)h * G + g) * D;
            const float inv = 1.0f / sc->l[r];
            const float *o = sc->o + (size_t)r * D;
            if (pr->q_bf16) {
                uint16_t *dst = (uint16_t *)out + off;
                for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(o[d] * inv);
            } else {
                float *dst = (float *)out + off;
                for (int d = 0; d < D; d += 8) store8(dst + d, load8(o + d) * inv);
            }
        }
    }
}

static void run_item(const params *pr, const work_item *it, const work_item *next,
                     int64_t part_index, scratch *sc, void *out) {
    if (pr->window > 0)
        run_item_impl(pr, it, next, part_index, sc, out, 1);
    else
        run_item_impl(pr, it, next, part_index, sc, out, 0);
}

/* Merge the nsplit partials of one split decode item into the output rows. */
static void merge_item(const params *pr, const work_item *it, int64_t part_index, void *out) {
    const int D = pr->D, G = pr->G;
    const size_t tok = (size_t)pr->query_start[it->seq] + it->q0;
    for (int g = 0; g < G; g++) {
        float m = -INFINITY;
        for (int k = 0; k < it->nsplit; k++) {
            float mk = pr->part_m[(part_index + k) * G + g];
            m = mk > m ? mk : m;
        }
        float l = 0.0f;
        float acc[D];
        memset(acc, 0, sizeof(acc));
        for (int k = 0; k < it->nsplit; k++) {
            float mk = pr->part_m[(part_index + k) * G + g];
            if (mk == -INFINITY) continue;
            float w = expf(mk - m);
            l += w * pr->part_l[(part_index + k) * G + g];
            const float *o = pr->part_o + ((size_t)(part_index + k) * G + g) * D;
            for (int d = 0; d < D; d++) acc[d] += w * o[d];
        }
        const float inv = 1.0f / l;
        size_t off = (tok * pr->hq + (size_t)it->head * G + g) * D;
        if (pr->q_bf16) {
            uint16_t *dst = (uint16_t *)out + off;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[d] * inv);
        } else {
            float *dst = (float *)out + off;
            for (int d = 0; d < D; d++) dst[d] = acc[d] * inv;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */

int pa_forward(void *out, const void *q, const void *k_pool, const void *v_pool,
               const int32_t *block_tables, const int32_t *query_start,
               const int32_t *context_lens, int num_tokens, int num_seqs, int max_pages,
               int num_pages, int hq, int hkv, int page_size, int head_dim, float scale,
               int window, int q_bf16, int kv_bf16, int num_threads, int64_t *err_info) {
    err_info[0] = err_info[1] = err_info[2] = 0;
    /* flags are 0 / 1; bf16 q with float32 K/V is not a supported combination */
    if ((q_bf16 != 0 && q_bf16 != 1) || (kv_bf16 != 0 && kv_bf16 != 1) || (q_bf16 && !kv_bf16)) {
        err_info[0] = q_bf16;
        err_info[1] = kv_bf16;
        return PA_ERR_DTYPE;
    }
    if (window < 0) {
        err_info[0] = window;
        return PA_ERR_WINDOW;
    }
    if (hkv <= 0 || hq % hkv != 0 || head_dim <= 0 || head_dim % 8 != 0 || page_size <= 0) {
        err_info[0] = hq;
        err_info[1] = hkv;
        err_info[2] = head_dim;
        return PA_ERR_SHAPE;
    }
    if (num_threads < 1) num_threads = 1;
    const int G = hq / hkv;
    const int P = page_size;

    /* Validate the per-sequence metadata and page ids before any thread reads a page. */
    if (query_start[0] < 0) {
        err_info[0] = 0;
        err_info[1] = query_start[0];
        return PA_ERR_QUERY_START;
    }
    for (int s = 0; s < num_seqs; s++) {
        int32_t a = query_start[s], b = query_start[s + 1];
        if (b < a || b > num_tokens) {
            err_info[0] = s;
            err_info[1] = a;
            err_info[2] = b;
            return PA_ERR_QUERY_START;
        }
        int32_t ctx = context_lens[s];
        if (ctx < b - a || ctx > (int64_t)max_pages * P) {
            err_info[0] = s;
            err_info[1] = ctx;
            err_info[2] = b - a;
            return PA_ERR_CONTEXT_LEN;
        }
        if (b == a) continue;
        int need = (ctx + P - 1) / P;
        /* pages before the first query's window are never read: not checked either */
        for (int pg = first_key(ctx - (b - a), window) / P; pg < need; pg++) {
            int32_t page = block_tables[(size_t)s * max_pages + pg];
            if (page < 0 || page >= num_pages) {
                err_info[0] = s;
                err_info[1] = pg;
                err_info[2] = page;
                return PA_ERR_PAGE_ID;
            }
        }
    }

    /* Build work items: query tiles x kv heads. */
    int tile_q = TARGET_ROWS / G;
    if (tile_q < 1) tile_q = 1;
    int64_t n_tiles = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = query_start[s + 1] - query_start[s];
        n_tiles += (q_len + tile_q - 1) / tile_q;
    }
    int64_t n_base = n_tiles * hkv;
    if (n_base == 0) return PA_OK;

    /*
     * Split decode items along the keys when there are fewer items than about 4 per thread,
     * so that batch-1 long-context decode still uses every thread.
     */
    int nsplit_max = 1;
    if (num_threads > 1 && n_base < 4 * (int64_t)num_threads) {
        nsplit_max = (int)((4 * (int64_t)num_threads + n_base - 1) / n_base);
    }

    /* Count items (a split decode item becomes nsplit items). */
    int64_t n_items = 0, n_parts = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = query_start[s + 1] - query_start[s];
        int ntile = (q_len + tile_q - 1) / tile_q;
        if (ntile == 0) continue;
        int nsplit = 1;
        if (q_len == 1 && nsplit_max > 1) {
            int pages = (context_lens[s] + P - 1) / P - first_key(context_lens[s] - 1, window) / P;
            nsplit = pages / MIN_PAGES_PER_SPLIT;
            if (nsplit > nsplit_max) nsplit = nsplit_max;
            if (nsplit < 1) nsplit = 1;
        }
        n_items += (int64_t)ntile * hkv * nsplit;
        if (nsplit > 1) n_parts += (int64_t)hkv * nsplit;
    }

    work_item *items = (work_item *)malloc(sizeof(work_item) * (size_t)n_items);
    int64_t *part_of = (int64_t *)malloc(sizeof(int64_t) * (size_t)n_items);
    float *part_o = NULL, *part_m = NULL, *part_l = NULL;
    if (n_parts > 0) {
        part_o = (float *)malloc(sizeof(float) * (size_t)n_parts * G * head_dim);
        part_m = (float *)malloc(sizeof(float) * (size_t)n_parts * G);
        part_l = (float *)malloc(sizeof(float) * (size_t)n_parts * G);
    }
    if (!items || !part_of || (n_parts > 0 && (!part_o || !part_m || !part_l))) {
        free(items);
        free(part_of);
        free(part_o);
        free(part_m);
        free(part_l);
        return PA_ERR_ALLOC;
    }

    /* Split items first (grouped so a merge finds its partials), then sort by cost. */
    int64_t k = 0, parts_used = 0;
    work_item *merges = NULL;
    int64_t n_merges = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int s = 0; s < num_seqs; s++) {
            int q_len = query_start[s + 1] - query_start[s];
            if (q_len == 0) continue;
            int ctx = context_lens[s];
            int nsplit = 1;
            if (q_len == 1 && nsplit_max > 1) {
                int pages = (ctx + P - 1) / P - first_key(ctx - 1, window) / P;
                nsplit = pages / MIN_PAGES_PER_SPLIT;
                if (nsplit > nsplit_max) nsplit = nsplit_max;
                if (nsplit < 1) nsplit = 1;
            }
            if ((pass == 0) != (nsplit > 1)) continue;
            for (int q0 = 0; q0 < q_len; q0 += tile_q) {
                int nq = q_len - q0 < tile_q ? q_len - q0 : tile_q;
                /* keys seen by the tile ~ position of its middle row */
                int64_t keys = (int64_t)ctx - q_len + q0 + (nq + 1) / 2;
                if (window > 0 && keys > window) keys = window;
                for (int h = 0; h < hkv; h++) {
                    for (int sp = 0; sp < nsplit; sp++) {
                        work_item *it = &items[k];
                        it->seq = s;
                        it->head = h;
                        it->q0 = q0;
                        it->nq = nq;
                        it->split = sp;
                        it->nsplit = nsplit;
                        it->cost = (keys + 64) * nq / nsplit;
                        part_of[k] = nsplit > 1 ? parts_used + sp : -1;
                        k++;
                    }
                    if (nsplit > 1) parts_used += nsplit;
                }
            }
        }
        if (pass == 0) n_merges = k;
    }
    /* part index is stored in 'split' slot via part_of; keep items and part ids together. */
    if (n_merges > 0) {
        merges = (work_item *)malloc(sizeof(work_item) * (size_t)(n_merges));
        if (!merges) {
            free(items);
            free(part_of);
            free(part_o);
            free(part_m);
            free(part_l);
            return PA_ERR_ALLOC;
        }
    }
    /* Record merge descriptors: one per (seq, head) split group (first split of each group). */
    int64_t n_groups = 0;
    int64_t *group_part = n_merges > 0 ? (int64_t *)malloc(sizeof(int64_t) * (size_t)n_merges)
                                       : NULL;
    for (int64_t i = 0; i < n_merges; i++) {
        if (items[i].split == 0) {
            merges[n_groups] = items[i];
            if (group_part) group_part[n_groups] = part_of[i];
            n_groups++;
        }
    }
    /* Encode each item's partial slot in its cost-sorted copy: pack into cost's low bits is
     * fragile, so sort an index array instead. */
    typedef struct {
        work_item it;
        int64_t part;
    } sorted_item;
    sorted_item *order = (sorted_item *)malloc(sizeof(sorted_item) * (size_t)n_items);
    if (!order || (n_merges > 0 && !group_part)) {
        free(items);
        free(part_of);
        free(part_o);
        free(part_m);
        free(part_l);
        free(merges);
        free(group_part);
        free(order);
        return PA_ERR_ALLOC;
    }
    for (int64_t i = 0; i < n_items; i++) {
        order[i].it = items[i];
        order[i].part = part_of[i];
    }
    qsort(order, (size_t)n_items, sizeof(sorted_item), cmp_cost_desc);

    params pr;
    pr.q = q;
    pr.k_pool = k_pool;
    pr.v_pool = v_pool;
    pr.block_tables = block_tables;
    pr.query_start = query_start;
    pr.context_lens = context_lens;
    pr.max_pages = max_pages;
    pr.hq = hq;
    pr.hkv = hkv;
    pr.P = P;
    pr.D = head_dim;
    pr.G = G;
    pr.q_bf16 = q_bf16;
    pr.kv_bf16 = kv_bf16;
    pr.ldS = (P + 7) & ~7;
    pr.scale = scale;
    pr.window = window;
    pr.part_o = part_o;
    pr.part_m = part_m;
    pr.part_l = part_l;

    int max_nq = 0;
    for (int64_t i = 0; i < n_items; i++) max_nq = items[i].nq > max_nq ? items[i].nq : max_nq;
    const int Mmax = max_nq * G;
    int nthreads = num_threads;
    if ((int64_t)nthreads > n_items) nthreads = (int)n_items;
    int alloc_failed = 0;
    int64_t next_item = 0; /* first unclaimed entry of order[] */

#pragma omp parallel num_threads(nthreads)
    {
        scratch sc = {0};
        size_t D = (size_t)head_dim;
        /* q, o: [Mmax, D]; s: [Mmax, ldS]; m, l: [Mmax]; lim, lo: [Mmax] ints (4 bytes each) */
        size_t words = (size_t)Mmax * D * 2 + (size_t)Mmax * pr.ldS + (size_t)Mmax * 4 + 16;
        float *buf = (float *)aligned_alloc(64, (words * sizeof(float) + 63) & ~(size_t)63);
        if (!buf) {
#pragma omp atomic write
            alloc_failed = 1;
        }
        if (buf) {
            sc.q = buf;
            sc.o = sc.q + (size_t)Mmax * D;
            sc.s = sc.o + (size_t)Mmax * D;
            sc.m = sc.s + (size_t)Mmax * pr.ldS;
            sc.l = sc.m + Mmax;
            sc.lim = (int *)(sc.l + Mmax);
            sc.lo = sc.lim + Mmax;
        }
        /* Dynamic schedule (largest items first) with one item claimed ahead, whose first page
         * the current item's last page prefetches. */
        int64_t i = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);
        while (i < n_items) {
            const int64_t j = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);
            if (buf)
                run_item(&pr, &order[i].it, j < n_items ? &order[j].it : NULL, order[i].part,
                         &sc, out);
            i = j;
        }
#pragma omp barrier
        /* all partials written */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_groups; i++) {
            if (buf) merge_item(&pr, &merges[i], group_part[i], out);
        }
        free(buf);
    }

    free(items);
    free(part_of);
    free(part_o);
    free(part_m);
    free(part_l);
    free(merges);
    free(group_part);
    free(order);
    return alloc_failed ? PA_ERR_ALLOC : PA_OK;
}

int pa_forward_addr(uintptr_t out, uintptr_t q, uintptr_t k_pool, uintptr_t v_pool, uintptr_t block_tables,
                    uintptr_t query_start, uintptr_t context_lens, int num_tokens, int num_seqs, int max_pages,
                    int num_pages, int hq, int hkv, int page_size, int head_dim, float scale, int window,
                    int q_bf16, int kv_bf16, int num_threads, int64_t *err_info) {
    return pa_forward((void *)out, (const void *)q, (const void *)k_pool, (const void *)v_pool,
                      (const int32_t *)block_tables, (const int32_t *)query_start, (const int32_t *)context_lens,
                      num_tokens, num_seqs, max_pages, num_pages, hq, hkv, page_size, head_dim, scale, window,
                      q_bf16, kv_bf16, num_threads, err_info);
}

int pa_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
