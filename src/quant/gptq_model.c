/*
 * GPTQ over a whole model (see gptq_model.h): the layer-by-layer calibration loop of
 * IST-DASLab's gptq (llama.py: inputs of block l cached, Hessians from hooks, block quantized,
 * inputs re-run through the quantized block) extended to MoE: one Hessian per routed expert from
 * exactly its routed tokens, fused NVFP4 global scales, a fallback for experts without
 * calibration tokens, and every weight of a block in one parallel GPTQ run.
 */
#include "quant/gptq_model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void mq_gptq_model_opts_init(mq_gptq_model_opts *o, const mq_qspec *spec) {
    memset(o, 0, sizeof *o);
    o->spec = *spec;
    o->spec.mse = true;
    o->gptq = mq_gptq_opts_default();
    o->gptq.act_order = spec->scheme == MQ_QS_INT4;
    /* the scale search scores candidates by running GPTQ over the group (docs/gptq_results.md:
     * lower KL in three of four cases, equal in the fourth); with one group per row that would
     * be GPTQ over whole rows once per candidate, so those keep the plain squared error */
    o->gptq.mse_weight = spec->group_size > 0 ? MQ_GPTQ_MSE_LOOP : MQ_GPTQ_MSE_PLAIN;
    o->mode = MQ_GPTQ_SEQUENTIAL;
    o->min_expert_tokens = 32;
    o->fallback = MQ_FALLBACK_BLOCK;
}

const char *mq_gptq_how_name(mq_gptq_how h) {
    switch (h) {
    case MQ_HOW_GPTQ: return "gptq";
    case MQ_HOW_GPTQ_BLOCK_HESSIAN: return "gptq-block-hessian";
    default: return "rtn";
    }
}

void mq_gptq_results_free(mq_gptq_results *r) {
    if (!r) return;
    for (int64_t i = 0; i < r->n; i++) {
        free(r->r[i].module);
        mq_qtensor_free(&r->r[i].q);
    }
    free(r->r);
    memset(r, 0, sizeof *r);
}

mq_gptq_result *mq_gptq_results_find(const mq_gptq_results *r, const char *module) {
    for (int64_t i = 0; i < r->n; i++)
        if (strcmp(r->r[i].module, module) == 0) return &r->r[i];
    return NULL;
}

static moeq_status results_reserve(mq_gptq_results *r, int64_t more) {
    if (r->n + more <= r->cap) return MOEQ_OK;
    int64_t cap = r->cap ? r->cap : 64;
    while (cap < r->n + more) cap *= 2;
    mq_gptq_result *v = realloc(r->r, (size_t)cap * sizeof *v);
    if (!v) return mq_err(MOEQ_E_NOMEM, "out of memory for GPTQ results");
    r->r = v;
    r->cap = cap;
    return MOEQ_OK;
}

static mq_gptq_result *results_add(mq_gptq_results *r, const char *module, int layer, int expert) {
    if (results_reserve(r, 1)) return NULL;
    mq_gptq_result *x = &r->r[r->n];
    memset(x, 0, sizeof *x);
    x->module = mq_strdup(module);
    if (!x->module) {
        mq_err(MOEQ_E_NOMEM, "out of memory for GPTQ results");
        return NULL;
    }
    x->layer = layer;
    x->expert = expert;
    r->n++;
    return x;
}

/* ---- one block ---------------------------------------------------------------------------- */

/* The Linears that read one input, and that input's Hessian. */
typedef struct {
    mq_site site;
    int expert;                  /* routed expert, else -1 */
    mq_linear *w[3];
    int nw;                      /* wanted weights */
    mq_hessian h;
    int64_t pend_rows;           /* rows of a deferred update waiting in the block's arena (0: none) */
    size_t pend_off;
    /* filled when quantizing */
    mq_gptq_how how;
    float *H;                    /* [K, K] the Hessian used (NULL for RTN) */
    int64_t tokens;
    float gs;                    /* NVFP4 global scale of its weights (fused) */
} slot;

