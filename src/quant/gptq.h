/*
 * GPTQ (Frantar et al., arXiv 2210.17323) on weights W [rows, K] whose input has the Hessian
 * H [K, K] = (2/n) sum x x^T. See ../shared/docs/torchao_gptq.md sections 3-6 and
 * ../shared/docs/formats.md section 4 for the reference algorithm.
 *
 * Two steps, so weights that read the same activation (q/k/v; gate/up; an expert's w1/w3) share
 * one factorisation:
 *   mq_gptq_factor_init   dead columns, damping (raised and retried if Cholesky fails), the
 *                         act-order permutation and U = upper Cholesky factor of H^-1;
 *   mq_gptq_run           the column loop for any number of (factor, weight) jobs at once: all
 *                         row blocks of all jobs form one parallel loop, so the experts of a layer
 *                         run in parallel. Results never depend on the thread count.
 */
#ifndef MOEQ_GPTQ_H
#define MOEQ_GPTQ_H

#include "formats/formats.h"
#include "kernels/gptq_kernels.h"

/* When a group's quantization parameters are taken. */
typedef enum {
    /* From the current weights (with the error feedback of every column processed before) when
     * the group's first column is reached: the group start in natural order (GPTQ's default);
     * with act-order, the first of its columns in act order. Groups stay runs of consecutive
     * columns of the original order, so every checkpoint format can store the result. */
    MQ_GPTQ_GROUPS_DYNAMIC = 0,
    /* From the original weights, before the loop (GPTQ's --static-groups). */
    MQ_GPTQ_GROUPS_STATIC,
    /* With act-order: groups are runs of group_size consecutive columns in act order and g_idx
     * gives each column's group (the GPTQ checkpoint format; INT4 only). Without act-order the
     * same as DYNAMIC. */
    MQ_GPTQ_GROUPS_GIDX,
} mq_gptq_groups;

/* How the MSE scale search (spec.mse) weighs each column's squared error in a group. */
typedef enum {
    MQ_GPTQ_MSE_PLAIN = 0,   /* sum (w_j - q_j)^2 */
    MQ_GPTQ_MSE_HDIAG,       /* sum H_jj (w_j - q_j)^2: the layer loss with H's diagonal only */
    MQ_GPTQ_MSE_OBQ,         /* sum (w_j - q_j)^2 / [H_F^-1]_jj = sum ((w_j - q_j) / U_jj)^2: the
                                loss GPTQ's update leaves for column j (OBQ), H_F the Hessian of
                                the columns not yet quantized when j is reached */
    MQ_GPTQ_MSE_LOOP,        /* each candidate scored by running GPTQ over the group's columns
                                (quantize, error feedback within the group): sum of e_j^2, the
                                group's share of the layer loss */
} mq_gptq_mse_weight;

typedef struct {
    double percdamp;         /* damping = percdamp * mean(diag H) added to the diagonal */
    mq_gptq_mse_weight mse_weight;
    int32_t block_size;      /* columns per lazy batch update */
    bool act_order;          /* process columns in order of decreasing diag(H) */
    mq_gptq_groups groups;
    bool rtn_loss;           /* also compute the RTN loss (N*K^2 more flops) */
    int32_t refine_passes;   /* after the column loop, passes of coordinate descent over the
                                codes on GPTQ's objective, the group parameters fixed (never
                                raises it; refine_rows in gptq.c). 0: none */
    bool refine_scales;      /* with refine_passes: after each pass over the codes, each group's
                                scale moved to the stored value nearest to its least-squares
                                optimum for the codes, when that lowers the objective */
    bool clip_search;        /* INT4 asymmetric with MQ_GPTQ_MSE_LOOP: the two ends of each
                                group's range clipped apart (set_params_clip in gptq.c; three
                                rounds of the grid, never worse than the plain search's score) */
    /* Progress of mq_gptq_run (label NULL: none): mq_progress(label, base + span * done tasks /
     * all tasks, total), from the calling thread. */
    const char *progress_label;
    int64_t progress_base, progress_span, progress_total;
} mq_gptq_opts;

/* percdamp 0.01, block 128, natural order, dynamic groups, RTN loss on. */
mq_gptq_opts mq_gptq_opts_default(void);

