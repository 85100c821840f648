/*
 * --max-gpu-memory: the GPU's memory bound and its plan.
 *
 * Everywhere (no GPU needed): the arithmetic of what the backend's objects take on the device
 * (gpu.c) against their allocations listed one by one from attention.cu, mlp.cu, hessian.cu and
 * gptq.cu, written out here apart from it; the plan's GPU part (memplan.c) made of those parts;
 * and a dry run of olmoe-tiny on `cuda` against a bound short of one layer, refused with a
 * message that names the bound and what one layer needs (a dry run plans against the bound where
 * there is no GPU), and against one that fits.
 *
 * On a GPU (skipped elsewhere): the same objects made on the device add exactly those bytes to
 * what the backend counts (mq_gpu_memory); a real run with a bound short of one layer stops
 * before any work with that message and leaves nothing; with a bound that fits it finishes, and
 * the peak of GPU memory it held is at most the bound.
 */
#include <stdlib.h>
#include <sys/stat.h>

#include "backend/gpu.h"
#include "harness.h"
#include "pipeline/internal.h"

/* ---- the arithmetic, by hand ----------------------------------------------------------------- */

static void test_attn_bytes(void) {
    const mq_gpu_attn_shape sh = {.D = 64, .H = 4, .KV = 2, .hd = 16, .max_T = 32, .E = 8, .top_k = 2};
    const int64_t QD = 64, KVD = 32, T = 32;
    /* mq_gpu_attn_new: norm, q, k, v, o, four biases, q and k norms, two RoPE tables, the scores
     * of min(2^28 / T^2, KV) = 2 heads, the FFN norm, the router */
    const int64_t fixed = 64 + QD * 64 + KVD * 64 + KVD * 64 + 64 * QD + QD + KVD + KVD + 64 + QD + KVD +
                          2 * T * 8 + 2 * T * T + 64 + 8 * 64;
    /* group_alloc for R rows: x, xn, q, k, v, att, y, positions, router logits, weights, choices */
    for (int i = 0; i < 2; i++) {
        const int64_t R = i ? T : MQ_GPU_ATTN_GROUP_ROWS;
        const int64_t group = R * 64 * 2 + R * QD + R * KVD * 2 + R * QD + R * 64 + R + R * 8 + R * 2 + R * 2;
        ASSERT_EQ_INT((fixed + group) * 4, mq_gpu_attn_bytes(&sh, i ? T : 0));
    }
    /* no routing: no router, logits or choices */
    mq_gpu_attn_shape dense = sh;
    dense.E = dense.top_k = 0;
    ASSERT_EQ_INT((fixed - 8 * 64 + T * (64 * 3 + QD * 2 + KVD * 2 + 1)) * 4, mq_gpu_attn_bytes(&dense, T));
}

static void test_mlp_and_hessian_bytes(void) {
    /* 3 experts' gate, up, down [F = 48, D = 32]; 2 lanes of 10 rows: x, hg, hu, y and indices */
    ASSERT_EQ_INT(3 * 3 * 48 * 32 * 4 + 2 * (10 * (32 + 48 + 48 + 32) * 4 + 10 * 4),
                  mq_gpu_mlp_bytes(3, 32, 48, true, 10, 2));
    ASSERT_EQ_INT(3 * 2 * 48 * 32 * 4 + (10 * (32 + 48 + 48 + 32) * 4 + 10 * 4), mq_gpu_mlp_bytes(3, 32, 48, false, 10, 1));
    ASSERT_EQ_INT(300 * 300 * 4, mq_gpu_hessians_bytes(300));
}

static int64_t r256(int64_t b) { return (b + 255) / 256 * 256; }