typedef struct {
    moeq_model *m;
    const mq_gptq_model_opts *o;
    int layer;
    slot *slots;
    int n_slots;
    int site_slot[MQ_SITE_COUNT];   /* non-expert sites; -1 when absent */
    int expert0, down0;             /* slot of EXPERT 0 / EXPERT_DOWN 0; -1 when dense */
    int phase;                      /* -1: every slot; 0: attention only; 1: the rest */
    float *ffn_in;                  /* [samples][max_len][D] MoE block input (fallback), or NULL */
    int64_t max_len;
    int64_t sample;                 /* sample being run */
    const float *x_in;              /* its block input */
    double t_hessian;
    float *arena;                   /* copies of captured inputs whose Hessian update is deferred */
    size_t arena_cap, arena_used;   /* floats */
} block_ctx;

static void block_free(block_ctx *b) {
    for (int i = 0; i < b->n_slots; i++) {
        mq_hessian_free(&b->slots[i].h);
        mq_free(b->slots[i].H);
    }
    free(b->slots);
    free(b->arena);
    b->arena = NULL;
    b->arena_cap = b->arena_used = 0;
    mq_free(b->ffn_in);
    b->slots = NULL;
    b->ffn_in = NULL;
    b->n_slots = 0;
}

/* Whether the slot belongs to the block's current phase (true-sequential: attention first). */
static bool in_phase(const block_ctx *b, const slot *s) {
    bool attn = s->site == MQ_SITE_QKV || s->site == MQ_SITE_O;
    return b->phase < 0 || attn == (b->phase == 0);
}

static bool wanted(const mq_gptq_model_opts *o, const mq_linear *l) {
    return l->w && (!o->want || o->want(o->want_user, l->name));
}

static int slot_add(block_ctx *b, mq_site site, int expert, mq_linear *w0, mq_linear *w1,
                    mq_linear *w2) {
    slot *s = &b->slots[b->n_slots];
    memset(s, 0, sizeof *s);
    s->site = site;
    s->expert = expert;
    mq_linear *ws[3] = {w0, w1, w2};
    for (int i = 0; i < 3; i++)
        if (ws[i] && wanted(b->o, ws[i])) s->w[s->nw++] = ws[i];
    return b->n_slots++;
}

static moeq_status block_init(block_ctx *b, moeq_model *m, const mq_gptq_model_opts *o, int l,
                              const mq_calib_set *calib) {
    memset(b, 0, sizeof *b);
    b->m = m;
    b->o = o;
    b->layer = l;
    b->expert0 = b->down0 = -1;
    b->phase = -1;
    for (int i = 0; i < MQ_SITE_COUNT; i++) b->site_slot[i] = -1;
    mq_layer *ly = &m->layers[l];
    const mq_config *c = &m->cfg;
    int E = ly->is_moe ? c->n_experts : 0;
    b->slots = calloc((size_t)(6 + 2 * E), sizeof *b->slots);
    if (!b->slots) return mq_err(MOEQ_E_NOMEM, "out of memory for block %d", l);
    b->site_slot[MQ_SITE_QKV] = slot_add(b, MQ_SITE_QKV, -1, &ly->q, &ly->k, &ly->v);
    b->site_slot[MQ_SITE_O] = slot_add(b, MQ_SITE_O, -1, &ly->o, NULL, NULL);
    if (ly->is_moe) {
        b->expert0 = b->n_slots;
        for (int e = 0; e < E; e++) slot_add(b, MQ_SITE_EXPERT, e, &ly->exp_gate[e], &ly->exp_up[e], NULL);
        b->down0 = b->n_slots;
        for (int e = 0; e < E; e++) slot_add(b, MQ_SITE_EXPERT_DOWN, e, &ly->exp_down[e], NULL, NULL);
        if (c->shared_ffn > 0) {
            b->site_slot[MQ_SITE_SHARED] = slot_add(b, MQ_SITE_SHARED, -1, &ly->sh_gate, &ly->sh_up, NULL);
            b->site_slot[MQ_SITE_SHARED_DOWN] = slot_add(b, MQ_SITE_SHARED_DOWN, -1, &ly->sh_down, NULL, NULL);
        }
    } else {
        b->site_slot[MQ_SITE_MLP] = slot_add(b, MQ_SITE_MLP, -1, &ly->gate, &ly->up, NULL);
        b->site_slot[MQ_SITE_MLP_DOWN] = slot_add(b, MQ_SITE_MLP_DOWN, -1, &ly->down, NULL, NULL);
    }
    moeq_status st = MOEQ_OK;
    bool any_expert = false;
    for (int i = 0; i < b->n_slots && !st; i++) {
        slot *s = &b->slots[i];
        if (!s->nw) continue;
        char what[96];
        snprintf(what, sizeof what, "Hessian of %s", s->w[0]->name);
        st = mq_hessian_init(&s->h, s->w[0]->in, what);
        any_expert |= s->expert >= 0;
    }
    if (!st && any_expert && o->fallback == MQ_FALLBACK_BLOCK && o->min_expert_tokens > 0) {
        b->max_len = calib->max_len;
        b->ffn_in = mq_alloc_array((size_t)(calib->n * calib->max_len), (size_t)c->D * sizeof(float),
                                   "MoE block inputs for the expert fallback");
        if (!b->ffn_in) st = MOEQ_E_NOMEM;
    }
    if (st) block_free(b);
    return st;
}

