/*
 * Public entry points of the CPU paged-attention kernel (see paged_attention.c for layouts), the
 * interface of pdserve.kernels.attention._cpu_kernels: _kernels_build.py reads the text between
 * the cffi markers as its cdef, so the C source and the binding declare each function once.
 */
#ifndef PDSERVE_PAGED_ATTENTION_H
#define PDSERVE_PAGED_ATTENTION_H

#include <stdint.h>

/* cffi:begin */
/* Return codes of pa_forward; err_info[0..2] carries the offending values. */
#define PA_OK 0
#define PA_ERR_SHAPE 1       /* err_info = {hq, hkv, head_dim} */
#define PA_ERR_QUERY_START 2 /* err_info = {seq, query_start[seq], query_start[seq + 1]} */
#define PA_ERR_CONTEXT_LEN 3 /* err_info = {seq, context_len, q_len} */
#define PA_ERR_PAGE_ID 4     /* err_info = {seq, page index in the row, page id} */
#define PA_ERR_ALLOC 5
#define PA_ERR_WINDOW 6      /* err_info = {window} */
#define PA_ERR_DTYPE 7       /* err_info = {q_bf16, kv_bf16} */

/* q_bf16: q and out hold bfloat16 bits (else float32); kv_bf16: likewise for k_pool and
 * v_pool. Supported (q_bf16, kv_bf16): (0, 0), (1, 1), (0, 1). */
int pa_forward(void *out, const void *q, const void *k_pool, const void *v_pool,
               const int32_t *block_tables, const int32_t *query_start,
               const int32_t *context_lens, int num_tokens, int num_seqs, int max_pages,
               int num_pages, int hq, int hkv, int page_size, int head_dim, float scale,
               int window, int q_bf16, int kv_bf16, int num_threads, int64_t *err_info);

/* pa_forward with every array as an integer address (tensor.data_ptr()): no ffi.cast per
 * argument (Python time on every call, commit c8c7cb3) on a call made once per layer per pass. */
int pa_forward_addr(uintptr_t out, uintptr_t q, uintptr_t k_pool, uintptr_t v_pool, uintptr_t block_tables,
                    uintptr_t query_start, uintptr_t context_lens, int num_tokens, int num_seqs, int max_pages,
                    int num_pages, int hq, int hkv, int page_size, int head_dim, float scale, int window,
                    int q_bf16, int kv_bf16, int num_threads, int64_t *err_info);

/* 1 when compiled with OpenMP, else 0 (the kernel then runs on one thread). */
int pa_has_openmp(void);
/* cffi:end */

#endif
