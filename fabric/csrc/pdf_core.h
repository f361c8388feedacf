/*
 * pdf_core.h - the interface of pdf_core.c, the native half of fabric's TransferEngine.
 *
 * This header is the one declaration of it: pdf_core.c includes it, and fabric/_ffi_build.py
 * hands the region between the cffi markers to cffi as its cdef (native_build.read_cdef), so
 * the C side and the Python bindings cannot disagree.  The region holds plain declarations and
 * `#define NAME <integer>` only (it is read by cffi's parser and compiled as C).
 *
 * Threads: every function may be called from any thread, except that pdf_progress is called
 * by the one progress thread only, and pdf_close after that thread returned for good.  All of
 * them take the engine lock for libfabric calls (FI_THREAD_DOMAIN, see pdf_core.c).
 */
#ifndef PDF_CORE_H
#define PDF_CORE_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
typedef struct pdf_engine pdf_engine;

/* Events pdf_progress / pdf_fail_peer / pdf_fail_all return (pdf_event.kind). */
#define PDF_EV_BATCH_DONE 1   /* id: batch */
#define PDF_EV_BATCH_FAILED 2 /* id: batch, code, count: writes not completed, aux: writes */
#define PDF_EV_IMM 3          /* id: tag, count: units landed (immediate data received), aux: the
                                 writer's fi_addr as the provider reports it (PDF_ADDR_UNKNOWN: not
                                 in the AV, or no FI_SOURCE; fabric/imm.py: who names writers) */
#define PDF_EV_RECV 4         /* id: receive slot, count: bytes (pdf_recv_buf, then pdf_recv_release),
                                 aux: the sender's fi_addr (PDF_ADDR_UNKNOWN: not in the AV, or no
                                 FI_SOURCE) */
#define PDF_ADDR_UNKNOWN 18446744073709551615u /* FI_ADDR_NOTAVAIL */
#define PDF_EV_SEND_DONE 5    /* id: send */
#define PDF_EV_SEND_FAILED 6  /* id: send, code, aux: peer */
#define PDF_EV_PEER_FAILED 7  /* id: peer (fi_addr), code */
#define PDF_EV_CQ_ERROR 8     /* code, count: provider errno */

typedef struct pdf_event {
    uint32_t kind;
    int32_t code;
    uint64_t id;
    uint64_t count;
    uint64_t aux;
} pdf_event;

/* imm_mode of a batch: no immediate data, on its last write only, on every write. */
#define PDF_IMM_NONE 0
#define PDF_IMM_LAST 1
#define PDF_IMM_EVERY 2

/* The 32-bit immediate data: the caller's tag in the high 24 bits, a unit count (the entries a
 * write coalesced) in the low 8 (pdf_core.c checks these against PDF_IMM_UNIT_BITS). */
#define PDF_IMM_UNIT_BITS 8
#define PDF_IMM_UNIT_MAX 255u
#define PDF_IMM_TAG_MAX 16777215u

/* pdf_check_writes: what is wrong with the entry it names. */
#define PDF_BAD_SHORT 1 /* length 0 */
#define PDF_BAD_LONG 2  /* length above max_len */
#define PDF_BAD_SRC 3   /* outside the source region */
#define PDF_BAD_DST 4   /* outside the destination region */

#define PDF_ADDR_MAX 256 /* the longest endpoint name */

/* What pdf_get_info reports of an open engine. */
typedef struct pdf_info {
    char provider[64];
    char fabric[128];
    char domain[128];
    uint64_t mr_mode;
    uint64_t tx_size;
    uint64_t rx_size;
    uint64_t tx_credits;
    uint64_t max_msg_size;
    uint64_t inject_size;
    uint64_t cq_data_size;
    uint32_t wait_mode; /* PDF_WAIT_* (pdf_wait.h) */
    uint32_t delivery_complete;
    uint32_t source_addr; /* FI_SOURCE: PDF_EV_RECV names the sender (aux) */
    uint32_t addrlen;
    uint64_t tx_msg_order; /* FI_ORDER_* the provider granted (fi_info tx_attr / rx_attr) */
    uint64_t rx_msg_order;
    uint8_t addr[PDF_ADDR_MAX];
} pdf_info;

/* pdf_write_sync's outcome (pdf_sync_result.status). */
#define PDF_SYNC_PENDING 0
#define PDF_SYNC_DONE 1
#define PDF_SYNC_FAILED 2
#define PDF_SYNC_TIMEOUT 3

typedef struct pdf_sync_result {
    int64_t writes;   /* writes the batch became (after coalescing and splitting) */
    uint32_t status;  /* PDF_SYNC_DONE / _FAILED / _TIMEOUT */
    int32_t code;     /* FAILED: the error */
    uint64_t missing; /* FAILED: writes not completed */
    uint64_t spin_ns; /* time the caller spent running progress rounds */
    uint32_t rounds;  /* progress rounds it ran */
    uint32_t slept;   /* 1 if it had to sleep (the spin budget ran out) */
} pdf_sync_result;

/* fi_strerror of either sign of a libfabric error code. */
const char *pdf_strerror(int code);

