/*
 * GPTQ's factorisation (see gptq.c's top comment): dead columns, the act-order permutation,
 * damping retried while Cholesky fails, and U with U^T U = H^-1 as R^-1 of the Cholesky factor
 * of H with rows and columns reversed; several Hessians factorised together, each step's tiles of
 * all of them one pool loop, over fixed tiles so the values depend neither on the thread count
 * nor on which matrices go together.
 */
#include "quant/gptq_internal.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_RETRIES = 16 };

static pthread_once_t g_blas_once = PTHREAD_ONCE_INIT;
static void blas_single_thread(void) { openblas_set_num_threads(1); }
void mq_gptq_blas_single(void) { pthread_once(&g_blas_once, blas_single_thread); }

/* ---- factor ------------------------------------------------------------------------------- */

void mq_gptq_factor_free(mq_gptq_factor *f) {
    if (!f) return;
    MQ_RELEASE_EACH(f->U, f->R, f->perm, f->inv_perm, f->dead, f->hdiag, f->Hp);
    memset(f, 0, sizeof *f);
}

typedef struct {
    float d;
    int32_t i;
} diag_ref;

/* Decreasing diagonal; ties by column index so the order is fully determined. */
static int cmp_diag_desc(const void *a, const void *b) {
    const diag_ref *x = a, *y = b;
    if (x->d != y->d) return x->d > y->d ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

typedef enum { FAC_OK = 0, FAC_NOMEM, FAC_NOT_PD, FAC_SINGULAR } fac_result;

enum { INV_TILE = 128 };

static inline int64_t fac_dim(int64_t K, int64_t b) {
    return K - b * FAC_BLOCK < FAC_BLOCK ? K - b * FAC_BLOCK : FAC_BLOCK;
}

static inline int64_t fac_blocks(int64_t K) { return (K + FAC_BLOCK - 1) / FAC_BLOCK; }

/* ---- several matrices' loops as one pool loop ------------------------------------------------ */

/* Matrix i's tasks are fn(base + i * stride, t, thread) for t < its count, all of them one pool
 * loop, matrix by matrix: a step of several factorisations keeps every thread busy however
 * uneven they are (one task per matrix left threads idle behind the largest, or behind one that
 * needed a second try with more damping: 0.64 of 16 threads, simulated), and each task is the
 * one its matrix alone would run, so the values are the same. */
typedef struct {
    mq_task_fn fn;
    char *base;
    size_t stride;
    const int64_t *first;   /* [n + 1]: each matrix's first task */
    int64_t n;
} ragged_loop;

/* The matrix of task `task` among n whose tasks begin at first[] (ascending; a matrix without
 * tasks has the same first as the next): the last one whose first task is at or before it. */
int64_t mq_gptq_ragged_owner(const int64_t *first, int64_t n, int64_t task) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static void ragged_task(void *vctx, int64_t task, int thread) {
    const ragged_loop *r = vctx;
    const int64_t i = mq_gptq_ragged_owner(r->first, r->n, task);
    r->fn(r->base + (size_t)i * r->stride, task - r->first[i], thread);
}

/* first[1 + i] holds matrix i's task count on entry (0: none); made the running sums here. */
void mq_gptq_ragged_for(mq_task_fn fn, void *base, size_t stride, int64_t n, int64_t *first) {
    first[0] = 0;
    for (int64_t i = 0; i < n; i++) first[i + 1] += first[i];
    ragged_loop r = {fn, base, stride, first, n};
    mq_parallel_for(first[n], ragged_task, &r);
}

/* ---- Cholesky ------------------------------------------------------------------------------- */

/* Diagonal tile kb: its lower Cholesky factor, in place. */
static void chol_diag_task(void *vctx, int64_t task, int thread) {
    (void)task, (void)thread;
    fac_ctx *c = vctx;
    const int64_t K = c->K, k0 = c->kb * FAC_BLOCK;
    /* column-major 'U' on our row-major storage is the row-major lower triangle */
    lapack_int info = LAPACKE_spotrf_work(LAPACK_COL_MAJOR, 'U', (lapack_int)fac_dim(K, c->kb),
                                          c->A + k0 * K + k0, (lapack_int)K);
    MQ_ASSERT(info >= 0);
    if (info > 0) c->pd = false;
}

/* Panel: A[i, k] = A[i, k] L_kk^-T for the row tile i = kb + 1 + task. */
static void chol_panel_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    fac_ctx *c = vctx;
    const int64_t K = c->K, k0 = c->kb * FAC_BLOCK, i0 = (c->kb + 1 + task) * FAC_BLOCK;
    cblas_strsm(CblasRowMajor, CblasRight, CblasLower, CblasTrans, CblasNonUnit,
                (int)fac_dim(K, c->kb + 1 + task), (int)fac_dim(K, c->kb), 1.0f, c->A + k0 * K + k0,
                (int)K, c->A + i0 * K + k0, (int)K);
}

