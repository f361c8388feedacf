/* pdu_core.c: see pdu_core.h for what it does and its thread rules. */
#include "pdu_core.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

#define PDU_AM_IMM 0x5044
#define PDU_AM_CTRL 0x5045
#define PDU_MAX_PEERS 4096
#define PDU_MAX_REGIONS 65536
#define PDU_MAX_RKEYS 65536
#define PDU_PROGRESS_ROUNDS 64   /* ucp_worker_progress calls per pdu_progress before returning */
#define PDU_TIMEOUT_CHECK_NS 50000000ull
#define PDU_CLOSE_WAIT_NS 1000000000ull   /* pdu_close: longest wait for endpoint closes */

typedef struct pdu_batch {
    struct pdu_batch *prev, *next;
    pdu_ctx *h;
    uint64_t id;
    int peer;
    int has_imm;
    int written_off;       /* its failure was already reported (peer failed) */
    uint64_t entries;
    uint32_t header[2];    /* PDU_AM_IMM header: tag, units; lives until the message completed */
    /* what pump() posts once the peer's window has room (pdu_submit copied the entries) */
    struct pdu_batch *queued_next;
    int posted;
    int region, rkey, coalesce;
    uint64_t src_base, dst_base, max_write, bytes;
    uint64_t *ent;         /* [3 * entries]: src offsets, dst offsets, lengths */
} pdu_batch;

typedef struct {
    ucp_ep_h ep;
    int failed;
    int closing;           /* a close request is in flight */
    void *close_req;
    int peer_errors;       /* UCP_ERR_HANDLING_MODE_PEER (else NONE: see pdu_connect) */
    uint64_t outstanding;  /* live batches */
    uint64_t last_ns;      /* last completion, or the submit that made outstanding non-zero */
    uint64_t inflight;     /* bytes of posted batches not finished */
    pdu_batch *queue, *queue_tail;   /* submitted, not posted yet (FIFO) */
    int pumping;
    pdu_ctx *h;
    int index;
} pdu_peer;

typedef struct {
    ucp_rkey_h rkey;
    int peer;
} pdu_rkey;

