/*
 * The CPU ops' thread pool (pool.h). Why not OpenMP: a parallel region ends at a barrier every
 * team thread must reach, so on a machine whose cores are shared with other processes a call
 * waits for a thread the OS has not scheduled yet: one scheduler time slice (milliseconds) for a
 * product that takes microseconds. On the 2-core shared VM of bench/results/engine/ a batch-1
 * decode step's 121 products then took 10x their time in some minutes. Here the caller waits
 * only for items a worker has claimed (each small), never for a worker to arrive.
 *
 * One job at a time (a second caller while a job runs computes its job inline):
 *   claim: generation | lo | hi, the unclaimed items [lo, hi); claimed by compare-and-swap, so a
 *          worker holding a stale generation cannot claim an item of a newer job (unless it
 *          slept through exactly 2^24 jobs between two loads);
 *   gen:   the generation last published, the futex word idle workers sleep on;
 *   done:  items finished in the current job, each thread's added when it finds nothing left to
 *          claim (the caller returns when it reaches n).
 * Publishing: close the claim word under the new generation (lo = hi = 0), write the job, open
 * it (hi = n), then store gen and wake sleepers. Every shared word is accessed with sequentially
 * consistent atomics: a handful per call, and the reasoning stays simple.
 *
 * Workers start lazily (up to the largest thread count asked for, MAX_WORKERS at most), spin
 * about SPIN_ROUNDS pause instructions (~0.1-0.3 ms) after their last item, then sleep on the futex.
 * A child process after fork() starts with no workers (pthread_atfork) and runs jobs inline
 * until it asks for threads again.
 */
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_WORKERS 64
#define SPIN_ROUNDS 4096
#define ITEM_BITS 20 /* items per job < 2^20 (a larger job runs inline) */

static struct {
    pool_item_fn fn;
    void *arg;
    int threads;
} job;

/* Each shared word on its own cache line: the claim word bounces between the cores at every item;
 * the others must not bounce with it. */
static _Alignas(64) uint64_t claim;
static _Alignas(64) uint32_t gen;
static _Alignas(64) int64_t done;
static _Alignas(64) int sleepers;
static int nworkers;
static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The claim word: generation (24 bits) | lo (20 bits) | hi (20 bits); [lo, hi) is unclaimed. */
#define GEN_BITS 24
#define GEN_MASK ((1u << GEN_BITS) - 1)
#define ITEM_MASK ((1u << ITEM_BITS) - 1)
static inline uint64_t claim_word(uint32_t g, uint32_t lo, uint32_t hi) {
    return ((uint64_t)(g & GEN_MASK) << (2 * ITEM_BITS)) | ((uint64_t)lo << ITEM_BITS) | hi;
}

/*
 * Claim and run items of generation g until none is left: the caller (front) from lo upwards, the
 * workers (back) from hi downwards, so that with two threads each reads one contiguous run of the
 * job's items (a weight matrix's rows), as a static split would, and the split point still moves
 * to wherever the two meet.
 */
static void work(uint32_t g, pool_item_fn fn, void *arg, int front) {
    int64_t ran = 0; /* added to `done` once, when nothing is left to claim */
    for (;;) {
        uint64_t c = LOAD(&claim);
        const uint32_t lo = (uint32_t)(c >> ITEM_BITS) & ITEM_MASK, hi = (uint32_t)c & ITEM_MASK;
        if ((uint32_t)(c >> (2 * ITEM_BITS)) != (g & GEN_MASK) || lo >= hi) break;
        const uint64_t next = front ? claim_word(g, lo + 1, hi) : claim_word(g, lo, hi - 1);
        if (!__atomic_compare_exchange_n(&claim, &c, next, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) continue;
        fn(arg, front ? (int64_t)lo : (int64_t)hi - 1);
        ran++;
    }
    if (ran) __atomic_add_fetch(&done, ran, __ATOMIC_SEQ_CST);
}

static void *worker(void *p) {
    const int index = (int)(intptr_t)p; /* worker i is the job's thread i + 1 */
    uint32_t seen = LOAD(&gen);
    for (;;) {
        uint32_t g = LOAD(&gen);
        for (int spin = 0; g == seen && spin < SPIN_ROUNDS; spin++) {
            cpu_pause();
            g = LOAD(&gen);
        }
        if (g == seen) {
            __atomic_add_fetch(&sleepers, 1, __ATOMIC_SEQ_CST);
            syscall(SYS_futex, &gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0); /* returns at once if gen moved */
            __atomic_sub_fetch(&sleepers, 1, __ATOMIC_SEQ_CST);
            continue;
        }
        seen = g;
        pool_item_fn fn = LOAD(&job.fn);
        void *arg = LOAD(&job.arg);
        if (index + 1 < LOAD(&job.threads)) work(g, fn, arg, 0); /* a stale read fails work()'s claim */
    }
    return NULL;
}

static void after_fork_child(void) {
    nworkers = 0; /* the parent's workers do not exist here */
    sleepers = 0;
    pthread_mutex_init(&run_lock, NULL);
    pthread_mutex_init(&start_lock, NULL);
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Start workers up to `want` (fewer if the OS refuses: the jobs still complete). */
static void ensure_workers(int want) {
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    if (LOAD(&nworkers) >= want) return;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&start_lock);
    while (nworkers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)nworkers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        STORE(&nworkers, nworkers + 1);
    }
    pthread_mutex_unlock(&start_lock);
}

void pool_run(pool_item_fn fn, void *arg, int64_t n, int threads) {
    if (n <= 0) return;
    if (threads <= 1 || n == 1 || n > (int64_t)ITEM_MASK || pthread_mutex_trylock(&run_lock) != 0) {
        for (int64_t i = 0; i < n; i++) fn(arg, i);
        return;
    }
    ensure_workers(threads - 1);
    const uint32_t g = LOAD(&gen) + 1;
    STORE(&claim, claim_word(g, 0, 0)); /* closed: nothing to claim under the new generation */
    STORE(&job.fn, fn);
    STORE(&job.arg, arg);
    STORE(&job.threads, threads);
    STORE(&done, 0);
    STORE(&claim, claim_word(g, 0, (uint32_t)n));
    STORE(&gen, g);
    if (LOAD(&sleepers) > 0) syscall(SYS_futex, &gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(g, fn, arg, 1);
    /* Only items a worker claimed are left: each takes microseconds unless its thread is preempted. */
    for (int spin = 0; LOAD(&done) < n; spin++) {
        if (spin < SPIN_ROUNDS)
            cpu_pause();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&run_lock);
}
