/*
 * Ranks over Open MPI. Only the main thread calls MPI (MPI_THREAD_FUNNELED): the pool's threads
 * compute, the main thread exchanges between stages. Every wait is a non-blocking collective
 * polled against the timeout, so a rank that never arrives cannot hang the others.
 */
#include "dist/dist.h"
#include "core/env.h"

#ifdef MOEQ_HAVE_MPI

#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_rank = 0, g_size = 1, g_local = 0;
static int g_world_rank = 0, g_world_size = 1;
static MPI_Comm g_comm = MPI_COMM_NULL;   /* the job's ranks, or a subset of them (benchmarks) */
static bool g_started = false, g_broken = false;
static double g_timeout = 3600;
/* Once an agreement found a failure, every rank knows it at the same step: later steps do not
 * communicate (the ranks may have left the stages at different points), they fail alike. */
static bool g_failed = false;
static moeq_status g_fail_st = MOEQ_OK;
static char g_fail_msg[2048];

/* Large buffers move in pieces: MPI counts are ints. */
enum { PIECE = 1 << 30 };

static moeq_status mpi_fail(int rc, const char *what, const char *step);
static moeq_status wait_for(MPI_Request *req, const char *step);

bool mq_dist_built(void) { return true; }
int mq_dist_rank(void) { return g_rank; }
int mq_dist_size(void) { return g_size; }
int mq_dist_local_rank(void) { return g_local; }
bool mq_dist_broken(void) { return g_broken; }
void mq_dist_set_timeout(double seconds) { g_timeout = seconds > 0 ? seconds : 3600; }

static bool launched(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return true;
    return false;
}

moeq_status mq_dist_start(void) {
    if (g_started || !launched()) return MOEQ_OK;
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return mq_err(MOEQ_E_IO, "MPI_Init_thread failed (started by mpirun?)");
    g_started = true;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    g_world_rank = g_rank;
    g_world_size = g_size;
    g_comm = MPI_COMM_WORLD;
    MPI_Comm local;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &local) == MPI_SUCCESS) {
        MPI_Comm_rank(local, &g_local);
        MPI_Comm_free(&local);
    }
    return MOEQ_OK;
}

void mq_dist_stop(void) {
    if (g_started && !g_broken) {
        if (g_comm != MPI_COMM_WORLD) MPI_Comm_free(&g_comm);
        MPI_Finalize();
    }
    g_started = false;
}

moeq_status mq_dist_subset(int k) {
    if (!g_started) return MOEQ_OK;
    if (g_comm != MPI_COMM_WORLD) MPI_Comm_free(&g_comm);
    g_comm = MPI_COMM_WORLD;
    g_rank = g_world_rank;
    g_size = g_world_size;
    if (k <= 0 || k >= g_world_size) return MOEQ_OK;
    MPI_Comm sub = MPI_COMM_NULL;
    int rc = MPI_Comm_split(MPI_COMM_WORLD, g_world_rank < k ? 0 : MPI_UNDEFINED, g_world_rank, &sub);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Comm_split", "a subset of the ranks");
    if (g_world_rank < k) {
        g_comm = sub;
        MPI_Comm_size(sub, &g_size);
    } else {
        g_size = 0;   /* sits this one out */
    }
    return MOEQ_OK;
}

moeq_status mq_dist_world_barrier(const char *step) {
    if (!g_started) return MOEQ_OK;
    MPI_Request req;
    int rc = MPI_Ibarrier(MPI_COMM_WORLD, &req);
    return rc == MPI_SUCCESS ? wait_for(&req, step) : mpi_fail(rc, "MPI_Ibarrier", step);
}

static moeq_status mpi_fail(int rc, const char *what, const char *step) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "error %d", rc);
    g_broken = true;
    return mq_err(MOEQ_E_IO, "rank %d: %s at %s: %s", g_rank, what, step, text);
}

