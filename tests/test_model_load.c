/*
 * Checkpoint loading, with checkpoints built here from the fixture models so that each has an
 * independent expected answer:
 *  - a Mixtral-layout model whose experts are all copies of llama-tiny's MLP reproduces
 *    llama-tiny's golden logits (its renormalised top-k weights sum to 1);
 *  - olmoe-tiny re-saved with fused experts (experts.gate_up_proj [E, 2F, D], down_proj
 *    [E, D, F]), in F32 or F16-exact values, or sharded, gives bit-identical logits;
 *  - broken checkpoints give one error that lists every problem: missing tensors, wrong shapes,
 *    wrong dtypes, layer counts that disagree with config.json, unknown model_type, bad configs.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "model/model.h"

/* ---- helpers ----------------------------------------------------------------------------------- */
static char *read_text(const char *dir, const char *name) {
    char *p = mq_path_join(dir, name), *text = NULL;
    size_t len;
    ASSERT_OK(mq_read_file(p, &text, &len));
    free(p);
    return text;
}

static void write_text(const char *dir, const char *name, const char *text) {
    char *p = mq_path_join(dir, name);
    ASSERT_OK(mq_write_file_atomic(p, text, strlen(text)));
    free(p);
}

/* text with every `from` replaced by `to` (malloc'ed); the pattern must occur. */
static char *replace(const char *text, const char *from, const char *to) {
    size_t nf = strlen(from), nt = strlen(to), n = 0;
    for (const char *p = strstr(text, from); p; p = strstr(p + nf, from)) n++;
    if (n == 0) FAIL("pattern '%s' not found", from);
    char *out = malloc(strlen(text) + n * nt + 1), *o = out;
    const char *p = text, *q;
    while ((q = strstr(p, from))) {
        memcpy(o, p, (size_t)(q - p));
        o += q - p;
        memcpy(o, to, nt);
        o += nt;
        p = q + nf;
    }
    strcpy(o, p);
    return out;
}

static char *new_dir(const char *name) {
    char *d = mq_path_join(mq_test_tmpdir(), name);
    ASSERT_TRUE(mkdir(d, 0755) == 0);
    return d;
}

static float *tensor_f32(const mq_tensor_view *t) {
    float *v = malloc(sizeof(float) * (size_t)t->numel);
    ASSERT_OK(mq_tensor_to_f32(t, v));
    return v;
}

static void add_f32(mq_st_writer *w, const char *name, int ndim, const int64_t *shape, const float *v) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    ASSERT_OK(mq_stw_add(w, name, MOEQ_DT_F32, ndim, shape, v, sizeof(float) * (size_t)n));
}

static void add_copy(mq_st_writer *w, const mq_tensor_view *t) {
    ASSERT_OK(mq_stw_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes));
}

/* Logits of the golden's input ids through moeq_session_forward. */
static float *logits_of(const char *dir, const int32_t *ids, int64_t T, int64_t V) {
    moeq_model_options opt = {.no_tokenizer = 1};
    moeq_model *m = mq_test_open_model(dir, &opt);
    ASSERT_EQ_INT(V, moeq_model_get_info(m)->vocab_size);
    float *out = mq_test_logits(m, ids, (int32_t)T);
    moeq_model_free(m);
    return out;
}

typedef struct {
    mq_st *st;
    int32_t ids[128];
    int64_t T;
    float *logits;   /* [T, 4096] */
} golden;

static void load_golden(const char *model, golden *g) {
    ASSERT_OK(mq_st_open_file(mq_test_model_golden(model), &g->st));
    const mq_tensor_view *ids = mq_st_find(g->st, "input_ids");
    ASSERT_TRUE(ids && ids->dtype == MOEQ_DT_I32 && ids->numel == 128);
    memcpy(g->ids, ids->data, sizeof g->ids);
    g->T = 128;
    g->logits = tensor_f32(mq_st_find(g->st, "logits"));
}

static void free_golden(golden *g) {
    free(g->logits);
    mq_st_close(g->st);
}

