/*
 * deepseek_v3 (and kimi_k2): the config (YaRN and the softmax scale against the values
 * transformers 5.17 printed for the fixture, malformed fields named), the fp32 forward against
 * transformers' goldens (tests/data/deepseekv3-*: q LoRA + YaRN + interleaved rope + expert
 * groups, its FP8 block-quantized copy, the variant without q LoRA when present) and against
 * itself through the KV cache, the latent attention (with and without q LoRA, YaRN and interleaved
 * rope) against a slow obvious one in double, the op's group-limited expert choice against an
 * obvious implementation written here, and the quantizer: GPTQ through the pipeline (every latent
 * attention Linear calibrated on its own input), the packed runtime against the dequantized fp32
 * path of the same checkpoint, the multi-token-prediction layer passed through byte for byte (or
 * dropped with drop_mtp), an FP8 source quantizing to the same codes as its dequantized twin, and
 * GGUF refused before any work.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "io/safetensors.h"
#include "kernels/moe_ffn.h"
#include "model/model.h"

static const double GOLDEN_RTOL = 1e-4;

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float urand(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rng >> 40) & 0xFFFFFF) / 16777216.0f;
}

static const char *data_dir(const char *name) {
    static char buf[4][1024];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, sizeof buf[0], "%s/%s", mq_test_repo("tests/data"), name);
    return p;
}

static bool is_dir(const char *p) {
    struct stat s;
    return stat(p, &s) == 0 && S_ISDIR(s.st_mode);
}

static void read_f32(const mq_st *st, const char *name, float *out, int64_t numel) {
    const mq_tensor_view *t = mq_st_find(st, name);
    if (!t) FAIL("tensor '%s' missing", name);
    ASSERT_EQ_INT(numel, t->numel);
    ASSERT_OK(mq_tensor_to_f32(t, out));
}

/* ---- config ------------------------------------------------------------------------------- */

/* The fixture's YaRN: transformers printed self_attn.scaling 0.25191097422871067 and the rotary
 * attention_scaling 1.0249579607969668 (scripts/gen_deepseek_goldens.py's log). */
static void test_config_fixture(void) {
    mq_config c;
    ASSERT_OK(mq_config_load(data_dir("deepseekv3-tiny"), &c));
    ASSERT_EQ_INT(MQ_ARCH_DEEPSEEK_V3, c.arch);
    ASSERT_TRUE(c.mla && c.yarn && c.rope_interleave && c.sigmoid_router && c.router_bias);
    ASSERT_EQ_INT(64, c.q_lora_rank);
    ASSERT_EQ_INT(32, c.kv_lora_rank);
    ASSERT_EQ_INT(24, c.head_dim); /* nope 16 + rope 8, not the config's head_dim 8 */
    ASSERT_EQ_INT(8, c.rope_dim);
    ASSERT_EQ_INT(16, c.v_head_dim);
    ASSERT_EQ_INT(4, c.n_group);
    ASSERT_EQ_INT(2, c.topk_group);
    ASSERT_EQ_INT(1, c.n_mtp);
    ASSERT_EQ_INT(16 * 1, c.n_experts);
    ASSERT_EQ_INT(32, c.shared_ffn);
    ASSERT_NEAR(2.5, c.routed_scale, 0);
    ASSERT_EQ_INT(0, c.layer_is_moe[0]);
    ASSERT_EQ_INT(1, c.layer_is_moe[1]);
    ASSERT_EQ_INT(1, c.layer_is_moe[2]);
    ASSERT_NEAR(0.25191097422871067, c.attn_scale, 1e-15);
    ASSERT_NEAR(1.0249579607969668, c.rope_attn_factor, 1e-15);
    mq_config_free(&c);
}

/* A config.json as DeepSeek-V3's release writes it (rope_scaling with "type", top-level
 * rope_theta, the hub's routing fields). mscale = mscale_all_dim = 1: cos/sin unscaled, softmax
 * scale 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.13523377... (computed here in long double from the
 * formula's constants: ln 40 = 3.6888794541139363). */
static const char *k_v3 =
    "{\"model_type\":\"deepseek_v3\",\"vocab_size\":129280,\"hidden_size\":7168,"
    "\"intermediate_size\":18432,\"moe_intermediate_size\":2048,\"num_hidden_layers\":61,"
    "\"num_attention_heads\":128,\"num_key_value_heads\":128,\"n_shared_experts\":1,"
    "\"n_routed_experts\":256,\"routed_scaling_factor\":2.5,\"kv_lora_rank\":512,"
    "\"q_lora_rank\":1536,\"qk_rope_head_dim\":64,\"v_head_dim\":128,\"qk_nope_head_dim\":128,"
    "\"topk_method\":\"noaux_tc\",\"n_group\":8,\"topk_group\":4,\"num_experts_per_tok\":8,"
    "\"moe_layer_freq\":1,\"first_k_dense_replace\":3,\"norm_topk_prob\":true,"
    "\"scoring_func\":\"sigmoid\",\"hidden_act\":\"silu\",\"max_position_embeddings\":163840,"
    "\"rms_norm_eps\":1e-06,\"rope_theta\":10000,\"num_nextn_predict_layers\":1,"
    "\"rope_scaling\":{\"beta_fast\":32,\"beta_slow\":1,\"factor\":40,\"mscale\":1.0,"
    "\"mscale_all_dim\":1.0,\"original_max_position_embeddings\":4096,\"type\":\"yarn\"},"
    "\"tie_word_embeddings\":false,\"bos_token_id\":0,\"eos_token_id\":1%s}";

/* k_v3 with `first` (keys, each followed by a comma) in front: of duplicate keys the first
 * counts. */
