/*
 * Expert-balanced calibration (--calib-balance experts): the calibration samples chosen from a
 * larger pool of candidates so that the routed experts get tokens as evenly as the text allows.
 *
 * Why: the router sends a text's tokens to a few favourite experts; with the first N samples
 * of a file, rare experts see a handful of tokens (or none: then GPTQ falls back), and their
 * Hessians are noise. MoEQuant's EBSS (arXiv 2505.03804) generates balanced text with the model
 * itself, which needs the whole model in memory for every generated token; here the user's own
 * text is the source, and the choice costs one streamed forward of the pool:
 *
 *   1. counts: every candidate through the unquantized model, layer by layer as the pipeline
 *      streams it (attention, router, then the experts chunk by chunk within the plan's
 *      memory), the tokens each candidate routes to each expert of each MoE layer recorded;
 *   2. selection: greedy, each time the candidate that adds most to
 *          sum over MoE layers l and experts e of  log(1 + tokens[l][e]),
 *      until N are chosen. The log rewards an expert's first tokens most and a favourite's
 *      next thousand least, so the choice feeds the starved experts first while the common
 *      ones keep enough. The objective is concave in the counts, so a candidate's gain only
 *      falls as others are chosen: lazy re-evaluation gives exactly the plain greedy's choice
 *      (ties to the lower index) with a fraction of the evaluations.
 *
 * The forward is the model's, part by part (model.h): the routed experts' outputs summed per
 * token in increasing expert order, the experts through the shape-independent GEMM, so the
 * counts are those of mq_forward_layers sample by sample for any thread count, group size,
 * expert chunk or rank count (tests/test_balance.c).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "dist/dist.h"
#include "kernels/vec.h"
#include "pipeline/internal.h"

/* ---- counts ----------------------------------------------------------------------------- */

/* A row of an expert: sample (within the group) << 32 | token << 8 | k (its slot among the
 * token's top-k). Tokens < 2^24, k < 256 (config limits). */
#define ROW(s, t, k) ((int64_t)(s) << 32 | (int64_t)(t) << 8 | (int64_t)(k))

typedef struct {
    const moeq_model *m;
    int layer, expert;
    int64_t D, F, K, Lmax;
    const float *xn;          /* [G][Lmax][D] FFN inputs */
    float *out;               /* [G][Lmax][D] FFN outputs */
    const float *w;           /* [G][Lmax][K] routing weights */
    const int64_t *rows;      /* the expert's rows, in (sample, token) order */
    int64_t n_rows;
    float *scratch;           /* per thread: x [R][D], g [R][F], u [R][F], y [R][D] */
    size_t per_thread;
} expert_job;

/* Rows [b R, (b + 1) R) of one expert (R = MQ_MOE_ROWS, the forward's blocks): gathered, run
 * through the expert, w * y added to each token's output. A token appears once per expert, so
 * blocks never touch the same output. */
static void expert_block_task(void *ctx, int64_t b, int thread) {
    const expert_job *j = ctx;
    const int64_t D = j->D, F = j->F, r0 = b * MQ_MOE_ROWS, LD = j->Lmax * D;
    const int64_t n = j->n_rows - r0 < MQ_MOE_ROWS ? j->n_rows - r0 : MQ_MOE_ROWS;
    float *x = j->scratch + (size_t)thread * j->per_thread, *g = x + MQ_MOE_ROWS * D,
          *u = g + MQ_MOE_ROWS * F, *y = u + MQ_MOE_ROWS * F;
    const int64_t *row = j->rows + r0;
    for (int64_t r = 0; r < n; r++)
        memcpy(x + r * D, j->xn + (row[r] >> 32) * LD + ((row[r] >> 8) & 0xffffff) * D, sizeof(float) * (size_t)D);
    const mq_layer *ly = &j->m->layers[j->layer];
    /* fp32 Linears: cannot fail */
    (void)mq_mlp_forward(&ly->exp_gate[j->expert], &ly->exp_up[j->expert], &ly->exp_down[j->expert], x, n,
                         g, u, y);
    for (int64_t r = 0; r < n; r++) {
        int64_t s = row[r] >> 32, t = (row[r] >> 8) & 0xffffff, k = row[r] & 0xff;
        mq_vec()->axpy(j->w[(s * j->Lmax + t) * j->K + k], y + r * D, j->out + s * LD + t * D, D);
    }
}

