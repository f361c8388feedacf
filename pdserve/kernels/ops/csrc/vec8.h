/* 8 x float vectors (GCC vector extensions; AVX2/AVX-512/SSE as -march allows) for pdserve/ops. */
#ifndef PDSERVE_VEC8_H
#define PDSERVE_VEC8_H
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Unaligned load / store. */
ALWAYS_INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

ALWAYS_INLINE void store8(float *p, v8f v) { memcpy(p, &v, sizeof(v)); }

ALWAYS_INLINE v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Lane-wise mask ? a : b (mask lanes all ones or all zeros, as vector comparisons give). */
ALWAYS_INLINE v8f select8(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* Fixed-order reduction of the 8 lanes: ((0+4)+(2+6)) + ((1+5)+(3+7)). */
ALWAYS_INLINE float hsum8(v8f v) {
    float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
    return (a0 + a2) + (a1 + a3);
}

#endif
