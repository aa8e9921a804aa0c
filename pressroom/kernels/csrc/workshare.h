/* Splitting a loop of chunks between the calling thread and helper threads that sleep when idle (workshare.c),
 * for the products of a decode step, where OpenMP's pool hurt on a shared machine: its idle workers spin about
 * a millisecond after every parallel region, taking the core another process needs, and its barrier waits for
 * every worker, one that another process preempted included. Here the caller claims chunks too, so it waits
 * only for chunks a helper is in the middle of; and after such a wait runs alone for a while (a busy machine). */
#pragma once
#include <stdint.h>

typedef void (*chunk_fn)(void *ctx, int64_t chunk);

/* fn(ctx, c) for every c in [0, chunks), each exactly once, on the caller and up to threads - 1 helpers;
 * returns when all are done. Chunks must not depend on each other's order. */
void workshare_run(chunk_fn fn, void *ctx, int64_t chunks, int threads);
