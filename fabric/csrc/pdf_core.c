/*
 * pdf_core.c - the native half of pdserve's fabric transport.
 *
 * One pdf_engine owns one libfabric FI_EP_RDM endpoint, its CQ, AV and domain.
 * Every libfabric call on these objects is made while holding e->lock, so the
 * domain is opened with FI_THREAD_DOMAIN and the provider takes no locks of
 * its own.  Application threads only append to queues (pdf_submit_*); the
 * single progress thread (pdf_progress) posts queued work within the tx credit
 * budget, polls the CQ, and returns compact events to Python.  No per-write
 * Python object exists on the hot path.  When there is nothing to do it
 * sleeps on the provider's wait fd or a shared doorbell (pdf_wait.c), so an
 * idle engine uses no CPU and still wakes within microseconds.
 *
 * Immediate data: the 32-bit value carries the caller's 24-bit tag in its
 * high bits and a unit count in its low 8 bits.  A write that coalesces k of
 * the caller's entries carries k units, so the receiver counts entries (not
 * posted operations) and coalescing never changes what it expects.
 *
 * This file is compiled into the cffi extension fabric._libfabric by
 * fabric/_ffi_build.py; its interface is declared once, in pdf_core.h, which
 * is also the builder's cdef.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "pdf_core.h"
#include "pdf_shm.h"
#include "pdf_wait.h"

#define PDF_CQ_BATCH 64

/* The immediate-data layout of pdf_core.h, spelled as literals there for cffi. */
_Static_assert(PDF_IMM_UNIT_MAX == (1u << PDF_IMM_UNIT_BITS) - 1, "PDF_IMM_UNIT_MAX");
_Static_assert(PDF_IMM_TAG_MAX == (1u << (32 - PDF_IMM_UNIT_BITS)) - 1, "PDF_IMM_TAG_MAX");

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
    uint32_t epoch; /* its peer's epoch when posted (see peer_fail) */
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
    uint64_t *src; /* one allocation holds src, dst, len and units */
    uint64_t *dst;
    uint64_t *len;
    uint64_t *units; /* entries each write coalesced (its immediate-data weight) */
    uint32_t next;      /* next write to post */
    uint32_t completed; /* writes completed successfully */
    uint32_t inflight;  /* writes posted and not yet completed */
    int failed;
    int reported;
    /* pdf_write_sync: a caller waits for this batch on its own thread.  Its
     * outcome is stored here (and `word` futex-woken) instead of becoming an
     * event, and sweep() keeps it until the caller has read it. */
    int sync;
    int outcome;      /* PDF_SYNC_PENDING / _DONE / _FAILED */
    int code;         /* the error of a failed batch */
    uint64_t missing; /* writes not completed when it failed */
    uint32_t word;    /* futex word: 1 once the outcome is set */
    int sleeping;     /* the caller sleeps on `word` */
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
    uint32_t epoch; /* bumped when the peer fails: older operations are orphans */
    uint64_t last_progress_ns;
    uint64_t eagain_since; /* first FI_EAGAIN of the current refusal streak */
    uint64_t blocked_round; /* refused a post in this post_work round */
    uint64_t posted_round;  /* last post_work round that posted to it */
    uint32_t *bell;         /* its doorbell (same host, BELL mode), else NULL */
    struct fid_ep *tx_ep;   /* per-peer transmit endpoint (shm, see write_ep) */
    int pidfd;              /* same host: becomes readable when its process exits */
    int has_pidfd;
} pdf_peer;

struct pdf_engine {
    pthread_mutex_t lock;
    int waiters; /* threads other than progress waiting for the lock */
    pdf_waiter waiter;
    int stop;
    int poke; /* pdf_poke: return from pdf_progress after one more round */

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

    uint64_t spin_ns;      /* idle: spin this long after the last activity */
    uint64_t busy_spin_ns; /* operations outstanding: spin this long without progress */
    uint64_t sleep_max_ns;
    uint64_t last_activity_ns;
    int delivery_complete;
    int source_addr; /* FI_SOURCE granted: a receive completion names its sender's fi_addr */
    int per_peer_tx; /* writes go through one endpoint per peer (shm) */
    uint64_t locked_since; /* when the engine lock was taken (atomic), 0 if free */
    pthread_t watchdog;
    int watchdog_on;
    int watchdog_stop;
    uint64_t locks_released; /* dead peers' shm locks released (atomic) */
    uint64_t peer_timeout_ns;
    uint64_t last_timeout_check;
    uint64_t round;
    int busy_poll; /* the progress thread never sleeps (FabricConfig.busy_poll) */

    /* Events produced by callers that ran progress rounds themselves
     * (pdf_write_sync); the progress thread hands them to Python. */
    pdf_event *defer;
    uint32_t ndefer, cap_defer;
    uint32_t sync_waiters; /* callers inside pdf_write_sync (pdf_close waits for them) */
};

/* Other threads take the lock through here: the progress thread, which
 * re-takes the lock in a tight loop, steps aside while someone waits (a
 * plain mutex is not fair and would starve submitters). */
static uint64_t now_ns(void);

/* The engine lock, with the time it was taken for the watchdog. */
static void lock(pdf_engine *e)
{
    pthread_mutex_lock(&e->lock);
    __atomic_store_n(&e->locked_since, now_ns(), __ATOMIC_RELAXED);
}

static void unlock(pdf_engine *e)
{
    __atomic_store_n(&e->locked_since, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&e->lock);
}

static void ext_lock(pdf_engine *e)
{
    __atomic_add_fetch(&e->waiters, 1, __ATOMIC_SEQ_CST);
    lock(e);
    __atomic_sub_fetch(&e->waiters, 1, __ATOMIC_SEQ_CST);
}

/* shm only: while the engine lock has been held for a long time, look for
 * region locks held by dead processes and release those that stay held
 * across two looks (a live holder lets go within microseconds).  See
 * pdf_shm.h. */
#define WATCHDOG_PERIOD_NS 50000000ull
#define WATCHDOG_STUCK_NS 100000000ull

static void *watchdog_main(void *arg)
{
    pdf_engine *e = (pdf_engine *)arg;
    uintptr_t seen[PDF_SHM_MAX_STUCK], cur[PDF_SHM_MAX_STUCK];
    int nseen = 0;
    struct timespec period = {0, (long)WATCHDOG_PERIOD_NS};
    while (!__atomic_load_n(&e->watchdog_stop, __ATOMIC_SEQ_CST)) {
        nanosleep(&period, NULL);
        uint64_t since = __atomic_load_n(&e->locked_since, __ATOMIC_RELAXED);
        if (!since || now_ns() - since < WATCHDOG_STUCK_NS) {
            nseen = 0;
            continue;
        }
        int n = pdf_shm_held_locks(cur, PDF_SHM_MAX_STUCK);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < nseen; j++)
                if (cur[i] == seen[j] && pdf_shm_release(cur[i]))
                    __atomic_add_fetch(&e->locks_released, 1, __ATOMIC_SEQ_CST);
        memcpy(seen, cur, sizeof(uintptr_t) * (size_t)n);
        nseen = n;
    }
    return NULL;
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