static moeq_status parse_v3(const char *first, mq_config *c) {
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "{%s", first);
    snprintf(buf + n, sizeof buf - (size_t)n, k_v3 + 1, "");
    return mq_config_parse(buf, strlen(buf), "config.json", c);
}

static void test_config_release(void) {
    mq_config c;
    ASSERT_OK(parse_v3("", &c));
    long double m = 0.1L * 3.6888794541139363L + 1.0L;
    ASSERT_NEAR((double)(m * m / sqrtl(192.0L)), c.attn_scale, 1e-12);
    ASSERT_NEAR(1.0, c.rope_attn_factor, 0);
    ASSERT_NEAR(40.0, c.yarn_factor, 0);
    ASSERT_EQ_INT(4096, c.yarn_orig_max_pos);
    ASSERT_EQ_INT(192, c.head_dim);
    ASSERT_EQ_INT(58, c.n_layers - 3);
    int64_t total = 0, active = 0;
    mq_config_param_counts(&c, &total, &active);
    /* DeepSeek-V3's model card: 671B total, 37B active (without the 14B MTP module) */
    ASSERT_TRUE(total > 670e9 && total < 672e9);
    ASSERT_TRUE(active > 36.5e9 && active < 38e9);
    mq_config_free(&c);
    /* kimi_k2 has the same layout (one group); the first of duplicate keys counts */
    char buf[4096];
    int n =
        snprintf(buf, sizeof buf, "{\"model_type\":\"kimi_k2\",\"n_group\":1,\"topk_group\":1,");
    snprintf(buf + n, sizeof buf - (size_t)n, k_v3 + 1, "");
    ASSERT_OK(mq_config_parse(buf, strlen(buf), "config.json", &c));
    ASSERT_EQ_INT(MQ_ARCH_DEEPSEEK_V3, c.arch);
    ASSERT_EQ_STR("kimi_k2", c.model_type);
    ASSERT_EQ_INT(1, c.n_group);
    mq_config_free(&c);
    /* q_lora_rank null: a plain q_proj */
    ASSERT_OK(parse_v3("\"q_lora_rank\":null,", &c));
    ASSERT_EQ_INT(0, c.q_lora_rank);
    mq_config_free(&c);
}

/* Every malformed field is refused with a message naming it and the file (the bad value goes
 * first: of duplicate keys, the first counts). */
static void test_config_errors(void) {
    static const struct {
        const char *json_prefix, *mention;
    } cases[] = {
        {"\"n_group\":5,", "n_group"},
        {"\"topk_group\":9,", "topk_group"},
        {"\"topk_group\":1,\"num_experts_per_tok\":40,", "num_experts_per_tok"},
        {"\"q_lora_rank\":0,", "q_lora_rank"},
        {"\"num_key_value_heads\":8,", "num_key_value_heads"},
        {"\"qk_rope_head_dim\":63,", "qk_rope_head_dim"},
        {"\"scoring_func\":\"softmax\",", "scoring_func"},
        {"\"topk_method\":\"greedy\",", "topk_method"},
        {"\"first_k_dense_replace\":62,", "first_k_dense_replace"},
        {"\"moe_layer_freq\":2,", "moe_layer_freq"},
        {"\"routed_scaling_factor\":-1,", "routed_scaling_factor"},
        {"\"kv_lora_rank\":\"512\",", "kv_lora_rank"},
        {"\"num_nextn_predict_layers\":-1,", "num_nextn_predict_layers"},
        {"\"rope_scaling\":{\"type\":\"longrope\"},", "longrope"},
        {"\"rope_scaling\":{\"type\":\"yarn\",\"factor\":-2},", "factor"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[4096];
        int n = snprintf(buf, sizeof buf, "{%s", cases[i].json_prefix);
        snprintf(buf + n, sizeof buf - (size_t)n, k_v3 + 1, "");
        mq_config c;
        moeq_status st = mq_config_parse(buf, strlen(buf), "config.json", &c);
        if (st == MOEQ_OK) {
            mq_config_free(&c);
            FAIL("case %zu (%s) was accepted", i, cases[i].json_prefix);
        }
        if (!strstr(moeq_last_error(), cases[i].mention))
            FAIL("case %zu: '%s' does not name '%s'", i, moeq_last_error(), cases[i].mention);
        if (!strstr(moeq_last_error(), "config.json"))
            FAIL("case %zu: '%s' does not name the file", i, moeq_last_error());
    }
    /* missing required fields are named too */
    const char *bare = "{\"model_type\":\"deepseek_v3\",\"vocab_size\":8,\"hidden_size\":8,"
                       "\"num_hidden_layers\":1,\"num_attention_heads\":1}";
    mq_config c;
    ASSERT_TRUE(mq_config_parse(bare, strlen(bare), "config.json", &c) != MOEQ_OK);
    ASSERT_ERROR_MENTIONS("kv_lora_rank");
    ASSERT_ERROR_MENTIONS("n_routed_experts");
    ASSERT_ERROR_MENTIONS("v_head_dim");
}

/* ---- forward ------------------------------------------------------------------------------ */

/* Layer by layer against the golden; then the same tokens through the KV cache in pieces (a
 * prefill, single-token decode steps, a block) give the same logits. */
static void golden(const char *model, const char *gold) {
    moeq_model *m = NULL;
    moeq_model_options opt = {.no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(model, &opt, &m));
    mq_st *g = NULL;
    ASSERT_OK(mq_st_open_file(gold, &g));
    const mq_tensor_view *tid = mq_st_find(g, "input_ids");
    ASSERT_TRUE(tid && tid->dtype == MOEQ_DT_I32);
    const int64_t T = tid->numel, D = m->cfg.D, V = m->cfg.vocab, L = m->cfg.n_layers;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    memcpy(ids, tid->data, sizeof(int32_t) * (size_t)T);
    float *x = malloc(sizeof(float) * (size_t)(T * D)),
          *ref = malloc(sizeof(float) * (size_t)(T * V));
    float *logits = malloc(sizeof(float) * (size_t)(T * V)),
          *lg2 = malloc(sizeof(float) * (size_t)(T * V));
    mq_state *s = NULL;
    ASSERT_OK(mq_state_new(m, (int32_t)T, &s));
    ASSERT_OK(mq_embed(m, ids, T, x));
    char name[64];
    for (int64_t l = 0; l <= L; l++) {
        if (l > 0) ASSERT_OK(mq_forward_layers(m, s, x, T, 0, (int)l - 1, (int)l, NULL));
        if (l == L) mq_final_norm(m, x, T);
        snprintf(name, sizeof name, "hidden_states.%lld", (long long)l);
        read_f32(g, name, ref, T * D);
        double e = mq_test_rel_maxdiff(x, ref, (size_t)(T * D));
        fprintf(stderr, "  %s: rel err %.3g\n", name, e);
        if (!(e <= GOLDEN_RTOL)) FAIL("%s: %s rel err %.3g", model, name, e);
    }
    mq_lm_head(m, x, T, logits);
    read_f32(g, "logits", ref, T * V);
    double e = mq_test_rel_maxdiff(logits, ref, (size_t)(T * V));
    fprintf(stderr, "  logits: rel err %.3g\n", e);
    if (!(e <= GOLDEN_RTOL)) FAIL("%s: logits rel err %.3g", model, e);

    moeq_session *ss = NULL;
    ASSERT_OK(moeq_session_create(m, (int32_t)T, &ss));
    const int pieces[] = {5, 1, 1, 1, 7, 1, 16};
    int64_t done = 0;
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0] && done < T; i++) {
        int n = (int)(pieces[i] < T - done ? pieces[i] : T - done);
        ASSERT_OK(moeq_session_forward(ss, ids + done, n, lg2 + done * V));
        done += n;
    }
    ASSERT_EQ_INT(T, done);
    double ec = mq_test_rel_maxdiff(lg2, logits, (size_t)(T * V));
    fprintf(stderr, "  through the KV cache in pieces: rel diff %.3g\n", ec);
    ASSERT_TRUE(ec <= 1e-5);
    moeq_session_free(ss);
    mq_state_free(s);
    mq_st_close(g);
    moeq_model_free(m);
    free(ids);
    free(x);
    free(ref);
    free(logits);
    free(lg2);
}