struct pdu_ctx {
    pthread_mutex_t lock;
    ucp_context_h context;
    ucp_worker_h worker;
    int efd;
    uint64_t peer_timeout_ns;
    uint64_t window;       /* bytes of posted, unfinished batches per peer before the next waits */
    uint64_t last_check_ns;
    uint64_t last_activity_ns;
    pdu_peer *peers[PDU_MAX_PEERS];
    int npeers;
    ucp_mem_h *regions;
    int nregions;
    pdu_rkey *rkeys;
    int nrkeys;
    pdu_batch batches;     /* list head of live and written-off batches */
    int sends;             /* control messages in flight */
    pdu_event *q;          /* event queue (ring) */
    size_t qcap, qhead, qlen;
    char transports[256];
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

const char *pdu_strerror(int status) {
    switch (status) {
    case PDU_ERR_NO_PEER: return "no such peer";
    case PDU_ERR_PEER_FAILED: return "peer failed";
    case PDU_ERR_TOO_MANY: return "table full";
    case PDU_ERR_NO_REGION: return "no such region or key";
    case PDU_ERR_NOMEM: return "out of memory";
    default: return ucs_status_string((ucs_status_t)status);
    }
}

/* Queue an event; on allocation failure the event is lost and logged (never blocks). */
static void push(pdu_ctx *h, int kind, int code, uint64_t id, uint64_t count, uint64_t aux, void *data) {
    if (h->qlen == h->qcap) {
        size_t cap = h->qcap ? h->qcap * 2 : 256;
        pdu_event *q = malloc(cap * sizeof(*q));
        if (!q) {
            fprintf(stderr, "pdu_core: event queue full, event %d id %llu lost\n", kind, (unsigned long long)id);
            free(data);
            return;
        }
        for (size_t i = 0; i < h->qlen; i++)
            q[i] = h->q[(h->qhead + i) % h->qcap];
        free(h->q);
        h->q = q;
        h->qcap = cap;
        h->qhead = 0;
    }
    pdu_event *e = &h->q[(h->qhead + h->qlen) % h->qcap];
    e->kind = kind;
    e->code = code;
    e->id = id;
    e->count = count;
    e->aux = aux;
    e->data = data;
    h->qlen++;
}

static void batch_unlink(pdu_batch *b) {
    b->prev->next = b->next;
    b->next->prev = b->prev;
}

static void batch_free(pdu_batch *b) {
    free(b->ent);
    free(b);
}

static void pump(pdu_peer *p);

/* The batch's last request completed (status) or it could not be posted further. */
static void batch_finish(pdu_batch *b, ucs_status_t status) {
    pdu_ctx *h = b->h;
    pdu_peer *p = h->peers[b->peer];
    batch_unlink(b);
    if (b->posted)
        p->inflight -= b->bytes;
    if (!b->written_off) {
        p->outstanding--;
        p->last_ns = now_ns();
        if (status == UCS_OK)
            push(h, PDU_EV_BATCH_DONE, 0, b->id, 0, 0, NULL);
        else
            push(h, PDU_EV_BATCH_FAILED, status, b->id, b->entries, (uint64_t)b->peer, NULL);
    }
    batch_free(b);
    pump(p);
}

static void am_done(void *req, ucs_status_t status, void *user) {
    batch_finish((pdu_batch *)user, status);
    ucp_request_free(req);
}

static void send_imm(pdu_batch *b) {
    pdu_peer *p = b->h->peers[b->peer];
    if (p->failed || !p->ep) {
        batch_finish(b, UCS_ERR_CONNECTION_RESET);
        return;
    }
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = am_done;
    rp.user_data = b;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t s = ucp_am_send_nbx(p->ep, PDU_AM_IMM, b->header, sizeof(b->header), NULL, 0, &rp);
    if (s == NULL)
        batch_finish(b, UCS_OK);
    else if (UCS_PTR_IS_ERR(s))
        batch_finish(b, UCS_PTR_STATUS(s));
}

static void flush_done(void *req, ucs_status_t status, void *user) {
    pdu_batch *b = user;
    if (req)
        ucp_request_free(req);
    if (status != UCS_OK || !b->has_imm || b->written_off)
        batch_finish(b, status);
    else
        send_imm(b);
}

static void start_close(pdu_peer *p) {
    if (!p->ep || p->closing)
        return;
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = p->peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;   /* UCX allows FORCE only in PEER mode */
    ucs_status_ptr_t s = ucp_ep_close_nbx(p->ep, &rp);
    p->closing = 1;
    if (UCS_PTR_IS_PTR(s))
        p->close_req = s;
    else
        p->ep = NULL;
}

/* Report every live batch of the peer failed now; later completions of their requests are
 * swallowed (written_off). Marks the peer failed. Under the lock. */
static void peer_fail(pdu_ctx *h, pdu_peer *p, int status) {
    if (p->failed)
        return;
    p->failed = 1;
    while (p->queue) {   /* never posted: reported and freed now */
        pdu_batch *b = p->queue;
        p->queue = b->queued_next;
        batch_unlink(b);
        push(h, PDU_EV_BATCH_FAILED, status, b->id, b->entries, (uint64_t)p->index, NULL);
        batch_free(b);
    }
    p->queue_tail = NULL;
    for (pdu_batch *b = h->batches.next; b != &h->batches; b = b->next) {
        if (b->peer == p->index && !b->written_off) {
            b->written_off = 1;
            push(h, PDU_EV_BATCH_FAILED, status, b->id, b->entries, (uint64_t)p->index, NULL);
        }
    }
    p->outstanding = 0;
    push(h, PDU_EV_PEER_FAILED, status, (uint64_t)p->index, 0, 0, NULL);
}

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    pdu_peer *p = arg;
    peer_fail(p->h, p, status);
    p->h->last_check_ns = 0;   /* close it in this progress round (pdu_progress, outside UCX's callback) */
}

static ucs_status_t am_imm(void *arg, const void *header, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param) {
    (void)data; (void)len; (void)param;
    pdu_ctx *h = arg;
    uint32_t hdr[2];
    if (hlen != sizeof(hdr)) {
        fprintf(stderr, "pdu_core: immediate-data message with a %zu-byte header dropped\n", hlen);
        return UCS_OK;
    }
    memcpy(hdr, header, sizeof(hdr));
    push(h, PDU_EV_IMM, 0, hdr[0], hdr[1], 0, NULL);
    return UCS_OK;
}