static void test_gptq_bytes(void) {
    /* K = 64 inputs, 96 rows, NVFP4 (groups of 16: 4 a row), no act-order, no in-loop search */
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_gptq_opts o = mq_gptq_opts_default();
    o.act_order = false;
    const int64_t K = 64, N = 96, ng = 4, G = 16, kl = K * N;
    int64_t want = r256(K * 4) * 2 + r256(K) + r256(8) + r256(K * 4) + 3 * r256(K * K * 4);   /* the factor */
    want += 2 * r256(ng * G * 4) + r256(ng * 4) + r256(K * 4) + r256(N * 4) + r256(8);        /* set metadata */
    want += 3 * r256(kl * 4) + r256(kl) + r256(32 * N * 4) + 2 * r256(ng * N * 4) +
            r256(ng * N * (int64_t)sizeof(mq_gparams)) + r256(G * N * 4);                     /* the loop's */
    want += r256(kl / 2) + r256(ng * N) + r256(4 * N * 8);                                    /* results */
    want += 8 * 256 + 256;           /* margin, alignment */
    const int64_t page = 2 << 20;    /* the arena comes from the pool in whole 2 MiB pages */
    ASSERT_EQ_INT((want + page - 1) / page * page + K * K * 4, mq_gpu_gptq_bytes(&s, &o, K, N));   /* + cuSOLVER's panel */
    /* act-order adds the permutation and its inverse; a large set more pages */
    o.act_order = true;
    ASSERT_EQ_INT((want + 2 * r256(K * 4) + page - 1) / page * page + K * K * 4, mq_gpu_gptq_bytes(&s, &o, K, N));
    ASSERT_TRUE(mq_gpu_gptq_bytes(&s, &o, 1024, 4096) > 3 * 1024 * 1024 * 4 + 3 * 1024 * 4096 * 4);
}

/* The plan of one layer from its parts (memplan.c's mq_plan_gpu_layer): attention object plus the
 * larger stage; each stage the sum of the parts named. */
static void test_layer_plan(void) {
    uint8_t moe[2] = {1, 1};
    mq_config c;
    memset(&c, 0, sizeof c);
    c.D = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16;
    c.n_experts = 8, c.top_k = 2, c.moe_ffn = 96, c.layer_is_moe = moe;
    const mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    const mq_gptq_opts o = mq_gptq_opts_default();
    const int64_t T = 32, rows = 100;
    const mq_gpu_layer_need n = mq_plan_gpu_layer(&c, T, rows, &s, &o);
    const mq_gpu_attn_shape sh = {.D = 64, .H = 4, .KV = 2, .hd = 16, .max_T = T, .E = 8, .top_k = 2};
    ASSERT_EQ_INT(mq_gpu_attn_bytes(&sh, T), n.attention);
    const int64_t gq = mq_gpu_gptq_bytes(&s, &o, 64, 64 + 2 * 32), go = mq_gpu_gptq_bytes(&s, &o, 64, 64);
    /* with the first expert and its lane, which go up during the attention */
    ASSERT_EQ_INT(64 * 64 * 4 * 2 + (gq > go ? gq : go) + 3 * 96 * 64 * 4 + (rows * (2 * 64 + 2 * 96) * 4 + rows * 4),
                  n.attention_stage);
    const int64_t gu = mq_gpu_gptq_bytes(&s, &o, 64, 2 * 96), gd = mq_gpu_gptq_bytes(&s, &o, 96, 64);
    ASSERT_EQ_INT(mq_gpu_mlp_bytes(1, 64, 96, true, rows, 1) + 64 * 64 * 4 + 96 * 96 * 4 + 2 * T * 2 * 64 * 4 +
                      (gu > gd ? gu : gd),
                  n.expert);
    ASSERT_EQ_INT(n.attention + (n.attention_stage > n.expert ? n.attention_stage : n.expert), n.least);
    ASSERT_EQ_INT(3 * 96 * 64 * 4 + 64 * 64 * 4 + 96 * 96 * 4, n.per_expert);
    /* a wider model needs more */
    c.moe_ffn = 192;
    ASSERT_TRUE(mq_plan_gpu_layer(&c, T, rows, &s, &o).least > n.least);
}

