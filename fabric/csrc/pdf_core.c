/*
 * pdf_core.c - the native half of pdserve's fabric transport.
 *
 * One pdf_engine owns one libfabric FI_EP_RDM endpoint, its CQ, AV and domain.
 * Every libfabric call on these objects is made while holding e->lock, so the
 * domain is opened with FI_THREAD_DOMAIN and the provider takes no locks of
 * its own.  Application threads only append to queues (pdf_submit_*); the
 * single progress thread (pdf_progress) posts queued work within the tx credit
 * budget, polls the CQ, and returns compact events to Python.  No per-write
 * Python object exists on the hot path.
 *
 * This file is compiled into the cffi extension fabric._libfabric by
 * fabric/_ffi_build.py; its public functions are declared there (PDF_CDEF).
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define PDF_EV_BATCH_DONE 1
#define PDF_EV_BATCH_FAILED 2
#define PDF_EV_IMM 3
#define PDF_EV_RECV 4
#define PDF_EV_SEND_DONE 5
#define PDF_EV_SEND_FAILED 6
#define PDF_EV_PEER_FAILED 7
#define PDF_EV_CQ_ERROR 8

#define PDF_IMM_NONE 0
#define PDF_IMM_LAST 1
#define PDF_IMM_EVERY 2

#define PDF_ADDR_MAX 256
#define PDF_CQ_BATCH 64

typedef struct pdf_event {
    uint32_t kind;
    int32_t code;
    uint64_t id;
    uint64_t count;
    uint64_t aux;
} pdf_event;

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
    uint32_t addrlen;
    uint8_t addr[PDF_ADDR_MAX];
} pdf_info;

enum { OP_WRITE = 1, OP_SEND = 2, OP_RECV = 3 };

struct pdf_batch;
struct pdf_send;

typedef struct pdf_op {
    struct fi_context2 ctx; /* must stay first: providers may use it */
    int kind;
    struct pdf_batch *batch;
    uint64_t send_id;
    uint32_t slot;
    uint64_t peer;
    int orphan; /* its credit was already returned when the peer failed */
    struct pdf_op *next_free;
} pdf_op;

typedef struct pdf_batch {
    uint64_t id;
    uint64_t peer;
    char *local_base;
    void *desc;
    uint64_t remote_base;
    uint64_t rkey;
    uint32_t imm;
    int imm_mode;
    uint32_t n;
    uint64_t *src; /* one allocation holds src, dst and len */
    uint64_t *dst;
    uint64_t *len;
    uint32_t next;      /* next write to post */
    uint32_t completed; /* writes completed successfully */
    uint32_t inflight;  /* writes posted and not yet completed */
    int failed;
    int reported;
    struct pdf_batch *link;
} pdf_batch;

typedef struct pdf_send {
    uint64_t id;
    uint64_t peer;
    uint32_t len;
    int reported;
    struct pdf_send *link;
    char data[];
} pdf_send;

typedef struct pdf_peer {
    int failed;
    uint32_t outstanding;
    uint32_t orphans;
    uint64_t last_progress_ns;
    uint64_t eagain_since; /* first FI_EAGAIN of the current refusal streak */
    uint64_t blocked_round; /* refused a post in this post_work round */
} pdf_peer;

typedef struct pdf_engine {
    pthread_mutex_t lock;
    int waiters; /* threads other than progress waiting for the lock */
    pthread_cond_t cv;
    int sleeping;
    int stop;

    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    uint64_t mr_mode;
    uint64_t next_key;

    uint64_t credits;
    uint64_t tx_credits;

    /* submitted by application threads, not yet seen by progress */
    pdf_batch *pend_head, *pend_tail;
    pdf_send *spend_head, *spend_tail;
    /* owned by the progress thread */
    pdf_batch *act_head, *act_tail;
    pdf_send *sact_head, *sact_tail;
    uint64_t active_ops;

    pdf_op *free_ops;

    /* control message pools */
    uint32_t nrecv;
    uint32_t msg_size;
    char *recv_pool;
    char *send_pool;
    struct fid_mr *recv_mr;
    struct fid_mr *send_mr;
    void *recv_desc;
    void *send_desc;
    pdf_op *recv_ops;
    pdf_op *send_ops;
    uint32_t *send_free;
    uint32_t send_free_n;
    uint32_t *repost;
    uint32_t repost_n;
    uint32_t recv_posted_fail;

    pdf_peer *peers;
    uint64_t npeers;

    uint64_t spin_ns;
    uint64_t sleep_max_ns;
    uint64_t peer_timeout_ns;
    uint64_t last_timeout_check;
    uint64_t round;
} pdf_engine;

/* Other threads take the lock through here: the progress thread, which
 * re-takes the lock in a tight loop, steps aside while someone waits (a
 * plain mutex is not fair and would starve submitters). */