/* One write's immediate data landed; `src` is its writer's address as the provider reports it
 * (fi_cq_readfrom; PDF_ADDR_UNKNOWN without FI_SOURCE). Our AV's fi_addr for the writer only
 * where the provider names the writers of remote writes: not shm or rxm (fabric/imm.py). */
static void ev_imm(evbuf *b, uint64_t data, uint64_t src)
{
    uint64_t tag = (data & 0xffffffffull) >> PDF_IMM_UNIT_BITS;
    uint64_t units = data & PDF_IMM_UNIT_MAX;
    /* Aggregate: writes of one tag from one writer tend to land together (never merged across
     * writers: the receiver counts a write only from the engine it expects). */
    int lo = b->n > 8 ? b->n - 8 : 0;
    for (int i = b->n - 1; i >= lo; i--) {
        if (b->ev[i].kind == PDF_EV_IMM && b->ev[i].id == tag && b->ev[i].aux == src) {
            b->ev[i].count += units;
            return;
        }
    }
    ev_push(b, PDF_EV_IMM, 0, tag, units, src);
}

/* --------------------------------------------------------------- failure */

/* A batch finished (failed: with `code`).  Its caller learns it through an
 * event, or, for a batch a caller waits for in pdf_write_sync, through its
 * outcome fields and a futex wake-up.  Called with the lock held. */
static void batch_report(pdf_batch *b, int failed, int code, evbuf *out)
{
    b->reported = 1;
    if (!b->sync) {
        if (failed)
            ev_push(out, PDF_EV_BATCH_FAILED, code, b->id, b->n - b->completed, b->n);
        else
            ev_push(out, PDF_EV_BATCH_DONE, 0, b->id, b->n, 0);
        return;
    }
    b->outcome = failed ? PDF_SYNC_FAILED : PDF_SYNC_DONE;
    b->code = code;
    b->missing = b->n - b->completed;
    __atomic_store_n(&b->word, 1, __ATOMIC_SEQ_CST);
    if (b->sleeping)
        syscall(SYS_futex, &b->word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void batch_fail(pdf_engine *e, pdf_batch *b, int code, evbuf *out)
{
    (void)e;
    b->failed = 1;
    if (!b->reported)
        batch_report(b, 1, code, out);
}

static void take_pending(pdf_engine *e);
static void forget_local(pdf_peer *p);
static int run_round(pdf_engine *e, evbuf *out, uint64_t *t);
static int drain_defer(pdf_engine *e, evbuf *out);
static void wake(pdf_engine *e);

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
     * credits back now; a late completion (older epoch) must not return
     * them twice. */
    e->credits += p->outstanding;
    e->active_ops -= p->outstanding;
    p->outstanding = 0;
    p->epoch++;
    if (p->tx_ep) {
        /* its stuck operations go with it; the other peers' endpoints
         * never saw them (see write_ep) */
        fi_close(&p->tx_ep->fid);
        p->tx_ep = NULL;
    }
    if (!was_failed)
        ev_push(out, PDF_EV_PEER_FAILED, code, peer, 0, 0);
}

/* The endpoint that carries writes to peer `p`.
 *
 * shm retires the completions of an endpoint through one response queue, in
 * order: an operation to a peer that died never completes and holds back
 * every later completion of that endpoint, whatever its target, so one dead
 * peer would jam the engine.  With shm each peer therefore gets its own
 * transmit endpoint (same domain, AV and CQ, so keys and completions are
 * shared), created on first use and closed when the peer fails.  Control
 * messages stay on the main endpoint: they are small (inject, no response)
 * and never wait on the peer. */
static struct fid_ep *write_ep(pdf_engine *e, pdf_peer *p, int *err)
{
    *err = 0;
    if (!e->per_peer_tx || !p)
        return e->ep;
    if (p->tx_ep)
        return p->tx_ep;
    struct fid_ep *ep = NULL;
    int ret = fi_endpoint(e->domain, e->info, &ep, NULL);
    if (!ret)
        ret = fi_ep_bind(ep, &e->av->fid, 0);
    if (!ret)
        ret = fi_ep_bind(ep, &e->cq->fid, FI_TRANSMIT | FI_RECV);
    if (!ret)
        ret = fi_enable(ep);
    if (ret) {
        if (ep)
            fi_close(&ep->fid);
        *err = ret < 0 ? -ret : ret;
        return NULL;
    }
    p->tx_ep = ep;
    return ep;
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
        if (b->reported && b->inflight == 0 && !b->sync) {
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

/* A write or send was posted: it holds a credit until its completion, and its
 * peer's progress clock starts when it had nothing outstanding. */
static void note_posted(pdf_engine *e, pdf_peer *p)
{
    e->credits--;
    e->active_ops++;
    if (p) {
        if (p->outstanding == 0)
            p->last_progress_ns = now_ns();
        p->outstanding++;
    }
}

/* Post write b->next of batch b (the caller checked that a credit is free).
 * Returns 1 if posted; 0 if it must wait (the tagged write waits for the
 * others, or FI_EAGAIN: *eagain set); -1 if the batch failed (reported into
 * out).  With out == NULL (a submitter posting inline) nothing is reported:
 * an error returns 0, and the progress thread meets it again and reports. */
static int post_one_write(pdf_engine *e, pdf_batch *b, pdf_peer *p, evbuf *out, int *eagain)
{
    uint32_t i = b->next;
    int last = (i == b->n - 1);
    /* The tagged write goes only once every other write of the batch
     * completed locally.  A local write completion means: verbs RC and EFA:
     * the target acknowledged the data; rxm over tcp and shm: the data is
     * ahead of the tagged write on the same ordered channel, which the target
     * processes in order.  So the tag lands after the data, with or without
     * FI_DELIVERY_COMPLETE. */
    if (b->imm_mode == PDF_IMM_LAST && last && b->n > 1 && b->completed < b->n - 1)
        return 0;
    int eperr = 0;
    struct fid_ep *ep = write_ep(e, p, &eperr);
    if (!ep) {
        if (!out)
            return 0;
        batch_fail(e, b, eperr, out);
        return -1;
    }
    pdf_op *op = op_get(e);
    if (!op) {
        if (!out)
            return 0;
        batch_fail(e, b, FI_ENOMEM, out);
        return -1;
    }
    op->kind = OP_WRITE;
    op->batch = b;
    op->peer = b->peer;
    op->epoch = p ? p->epoch : 0;
    char *src = b->local_base + b->src[i];
    uint64_t raddr = b->remote_base + b->dst[i];
    ssize_t r;
    if (b->imm_mode == PDF_IMM_EVERY || (b->imm_mode == PDF_IMM_LAST && last)) {
        /* "last" counts one unit per batch; "every" one per entry */
        uint64_t units = b->imm_mode == PDF_IMM_EVERY ? b->units[i] : 1;
        uint64_t data = ((uint64_t)b->imm << PDF_IMM_UNIT_BITS) | units;
        r = fi_writedata(ep, src, b->len[i], b->desc, data, b->peer, raddr, b->rkey, &op->ctx);
    } else {
        r = fi_write(ep, src, b->len[i], b->desc, b->peer, raddr, b->rkey, &op->ctx);
    }
    if (r == -FI_EAGAIN) {
        op_put(e, op);
        *eagain = 1;
        note_eagain(e, p);
        return 0;
    }
    if (r) {
        op_put(e, op);
        if (!out)
            return 0;
        batch_fail(e, b, (int)-r, out);
        return -1;
    }
    if (p)
        p->eagain_since = 0;
    b->next++;
    b->inflight++;
    note_posted(e, p);
    return 1;
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
        op->epoch = p ? p->epoch : 0;
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
        note_posted(e, p);
        if (p)
            p->posted_round = e->round;
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
            if (post_one_write(e, b, p, out, eagain) != 1)
                break;
            if (p)
                p->posted_round = e->round;
            posted++;
        }
    }
    return posted;
}

/* Returns 1 for an orphan (posted before its peer failed), which changes
 * nothing: it was accounted for when the peer failed. */
static int op_finished(pdf_engine *e, pdf_op *op, uint64_t t)
{
    pdf_peer *p = peer_get(e, op->peer);
    if (p && op->epoch != p->epoch)
        return 1;
    e->active_ops--;
    e->credits++;
    if (p) {
        if (p->outstanding)
            p->outstanding--;
        p->last_progress_ns = t;
    }
    return 0;
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
    /* an orphan's error says nothing about the peer as it is now (it may
     * have been reconnected since): report the operation, not the peer */
    int orphan = op_finished(e, op, t);
    if (op->kind == OP_SEND) {
        uint64_t id = op->send_id;
        e->send_free[e->send_free_n++] = op->slot;
        if (err) {
            ev_push(out, PDF_EV_SEND_FAILED, err, id, 0, op->peer);
            if (!orphan)
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
        if (!orphan)
            peer_fail(e, b->peer, err, out);
    } else {
        b->completed++;
        if (!b->reported && b->completed == b->n)
            batch_report(b, 0, 0, out);
    }
    op_put(e, op);
}

static int poll_cq(pdf_engine *e, evbuf *out)
{
    struct fi_cq_data_entry ent[PDF_CQ_BATCH];
    fi_addr_t src[PDF_CQ_BATCH];
    int total = 0;
    for (;;) {
        /* keep room: one CQ read can produce a few events per entry */
        if (out->cap - out->n < PDF_CQ_BATCH * 3 + 8)
            return total;
        ssize_t r;
        if (e->source_addr) {
            r = fi_cq_readfrom(e->cq, ent, PDF_CQ_BATCH, src);
        } else {
            r = fi_cq_read(e->cq, ent, PDF_CQ_BATCH);
            for (int k = 0; k < PDF_CQ_BATCH; k++)
                src[k] = FI_ADDR_NOTAVAIL;
        }
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
                ev_imm(out, c->data, (uint64_t)src[i]);
                if (!(c->flags & FI_RECV))
                    continue;
            }
            pdf_op *op = (pdf_op *)c->op_context;
            if (!op)
                continue;
            if (op->kind == OP_RECV) {
                ev_push(out, PDF_EV_RECV, 0, op->slot, c->len, (uint64_t)src[i]);
                continue;
            }
            complete_op(e, op, 0, out, t);
        }
        total += (int)r;
        if (r < PDF_CQ_BATCH)
            return total;
    }
}

