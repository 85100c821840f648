/* GGUF files read in place (moeq_model_open and the lazy model on a .gguf path, io/gguf_hf.h):
 *  - every view against the file's raw tensors decoded here with the test's own indexing (expert
 *    slices, llama's q/k rows, NVFP4 times NAME.scale, deepseek2's kv_b merged), bit for bit, and
 *    any range of a view (block-cut, row-cut) equal to that slice of the whole;
 *  - llama, olmoe, qwen2moe, qwen3moe, Mixtral and deepseek2 files, whole and streamed, with and
 *    without act_quant q8_0, evaluate exactly as their imported checkpoints (moeq_import_gguf), and
 *    the Q4_0 ones compute the logits of the compressed-tensors checkpoint they were written from;
 *  - F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and NVFP4 (one scale per expert too), from
 *    files retyped here with blocks of made-up codes;
 *  - a streamed open holds no weights (weight_bytes is one layer and the output layer, the anonymous
 *    memory does not grow by the model), a lazy load in odd pieces equals the whole load;
 *  - corrupt and truncated files fail with errors naming the file. */
#define _GNU_SOURCE   /* memmem */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <unistd.h>

#include "export/gguf_export.h"
#include "harness.h"
#include "io/gguf.h"
#include "io/gguf_hf.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

/* ---- files ------------------------------------------------------------------------------------ */

/* model quantized to a compressed-tensors checkpoint (f16 scales) and exported with rest:
 * ckpt and file are filled (static buffers of the caller). */
static void make_gguf(const char *model, const char *tag, mq_qscheme sch, int group, bool asym, mq_gguf_rest rest,
                      const char *ignore, char ckpt[1100], char file[1100]) {
    snprintf(ckpt, 1100, "%s/%s-ct", mq_test_tmpdir(), tag);
    snprintf(file, 1100, "%s/%s.gguf", mq_test_tmpdir(), tag);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, sch, MQ_FMT_CT);
    o.spec.scale_dtype = MOEQ_DT_F16;
    if (sch == MQ_QS_INT4) o.spec.group_size = group, o.spec.asym = asym;
    const char *ign[1] = {ignore};
    if (ignore) o.ignore = ign, o.n_ignore = 1;
    ASSERT_OK(mq_pipeline_run(model, ckpt, &o, NULL));
    ASSERT_OK(mq_gguf_export(ckpt, file, rest));
}