void mq_balance_counter_free(mq_balance_counter *k) {
    MQ_RELEASE_EACH(k->x, k->xn, k->out, k->probs, k->wt, k->sel, k->rows, k->start, k->scratch,
                    k->mlp_scratch);
    mq_state_free(k->state);
    free(k->moe_index);
    memset(k, 0, sizeof *k);
}

moeq_status mq_balance_counter_init(mq_balance_counter *k, mq_lazy_model *lz, int64_t group,
                                    int64_t max_len, int chunk) {
    memset(k, 0, sizeof *k);
    k->lz = lz;
    k->m = mq_lazy_model_of(lz);
    const mq_config *c = &k->m->cfg;
    k->G = group > 0 ? group : 1;
    k->Lmax = max_len;
    k->chunk = chunk > 0 && chunk < c->n_experts ? chunk : (c->n_experts > 0 ? c->n_experts : 1);
    k->moe_index = malloc(sizeof(int) * (size_t)(c->n_layers > 0 ? c->n_layers : 1));
    if (!k->moe_index) return mq_err(MOEQ_E_NOMEM, "out of memory");
    k->last_moe = -1;
    for (int l = 0; l < c->n_layers; l++) {
        k->moe_index[l] = k->m->layers[l].is_moe ? k->n_moe++ : -1;
        if (k->m->layers[l].is_moe) k->last_moe = l;
    }
    const size_t GLD = (size_t)(k->G * max_len * c->D), GLK = (size_t)(k->G * max_len * (c->top_k > 0 ? c->top_k : 1));
    const int64_t F = c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn;
    k->per_thread = (size_t)(MQ_MOE_ROWS * (2 * c->D + 2 * c->moe_ffn));
    k->x = mq_alloc_array(GLD, sizeof(float), "balance: activations");
    k->xn = mq_alloc_array(GLD, sizeof(float), "balance: FFN inputs");
    k->out = mq_alloc_array(GLD, sizeof(float), "balance: FFN outputs");
    k->mlp_scratch = mq_alloc_array((size_t)(max_len * (2 * F + c->D + 1)), sizeof(float), "balance: MLP scratch");
    if (!k->x || !k->xn || !k->out || !k->mlp_scratch) goto nomem;
    if (c->n_experts > 0) {
        k->probs = mq_alloc_array((size_t)(max_len * c->n_experts), sizeof(float), "balance: router scores");
        k->wt = mq_alloc_array(GLK, sizeof(float), "balance: routing");
        k->sel = mq_alloc_array(GLK, sizeof(int32_t), "balance: routing");
        k->rows = mq_alloc_array(GLK, sizeof(int64_t), "balance: expert rows");
        k->start = mq_alloc_array((size_t)c->n_experts + 1, sizeof(int64_t), "balance: expert rows");
        k->scratch = mq_alloc_array((size_t)mq_pool_size() * k->per_thread, sizeof(float), "balance: expert scratch");
        if (!k->probs || !k->wt || !k->sel || !k->rows || !k->start || !k->scratch) goto nomem;
    }
    moeq_status st = mq_state_new_ex(k->m, (int32_t)max_len, false, &k->state);
    if (st) mq_balance_counter_free(k);
    return st;
nomem:
    mq_balance_counter_free(k);
    return MOEQ_E_NOMEM;
}

static moeq_status load(mq_balance_counter *k, int l, unsigned what, int e0, int e1) {
    moeq_status st = mq_lazy_load(k->lz, l, what, e0, e1);
    return st ? mq_err_prefix(st, "balancing the calibration set: layer %d", l) : MOEQ_OK;
}

/* Layer l's routed experts for the group's g samples, into out (zeroed): the rows sorted by
 * expert (counting sort, (sample, token) order kept), then chunk by chunk, expert by expert. */