/* Trailing update of tile (i, j), kb < j <= i: A_ij -= A_ik A_jk^T (lower triangle only). */
static void chol_update_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    fac_ctx *c = vctx;
    int64_t i = 0;
    while ((i + 1) * (i + 2) / 2 <= task) i++;
    int64_t j = task - i * (i + 1) / 2;
    i += c->kb + 1;
    j += c->kb + 1;
    const int64_t K = c->K, k0 = c->kb * FAC_BLOCK, kn = fac_dim(K, c->kb);
    const float *aik = c->A + i * FAC_BLOCK * K + k0, *ajk = c->A + j * FAC_BLOCK * K + k0;
    float *aij = c->A + i * FAC_BLOCK * K + j * FAC_BLOCK;
    if (i == j)
        cblas_ssyrk(CblasRowMajor, CblasLower, CblasNoTrans, (int)fac_dim(K, i), (int)kn, -1.0f,
                    aik, (int)K, 1.0f, aij, (int)K);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)fac_dim(K, i), (int)fac_dim(K, j),
                    (int)kn, -1.0f, aik, (int)K, ajk, (int)K, 1.0f, aij, (int)K);
}

/* Lower Cholesky factors of n matrices at once, each fac_ctx at base + i * stride (its A's
 * row-major lower triangle, in place; pd: in, whether to factor it, out, false where not positive
 * definite): step kb's diagonal tiles, then its panels, then its trailing updates, each step one
 * pool loop over the matrices still going. first: [n + 1] scratch. */
void mq_gptq_cholesky_many(void *base, size_t stride, int64_t n, int64_t *first) {
#define FAC_AT(i) ((fac_ctx *)((char *)base + (size_t)(i) * stride))
    int64_t steps = 0;
    for (int64_t i = 0; i < n; i++)
        if (FAC_AT(i)->pd && fac_blocks(FAC_AT(i)->K) > steps) steps = fac_blocks(FAC_AT(i)->K);
    for (int64_t kb = 0; kb < steps; kb++) {
        for (int64_t i = 0; i < n; i++) {
            FAC_AT(i)->kb = kb;
            first[i + 1] = FAC_AT(i)->pd && kb < fac_blocks(FAC_AT(i)->K);
        }
        mq_gptq_ragged_for(chol_diag_task, base, stride, n, first);
        for (int64_t i = 0; i < n; i++) {
            const int64_t m = fac_blocks(FAC_AT(i)->K) - kb - 1;
            first[i + 1] = FAC_AT(i)->pd && m > 0 ? m : 0;
        }
        mq_gptq_ragged_for(chol_panel_task, base, stride, n, first);
        for (int64_t i = 0; i < n; i++) {
            const int64_t m = fac_blocks(FAC_AT(i)->K) - kb - 1;
            first[i + 1] = FAC_AT(i)->pd && m > 0 ? m * (m + 1) / 2 : 0;
        }
        mq_gptq_ragged_for(chol_update_task, base, stride, n, first);
    }
#undef FAC_AT
}

/* Columns [c0, c0 + INV_COLS) of U = R^-1 (U is upper), within the column tile j of INV_TILE
 * columns that ends at j1: solve R[0:j1, 0:j1] X = I[0:j1, c0:c0+n]. Each column is its own
 * right-hand side, so splitting a tile's columns changes no value on most of OpenBLAS's kernel
 * sets (on Haswell's the last bits can move); the system size stays the tile's. A task per column
 * tile made the last tile (costs grow as j1 squared) 17% of the work at K = 2048: at 16 threads
 * the others waited for it; a quarter of a tile is 4%. */
enum { INV_COLS = 32 };