static void ext_lock(pdf_engine *e)
{
    __atomic_add_fetch(&e->waiters, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&e->lock);
    __atomic_sub_fetch(&e->waiters, 1, __ATOMIC_SEQ_CST);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

const char *pdf_strerror(int code)
{
    return fi_strerror(code < 0 ? -code : code);
}

static void set_err(char *buf, size_t len, const char *what, int ret)
{
    if (buf && len)
        snprintf(buf, len, "%s", what);
    (void)ret;
}

/* ------------------------------------------------------------------ ops */

static pdf_op *op_get(pdf_engine *e)
{
    pdf_op *op = e->free_ops;
    if (op) {
        e->free_ops = op->next_free;
    } else {
        op = (pdf_op *)malloc(sizeof(*op));
        if (!op)
            return NULL;
    }
    memset(op, 0, sizeof(*op));
    return op;
}

static void op_put(pdf_engine *e, pdf_op *op)
{
    op->next_free = e->free_ops;
    e->free_ops = op;
}

static pdf_peer *peer_get(pdf_engine *e, uint64_t peer)
{
    if (peer >= e->npeers) {
        uint64_t n = e->npeers ? e->npeers : 16;
        while (n <= peer)
            n *= 2;
        pdf_peer *p = (pdf_peer *)realloc(e->peers, n * sizeof(*p));
        if (!p)
            return NULL;
        memset(p + e->npeers, 0, (n - e->npeers) * sizeof(*p));
        e->peers = p;
        e->npeers = n;
    }
    return &e->peers[peer];
}

/* --------------------------------------------------------------- events */

typedef struct evbuf {
    pdf_event *ev;
    int cap;
    int n;
} evbuf;

static void ev_push(evbuf *b, uint32_t kind, int32_t code, uint64_t id, uint64_t count, uint64_t aux)
{
    /* Callers keep a reserve so that this never overflows (see poll_cq). */
    if (b->n >= b->cap)
        return;
    pdf_event *x = &b->ev[b->n++];
    x->kind = kind;
    x->code = code;
    x->id = id;
    x->count = count;
    x->aux = aux;
}

static void ev_imm(evbuf *b, uint64_t imm)
{
    /* Aggregate: writes of one tag tend to land together. */
    int lo = b->n > 8 ? b->n - 8 : 0;
    for (int i = b->n - 1; i >= lo; i--) {
        if (b->ev[i].kind == PDF_EV_IMM && b->ev[i].id == imm) {
            b->ev[i].count++;
            return;
        }
    }
    ev_push(b, PDF_EV_IMM, 0, imm, 1, 0);
}

/* --------------------------------------------------------------- failure */

static void batch_fail(pdf_engine *e, pdf_batch *b, int code, evbuf *out)
{
    (void)e;
    b->failed = 1;
    if (!b->reported) {
        b->reported = 1;
        ev_push(out, PDF_EV_BATCH_FAILED, code, b->id, b->n - b->completed, b->n);
    }
}

static void take_pending(pdf_engine *e);

static void peer_fail(pdf_engine *e, uint64_t peer, int code, evbuf *out)
{
    pdf_peer *p = peer_get(e, peer);
    if (!p)
        return;
    take_pending(e);
    int was_failed = p->failed;
    p->failed = 1;
    for (pdf_batch *b = e->act_head; b; b = b->link)
        if (b->peer == peer && !b->reported)
            batch_fail(e, b, code, out);
    for (pdf_send *s = e->sact_head; s; s = s->link)
        if (s->peer == peer && !s->reported) {
            s->reported = 1;
            ev_push(out, PDF_EV_SEND_FAILED, code, s->id, 0, peer);
        }
    /* Operations lost inside the provider may never complete: give their
     * credits back now; a late completion must not return them twice. */
    e->credits += p->outstanding;
    p->orphans += p->outstanding;
    p->outstanding = 0;
    if (!was_failed)
        ev_push(out, PDF_EV_PEER_FAILED, code, peer, 0, 0);
}

/* -------------------------------------------------------------- queues */

static void take_pending(pdf_engine *e)
{
    if (e->pend_head) {
        if (e->act_tail)
            e->act_tail->link = e->pend_head;
        else
            e->act_head = e->pend_head;
        e->act_tail = e->pend_tail;
        e->pend_head = e->pend_tail = NULL;
    }
    if (e->spend_head) {
        if (e->sact_tail)
            e->sact_tail->link = e->spend_head;
        else
            e->sact_head = e->spend_head;
        e->sact_tail = e->spend_tail;
        e->spend_head = e->spend_tail = NULL;
    }
}

static int post_recv(pdf_engine *e, uint32_t slot)
{
    pdf_op *op = &e->recv_ops[slot];
    memset(op, 0, sizeof(*op));
    op->kind = OP_RECV;
    op->slot = slot;
    ssize_t r = fi_recv(e->ep, e->recv_pool + (size_t)slot * e->msg_size, e->msg_size, e->recv_desc,
                        FI_ADDR_UNSPEC, &op->ctx);
    return (int)r;
}

static void sweep(pdf_engine *e)
{
    pdf_batch *prev = NULL, *b = e->act_head;
    while (b) {
        pdf_batch *nx = b->link;
        if (b->reported && b->inflight == 0) {
            if (prev)
                prev->link = nx;
            else
                e->act_head = nx;
            if (e->act_tail == b)
                e->act_tail = prev;
            free(b->src);
            free(b);
        } else {
            prev = b;
        }
        b = nx;
    }
    pdf_send *sp = NULL, *s = e->sact_head;
    while (s) {
        pdf_send *nx = s->link;
        if (s->reported) {
            /* a send in flight keeps its bounce slot, not this struct */
            if (sp)
                sp->link = nx;
            else
                e->sact_head = nx;
            if (e->sact_tail == s)
                e->sact_tail = sp;
            free(s);
        } else {
            sp = s;
        }
        s = nx;
    }
}

static void note_eagain(pdf_engine *e, pdf_peer *p)
{
    if (!p)
        return;
    p->blocked_round = e->round;
    if (!p->eagain_since)
        p->eagain_since = now_ns();
}

/* Post what the credit budget allows.  Returns the number of posts, or stops
 * at the first FI_EAGAIN (back-pressure: progress must run first). */
static int post_work(pdf_engine *e, evbuf *out, int *eagain)
{
    int posted = 0;
    *eagain = 0;
    e->round++;
    while (e->repost_n) {
        uint32_t slot = e->repost[e->repost_n - 1];
        int r = post_recv(e, slot);
        if (r == -FI_EAGAIN) {
            *eagain = 1;
            return posted;
        }
        e->repost_n--;
        if (r)
            e->recv_posted_fail++;
        posted++;
    }
    for (pdf_send *s = e->sact_head; s; s = s->link) {
        if (s->reported)
            continue;
        if (e->credits == 0 || e->send_free_n == 0)
            break;
        pdf_peer *p = peer_get(e, s->peer);
        if (p && p->failed) {
            s->reported = 1;
            ev_push(out, PDF_EV_SEND_FAILED, FI_EHOSTUNREACH, s->id, 0, s->peer);
            continue;
        }
        if (p && p->blocked_round == e->round)
            continue;
        uint32_t slot = e->send_free[e->send_free_n - 1];
        pdf_op *op = &e->send_ops[slot];
        memset(op, 0, sizeof(*op));
        op->kind = OP_SEND;
        op->slot = slot;
        op->peer = s->peer;
        op->send_id = s->id;
        char *buf = e->send_pool + (size_t)slot * e->msg_size;
        memcpy(buf, s->data, s->len);
        ssize_t r = fi_send(e->ep, buf, s->len, e->send_desc, s->peer, &op->ctx);
        if (r == -FI_EAGAIN) {
            /* this peer is refusing (e.g. its connection is broken): keep
             * serving the others, and let the peer timeout judge it */
            *eagain = 1;
            note_eagain(e, p);
            continue;
        }
        if (p)
            p->eagain_since = 0;
        s->reported = 1; /* from here on the op reports the outcome */
        if (r) {
            ev_push(out, PDF_EV_SEND_FAILED, (int)-r, s->id, 0, s->peer);
            continue;
        }
        e->send_free_n--;
        e->credits--;
        e->active_ops++;
        if (p) {
            if (p->outstanding == 0)
                p->last_progress_ns = now_ns();
            p->outstanding++;
        }
        posted++;
    }
    for (pdf_batch *b = e->act_head; b; b = b->link) {
        if (b->reported)
            continue;
        pdf_peer *p = peer_get(e, b->peer);
        if (p && p->failed) {
            batch_fail(e, b, FI_EHOSTUNREACH, out);
            continue;
        }
        if (p && p->blocked_round == e->round)
            continue;
        while (b->next < b->n) {
            if (e->credits == 0)
                return posted;
            uint32_t i = b->next;
            int last = (i == b->n - 1);
            /* The tagged write goes only once every other write of the batch
             * completed locally.  A local write completion means: verbs RC
             * and EFA: the target acknowledged the data; rxm over tcp and
             * shm: the data is ahead of the tagged write on the same ordered
             * channel, which the target processes in order.  So the tag
             * lands after the data.  (FI_DELIVERY_COMPLETE would say the
             * same, but rxm 1.17 can deadlock in fi_writemsg with it once a
             * connection has failed.) */
            if (b->imm_mode == PDF_IMM_LAST && last && b->n > 1 && b->completed < b->n - 1)
                break;
            pdf_op *op = op_get(e);
            if (!op) {
                batch_fail(e, b, FI_ENOMEM, out);
                break;
            }
            op->kind = OP_WRITE;
            op->batch = b;
            op->peer = b->peer;
            char *src = b->local_base + b->src[i];
            uint64_t raddr = b->remote_base + b->dst[i];
            ssize_t r;
            if (b->imm_mode == PDF_IMM_EVERY || (b->imm_mode == PDF_IMM_LAST && last)) {
                r = fi_writedata(e->ep, src, b->len[i], b->desc, (uint64_t)b->imm, b->peer, raddr, b->rkey,
                                 &op->ctx);
            } else {
                r = fi_write(e->ep, src, b->len[i], b->desc, b->peer, raddr, b->rkey, &op->ctx);
            }
            if (r == -FI_EAGAIN) {
                op_put(e, op);
                *eagain = 1;
                note_eagain(e, p);
                break;
            }
            if (p)
                p->eagain_since = 0;
            if (r) {
                op_put(e, op);
                batch_fail(e, b, (int)-r, out);
                break;
            }
            b->next++;
            b->inflight++;
            e->credits--;
            e->active_ops++;
            if (p) {
                if (p->outstanding == 0)
                    p->last_progress_ns = now_ns();
                p->outstanding++;
            }
            posted++;
        }
    }
    return posted;
}

static void op_finished(pdf_engine *e, pdf_op *op, uint64_t t)
{
    pdf_peer *p = peer_get(e, op->peer);
    e->active_ops--;
    if (p && p->orphans) {
        p->orphans--;
    } else {
        e->credits++;
        if (p) {
            if (p->outstanding)
                p->outstanding--;
            p->last_progress_ns = t;
        }
    }
}

static void complete_op(pdf_engine *e, pdf_op *op, int err, evbuf *out, uint64_t t)
{
    if (op->kind == OP_RECV) {
        if (err) {
            /* cancelled at close, or truncated: give the buffer back */
            if (err != FI_ECANCELED)
                e->repost[e->repost_n++] = op->slot;
            return;
        }
        return; /* success handled by caller, which knows the length */
    }
    op_finished(e, op, t);
    if (op->kind == OP_SEND) {
        uint64_t id = op->send_id;
        e->send_free[e->send_free_n++] = op->slot;
        if (err) {
            ev_push(out, PDF_EV_SEND_FAILED, err, id, 0, op->peer);
            peer_fail(e, op->peer, err, out);
        } else {
            ev_push(out, PDF_EV_SEND_DONE, 0, id, 0, op->peer);
        }
        return;
    }
    pdf_batch *b = op->batch;
    b->inflight--;
    if (err) {
        batch_fail(e, b, err, out);
        peer_fail(e, b->peer, err, out);
    } else {
        b->completed++;
        if (!b->reported && b->completed == b->n) {
            b->reported = 1;
            ev_push(out, PDF_EV_BATCH_DONE, 0, b->id, b->n, 0);
        }
    }
    op_put(e, op);
}

static int poll_cq(pdf_engine *e, evbuf *out)
{
    struct fi_cq_data_entry ent[PDF_CQ_BATCH];
    int total = 0;
    for (;;) {
        /* keep room: one CQ read can produce a few events per entry */
        if (out->cap - out->n < PDF_CQ_BATCH * 3 + 8)
            return total;
        ssize_t r = fi_cq_read(e->cq, ent, PDF_CQ_BATCH);
        if (r == -FI_EAGAIN)
            return total;
        uint64_t t = now_ns();
        if (r == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof(err));
            ssize_t rr = fi_cq_readerr(e->cq, &err, 0);
            if (rr < 0)
                return total;
            total++;
            int code = err.err ? err.err : FI_EOTHER;
            if (err.op_context && !(err.flags & FI_REMOTE_CQ_DATA)) {
                complete_op(e, (pdf_op *)err.op_context, code, out, t);
            } else {
                ev_push(out, PDF_EV_CQ_ERROR, code, err.data, err.prov_errno, err.flags);
            }
            continue;
        }
        if (r < 0) {
            ev_push(out, PDF_EV_CQ_ERROR, (int)-r, 0, 0, 0);
            return total;
        }
        for (ssize_t i = 0; i < r; i++) {
            struct fi_cq_data_entry *c = &ent[i];
            if (c->flags & FI_REMOTE_CQ_DATA) {
                ev_imm(out, c->data & 0xffffffffull);
                if (!(c->flags & FI_RECV))
                    continue;
            }
            pdf_op *op = (pdf_op *)c->op_context;
            if (!op)
                continue;
            if (op->kind == OP_RECV) {
                ev_push(out, PDF_EV_RECV, 0, op->slot, c->len, 0);
                continue;
            }
            complete_op(e, op, 0, out, t);
        }
        total += (int)r;
        if (r < PDF_CQ_BATCH)
            return total;
    }
}