/* Polls a request until it completes or the timeout passes. MPI moves a large message only
 * while it is polled (shared-memory fragments), so data transfers (spin) poll without pause.
 * Agreements wait for ranks still computing: they poll without pause for their first
 * SPIN_FIRST_S (most waits between ranks in step are that short, and this rank's workers are idle
 * meanwhile, so the core is free), then sleep between polls, 50 us doubling up to 1 ms: a rank
 * never notices the others more than 1 ms late (a 20 ms cap once cost a seventh of a 4-rank
 * layer, the overshoot of hundreds of short waits). */
enum { SLEEP_MAX_NS = 1000000 };
static const double SPIN_FIRST_S = 2e-3;

/* Which rank is lost: a wait that runs out asks every other rank "are you there?" (TAG_PING) for
 * the last part of the timeout, and names those that do not answer (TAG_PONG) by its end. Every
 * wait answers the pings it finds, so a rank that waits at any step answers; one that is gone (its
 * host down, its link cut) or hung does not. Point-to-point messages on the job's communicator,
 * apart from its collectives. */
enum { TAG_PING = 0x6d71, TAG_PONG = 0x6d72 };
static const double PING_WINDOW_S = 5.0;

static void answer_pings(void) {
    static int32_t pong = 1;   /* the sends below read it after this returns */
    for (int n = 0; n < 64; n++) {
        int found = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_PING, g_comm, &found, &st) != MPI_SUCCESS || !found) return;
        int32_t v;
        if (MPI_Recv(&v, 1, MPI_INT32_T, st.MPI_SOURCE, TAG_PING, g_comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
        MPI_Request r;
        if (MPI_Isend(&pong, 1, MPI_INT32_T, st.MPI_SOURCE, TAG_PONG, g_comm, &r) == MPI_SUCCESS) MPI_Request_free(&r);
    }
}

/* A round of pings: its receives and answers live in storage that is never freed, since MPI may
 * still write an answer that arrives after the round (a cancelled receive, a slow peer). */
typedef struct {
    MPI_Request *recv;            /* [size] the answers (MPI_REQUEST_NULL: this rank) */
    int32_t *answer;
    int *answered;
    bool started;
} ping_round;

static void ping_start(ping_round *pr) {
    static int32_t ping = 1;
    static MPI_Request *recv;
    static int32_t *answer;
    static int *answered;
    static int cap;
    pr->started = true;
    if (g_size > cap) {   /* grown only: an old round's receives may still point into the old */
        MPI_Request *r = malloc(sizeof *r * (size_t)g_size);
        int32_t *a = calloc((size_t)g_size, sizeof *a);
        int *d = calloc((size_t)g_size, sizeof *d);
        if (!r || !a || !d) {
            free(r), free(a), free(d);
            return;
        }
        recv = r, answer = a, answered = d, cap = g_size;
    }
    pr->recv = recv, pr->answer = answer, pr->answered = answered;
    for (int r = 0; r < g_size; r++) {
        pr->recv[r] = MPI_REQUEST_NULL;
        pr->answered[r] = r == g_rank;
        if (r == g_rank) continue;
        MPI_Request sr;
        if (MPI_Irecv(&pr->answer[r], 1, MPI_INT32_T, r, TAG_PONG, g_comm, &pr->recv[r]) != MPI_SUCCESS)
            pr->recv[r] = MPI_REQUEST_NULL;
        if (MPI_Isend(&ping, 1, MPI_INT32_T, r, TAG_PING, g_comm, &sr) == MPI_SUCCESS) MPI_Request_free(&sr);
    }
}

static void ping_poll(ping_round *pr) {
    for (int r = 0; pr->answered && r < g_size; r++)
        if (!pr->answered[r] && pr->recv[r] != MPI_REQUEST_NULL &&
            MPI_Test(&pr->recv[r], &pr->answered[r], MPI_STATUS_IGNORE) != MPI_SUCCESS)
            pr->recv[r] = MPI_REQUEST_NULL;
}

