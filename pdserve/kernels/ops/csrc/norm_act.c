/*
 * The small per-token operations of a decoder layer, fused so that each reads its input once:
 *
 *   add_rms_norm: h += delta (optional), out = w * (h / sqrt(mean(h^2) + eps))   rows of H floats
 *   silu_mul:     out = silu(gate) * up, gate | up side by side in one row        rows of 2I floats
 *   argmax_rows:  index of each row's largest value (first on ties; first NaN wins, as torch)
 *
 * float32 only; rows may be strided (leading dimensions in elements). add_rms_norm and argmax run
 * on one thread (a decode step's rows are a few KB: forking threads would cost more than it
 * saves); silu_mul, whose exp dominates, splits rows over num_threads for large enough inputs.
 * Vector code uses GCC vector extensions (8 x float).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_ops.h"
#include "vec8.h" /* pdserve/kernels/csrc */
#include "exp8.h" /* pdserve/kernels/csrc */

/* Elements of silu_mul below which one thread does all rows (a fork costs a few microseconds). */
#define SILU_PARALLEL_MIN 16384

/* silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) so that nothing overflows. */
ALWAYS_INLINE v8f silu8(v8f g) {
    const v8i neg = g < splat8(0.0f);
    const v8f e = exp8(select8(neg, g, -g));
    const v8f one = splat8(1.0f);
    const v8f sig = select8(neg, e, one) / (one + e);
    return g * sig;
}

ALWAYS_INLINE float silu1(float g) {
    const float e = expf(-fabsf(g));
    return g * ((g < 0.0f ? e : 1.0f) / (1.0f + e));
}

int op_add_rms_norm(float *out, float *h, const float *delta, const float *w, int rows, int H,
                    int64_t ld_out, int64_t ld_h, int64_t ld_delta, float eps) {
    if (rows < 0 || H <= 0) return OP_ERR_SHAPE;
    if (ld_out < H || ld_h < H || (delta && ld_delta < H)) return OP_ERR_STRIDE;
    const int H8 = H & ~7;
    for (int r = 0; r < rows; r++) {
        float *hr = h + (int64_t)r * ld_h;
        float *orow = out + (int64_t)r * ld_out;
        v8f ss = splat8(0.0f);
        float tail = 0.0f;
        if (delta) {
            const float *dr = delta + (int64_t)r * ld_delta;
            for (int i = 0; i < H8; i += 8) {
                const v8f v = load8(hr + i) + load8(dr + i);
                store8(hr + i, v);
                ss += v * v;
            }
            for (int i = H8; i < H; i++) {
                hr[i] += dr[i];
                tail += hr[i] * hr[i];
            }
        } else {
            for (int i = 0; i < H8; i += 8) {
                const v8f v = load8(hr + i);
                ss += v * v;
            }
            for (int i = H8; i < H; i++) tail += hr[i] * hr[i];
        }
        const float inv = 1.0f / sqrtf((hsum8_fold(ss) + tail) / (float)H + eps);
        const v8f vinv = splat8(inv);
        for (int i = 0; i < H8; i += 8) store8(orow + i, load8(w + i) * (load8(hr + i) * vinv));
        for (int i = H8; i < H; i++) orow[i] = w[i] * (hr[i] * inv);
    }
    return OP_OK;
}

int op_add_rms_norm_addr(uintptr_t out, uintptr_t h, uintptr_t delta, uintptr_t w, int rows, int H, int64_t ld_out,
                         int64_t ld_h, int64_t ld_delta, float eps) {
    return op_add_rms_norm((float *)out, (float *)h, (const float *)delta, (const float *)w, rows, H, ld_out, ld_h,
                           ld_delta, eps);
}

int op_silu_mul(float *out, const float *gate_up, int rows, int I, int64_t ld_out, int64_t ld_in,
                int num_threads) {
    if (rows < 0 || I <= 0) return OP_ERR_SHAPE;
    if (ld_out < I || ld_in < 2 * (int64_t)I) return OP_ERR_STRIDE;
    const int I8 = I & ~7;
    /* rows split over threads once there is enough work to pay for the fork (SILU_PARALLEL_MIN;
     * a batch-32 decode step's 32 x 1536 SiLUs qualify: commit 4afc65e); each row is computed
     * alike whatever the split */
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && (int64_t)rows * I >= SILU_PARALLEL_MIN)
#else
    (void)num_threads;
#endif
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * ld_in;
        const float *u = g + I;
        float *o = out + (int64_t)r * ld_out;
        for (int i = 0; i < I8; i += 8) store8(o + i, silu8(load8(g + i)) * load8(u + i));
        for (int i = I8; i < I; i++) o[i] = silu1(g[i]) * u[i];
    }
    return OP_OK;
}

int op_silu_mul_addr(uintptr_t out, uintptr_t gate_up, int rows, int I, int64_t ld_out, int64_t ld_in,
                     int num_threads) {
    return op_silu_mul((float *)out, (const float *)gate_up, rows, I, ld_out, ld_in, num_threads);
}

int op_argmax_rows(int64_t *out, const float *x, int rows, int V, int64_t ld) {
    if (rows < 0 || V <= 0) return OP_ERR_SHAPE;
    if (ld < V) return OP_ERR_STRIDE;
    const int V8 = V & ~7;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * ld;
        /* Pass 1: the row's max (lane-wise, ignoring NaN) and whether any NaN occurs. */
        v8f m = splat8(-INFINITY);
        v8i nan = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < V8; i += 8) {
            const v8f v = load8(xr + i);
            m = select8(v > m, v, m);
            nan |= (v8i)(v != v);
        }
        float best = -INFINITY;
        int any_nan = 0;
        for (int l = 0; l < 8; l++) {
            best = m[l] > best ? m[l] : best;
            any_nan |= nan[l];
        }
        for (int i = V8; i < V; i++) {
            best = xr[i] > best ? xr[i] : best;
            any_nan |= xr[i] != xr[i];
        }
        /* Pass 2: the first index holding it (the first NaN when there is one). */
        int64_t idx = 0;
        for (int i = 0; i < V; i++) {
            if (any_nan ? xr[i] != xr[i] : xr[i] == best) {
                idx = i;
                break;
            }
        }
        out[r] = idx;
    }
    return OP_OK;
}
