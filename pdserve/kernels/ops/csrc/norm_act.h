#ifndef PDSERVE_NORM_ACT_H
#define PDSERVE_NORM_ACT_H
#include <stdint.h>

#define OP_OK 0
#define OP_ERR_SHAPE 1
#define OP_ERR_STRIDE 2

int op_add_rms_norm(float *out, float *h, const float *delta, const float *w, int rows, int H,
                    int64_t ld_out, int64_t ld_h, int64_t ld_delta, float eps);
int op_silu_mul(float *out, const float *gate_up, int rows, int I, int64_t ld_out, int64_t ld_in,
                int num_threads);
int op_argmax_rows(int64_t *out, const float *x, int rows, int V, int64_t ld);

#endif