static void rmsnorm_rows(float *x, int64_t rows, int64_t n, const float *w, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) xr[i] = w[i] * (xr[i] * inv);
    }
}

/* Hessian updates run together on the pool once the layer's forward is done (flush_updates):
 * the hook copies its borrowed input, and every Hessian still gets the same one ssyrk call per
 * sample, in sample order, so the sums are bit for bit those of updating inside the hook, while
 * q/k/v, o and all the experts' Hessians update in parallel. */
static void update_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    block_ctx *b = ctx;
    slot *s = &b->slots[task];
    if (s->pend_rows) mq_hessian_add(&s->h, b->arena + s->pend_off, s->pend_rows);
}

static void flush_updates(block_ctx *b) {
    if (!b->arena_used) return;
    double t0 = mq_now();
    mq_parallel_for(b->n_slots, update_task, b);
    for (int i = 0; i < b->n_slots; i++) b->slots[i].pend_rows = 0;
    b->arena_used = 0;
    b->t_hessian += mq_now() - t0;
}

/* Queues x [rows, K] for slot s's Hessian; false when out of memory (update it now instead). */
static bool defer_update(block_ctx *b, slot *s, const float *x, int64_t rows) {
    size_t n = (size_t)rows * (size_t)s->h.K;
    if (b->arena_used + n > b->arena_cap) {
        size_t cap = 2 * (b->arena_used + n);
        float *a = realloc(b->arena, cap * sizeof(float));
        if (!a) return false;
        b->arena = a;
        b->arena_cap = cap;
    }
    memcpy(b->arena + b->arena_used, x, n * sizeof(float));
    s->pend_off = b->arena_used;
    s->pend_rows = rows;
    b->arena_used += n;
    return true;
}

static void on_capture(void *user, int layer, mq_site site, int expert, const float *x,
                       int64_t rows, int64_t cols) {
    block_ctx *b = user;
    if (layer != b->layer) return;
    int i = site == MQ_SITE_EXPERT        ? (b->expert0 >= 0 ? b->expert0 + expert : -1)
            : site == MQ_SITE_EXPERT_DOWN ? (b->down0 >= 0 ? b->down0 + expert : -1)
                                          : b->site_slot[site];
    slot *s = i >= 0 && b->slots[i].nw && in_phase(b, &b->slots[i]) ? &b->slots[i] : NULL;
    if (s && s->pend_rows) flush_updates(b);   /* one waiting update per Hessian keeps the order */
    double t0 = mq_now();
    if (s && rows > 0) {
        MQ_ASSERT(cols == s->h.K);
        if (!defer_update(b, s, x, rows)) mq_hessian_add(&s->h, x, rows);
    }
    if (site == MQ_SITE_O && b->ffn_in && b->phase != 0) {
        /* the MoE block input of every token: RMSNorm(x_in + o_proj(attention)) */
        const mq_layer *ly = &b->m->layers[layer];
        const int64_t D = b->m->cfg.D;
        float *f = b->ffn_in + b->sample * b->max_len * D;
        mq_linear_forward(&ly->o, x, rows, f);
        for (int64_t k = 0; k < rows * D; k++) f[k] += b->x_in[k];
        rmsnorm_rows(f, rows, D, ly->ffn_norm, b->m->cfg.rms_eps);
    }
    b->t_hessian += mq_now() - t0;
}

