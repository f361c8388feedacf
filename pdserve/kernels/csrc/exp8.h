/*
 * exp(x) for 8 floats (Cephes expf: Cody-Waite range reduction, degree-5 polynomial), shared by
 * the C kernels (pdserve/kernels/attention/csrc: softmax; pdserve/kernels/ops/csrc: SiLU).
 *
 * Input range, and what exp8 gives outside it:
 *   -87 < x < 88   exp(x) within ~1-2 ulp (results between ~1.6e-38 and ~1.7e38, all normal)
 *   x <= -87       exactly 0, -inf included (true exp(-87) ~ 1.6e-38: results that would be
 *                  tiny or subnormal are flushed to 0; the attention kernel's masked scores
 *                  (-inf - max) rely on this giving 0)
 *   x >= 88        exp(88) ~ 1.65e38, +inf included: clamped, never inf
 *   NaN            0 (not NaN: NaN fails the x > -87 test like a masked score)
 * The callers stay in x <= 0: scores minus their running max (softmax), -|g| (SiLU).
 *
 * Bits: the result depends on whether the including module contracts a * b + c into a fused
 * multiply-add: the attention module does (GCC's default with -march=native), the ops module is
 * built with -ffp-contract=off. Each module's results are reproducible, but the two modules'
 * exp8 can differ by an ulp for the same x.
 *
 * Checked at compile time: no -ffast-math / -ffinite-math-only, under which the compiler may
 * assume x is never -inf or NaN and drop the comparisons the ranges above rest on.
 */
#ifndef PDSERVE_EXP8_H
#define PDSERVE_EXP8_H

#include "vec8.h"

#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error "exp8.h needs IEEE infinities and NaN: build without -ffast-math / -ffinite-math-only"
#endif

ALWAYS_INLINE v8f exp8(v8f x) {
    const v8i keep = x > splat8(-87.0f);       /* false for x <= -87 and NaN: those lanes give 0 */
    x = select8(keep, x, splat8(-87.0f));
    x = select8(x < splat8(88.0f), x, splat8(88.0f));
    /* n = floor(x / ln 2 + 1/2) in [-126, 127], so 2^n below is a normal float and
     * the conversion to int32 cannot overflow */
    v8f fx = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(fx, v8i); /* truncates toward zero */
    v8f tf = __builtin_convertvector(n, v8f);
    v8i gt = tf > fx;                          /* floor for negatives */
    n = n + gt;                                /* gt is -1 where true */
    tf = __builtin_convertvector(n, v8f);
    x = x - tf * 0.693359375f;                 /* x - n ln 2, ln 2 split in two (Cody-Waite) */
    x = x - tf * -2.12194440e-4f;
    v8f y = splat8(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    v8i e = (n + 127) << 23;                   /* 2^n as float bits */
    y = y * (v8f)e;
    return select8(keep, y, splat8(0.0f));
}

#endif
