/* Whole-checkpoint quantization (src/export/quantize.c) on the fixture models: per output format,
 * tensor names, dtypes and shapes and the config block against formats.md section 2; fused global
 * scales; ignore lists; write -> read round trips bit-identical to in-memory RTN; atomic output
 * (existing directory, interrupt, numeric error); sharding. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "export/writer.h"
#include "pipeline/pipeline.h"
#include "harness.h"
#include "ckpt/source.h"

/* The shared fixture model, or the bundled copy (olmoe-tiny) without the shared folder. */
static const char *fixture(const char *model) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s", mq_test_model(model));
    return buf;
}

static char *outdir(const char *name) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/%s", mq_test_tmpdir(), name);
    return buf;
}

static char *read_all(const char *dir, const char *name, size_t *len) {
    char path[2500];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *text = NULL;
    size_t n = 0;
    if (mq_read_file(path, &text, &n) != MOEQ_OK) return NULL;
    if (len) *len = n;
    return text;
}

static cJSON *read_json(const char *dir, const char *name) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *text;
    size_t len;
    if (mq_read_file(path, &text, &len) != MOEQ_OK) return NULL;
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    return j;
}

static const cJSON *jget(const cJSON *o, const char *path) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    const cJSON *cur = o;
    for (char *tok = strtok(buf, "/"); tok && cur; tok = strtok(NULL, "/"))
        cur = cJSON_GetObjectItemCaseSensitive(cur, tok);
    return cur;
}

#define ASSERT_JSTR(obj, path, want)                                                               \
    do {                                                                                           \
        const cJSON *j_ = jget(obj, path);                                                         \
        ASSERT_EQ_STR(want, cJSON_IsString(j_) ? j_->valuestring : "(missing)");                   \
    } while (0)
#define ASSERT_JNUM(obj, path, want)                                                               \
    do {                                                                                           \
        const cJSON *j_ = jget(obj, path);                                                         \
        ASSERT_TRUE(cJSON_IsNumber(j_));                                                           \
        if (cJSON_IsNumber(j_)) ASSERT_NEAR(want, j_->valuedouble, 0);                             \
    } while (0)

static bool json_array_has(const cJSON *arr, const char *s) {
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) if (cJSON_IsString(e) && strcmp(e->valuestring, s) == 0) return true;
    return false;
}

static void expect(const mq_st *st, const char *name, moeq_dtype dt, int ndim, int64_t d0, int64_t d1) {
    const mq_tensor_view *t = mq_st_find(st, name);
    if (!t) {
        FAIL("tensor '%s' missing", name);
        return;
    }
    ASSERT_EQ_STR(moeq_dtype_name(dt), moeq_dtype_name(t->dtype));
    ASSERT_EQ_INT(ndim, t->ndim);
    if (ndim > 0) ASSERT_EQ_INT(d0, t->shape[0]);
    if (ndim > 1) ASSERT_EQ_INT(d1, t->shape[1]);
}

static float scalar(const mq_st *st, const char *name) {
    const mq_tensor_view *t = mq_st_find(st, name);
    float v = NAN;
    if (t && t->nbytes == 4) memcpy(&v, t->data, 4);
    return v;
}

static float *load_f32(const mq_st *st, const char *name, int64_t *n) {
    const mq_tensor_view *t = mq_st_find(st, name);
    if (!t) return NULL;
    float *w = malloc(sizeof(float) * (size_t)t->numel);
    if (mq_tensor_to_f32(t, w) != MOEQ_OK) {
        free(w);
        return NULL;
    }
    *n = t->numel;
    return w;
}

static const mq_tensor_view *st_lookup(void *user, const char *name) {
    return mq_st_find(user, name);
}

/* The written module dequantizes exactly like RTN of the source weight with the same spec and
 * global scale. */
static void check_round_trip(const mq_st *src, const mq_st *out, const char *module,
                             const mq_qspec *spec, float global_scale) {
    char name[512];
    snprintf(name, sizeof name, "%s.weight", module);
    int64_t n;
    float *w = load_f32(src, name, &n);
    if (!w) {
        FAIL("source '%s' missing", name);
        return;
    }
    const mq_tensor_view *t = mq_st_find(src, name);
    int64_t R = t->shape[0], C = t->shape[1];
    mq_qtensor q;
    ASSERT_OK(mq_quantize_rtn(spec, w, R, C, global_scale, module, &q));
    float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
    mq_dequantize(&q, a);
    mq_linear_kind kind;
    ASSERT_OK(mq_load_linear_weight(out, module, R, C, b, &kind));
    ASSERT_TRUE(kind != MQ_LIN_DENSE);
    if (memcmp(a, b, sizeof(float) * (size_t)n) != 0)
        FAIL("%s: the written weight does not load as the in-memory RTN result", module);
    mq_qtensor_free(&q);
    free(a); free(b); free(w);
}

