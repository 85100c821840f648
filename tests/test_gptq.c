/*
 * GPTQ (src/quant/gptq.c) against a slow, obvious implementation written here: double precision,
 * textbook formulas (H^-1 through the Cholesky factor, U = upper Cholesky factor of H^-1), no
 * blocking, column by column. Scalar quantization of one value goes through formats.h, whose own
 * tests cover it; what is tested here is the algorithm around it.
 */
#include <float.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "formats/kquant.h"
#include "harness.h"
#include "io/gguf.h"
#include "quant/gptq.h"

/* ---- deterministic random data (the harness's mq_test_rnd_*) ------------------------------- */

/* H = (2/T) X^T X for T tokens of inputs with correlated features and uneven scales (so both
 * error feedback and act-order matter). dead: columns of X that are all zero (may be NULL). */
static float *make_hessian(int64_t K, int64_t T, uint64_t seed, const int *dead, int n_dead) {
    double *x = mq_test_correlated_inputs(T, K, seed);
    for (int i = 0; i < n_dead; i++)
        for (int64_t t = 0; t < T; t++) x[t * K + dead[i]] = 0;
    float *H = malloc((size_t)(K * K) * sizeof(float));
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = 0; b <= a; b++) {
            double s = 0;
            for (int64_t t = 0; t < T; t++) s += x[t * K + a] * x[t * K + b];
            H[a * K + b] = H[b * K + a] = (float)(2.0 * s / (double)T);
        }
    free(x);
    return H;
}

/* ---- the textbook algorithm, double precision ------------------------------------------------ */

/* Lower Cholesky factor in place (a = L L^T); returns 0 if not positive definite. */
static int chol_lower(double *a, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        double d = a[j * n + j];
        for (int64_t k = 0; k < j; k++) d -= a[j * n + k] * a[j * n + k];
        if (!(d > 0)) return 0;
        d = sqrt(d);
        a[j * n + j] = d;
        for (int64_t i = j + 1; i < n; i++) {
            double s = a[i * n + j];
            for (int64_t k = 0; k < j; k++) s -= a[i * n + k] * a[j * n + k];
            a[i * n + j] = s / d;
        }
        for (int64_t k = j + 1; k < n; k++) a[j * n + k] = 0;
    }
    return 1;
}

/* u = upper Cholesky factor of h^-1 (h damped, positive definite). */
static void textbook_u(const double *h, int64_t K, double *u) {
    double *l = malloc((size_t)(K * K) * sizeof(double));
    double *li = calloc((size_t)(K * K), sizeof(double));
    memcpy(l, h, (size_t)(K * K) * sizeof(double));
    if (!chol_lower(l, K)) abort();
    for (int64_t j = 0; j < K; j++) {   /* li = L^-1 by forward substitution, column by column */
        li[j * K + j] = 1.0 / l[j * K + j];
        for (int64_t i = j + 1; i < K; i++) {
            double s = 0;
            for (int64_t k = j; k < i; k++) s += l[i * K + k] * li[k * K + j];
            li[i * K + j] = -s / l[i * K + i];
        }
    }
    for (int64_t a = 0; a < K; a++)      /* h^-1 = L^-T L^-1 */
        for (int64_t b = 0; b < K; b++) {
            double s = 0;
            for (int64_t k = a > b ? a : b; k < K; k++) s += li[k * K + a] * li[k * K + b];
            u[a * K + b] = s;
        }
    if (!chol_lower(u, K)) abort();     /* h^-1 = C C^T, so U = C^T */
    for (int64_t a = 0; a < K; a++)
        for (int64_t b = a + 1; b < K; b++) {
            u[a * K + b] = u[b * K + a];
            u[b * K + a] = 0;
        }
    free(l);
    free(li);
}

typedef struct {
    uint8_t *codes;       /* [N, K] original column order */
    float *deq;
    mq_gparams *params;   /* [N, ng] */
    int32_t *perm;
    double *u;
} ref_result;

static void ref_free(ref_result *r) {
    free(r->codes);
    free(r->deq);
    free(r->params);
    free(r->perm);
    free(r->u);
}

/* GPTQ's in-loop scale search (MQ_GPTQ_MSE_LOOP) for one row of a group, in double: the
 * group's columns at processing positions qp[0..G-1] (values w[qp[t]]); each candidate of the
 * MSE grid quantizes them in increasing position with the errors fed back inside the group;
 * the least sum of squared scaled errors wins. */
static mq_gparams ref_loop_params(const mq_qspec *s, float gs, const double *w, const int64_t *qp,
                                  int64_t G, const double *u, int64_t K) {
    float *vals = malloc((size_t)G * sizeof(float));
    int64_t *order = malloc((size_t)G * sizeof(int64_t));
    double *wl = malloc((size_t)G * sizeof(double));
    mq_gparams *cand = malloc((size_t)s->mse_steps * sizeof(mq_gparams)), best_p;
    for (int64_t t = 0; t < G; t++) {
        vals[t] = (float)w[qp[t]];
        order[t] = qp[t];
    }
    for (int64_t a = 1; a < G; a++)   /* positions in increasing order */
        for (int64_t b = a; b > 0 && order[b] < order[b - 1]; b--) {
            int64_t t = order[b];
            order[b] = order[b - 1];
            order[b - 1] = t;
        }
    int nc = mq_group_candidates(s, gs, vals, G, 1, &best_p, cand);
    double best = INFINITY;
    for (int k = 0; k < nc; k++) {
        double score = 0;
        for (int64_t a = 0; a < G; a++) wl[a] = w[order[a]];
        for (int64_t a = 0; a < G; a++) {
            float q = mq_dequant_value(s, gs, &cand[k], mq_quant_value(s, gs, &cand[k], (float)wl[a]));
            double e = (wl[a] - q) / u[order[a] * K + order[a]];
            score += e * e;
            for (int64_t b = a + 1; b < G; b++) wl[b] -= u[order[a] * K + order[b]] * e;
        }
        if (score < best) {
            best = score;
            best_p = cand[k];
        }
    }
    free(vals);
    free(order);
    free(wl);
    free(cand);
    return best_p;
}

static ref_result ref_gptq(const mq_qspec *s, float gs, const float *H, const float *W, int64_t N,
                           int64_t K, const mq_gptq_opts *o) {
    const int64_t G = mq_qspec_group(s, K), ng = K / G;
    /* K-quants: the params of a block's sub-blocks are chosen together (span columns) */
    const bool kq = s->scheme == MQ_QS_KQUANT;
    const mq_kq_info *kt = mq_kq_info_of(s->kq);
    const int64_t span = kq ? kt->block : G, per = span / G;
    ref_result r;
    r.codes = malloc((size_t)(N * K));
    r.deq = malloc((size_t)(N * K) * sizeof(float));
    r.params = malloc((size_t)(N * ng) * sizeof(mq_gparams));
    r.perm = malloc((size_t)K * sizeof(int32_t));
    r.u = malloc((size_t)(K * K) * sizeof(double));
    double *h = malloc((size_t)(K * K) * sizeof(double));
    double *w = malloc((size_t)(N * K) * sizeof(double));
    double *diag = malloc((size_t)K * sizeof(double));
    int32_t *pos = malloc((size_t)K * sizeof(int32_t));
    uint8_t *ready = calloc((size_t)ng, 1), *started = calloc((size_t)(K / span), 1);
    /* K-quants, dynamic: each row's super-scales d and dmin of each block, fixed at the block's
     * first column; each sub-block's multipliers chosen at its own first column */
    float *refd = malloc((size_t)(N * (K / span)) * sizeof(float));
    float *refdm = malloc((size_t)(N * (K / span)) * sizeof(float));
    float *vals = malloc((size_t)span * sizeof(float));
    float *hw = malloc((size_t)span * sizeof(float));
    int64_t *qp = malloc((size_t)span * sizeof(int64_t));
    const bool loop = s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP;

    for (int64_t i = 0; i < K; i++) {
        diag[i] = H[i * K + i] == 0 ? 1.0 : H[i * K + i];
        r.perm[i] = (int32_t)i;
    }
    if (o->act_order)   /* insertion sort: decreasing diagonal, ties by index */
        for (int64_t i = 1; i < K; i++)
            for (int64_t j = i; j > 0 && diag[r.perm[j]] > diag[r.perm[j - 1]]; j--) {
                int32_t t = r.perm[j];
                r.perm[j] = r.perm[j - 1];
                r.perm[j - 1] = t;
            }
    for (int64_t p = 0; p < K; p++) pos[r.perm[p]] = (int32_t)p;
    double mean = 0;
    for (int64_t i = 0; i < K; i++) mean += diag[i];
    mean /= (double)K;
    for (int64_t a = 0; a < K; a++) {
        for (int64_t b = 0; b < K; b++) h[a * K + b] = H[r.perm[a] * K + r.perm[b]];
        h[a * K + a] = diag[r.perm[a]] + (double)(float)(o->percdamp * mean);
    }
    textbook_u(h, K, r.u);
    /* weight of the MSE search for the column at position p (mq_gptq_mse_weight) */
#define REF_WEIGHT(p)                                                                              \
    (o->mse_weight == MQ_GPTQ_MSE_HDIAG ? (float)diag[r.perm[p]]                                   \
                                        : (float)(1.0 / (r.u[(p) * K + (p)] * r.u[(p) * K + (p)])))
    const float *hwp = s->mse && o->mse_weight != MQ_GPTQ_MSE_PLAIN ? hw : NULL;
    for (int64_t n = 0; n < N; n++)
        for (int64_t p = 0; p < K; p++) {
            int64_t c = r.perm[p];
            w[n * K + p] = H[c * K + c] == 0 ? 0 : W[n * K + c];
        }
    bool gidx = o->act_order && o->groups == MQ_GPTQ_GROUPS_GIDX;
    /* a K-quant block's fit from the values of its columns (positions of block b), each column's
     * error weighted as the search weighs it, dead ones not at all */
#define REF_KQ_BLOCK(n, b, value_at)                                                               \
    do {                                                                                           \
        for (int64_t u = 0; u < span; u++) {                                                       \
            int64_t q = pos[(b) * span + u];                                                       \
            vals[u] = (float)(value_at);                                                           \
            hw[u] = H[((b) * span + u) * (K + 1)] == 0 ? 0.0f                                      \
                    : !s->mse || o->mse_weight == MQ_GPTQ_MSE_PLAIN ? 1.0f : REF_WEIGHT(q);        \
        }                                                                                          \
        mq_kq_fit_block_d(kt, s, vals, 1, hw, &r.params[(n) * ng + (b) * per],                    \
                          &refd[(n) * (K / span) + (b)], &refdm[(n) * (K / span) + (b)]);          \
    } while (0)
    if (kq && o->groups == MQ_GPTQ_GROUPS_STATIC) {
        for (int64_t n = 0; n < N; n++)
            for (int64_t b = 0; b < K / span; b++) REF_KQ_BLOCK(n, b, w[n * K + q]);
        memset(ready, 1, (size_t)ng);
    }
    if (!kq && o->groups == MQ_GPTQ_GROUPS_STATIC) {
        for (int64_t n = 0; n < N; n++)
            for (int64_t g = 0; g < ng; g++) {
                for (int64_t t = 0; t < G; t++) {
                    vals[t] = (float)w[n * K + pos[g * G + t]];
                    hw[t] = REF_WEIGHT(pos[g * G + t]);
                    qp[t] = pos[g * G + t];
                }
                if (loop) r.params[n * ng + g] = ref_loop_params(s, gs, w + n * K, qp, G, r.u, K);
                else mq_group_params_h(s, gs, vals, G, 1, hwp, &r.params[n * ng + g]);
            }
        memset(ready, 1, (size_t)ng);
    }
    for (int64_t p = 0; p < K; p++) {
        int64_t c = r.perm[p], g = gidx ? p / G : c / G;
        if (!ready[g] && kq && !started[c / span]) {   /* the block's first column */
            const int64_t b = c / span;
            for (int64_t n = 0; n < N; n++) REF_KQ_BLOCK(n, b, w[n * K + q]);
            started[b] = 1;
            ready[g] = 1;
        }
        if (!ready[g] && kq) {   /* a later sub-block of a started block: its values now */
            const int64_t b = c / span;
            for (int64_t n = 0; n < N; n++) {
                for (int64_t t = 0; t < G; t++) {
                    int64_t q = pos[g * G + t];
                    vals[t] = (float)w[n * K + q];
                    hw[t] = H[(g * G + t) * (K + 1)] == 0 ? 0.0f
                            : !s->mse || o->mse_weight == MQ_GPTQ_MSE_PLAIN ? 1.0f : REF_WEIGHT(q);
                }
                mq_kq_fit_sub(kt, s, vals, 1, hw, refd[n * (K / span) + b], refdm[n * (K / span) + b],
                              &r.params[n * ng + g]);
            }
            ready[g] = 1;
        }
        if (!ready[g]) {
            for (int64_t n = 0; n < N; n++) {
                for (int64_t t = 0; t < G; t++) {
                    int64_t q = qp[t] = gidx ? g * G + t : pos[g * G + t];
                    vals[t] = (float)w[n * K + q];
                    hw[t] = REF_WEIGHT(q);
                }
                if (loop) r.params[n * ng + g] = ref_loop_params(s, gs, w + n * K, qp, G, r.u, K);
                else mq_group_params_h(s, gs, vals, G, 1, hwp, &r.params[n * ng + g]);
            }
            ready[g] = 1;
        }
        for (int64_t n = 0; n < N; n++) {
            const mq_gparams *gp = &r.params[n * ng + g];
            uint8_t code = mq_quant_value(s, gs, gp, (float)w[n * K + p]);
            float q = mq_dequant_value(s, gs, gp, code);
            double err = (w[n * K + p] - q) / r.u[p * K + p];
            for (int64_t j = p; j < K; j++) w[n * K + j] -= err * r.u[p * K + j];
            r.codes[n * K + c] = code;
            r.deq[n * K + c] = q;
        }
    }
    free(h);
    free(w);
    free(diag);
    free(pos);
    free(ready);
    free(started);
    free(refd);
    free(refdm);
    free(vals);
    free(hw);
    free(qp);
#undef REF_WEIGHT
#undef REF_KQ_BLOCK
    return r;
}

