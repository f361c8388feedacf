/*
 * A small thread pool for the CPU ops' parallel loops (pool.c): items 0 .. n-1 of a job are claimed
 * one at a time by the calling thread and the pool's workers; the call returns when every item is
 * done. Unlike an OpenMP parallel region it never waits for a worker that has not claimed an item,
 * so a worker the OS has not scheduled yet (a core busy with another process) costs nothing: the
 * caller does its items. Each item must be computed alike by whichever thread runs it.
 */
#ifndef PDSERVE_POOL_H
#define PDSERVE_POOL_H
#include <stdint.h>

typedef void (*pool_item_fn)(void *arg, int64_t item);

/* Run fn(arg, i) for i in [0, n) on up to `threads` threads (the caller's included; <= 1: inline). */
void pool_run(pool_item_fn fn, void *arg, int64_t n, int threads);

#endif