static float amax_of(const mq_st *st, const char *name) {
    int64_t n;
    float *w = load_f32(st, name, &n);
    float a = w ? mq_absmax(w, n) : NAN;
    free(w);
    return a;
}

static void test_ct_nvfp4_olmoe(void) {
    const char *model = fixture("olmoe-tiny");
    const char *out = outdir("olmoe-ct-nvfp4");
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    mq_pipeline_result stats;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &stats));
    ASSERT_EQ_INT(4 * (4 + 8 * 3), stats.n_quantized);   /* q,k,v,o + 8 experts x 3 per layer */
    ASSERT_EQ_INT(4, stats.n_kept);                       /* the routers */
    mq_st *src, *st;
    ASSERT_OK(mq_st_open_dir(model, &src));
    ASSERT_OK(mq_st_open_dir(out, &st));
    const char *q = "model.layers.0.self_attn.q_proj";
    expect(st, "model.layers.0.self_attn.q_proj.weight_packed", MOEQ_DT_U8, 2, 256, 128);
    expect(st, "model.layers.0.self_attn.q_proj.weight_scale", MOEQ_DT_F8_E4M3, 2, 256, 16);
    expect(st, "model.layers.0.self_attn.q_proj.weight_global_scale", MOEQ_DT_F32, 1, 1, 0);
    expect(st, "model.layers.2.mlp.experts.7.down_proj.weight_packed", MOEQ_DT_U8, 2, 256, 128);
    expect(st, "model.layers.0.mlp.gate.weight", MOEQ_DT_BF16, 2, 8, 256);
    expect(st, "model.embed_tokens.weight", MOEQ_DT_BF16, 2, 4096, 256);
    expect(st, "lm_head.weight", MOEQ_DT_BF16, 2, 4096, 256);
    expect(st, "model.layers.0.self_attn.q_norm.weight", MOEQ_DT_BF16, 1, 256, 0);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.self_attn.q_proj.weight") == NULL);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.self_attn.q_proj.input_global_scale") == NULL);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.self_attn.q_proj.weight_zero_point") == NULL);
    /* fused global scales: q/k/v share 2688/joint amax; each expert's gate/up share theirs */
    float joint = fmaxf(fmaxf(amax_of(src, "model.layers.0.self_attn.q_proj.weight"),
                              amax_of(src, "model.layers.0.self_attn.k_proj.weight")),
                        amax_of(src, "model.layers.0.self_attn.v_proj.weight"));
    float gq = scalar(st, "model.layers.0.self_attn.q_proj.weight_global_scale");
    ASSERT_NEAR(2688.0f / joint, gq, 0);
    ASSERT_NEAR(gq, scalar(st, "model.layers.0.self_attn.k_proj.weight_global_scale"), 0);
    ASSERT_NEAR(gq, scalar(st, "model.layers.0.self_attn.v_proj.weight_global_scale"), 0);
    float gg = scalar(st, "model.layers.1.mlp.experts.3.gate_proj.weight_global_scale");
    ASSERT_NEAR(gg, scalar(st, "model.layers.1.mlp.experts.3.up_proj.weight_global_scale"), 0);
    float ge = fmaxf(amax_of(src, "model.layers.1.mlp.experts.3.gate_proj.weight"),
                     amax_of(src, "model.layers.1.mlp.experts.3.up_proj.weight"));
    ASSERT_NEAR(2688.0f / ge, gg, 0);
    float go = scalar(st, "model.layers.0.self_attn.o_proj.weight_global_scale");
    ASSERT_NEAR(2688.0f / amax_of(src, "model.layers.0.self_attn.o_proj.weight"), go, 0);
    check_round_trip(src, st, q, &o.spec, gq);
    mq_linear_qinfo qi;
    ASSERT_OK(mq_linear_qinfo_get(st, q, &qi));
    ASSERT_EQ_INT(MQ_LIN_CT_NVFP4, qi.kind);
    ASSERT_EQ_INT(256, qi.rows);
    ASSERT_EQ_INT(256, qi.cols);
    ASSERT_NEAR(4.5 + 32.0 / 65536, qi.bits_per_weight, 1e-12);
    ASSERT_OK(mq_linear_qinfo_get(st, "model.layers.0.mlp.gate", &qi));
    ASSERT_EQ_INT(MQ_LIN_DENSE, qi.kind);
    ASSERT_NEAR(16.0, qi.bits_per_weight, 0);
    /* an unquantized Linear loads as its bf16 values */
    float router[8 * 256];
    int64_t nr;
    float *want = load_f32(src, "model.layers.0.mlp.gate.weight", &nr);
    ASSERT_OK(mq_load_linear_weight(st, "model.layers.0.mlp.gate", 8, 256, router, NULL));
    ASSERT_TRUE(want && memcmp(want, router, sizeof router) == 0);
    free(want);
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_load_linear_weight(st, "model.layers.0.mlp.gate", 8, 128, router, NULL));
    ASSERT_STATUS(MOEQ_E_NOTFOUND, mq_load_linear_weight(st, "model.layers.9.mlp.gate", 8, 256, router, NULL));
    check_round_trip(src, st, "model.layers.1.mlp.experts.3.up_proj", &o.spec, gg);
    check_round_trip(src, st, "model.layers.0.self_attn.o_proj", &o.spec, go);
    /* config block (formats.md 2.1) */
    cJSON *cfg = read_json(out, "config.json");
    ASSERT_TRUE(cfg != NULL);
    const cJSON *qc = jget(cfg, "quantization_config");
    ASSERT_JSTR(qc, "quant_method", "compressed-tensors");
    ASSERT_JSTR(qc, "format", "nvfp4-pack-quantized");
    ASSERT_JSTR(qc, "quantization_status", "compressed");
    ASSERT_JSTR(cfg, "model_type", "olmoe");
    const cJSON *wq = jget(qc, "config_groups/group_0/weights");
    ASSERT_JNUM(wq, "num_bits", 4);
    ASSERT_JSTR(wq, "type", "float");
    ASSERT_JNUM(wq, "group_size", 16);
    ASSERT_JSTR(wq, "strategy", "tensor_group");
    ASSERT_TRUE(cJSON_IsTrue(jget(wq, "symmetric")));
    ASSERT_TRUE(cJSON_IsFalse(jget(wq, "dynamic")));
    ASSERT_TRUE(cJSON_IsNull(jget(qc, "config_groups/group_0/input_activations")));
    ASSERT_TRUE(json_array_has(jget(qc, "config_groups/group_0/targets"), "Linear"));
    const cJSON *ign = jget(qc, "ignore");
    ASSERT_EQ_INT(5, cJSON_GetArraySize(ign));
    ASSERT_TRUE(json_array_has(ign, "lm_head"));
    ASSERT_TRUE(json_array_has(ign, "model.layers.3.mlp.gate"));
    cJSON_Delete(cfg);
    char path[1200];
    snprintf(path, sizeof path, "%s/tokenizer.json", out);
    ASSERT_TRUE(mq_file_exists(path));
    snprintf(path, sizeof path, "%s/tokenizer_config.json", out);
    ASSERT_TRUE(mq_file_exists(path));
    mq_st_close(st);
    mq_st_close(src);
}