static bool ends(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* n values' worth of blocks of type in dst: made-up codes with scales small enough for finite
 * logits, except Q8_0 and the float types, which encode x (the source's values). */
static void encode(uint32_t type, const float *x, int64_t n, uint8_t *dst, uint64_t *rng) {
    int64_t blk;
    size_t bb;
    ASSERT_TRUE(mq_ggml_type_info(type, NULL, &blk, &bb));
    for (int64_t b = 0; b < n / blk; b++) {
        uint8_t *p = dst + (size_t)b * bb;
        const float *v = x + b * blk;
        for (size_t i = 0; i < bb; i++) p[i] = (uint8_t)rng_next(rng);
        const uint16_t sign = (rng_next(rng) & 1) ? 0x8000 : 0;
        switch (type) {
        case MQ_GGML_F32: memcpy(p, v, 4); break;
        case MQ_GGML_F16: put16(p, mq_f32_to_f16(v[0])); break;
        case MQ_GGML_BF16: put16(p, mq_f32_to_bf16(v[0])); break;
        case MQ_GGML_Q8_0: mq_ggml_put_q8_0(p, v); break;
        case MQ_GGML_Q4_0: put16(p, (uint16_t)(sign | mq_f32_to_f16(0.004f))); break;
        case MQ_GGML_Q4_1:
            put16(p, mq_f32_to_f16(0.003f));
            put16(p + 2, (uint16_t)(sign | mq_f32_to_f16(0.02f)));
            break;
        case MQ_GGML_Q4_K:
        case MQ_GGML_Q5_K:
            put16(p, mq_f32_to_f16(0.0002f));
            put16(p + 2, mq_f32_to_f16(0.0004f));
            break;
        case MQ_GGML_Q6_K: put16(p + 208, (uint16_t)(sign | mq_f32_to_f16(0.00002f))); break;
        case MQ_GGML_NVFP4:
            for (int s = 0; s < 4; s++) p[s] = (uint8_t)(0x18 + (rng_next(rng) & 7));   /* E4M3 2^-4 .. */
            break;
        default: FAIL("type %u", type);
        }
    }
}

typedef uint32_t (*type_fn)(const char *name, const mq_gguf_tensor *t);

static bool is_scale(const char *name) { return ends(name, ".scale"); }

/* src rewritten to dst with each tensor of the type choose() gives (its own where that returns
 * it): the KVs copied, the values re-encoded (encode), src's NAME.scale tensors dropped and each
 * NVFP4 weight given a NAME.scale of its own, one value per matrix (0.5, 0.75, 1, ...). */
static void retype(const char *src, const char *dst, type_fn choose) {
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(src, &g));
    mq_gguf_writer *w = mq_gguf_writer_new();
    for (size_t i = 0; i < mq_gguf_kv_count(g); i++) {
        const mq_gguf_kv *kv = mq_gguf_kv_at(g, i);
        double d;
        switch (kv->type) {
        case MQ_GGUF_U32: mq_gguf_kv_num_at(kv, 0, &d), mq_gguf_kv_u32(w, kv->key, (uint32_t)d); break;
        case MQ_GGUF_I32: mq_gguf_kv_num_at(kv, 0, &d), mq_gguf_kv_i32(w, kv->key, (int32_t)d); break;
        case MQ_GGUF_F32: mq_gguf_kv_num_at(kv, 0, &d), mq_gguf_kv_f32(w, kv->key, (float)d); break;
        case MQ_GGUF_BOOL: mq_gguf_kv_bool(w, kv->key, kv->data[0] != 0); break;
        case MQ_GGUF_STRING: {
            char *v = mq_strndup((const char *)kv->data, (size_t)kv->n);
            mq_gguf_kv_str(w, kv->key, v);
            free(v);
            break;
        }
        case MQ_GGUF_ARRAY:
            if (kv->arr_type == MQ_GGUF_STRING) {
                const char **s = malloc(sizeof *s * (size_t)(kv->n + 1));
                size_t *l = malloc(sizeof *l * (size_t)(kv->n + 1));
                for (uint64_t k = 0; k < kv->n; k++) mq_gguf_kv_str_at(kv, k, &s[k], &l[k]);
                mq_gguf_kv_arr_str(w, kv->key, s, l, kv->n);
                free(s);
                free(l);
            } else if (kv->arr_type == MQ_GGUF_I32) {
                int32_t *v = malloc(sizeof *v * (size_t)(kv->n + 1));
                for (uint64_t k = 0; k < kv->n; k++) mq_gguf_kv_num_at(kv, k, &d), v[k] = (int32_t)d;
                mq_gguf_kv_arr_i32(w, kv->key, v, kv->n);
                free(v);
            } else {
                FAIL("KV %s: array of %u", kv->key, kv->arr_type);
            }
            break;
        default: FAIL("KV %s: type %u", kv->key, kv->type);
        }
    }
    const size_t n = mq_gguf_tensor_count(g);
    uint32_t *types = calloc(n, sizeof *types);
    for (size_t i = 0; i < n; i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        types[i] = choose(t->name, t);
        if (!is_scale(t->name)) ASSERT_OK(mq_gguf_writer_tensor(w, t->name, t->n_dims, t->ne, types[i]));
    }
    for (size_t i = 0; i < n; i++) {   /* the scales after every tensor, in the same order */
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        size_t nl = strlen(t->name);
        if (types[i] != MQ_GGML_NVFP4 || nl < 8 || strcmp(t->name + nl - 7, ".weight")) continue;
        char sn[200];
        snprintf(sn, sizeof sn, "%.*s.scale", (int)(nl - 7), t->name);
        int64_t ne[1] = {t->n_dims == 3 ? t->ne[2] : 1};
        ASSERT_OK(mq_gguf_writer_tensor(w, sn, 1, ne, MQ_GGML_F32));
    }
    FILE *f = fopen(dst, "wb");
    ASSERT_TRUE(f != NULL);
    ASSERT_OK(mq_gguf_writer_begin(w, f, dst));
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        if (is_scale(t->name)) continue;
        int64_t blk;
        size_t bb;
        mq_ggml_type_info(types[i], NULL, &blk, &bb);
        float *x = malloc(sizeof(float) * (size_t)t->numel);
        uint8_t *y = malloc((size_t)(t->numel / blk) * bb);
        ASSERT_OK(mq_gguf_tensor_to_f32(t, x));
        if (types[i] == t->type) memcpy(y, t->data, t->nbytes);
        else encode(types[i], x, t->numel, y, &rng);
        ASSERT_OK(mq_gguf_writer_data(w, y, (size_t)(t->numel / blk) * bb));
        free(x);
        free(y);
    }
    for (size_t i = 0; i < n; i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        size_t nl = strlen(t->name);
        if (types[i] != MQ_GGML_NVFP4 || nl < 8 || strcmp(t->name + nl - 7, ".weight")) continue;
        for (int64_t e = 0; e < (t->n_dims == 3 ? t->ne[2] : 1); e++) {
            float v = 0.5f + 0.25f * (float)e;
            ASSERT_OK(mq_gguf_writer_data(w, &v, 4));
        }
    }
    ASSERT_OK(mq_gguf_writer_end(w));
    fclose(f);
    mq_gguf_writer_free(w);
    free(types);
    mq_gguf_close(g);
}

/* olmoe: every ggml type somewhere; layer 1's experts NVFP4 with a scale per expert, the output
 * NVFP4 with one scale, the embeddings Q4_K (rows read one at a time by the streamed embed). */
static uint32_t olmoe_types(const char *name, const mq_gguf_tensor *t) {
    if (t->n_dims == 1) return t->type;
    if (!strcmp(name, "token_embd.weight")) return MQ_GGML_Q4_K;
    if (!strcmp(name, "output.weight")) return MQ_GGML_NVFP4;
    const bool odd = strstr(name, "blk.1.") || strstr(name, "blk.3.");
    if (ends(name, "attn_q.weight")) return odd ? MQ_GGML_BF16 : MQ_GGML_F16;
    if (ends(name, "attn_k.weight")) return odd ? MQ_GGML_F16 : MQ_GGML_BF16;
    if (ends(name, "attn_v.weight")) return MQ_GGML_Q8_0;
    if (ends(name, "attn_output.weight")) return MQ_GGML_Q4_1;
    if (ends(name, "ffn_gate_inp.weight")) return MQ_GGML_F32;
    if (strstr(name, "blk.1.") && strstr(name, "_exps.")) return MQ_GGML_NVFP4;
    if (ends(name, "ffn_gate_exps.weight")) return MQ_GGML_Q4_K;
    if (ends(name, "ffn_up_exps.weight")) return MQ_GGML_Q5_K;
    if (ends(name, "ffn_down_exps.weight")) return MQ_GGML_Q6_K;
    return t->type;
}

