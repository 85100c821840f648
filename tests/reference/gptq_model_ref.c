/*
 * The test reference of the pipeline's GPTQ (see gptq_model_ref.h): the layer-by-layer
 * calibration loop of IST-DASLab's gptq (llama.py: inputs of block l cached, Hessians from hooks,
 * block quantized, inputs re-run through the quantized block) extended to MoE: one Hessian per
 * routed expert from exactly its routed tokens, fused NVFP4 global scales, a fallback for experts
 * without calibration tokens, and every weight of a block in one parallel GPTQ run.
 */
#include "reference/gptq_model_ref.h"
#include <cblas.h>
#include <lapacke.h>

#include "kernels/gemm_det.h"
#include "kernels/vec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void ref_gptq_opts_init(ref_gptq_opts *o, const mq_qspec *spec) {
    memset(o, 0, sizeof *o);
    o->spec = *spec;
    o->spec.mse = true;
    o->gptq = mq_gptq_opts_default();
    o->gptq.act_order = spec->scheme == MQ_QS_INT4;
    /* the scale search scores candidates by running GPTQ over the group
     * (docs/results/gptq_results.md: lower KL in three of four cases, equal in the fourth); with
     * one group per row that would be GPTQ over whole rows once per candidate, so those keep the
     * plain squared error */
    o->gptq.mse_weight = spec->group_size > 0 ? MQ_GPTQ_MSE_LOOP : MQ_GPTQ_MSE_PLAIN;
    o->mode = REF_SEQUENTIAL;
    o->min_expert_tokens = 32;
    o->fallback = REF_FALLBACK_BLOCK;
}

const char *ref_how_name(ref_how h) {
    switch (h) {
    case REF_HOW_GPTQ: return "gptq";
    case REF_HOW_GPTQ_BLOCK_HESSIAN: return "gptq-block-hessian";
    default: return "rtn";
    }
}

void ref_gptq_results_free(ref_gptq_results *r) {
    if (!r) return;
    for (int64_t i = 0; i < r->n; i++) {
        free(r->r[i].module);
        mq_qtensor_free(&r->r[i].q);
    }
    free(r->r);
    memset(r, 0, sizeof *r);
}

ref_gptq_result *ref_gptq_results_find(const ref_gptq_results *r, const char *module) {
    for (int64_t i = 0; i < r->n; i++)
        if (strcmp(r->r[i].module, module) == 0) return &r->r[i];
    return NULL;
}

static moeq_status results_reserve(ref_gptq_results *r, int64_t more) {
    if (r->n + more <= r->cap) return MOEQ_OK;
    int64_t cap = r->cap ? r->cap : 64;
    while (cap < r->n + more) cap *= 2;
    ref_gptq_result *v = realloc(r->r, (size_t)cap * sizeof *v);
    if (!v) return mq_err(MOEQ_E_NOMEM, "out of memory for GPTQ results");
    r->r = v;
    r->cap = cap;
    return MOEQ_OK;
}

static ref_gptq_result *results_add(ref_gptq_results *r, const char *module, int layer, int expert) {
    if (results_reserve(r, 1)) return NULL;
    ref_gptq_result *x = &r->r[r->n];
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
    ref_how how;
    float *H;                    /* [K, K] the Hessian used (NULL for RTN) */
    int64_t tokens;
    float gs;                    /* NVFP4 global scale of its weights (fused) */
    /* asymmetric calibration (opts asym) */
    float *xf;                   /* the unquantized stream's input of this sample (not experts) */
    int64_t xf_rows;
    int64_t *tok, ntok;          /* a routed expert's gate/up slot: the tokens of its last rows */
    float *G;                    /* [K, K] sum x_f x_q^T */
    int64_t g_rows;
} slot;