static void test_modelopt_nvfp4_qwen2moe(void) {
    const char *model = fixture("qwen2moe-tiny");
    const char *out = outdir("qwen2moe-modelopt");
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_MODELOPT);
    ASSERT_EQ_INT(MQ_NVFP4_MUL, o.spec.nvfp4_conv);
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    mq_st *src, *st;
    ASSERT_OK(mq_st_open_dir(model, &src));
    ASSERT_OK(mq_st_open_dir(out, &st));
    const char *sg = "model.layers.0.mlp.shared_expert.gate_proj";
    expect(st, "model.layers.0.mlp.shared_expert.gate_proj.weight", MOEQ_DT_U8, 2, 256, 128);
    expect(st, "model.layers.0.mlp.shared_expert.gate_proj.weight_scale", MOEQ_DT_F8_E4M3, 2, 256, 16);
    expect(st, "model.layers.0.mlp.shared_expert.gate_proj.weight_scale_2", MOEQ_DT_F32, 0, 0, 0);
    expect(st, "model.layers.0.mlp.experts.5.down_proj.weight", MOEQ_DT_U8, 2, 256, 64);
    expect(st, "model.layers.0.mlp.shared_expert_gate.weight", MOEQ_DT_BF16, 2, 1, 256);
    expect(st, "model.layers.0.self_attn.q_proj.bias", MOEQ_DT_BF16, 1, 256, 0);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.self_attn.q_proj.input_scale") == NULL);
    float s2 = scalar(st, "model.layers.0.mlp.shared_expert.gate_proj.weight_scale_2");
    ASSERT_NEAR(s2, scalar(st, "model.layers.0.mlp.shared_expert.up_proj.weight_scale_2"), 0);
    float joint = fmaxf(amax_of(src, "model.layers.0.mlp.shared_expert.gate_proj.weight"),
                        amax_of(src, "model.layers.0.mlp.shared_expert.up_proj.weight"));
    ASSERT_NEAR(joint / 2688.0f, s2, 0);
    check_round_trip(src, st, sg, &o.spec, s2);
    cJSON *h = read_json(out, "hf_quant_config.json");
    ASSERT_TRUE(h != NULL);
    ASSERT_JSTR(h, "producer/name", "modelopt");
    ASSERT_JSTR(h, "quantization/quant_algo", "W4A16_NVFP4");
    ASSERT_JNUM(h, "quantization/group_size", 16);
    ASSERT_TRUE(cJSON_IsNull(jget(h, "quantization/kv_cache_quant_algo")));
    const cJSON *ex = jget(h, "quantization/exclude_modules");
    ASSERT_TRUE(json_array_has(ex, "model.layers.0.mlp.shared_expert_gate"));
    ASSERT_TRUE(json_array_has(ex, "model.layers.0.mlp.gate"));
    ASSERT_TRUE(json_array_has(ex, "lm_head"));
    cJSON_Delete(h);
    cJSON *cfg = read_json(out, "config.json");
    ASSERT_JSTR(cfg, "quantization_config/quant_method", "modelopt");
    ASSERT_JSTR(cfg, "quantization_config/quant_algo", "W4A16_NVFP4");
    ASSERT_TRUE(json_array_has(jget(cfg, "quantization_config/ignore"), "model.layers.3.mlp.gate"));
    cJSON_Delete(cfg);
    mq_st_close(st);
    mq_st_close(src);
}