/* The shared fixture, or the bundled copy (models/olmoe-tiny) when the shared folder is absent. */
static char *fixture(const char *model) { return mq_strdup(mq_test_model(model)); }

/* ---- equivalent checkpoints ---------------------------------------------------------------- */
/* A Mixtral checkpoint made of llama-tiny's first n_layers layers, each MLP copied into 4 experts,
 * with a random router; window > 0 sets sliding_window. */
static void build_mixtral_from_llama(const char *dst, int n_layers, int window) {
    char *src = fixture("llama-tiny");
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(src, &st));
    const int E = 4;
    mq_st_writer *w = mq_stw_new();
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *t = mq_st_at(st, i);
        int l = -1;
        if (sscanf(t->name, "model.layers.%d.", &l) == 1 && l >= n_layers) continue;
        if (!strstr(t->name, ".mlp.")) add_copy(w, t);
    }
    uint32_t r = 99;
    for (int l = 0; l < n_layers; l++) {
        const char *hub[3] = {"gate_proj", "up_proj", "down_proj"}, *mix[3] = {"w1", "w3", "w2"};
        for (int k = 0; k < 3; k++) {
            char name[128];
            snprintf(name, sizeof name, "model.layers.%d.mlp.%s.weight", l, hub[k]);
            const mq_tensor_view *t = mq_st_find(st, name);
            ASSERT_TRUE(t != NULL);
            for (int e = 0; e < E; e++) {
                snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight",
                         l, e, mix[k]);
                ASSERT_OK(mq_stw_add(w, name, t->dtype, t->ndim, t->shape, t->data, t->nbytes));
            }
        }
        /* A router with real preferences, so different tokens pick different experts. */
        float router[4 * 256];
        for (int i = 0; i < E * 256; i++) {
            r = r * 1664525u + 1013904223u;
            router[i] = ((float)(r >> 8) * 0x1p-24f - 0.5f) * 0.5f;
        }
        int64_t shape[2] = {E, 256};
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.gate.weight", l);
        add_f32(w, name, 2, shape, router);
    }
    mq_test_write_model_st(w, dst);
    char *cfg = read_text(src, "config.json");
    char extra[200], layers[64];
    snprintf(extra, sizeof extra, "\"model_type\": \"mixtral\", \"num_local_experts\": 4, "
             "\"num_experts_per_tok\": 2, \"sliding_window\": %d", window);
    if (window <= 0) snprintf(strstr(extra, "\"sliding_window\""), 32, "\"sliding_window\": null");
    char *c1 = replace(cfg, "\"model_type\": \"llama\"", extra);
    snprintf(layers, sizeof layers, "\"num_hidden_layers\": %d", n_layers);
    char *c2 = replace(c1, "\"num_hidden_layers\": 4", layers);
    write_text(dst, "config.json", c2);
    free(c1);
    free(c2);
    free(cfg);
    mq_st_close(st);
    free(src);
}

static void test_mixtral_from_llama_copies(void) {
    golden g;
    load_golden("llama-tiny", &g);
    char *dst = new_dir("mixtral-from-llama");
    build_mixtral_from_llama(dst, 4, 0);
    float *out = logits_of(dst, g.ids, g.T, 4096);
    double err = mq_test_rel_maxdiff(out, g.logits, (size_t)(g.T * 4096));
    fprintf(stderr, "  mixtral made of llama-tiny MLP copies vs llama-tiny golden: %.3g\n", err);
    ASSERT_TRUE(err <= 1e-4);
    moeq_model *m = NULL;
    moeq_model_options opt = {.no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(dst, &opt, &m));
    ASSERT_EQ_INT(MQ_ARCH_MIXTRAL, m->cfg.arch);
    ASSERT_TRUE(m->cfg.norm_topk_prob);
    ASSERT_EQ_STR("model.layers.0.block_sparse_moe.experts.3.w2", m->layers[0].exp_down[3].name);
    /* the router really mixes: every expert of layer 0 gets tokens */
    int hits[4] = {0};
    for (int64_t t = 0; t < g.T; t++) {
        float x[256], logit[4];
        ASSERT_OK(mq_embed(m, g.ids + t, 1, x));
        for (int e = 0; e < 4; e++) {
            logit[e] = 0;
            for (int i = 0; i < 256; i++) logit[e] += m->layers[0].router[e * 256 + i] * x[i];
        }
        int best = 0;
        for (int e = 1; e < 4; e++) best = logit[e] > logit[best] ? e : best;
        hits[best]++;
    }
    for (int e = 0; e < 4; e++) ASSERT_TRUE(hits[e] > 0);
    moeq_model_free(m);
    free(out);
    free(dst);
    free_golden(&g);
}