static void test_golden_qlora_yarn(void) {
    golden(data_dir("deepseekv3-tiny"), data_dir("deepseekv3-fp8-tiny.golden.safetensors"));
}
static void test_golden_fp8(void) {
    golden(data_dir("deepseekv3-fp8-tiny"), data_dir("deepseekv3-fp8-tiny.golden.safetensors"));
}
static void test_golden_noqlora(void) {
    if (!is_dir(data_dir("deepseekv3-noqlora-tiny")))
        SKIP("tests/data/deepseekv3-noqlora-tiny is not there yet (made by "
             "scripts/gen_deepseek_goldens.py on the GPU machine)");
    golden(data_dir("deepseekv3-noqlora-tiny"),
           data_dir("deepseekv3-noqlora-tiny.golden.safetensors"));
}

/* ---- the latent attention against a slow obvious one -------------------------------------- */

/* y[n] = W[n, k] x[k] (+ b) in double. */
static void matvec(const mq_linear *l, const double *x, double *y) {
    for (int64_t o = 0; o < l->out; o++) {
        double a = l->bias ? l->bias[o] : 0.0;
        for (int64_t i = 0; i < l->in; i++) a += (double)l->w[o * l->in + i] * x[i];
        y[o] = a;
    }
}

static void rms(double *x, int64_t n, const float *w, double eps) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / (double)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * w[i];
}

/* transformers' rotary angles of pair i at position p (default or YaRN), and the cos/sin factor */
static double angle(const mq_config *c, int64_t i, int64_t p) {
    const double d = c->rope_dim, ex = 1.0 / pow(c->rope_theta, 2.0 * (double)i / d);
    if (!c->yarn) return (double)p * ex;
    const double pi = 3.14159265358979323846;
    double lo = floor(d * log(c->yarn_orig_max_pos / (c->yarn_beta_fast * 2 * pi)) /
                      (2 * log(c->rope_theta)));
    double hi = ceil(d * log(c->yarn_orig_max_pos / (c->yarn_beta_slow * 2 * pi)) /
                     (2 * log(c->rope_theta)));
    lo = lo < 0 ? 0 : lo;
    hi = hi > d - 1 ? d - 1 : hi;
    if (lo == hi) hi += 0.001;
    double ramp = ((double)i - lo) / (hi - lo);
    ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
    double keep = 1.0 - ramp; /* share of the extrapolated frequency */
    return (double)p * (ex / c->yarn_factor * (1.0 - keep) + ex * keep);
}

/* apply_rotary_pos_emb (halves) or apply_rotary_pos_emb_interleave (pairs, output de-interleaved)
 * on v[rope_dim] at position p */
static void rotate(const mq_config *c, double *v, int64_t p) {
    const int64_t h = c->rope_dim / 2;
    double o[512];
    for (int64_t i = 0; i < h; i++) {
        double cs = cos(angle(c, i, p)) * c->rope_attn_factor,
               sn = sin(angle(c, i, p)) * c->rope_attn_factor;
        double a = c->rope_interleave ? v[2 * i] : v[i],
               b = c->rope_interleave ? v[2 * i + 1] : v[h + i];
        o[i] = a * cs - b * sn;
        o[h + i] = b * cs + a * sn;
    }
    memcpy(v, o, sizeof(double) * (size_t)c->rope_dim);
}