/* Open an engine on provider `prov` (bound to `node` if not NULL) in the libfabric domain named
 * `domain` (if not NULL: asked of fi_getinfo as hints->domain_attr->name, and the first returned
 * entry of that name taken, since some providers, e.g. tcp in libfabric 1.17, ignore the hint;
 * NULL: the provider's first entry, as before): fabric, domain, AV, CQ, endpoint, the control
 * message pools (nrecv slots of msg_size bytes) and, for shm, the watchdog.  tx_cap: most writes
 * posted at once (0: the provider's tx size).  The waits and timeouts are FabricConfig's
 * (fabric/config.py).  bell_name: this engine's doorbell (shm).  Returns 0 with *out set, or a
 * negative error with `err` naming the step that failed (no such domain: -FI_ENODATA, `err`
 * naming it and the domains the provider has). */
int pdf_open(const char *prov, const char *node, const char *domain, uint32_t tx_cap, uint32_t nrecv,
             uint32_t msg_size, uint32_t spin_us, uint32_t busy_spin_us, uint32_t sleep_max_us,
             uint32_t peer_timeout_ms, int delivery_complete, int busy_poll, const char *bell_name,
             pdf_engine **out, char *err, size_t errlen);
int pdf_get_info(pdf_engine *e, pdf_info *out);

/* Register [addr, addr + len) for local and remote access. */
int pdf_mr_reg(pdf_engine *e, uint64_t addr, uint64_t len, uint64_t *key_out,
               uint64_t *desc_out, uint64_t *mr_out);
int pdf_mr_close(pdf_engine *e, uint64_t mr);

/* Insert a peer's endpoint name (addrlen bytes) into the AV (its fi_addr is the peer's id here),
 * or remove it.  -FI_EINVAL for a name too short or long for the provider's format. */
int pdf_av_insert(pdf_engine *e, const uint8_t *addr, uint32_t addrlen, uint64_t *fi_addr_out);
int pdf_av_remove(pdf_engine *e, uint64_t fi_addr);

/* Queue a batch of n writes (src/dst offsets and lengths) to `peer`; the progress thread posts
 * it.  Returns the writes it became (>= 1), or a negative error before anything was queued. */
int64_t pdf_submit_writes(pdf_engine *e, uint64_t id, uint64_t peer, uint64_t local_base,
                          uint64_t desc, uint64_t remote_base, uint64_t rkey,
                          const uint64_t *src, const uint64_t *dst, const uint64_t *len,
                          uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write,
                          int coalesce);
/* Post a batch and wait for it on the calling thread: progress rounds for up to spin_us, then
 * a sleep until its outcome or timeout_us (< 0: no limit; then the batch is detached and
 * reports through ordinary events).  Returns 0 with *res filled, or a negative error before
 * anything was queued. */
int pdf_write_sync(pdf_engine *e, uint64_t id, uint64_t peer, uint64_t local_base, uint64_t desc,
                   uint64_t remote_base, uint64_t rkey, const uint64_t *src, const uint64_t *dst,
                   const uint64_t *len, uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write,
                   int coalesce, uint32_t spin_us, int64_t timeout_us, pdf_sync_result *res);
/* Validate a batch before anything is queued: every length >= 1 (and at most max_len when
 * max_len != 0), every [offset, offset + length) inside its region, without overflow.  Returns
 * -1 if all is well, else the index of the first bad entry with *what = PDF_BAD_*; *total gets
 * the bytes. */
int64_t pdf_check_writes(const uint64_t *src, const uint64_t *dst, const uint64_t *len, uint32_t n,
                         uint64_t src_size, uint64_t dst_size, uint64_t max_len, int *what, uint64_t *total);

/* Queue a control message of len <= msg_size bytes to `peer`. */
int pdf_submit_send(pdf_engine *e, uint64_t id, uint64_t peer, const uint8_t *data, uint32_t len);
/* The bytes of a PDF_EV_RECV slot; pdf_recv_release hands the slot back for reposting. */
const uint8_t *pdf_recv_buf(pdf_engine *e, uint32_t slot);
void pdf_recv_release(pdf_engine *e, uint32_t slot);

/* Declare a peer failed: every queued or outstanding batch and send to it is reported failed
 * with `code` (events into ev, at most cap), and nothing more is posted to it until it is
 * inserted again. */
int pdf_fail_peer(pdf_engine *e, uint64_t peer, int code, pdf_event *ev, int cap);
/* Fail everything still queued or in flight with `code` (at close, after pdf_stop). */
int pdf_fail_all(pdf_engine *e, int code, pdf_event *ev, int cap);
/* Batches and sends not yet reported, plus operations the provider still holds. */
uint64_t pdf_outstanding(pdf_engine *e);
/* Make pdf_progress return for good (soon), and refuse new sends. */
void pdf_stop(pdf_engine *e);
/* Make pdf_progress return after one more full round. */
void pdf_poke(pdf_engine *e);
/* Peer `peer` runs on this host as process `pid`: watch for its exit (pidfd) and, in BELL
 * mode, map its doorbell `bell_name`.  Returns 0, or a negative error if neither worked. */
int pdf_peer_local(pdf_engine *e, uint64_t peer, int pid, const char *bell_name);
/* How many region locks of dead shm peers the watchdog released (pdf_shm.h). */
uint64_t pdf_locks_released(pdf_engine *e);
/* The progress engine (the progress thread only): run until events are ready, pdf_stop or
 * pdf_poke, or timeout_us passes; returns the number of events written to ev (cap >= 256). */
int pdf_progress(pdf_engine *e, pdf_event *ev, int cap, int64_t timeout_us);
/* Close the endpoint only (then the caller closes its own MRs), and everything at last. */
void pdf_close_ep(pdf_engine *e);
void pdf_close(pdf_engine *e);
/* cffi:end */

#endif
