/*
 * y = x W^T (+ b) for a few rows of x: the decode-step shape of every linear layer.
 *
 *   x: [M, K] float32, row stride ldx      W: [N, K] float32, contiguous (nn.Linear layout)
 *   y: [M, N] float32, row stride ldy      b: [N] float32 or NULL
 *
 * With M small (a decode batch) the product is bound by streaming W from memory once. General
 * GEMM libraries pack W for every call or, for 2-3 rows, take paths that cost several times one
 * row's time; this kernel reads each W row once per call and reuses it from L1 for every row of
 * x, so the time stays close to one row's until the FMAs, not the bytes, dominate.
 *
 * Tiles of 3 rows of W by 4 rows of x keep 12 accumulators of 8 floats in registers (plus 3 W
 * vectors and 1 x vector: 16 registers on AVX2); 1 or 2 rows of x get taller tiles (see
 * rows()). Each output element is a dot product summed in the same order whatever M, tile
 * shape, position or thread count: 8 lane-wise partial sums
 * over k = 0, 8, 16, ..., a fixed lane reduction, then the k tail, then the bias. So a row's
 * result does not depend on which other rows share the call (batch invariance).
 *
 * Threads: OpenMP over bands of W rows, claimed CHUNK_BANDS at a time; `num_threads` <= 1 runs
 * inline.
 * Vector code uses GCC vector extensions (8 x float), compiled for the -march the build allows.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_ops.h"
#include "vec8.h" /* pdserve/kernels/csrc */

/*
 * acc + a * b. Explicit, because the build passes -ffp-contract=off: left to itself GCC fused
 * some tile shapes' multiply-adds and not others, which broke batch invariance by an ulp.
 */
#if defined(__FMA__)
#include <immintrin.h>
ALWAYS_INLINE v8f fma8(v8f a, v8f b, v8f acc) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc); }
ALWAYS_INLINE float fma1(float a, float b, float acc) { return __builtin_fmaf(a, b, acc); }
#else
ALWAYS_INLINE v8f fma8(v8f a, v8f b, v8f acc) { return acc + a * b; }
ALWAYS_INLINE float fma1(float a, float b, float acc) { return acc + a * b; }
#endif

/* Largest tile: NB rows of W by MB rows of x (accumulator array bounds). */
#define NB 8
#define MB 4
/* W rows per band: the unit of work split across threads; a multiple of every tile height. */
#define BAND 24
/*
 * Bands a thread claims at a time. A static split (one half of W per thread) waits at the end
 * for the slower core, and on a shared VM the two cores' speeds differ from moment to moment:
 * claiming 2 bands at a time made a decode step's 121 products faster there (paired passes at
 * 32 rows, commit 989e4fb); each band is computed alike whoever takes it, so results are
 * unchanged bit for bit.
 */
#define CHUNK_BANDS 2
/*
 * Software prefetch, in bytes ahead of the tile's start (0 = off). A tile's nb W rows are one
 * contiguous span of nb * K floats (W is row-major), read as nb streams of one short row each
 * (K = 576: 36 cache lines), too short for the hardware prefetcher to train on. So the first
 * m-tile of each W tile prefetches that span linearly, SL_PREFETCH bytes ahead, as fast as the
 * tile consumes it (nb * 32 bytes per k step): past the tile's end, into the next tile's rows.
 * Into every cache level (locality 3): prefetching each row 2 KB ahead with the
 * non-temporal hint, as before, was 18-37% slower at M = 1..8 than this on one thread, and
 * slower than no prefetch at all at M = 1 (paired runs,
 * bench/results/engine/small_linear_prefetch.md).
 */
#ifndef SL_PREFETCH
#define SL_PREFETCH 8192
#endif

/*
 * One tile: rows n0 .. n0+nb-1 of W against rows m0 .. m0+mb-1 of x (nb <= NB, mb <= MB, both
 * compile-time constants at every call site so the loops unroll and the accumulators stay in
 * registers). Only the first m-tile of a W tile prefetches (later ones find W in L1).
 * Prefetching never reads past what the hint names: a prefetch beyond W's end does not fault.
 */