/* llama (q/k rows permuted in the file): K-quants and NVFP4 on the permuted rows. */
static uint32_t llama_types(const char *name, const mq_gguf_tensor *t) {
    if (t->n_dims == 1) return t->type;
    if (!strcmp(name, "token_embd.weight")) return MQ_GGML_Q6_K;   /* tied: lm_head too */
    const bool odd = strstr(name, "blk.1.") || strstr(name, "blk.3.");
    if (ends(name, "attn_q.weight")) return odd ? MQ_GGML_NVFP4 : MQ_GGML_Q6_K;
    if (ends(name, "attn_k.weight")) return odd ? MQ_GGML_Q4_0 : MQ_GGML_Q5_K;
    if (ends(name, "attn_v.weight")) return MQ_GGML_Q4_K;
    if (ends(name, "attn_output.weight")) return MQ_GGML_Q8_0;
    if (ends(name, "ffn_gate.weight")) return MQ_GGML_F16;
    if (ends(name, "ffn_up.weight")) return MQ_GGML_BF16;
    if (ends(name, "ffn_down.weight")) return MQ_GGML_Q4_K;
    return t->type;
}

/* ---- views against the raw tensors ------------------------------------------------------------- */

/* The expected values of HF tensor `name` of file g (test's own indexing), or NULL when the test
 * does not know the name. */
static float *expected_view(const mq_gguf *g, const char *name, bool llama, int64_t H, int64_t KV, int64_t *n) {
    char gn[200] = "", kind[64];
    int l = -1, e = -1;
    float *x = NULL;
    const mq_gguf_tensor *t = NULL;
    int64_t heads = 0;
    static const char *const exps[3][2] = {{"gate_proj", "ffn_gate_exps"}, {"up_proj", "ffn_up_exps"},
                                           {"down_proj", "ffn_down_exps"}};
    if (sscanf(name, "model.layers.%d.mlp.experts.%d.%63[a-z_]", &l, &e, kind) == 3) {
        for (int i = 0; i < 3; i++)
            if (!strcmp(kind, exps[i][0])) snprintf(gn, sizeof gn, "blk.%d.%s.weight", l, exps[i][1]);
        if (!gn[0]) return NULL;
    } else if (sscanf(name, "model.layers.%d.self_attn.%63[a-z_]", &l, kind) == 2 && ends(name, ".weight")) {
        static const char *const att[4][2] = {{"q_proj", "attn_q"}, {"k_proj", "attn_k"}, {"v_proj", "attn_v"},
                                              {"o_proj", "attn_output"}};
        gn[0] = 0;
        for (int i = 0; i < 4; i++)
            if (!strcmp(kind, att[i][0])) snprintf(gn, sizeof gn, "blk.%d.%s.weight", l, att[i][1]);
        if (llama && !strcmp(kind, "q_proj")) heads = H;
        if (llama && !strcmp(kind, "k_proj")) heads = KV;
        if (!gn[0]) return NULL;
    } else if (!strcmp(name, "model.embed_tokens.weight")) {
        snprintf(gn, sizeof gn, "token_embd.weight");
    } else if (!strcmp(name, "lm_head.weight")) {
        snprintf(gn, sizeof gn, "output.weight");
    } else {
        return NULL;
    }
    t = mq_gguf_find_tensor(g, gn);
    if (!t) return NULL;
    float *all = malloc(sizeof(float) * (size_t)t->numel);
    ASSERT_OK(mq_gguf_tensor_to_f32(t, all));
    const int64_t rows = t->ne[1], cols = t->ne[0], per = rows * cols, ex = e >= 0 ? e : 0;
    x = malloc(sizeof(float) * (size_t)per);
    memcpy(x, all + ex * per, sizeof(float) * (size_t)per);
    if (heads) {   /* GGUF row h*hd + 2i + j holds HF row h*hd + j*hd/2 + i */
        const int64_t hd = rows / heads;
        for (int64_t h = 0; h < heads; h++)
            for (int64_t i = 0; i < hd / 2; i++)
                for (int64_t j = 0; j < 2; j++)
                    memcpy(x + (h * hd + j * hd / 2 + i) * cols, all + (h * hd + 2 * i + j) * cols,
                           sizeof(float) * (size_t)cols);
    }
    char sn[220];
    snprintf(sn, sizeof sn, "%.*s.scale", (int)(strlen(gn) - 7), gn);
    const mq_gguf_tensor *sc = mq_gguf_find_tensor(g, sn);
    if (sc) {   /* NVFP4's global scale: matrix ex's entry */
        float *sv = malloc(sizeof(float) * (size_t)sc->numel);
        ASSERT_OK(mq_gguf_tensor_to_f32(sc, sv));
        for (int64_t k = 0; k < per; k++) x[k] *= sv[ex];
        free(sv);
    }
    free(all);
    *n = per;
    return x;
}

/* Every view of file: whole against the raw tensor (where the test knows the name), and random
 * ranges (block- and row-cutting) against the whole. Returns how many views were checked raw. */
static int check_views(const char *file, bool llama, int64_t H, int64_t KV) {
    mq_st *st;
    mq_gguf_docs d;
    ASSERT_OK(mq_st_open_gguf(file, false, &st, &d));
    ASSERT_TRUE(d.tokenizer == NULL && d.config && d.types);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    uint64_t rng = 12345;
    int raw = 0;
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *v = mq_st_at(st, i);
        ASSERT_TRUE(v->ggml != NULL && !strcmp(v->file, file));
        float *whole = malloc(sizeof(float) * (size_t)v->numel), *part = malloc(sizeof(float) * (size_t)v->numel);
        ASSERT_OK(mq_tensor_to_f32(v, whole));
        int64_t n = 0;
        float *want = expected_view(g, v->name, llama, H, KV, &n);
        if (want) {
            ASSERT_EQ_INT(v->numel, n);
            mq_test_same_floats(want, whole, n, v->name);
            raw++;
        }
        free(want);
        for (int k = 0; k < 12; k++) {
            int64_t a = (int64_t)(rng_next(&rng) % (uint64_t)v->numel), b = (int64_t)(rng_next(&rng) % (uint64_t)v->numel);
            if (k == 0) a = 0, b = v->numel;   /* all of it through the range call */
            if (a > b) {
                int64_t c = a;
                a = b, b = c;
            }
            ASSERT_OK(mq_tensor_range_to_f32(v, a, b, part));
            mq_test_same_floats(whole + a, part, b - a, v->name);
        }
        free(whole);
        free(part);
    }
    mq_gguf_close(g);
    mq_gguf_docs_free(&d);
    mq_st_close(st);
    return raw;
}