static ucs_status_t am_ctrl(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    (void)header; (void)hlen;
    pdu_ctx *h = arg;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        fprintf(stderr, "pdu_core: control message of %zu bytes arrived by rendezvous; dropped\n", len);
        return UCS_OK;
    }
    void *copy = malloc(len ? len : 1);
    if (!copy) {
        fprintf(stderr, "pdu_core: no memory for a %zu-byte control message; dropped\n", len);
        return UCS_OK;
    }
    memcpy(copy, data, len);
    push(h, PDU_EV_MSG, 0, 0, len, 0, copy);
    return UCS_OK;
}

static int set_handler(pdu_ctx *h, unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp;
    memset(&hp, 0, sizeof(hp));
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.cb = cb;
    hp.arg = h;
    return ucp_worker_set_am_recv_handler(h->worker, &hp);
}

static void describe_transports(pdu_ctx *h) {
    const char *tls = getenv("UCX_TLS");
    snprintf(h->transports, sizeof(h->transports), "UCX %s, UCX_TLS=%s", ucp_get_version_string(),
             tls && *tls ? tls : "(all)");
}

int pdu_open(const char *net_devices, uint64_t peer_timeout_us, uint64_t window_bytes, pdu_ctx **out, char *errbuf,
             size_t errlen) {
    pdu_ctx *h = calloc(1, sizeof(*h));
    ucp_config_t *cfg = NULL;
    ucs_status_t st;
    if (!h)
        return PDU_ERR_NOMEM;
    pthread_mutex_init(&h->lock, NULL);
    h->batches.next = h->batches.prev = &h->batches;
    h->peer_timeout_ns = peer_timeout_us * 1000ull;
    h->window = window_bytes;
    h->efd = -1;
    st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        snprintf(errbuf, errlen, "ucp_config_read: %s", ucs_status_string(st));
        goto fail;
    }
    if (net_devices && *net_devices && (st = ucp_config_modify(cfg, "NET_DEVICES", net_devices)) != UCS_OK) {
        snprintf(errbuf, errlen, "UCX_NET_DEVICES=%s: %s", net_devices, ucs_status_string(st));
        goto fail;
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    st = ucp_init(&params, cfg, &h->context);
    ucp_config_release(cfg);
    cfg = NULL;
    if (st != UCS_OK) {
        snprintf(errbuf, errlen, "ucp_init: %s", ucs_status_string(st));
        goto fail;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    if ((st = ucp_worker_create(h->context, &wp, &h->worker)) != UCS_OK) {
        snprintf(errbuf, errlen, "ucp_worker_create: %s", ucs_status_string(st));
        goto fail;
    }
    if ((st = ucp_worker_get_efd(h->worker, &h->efd)) != UCS_OK ||
        (st = set_handler(h, PDU_AM_IMM, am_imm)) != UCS_OK || (st = set_handler(h, PDU_AM_CTRL, am_ctrl)) != UCS_OK) {
        snprintf(errbuf, errlen, "worker setup: %s", ucs_status_string(st));
        goto fail;
    }
    h->regions = calloc(PDU_MAX_REGIONS, sizeof(*h->regions));
    h->rkeys = calloc(PDU_MAX_RKEYS, sizeof(*h->rkeys));
    if (!h->regions || !h->rkeys) {
        snprintf(errbuf, errlen, "out of memory");
        st = UCS_ERR_NO_MEMORY;
        goto fail;
    }
    describe_transports(h);
    *out = h;
    return 0;
fail:
    if (cfg)
        ucp_config_release(cfg);
    if (h->worker)
        ucp_worker_destroy(h->worker);
    if (h->context)
        ucp_cleanup(h->context);
    free(h->regions);
    free(h->rkeys);
    free(h);
    return st < 0 ? st : -1;
}

const char *pdu_transports(pdu_ctx *h) { return h->transports; }

int pdu_address(pdu_ctx *h, uint8_t *buf, size_t cap, size_t *len) {
    ucp_address_t *addr;
    size_t n;
    pthread_mutex_lock(&h->lock);
    ucs_status_t st = ucp_worker_get_address(h->worker, &addr, &n);
    if (st == UCS_OK) {
        *len = n;
        if (n <= cap)
            memcpy(buf, addr, n);
        else
            st = UCS_ERR_BUFFER_TOO_SMALL;
        ucp_worker_release_address(h->worker, addr);
    }
    pthread_mutex_unlock(&h->lock);
    return st;
}

int pdu_mem_map(pdu_ctx *h, uint64_t addr, uint64_t len, uint8_t *rkey, size_t cap, size_t *rkey_len) {
    int rc = PDU_ERR_TOO_MANY;
    pthread_mutex_lock(&h->lock);
    int idx = -1;
    for (int i = 0; i < PDU_MAX_REGIONS; i++)
        if (!h->regions[i]) { idx = i; break; }
    if (idx >= 0) {
        ucp_mem_map_params_t mp;
        memset(&mp, 0, sizeof(mp));
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = (void *)(uintptr_t)addr;
        mp.length = len;
        ucp_mem_h memh;
        ucs_status_t st = ucp_mem_map(h->context, &mp, &memh);
        rc = st;
        if (st == UCS_OK) {
            void *packed;
            size_t n;
            st = ucp_rkey_pack(h->context, memh, &packed, &n);
            if (st == UCS_OK && n > cap)
                st = UCS_ERR_BUFFER_TOO_SMALL;
            if (st == UCS_OK) {
                memcpy(rkey, packed, n);
                *rkey_len = n;
            }
            if (packed && st != UCS_ERR_BUFFER_TOO_SMALL)
                ucp_rkey_buffer_release(packed);
            if (st != UCS_OK) {
                ucp_mem_unmap(h->context, memh);
                rc = st;
            } else {
                h->regions[idx] = memh;
                rc = idx;
            }
        }
    }
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int pdu_mem_unmap(pdu_ctx *h, int region) {
    int rc = PDU_ERR_NO_REGION;
    pthread_mutex_lock(&h->lock);
    if (region >= 0 && region < PDU_MAX_REGIONS && h->regions[region]) {
        rc = ucp_mem_unmap(h->context, h->regions[region]);
        h->regions[region] = NULL;
    }
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int pdu_connect(pdu_ctx *h, const uint8_t *addr, size_t len, int peer_errors) {
    (void)len;
    int rc;
    pthread_mutex_lock(&h->lock);
    if (h->npeers >= PDU_MAX_PEERS) {
        rc = PDU_ERR_TOO_MANY;
        goto out;
    }
    pdu_peer *p = calloc(1, sizeof(*p));
    if (!p) {
        rc = PDU_ERR_NOMEM;
        goto out;
    }
    p->h = h;
    p->index = h->npeers;
    p->peer_errors = peer_errors;
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = (const ucp_address_t *)addr;
    ep.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = ep_error;
    ep.err_handler.arg = p;
    ucs_status_t st = ucp_ep_create(h->worker, &ep, &p->ep);
    if (st != UCS_OK) {
        free(p);
        rc = st;
        goto out;
    }
    h->peers[h->npeers++] = p;
    rc = p->index;
out:
    pthread_mutex_unlock(&h->lock);
    return rc;
}

static pdu_peer *peer_at(pdu_ctx *h, int peer) {
    return peer >= 0 && peer < h->npeers ? h->peers[peer] : NULL;
}

int pdu_peer_fail(pdu_ctx *h, int peer, int status) {
    pthread_mutex_lock(&h->lock);
    pdu_peer *p = peer_at(h, peer);
    if (p) {
        peer_fail(h, p, status);
        start_close(p);
    }
    pthread_mutex_unlock(&h->lock);
    ucp_worker_signal(h->worker);
    return p ? 0 : PDU_ERR_NO_PEER;
}

int pdu_peer_failed(pdu_ctx *h, int peer) {
    pthread_mutex_lock(&h->lock);
    pdu_peer *p = peer_at(h, peer);
    int rc = p ? p->failed : PDU_ERR_NO_PEER;
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int pdu_rkey_unpack(pdu_ctx *h, int peer, const uint8_t *buf, size_t len) {
    (void)len;
    int rc = PDU_ERR_TOO_MANY;
    pthread_mutex_lock(&h->lock);
    pdu_peer *p = peer_at(h, peer);
    if (!p || !p->ep || p->failed) {
        rc = p ? PDU_ERR_PEER_FAILED : PDU_ERR_NO_PEER;
    } else if (h->nrkeys < PDU_MAX_RKEYS) {
        ucp_rkey_h rkey;
        ucs_status_t st = ucp_ep_rkey_unpack(p->ep, buf, &rkey);
        if (st == UCS_OK) {
            h->rkeys[h->nrkeys].rkey = rkey;
            h->rkeys[h->nrkeys].peer = peer;
            rc = h->nrkeys++;
        } else {
            rc = st;
        }
    }
    pthread_mutex_unlock(&h->lock);
    return rc;
}

/* Post the puts of one batch, merging entries contiguous at both ends. Under the lock. */
static ucs_status_t post_puts(pdu_peer *p, ucp_mem_h memh, uint64_t src_base, ucp_rkey_h rkey, uint64_t dst_base,
                              const uint64_t *src, const uint64_t *dst, const uint64_t *lens, size_t n,
                              uint64_t max_write, int coalesce, int64_t *puts) {
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    rp.memh = memh;
    size_t i = 0;
    while (i < n) {
        uint64_t s = src[i], d = dst[i], len = lens[i];
        size_t j = i + 1;
        while (coalesce && j < n && src[j] == s + len && dst[j] == d + len && (!max_write || len + lens[j] <= max_write)) {
            len += lens[j];
            j++;
        }
        /* a run longer than max_write (one entry) goes as several puts */
        for (uint64_t off = 0; off < len;) {
            uint64_t chunk = max_write && len - off > max_write ? max_write : len - off;
            ucs_status_ptr_t sp = ucp_put_nbx(p->ep, (void *)(uintptr_t)(src_base + s + off), chunk,
                                              dst_base + d + off, rkey, &rp);
            if (UCS_PTR_IS_ERR(sp))
                return UCS_PTR_STATUS(sp);
            if (sp != NULL)
                ucp_request_free(sp);   /* completes on its own; the flush covers it */
            (*puts)++;
            off += chunk;
        }
        i = j;
    }
    return UCS_OK;
}

/* Post a batch's puts and its flush (its window bytes count from now). Under the lock. */
static void post_batch(pdu_peer *p, pdu_batch *b) {
    pdu_ctx *h = p->h;
    int64_t puts = 0;
    size_t n = b->entries;
    b->posted = 1;
    p->inflight += b->bytes;
    ucs_status_t st = post_puts(p, h->regions[b->region], b->src_base, h->rkeys[b->rkey].rkey, b->dst_base, b->ent,
                                b->ent + n, b->ent + 2 * n, n, b->max_write, b->coalesce, &puts);
    if (st != UCS_OK && puts == 0) {
        batch_finish(b, st);
        return;
    }
    if (st != UCS_OK) {   /* part posted: the flush waits for it, the batch fails now */
        b->has_imm = 0;
        b->written_off = 1;
        p->outstanding--;
        push(h, PDU_EV_BATCH_FAILED, st, b->id, b->entries, (uint64_t)p->index, NULL);
    }
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = flush_done;
    rp.user_data = b;
    ucs_status_ptr_t fs = ucp_ep_flush_nbx(p->ep, &rp);
    if (fs == NULL)
        flush_done(NULL, UCS_OK, b);
    else if (UCS_PTR_IS_ERR(fs))
        flush_done(NULL, UCS_PTR_STATUS(fs), b);
}

/* Post queued batches while the peer's window has room (always one when nothing is in flight):
 * a flush covers everything posted on the endpoint before it, so the window bounds how long a
 * batch waits behind the others. Not re-entered from the completions it causes. */
static void pump(pdu_peer *p) {
    if (p->pumping)
        return;
    p->pumping = 1;
    while (p->queue && !p->failed && p->ep && (p->inflight == 0 || p->inflight + p->queue->bytes <= p->h->window)) {
        pdu_batch *b = p->queue;
        p->queue = b->queued_next;
        if (!p->queue)
            p->queue_tail = NULL;
        post_batch(p, b);
    }
    p->pumping = 0;
}

/* How many puts post_puts makes of these entries. */
static int64_t count_puts(const uint64_t *src, const uint64_t *dst, const uint64_t *lens, size_t n,
                          uint64_t max_write, int coalesce) {
    int64_t puts = 0;
    size_t i = 0;
    while (i < n) {
        uint64_t len = lens[i];
        size_t j = i + 1;
        while (coalesce && j < n && src[j] == src[j - 1] + lens[j - 1] && dst[j] == dst[j - 1] + lens[j - 1] &&
               (!max_write || len + lens[j] <= max_write)) {
            len += lens[j];
            j++;
        }
        puts += max_write ? (int64_t)((len + max_write - 1) / max_write) : 1;
        i = j;
    }
    return puts;
}

int64_t pdu_submit(pdu_ctx *h, uint64_t batch_id, int peer, int region, uint64_t src_base, int rkey,
                   uint64_t dst_base, const uint64_t *src, const uint64_t *dst, const uint64_t *lens, size_t n,
                   int has_imm, uint32_t tag, uint32_t units, uint64_t max_write, int coalesce) {
    pthread_mutex_lock(&h->lock);
    pdu_peer *p = peer_at(h, peer);
    int64_t rc = 0;
    if (!p) {
        rc = PDU_ERR_NO_PEER;
    } else if (p->failed || !p->ep) {
        rc = PDU_ERR_PEER_FAILED;
    } else if (region < 0 || region >= PDU_MAX_REGIONS || !h->regions[region] || rkey < 0 || rkey >= h->nrkeys ||
               h->rkeys[rkey].peer != peer) {
        rc = PDU_ERR_NO_REGION;
    }
    pdu_batch *b = rc ? NULL : calloc(1, sizeof(*b));
    uint64_t *ent = b ? malloc(3 * n * sizeof(uint64_t)) : NULL;
    if (!rc && (!b || !ent)) {
        free(b);
        rc = PDU_ERR_NOMEM;
    }
    if (rc) {
        pthread_mutex_unlock(&h->lock);
        return rc;
    }
    memcpy(ent, src, n * sizeof(uint64_t));
    memcpy(ent + n, dst, n * sizeof(uint64_t));
    memcpy(ent + 2 * n, lens, n * sizeof(uint64_t));
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; i++)
        bytes += lens[i];
    *b = (pdu_batch){.h = h, .id = batch_id, .peer = peer, .has_imm = has_imm, .entries = n, .header = {tag, units},
                     .region = region, .rkey = rkey, .coalesce = coalesce, .src_base = src_base,
                     .dst_base = dst_base, .max_write = max_write, .bytes = bytes, .ent = ent};
    b->next = &h->batches;
    b->prev = h->batches.prev;
    h->batches.prev->next = b;
    h->batches.prev = b;
    if (p->outstanding++ == 0)
        p->last_ns = now_ns();
    if (p->queue_tail)
        p->queue_tail->queued_next = b;
    else
        p->queue = b;
    p->queue_tail = b;
    pump(p);
    h->last_activity_ns = now_ns();
    pthread_mutex_unlock(&h->lock);
    ucp_worker_signal(h->worker);
    return count_puts(src, dst, lens, n, max_write, coalesce);
}

static void send_done(void *req, ucs_status_t status, void *user) {
    void **slot = user;
    pdu_ctx *h = slot[0];
    if (status != UCS_OK)
        push(h, PDU_EV_SEND_FAILED, status, (uint64_t)(uintptr_t)slot[1], 0, 0, NULL);
    h->sends--;
    free(slot);
    ucp_request_free(req);
}

int pdu_send(pdu_ctx *h, int peer, const uint8_t *data, size_t len) {
    int rc = 0;
    pthread_mutex_lock(&h->lock);
    pdu_peer *p = peer_at(h, peer);
    if (!p || !p->ep || p->failed) {
        rc = p ? PDU_ERR_PEER_FAILED : PDU_ERR_NO_PEER;
        goto out;
    }
    /* slot: {ctx, peer index, payload...}: the payload must live until the send completed */
    void **slot = malloc(2 * sizeof(void *) + (len ? len : 1));
    if (!slot) {
        rc = PDU_ERR_NOMEM;
        goto out;
    }
    slot[0] = h;
    slot[1] = (void *)(uintptr_t)peer;
    memcpy(slot + 2, data, len);
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = send_done;
    rp.user_data = slot;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t s = ucp_am_send_nbx(p->ep, PDU_AM_CTRL, NULL, 0, slot + 2, len, &rp);
    if (s == NULL) {
        free(slot);
    } else if (UCS_PTR_IS_ERR(s)) {
        free(slot);
        rc = UCS_PTR_STATUS(s);
    } else {
        h->sends++;
    }
out:
    pthread_mutex_unlock(&h->lock);
    ucp_worker_signal(h->worker);
    return rc;
}

/* Peers with outstanding batches and no completion for the peer timeout fail; failed peers'
 * endpoints are closed, finished close requests released. Under the lock. */
static void check_peers(pdu_ctx *h, uint64_t now) {
    for (int i = 0; i < h->npeers; i++) {
        pdu_peer *p = h->peers[i];
        if (!p->failed && p->outstanding && h->peer_timeout_ns && now - p->last_ns > h->peer_timeout_ns)
            peer_fail(h, p, UCS_ERR_TIMED_OUT);
        if (p->failed && !p->closing)
            start_close(p);
        if (p->close_req && ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
            ucp_request_free(p->close_req);
            p->close_req = NULL;
            p->ep = NULL;
        }
    }
}

static int drain(pdu_ctx *h, pdu_event *evs, int max) {
    int n = 0;
    while (n < max && h->qlen) {
        evs[n++] = h->q[h->qhead];
        h->qhead = (h->qhead + 1) % h->qcap;
        h->qlen--;
    }
    return n;
}

static int busy(pdu_ctx *h) {
    return h->batches.next != &h->batches || h->sends > 0;
}

int pdu_progress(pdu_ctx *h, pdu_event *evs, int max, uint64_t spin_us, uint64_t busy_spin_us, uint64_t timeout_us,
                 uint64_t sleep_busy_us) {
    pthread_mutex_lock(&h->lock);
    unsigned made = 0;
    for (int r = 0; r < PDU_PROGRESS_ROUNDS && h->qlen < (size_t)max; r++) {
        unsigned k = ucp_worker_progress(h->worker);
        made += k;
        if (!k)
            break;
    }
    uint64_t now = now_ns();
    if (made || h->qlen)
        h->last_activity_ns = now;
    if (now - h->last_check_ns > PDU_TIMEOUT_CHECK_NS) {
        h->last_check_ns = now;
        check_peers(h, now);
    }
    int n = drain(h, evs, max);
    uint64_t spin_ns = (busy(h) ? busy_spin_us : spin_us) * 1000ull;
    if (n || made || now - h->last_activity_ns < spin_ns) {
        pthread_mutex_unlock(&h->lock);
        return n;
    }
    ucs_status_t st = ucp_worker_arm(h->worker);
    uint64_t wait_us = busy(h) ? sleep_busy_us : timeout_us;
    pthread_mutex_unlock(&h->lock);
    if (st == UCS_OK) {
        struct pollfd pfd = {.fd = h->efd, .events = POLLIN};
        poll(&pfd, 1, (int)((wait_us + 999) / 1000));
    }
    return 0;
}

void pdu_signal(pdu_ctx *h) { ucp_worker_signal(h->worker); }

int pdu_outstanding(pdu_ctx *h, int with_sends) {
    pthread_mutex_lock(&h->lock);
    int n = with_sends ? h->sends : 0;
    for (pdu_batch *b = h->batches.next; b != &h->batches; b = b->next)
        n += !b->written_off;
    pthread_mutex_unlock(&h->lock);
    return n;
}

void pdu_free_data(void *p) { free(p); }

void pdu_close(pdu_ctx *h) {
    pthread_mutex_lock(&h->lock);
    for (int i = 0; i < h->npeers; i++) {
        pdu_peer *p = h->peers[i];
        peer_fail(h, p, UCS_ERR_CANCELED);
        start_close(p);
    }
    uint64_t deadline = now_ns() + PDU_CLOSE_WAIT_NS;
    for (;;) {
        ucp_worker_progress(h->worker);
        int open = 0;
        for (int i = 0; i < h->npeers; i++) {
            pdu_peer *p = h->peers[i];
            if (p->close_req && ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
                ucp_request_free(p->close_req);
                p->close_req = NULL;
            }
            open += p->close_req != NULL;
        }
        if (!open || now_ns() > deadline)
            break;
    }
    for (int i = 0; i < h->nrkeys; i++)
        ucp_rkey_destroy(h->rkeys[i].rkey);
    for (int i = 0; i < PDU_MAX_REGIONS; i++)
        if (h->regions[i])
            ucp_mem_unmap(h->context, h->regions[i]);
    ucp_worker_destroy(h->worker);
    ucp_cleanup(h->context);
    while (h->batches.next != &h->batches) {
        pdu_batch *b = h->batches.next;
        batch_unlink(b);
        batch_free(b);
    }
    for (int i = 0; i < h->npeers; i++)
        free(h->peers[i]);
    for (size_t i = 0; i < h->qlen; i++)
        free(h->q[(h->qhead + i) % h->qcap].data);
    free(h->q);
    free(h->regions);
    free(h->rkeys);
    pthread_mutex_unlock(&h->lock);
    pthread_mutex_destroy(&h->lock);
    free(h);
}