/* Hessian of expert e's down input if every block token had been routed to it, from the first
 * FALLBACK_TOKENS tokens (a fallback needs the shape of the distribution, not every token). */
enum { FALLBACK_TOKENS = 8192 };
static moeq_status fallback_down_hessian(block_ctx *b, int e, const mq_calib_set *calib,
                                         mq_hessian *h) {
    const mq_layer *ly = &b->m->layers[b->layer];
    const int64_t D = b->m->cfg.D, F = ly->exp_gate[e].out;
    float *g = mq_alloc_array((size_t)(b->max_len * F), sizeof(float), "fallback activations");
    float *u = mq_alloc_array((size_t)(b->max_len * F), sizeof(float), "fallback activations");
    if (!g || !u) {
        mq_free(g);
        mq_free(u);
        return MOEQ_E_NOMEM;
    }
    for (int64_t s = 0, used = 0; s < calib->n && used < FALLBACK_TOKENS; s++) {
        const float *x = b->ffn_in + s * b->max_len * D;
        int64_t T = calib->len[s];
        used += T;
        mq_linear_forward(&ly->exp_gate[e], x, T, g);
        mq_linear_forward(&ly->exp_up[e], x, T, u);
        for (int64_t k = 0; k < T * F; k++) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
        mq_hessian_add(h, g, T);
    }
    mq_free(g);
    mq_free(u);
    return MOEQ_OK;
}

/* Decides how each slot is quantized and forms its Hessian. */
static moeq_status block_hessians(block_ctx *b, const mq_calib_set *calib) {
    const mq_gptq_model_opts *o = b->o;
    mq_hessian block_in = {0};
    moeq_status st = MOEQ_OK;
    bool need_block = false;
    for (int i = 0; i < b->n_slots; i++) {
        slot *s = &b->slots[i];
        if (!s->nw || !in_phase(b, s)) continue;
        s->tokens = s->expert >= 0 ? b->slots[b->expert0 + s->expert].h.n : s->h.n;
        s->how = MQ_HOW_GPTQ;
        if (s->expert >= 0 && s->tokens < o->min_expert_tokens)
            s->how = o->fallback == MQ_FALLBACK_RTN ? MQ_HOW_RTN : MQ_HOW_GPTQ_BLOCK_HESSIAN;
        need_block |= s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && s->site == MQ_SITE_EXPERT;
    }
    if (need_block) {   /* every token reaches top_k experts: the sum over experts is top_k x it */
        st = mq_hessian_init(&block_in, b->m->cfg.D, "MoE block Hessian");
        for (int e = 0; !st && e < b->m->cfg.n_experts; e++)
            if (b->slots[b->expert0 + e].nw) mq_hessian_merge(&block_in, &b->slots[b->expert0 + e].h);
    }
    for (int i = 0; i < b->n_slots && !st; i++) {
        slot *s = &b->slots[i];
        if (!s->nw || !in_phase(b, s) || s->how == MQ_HOW_RTN) continue;
        const int64_t K = s->h.K;
        const mq_hessian *src = &s->h;
        mq_hessian tmp = {0};
        if (s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN) {
            if (s->site == MQ_SITE_EXPERT) {
                src = &block_in;
            } else {
                if ((st = mq_hessian_init(&tmp, K, "fallback down Hessian"))) break;
                st = fallback_down_hessian(b, s->expert, calib, &tmp);
                src = &tmp;
            }
        }
        s->H = st ? NULL : mq_alloc_array((size_t)(K * K), sizeof(float), "GPTQ Hessian");
        if (!st && !s->H) st = MOEQ_E_NOMEM;
        if (!st) mq_hessian_get(src, s->H);
        mq_hessian_free(&tmp);
    }
    mq_hessian_free(&block_in);
    for (int i = 0; i < b->n_slots; i++)   /* sums done */
        if (in_phase(b, &b->slots[i])) mq_hessian_free(&b->slots[i].h);
    return st;
}

/* Factorises, quantizes every weight of the block in one run, writes the dequantized weights
 * back into the model and records the results. */
