/*
 * The parts of GPTQ its files share (not part of quant's interface, gptq.h): gptq_factor.c
 * factorises the Hessians, gptq.c runs the column loop, gptq_kquant.c rounds it to llama.cpp's
 * K-quant grids, gptq_target.c corrects the weights toward the unquantized model's outputs.
 */
#ifndef MOEQ_QUANT_GPTQ_INTERNAL_H
#define MOEQ_QUANT_GPTQ_INTERNAL_H

#include <stdatomic.h>

#include "quant/gptq.h"

/* Every BLAS/LAPACK call of GPTQ runs inside one pool task: OpenBLAS must not start its own
 * threads (that would oversubscribe the cores and could change results with the thread count).
 * Called before the first. */
void mq_gptq_blas_single(void);

/* Blocked right-looking Cholesky over fixed FAC_BLOCK tiles and a triangular inverse over fixed
 * INV_TILE column tiles: each tile operation is one single-threaded BLAS/LAPACK call, and the
 * tiles of a step run as one pool loop (or serially inside a pool task), for one matrix or for
 * several factorised together, so the result depends neither on the thread count nor on which
 * matrices go together. The tile trades the updates' rate against the steps' critical path: on
 * the 16-core Xeon 16 threads ran 256-tile updates at 52-55 GFLOP/s each against 34-36 for
 * 128-tiles, and a chunk of 64 experts' factorisations took 0.86 s a layer against 1.02, but a
 * lone weight's factorisation (diagonal tile, then a panel, then an update, each step in turn)
 * simulated for 16 threads (`bench gptq --simulate-threads 16`) took 3-4x as long with
 * 256-tiles: 128 keeps the lone weight's. */
enum { FAC_BLOCK = 128 };

typedef struct {
    float *A;
    const float *R;
    float *U;
    int64_t K, kb;
    bool pd;   /* in: factor this matrix; out: false if a diagonal tile was not positive definite */
} fac_ctx;

/* Lower Cholesky factors of n matrices at once, each fac_ctx at base + i * stride (its A's
 * row-major lower triangle, in place; pd: in, whether to factor it, out, false where not positive
 * definite): step kb's diagonal tiles, then its panels, then its trailing updates, each step one
 * pool loop over the matrices still going. first: [n + 1] scratch. */
void mq_gptq_cholesky_many(void *base, size_t stride, int64_t n, int64_t *first);

/* Matrix i's tasks are fn(base + i * stride, t, thread) for t < its count, all of them one pool
 * loop, matrix by matrix (first[1 + i] holds matrix i's task count on entry, 0: none; made the
 * running sums here). */
void mq_gptq_ragged_for(mq_task_fn fn, void *base, size_t stride, int64_t n, int64_t *first);
/* The matrix of task `task` among n whose tasks begin at first[] (ascending). */
int64_t mq_gptq_ragged_owner(const int64_t *first, int64_t n, int64_t task);

/* ---- the column loop's state ------------------------------------------------------------------- */

typedef struct {
    float *wt;          /* [K][rows] working copy, transposed, processing order */
    float *et;          /* [block][rows] scaled errors of the current block */
    float *tmp;         /* [G][rows] current values of a group's columns */
    float *dq;          /* [rows] */
    uint8_t *ct;        /* [K][rows] codes, transposed, processing order */
    mq_gparams *gp;     /* [n_groups][rows] */
    float *step, *zero; /* [n_groups][rows] quantization step and zero point of gp */
    uint8_t *ready;     /* [n_groups] */
    float *w0t;         /* [K][rows] original weights (W0'), then the quantized ones */
    float *d;           /* [rows][K] RTN residual rows (rtn_loss only) */
    float *hw;          /* [G] weights of a group's columns in the MSE scale search */
    int64_t *pos;       /* [G] processing positions of a group's columns */
    /* the in-loop scale search (MQ_GPTQ_MSE_LOOP) only: */
    float *ucol;        /* [G][G] U restricted to a group's columns, processing order, by column */
    int64_t *ord;       /* [G] a group's columns (t) in processing order */
    float *wl;          /* [G][rows] a group's current values in processing order */
    float *lwork;       /* [G + 2][rows] mq_gptq_loop_scores work */
    uint8_t *lcode;     /* [rows] */
    mq_gparams *cand;   /* [rows][mse_steps] candidates of each row */
    int *nc;            /* [rows] number of candidates of each row */
    float *kstep, *kzero; /* [mse_steps][rows] the candidates' steps and zeros, by candidate */
    int *bestk;           /* [rows] each row's best candidate so far, -1: none */
    double *score, *best; /* [rows] */
    float *gt;            /* [K][rows] refinement: the gradient (W0' - Q) H', transposed */
    float *hsub, *hcols;  /* [G][G], [K][G] scale refinement: H' of a group, its columns */
    float *cv, *dv;       /* [G][rows] scale refinement: unit values, changes */
    float *xlo, *xhi;     /* [rows] clip search: each row's range and its best multipliers */
    float *blo, *bhi;
} scratch;