/* The part of GPTQ that depends on H only. */
typedef struct {
    int64_t K;
    float *U;                /* [K, K] upper Cholesky factor of H'^-1 in processing order (lower
                                part zero); H' = H with dead columns fixed, permuted, damped */
    float *R;                /* [K, K] upper, H' = R R^T (for the RTN loss); NULL if not kept */
    int32_t *perm;           /* [K] processing position -> original column; NULL = identity */
    int32_t *inv_perm;       /* [K] original column -> processing position; NULL = identity */
    uint8_t *dead;           /* [K] 1 where diag(H) == 0 (input never non-zero), original order */
    float *hdiag;            /* [K] diag(H) in processing order (dead columns 1, undamped) */
    float *Hp;               /* [K, K] H' in processing order (opts.refine_passes), else NULL */
    int64_t n_dead;
    double percdamp;         /* damping fraction finally used (after retries) */
    double damp;             /* absolute damping added to the diagonal */
    int retries;             /* failed Cholesky attempts before the one that worked */
    double sec_cholesky, sec_inverse;   /* wall seconds of the two; a batch (mq_gptq_factor_many) gives
                                           each of its factors the whole batch's */
    double sec_copies;                  /* the same of the rest: dead columns, copies, the rotation,
                                           U's page faults */
} mq_gptq_factor;

/* H [K, K] symmetric (read in full; must be finite). name is used in messages. Not positive
 * definite even after the damping was raised up to MQ_GPTQ_MAX_PERCDAMP: MOEQ_E_NUMERIC. Each
 * raise is logged with mq_warn. want_R keeps the factor the RTN loss needs. */
#define MQ_GPTQ_MAX_PERCDAMP 100.0
moeq_status mq_gptq_factor_init(const float *H, int64_t K, const mq_gptq_opts *o, bool want_R,
                                const char *name, mq_gptq_factor *f);
/* Factorises n Hessians (H[i] of size K[i]) together: each step's tiles of all of them (copies,
 * Cholesky steps, inverse columns; single-threaded BLAS/LAPACK calls) one pool loop, the largest
 * first, a retry with more damping only for those that failed; the values are
 * mq_gptq_factor_init's of each alone. Every factor's memory is held at once (the plan counts it
 * per input). H[i] may be NULL to skip (f[i] is then zeroed). On error every factor is freed. */
moeq_status mq_gptq_factor_many(const float *const *H, const int64_t *K, int64_t n,
                                const mq_gptq_opts *o, bool want_R, const char *const *names,
                                mq_gptq_factor *f);
void mq_gptq_factor_free(mq_gptq_factor *f);
/* Rows per column-loop task (speed only: the results do not depend on it); MOEQ_DEBUG_GPTQ_ROWS sets
 * it for measurements, mq_gptq_set_row_block for tests (out of 1..512: the default). */
int mq_gptq_row_block(void);
void mq_gptq_set_row_block(int rows);
/* mq_gptq_run keeps its per-thread scratch for the next run (the slabs' page faults are paid once,
 * not by every run's first tasks); this frees it (the pipeline after each stage that runs GPTQ). */
void mq_gptq_release_scratch(void);

typedef struct {
    double loss;             /* tr((W-Q) H (W-Q)^T) with the H given (undamped) */
    double rtn_loss;         /* the same for round-to-nearest with the same spec and global
                                scale; NaN unless opts.rtn_loss */
    double percdamp;         /* damping fraction used */
    int64_t n_dead;
    double seconds;          /* wall time of this job's share (factor excluded) */
} mq_gptq_stats;

typedef struct {
    const mq_gptq_factor *f;
    const float *w;          /* [rows, f->K] original weights (not modified) */
    int64_t rows;
    float global_scale;      /* NVFP4 (spec convention), e.g. shared by fused gate/up;
                                <= 0: from the absolute max of this w */
    const char *name;
    mq_qtensor *out;         /* initialised by mq_gptq_run (free with mq_qtensor_free) */
    float *deq;              /* optional [rows, K]: the dequantized result, in original order;
                                may be w itself (each row block of w is read before its
                                dequantized rows replace it) */
    mq_gptq_stats stats;     /* filled by mq_gptq_run */
    const mq_qspec *spec;    /* NULL: mq_gptq_run's; else this job's own (the tensors of a mixed
                                K-quant recipe each have their block type) */
} mq_gptq_job;

