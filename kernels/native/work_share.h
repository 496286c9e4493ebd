/* How the kernels' parallel loops over items of equal cost (weight rows, column blocks) share them
 * out: each thread first takes the contiguous range that schedule(static) would give it, front to
 * back in chunks, so that it reads its part of a weight as one stream the hardware prefetchers
 * follow; once its range is done it takes chunks from the back of the ranges still open.
 *
 * With a static split the step waits, at the end of every parallel region, for the slower thread.
 * A decode step is some 120 projections of 10 microseconds to a millisecond each, and when other
 * processes share the cores (the scheduler, the frontend and the clients of streamed requests, on
 * a small host) one of them holds up one thread now and then: its work then waited for it. Taken
 * this way, the other thread does it. Through `serve` on AMD Zen 4 (2 vCPUs), 32 streamed
 * requests at once (bench/real_model.py, bfloat16, the two libraries alternated over five pairs
 * of runs) read 4.5-8 % more tokens per second than with the static split, in every pair; whole
 * answers, which leave the cores to the worker, were within the runs' noise (-1 % to +17 %), as
 * was one sequence's forward in-process. In a chain of the panel kernel alone at 32 rows, with
 * nothing else running, it was 2.5 % slower. The thread that computes an item changes no result:
 * each item is computed whole by one thread, with the same code.
 *
 *     struct work_share share;
 *     work_share_init(&share, num_items);
 *     #pragma omp parallel if (...)
 *     {
 *         struct work_cursor cursor = work_cursor_start();
 *         int64_t first, count;
 *         while ((count = work_next(&share, &cursor, chunk, &first)) > 0)
 *             ... items first .. first + count - 1 ...
 *     }
 *
 * Every item is taken exactly once by whatever team runs the region (one thread when its `if`
 * fails: the parts no thread owns are taken front to back). cursor.backwards tells whether the
 * thread's next chunk, if any, is likely the one before this one (it is taking another range from
 * the back) rather than the one after: what a kernel that prefetches its next item needs. */
#ifndef PAGEDSERVE_WORK_SHARE_H
#define PAGEDSERVE_WORK_SHARE_H

#include <omp.h>
#include <stdint.h>

#define WORK_MAX_PARTS 64
/* a chunk of a weight's rows: small enough that the last chunks even out the threads' ends, large
 * enough that taking it costs nothing beside reading it */
#define WORK_CHUNK_BYTES 16384

/* the items of a chunk, for items of item_bytes each: about WORK_CHUNK_BYTES, at least one */
static inline int64_t work_chunk(int64_t item_bytes) {
    const int64_t items = WORK_CHUNK_BYTES / item_bytes;
    return items > 0 ? items : 1;
}

/* one thread's range, next (low 32 bits) and end (high 32 bits), on a cache line of its own */
struct work_part {
    _Alignas(64) int64_t range;
};

struct work_share {
    struct work_part parts[WORK_MAX_PARTS];
    int num_parts;
};

struct work_cursor {
    int self, team, step;
    int backwards; /* the last chunk came from the back of another thread's range */
};

/* thread `part`'s range when items 0 .. num_items - 1 are split as schedule(static) splits them
 * over `parts` threads: its first item in *begin, its end in *end */
static inline void work_share_part(int64_t num_items, int part, int parts, int64_t *begin, int64_t *end) {
    const int64_t quotient = num_items / parts, remainder = num_items % parts;
    *begin = part * quotient + (part < remainder ? part : remainder);
    *end = *begin + quotient + (part < remainder);
}

/* items 0 .. num_items - 1 (< 2^31) split that way over `parts` threads */
static inline void work_share_init_parts(struct work_share *share, int64_t num_items, int parts) {
    parts = parts < 1 ? 1 : parts > WORK_MAX_PARTS ? WORK_MAX_PARTS : parts;
    for (int p = 0; p < parts; p++) {
        int64_t begin, end;
        work_share_part(num_items, p, parts, &begin, &end);
        share->parts[p].range = begin | (end << 32);
    }
    share->num_parts = parts;
}

/* the split over the threads a parallel region started now would have */
static inline void work_share_init(struct work_share *share, int64_t num_items) {
    work_share_init_parts(share, num_items, omp_get_max_threads());
}

/* inside the parallel region, once per thread */
static inline struct work_cursor work_cursor_start(void) {
    struct work_cursor cursor = {omp_get_thread_num(), omp_get_num_threads(), 0, 0};
    return cursor;
}

/* up to `chunk` items of part: its first ones (front), or its last ones but the owner's next chunk
 * (back: the owner may have prefetched that one, and would finish it before another thread reading
 * it cold); the count (0: none left to take), the first item in *first */
static inline int64_t work_take(struct work_part *part, int64_t chunk, int from_back, int64_t *first) {
    int64_t range = __atomic_load_n(&part->range, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t next = range & 0xffffffff, end = (int64_t)((uint64_t)range >> 32);
        const int64_t open = end - next - (from_back ? chunk : 0);
        if (open <= 0) return 0;
        const int64_t take = open < chunk ? open : chunk;
        const int64_t updated = from_back ? next | ((end - take) << 32) : (next + take) | (end << 32);
        if (__atomic_compare_exchange_n(&part->range, &range, updated, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *first = from_back ? end - take : next;
            return take;
        }
    }
}

/* the calling thread's next chunk: its own part's front, then the other parts in turn, from the
 * back where a thread of the team owns the part, else from the front */
static inline int64_t work_next(struct work_share *share, struct work_cursor *cursor, int64_t chunk,
                                int64_t *first) {
    while (cursor->step < share->num_parts) {
        const int part = (cursor->self + cursor->step) % share->num_parts;
        const int from_back = part != cursor->self && part < cursor->team;
        const int64_t count = work_take(&share->parts[part], chunk, from_back, first);
        if (count) {
            cursor->backwards = from_back;
            return count;
        }
        cursor->step++;
    }
    return 0;
}

#define WORK_SHARE_PRAGMA(text) _Pragma(#text)

/* for (int64_t n ...) over items 0 .. num_items - 1, shared out as above in chunks of `chunk`, in
 * a parallel region where `condition` holds: { body } */
#define FOR_EACH_SHARED_ITEM(n, num_items, chunk, condition, ...)                                                 \
    {                                                                                                              \
        struct work_share work_;                                                                                   \
        work_share_init(&work_, num_items);                                                                        \
        WORK_SHARE_PRAGMA(omp parallel if (condition)) {                                                           \
            struct work_cursor cursor_ = work_cursor_start();                                                      \
            int64_t first_, count_;                                                                                \
            while ((count_ = work_next(&work_, &cursor_, chunk, &first_)) > 0)                                     \
                for (int64_t n = first_; n < first_ + count_; n++) {                                               \
                    __VA_ARGS__                                                                                    \
                }                                                                                                  \
        }                                                                                                          \
    }

#endif