ALWAYS_INLINE void tile(float *y, int64_t ldy, const float *x, int64_t ldx, const float *w,
                        const float *bias, int K, int kb, int64_t pstride, int n0, int m0, const int nb,
                        const int mb) {
    v8f acc[NB][MB];
    float s[NB][MB];
    const float *wr[NB];
    const float *xr[MB];
    for (int i = 0; i < nb; i++) wr[i] = w + (int64_t)(n0 + i) * K;
    for (int j = 0; j < mb; j++) xr[j] = x + (int64_t)(m0 + j) * ldx;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) s[i][j] = 0.0f; /* K == 0: y = bias */
    /* the prefetch cursor: the next cache line to prefetch, and how far this tile has read */
    const char *pf = (const char *)((uintptr_t)((const char *)(w + (int64_t)n0 * K) + SL_PREFETCH) & ~(uintptr_t)63);
    const char *pf_end = pf;
    /* One K block at a time (kb == K: the whole row, the unblocked kernel); see sl_linear_blocked. */
    for (int b0 = 0, blk = 0; b0 < K; b0 += kb, blk++) {
        const int kend = K - b0 > kb ? b0 + kb : K;
        for (int i = 0; i < nb; i++)
            for (int j = 0; j < mb; j++) acc[i][j] = splat8(0.0f);
        const int k8 = b0 + ((kend - b0) & ~7);
        for (int k = b0; k < k8; k += 8) {
            v8f wv[NB];
            if (SL_PREFETCH > 0 && m0 == 0) {
                pf_end += nb * 32; /* the bytes of W this k step reads */
                for (; pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, 3);
            }
            for (int i = 0; i < nb; i++) wv[i] = load8(wr[i] + k);
            for (int j = 0; j < mb; j++) {
                const v8f xv = load8(xr[j] + k);
                for (int i = 0; i < nb; i++) acc[i][j] = fma8(wv[i], xv, acc[i][j]);
            }
        }
        for (int i = 0; i < nb; i++) {
            for (int j = 0; j < mb; j++) {
                float t = hsum8_fold(acc[i][j]);
                for (int k = k8; k < kend; k++) t = fma1(wr[i][k], xr[j][k], t);
                if (pstride) /* block partials: block blk's dot products at y + blk * pstride */
                    y[blk * pstride + (int64_t)(m0 + j) * ldy + n0 + i] = t;
                else /* the left fold: block 0's dot, then + block 1's, + block 2's, ... */
                    s[i][j] = b0 == 0 ? t : s[i][j] + t;
            }
        }
    }
    if (pstride) return;
    for (int i = 0; i < nb; i++) {
        for (int j = 0; j < mb; j++) {
            float t = s[i][j];
            if (bias) t += bias[n0 + i];
            y[(int64_t)(m0 + j) * ldy + n0 + i] = t;
        }
    }
}

/* Every row of x (M >= 3: tiles of 4 rows, then the rest) against W rows n0 .. n0+nb-1. */
ALWAYS_INLINE void column(float *y, int64_t ldy, const float *x, int64_t ldx, const float *w,
                          const float *bias, int M, int K, int kb, int64_t ps, int n0, const int nb) {
    int m0 = 0;
    for (; m0 + MB <= M; m0 += MB) tile(y, ldy, x, ldx, w, bias, K, kb, ps, n0, m0, nb, MB);
    switch (M - m0) {
    case 3: tile(y, ldy, x, ldx, w, bias, K, kb, ps, n0, m0, nb, 3); break;
    case 2: tile(y, ldy, x, ldx, w, bias, K, kb, ps, n0, m0, nb, 2); break;
    case 1: tile(y, ldy, x, ldx, w, bias, K, kb, ps, n0, m0, nb, 1); break;
    default: break;
    }
}

/*
 * W rows [n0, n1) in tiles shaped for M: with 1 or 2 rows of x there are few accumulators per
 * W row, so tiles are taller (8 x 1, 6 x 2: more W streams and independent FMA chains); from 3
 * rows on, 3 x 4. A band (BAND rows) splits evenly into each shape; a short last band finishes
 * with smaller tiles.
 */