static void check_timeouts(pdf_engine *e, evbuf *out, uint64_t t)
{
    if (!e->peer_timeout_ns || t - e->last_timeout_check < 1000000ull)
        return;
    e->last_timeout_check = t;
    for (uint64_t i = 0; i < e->npeers; i++) {
        pdf_peer *p = &e->peers[i];
        if (p->failed)
            continue;
        if ((p->outstanding && t - p->last_progress_ns > e->peer_timeout_ns) ||
            (p->eagain_since && t - p->eagain_since > e->peer_timeout_ns))
            peer_fail(e, i, FI_ETIMEDOUT, out);
    }
}

/* ------------------------------------------------------------ public API */

int pdf_open(const char *prov, const char *node, uint32_t tx_cap, uint32_t nrecv, uint32_t msg_size,
             uint32_t spin_us, uint32_t sleep_max_us, uint32_t peer_timeout_ms, pdf_engine **out, char *err,
             size_t errlen)
{
    int ret;
    char what[256];
    *out = NULL;
    pdf_engine *e = (pdf_engine *)calloc(1, sizeof(*e));
    if (!e)
        return -FI_ENOMEM;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->cv, NULL);

    struct fi_info *hints = fi_allocinfo();
    if (!hints) {
        free(e);
        return -FI_ENOMEM;
    }
    hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->av_type = FI_AV_TABLE;
    if (prov && prov[0])
        hints->fabric_attr->prov_name = strdup(prov);
    ret = fi_getinfo(FI_VERSION(1, 17), (node && node[0]) ? node : NULL, NULL, (node && node[0]) ? FI_SOURCE : 0,
                     hints, &e->info);
    fi_freeinfo(hints);
    if (ret) {
        snprintf(what, sizeof(what), "fi_getinfo(provider=%s, node=%s)", prov ? prov : "", node ? node : "");
        goto fail;
    }
    e->mr_mode = e->info->domain_attr->mr_mode;
    if (e->mr_mode & (FI_MR_ENDPOINT | FI_MR_RAW)) {
        ret = -FI_ENOSYS;
        snprintf(what, sizeof(what), "provider %s needs MR mode 0x%llx (FI_MR_ENDPOINT/FI_MR_RAW unsupported)",
                 e->info->fabric_attr->prov_name, (unsigned long long)e->mr_mode);
        goto fail;
    }
    ret = fi_fabric(e->info->fabric_attr, &e->fabric, NULL);
    if (ret) {
        snprintf(what, sizeof(what), "fi_fabric");
        goto fail;
    }
    ret = fi_domain(e->fabric, e->info, &e->domain, NULL);
    if (ret) {
        snprintf(what, sizeof(what), "fi_domain");
        goto fail;
    }
    struct fi_av_attr av_attr;
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    av_attr.count = 64;
    ret = fi_av_open(e->domain, &av_attr, &e->av, NULL);
    if (ret) {
        snprintf(what, sizeof(what), "fi_av_open");
        goto fail;
    }
    e->tx_credits = e->info->tx_attr->size;
    if (tx_cap && tx_cap < e->tx_credits)
        e->tx_credits = tx_cap;
    if (e->tx_credits == 0)
        e->tx_credits = 64;
    e->credits = e->tx_credits;
    struct fi_cq_attr cq_attr;
    memset(&cq_attr, 0, sizeof(cq_attr));
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = e->info->tx_attr->size + e->info->rx_attr->size + 1024;
    ret = fi_cq_open(e->domain, &cq_attr, &e->cq, NULL);
    if (ret) {
        snprintf(what, sizeof(what), "fi_cq_open");
        goto fail;
    }
    ret = fi_endpoint(e->domain, e->info, &e->ep, NULL);
    if (ret) {
        snprintf(what, sizeof(what), "fi_endpoint");
        goto fail;
    }
    ret = fi_ep_bind(e->ep, &e->av->fid, 0);
    if (ret) {
        snprintf(what, sizeof(what), "fi_ep_bind(av)");
        goto fail;
    }
    ret = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV);
    if (ret) {
        snprintf(what, sizeof(what), "fi_ep_bind(cq)");
        goto fail;
    }
    ret = fi_enable(e->ep);
    if (ret) {
        snprintf(what, sizeof(what), "fi_enable");
        goto fail;
    }

    e->next_key = 1;
    e->nrecv = nrecv ? nrecv : 1;
    e->msg_size = msg_size ? msg_size : 4096;
    size_t pool = (size_t)e->nrecv * e->msg_size;
    e->recv_pool = (char *)aligned_alloc(4096, (pool + 4095) & ~(size_t)4095);
    e->send_pool = (char *)aligned_alloc(4096, (pool + 4095) & ~(size_t)4095);
    e->recv_ops = (pdf_op *)calloc(e->nrecv, sizeof(pdf_op));
    e->send_ops = (pdf_op *)calloc(e->nrecv, sizeof(pdf_op));
    e->send_free = (uint32_t *)calloc(e->nrecv, sizeof(uint32_t));
    e->repost = (uint32_t *)calloc(e->nrecv, sizeof(uint32_t));
    if (!e->recv_pool || !e->send_pool || !e->recv_ops || !e->send_ops || !e->send_free || !e->repost) {
        ret = -FI_ENOMEM;
        snprintf(what, sizeof(what), "control message pools");
        goto fail;
    }
    uint64_t access = FI_SEND | FI_RECV;
    ret = fi_mr_reg(e->domain, e->recv_pool, pool, access, 0, (1ull << 62) + 1, 0, &e->recv_mr, NULL);
    if (ret) {
        snprintf(what, sizeof(what), "fi_mr_reg(recv pool)");
        goto fail;
    }
    ret = fi_mr_reg(e->domain, e->send_pool, pool, access, 0, (1ull << 62) + 2, 0, &e->send_mr, NULL);
    if (ret) {
        snprintf(what, sizeof(what), "fi_mr_reg(send pool)");
        goto fail;
    }
    e->recv_desc = fi_mr_desc(e->recv_mr);
    e->send_desc = fi_mr_desc(e->send_mr);
    for (uint32_t i = 0; i < e->nrecv; i++) {
        e->send_free[i] = i;
        ret = post_recv(e, i);
        if (ret) {
            snprintf(what, sizeof(what), "fi_recv(slot %u)", i);
            goto fail;
        }
    }
    e->send_free_n = e->nrecv;
    e->spin_ns = (uint64_t)spin_us * 1000ull;
    e->sleep_max_ns = (uint64_t)(sleep_max_us ? sleep_max_us : 1000) * 1000ull;
    e->peer_timeout_ns = (uint64_t)peer_timeout_ms * 1000000ull;
    *out = e;
    return 0;
