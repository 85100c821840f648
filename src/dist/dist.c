/* What every build shares: how work is cut into ranks' shares. */
#include "dist/dist.h"

void mq_dist_share(int64_t n, int rank, int size, int64_t *lo, int64_t *hi) {
    if (size < 1) size = 1;
    const int64_t base = n / size, extra = n % size;
    *lo = rank * base + (rank < extra ? rank : extra);
    *hi = *lo + base + (rank < extra ? 1 : 0);
}

/* ---- the public face (include/moeq.h) ---- */
int moeq_dist_built(void) { return mq_dist_built() ? 1 : 0; }
moeq_status moeq_dist_start(void) { return mq_dist_start(); }
void moeq_dist_stop(void) { mq_dist_stop(); }
int moeq_dist_rank(void) { return mq_dist_rank(); }
int moeq_dist_size(void) { return mq_dist_size(); }