static moeq_status routed(mq_balance_counter *k, int l, const int64_t *len, int64_t g) {
    const mq_config *c = &k->m->cfg;
    const int64_t E = c->n_experts, K = c->top_k, Lmax = k->Lmax;
    int64_t *start = k->start;
    memset(start, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t s = 0; s < g; s++)
        for (int64_t i = 0; i < len[s] * K; i++) start[k->sel[s * Lmax * K + i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t s = 0; s < g; s++)   /* start[e] runs to the end of e's rows, then back below */
        for (int64_t t = 0; t < len[s]; t++)
            for (int64_t kk = 0; kk < K; kk++) {
                int32_t e = k->sel[(s * Lmax + t) * K + kk];
                k->rows[start[e]++] = ROW(s, t, kk);
            }
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    expert_job j = {k->m, l, 0, c->D, c->moe_ffn, K, Lmax, k->xn, k->out, k->wt, NULL, 0, k->scratch,
                    k->per_thread};
    moeq_status st = MOEQ_OK;
    for (int e0 = 0; e0 < E && !st; e0 += k->chunk) {
        int e1 = e0 + k->chunk < E ? e0 + k->chunk : (int)E;
        if ((st = load(k, l, MQ_PART_EXPERTS, e0, e1))) break;
        if (e1 < E) mq_lazy_prefetch(k->lz, l, MQ_PART_EXPERTS, e1, e1 + k->chunk < E ? e1 + k->chunk : (int)E);
        for (int e = e0; e < e1; e++) {   /* in increasing order: each token's sum in the forward's */
            j.expert = e;
            j.rows = k->rows + start[e];
            j.n_rows = start[e + 1] - start[e];
            if (j.n_rows > 0) mq_parallel_for((j.n_rows + MQ_MOE_ROWS - 1) / MQ_MOE_ROWS, expert_block_task, &j);
        }
        mq_lazy_release(k->lz, l, MQ_PART_EXPERTS, e0, e1);
    }
    return st;
}

moeq_status mq_balance_count_group(mq_balance_counter *k, const mq_calib_set *pool, int64_t s0,
                                   int64_t g, int32_t *counts, void (*progress)(void *, int64_t),
                                   void *user) {
    const moeq_model *m = k->m;
    const mq_config *c = &m->cfg;
    const int64_t D = c->D, E = c->n_experts, K = c->top_k, Lmax = k->Lmax, LD = Lmax * D;
    const int64_t *len = pool->len + s0;
    if (g > k->G) return mq_err(MOEQ_E_ARG, "balance: a group of %lld samples in buffers for %lld", (long long)g, (long long)k->G);
    moeq_status st = MOEQ_OK;
    for (int64_t s = 0; s < g && !st; s++) st = mq_lazy_embed(k->lz, pool->ids[s0 + s], len[s], k->x + s * LD);
    float *gs = k->mlp_scratch, *us = gs + Lmax * (c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn),
          *ys = us + Lmax * (c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn), *sgate = ys + Lmax * D;
    for (int l = 0; l <= k->last_moe && !st; l++) {   /* past the last MoE layer: nothing to count */
        if (moeq_interrupted()) return mq_err(MOEQ_E_INTERRUPTED, "balancing the calibration set interrupted");
        const mq_layer *ly = &m->layers[l];
        const bool last = l == k->last_moe, moe = ly->is_moe;
        unsigned parts = MQ_PART_ATTN | MQ_PART_FFN_NORM | (moe ? MQ_PART_ROUTER : 0);
        if ((st = load(k, l, parts, 0, 0))) break;
        if (!last) mq_lazy_prefetch(k->lz, l + 1, MQ_PART_ATTN | MQ_PART_FFN_NORM | MQ_PART_ROUTER, 0, 0);
        for (int64_t s = 0; s < g && !st; s++) {
            float *x = k->x + s * LD, *xn = k->xn + s * LD;
            st = mq_attention_forward(m, k->state, l, x, len[s], 0, NULL);
            if (st) break;
            mq_ffn_norm(m, l, x, len[s], xn);
            if (!moe) continue;
            int32_t *sel = k->sel + s * Lmax * K;
            mq_moe_route(m, l, xn, len[s], k->probs, sel, k->wt + s * Lmax * K);
            int32_t *cnt = counts + ((s0 + s) * k->n_moe + k->moe_index[l]) * E;
            for (int64_t i = 0; i < len[s] * K; i++) cnt[sel[i]]++;
        }
        mq_state_drop_layer(k->state, l);
        if (!st && !last) {
            for (int64_t s = 0; s < g; s++) memset(k->out + s * LD, 0, sizeof(float) * (size_t)(len[s] * D));
            if (moe) {
                st = routed(k, l, len, g);
                if (!st && c->shared_ffn > 0 && !(st = load(k, l, MQ_PART_SHARED, 0, 0))) {
                    for (int64_t s = 0; s < g && !st; s++) {
                        st = mq_mlp_forward(&ly->sh_gate, &ly->sh_up, &ly->sh_down, k->xn + s * LD, len[s], gs, us, ys);
                        if (!st) mq_shared_expert_add(m, l, k->xn + s * LD, len[s], ys, sgate, k->out + s * LD);
                    }
                    mq_lazy_release(k->lz, l, MQ_PART_SHARED, 0, 0);
                }
            } else if (!(st = load(k, l, MQ_PART_MLP, 0, 0))) {
                for (int64_t s = 0; s < g && !st; s++)
                    st = mq_mlp_forward(&ly->gate, &ly->up, &ly->down, k->xn + s * LD, len[s], gs, us, k->out + s * LD);
                mq_lazy_release(k->lz, l, MQ_PART_MLP, 0, 0);
            }
            for (int64_t s = 0; s < g && !st; s++)   /* x += out, as the forward's residual */
                mq_vec()->axpy(1.0f, k->out + s * LD, k->x + s * LD, len[s] * D);
        }
        mq_lazy_release(k->lz, l, parts, 0, 0);
        if (!st && progress) progress(user, g);
    }
    return st;
}

/* ---- selection -------------------------------------------------------------------------- */

/* The objective's gain from adding candidate i's counts to the chosen ones' totals. */
static double gain_of(const int32_t *ci, const int64_t *tot, int64_t n) {
    double g = 0;
    for (int64_t j = 0; j < n; j++)
        if (ci[j]) g += log1p((double)(tot[j] + ci[j])) - log1p((double)tot[j]);
    return g;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

moeq_status mq_balance_select(const int32_t *counts, int64_t n, int64_t width, int64_t want,
                              int64_t *chosen) {
    if (want > n) want = n;
    int64_t *tot = calloc((size_t)(width > 0 ? width : 1), sizeof *tot);
    double *bound = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    uint8_t *state = calloc((size_t)(n > 0 ? n : 1), 1);   /* 0 stale, 1 fresh this round, 2 chosen */
    if (!tot || !bound || !state) {
        free(tot);
        free(bound);
        free(state);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    for (int64_t i = 0; i < n; i++) bound[i] = gain_of(counts + i * width, tot, width);
    for (int64_t pick = 0; pick < want; pick++) {
        for (int64_t i = 0; i < n; i++)
            if (state[i] == 1) state[i] = 0;
        for (;;) {
            int64_t best = -1;
            for (int64_t i = 0; i < n; i++)
                if (state[i] != 2 && (best < 0 || bound[i] > bound[best])) best = i;
            if (state[best] == 1) {   /* its gain is current and no other can beat it */
                state[best] = 2;
                chosen[pick] = best;
                const int32_t *cb = counts + best * width;
                for (int64_t j = 0; j < width; j++) tot[j] += cb[j];
                break;
            }
            bound[best] = gain_of(counts + best * width, tot, width);
            state[best] = 1;
        }
    }
    free(tot);
    free(bound);
    free(state);
    qsort(chosen, (size_t)want, sizeof *chosen, cmp_i64);   /* the samples keep the file's order */
    return MOEQ_OK;
}

/* ---- the pipeline's step ------------------------------------------------------------------ */

typedef struct {
    int64_t done, total;
} pass_progress;

static void on_layer(void *user, int64_t g) {
    pass_progress *pp = user;
    pp->done += g;
    mq_progress("balance calibration", pp->done, pp->total);
}

static moeq_status keep_first(mq_pipe *p, int64_t want) {
    int64_t n = want < p->calib.n ? want : p->calib.n;
    int64_t *idx = malloc(sizeof *idx * (size_t)(n > 0 ? n : 1));
    if (!idx) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int64_t i = 0; i < n; i++) idx[i] = i;
    moeq_status st = mq_calib_keep(&p->calib, idx, n);
    free(idx);
    return st;
}

/* The candidates' identity: their token ids, as the work directory's calibration hash. */
static uint32_t pool_crc(const mq_calib_set *s) {
    uint32_t c = 0;
    for (int64_t i = 0; i < s->n; i++) {
        c = mq_crc32(c, &s->len[i], sizeof s->len[i]);
        c = mq_crc32(c, s->ids[i], sizeof(int32_t) * (size_t)s->len[i]);
    }
    return c;
}

static char *record_text(const mq_calib_set *pool, int64_t want, const int64_t *chosen, const int64_t st[4]) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "candidates", (double)pool->n);
    cJSON_AddNumberToObject(j, "candidates_crc", (double)pool_crc(pool));
    cJSON_AddNumberToObject(j, "samples", (double)want);
    cJSON *a = cJSON_AddArrayToObject(j, "chosen");
    for (int64_t i = 0; i < want; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((double)chosen[i]));
    cJSON *s = cJSON_AddArrayToObject(j, "stats");   /* under, under, fewest, fewest */
    for (int i = 0; i < 4; i++) cJSON_AddItemToArray(s, cJSON_CreateNumber((double)st[i]));
    char *t = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    return t;
}

