/*
 * Asymmetric calibration's target for GPTQ (mq_gptq_target, gptq.h): each Linear's weights
 * corrected toward the unquantized model's outputs before GPTQ, by a damped least-squares solve
 * over the Hessian's Cholesky factor (gptq_factor.c's tiles).
 */
#include "quant/gptq_internal.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- asymmetric calibration's target (mq_gptq_target) ---------------------------------------- */

/* The correction in three steps over the pool, each cut into fixed blocks (the same whatever the
 * thread count): per input, R = share ((2/n) G - H)^T and the Cholesky factor L of H + damping
 * (the factorisation's tiles, of every input of a wave in one loop a step); R := (L L^T)^-1 R in
 * blocks of 128 columns (each block reads all of L twice: 16 threads solved 128-column blocks at
 * 52-54 GFLOP/s each against 44-49 for 64 on the Xeon); then W += W R^T in blocks of 256 rows,
 * each block's product as OpenBLAS tiles of 256 columns (each tile packs the block's rows again:
 * 16 threads ran 256 x 256 tiles at 70-79 GFLOP/s each against 66-73 for 256 x 128 there). BLAS
 * runs single-threaded in every task. */
enum { TARGET_COLS = 128, TARGET_ROWS = 256, TARGET_TILE_N = 256 };

/* The right-hand sides R = share ((2/n) G - H)^T and the lower triangle of H (the damping added
 * to A's diagonal after) in blocks of TARGET_FILL rows: elementwise, any split gives the same
 * matrices. */
enum { TARGET_FILL = 64 };

typedef struct {
    const mq_gptq_target_job *j;
    float *A, *R;   /* R NULL: A's triangle only (a retry) */
    float sc;
} target_fill;

typedef struct {
    const mq_gptq_target_job *j;
    float *A, *R;          /* [K, K]: H + damping, then its factor L; the right-hand sides */
    bool live;             /* factored: the solve and product steps run for it */
    moeq_status st;
    char msg[320];
    double mean_diag;
    target_fill fill;
    fac_ctx fc;
} target_input;

typedef struct {
    target_input *in;
    int64_t n;
    int64_t *first;        /* [n + 1]: each input's first task of the step */
    float *scratch;        /* [pool threads][TARGET_ROWS * Kmax] */
    int64_t kmax;
} target_step;

static void target_fill_task(void *vctx, int64_t b, int thread) {
    (void)thread;
    const target_fill *f = vctx;
    const int64_t K = f->j->K, a0 = b * TARGET_FILL, a1 = a0 + TARGET_FILL < K ? a0 + TARGET_FILL : K;
    const float *H = f->j->H, *G = f->j->G;
    if (f->R)   /* rows [a0, a1) of the transposes, by 64-column blocks (both read down columns) */
        for (int64_t c0 = 0; c0 < K; c0 += 64)
            for (int64_t a = a0; a < a1; a++)
                for (int64_t c = c0; c < K && c < c0 + 64; c++)
                    f->R[a * K + c] = f->j->share * (f->sc * G[c * K + a] - H[c * K + a]);
    for (int64_t a = a0; a < a1; a++) memcpy(f->A + a * K, H + a * K, sizeof(float) * (size_t)(a + 1));
}

/* The wave's right-hand sides and Cholesky factors L of H + damping: every input's fill blocks
 * in one loop, then the factorisations' steps together (cholesky_many; a wave of fewer inputs
 * than threads, the attention's one at a time, still spreads its tiles over every core), the
 * damping raised tenfold where one fails, as GPTQ's is, up to three times. */