static void inverse_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    fac_ctx *c = vctx;
    const int64_t K = c->K, per = INV_TILE / INV_COLS;
    task = (K + INV_TILE - 1) / INV_TILE * per - 1 - task;   /* the costliest (last) columns first */
    const int64_t tile = task / per;
    const int64_t j1 = (tile + 1) * INV_TILE < K ? (tile + 1) * INV_TILE : K;
    const int64_t c0 = task * INV_COLS, n = j1 - c0 < INV_COLS ? j1 - c0 : INV_COLS;
    if (n <= 0) return;   /* past a short last tile */
    float *X = c->U + c0;
    for (int64_t t = 0; t < n; t++) X[(c0 + t) * K + t] = 1.0f;
    cblas_strsm(CblasRowMajor, CblasLeft, CblasUpper, CblasNoTrans, CblasNonUnit, (int)j1, (int)n,
                1.0f, c->R, (int)K, X, (int)K);
}

/* The factor's O(K^2) copies over blocks of COPY_ROWS rows on the pool (pure copies: any split
 * gives the same matrices; nested in a pool task they run on its thread). */
enum { COPY_ROWS = 64 };

typedef struct {
    const float *H;
    float *A, *Hp;
    const float *diag;
    const int32_t *perm;
    int64_t K;
    float damp;
} copy_ctx;

/* A's lower triangle: H' with rows and columns in reverse processing order, damped diagonal */
static void copy_reversed_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    const copy_ctx *c = vctx;
    const int64_t K = c->K, a1 = (task + 1) * COPY_ROWS < K ? (task + 1) * COPY_ROWS : K;
    for (int64_t a = task * COPY_ROWS; a < a1; a++) {
        const int64_t pa = K - 1 - a, ca = c->perm ? c->perm[pa] : pa;
        for (int64_t b = 0; b <= a; b++) {
            const int64_t pb = K - 1 - b, cb = c->perm ? c->perm[pb] : pb;
            c->A[a * K + b] = c->H[ca * K + cb];
        }
        c->A[a * K + a] = c->diag[ca] + c->damp;
    }
}

/* Hp: H' in processing order (the refinement's), damped diagonal */
static void copy_ordered_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    const copy_ctx *c = vctx;
    const int64_t K = c->K, a1 = (task + 1) * COPY_ROWS < K ? (task + 1) * COPY_ROWS : K;
    for (int64_t a = task * COPY_ROWS; a < a1; a++) {
        const int64_t ca = c->perm ? c->perm[a] : a;
        for (int64_t b = 0; b < K; b++) {
            const int64_t cb = c->perm ? c->perm[b] : b;
            c->Hp[a * K + b] = a == b ? c->diag[ca] + c->damp : c->H[ca * K + cb];
        }
    }
}

/* The lower factor L (A's lower triangle) turned by 180 degrees into the upper R: row a of R is
 * row K-1-a of L reversed, zero below the diagonal. Rows a and K-1-a go together (in place). */
static void rotate_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    const copy_ctx *c = vctx;
    const int64_t K = c->K, half = (K + 1) / 2;
    const int64_t a1 = (task + 1) * COPY_ROWS < half ? (task + 1) * COPY_ROWS : half;
    float *A = c->A;
    for (int64_t a = task * COPY_ROWS; a < a1; a++) {
        const int64_t z = K - 1 - a;   /* the partner row */
        float *ra = A + a * K, *rz = A + z * K;
        if (a == z) {   /* the middle row (odd K): reversed in place */
            for (int64_t i = 0, j = K - 1; i < j; i++, j--) {
                float t = ra[i];
                ra[i] = ra[j];
                ra[j] = t;
            }
        } else {
            for (int64_t i = 0; i < K; i++) {
                float t = ra[i];
                ra[i] = rz[K - 1 - i];
                rz[K - 1 - i] = t;
            }
        }
        memset(ra, 0, (size_t)a * sizeof(float));
        memset(rz, 0, (size_t)z * sizeof(float));
    }
}

/* One Hessian's factorisation while it is made (factor_batch). */
typedef struct {
    const float *H;
    mq_gptq_factor *f;
    float *diag, *A;
    double mean, percdamp;
    int attempt;
    fac_result res;   /* FAC_OK until it fails */
    bool pending;     /* its Cholesky still to (re)try */
    copy_ctx cc;
    fac_ctx fc;
} fac_job;