static int peer_process_exited(pdf_peer *p)
{
    if (!p->has_pidfd)
        return 0;
    struct pollfd pfd = {p->pidfd, POLLIN, 0};
    return poll(&pfd, 1, 0) == 1 && (pfd.revents & POLLIN);
}

/* Every millisecond: fail peers whose process has exited (same host: fast,
 * and before anything else is posted to a region nobody serves) and peers
 * that made no progress for peer_timeout. */
static void check_timeouts(pdf_engine *e, evbuf *out, uint64_t t)
{
    if (t - e->last_timeout_check < 1000000ull)
        return;
    e->last_timeout_check = t;
    for (uint64_t i = 0; i < e->npeers; i++) {
        pdf_peer *p = &e->peers[i];
        if (p->failed)
            continue;
        if (peer_process_exited(p)) {
            peer_fail(e, i, FI_ECONNRESET, out);
            continue;
        }
        if (!e->peer_timeout_ns)
            continue;
        if ((p->outstanding && t - p->last_progress_ns > e->peer_timeout_ns) ||
            (p->eagain_since && t - p->eagain_since > e->peer_timeout_ns))
            peer_fail(e, i, FI_ETIMEDOUT, out);
    }
}

/* Wake peers on this host that sleep while something we posted waits for
 * them (BELL mode: shm moves data only while the target polls).  Checked
 * every round, so work a provider defers is covered too. */
static void ring_peers(pdf_engine *e)
{
    for (uint64_t i = 0; i < e->npeers; i++) {
        pdf_peer *p = &e->peers[i];
        if (p->bell && !p->failed && (p->outstanding || p->posted_round == e->round))
            pdf_bell_ring(p->bell);
    }
}

/* ------------------------------------------------------------ public API */

static struct fi_info *make_hints(const char *prov, const char *domain, int delivery_complete, int source, int waw)
{
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        return NULL;
    hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    /* FI_SOURCE: receive completions carry the sender's address (fi_cq_readfrom), so a control
     * message is attributed to the endpoint it came from, never to what its payload claims */
    if (source)
        hints->caps |= FI_SOURCE;
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->av_type = FI_AV_TABLE;
    /* control messages to one peer arrive in the order sent (a revocation
     * before the handshake's answer, goodbye after the last message); with `waw`, also writes
     * after writes (FI_ORDER_WAW: the prefill node's delivery fence, posted after a transfer's
     * writes on the same connection, lands only after them). What was granted is in
     * pdf_info.tx_msg_order / rx_msg_order: a fence is trusted only where WAW was. */
    hints->tx_attr->msg_order = FI_ORDER_SAS | (waw ? FI_ORDER_WAW : 0);
    hints->rx_attr->msg_order = FI_ORDER_SAS | (waw ? FI_ORDER_WAW : 0);
    if (delivery_complete)
        hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE; /* default for fi_write/fi_writedata/fi_send */
    if (prov && prov[0])
        hints->fabric_attr->prov_name = strdup(prov);
    /* the domain (NIC) by name, e.g. efa's "rdmap0s6-rdm", verbs' "mlx5_0" (freed by fi_freeinfo) */
    if (domain && domain[0] && !(hints->domain_attr->name = strdup(domain))) {
        fi_freeinfo(hints);
        return NULL;
    }
    return hints;
}

/* Open the CQ with a wait fd where the provider has one (the progress
 * thread then sleeps in poll()), else without a wait object. */
static int open_cq(pdf_engine *e, struct fi_cq_attr *attr, int *cq_fd)
{
    *cq_fd = -1;
    attr->wait_obj = getenv("PDF_EXPERIMENT_NO_FD") ? FI_WAIT_NONE : FI_WAIT_FD;
    int ret = getenv("PDF_EXPERIMENT_NO_FD") ? -1 : fi_cq_open(e->domain, attr, &e->cq, NULL);
    if (ret == 0) {
        int fd = -1;
        if (fi_control(&e->cq->fid, FI_GETWAIT, &fd) == 0 && fd >= 0) {
            *cq_fd = fd;
            return 0;
        }
        fi_close(&e->cq->fid);
        e->cq = NULL;
    }
    attr->wait_obj = FI_WAIT_NONE;
    return fi_cq_open(e->domain, attr, &e->cq, NULL);
}