/* ---- helpers --------------------------------------------------------------------------------- */

static double direct_loss(const float *H, int64_t K, const float *w, const float *q, int64_t N) {
    double loss = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t a = 0; a < K; a++) {
            double da = (double)w[n * K + a] - q[n * K + a], s = 0;
            for (int64_t b = 0; b < K; b++) s += (double)H[a * K + b] * ((double)w[n * K + b] - q[n * K + b]);
            loss += da * s;
        }
    return loss;
}

static int64_t count_diff(const uint8_t *a, const uint8_t *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += a[i] != b[i];
    return d;
}

static mq_qspec int4_spec(int group) {
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = group;
    s.scale_dtype = MOEQ_DT_F32;
    return s;
}

/* Runs both implementations on one case and checks agreement, the loss and GPTQ <= RTN. */
static void check_against_reference(const mq_qspec *s, const mq_gptq_opts *o, int64_t N, int64_t K,
                                    const int *dead, int n_dead, double max_code_diff) {
    float *W = mq_test_weights(N, K, 11 + (uint64_t)K);
    float *H = make_hessian(K, 2 * K, 5 + (uint64_t)N, dead, n_dead);
    mq_qtensor q;
    mq_gptq_stats st;
    float *deq = malloc((size_t)(N * K) * sizeof(float));
    ASSERT_OK(mq_gptq_quantize(s, o, H, W, N, K, 0, "layer.w", &q, deq, &st));
    ref_result r = ref_gptq(s, q.global_scale, H, W, N, K, o);
    int64_t diff = count_diff(q.codes, r.codes, N * K);
    if (getenv("GPTQ_TEST_VERBOSE")) printf("diff %lld/%lld loss %g rtn %g\n", (long long)diff, (long long)(N * K), st.loss, st.rtn_loss);
    if (getenv("GPTQ_TEST_VERBOSE") && s->scheme == MQ_QS_KQUANT)
        for (int64_t n = 0; n < N; n++)
            for (int64_t b = 0; b < K / 256; b++) {
                int64_t d = count_diff(q.codes + n * K + b * 256, r.codes + n * K + b * 256, 256);
                if (d) printf("  row %lld block %lld: %lld differ; scale0 %g vs %g\n", (long long)n, (long long)b, (long long)d,
                              q.params[n * q.n_groups + b * (256 / q.group_size)].scale, r.params[n * q.n_groups + b * (256 / q.group_size)].scale);
            }
    if ((double)diff > max_code_diff * (double)(N * K))
        FAIL("%lld of %lld codes differ from the reference", (long long)diff, (long long)(N * K));
    ASSERT_EQ_INT(n_dead, st.n_dead);
    double ref_loss = direct_loss(H, K, W, r.deq, N), loss = direct_loss(H, K, W, deq, N);
    /* (a K-quant block whose scales flip on a float's last bit changes 256 codes of its row and
     * the rows's error feedback after it: a looser bound) */
    ASSERT_REL(ref_loss, loss, s->scheme == MQ_QS_KQUANT ? 0.03 : 0.01);
    ASSERT_REL(loss, st.loss, 1e-3);   /* the loss identity, against the direct formula */
    /* RTN of the same spec and global scale, loss computed directly */
    mq_qtensor rq;
    ASSERT_OK(mq_quantize_rtn(s, W, N, K, q.global_scale, "layer.w", &rq));
    float *rdeq = malloc((size_t)(N * K) * sizeof(float));
    mq_dequantize(&rq, rdeq);
    ASSERT_REL(direct_loss(H, K, W, rdeq, N), st.rtn_loss, 1e-3);
    if (!(st.loss <= st.rtn_loss)) FAIL("GPTQ loss %g > RTN loss %g", st.loss, st.rtn_loss);
    /* the dequantized output is what a loader of the codes computes */
    float *back = malloc((size_t)(N * K) * sizeof(float));
    mq_dequantize(&q, back);
    ASSERT_TRUE(memcmp(back, deq, (size_t)(N * K) * sizeof(float)) == 0);
    /* (an asymmetric K-quant grid need not hold 0, nor IQ4's table, whose values nearest 0 are
     * 1 and -10: their dead columns take the nearest value) */
    const bool zero_on_grid = s->scheme != MQ_QS_KQUANT ||
                              (mq_kq_info_of(s->kq)->zero >= 0 && !mq_kq_info_of(s->kq)->table);
    for (int i = 0; i < n_dead && zero_on_grid; i++)
        for (int64_t n = 0; n < N; n++) ASSERT_EQ_INT(0, deq[n * K + dead[i]] != 0.0f);
    if (s->scheme == MQ_QS_KQUANT) {   /* the codes GPTQ used are the file's: decode(blocks) == deq */
        const mq_kq_info *t = mq_kq_info_of(s->kq);
        uint8_t *blk = malloc((size_t)(K / t->block * t->bytes));
        float *row = malloc((size_t)K * sizeof(float));
        for (int64_t n = 0; n < N; n++) {
            for (int64_t b = 0; b < K / t->block; b++)
                if (!mq_kq_pack_block(t, q.params + n * q.n_groups + b * (t->block / t->sub),
                                      q.codes + n * K + b * t->block, blk + b * t->bytes))
                    FAIL("%s: row %lld block %lld does not pack", t->name, (long long)n, (long long)b);
            ASSERT_OK(mq_ggml_dequantize(t->ggml_type, blk, K, row));
            if (memcmp(row, deq + n * K, (size_t)K * sizeof(float)))
                FAIL("%s: row %lld decodes to other values than GPTQ's", t->name, (long long)n);
        }
        free(blk);
        free(row);
    }
    free(back);
    free(rdeq);
    mq_qtensor_free(&rq);
    ref_free(&r);
    free(deq);
    mq_qtensor_free(&q);
    free(W);
    free(H);
}

/* ---- cases ----------------------------------------------------------------------------------- */

static void test_reference_nvfp4(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    check_against_reference(&s, &o, 160, 256, NULL, 0, 0.003);
}

static void test_reference_int4(void) {
    mq_qspec s = int4_spec(64);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.block_size = 32;
    check_against_reference(&s, &o, 160, 256, NULL, 0, 0.003);
    s.int4_signed_scale = true;   /* signed scales, with and without the search and act-order */
    check_against_reference(&s, &o, 160, 256, NULL, 0, 0.003);
    s.mse = true;
    o.act_order = true;
    check_against_reference(&s, &o, 96, 256, NULL, 0, 0.003);
}

static void test_reference_act_order(void) {
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = true;
    mq_qspec nv = mq_qspec_default(MQ_QS_NVFP4), i4 = int4_spec(64);
    o.groups = MQ_GPTQ_GROUPS_DYNAMIC;   /* params at each group's first column in act order */
    check_against_reference(&nv, &o, 130, 192, NULL, 0, 0.003);
    check_against_reference(&i4, &o, 130, 192, NULL, 0, 0.003);
    o.groups = MQ_GPTQ_GROUPS_STATIC;
    check_against_reference(&nv, &o, 130, 192, NULL, 0, 0.003);
    o.groups = MQ_GPTQ_GROUPS_GIDX;
    check_against_reference(&i4, &o, 130, 192, NULL, 0, 0.003);
}

static void test_reference_mse(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    s.mse = true;
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = true;
    check_against_reference(&s, &o, 64, 128, NULL, 0, 0.003);
}

/* The Hessian-weighted scale searches, against the reference with the same weights; and the
 * weights do change the choice. */
static void test_reference_mse_weights(void) {
    mq_qspec nv = mq_qspec_default(MQ_QS_NVFP4), i4 = int4_spec(32);
    nv.mse = i4.mse = true;
    mq_gptq_opts o = mq_gptq_opts_default();
    const mq_gptq_mse_weight wts[3] = {MQ_GPTQ_MSE_HDIAG, MQ_GPTQ_MSE_OBQ, MQ_GPTQ_MSE_LOOP};
    static const int dead[2] = {3, 40};
    for (int k = 0; k < 3; k++) {
        o.mse_weight = wts[k];
        o.act_order = false;
        o.groups = MQ_GPTQ_GROUPS_DYNAMIC;
        check_against_reference(&nv, &o, 64, 128, dead, 2, 0.003);
        o.act_order = true;
        check_against_reference(&i4, &o, 64, 128, NULL, 0, 0.003);
        o.groups = MQ_GPTQ_GROUPS_STATIC;
        check_against_reference(&nv, &o, 64, 128, NULL, 0, 0.003);
    }
    /* the weights matter: codes differ from the plain search's */
    float *W = mq_test_weights(64, 128, 3), *H = make_hessian(128, 256, 4, NULL, 0);
    mq_qtensor a, b;
    o = mq_gptq_opts_default();
    ASSERT_OK(mq_gptq_quantize(&nv, &o, H, W, 64, 128, 0, "w", &a, NULL, NULL));
    for (int k = 0; k < 3; k++) {
        o.mse_weight = wts[k];
        ASSERT_OK(mq_gptq_quantize(&nv, &o, H, W, 64, 128, 0, "w", &b, NULL, NULL));
        int64_t scales = 0;
        for (int64_t i = 0; i < a.rows * a.n_groups; i++)
            scales += a.params[i].scale != b.params[i].scale;
        if (scales < a.rows * a.n_groups / 20)
            FAIL("weights %d: only %lld of %lld group scales changed", k, (long long)scales,
                 (long long)(a.rows * a.n_groups));
        mq_qtensor_free(&b);
    }
    mq_qtensor_free(&a);
    free(W);
    free(H);
}

/* GPTQ into llama.cpp's K-quant grids: every type, dynamic and static groups, act-order, dead
 * columns, each Hessian weighting of the block search; against the reference loop, whose block
 * fit sees the same current values. */
static void test_reference_kquant(void) {
    static const int dead[2] = {3, 300};
    mq_gptq_opts o = mq_gptq_opts_default();
    o.block_size = 64;
    for (int ty = 0; ty < MQ_KQ_COUNT; ty++) {
        mq_qspec s = mq_kq_spec((mq_kq_type)ty);
        s.mse = true;
        o.act_order = ty % 2 == 1;
        o.mse_weight = ty % 3 == 0 ? MQ_GPTQ_MSE_OBQ : ty % 3 == 1 ? MQ_GPTQ_MSE_HDIAG : MQ_GPTQ_MSE_PLAIN;
        o.groups = MQ_GPTQ_GROUPS_DYNAMIC;
        check_against_reference(&s, &o, 48, 512, dead, 2, 0.02);
        o.groups = MQ_GPTQ_GROUPS_STATIC;
        s.mse = ty % 2 == 0;
        check_against_reference(&s, &o, 40, 512, NULL, 0, 0.02);
    }
}