/* Sliding-window attention, one layer, window W: the logits at position p >= W-1 equal those of
 * the full-attention model run on the last W tokens only (RoPE is relative); before that they equal
 * the full-attention model's on the whole sequence. */
static void test_sliding_window_one_layer(void) {
    golden g;
    load_golden("llama-tiny", &g);
    const int W = 16, T = 100;   /* > ATT_QB + W: later query blocks start past key 0 */
    char *full = new_dir("mixtral-1l-full"), *win = new_dir("mixtral-1l-window");
    build_mixtral_from_llama(full, 1, 0);
    build_mixtral_from_llama(win, 1, W);
    float *a = logits_of(win, g.ids, T, 4096);
    float *b = logits_of(full, g.ids, T, 4096);
    ASSERT_TRUE(mq_test_rel_maxdiff(a, b, (size_t)(W * 4096)) == 0);
    double worst = 0;
    for (int p = W; p < T; p++) {
        float *c = logits_of(full, g.ids + p - W + 1, W, 4096);
        double e = mq_test_rel_maxdiff(a + (int64_t)p * 4096, c + (int64_t)(W - 1) * 4096, 4096);
        worst = e > worst ? e : worst;
        free(c);
    }
    fprintf(stderr, "  sliding window %d vs full attention on the last %d tokens: %.3g\n", W, W, worst);
    ASSERT_TRUE(worst <= 1e-4);
    /* token by token through the KV cache (the decode path) gives the same */
    moeq_model *m = NULL;
    moeq_model_options opt = {.no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(win, &opt, &m));
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, T, &s));
    float *d = malloc(sizeof(float) * 4096 * (size_t)T);
    for (int p = 0; p < T; p++) ASSERT_OK(moeq_session_forward(s, g.ids + p, 1, d + (int64_t)p * 4096));
    ASSERT_TRUE(mq_test_rel_maxdiff(d, a, (size_t)T * 4096) <= 1e-5);
    moeq_session_free(s);
    moeq_model_free(m);
    free(d);
    /* and the window matters */
    ASSERT_TRUE(mq_test_rel_maxdiff(a + (int64_t)(T - 1) * 4096, b + (int64_t)(T - 1) * 4096, 4096) > 1e-3);
    free(a);
    free(b);
    free(full);
    free(win);
    free_golden(&g);
}

/* Writes olmoe-tiny in dtype (F32 or F16), its experts optionally fused (as F32), optionally
 * sharded; via_f16 first rounds every value to f16 (so an F16 file and an F32 file can hold the
 * same values). */