static void target_factor(target_input *in, int64_t n, int64_t *first) {
    for (int64_t i = 0; i < n; i++) {
        target_input *t = &in[i];
        const mq_gptq_target_job *j = t->j;
        const int64_t K = j->K;
        t->A = mq_alloc_array((size_t)K, (size_t)K * sizeof(float), "asymmetric calibration");
        t->R = mq_alloc_array((size_t)K, (size_t)K * sizeof(float), "asymmetric calibration");
        first[i + 1] = 0;
        if (!t->A || !t->R) {
            t->st = MOEQ_E_NOMEM;
            snprintf(t->msg, sizeof t->msg, "%s: out of memory for asymmetric calibration", j->name);
            continue;
        }
        t->mean_diag = 0;
        for (int64_t k = 0; k < K; k++) t->mean_diag += j->H[k * K + k];
        t->mean_diag /= (double)K;
        t->fill = (target_fill){j, t->A, t->R, 2.0f / (float)j->n};
        t->fc = (fac_ctx){t->A, NULL, NULL, K, 0, true};
        first[i + 1] = (K + TARGET_FILL - 1) / TARGET_FILL;
    }
    for (int r = 0; r < 4; r++) {
        if (r > 0) {   /* a retry copies the triangle again, for the inputs still to factor */
            for (int64_t i = 0; i < n; i++) {
                in[i].fill.R = NULL;
                first[i + 1] = in[i].fc.pd ? (in[i].j->K + TARGET_FILL - 1) / TARGET_FILL : 0;
            }
        }
        mq_gptq_ragged_for(target_fill_task, &in[0].fill, sizeof *in, n, first);
        for (int64_t i = 0; i < n; i++) {
            target_input *t = &in[i];
            if (!t->fc.pd) continue;
            const int64_t K = t->j->K;
            const float damp = (float)(t->j->percdamp * pow(10.0, r) * t->mean_diag) + (t->mean_diag == 0);
            for (int64_t a = 0; a < K; a++) t->A[a * K + a] = t->j->H[a * K + a] + damp;
        }
        mq_gptq_cholesky_many(&in[0].fc, sizeof *in, n, first);
        bool again = false;
        for (int64_t i = 0; i < n; i++) {
            target_input *t = &in[i];
            if (t->st || t->live) continue;
            if (t->fc.pd) t->live = true, t->fc.pd = false;   /* done: not factored again */
            else if (r < 3) t->fc.pd = again = true;
        }
        if (!again) break;
    }
    for (int64_t i = 0; i < n; i++)
        if (!in[i].st && !in[i].live) {
            in[i].st = MOEQ_E_NUMERIC;
            snprintf(in[i].msg, sizeof in[i].msg, "%s: asymmetric calibration: the damped Hessian is not positive "
                     "definite (damping up to 1000x percdamp)", in[i].j->name);
        }
}

/* Columns [64 b, 64 b + 64) of an input's R := (L L^T)^-1 R. */
static void target_solve_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    const target_step *c = vctx;
    const int64_t i = mq_gptq_ragged_owner(c->first, c->n, task);
    const target_input *t = &c->in[i];
    const int64_t K = t->j->K, c0 = (task - c->first[i]) * TARGET_COLS;
    const int64_t nc = K - c0 < TARGET_COLS ? K - c0 : TARGET_COLS;
    cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasNonUnit, (int)K, (int)nc, 1.0f, t->A,
                (int)K, t->R + c0, (int)K);
    cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasTrans, CblasNonUnit, (int)K, (int)nc, 1.0f, t->A,
                (int)K, t->R + c0, (int)K);
}

/* Rows [256 b, 256 b + 256) of one of an input's weights: W += W R^T through the thread's
 * scratch (the block's old rows are read by every column tile). */
static void target_product_task(void *vctx, int64_t task, int thread) {
    const target_step *c = vctx;
    const int64_t i = mq_gptq_ragged_owner(c->first, c->n, task);
    const target_input *t = &c->in[i];
    const mq_gptq_target_job *j = t->j;
    const int64_t K = j->K;
    int64_t b = task - c->first[i], k = 0;
    while (b >= (j->rows[k] + TARGET_ROWS - 1) / TARGET_ROWS) b -= (j->rows[k++] + TARGET_ROWS - 1) / TARGET_ROWS;
    const int64_t r0 = b * TARGET_ROWS, m = j->rows[k] - r0 < TARGET_ROWS ? j->rows[k] - r0 : TARGET_ROWS;
    float *w = j->W[k] + r0 * K, *ws = c->scratch + (size_t)thread * (size_t)(TARGET_ROWS * c->kmax);
    memcpy(ws, w, sizeof(float) * (size_t)(m * K));
    for (int64_t n0 = 0; n0 < K; n0 += TARGET_TILE_N) {
        const int64_t nn = K - n0 < TARGET_TILE_N ? K - n0 : TARGET_TILE_N;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nn, (int)K, 1.0f, w, (int)K,
                    t->R + n0 * K, (int)K, 1.0f, ws + n0, (int)K);
    }
    memcpy(w, ws, sizeof(float) * (size_t)(m * K));
}