typedef struct {
    moeq_model *m;
    const ref_gptq_opts *o;
    int layer;
    slot *slots;
    int n_slots;
    int site_slot[MQ_SITE_COUNT];   /* non-expert sites; -1 when absent */
    int expert0, down0;             /* slot of EXPERT 0 / EXPERT_DOWN 0; -1 when dense */
    int phase;                      /* -1: every slot; 0: attention only; 1: the rest */
    float *ffn_in;                  /* [samples][max_len][D] MoE block input (fallback), or NULL */
    mq_hessian block_h;             /* its Hessian over every token, one update per sample */
    int64_t max_len;
    int64_t sample;                 /* sample being run */
    bool asym;                      /* asymmetric calibration on (opts asym) */
    bool fp_pass;                   /* the hooks see the unquantized stream */
    float *xf_ffn, *xq_ffn;         /* this sample's FFN inputs, both streams */
    int64_t ffn_rows;
    moeq_status err;                /* a hook's failure */
    double t_hessian;
    float *arena;                   /* copies of captured inputs whose Hessian update is deferred */
    size_t arena_cap, arena_used;   /* floats */
} block_ctx;

static void block_free(block_ctx *b) {
    for (int i = 0; i < b->n_slots; i++) {
        mq_hessian_free(&b->slots[i].h);
        mq_free(b->slots[i].H);
        free(b->slots[i].xf);
        free(b->slots[i].tok);
        free(b->slots[i].G);
    }
    free(b->slots);
    free(b->xf_ffn), free(b->xq_ffn);
    b->xf_ffn = b->xq_ffn = NULL;
    free(b->arena);
    b->arena = NULL;
    b->arena_cap = b->arena_used = 0;
    mq_free(b->ffn_in);
    mq_hessian_free(&b->block_h);
    b->slots = NULL;
    b->ffn_in = NULL;
    b->n_slots = 0;
}

/* Whether the slot belongs to the block's current phase (true-sequential: attention first). */
static bool in_phase(const block_ctx *b, const slot *s) {
    bool attn = s->site == MQ_SITE_QKV || s->site == MQ_SITE_O || s->site == MQ_SITE_Q_B ||
                s->site == MQ_SITE_KV_B;
    return b->phase < 0 || attn == (b->phase == 0);
}