static void rows(float *y, int64_t ldy, const float *x, int64_t ldx, const float *w,
                 const float *bias, int M, int K, int kb, int64_t ps, int n0, int n1) {
    int n = n0;
    if (M == 1) {
        for (; n + 8 <= n1; n += 8) tile(y, ldy, x, ldx, w, bias, K, kb, ps, n, 0, 8, 1);
    } else if (M == 2) {
        for (; n + 6 <= n1; n += 6) tile(y, ldy, x, ldx, w, bias, K, kb, ps, n, 0, 6, 2);
    }
    for (; n + 3 <= n1; n += 3) column(y, ldy, x, ldx, w, bias, M, K, kb, ps, n, 3);
    switch (n1 - n) {
    case 2: column(y, ldy, x, ldx, w, bias, M, K, kb, ps, n, 2); break;
    case 1: column(y, ldy, x, ldx, w, bias, M, K, kb, ps, n, 1); break;
    default: break;
    }
}

static void bands(float *y, int64_t ldy, const float *x, int64_t ldx, const float *w,
                  const float *bias, int M, int N, int K, int kb, int64_t ps, int64_t b0, int64_t b1) {
    const int n0 = (int)(b0 * BAND);
    const int n1 = b1 * BAND < N ? (int)(b1 * BAND) : N;
    rows(y, ldy, x, ldx, w, bias, M, K, kb, ps, n0, n1);
}

/*
 * The blocked form (tensor-parallel invariance, pdserve/model/tp.py): K splits into blocks of kb
 * (the last may be shorter); each output's dot product over a block is summed as the unblocked
 * kernel sums a whole row (8 lane partials, the fixed lane fold, the block's k tail). Then
 *   pstride == 0: y = ((block 0 + block 1) + block 2) + ... , then + bias;
 *   pstride > 0:  block j's dot products go to y + j * pstride (no fold; bias must be NULL),
 * for a tensor-parallel rank whose running sum arrives from the rank before it. kb >= K is the
 * unblocked kernel, bit for bit.
 */
int sl_linear_blocked(float *y, const float *x, const float *w, const float *bias, int M, int N, int K,
                      int64_t ldx, int64_t ldy, int kb, int64_t pstride, int num_threads) {
    if (M < 0 || N < 0 || K < 0 || kb <= 0 || pstride < 0 || (pstride && bias)) return SL_ERR_SHAPE;
    if (ldx < K || ldy < N || (pstride && pstride < ldy * M)) return SL_ERR_STRIDE;
    if (M == 0 || N == 0) return SL_OK;
    if (kb > K) kb = K > 0 ? K : 1;
    const int64_t nbands = ((int64_t)N + BAND - 1) / BAND;
    /* Below ~8 bands (192 W rows) per thread the fork/join costs more than the split saves. */
    int64_t nt = num_threads;
    if (nt > nbands / 8) nt = nbands / 8;
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel for num_threads((int)nt) schedule(dynamic, CHUNK_BANDS)
        for (int64_t b = 0; b < nbands; b++) bands(y, ldy, x, ldx, w, bias, M, N, K, kb, pstride, b, b + 1);
        return SL_OK;
    }
#endif
    bands(y, ldy, x, ldx, w, bias, M, N, K, kb, pstride, 0, nbands);
    return SL_OK;
}

int sl_linear(float *y, const float *x, const float *w, const float *bias, int M, int N, int K,
              int64_t ldx, int64_t ldy, int num_threads) {
    return sl_linear_blocked(y, x, w, bias, M, N, K, ldx, ldy, K > 0 ? K : 1, 0, num_threads);
}

int sl_linear_blocked_addr(uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t bias, int M, int N, int K,
                           int64_t ldx, int64_t ldy, int kb, int64_t pstride, int num_threads) {
    return sl_linear_blocked((float *)y, (const float *)x, (const float *)w, (const float *)bias, M, N, K, ldx,
                             ldy, kb, pstride, num_threads);
}

int sl_linear_addr(uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t bias, int M, int N, int K, int64_t ldx,
                   int64_t ldy, int num_threads) {
    return sl_linear((float *)y, (const float *)x, (const float *)w, (const float *)bias, M, N, K, ldx, ldy,
                     num_threads);
}

int sl_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
