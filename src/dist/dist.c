/* What every build shares: how work is cut into ranks' shares. */
#include "dist/dist.h"

void mq_dist_share(int64_t n, int rank, int size, int64_t *lo, int64_t *hi) {
    if (size < 1) size = 1;
    const int64_t base = n / size, extra = n % size;
    *lo = rank * base + (rank < extra ? rank : extra);
    *hi = *lo + base + (rank < extra ? 1 : 0);
}

/* The first item before which at least part / size of `all` lies. */
static int64_t weighted_bound(const int64_t *cost, int64_t n, int64_t all, int part, int size) {
    if (part <= 0) return 0;
    if (part >= size) return n;
    int64_t e = 0, before = 0;
    while (e < n && before * size < (int64_t)part * all) before += cost[e++];
    return e;
}

void mq_dist_share_weighted(const int64_t *cost, int64_t n, int rank, int size, int64_t *lo,
                            int64_t *hi) {
    if (size < 1) size = 1;
    int64_t all = 0;
    for (int64_t i = 0; i < n; i++) all += cost[i];
    if (all == 0) {
        mq_dist_share(n, rank, size, lo, hi);
        return;
    }
    *lo = weighted_bound(cost, n, all, rank, size);
    *hi = weighted_bound(cost, n, all, rank + 1, size);
}

/* ---- the public face (include/moeq.h) ---- */
int moeq_dist_built(void) { return mq_dist_built() ? 1 : 0; }
moeq_status moeq_dist_start(void) { return mq_dist_start(); }
void moeq_dist_stop(void) { mq_dist_stop(); }
int moeq_dist_rank(void) { return mq_dist_rank(); }
int moeq_dist_size(void) { return mq_dist_size(); }