/* x[T, D] += DeepseekV3Attention(input_layernorm(x)) of layer l, positions 0.., in double. */
static void slow_mla(const moeq_model *m, int l, float *x, int64_t T) {
    const mq_config *c = &m->cfg;
    const mq_layer *ly = &m->layers[l];
    const int64_t D = c->D, H = c->n_heads, hd = c->head_dim, nope = c->qk_nope, rd = c->rope_dim;
    const int64_t vd = c->v_head_dim, r = c->kv_lora_rank;
    double *q = calloc((size_t)(T * H * hd), sizeof(double)),
           *k = calloc((size_t)(T * H * hd), sizeof(double));
    double *v = calloc((size_t)(T * H * vd), sizeof(double)),
           *att = calloc((size_t)(T * H * vd), sizeof(double));
    double xn[1024], qa[2048], ckv[2048], kvb[8192], o[1024];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < D; i++) xn[i] = x[t * D + i];
        rms(xn, D, ly->attn_norm, c->rms_eps);
        if (c->q_lora_rank > 0) {
            matvec(&ly->q_a, xn, qa);
            rms(qa, c->q_lora_rank, ly->q_a_norm, 1e-6);
            matvec(&ly->q_b, qa, q + t * H * hd);
        } else {
            matvec(&ly->q, xn, q + t * H * hd);
        }
        matvec(&ly->kv_a, xn, ckv);
        rms(ckv, r, ly->kv_a_norm, 1e-6);
        matvec(&ly->kv_b, ckv, kvb);
        rotate(c, ckv + r, t); /* the shared rotary key */
        for (int64_t h = 0; h < H; h++) {
            double *kh = k + (t * H + h) * hd;
            for (int64_t i = 0; i < nope; i++) kh[i] = kvb[h * (nope + vd) + i];
            for (int64_t i = 0; i < rd; i++) kh[nope + i] = ckv[r + i];
            for (int64_t i = 0; i < vd; i++)
                v[(t * H + h) * vd + i] = kvb[h * (nope + vd) + nope + i];
            rotate(c, q + (t * H + h) * hd + nope, t);
        }
    }
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++) {
            double sc[256], mx = -INFINITY, sum = 0;
            for (int64_t u = 0; u <= t; u++) {
                double a = 0;
                for (int64_t i = 0; i < hd; i++)
                    a += q[(t * H + h) * hd + i] * k[(u * H + h) * hd + i];
                sc[u] = a * c->attn_scale;
                mx = sc[u] > mx ? sc[u] : mx;
            }
            for (int64_t u = 0; u <= t; u++) sum += sc[u] = exp(sc[u] - mx);
            for (int64_t u = 0; u <= t; u++)
                for (int64_t i = 0; i < vd; i++)
                    att[(t * H + h) * vd + i] += sc[u] / sum * v[(u * H + h) * vd + i];
        }
    for (int64_t t = 0; t < T; t++) {
        matvec(&ly->o, att + t * H * vd, o);
        for (int64_t i = 0; i < D; i++) x[t * D + i] += (float)o[i];
    }
    free(q);
    free(k);
    free(v);
    free(att);
}

/* mq_attention_forward of every layer against slow_mla, on the fixture and on variants of it made
 * by changing its config in memory: without YaRN, without rope_interleave, and with a plain
 * q_proj (the product of the fixture's q_b and q_a as its weight). */
static void test_latent_attention_variants(void) {
    moeq_model *m = NULL;
    moeq_model_options opt = {.no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(data_dir("deepseekv3-tiny"), &opt, &m));
    mq_config *c = &m->cfg;
    const int64_t T = 40, D = c->D;
    ASSERT_TRUE(D <= 1024 && c->rope_dim <= 512 && T <= 256);
    float *x = malloc(sizeof(float) * (size_t)(T * D)),
          *a = malloc(sizeof(float) * (size_t)(T * D));
    float *b = malloc(sizeof(float) * (size_t)(T * D)),
          *prev = malloc(sizeof(float) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) x[i] = 2.0f * (urand() - 0.5f);
    for (int variant = 0; variant < 4; variant++) {
        if (variant == 1) { /* no YaRN: the default rotation and softmax scale */
            c->yarn = false;
            c->rope_attn_factor = 1.0;
            c->attn_scale = 1.0 / sqrt((double)c->head_dim);
        } else if (variant == 2) {
            c->rope_interleave = false;
        } else if (variant == 3) { /* q_proj = q_b q_a, no q LoRA (and no latent norm of q) */
            for (int l = 0; l < c->n_layers; l++) {
                mq_layer *ly = &m->layers[l];
                const int64_t QO = ly->q_b.out, QR = ly->q_b.in;
                float *w = mq_alloc_array((size_t)(QO * D), sizeof(float), "q_proj");
                for (int64_t o = 0; o < QO; o++)
                    for (int64_t i = 0; i < D; i++) {
                        double s = 0;
                        for (int64_t j = 0; j < QR; j++)
                            s += (double)ly->q_b.w[o * QR + j] * ly->q_a.w[j * D + i];
                        w[o * D + i] = (float)s;
                    }
                ly->q = (mq_linear){.out = QO, .in = D, .w = w};
            }
            c->q_lora_rank = 0;
        }
        mq_state *s = NULL;
        ASSERT_OK(mq_state_new(m, (int32_t)T, &s));
        for (int l = 0; l < c->n_layers; l++) {
            memcpy(a, x, sizeof(float) * (size_t)(T * D));
            memcpy(b, x, sizeof(float) * (size_t)(T * D));
            ASSERT_OK(mq_attention_forward(m, s, l, a, T, 0, NULL));
            slow_mla(m, l, b, T);
            for (int64_t i = 0; i < T * D; i++) { /* the attention's contribution alone */
                a[i] -= x[i];
                b[i] -= x[i];
            }
            double e = mq_test_rel_maxdiff(a, b, (size_t)(T * D));
            fprintf(stderr, "  variant %d layer %d: rel err %.3g\n", variant, l, e);
            if (!(e <= 1e-5)) FAIL("variant %d layer %d: rel err %.3g", variant, l, e);
            if (l == 0 && variant > 0) { /* each change of the config changes the attention */
                double d = mq_test_rel_maxdiff(a, prev, (size_t)(T * D));
                if (!(d > 1e-3)) FAIL("variant %d: layer 0 barely changed (%.3g)", variant, d);
            }
            if (l == 0) memcpy(prev, a, sizeof(float) * (size_t)(T * D));
        }
        mq_state_free(s);
    }
    free(x);
    free(a);
    free(b);
    free(prev);
    moeq_model_free(m);
}

