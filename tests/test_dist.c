/* The ranks' shares (src/dist): contiguous, covering, balanced to one item, the larger first;
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

TEST_MAIN(T(test_shares), T(test_alone))