/* The choice an interrupted run kept in its work directory, when it was made from these
 * candidates for this many samples. */
static bool record_read(const mq_pipe *p, int64_t want, int64_t *chosen, int64_t st[4]) {
    const mq_pipeline_opts *o = p->o;
    char *dir = o->work_dir ? mq_strdup(o->work_dir) : mq_asprintf("%s.moeq-work", p->out_dir);
    char *path = dir ? mq_path_join(dir, MQ_BALANCE_RECORD) : NULL, *text = NULL;
    size_t len = 0;
    bool ok = false;
    if (path && mq_read_file(path, &text, &len) == MOEQ_OK) {
        cJSON *j = cJSON_ParseWithLength(text, len);
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "chosen"), *s = cJSON_GetObjectItemCaseSensitive(j, "stats");
        const cJSON *nc = cJSON_GetObjectItemCaseSensitive(j, "candidates"),
                    *crc = cJSON_GetObjectItemCaseSensitive(j, "candidates_crc"),
                    *ns = cJSON_GetObjectItemCaseSensitive(j, "samples");
        int64_t v_nc = -1, v_crc = -1, v_ns = -1;   /* a record's numbers are checked before any cast */
        ok = cJSON_IsArray(a) && cJSON_IsArray(s) && cJSON_IsNumber(nc) && cJSON_IsNumber(crc) &&
             cJSON_IsNumber(ns) && mq_int_of(nc->valuedouble, 0, INT64_MAX, &v_nc) && v_nc == p->calib.n &&
             mq_int_of(crc->valuedouble, 0, UINT32_MAX, &v_crc) && (uint32_t)v_crc == pool_crc(&p->calib) &&
             mq_int_of(ns->valuedouble, 0, INT64_MAX, &v_ns) && v_ns == want &&
             cJSON_GetArraySize(a) == want && cJSON_GetArraySize(s) == 4;
        for (int64_t i = 0; ok && i < want; i++) {
            const cJSON *c = cJSON_GetArrayItem(a, (int)i);
            ok = cJSON_IsNumber(c) && mq_int_of(c->valuedouble, i ? chosen[i - 1] + 1 : 0, p->calib.n - 1, &chosen[i]);
        }
        for (int i = 0; ok && i < 4; i++) {
            const cJSON *c = cJSON_GetArrayItem(s, i);
            ok = cJSON_IsNumber(c) && mq_int_of(c->valuedouble, 0, INT64_MAX, &st[i]);
        }
        cJSON_Delete(j);
        if (!ok) mq_info("%s: not this run's calibration choice; choosing again", path);
    }
    free(text);
    free(path);
    free(dir);
    return ok;
}