/* Inputs in[0..n) through the three steps. */
static moeq_status target_wave(target_input *in, int64_t n, double sec[3]) {
    const int P = mq_pool_size();
    double t0 = mq_now();
    target_step c = {in, n, malloc(sizeof(int64_t) * (size_t)(n + 1)), NULL, 0};
    moeq_status st = c.first ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!st) target_factor(in, n, c.first);
    sec[0] += mq_now() - t0;
    t0 = mq_now();
    for (int64_t i = 0; i < n; i++)
        if (in[i].live && in[i].j->K > c.kmax) c.kmax = in[i].j->K;
    if (!st && c.kmax > 0) {
        c.first[0] = 0;
        for (int64_t i = 0; i < n; i++)
            c.first[i + 1] = c.first[i] + (in[i].live ? (in[i].j->K + TARGET_COLS - 1) / TARGET_COLS : 0);
        mq_parallel_for(c.first[n], target_solve_task, &c);
        sec[1] += mq_now() - t0;
        c.scratch = mq_alloc_array((size_t)P * TARGET_ROWS, (size_t)c.kmax * sizeof(float), "asymmetric calibration");
        if (!c.scratch) st = MOEQ_E_NOMEM;
    }
    if (!st && c.kmax > 0) {
        for (int64_t i = 0; i < n; i++) {
            int64_t blocks = 0;
            for (int k = 0; in[i].live && k < in[i].j->nw; k++) blocks += (in[i].j->rows[k] + TARGET_ROWS - 1) / TARGET_ROWS;
            c.first[i + 1] = c.first[i] + blocks;
        }
        t0 = mq_now();
        mq_parallel_for(c.first[n], target_product_task, &c);
        sec[2] += mq_now() - t0;
    }
    for (int64_t i = 0; i < n; i++) {
        mq_free(in[i].A);
        mq_free(in[i].R);
        in[i].A = in[i].R = NULL;
    }
    mq_free(c.scratch);
    free(c.first);
    return st;
}

/* Job indices by K, largest first (stable): a wave then holds inputs alike, and its steps' loops
 * (the factorisations' tiles, the solves, the products) hand out the largest inputs' tasks first,
 * so the small ones fill the end. Each job corrects its own weights, so the order changes no
 * value. */
static int64_t *jobs_by_k(const mq_gptq_target_job *jobs, int64_t n) {
    int64_t *o = malloc(sizeof *o * (size_t)(n > 0 ? n : 1));
    if (!o) return NULL;
    for (int64_t i = 0; i < n; i++) {   /* insertion: a layer has at most a few hundred inputs */
        int64_t k = i;
        while (k > 0 && jobs[o[k - 1]].K < jobs[i].K) o[k] = o[k - 1], k--;
        o[k] = i;
    }
    return o;
}

moeq_status mq_gptq_target_many(const mq_gptq_target_job *jobs, int64_t n_jobs, double sec[3]) {
    double own[3];
    if (!sec) sec = own;
    sec[0] = sec[1] = sec[2] = 0;
    mq_gptq_blas_single();
    const int64_t P = mq_pool_size(), wave = n_jobs >= P ? P : 1;
    target_input *in = calloc((size_t)(wave > 0 ? wave : 1), sizeof *in);
    int64_t *order = jobs_by_k(jobs, n_jobs);
    if (!in || !order) {
        free(in);
        free(order);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    moeq_status st = MOEQ_OK, fst = MOEQ_OK;
    int64_t failed = -1;   /* the first job, in the jobs' order, whose input failed: fst, fmsg */
    char fmsg[320] = "";
    for (int64_t i0 = 0; i0 < n_jobs && !st; i0 += wave) {
        int64_t n = 0;
        for (int64_t i = i0; i < n_jobs && i < i0 + wave; i++) {
            const mq_gptq_target_job *j = &jobs[order[i]];
            if (j->n <= 0 || j->share == 0.0f || j->K <= 0) continue;   /* nothing to correct */
            memset(&in[n], 0, sizeof in[n]);
            in[n++].j = j;
        }
        st = target_wave(in, n, sec);
        for (int64_t i = 0; i < n && !st; i++)
            if (in[i].st && (failed < 0 || in[i].j - jobs < failed)) {
                failed = in[i].j - jobs;
                fst = in[i].st;
                snprintf(fmsg, sizeof fmsg, "%s", in[i].msg);
            }
    }
    free(in);
    free(order);
    return st ? st : fst ? mq_err(fst, "%s", fmsg) : MOEQ_OK;
}

moeq_status mq_gptq_target(const float *H, const float *G, int64_t K, int64_t n, float share, double percdamp,
                           float *const *W, const int64_t *rows, int nw, const char *name) {
    mq_gptq_target_job j = {H, G, K, n, share, percdamp, W, rows, nw, name};
    return mq_gptq_target_many(&j, 1, NULL);
}

