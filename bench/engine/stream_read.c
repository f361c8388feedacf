/*
 * STREAM-like memory bandwidth kernels for bench.engine.decode_bandwidth (compiled there with cc,
 * loaded with ctypes). Each splits its array into `threads` equal contiguous parts, one per
 * OpenMP thread (static schedule), as a decode step's kernel splits a weight matrix.
 *
 *   sb_read:  the sum of a[0..n) (16 independent 8-float accumulators: enough loads in flight
 *             that the loop is bound by memory, not by the FMA latency); returns it so the
 *             compiler cannot drop the loop. Bytes moved: 4 n.
 *   sb_triad: a[i] = b[i] + s * c[i] (STREAM's triad). Bytes moved, counted as STREAM does:
 *             12 n (b and c read, a written; the write-allocate read of a is not counted).
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v8f __attribute__((vector_size(32)));

static inline v8f ld8(const float *p) {
    v8f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

double sb_read(const float *a, int64_t n, int threads) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int64_t per = (n / nt) & ~(int64_t)127;
        const int64_t lo = t * per, hi = t + 1 == nt ? n : lo + per;
        v8f acc[16] = {{0}};
        int64_t i = lo;
        for (; i + 128 <= hi; i += 128)
            for (int j = 0; j < 16; j++) acc[j] += ld8(a + i + 8 * j);
        double s = 0.0;
        for (int j = 0; j < 16; j++)
            for (int l = 0; l < 8; l++) s += acc[j][l];
        for (; i < hi; i++) s += a[i];
        total += s;
    }
    return total;
}

void sb_triad(float *a, const float *b, const float *c, float s, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}
