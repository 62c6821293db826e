/* A deterministic parallel loop for the C kernels of RowNorm steps (rownorm_passes.inc, power_iteration.inc).
 *
 * A kernel splits its work into a fixed list of items (a matrix of the bucket times a block of BLOCK_ROWS rows)
 * that does not depend on the thread count; each item writes only its own outputs (its rows, or its own slot of
 * partial sums, which the caller then adds up in item order). Threads only decide who runs which item, so results
 * are bit-identical for any thread count. Threads take the items one at a time, so one that other jobs keep off
 * the cores takes fewer of them instead of holding up the rest.
 *
 * Built with -fopenmp (native_rownorm.py's first choice), the threads are torch's own OpenMP team: the library
 * links libgomp.so.1, which in a torch process is the copy torch has loaded. Threads of our own would compete with
 * torch's, which keep spinning on the cores for a while after every torch op (measured: 2 pthreads were slower
 * than 1 when a torch op ran just before; torch's team gives 1.3x). Without OpenMP: pthreads started per call,
 * detached, the caller waiting for the items rather than the threads. Calls with little work stay on the calling
 * thread. */

#ifndef ROW_BLOCKS_H
#define ROW_BLOCKS_H

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>

#define BLOCK_ROWS 128                /* rows per item: one partial-sum vector per block */
#define MIN_WORK_PER_THREAD (1L << 16) /* elements: below ~64K a thread costs more than it saves */
#define MAX_THREADS 64
/* the one-pass step (rownorm_passes.inc): bytes of G and M per chunk of a wide bucket's rows (read back from L2) */
/* blocks of rows per item of the power iteration's products, read in turn (power_iteration.inc); -DPI_GROUP=n
 * builds another (benchmarks/bench_rownorm_builds.py) */
#ifndef PI_GROUP
#define PI_GROUP 4
#endif
/* the momentum pass writes U with streaming stores from this size of U up (rownorm_passes.inc: stream_row): the
 * power iteration then reads it from memory; smaller buckets' U is read back from the cache */
#define STREAM_MIN_BYTES (16L << 20)
#define STEP_CHUNK_BYTES (24L << 10)

typedef void (*item_fn)(void *ctx, long item);

/* The items of one call, handed out one at a time. With pthreads the caller waits for the items, not for the
 * threads, and the last participant to let go frees the queue (a helper may start after the call has returned). */
typedef struct {
    item_fn fn;
    void *ctx;
    long items, next, done; /* next, done: atomic */
    int refs;               /* atomic */
} item_queue;

static void drain(item_queue *q) {
    long k;
    while ((k = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED)) < q->items) {
        q->fn(q->ctx, k);
        __atomic_add_fetch(&q->done, 1, __ATOMIC_RELEASE);
    }
}

static void release(item_queue *q) {
    if (__atomic_sub_fetch(&q->refs, 1, __ATOMIC_ACQ_REL) == 0) free(q);
}

static void *helper(void *arg) {
    drain(arg);
    release(arg);
    return NULL;
}

static long blocks_of(long n, long size) { return n > 0 ? (n + size - 1) / size : 0; }

/* How many of `threads` are worth starting for `work` elements. */
static int useful_threads(long work, int threads) {
    long useful = work / MIN_WORK_PER_THREAD;
    if (threads > useful) threads = (int)(useful > 0 ? useful : 1);
    return threads > MAX_THREADS ? MAX_THREADS : threads;
}

/* fn(ctx, k) for k in [0, items), on up to `threads` threads, `work` elements in all; returns when all are done. */
static void for_each_item(item_fn fn, void *ctx, long items, long work, int threads) {
    threads = useful_threads(work, threads);
    if (threads > items) threads = (int)items;
#ifdef _OPENMP
    if (threads > 1) {
        item_queue team = {fn, ctx, items, 0, 0, 1};
#pragma omp parallel num_threads(threads)
        drain(&team);
        return;
    }
#endif
    item_queue *q = threads > 1 ? malloc(sizeof *q) : NULL;
    if (!q) {
        for (long k = 0; k < items; ++k) fn(ctx, k);
        return;
    }
    *q = (item_queue){fn, ctx, items, 0, 0, 1};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int t = 1; t < threads; ++t) {
        pthread_t id;
        __atomic_add_fetch(&q->refs, 1, __ATOMIC_RELAXED);
        if (pthread_create(&id, &attr, helper, q) != 0) __atomic_sub_fetch(&q->refs, 1, __ATOMIC_RELAXED);
    }
    pthread_attr_destroy(&attr);
    drain(q);
    while (__atomic_load_n(&q->done, __ATOMIC_ACQUIRE) < items) sched_yield();
    release(q);
}

#endif