static moeq_status block_quantize(block_ctx *b, mq_gptq_results *res) {
    const mq_gptq_model_opts *o = b->o;
    moeq_status st = MOEQ_OK;
    int n = b->n_slots, n_jobs = 0;
    const float **Hs = calloc((size_t)n, sizeof *Hs);
    int64_t *Ks = calloc((size_t)n, sizeof *Ks);
    const char **names = calloc((size_t)n, sizeof *names);
    mq_gptq_factor *f = calloc((size_t)n, sizeof *f);
    mq_gptq_job *jobs = calloc((size_t)(3 * n), sizeof *jobs);
    int64_t *job_res = calloc((size_t)(3 * n), sizeof *job_res);
    if (!Hs || !Ks || !names || !f || !jobs || !job_res) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory quantizing block %d", b->layer);
        goto done;
    }
    for (int i = 0; i < n; i++) {
        slot *s = &b->slots[i];
        if (!s->nw || !in_phase(b, s)) continue;
        Hs[i] = s->how == MQ_HOW_RTN ? NULL : s->H;
        Ks[i] = s->w[0]->in;
        names[i] = s->w[0]->name;
        float amax = 0;
        for (int k = 0; k < s->nw; k++) amax = fmaxf(amax, mq_absmax(s->w[k]->w, s->w[k]->out * s->w[k]->in));
        s->gs = mq_nvfp4_global_scale(&o->spec, amax);
    }
    if ((st = mq_gptq_factor_many(Hs, Ks, n, &o->gptq, o->gptq.rtn_loss, names, f))) goto done;
    /* the jobs point at results: no reallocation of res->r from here on */
    int64_t first = res->n, count = 0;
    for (int i = 0; i < n; i++) count += in_phase(b, &b->slots[i]) ? b->slots[i].nw : 0;
    if ((st = results_reserve(res, count))) goto done;
    for (int i = 0; i < n && !st; i++) {
        slot *s = &b->slots[i];
        for (int k = 0; k < s->nw && in_phase(b, s) && !st; k++) {
            mq_linear *l = s->w[k];
            mq_gptq_result *r = results_add(res, l->name, b->layer, s->expert);
            if (!r) {
                st = MOEQ_E_NOMEM;
                break;
            }
            r->tokens = s->tokens;
            r->how = s->how;
            float gs = o->no_fuse ? mq_nvfp4_global_scale(&o->spec, mq_absmax(l->w, l->out * l->in)) : s->gs;
            if (s->how == MQ_HOW_RTN) {
                double t0 = mq_now();
                st = mq_quantize_rtn(&o->spec, l->w, l->out, l->in, gs, l->name, &r->q);
                r->stats = (mq_gptq_stats){NAN, NAN, 0, 0, mq_now() - t0};
                continue;
            }
            job_res[n_jobs] = res->n - 1;
            jobs[n_jobs++] = (mq_gptq_job){&f[i], l->w, l->out, gs, l->name, &r->q, NULL, {0, 0, 0, 0, 0}};
        }
    }
    if (st) goto done;
    if ((st = mq_gptq_run(&o->spec, &o->gptq, jobs, n_jobs))) goto done;
    for (int j = 0; j < n_jobs; j++) res->r[job_res[j]].stats = jobs[j].stats;
    /* the model continues with the quantized weights (results are in slot order) */
    for (int i = 0, k2 = 0; i < n; i++)
        for (int k = 0; k < b->slots[i].nw && in_phase(b, &b->slots[i]); k++, k2++)
            mq_dequantize(&res->r[first + k2].q, b->slots[i].w[k]->w);
done:
    for (int i = 0; f && i < n; i++) mq_gptq_factor_free(&f[i]);
    free(Hs);
    free(Ks);
    free(names);
    free(f);
    free(jobs);
    free(job_res);
    return st;
}

/* ---- the model loop ------------------------------------------------------------------------- */

