/*
 * pdf_shm.c - find and release shm region locks held by dead processes
 * (see pdf_shm.h for why).
 */
#define _GNU_SOURCE
#include "pdf_shm.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#define SHM_REGION_VERSION 4 /* struct smr_region of libfabric 1.17 */
#define SHM_PID_OFFSET 4
#define SHM_LOCK_OFFSET 24

/* Gone: no such process, or a zombie (it holds nothing any more). */
static int process_gone(int pid)
{
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) != 0)
        return errno == ESRCH;
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    char *paren = strrchr(buf, ')');
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

int pdf_shm_held_locks(uintptr_t *locks, int cap)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return 0;
    char line[1024];
    int n = 0;
    while (n < cap && fgets(line, sizeof(line), f)) {
        unsigned long lo, hi, off;
        char perms[8];
        int pos = 0;
        if (sscanf(line, "%lx-%lx %7s %lx %*s %*s %n", &lo, &hi, perms, &off, &pos) < 4 || !pos)
            continue;
        const char *path = line + pos;
        if (strncmp(path, "/dev/shm/", 9) != 0 || off != 0 || perms[0] != 'r' || perms[1] != 'w')
            continue;
        char *end = NULL;
        long owner = strtol(path + 9, &end, 10);
        if (end == path + 9 || *end != ':' || hi - lo < 64)
            continue; /* not an shm provider region */
        const uint8_t *hdr = (const uint8_t *)lo;
        int32_t hdr_pid;
        memcpy(&hdr_pid, hdr + SHM_PID_OFFSET, sizeof(hdr_pid));
        if (hdr[0] != SHM_REGION_VERSION || hdr_pid != owner || !process_gone((int)owner))
            continue;
        int *lock = (int *)(lo + SHM_LOCK_OFFSET);
        if (__atomic_load_n(lock, __ATOMIC_SEQ_CST) <= 0) /* glibc x86: 1 = free */
            locks[n++] = (uintptr_t)lock;
    }
    fclose(f);
    return n;
}

int pdf_shm_release(uintptr_t addr)
{
    int *lock = (int *)addr;
    int v = __atomic_load_n(lock, __ATOMIC_SEQ_CST);
    while (v <= 0) {
        /* waiters decrement it while they spin: swap in "free" from whatever they left */
        if (__atomic_compare_exchange_n(lock, &v, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return 1;
    }
    return 0;
}
