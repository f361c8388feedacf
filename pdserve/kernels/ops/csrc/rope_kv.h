#ifndef PDSERVE_ROPE_KV_H
#define PDSERVE_ROPE_KV_H
#include <stdint.h>

/* Error codes shared with norm_act.h (OP_OK, OP_ERR_SHAPE, OP_ERR_STRIDE) plus: */
#define OP_ERR_ROW 3

int op_rope(float *out, const float *x, const float *cos_t, const float *sin_t, int T, int H, int D,
            int64_t ld_x);
int op_write_kv(void *k_pool, void *v_pool, const float *k, const float *v, const int64_t *rows, int T,
                int Hkv, int D, int64_t ld_k, int64_t ld_v, int64_t pool_rows, int pool_bf16,
                int64_t *bad);

#endif