/* ---- the plan of a run ----------------------------------------------------------------------- */

static moeq_quant_options gptq_on_cuda(int64_t bound, bool dry) {
    moeq_quant_options o = mq_test_gptq_options(MOEQ_QUANT_NVFP4A16, mq_test_calib_text(), 8, 128);
    o.device = "cuda";
    o.max_gpu_memory = bound;
    o.dry_run = dry;
    o.force = 1;
    return o;
}

/* olmoe-tiny and an output folder of the case's own for a run. */
typedef struct {
    char model[4096], out[4096];
} run_dirs;

static run_dirs olmoe_dirs(void) {
    run_dirs d;
    snprintf(d.model, sizeof d.model, "%s", mq_test_model("olmoe-tiny"));
    snprintf(d.out, sizeof d.out, "%s/q", mq_test_tmpdir());
    return d;
}

static void test_dry_run_refusal(void) {
    const run_dirs d = olmoe_dirs();
    moeq_quant_options o = gptq_on_cuda(1000000, true);
    moeq_quant_result r;
    ASSERT_STATUS(MOEQ_E_NOMEM, moeq_quantize(d.model, d.out, &o, &r));
    ASSERT_ERROR_MENTIONS("--max-gpu-memory 0.001 GB is too small: one layer needs");
    ASSERT_EQ_INT(1000000, r.plan.gpu_budget);
    ASSERT_TRUE(r.plan.gpu_least > 1000000);
    ASSERT_TRUE(r.plan.gpu_attention > 0 && r.plan.gpu_attention_stage > 0 && r.plan.gpu_expert > 0);
    ASSERT_EQ_INT(r.plan.gpu_attention + (r.plan.gpu_attention_stage > r.plan.gpu_expert ? r.plan.gpu_attention_stage
                                                                                          : r.plan.gpu_expert),
                  r.plan.gpu_least);
    char gb[64];
    snprintf(gb, sizeof gb, "one layer needs %.3f GB", (double)r.plan.gpu_least / 1e9);
    ASSERT_ERROR_MENTIONS(gb);
    ASSERT_TRUE(r.plan.peak > 0);   /* the CPU's part of the plan is filled too */
    /* a bound one byte short of it still refuses; one that holds it plans, experts capped at
     * what fits beside one layer's least */
    const int64_t least = r.plan.gpu_least;
    o = gptq_on_cuda(least - 1, true);
    ASSERT_STATUS(MOEQ_E_NOMEM, moeq_quantize(d.model, d.out, &o, &r));
    o = gptq_on_cuda(least, true);
    ASSERT_OK(moeq_quantize(d.model, d.out, &o, &r));
    if (!mq_gpu_built()) ASSERT_EQ_INT(least, r.plan.gpu_budget);
    ASSERT_EQ_INT(least, r.plan.gpu_least);
    ASSERT_EQ_INT(1, r.plan.gpu_chunk);
    ASSERT_EQ_INT(1, r.plan.chunk);
    o = gptq_on_cuda((int64_t)4 << 30, true);
    ASSERT_OK(moeq_quantize(d.model, d.out, &o, &r));
    ASSERT_TRUE(r.plan.gpu_chunk > 1);
    struct stat sb;
    ASSERT_TRUE(stat(d.out, &sb) != 0);   /* a dry run writes nothing */
}

/* ---- on a GPU ------------------------------------------------------------------------------------ */

static int64_t used_now(mq_gpu *g) {
    int64_t u = 0;
    mq_gpu_memory(g, &u, NULL, NULL);
    return u;
}