static void test_ct_int4_and_gptq_llama(void) {
    const char *model = fixture("llama-tiny");
    mq_st *src, *st;
    ASSERT_OK(mq_st_open_dir(model, &src));
    /* compressed-tensors pack-quantized, group 128, symmetric */
    const char *out = outdir("llama-ct-int4");
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    ASSERT_OK(mq_st_open_dir(out, &st));
    expect(st, "model.layers.1.mlp.down_proj.weight_packed", MOEQ_DT_I32, 2, 256, 96);
    expect(st, "model.layers.1.mlp.down_proj.weight_scale", MOEQ_DT_BF16, 2, 256, 6);
    expect(st, "model.layers.1.mlp.down_proj.weight_shape", MOEQ_DT_I64, 1, 2, 0);
    expect(st, "model.layers.1.self_attn.k_proj.weight_packed", MOEQ_DT_I32, 2, 128, 32);
    ASSERT_TRUE(mq_st_find(st, "model.layers.1.mlp.down_proj.weight_zero_point") == NULL);
    ASSERT_TRUE(mq_st_find(st, "model.layers.1.mlp.down_proj.weight_global_scale") == NULL);
    check_round_trip(src, st, "model.layers.1.mlp.down_proj", &o.spec, 1.0f);
    cJSON *cfg = read_json(out, "config.json");
    const cJSON *qc = jget(cfg, "quantization_config");
    ASSERT_JSTR(qc, "format", "pack-quantized");
    ASSERT_JSTR(qc, "config_groups/group_0/weights/type", "int");
    ASSERT_JSTR(qc, "config_groups/group_0/weights/strategy", "group");
    ASSERT_JNUM(qc, "config_groups/group_0/weights/group_size", 128);
    ASSERT_TRUE(cJSON_IsTrue(jget(qc, "config_groups/group_0/weights/symmetric")));
    ASSERT_TRUE(cJSON_IsNull(jget(qc, "config_groups/group_0/weights/actorder")));
    ASSERT_EQ_INT(1, cJSON_GetArraySize(jget(qc, "ignore")));   /* lm_head only: tied, dense */
    cJSON_Delete(cfg);
    mq_st_close(st);
    /* asymmetric group 32 */
    out = outdir("llama-ct-int4-asym");
    o.spec.group_size = 32;
    o.spec.asym = true;
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    ASSERT_OK(mq_st_open_dir(out, &st));
    expect(st, "model.layers.0.self_attn.k_proj.weight_zero_point", MOEQ_DT_I32, 2, 16, 8);
    check_round_trip(src, st, "model.layers.0.self_attn.k_proj", &o.spec, 1.0f);
    cfg = read_json(out, "config.json");
    ASSERT_TRUE(cJSON_IsFalse(jget(cfg, "quantization_config/config_groups/group_0/weights/symmetric")));
    cJSON_Delete(cfg);
    mq_st_close(st);
    /* GPTQ v1 */
    out = outdir("llama-gptq");
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_GPTQ);
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    ASSERT_OK(mq_st_open_dir(out, &st));
    expect(st, "model.layers.0.mlp.up_proj.qweight", MOEQ_DT_I32, 2, 32, 768);
    expect(st, "model.layers.0.mlp.up_proj.qzeros", MOEQ_DT_I32, 2, 2, 96);
    expect(st, "model.layers.0.mlp.up_proj.scales", MOEQ_DT_F16, 2, 2, 768);
    expect(st, "model.layers.0.mlp.up_proj.g_idx", MOEQ_DT_I32, 1, 256, 0);
    uint32_t z;
    memcpy(&z, mq_st_find(st, "model.layers.0.mlp.up_proj.qzeros")->data, 4);
    ASSERT_EQ_HEX(0x77777777u, z);
    check_round_trip(src, st, "model.layers.0.mlp.up_proj", &o.spec, 1.0f);
    mq_linear_qinfo qi;
    ASSERT_OK(mq_linear_qinfo_get(st, "model.layers.0.mlp.up_proj", &qi));
    ASSERT_EQ_INT(MQ_LIN_GPTQ, qi.kind);
    ASSERT_EQ_INT(768, qi.rows);
    ASSERT_EQ_INT(256, qi.cols);
    ASSERT_EQ_INT(128, qi.group_size);
    ASSERT_FALSE(qi.asym);
    ASSERT_FALSE(qi.act_order);
    ASSERT_NEAR((768.0 * 128 + 2 * 96 * 4 + 2 * 768 * 2 + 256 * 4) * 8 / (768.0 * 256), qi.bits_per_weight, 1e-12);
    cfg = read_json(out, "config.json");
    ASSERT_JSTR(cfg, "quantization_config/quant_method", "gptq");
    ASSERT_JNUM(cfg, "quantization_config/bits", 4);
    ASSERT_JNUM(cfg, "quantization_config/group_size", 128);
    ASSERT_TRUE(cJSON_IsTrue(jget(cfg, "quantization_config/sym")));
    ASSERT_TRUE(cJSON_IsFalse(jget(cfg, "quantization_config/desc_act")));
    ASSERT_JSTR(cfg, "quantization_config/checkpoint_format", "gptq");
    cJSON_Delete(cfg);
    cJSON *qz = read_json(out, "quantize_config.json");
    ASSERT_JNUM(qz, "bits", 4);
    cJSON_Delete(qz);
    mq_st_close(st);
    mq_st_close(src);
}