static void resave_olmoe(const char *dst, bool fused, moeq_dtype dtype, bool via_f16,
                         size_t shard_bytes) {
    char *src = fixture("olmoe-tiny");
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(src, &st));
    mq_shard_writer *sw = NULL;
    ASSERT_OK(mq_shards_open(dst, shard_bytes, &sw));
    const int64_t E = 8, F = 256, D = 256;
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *t = mq_st_at(st, i);
        if (fused && strstr(t->name, ".experts.")) continue;
        float *v = tensor_f32(t);
        size_t es = moeq_dtype_size(dtype);
        uint8_t *buf = malloc((size_t)t->numel * es);
        for (int64_t k = 0; k < t->numel; k++) {
            uint16_t h = mq_f32_to_f16(v[k]);
            if (via_f16) v[k] = mq_f16_to_f32(h);
            if (dtype == MOEQ_DT_F32) memcpy(buf + 4 * k, &v[k], 4);
            else memcpy(buf + 2 * k, &h, 2);
        }
        ASSERT_OK(mq_shards_add(sw, t->name, dtype, t->ndim, t->shape, buf, (size_t)t->numel * es));
        free(buf);
        free(v);
    }
    for (int l = 0; fused && l < 4; l++) {
        float *gu = malloc(sizeof(float) * (size_t)(E * 2 * F * D));
        float *dn = malloc(sizeof(float) * (size_t)(E * D * F));
        for (int64_t e = 0; e < E; e++) {
            const char *parts[3] = {"gate_proj", "up_proj", "down_proj"};
            for (int k = 0; k < 3; k++) {
                char name[128];
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%lld.%s.weight", l,
                         (long long)e, parts[k]);
                float *v = tensor_f32(mq_st_find(st, name));
                float *dstp = k == 2 ? dn + e * D * F : gu + e * 2 * F * D + (k == 1 ? F * D : 0);
                memcpy(dstp, v, sizeof(float) * (size_t)(F * D));
                free(v);
            }
        }
        char name[128];
        int64_t s1[3] = {E, 2 * F, D}, s2[3] = {E, D, F};
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", l);
        ASSERT_OK(mq_shards_add(sw, name, MOEQ_DT_F32, 3, s1, gu, sizeof(float) * (size_t)(E * 2 * F * D)));
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", l);
        ASSERT_OK(mq_shards_add(sw, name, MOEQ_DT_F32, 3, s2, dn, sizeof(float) * (size_t)(E * D * F)));
        free(gu);
        free(dn);
    }
    ASSERT_OK(mq_shards_finish(sw));
    mq_shards_free(sw);
    char *cfg = read_text(src, "config.json");
    write_text(dst, "config.json", cfg);
    free(cfg);
    mq_st_close(st);
    free(src);
}

static void test_olmoe_fused_and_dtypes_bit_identical(void) {
    char *src = fixture("olmoe-tiny");
    golden g;
    load_golden("olmoe-tiny", &g);
    size_t n = (size_t)(g.T * 4096);
    float *ref = logits_of(src, g.ids, g.T, 4096);
    ASSERT_TRUE(mq_test_rel_maxdiff(ref, g.logits, n) <= 1e-4);
    /* Each variant must give exactly the logits of the one before the arrow. */
    struct {
        const char *name;
        bool fused;
        moeq_dtype dt;
        bool via_f16;
        size_t shard;
        int same_as;   /* -1: the bf16 per-expert fixture */
    } v[] = {
        {"olmoe-fused-f32", true, MOEQ_DT_F32, false, (size_t)1 << 40, -1},
        {"olmoe-fused-sharded", true, MOEQ_DT_F32, false, (size_t)8 << 20, -1},
        {"olmoe-f16-values-f32", false, MOEQ_DT_F32, true, (size_t)1 << 40, -2},
        {"olmoe-f16", false, MOEQ_DT_F16, true, (size_t)1 << 40, 2},
    };
    float *outs[4] = {0};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        char *dst = new_dir(v[i].name);
        resave_olmoe(dst, v[i].fused, v[i].dt, v[i].via_f16, v[i].shard);
        if (v[i].shard < ((size_t)1 << 30)) {
            char *idx = mq_path_join(dst, "model.safetensors.index.json");
            ASSERT_TRUE(access(idx, R_OK) == 0);
            free(idx);
        }
        outs[i] = logits_of(dst, g.ids, g.T, 4096);
        const float *want = v[i].same_as == -1 ? ref : v[i].same_as >= 0 ? outs[v[i].same_as] : NULL;
        if (want && memcmp(outs[i], want, sizeof(float) * n) != 0)
            FAIL("%s: logits differ from its twin (rel %.3g)", v[i].name,
                 mq_test_rel_maxdiff(outs[i], want, n));
        if (!want)   /* f16 rounding moves the result a little, not a lot */
            ASSERT_TRUE(mq_test_rel_maxdiff(outs[i], ref, n) < 0.05);
        free(dst);
    }
    for (int i = 0; i < 4; i++) free(outs[i]);
    free(ref);
    free_golden(&g);
    free(src);
}

