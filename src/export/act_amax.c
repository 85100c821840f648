/*
 * Activation amax calibration through the forward hooks of src/model: every hook site maps to the
 * Linears that read that input (q/k/v share the attention input, gate/up share the MLP input, an
 * expert's gate/up its routed tokens). Static min-max as in llm-compressor's observers
 * (formats.md section 2.1, input_global_scale).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "export/act_amax.h"
#include "formats/formats.h"

/* amax per (layer, site, expert): expert slots only for the expert sites */
struct mq_act_amax {
    const moeq_model *m;   /* valid during collect only */
    int n_layers, n_experts;
    float *site;     /* [n_layers, MQ_SITE_COUNT] */
    float *expert;   /* [n_layers, 2, n_experts]: EXPERT, EXPERT_DOWN */
    uint8_t *seen;   /* same shape as expert */
    void *table;     /* sorted entries (module name -> amax) */
    size_t n_table;
};

static moeq_status build_table(mq_act_amax *a);

static void on_capture(void *user, int layer, mq_site site, int expert, const float *x,
                       int64_t rows, int64_t cols) {
    mq_act_amax *a = user;
    if (rows <= 0 || layer < 0 || layer >= a->n_layers) return;
    float v = mq_absmax(x, rows * cols);
    if (isnan(v)) return;
    if ((site == MQ_SITE_EXPERT || site == MQ_SITE_EXPERT_DOWN) && expert >= 0 &&
        expert < a->n_experts) {
        size_t i = ((size_t)layer * 2 + (site == MQ_SITE_EXPERT_DOWN)) * (size_t)a->n_experts +
                   (size_t)expert;
        if (v > a->expert[i]) a->expert[i] = v;
        a->seen[i] = 1;
        return;
    }
    float *p = &a->site[(size_t)layer * MQ_SITE_COUNT + site];
    if (v > *p) *p = v;
}

moeq_status mq_act_amax_collect(const moeq_model *m, const int32_t *ids, int64_t n_ids,
                                int64_t chunk, mq_act_amax **out) {
    *out = NULL;
    if (chunk <= 0 || n_ids <= 0)
        return mq_err(MOEQ_E_ARG, "calibration needs tokens (got %lld) and a positive chunk",
                      (long long)n_ids);
    mq_act_amax *a = calloc(1, sizeof *a);
    if (!a) return mq_err(MOEQ_E_NOMEM, "out of memory");
    a->m = m;
    a->n_layers = m->cfg.n_layers;
    a->n_experts = m->cfg.n_experts > 0 ? m->cfg.n_experts : 1;
    size_t ne = (size_t)a->n_layers * 2 * (size_t)a->n_experts;
    a->site = calloc((size_t)a->n_layers * MQ_SITE_COUNT, sizeof(float));
    a->expert = calloc(ne, sizeof(float));
    a->seen = calloc(ne, 1);
    float *x = mq_alloc_array((size_t)chunk, (size_t)m->cfg.D * sizeof(float), "calibration activations");
    mq_state *st = NULL;
    moeq_status s = (!a->site || !a->expert || !a->seen || !x) ? mq_err(MOEQ_E_NOMEM, "out of memory")
                                                                : mq_state_new(m, (int32_t)chunk, &st);
    mq_hooks hooks = {on_capture, a};
    for (int64_t off = 0; off < n_ids && !s; off += chunk) {
        if (moeq_interrupted()) {
            s = mq_err(MOEQ_E_INTERRUPTED, "calibration interrupted");
            break;
        }
        int64_t T = n_ids - off < chunk ? n_ids - off : chunk;
        s = mq_embed(m, ids + off, T, x);
        if (!s) s = mq_forward_layers(m, st, x, T, 0, 0, m->cfg.n_layers, &hooks);
        mq_progress("calibrate", off + T, n_ids);
    }
    mq_state_free(st);
    mq_free(x);
    if (s) {
        mq_act_amax_free(a);
        return s;
    }
    /* experts that saw no token: the layer's largest expert amax at that site */
    for (size_t ls = 0; ls < (size_t)a->n_layers * 2; ls++) {
        float mx = 0.0f;
        for (int e = 0; e < a->n_experts; e++) mx = fmaxf(mx, a->expert[ls * (size_t)a->n_experts + (size_t)e]);
        for (int e = 0; e < a->n_experts; e++)
            if (!a->seen[ls * (size_t)a->n_experts + (size_t)e]) a->expert[ls * (size_t)a->n_experts + (size_t)e] = mx;
    }
    if ((s = build_table(a))) {
        mq_act_amax_free(a);
        return s;
    }
    *out = a;
    return MOEQ_OK;
}

typedef struct {
    char *name;         /* copied: the table outlives the model */
    float amax;
} entry;

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const entry *)a)->name, ((const entry *)b)->name);
}

static void put(entry *v, size_t *n, const mq_linear *l, float amax) {
    char *name = l->name ? mq_strdup(l->name) : NULL;
    if (name) v[(*n)++] = (entry){name, amax};
}

/* Sorted (module, amax) table for lookups by name. */
static moeq_status build_table(mq_act_amax *a) {
    const moeq_model *m = a->m;
    size_t cap = (size_t)a->n_layers * (7 + 3 * (size_t)a->n_experts), n = 0;
    entry *v = calloc(cap ? cap : 1, sizeof *v);
    if (!v) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int l = 0; l < a->n_layers; l++) {
        const mq_layer *ly = &m->layers[l];
        const float *site = &a->site[(size_t)l * MQ_SITE_COUNT];
        put(v, &n, &ly->q, site[MQ_SITE_QKV]);
        put(v, &n, &ly->k, site[MQ_SITE_QKV]);
        put(v, &n, &ly->v, site[MQ_SITE_QKV]);
        put(v, &n, &ly->o, site[MQ_SITE_O]);
        if (!ly->is_moe) {
            put(v, &n, &ly->gate, site[MQ_SITE_MLP]);
            put(v, &n, &ly->up, site[MQ_SITE_MLP]);
            put(v, &n, &ly->down, site[MQ_SITE_MLP_DOWN]);
            continue;
        }
        size_t base = (size_t)l * 2 * (size_t)a->n_experts;
        for (int e = 0; e < m->cfg.n_experts; e++) {
            put(v, &n, &ly->exp_gate[e], a->expert[base + (size_t)e]);
            put(v, &n, &ly->exp_up[e], a->expert[base + (size_t)e]);
            put(v, &n, &ly->exp_down[e], a->expert[base + (size_t)a->n_experts + (size_t)e]);
        }
        if (m->cfg.shared_ffn > 0) {
            put(v, &n, &ly->sh_gate, site[MQ_SITE_SHARED]);
            put(v, &n, &ly->sh_up, site[MQ_SITE_SHARED]);
            put(v, &n, &ly->sh_down, site[MQ_SITE_SHARED_DOWN]);
        }
    }
    qsort(v, n, sizeof *v, cmp_entry);
    a->table = v;
    a->n_table = n;
    return MOEQ_OK;
}

float mq_act_amax_get(const mq_act_amax *a, const char *module) {
    if (!a) return 0.0f;
    entry key = {(char *)module, 0.0f};
    const entry *e = bsearch(&key, a->table, a->n_table, sizeof key, cmp_entry);
    return e ? e->amax : 0.0f;
}

void mq_act_amax_free(mq_act_amax *a) {
    if (!a) return;
    free(a->site);
    free(a->expert);
    free(a->seen);
    entry *t = a->table;
    for (size_t i = 0; i < a->n_table; i++) free(t[i].name);
    free(a->table);
    free(a);
}