/* pdf_open, step by step.  Each step fills what it opens into `e` (every field stays NULL / 0
 * until its step set it) and, on failure, names itself in `what`; pdf_open then hands the
 * partly opened engine to engine_destroy, the same teardown pdf_close uses. */

static void engine_destroy(pdf_engine *e);

/* 1 if `name` is one of the ", "-separated names in `names`. */
static int listed(const char *names, const char *name)
{
    size_t len = strlen(name);
    for (const char *p = names; *p;) {
        const char *end = strstr(p, ", ");
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, name, len) == 0)
            return 1;
        if (!end)
            break;
        p = end + 2;
    }
    return 0;
}

/* The first entry of `list` in the domain named `domain`, as a copy of its own (NULL: none, or no
 * memory, *nomem then set); `names` gets the domain names seen ("lo, eth0, ..."), truncated. */
static struct fi_info *pick_domain(struct fi_info *list, const char *domain, char *names, size_t nlen, int *nomem)
{
    size_t used = 0;
    names[0] = '\0';
    *nomem = 0;
    for (struct fi_info *i = list; i; i = i->next) {
        const char *name = i->domain_attr && i->domain_attr->name ? i->domain_attr->name : "";
        if (strcmp(name, domain) == 0) {
            struct fi_info *one = fi_dupinfo(i);
            *nomem = one == NULL;
            return one;
        }
        if (used + 1 < nlen && !listed(names, name)) {
            int w = snprintf(names + used, nlen - used, "%s%s", used ? ", " : "", name);
            used = w < 0 ? nlen : used + (size_t)w;
        }
    }
    return NULL;
}

/* fi_getinfo for an RDM endpoint with what we need (FI_DELIVERY_COMPLETE where the provider
 * accepts it: a local write completion then means the data is in the target's memory), the
 * MR modes we support, and the tx credit budget (tx_cap if lower than the provider's).
 * With `domain`, only an entry of that name is taken (pick_domain). */
static int open_info(pdf_engine *e, const char *prov, const char *node, const char *domain, int delivery_complete,
                     uint32_t tx_cap, char *what, size_t wlen)
{
    const char *n = (node && node[0]) ? node : NULL;
    const char *d = (domain && domain[0]) ? domain : NULL;
    char names[160] = "";
    int missing = 0; /* some attempt found entries, none in domain `d` */
    int ret = -FI_ENODATA;
    /* the most wanted first: write-after-write order, then delivery complete (if asked), then
     * FI_SOURCE; each given up in turn (WAW last to go: it is what makes a fence sound) */
    for (int attempt = 0; attempt < 8 && ret; attempt++) {
        int waw = attempt < 4;
        int dc = delivery_complete && attempt % 4 < 2;
        int src = attempt % 2 == 0;
        if (!delivery_complete && attempt % 4 >= 2)
            continue;
        struct fi_info *hints = make_hints(prov, d, dc, src, waw);
        if (!hints) {
            snprintf(what, wlen, "fi_allocinfo");
            return -FI_ENOMEM;
        }
        ret = fi_getinfo(FI_VERSION(1, 17), n, NULL, n ? FI_SOURCE : 0, hints, &e->info);
        fi_freeinfo(hints);
        if (ret == 0 && d) {
            int nomem = 0;
            struct fi_info *one = pick_domain(e->info, d, names, sizeof(names), &nomem);
            fi_freeinfo(e->info);
            e->info = one;
            if (nomem) {
                snprintf(what, wlen, "fi_dupinfo");
                return -FI_ENOMEM;
            }
            if (!one) {
                missing = 1;
                ret = -FI_ENODATA;
            }
        }
        if (ret == 0) {
            e->delivery_complete = dc && (e->info->tx_attr->op_flags & FI_DELIVERY_COMPLETE);
            e->source_addr = src && (e->info->caps & FI_SOURCE);
            /* shm (libfabric 1.17) names a sender by the sender's own AV index for us, not by
             * ours for it, which is only right by coincidence: never trusted (fabric.protocol) */
            if (strcmp(e->info->fabric_attr->prov_name, "shm") == 0)
                e->source_addr = 0;
        }
    }
    if (ret && missing) {
        snprintf(what, wlen, "fi_getinfo(provider=%s, node=%s): no domain named '%s' (the provider's: %s)",
                 prov ? prov : "", node ? node : "", d, names);
        return ret;
    }
    if (ret) {
        snprintf(what, wlen, "fi_getinfo(provider=%s, node=%s%s%s)", prov ? prov : "", node ? node : "",
                 d ? ", domain=" : "", d ? d : "");
        return ret;
    }
    e->mr_mode = e->info->domain_attr->mr_mode;
    if (e->mr_mode & (FI_MR_ENDPOINT | FI_MR_RAW)) {
        snprintf(what, wlen, "provider %s needs MR mode 0x%llx (FI_MR_ENDPOINT/FI_MR_RAW unsupported)",
                 e->info->fabric_attr->prov_name, (unsigned long long)e->mr_mode);
        return -FI_ENOSYS;
    }
    e->tx_credits = e->info->tx_attr->size;
    if (tx_cap && tx_cap < e->tx_credits)
        e->tx_credits = tx_cap;
    if (e->tx_credits == 0)
        e->tx_credits = 64;
    e->credits = e->tx_credits;
    return 0;
}

/* The fabric, the domain and the address vector. */
static int open_domain(pdf_engine *e, char *what, size_t wlen)
{
    int ret = fi_fabric(e->info->fabric_attr, &e->fabric, NULL);
    if (ret) {
        snprintf(what, wlen, "fi_fabric");
        return ret;
    }
    ret = fi_domain(e->fabric, e->info, &e->domain, NULL);
    if (ret) {
        snprintf(what, wlen, "fi_domain");
        return ret;
    }
    struct fi_av_attr av_attr;
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    av_attr.count = 64;
    ret = fi_av_open(e->domain, &av_attr, &e->av, NULL);
    if (ret)
        snprintf(what, wlen, "fi_av_open");
    return ret;
}

/* The completion queue, and the waiter the progress thread sleeps on (its wait fd, else the
 * doorbell `bell_name`, else timed sleeps: pdf_wait.h). */
static int open_cq_waiter(pdf_engine *e, const char *bell_name, char *what, size_t wlen)
{
    struct fi_cq_attr cq_attr;
    memset(&cq_attr, 0, sizeof(cq_attr));
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = e->info->tx_attr->size + e->info->rx_attr->size + 1024;
    int cq_fd = -1;
    int ret = open_cq(e, &cq_attr, &cq_fd);
    if (ret) {
        snprintf(what, wlen, "fi_cq_open");
        return ret;
    }
    ret = pdf_waiter_init(&e->waiter, cq_fd, bell_name);
    if (ret)
        snprintf(what, wlen, "eventfd for the progress thread");
    return ret;
}