/* The streaming pipeline's lazy loader converts in pieces (mq_lazy_set_piece): pieces of 1,
 * 1000 (dividing no tensor) and the default give every decoder weight of the bf16 fixture and of
 * its fused-experts fp32 resave (experts as slices of one tensor) bit for bit as the whole-model
 * load does. */
static int linear_differs(const mq_linear *a, const mq_linear *b) {
    if (!a->w && !b->w) return 0;
    if (!a->w || !b->w || a->out != b->out || a->in != b->in) return 1;
    return memcmp(a->w, b->w, sizeof(float) * (size_t)(a->out * a->in)) != 0;
}

static void check_lazy_pieces(const char *dir) {
    moeq_model *full = mq_test_open_model(dir, NULL);
    if (!full) return;
    const int64_t pieces[] = {1, 1000, 0};
    for (size_t k = 0; k < sizeof pieces / sizeof pieces[0]; k++) {
        mq_lazy_model *lz = NULL;
        ASSERT_OK(mq_lazy_open(dir, false, &lz));
        if (!lz) break;
        mq_lazy_set_piece(lz, pieces[k]);
        moeq_model *m = mq_lazy_model_of(lz);
        const unsigned all = MQ_PART_ATTN | MQ_PART_FFN_NORM | MQ_PART_ROUTER | MQ_PART_MLP |
                             MQ_PART_SHARED | MQ_PART_EXPERTS;
        int bad = 0, seen = 0;
        for (int l = 0; l < m->cfg.n_layers; l++) {
            ASSERT_OK(mq_lazy_load(lz, l, all, 0, m->cfg.n_experts));
            const mq_layer *a = &m->layers[l], *b = &full->layers[l];
            const mq_linear *la[] = {&a->q, &a->k, &a->v, &a->o}, *lb[] = {&b->q, &b->k, &b->v, &b->o};
            for (int i = 0; i < 4; i++) bad += linear_differs(la[i], lb[i]), seen += la[i]->w != NULL;
            for (int e = 0; e < m->cfg.n_experts; e++) {
                bad += linear_differs(&a->exp_gate[e], &b->exp_gate[e]) + linear_differs(&a->exp_up[e], &b->exp_up[e]) +
                       linear_differs(&a->exp_down[e], &b->exp_down[e]);
                seen += 3 * (a->exp_gate[e].w != NULL);
            }
            if (m->cfg.n_experts > 0)
                bad += memcmp(a->router, b->router, sizeof(float) * (size_t)(m->cfg.n_experts * m->cfg.D)) != 0;
            mq_lazy_release(lz, l, all, 0, m->cfg.n_experts);
        }
        if (bad) FAIL("%s, pieces of %lld: %d weights differ from the whole-model load", dir, (long long)pieces[k], bad);
        ASSERT_EQ_INT(4 * 4 + 4 * 8 * 3, seen);   /* olmoe-tiny: 4 layers of 4 + 8 x 3 */
        mq_lazy_close(lz);
    }
    moeq_model_free(full);
}

/* The read-ahead (mq_lazy_ahead_*): experts [e0, e1) of every layer, finished at once (the pool
 * converts what the thread has not), finished after the thread had time, or cancelled, in
 * pieces of 1000 values and of the default: the weights equal the whole-model load bit for bit,
 * a load after the finish keeps its buffers (they count as loaded), a cancel frees them, and
 * what is loaded already is not read ahead. */
