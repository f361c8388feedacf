/*
 * exp(x) for 8 floats (Cephes expf polynomial, ~1-2 ulp in the normal range), shared by the C
 * kernels (pdserve/kernels/attention/csrc, pdserve/kernels/ops/csrc). Inputs below -87 (including -inf) give
 * exactly 0 and inputs above 88 are clamped; the callers pass x <= 0 (scores minus their max,
 * -|g| for SiLU).
 *
 * The includer defines first: v8f (8 x float) and v8i (8 x int32) vector types, ALWAYS_INLINE,
 * splat8(float) and select8(mask, a, b).
 */
#ifndef PDSERVE_EXP8_H
#define PDSERVE_EXP8_H

ALWAYS_INLINE v8f exp8(v8f x) {
    const v8i keep = x > splat8(-87.0f);
    x = select8(keep, x, splat8(-87.0f));
    x = select8(x < splat8(88.0f), x, splat8(88.0f));
    v8f fx = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(fx, v8i); /* truncates toward zero */
    v8f tf = __builtin_convertvector(n, v8f);
    v8i gt = tf > fx;                          /* floor for negatives */
    n = n + gt;                                /* gt is -1 where true */
    tf = __builtin_convertvector(n, v8f);
    x = x - tf * 0.693359375f;
    x = x - tf * -2.12194440e-4f;
    v8f y = splat8(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    v8i e = (n + 127) << 23;
    y = y * (v8f)e;
    return select8(keep, y, splat8(0.0f));
}

#endif
