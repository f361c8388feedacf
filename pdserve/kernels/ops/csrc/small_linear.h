#ifndef PDSERVE_SMALL_LINEAR_H
#define PDSERVE_SMALL_LINEAR_H
#include <stdint.h>

#define SL_OK 0
#define SL_ERR_SHAPE 1
#define SL_ERR_STRIDE 2

int sl_linear(float *y, const float *x, const float *w, const float *bias, int M, int N, int K,
              int64_t ldx, int64_t ldy, int num_threads);
int sl_has_openmp(void);

#endif