static void check_lazy_ahead(const char *dir) {
    moeq_model *full = mq_test_open_model(dir, NULL);
    if (!full) return;
    const int64_t pieces[] = {1000, 0};
    for (size_t k = 0; k < 2; k++) {
        mq_lazy_model *lz = NULL;
        ASSERT_OK(mq_lazy_open(dir, false, &lz));
        if (!lz) break;
        mq_lazy_set_piece(lz, pieces[k]);
        moeq_model *m = mq_lazy_model_of(lz);
        const int E = m->cfg.n_experts;
        for (int l = 0; l < m->cfg.n_layers; l++) {
            const mq_layer *a = &m->layers[l], *b = &full->layers[l];
            for (int how = 0; how < 3; how++) {   /* finish at once, finish later, cancel */
                const int e0 = how == 1 ? 3 : 0, e1 = how == 1 ? E : 3;
                mq_lazy_ahead *ah = NULL;
                ASSERT_OK(mq_lazy_ahead_start(lz, l, MQ_PART_EXPERTS, e0, e1, &ah));
                if (!ah) FAIL("%s layer %d: experts %d..%d not read ahead", dir, l, e0, e1);
                if (how == 1) {
                    struct timespec ts = {0, 20 * 1000 * 1000};
                    nanosleep(&ts, NULL);
                }
                if (how == 2) {
                    mq_lazy_ahead_cancel(ah);
                    for (int e = e0; e < e1; e++)
                        if (a->exp_gate[e].w || a->exp_up[e].w || a->exp_down[e].w)
                            FAIL("%s layer %d expert %d: kept after the cancel", dir, l, e);
                    continue;
                }
                int64_t by = -1, n = -1;
                ASSERT_OK(mq_lazy_ahead_finish(ah, &by, &n));
                const int64_t per = pieces[k] ? ((int64_t)m->cfg.moe_ffn * m->cfg.D + pieces[k] - 1) / pieces[k] : 1;
                ASSERT_EQ_INT(3 * (e1 - e0) * per, n);
                if (by < 0 || by > n) FAIL("%s: %lld of %lld pieces by the thread", dir, (long long)by, (long long)n);
                const float *kept = a->exp_down[e0].w;
                ASSERT_OK(mq_lazy_load(lz, l, MQ_PART_EXPERTS, e0, e1));
                if (a->exp_down[e0].w != kept) FAIL("%s: the load replaced a read-ahead buffer", dir);
                int bad = 0;
                for (int e = e0; e < e1; e++)
                    bad += linear_differs(&a->exp_gate[e], &b->exp_gate[e]) + linear_differs(&a->exp_up[e], &b->exp_up[e]) +
                           linear_differs(&a->exp_down[e], &b->exp_down[e]) + !a->exp_gate[e].w;
                if (bad) FAIL("%s layer %d, pieces of %lld: %d expert weights differ from the whole-model load", dir, l,
                              (long long)pieces[k], bad);
                ASSERT_OK(mq_lazy_ahead_start(lz, l, MQ_PART_EXPERTS, e0, e1, &ah));
                if (ah) FAIL("%s: loaded experts read ahead again", dir);
                mq_lazy_release(lz, l, MQ_PART_EXPERTS, 0, E);
            }
            /* the attention's parts (the next layer's, read during the last chunk) */
            const unsigned att = MQ_PART_ATTN | MQ_PART_FFN_NORM | MQ_PART_ROUTER;
            mq_lazy_ahead *ah = NULL;
            ASSERT_OK(mq_lazy_ahead_start(lz, l, att, 0, 0, &ah));
            if (!ah) FAIL("%s layer %d: the attention not read ahead", dir, l);
            ASSERT_OK(mq_lazy_ahead_finish(ah, NULL, NULL));
            const mq_linear *la[] = {&a->q, &a->k, &a->v, &a->o}, *lb[] = {&b->q, &b->k, &b->v, &b->o};
            int bad = 0;
            for (int i = 0; i < 4; i++) bad += linear_differs(la[i], lb[i]) + !la[i]->w;
            bad += memcmp(a->router, b->router, sizeof(float) * (size_t)(E * m->cfg.D)) != 0;
            bad += memcmp(a->ffn_norm, b->ffn_norm, sizeof(float) * (size_t)m->cfg.D) != 0;
            if (bad) FAIL("%s layer %d: %d attention weights differ from the whole-model load", dir, l, bad);
            mq_lazy_release(lz, l, att, 0, 0);
        }
        mq_lazy_close(lz);
    }
    moeq_model_free(full);
}