/* Dead columns, the diagonal, its mean, the act-order permutation and A's memory. */
static void fac_prepare(fac_job *j, const mq_gptq_opts *o) {
    mq_gptq_factor *f = j->f;
    const int64_t K = f->K;
    f->dead = mq_alloc_zero((size_t)K, "GPTQ dead columns");
    j->diag = mq_alloc_array((size_t)K, sizeof(float), "GPTQ diagonal");
    j->A = mq_alloc_array((size_t)K * (size_t)K, sizeof(float), "GPTQ factor");
    if (!f->dead || !j->diag || !j->A) {
        j->res = FAC_NOMEM;
        return;
    }
    double mean = 0;
    for (int64_t i = 0; i < K; i++) {
        float d = j->H[i * K + i];
        if (d == 0.0f) {
            f->dead[i] = 1;
            f->n_dead++;
            d = 1.0f;
        }
        j->diag[i] = d;
        mean += d;
    }
    j->mean = mean / (double)K;
    j->percdamp = o->percdamp;
    if (o->act_order) {
        f->perm = mq_alloc_array((size_t)K, sizeof(int32_t), "GPTQ permutation");
        f->inv_perm = mq_alloc_array((size_t)K, sizeof(int32_t), "GPTQ permutation");
        diag_ref *refs = mq_alloc_array((size_t)K, sizeof(diag_ref), "GPTQ permutation");
        if (!f->perm || !f->inv_perm || !refs) {
            mq_free(refs);
            j->res = FAC_NOMEM;
            return;
        }
        for (int64_t i = 0; i < K; i++) refs[i] = (diag_ref){j->diag[i], (int32_t)i};
        qsort(refs, (size_t)K, sizeof *refs, cmp_diag_desc);
        for (int64_t p = 0; p < K; p++) {
            f->perm[p] = refs[p].i;
            f->inv_perm[refs[p].i] = (int32_t)p;
        }
        mq_free(refs);
    }
    j->pending = true;
}

typedef struct {
    fac_job *J;
    const mq_gptq_opts *o;
} prepare_ctx;

static void fac_prepare_task(void *vctx, int64_t i, int thread) {
    (void)thread;
    const prepare_ctx *c = vctx;
    fac_prepare(&c->J[i], c->o);
}

/* The factorisations of n Hessians at once (jobs[i].H, jobs[i].f->K set; the rest zero), each
 * step's pieces of all of them one pool loop: the dead columns and damping, the Cholesky factor
 * with the damping doubled and the factor retried while it fails (only the ones that failed go
 * again), then R and U = R^-1. Does not touch the thread's error state (the caller turns each
 * jobs[i].res into a message). first: [n + 1] scratch. */