moeq_status mq_gptq_model(moeq_model *m, const mq_calib_set *calib, const mq_gptq_model_opts *o,
                          mq_gptq_results *out) {
    memset(out, 0, sizeof *out);
    const mq_config *c = &m->cfg;
    const int64_t D = c->D, S = calib->n, Lmax = calib->max_len;
    if (S <= 0) return mq_err(MOEQ_E_ARG, "GPTQ needs calibration samples");
    if (o->spec.scheme != MQ_QS_NVFP4 && o->spec.scheme != MQ_QS_INT4 && o->spec.scheme != MQ_QS_MXFP4)
        return mq_err(MOEQ_E_ARG, "GPTQ: no quantization scheme");
    double t_start = mq_now();
    mq_state *state = NULL;
    float *X = mq_alloc_array((size_t)(S * Lmax), (size_t)D * sizeof(float), "calibration activations");
    float *xt = mq_alloc_array((size_t)Lmax, (size_t)D * sizeof(float), "calibration activations");
    moeq_status st = X && xt ? MOEQ_OK : MOEQ_E_NOMEM;
    if (!st) st = mq_state_new(m, (int32_t)Lmax, &state);
    /* block inputs of block 0: the embeddings */
    for (int64_t s = 0; s < S && !st; s++) st = mq_embed(m, calib->ids[s], calib->len[s], X + s * Lmax * D);
    out->samples = S;
    out->tokens = calib->total;
    const bool seq = o->mode == MQ_GPTQ_SEQUENTIAL;
    const int phases = seq && o->true_sequential ? 2 : 1;
    /* progress units: one per sample forward, and a block's GPTQ weighted like a quarter pass */
    const int64_t quant_units = S / 4 + 1, per_layer = (S + quant_units) * phases + (seq ? S : 0);
    const int64_t total = per_layer * c->n_layers;
    int64_t done_units = 0;
    for (int l = 0; l < c->n_layers && !st; l++) {
        block_ctx b;
        if ((st = block_init(&b, m, o, l, calib))) break;
        mq_hooks hooks = {on_capture, &b};
        for (int ph = 0; ph < phases && !st; ph++) {
            b.phase = phases == 1 ? -1 : ph;
            b.t_hessian = 0;
            double t0 = mq_now();
            /* 1. capture: the block on its inputs (a copy: the inputs are needed again) */
            for (int64_t s = 0; s < S && !st; s++) {
                if (moeq_interrupted()) {
                    st = mq_err(MOEQ_E_INTERRUPTED, "GPTQ interrupted");
                    break;
                }
                float *x = X + s * Lmax * D;
                memcpy(xt, x, (size_t)(calib->len[s] * D) * sizeof(float));
                b.sample = s;
                b.x_in = x;
                st = mq_forward_layers(m, state, xt, calib->len[s], 0, l, l + 1, &hooks);
                flush_updates(&b);
                if (!seq) memcpy(x, xt, (size_t)(calib->len[s] * D) * sizeof(float));
                mq_progress("gptq", ++done_units, total);
            }
            double t1 = mq_now();
            /* 2. Hessians, fallbacks, GPTQ for every weight of the block (or of the phase) */
            if (!st) st = block_hessians(&b, calib);
            mq_gptq_model_opts ol = *o;   /* progress over this block's GPTQ tasks */
            ol.gptq.progress_label = "gptq";
            ol.gptq.progress_base = done_units;
            ol.gptq.progress_span = quant_units;
            ol.gptq.progress_total = total;
            b.o = &ol;
            if (!st) st = block_quantize(&b, out);
            b.o = o;
            done_units += quant_units;
            mq_progress("gptq", done_units, total);
            out->seconds_hessian += b.t_hessian;
            out->seconds_forward += (t1 - t0) - b.t_hessian;
            out->seconds_gptq += mq_now() - t1;
        }
        block_free(&b);
        double t2 = mq_now();
        /* 3. sequential: the next block's inputs from the quantized block */
        for (int64_t s = 0; seq && s < S && !st; s++) {
            if (moeq_interrupted()) {
                st = mq_err(MOEQ_E_INTERRUPTED, "GPTQ interrupted");
                break;
            }
            st = mq_forward_layers(m, state, X + s * Lmax * D, calib->len[s], 0, l, l + 1, NULL);
            mq_progress("gptq", ++done_units, total);
        }
        out->seconds_forward += mq_now() - t2;
    }
    mq_state_free(state);
    mq_free(X);
    mq_free(xt);
    out->seconds_total = mq_now() - t_start;
    if (st) mq_gptq_results_free(out);
    return st;
}