/* With the refinement (the codes moved by coordinate descent, the block scales kept) and dead
 * columns: the file still decodes to GPTQ's values, and the loss does not rise. */
static void test_kquant_refine(void) {
    static const int dead[3] = {0, 77, 511};
    const int64_t N = 40, K = 512;
    float *W = mq_test_weights(N, K, 21), *H = make_hessian(K, 2 * K, 22, dead, 3);
    float *deq = malloc((size_t)(N * K) * sizeof(float)), *back = malloc((size_t)(N * K) * sizeof(float));
    const mq_kq_type types[2] = {MQ_KQ_Q4_K, MQ_KQ_Q6_K};
    for (int k = 0; k < 2; k++) {
        const mq_kq_info *t = mq_kq_info_of(types[k]);
        mq_qspec s = mq_kq_spec(types[k]);
        s.mse = true;
        mq_gptq_opts o = mq_gptq_opts_default();
        o.mse_weight = MQ_GPTQ_MSE_OBQ;
        mq_qtensor q0, q;
        mq_gptq_stats st0, st;
        ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &q0, NULL, &st0));
        o.refine_passes = 2;
        o.refine_scales = true;   /* asked for, but a K-quant's scales stay its block's */
        ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &q, deq, &st));
        ASSERT_REL(direct_loss(H, K, W, deq, N), st.loss, 1e-3);
        if (!(st.loss <= st0.loss)) FAIL("%s: refined loss %g above GPTQ's %g", t->name, st.loss, st0.loss);
        for (int64_t i = 0; i < N * q.n_groups; i++) ASSERT_NEAR(q0.params[i].scale, q.params[i].scale, 0);
        mq_dequantize(&q, back);
        ASSERT_EQ_INT(0, memcmp(back, deq, (size_t)(N * K) * sizeof(float)));
        uint8_t blk[2 * 210];
        float row[512];
        for (int64_t n = 0; n < N; n++) {
            for (int b = 0; b < 2; b++)
                ASSERT_TRUE(mq_kq_pack_block(t, q.params + n * q.n_groups + b * (256 / t->sub), q.codes + n * K + 256 * b,
                                             blk + b * t->bytes));
            ASSERT_OK(mq_ggml_dequantize(t->ggml_type, blk, K, row));
            ASSERT_EQ_INT(0, memcmp(row, deq + n * K, sizeof row));
        }
        mq_qtensor_free(&q0);
        mq_qtensor_free(&q);
    }
    free(W);
    free(H);
    free(deq);
    free(back);
}

static void test_dead_columns(void) {
    static const int dead[] = {0, 5, 17, 100, 127};
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    check_against_reference(&s, &o, 48, 128, dead, 5, 0.003);
    o.act_order = true;
    mq_qspec i4 = int4_spec(32);
    check_against_reference(&i4, &o, 48, 128, dead, 5, 0.003);
}

static int g_warnings;
static char g_last_warning[512];
static void capture_log(void *user, int level, const char *msg) {
    (void)user;
    if (level > 0) {
        g_warnings++;
        snprintf(g_last_warning, sizeof g_last_warning, "%s", msg);
    }
}

static void test_damping_retry(void) {
    const int64_t K = 32, N = 16;
    float *H = make_hessian(K, 64, 3, NULL, 0);
    H[7 * K + 7] = -0.5f * H[7 * K + 7];   /* indefinite: needs damping beyond 1% of the mean */
    float *W = mq_test_weights(N, K, 4);
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    mq_qtensor q;
    mq_gptq_stats st;
    g_warnings = 0;
    moeq_set_log(capture_log, NULL);
    moeq_status rc = mq_gptq_quantize(&s, &o, H, W, N, K, 0, "blk.0.q", &q, NULL, &st);
    moeq_set_log(NULL, NULL);
    ASSERT_OK(rc);
    ASSERT_TRUE(st.percdamp > 0.01);
    ASSERT_EQ_INT(1, g_warnings);
    ASSERT_TRUE(strstr(g_last_warning, "blk.0.q") != NULL);
    /* the factor really is of the damped matrix it reports */
    mq_gptq_factor f;
    moeq_set_log(capture_log, NULL);
    ASSERT_OK(mq_gptq_factor_init(H, K, &o, true, "blk.0.q", &f));
    moeq_set_log(NULL, NULL);
    ASSERT_REL(st.percdamp, f.percdamp, 0);
    double mean = 0;
    for (int64_t i = 0; i < K; i++) mean += H[i * K + i];
    mean /= (double)K;
    for (int64_t a = 0; a < K; a++)   /* H + damp I == R R^T */
        for (int64_t b = 0; b < K; b++) {
            double v = 0;
            for (int64_t k = 0; k < K; k++) v += (double)f.R[a * K + k] * f.R[b * K + k];
            double want = H[a * K + b] + (a == b ? f.damp : 0.0);
            ASSERT_NEAR(want, v, 1e-4 * mean);
        }
    ASSERT_NEAR(f.percdamp * mean, f.damp, 1e-6 * mean);
    mq_gptq_factor_free(&f);
    mq_qtensor_free(&q);
    /* hopeless: negative definite */
    for (int64_t i = 0; i < K * K; i++) H[i] = i % (K + 1) == 0 ? -1.0f : 0.0f;
    moeq_set_log(capture_log, NULL);
    rc = mq_gptq_quantize(&s, &o, H, W, N, K, 0, "blk.0.q", &q, NULL, &st);
    moeq_set_log(NULL, NULL);
    ASSERT_STATUS(MOEQ_E_NUMERIC, rc);
    ASSERT_ERROR_MENTIONS("blk.0.q");
    free(H);
    free(W);
}

static void test_factor_matches_textbook(void) {
    const int64_t K = 96;
    float *H = make_hessian(K, 200, 9, NULL, 0);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = true;
    mq_gptq_factor f;
    ASSERT_OK(mq_gptq_factor_init(H, K, &o, false, "h", &f));
    float *W = mq_test_weights(1, K, 1);
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    ref_result r = ref_gptq(&s, 1.0f, H, W, 1, K, &o);
    for (int64_t p = 0; p < K; p++) ASSERT_EQ_INT(r.perm[p], f.perm[p]);
    double umax = 0;
    for (int64_t i = 0; i < K * K; i++) umax = fmax(umax, fabs(r.u[i]));
    for (int64_t i = 0; i < K * K; i++) ASSERT_NEAR(r.u[i], f.U[i], 1e-4 * umax);
    ref_free(&r);
    mq_gptq_factor_free(&f);
    free(H);
    free(W);
}

/* An odd K over several factor blocks and inverse tiles (each ending in a short one) and copy
 * blocks (the row-block copies, the turn of L into R about its middle row): U^T U is the inverse
 * of the damped H, and U the inverse of R. */
static void test_factor_odd_size(void) {
    const int64_t K = 557;
    float *H = make_hessian(K, 400, 12, NULL, 0);
    mq_gptq_opts o = mq_gptq_opts_default();
    mq_gptq_factor f;
    ASSERT_OK(mq_gptq_factor_init(H, K, &o, true, "h", &f));
    double worst_inv = 0, worst_ru = 0;
    double *utu = calloc((size_t)(K * K), sizeof *utu);
    ASSERT_TRUE(utu != NULL);
    for (int64_t r = 0; r < K; r++)
        for (int64_t i = 0; i < K; i++)
            for (int64_t m = 0; m < K; m++) utu[i * K + m] += (double)f.U[r * K + i] * f.U[r * K + m];
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++) {
            double a = 0, b = 0;   /* (U^T U H')_ij and (R U)_ij */
            for (int64_t m = 0; m < K; m++) {
                a += utu[i * K + m] * ((double)H[m * K + j] + (m == j ? f.damp : 0.0));
                b += (double)f.R[i * K + m] * f.U[m * K + j];
            }
            worst_inv = fmax(worst_inv, fabs(a - (i == j)));
            worst_ru = fmax(worst_ru, fabs(b - (i == j)));
        }
    free(utu);
    ASSERT_TRUE(worst_inv < 1e-3);   /* fp32 factors of a well-conditioned H (2K tokens for K) */
    ASSERT_TRUE(worst_ru < 1e-4);
    for (int64_t i = 1; i < K; i++)
        for (int64_t j = 0; j < i; j++) ASSERT_TRUE(f.R[i * K + j] == 0.0f && f.U[i * K + j] == 0.0f);
    mq_gptq_factor_free(&f);
    free(H);
}

static void test_gidx_consistency(void) {
    const int64_t N = 40, K = 256, G = 64;
    float *W = mq_test_weights(N, K, 21);
    float *H = make_hessian(K, 300, 22, NULL, 0);
    mq_qspec s = int4_spec((int)G);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = true;
    o.groups = MQ_GPTQ_GROUPS_GIDX;
    mq_qtensor q;
    float *deq = malloc((size_t)(N * K) * sizeof(float)), *back = malloc((size_t)(N * K) * sizeof(float));
    ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &q, deq, NULL));
    ASSERT_TRUE(q.g_idx != NULL);
    int count[4] = {0};
    for (int64_t c = 0; c < K; c++) {
        ASSERT_TRUE(q.g_idx[c] >= 0 && q.g_idx[c] < 4);
        count[q.g_idx[c]]++;
    }
    for (int g = 0; g < 4; g++) ASSERT_EQ_INT(G, count[g]);
    /* the column with the largest diagonal is in group 0, the smallest in the last group */
    int64_t cmax = 0, cmin = 0;
    for (int64_t c = 1; c < K; c++) {
        if (H[c * K + c] > H[cmax * K + cmax]) cmax = c;
        if (H[c * K + c] < H[cmin * K + cmin]) cmin = c;
    }
    ASSERT_EQ_INT(0, q.g_idx[cmax]);
    ASSERT_EQ_INT(3, q.g_idx[cmin]);
    mq_dequantize(&q, back);
    ASSERT_TRUE(memcmp(back, deq, (size_t)(N * K) * sizeof(float)) == 0);
    mq_qtensor_free(&q);
    /* NVFP4 cannot store g_idx */
    mq_qspec nv = mq_qspec_default(MQ_QS_NVFP4);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_gptq_quantize(&nv, &o, H, W, N, K, 0, "w", &q, deq, NULL));
    ASSERT_ERROR_MENTIONS("w");
    free(deq);
    free(back);
    free(W);
    free(H);
}

static void test_static_vs_dynamic(void) {
    const int64_t N = 24, K = 128;
    float *W = mq_test_weights(N, K, 31);
    float *H = make_hessian(K, 300, 32, NULL, 0);
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    mq_qtensor rtn, dyn, sta;
    ASSERT_OK(mq_quantize_rtn(&s, W, N, K, 0, "w", &rtn));
    ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &dyn, NULL, NULL));
    o.groups = MQ_GPTQ_GROUPS_STATIC;
    ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &sta, NULL, NULL));
    const int64_t ng = K / 16;
    int64_t dyn_differs = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < ng; g++) {
            const mq_gparams *r = &rtn.params[n * ng + g];
            /* static: exactly RTN's params of the original weights */
            ASSERT_EQ_HEX(r->scale_code, sta.params[n * ng + g].scale_code);
            /* dynamic: the first group has seen no error feedback yet */
            if (g == 0) ASSERT_EQ_HEX(r->scale_code, dyn.params[n * ng + g].scale_code);
            dyn_differs += r->scale_code != dyn.params[n * ng + g].scale_code;
        }
    ASSERT_TRUE(dyn_differs > 0);
    ASSERT_TRUE(count_diff(dyn.codes, sta.codes, N * K) > 0);
    mq_qtensor_free(&rtn);
    mq_qtensor_free(&dyn);
    mq_qtensor_free(&sta);
    free(W);
    free(H);
}