/* The MTP layer's tensors are only allowed where the config declares them. */
static void test_mtp_needs_its_config(void) {
    char dir[1200], a[1400], b[1400];
    snprintf(dir, sizeof dir, "%s/no-mtp", mq_test_tmpdir());
    ASSERT_TRUE(mkdir(dir, 0755) == 0);
    snprintf(a, sizeof a, "%s/model.safetensors", data_dir("deepseekv3-tiny"));
    snprintf(b, sizeof b, "%s/model.safetensors", dir);
    ASSERT_TRUE(symlink(a, b) == 0);
    snprintf(a, sizeof a, "%s/config.json", data_dir("deepseekv3-tiny"));
    char *cfg;
    size_t len;
    ASSERT_OK(mq_read_file(a, &cfg, &len));
    char *k = strstr(cfg, "\"num_nextn_predict_layers\": 1");
    ASSERT_TRUE(k != NULL);
    k[strlen("\"num_nextn_predict_layers\": ")] = '0';
    snprintf(b, sizeof b, "%s/config.json", dir);
    FILE *f = fopen(b, "wb");
    fwrite(cfg, 1, len, f);
    fclose(f);
    free(cfg);
    moeq_model *m = NULL;
    moeq_model_options opt = {.no_tokenizer = 1};
    ASSERT_TRUE(moeq_model_open(dir, &opt, &m) != MOEQ_OK);
    ASSERT_ERROR_MENTIONS("num_nextn_predict_layers = 0");
    ASSERT_ERROR_MENTIONS("model.layers.3.");
}

/* ---- the op's group-limited choice against an obvious implementation ---------------------- */

/* Sorts indices by (score desc, index asc). */
static void order_desc(const float *v, int n, int *idx) {
    for (int i = 0; i < n; i++) idx[i] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && (v[idx[j]] > v[idx[j - 1]] ||
                                  (v[idx[j]] == v[idx[j - 1]] && idx[j] < idx[j - 1]));
             j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
}

static void obvious_select(const float *p, const float *bias, int E, int k, int G, int TG,
                           int32_t *sel) {
    float s[256], gs[64];
    int idx[256], gi[64];
    for (int e = 0; e < E; e++) s[e] = p[e] + (bias ? bias[e] : 0.0f);
    bool ok[256];
    for (int e = 0; e < E; e++) ok[e] = true;
    if (G > 1) {
        int EG = E / G;
        for (int g = 0; g < G; g++) {
            order_desc(s + g * EG, EG, idx);
            gs[g] = s[g * EG + idx[0]] + s[g * EG + idx[1]];
        }
        order_desc(gs, G, gi);
        for (int e = 0; e < E; e++) {
            ok[e] = false;
            for (int j = 0; j < TG; j++) ok[e] |= e / EG == gi[j];
        }
    }
    float masked[256];
    for (int e = 0; e < E; e++) masked[e] = ok[e] ? s[e] : -INFINITY;
    order_desc(masked, E, idx);
    for (int j = 0; j < k; j++) sel[j] = idx[j];
}

static void test_group_select(void) {
    static const int shapes[][4] = {/* E, G, TG, k */
                                    {16, 4, 2, 3}, {256, 8, 4, 8}, {8, 1, 1, 2},
                                    {12, 6, 1, 2}, {64, 8, 8, 6},  {32, 16, 3, 6}};
    int checked = 0, restricted = 0;
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        const int E = shapes[c][0], G = shapes[c][1], TG = shapes[c][2], k = shapes[c][3];
        for (int rep = 0; rep < 200; rep++) {
            float p[256], b[256];
            /* coarse values (many ties) in a third of the cases, every value distinct else */
            bool coarse = rep % 3 == 0;
            for (int e = 0; e < E; e++) {
                p[e] = coarse ? (float)(int)(urand() * 4) / 4.0f : urand();
                b[e] = coarse ? 0.0f : 0.2f * (urand() - 0.5f);
            }
            int32_t got[16], want[16];
            uint8_t taken[256];
            const float *bias = rep % 2 ? b : NULL;
            mq_moe_select(p, bias, E, k, G, TG, taken, got);
            obvious_select(p, bias, E, k, G, TG, want);
            for (int j = 0; j < k; j++)
                if (got[j] != want[j])
                    FAIL("E %d G %d TG %d k %d rep %d: slot %d chose %d, expected %d", E, G, TG, k,
                         rep, j, got[j], want[j]);
            /* the plain top-k differs somewhere, so the groups are exercised */
            int32_t plain[16];
            obvious_select(p, bias, E, k, 1, 1, plain);
            restricted += memcmp(plain, want, sizeof(int32_t) * (size_t)k) != 0;
            checked++;
        }
    }
    fprintf(stderr, "  %d choices checked, %d differ from the plain top-k\n", checked, restricted);
    ASSERT_TRUE(restricted > checked / 10);
}

