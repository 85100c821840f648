/*
 * Ranks of a distributed run (Open MPI underneath, behind this C interface: no MPI type leaves
 * src/dist). A process started by mpirun with N > 1 ranks is one of N; any other process is rank
 * 0 of 1 and every call below is a no-op, so the pipeline has one code path.
 *
 * Failure handling: every exchange is preceded by mq_dist_agree, where each rank brings its
 * status; when any rank failed, every rank returns that rank's error ("rank R: message"). A rank
 * that never arrives (hung, or lost without the runtime noticing) makes the others give up after
 * the timeout with an error saying where they waited; such a process must then exit without
 * mq_dist_stop's collective shutdown (mq_dist_broken), and mpirun ends the job. A rank that dies
 * is noticed by mpirun, which names it and stops the others.
 */
#ifndef MOEQ_DIST_H
#define MOEQ_DIST_H

#include "core/core.h"

/* true when this build has MPI (-DMOEQ_MPI=ON). */
bool mq_dist_built(void);
/* Joins the job when the process was started by mpirun (any N), else stays rank 0 of 1. A
 * launch with N > 1 on a build without MPI is MOEQ_E_UNSUPPORTED (N copies would each write the
 * same checkpoint). Idempotent. */
moeq_status mq_dist_start(void);
/* Leaves the job (collective; skipped after a timeout, see mq_dist_broken). */
void mq_dist_stop(void);
int mq_dist_rank(void);
int mq_dist_size(void);
int mq_dist_local_rank(void);          /* rank among the ranks of this machine */
bool mq_dist_broken(void);             /* a collective step timed out */
void mq_dist_set_timeout(double seconds);   /* <= 0: the default, 3600 s */

/* Every rank's status at `step`: MOEQ_OK when all are OK, else the lowest failing rank's status
 * with its message (the failing rank keeps its own message, prefixed with its rank). */
moeq_status mq_dist_agree(moeq_status st, const char *step);
/* Seconds this rank spent so far waiting for the others at agreements (load imbalance) and
 * moving data (transfers), for the reports. */
void mq_dist_seconds(double *waiting, double *moving);
/* MOEQ_DEBUG_DIST_PROFILE=1: where those seconds went, by kind of step ("layer N: " and what follows
 * " of " left out), as one line per rank on stderr, the largest first; then starts over. */
void mq_dist_profile_report(void);
/* Forgets an agreed failure (a new job in the same processes; every rank calls it). */
void mq_dist_reset(void);
/* n bytes at buf from root to every rank. */
moeq_status mq_dist_bcast(void *buf, size_t n, int root, const char *step);
/* A buffer of the root's size: root's (*buf, *n) to every rank; the others get a new malloc'd
 * buffer (free it). */
moeq_status mq_dist_bcast_blob(void **buf, size_t *n, int root, const char *step);
/* n bytes from this rank to dest / from src into buf (matched in the order they are posted). */
moeq_status mq_dist_send(const void *buf, size_t n, int dest, const char *step);
moeq_status mq_dist_recv(void *buf, size_t n, int src, const char *step);
/* *v = the largest of every rank's *v (NaN never wins: amax values). */
moeq_status mq_dist_max_f32(float *v, const char *step);
/* The largest of every rank's v, on every rank; all[r] (may be NULL, size mq_dist_size()) gets
 * rank r's v. */
moeq_status mq_dist_gather_i64(int64_t v, int64_t *max, int64_t *all, const char *step);

/* Benchmarks: the job's first k ranks act as a job of k (mq_dist_rank/size describe it); the
 * others get mq_dist_size() 0 and sit it out (mq_dist_world_barrier waits for all). k <= 0 or
 * >= the job's size: the whole job again. Collective over the whole job. */
moeq_status mq_dist_subset(int k);
moeq_status mq_dist_world_barrier(const char *step);

/* The share [*lo, *hi) of n items of `rank` of `size`: contiguous, sizes differing by at most one,
 * lower ranks taking the larger shares. */
void mq_dist_share(int64_t n, int rank, int size, int64_t *lo, int64_t *hi);
/* The share [*lo, *hi) of n items of costs cost[] (>= 0): contiguous, in rank order, the largest
 * share's cost the least any contiguous split gives (so within one item's of the ideal total /
 * size), the parts filled from the last rank back (rank 0 the lightest where they differ); all
 * costs 0: mq_dist_share's. */
void mq_dist_share_weighted(const int64_t *cost, int64_t n, int rank, int size, int64_t *lo,
                            int64_t *hi);

#endif
