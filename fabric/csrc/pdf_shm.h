/*
 * pdf_shm.h - surviving peers that die inside the shm provider (libfabric 1.17).
 *
 * Every shm endpoint owns a region in /dev/shm, named "<pid>:<ep>:<domain>",
 * whose header holds a process-shared spin lock.  Peers take that lock to
 * queue commands and the owner takes it to retire them.  A process killed
 * while holding it (likely: the owner holds it while copying a large write
 * with process_vm_readv) leaves it held forever, and the next fi_write,
 * fi_send or fi_cq_read that needs it spins forever, holding the engine.
 *
 * A watchdog finds such locks: regions mapped in this process whose owner
 * process is gone and whose lock stayed held for a whole observation period.
 * Releasing them lets the stuck call finish (it queues into a region nobody
 * reads any more); the dead peer is then failed as usual.  Only the 1.17
 * region header is recognised (version 4: pid at byte 4, lock at byte 24);
 * anything else is left alone.
 */
#ifndef PDF_SHM_H
#define PDF_SHM_H

#include <stdint.h>

#define PDF_SHM_MAX_STUCK 64

/* Addresses of held locks in regions of dead owners mapped here. */
int pdf_shm_held_locks(uintptr_t *locks, int cap);
/* Release the lock at `lock` if it is still held; returns 1 if released. */
int pdf_shm_release(uintptr_t lock);

#endif