static void run_blocks(const mq_qspec *s, mq_gptq_opts o, int64_t N, int64_t K) {
    float *W = mq_test_weights(N, K, 41);
    float *H = make_hessian(K, 2 * K, 42, NULL, 0);
    static const int sizes[] = {1, 16, 128, 0};
    mq_qtensor q[4];
    mq_gptq_stats st[4];
    for (int i = 0; i < 4; i++) {
        o.block_size = sizes[i] ? sizes[i] : (int)K;
        ASSERT_OK(mq_gptq_quantize(s, &o, H, W, N, K, 0, "w", &q[i], NULL, &st[i]));
    }
    for (int i = 1; i < 4; i++) {
        int64_t d = count_diff(q[0].codes, q[i].codes, N * K);
        if ((double)d > 0.002 * (double)(N * K))
            FAIL("block %d: %lld of %lld codes differ from block 1", sizes[i], (long long)d,
                 (long long)(N * K));
        ASSERT_REL(st[0].loss, st[i].loss, 2e-3);
    }
    for (int i = 0; i < 4; i++) mq_qtensor_free(&q[i]);
    free(W);
    free(H);
}

static void test_block_sizes(void) {
    mq_qspec nv = mq_qspec_default(MQ_QS_NVFP4), i4 = int4_spec(128);
    mq_gptq_opts o = mq_gptq_opts_default();
    run_blocks(&nv, o, 64, 256);
    run_blocks(&i4, o, 64, 256);
    o.act_order = true;   /* first-column-in-act-order groups: pending errors applied on the fly */
    run_blocks(&nv, o, 64, 256);
    run_blocks(&i4, o, 64, 256);
    o.groups = MQ_GPTQ_GROUPS_GIDX;
    run_blocks(&i4, o, 64, 256);
}

static void test_thread_count_independent(void) {
    const int64_t N = 300, K = 128;
    float *W = mq_test_weights(N, K, 51);
    float *H = make_hessian(K, 256, 52, NULL, 0);
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = true;
    mq_qtensor a, b;
    mq_gptq_stats sa, sb;
    int saved = moeq_threads();
    moeq_set_threads(1);
    ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &a, NULL, &sa));
    moeq_set_threads(getenv("MOEQ_CROSS") ? 1 : 3);   /* qemu-user: contended locks crawl */
    ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &b, NULL, &sb));
    moeq_set_threads(saved);
    ASSERT_EQ_INT(0, count_diff(a.codes, b.codes, N * K));
    for (int64_t i = 0; i < N * K / 16; i++) {
        ASSERT_TRUE(a.params[i].scale == b.params[i].scale);
        ASSERT_EQ_HEX(a.params[i].scale_code, b.params[i].scale_code);
    }
    ASSERT_TRUE(sa.loss == sb.loss && sa.rtn_loss == sb.rtn_loss);
    mq_qtensor_free(&a);
    mq_qtensor_free(&b);
    free(W);
    free(H);
}

/* Two configurations that use most of the column loop's buffers: NVFP4 with the in-loop scale
 * search and one refinement pass; INT4 with act-order g_idx groups. */
static void two_loop_configs(mq_qspec specs[2], mq_gptq_opts opts[2]) {
    specs[0] = mq_qspec_default(MQ_QS_NVFP4);
    specs[1] = mq_qspec_default(MQ_QS_INT4);
    specs[0].mse = true;
    opts[0] = opts[1] = mq_gptq_opts_default();
    opts[0].mse_weight = MQ_GPTQ_MSE_LOOP;
    opts[0].refine_passes = 1;
    opts[1].act_order = true;
    opts[1].groups = MQ_GPTQ_GROUPS_GIDX;
}

/* The rows per column-loop task change no code or scale (a row's work never sees another row's;
 * the block updates' products are per row): 256, 128, 64 and 96 on a weight whose rows are no
 * multiple of them, NVFP4 with the in-loop scale search and refinement, INT4 with act-order
 * g_idx. The losses are summed per task, so only their last digits may move. */
static void test_row_block_independent(void) {
    const int64_t N = 300, K = 256;
    float *W = mq_test_weights(N, K, 61);
    float *H = make_hessian(K, 512, 62, NULL, 0);
    mq_qspec specs[2];
    mq_gptq_opts opts[2];
    two_loop_configs(specs, opts);
    const int blocks[] = {256, 128, 64, 96};
    for (int k = 0; k < 2; k++) {
        mq_qtensor a, b;
        mq_gptq_stats sa, sb;
        mq_gptq_set_row_block(blocks[0]);
        ASSERT_OK(mq_gptq_quantize(&specs[k], &opts[k], H, W, N, K, 0, "w", &a, NULL, &sa));
        for (int i = 1; i < 4; i++) {
            mq_gptq_set_row_block(blocks[i]);
            ASSERT_EQ_INT(blocks[i], mq_gptq_row_block());
            ASSERT_OK(mq_gptq_quantize(&specs[k], &opts[k], H, W, N, K, 0, "w", &b, NULL, &sb));
            ASSERT_EQ_INT(0, count_diff(a.codes, b.codes, N * K));
            for (int64_t g = 0; g < N * a.n_groups; g++) {
                ASSERT_TRUE(memcmp(&a.params[g].scale, &b.params[g].scale, 4) == 0);
                ASSERT_TRUE(memcmp(&a.params[g].zero, &b.params[g].zero, 4) == 0);
                ASSERT_EQ_HEX(a.params[g].scale_code, b.params[g].scale_code);
            }
            /* each task sums its rows' squared errors, and the loss is a difference of two such
             * sums (e2 - damp * dsq): regrouped rows move it by a few 1e-8 relative here */
            ASSERT_TRUE(fabs(sa.loss - sb.loss) <= 1e-6 * fabs(sa.loss));
            ASSERT_TRUE(fabs(sa.rtn_loss - sb.rtn_loss) <= 1e-6 * fabs(sa.rtn_loss));
            mq_qtensor_free(&b);
        }
        mq_qtensor_free(&a);
    }
    mq_gptq_set_row_block(0);   /* back to the default */
    free(W);
    free(H);
}

/* The scratch one run keeps for the next (mq_gptq_release_scratch): runs of other widths, row
 * counts, thread counts and options after each other give each run's result from fresh scratch
 * to the bit: a kept scratch with wider rows (other strides), one without the in-loop search's or
 * the refinement's buffers (which must not be taken), one made for fewer threads. */
static void test_scratch_reuse(void) {
    const int64_t N[2] = {300, 200}, K[2] = {128, 512};
    float *W[2] = {mq_test_weights(N[0], K[0], 71), mq_test_weights(N[1], K[1], 72)};
    float *H[2] = {make_hessian(K[0], 256, 73, NULL, 0), make_hessian(K[1], 1024, 74, NULL, 0)};
    mq_qspec specs[2];
    mq_gptq_opts opts[2];
    two_loop_configs(specs, opts);
    const int saved = moeq_threads();
    const int threads[2] = {1, getenv("MOEQ_CROSS") ? 1 : 3};
    /* case c: weight c / 2 % 2, spec and options c % 2, threads c / 4 */
    mq_qtensor ref[8];
    mq_gptq_stats rs[8];
    for (int c = 0; c < 8; c++) {
        const int w = c / 2 % 2, k = c % 2;
        moeq_set_threads(threads[c / 4]);
        mq_gptq_release_scratch();
        ASSERT_OK(mq_gptq_quantize(&specs[k], &opts[k], H[w], W[w], N[w], K[w], 0, "w", &ref[c], NULL, &rs[c]));
    }
    mq_gptq_release_scratch();
    /* narrow after wide, wide after narrow, without and with the search, more threads after fewer */
    const int order[] = {3, 0, 2, 1, 6, 4, 7, 5, 0};
    for (size_t i = 0; i < sizeof order / sizeof *order; i++) {
        const int c = order[i], w = c / 2 % 2, k = c % 2;
        moeq_set_threads(threads[c / 4]);
        mq_qtensor q;
        mq_gptq_stats st;
        ASSERT_OK(mq_gptq_quantize(&specs[k], &opts[k], H[w], W[w], N[w], K[w], 0, "w", &q, NULL, &st));
        ASSERT_EQ_INT(0, count_diff(ref[c].codes, q.codes, N[w] * K[w]));
        for (int64_t g = 0; g < N[w] * q.n_groups; g++) {   /* field by field: the struct has padding */
            ASSERT_TRUE(memcmp(&ref[c].params[g].scale, &q.params[g].scale, 4) == 0);
            ASSERT_TRUE(memcmp(&ref[c].params[g].zero, &q.params[g].zero, 4) == 0);
            ASSERT_EQ_HEX(ref[c].params[g].scale_code, q.params[g].scale_code);
        }
        if (memcmp(&rs[c].loss, &st.loss, sizeof st.loss) != 0 || memcmp(&rs[c].rtn_loss, &st.rtn_loss, sizeof st.rtn_loss) != 0)
            FAIL("case %d after case %d: loss %.17g / %.17g, fresh %.17g / %.17g", c, i ? order[i - 1] : -1,
                 st.loss, st.rtn_loss, rs[c].loss, rs[c].rtn_loss);
        mq_qtensor_free(&q);
    }
    mq_gptq_release_scratch();
    moeq_set_threads(saved);
    for (int c = 0; c < 8; c++) mq_qtensor_free(&ref[c]);
    for (int w = 0; w < 2; w++) {
        free(W[w]);
        free(H[w]);
    }
}

/* Several jobs in one run (experts of a layer; gate and up sharing a factor) give the same
 * result as separate runs. */
static void test_many_jobs(void) {
    const int64_t K = 64, N = 48, E = 3;
    float *H[3], *W[3][2];
    const char *names[3] = {"e0", "e1", "e2"};
    for (int e = 0; e < E; e++) {
        H[e] = make_hessian(K, 128, 60 + (uint64_t)e, NULL, 0);
        W[e][0] = mq_test_weights(N, K, 70 + (uint64_t)e);
        W[e][1] = mq_test_weights(N, K, 80 + (uint64_t)e);
    }
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    mq_gptq_factor f[3];
    const int64_t Ks[3] = {K, K, K};
    ASSERT_OK(mq_gptq_factor_many((const float *const *)H, Ks, E, &o, true, names, f));
    mq_gptq_job jobs[6];
    mq_qtensor q[6];
    for (int e = 0; e < E; e++)
        for (int k = 0; k < 2; k++) jobs[2 * e + k] = (mq_gptq_job){&f[e], W[e][k], N, 0.5f, names[e], &q[2 * e + k], NULL, {0, 0, 0, 0, 0}, NULL};
    ASSERT_OK(mq_gptq_run(&s, &o, jobs, 6));
    for (int e = 0; e < E; e++)
        for (int k = 0; k < 2; k++) {
            mq_qtensor one;
            mq_gptq_stats st;
            ASSERT_OK(mq_gptq_quantize(&s, &o, H[e], W[e][k], N, K, 0.5f, "x", &one, NULL, &st));
            ASSERT_EQ_INT(0, count_diff(one.codes, q[2 * e + k].codes, N * K));
            ASSERT_TRUE(one.global_scale == 0.5f);
            ASSERT_TRUE(st.loss == jobs[2 * e + k].stats.loss);
            mq_qtensor_free(&one);
            mq_qtensor_free(&q[2 * e + k]);
            free(W[e][k]);
        }
    for (int e = 0; e < E; e++) {
        mq_gptq_factor_free(&f[e]);
        free(H[e]);
    }
}

/* Factorisations of uneven sizes in one call (DeepSeek-V3's o_proj beside its small latent
 * Linears), one of them failing in its second tile until its damping is raised twice: their tiles
 * go out together, step by step, and every factor is bit for bit mq_gptq_factor_init's of its
 * Hessian alone (damping and retries too), at every thread count. */