fail:
    set_err(err, errlen, what, ret);
    if (e->ep)
        fi_close(&e->ep->fid);
    if (e->recv_mr)
        fi_close(&e->recv_mr->fid);
    if (e->send_mr)
        fi_close(&e->send_mr->fid);
    if (e->cq)
        fi_close(&e->cq->fid);
    if (e->av)
        fi_close(&e->av->fid);
    if (e->domain)
        fi_close(&e->domain->fid);
    if (e->fabric)
        fi_close(&e->fabric->fid);
    if (e->info)
        fi_freeinfo(e->info);
    free(e->recv_pool);
    free(e->send_pool);
    free(e->recv_ops);
    free(e->send_ops);
    free(e->send_free);
    free(e->repost);
    free(e);
    return ret < 0 ? ret : -ret;
}

int pdf_get_info(pdf_engine *e, pdf_info *out)
{
    memset(out, 0, sizeof(*out));
    snprintf(out->provider, sizeof(out->provider), "%s", e->info->fabric_attr->prov_name);
    snprintf(out->fabric, sizeof(out->fabric), "%s", e->info->fabric_attr->name);
    snprintf(out->domain, sizeof(out->domain), "%s", e->info->domain_attr->name);
    out->mr_mode = e->mr_mode;
    out->tx_size = e->info->tx_attr->size;
    out->rx_size = e->info->rx_attr->size;
    out->tx_credits = e->tx_credits;
    out->max_msg_size = e->info->ep_attr->max_msg_size;
    out->inject_size = e->info->tx_attr->inject_size;
    out->cq_data_size = e->info->domain_attr->cq_data_size;
    size_t len = PDF_ADDR_MAX;
    ext_lock(e);
    int ret = fi_getname(&e->ep->fid, out->addr, &len);
    pthread_mutex_unlock(&e->lock);
    if (ret)
        return ret;
    out->addrlen = (uint32_t)len;
    return 0;
}