/* The endpoint, bound to the AV and the CQ, enabled. */
static int open_ep(pdf_engine *e, char *what, size_t wlen)
{
    e->per_peer_tx = strcmp(e->info->fabric_attr->prov_name, "shm") == 0;
    /* with per-peer transmit endpoints the main one only sends control
     * messages: no delivery-complete wait on a peer that may be dead */
    struct fi_info *mi = fi_dupinfo(e->info);
    if (!mi) {
        snprintf(what, wlen, "fi_dupinfo");
        return -FI_ENOMEM;
    }
    if (e->per_peer_tx)
        mi->tx_attr->op_flags &= ~(uint64_t)FI_DELIVERY_COMPLETE;
    int ret = fi_endpoint(e->domain, mi, &e->ep, NULL);
    fi_freeinfo(mi);
    if (ret) {
        snprintf(what, wlen, "fi_endpoint");
        return ret;
    }
    ret = fi_ep_bind(e->ep, &e->av->fid, 0);
    if (ret) {
        snprintf(what, wlen, "fi_ep_bind(av)");
        return ret;
    }
    ret = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV);
    if (ret) {
        snprintf(what, wlen, "fi_ep_bind(cq)");
        return ret;
    }
    ret = fi_enable(e->ep);
    if (ret)
        snprintf(what, wlen, "fi_enable");
    return ret;
}

/* The control message pools: nrecv receive and send slots of msg_size bytes, registered, every
 * receive slot posted. */
static int open_control_pools(pdf_engine *e, uint32_t nrecv, uint32_t msg_size, char *what, size_t wlen)
{
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
        snprintf(what, wlen, "control message pools");
        return -FI_ENOMEM;
    }
    uint64_t access = FI_SEND | FI_RECV;
    int ret = fi_mr_reg(e->domain, e->recv_pool, pool, access, 0, (1ull << 62) + 1, 0, &e->recv_mr, NULL);
    if (ret) {
        snprintf(what, wlen, "fi_mr_reg(recv pool)");
        return ret;
    }
    ret = fi_mr_reg(e->domain, e->send_pool, pool, access, 0, (1ull << 62) + 2, 0, &e->send_mr, NULL);
    if (ret) {
        snprintf(what, wlen, "fi_mr_reg(send pool)");
        return ret;
    }
    e->recv_desc = fi_mr_desc(e->recv_mr);
    e->send_desc = fi_mr_desc(e->send_mr);
    for (uint32_t i = 0; i < e->nrecv; i++) {
        e->send_free[i] = i;
        ret = post_recv(e, i);
        if (ret) {
            snprintf(what, wlen, "fi_recv(slot %u)", i);
            return ret;
        }
    }
    e->send_free_n = e->nrecv;
    return 0;
}

/* shm only: the watchdog that releases region locks of dead peers (pdf_shm.h). */
static int start_watchdog(pdf_engine *e, char *what, size_t wlen)
{
    if (!e->per_peer_tx)
        return 0;
    int ret = pthread_create(&e->watchdog, NULL, watchdog_main, e);
    if (ret) {
        snprintf(what, wlen, "pthread_create(shm watchdog)");
        return -ret;
    }
    e->watchdog_on = 1;
    return 0;
}

int pdf_open(const char *prov, const char *node, const char *domain, uint32_t tx_cap, uint32_t nrecv,
             uint32_t msg_size, uint32_t spin_us, uint32_t busy_spin_us, uint32_t sleep_max_us,
             uint32_t peer_timeout_ms, int delivery_complete, int busy_poll, const char *bell_name,
             pdf_engine **out, char *err, size_t errlen)
{
    *out = NULL;
    pdf_engine *e = (pdf_engine *)calloc(1, sizeof(*e));
    if (!e)
        return -FI_ENOMEM;
    pthread_mutex_init(&e->lock, NULL);
    e->waiter.event_fd = -1;
    e->next_key = 1;

    char what[384] = "";
    int ret = open_info(e, prov, node, domain, delivery_complete, tx_cap, what, sizeof(what));
    if (!ret)
        ret = open_domain(e, what, sizeof(what));
    if (!ret)
        ret = open_cq_waiter(e, bell_name, what, sizeof(what));
    if (!ret)
        ret = open_ep(e, what, sizeof(what));
    if (!ret)
        ret = open_control_pools(e, nrecv, msg_size, what, sizeof(what));
    if (!ret)
        ret = start_watchdog(e, what, sizeof(what));
    if (ret) {
        set_err(err, errlen, what, ret);
        ext_lock(e);
        engine_destroy(e);
        return ret < 0 ? ret : -ret;
    }
    e->spin_ns = (uint64_t)spin_us * 1000ull;
    e->busy_spin_ns = (uint64_t)busy_spin_us * 1000ull;
    e->sleep_max_ns = (uint64_t)(sleep_max_us ? sleep_max_us : 1000) * 1000ull;
    e->peer_timeout_ns = (uint64_t)peer_timeout_ms * 1000000ull;
    e->busy_poll = busy_poll;
    *out = e;
    return 0;
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
    out->wait_mode = (uint32_t)e->waiter.mode;
    out->delivery_complete = (uint32_t)e->delivery_complete;
    out->source_addr = (uint32_t)e->source_addr;
    out->tx_msg_order = e->info->tx_attr->msg_order;
    out->rx_msg_order = e->info->rx_attr->msg_order;
    size_t len = PDF_ADDR_MAX;
    ext_lock(e);
    int ret = fi_getname(&e->ep->fid, out->addr, &len);
    unlock(e);
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
    unlock(e);
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
    unlock(e);
    return ret;
}

int pdf_av_insert(pdf_engine *e, const uint8_t *addr, uint32_t addrlen, uint64_t *fi_addr_out)
{
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    /* the provider reads as many bytes as its address format says (shm: up to the NUL); a name
     * from the network must hold them (fabric.descriptors.check_address checks the format) */
    if (addrlen < 1 || addrlen > PDF_ADDR_MAX)
        return -FI_EINVAL;
    if (strcmp(e->info->fabric_attr->prov_name, "shm") == 0 && memchr(addr, 0, addrlen) == NULL)
        return -FI_EINVAL;
    if (strcmp(e->info->fabric_attr->prov_name, "shm") != 0 && e->info->src_addrlen &&
        addrlen < e->info->src_addrlen)
        return -FI_EINVAL;
    ext_lock(e);
    int ret = fi_av_insert(e->av, addr, 1, &fa, 0, NULL);
    if (ret == 1) {
        pdf_peer *p = peer_get(e, fa);
        if (p) {
            p->failed = 0;
            p->last_progress_ns = now_ns();
            forget_local(p); /* the caller says again who it is (pdf_peer_local) */
        }
    }
    unlock(e);
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
    unlock(e);
    return ret;
}

static void wake(pdf_engine *e)
{
    pdf_waiter_wake(&e->waiter);
}

/* Peer `peer` runs on this host as process `pid`: watch for its exit
 * (pidfd) and, in BELL mode, map its doorbell (`bell_name`) so that posts
 * to it can wake it.  Returns 0, or a negative error if neither worked. */