/* "rank 3 does not answer", "ranks 1, 2 and 3 do not answer" (lost or hung), or that all do. */
static void ping_verdict(const ping_round *pr, char *out, size_t n) {
    if (!pr->answered) {
        snprintf(out, n, "no rank could be asked whether it is there");
        return;
    }
    int k = 0, missing = 0;
    for (int r = 0; r < g_size; r++) missing += !pr->answered[r];
    if (missing == 0) {
        snprintf(out, n, "every rank answers (one of them waits at another step)");
        return;
    }
    size_t at = (size_t)snprintf(out, n, "rank%s", missing > 1 ? "s" : "");
    for (int r = 0; r < g_size && at < n; r++) {
        if (pr->answered[r]) continue;
        k++;
        const char *sep = k == 1 ? " " : k == missing ? " and " : ", ";
        at += (size_t)snprintf(out + at, n - at, "%s%d", sep, r);
    }
    if (at < n) snprintf(out + at, n - at, " do%s not answer: lost or hung", missing > 1 ? "" : "es");
}

/* The receives still open are cancelled and let go (a cancel of a receive completes here, without
 * the peer); their storage stays. */
static void ping_end(ping_round *pr) {
    for (int r = 0; pr->answered && r < g_size; r++)
        if (!pr->answered[r] && pr->recv[r] != MPI_REQUEST_NULL) {
            MPI_Cancel(&pr->recv[r]);
            MPI_Request_free(&pr->recv[r]);
        }
}

static moeq_status wait_on(MPI_Request *req, const char *step, bool spin) {
    const double t0 = mq_now();
    long sleep_ns = 50000;
    bool sleeping = false;
    ping_round pr = {NULL, NULL, NULL, false};
    const double ping_at = g_timeout - (g_timeout / 3 < PING_WINDOW_S ? g_timeout / 3 : PING_WINDOW_S);
    for (unsigned polls = 1;; polls++) {
        int done = 0;
        int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            if (pr.started) ping_end(&pr);
            return mpi_fail(rc, "MPI_Test", step);
        }
        if (done) {
            if (pr.started) ping_end(&pr);
            return MOEQ_OK;
        }
        if (!sleeping && polls % 256 != 0) continue;   /* the clock now and then while spinning */
        answer_pings();
        const double waited = mq_now() - t0;
        if (waited > ping_at && !pr.started) ping_start(&pr);
        if (pr.started) ping_poll(&pr);
        if (waited > g_timeout) {
            char who[512];
            ping_verdict(&pr, who, sizeof who);
            ping_end(&pr);
            g_broken = true;
            return mq_err(MOEQ_E_IO, "rank %d: the other ranks did not reach '%s' within %.0f s; %s "
                          "(--mpi-timeout sets the limit); stopping", g_rank, step, g_timeout, who);
        }
        if (spin || waited < SPIN_FIRST_S) continue;
        sleeping = true;
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        sleep_ns = 2 * sleep_ns < SLEEP_MAX_NS ? 2 * sleep_ns : SLEEP_MAX_NS;
    }
}

static double g_wait_s, g_data_s;   /* seconds in agreements / in data transfers */

/* MOEQ_DEBUG_DIST_PROFILE: seconds by kind of step */
enum { PROF_KINDS = 24 };
static struct {
    char kind[40];
    double wait, data;
    int64_t n;
} g_prof[PROF_KINDS];
static int g_prof_n = -1;   /* -1: not yet looked at the environment; -2: off */