static void test_fused_experts_on_disk_are_split_per_expert(void) {
    const char *model = mq_test_repo("tests/data/mixtral-tiny-fused");
    const char *out = outdir("mixtral-fused-ct");
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    mq_st *src, *st;
    ASSERT_OK(mq_st_open_dir(model, &src));
    ASSERT_OK(mq_st_open_dir(out, &st));
    /* per-expert hub names: Mixtral's MoE block goes back under block_sparse_moe */
    expect(st, "model.layers.0.block_sparse_moe.experts.2.w1.weight_packed", MOEQ_DT_U8, 2, 96, 32);
    expect(st, "model.layers.0.block_sparse_moe.experts.2.w3.weight_packed", MOEQ_DT_U8, 2, 96, 32);
    expect(st, "model.layers.0.block_sparse_moe.experts.2.w2.weight_packed", MOEQ_DT_U8, 2, 64, 48);
    expect(st, "model.layers.0.block_sparse_moe.gate.weight", MOEQ_DT_BF16, 2, 4, 64);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.mlp.experts.gate_up_proj") == NULL);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.mlp.gate.weight") == NULL);
    float g1 = scalar(st, "model.layers.0.block_sparse_moe.experts.2.w1.weight_global_scale");
    ASSERT_NEAR(g1, scalar(st, "model.layers.0.block_sparse_moe.experts.2.w3.weight_global_scale"), 0);
    /* expert 2's gate_up slice: its joint amax gives the shared scale */
    const mq_tensor_view *gu = mq_st_find(src, "model.layers.0.mlp.experts.gate_up_proj");
    float *all = malloc(sizeof(float) * (size_t)gu->numel);
    ASSERT_OK(mq_tensor_to_f32(gu, all));
    ASSERT_NEAR(2688.0f / mq_absmax(all + 2 * 192 * 64, 192 * 64), g1, 0);
    /* w1 = the first 96 rows of the slice */
    mq_qtensor q, back;
    ASSERT_OK(mq_quantize_rtn(&o.spec, all + 2 * 192 * 64, 96, 64, g1, "w1", &q));
    ASSERT_OK(mq_layout_read("model.layers.0.block_sparse_moe.experts.2.w1", 96, 64, st_lookup, st, &back));
    ASSERT_TRUE(back.codes && memcmp(q.codes, back.codes, 96 * 64) == 0);
    mq_qtensor_free(&q);
    mq_qtensor_free(&back);
    free(all);
    mq_st_close(st);
    mq_st_close(src);
}