static void test_factor_many_uneven(void) {
    const int64_t Ks[4] = {24, 600, 16, 40};
    float *H[4];
    const char *names[4] = {"a", "big", "b", "c"};
    for (int i = 0; i < 4; i++) H[i] = make_hessian(Ks[i], 2 * Ks[i] + 8, 90 + (uint64_t)i, NULL, 0);
    H[1][400 * 600 + 400] *= -0.02f;   /* indefinite past the first three 128-column tiles */
    mq_gptq_opts o = mq_gptq_opts_default();
    o.refine_passes = 1;   /* H' is kept too */
    mq_gptq_factor one[4];
    moeq_set_log(capture_log, NULL);
    for (int i = 0; i < 4; i++) ASSERT_OK(mq_gptq_factor_init(H[i], Ks[i], &o, true, names[i], &one[i]));
    moeq_set_log(NULL, NULL);
    ASSERT_TRUE(one[1].retries >= 2);
    ASSERT_EQ_INT(0, one[0].retries + one[2].retries + one[3].retries);
    for (int threads = 1; threads <= 3; threads++) {
        moeq_set_threads(threads);
        mq_gptq_factor f[4];
        moeq_set_log(capture_log, NULL);
        ASSERT_OK(mq_gptq_factor_many((const float *const *)H, Ks, 4, &o, true, names, f));
        moeq_set_log(NULL, NULL);
        for (int i = 0; i < 4; i++) {
            const size_t kk = (size_t)(Ks[i] * Ks[i]) * sizeof(float);
            ASSERT_EQ_INT(one[i].retries, f[i].retries);
            ASSERT_TRUE(memcmp(f[i].U, one[i].U, kk) == 0);
            ASSERT_TRUE(memcmp(f[i].R, one[i].R, kk) == 0);
            ASSERT_TRUE(memcmp(f[i].Hp, one[i].Hp, kk) == 0);
            ASSERT_TRUE(f[i].damp == one[i].damp);
            mq_gptq_factor_free(&f[i]);
        }
    }
    moeq_set_threads(0);
    for (int i = 0; i < 4; i++) {
        mq_gptq_factor_free(&one[i]);
        free(H[i]);
    }
}

/* The loop's branch-free column qdq is bit-identical to formats.h's mq_qdq_n, ties included. */
static void test_qdq_column_matches_formats(void) {
    const int64_t n = 4096;
    static const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f, 7.0f, 0.5f};
    mq_qspec specs[5] = {mq_qspec_default(MQ_QS_NVFP4), int4_spec(32), int4_spec(32),
                         mq_qspec_default(MQ_QS_NVFP4), int4_spec(32)};
    specs[2].asym = true;
    specs[3].nvfp4_conv = MQ_NVFP4_MUL;
    specs[4].int4_signed_scale = true;   /* negative steps */
    float *x = malloc((size_t)n * sizeof(float)), *step = malloc((size_t)n * sizeof(float));
    float *zero = malloc((size_t)n * sizeof(float)), *dq = malloc((size_t)n * sizeof(float));
    float *dq2 = malloc((size_t)n * sizeof(float));
    uint8_t *code = malloc((size_t)n), *code2 = malloc((size_t)n);
    mq_gparams *gp = malloc((size_t)n * sizeof(mq_gparams));
    for (int k = 0; k < 5; k++) {
        const mq_qspec *s = &specs[k];
        mq_test_rng = 99 + (uint64_t)k;
        for (int64_t i = 0; i < n; i++) {
            float v[16];
            for (int t = 0; t < 16; t++) v[t] = (float)(0.05 * mq_test_rnd_normal());
            if (i % 97 == 0) memset(v, 0, sizeof v);   /* all-zero group: step 0 */
            mq_group_params(s, 0.37f, v, 16, 1, &gp[i]);
            step[i] = mq_group_step(s, 0.37f, &gp[i]);
            zero[i] = gp[i].zero;
            double u = mq_test_rnd_unit();
            float sign = mq_test_rnd_unit() < 0.5 ? -1.0f : 1.0f;
            if (u < 0.3)   /* exactly on a rounding tie or grid point */
                x[i] = sign * ties[(int)(mq_test_rnd_unit() * 10)] * step[i];
            else if (u < 0.35)
                x[i] = sign * 0.0f;
            else
                x[i] = (float)(0.08 * mq_test_rnd_normal());
        }
        mq_gptq_qdq_column(s, step, zero, x, n, code, dq);
        mq_qdq_n(s, 0.37f, gp, x, n, code2, dq2);
        for (int64_t i = 0; i < n; i++) {
            ASSERT_EQ_HEX(code2[i], code[i]);
            ASSERT_TRUE(memcmp(&dq2[i], &dq[i], sizeof(float)) == 0);
        }
        if (MQ_TEST_X86 && mq_cpu_has_avx2_fma()) {   /* the SIMD twin, on a length with a scalar tail */
#if MQ_TEST_X86
            memset(code2, 0xff, (size_t)n);
            mq_gptq_qdq_column_avx2(s, step, zero, x, n - 3, code2, dq2);
            for (int64_t i = 0; i < n - 3; i++) {
                ASSERT_EQ_HEX(code[i], code2[i]);
                ASSERT_TRUE(memcmp(&dq2[i], &dq[i], sizeof(float)) == 0);
            }
            if (mq_cpu_has_avx512()) {   /* and the AVX-512 one (16-lane blocks, then the tail) */
                memset(code2, 0xff, (size_t)n);
                mq_gptq_qdq_column_avx512(s, step, zero, x, n - 3, code2, dq2);
                for (int64_t i = 0; i < n - 3; i++) {
                    ASSERT_EQ_HEX(code[i], code2[i]);
                    ASSERT_TRUE(memcmp(&dq2[i], &dq[i], sizeof(float)) == 0);
                }
            }
#endif
        }
    }
    free(x);
    free(step);
    free(zero);
    free(dq);
    free(dq2);
    free(code);
    free(code2);
    free(gp);
}

/* E2M1 at its edges: every decision threshold and grid point, the floats just beside each, zero
 * of both signs, subnormals, the largest float, infinities and NaN, at steps 1 and 2^-3 (exact
 * quotients) and 0: the SIMD twins' codes and values (the AVX-512 one rounds at each binade's
 * spacing instead of counting thresholds) bit for bit the scalar kernel's; and the in-loop
 * search's scores, whose values-only step skips the codes, on the finite ones. */
static void test_e2m1_edges(void) {
    if (!MQ_TEST_X86 || !mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
#if MQ_TEST_X86
    static const float marks[] = {0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f,
                                  3.5f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, 12.0f, 1e-3f, 1e-30f};
    enum { NM = sizeof marks / sizeof marks[0], N = 4 * NM * 3 + 8 };
    const mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    float y[N], x[N], step[N], zero[N] = {0}, dq[N], dq2[N];
    uint8_t code[N], code2[N];
    int n = 0;
    for (int m = 0; m < NM; m++)
        for (int d = -1; d <= 1; d++) {
            const float v = d == 0 ? marks[m] : nextafterf(marks[m], d < 0 ? 0.0f : INFINITY);
            y[n++] = v;
            y[n++] = -v;
        }
    const float specials[] = {0.0f,    -0.0f,     1e-40f,   -1e-40f,   FLT_MAX,
                              -FLT_MAX, INFINITY, -INFINITY, NAN,      -NAN};
    for (size_t k = 0; k < sizeof specials / sizeof specials[0]; k++) y[n++] = specials[k];
    const int finite = n - 4;   /* the infinities and NaNs last */
    const float steps[3] = {1.0f, 0.125f, 0.0f};
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < n; i++) {
            step[i] = steps[k];
            x[i] = k == 2 ? y[i] : y[i] * steps[k];   /* x / step == y exactly */
        }
        mq_gptq_qdq_column(&s, step, zero, x, n, code, dq);
        mq_gptq_qdq_column_avx2(&s, step, zero, x, n, code2, dq2);
        for (int i = 0; i < n; i++)
            if (code[i] != code2[i] || memcmp(&dq[i], &dq2[i], sizeof(float)) != 0)
                FAIL("AVX2, step %g, y %a: code %d value %a, scalar %d %a", steps[k], y[i], code2[i],
                     dq2[i], code[i], dq[i]);
        if (!mq_cpu_has_avx512()) continue;
        mq_gptq_qdq_column_avx512(&s, step, zero, x, n, code2, dq2);
        for (int i = 0; i < n; i++)
            if (code[i] != code2[i] || memcmp(&dq[i], &dq2[i], sizeof(float)) != 0)
                FAIL("AVX-512, step %g, y %a: code %d value %a, scalar %d %a", steps[k], y[i],
                     code2[i], dq2[i], code[i], dq[i]);
    }
    /* the search: a group of G = 1 column per row, U = 1, so each row's score is (x - q)^2 */
    const float one = 1.0f;
    float work[3 * N];
    double sa[N], sb[N];
    for (int i = 0; i < n; i++) {
        step[i] = 0.125f;
        x[i] = y[i] * 0.125f;
    }
    mq_gptq_loop_scores_ref(&s, &one, 1, x, N, finite, step, zero, work, code, sa);
    for (int i = 0; i < finite; i++) {
        mq_gptq_qdq_column(&s, &step[i], zero, &x[i], 1, &code[i], &dq[i]);
        const double e = (double)(x[i] - dq[i]);
        if (sa[i] != e * e) FAIL("scalar score of y %a: %.17g, expected %.17g", y[i], sa[i], e * e);
    }
    mq_gptq_loop_scores_avx2(&s, &one, 1, x, N, finite, step, zero, work, code, sb);
    ASSERT_TRUE(memcmp(sa, sb, (size_t)finite * sizeof(double)) == 0);
    if (mq_cpu_has_avx512()) {
        memset(sb, 0, sizeof sb);
        mq_gptq_loop_scores_avx512(&s, &one, 1, x, N, finite, step, zero, work, code, sb);
        for (int i = 0; i < finite; i++)
            if (sa[i] != sb[i]) FAIL("AVX-512 score of y %a: %.17g, scalar %.17g", y[i], sb[i], sa[i]);
    }
#endif
}

static void test_column_errors_twin(void) {
    if (!MQ_TEST_X86 || !mq_cpu_has_avx2_fma()) SKIP("no AVX2+FMA");
#if MQ_TEST_X86
    const int64_t n = 1003;
    float *x = malloc((size_t)n * sizeof(float)), *q = malloc((size_t)n * sizeof(float));
    float *w0a = malloc((size_t)n * sizeof(float)), *w0b = malloc((size_t)n * sizeof(float));
    float *ea = malloc((size_t)n * sizeof(float)), *eb = malloc((size_t)n * sizeof(float));
    mq_test_rng = 5;
    for (int64_t i = 0; i < n; i++) {
        x[i] = (float)mq_test_rnd_normal();
        q[i] = (float)(0.5 * mq_test_rnd_normal());
        w0a[i] = w0b[i] = (float)mq_test_rnd_normal();
    }
    double da = 0.25, db = 0.25;
    double sa = mq_gptq_column_errors_ref(x, q, 0.7f, w0a, n, ea, &da);
    double sb = mq_gptq_column_errors_avx2(x, q, 0.7f, w0b, n, eb, &db);
    ASSERT_TRUE(memcmp(ea, eb, (size_t)n * sizeof(float)) == 0);
    ASSERT_TRUE(memcmp(w0a, q, (size_t)n * sizeof(float)) == 0);
    ASSERT_TRUE(memcmp(w0b, q, (size_t)n * sizeof(float)) == 0);
    ASSERT_REL(sa, sb, 1e-5);
    ASSERT_REL(da, db, 1e-5);
    double direct = 0;
    for (int64_t i = 0; i < n; i++) direct += (double)ea[i] * ea[i];
    ASSERT_REL(direct, sa, 1e-5);
    /* the AVX-512 twin: e and w0 as the others, both sums the AVX2 twin's to the bit (its
     * 8-lane order), on lengths ending in every kind of tail */
    if (mq_cpu_has_avx512()) {
        for (int64_t len = n - 20; len <= n; len += 4) {   /* 983 .. 1003: tails of 8 + 7, 3, ... */
            double d2 = 0.25, d5 = 0.25;
            for (int64_t i = 0; i < n; i++) w0a[i] = w0b[i] = (float)(i % 7) - 3.0f;
            double s2 = mq_gptq_column_errors_avx2(x, q, 0.7f, w0a, len, ea, &d2);
            double s5 = mq_gptq_column_errors_avx512(x, q, 0.7f, w0b, len, eb, &d5);
            ASSERT_TRUE(memcmp(ea, eb, (size_t)len * sizeof(float)) == 0);
            ASSERT_TRUE(memcmp(w0b, q, (size_t)len * sizeof(float)) == 0);
            if (memcmp(&s2, &s5, sizeof s2) != 0 || memcmp(&d2, &d5, sizeof d2) != 0)
                FAIL("n %lld: AVX2 sums %.17g %.17g, AVX-512 %.17g %.17g", (long long)len, s2, d2, s5, d5);
        }
    } else {
        fprintf(stderr, "  no AVX-512 on this CPU (or MOEQ_NO_AVX512): its twin is not run\n");
    }
    free(x);
    free(q);
    free(w0a);
    free(w0b);
    free(ea);
    free(eb);
#endif
}