static void prof_add(const char *step, double sec, bool data) {
    if (g_prof_n == -1) g_prof_n = mq_env(MQ_ENV_DIST_PROFILE) ? 0 : -2;
    if (g_prof_n < 0) return;
    if (strncmp(step, "layer ", 6) == 0 && strchr(step, ':')) step = strchr(step, ':') + 1;
    while (*step == ' ') step++;
    char kind[40];
    size_t n = strlen(step);
    const char *of = strstr(step, " of ");
    if (of) n = (size_t)(of - step);
    if (n >= sizeof kind) n = sizeof kind - 1;
    memcpy(kind, step, n);
    kind[n] = 0;
    int i = 0;
    while (i < g_prof_n && strcmp(g_prof[i].kind, kind) != 0) i++;
    if (i == g_prof_n) {
        if (g_prof_n == PROF_KINDS) i = PROF_KINDS - 1;   /* the last slot takes the rest */
        else snprintf(g_prof[g_prof_n++].kind, sizeof g_prof[0].kind, "%s", kind);
    }
    *(data ? &g_prof[i].data : &g_prof[i].wait) += sec;
    g_prof[i].n++;
}

static int prof_cmp(const void *a, const void *b) {
    const double x = ((const double *)a)[0], y = ((const double *)b)[0];
    return x > y ? -1 : x < y;
}

void mq_dist_profile_report(void) {
    if (g_prof_n <= 0 || g_size <= 1) return;
    double order[PROF_KINDS][2];
    for (int i = 0; i < g_prof_n; i++) order[i][0] = g_prof[i].wait + g_prof[i].data, order[i][1] = i;
    qsort(order, (size_t)g_prof_n, sizeof order[0], prof_cmp);
    char line[1400];
    int at = snprintf(line, sizeof line, "rank %d: waiting / moving data by step:", g_rank);
    for (int k = 0; k < g_prof_n && at < (int)sizeof line - 80; k++) {
        const int i = (int)order[k][1];
        at += snprintf(line + at, sizeof line - (size_t)at, "%s %s %.2f/%.2f s (%lld)", k ? "," : "",
                       g_prof[i].kind, g_prof[i].wait, g_prof[i].data, (long long)g_prof[i].n);
    }
    fprintf(stderr, "%s\n", line);
    g_prof_n = 0;
}

static moeq_status wait_for(MPI_Request *req, const char *step) {
    double t0 = mq_now();
    moeq_status s = wait_on(req, step, false);
    const double dt = mq_now() - t0;
    g_wait_s += dt;
    prof_add(step, dt, false);
    return s;
}

static moeq_status wait_data(MPI_Request *req, const char *step) {
    double t0 = mq_now();
    moeq_status s = wait_on(req, step, true);
    const double dt = mq_now() - t0;
    g_data_s += dt;
    prof_add(step, dt, true);
    return s;
}

void mq_dist_seconds(double *waiting, double *moving) {
    *waiting = g_wait_s;
    *moving = g_data_s;
}

void mq_dist_reset(void) { g_failed = false; }

static moeq_status failed_before(void) { return mq_err(g_fail_st, "%s", g_fail_msg); }

moeq_status mq_dist_agree(moeq_status st, const char *step) {
    if (g_size <= 1) return st;
    if (g_failed) return failed_before();
    if (g_broken) return st ? st : mq_err(MOEQ_E_IO, "rank %d: an earlier step failed", g_rank);
    int mine = st ? g_rank : g_size, first = g_size;
    MPI_Request req;
    int rc = MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, g_comm, &req);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Iallreduce", step);
    moeq_status ws = wait_for(&req, step);
    if (ws) return ws;
    if (first == g_size) return MOEQ_OK;
    struct {
        int32_t status;
        char msg[1536];
    } m;
    memset(&m, 0, sizeof m);
    if (g_rank == first) {
        m.status = st;
        snprintf(m.msg, sizeof m.msg, "%s", moeq_last_error()[0] ? moeq_last_error() : moeq_status_text(st));
    }
    rc = MPI_Ibcast(&m, (int)sizeof m, MPI_BYTE, first, g_comm, &req);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Ibcast", step);
    if ((ws = wait_for(&req, step))) return ws;
    g_failed = true;
    g_fail_st = (moeq_status)m.status;
    snprintf(g_fail_msg, sizeof g_fail_msg, "rank %d: %s", first, m.msg);
    return failed_before();
}

