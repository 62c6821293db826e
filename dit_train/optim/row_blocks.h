/* A deterministic parallel loop for the C kernels of RowNorm steps (rownorm_kernels.c, power_iteration_kernels.c).
 *
 * A kernel splits its work into a fixed list of items (a matrix of the bucket times a block of BLOCK_ROWS rows)
 * that does not depend on the thread count; each item writes only its own outputs (its rows, or its own slot of
 * partial sums, which the caller then adds up in item order). Threads only decide who runs which item, so results
 * are bit-identical for any thread count. (Column sums are the exception that needs no fixed partition: each
 * column's sum runs over the rows in order whichever strip of columns an item takes, so their strips follow the
 * thread count, and one thread reads whole rows.) Threads are plain pthreads
 * started per call (no pool to leak, nothing shared with torch's OpenMP runtime); where one cannot be started,
 * the calling thread runs its items. Calls with little work stay on the calling thread. */

#ifndef ROW_BLOCKS_H
#define ROW_BLOCKS_H

#include <pthread.h>

#define BLOCK_ROWS 128                /* rows per item: one partial-sum vector per block */
#define STRIP_ALIGN 16               /* column strips start at multiples of 16 columns (64 B of fp32) */
#define MIN_WORK_PER_THREAD (1L << 16) /* elements: below ~64K a thread costs more than it saves */
#define MAX_THREADS 64

typedef void (*item_fn)(void *ctx, long item);

typedef struct {
    item_fn fn;
    void *ctx;
    long begin, end;
} item_range;

static void *run_items(void *arg) {
    item_range *r = (item_range *)arg;
    for (long k = r->begin; k < r->end; ++k) r->fn(r->ctx, k);
    return NULL;
}

static long blocks_of(long n, long size) { return n > 0 ? (n + size - 1) / size : 0; }

/* How many of `threads` are worth starting for `work` elements. */
static int useful_threads(long work, int threads) {
    long useful = work / MIN_WORK_PER_THREAD;
    if (threads > useful) threads = (int)(useful > 0 ? useful : 1);
    return threads > MAX_THREADS ? MAX_THREADS : threads;
}

/* fn(ctx, k) for k in [0, items), on up to `threads` threads (contiguous ranges of items), `work` elements in all. */
static void for_each_item(item_fn fn, void *ctx, long items, long work, int threads) {
    threads = useful_threads(work, threads);
    if (threads > items) threads = (int)items;
    if (threads <= 1) {
        item_range all = {fn, ctx, 0, items};
        run_items(&all);
        return;
    }
    item_range ranges[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 0; t < threads; ++t) {
        ranges[t] = (item_range){fn, ctx, items * t / threads, items * (t + 1) / threads};
        started[t] = t > 0 && pthread_create(&ids[t], NULL, run_items, &ranges[t]) == 0;
    }
    run_items(&ranges[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_items(&ranges[t]);
    }
}

#endif