/* ---- export and report ---------------------------------------------------------------------- */

moeq_status mq_gptq_take(void *user, const char *module, const float *w, int64_t rows,
                         int64_t cols, const mq_qspec *spec, float global_scale, mq_qtensor *out) {
    (void)w;
    mq_gptq_result *r = mq_gptq_results_find(user, module);
    if (!r || !r->q.codes)
        return mq_err(MOEQ_E_NOTFOUND, "%s: no GPTQ result for this module", module);
    if (r->q.rows != rows || r->q.cols != cols)
        return mq_err(MOEQ_E_SHAPE, "%s: GPTQ result is [%lld, %lld], the checkpoint [%lld, %lld]",
                      module, (long long)r->q.rows, (long long)r->q.cols, (long long)rows,
                      (long long)cols);
    if (r->q.spec.scheme != spec->scheme || r->q.group_size != mq_qspec_group(spec, cols))
        return mq_err(MOEQ_E_ARG, "%s: GPTQ result has another scheme or group size", module);
    if (spec->scheme == MQ_QS_NVFP4 && r->q.global_scale != global_scale)
        return mq_err(MOEQ_E_ARG, "%s: GPTQ used the NVFP4 global scale %.9g, the writer wants %.9g",
                      module, (double)r->q.global_scale, (double)global_scale);
    *out = r->q;
    memset(&r->q, 0, sizeof r->q);
    return MOEQ_OK;
}

static void json_num(cJSON *o, const char *k, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, k, v);
    else cJSON_AddNullToObject(o, k);
}