/* The in-loop search's scores: the scalar kernel against the obvious per-row loop (errors fed
 * forward column by column, in float as the kernel), and the AVX2 and AVX-512 twins against both,
 * bit for bit, on 93 rows of a wider buffer (AVX2: 2 x 32 + 3 x 8 + a scalar tail of 5; AVX-512:
 * 64 + 16 + 13 rows on the AVX2 twin). */
static void test_loop_scores_twin(void) {
    enum { G = 16, LD = 96, N = 93 };
    mq_qspec specs[4] = {mq_qspec_default(MQ_QS_NVFP4), int4_spec(G), int4_spec(G), int4_spec(G)};
    specs[2].asym = true;
    specs[3].int4_signed_scale = true;
    float ucol[G * G], x[G * LD], step[LD], zero[LD], work[(G + 2) * LD], wl[G];
    uint8_t code[LD];
    double sa[LD], sb[LD];
    mq_test_rng = 11;
    for (int b = 0; b < G; b++)
        for (int a = 0; a < G; a++)
            ucol[b * G + a] = a > b ? 0.0f : a == b ? 0.5f + (float)fabs(mq_test_rnd_normal()) : 0.3f * (float)mq_test_rnd_normal();
    for (int i = 0; i < G * LD; i++) x[i] = (float)mq_test_rnd_normal();
    for (int k = 0; k < 4; k++) {
        const mq_qspec *s = &specs[k];
        for (int i = 0; i < LD; i++) {
            step[i] = i == 7 ? 0.0f : 0.2f + 0.1f * (float)(i % 5);   /* row 7: an all-zero group */
            if (s->int4_signed_scale && i % 2) step[i] = -step[i];
            zero[i] = s->asym ? (float)(i % 16) : 0.0f;
        }
        mq_gptq_loop_scores_ref(s, ucol, G, x, LD, N, step, zero, work, code, sa);
        for (int i = 0; i < N; i++) {
            double score = 0;
            for (int a = 0; a < G; a++) wl[a] = x[a * LD + i];
            for (int a = 0; a < G; a++) {
                uint8_t c;
                float q;
                mq_gptq_qdq_column(s, &step[i], &zero[i], &wl[a], 1, &c, &q);
                float e = (wl[a] - q) / ucol[a * G + a];
                score += (double)e * e;
                for (int b = a + 1; b < G; b++) wl[b] -= ucol[b * G + a] * e;
            }
            if (score != sa[i]) FAIL("scheme %d row %d: kernel %.17g, direct %.17g", k, i, sa[i], score);
        }
        ASSERT_TRUE(sa[3] > 0);
        if (!mq_cpu_has_avx2_fma()) continue;
#if MQ_TEST_X86
        mq_gptq_loop_scores_avx2(s, ucol, G, x, LD, N, step, zero, work, code, sb);
        ASSERT_TRUE(memcmp(sa, sb, N * sizeof(double)) == 0);
        if (mq_cpu_has_avx512()) {   /* 16 + 16 rows, then 13 on the AVX2 twin's blocks */
            memset(sb, 0, sizeof sb);
            mq_gptq_loop_scores_avx512(s, ucol, G, x, LD, N, step, zero, work, code, sb);
            ASSERT_TRUE(memcmp(sa, sb, N * sizeof(double)) == 0);
        }
#else
        (void)sb;
#endif
    }
}

/* The whole loop with the scalar reference kernels gives the same codes as with AVX2. */
static void test_force_ref_same_codes(void) {
    const int64_t N = 70, K = 128;
    float *W = mq_test_weights(N, K, 61);
    float *H = make_hessian(K, 256, 62, NULL, 0);
    mq_qspec specs[4] = {mq_qspec_default(MQ_QS_NVFP4), int4_spec(32), mq_qspec_default(MQ_QS_NVFP4),
                         int4_spec(32)};
    specs[1].asym = true;
    specs[2].mse = specs[3].mse = true;   /* with the in-loop scale search */
    for (int k = 0; k < 4; k++) {
        mq_gptq_opts o = mq_gptq_opts_default();
        o.mse_weight = MQ_GPTQ_MSE_LOOP;
        mq_qtensor a, b;
        moeq_set_force_ref(1);
        ASSERT_OK(mq_gptq_quantize(&specs[k], &o, H, W, N, K, 0, "w", &a, NULL, NULL));
        moeq_set_force_ref(0);
        ASSERT_OK(mq_gptq_quantize(&specs[k], &o, H, W, N, K, 0, "w", &b, NULL, NULL));
        ASSERT_EQ_INT(0, count_diff(a.codes, b.codes, N * K));
        mq_qtensor_free(&a);
        mq_qtensor_free(&b);
    }
    free(W);
    free(H);
}

typedef struct {
    pthread_t caller;
    int calls, foreign;
    int64_t last, total;
    bool decreasing;
} progress_log;

static void on_progress(void *user, const char *label, int64_t done, int64_t total) {
    progress_log *p = user;
    if (strcmp(label, "gptq-test") != 0) return;
    p->calls++;
    p->foreign += !pthread_equal(pthread_self(), p->caller);
    p->decreasing |= done < p->last;
    p->last = done;
    p->total = total;
}

/* Progress comes from the calling thread, never goes back, stays inside its span. */
static void test_progress(void) {
    const int64_t N = 1500, K = 64;
    float *W = mq_test_weights(N, K, 71);
    float *H = make_hessian(K, 128, 72, NULL, 0);
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.progress_label = "gptq-test";
    o.progress_base = 10;
    o.progress_span = 5;
    o.progress_total = 20;
    progress_log p = {pthread_self(), 0, 0, 0, 0, false};
    moeq_set_progress(on_progress, &p);
    mq_qtensor q;
    moeq_status st = mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &q, NULL, NULL);
    moeq_set_progress(NULL, NULL);
    ASSERT_OK(st);
    ASSERT_TRUE(p.calls >= 1);
    ASSERT_EQ_INT(0, p.foreign);
    ASSERT_FALSE(p.decreasing);
    ASSERT_EQ_INT(15, p.last);
    ASSERT_EQ_INT(20, p.total);
    mq_qtensor_free(&q);
    free(W);
    free(H);
}

static void test_bad_input(void) {
    const int64_t K = 32, N = 8;
    float *W = mq_test_weights(N, K, 1);
    float *H = make_hessian(K, 64, 2, NULL, 0);
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    mq_qtensor q;
    W[3 * K + 5] = NAN;
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_gptq_quantize(&s, &o, H, W, N, K, 0, "mlp.up", &q, NULL, NULL));
    ASSERT_ERROR_MENTIONS("mlp.up");
    W[3 * K + 5] = 0;
    H[K + 2] = INFINITY;
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_gptq_quantize(&s, &o, H, W, N, K, 0, "mlp.up", &q, NULL, NULL));
    ASSERT_ERROR_MENTIONS("mlp.up");
    free(W);
    free(H);
    W = mq_test_weights(N, 24, 1);   /* NVFP4 needs K % 16 == 0 */
    H = make_hessian(24, 64, 2, NULL, 0);
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_gptq_quantize(&s, &o, H, W, N, 24, 0, "mlp.down", &q, NULL, NULL));
    ASSERT_ERROR_MENTIONS("mlp.down");
    free(W);
    free(H);
    /* several at once (checked on the pool): the first bad one is named, with the position */
    float *Hs[3], *Ws[3];
    const char *names[3] = {"e0", "e1", "e2"};
    const int64_t Ks[3] = {K, K, K};
    for (int e = 0; e < 3; e++) Hs[e] = make_hessian(K, 64, 3 + (uint64_t)e, NULL, 0), Ws[e] = mq_test_weights(N, K, 9 + (uint64_t)e);
    mq_gptq_factor f[3];
    Hs[2][0] = NAN;
    Hs[1][K * K - 1] = -INFINITY;
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_gptq_factor_many((const float *const *)Hs, Ks, 3, &o, true, names, f));
    ASSERT_ERROR_MENTIONS("e1: non-finite Hessian entry -inf at (31, 31)");
    Hs[1][K * K - 1] = 1;
    Hs[2][0] = 1;
    ASSERT_OK(mq_gptq_factor_many((const float *const *)Hs, Ks, 3, &o, true, names, f));
    mq_gptq_job jobs[3];
    mq_qtensor qs[3];
    for (int e = 0; e < 3; e++) jobs[e] = (mq_gptq_job){&f[e], Ws[e], N, 0, names[e], &qs[e], NULL, {0, 0, 0, 0, 0}, NULL};
    Ws[2][0] = INFINITY;
    Ws[1][N * K - 1] = NAN;
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_gptq_run(&s, &o, jobs, 3));
    ASSERT_ERROR_MENTIONS("tensor 'e1': non-finite weight nan at row 7, column 31");
    for (int e = 0; e < 3; e++) {
        mq_gptq_factor_free(&f[e]);
        free(Hs[e]);
        free(Ws[e]);
    }
}

/* ---- beyond textbook GPTQ (issue 15) ---------------------------------------------------------- */

/* The clip search (INT4 asymmetric, in-loop scores) never scores worse than the plain search,
 * whose candidates are its first round. With one group per row and no damping, a group's score
 * is the row's whole share of the layer loss, so the layer loss cannot rise either; on these
 * weights it falls. Without zero points the option is refused. */
static void test_clip_search(void) {
    const int64_t N = 96, K = 32;
    float *W = mq_test_weights(N, K, 21), *H = make_hessian(K, 64, 22, NULL, 0);
    mq_qspec s = int4_spec(32);
    s.asym = true;
    s.mse = true;
    mq_gptq_opts o = mq_gptq_opts_default();
    o.percdamp = 0;
    o.mse_weight = MQ_GPTQ_MSE_LOOP;
    mq_qtensor a, b;
    mq_gptq_stats sa, sb;
    float *da = malloc((size_t)(N * K) * sizeof(float)), *db = malloc((size_t)(N * K) * sizeof(float));
    ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &a, da, &sa));
    o.clip_search = true;
    ASSERT_OK(mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &b, db, &sb));
    /* row by row: the loss of each row from the direct formula */
    int64_t better = 0;
    for (int64_t i = 0; i < N; i++) {
        double la = direct_loss(H, K, W + i * K, da + i * K, 1);
        double lb = direct_loss(H, K, W + i * K, db + i * K, 1);
        if (lb > la * (1 + 1e-5) + 1e-12) FAIL("row %lld: clip search %.9g > plain %.9g", (long long)i, lb, la);
        better += lb < la * (1 - 1e-4);
    }
    if (better < N / 4) FAIL("the clip search improved only %lld of %lld rows", (long long)better, (long long)N);
    ASSERT_TRUE(sb.loss < sa.loss);
    ASSERT_NEAR(direct_loss(H, K, W, db, N), sb.loss, 1e-4 * sb.loss);
    mq_qtensor_free(&a);
    mq_qtensor_free(&b);
    s.asym = false;
    mq_qtensor c;
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gptq_quantize(&s, &o, H, W, N, K, 0, "w", &c, NULL, NULL));
    free(da);
    free(db);
    free(W);
    free(H);
}

/* The damping sweep: each candidate's held-out loss is GPTQ on the fitting Hessian with that
 * damping, scored on the held-out Hessian (computed here with the single-weight entry point and
 * the direct loss), and the first least one is chosen. */