static void test_lazy_pieces_bit_identical(void) {
    char *src = fixture("olmoe-tiny");
    check_lazy_pieces(src);
    check_lazy_ahead(src);
    char *dst = new_dir("olmoe-lazy-fused");
    resave_olmoe(dst, true, MOEQ_DT_F32, false, (size_t)8 << 20);
    check_lazy_pieces(dst);
    check_lazy_ahead(dst);
    free(dst);
    free(src);
}

/* ---- broken checkpoints -------------------------------------------------------------------- */
static void test_missing_and_misshapen_listed_together(void) {
    char *src = fixture("olmoe-tiny");
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(src, &st));
    char *dst = new_dir("olmoe-broken");
    mq_st_writer *w = mq_stw_new();
    float small[7 * 256] = {0};
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *t = mq_st_at(st, i);
        if (!strcmp(t->name, "model.layers.1.self_attn.q_proj.weight")) continue;
        if (!strcmp(t->name, "model.layers.3.mlp.experts.5.up_proj.weight")) continue;
        if (!strcmp(t->name, "model.layers.2.mlp.gate.weight")) {
            int64_t shape[2] = {7, 256};
            add_f32(w, t->name, 2, shape, small);
            continue;
        }
        if (!strcmp(t->name, "model.norm.weight")) {   /* an integer dtype */
            ASSERT_OK(mq_stw_add(w, t->name, MOEQ_DT_I16, t->ndim, t->shape, t->data, t->nbytes));
            continue;
        }
        add_copy(w, t);
    }
    mq_test_write_model_st(w, dst);
    char *cfg = read_text(src, "config.json");
    write_text(dst, "config.json", cfg);
    moeq_model *m = NULL;
    ASSERT_STATUS(MOEQ_E_SHAPE, moeq_model_open(dst, NULL, &m));
    ASSERT_TRUE(m == NULL);
    fprintf(stderr, "  message: %s\n", moeq_last_error());
    ASSERT_ERROR_MENTIONS(dst);
    ASSERT_ERROR_MENTIONS("4 problems");
    ASSERT_ERROR_MENTIONS("missing tensor 'model.layers.1.self_attn.q_proj.weight' (expected [256, 256])");
    ASSERT_ERROR_MENTIONS("missing tensor 'model.layers.3.mlp.experts.5.up_proj.weight'");
    ASSERT_ERROR_MENTIONS("tensor 'model.layers.2.mlp.gate.weight': expected shape [8, 256], found [7, 256]");
    ASSERT_ERROR_MENTIONS("tensor 'model.norm.weight' has dtype I16");
    free(cfg);
    free(dst);
    mq_st_close(st);
    free(src);
}

static void test_layer_count_mismatch(void) {
    char *src = fixture("olmoe-tiny");
    char *cfg = read_text(src, "config.json");
    const char *variants[2][2] = {{"\"num_hidden_layers\": 3", "tensors for layer 3"},
                                  {"\"num_hidden_layers\": 5", "layer 4: none of its 33 tensors"}};
    for (int i = 0; i < 2; i++) {
        char name[32];
        snprintf(name, sizeof name, "layers-%d", i);
        char *dst = new_dir(name);
        char *link = mq_path_join(dst, "model.safetensors"), *target = mq_path_join(src, "model.safetensors");
        ASSERT_TRUE(symlink(target, link) == 0);
        char *c = replace(cfg, "\"num_hidden_layers\": 4", variants[i][0]);
        write_text(dst, "config.json", c);
        moeq_model *m = NULL;
        ASSERT_STATUS(MOEQ_E_SHAPE, moeq_model_open(dst, NULL, &m));
        ASSERT_ERROR_MENTIONS(variants[i][1]);
        ASSERT_ERROR_MENTIONS("1 problem");
        free(c);
        free(link);
        free(target);
        free(dst);
    }
    free(cfg);
    free(src);
}

