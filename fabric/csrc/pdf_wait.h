/*
 * pdf_wait.h - how the progress thread sleeps without missing work.
 *
 * The progress thread must wake for three things: work submitted by a local
 * thread, completions of its own operations, and operations that peers post
 * to it (rxm and shm make progress only while the target polls its CQ).  A
 * pdf_waiter picks the best mechanism the provider allows:
 *
 *   PDF_WAIT_FD    the CQ has a wait fd (FI_WAIT_FD: tcp, verbs): poll() on
 *                  it and on an eventfd for local submissions, after
 *                  fi_trywait() said that sleeping is safe.
 *   PDF_WAIT_BELL  no wait fd (shm): a doorbell word in a small shared-memory
 *                  file named after the engine.  The sleeper stores 1, checks
 *                  its CQ once more, then futex-waits on the word; a local
 *                  submitter or a peer on the same host that just posted to
 *                  it swaps the word back to 0 and futex-wakes it.  Both
 *                  sides order their store before their load (seq_cst), so
 *                  one of them always sees the other: no lost wake-up.
 *   PDF_WAIT_SLEEP neither (e.g. a provider without wait objects whose peers
 *                  are on other hosts): timed sleeps, woken early by local
 *                  submissions only.
 *
 * Arming is two-phase: pdf_waiter_arm() announces the sleep, the caller
 * polls its CQ one more time, and only if that found nothing calls
 * pdf_waiter_block().  pdf_waiter_disarm() ends the sleep either way.
 */
#ifndef PDF_WAIT_H
#define PDF_WAIT_H

#include <stdint.h>

/* The mode a waiter picked (pdf_info.wait_mode; fabric/_ffi_build.py binds these). */
/* cffi:begin */
#define PDF_WAIT_SLEEP 0
#define PDF_WAIT_FD 1
#define PDF_WAIT_BELL 2
/* cffi:end */

typedef struct pdf_waiter {
    int mode;
    int event_fd;       /* local wake-ups (FD and SLEEP modes) */
    int cq_fd;          /* the provider's CQ wait fd (FD mode), else -1 */
    int sleeping;       /* FD and SLEEP modes: armed (atomic) */
    uint32_t *bell;     /* BELL mode: the shared doorbell word, else NULL */
    char bell_name[128];
} pdf_waiter;

/* Pick the mode: FD if cq_fd >= 0, else BELL if bell_name names a shared
 * memory object that can be created, else SLEEP.  Returns 0 or -errno. */
int pdf_waiter_init(pdf_waiter *w, int cq_fd, const char *bell_name);
void pdf_waiter_fini(pdf_waiter *w);

void pdf_waiter_arm(pdf_waiter *w);
void pdf_waiter_disarm(pdf_waiter *w);
/* Sleep until woken or timeout_ns passes.  FD mode: the caller has just had
 * fi_trywait() return 0. */
void pdf_waiter_block(pdf_waiter *w, uint64_t timeout_ns);
/* Wake the owner if it is armed (any thread, any lock held). */
void pdf_waiter_wake(pdf_waiter *w);

/* A peer's doorbell (same host, BELL mode): map, ring if it sleeps, unmap. */
uint32_t *pdf_bell_open(const char *bell_name);
int pdf_bell_ring(uint32_t *bell);
void pdf_bell_close(uint32_t *bell);

#endif