/* mq_gptq_loop_scores_ref or its AVX2 twin */
typedef void (*loop_scores_fn)(const mq_qspec *, const float *, int64_t, const float *, int64_t,
                               int64_t, const float *, const float *, float *, uint8_t *, double *);

typedef struct {
    int64_t job, rb;
} task_ref;

typedef struct {
    double e2;          /* sum of squared scaled errors */
    double dsq;         /* ||W0' - Q||^2 */
    double rtn_e2, rtn_dsq;
    double seconds;
} task_out;

typedef struct {
    const mq_qspec *s;
    const mq_gptq_opts *o;
    mq_gptq_job *jobs;
    task_ref *tasks;
    task_out *outs;
    scratch *scr;
    int64_t block;      /* effective block size */
    void (*qdq)(const mq_qspec *, const float *, const float *, const float *, int64_t, uint8_t *,
                float *);
    double (*errors)(const float *, const float *, float, float *, int64_t, float *, double *);
    loop_scores_fn loop_scores;
    int64_t n_tasks;
    atomic_int_fast64_t done;
    const int64_t *order;   /* [n_tasks] the tasks, costliest first */
    int64_t rows;           /* rows per task */
} run_ctx;

static inline int64_t col_of(const mq_gptq_factor *f, int64_t p) { return f->perm ? f->perm[p] : p; }
static inline int64_t pos_of(const mq_gptq_factor *f, int64_t c) {
    return f->inv_perm ? f->inv_perm[c] : c;
}

/* Loop state of one task, passed to the helpers below. */
typedef struct {
    const mq_qspec *s;
    const mq_gptq_factor *f;
    scratch *sc;
    int64_t K, nr, G;
    float gs;
    bool gidx;          /* groups in processing order */
    mq_gptq_mse_weight mse_weight;
    int64_t ncand;            /* room for candidates per row (sc->cand) */
    loop_scores_fn loop_scores;
    bool clip;                /* the clip search (INT4 asymmetric, in-loop scores) */
    /* the column's quantize-dequantize (mq_gptq_qdq_column or a SIMD twin) */
    void (*qdq)(const mq_qspec *, const float *, const float *, const float *, int64_t, uint8_t *, float *);
    int64_t b0, b1, s0, s1;   /* current block and sub-block */
} loop_state;

/* Processing position of the t-th column of group g. */
static inline int64_t group_pos(const loop_state *L, int64_t g, int64_t t) {
    return L->gidx ? g * L->G + t : pos_of(L->f, g * L->G + t);
}

/* The MSE search's weight of the column at processing position q (mq_gptq_mse_weight). */
static inline float column_weight(const loop_state *L, int64_t q) {
    if (L->mse_weight == MQ_GPTQ_MSE_HDIAG) return L->f->hdiag[q];
    /* OBQ (and static groups with the in-loop search: the loss of each column alone) */
    float u = L->f->U[q * L->K + q];
    return 1.0f / (u * u);
}

/* ---- llama.cpp's K-quant grids (gptq_kquant.c) ---------------------------------------------- */

/* sc->ready of a K-quant sub-block whose block's super-scales are fixed and whose multipliers
 * are still to be chosen (its params hold d and dmin meanwhile) */
enum { KQ_PENDING = 2 };

/* Columns a group's params are chosen over at once: a K-quant's whole block of sub-blocks,
 * else the group. */
int64_t mq_gptq_param_span(const mq_qspec *s, int64_t group_size);
/* Dynamic groups: the params of every sub-block of the block of sub-block g, whose first column
 * is reached at processing position p, from its columns' current values (the errors of the
 * current block not yet applied added on the fly, as group_params_dynamic does); ready set. */
void mq_gptq_kq_params_dynamic(const loop_state *L, int64_t g, int64_t p);
/* Static groups: every block's params from the original weights w (rows r0 .. r0 + nr). */
void mq_gptq_kq_params_static(const loop_state *L, const float *w, int64_t r0);
/* The RTN row (the block fit without weights, rounded) of a K-quant, dequantized: q [cols]. */
void mq_gptq_kq_rtn_row(const mq_qspec *s, const float *row, int64_t cols, float *q);

#endif
