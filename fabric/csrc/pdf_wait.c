/*
 * pdf_wait.c - the progress thread's sleeping and waking (see pdf_wait.h).
 */
#define _GNU_SOURCE
#include "pdf_wait.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BELL_BYTES 4096

static long futex(uint32_t *word, int op, uint32_t val, const struct timespec *ts)
{
    /* not FUTEX_PRIVATE_FLAG: the word is shared between processes */
    return syscall(SYS_futex, word, op, val, ts, NULL, 0);
}

static void drain_eventfd(int fd)
{
    uint64_t v;
    while (read(fd, &v, sizeof(v)) == (ssize_t)sizeof(v))
        ;
}

int pdf_waiter_init(pdf_waiter *w, int cq_fd, const char *bell_name)
{
    memset(w, 0, sizeof(*w));
    w->cq_fd = cq_fd;
    w->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->event_fd < 0)
        return -errno;
    if (cq_fd >= 0) {
        w->mode = PDF_WAIT_FD;
        return 0;
    }
    w->mode = PDF_WAIT_SLEEP;
    if (!bell_name || !bell_name[0])
        return 0;
    int fd = shm_open(bell_name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return 0; /* no doorbell: peers cannot wake us, timed sleeps it is */
    void *p = MAP_FAILED;
    if (ftruncate(fd, BELL_BYTES) == 0)
        p = mmap(NULL, BELL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(bell_name);
        return 0;
    }
    w->bell = (uint32_t *)p;
    snprintf(w->bell_name, sizeof(w->bell_name), "%s", bell_name);
    w->mode = PDF_WAIT_BELL;
    return 0;
}

void pdf_waiter_fini(pdf_waiter *w)
{
    if (w->event_fd >= 0)
        close(w->event_fd);
    w->event_fd = -1;
    if (w->bell) {
        munmap(w->bell, BELL_BYTES);
        shm_unlink(w->bell_name);
        w->bell = NULL;
    }
}

void pdf_waiter_arm(pdf_waiter *w)
{
    if (w->mode == PDF_WAIT_BELL)
        __atomic_store_n(w->bell, 1, __ATOMIC_SEQ_CST);
    else
        __atomic_store_n(&w->sleeping, 1, __ATOMIC_SEQ_CST);
}

void pdf_waiter_disarm(pdf_waiter *w)
{
    if (w->mode == PDF_WAIT_BELL)
        __atomic_store_n(w->bell, 0, __ATOMIC_SEQ_CST);
    else
        __atomic_store_n(&w->sleeping, 0, __ATOMIC_SEQ_CST);
}

void pdf_waiter_block(pdf_waiter *w, uint64_t timeout_ns)
{
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    if (w->mode == PDF_WAIT_BELL) {
        /* returns at once if someone already swapped the word to 0 */
        futex(w->bell, FUTEX_WAIT, 1, &ts);
        return;
    }
    struct pollfd fds[2] = {{w->event_fd, POLLIN, 0}, {w->cq_fd, POLLIN, 0}};
    int nfds = w->mode == PDF_WAIT_FD ? 2 : 1;
    int ms = (int)((timeout_ns + 999999ull) / 1000000ull);
    if (ms < 1)
        ms = 1;
    if (w->mode == PDF_WAIT_SLEEP && timeout_ns < 1000000ull) {
        /* sub-millisecond back-off: poll() cannot, ppoll() can */
        ppoll(fds, 1, &ts, NULL);
    } else {
        poll(fds, nfds, ms);
    }
    if (fds[0].revents & POLLIN)
        drain_eventfd(w->event_fd);
}

void pdf_waiter_wake(pdf_waiter *w)
{
    if (w->mode == PDF_WAIT_BELL) {
        pdf_bell_ring(w->bell);
        return;
    }
    if (__atomic_exchange_n(&w->sleeping, 0, __ATOMIC_SEQ_CST)) {
        uint64_t one = 1;
        ssize_t r = write(w->event_fd, &one, sizeof(one));
        (void)r; /* EAGAIN: the counter is already non-zero, a wake-up is pending */
    }
}

uint32_t *pdf_bell_open(const char *bell_name)
{
    int fd = shm_open(bell_name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
        return NULL;
    struct stat st;
    void *p = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size >= BELL_BYTES)
        p = mmap(NULL, BELL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? NULL : (uint32_t *)p;
}

int pdf_bell_ring(uint32_t *bell)
{
    /* order our post (the caller's stores into the peer's queue) before the
     * load of the word; pairs with the sleeper's seq_cst store in arm() */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(bell, __ATOMIC_SEQ_CST) == 0)
        return 0;
    uint32_t one = 1;
    if (!__atomic_compare_exchange_n(bell, &one, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return 0;
    futex(bell, FUTEX_WAKE, 1, NULL);
    return 1;
}

void pdf_bell_close(uint32_t *bell)
{
    if (bell)
        munmap(bell, BELL_BYTES);
}