/* Over the MoE layers and experts: how many got fewer than `few` tokens from the samples
 * idx[0..n), and the fewest any got. */
static void starved(const int32_t *counts, int64_t width, const int64_t *idx, int64_t n, int64_t few,
                    int64_t *under, int64_t *least) {
    *under = 0;
    *least = INT64_MAX;
    for (int64_t j = 0; j < width; j++) {
        int64_t t = 0;
        for (int64_t i = 0; i < n; i++) t += counts[idx[i] * width + j];
        *under += t < few;
        if (t < *least) *least = t;
    }
}

/* The pass over the candidates (this rank's share; the counts then go to every rank) and the
 * greedy choice; stats: experts under min_expert_tokens from the first and the chosen samples,
 * the fewest tokens of both. */
static moeq_status choose(mq_pipe *p, int64_t want, int64_t *chosen, int64_t stats[4]) {
    const mq_pipeline_opts *o = p->o;
    const mq_config *c = p->c;
    const int64_t n = p->calib.n, Lmax = p->calib.max_len, K = c->top_k;
    /* groups of samples whose buffers (activations, FFN inputs and outputs, routing) fit in the
     * budget beside the largest layer's weights as the pass loads them, the attention state and
     * the scratch: the pass needs no Hessians, factors or codes */
    const int64_t per_sample = Lmax * c->D * 4 * 3 + Lmax * K * 16;
    const int chunk = p->mp.chunk > 0 ? p->mp.chunk : (int)c->n_experts;
    int64_t weights = 0;
    for (int l = 0; l < c->n_layers; l++) {
        int64_t a = mq_lazy_bytes(p->lz, l, MQ_PART_ATTN | MQ_PART_FFN_NORM | MQ_PART_ROUTER, 0, 0);
        int64_t e = mq_lazy_bytes(p->lz, l, MQ_PART_EXPERTS, 0, chunk < c->n_experts ? chunk : (int)c->n_experts),
                f = mq_lazy_bytes(p->lz, l, MQ_PART_SHARED | MQ_PART_MLP, 0, 0);
        if (a + (e > f ? e : f) > weights) weights = a + (e > f ? e : f);
    }
    const int64_t F = c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn;
    const int64_t fixed = weights + p->mp.state + (64 << 20) +
                          4 * ((int64_t)mq_pool_size() * MQ_MOE_ROWS * (2 * c->D + 2 * c->moe_ffn) +
                               Lmax * (2 * F + c->D + 1 + c->n_experts));
    int64_t G = (p->mp.budget - fixed) / per_sample;
    G = G < 1 ? 1 : G > want ? want : G;
    int64_t lo = 0, hi = n;
    if (p->ranks > 1) mq_dist_share(n, p->rank, p->ranks, &lo, &hi);
    if (G > hi - lo) G = hi - lo > 0 ? hi - lo : 1;
    mq_balance_counter k;
    int64_t width = 0;
    int32_t *counts = NULL;
    int64_t *first = malloc(sizeof *first * (size_t)want);
    moeq_status st = first ? mq_balance_counter_init(&k, p->lz, G, Lmax, p->mp.chunk) : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!st) {
        width = (int64_t)k.n_moe * c->n_experts;
        counts = calloc((size_t)(n * width), sizeof *counts);
        if (!counts) st = mq_err(MOEQ_E_NOMEM, "out of memory for the expert counts of %lld samples", (long long)n);
        mq_info("balancing the calibration set across experts: %lld candidate samples (%lld tokens) through "
                "the unquantized model in groups of %lld (%.2f GB with the weights), to choose %lld", (long long)n,
                (long long)p->calib.total, (long long)G, (double)(fixed + G * per_sample) / 1e9, (long long)want);
        pass_progress pp = {0, (hi - lo) * (k.last_moe + 1)};
        for (int64_t s0 = lo; s0 < hi && !st; s0 += G)
            st = mq_balance_count_group(&k, &p->calib, s0, hi - s0 < G ? hi - s0 : G, counts, on_layer, &pp);
        mq_balance_counter_free(&k);
    }
    for (int r = 0; r < p->ranks && p->ranks > 1; r++) {   /* every rank's counts to every rank */
        if ((st = mq_dist_agree(st, "the calibration balance"))) break;
        int64_t a, b;
        mq_dist_share(n, r, p->ranks, &a, &b);
        st = mq_dist_bcast(counts + a * width, sizeof *counts * (size_t)((b - a) * width), r,
                           "the calibration balance");
    }
    if (!st) st = mq_balance_select(counts, n, width, want, chosen);
    if (!st) {
        for (int64_t i = 0; i < want; i++) first[i] = i;
        starved(counts, width, first, want, o->min_expert_tokens, &stats[0], &stats[2]);
        starved(counts, width, chosen, want, o->min_expert_tokens, &stats[1], &stats[3]);
    }
    free(counts);
    free(first);
    return st;
}