int pdf_mr_reg(pdf_engine *e, uint64_t addr, uint64_t len, uint64_t *key_out, uint64_t *desc_out, uint64_t *mr_out)
{
    struct fid_mr *mr = NULL;
    uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    ext_lock(e);
    uint64_t want = e->next_key++;
    int ret = fi_mr_reg(e->domain, (void *)(uintptr_t)addr, len, access, 0, want, 0, &mr, NULL);
    pthread_mutex_unlock(&e->lock);
    if (ret)
        return ret;
    *key_out = fi_mr_key(mr);
    *desc_out = (uint64_t)(uintptr_t)fi_mr_desc(mr);
    *mr_out = (uint64_t)(uintptr_t)mr;
    return 0;
}

int pdf_mr_close(pdf_engine *e, uint64_t mr)
{
    ext_lock(e);
    int ret = fi_close(&((struct fid_mr *)(uintptr_t)mr)->fid);
    pthread_mutex_unlock(&e->lock);
    return ret;
}

int pdf_av_insert(pdf_engine *e, const uint8_t *addr, uint64_t *fi_addr_out)
{
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    ext_lock(e);
    int ret = fi_av_insert(e->av, addr, 1, &fa, 0, NULL);
    if (ret == 1) {
        pdf_peer *p = peer_get(e, fa);
        if (p) {
            p->failed = 0;
            p->last_progress_ns = now_ns();
        }
    }
    pthread_mutex_unlock(&e->lock);
    if (ret != 1)
        return ret < 0 ? ret : -FI_EINVAL;
    *fi_addr_out = fa;
    return 0;
}

