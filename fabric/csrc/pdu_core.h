/* pdu_core: fabric's UCX core (UCP one-sided puts, active messages, progress), bound by cffi as
 * fabric._ucx (fabric/_ucx_build.py). The region between the cffi markers is the cdef.
 *
 * One pdu_ctx = one ucp_context + one worker. Every UCP call happens under the context's mutex
 * (worker thread mode SERIALIZED), from the progress thread (pdu_progress) or a caller thread
 * (pdu_submit, pdu_send, ...). Completions, arrivals and failures become pdu_event values that
 * pdu_progress hands back to Python: nothing is called back into Python from C.
 *
 * A batch (pdu_submit) is a run of ucp_put_nbx (entries contiguous at both ends merged, up to
 * max_write bytes each), then ucp_ep_flush_nbx on the peer's endpoint; once the flush completed
 * (the puts are in the target's memory), an active message PDU_AM_IMM with header
 * {tag, units} when the batch carries a tag. The batch is done when the flush (and that
 * message) completed: PDU_EV_BATCH_DONE means the data is in the target's memory.
 */
#ifndef PDU_CORE_H
#define PDU_CORE_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
#define PDU_EV_BATCH_DONE 1
#define PDU_EV_BATCH_FAILED 2
#define PDU_EV_IMM 3
#define PDU_EV_MSG 4
#define PDU_EV_PEER_FAILED 5
#define PDU_EV_SEND_FAILED 6

#define PDU_ERR_NO_PEER -1000
#define PDU_ERR_PEER_FAILED -1001
#define PDU_ERR_TOO_MANY -1002
#define PDU_ERR_NO_REGION -1003
#define PDU_ERR_NOMEM -1004

typedef struct {
    int kind;          /* PDU_EV_* */
    int code;          /* failures: the ucs_status_t (negative) */
    uint64_t id;       /* BATCH_*: batch id; IMM: tag; PEER_FAILED / SEND_FAILED: peer index */
    uint64_t count;    /* IMM: units; MSG: payload bytes; BATCH_FAILED: entries of the batch */
    uint64_t aux;      /* BATCH_FAILED: peer index */
    void *data;        /* MSG: the payload (malloc'd: pdu_free_data) */
} pdu_event;

typedef struct pdu_ctx pdu_ctx;

/* net_devices: UCX_NET_DEVICES for this context ("" or NULL: UCX's own choice / environment).
 * peer_timeout_us: a peer with outstanding batches and no completion for this long fails
 * (0: never). window_bytes: bytes of posted, unfinished batches per peer; later batches wait in
 * a queue (their entries copied) until earlier ones finish (a flush covers everything posted
 * before it: without a window the first batch would wait for all the others). errbuf receives
 * the reason when it returns < 0. */
int pdu_open(const char *net_devices, uint64_t peer_timeout_us, uint64_t window_bytes, pdu_ctx **out, char *errbuf,
             size_t errlen);
int pdu_address(pdu_ctx *h, uint8_t *buf, size_t cap, size_t *len);
const char *pdu_transports(pdu_ctx *h);
/* Map [addr, addr+len) and pack its remote key into rkey (cap bytes); returns the region index. */
int pdu_mem_map(pdu_ctx *h, uint64_t addr, uint64_t len, uint8_t *rkey, size_t cap, size_t *rkey_len);
int pdu_mem_unmap(pdu_ctx *h, int region);
/* An endpoint to the worker address; returns the peer index (>= 0) or a negative status.
 * peer_errors: UCP_ERR_HANDLING_MODE_PEER (transport errors fail the peer at once, force close);
 * 0: MODE_NONE, which UCX 1.22 needs to put through shared memory (cma, posix: with PEER it
 * picks software-emulated puts over tcp even on one host); such a peer's death is found by the
 * peer timeout (check_peers) and, in Python, its pid. */
int pdu_connect(pdu_ctx *h, const uint8_t *addr, size_t len, int peer_errors);
/* Fail the peer's outstanding batches (events) and close its endpoint. */
int pdu_peer_fail(pdu_ctx *h, int peer, int status);
int pdu_peer_failed(pdu_ctx *h, int peer);
/* Unpack a packed remote key on the peer's endpoint; returns the key index. */
int pdu_rkey_unpack(pdu_ctx *h, int peer, const uint8_t *buf, size_t len);
/* Queue one batch (posted at once when the peer's window has room); returns the number of puts
 * it becomes (>= 1) or a negative status (nothing queued, no event). */
int64_t pdu_submit(pdu_ctx *h, uint64_t batch_id, int peer, int region, uint64_t src_base, int rkey,
                   uint64_t dst_base, const uint64_t *src, const uint64_t *dst, const uint64_t *lens, size_t n,
                   int has_imm, uint32_t tag, uint32_t units, uint64_t max_write, int coalesce);
/* A control message (best effort, eager active message PDU_AM_CTRL). */
int pdu_send(pdu_ctx *h, int peer, const uint8_t *data, size_t len);
/* Progress the worker; when nothing happened for spin_us (busy_spin_us while batches or messages
 * are outstanding), arm it and sleep on its event fd for at most timeout_us (sleep_busy_us while
 * outstanding). Returns events written. */
int pdu_progress(pdu_ctx *h, pdu_event *evs, int max, uint64_t spin_us, uint64_t busy_spin_us, uint64_t timeout_us,
                 uint64_t sleep_busy_us);
void pdu_signal(pdu_ctx *h);
/* Batches not finished (and with_sends: control messages in flight). */
int pdu_outstanding(pdu_ctx *h, int with_sends);
void pdu_free_data(void *p);
/* Close every endpoint (force), destroy keys, unmap regions, destroy the worker and context. */
void pdu_close(pdu_ctx *h);
const char *pdu_strerror(int status);
/* cffi:end */

#endif