int pdf_peer_local(pdf_engine *e, uint64_t peer, int pid, const char *bell_name)
{
    int pidfd = pid > 0 ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
    uint32_t *bell = NULL;
    if (e->waiter.mode == PDF_WAIT_BELL && bell_name && bell_name[0])
        bell = pdf_bell_open(bell_name);
    ext_lock(e);
    pdf_peer *p = peer_get(e, peer);
    if (p) {
        if (pidfd >= 0 && !p->has_pidfd) {
            p->pidfd = pidfd;
            p->has_pidfd = 1;
            pidfd = -1;
        }
        if (bell && !p->bell) {
            p->bell = bell;
            bell = NULL;
        }
    }
    int ok = p && p->has_pidfd && (p->bell || e->waiter.mode != PDF_WAIT_BELL);
    unlock(e);
    if (pidfd >= 0)
        close(pidfd);
    pdf_bell_close(bell);
    return ok ? 0 : -FI_ENOENT;
}

static void forget_local(pdf_peer *p)
{
    if (p->has_pidfd)
        close(p->pidfd);
    p->has_pidfd = 0;
    pdf_bell_close(p->bell);
    p->bell = NULL;
}

/* How many region locks of dead shm peers the watchdog released. */
uint64_t pdf_locks_released(pdf_engine *e)
{
    return __atomic_load_n(&e->locks_released, __ATOMIC_SEQ_CST);
}

/* Make pdf_progress return after one more full round (Python's quiesce). */
void pdf_poke(pdf_engine *e)
{
    ext_lock(e);
    e->poke = 1;
    wake(e);
    unlock(e);
}

/* Validate a batch before anything is queued: every length >= 1 (and at
 * most max_len when max_len != 0), every [offset, offset + length) inside
 * its region, without overflow.  Returns -1 if all is well, else the index
 * of the first bad entry with *what = PDF_BAD_* ; *total gets the bytes. */
int64_t pdf_check_writes(const uint64_t *src, const uint64_t *dst, const uint64_t *len, uint32_t n,
                         uint64_t src_size, uint64_t dst_size, uint64_t max_len, int *what, uint64_t *total)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t l = len[i];
        if (l < 1 || (max_len && l > max_len)) {
            *what = l < 1 ? PDF_BAD_SHORT : PDF_BAD_LONG;
            return i;
        }
        if (src[i] > src_size || l > src_size - src[i]) {
            *what = PDF_BAD_SRC;
            return i;
        }
        if (dst[i] > dst_size || l > dst_size - dst[i]) {
            *what = PDF_BAD_DST;
            return i;
        }
        sum += l;
    }
    *total = sum;
    return -1;
}

/* An idle engine posts the first writes of a new batch on the submitting
 * thread: the progress thread is likely asleep, and waking it first would
 * add its wake-up to every lone write's latency.  It is woken right after,
 * to poll for the completions.  Busy engines leave posting to it (order,
 * fairness between peers).  Called with the lock held. */
#define PDF_INLINE_WRITES 4

static void post_inline(pdf_engine *e, pdf_batch *b)
{
    if (e->stop || e->pend_head != b || e->act_head || e->sact_head || e->active_ops)
        return;
    pdf_peer *p = peer_get(e, b->peer);
    if (!p || p->failed)
        return;
    take_pending(e);
    int eagain = 0, posted = 0;
    while (posted < PDF_INLINE_WRITES && b->next < b->n && e->credits > 0 &&
           post_one_write(e, b, p, NULL, &eagain) == 1)
        posted++;
    if (posted && p->bell)
        pdf_bell_ring(p->bell);
}

/* Queue a batch of writes.  The arrays are copied and runs contiguous at
 * both ends are merged into one write of at most max_write bytes (0: no
 * limit).  With imm_mode EVERY a merged write also carries the number of
 * entries it holds (at most PDF_IMM_UNIT_MAX), and entries are never split
 * (the caller checked len <= max_write); otherwise an entry longer than
 * max_write is split.  Returns the number of writes the batch was turned
 * into, or a negative error. */
static int64_t build_batch(uint64_t id, uint64_t peer, uint64_t local_base, uint64_t desc,
                           uint64_t remote_base, uint64_t rkey, const uint64_t *src, const uint64_t *dst,
                           const uint64_t *len, uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write,
                           int coalesce, pdf_batch **out)
{
    *out = NULL;
    if (n == 0)
        return -FI_EINVAL;
    if (imm > PDF_IMM_TAG_MAX)
        return -FI_EINVAL;
    if (!max_write)
        max_write = UINT64_MAX;
    int every = imm_mode == PDF_IMM_EVERY;
    uint64_t cap = n;
    if (!every)
        for (uint32_t i = 0; i < n; i++)
            if (len[i] > max_write)
                cap += len[i] / max_write;
    pdf_batch *b = (pdf_batch *)calloc(1, sizeof(*b));
    uint64_t *arr = (uint64_t *)malloc(sizeof(uint64_t) * 4 * cap);
    if (!b || !arr) {
        free(b);
        free(arr);
        return -FI_ENOMEM;
    }
    b->src = arr;
    b->dst = arr + cap;
    b->len = arr + 2 * cap;
    b->units = arr + 3 * cap;
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t s = src[i], d = dst[i], l = len[i];
        if (coalesce && m > 0 && b->src[m - 1] + b->len[m - 1] == s && b->dst[m - 1] + b->len[m - 1] == d &&
            l <= max_write - b->len[m - 1] && (!every || b->units[m - 1] < PDF_IMM_UNIT_MAX)) {
            b->len[m - 1] += l;
            b->units[m - 1]++;
            continue;
        }
        while (!every && l > max_write) {
            b->src[m] = s;
            b->dst[m] = d;
            b->len[m] = max_write;
            b->units[m] = 1;
            m++;
            s += max_write;
            d += max_write;
            l -= max_write;
        }
        b->src[m] = s;
        b->dst[m] = d;
        b->len[m] = l;
        b->units[m] = 1;
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
    *out = b;
    return m;
}

static void free_batch(pdf_batch *b)
{
    free(b->src);
    free(b);
}

/* Queue a built batch (and post its first writes if the engine is idle).
 * Called with the lock held; -FI_ESHUTDOWN once the engine stops. */
static int enqueue_batch(pdf_engine *e, pdf_batch *b)
{
    if (e->stop)
        return -FI_ESHUTDOWN;
    if (e->pend_tail)
        e->pend_tail->link = b;
    else
        e->pend_head = b;
    e->pend_tail = b;
    post_inline(e, b);
    return 0;
}

int64_t pdf_submit_writes(pdf_engine *e, uint64_t id, uint64_t peer, uint64_t local_base, uint64_t desc,
                          uint64_t remote_base, uint64_t rkey, const uint64_t *src, const uint64_t *dst,
                          const uint64_t *len, uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write,
                          int coalesce)
{
    pdf_batch *b;
    int64_t m = build_batch(id, peer, local_base, desc, remote_base, rkey, src, dst, len, n, imm, imm_mode,
                            max_write, coalesce, &b);
    if (m < 0)
        return m;
    ext_lock(e);
    int ret = enqueue_batch(e, b);
    if (!ret)
        wake(e);
    unlock(e);
    if (ret) {
        free_batch(b);
        return ret;
    }
    return m;
}

/* ------------------------------------------------------ synchronous writes */