static void test_views_olmoe_every_type(void) {
    char ckpt[1100], file[1100], re[1100];
    make_gguf(mq_test_model("olmoe-tiny"), "olmoe-f32", MQ_QS_INT4, 32, false, MQ_GGUF_REST_F32, NULL, ckpt, file);
    ASSERT_TRUE(check_views(file, false, 4, 4) == 2 + 4 * (4 + 3 * 8));
    snprintf(re, sizeof re, "%s/olmoe-retyped.gguf", mq_test_tmpdir());
    retype(file, re, olmoe_types);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(re, &g));
    ASSERT_EQ_INT(MQ_GGML_Q5_K, mq_gguf_find_tensor(g, "blk.2.ffn_up_exps.weight")->type);
    ASSERT_EQ_INT(8, mq_gguf_find_tensor(g, "blk.1.ffn_down_exps.scale")->numel);
    mq_gguf_close(g);
    ASSERT_TRUE(check_views(re, false, 4, 4) == 2 + 4 * (4 + 3 * 8));
}

static void test_views_llama_permuted(void) {
    char ckpt[1100], file[1100], re[1100], model[1024];
    snprintf(model, sizeof model, "%s", mq_test_shared("fixtures/models/llama-tiny"));
    make_gguf(model, "llama-f32", MQ_QS_INT4, 32, false, MQ_GGUF_REST_F32, NULL, ckpt, file);
    ASSERT_TRUE(check_views(file, true, 4, 2) == 1 + 4 * 4);
    snprintf(re, sizeof re, "%s/llama-retyped.gguf", mq_test_tmpdir());
    retype(file, re, llama_types);
    ASSERT_TRUE(check_views(re, true, 4, 2) == 1 + 4 * 4);   /* NVFP4 q rows: scaled and permuted */
    mq_st *st;
    mq_gguf_docs d;
    ASSERT_OK(mq_st_open_gguf(re, true, &st, &d));
    ASSERT_TRUE(d.tokenizer != NULL);
    const mq_tensor_view *q = mq_st_find(st, "model.layers.1.self_attn.q_proj.weight");
    ASSERT_TRUE(q && q->ggml->type == MQ_GGML_NVFP4 && q->ggml->scaled && q->ggml->perm_hd == 64);
    ASSERT_TRUE(q->ggml->scale == 0.5f);
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(d.types, "lm_head.weight");
    ASSERT_TRUE(cJSON_IsString(ty) && !strcmp(ty->valuestring, "q6_K"));   /* tied: token_embd's */
    mq_gguf_docs_free(&d);
    mq_st_close(st);
}

/* ---- models: direct against imported ---------------------------------------------------------- */

static moeq_docs *text_docs(void) {
    static const int len[] = {300, 500, 90};
    return mq_test_calib_docs(len, 3);
}

typedef struct {
    double ll, doc[3];
    int64_t tokens;
} ev;

static ev eval_of(const char *path, int stream, int act_quant, moeq_docs *docs) {
    moeq_model_options mo = {.stream = stream, .act_quant = act_quant};
    moeq_model *m = NULL;
    ev r;
    memset(&r, 0, sizeof r);
    ASSERT_OK(moeq_model_open(path, &mo, &m));
    if (!m) return r;
    moeq_eval_options o = mq_test_text_eval(40, NULL);
    o.doc_loglikelihood = r.doc;
    moeq_eval_result res;
    ASSERT_OK(moeq_eval(m, docs, &o, &res));
    ASSERT_EQ_INT(stream, res.plan.streamed);
    r.ll = res.loglikelihood;
    r.tokens = res.tokens;
    moeq_model_free(m);
    return r;
}

static void same_eval(const ev *a, const ev *b, const char *what) {
    if (!(a->ll == b->ll)) FAIL("%s: loglikelihood %.17g against %.17g", what, a->ll, b->ll);
    ASSERT_EQ_INT(a->tokens, b->tokens);
    for (int d = 0; d < 3; d++)
        if (!(a->doc[d] == b->doc[d])) FAIL("%s: document %d: %.17g against %.17g", what, d, a->doc[d], b->doc[d]);
}

/* Logits of one forward of the models at paths a and b (whole), bit for bit, and the same token ids
 * from their tokenizers. */