moeq_status mq_gptq_report_write(const mq_gptq_results *r, const mq_gptq_model_opts *o,
                                 const mq_calib_opts *calib, const char *path) {
    cJSON *j = cJSON_CreateObject();
    cJSON *set = cJSON_AddObjectToObject(j, "settings");
    cJSON_AddStringToObject(set, "scheme", mq_qscheme_name(o->spec.scheme));
    cJSON_AddNumberToObject(set, "group_size", o->spec.group_size);
    cJSON_AddBoolToObject(set, "mse", o->spec.mse);
    if (o->spec.mse)
        cJSON_AddStringToObject(set, "mse_weight", o->gptq.mse_weight == MQ_GPTQ_MSE_HDIAG ? "hessian"
                                                   : o->gptq.mse_weight == MQ_GPTQ_MSE_OBQ ? "obq"
                                                   : o->gptq.mse_weight == MQ_GPTQ_MSE_LOOP ? "gptq"
                                                                                          : "plain");
    cJSON_AddStringToObject(set, "mode", o->mode == MQ_GPTQ_SEQUENTIAL ? "sequential" : "nonsequential");
    cJSON_AddBoolToObject(set, "true_sequential", o->true_sequential && o->mode == MQ_GPTQ_SEQUENTIAL);
    cJSON_AddNumberToObject(set, "percdamp", o->gptq.percdamp);
    cJSON_AddNumberToObject(set, "block_size", o->gptq.block_size);
    cJSON_AddBoolToObject(set, "act_order", o->gptq.act_order);
    cJSON_AddStringToObject(set, "groups", o->gptq.groups == MQ_GPTQ_GROUPS_STATIC ? "static"
                                           : o->gptq.groups == MQ_GPTQ_GROUPS_GIDX ? "g_idx"
                                                                                  : "dynamic");
    cJSON_AddNumberToObject(set, "min_expert_tokens", (double)o->min_expert_tokens);
    cJSON_AddStringToObject(set, "expert_fallback", o->fallback == MQ_FALLBACK_RTN ? "rtn" : "block-hessian");
    cJSON *cal = cJSON_AddObjectToObject(j, "calibration");
    if (calib) {
        if (calib->path) cJSON_AddStringToObject(cal, "file", calib->path);
        cJSON_AddStringToObject(cal, "sampling", calib->mode == MQ_CALIB_RANDOM ? "random"
                                                 : calib->mode == MQ_CALIB_DOCS ? "docs" : "chunks");
        cJSON_AddNumberToObject(cal, "seqlen", (double)calib->seqlen);
    }
    cJSON_AddNumberToObject(cal, "samples", (double)r->samples);
    cJSON_AddNumberToObject(cal, "tokens", (double)r->tokens);
    cJSON *sec = cJSON_AddObjectToObject(j, "seconds");
    cJSON_AddNumberToObject(sec, "total", r->seconds_total);
    cJSON_AddNumberToObject(sec, "forward", r->seconds_forward);
    cJSON_AddNumberToObject(sec, "hessians", r->seconds_hessian);
    cJSON_AddNumberToObject(sec, "gptq", r->seconds_gptq);
    cJSON *mods = cJSON_AddArrayToObject(j, "modules");
    double sum_g = 0, sum_r = 0;
    int64_t worse = 0, fallbacks = 0;
    for (int64_t i = 0; i < r->n; i++) {
        const mq_gptq_result *x = &r->r[i];
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "module", x->module);
        cJSON_AddNumberToObject(m, "layer", x->layer);
        if (x->expert >= 0) cJSON_AddNumberToObject(m, "expert", x->expert);
        cJSON_AddNumberToObject(m, "tokens", (double)x->tokens);
        cJSON_AddStringToObject(m, "method", mq_gptq_how_name(x->how));
        json_num(m, "loss", x->stats.loss);
        json_num(m, "rtn_loss", x->stats.rtn_loss);
        if (x->how != MQ_HOW_RTN) {
            cJSON_AddNumberToObject(m, "percdamp", x->stats.percdamp);
            cJSON_AddNumberToObject(m, "dead_columns", (double)x->stats.n_dead);
        }
        cJSON_AddNumberToObject(m, "seconds", x->stats.seconds);
        cJSON_AddItemToArray(mods, m);
        if (x->how != MQ_HOW_GPTQ) fallbacks++;
        if (isfinite(x->stats.loss) && isfinite(x->stats.rtn_loss)) {
            sum_g += x->stats.loss;
            sum_r += x->stats.rtn_loss;
            worse += x->stats.loss > x->stats.rtn_loss;
        }
    }
    cJSON *sum = cJSON_AddObjectToObject(j, "summary");
    cJSON_AddNumberToObject(sum, "modules", (double)r->n);
    cJSON_AddNumberToObject(sum, "expert_fallbacks", (double)fallbacks);
    cJSON_AddNumberToObject(sum, "gptq_loss_total", sum_g);
    cJSON_AddNumberToObject(sum, "rtn_loss_total", sum_r);
    cJSON_AddNumberToObject(sum, "modules_worse_than_rtn", (double)worse);
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text) return mq_err(MOEQ_E_NOMEM, "out of memory writing %s", path);
    size_t len = strlen(text);
    text[len] = '\n';   /* cJSON_Print leaves room only for the NUL: write len bytes + newline */
    moeq_status st = mq_write_file_atomic(path, text, len + 1);
    free(text);
    return st;
}

moeq_status mq_gptq_quantize_checkpoint(const char *model_dir, const char *out_dir,
                                        mq_quantize_opts *qo, const mq_gptq_model_opts *go,
                                        const mq_calib_opts *co, const char *report_path,
                                        mq_gptq_results *results, mq_quantize_stats *stats) {
    memset(results, 0, sizeof *results);
    if (go->spec.scheme != qo->spec.scheme)
        return mq_err(MOEQ_E_ARG, "GPTQ and the checkpoint writer disagree on the scheme");
    if (go->no_fuse != qo->no_fuse)
        return mq_err(MOEQ_E_ARG, "GPTQ and the checkpoint writer disagree on fused global scales");
    moeq_model *m = NULL;
    mq_calib_set calib = {0};
    moeq_status st = moeq_model_open(model_dir, NULL, &m);
    if (!st) st = mq_calib_load(moeq_model_tokenizer(m), co, &calib);
    if (!st) st = mq_gptq_model(m, &calib, go, results);
    moeq_model_free(m);
    mq_calib_free(&calib);
    if (st) return st;
    qo->step = mq_gptq_take;
    qo->step_user = results;
    st = mq_quantize_checkpoint(model_dir, out_dir, qo, stats);
    /* after the checkpoint: the report may go into OUT_DIR, which the writer replaces */
    if (!st && report_path) st = mq_gptq_report_write(results, go, co, report_path);
    return st;
}