static bool wanted(const ref_gptq_opts *o, const mq_linear *l) {
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

static moeq_status block_init(block_ctx *b, moeq_model *m, const ref_gptq_opts *o, int l,
                              const mq_calib_set *calib) {
    memset(b, 0, sizeof *b);
    b->m = m;
    b->o = o;
    b->layer = l;
    b->expert0 = b->down0 = -1;
    b->phase = -1;
    b->asym = o->asym != 0 && o->mode == REF_SEQUENTIAL && !o->true_sequential;
    for (int i = 0; i < MQ_SITE_COUNT; i++) b->site_slot[i] = -1;
    mq_layer *ly = &m->layers[l];
    const mq_config *c = &m->cfg;
    int E = ly->is_moe ? c->n_experts : 0;
    b->slots = calloc((size_t)(8 + 2 * E), sizeof *b->slots);
    if (!b->slots) return mq_err(MOEQ_E_NOMEM, "out of memory for block %d", l);
    if (c->mla) {   /* latent attention: q_a (or q_proj) with kv_a; q_b and kv_b on their latents */
        b->site_slot[MQ_SITE_QKV] =
            slot_add(b, MQ_SITE_QKV, -1, c->q_lora_rank > 0 ? &ly->q_a : &ly->q, &ly->kv_a, NULL);
        b->site_slot[MQ_SITE_Q_B] = slot_add(b, MQ_SITE_Q_B, -1, &ly->q_b, NULL, NULL);
        b->site_slot[MQ_SITE_KV_B] = slot_add(b, MQ_SITE_KV_B, -1, &ly->kv_b, NULL, NULL);
    } else {
        b->site_slot[MQ_SITE_QKV] = slot_add(b, MQ_SITE_QKV, -1, &ly->q, &ly->k, &ly->v);
    }
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
    if (!st && any_expert && o->fallback == REF_FALLBACK_BLOCK && o->min_expert_tokens > 0) {
        b->max_len = calib->max_len;
        b->ffn_in = mq_alloc_array((size_t)(calib->n * calib->max_len), (size_t)c->D * sizeof(float),
                                   "MoE block inputs for the expert fallback");
        if (!b->ffn_in) st = MOEQ_E_NOMEM;
        if (!st) st = mq_hessian_init(&b->block_h, c->D, "MoE block Hessian");
    }
    if (st) block_free(b);
    return st;
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

/* Asymmetric calibration's pairs: on the unquantized stream's pass, keeps each non-expert
 * input and the FFN input (returns false: nothing else to do with it); on the quantized stream's,
 * G += x_f^T x_q for the slot, a routed expert's x_f gathered from the unquantized FFN input by
 * its rows' tokens (found by value in the quantized FFN input, in the forward's row order). */
static bool keep_copy(block_ctx *b, float **dst, const float *x, int64_t n) {
    float *p = realloc(*dst, sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!p) {
        b->err = mq_err(MOEQ_E_NOMEM, "out of memory for the unquantized stream's inputs");
        return false;
    }
    memcpy(p, x, sizeof(float) * (size_t)n);
    *dst = p;
    return true;
}

static bool capture_pair(block_ctx *b, slot *s, mq_site site, const float *x, int64_t rows, int64_t cols) {
    if (b->err) return false;
    if (site == MQ_SITE_FFN) {
        if (!keep_copy(b, b->fp_pass ? &b->xf_ffn : &b->xq_ffn, x, rows * cols)) return false;
        b->ffn_rows = rows;
    }
    if (b->fp_pass) {
        if (s && s->expert < 0 && keep_copy(b, &s->xf, x, rows * cols)) s->xf_rows = rows;
        return false;
    }
    if (!s || rows <= 0) return true;
    const float *xf = s->xf;
    float *gathered = NULL, *g = NULL, *u = NULL;
    if (s->expert >= 0) {
        const mq_layer *ly = &b->m->layers[b->layer];
        const int e = s->expert;
        const int64_t D = b->m->cfg.D;
        slot *gu = &b->slots[b->expert0 + e];
        if (site == MQ_SITE_EXPERT) {
            int64_t *tok = realloc(gu->tok, sizeof(int64_t) * (size_t)rows);
            if (!tok) {
                b->err = mq_err(MOEQ_E_NOMEM, "out of memory for expert %d's tokens", e);
                return false;
            }
            gu->tok = tok;
            for (int64_t r = 0, t = 0; r < rows; r++) {
                while (t < b->ffn_rows && memcmp(b->xq_ffn + t * D, x + r * cols, sizeof(float) * (size_t)D)) t++;
                if (t == b->ffn_rows) {
                    b->err = mq_err(MOEQ_E_SHAPE, "expert %d: a routed row is no token's FFN input", e);
                    return false;
                }
                tok[r] = t;
            }
            gu->ntok = rows;
        }
        if (gu->ntok != rows) {
            b->err = mq_err(MOEQ_E_SHAPE, "expert %d: %lld down rows after %lld gate/up rows", e, (long long)rows,
                            (long long)gu->ntok);
            return false;
        }
        gathered = mq_alloc_array((size_t)rows, (size_t)D * sizeof(float), "the unquantized stream's expert rows");
        if (!gathered) {
            b->err = MOEQ_E_NOMEM;
            return false;
        }
        for (int64_t r = 0; r < rows; r++)
            memcpy(gathered + r * D, b->xf_ffn + gu->tok[r] * D, sizeof(float) * (size_t)D);
        xf = gathered;
        if (site == MQ_SITE_EXPERT_DOWN) {   /* through the expert's unquantized gate and up */
            g = mq_alloc_array((size_t)rows, (size_t)cols * sizeof(float), "the unquantized stream's down rows");
            u = mq_alloc_array((size_t)rows, (size_t)cols * sizeof(float), "the unquantized stream's down rows");
            if (!g || !u) b->err = MOEQ_E_NOMEM;
            if (!b->err) b->err = mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, gathered, rows, g, u, NULL);
            xf = g;
        }
    } else if (s->xf_rows != rows) {
        b->err = mq_err(MOEQ_E_SHAPE, "%s: %lld rows against %lld unquantized", s->w[0]->name, (long long)rows,
                        (long long)s->xf_rows);
    }
    if (!b->err && !s->G && !(s->G = calloc((size_t)(cols * cols), sizeof(float))))
        b->err = mq_err(MOEQ_E_NOMEM, "out of memory for %s's cross sum", s->w[0]->name);
    if (!b->err) {   /* G[a][c] += sum_t x_f[t][a] x_q[t][c] */
        mq_cross_det_acc_pool(cols, rows, xf, cols, x, cols, s->G, cols);
        s->g_rows += rows;
    }
    mq_free(gathered);
    mq_free(g);
    mq_free(u);
    return !b->err;
}

static void on_capture(void *user, int layer, mq_site site, int expert, const float *x,
                       int64_t rows, int64_t cols) {
    block_ctx *b = user;
    if (layer != b->layer) return;
    int i = site == MQ_SITE_EXPERT        ? (b->expert0 >= 0 ? b->expert0 + expert : -1)
            : site == MQ_SITE_EXPERT_DOWN ? (b->down0 >= 0 ? b->down0 + expert : -1)
                                          : b->site_slot[site];
    slot *s = i >= 0 && b->slots[i].nw && in_phase(b, &b->slots[i]) ? &b->slots[i] : NULL;
    if (b->asym && !capture_pair(b, s, site, x, rows, cols)) return;   /* the unquantized stream's */
    if (s && s->pend_rows) flush_updates(b);   /* one waiting update per Hessian keeps the order */
    double t0 = mq_now();
    if (s && rows > 0) {
        MQ_ASSERT(cols == s->h.K);
        if (!defer_update(b, s, x, rows)) mq_hessian_add(&s->h, x, rows);
    }
    if (site == MQ_SITE_FFN && b->ffn_in && b->phase != 0) {
        /* the MoE block input of every token, kept for the fallback, and its Hessian */
        memcpy(b->ffn_in + b->sample * b->max_len * cols, x, sizeof(float) * (size_t)(rows * cols));
        mq_hessian_add(&b->block_h, x, rows);
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
        mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, x, T, g, u, NULL);
        mq_hessian_add(h, g, T);
    }
    mq_free(g);
    mq_free(u);
    return MOEQ_OK;
}