static void same_logits(const char *a, const char *b, int act_quant, const char *what) {
    moeq_model_options mo = {.act_quant = act_quant};
    moeq_model *ma = NULL, *mb = NULL;
    ASSERT_OK(moeq_model_open(a, &mo, &ma));
    ASSERT_OK(moeq_model_open(b, &mo, &mb));
    if (!ma || !mb) return;
    const moeq_model_info *ia = moeq_model_get_info(ma), *ib = moeq_model_get_info(mb);
    ASSERT_EQ_STR(ia->model_type, ib->model_type);
    ASSERT_EQ_INT(ia->n_params, ib->n_params);
    ASSERT_EQ_INT(ia->weight_bytes, ib->weight_bytes);
    ASSERT_EQ_INT(ia->bos_token_id, ib->bos_token_id);
    ASSERT_EQ_INT(ia->eos_token_id, ib->eos_token_id);
    const char *text = "The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building.";
    int32_t *ids = NULL, *idb = NULL;
    size_t n = 0, nb = 0;
    ASSERT_OK(moeq_tokenizer_encode(moeq_model_tokenizer(ma), text, strlen(text), &ids, &n));
    ASSERT_OK(moeq_tokenizer_encode(moeq_model_tokenizer(mb), text, strlen(text), &idb, &nb));
    ASSERT_EQ_INT(n, nb);
    for (size_t i = 0; i < n && i < nb; i++) ASSERT_EQ_INT(ids[i], idb[i]);
    const int64_t V = ia->vocab_size;
    ASSERT_EQ_INT(V, ib->vocab_size);
    float *la = mq_test_logits(ma, ids, (int32_t)n), *lb = mq_test_logits(mb, ids, (int32_t)n);
    mq_test_same_floats(la, lb, (int64_t)n * V, what);
    free(la), free(lb), free(ids), free(idb);
    moeq_model_free(ma);
    moeq_model_free(mb);
}

/* file read directly equals its import: logits (whole), and the evaluation whole and streamed, with
 * and without llama.cpp's Q8_0 activations (q8_moves: the file has Linears that rounding touches). */
static void direct_equals_import(const char *file, const char *tag, bool q8_moves) {
    char imp[1100];
    snprintf(imp, sizeof imp, "%s/%s-imported", mq_test_tmpdir(), tag);
    ASSERT_OK(moeq_import_gguf(file, imp));
    moeq_docs *docs = text_docs();
    double plain = 0;
    for (int aq = 0; aq < 2; aq++) {
        const int act = aq ? MOEQ_ACT_QUANT_Q8_0 : MOEQ_ACT_QUANT_NONE;
        same_logits(imp, file, act, tag);
        ev iw = eval_of(imp, 0, act, docs), is = eval_of(imp, 1, act, docs);
        ev dw = eval_of(file, 0, act, docs), ds = eval_of(file, 1, act, docs);
        ASSERT_TRUE(isfinite(iw.ll) && iw.tokens > 100);
        same_eval(&iw, &dw, "direct whole");
        same_eval(&iw, &ds, "direct streamed");
        same_eval(&iw, &is, "imported streamed");
        if (!aq) plain = iw.ll;
        else if (q8_moves && iw.ll == plain) FAIL("%s: act_quant q8_0 changed nothing", tag);
        else if (!q8_moves && iw.ll != plain) FAIL("%s: act_quant q8_0 rounded a Linear it should not", tag);
    }
    moeq_docs_free(docs);
}

static void test_olmoe_q4_0(void) {
    char ckpt[1100], file[1100];
    make_gguf(mq_test_model("olmoe-tiny"), "olmoe", MQ_QS_INT4, 32, false, MQ_GGUF_REST_AUTO, NULL, ckpt, file);
    same_logits(ckpt, file, 0, "olmoe: checkpoint against its .gguf");   /* Q4_0 decodes exactly */
    direct_equals_import(file, "olmoe", true);
}

static void test_olmoe_q4_1_f16(void) {
    char ckpt[1100], file[1100];
    make_gguf(mq_test_model("olmoe-tiny"), "olmoe-asym", MQ_QS_INT4, 64, true, MQ_GGUF_REST_F16, NULL, ckpt, file);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    ASSERT_EQ_INT(MQ_GGML_Q4_1, mq_gguf_find_tensor(g, "blk.0.ffn_up_exps.weight")->type);
    ASSERT_EQ_INT(MQ_GGML_F16, mq_gguf_find_tensor(g, "output.weight")->type);
    mq_gguf_close(g);
    direct_equals_import(file, "olmoe-asym", true);
}

static void test_olmoe_every_type(void) {
    char ckpt[1100], file[1100], re[1100];
    make_gguf(mq_test_model("olmoe-tiny"), "olmoe-f32b", MQ_QS_INT4, 32, false, MQ_GGUF_REST_F32, NULL, ckpt, file);
    snprintf(re, sizeof re, "%s/olmoe-every.gguf", mq_test_tmpdir());
    retype(file, re, olmoe_types);
    direct_equals_import(re, "olmoe-every", true);
}

static void test_llama_q4_0_q8_0_rest(void) {
    char ckpt[1100], file[1100], model[1024];
    snprintf(model, sizeof model, "%s", mq_test_shared("fixtures/models/llama-tiny"));
    make_gguf(model, "llama", MQ_QS_INT4, 32, false, MQ_GGUF_REST_Q8_0, NULL, ckpt, file);
    direct_equals_import(file, "llama", true);
    char ckpt2[1100], file2[1100];
    make_gguf(model, "llama-auto", MQ_QS_INT4, 32, false, MQ_GGUF_REST_AUTO, NULL, ckpt2, file2);
    same_logits(ckpt2, file2, 0, "llama: checkpoint against its .gguf (q/k rows un-permuted)");
}

static void test_llama_nvfp4_and_kquants(void) {
    char ckpt[1100], file[1100], model[1024], re[1100];
    snprintf(model, sizeof model, "%s", mq_test_shared("fixtures/models/llama-tiny"));
    make_gguf(model, "llama-nv", MQ_QS_NVFP4, 16, false, MQ_GGUF_REST_BF16, NULL, ckpt, file);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    ASSERT_TRUE(mq_gguf_find_tensor(g, "blk.0.attn_q.scale") != NULL);
    mq_gguf_close(g);
    direct_equals_import(file, "llama-nv", true);
    snprintf(re, sizeof re, "%s/llama-every.gguf", mq_test_tmpdir());
    retype(file, re, llama_types);
    direct_equals_import(re, "llama-every", true);
}