static void test_damp_sweep(void) {
    const int64_t N = 64, K = 64;
    float *W[2] = {mq_test_weights(N, K, 31), mq_test_weights(N / 2, K, 32)};
    /* few fitting rows (GPTQ over-fits them), many held-out ones from the same distribution */
    float *Hf = make_hessian(K, 72, 33, NULL, 0), *Hh = make_hessian(K, 2000, 34, NULL, 0);
    const int64_t rows[2] = {N, N / 2};
    const float *w[2] = {W[0], W[1]};
    const double cand[5] = {0.001, 0.01, 0.1, 1.0, 0.01};
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    double loss[5], want[5];
    int best = -2;
    ASSERT_OK(mq_gptq_damp_sweep(&s, &o, Hf, Hh, K, w, rows, NULL, 2, cand, 5, "w", &best, loss));
    float *deq = malloc((size_t)(N * K) * sizeof(float));
    int argmin = 0;
    for (int c = 0; c < 5; c++) {
        mq_gptq_opts oc = o;
        oc.percdamp = cand[c];
        want[c] = 0;
        for (int k = 0; k < 2; k++) {
            mq_qtensor q;
            ASSERT_OK(mq_gptq_quantize(&s, &oc, Hf, W[k], rows[k], K, 0, "w", &q, deq, NULL));
            want[c] += direct_loss(Hh, K, W[k], deq, rows[k]);
            mq_qtensor_free(&q);
        }
        ASSERT_NEAR(want[c], loss[c], 1e-4 * want[c]);
        if (want[c] < want[argmin]) argmin = c;
    }
    ASSERT_EQ_INT(argmin, best);
    ASSERT_TRUE(loss[4] == loss[1]);   /* the repeated candidate: the same run, not chosen over it */
    ASSERT_TRUE(best != 4);
    /* 72 fitting rows of 64 columns: the least damping over-fits and loses on held-out rows */
    ASSERT_TRUE(loss[0] > loss[best]);
    /* held out = fitting: the sweep scores on the rows it fits, where little damping wins over
     * a damping that turns GPTQ into round to nearest */
    ASSERT_OK(mq_gptq_damp_sweep(&s, &o, Hh, Hh, K, w, rows, NULL, 2, cand, 4, "w", &best, loss));
    ASSERT_TRUE(best != 3);
    ASSERT_TRUE(loss[3] > loss[0]);
    ASSERT_EQ_INT(MOEQ_E_ARG, mq_gptq_damp_sweep(&s, &o, Hf, Hh, K, w, rows, NULL, 2, cand, 0, "w", &best, loss));
    free(deq);
    free(W[0]);
    free(W[1]);
    free(Hf);
    free(Hh);
}

/* The refinement: cyclic coordinate descent over the codes, against the obvious version here in
 * double (each value moved to the grid point of its group nearest to its unconstrained optimum
 * given the others, columns in processing order), starting from GPTQ's result without it. It
 * keeps the group parameters, never raises the damped objective, lowers it on these weights,
 * and does not depend on the thread count. */
static void refine_case(const mq_qspec *s, bool act_order) {
    const int64_t N = 40, K = 64;
    float *W = mq_test_weights(N, K, 61), *H = make_hessian(K, 96, 62, NULL, 0);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = act_order;
    mq_qtensor a, b;
    mq_gptq_stats sa, sb;
    float *da = malloc((size_t)(N * K) * sizeof(float)), *db = malloc((size_t)(N * K) * sizeof(float));
    ASSERT_OK(mq_gptq_quantize(s, &o, H, W, N, K, 0, "w", &a, da, &sa));
    o.refine_passes = 2;
    ASSERT_OK(mq_gptq_quantize(s, &o, H, W, N, K, 0, "w", &b, db, &sb));
    for (int64_t i = 0; i < N * a.n_groups; i++) {
        ASSERT_TRUE(a.params[i].scale == b.params[i].scale);
        ASSERT_TRUE(a.params[i].zero == b.params[i].zero);
    }
    /* the damped objective H' = H + damp I, damp = percdamp mean(diag H) */
    double mean = 0;
    for (int64_t k = 0; k < K; k++) mean += H[k * K + k];
    const float damp = (float)(0.01 * (mean / (double)K));
    float *Hd = malloc((size_t)(K * K) * sizeof(float));
    memcpy(Hd, H, (size_t)(K * K) * sizeof(float));
    for (int64_t k = 0; k < K; k++) Hd[k * K + k] += damp;
    double oa = direct_loss(Hd, K, W, da, N), ob = direct_loss(Hd, K, W, db, N);
    if (!(ob < oa * (1 - 1e-3))) FAIL("refined objective %.9g, GPTQ's %.9g", ob, oa);
    ASSERT_NEAR(direct_loss(H, K, W, db, N), sb.loss, 1e-4 * sb.loss);
    /* the obvious coordinate descent in double from GPTQ's values */
    int32_t *order = malloc((size_t)K * sizeof(int32_t));
    for (int64_t k = 0; k < K; k++) order[k] = (int32_t)k;
    if (act_order)   /* decreasing diag(H), ties by index (stable insertion sort) */
        for (int64_t i = 1; i < K; i++)
            for (int64_t j = i; j > 0 && H[order[j] * K + order[j]] > H[order[j - 1] * K + order[j - 1]]; j--) {
                int32_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
    double *q = malloc((size_t)(N * K) * sizeof(double));
    for (int64_t i = 0; i < N * K; i++) q[i] = da[i];
    for (int64_t r = 0; r < N; r++)
        for (int pass = 0; pass < 2; pass++)
            for (int64_t pi = 0; pi < K; pi++) {
                const int64_t p = order[pi];
                double g = 0;   /* (D H')_p */
                for (int64_t k = 0; k < K; k++) g += ((double)W[r * K + k] - q[r * K + k]) * Hd[k * K + p];
                const float t = (float)(q[r * K + p] + g / Hd[p * K + p]);
                const mq_gparams *gp = &a.params[r * a.n_groups + p / a.group_size];
                q[r * K + p] = mq_dequant_value(s, a.global_scale, gp, mq_quant_value(s, a.global_scale, gp, t));
            }
    /* values, not codes: E2M1's -0 and +0 are one value */
    int64_t diff = 0;
    for (int64_t i = 0; i < N * K; i++) diff += (float)q[i] != db[i];
    if (diff > N * K / 200)
        FAIL("%lld of %lld values differ from the reference refinement", (long long)diff, (long long)(N * K));
    /* the scale step: the codes' least-squares scales, never a higher objective */
    mq_qtensor e;
    mq_gptq_stats se;
    float *de = malloc((size_t)(N * K) * sizeof(float));
    o.refine_scales = true;
    ASSERT_OK(mq_gptq_quantize(s, &o, H, W, N, K, 0, "w", &e, de, &se));
    o.refine_scales = false;
    double oe = direct_loss(Hd, K, W, de, N);
    if (!(oe <= ob * (1 + 1e-5))) FAIL("with the scale step %.9g, without %.9g", oe, ob);
    ASSERT_NEAR(direct_loss(H, K, W, de, N), se.loss, 1e-4 * se.loss);
    int64_t moved = 0;
    for (int64_t i = 0; i < N * e.n_groups; i++) moved += e.params[i].scale != a.params[i].scale;
    if (s->scheme == MQ_QS_INT4 && moved == 0) FAIL("the scale step moved no INT4 scale");
    /* the stored values are what the codes and the moved scales dequantize to */
    float *back = malloc((size_t)(N * K) * sizeof(float));
    mq_dequantize(&e, back);
    for (int64_t i = 0; i < N * K; i++) ASSERT_TRUE(back[i] == de[i]);
    free(back);
    free(de);
    mq_qtensor_free(&e);
    /* the thread count */
    mq_qtensor c1;
    mq_gptq_stats s1;
    int saved = moeq_threads();
    moeq_set_threads(1);
    ASSERT_OK(mq_gptq_quantize(s, &o, H, W, N, K, 0, "w", &c1, NULL, &s1));
    moeq_set_threads(saved);
    ASSERT_EQ_INT(0, count_diff(c1.codes, b.codes, N * K));
    ASSERT_TRUE(s1.loss == sb.loss);
    mq_qtensor_free(&c1);
    free(q);
    free(order);
    free(Hd);
    mq_qtensor_free(&a);
    mq_qtensor_free(&b);
    free(da);
    free(db);
    free(W);
    free(H);
}

/* NVFP4's global-scale headroom: the tensor's amax maps to a block scale of 448/H, so a block at
 * the amax can take a scale up to H times its max-based one (without it, 448 clamps it). */
static void test_global_scale_headroom(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    ASSERT_TRUE(mq_nvfp4_global_scale(&s, 3.0f) == 2688.0f / 3.0f);
    s.nvfp4_headroom = 1.5f;
    ASSERT_TRUE(mq_nvfp4_global_scale(&s, 3.0f) == 2688.0f / (3.0f * 1.5f));
    s.mse = true;
    s.mse_lo = 1.2f;
    s.mse_hi = 1.5f;
    s.mse_steps = 9;
    float x[16];
    for (int i = 0; i < 16; i++) x[i] = i == 0 ? 3.0f : 0.37f * (float)(i % 5) - 0.6f;
    mq_gparams plain, cand[9];
    int n = mq_group_candidates(&s, mq_nvfp4_global_scale(&s, 3.0f), x, 16, 1, &plain, cand);
    ASSERT_TRUE(n > 1);
    ASSERT_TRUE(cand[n - 1].scale > plain.scale * 1.4f);
    s.nvfp4_headroom = 0;   /* clamped at 448: a single candidate */
    n = mq_group_candidates(&s, mq_nvfp4_global_scale(&s, 3.0f), x, 16, 1, &plain, cand);
    ASSERT_EQ_INT(1, n);
    ASSERT_TRUE(cand[0].scale == 448.0f);
}

static void test_refine(void) {
    mq_qspec nv = mq_qspec_default(MQ_QS_NVFP4), i4 = int4_spec(32);
    nv.mse = i4.mse = true;
    refine_case(&nv, false);
    refine_case(&i4, true);
    i4.int4_signed_scale = true;   /* negative scales through the value and scale steps */
    refine_case(&i4, true);
    i4.int4_signed_scale = false;
    i4.asym = true;
    refine_case(&i4, true);
}

/* Asymmetric calibration's correction (mq_gptq_target) against the formula in double precision:
 * W' = W + a W ((2/n) G - H)(H + damping)^-1, the damping GPTQ's (percdamp mean(diag H), in
 * float as the code forms it). Bound: the float Cholesky solve's relative error is within
 * c K 2^-24 cond(A), cond(A) <= (Gershgorin's bound on H's largest eigenvalue + damping) /
 * damping, and the update adds one rounding per product; 8 K 2^-24 cond(A) of the largest
 * correction (here about 1% of it) is far below what a wrong sign, transpose or scale gives.
 * Where (2/n) G equals H exactly (the two streams agree) the weights do not move, not by a bit;
 * share 0 leaves them; an H no damping makes positive definite is an error naming the Linear. */
/* H = (2/n) sum x_q x_q^T and G = sum x_f x_q^T of n correlated rows, x_f = x_q + noise. */
static void target_sums(int64_t K, int64_t n, uint64_t seed, float *H, float *G) {
    mq_test_rng = seed;
    double *xq = malloc(sizeof(double) * (size_t)(n * K)), *xf = malloc(sizeof(double) * (size_t)(n * K));
    for (int64_t t = 0; t < n; t++) {
        double prev = 0;
        for (int64_t k = 0; k < K; k++) {
            prev = mq_test_rnd_normal() + 0.6 * prev;
            xq[t * K + k] = prev * (1 + 0.05 * (double)k);
            xf[t * K + k] = xq[t * K + k] + 0.3 * mq_test_rnd_normal();
        }
    }
    for (int64_t a = 0; a < K; a++)
        for (int64_t c = 0; c < K; c++) {
            double h = 0, g = 0;
            for (int64_t t = 0; t < n; t++) {
                h += xq[t * K + a] * xq[t * K + c];
                g += xf[t * K + a] * xq[t * K + c];
            }
            H[a * K + c] = (float)(2.0 * h / (double)n);
            G[a * K + c] = (float)g;
        }
    free(xq), free(xf);
}

/* The corrected weights ws[m] of orig[m] against the formula in double (bound above). */
static void target_check(const float *H, const float *G, int64_t K, int64_t n, float share, double percdamp,
                         const float *const *orig,
                         float *const *ws, const int64_t *rows, int nw) {
    /* the formula in double: A = H + damp I, M = share ((2/n) G - H), Z = M A^-1 (A Z^T = M^T) */
    double mean = 0;
    for (int64_t k = 0; k < K; k++) mean += H[k * K + k];
    mean /= (double)K;
    const float damp = (float)(percdamp * mean);
    double *A = malloc(sizeof(double) * (size_t)(K * K)), *Z = malloc(sizeof(double) * (size_t)(K * K));
    double lmax = 0;
    for (int64_t a = 0; a < K; a++) {
        double row = 0;
        for (int64_t c = 0; c < K; c++) {
            A[a * K + c] = (double)H[a * K + c] + (a == c ? (double)damp : 0);
            Z[c * K + a] = share * (2.0 / (double)n * G[a * K + c] - H[a * K + c]);   /* Z = M^T */
            row += fabs((double)H[a * K + c]);
        }
        if (row > lmax) lmax = row;
    }
    ASSERT_TRUE(chol_lower(A, K));
    for (int64_t j = 0; j < K; j++) {   /* columns of M^T: solve L L^T z = m */
        for (int64_t i = 0; i < K; i++) {
            double v = Z[i * K + j];
            for (int64_t k = 0; k < i; k++) v -= A[i * K + k] * Z[k * K + j];
            Z[i * K + j] = v / A[i * K + i];
        }
        for (int64_t i = K - 1; i >= 0; i--) {
            double v = Z[i * K + j];
            for (int64_t k = i + 1; k < K; k++) v -= A[k * K + i] * Z[k * K + j];
            Z[i * K + j] = v / A[i * K + i];
        }
    }
    /* Z now holds A^-1 M^T = (M A^-1)^T: W' = W + W Z^T */
    const double cond = (lmax + damp) / damp, rel = 8.0 * (double)K * 0x1p-24 * cond;
    double worst = 0, largest = 0;
    for (int m = 0; m < nw; m++)
        for (int64_t r = 0; r < rows[m]; r++)
            for (int64_t c = 0; c < K; c++) {
                double d = 0;
                for (int64_t k = 0; k < K; k++) d += (double)orig[m][r * K + k] * Z[c * K + k];
                if (fabs(d) > largest) largest = fabs(d);
                double e = fabs((double)ws[m][r * K + c] - ((double)orig[m][r * K + c] + d));
                if (e > worst) worst = e;
            }
    printf("  target K %lld: largest correction %.3g, worst error %.3g, bound %.3g (cond(A) <= %.0f)\n",
           (long long)K, largest, worst, rel * largest, cond);
    ASSERT_TRUE(largest > 1e-3);
    ASSERT_TRUE(rel < 0.05);
    ASSERT_TRUE(worst <= rel * largest + 2 * 0x1p-24 * 0.2);
    free(A), free(Z);
}

static void test_target(void) {
    const int64_t K = 40, n = 200, N = 24;
    float *H = malloc(sizeof(float) * (size_t)(K * K)), *G = malloc(sizeof(float) * (size_t)(K * K));
    target_sums(K, n, 99, H, G);
    float *w0 = mq_test_weights(N, K, 5), *w1 = mq_test_weights(N / 2, K, 6);
    float *v0 = malloc(sizeof(float) * (size_t)(N * K)), *v1 = malloc(sizeof(float) * (size_t)(N / 2 * K));
    memcpy(v0, w0, sizeof(float) * (size_t)(N * K));
    memcpy(v1, w1, sizeof(float) * (size_t)(N / 2 * K));
    float *ws[2] = {v0, v1};
    const float *orig[2] = {w0, w1};
    const int64_t rows[2] = {N, N / 2};
    const float share = 0.5f;
    ASSERT_OK(mq_gptq_target(H, G, K, n, share, 0.01, ws, rows, 2, "test.proj"));
    target_check(H, G, K, n, share, 0.01, orig, ws, rows, 2);
    /* the streams agree: G's sum is H's, (2/n) G - H is zero, nothing moves */
    const float sc = 2.0f / (float)n;
    for (int64_t i = 0; i < K * K; i++) H[i] = sc * G[i];
    memcpy(v0, w0, sizeof(float) * (size_t)(N * K));
    float *same[1] = {v0};
    ASSERT_OK(mq_gptq_target(H, G, K, n, 1.0f, 0.01, same, rows, 1, "test.proj"));
    ASSERT_TRUE(memcmp(v0, w0, sizeof(float) * (size_t)(N * K)) == 0);
    memcpy(G, H, sizeof(float) * (size_t)(K * K));
    G[3] += 1;
    ASSERT_OK(mq_gptq_target(H, G, K, n, 0.0f, 0.01, same, rows, 1, "test.proj"));
    ASSERT_TRUE(memcmp(v0, w0, sizeof(float) * (size_t)(N * K)) == 0);
    for (int64_t i = 0; i < K * K; i++) H[i] = i % (K + 1) == 0 ? -1.0f : 0.0f;   /* -I */
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_gptq_target(H, G, K, n, 0.5f, 0.01, same, rows, 1, "test.proj"));
    ASSERT_ERROR_MENTIONS("test.proj");
    free(H), free(G), free(w0), free(w1), free(v0), free(v1);
}