static void test_ignore_no_fuse_and_sharding(void) {
    const char *model = fixture("olmoe-tiny");
    const char *out = outdir("olmoe-ignore");
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    const char *ign[] = {"layers\\.1\\.self_attn\\.q_proj$", "experts\\.0\\.down"};
    o.ignore = ign;
    o.n_ignore = 2;
    o.no_fuse = true;
    o.max_shard_bytes = 1 << 20;
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    char path[1200];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
    ASSERT_TRUE(mq_file_exists(path));
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    ASSERT_FALSE(mq_file_exists(path));
    mq_st *src, *st;
    ASSERT_OK(mq_st_open_dir(model, &src));
    ASSERT_OK(mq_st_open_dir(out, &st));
    /* q ignored -> k and v (fused with it in vLLM) stay unquantized too */
    expect(st, "model.layers.1.self_attn.q_proj.weight", MOEQ_DT_BF16, 2, 256, 256);
    expect(st, "model.layers.1.self_attn.k_proj.weight", MOEQ_DT_BF16, 2, 256, 256);
    expect(st, "model.layers.1.self_attn.v_proj.weight", MOEQ_DT_BF16, 2, 256, 256);
    expect(st, "model.layers.0.self_attn.v_proj.weight_packed", MOEQ_DT_U8, 2, 256, 128);
    expect(st, "model.layers.2.mlp.experts.0.down_proj.weight", MOEQ_DT_BF16, 2, 256, 256);
    const mq_tensor_view *a = mq_st_find(src, "model.layers.1.self_attn.k_proj.weight");
    const mq_tensor_view *b = mq_st_find(st, "model.layers.1.self_attn.k_proj.weight");
    ASSERT_TRUE(a && b && a->nbytes == b->nbytes && memcmp(a->data, b->data, a->nbytes) == 0);
    /* no_fuse: q and k get their own global scales */
    float gq = scalar(st, "model.layers.0.self_attn.q_proj.weight_global_scale");
    float gk = scalar(st, "model.layers.0.self_attn.k_proj.weight_global_scale");
    ASSERT_NEAR(2688.0f / amax_of(src, "model.layers.0.self_attn.q_proj.weight"), gq, 0);
    ASSERT_NEAR(2688.0f / amax_of(src, "model.layers.0.self_attn.k_proj.weight"), gk, 0);
    ASSERT_TRUE(gq != gk);
    cJSON *cfg = read_json(out, "config.json");
    const cJSON *ig = jget(cfg, "quantization_config/ignore");
    ASSERT_TRUE(json_array_has(ig, "model.layers.1.self_attn.v_proj"));
    ASSERT_TRUE(json_array_has(ig, "model.layers.3.mlp.experts.0.down_proj"));
    cJSON_Delete(cfg);
    mq_st_close(st);
    mq_st_close(src);
    /* a bad pattern is an error naming it */
    const char *bad[] = {"experts.(0"};
    o.ignore = bad;
    o.n_ignore = 1;
    o.force = true;
    ASSERT_STATUS(MOEQ_E_ARG, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("experts.(0");
}

static int count_entries(const char *dir) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", dir);
    FILE *f = popen(cmd, "r");
    int n = -1;
    if (f) {
        if (fscanf(f, "%d", &n) != 1) n = -1;
        pclose(f);
    }
    return n;
}

static void test_atomic_output(void) {
    const char *model = fixture(mq_test_have_shared() ? "llama-tiny" : "olmoe-tiny");
    char parent[1024], out[1100], path[1200];
    snprintf(parent, sizeof parent, "%s/atomic", mq_test_tmpdir());
    ASSERT_TRUE(mkdir(parent, 0755) == 0);
    snprintf(out, sizeof out, "%s/q", parent);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    /* existing OUT_DIR: refused without force, untouched */
    ASSERT_TRUE(mkdir(out, 0755) == 0);
    snprintf(path, sizeof path, "%s/keep.txt", out);
    ASSERT_OK(mq_write_file_atomic(path, "x", 1));
    ASSERT_STATUS(MOEQ_E_EXISTS, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("--force");
    ASSERT_TRUE(mq_file_exists(path));
    /* interrupted: nothing new is left behind, the old directory is intact */
    o.force = true;
    moeq_interrupt();
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, mq_pipeline_run(model, out, &o, NULL));
    moeq_clear_interrupt();
    ASSERT_EQ_INT(1, count_entries(parent));
    ASSERT_TRUE(mq_file_exists(path));
    /* force replaces it */
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    ASSERT_FALSE(mq_file_exists(path));
    snprintf(path, sizeof path, "%s/config.json", out);
    ASSERT_TRUE(mq_file_exists(path));
    ASSERT_EQ_INT(1, count_entries(parent));
    /* the model directory itself is never a valid output */
    ASSERT_STATUS(MOEQ_E_ARG, mq_pipeline_run(model, model, &o, NULL));
    /* quantizing a quantized checkpoint is refused */
    char out2[1100];
    snprintf(out2, sizeof out2, "%s/q2", parent);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_pipeline_run(out, out2, &o, NULL));
    ASSERT_EQ_INT(1, count_entries(parent));
    /* a format that cannot hold the scheme */
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_GPTQ);
    ASSERT_STATUS(MOEQ_E_ARG, mq_pipeline_run(model, out2, &o, NULL));
}