/* Runs GPTQ for every job. Errors (bad shape or spec, non-finite weights, out of memory,
 * interrupt) name the tensor; on error every out is freed. */
moeq_status mq_gptq_run(const mq_qspec *s, const mq_gptq_opts *o, mq_gptq_job *jobs,
                        int64_t n_jobs);

/* One weight, one Hessian: factor + run. */
moeq_status mq_gptq_quantize(const mq_qspec *s, const mq_gptq_opts *o, const float *H,
                             const float *w, int64_t rows, int64_t cols, float global_scale,
                             const char *name, mq_qtensor *out, float *deq,
                             mq_gptq_stats *stats);

/* GPTQ's column kernels (the quantize-dequantize step, the error step, the in-loop scale
 * search's scores) and their SIMD twins: kernels/gptq_kernels.h. */

/* The damping sweep: for each candidate percdamp cand[c], GPTQ of the weights w[k] [rows[k], K]
 * (NVFP4 global scales gs[k], NULL: each weight's own) on H_fit, the Hessian of the fitting
 * rows, scored by the held-out loss loss[c] = sum_k tr((W_k - Q_k) H_held (W_k - Q_k)^T), H_held
 * the Hessian of rows GPTQ did not see. *best = the first candidate with the least loss. A
 * candidate whose factorisation fails even with the damping raised scores +inf; none left:
 * MOEQ_E_NUMERIC. Costs nc GPTQ runs and nc held-out losses (2 rows K^2 flops each). */
moeq_status mq_gptq_damp_sweep(const mq_qspec *s, const mq_gptq_opts *o, const float *H_fit,
                               const float *H_held, int64_t K, const float *const *w,
                               const int64_t *rows, const float *gs, int nw, const double *cand,
                               int nc, const char *name, int *best, double *loss);

/* Asymmetric calibration (GPTAQ's target, a share of it): GPTQ of the weights W that read one
 * input then aims at the unquantized model's outputs instead of the same weights' outputs on the
 * quantized stream. With H the Hessian GPTQ runs on ((2/n) sum x_q x_q^T, both triangles, from
 * mq_hessian_get) and G = sum x_f x_q^T over the same n rows (x_f the unquantized model's input
 * of the same token; mq_cross_det_acc), each W [rows[k], K] becomes
 *     W + share W ((2/n) G - H)(H + percdamp mean(diag H) I)^-1,
 * the least-squares correction toward x_f W^T from x_q, damped as GPTQ damps. Written as a
 * correction, so the damping bounds the correction alone: W (2/n) G (H + damping)^-1 taken
 * literally shrinks W along H's small directions even where the two streams agree. The share
 * (0.5 measured best on the fixtures, docs/results/gptq_results.md) keeps it from fitting the few routed
 * tokens of an expert. Deterministic (fixed pool tiles, single-threaded BLAS inside each). */
moeq_status mq_gptq_target(const float *H, const float *G, int64_t K, int64_t n, float share, double percdamp,
                           float *const *W, const int64_t *rows, int nw, const char *name);

/* mq_gptq_target for several inputs (a chunk's experts), the same values: each input's
 * factorisation is one pool task, and the solves and the weights' products of all of them are
 * cut into column and row blocks that go over the pool together, so uneven inputs leave no
 * thread idle. Inputs are taken up to one per pool thread at a time when there are at least as
 * many as threads, else one at a time (each holds 2 K^2 floats while it is corrected), largest K
 * first, so a wave's factorisations (one task each) are alike. Every input is tried; the first
 * failure in the order of the jobs is the one reported. */
typedef struct {
    const float *H, *G;
    int64_t K, n;
    float share;
    double percdamp;
    float *const *W;
    const int64_t *rows;
    int nw;
    const char *name;
} mq_gptq_target_job;
/* sec (NULL: not wanted): the wall seconds of the three steps over all waves, {factorisations
 * (with the right-hand sides' fill), solves, products}, for MOEQ_DEBUG_PROFILE. */
moeq_status mq_gptq_target_many(const mq_gptq_target_job *jobs, int64_t n_jobs, double sec[3]);

/* tr((W-Q) H (W-Q)^T) computed directly (2*rows*K^2 flops, double accumulation). */
double mq_gptq_loss(const float *H, int64_t K, const float *w, const float *q, int64_t rows);

#endif