/* ---- quantize ----------------------------------------------------------------------------- */

static void opts_nvfp4(moeq_quant_options *o, bool gptq) {
    moeq_quant_options_init(o);
    o->scheme = MOEQ_QUANT_NVFP4A16;
    o->method = gptq ? MOEQ_QUANT_GPTQ : MOEQ_QUANT_RTN;
    if (gptq) {
        o->calib = mq_test_calib_text();
        o->gptq.nsamples = 16;
        o->gptq.seqlen = 128;
    }
}

/* Logits of ids through the model at dir (packed or not). */
static float *logits_of(const char *dir, bool packed, const int32_t *ids, int T, int *n_packed) {
    moeq_model *m = NULL;
    moeq_model_options opt = {.no_tokenizer = 1, .keep_packed = packed ? 1 : 0};
    ASSERT_OK(moeq_model_open(dir, &opt, &m));
    if (n_packed) *n_packed = moeq_model_get_info(m)->packed_linears;
    float *lg = mq_test_logits(m, ids, T);
    moeq_model_free(m);
    return lg;
}

/* A tensor of a checkpoint directory's (single) model.safetensors or shards, by name. */
static bool tensor_bytes_equal(const mq_st *a, const mq_st *b, const char *name) {
    const mq_tensor_view *x = mq_st_find(a, name), *y = mq_st_find(b, name);
    return x && y && x->dtype == y->dtype && x->nbytes == y->nbytes &&
           memcmp(x->data, y->data, x->nbytes) == 0;
}

/* The packed runtime against the fp32 path on the same checkpoint, layer by layer from the same
 * input (the fp32 path's), so that a token routed differently by the two paths changes only its
 * own row of that layer's output. A token's routing near a tie is found on the fp32 path's FFN
 * input (the MQ_SITE_FFN hook): routed as it is and with each value moved by +-2e-4 of itself
 * (signs from a fixed pattern, both ways); a token whose experts then change is left out of that
 * layer's comparison (the packed products, summed in other orders, move the FFN input by about
 * 1e-4 and may route it either way, and its row then differs by far more than rounding).
 * Returns the largest difference of a compared row relative to the layer output's largest value;
 * *n_near: the (layer, token) pairs left out, *first_near: the first token left out (T: none). */
typedef struct {
    const moeq_model *m;
    int T;
    bool *near;
} tie_probe;

static void tie_probe_ffn(void *user, int layer, mq_site site, int expert, const float *x, int64_t rows,
                          int64_t cols) {
    (void)expert;
    tie_probe *tp = user;
    if (site != MQ_SITE_FFN || !tp->m->layers[layer].is_moe) return;
    const int64_t E = tp->m->cfg.n_experts, K = tp->m->cfg.top_k;
    float *xp = malloc(sizeof(float) * (size_t)(rows * cols)), *probs = malloc(sizeof(float) * (size_t)(rows * E)),
          *w = malloc(sizeof(float) * (size_t)(rows * K));
    int32_t *sel0 = malloc(sizeof(int32_t) * (size_t)(rows * K)), *sel = malloc(sizeof(int32_t) * (size_t)(rows * K));
    ASSERT_TRUE(xp && probs && w && sel0 && sel);
    mq_moe_route(tp->m, layer, x, rows, probs, sel0, w);
    for (int dir = -1; dir <= 1; dir += 2) {
        uint32_t h = 12345;
        for (int64_t i = 0; i < rows * cols; i++) {
            h = h * 1664525u + 1013904223u;
            xp[i] = x[i] * (1.0f + (float)dir * ((h >> 31) ? 2e-4f : -2e-4f));
        }
        mq_moe_route(tp->m, layer, xp, rows, probs, sel, w);
        for (int64_t t = 0; t < rows && t < tp->T; t++)
            for (int64_t k = 0; k < K; k++) tp->near[t] |= sel[t * K + k] != sel0[t * K + k];
    }
    free(xp), free(probs), free(w), free(sel0), free(sel);
}

static double packed_by_layer(const char *dir, const int32_t *ids, int T, int *n_near, int *first_near) {
    moeq_model *mf = NULL, *mp = NULL;
    moeq_model_options of = {.no_tokenizer = 1}, op = {.no_tokenizer = 1, .keep_packed = 1};
    ASSERT_OK(moeq_model_open(dir, &of, &mf));
    ASSERT_OK(moeq_model_open(dir, &op, &mp));
    const int64_t D = mf->cfg.D;
    mq_state *sf = NULL, *sp = NULL;
    ASSERT_OK(mq_state_new(mf, T, &sf));
    ASSERT_OK(mq_state_new(mp, T, &sp));
    float *x = malloc(sizeof(float) * (size_t)(T * D)), *y = malloc(sizeof(float) * (size_t)(T * D));
    bool *near = malloc(sizeof(bool) * (size_t)T);
    ASSERT_TRUE(x && y && near);
    ASSERT_OK(mq_embed(mf, ids, T, x));
    double worst = 0;
    *n_near = 0;
    *first_near = T;
    for (int l = 0; l < mf->cfg.n_layers; l++) {
        memcpy(y, x, sizeof(float) * (size_t)(T * D));
        memset(near, 0, sizeof(bool) * (size_t)T);
        tie_probe tp = {mf, T, near};
        mq_hooks hooks = {tie_probe_ffn, &tp};
        ASSERT_OK(mq_forward_layers(mf, sf, x, T, 0, l, l + 1, &hooks));
        ASSERT_OK(mq_forward_layers(mp, sp, y, T, 0, l, l + 1, NULL));
        float ref = 0;
        for (int64_t i = 0; i < T * D; i++) ref = fabsf(x[i]) > ref ? fabsf(x[i]) : ref;
        for (int t = 0; t < T; t++) {
            if (near[t]) {
                (*n_near)++;
                if (t < *first_near) *first_near = t;
                continue;
            }
            for (int64_t i = t * D; i < (t + 1) * D; i++) {
                const double d = fabs((double)y[i] - x[i]) / ref;
                worst = d > worst || d != d ? d : worst;
            }
        }
    }
    free(x), free(y), free(near);
    mq_state_free(sf);
    mq_state_free(sp);
    moeq_model_free(mf);
    moeq_model_free(mp);
    return worst;
}