/* Decides how each slot is quantized and forms its Hessian. */
static moeq_status block_hessians(block_ctx *b, const mq_calib_set *calib) {
    const ref_gptq_opts *o = b->o;
    mq_hessian block_in = {0};
    moeq_status st = MOEQ_OK;
    bool need_block = false;
    for (int i = 0; i < b->n_slots; i++) {
        slot *s = &b->slots[i];
        if (!s->nw || !in_phase(b, s)) continue;
        s->tokens = s->expert >= 0 ? b->slots[b->expert0 + s->expert].h.n : s->h.n;
        s->how = REF_HOW_GPTQ;
        if (s->expert >= 0 && s->tokens < o->min_expert_tokens)
            s->how = o->fallback == REF_FALLBACK_RTN ? REF_HOW_RTN : REF_HOW_GPTQ_BLOCK_HESSIAN;
        need_block |= s->how == REF_HOW_GPTQ_BLOCK_HESSIAN && s->site == MQ_SITE_EXPERT;
    }
    if (need_block) {   /* every token's FFN input */
        block_in = b->block_h;
        b->block_h = (mq_hessian){0};
    }
    for (int i = 0; i < b->n_slots && !st; i++) {
        slot *s = &b->slots[i];
        if (!s->nw || !in_phase(b, s) || s->how == REF_HOW_RTN) continue;
        const int64_t K = s->h.K;
        const mq_hessian *src = &s->h;
        mq_hessian tmp = {0};
        if (s->how == REF_HOW_GPTQ_BLOCK_HESSIAN) {
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

/* Asymmetric calibration: each slot's weights become W + asym W (G - H)(H + damping)^-1, H the
 * Hessian GPTQ runs on (2/n sum x_q x_q^T) and G scaled alike; written as a correction so that
 * the damping bounds the correction alone (W G (H + damping)^-1 would shrink W along H's small
 * directions even where both streams agree). */
static moeq_status asym_targets(block_ctx *b) {
    for (int i = 0; i < b->n_slots; i++) {
        slot *s = &b->slots[i];
        if (!s->nw || !in_phase(b, s) || !s->G || !s->H || s->how != REF_HOW_GPTQ || !s->g_rows) continue;
        float *w[3];
        int64_t rows[3];
        for (int k = 0; k < s->nw; k++) {
            w[k] = s->w[k]->w;
            rows[k] = s->w[k]->out;
        }
        moeq_status st = mq_gptq_target(s->H, s->G, s->w[0]->in, s->g_rows, b->o->asym, b->o->gptq.percdamp, w, rows,
                                        s->nw, s->w[0]->name);
        if (st) return st;
    }
    return MOEQ_OK;
}

/* Factorises, quantizes every weight of the block in one run, writes the dequantized weights
 * back into the model and records the results. */
static moeq_status block_quantize(block_ctx *b, ref_gptq_results *res) {
    const ref_gptq_opts *o = b->o;
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
    if (b->asym && (st = asym_targets(b))) goto done;
    for (int i = 0; i < n; i++) {
        slot *s = &b->slots[i];
        if (!s->nw || !in_phase(b, s)) continue;
        Hs[i] = s->how == REF_HOW_RTN ? NULL : s->H;
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
            ref_gptq_result *r = results_add(res, l->name, b->layer, s->expert);
            if (!r) {
                st = MOEQ_E_NOMEM;
                break;
            }
            r->tokens = s->tokens;
            r->how = s->how;
            float gs = o->no_fuse ? mq_nvfp4_global_scale(&o->spec, mq_absmax(l->w, l->out * l->in)) : s->gs;
            if (s->how == REF_HOW_RTN) {
                double t0 = mq_now();
                st = mq_quantize_rtn(&o->spec, l->w, l->out, l->in, gs, l->name, &r->q);
                r->stats = (mq_gptq_stats){NAN, NAN, 0, 0, mq_now() - t0};
                continue;
            }
            job_res[n_jobs] = res->n - 1;
            jobs[n_jobs++] = (mq_gptq_job){&f[i], l->w, l->out, gs, l->name, &r->q, NULL, {0, 0, 0, 0, 0}, NULL};
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

moeq_status ref_gptq_model(moeq_model *m, const mq_calib_set *calib, const ref_gptq_opts *o,
                          ref_gptq_results *out) {
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
    /* asymmetric calibration: the unquantized model's activations beside the quantized ones */
    const bool asym = o->asym != 0 && o->mode == REF_SEQUENTIAL && !o->true_sequential;
    float *XF = asym ? mq_alloc_array((size_t)(S * Lmax), (size_t)D * sizeof(float), "unquantized activations") : NULL;
    moeq_status st = X && xt && (XF || !asym) ? MOEQ_OK : MOEQ_E_NOMEM;
    if (!st) st = mq_state_new(m, (int32_t)Lmax, &state);
    /* block inputs of block 0: the embeddings */
    for (int64_t s = 0; s < S && !st; s++) st = mq_embed(m, calib->ids[s], calib->len[s], X + s * Lmax * D);
    if (XF && !st) memcpy(XF, X, sizeof(float) * (size_t)(S * Lmax * D));
    out->samples = S;
    out->tokens = calib->total;
    const bool seq = o->mode == REF_SEQUENTIAL;
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
                if (XF) {   /* the unquantized stream first (its inputs kept), on to the next layer */
                    b.fp_pass = true;
                    st = mq_forward_layers(m, state, XF + s * Lmax * D, calib->len[s], 0, l, l + 1, &hooks);
                    b.fp_pass = false;
                    if (!st) st = b.err;
                    if (st) break;
                }
                st = mq_forward_layers(m, state, xt, calib->len[s], 0, l, l + 1, &hooks);
                if (!st) st = b.err;
                flush_updates(&b);
                if (!seq) memcpy(x, xt, (size_t)(calib->len[s] * D) * sizeof(float));
                mq_progress("gptq", ++done_units, total);
            }
            double t1 = mq_now();
            /* 2. Hessians, fallbacks, GPTQ for every weight of the block (or of the phase) */
            if (!st) st = block_hessians(&b, calib);
            ref_gptq_opts ol = *o;   /* progress over this block's GPTQ tasks */
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
    mq_free(XF);
    out->seconds_total = mq_now() - t_start;
    if (st) ref_gptq_results_free(out);
    return st;
}