/* The objects' allocations add what gpu.c says they take. */
static void test_device_counts(void) {
    mq_gpu *g = mq_test_open_gpu();
    const int64_t D = 128, H = 4, KV = 2, hd = 32, T = 64, E = 4, F = 96;
    float *cs = calloc((size_t)(T * hd / 2), sizeof(float)), *sn = calloc((size_t)(T * hd / 2), sizeof(float));
    const mq_gpu_attn_shape sh = {.D = D, .H = H, .KV = KV, .hd = hd, .max_T = T, .eps = 1e-6f, .rope_cos = cs,
                                  .rope_sin = sn, .E = E, .top_k = 2};
    int64_t u0 = used_now(g);
    mq_gpu_attn *a = NULL;
    ASSERT_OK(mq_gpu_attn_new(g, &sh, &a));
    ASSERT_EQ_INT(mq_gpu_attn_bytes(&sh, 0), used_now(g) - u0);
    mq_gpu_attn_free(a);
    ASSERT_EQ_INT(u0, used_now(g));
    float *w = calloc((size_t)(D * F), sizeof(float));
    const float *ws[1] = {w};
    mq_gpu_mlp *m = NULL;
    ASSERT_OK(mq_gpu_mlp_new(g, 1, D, F, ws, ws, ws, 50, &m));
    ASSERT_EQ_INT(mq_gpu_mlp_bytes(1, D, F, true, 50, 1), used_now(g) - u0);
    mq_gpu_mlp_free(m);
    mq_gpu_hessians *hs = NULL;
    const int64_t K[2] = {D, F};
    ASSERT_OK(mq_gpu_hessians_new(g, 2, K, &hs));
    ASSERT_EQ_INT(mq_gpu_hessians_bytes(D) + mq_gpu_hessians_bytes(F), used_now(g) - u0);
    mq_gpu_hessians_free(hs);
    ASSERT_EQ_INT(u0, used_now(g));
    free(cs), free(sn), free(w);
    mq_gpu_close(g);
}

static void test_bound_end_to_end(void) {
    mq_gpu *probe = mq_test_open_gpu();
    mq_gpu_close(probe);
    const run_dirs d = olmoe_dirs();
    moeq_quant_options o = gptq_on_cuda(1000000, false);
    moeq_quant_result r;
    /* short of one layer: refused before any work (no checkpoint, no work directory) */
    ASSERT_STATUS(MOEQ_E_NOMEM, moeq_quantize(d.model, d.out, &o, &r));
    ASSERT_ERROR_MENTIONS("one layer needs");
    struct stat sb;
    ASSERT_TRUE(stat(d.out, &sb) != 0);
    char work[4200];
    snprintf(work, sizeof work, "%s.moeq-work", d.out);
    ASSERT_TRUE(stat(work, &sb) != 0);
    /* the plan's least, then a run within twice that */
    o = gptq_on_cuda(1000000, true);
    moeq_quantize(d.model, d.out, &o, &r);
    const int64_t bound = 2 * r.plan.gpu_least;
    printf("  plan: one layer's least %.1f MB (the attention %.1f MB, its stage %.1f MB, an expert's %.1f MB)\n",
           (double)r.plan.gpu_least / 1e6, (double)r.plan.gpu_attention / 1e6,
           (double)r.plan.gpu_attention_stage / 1e6, (double)r.plan.gpu_expert / 1e6);
    o = gptq_on_cuda(bound, false);
    ASSERT_OK(moeq_quantize(d.model, d.out, &o, &r));
    printf("  bound %.3f GB (twice one layer's least): peak of GPU memory held %.3f GB\n", (double)bound / 1e9,
           (double)r.gpu_peak_bytes / 1e9);
    ASSERT_TRUE(r.gpu_peak_bytes > 0);
    if (r.gpu_peak_bytes > bound)
        FAIL("the run held %lld bytes of GPU memory, over its bound of %lld", (long long)r.gpu_peak_bytes,
             (long long)bound);
    ASSERT_TRUE(stat(d.out, &sb) == 0);
}

TEST_MAIN(T(test_attn_bytes), T(test_mlp_and_hessian_bytes), T(test_gptq_bytes), T(test_layer_plan),
          T(test_dry_run_refusal), T(test_device_counts), T(test_bound_end_to_end))