static void test_qwen2moe_shared_expert(void) {
    char ckpt[1100], file[1100];
    make_gguf(mq_test_qwen2moe_nonorm(), "qwen2moe", MQ_QS_INT4, 32, false, MQ_GGUF_REST_AUTO, NULL, ckpt, file);
    same_logits(ckpt, file, 0, "qwen2moe: checkpoint against its .gguf");
    direct_equals_import(file, "qwen2moe", true);
}

static void test_qwen3moe(void) {
    char ckpt[1100], file[1100], cp[1200], *text;
    size_t len;
    /* the fixture's config says num_local_experts; the GGUF writer reads qwen3_moe's num_experts */
    const char *dir = mq_test_with_tokenizer("qwen3moe-tiny");
    snprintf(cp, sizeof cp, "%s/config.json", dir);
    ASSERT_OK(mq_read_file(cp, &text, &len));
    char *p = strstr(text, "\"num_local_experts\"");
    ASSERT_TRUE(p != NULL);
    memcpy(p, "\"num_experts\"      ", 19);
    ASSERT_OK(mq_write_file_atomic(cp, text, len));
    free(text);
    /* moe_intermediate_size 48: the experts' down_proj has no whole 32-value blocks, stays float */
    make_gguf(dir, "qwen3moe", MQ_QS_INT4, 32, false, MQ_GGUF_REST_AUTO,
              "experts\\.\\d+\\.down_proj", ckpt, file);
    same_logits(ckpt, file, 0, "qwen3moe: checkpoint against its .gguf");
    direct_equals_import(file, "qwen3moe", true);
}

static void test_mixtral(void) {
    char ckpt[1100], file[1100];
    make_gguf(mq_test_with_tokenizer("mixtral-tiny"), "mixtral", MQ_QS_INT4, 32, false, MQ_GGUF_REST_AUTO, NULL,
              ckpt, file);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    const char *a;
    size_t al;
    ASSERT_OK(mq_gguf_get_str(g, "general.architecture", &a, &al));
    ASSERT_TRUE(al == 5 && !memcmp(a, "llama", 5));   /* llama with experts, q/k permuted */
    mq_gguf_close(g);
    same_logits(ckpt, file, 0, "mixtral: checkpoint against its .gguf");
    direct_equals_import(file, "mixtral", true);
}

/* deepseek2: kv_b_proj merged from attn_k_b / attn_v_b by a view that converts only whole. */
static void test_deepseek2_merged_kv_b(void) {
    char ckpt[1100], file[1100];
    make_gguf(mq_test_with_tokenizer("deepseekv3-tiny"), "ds", MQ_QS_INT4, 32, false, MQ_GGUF_REST_AUTO,
              "model\\.layers\\.0\\.mlp\\.down_proj", ckpt, file);
    same_logits(ckpt, file, 0, "deepseek2: checkpoint against its .gguf");
    direct_equals_import(file, "ds", true);
    mq_st *st;
    mq_gguf_docs d;
    ASSERT_OK(mq_st_open_gguf(file, false, &st, &d));
    const mq_tensor_view *kv = mq_st_find(st, "model.layers.1.self_attn.kv_b_proj.weight");
    ASSERT_TRUE(kv && mq_tensor_whole_only(kv));
    ASSERT_TRUE(mq_st_find(st, "model.layers.3.input_layernorm.weight") == NULL);   /* no MTP layer */
    float *x = malloc(sizeof(float) * (size_t)kv->numel);
    ASSERT_STATUS(MOEQ_E_ARG, mq_tensor_range_to_f32(kv, 0, 10, x));
    ASSERT_ERROR_MENTIONS("kv_b_proj");
    ASSERT_OK(mq_tensor_range_to_f32(kv, 0, kv->numel, x));
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(d.types, "model.layers.1.self_attn.kv_b_proj.weight");
    ASSERT_TRUE(cJSON_IsString(ty) && !strcmp(ty->valuestring, "f32+q4_0"));
    free(x);
    mq_gguf_docs_free(&d);
    mq_st_close(st);
}

/* ---- memory --------------------------------------------------------------------------------- */

/* The process's anonymous resident memory (heap and anonymous maps; not the mapped file) after
 * giving back what earlier cases freed (core's kept blocks, malloc's free pages), so that what an
 * open allocates has to fault in fresh pages. */
static int64_t rss_anon(void) {
    mq_mem_release();
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    return mq_mem_anon_bytes();
}

