/*
 * The C CPU ops of pdserve.kernels.ops._cpu_ops: small-batch linear (small_linear.c), fused
 * RMSNorm / SiLU-mul / argmax (norm_act.c), rotary embedding and KV-pool write (rope_kv.c).
 *
 * Between the cffi markers: the module's Python interface, read by _ops_build.py as its cdef
 * (so the C sources and the binding declare each function once). Entry points named *_addr take
 * every array as an integer address (torch's data_ptr()): a decode step makes ~600 such calls,
 * and an ffi.cast per pointer argument adds up over them (commit c8c7cb3). Below the markers:
 * the typed forms the _addr entry points wrap, for use inside C.
 */
#ifndef PDSERVE_CPU_OPS_H
#define PDSERVE_CPU_OPS_H
#include <stdint.h>

/* cffi:begin */
/* Return codes of sl_linear / sl_linear_addr. */
#define SL_OK 0
#define SL_ERR_SHAPE 1
#define SL_ERR_STRIDE 2

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) . w [N, K]^T (+ bias [N]; 0 = none). */
int sl_linear_addr(uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t bias, int M, int N, int K, int64_t ldx,
                   int64_t ldy, int num_threads);
/* The same, K summed in blocks of kb folded left to right (pstride 0), or block j's partial
 * dot products written to y + j * pstride (pstride > 0, bias 0): small_linear.c. */
int sl_linear_blocked_addr(uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t bias, int M, int N, int K,
                           int64_t ldx, int64_t ldy, int kb, int64_t pstride, int num_threads);
/* 1 when compiled with OpenMP, else 0 (every op then runs on one thread). */
int sl_has_openmp(void);

/* Return codes of the op_* functions. */
#define OP_OK 0
#define OP_ERR_SHAPE 1
#define OP_ERR_STRIDE 2
#define OP_ERR_ROW 3

int op_argmax_rows(int64_t *out, const float *x, int rows, int V, int64_t ld);
int op_rope(float *out, const float *x, const float *cos_t, const float *sin_t, int T, int H, int D,
            int64_t ld_x);
int op_add_rms_norm_addr(uintptr_t out, uintptr_t h, uintptr_t delta, uintptr_t w, int rows, int H, int64_t ld_out,
                         int64_t ld_h, int64_t ld_delta, float eps);
int op_silu_mul_addr(uintptr_t out, uintptr_t gate_up, int rows, int I, int64_t ld_out, int64_t ld_in,
                     int num_threads);
/* q and k rotated out of one qkv row block ([T, ld_qkv]: q heads at column 0, k heads at Hq * D). */
int op_rope_qk_addr(uintptr_t q_out, uintptr_t k_out, uintptr_t qkv, uintptr_t cos_t, uintptr_t sin_t, int T,
                    int Hq, int Hkv, int D, int64_t ld_qkv);
/* OP_ERR_ROW: bad = {index into rows, the row}. */
int op_write_kv_addr(uintptr_t k_pool, uintptr_t v_pool, uintptr_t k, uintptr_t v, uintptr_t rows, int T, int Hkv,
                     int D, int64_t ld_k, int64_t ld_v, int64_t pool_rows, int pool_bf16, int64_t *bad);
/* cffi:end */

int sl_linear(float *y, const float *x, const float *w, const float *bias, int M, int N, int K,
              int64_t ldx, int64_t ldy, int num_threads);
int sl_linear_blocked(float *y, const float *x, const float *w, const float *bias, int M, int N, int K,
                      int64_t ldx, int64_t ldy, int kb, int64_t pstride, int num_threads);
int op_add_rms_norm(float *out, float *h, const float *delta, const float *w, int rows, int H,
                    int64_t ld_out, int64_t ld_h, int64_t ld_delta, float eps);
int op_silu_mul(float *out, const float *gate_up, int rows, int I, int64_t ld_out, int64_t ld_in,
                int num_threads);
int op_write_kv(void *k_pool, void *v_pool, const float *k, const float *v, const int64_t *rows, int T,
                int Hkv, int D, int64_t ld_k, int64_t ld_v, int64_t pool_rows, int pool_bf16,
                int64_t *bad);

#endif
