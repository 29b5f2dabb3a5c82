/* Work sharing that a slow thread cannot stall (included by cpu_ops.c and quant_ops.c).
 *
 * A parallel loop with a static split ends when its slowest thread does. On a shared or
 * virtual machine one core is often slower for a while (another tenant, an interrupt, a
 * frequency step), and every parallel region of a step then waits for it at its barrier.
 *
 * Here the units of work (output groups, tiles) are split into shares as a static split
 * would give them to the threads, so each thread keeps the data it would have had (its slice
 * of a weight in its own L2). A share may be walked several rounds (row blocks: its units for
 * round 0, then for round 1, ...). A thread takes its own share's items from the front; once
 * that is empty it takes single items from the back of the others' shares. Each share's
 * state (next, end) is one 64-bit word changed by compare-and-swap, so every item is taken
 * exactly once, whichever thread takes it; which thread computes an item never changes what
 * it computes, so results keep their bits.
 *
 * Set up before the parallel region for omp_get_max_threads() shares (work_share_threads): a
 * team that turns out smaller (an if() clause, a nested region) still takes every item, the
 * missing threads' shares from the front by the thread whose index they would have had
 * modulo the team's size. */
#ifndef PAGEDLLM_WORK_SHARE_H
#define PAGEDLLM_WORK_SHARE_H

#include <omp.h>
#include <stdint.h>

#define WORK_SHARE_MAX 64 /* shares at most; threads past the last take from it first */

typedef struct {
    uint64_t state; /* next << 32 | end: the share's local item indices */
    int64_t lo, hi; /* its units */
    char pad[40];   /* one cache line per share: owners do not disturb one another */
} WorkShareSlot;

typedef struct {
    WorkShareSlot slot[WORK_SHARE_MAX];
    int64_t shares, rounds;
} WorkShare;

typedef struct {
    int64_t unit, round; /* what to compute */
    int64_t share_hi;    /* the end of the units of the share it came from */
    int own;             /* taken from the thread's own share, in order */
} WorkItem;

/* Shares for a region: the threads it may get, at most `units` and WORK_SHARE_MAX (1 or more). */
static inline int64_t work_share_threads(int64_t units) {
    int64_t t = omp_get_max_threads();
    if (t > units) t = units;
    if (t > WORK_SHARE_MAX) t = WORK_SHARE_MAX;
    return t > 0 ? t : 1;
}

/* Share s of `shares`: units bounds[s] .. bounds[s + 1], each for `rounds` rounds (the items of
 * all shares at most 2^31 - 1). */
static inline void work_share_init_bounds(WorkShare *ws, const int64_t *bounds, int64_t shares, int64_t rounds) {
    const int64_t kept = shares < WORK_SHARE_MAX ? shares : WORK_SHARE_MAX; /* the rest join the last */
    ws->shares = kept;
    ws->rounds = rounds;
    for (int64_t s = 0; s < kept; s++) {
        ws->slot[s].lo = bounds[s];
        ws->slot[s].hi = bounds[s + 1 < kept ? s + 1 : shares];
        __atomic_store_n(&ws->slot[s].state, (uint64_t)((ws->slot[s].hi - ws->slot[s].lo) * rounds), __ATOMIC_RELAXED);
    }
}

/* `units` in `shares` (work_share_threads) equal shares, as a static split, `rounds` rounds each. */
static inline void work_share_init(WorkShare *ws, int64_t units, int64_t shares, int64_t rounds) {
    int64_t bounds[WORK_SHARE_MAX + 1];
    if (shares > WORK_SHARE_MAX) shares = WORK_SHARE_MAX;
    for (int64_t s = 0; s <= shares; s++) bounds[s] = units * s / shares;
    work_share_init_bounds(ws, bounds, shares, rounds);
}

/* One item of share s from the front (own) or the back; 0 when the share is empty. */
static inline int work_share_take(WorkShare *ws, int64_t s, int front, WorkItem *it) {
    WorkShareSlot *slot = &ws->slot[s];
    uint64_t old = __atomic_load_n(&slot->state, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint32_t next = (uint32_t)(old >> 32), end = (uint32_t)old;
        if (next >= end) return 0;
        const uint64_t want = front ? ((uint64_t)(next + 1) << 32) | end : ((uint64_t)next << 32) | (end - 1);
        if (__atomic_compare_exchange_n(&slot->state, &old, want, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            const int64_t local = front ? next : end - 1, width = slot->hi - slot->lo;
            it->round = local / width;
            it->unit = slot->lo + local % width;
            it->share_hi = slot->hi;
            return 1;
        }
    }
}

/* The next item for thread `me` of a team of `nth`: its own share's next, then the shares of
 * no thread, then the last item of the nearest share that has one; 0 when every item is taken. */
static inline int work_share_next(WorkShare *ws, int64_t me, int64_t nth, WorkItem *it) {
    const int64_t home = me < ws->shares ? me : ws->shares - 1;
    it->own = 1;
    if (work_share_take(ws, home, 1, it)) return 1;
    for (int64_t s = home + nth; s < ws->shares; s += nth)
        if (work_share_take(ws, s, 1, it)) return 1;
    it->own = 0;
    for (int64_t k = 1; k < ws->shares; k++)
        if (work_share_take(ws, (home + k) % ws->shares, 0, it)) return 1;
    return 0;
}

#endif
