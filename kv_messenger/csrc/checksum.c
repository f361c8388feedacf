/* CRC32C, two ways that give the same values (checksum.h):
 *
 * - table: slicing-by-8 over the reflected polynomial 0x82F63B78, 8 bytes per step.
 * - hw (x86-64 with SSE4.2): the crc32 instruction 8 bytes at a time. One chain of crc32q is
 *   bound by the instruction's latency, so a long run is hashed as three interleaved streams of
 *   equal blocks whose partial CRCs are joined afterwards: CRC is linear, so the state after
 *   A|B equals shift(state after A, |B|) ^ (state after B from 0), where shift(s, n) is s fed n
 *   zero bytes. shift for the two block sizes is a precomputed 4 x 256 table (one lookup per
 *   byte of the 32-bit state). The block sizes and the speed of each path are in
 *   bench/results/fabric/checksum.md.
 *
 * All state is in registers; the states here are the raw (not inverted) CRC register, inverted on
 * entry and exit of pd_crc32c as the standard CRC32C defines.
 */
#include "checksum.h"

#include <string.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#define PD_HAVE_X86 1
#else
#define PD_HAVE_X86 0
#endif

#define POLY 0x82F63B78u
#define LONG_BLOCK 2048u   /* bytes per stream in the long interleave (3 x 2 KiB = 6 KiB) */
#define SHORT_BLOCK 256u   /* bytes per stream in the short interleave (3 x 256 B) */

static uint32_t table8[8][256];       /* slicing-by-8 */
static uint32_t shift_long[4][256];   /* state -> state fed LONG_BLOCK zero bytes */
static uint32_t shift_short[4][256];  /* state -> state fed SHORT_BLOCK zero bytes */
static int initialised = 0;
static int hw_ok = 0;

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);  /* unaligned and little-endian as the x86 and table paths both read it */
    return v;
}

static uint32_t table_update(uint32_t s, const uint8_t *p, uint64_t n) {
    while (n && ((uintptr_t)p & 7u)) {
        s = table8[0][(s ^ *p++) & 0xFFu] ^ (s >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t v = load64(p) ^ s;
        s = table8[7][v & 0xFFu] ^ table8[6][(v >> 8) & 0xFFu] ^ table8[5][(v >> 16) & 0xFFu] ^
            table8[4][(v >> 24) & 0xFFu] ^ table8[3][(v >> 32) & 0xFFu] ^ table8[2][(v >> 40) & 0xFFu] ^
            table8[1][(v >> 48) & 0xFFu] ^ table8[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) s = table8[0][(s ^ *p++) & 0xFFu] ^ (s >> 8);
    return s;
}

static uint32_t zeros_shift(uint32_t s, uint64_t n) {
    /* s fed n zero bytes, one at a time (init only) */
    while (n--) s = table8[0][s & 0xFFu] ^ (s >> 8);
    return s;
}

static void build_shift(uint32_t shift[4][256], uint64_t n) {
    uint32_t basis[32];
    for (int b = 0; b < 32; b++) basis[b] = zeros_shift(1u << b, n);
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < 256; v++) {
            uint32_t acc = 0;
            for (int b = 0; b < 8; b++)
                if (v & (1 << b)) acc ^= basis[8 * i + b];
            shift[i][v] = acc;
        }
}

static inline uint32_t apply_shift(uint32_t shift[4][256], uint32_t s) {
    return shift[0][s & 0xFFu] ^ shift[1][(s >> 8) & 0xFFu] ^ shift[2][(s >> 16) & 0xFFu] ^ shift[3][s >> 24];
}

#if PD_HAVE_X86
__attribute__((target("sse4.2"))) static uint32_t hw_single(uint32_t s, const uint8_t *p, uint64_t n) {
    uint64_t s64 = s;
    while (n >= 8) {
        s64 = _mm_crc32_u64(s64, load64(p));
        p += 8;
        n -= 8;
    }
    s = (uint32_t)s64;
    while (n--) s = _mm_crc32_u8(s, *p++);
    return s;
}

__attribute__((target("sse4.2"))) static uint32_t hw_triple(uint32_t s, const uint8_t **pp, uint64_t *np,
                                                             uint64_t block, uint32_t shift[4][256]) {
    const uint8_t *p = *pp;
    uint64_t n = *np;
    while (n >= 3 * block) {
        uint64_t a = s, b = 0, c = 0;
        for (uint64_t i = 0; i < block; i += 8) {
            a = _mm_crc32_u64(a, load64(p + i));
            b = _mm_crc32_u64(b, load64(p + block + i));
            c = _mm_crc32_u64(c, load64(p + 2 * block + i));
        }
        s = apply_shift(shift, (uint32_t)a) ^ (uint32_t)b;
        s = apply_shift(shift, s) ^ (uint32_t)c;
        p += 3 * block;
        n -= 3 * block;
    }
    *pp = p;
    *np = n;
    return s;
}

static uint32_t hw_update(uint32_t s, const uint8_t *p, uint64_t n) {
    s = hw_triple(s, &p, &n, LONG_BLOCK, shift_long);
    s = hw_triple(s, &p, &n, SHORT_BLOCK, shift_short);
    return hw_single(s, p, n);
}
#endif

int pd_crc32c_init(void) {
    if (initialised) return hw_ok;
    for (uint32_t v = 0; v < 256; v++) {
        uint32_t c = v;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ POLY : c >> 1;
        table8[0][v] = c;
    }
    for (uint32_t v = 0; v < 256; v++)
        for (int t = 1; t < 8; t++) table8[t][v] = table8[0][table8[t - 1][v] & 0xFFu] ^ (table8[t - 1][v] >> 8);
    build_shift(shift_long, LONG_BLOCK);
    build_shift(shift_short, SHORT_BLOCK);
#if PD_HAVE_X86
    __builtin_cpu_init();
    hw_ok = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
    initialised = 1;
    return hw_ok;
}

static uint32_t update(uint32_t s, const uint8_t *p, uint64_t n, int impl) {
#if PD_HAVE_X86
    if (hw_ok && impl == PD_CRC32C_HW_SERIAL) return hw_single(s, p, n);
    if (hw_ok && impl != PD_CRC32C_TABLE) return hw_update(s, p, n);
#endif
    (void)impl;
    return table_update(s, p, n);
}

uint32_t pd_crc32c(uint32_t crc, const uint8_t *data, uint64_t len, int impl) {
    return ~update(~crc, data, len, impl);
}

int pd_crc32c_runs(const uint8_t *base, const uint64_t *offsets, const uint64_t *lengths, uint64_t n,
                   uint32_t *out, int impl) {
    for (uint64_t i = 0; i < n; i++) out[i] = ~update(0xFFFFFFFFu, base + offsets[i], lengths[i], impl);
    return 0;
}
