/*
 * The GPU evaluation's reader of a quantized checkpoint's experts (eval/eval_gpu_experts.c, no
 * GPU needed): the canonical moeq_moe_experts_desc it builds from the files, packed by the CPU
 * op, must run every MoE layer bit for bit as the loader's own packed experts (keep_packed) do on
 * the same input, for NVFP4 in both global-scale conventions (compressed-tensors, ModelOpt) and
 * INT4 (compressed-tensors groups of 32, GPTQ v1 groups of 128 rows); and a checkpoint whose
 * experts are not stored quantized is refused as MOEQ_E_UNSUPPORTED.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "eval/eval_gpu.h"
#include "harness.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

static uint64_t g_rng = 7;
static float rnd(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static void check_layers(const char *dir, const char *what) {
    moeq_model_options po = {.keep_packed = 1};
    moeq_model *pm = mq_test_open_model(dir, &po);
    mq_lazy_model *lz = NULL;
    ASSERT_OK(mq_lazy_open(dir, false, &lz));
    moeq_model *lm = mq_lazy_model_of(lz);
    const mq_config *c = &lm->cfg;
    const int64_t T = 37, D = c->D;
    float *x = malloc(sizeof(float) * (size_t)(T * D)), *y0 = malloc(sizeof(float) * (size_t)(T * D)),
          *y1 = malloc(sizeof(float) * (size_t)(T * D));
    ASSERT_TRUE(x && y0 && y1);
    for (int64_t i = 0; i < T * D; i++) x[i] = rnd();
    int layers = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const mq_layer *pl = &pm->layers[l];
        if (!pl->is_moe) continue;
        ASSERT_TRUE(pl->pexperts != NULL);
        mq_gpu_experts g;
        ASSERT_OK(mq_gpu_experts_read(mq_lazy_st(lz), c, &lm->layers[l], l, &g));
        ASSERT_TRUE(!g.has_zp);
        moeq_moe_experts *w = NULL;
        ASSERT_OK(moeq_moe_experts_pack(&g.desc, &w));
        ASSERT_EQ_INT((int64_t)moeq_moe_experts_bytes(pl->pexperts), (int64_t)moeq_moe_experts_bytes(w));
        moeq_moe_ffn_args a = {.x = {x, MOEQ_DT_F32, 2, {T, D, 0, 0}, sizeof(float) * (size_t)(T * D)},
                               .router = {pl->router, MOEQ_DT_F32, 2, {c->n_experts, D, 0, 0},
                                          sizeof(float) * (size_t)(c->n_experts * D)},
                               .experts = pl->pexperts,
                               .top_k = c->top_k,
                               .scoring = MOEQ_MOE_SOFTMAX,
                               .renormalize = c->norm_topk_prob,
                               .route_scale = 1.0f};
        ASSERT_OK(moeq_moe_ffn(&a, y0, (size_t)(T * D)));
        a.experts = w;
        ASSERT_OK(moeq_moe_ffn(&a, y1, (size_t)(T * D)));
        ASSERT_TRUE(memcmp(y0, y1, sizeof(float) * (size_t)(T * D)) == 0);
        double n = 0;
        for (int64_t i = 0; i < T * D; i++) n += fabs((double)y0[i]);
        ASSERT_TRUE(n > 0 && isfinite(n));   /* the layer computed something */
        moeq_moe_experts_free(w);
        mq_gpu_experts_free(&g);
        layers++;
    }
    ASSERT_TRUE(layers > 0);
    printf("  %-28s %d MoE layers equal the loader's packed experts\n", what, layers);
    free(x);
    free(y0);
    free(y1);
    mq_lazy_close(lz);
    moeq_model_free(pm);
}

static void check_scheme(mq_qscheme sch, mq_ckpt_format fmt, int group, const char *name) {
    char *dir = mq_path_join(mq_test_tmpdir(), name);
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, sch, fmt);
    if (group) q.spec.group_size = group;
    ASSERT_OK(mq_pipeline_run(mq_test_model("olmoe-tiny"), dir, &q, NULL));
    check_layers(dir, name);
    free(dir);
}

static void test_nvfp4_ct(void) { check_scheme(MQ_QS_NVFP4, MQ_FMT_CT, 0, "nvfp4 compressed-tensors"); }
static void test_nvfp4_modelopt(void) { check_scheme(MQ_QS_NVFP4, MQ_FMT_MODELOPT, 0, "nvfp4 modelopt"); }
static void test_int4_ct(void) { check_scheme(MQ_QS_INT4, MQ_FMT_CT, 32, "int4 g32 compressed-tensors"); }
static void test_int4_gptq(void) { check_scheme(MQ_QS_INT4, MQ_FMT_GPTQ, 128, "int4 g128 gptq-v1"); }

/* An unquantized checkpoint: its experts are not codes. */
static void test_refuses_dense(void) {
    mq_lazy_model *lz = NULL;
    ASSERT_OK(mq_lazy_open(mq_test_model("olmoe-tiny"), false, &lz));
    moeq_model *lm = mq_lazy_model_of(lz);
    mq_gpu_experts g;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, mq_gpu_experts_read(mq_lazy_st(lz), &lm->cfg, &lm->layers[0], 0, &g));
    ASSERT_ERROR_MENTIONS("not stored quantized");
    mq_lazy_close(lz);
}

TEST_MAIN(T(test_nvfp4_ct), T(test_nvfp4_modelopt), T(test_int4_ct), T(test_int4_gptq), T(test_refuses_dense))
