/* Page-shard checksums (S7): CRC32C (Castagnoli, reflected polynomial 0x82F63B78, the iSCSI /
 * ext4 / RDMA-ICRC family), computed with the SSE4.2 crc32 instruction when the CPU has it and a
 * slicing-by-8 table otherwise; both give the same values. kv_messenger/checksum.py is the
 * Python face; kv_messenger/_checksum_build.py compiles it (cffi, API mode).
 */
#ifndef PD_CHECKSUM_H
#define PD_CHECKSUM_H

#include <stdint.h>

/* cffi:begin */
#define PD_CRC32C_AUTO 0
#define PD_CRC32C_HW 1
#define PD_CRC32C_TABLE 2
#define PD_CRC32C_HW_SERIAL 3

/* Builds the tables (idempotent; call once before anything else, under the caller's lock).
 * Returns 1 when the SSE4.2 path can run on this CPU, 0 otherwise. */
int pd_crc32c_init(void);

/* CRC32C of data[0, len), continuing from `crc` (0 to start; a previous result to continue, as
 * zlib.crc32 does). impl: PD_CRC32C_AUTO / _HW / _TABLE / _HW_SERIAL (one crc32 chain, no interleave: for the
 * benchmark); HW without SSE4.2 runs the table. */
uint32_t pd_crc32c(uint32_t crc, const uint8_t *data, uint64_t len, int impl);

/* out[i] = CRC32C of base[offsets[i], offsets[i] + lengths[i]) for i < n, each from 0. The caller
 * has checked every run lies inside the buffer. Returns 0. */
int pd_crc32c_runs(const uint8_t *base, const uint64_t *offsets, const uint64_t *lengths, uint64_t n,
                   uint32_t *out, int impl);
/* cffi:end */

#endif
