/*
 * 8 x float vectors for the C kernels (pdserve/kernels/attention/csrc, pdserve/kernels/ops/csrc):
 * GCC vector extensions, compiled to AVX2 / AVX-512 / SSE as the build's -march allows. The one
 * definition of the vector types and helpers both modules use.
 *
 * Two horizontal sums, because the kernels were tuned and tested with different lane orders and
 * float addition is not associative: each kernel keeps the order it has always used, so its
 * outputs stay bit-identical. Pick by name, never by habit:
 *   hsum8_fold           ((0+4) + (2+6)) + ((1+5) + (3+7))   the CPU ops (small_linear, norm_act)
 *   hsum8_fold_adjacent  ((0+4) + (1+5)) + ((2+6) + (3+7))   the paged-attention kernel
 * Both first fold the upper 4 lanes onto the lower 4 (b[i] = v[i] + v[i + 4]); then hsum8_fold
 * folds the halves again ((b0 + b2) + (b1 + b3)), hsum8_fold_adjacent adds neighbours
 * ((b0 + b1) + (b2 + b3), the order of a horizontal add).
 */
#ifndef PDSERVE_VEC8_H
#define PDSERVE_VEC8_H
#include <stdint.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
/* The same vectors at 4-byte alignment: what load8 / store8 read and write through. */
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));

_Static_assert(sizeof(v8f) == 8 * sizeof(float) && sizeof(v8i) == sizeof(v8f), "8-lane vectors of 32 bytes");

/* Unaligned load / store of 8 floats. */
ALWAYS_INLINE v8f load8(const float *p) { return *(const v8f_u *)p; }
ALWAYS_INLINE void store8(float *p, v8f v) { *(v8f_u *)p = v; }

ALWAYS_INLINE v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Lane-wise mask ? a : b (mask lanes all ones or all zeros, as vector comparisons give). */
ALWAYS_INLINE v8f select8(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* Lane-wise max (b where either is NaN). */
ALWAYS_INLINE v8f max8(v8f a, v8f b) { return select8(a > b, a, b); }

/* Largest lane, scanning lanes 0..7 (a NaN lane is skipped unless it is lane 0). */
ALWAYS_INLINE float hmax8(v8f a) {
    float m = a[0];
    for (int i = 1; i < 8; i++) m = a[i] > m ? a[i] : m;
    return m;
}

/* Sum of the 8 lanes as ((0+4) + (2+6)) + ((1+5) + (3+7)): the CPU ops' order (see the top). */
ALWAYS_INLINE float hsum8_fold(v8f v) {
    float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
    return (a0 + a2) + (a1 + a3);
}

/* Sum of the 8 lanes as ((0+4) + (1+5)) + ((2+6) + (3+7)): the attention kernel's order. */
ALWAYS_INLINE float hsum8_fold_adjacent(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#endif
