/*
 * Rotary position embedding and the KV-pool write of a decoder layer, each in one pass:
 *
 *   rope:     out[t, h, d] = x[t, h, (d + D/2) % D] * sin_signed[t, d] + x[t, h, d] * cos[t, d]
 *             (rotate-half convention: sin_signed is sin with its first half negated, so this is
 *             x * cos + rotate_half(x) * sin, bit for bit: no fused multiply-add, see the build)
 *   write_kv: pool row rows[t * Hkv + h] <- k[t, h, :] (and v alike), the pool seen as
 *             [pool_rows, D] (HND pages: row = (page * Hkv + head) * P + slot); float32 rows,
 *             stored as float32 or as bfloat16 (round to nearest even, NaN kept quiet: what
 *             torch's .to(torch.bfloat16) gives).
 *
 * x / k / v rows may be strided per token (ld_* in elements; heads are D apart inside a token),
 * so both read straight from the fused qkv projection's output. Single-threaded: a decode step
 * moves a few KB per layer. Rows are written with streaming stores (see put_row).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

#include "cpu_ops.h"
#include "vec8.h" /* pdserve/kernels/csrc */
#include "bf16.h" /* pdserve/kernels/csrc: f32_to_bf16 */

int op_rope(float *out, const float *x, const float *cos_t, const float *sin_t, int T, int H, int D,
            int64_t ld_x) {
    if (T < 0 || H <= 0 || D <= 0 || D % 16) return OP_ERR_SHAPE; /* halves of whole 8-lane vectors */
    if (ld_x < (int64_t)H * D) return OP_ERR_STRIDE;
    const int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (int64_t)t * D, *s = sin_t + (int64_t)t * D;
        for (int h = 0; h < H; h++) {
            const float *xr = x + (int64_t)t * ld_x + (int64_t)h * D;
            float *o = out + ((int64_t)t * H + h) * D;
            for (int d = 0; d < half; d += 8) {
                /* out[d] pairs x[d] with x[d + half]; out[d + half] pairs x[d + half] with x[d] */
                const v8f lo = load8(xr + d), hi = load8(xr + d + half);
                store8(o + d, hi * load8(s + d) + lo * load8(c + d));
                store8(o + d + half, lo * load8(s + d + half) + hi * load8(c + d + half));
            }
        }
    }
    return OP_OK;
}

int op_rope_qk_addr(uintptr_t q_out, uintptr_t k_out, uintptr_t qkv, uintptr_t cos_t, uintptr_t sin_t, int T,
                    int Hq, int Hkv, int D, int64_t ld_qkv) {
    if (ld_qkv < (int64_t)(Hq + Hkv) * D) return OP_ERR_STRIDE;
    const float *x = (const float *)qkv;
    int rc = op_rope((float *)q_out, x, (const float *)cos_t, (const float *)sin_t, T, Hq, D, ld_qkv);
    if (rc != OP_OK) return rc;
    return op_rope((float *)k_out, x + (int64_t)Hq * D, (const float *)cos_t, (const float *)sin_t, T, Hkv, D, ld_qkv);
}

/*
 * Streams `bytes` from src to dst with non-temporal stores where dst is 32-byte aligned and bytes
 * a multiple of 32 (AVX builds), else memcpy. The pool rows a step writes are cold (each in a
 * different page), so a normal store first reads every line from DRAM (read-for-ownership), one
 * miss after another, a large share of a batch-32 decode step on the default model (commit
 * f7da86e). Streaming stores
 * skip that read; the caller fences once after its last row.
 */
static void put_row(void *dst, const void *src, size_t bytes) {
#ifdef __AVX__
    if (((uintptr_t)dst & 31) == 0 && (bytes & 31) == 0) {
        for (size_t off = 0; off < bytes; off += 32)
            _mm256_stream_ps((float *)((char *)dst + off), _mm256_loadu_ps((const float *)((const char *)src + off)));
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

static void copy_row(void *pool, int64_t row, const float *src, int D, int bf16) {
    if (bf16) {
        uint16_t tmp[512]; /* D <= 512: checked by op_write_kv */
        for (int d = 0; d < D; d++) tmp[d] = f32_to_bf16(src[d]);
        put_row((uint16_t *)pool + row * D, tmp, (size_t)D * sizeof(uint16_t));
    } else {
        put_row((float *)pool + row * D, src, (size_t)D * sizeof(float));
    }
}

int op_write_kv(void *k_pool, void *v_pool, const float *k, const float *v, const int64_t *rows, int T,
                int Hkv, int D, int64_t ld_k, int64_t ld_v, int64_t pool_rows, int pool_bf16,
                int64_t *bad) {
    if (T < 0 || Hkv <= 0 || D <= 0 || D > 512) return OP_ERR_SHAPE;
    if (ld_k < (int64_t)Hkv * D || ld_v < (int64_t)Hkv * D) return OP_ERR_STRIDE;
    /* every row is checked before anything is written: a bad table leaves the pool untouched */
    for (int64_t i = 0; i < (int64_t)T * Hkv; i++) {
        if (rows[i] < 0 || rows[i] >= pool_rows) {
            bad[0] = i;
            bad[1] = rows[i];
            return OP_ERR_ROW;
        }
    }
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < Hkv; h++) {
            const int64_t row = rows[(int64_t)t * Hkv + h];
            copy_row(k_pool, row, k + (int64_t)t * ld_k + (int64_t)h * D, D, pool_bf16);
            copy_row(v_pool, row, v + (int64_t)t * ld_v + (int64_t)h * D, D, pool_bf16);
        }
    }
#ifdef __AVX__
    _mm_sfence(); /* the streamed rows are visible to every thread before attention reads them */
#endif
    return OP_OK;
}

int op_write_kv_addr(uintptr_t k_pool, uintptr_t v_pool, uintptr_t k, uintptr_t v, uintptr_t rows, int T, int Hkv,
                     int D, int64_t ld_k, int64_t ld_v, int64_t pool_rows, int pool_bf16, int64_t *bad) {
    return op_write_kv((void *)k_pool, (void *)v_pool, (const float *)k, (const float *)v, (const int64_t *)rows, T,
                       Hkv, D, ld_k, ld_v, pool_rows, pool_bf16, bad);
}