int pdf_av_remove(pdf_engine *e, uint64_t fi_addr)
{
    fi_addr_t fa = fi_addr;
    ext_lock(e);
    int ret = fi_av_remove(e->av, &fa, 1, 0);
    pthread_mutex_unlock(&e->lock);
    return ret;
}

static void wake(pdf_engine *e)
{
    if (e->sleeping)
        pthread_cond_signal(&e->cv);
}

/* Queue a batch of writes.  The arrays are copied; contiguous runs are
 * merged when imm_mode is not EVERY (merging would change the count the
 * receiver expects), and no single write exceeds max_write bytes. Returns
 * the number of writes the batch was turned into, or a negative error. */
int64_t pdf_submit_writes(pdf_engine *e, uint64_t id, uint64_t peer, uint64_t local_base, uint64_t desc,
                          uint64_t remote_base, uint64_t rkey, const uint64_t *src, const uint64_t *dst,
                          const uint64_t *len, uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write)
{
    if (n == 0)
        return -FI_EINVAL;
    if (!max_write)
        max_write = UINT64_MAX;
    uint64_t cap = n;
    int merge = imm_mode != PDF_IMM_EVERY;
    if (merge)
        for (uint32_t i = 0; i < n; i++)
            if (len[i] > max_write)
                cap += len[i] / max_write;
    pdf_batch *b = (pdf_batch *)calloc(1, sizeof(*b));
    uint64_t *arr = (uint64_t *)malloc(sizeof(uint64_t) * 3 * cap);
    if (!b || !arr) {
        free(b);
        free(arr);
        return -FI_ENOMEM;
    }
    b->src = arr;
    b->dst = arr + cap;
    b->len = arr + 2 * cap;
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t s = src[i], d = dst[i], l = len[i];
        if (merge && m > 0 && b->src[m - 1] + b->len[m - 1] == s && b->dst[m - 1] + b->len[m - 1] == d &&
            b->len[m - 1] + l <= max_write) {
            b->len[m - 1] += l;
            continue;
        }
        while (merge && l > max_write) {
            b->src[m] = s;
            b->dst[m] = d;
            b->len[m] = max_write;
            m++;
            s += max_write;
            d += max_write;
            l -= max_write;
        }
        b->src[m] = s;
        b->dst[m] = d;
        b->len[m] = l;
        m++;
    }
    b->id = id;
    b->peer = peer;
    b->local_base = (char *)(uintptr_t)local_base;
    b->desc = (void *)(uintptr_t)desc;
    b->remote_base = remote_base;
    b->rkey = rkey;
    b->imm = imm;
    b->imm_mode = imm_mode;
    b->n = m;
    ext_lock(e);
    if (e->stop) {
        pthread_mutex_unlock(&e->lock);
        free(arr);
        free(b);
        return -FI_ESHUTDOWN;
    }
    if (e->pend_tail)
        e->pend_tail->link = b;
    else
        e->pend_head = b;
    e->pend_tail = b;
    wake(e);
    pthread_mutex_unlock(&e->lock);
    return m;
}