static void test_nan_weight_names_module_and_leaves_nothing(void) {
    char dir[1024], out[1100], path[1200];
    snprintf(dir, sizeof dir, "%s/nanmodel", mq_test_tmpdir());
    ASSERT_TRUE(mkdir(dir, 0755) == 0);
    snprintf(path, sizeof path, "%s/config.json", dir);
    const char *cfg = "{\"model_type\": \"llama\"}";
    ASSERT_OK(mq_write_file_atomic(path, cfg, strlen(cfg)));
    float w[32 * 32];
    for (int i = 0; i < 32 * 32; i++) w[i] = (float)(i % 13) * 0.01f;
    w[7 * 32 + 20] = NAN;
    mq_st_writer *sw = mq_stw_new();
    int64_t shape[2] = {32, 32};
    ASSERT_OK(mq_stw_add(sw, "model.layers.0.mlp.down_proj.weight", MOEQ_DT_F32, 2, shape, w, sizeof w));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ASSERT_OK(mq_stw_write(sw, path));
    mq_stw_free(sw);
    snprintf(out, sizeof out, "%s/nanout", mq_test_tmpdir());
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.group_size = 32;
    ASSERT_STATUS(MOEQ_E_NUMERIC, mq_pipeline_run(dir, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("model.layers.0.mlp.down_proj");
    ASSERT_ERROR_MENTIONS("row 7, column 20");
    ASSERT_FALSE(mq_dir_exists(out));
    /* NVFP4 on in-features that are not a multiple of 16 names the module */
    w[7 * 32 + 20] = 0;
    sw = mq_stw_new();
    int64_t odd[2] = {32, 24};
    ASSERT_OK(mq_stw_add(sw, "model.layers.0.mlp.down_proj.weight", MOEQ_DT_F32, 2, odd, w, 32 * 24 * 4));
    ASSERT_OK(mq_stw_write(sw, path));
    mq_stw_free(sw);
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_pipeline_run(dir, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("model.layers.0.mlp.down_proj");
    ASSERT_FALSE(mq_dir_exists(out));
}

/* ---- write-behind (export/writer.h) ---- */
enum { WB_N = 12, WB_ROWS = 256, WB_COLS = 512 };   /* 64 KiB packed, 8 KiB of scales a weight */

typedef struct {
    mq_tensor_decl d[WB_N * 4];
    char names[WB_N * 4][96];
    size_t n;
} wb_decls;

static moeq_status wb_describe(void *user, const char *name, moeq_dtype dtype, int ndim, const int64_t *shape) {
    wb_decls *x = user;
    snprintf(x->names[x->n], sizeof x->names[x->n], "%s", name);
    mq_tensor_decl *d = &x->d[x->n];
    d->name = x->names[x->n++];
    d->dtype = dtype;
    d->ndim = ndim;
    for (int i = 0; i < ndim; i++) d->shape[i] = shape[i];
    return MOEQ_OK;
}

/* WB_N NVFP4 Linears (RTN of distinct weights) through a writer in dir: written at once, or
 * queued (cap bytes) and flushed; max_shard_bytes small, so they spread over several files. */
static void wb_write(const char *dir, bool behind, size_t cap, const wb_decls *dd, const mq_qtensor *q) {
    mq_ckpt_opts o = {.format = MQ_FMT_CT, .spec = mq_qspec_default(MQ_QS_NVFP4), .max_shard_bytes = 300000};
    mq_ckpt_writer *w = NULL;
    ASSERT_TRUE(mkdir(dir, 0755) == 0);
    ASSERT_OK(mq_ckpt_writer_open(dir, dd->d, dd->n, &o, false, &w));
    if (behind) ASSERT_OK(mq_ckpt_writer_behind(w, cap));
    char mod[64];
    for (int i = 0; i < WB_N; i++) {
        snprintf(mod, sizeof mod, "model.layers.%d.mlp.down_proj", i);
        ASSERT_OK(mq_ckpt_writer_put_linear(w, mod, &q[i], 0));
    }
    ASSERT_OK(mq_ckpt_writer_flush(w));
    cJSON *cfg = cJSON_Parse("{\"model_type\": \"llama\"}");
    ASSERT_OK(mq_ckpt_writer_finish(w, cfg, dir, NULL, 0));
    cJSON_Delete(cfg);
    mq_ckpt_writer_close(w);
}

static void wb_setup(wb_decls *dd, mq_qtensor *q) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    float *w = malloc(sizeof(float) * WB_ROWS * WB_COLS);
    char mod[64];
    dd->n = 0;
    for (int i = 0; i < WB_N; i++) {
        for (int k = 0; k < WB_ROWS * WB_COLS; k++) w[k] = sinf(0.37f * (float)k + (float)i) * (float)(1 + i % 5);
        ASSERT_OK(mq_quantize_rtn(&s, w, WB_ROWS, WB_COLS, 0, "w", &q[i]));
        snprintf(mod, sizeof mod, "model.layers.%d.mlp.down_proj", i);
        ASSERT_OK(mq_layout_describe(MQ_FMT_CT, mod, &s, WB_ROWS, WB_COLS, false, false, wb_describe, dd));
    }
    free(w);
}

/* Queued writes land as direct ones do, byte for byte in every shard: in the emitters' own
 * buffers a tensor at a time (cap 1: each put waits for the one before), in a ring that wraps
 * and makes puts wait (100 KB: one packed weight and a few scales), in a ring holding them all. */
static void test_write_behind_equals_direct_writes(void) {
    wb_decls dd;
    mq_qtensor q[WB_N];
    wb_setup(&dd, q);
    char a[1024], b[1100], c[1100], d[1100];
    snprintf(a, sizeof a, "%s/wb_direct", mq_test_tmpdir());
    snprintf(b, sizeof b, "%s/wb_cap1", mq_test_tmpdir());
    snprintf(c, sizeof c, "%s/wb_ring", mq_test_tmpdir());
    snprintf(d, sizeof d, "%s/wb_all", mq_test_tmpdir());
    wb_write(a, false, 0, &dd, q);
    wb_write(b, true, 1, &dd, q);
    wb_write(c, true, 100000, &dd, q);
    wb_write(d, true, (size_t)4 << 20, &dd, q);
    char name[64];
    int shards = 0;
    for (int k = 1; k <= 9; k++) {
        snprintf(name, sizeof name, "model-%05d-of-", k);
        char pa[300];
        DIR *dir = opendir(a);
        struct dirent *e;
        const char *found = NULL;
        while (dir && (e = readdir(dir)))
            if (strncmp(e->d_name, name, strlen(name)) == 0) {
                snprintf(pa, sizeof pa, "%s", e->d_name);
                found = pa;
            }
        if (dir) closedir(dir);
        if (!found) break;
        shards++;
        size_t na = 0, nb = 1, nc = 2, nd = 3;
        char *da = read_all(a, found, &na), *db = read_all(b, found, &nb), *dc = read_all(c, found, &nc),
             *de = read_all(d, found, &nd);
        ASSERT_TRUE(da && db && dc && de);
        ASSERT_TRUE(na == nb && na == nc && na == nd);
        ASSERT_TRUE(memcmp(da, db, na) == 0 && memcmp(da, dc, na) == 0 && memcmp(da, de, na) == 0);
        free(da), free(db), free(dc), free(de);
    }
    ASSERT_TRUE(shards >= 3);   /* the writes went to several files */
    for (int i = 0; i < WB_N; i++) mq_qtensor_free(&q[i]);
}

/* A write that fails on the writer's thread (here: past the process's file size limit) is
 * returned by the flush, naming the file, and by every put after it; nothing is lost silently. */
static void test_write_behind_failure_is_reported(void) {
    wb_decls dd;
    mq_qtensor q[WB_N];
    wb_setup(&dd, q);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/wb_fail", mq_test_tmpdir());
    ASSERT_TRUE(mkdir(dir, 0755) == 0);
    mq_ckpt_opts o = {.format = MQ_FMT_CT, .spec = mq_qspec_default(MQ_QS_NVFP4)};
    mq_ckpt_writer *w = NULL;
    ASSERT_OK(mq_ckpt_writer_open(dir, dd.d, dd.n, &o, false, &w));
    ASSERT_OK(mq_ckpt_writer_behind(w, (size_t)4 << 20));
    struct rlimit old, lim;
    ASSERT_TRUE(getrlimit(RLIMIT_FSIZE, &old) == 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);   /* EFBIG instead of the signal */
    lim = old;
    lim.rlim_cur = 1024;   /* below every tensor's data (the header alone is larger) */
    ASSERT_TRUE(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    /* queued; the thread's failure is reported by the flush, or by the put itself where the
     * thread failed before the put returned (it looks at the thread's status last) */
    moeq_status st = mq_ckpt_writer_put_linear(w, "model.layers.0.mlp.down_proj", &q[0], 0);
    if (!st) st = mq_ckpt_writer_flush(w);
    ASSERT_TRUE(setrlimit(RLIMIT_FSIZE, &old) == 0);
    signal(SIGXFSZ, prev);
    ASSERT_STATUS(MOEQ_E_IO, st);
    ASSERT_ERROR_MENTIONS("model.safetensors.partial");
    ASSERT_STATUS(MOEQ_E_IO, mq_ckpt_writer_put_linear(w, "model.layers.1.mlp.down_proj", &q[1], 0));
    ASSERT_STATUS(MOEQ_E_IO, mq_ckpt_writer_flush(w));
    uint32_t crc;
    ASSERT_FALSE(mq_ckpt_writer_crc(w, "model.layers.0.mlp.down_proj.weight_packed", &crc));
    mq_ckpt_writer_close(w);
    for (int i = 0; i < WB_N; i++) mq_qtensor_free(&q[i]);
}

TEST_MAIN(T(test_ct_nvfp4_olmoe), T(test_modelopt_nvfp4_qwen2moe), T(test_ct_int4_and_gptq_llama),
          T(test_fused_experts_on_disk_are_split_per_expert), T(test_ignore_no_fuse_and_sharding),
          T(test_atomic_output), T(test_nan_weight_names_module_and_leaves_nothing),
          T(test_write_behind_equals_direct_writes), T(test_write_behind_failure_is_reported))