static void test_stream_open_holds_one_layer(void) {
    char ckpt[1100], file[1100];
    make_gguf(mq_test_model("olmoe-tiny"), "olmoe-mem", MQ_QS_INT4, 32, false, MQ_GGUF_REST_F32, NULL, ckpt, file);
    const int64_t before = rss_anon();
    if (before <= 0) SKIP("no /proc/self/status RssAnon");
    moeq_model_options so = {.stream = 1};
    moeq_model *m = NULL;
    mq_mem_watch_start();   /* sampled every 10 ms: the peak during the open too */
    ASSERT_OK(moeq_model_open(file, &so, &m));
    const int64_t grown = mq_mem_anon_bytes() - before, peak = mq_mem_watch_take_peak() - before;
    mq_mem_watch_stop();
    const moeq_model_info *i = moeq_model_get_info(m);
    /* olmoe: norms (attention, FFN, q and k), q/k/v/o, the router and E experts a layer; the
     * output layer is the final norm and lm_head (untied) */
    const int64_t D = i->hidden_size, E = i->n_experts, F = i->moe_intermediate_size, V = i->vocab_size;
    ASSERT_EQ_INT(D, (int64_t)i->n_heads * i->head_dim);
    ASSERT_EQ_INT(D, (int64_t)i->n_kv_heads * i->head_dim);
    const int64_t layer = 4 * (4 * D + 4 * D * D + E * D + 3 * E * F * D), head = 4 * (D + V * D);
    ASSERT_EQ_INT(layer + head, i->weight_bytes);
    ASSERT_EQ_INT(4 * V * D + head + i->n_layers * layer, i->weight_bytes_whole);
    ASSERT_EQ_INT(i->weight_bytes_whole, i->weight_bytes_fp32);
    if (grown > i->weight_bytes_fp32 / 8 || peak > i->weight_bytes_fp32 / 8)
        FAIL("a streamed open grew the anonymous memory by %lld bytes, %lld at its peak (the model is "
             "%lld in fp32)", (long long)grown, (long long)peak, (long long)i->weight_bytes_fp32);
    /* the same figures as the imported checkpoint's streamed open */
    char imp[1100];
    snprintf(imp, sizeof imp, "%s/olmoe-mem-imported", mq_test_tmpdir());
    ASSERT_OK(moeq_import_gguf(file, imp));
    moeq_model *mi = mq_test_open_model(imp, &so);
    ASSERT_EQ_INT(moeq_model_get_info(mi)->weight_bytes, i->weight_bytes);
    ASSERT_EQ_INT(moeq_model_get_info(mi)->weight_bytes_whole, i->weight_bytes_whole);
    moeq_model_free(mi);
    const int64_t streamed_whole = i->weight_bytes_whole;
    moeq_model_free(m);
    /* the measure sees weights: a whole open grows by the model (as the stream said it would) */
    const int64_t b2 = rss_anon();
    ASSERT_OK(moeq_model_open(file, NULL, &m));
    const int64_t whole = mq_mem_anon_bytes() - b2;
    ASSERT_EQ_INT(streamed_whole, moeq_model_get_info(m)->weight_bytes);
    if (whole < moeq_model_get_info(m)->weight_bytes_fp32 * 9 / 10)
        FAIL("a whole open grew the anonymous memory by only %lld bytes", (long long)whole);
    moeq_model_free(m);
}

/* The lazy model in pieces that cut blocks and rows (7919 values) equals the whole load, layer by
 * layer, and its embedding rows (Q4_K / Q6_K blocks) the whole model's. */
static void lazy_equals_whole(const char *file) {
    moeq_model *w = NULL;
    moeq_model_options no_tok = {.no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(file, &no_tok, &w));
    mq_lazy_model *lz = NULL;
    ASSERT_OK(mq_lazy_open(file, false, &lz));
    if (!w || !lz) return;
    mq_lazy_set_piece(lz, 7919);
    moeq_model *m = mq_lazy_model_of(lz);
    const mq_config *c = &w->cfg;
    for (int l = 0; l < c->n_layers; l++) {
        ASSERT_OK(mq_lazy_load(lz, l, MQ_PART_LAYER, 0, c->n_experts));
        const mq_layer *a = &w->layers[l], *b = &m->layers[l];
        const mq_linear *la[7] = {&a->q, &a->k, &a->v, &a->o, &a->gate, &a->up, &a->down};
        const mq_linear *lb[7] = {&b->q, &b->k, &b->v, &b->o, &b->gate, &b->up, &b->down};
        for (int k = 0; k < 7; k++)
            if (la[k]->w) mq_test_same_floats(la[k]->w, lb[k]->w, la[k]->out * la[k]->in, la[k]->name);
        mq_test_same_floats(a->attn_norm, b->attn_norm, c->D, "attn_norm");
        for (int e = 0; a->is_moe && e < c->n_experts; e++) {
            mq_test_same_floats(a->exp_gate[e].w, b->exp_gate[e].w, a->exp_gate[e].out * a->exp_gate[e].in, a->exp_gate[e].name);
            mq_test_same_floats(a->exp_down[e].w, b->exp_down[e].w, a->exp_down[e].out * a->exp_down[e].in, a->exp_down[e].name);
        }
        if (a->is_moe) mq_test_same_floats(a->router, b->router, (int64_t)c->n_experts * c->D, "router");
        mq_lazy_release(lz, l, MQ_PART_LAYER, 0, c->n_experts);
    }
    int32_t ids[5] = {0, 1, 77, 4000, c->vocab - 1};
    float *x = malloc(sizeof(float) * 5 * (size_t)c->D);
    ASSERT_OK(mq_lazy_embed(lz, ids, 5, x));
    for (int t = 0; t < 5; t++) mq_test_same_floats(w->embed + (int64_t)ids[t] * c->D, x + t * c->D, c->D, "embedding row");
    int32_t bad = c->vocab;
    ASSERT_STATUS(MOEQ_E_ARG, mq_lazy_embed(lz, &bad, 1, x));
    free(x);
    mq_lazy_close(lz);
    moeq_model_free(w);
}

static void test_lazy_pieces_equal_whole(void) {
    char ckpt[1100], file[1100], re[1100], model[1024];
    make_gguf(mq_test_model("olmoe-tiny"), "olmoe-pc", MQ_QS_INT4, 32, false, MQ_GGUF_REST_F32, NULL, ckpt, file);
    snprintf(re, sizeof re, "%s/olmoe-pc-every.gguf", mq_test_tmpdir());
    retype(file, re, olmoe_types);
    lazy_equals_whole(re);
    snprintf(model, sizeof model, "%s", mq_test_shared("fixtures/models/llama-tiny"));
    make_gguf(model, "llama-pc", MQ_QS_NVFP4, 16, false, MQ_GGUF_REST_F32, NULL, ckpt, file);
    snprintf(re, sizeof re, "%s/llama-pc-every.gguf", mq_test_tmpdir());
    retype(file, re, llama_types);
    lazy_equals_whole(re);
}