int pdf_submit_send(pdf_engine *e, uint64_t id, uint64_t peer, const uint8_t *data, uint32_t len)
{
    if (len > e->msg_size)
        return -FI_EMSGSIZE;
    pdf_send *s = (pdf_send *)calloc(1, sizeof(*s) + len);
    if (!s)
        return -FI_ENOMEM;
    s->id = id;
    s->peer = peer;
    s->len = len;
    memcpy(s->data, data, len);
    ext_lock(e);
    if (e->stop) {
        pthread_mutex_unlock(&e->lock);
        free(s);
        return -FI_ESHUTDOWN;
    }
    if (e->spend_tail)
        e->spend_tail->link = s;
    else
        e->spend_head = s;
    e->spend_tail = s;
    wake(e);
    pthread_mutex_unlock(&e->lock);
    return 0;
}

const uint8_t *pdf_recv_buf(pdf_engine *e, uint32_t slot)
{
    return (const uint8_t *)e->recv_pool + (size_t)slot * e->msg_size;
}

void pdf_recv_release(pdf_engine *e, uint32_t slot)
{
    ext_lock(e);
    e->repost[e->repost_n++] = slot;
    wake(e);
    pthread_mutex_unlock(&e->lock);
}

/* Declare a peer failed: every queued or outstanding batch and send to it
 * is reported failed with `code`, and nothing more is posted to it until it
 * is inserted again. */
int pdf_fail_peer(pdf_engine *e, uint64_t peer, int code, pdf_event *ev, int cap)
{
    evbuf out = {ev, cap, 0};
    ext_lock(e);
    peer_fail(e, peer, code, &out);
    sweep(e);
    pthread_mutex_unlock(&e->lock);
    return out.n;
}

/* Outstanding work: batches and sends not yet reported, plus ops that the
 * provider still holds. */
uint64_t pdf_outstanding(pdf_engine *e)
{
    uint64_t n = 0;
    ext_lock(e);
    for (pdf_batch *b = e->pend_head; b; b = b->link)
        n++;
    for (pdf_batch *b = e->act_head; b; b = b->link)
        if (!b->reported)
            n++;
    for (pdf_send *s = e->spend_head; s; s = s->link)
        n++;
    for (pdf_send *s = e->sact_head; s; s = s->link)
        if (!s->reported)
            n++;
    n += e->active_ops;
    pthread_mutex_unlock(&e->lock);
    return n;
}

/* Fail everything still queued or in flight with `code` (used at close). */
int pdf_fail_all(pdf_engine *e, int code, pdf_event *ev, int cap)
{
    evbuf out = {ev, cap, 0};
    ext_lock(e);
    take_pending(e);
    for (pdf_batch *b = e->act_head; b && out.n < cap - 1; b = b->link)
        if (!b->reported)
            batch_fail(e, b, code, &out);
    for (pdf_send *s = e->sact_head; s && out.n < cap - 1; s = s->link)
        if (!s->reported) {
            s->reported = 1;
            ev_push(&out, PDF_EV_SEND_FAILED, code, s->id, 0, s->peer);
        }
    pthread_mutex_unlock(&e->lock);
    return out.n;
}