static void factor_batch(fac_job *J, int64_t n, const mq_gptq_opts *o, bool want_R, int64_t *first) {
    const double tb = mq_now();
    double t_chol = 0;
    prepare_ctx pc = {J, o};
    mq_parallel_for(n, fac_prepare_task, &pc);
    /* A = H' with rows and columns in reverse processing order (only the lower triangle, row
     * major, is read by the factorisation), factored; again with more damping where it fails */
    for (bool more = true; more;) {
        for (int64_t i = 0; i < n; i++) {
            fac_job *j = &J[i];
            const int64_t K = j->f->K;
            j->cc = (copy_ctx){j->H, j->A, NULL, j->diag, j->f->perm, K, (float)(j->percdamp * j->mean)};
            j->fc = (fac_ctx){j->A, NULL, NULL, K, 0, j->pending};
            first[i + 1] = j->pending ? (K + COPY_ROWS - 1) / COPY_ROWS : 0;
        }
        mq_gptq_ragged_for(copy_reversed_task, &J[0].cc, sizeof *J, n, first);
        const double t0 = mq_now();
        mq_gptq_cholesky_many(&J[0].fc, sizeof *J, n, first);
        const double dt = mq_now() - t0;
        t_chol += dt;
        more = false;
        for (int64_t i = 0; i < n; i++) {
            fac_job *j = &J[i];
            if (!j->pending) continue;
            mq_gptq_factor *f = j->f;
            f->sec_cholesky += dt;
            if (j->fc.pd) {
                j->pending = false;
                f->percdamp = j->percdamp;
                f->damp = (double)(float)(j->percdamp * j->mean);
                f->retries = j->attempt;
            } else if (j->attempt + 1 >= MAX_RETRIES || j->percdamp * 2 > MQ_GPTQ_MAX_PERCDAMP) {
                j->pending = false;
                j->res = FAC_NOT_PD;
                f->percdamp = j->percdamp;
                f->retries = j->attempt + 1;
            } else {
                j->attempt++;
                j->percdamp = j->percdamp == 0 ? 1e-4 : j->percdamp * 2;
                more = true;
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {   /* H' in processing order for the refinement */
        fac_job *j = &J[i];
        first[i + 1] = 0;
        if (j->res || o->refine_passes <= 0) continue;
        const int64_t K = j->f->K;
        j->f->Hp = mq_alloc_array((size_t)K * (size_t)K, sizeof(float), "GPTQ refinement Hessian");
        if (!j->f->Hp) j->res = FAC_NOMEM;
        j->cc = (copy_ctx){j->H, NULL, j->f->Hp, j->diag, j->f->perm, K, (float)j->f->damp};
        first[i + 1] = j->res ? 0 : (K + COPY_ROWS - 1) / COPY_ROWS;
    }
    mq_gptq_ragged_for(copy_ordered_task, &J[0].cc, sizeof *J, n, first);
    /* Rotating the lower factor L by 180 degrees (reversing the flat array) gives R, upper. */
    for (int64_t i = 0; i < n; i++) {
        fac_job *j = &J[i];
        mq_gptq_factor *f = j->f;
        const int64_t K = f->K;
        first[i + 1] = 0;
        if (j->res) continue;
        f->hdiag = mq_alloc_array((size_t)K, sizeof(float), "GPTQ diagonal");
        f->U = mq_alloc_zero((size_t)K * (size_t)K * sizeof(float), "GPTQ factor");
        if (!f->hdiag || !f->U) {
            j->res = FAC_NOMEM;
            continue;
        }
        for (int64_t p = 0; p < K; p++) f->hdiag[p] = j->diag[f->perm ? f->perm[p] : p];
        j->cc = (copy_ctx){NULL, j->A, NULL, NULL, NULL, K, 0};
        first[i + 1] = ((K + 1) / 2 + COPY_ROWS - 1) / COPY_ROWS;
    }
    mq_gptq_ragged_for(rotate_task, &J[0].cc, sizeof *J, n, first);
    /* U's pages faulted in on the pool first: every inverse task writes a column block down all
     * the rows, so the first (the largest) took the zeroing of all of U's pages (5.8 of its 6
     * ms at K = 2048, the whole step's time at 16 threads). Only a speed-up: skipped without
     * memory for the lists. */
    void **ub = malloc(sizeof *ub * (size_t)(n + 1));
    size_t *un = malloc(sizeof *un * (size_t)(n + 1));
    if (ub && un) {
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++)
            if (!J[i].res) ub[m] = J[i].f->U, un[m++] = (size_t)J[i].f->K * (size_t)J[i].f->K * sizeof(float);
        mq_touch_pages(ub, un, m);
    }
    free(ub);
    free(un);
    for (int64_t i = 0; i < n; i++) {
        fac_job *j = &J[i];
        j->fc = (fac_ctx){NULL, j->A, j->f->U, j->f->K, 0, true};
        first[i + 1] = j->res ? 0 : (j->f->K + INV_TILE - 1) / INV_TILE * (INV_TILE / INV_COLS);
    }
    const double t0 = mq_now();
    mq_gptq_ragged_for(inverse_task, &J[0].fc, sizeof *J, n, first);
    const double dt = mq_now() - t0, t_copies = t0 - tb - t_chol;
    for (int64_t i = 0; i < n; i++) {
        fac_job *j = &J[i];
        mq_gptq_factor *f = j->f;
        mq_free(j->diag);
        j->diag = NULL;
        if (j->res) {
            mq_free(j->A);
            j->A = NULL;
            continue;
        }
        f->sec_inverse = dt;
        f->sec_copies = t_copies;
        if (want_R) f->R = j->A;
        else mq_free(j->A);
        j->A = NULL;
        for (int64_t p = 0; p < f->K; p++)
            if (!isfinite(f->U[p * f->K + p])) {
                j->res = FAC_SINGULAR;
                break;
            }
    }
}

static moeq_status check_hessian(const float *H, int64_t K, const char *name) {
    if (K <= 0) return mq_err(MOEQ_E_SHAPE, "%s: Hessian size %lld", name, (long long)K);
    for (int64_t i = 0; i < K * K; i++)
        if (!isfinite(H[i]))
            return mq_err(MOEQ_E_NUMERIC, "%s: non-finite Hessian entry %g at (%lld, %lld)", name,
                          (double)H[i], (long long)(i / K), (long long)(i % K));
    return MOEQ_OK;
}

/* Turns a factor_batch result into the thread's error message and the damping log. */
static moeq_status factor_report(fac_result r, const mq_gptq_opts *o, const char *name,
                                 mq_gptq_factor *f) {
    switch (r) {
    case FAC_OK:
        if (f->retries > 0)
            mq_warn("%s: Hessian not positive definite with percdamp %g; raised to %g", name,
                    o->percdamp, f->percdamp);
        return MOEQ_OK;
    case FAC_NOMEM:
        mq_gptq_factor_free(f);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory factorising the Hessian", name);
    case FAC_NOT_PD: {
        double pd = f->percdamp;
        mq_gptq_factor_free(f);
        return mq_err(MOEQ_E_NUMERIC,
                      "%s: Hessian not positive definite even with percdamp raised to %g", name, pd);
    }
    default:
        mq_gptq_factor_free(f);
        return mq_err(MOEQ_E_NUMERIC, "%s: Cholesky factor of the Hessian is singular", name);
    }
}

moeq_status mq_gptq_factor_init(const float *H, int64_t K, const mq_gptq_opts *o, bool want_R,
                                const char *name, mq_gptq_factor *f) {
    memset(f, 0, sizeof *f);
    moeq_status st = check_hessian(H, K, name);
    if (st) return st;
    mq_gptq_blas_single();
    fac_job j = {.H = H, .f = f};
    int64_t first[2];
    f->K = K;
    factor_batch(&j, 1, o, want_R, first);
    return factor_report(j.res, o, name, f);
}

moeq_status mq_gptq_factor_many(const float *const *H, const int64_t *K, int64_t n,
                                const mq_gptq_opts *o, bool want_R, const char *const *names,
                                mq_gptq_factor *f) {
    memset(f, 0, (size_t)n * sizeof *f);
    uint8_t *ok = mq_alloc_array((size_t)n + 1, 1, "GPTQ Hessian checks");
    int64_t *sizes = mq_alloc_array((size_t)n + 1, sizeof *sizes, "GPTQ Hessian checks");
    moeq_status cst = ok && sizes ? MOEQ_OK : MOEQ_E_NOMEM;
    for (int64_t i = 0; i < n && !cst; i++) sizes[i] = K[i] > 0 ? K[i] * K[i] : 0;
    if (!cst) cst = mq_all_finite_many(H, sizes, n, ok);
    mq_free(sizes);
    if (cst) {
        mq_free(ok);
        return cst;
    }
    for (int64_t i = 0; i < n; i++) {
        if (!H[i]) continue;
        moeq_status st = K[i] <= 0 || !ok[i] ? check_hessian(H[i], K[i], names[i]) : MOEQ_OK;
        if (st) {
            mq_free(ok);
            return st;
        }
    }
    mq_free(ok);
    /* the largest first (K^3; ties in order): the pool hands out each step's pieces in order */
    int64_t *order = mq_alloc_array((size_t)n + 1, sizeof *order, "GPTQ factor order");
    int64_t *first = mq_alloc_array((size_t)n + 1, sizeof *first, "GPTQ factor order");
    fac_job *J = mq_alloc_zero((size_t)n * sizeof *J + 1, "GPTQ factor jobs");
    if (!order || !first || !J) {
        mq_free(order);
        mq_free(first);
        mq_free(J);
        return MOEQ_E_NOMEM;
    }
    int64_t m = 0;   /* Hessians to factor */
    for (int64_t i = 0; i < n; i++) {
        if (!H[i]) continue;
        int64_t u = m++;
        for (; u > 0 && K[order[u - 1]] < K[i]; u--) order[u] = order[u - 1];
        order[u] = i;
    }
    mq_gptq_blas_single();
    for (int64_t u = 0; u < m; u++) {
        J[u] = (fac_job){.H = H[order[u]], .f = &f[order[u]]};
        f[order[u]].K = K[order[u]];
    }
    factor_batch(J, m, o, want_R, first);
    moeq_status st = MOEQ_OK;
    for (int64_t i = 0; i < n; i++) first[i] = -1;   /* now each input's job */
    for (int64_t u = 0; u < m; u++) first[order[u]] = u;
    for (int64_t i = 0; i < n; i++) {   /* the first failure in the inputs' order keeps its message */
        if (first[i] < 0) continue;
        moeq_status si = factor_report(J[first[i]].res, o, names[i], &f[i]);
        if (si && !st) st = si;
    }
    mq_free(order);
    mq_free(first);
    mq_free(J);
    if (st)
        for (int64_t i = 0; i < n; i++) mq_gptq_factor_free(&f[i]);
    return st;
}