moeq_status mq_pipe_balance(mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    const mq_config *c = p->c;
    const int64_t want = o->calib.nsamples, n = p->calib.n;
    if (c->n_experts == 0) {
        mq_warn("--calib-balance experts: %s has no routed experts; the first %lld samples are used",
                p->model_dir, (long long)want);
        return keep_first(p, want);
    }
    if (n <= want) {
        mq_info("--calib-balance experts: %s gives %lld candidate samples, no more than the %lld wanted: all "
                "are used", o->calib.path, (long long)n, (long long)want);
        return MOEQ_OK;
    }
    if (o->device >= 0)   /* the pass has no GPU twin yet: say what it costs there */
        mq_warn("--calib-balance experts: the candidates' forward runs on the CPU, not on cuda:%d (about "
                "%.1f times one calibration forward of the chosen samples, at the CPU's speed)", o->device,
                (double)n / (double)want);
    /* the plan of the run that follows (the shape of `want` samples): this pass holds no more
     * than its activations and routing, and loads experts as it does */
    const int64_t all_tokens = p->calib.total;
    int64_t first_tokens = 0;
    for (int64_t i = 0; i < want; i++) first_tokens += p->calib.len[i];
    p->calib.n = want;
    p->calib.total = first_tokens;
    moeq_status st = mq_plan_memory(p);
    p->calib.n = n;
    p->calib.total = all_tokens;
    p->progress.total = 0;
    memset(&p->mp_units, 0, sizeof p->mp_units);
    if (st) return st;
    if (o->dry_run) {
        mq_info("--calib-balance experts: the run first streams %lld candidate samples through the "
                "unquantized model to choose %lld (about %.1f times one calibration forward)",
                (long long)n, (long long)want, (double)all_tokens / (double)first_tokens);
        return keep_first(p, want);
    }
    const double t0 = mq_now();
    int64_t *chosen = malloc(sizeof *chosen * (size_t)want), stats[4] = {0};
    if (!chosen) return mq_err(MOEQ_E_NOMEM, "out of memory");
    int32_t have = o->resume && p->rank == 0 && record_read(p, want, chosen, stats);
    if (p->ranks > 1) {   /* rank 0's record (only it has the work directory) */
        st = mq_dist_bcast(&have, sizeof have, 0, "the calibration balance");
        if (!st && have) st = mq_dist_bcast(chosen, sizeof *chosen * (size_t)want, 0, "the calibration balance");
        if (!st && have) st = mq_dist_bcast(stats, sizeof stats, 0, "the calibration balance");
    }
    if (!st && have)
        mq_info("the calibration samples the interrupted run chose across experts (%s in its work directory)",
                MQ_BALANCE_RECORD);
    else if (!st)
        st = choose(p, want, chosen, stats);
    if (!st) {
        int64_t tok = 0;
        for (int64_t i = 0; i < want; i++) tok += p->calib.len[chosen[i]];
        p->res->balance_pool = n;
        p->res->balance_under[0] = stats[0];
        p->res->balance_under[1] = stats[1];
        p->res->balance_least[0] = stats[2];
        p->res->balance_least[1] = stats[3];
        p->res->balance_seconds = mq_now() - t0;
        mq_info("calibration balanced across experts in %.1f s: %lld of %lld candidates (%lld tokens); experts "
                "with fewer than %lld tokens %lld -> %lld, the fewest tokens %lld -> %lld (against the first "
                "%lld samples)", p->res->balance_seconds, (long long)want, (long long)n, (long long)tok,
                (long long)o->min_expert_tokens, (long long)stats[0], (long long)stats[1], (long long)stats[2],
                (long long)stats[3], (long long)want);
        free(p->balance_record);
        p->balance_record = record_text(&p->calib, want, chosen, stats);
        if (!p->balance_record) st = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    if (!st) st = mq_calib_keep(&p->calib, chosen, want);
    free(chosen);
    return st;
}
