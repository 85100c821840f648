/* What every build shares: how work is cut into ranks' shares. */
#include "dist/dist.h"

void mq_dist_share(int64_t n, int rank, int size, int64_t *lo, int64_t *hi) {
    if (size < 1) size = 1;
    const int64_t base = n / size, extra = n % size;
    *lo = rank * base + (rank < extra ? rank : extra);
    *hi = *lo + base + (rank < extra ? 1 : 0);
}

/* How many contiguous parts of at most `cap` the items need, packed from the last item back. */
static int64_t parts_from_back(const int64_t *cost, int64_t n, int64_t cap) {
    int64_t parts = 1, sum = 0;
    for (int64_t i = n - 1; i >= 0; i--) {
        if (sum + cost[i] > cap) {
            parts++;
            sum = 0;
        }
        sum += cost[i];
    }
    return parts;
}

/* The contiguous split whose largest share is the least possible (the slowest rank sets the
 * layer's time): the least cap that `size` parts can hold, by bisection, then the parts packed
 * from the last item back, so that rank 0, which also writes the checkpoint's global tensors
 * and report, keeps what is left (the lightest share where the split is uneven). Integer
 * arithmetic only: every rank computes the same split. */
void mq_dist_share_weighted(const int64_t *cost, int64_t n, int rank, int size, int64_t *lo,
                            int64_t *hi) {
    if (size < 1) size = 1;
    int64_t all = 0, big = 0;
    for (int64_t i = 0; i < n; i++) {
        all += cost[i];
        big = cost[i] > big ? cost[i] : big;
    }
    if (all == 0) {
        mq_dist_share(n, rank, size, lo, hi);
        return;
    }
    int64_t a = (all + size - 1) / size, b = all;   /* the least feasible cap lies in [a, b] */
    if (a < big) a = big;
    while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        if (parts_from_back(cost, n, mid) <= size) b = mid;
        else a = mid + 1;
    }
    /* rank size-1 takes the last part, size-2 the one before, ...; ranks before the first part
     * take nothing */
    int64_t end = n, start = n;
    for (int r = size - 1; r >= rank; r--) {
        end = start;
        for (int64_t sum = 0; start > 0 && (r == 0 || sum + cost[start - 1] <= a);) sum += cost[--start];
    }
    *lo = start;
    *hi = end;
}

/* ---- the public face (include/moeq.h) ---- */
int moeq_dist_built(void) { return mq_dist_built() ? 1 : 0; }
moeq_status moeq_dist_start(void) { return mq_dist_start(); }
void moeq_dist_stop(void) { mq_dist_stop(); }
int moeq_dist_rank(void) { return mq_dist_rank(); }
int moeq_dist_size(void) { return mq_dist_size(); }