/* ---- bad files ------------------------------------------------------------------------------ */

/* src's first len bytes (0: all) to dst, with the bytes find (flen of them) replaced by repl. */
static void write_cut_n(const char *src, const char *dst, size_t len, const char *find, const char *repl, size_t flen) {
    char *buf = NULL;
    size_t n = 0;
    ASSERT_OK(mq_read_file(src, &buf, &n));
    if (find) {
        char *p = memmem(buf, n, find, flen);
        ASSERT_TRUE(p != NULL);
        if (p) memcpy(p, repl, flen);
    }
    ASSERT_OK(mq_write_file_atomic(dst, buf, len && len < n ? len : n));
    free(buf);
}

static void write_cut(const char *src, const char *dst, size_t len, const char *find, const char *repl) {
    write_cut_n(src, dst, len, find, repl, find ? strlen(find) : 0);
}

/* Every way in (whole, streamed, the lazy model, the tokenizer) fails naming the file and what. */
static void expect_bad(const char *path, const char *what) {
    for (int stream = 0; stream < 2; stream++) {
        moeq_model_options mo = {.stream = stream};
        moeq_model *m = NULL;
        ASSERT_TRUE(moeq_model_open(path, &mo, &m) != MOEQ_OK);
        ASSERT_TRUE(m == NULL);
        ASSERT_ERROR_MENTIONS(path);
        ASSERT_ERROR_MENTIONS(what);
    }
    mq_lazy_model *lz = NULL;
    ASSERT_TRUE(mq_lazy_open(path, true, &lz) != MOEQ_OK);
    ASSERT_ERROR_MENTIONS(path);
    moeq_tokenizer *t = NULL;
    if (strstr(what, "architecture")) {   /* ... and reads the file's vocabulary */
        ASSERT_OK(moeq_tokenizer_load(path, &t));
        ASSERT_TRUE(moeq_tokenizer_vocab_size(t) == 4096);
        moeq_tokenizer_free(t);
        t = NULL;
    }
    if (!strstr(what, "architecture")) {   /* the tokenizer alone does not need the architecture */
        if (moeq_tokenizer_load(path, &t) == MOEQ_OK) FAIL("%s: the tokenizer loads", path);
        ASSERT_ERROR_MENTIONS(path);
    }
}

static void test_corrupt_and_truncated(void) {
    char ckpt[1100], file[1100], bad[1100];
    make_gguf(mq_test_model("olmoe-tiny"), "olmoe-bad", MQ_QS_INT4, 32, false, MQ_GGUF_REST_AUTO, NULL, ckpt, file);
    struct stat sb;
    ASSERT_EQ_INT(0, stat(file, &sb));
    snprintf(bad, sizeof bad, "%s/cut-data.gguf", mq_test_tmpdir());
    write_cut(file, bad, (size_t)sb.st_size / 2, NULL, NULL);   /* the tensors' data cut */
    expect_bad(bad, "past the end of the file");
    snprintf(bad, sizeof bad, "%s/cut-kvs.gguf", mq_test_tmpdir());
    write_cut(file, bad, 3000, NULL, NULL);   /* inside the vocabulary's KV */
    expect_bad(bad, "cannot fit in the file");
    snprintf(bad, sizeof bad, "%s/cut-header.gguf", mq_test_tmpdir());
    write_cut(file, bad, 20, NULL, NULL);   /* inside the counts */
    expect_bad(bad, "truncated GGUF");
    snprintf(bad, sizeof bad, "%s/magic.gguf", mq_test_tmpdir());
    write_cut(file, bad, 0, "GGUF", "GGUH");
    expect_bad(bad, "not a GGUF file");
    snprintf(bad, sizeof bad, "%s/arch.gguf", mq_test_tmpdir());
    /* general.architecture's value: after the key, its type (u32 8: string) and length (u64 5) */
    static const char key[] = "general.architecture\x08\0\0\0\x05\0\0\0\0\0\0\0olmoe",
                      rep[] = "general.architecture\x08\0\0\0\x05\0\0\0\0\0\0\0xlmoe";
    write_cut_n(file, bad, 0, key, rep, sizeof key - 1);
    expect_bad(bad, "architecture 'xlmoe'");
    /* a file without .gguf in its name is still read by its magic */
    char plain[1100];
    snprintf(plain, sizeof plain, "%s/model.bin", mq_test_tmpdir());
    write_cut(file, plain, 0, NULL, NULL);
    ASSERT_TRUE(mq_is_gguf_file(plain));
    moeq_model *m = NULL;
    moeq_model_options mo = {.stream = 1, .no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(plain, &mo, &m));
    moeq_model_free(m);
    /* the quantizer needs a checkpoint directory: told so, nothing written */
    moeq_quant_options q;
    moeq_quant_options_init(&q);
    q.scheme = MOEQ_QUANT_INT4;
    char out[1100];
    snprintf(out, sizeof out, "%s/requantized", mq_test_tmpdir());
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_quantize(file, out, &q, NULL));
    ASSERT_ERROR_MENTIONS("moeq_import_gguf");
    ASSERT_FALSE(mq_file_exists(out));
}

TEST_MAIN(T(test_views_olmoe_every_type), T(test_views_llama_permuted), T(test_olmoe_q4_0), T(test_olmoe_q4_1_f16),
          T(test_olmoe_every_type), T(test_llama_q4_0_q8_0_rest), T(test_llama_nvfp4_and_kquants),
          T(test_qwen2moe_shared_expert), T(test_qwen3moe), T(test_mixtral), T(test_deepseek2_merged_kv_b),
          T(test_stream_open_holds_one_layer), T(test_lazy_pieces_equal_whole), T(test_corrupt_and_truncated))