/* Events a synchronous caller's round may produce at most (poll_cq keeps
 * PDF_CQ_BATCH * 3 + 8 free before it reads). */
#define PDF_SYNC_EVCAP 512
#define PDF_DEFER_MAX (1u << 16)

/* Make room for `k` more deferred events.  Lock held.  0 if there is none
 * (then the caller leaves polling to the progress thread). */
static int defer_reserve(pdf_engine *e, uint32_t k)
{
    if (e->cap_defer - e->ndefer >= k)
        return 1;
    uint32_t cap = e->cap_defer ? e->cap_defer : 1024;
    while (cap - e->ndefer < k)
        cap *= 2;
    if (cap > PDF_DEFER_MAX)
        return 0;
    pdf_event *d = (pdf_event *)realloc(e->defer, sizeof(pdf_event) * cap);
    if (!d)
        return 0;
    e->defer = d;
    e->cap_defer = cap;
    return 1;
}

/* Post a batch and wait for it on the calling thread (which has released
 * the GIL): the lone-write path, without the two thread hops of
 * pdf_submit_writes (progress thread -> Python callback -> waiting thread).
 *
 * The caller first runs progress rounds itself for up to spin_us (posting
 * the rest of its batch, polling the CQ, ringing the target's doorbell);
 * events for anything else that those rounds produce are deferred to the
 * progress thread, which is woken to hand them to Python.  Once the spin
 * budget is spent it wakes the progress thread to take over and sleeps on
 * a futex until the batch's outcome is set, or timeout_us passes (< 0: no
 * limit): then the batch is detached and reports through the ordinary
 * events, under its id, like any pdf_submit_writes batch.
 *
 * Returns 0 with *res filled, or a negative error before anything was
 * queued. */
int pdf_write_sync(pdf_engine *e, uint64_t id, uint64_t peer, uint64_t local_base, uint64_t desc,
                   uint64_t remote_base, uint64_t rkey, const uint64_t *src, const uint64_t *dst,
                   const uint64_t *len, uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write, int coalesce,
                   uint32_t spin_us, int64_t timeout_us, pdf_sync_result *res)
{
    memset(res, 0, sizeof(*res));
    pdf_batch *b;
    int64_t m = build_batch(id, peer, local_base, desc, remote_base, rkey, src, dst, len, n, imm, imm_mode,
                            max_write, coalesce, &b);
    if (m < 0)
        return (int)m;
    b->sync = 1;
    res->writes = m;
    uint64_t t0 = now_ns();
    uint64_t spin_end = t0 + (uint64_t)spin_us * 1000ull;
    uint64_t deadline = timeout_us < 0 ? UINT64_MAX : t0 + (uint64_t)timeout_us * 1000ull;
    ext_lock(e);
    int ret = enqueue_batch(e, b);
    if (ret) {
        unlock(e);
        free_batch(b);
        return ret;
    }
    e->sync_waiters++;
    unlock(e);

    pdf_event local[PDF_SYNC_EVCAP];
    uint64_t t = t0;
    for (;;) {
        ext_lock(e);
        if (b->outcome || e->stop || t >= spin_end || !defer_reserve(e, PDF_SYNC_EVCAP)) {
            unlock(e);
            break;
        }
        evbuf out = {local, PDF_SYNC_EVCAP, 0};
        run_round(e, &out, &t);
        res->rounds++;
        if (out.n) {
            memcpy(e->defer + e->ndefer, local, sizeof(pdf_event) * (size_t)out.n);
            e->ndefer += (uint32_t)out.n;
            wake(e);
        }
        int got = b->outcome != PDF_SYNC_PENDING;
        unlock(e);
        if (got)
            break;
        if ((res->rounds & 15) == 0)
            sched_yield(); /* a target on this core must get to run */
    }
    res->spin_ns = now_ns() - t0;

    ext_lock(e);
    if (!b->outcome) {
        /* the progress thread takes over polling; sleep until it is done */
        b->sleeping = 1;
        res->slept = 1;
        wake(e);
    }
    unlock(e);
    while (!__atomic_load_n(&b->word, __ATOMIC_SEQ_CST)) {
        t = now_ns();
        if (t >= deadline)
            break;
        uint64_t left = deadline - t;
        if (left > 1000000000ull)
            left = 1000000000ull;
        struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
        syscall(SYS_futex, &b->word, FUTEX_WAIT_PRIVATE, 0, &ts, NULL, 0);
    }
    ext_lock(e);
    if (b->outcome) {
        res->status = (uint32_t)b->outcome;
        res->code = b->code;
        res->missing = b->missing;
    } else {
        res->status = PDF_SYNC_TIMEOUT; /* detached: reports as an event later */
    }
    b->sync = 0; /* sweep frees it once nothing of it is in flight */
    b->sleeping = 0;
    e->sync_waiters--;
    sweep(e); /* now, so that the next batch finds the engine idle and posts inline */
    unlock(e);
    return 0;
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
        unlock(e);
        free(s);
        return -FI_ESHUTDOWN;
    }
    if (e->spend_tail)
        e->spend_tail->link = s;
    else
        e->spend_head = s;
    e->spend_tail = s;
    wake(e);
    unlock(e);
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
    unlock(e);
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
    unlock(e);
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
    unlock(e);
    return n;
}

/* Fail everything still queued or in flight with `code` (used at close). */
int pdf_fail_all(pdf_engine *e, int code, pdf_event *ev, int cap)
{
    evbuf out = {ev, cap, 0};
    ext_lock(e);
    /* events synchronous callers left for the progress thread, which has stopped */
    uint32_t k = e->ndefer < (uint32_t)(cap - 1) ? e->ndefer : (uint32_t)(cap - 1);
    if (k) {
        memcpy(out.ev, e->defer, sizeof(pdf_event) * k);
        out.n = (int)k;
        memmove(e->defer, e->defer + k, sizeof(pdf_event) * (e->ndefer - k));
        e->ndefer -= k;
    }
    take_pending(e);
    for (pdf_batch *b = e->act_head; b && out.n < cap - 1; b = b->link)
        if (!b->reported)
            batch_fail(e, b, code, &out);
    for (pdf_send *s = e->sact_head; s && out.n < cap - 1; s = s->link)
        if (!s->reported) {
            s->reported = 1;
            ev_push(&out, PDF_EV_SEND_FAILED, code, s->id, 0, s->peer);
        }
    unlock(e);
    return out.n;
}

void pdf_stop(pdf_engine *e)
{
    ext_lock(e);
    e->stop = 1;
    wake(e);
    unlock(e);
}

/* One round of progress, with the lock held: post what the credits allow,
 * poll the CQ, judge peers, free finished batches, ring peers that must
 * move our data.  Returns how much it did; *t gets the time it polled. */
static int run_round(pdf_engine *e, evbuf *out, uint64_t *t)
{
    take_pending(e);
    int eagain = 0;
    int did = post_work(e, out, &eagain);
    did += poll_cq(e, out);
    if (eagain)
        did += post_work(e, out, &eagain);
    *t = now_ns();
    check_timeouts(e, out, *t);
    sweep(e);
    if (e->waiter.mode == PDF_WAIT_BELL)
        ring_peers(e);
    return did;
}

