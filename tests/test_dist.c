/* The ranks' shares (src/dist): contiguous, covering, balanced to one item, the larger first
 * (weighted: the least largest share);
 * and a process alone is rank 0 of 1 whose agreements return its own status. */
#include <stdlib.h>

#include "harness.h"

#include "dist/dist.h"

static void test_shares(void) {
    for (int64_t n = 0; n <= 70; n++)
        for (int size = 1; size <= 9; size++) {
            int64_t next = 0;
            bool seen_small = false;
            for (int r = 0; r < size; r++) {
                int64_t lo, hi;
                mq_dist_share(n, r, size, &lo, &hi);
                ASSERT_EQ_INT(next, lo);               /* contiguous, in rank order */
                int64_t k = hi - lo;
                ASSERT_TRUE(k == n / size || k == n / size + 1);
                if (k == n / size + 1 && n % size) ASSERT_FALSE(seen_small);   /* larger first */
                if (k == n / size && n % size) seen_small = true;
                next = hi;
            }
            ASSERT_EQ_INT(n, next);                    /* covering */
        }
    int64_t lo, hi;
    mq_dist_share(10, 2, 4, &lo, &hi);                 /* 3 3 2 2 */
    ASSERT_EQ_INT(6, lo);
    ASSERT_EQ_INT(8, hi);
}

/* Weighted shares: contiguous and covering; each share's cost within one item's of the ideal
 * total / size; a hand-made case; zero costs fall back to the plain shares. */
static void test_weighted_shares(void) {
    const int64_t hand[6] = {10, 1, 1, 1, 1, 10};
    int64_t lo, hi;
    mq_dist_share_weighted(hand, 6, 0, 2, &lo, &hi);
    ASSERT_EQ_INT(0, lo);
    ASSERT_EQ_INT(3, hi);   /* 10 + 1 + 1 = 12 of 24 */
    mq_dist_share_weighted(hand, 6, 1, 2, &lo, &hi);
    ASSERT_EQ_INT(3, lo);
    ASSERT_EQ_INT(6, hi);
    int64_t cost[64];
    uint64_t x = 88172645463325252ull;
    for (int trial = 0; trial < 200; trial++) {
        const int64_t n = 1 + trial % 64;
        int64_t all = 0, big = 0;
        for (int64_t i = 0; i < n; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            cost[i] = (int64_t)(x % 1000) * (trial % 3 ? 1 : (int64_t)(x % 7));   /* some zeros */
            all += cost[i];
            big = cost[i] > big ? cost[i] : big;
        }
        for (int size = 1; size <= 9; size++) {
            int64_t next = 0;
            for (int r = 0; r < size; r++) {
                mq_dist_share_weighted(cost, n, r, size, &lo, &hi);
                ASSERT_EQ_INT(next, lo);
                ASSERT_TRUE(hi >= lo);
                int64_t c = 0;
                for (int64_t i = lo; i < hi; i++) c += cost[i];
                if (all > 0 && (double)c > (double)all / size + (double)big)
                    FAIL("share %d of %d: cost %lld, ideal %.1f, largest item %lld", r, size, (long long)c,
                         (double)all / size, (long long)big);
                next = hi;
            }
            ASSERT_EQ_INT(n, next);
        }
    }
    const int64_t zero[5] = {0};
    int64_t plo, phi;
    mq_dist_share_weighted(zero, 5, 1, 2, &lo, &hi);
    mq_dist_share(5, 1, 2, &plo, &phi);
    ASSERT_EQ_INT(plo, lo);
    ASSERT_EQ_INT(phi, hi);
}

/* The largest share is the least any contiguous split of the items into `size` parts gives
 * (every split tried), and rank 0's is never above the others' where the parts differ. */
static int64_t best_max(const int64_t *cost, int64_t n, int parts) {
    if (parts == 1) {
        int64_t c = 0;
        for (int64_t i = 0; i < n; i++) c += cost[i];
        return c;
    }
    int64_t best = -1, first = 0;
    for (int64_t k = 0; k <= n; k++) {   /* the first part is [0, k) */
        if (k > 0) first += cost[k - 1];
        const int64_t rest = best_max(cost + k, n - k, parts - 1), m = first > rest ? first : rest;
        if (best < 0 || m < best) best = m;
    }
    return best;
}

static void test_weighted_shares_least_max(void) {
    int64_t cost[10];
    uint64_t x = 2463534242ull;
    for (int trial = 0; trial < 300; trial++) {
        const int64_t n = trial % 11;
        for (int64_t i = 0; i < n; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            cost[i] = (int64_t)(x % 50) * (trial % 4 ? 1 : (int64_t)(x % 3));   /* some zeros */
        }
        for (int size = 1; size <= 4; size++) {
            int64_t most = 0, c0 = 0, next = 0;
            for (int r = 0; r < size; r++) {
                int64_t lo, hi, c = 0;
                mq_dist_share_weighted(cost, n, r, size, &lo, &hi);
                ASSERT_EQ_INT(next, lo);
                for (int64_t i = lo; i < hi; i++) c += cost[i];
                most = c > most ? c : most;
                if (r == 0) c0 = c;
                next = hi;
            }
            ASSERT_EQ_INT(n, next);
            int64_t all = 0;
            for (int64_t i = 0; i < n; i++) all += cost[i];
            if (all == 0) continue;   /* the plain shares */
            if (most != best_max(cost, n, size))
                FAIL("n %lld, %d ranks: largest share %lld, the best split's %lld", (long long)n, size,
                     (long long)most, (long long)best_max(cost, n, size));
            ASSERT_TRUE(c0 <= most);
        }
    }
}

static void test_alone(void) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK")) SKIP("started by mpirun");
    ASSERT_EQ_INT(MOEQ_OK, mq_dist_start());           /* not started by mpirun: alone */
    ASSERT_EQ_INT(0, mq_dist_rank());
    ASSERT_EQ_INT(1, mq_dist_size());
    ASSERT_EQ_INT(MOEQ_OK, mq_dist_agree(MOEQ_OK, "a step"));
    ASSERT_EQ_INT(MOEQ_E_IO, mq_dist_agree(MOEQ_E_IO, "a step"));
    int64_t mx = 0, all[1] = {0};
    ASSERT_EQ_INT(MOEQ_OK, mq_dist_gather_i64(42, &mx, all, "memory"));
    ASSERT_EQ_INT(42, mx);
    ASSERT_EQ_INT(42, all[0]);
    float v = 1.5f;
    ASSERT_EQ_INT(MOEQ_OK, mq_dist_max_f32(&v, "amax"));
    ASSERT_TRUE(v == 1.5f);
    mq_dist_stop();
}

TEST_MAIN(T(test_shares), T(test_weighted_shares), T(test_weighted_shares_least_max), T(test_alone))