void pdf_stop(pdf_engine *e)
{
    ext_lock(e);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
}

/* Run the progress engine until at least one event is ready (then keep
 * gathering briefly so that bursts come back together), stop is requested,
 * or timeout_us passes.  Spins while work is outstanding or for spin_us after
 * the last activity, then sleeps with exponential back-off up to
 * sleep_max_us, waking at once when work is submitted.  Returns the number of
 * events written to ev (cap must be >= 256). */
int pdf_progress(pdf_engine *e, pdf_event *ev, int cap, int64_t timeout_us)
{
    evbuf out = {ev, cap, 0};
    uint64_t start = now_ns();
    uint64_t deadline = start + (uint64_t)(timeout_us > 0 ? timeout_us : 0) * 1000ull;
    uint64_t idle_since = 0, first_ev = 0;
    uint64_t sleep_ns = 20000;
    unsigned spins = 0;
    for (;;) {
        pthread_mutex_lock(&e->lock);
        int before = out.n;
        take_pending(e);
        int eagain = 0;
        int did = post_work(e, &out, &eagain);
        did += poll_cq(e, &out);
        if (eagain)
            did += post_work(e, &out, &eagain);
        uint64_t t = now_ns();
        check_timeouts(e, &out, t);
        sweep(e);
        int busy = e->active_ops > 0 || e->act_head != NULL || e->sact_head != NULL;
        int stop = e->stop;
        pthread_mutex_unlock(&e->lock);
        if (__atomic_load_n(&e->waiters, __ATOMIC_SEQ_CST)) {
            uint64_t t0 = now_ns();
            while (__atomic_load_n(&e->waiters, __ATOMIC_SEQ_CST) && now_ns() - t0 < 2000000ull)
                sched_yield();
        }
        if (stop)
            return out.n;
        if (out.n > 0) {
            if (!first_ev)
                first_ev = t;
            /* return once the burst pauses, the buffer fills, or 100us pass */
            if (out.n == before || out.cap - out.n < PDF_CQ_BATCH * 3 + 16 || t - first_ev > 100000ull)
                return out.n;
        }
        if (t >= deadline)
            return out.n;
        if (did || busy) {
            idle_since = 0;
            sleep_ns = 20000;
            if (!did && (++spins & 63) == 0)
                sched_yield(); /* let the other side run on small machines */
            continue;
        }
        if (!idle_since)
            idle_since = t;
        if (t - idle_since < e->spin_ns)
            continue;
        pthread_mutex_lock(&e->lock);
        if (!e->stop && !e->pend_head && !e->spend_head && !e->repost_n) {
            uint64_t wake_at = t + sleep_ns;
            if (wake_at > deadline)
                wake_at = deadline;
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            uint64_t rel = wake_at > t ? wake_at - t : 0;
            uint64_t abs_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + rel;
            ts.tv_sec = (time_t)(abs_ns / 1000000000ull);
            ts.tv_nsec = (long)(abs_ns % 1000000000ull);
            e->sleeping = 1;
            pthread_cond_timedwait(&e->cv, &e->lock, &ts);
            e->sleeping = 0;
        }
        pthread_mutex_unlock(&e->lock);
        sleep_ns *= 2;
        if (sleep_ns > e->sleep_max_ns)
            sleep_ns = e->sleep_max_ns;
    }
}

/* Close the endpoint only (then the caller closes its own MRs). */
void pdf_close_ep(pdf_engine *e)
{
    ext_lock(e);
    if (e->ep)
        fi_close(&e->ep->fid);
    e->ep = NULL;
    pthread_mutex_unlock(&e->lock);
}

/* Close everything.  The progress thread must have returned for good. */
void pdf_close(pdf_engine *e)
{
    if (!e)
        return;
    ext_lock(e);
    if (e->ep)
        fi_close(&e->ep->fid);
    if (e->recv_mr)
        fi_close(&e->recv_mr->fid);
    if (e->send_mr)
        fi_close(&e->send_mr->fid);
    if (e->cq)
        fi_close(&e->cq->fid);
    if (e->av)
        fi_close(&e->av->fid);
    if (e->domain)
        fi_close(&e->domain->fid);
    if (e->fabric)
        fi_close(&e->fabric->fid);
    fi_freeinfo(e->info);
    take_pending(e);
    for (pdf_batch *b = e->act_head; b;) {
        pdf_batch *nx = b->link;
        free(b->src);
        free(b);
        b = nx;
    }
    for (pdf_send *s = e->sact_head; s;) {
        pdf_send *nx = s->link;
        free(s);
        s = nx;
    }
    while (e->free_ops) {
        pdf_op *nx = e->free_ops->next_free;
        free(e->free_ops);
        e->free_ops = nx;
    }
    free(e->recv_pool);
    free(e->send_pool);
    free(e->recv_ops);
    free(e->send_ops);
    free(e->send_free);
    free(e->repost);
    free(e->peers);
    pthread_mutex_unlock(&e->lock);
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->cv);
    free(e);
}