/* Move events that pdf_write_sync callers produced into `out`, keeping
 * poll_cq's reserve.  Lock held.  Returns how many moved. */
static int drain_defer(pdf_engine *e, evbuf *out)
{
    uint32_t room = 0, k = 0;
    if (out->cap - out->n > PDF_CQ_BATCH * 3 + 16)
        room = (uint32_t)(out->cap - out->n - (PDF_CQ_BATCH * 3 + 16));
    k = e->ndefer < room ? e->ndefer : room;
    if (!k)
        return 0;
    memcpy(out->ev + out->n, e->defer, sizeof(pdf_event) * k);
    out->n += (int)k;
    memmove(e->defer, e->defer + k, sizeof(pdf_event) * (e->ndefer - k));
    e->ndefer -= k;
    return (int)k;
}

/* Sleep until woken or `timeout_ns` passes.  The caller armed the waiter
 * and has since polled the CQ once and found nothing.  With a wait fd,
 * fi_trywait() must agree first (else the provider has work to drive). */
static void block(pdf_engine *e, uint64_t timeout_ns)
{
    if (e->waiter.mode == PDF_WAIT_FD) {
        lock(e);
        struct fid *fids[1] = {&e->cq->fid};
        int ok = !e->stop && !e->poke && fi_trywait(e->fabric, fids, 1) == FI_SUCCESS;
        unlock(e);
        if (!ok)
            return;
    }
    pdf_waiter_block(&e->waiter, timeout_ns);
}

/* Run the progress engine until at least one event is ready (then keep
 * gathering briefly so that bursts come back together), stop or pdf_poke is
 * requested, or timeout_us passes.  Returns the number of events written to
 * ev (cap must be >= 256).
 *
 * Waiting: while operations are outstanding it spins (yielding now and then)
 * for up to busy_spin_us without progress, then sleeps in steps growing to
 * sleep_max_us (a slow or dead peer must not cost a core).  Idle, it spins for spin_us after the last activity, then
 * sleeps until work arrives (wait fd, doorbell or local submission; timed
 * steps where the provider offers neither). */
int pdf_progress(pdf_engine *e, pdf_event *ev, int cap, int64_t timeout_us)
{
    evbuf out = {ev, cap, 0};
    uint64_t start = now_ns();
    uint64_t deadline = start + (uint64_t)(timeout_us > 0 ? timeout_us : 0) * 1000ull;
    uint64_t first_ev = 0;
    uint64_t step_ns = 20000;
    unsigned spins = 0;
    int armed = 0;
    for (;;) {
        lock(e);
        int before = out.n;
        int did = drain_defer(e, &out);
        uint64_t t;
        did += run_round(e, &out, &t);
        int busy = e->active_ops > 0 || e->act_head != NULL || e->sact_head != NULL;
        int stop = e->stop;
        int poke = e->poke;
        e->poke = 0;
        unlock(e);
        if (__atomic_load_n(&e->waiters, __ATOMIC_SEQ_CST)) {
            uint64_t t0 = now_ns();
            while (__atomic_load_n(&e->waiters, __ATOMIC_SEQ_CST) && now_ns() - t0 < 2000000ull)
                sched_yield();
        }
        if (did || out.n > before) {
            e->last_activity_ns = t;
            step_ns = 20000;
        }
        if (armed && (did || out.n > before || stop || poke)) {
            pdf_waiter_disarm(&e->waiter);
            armed = 0;
        }
        if (stop || poke) {
            if (armed)
                pdf_waiter_disarm(&e->waiter);
            return out.n;
        }
        if (out.n > 0) {
            if (!first_ev)
                first_ev = t;
            /* return once the burst pauses, the buffer fills, or 100us pass */
            if (out.n == before || out.cap - out.n < PDF_CQ_BATCH * 3 + 16 || t - first_ev > 100000ull) {
                if (armed)
                    pdf_waiter_disarm(&e->waiter);
                return out.n;
            }
        }
        if (t >= deadline) {
            if (armed)
                pdf_waiter_disarm(&e->waiter);
            return out.n;
        }
        if (did)
            continue;
        uint64_t quiet = t - e->last_activity_ns;
        if (busy && quiet < e->busy_spin_ns) {
            if ((++spins & 63) == 0)
                sched_yield(); /* let the other side run on small machines */
            continue;
        }
        if (!busy && quiet < e->spin_ns)
            continue;
        if (e->busy_poll) {
            if ((++spins & 63) == 0)
                sched_yield();
            continue;
        }
        if (!armed) {
            /* announce the sleep, then look once more before sleeping */
            pdf_waiter_arm(&e->waiter);
            armed = 1;
            continue;
        }
        uint64_t limit = deadline - t;
        if (busy || e->waiter.mode == PDF_WAIT_SLEEP) {
            /* remote progress cannot wake us here: sleep in growing steps */
            if (limit > step_ns)
                limit = step_ns;
            step_ns *= 2;
            if (step_ns > e->sleep_max_ns)
                step_ns = e->sleep_max_ns;
        }
        block(e, limit);
        pdf_waiter_disarm(&e->waiter);
        armed = 0;
    }
}

/* Close the endpoint only (then the caller closes its own MRs). */
static void close_peer_eps(pdf_engine *e)
{
    for (uint64_t i = 0; i < e->npeers; i++)
        if (e->peers[i].tx_ep) {
            fi_close(&e->peers[i].tx_ep->fid);
            e->peers[i].tx_ep = NULL;
        }
}

void pdf_close_ep(pdf_engine *e)
{
    ext_lock(e);
    close_peer_eps(e);
    if (e->ep)
        fi_close(&e->ep->fid);
    e->ep = NULL;
    unlock(e);
}

/* The one teardown of an engine, for pdf_close and for a pdf_open that failed part way: every
 * libfabric object it holds (the endpoints before the MRs, CQ and AV they use, the domain and
 * fabric last), the queues, pools and peers, the waiter, then the watchdog and the engine
 * itself.  Called with the engine lock held (it is released here): the shm watchdog keeps
 * running until the objects are closed, so a close that finds a dead peer's region lock held
 * is released by it. */
static void engine_destroy(pdf_engine *e)
{
    close_peer_eps(e);
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
    take_pending(e);
    for (pdf_batch *b = e->act_head; b;) {
        pdf_batch *nx = b->link;
        free_batch(b);
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
    free(e->defer);
    for (uint64_t i = 0; i < e->npeers; i++)
        forget_local(&e->peers[i]);
    free(e->peers);
    pdf_waiter_fini(&e->waiter);
    unlock(e);
    if (e->watchdog_on) {
        __atomic_store_n(&e->watchdog_stop, 1, __ATOMIC_SEQ_CST);
        pthread_join(e->watchdog, NULL);
    }
    pthread_mutex_destroy(&e->lock);
    free(e);
}

/* Close everything.  The progress thread must have returned for good.  Callers still inside
 * pdf_write_sync are waited for: pdf_fail_all gave their batches an outcome, so each leaves
 * within its next wake-up. */
void pdf_close(pdf_engine *e)
{
    if (!e)
        return;
    ext_lock(e);
    while (e->sync_waiters) {
        unlock(e);
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
        ext_lock(e);
    }
    engine_destroy(e);
}