static void test_bad_directories_and_configs(void) {
    moeq_model *m = NULL;
    char *none = mq_path_join(mq_test_tmpdir(), "no-such-model");
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_model_open(none, NULL, &m));
    ASSERT_ERROR_MENTIONS("no-such-model");
    char *empty = new_dir("empty-model");
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_model_open(empty, NULL, &m));
    ASSERT_ERROR_MENTIONS("config.json");
    char *src = fixture("olmoe-tiny");
    char *cfg = read_text(src, "config.json");
    /* config but no weights */
    write_text(empty, "config.json", cfg);
    ASSERT_TRUE(moeq_model_open(empty, NULL, &m) != MOEQ_OK);
    ASSERT_ERROR_MENTIONS("empty-model");
    /* unknown model_type */
    char *c = replace(cfg, "\"model_type\": \"olmoe\"", "\"model_type\": \"deepseek_v2\"");
    write_text(empty, "config.json", c);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_model_open(empty, NULL, &m));
    ASSERT_ERROR_MENTIONS("deepseek_v2");
    ASSERT_ERROR_MENTIONS("mixtral");
    free(c);
    /* missing fields, all named */
    char *c1 = replace(cfg, "\"hidden_size\": 256,", "");
    char *c2 = replace(c1, "\"num_experts\": 8,", "");
    write_text(empty, "config.json", c2);
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_model_open(empty, NULL, &m));
    ASSERT_ERROR_MENTIONS("config.json");
    ASSERT_ERROR_MENTIONS("'hidden_size'");
    ASSERT_ERROR_MENTIONS("'num_experts'");
    ASSERT_TRUE(m == NULL);
    free(c1);
    free(c2);
    free(cfg);
    free(src);
    free(empty);
    free(none);
}

/* Out-of-range token ids and session limits are errors, not crashes. */
static void test_session_errors(void) {
    /* any 4-layer model with D 256 and 4096 tokens: llama-tiny, or the bundled olmoe-tiny */
    char *src = fixture(mq_test_have_shared() ? "llama-tiny" : "olmoe-tiny");
    moeq_model *m = NULL;
    moeq_model_options opt = {.no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(src, &opt, &m));
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, 4, &s));
    int32_t ids[5] = {1, 2, 4096, 3, 4};
    float logits[5 * 4096];
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_forward(s, ids, 3, logits));
    ASSERT_ERROR_MENTIONS("4096");
    ASSERT_EQ_INT(0, moeq_session_pos(s));
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_forward(s, ids + 3, 5, logits));
    ids[2] = 7;
    ASSERT_OK(moeq_session_forward(s, ids, 4, logits));
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_forward(s, ids, 1, logits));
    ASSERT_ERROR_MENTIONS("session full");
    moeq_session_reset(s);
    ASSERT_OK(moeq_session_forward(s, ids, 1, logits));
    moeq_session *s2 = NULL;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_session_create(m, 0, &s2));
    ASSERT_TRUE(s2 == NULL);
    moeq_session_free(s);
    /* a state filled to 2 positions cannot take a chunk at position 3 */
    mq_state *st = NULL;
    ASSERT_OK(mq_state_new(m, 8, &st));
    float x[256];
    ASSERT_OK(mq_embed(m, ids, 1, x));
    ASSERT_STATUS(MOEQ_E_ARG, mq_forward_layers(m, st, x, 1, 3, 0, 4, NULL));
    ASSERT_STATUS(MOEQ_E_ARG, mq_forward_layers(m, st, x, 1, 0, 0, 5, NULL));
    mq_state_free(st);
    moeq_model_free(m);
    free(src);
}

TEST_MAIN(T(test_mixtral_from_llama_copies), T(test_lazy_pieces_bit_identical), T(test_sliding_window_one_layer),
          T(test_olmoe_fused_and_dtypes_bit_identical),
          T(test_missing_and_misshapen_listed_together), T(test_layer_count_mismatch),
          T(test_bad_directories_and_configs), T(test_session_errors))