static void test_gptq_packed_mtp(void) {
    const char *src = mq_test_with_tokenizer("deepseekv3-tiny");
    char out[1200];
    snprintf(out, sizeof out, "%s/gptq", mq_test_tmpdir());
    moeq_quant_options o;
    opts_nvfp4(&o, true);
    moeq_quant_result r;
    ASSERT_OK(moeq_quantize(src, out, &o, &r));

    mq_st *a = NULL, *b = NULL;
    ASSERT_OK(mq_st_open_dir(src, &a));
    ASSERT_OK(mq_st_open_dir(out, &b));
    /* every Linear of the latent attention, the dense MLP, experts and shared experts quantized
     * (compressed-tensors NVFP4: weight_packed), routers and their bias as in the source */
    const char *q[] = {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                       "self_attn.kv_b_proj", "self_attn.o_proj"};
    char n[256];
    for (int l = 0; l < 3; l++)
        for (int i = 0; i < 5; i++) {
            snprintf(n, sizeof n, "model.layers.%d.%s.weight_packed", l, q[i]);
            if (!mq_st_find(b, n)) FAIL("'%s' missing", n);
        }
    ASSERT_TRUE(mq_st_find(b, "model.layers.0.mlp.down_proj.weight_packed") != NULL);
    ASSERT_TRUE(mq_st_find(b, "model.layers.1.mlp.experts.15.up_proj.weight_packed") != NULL);
    ASSERT_TRUE(mq_st_find(b, "model.layers.2.mlp.shared_experts.gate_proj.weight_packed") != NULL);
    ASSERT_TRUE(tensor_bytes_equal(a, b, "model.layers.1.mlp.gate.weight"));
    ASSERT_TRUE(tensor_bytes_equal(a, b, "model.layers.2.mlp.gate.e_score_correction_bias"));
    ASSERT_TRUE(tensor_bytes_equal(a, b, "model.layers.1.self_attn.kv_a_layernorm.weight"));
    /* the MTP layer: every tensor of layer 3 byte for byte, nothing quantized there */
    int n_mtp = 0;
    for (size_t i = 0; i < mq_st_count(a); i++) {
        const char *name = mq_st_at(a, i)->name;
        if (strncmp(name, "model.layers.3.", 15) != 0) continue;
        if (!tensor_bytes_equal(a, b, name)) FAIL("MTP tensor '%s' not passed through", name);
        n_mtp++;
    }
    ASSERT_EQ_INT(68, n_mtp); /* 62 of a MoE decoder layer, 6 of the MTP head */
    for (size_t i = 0; i < mq_st_count(b); i++)
        if (strncmp(mq_st_at(b, i)->name, "model.layers.3.", 15) == 0 &&
            strstr(mq_st_at(b, i)->name, "weight_packed"))
            FAIL("'%s': an MTP tensor was quantized", mq_st_at(b, i)->name);
    mq_st_close(a);
    mq_st_close(b);

    /* each of q_b and kv_b had a Hessian of its own: GPTQ ran on every attention Linear */
    char rp[1400], *rep;
    size_t rl;
    snprintf(rp, sizeof rp, "%s/gptq_report.json", out);
    ASSERT_OK(mq_read_file(rp, &rep, &rl));
    for (int i = 0; i < 5; i++) {
        snprintf(n, sizeof n, "model.layers.1.%s\"", q[i]);
        char *at = strstr(rep, n);
        if (!at) FAIL("report has no '%s'", n);
        char *end = strchr(at, '}');
        char *how = strstr(at, "\"method\"");
        ASSERT_TRUE(how && how < end && strncmp(strchr(how, ':') + 1, "\t\"gptq\"", 7) == 0);
    }
    free(rep);

    /* the packed runtime (its op's sigmoid group-limited routing with the selection bias, the
     * packed latent-attention Linears) against the fp32 path on the same checkpoint's
     * dequantized weights; both near the unquantized model */
    int32_t ids[48];
    for (int i = 0; i < 48; i++) ids[i] = (int32_t)(7 + 83 * i) % 4096;
    int npk = 0;
    float *lp = logits_of(out, true, ids, 48, &npk), *lf = logits_of(out, false, ids, 48, NULL);
    float *l0 = logits_of(src, false, ids, 48, NULL);
    /* layer by layer from the same inputs, leaving out tokens whose routing is near a tie (where
     * those are depends on which calibration text made the checkpoint: none with the fixtures'
     * text; with data/demo-calib.txt token 5 of 48, whose different experts then move every
     * later token's logits through the attention by up to 0.26 of the largest); the logits
     * themselves up to the first such token */
    int n_near = 0, first_near = 48;
    const double e_layer = packed_by_layer(out, ids, 48, &n_near, &first_near);
    const double e_pk = first_near > 0 ? mq_test_rel_maxdiff(lp, lf, (size_t)first_near * 4096) : 0;
    const double e_q = mq_test_rel_maxdiff(lf, l0, 48 * 4096);
    fprintf(stderr,
            "  %d Linears packed; packed vs dequantized fp32: layer outputs rel %.3g (%d of 3 x 48 "
            "tokens near a routing tie left out), logits rel %.3g over the %d tokens before the first; "
            "quantized vs unquantized: rel %.3g\n",
            npk, e_layer, n_near, e_pk, first_near, e_q);
    ASSERT_EQ_INT(3 * 5 + 3 + 2 * (16 * 3 + 3), npk);
    ASSERT_TRUE(e_layer < 5e-3);
    ASSERT_TRUE(e_pk < 5e-3);
    ASSERT_TRUE(n_near <= 6);   /* ties are rare: the comparison covers nearly every row */
    ASSERT_TRUE(e_q > 1e-3);
    free(lp);
    free(lf);
    free(l0);

    /* GPTQ beats RTN on held-out text (KL against the unquantized model; measured 0.033 and
     * 0.059 nats per token) */
    char rtn[1200];
    snprintf(rtn, sizeof rtn, "%s/rtn", mq_test_tmpdir());
    opts_nvfp4(&o, false);
    ASSERT_OK(moeq_quantize(src, rtn, &o, &r));
    double kl[2];
    moeq_model *base = mq_test_open_model(src, NULL);
    moeq_docs *docs = mq_test_demo_docs();
    for (int i = 0; i < 2; i++) {
        moeq_model *m = mq_test_open_model(i ? rtn : out, NULL);
        moeq_eval_options eo = mq_test_text_eval(128, base);
        moeq_eval_result er;
        ASSERT_OK(moeq_eval(m, docs, &eo, &er));
        kl[i] = er.kl_mean;
        moeq_model_free(m);
    }
    fprintf(stderr, "  KL to the unquantized model: GPTQ %.4g, RTN %.4g nats/token\n", kl[0],
            kl[1]);
    ASSERT_TRUE(kl[0] > 0 && kl[0] < 0.8 * kl[1]);
    moeq_docs_free(docs);
    moeq_model_free(base);

    /* --drop-mtp: no layer 3 in the output, and its config says so */
    snprintf(out, sizeof out, "%s/rtn-drop", mq_test_tmpdir());
    opts_nvfp4(&o, false);
    o.drop_mtp = 1;
    ASSERT_OK(moeq_quantize(src, out, &o, &r));
    ASSERT_OK(mq_st_open_dir(out, &b));
    for (size_t i = 0; i < mq_st_count(b); i++)
        if (strncmp(mq_st_at(b, i)->name, "model.layers.3.", 15) == 0)
            FAIL("'%s' kept despite drop_mtp", mq_st_at(b, i)->name);
    mq_st_close(b);
    snprintf(rp, sizeof rp, "%s/config.json", out);
    ASSERT_OK(mq_read_file(rp, &rep, &rl));
    ASSERT_TRUE(strstr(rep, "\"num_nextn_predict_layers\":\t0") != NULL);
    free(rep);
}