moeq_status mq_dist_bcast(void *buf, size_t n, int root, const char *step) {
    if (g_size <= 1) return MOEQ_OK;
    if (g_failed) return failed_before();
    for (size_t off = 0; off < n; off += PIECE) {
        size_t len = n - off < PIECE ? n - off : PIECE;
        MPI_Request req;
        int rc = MPI_Ibcast((char *)buf + off, (int)len, MPI_BYTE, root, g_comm, &req);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "MPI_Ibcast", step);
        moeq_status s = wait_data(&req, step);
        if (s) return s;
    }
    return MOEQ_OK;
}

moeq_status mq_dist_bcast_blob(void **buf, size_t *n, int root, const char *step) {
    if (g_size <= 1) return MOEQ_OK;
    uint64_t len = g_rank == root ? (uint64_t)*n : 0;
    moeq_status s = mq_dist_bcast(&len, sizeof len, root, step);
    if (s) return s;
    if (g_rank != root) {
        *n = (size_t)len;
        *buf = malloc(len ? (size_t)len : 1);
        if (!*buf) {
            /* the others would wait in the bcast below: this rank cannot go on */
            g_broken = true;
            return mq_err(MOEQ_E_NOMEM, "rank %d: out of memory for %llu bytes at %s", g_rank,
                          (unsigned long long)len, step);
        }
    }
    return mq_dist_bcast(*buf, (size_t)len, root, step);
}

moeq_status mq_dist_gather_i64(int64_t v, int64_t *max, int64_t *all, const char *step) {
    *max = v;
    if (all) all[0] = v;
    if (g_size <= 1) return MOEQ_OK;
    int64_t *tmp = malloc(sizeof(int64_t) * (size_t)g_size);
    if (!tmp) {
        g_broken = true;
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    MPI_Request req;
    int rc = MPI_Iallgather(&v, 1, MPI_INT64_T, tmp, 1, MPI_INT64_T, g_comm, &req);
    moeq_status s = rc == MPI_SUCCESS ? wait_for(&req, step) : mpi_fail(rc, "MPI_Iallgather", step);
    if (!s) {
        for (int r = 0; r < g_size; r++) {
            if (tmp[r] > *max) *max = tmp[r];
            if (all) all[r] = tmp[r];
        }
    }
    free(tmp);
    return s;
}

/* Point to point, in pieces; the pieces of one message travel in order (same tag). */
static moeq_status p2p(void *buf, size_t n, int peer, bool send, const char *step) {
    if (g_size <= 1) return MOEQ_OK;
    if (g_failed) return failed_before();
    for (size_t off = 0; off < n; off += PIECE) {
        size_t len = n - off < PIECE ? n - off : PIECE;
        MPI_Request req;
        int rc = send ? MPI_Isend((char *)buf + off, (int)len, MPI_BYTE, peer, 7, g_comm, &req)
                      : MPI_Irecv((char *)buf + off, (int)len, MPI_BYTE, peer, 7, g_comm, &req);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, send ? "MPI_Isend" : "MPI_Irecv", step);
        moeq_status s = wait_data(&req, step);
        if (s) return s;
    }
    return MOEQ_OK;
}

moeq_status mq_dist_send(const void *buf, size_t n, int dest, const char *step) {
    return p2p((void *)buf, n, dest, true, step);
}

moeq_status mq_dist_recv(void *buf, size_t n, int src, const char *step) {
    return p2p(buf, n, src, false, step);
}

moeq_status mq_dist_max_f32(float *v, const char *step) {
    if (g_size <= 1) return MOEQ_OK;
    if (g_failed) return failed_before();
    float in = *v;
    MPI_Request req;
    int rc = MPI_Iallreduce(&in, v, 1, MPI_FLOAT, MPI_MAX, g_comm, &req);
    return rc == MPI_SUCCESS ? wait_for(&req, step) : mpi_fail(rc, "MPI_Iallreduce", step);
}

#endif
