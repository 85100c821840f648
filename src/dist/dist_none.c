/* Ranks in a build without MPI: always rank 0 of 1, but a launch by mpirun with several ranks is
 * refused (each copy would quantize the whole model into the same files). */
#include "dist/dist.h"

#include <stdlib.h>
#include <string.h>

#ifndef MOEQ_HAVE_MPI

bool mq_dist_built(void) { return false; }

moeq_status mq_dist_start(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && atoi(v) > 1)
            return mq_err(MOEQ_E_UNSUPPORTED, "started by mpirun with %s=%s, but this moeq was built "
                          "without MPI (configure with -DMOEQ_MPI=ON; needs libopenmpi-dev)", vars[i], v);
    }
    return MOEQ_OK;
}

void mq_dist_stop(void) {}
void mq_dist_reset(void) {}
void mq_dist_seconds(double *waiting, double *moving) { *waiting = *moving = 0; }
moeq_status mq_dist_subset(int k) {
    (void)k;
    return MOEQ_OK;
}
moeq_status mq_dist_world_barrier(const char *step) {
    (void)step;
    return MOEQ_OK;
}
int mq_dist_rank(void) { return 0; }
int mq_dist_size(void) { return 1; }
int mq_dist_local_rank(void) { return 0; }
bool mq_dist_broken(void) { return false; }
void mq_dist_set_timeout(double seconds) { (void)seconds; }
moeq_status mq_dist_agree(moeq_status st, const char *step) {
    (void)step;
    return st;
}
moeq_status mq_dist_bcast(void *buf, size_t n, int root, const char *step) {
    (void)buf, (void)n, (void)root, (void)step;
    return MOEQ_OK;
}
moeq_status mq_dist_bcast_blob(void **buf, size_t *n, int root, const char *step) {
    (void)buf, (void)n, (void)root, (void)step;
    return MOEQ_OK;
}
moeq_status mq_dist_gather_i64(int64_t v, int64_t *max, int64_t *all, const char *step) {
    (void)step;
    *max = v;
    if (all) all[0] = v;
    return MOEQ_OK;
}

moeq_status mq_dist_send(const void *buf, size_t n, int dest, const char *step) {
    (void)buf, (void)n, (void)dest, (void)step;
    return MOEQ_OK;
}
moeq_status mq_dist_recv(void *buf, size_t n, int src, const char *step) {
    (void)buf, (void)n, (void)src, (void)step;
    return MOEQ_OK;
}
moeq_status mq_dist_max_f32(float *v, const char *step) {
    (void)v, (void)step;
    return MOEQ_OK;
}

void mq_dist_profile_report(void) {}

#endif