/* An FP8 source quantizes to exactly what its dequantized twin (deepseekv3-tiny, the same
 * weights in F32) gives: RTN reads the same fp32 values. */
static void test_fp8_source_same_codes(void) {
    char o8[1200], o32[1200];
    snprintf(o8, sizeof o8, "%s/from-fp8", mq_test_tmpdir());
    snprintf(o32, sizeof o32, "%s/from-f32", mq_test_tmpdir());
    moeq_quant_options o;
    opts_nvfp4(&o, false);
    moeq_quant_result r;
    ASSERT_OK(moeq_quantize(data_dir("deepseekv3-fp8-tiny"), o8, &o, &r));
    o.drop_mtp = 1;
    ASSERT_OK(moeq_quantize(data_dir("deepseekv3-tiny"), o32, &o, &r));
    mq_st *a = NULL, *b = NULL;
    ASSERT_OK(mq_st_open_dir(o8, &a));
    ASSERT_OK(mq_st_open_dir(o32, &b));
    ASSERT_EQ_INT((int64_t)mq_st_count(b), (int64_t)mq_st_count(a));
    int packed = 0;
    for (size_t i = 0; i < mq_st_count(a); i++) {
        const char *name = mq_st_at(a, i)->name;
        if (!tensor_bytes_equal(a, b, name))
            FAIL("'%s' differs between the FP8 and F32 sources", name);
        packed += strstr(name, "weight_packed") != NULL;
    }
    ASSERT_EQ_INT(3 * 5 + 3 + 2 * (16 * 3 + 3), packed);
    mq_st_close(a);
    mq_st_close(b);
}

/* NVFP4 as GGUF: llama.cpp's deepseek2 graph applies no global scales (INT4 is written, test_gguf) */
static void test_gguf_refused(void) {
    char out[1200];
    snprintf(out, sizeof out, "%s/x.gguf", mq_test_tmpdir());
    moeq_quant_options o;
    opts_nvfp4(&o, false);
    o.format = MOEQ_FORMAT_GGUF;
    moeq_quant_result r;
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_quantize(data_dir("deepseekv3-tiny"), out, &o, &r));
    ASSERT_ERROR_MENTIONS("deepseek2");
    struct stat s;
    ASSERT_TRUE(stat(out, &s) != 0);
}

TEST_MAIN(T(test_config_fixture), T(test_config_release), T(test_config_errors),
          T(test_golden_qlora_yarn), T(test_golden_fp8), T(test_golden_noqlora),
          T(test_latent_attention_variants), T(test_mtp_needs_its_config), T(test_group_select),
          T(test_gptq_packed_mtp), T(test_fp8_source_same_codes), T(test_gguf_refused))