/* Many inputs at once (mq_gptq_target_many: more than the pool's threads, so in waves, and
 * fewer, so one at a time): inputs of 300, 70 and 130 columns (partial factor tiles, 128-column
 * solve blocks and product tiles) and weights of 520 and 17 rows (partial 256-row blocks), each
 * against the double-precision formula, and bit for bit what one mq_gptq_target call gives it
 * at 1 and at 3 threads (damping 0.1, which keeps the bound above meaningful at 300 columns);
 * an input no damping makes positive definite fails the call with its
 * own name, the first such in the jobs' order. */
static void test_target_many(void) {
    const int64_t Ks[3] = {300, 70, 130}, n = 400;
    const int saved = moeq_threads();
    for (int threads = 1; threads <= 3; threads += 2) {
        moeq_set_threads(threads);
        const int64_t nj = mq_pool_size() + 2;
        for (int64_t count = 2; count <= nj; count += nj - 2) {   /* fewer than the threads, then more */
            mq_gptq_target_job *jobs = calloc((size_t)count, sizeof *jobs);
            float **H = calloc((size_t)count, sizeof *H), **G = calloc((size_t)count, sizeof *G);
            float *(*w)[2] = calloc((size_t)count, sizeof *w), *(*one)[2] = calloc((size_t)count, sizeof *one);
            float *(*orig)[2] = calloc((size_t)count, sizeof *orig);
            int64_t (*rows)[2] = calloc((size_t)count, sizeof *rows);
            char (*names)[32] = calloc((size_t)count, sizeof *names);
            for (int64_t j = 0; j < count; j++) {
                const int64_t K = Ks[j % 3];
                H[j] = malloc(sizeof(float) * (size_t)(K * K));
                G[j] = malloc(sizeof(float) * (size_t)(K * K));
                target_sums(K, n, 7 + (uint64_t)j, H[j], G[j]);
                if (j == 3) H[j][(K - 5) * K + K - 5] *= -1.0f;   /* factored only with more damping, beside others */
                rows[j][0] = j % 2 ? 17 : 520;
                rows[j][1] = 33;
                for (int k = 0; k < 2; k++) {
                    orig[j][k] = mq_test_weights(rows[j][k], K, 100 + (uint64_t)(2 * j + k));
                    w[j][k] = malloc(sizeof(float) * (size_t)(rows[j][k] * K));
                    one[j][k] = malloc(sizeof(float) * (size_t)(rows[j][k] * K));
                    memcpy(w[j][k], orig[j][k], sizeof(float) * (size_t)(rows[j][k] * K));
                    memcpy(one[j][k], orig[j][k], sizeof(float) * (size_t)(rows[j][k] * K));
                }
                snprintf(names[j], sizeof names[j], "layer.%lld.proj", (long long)j);
                jobs[j] = (mq_gptq_target_job){H[j], G[j], K, n, 0.5f, 0.1, w[j], rows[j], 1 + (int)(j % 2 == 0), names[j]};
            }
            double sec[3] = {-1, -1, -1};
            ASSERT_OK(mq_gptq_target_many(jobs, count, sec));
            ASSERT_TRUE(sec[0] > 0 && sec[1] > 0 && sec[2] > 0);   /* each step ran and was timed */
            for (int64_t j = 0; j < count; j++) {
                const int64_t K = Ks[j % 3];
                ASSERT_OK(mq_gptq_target(H[j], G[j], K, n, 0.5f, 0.1, one[j], rows[j], jobs[j].nw, names[j]));
                for (int k = 0; k < jobs[j].nw; k++)
                    ASSERT_TRUE(memcmp(one[j][k], w[j][k], sizeof(float) * (size_t)(rows[j][k] * K)) == 0);
                if (j < 3 && threads == 1)
                    target_check(H[j], G[j], K, n, 0.5f, 0.1, (const float *const *)orig[j], w[j], rows[j], jobs[j].nw);
                /* a weight past nw is not touched */
                if (jobs[j].nw == 1)
                    ASSERT_TRUE(memcmp(w[j][1], orig[j][1], sizeof(float) * (size_t)(rows[j][1] * K)) == 0);
            }
            /* two inputs that cannot be factored: the first in the jobs' order is named */
            for (int64_t i = 0; i < Ks[1] * Ks[1]; i++) H[1][i] = i % (Ks[1] + 1) == 0 ? -1.0f : 0.0f;
            const int64_t last = count - 1;
            for (int64_t i = 0; i < Ks[last % 3] * Ks[last % 3]; i++)
                H[last][i] = i % (Ks[last % 3] + 1) == 0 ? -1.0f : 0.0f;
            ASSERT_STATUS(MOEQ_E_NUMERIC, mq_gptq_target_many(jobs, count, NULL));
            ASSERT_ERROR_MENTIONS("layer.1.proj");
            for (int64_t j = 0; j < count; j++) {
                free(H[j]), free(G[j]);
                for (int k = 0; k < 2; k++) free(w[j][k]), free(one[j][k]), free(orig[j][k]);
            }
            free(jobs), free(H), free(G), free(w), free(one), free(orig), free(rows), free(names);
        }
    }
    moeq_set_threads(saved);
}

/* One input's correction has the same bits at 1, 2 and 3 threads: its factorisation runs its
 * tiles on the pool when the input is alone (K = 300: three 128-column tiles, a partial one) and
 * in turn inside a task in a wave (test_target_many compares the two). */
static void test_target_threads(void) {
    const int64_t K = 300, n = 400, rows[2] = {260, 33};
    float *H = malloc(sizeof(float) * (size_t)(K * K)), *G = malloc(sizeof(float) * (size_t)(K * K));
    target_sums(K, n, 11, H, G);
    float *orig = mq_test_weights(rows[0], K, 21), *first = NULL;
    const int saved = moeq_threads();
    for (int threads = 1; threads <= 3; threads++) {
        moeq_set_threads(threads);
        float *w = malloc(sizeof(float) * (size_t)(rows[0] * K));
        memcpy(w, orig, sizeof(float) * (size_t)(rows[0] * K));
        float *ws[2] = {w, NULL};
        ASSERT_OK(mq_gptq_target(H, G, K, n, 0.5f, 0.1, ws, rows, 1, "test.proj"));
        ASSERT_TRUE(memcmp(w, orig, sizeof(float) * (size_t)(rows[0] * K)) != 0);   /* corrected */
        if (!first) first = w;
        else {
            ASSERT_TRUE(memcmp(first, w, sizeof(float) * (size_t)(rows[0] * K)) == 0);
            free(w);
        }
    }
    moeq_set_threads(saved);
    free(first), free(orig), free(H), free(G);
}

TEST_MAIN(T(test_reference_nvfp4), T(test_reference_int4), T(test_reference_kquant), T(test_kquant_refine), T(test_target_many), T(test_reference_act_order),
          T(test_reference_mse), T(test_reference_mse_weights), T(test_dead_columns), T(test_damping_retry),
          T(test_factor_matches_textbook), T(test_gidx_consistency), T(test_static_vs_dynamic),
          T(test_block_sizes), T(test_thread_count_independent), T(test_row_block_independent), T(test_scratch_reuse), T(test_many_jobs), T(test_factor_many_uneven),
          T(test_qdq_column_matches_formats), T(test_e2m1_edges), T(test_column_errors_twin), T(test_loop_scores_twin),
          T(test_force_ref_same_codes), T(test_progress), T(test_bad_input), T(test_clip_search),
          T(test_damp_sweep), T(test_refine), T(test_global_scale_headroom), T(test_factor_odd_size),
          T(test_target), T(test_target_threads))
