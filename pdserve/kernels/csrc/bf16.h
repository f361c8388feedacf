/*
 * float32 -> bfloat16 bits, round to nearest even, NaN kept quiet (what torch's
 * .to(torch.bfloat16) gives), shared by the C kernels (pdserve/kernels/attention/csrc, pdserve/kernels/ops/csrc).
 */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                             /* nearest even */
    return (uint16_t)(u >> 16);
}

#endif
