#define _DEFAULT_SOURCE   /* mincore */
/*
 * The streaming pipeline (src/pipeline) against the whole-model reference loop
 * (tests/reference/gptq_model_ref.c: the model loaded in full, hooks, one block at a time):
 * every quantized Linear of the pipeline's checkpoint, read back from its files, has the
 * reference's codes, scales, global scale and g_idx, and the report its tokens and method, for
 * each family and GPTQ mode; the checkpoint's bytes do not depend on the expert chunk, the thread
 * count or where the activations live; the memory plan refuses a budget too small and a dry run
 * writes nothing; an interrupted run resumes to the same bytes, also after a torn work file, and a
 * resume with other options is refused.
 */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export/layout.h"
#include "harness.h"
#include "model/model.h"
#include "pipeline/internal.h"
#include "pipeline/pipeline.h"
#include "reference/gptq_model_ref.h"

/* ---- models and options -------------------------------------------------------------------------- */

typedef struct {
    mq_qscheme scheme;
    int group;                 /* INT4 */
    int act_order;             /* -1: the scheme's default */
    bool gidx;
    ref_gptq_mode mode;
    bool true_seq;
    ref_expert_fallback fallback;
    int64_t min_tokens;        /* -1: default 32 */
    int64_t nsamples, seqlen;
} cfg;

/* The same settings for the pipeline and for the reference. */
static void configure(const cfg *c, mq_pipeline_opts *po, ref_gptq_opts *ro) {
    mq_pipeline_opts_init(po, c->scheme, MQ_FMT_CT);
    if (c->scheme == MQ_QS_INT4 && c->group) po->spec.group_size = c->group;
    po->spec.mse = true;
    po->gptq = true;
    ref_gptq_opts_init(ro, &po->spec);   /* the reference's defaults (moeq quantize's) */
    if (c->act_order >= 0) ro->gptq.act_order = c->act_order != 0;
    if (c->gidx) ro->gptq.groups = MQ_GPTQ_GROUPS_GIDX;
    ro->mode = c->mode;
    ro->true_sequential = c->true_seq;
    ro->fallback = c->fallback;
    if (c->min_tokens >= 0) ro->min_expert_tokens = c->min_tokens;
    po->g = ro->gptq;
    po->spec = ro->spec;
    po->sequential = c->mode == REF_SEQUENTIAL;
    po->true_sequential = c->true_seq;
    po->fallback_rtn = c->fallback == REF_FALLBACK_RTN;
    po->min_expert_tokens = ro->min_expert_tokens;
    po->calib.path = mq_test_calib_text();
    po->calib.nsamples = c->nsamples;
    po->calib.seqlen = c->seqlen;
}

/* ---- reading a checkpoint back ------------------------------------------------------------------- */

static const mq_tensor_view *st_lookup(void *user, const char *name) { return mq_st_find(user, name); }

static cJSON *read_json(const char *path) {
    char *text;
    size_t len;
    ASSERT_OK(mq_read_file(path, &text, &len));
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    ASSERT_TRUE(j != NULL);
    return j;
}

static const cJSON *report_module(const cJSON *rep, const char *module) {
    const cJSON *m;
    cJSON_ArrayForEach(m, cJSON_GetObjectItemCaseSensitive(rep, "modules")) {
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(m, "module");
        if (cJSON_IsString(n) && strcmp(n->valuestring, module) == 0) return m;
    }
    return NULL;
}

/* Every module of the reference run equals what the pipeline wrote. */
static void check_against(const char *out, const char *report, const ref_gptq_results *rr) {
    mq_st *st;
    ASSERT_OK(mq_st_open_dir(out, &st));
    cJSON *rep = read_json(report);
    int64_t n_rep = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(rep, "modules"));
    ASSERT_EQ_INT(rr->n, n_rep);
    for (int64_t i = 0; i < rr->n; i++) {
        const ref_gptq_result *x = &rr->r[i];
        mq_qtensor q;
        ASSERT_OK(mq_layout_read(x->module, x->q.rows, x->q.cols, st_lookup, st, &q));
        int64_t n = q.rows * q.cols, ng = q.rows * q.n_groups;
        if (memcmp(q.codes, x->q.codes, (size_t)n) != 0) {
            int64_t d = 0;
            for (int64_t k = 0; k < n; k++) d += q.codes[k] != x->q.codes[k];
            FAIL("%s: %lld of %lld codes differ from the reference", x->module, (long long)d, (long long)n);
        }
        for (int64_t g = 0; g < ng; g++)
            if (q.params[g].scale != x->q.params[g].scale || q.params[g].zero != x->q.params[g].zero ||
                q.params[g].scale_code != x->q.params[g].scale_code)
                FAIL("%s: group %lld: scale %g/%g zero %g/%g", x->module, (long long)g,
                     (double)q.params[g].scale, (double)x->q.params[g].scale, (double)q.params[g].zero,
                     (double)x->q.params[g].zero);
        ASSERT_TRUE(q.global_scale == x->q.global_scale);
        if (x->q.g_idx) {
            ASSERT_TRUE(q.g_idx && memcmp(q.g_idx, x->q.g_idx, sizeof(int32_t) * (size_t)q.cols) == 0);
        } else if (q.g_idx) {   /* the pipeline gives round-to-nearest fallbacks the identity */
            for (int64_t k = 0; k < q.cols; k++) ASSERT_EQ_INT(k / q.group_size, q.g_idx[k]);
        }
        const cJSON *m = report_module(rep, x->module);
        ASSERT_TRUE(m != NULL);
        ASSERT_EQ_INT(x->tokens, (int64_t)cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(m, "tokens")));
        ASSERT_EQ_STR(ref_how_name(x->how), cJSON_GetObjectItemCaseSensitive(m, "method")->valuestring);
        mq_qtensor_free(&q);
    }
    cJSON_Delete(rep);
    mq_st_close(st);
}

/* target: the unquantized target's share (asymmetric calibration; 0: off), act: where the
 * pipeline keeps its activations */
static void match_reference_ex(const char *model, const cfg *c, int chunk, float target, mq_act_storage act) {
    mq_pipeline_opts po;
    ref_gptq_opts ro;
    configure(c, &po, &ro);
    po.expert_chunk = chunk;
    po.target_share = ro.asym = target;
    po.act_storage = act;
    char out[1100], report[1200];
    snprintf(out, sizeof out, "%s/q", mq_test_tmpdir());
    snprintf(report, sizeof report, "%s.report.json", out);
    po.report_path = report;
    mq_pipeline_result pr;
    ASSERT_OK(mq_pipeline_run(model, out, &po, &pr));
    ASSERT_TRUE(pr.peak_anon > 0);
    /* the reference on the model loaded in full */
    moeq_model *m;
    ASSERT_OK(moeq_model_open(model, NULL, &m));
    mq_model_det_experts(m, true);   /* the pipeline's expert products (model.h) */
    mq_calib_set cs;
    ASSERT_OK(mq_calib_load(moeq_model_tokenizer(m), &po.calib, &cs));
    ref_gptq_results rr;
    ASSERT_OK(ref_gptq_model(m, &cs, &ro, &rr));
    ASSERT_EQ_INT(cs.total, pr.tokens);
    check_against(out, report, &rr);
    int fallbacks = 0;
    for (int64_t i = 0; i < rr.n; i++) fallbacks += rr.r[i].how != REF_HOW_GPTQ;
    ASSERT_EQ_INT(fallbacks, pr.fallbacks);
    ref_gptq_results_free(&rr);
    mq_calib_free(&cs);
    moeq_model_free(m);
}

static void match_reference(const char *model, const cfg *c, int chunk) {
    match_reference_ex(model, c, chunk, 0.0f, MQ_ACT_AUTO);
}

static void test_olmoe_nvfp4_sequential_block_fallback(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 8, 64};
    match_reference(mq_test_model("olmoe-tiny"), &c, 3);
}

static void test_olmoe_int4_gidx_nonsequential_rtn_fallback(void) {
    cfg c = {MQ_QS_INT4, 64, 1, true, REF_NONSEQUENTIAL, false, REF_FALLBACK_RTN, -1, 8, 64};
    match_reference(mq_test_model("olmoe-tiny"), &c, 0);
}

static void test_olmoe_true_sequential(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, true, REF_FALLBACK_BLOCK, 0, 6, 64};
    match_reference(mq_test_model("olmoe-tiny"), &c, 5);
}

/* shared expert with its sigmoid gate, q/k/v bias, dense and MoE layers mixed */
static void test_qwen2moe_dense_layers_shared_expert(void) {
    cfg c = {MQ_QS_INT4, 16, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 6, 64};
    match_reference(mq_test_with_tokenizer("qwen2moe-dense-tiny"), &c, 3);
}

/* Mixtral's w1/w2/w3 fused on disk (transformers 5), written per expert under block_sparse_moe */
static void test_mixtral_fused_nonsequential(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_NONSEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 6, 64};
    match_reference(mq_test_with_tokenizer("mixtral-tiny-fused"), &c, 1);
}

/* deepseek_v3: latent attention in four slots, dense first layer, sigmoid group-limited routing
 * with the selection bias, shared experts, the MTP layer passed through */
static void test_deepseek_sequential(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 6, 64};
    match_reference(mq_test_with_tokenizer("deepseekv3-tiny"), &c, 5);
}

/* the FP8 source (dequantized as each layer loads), true-sequential, RTN expert fallback */
static void test_deepseek_fp8_true_sequential(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, true, REF_FALLBACK_RTN, 4, 6, 64};
    match_reference(mq_test_with_tokenizer("deepseekv3-fp8-tiny"), &c, 0);
}

/* per-head q/k norms, renormalised top-k */
static void test_qwen3moe_sequential(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 6, 64};
    match_reference(mq_test_with_tokenizer("qwen3moe-tiny"), &c, 2);
}

/* ---- invariance ----------------------------------------------------------------------------------- */

static bool same_file(const char *a, const char *b) {
    char *x, *y;
    size_t nx, ny;
    if (mq_read_file(a, &x, &nx) != MOEQ_OK) return false;
    if (mq_read_file(b, &y, &ny) != MOEQ_OK) {
        free(x);
        return false;
    }
    bool same = nx == ny && memcmp(x, y, nx) == 0;
    free(x);
    free(y);
    return same;
}

/* Every file of checkpoint a is in b with the same bytes (and b has no other). */
static void same_checkpoint(const char *a, const char *b) {
    int na = 0, nb = 0;
    DIR *d = opendir(a);
    ASSERT_TRUE(d != NULL);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char pa[2400], pb[2400];
        snprintf(pa, sizeof pa, "%s/%s", a, e->d_name);
        snprintf(pb, sizeof pb, "%s/%s", b, e->d_name);
        if (!same_file(pa, pb)) {
            closedir(d);
            FAIL("%s differs from %s", pb, pa);
        }
        na++;
    }
    closedir(d);
    d = opendir(b);
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') nb++;
    closedir(d);
    ASSERT_EQ_INT(na, nb);
}

static void default_gptq(mq_pipeline_opts *o) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 8, 64};
    ref_gptq_opts ro;
    configure(&c, o, &ro);
}

/* The reference's asymmetric calibration (ref_gptq_opts.asym, which the pipeline equals): in
 * layer 0 both streams are the embeddings, and G's chains (mq_cross_det_acc) are H's sums term
 * for term (fmaf(a, b, c) == fmaf(b, a, c)), so (2/n) G - H is exactly zero and the codes are
 * the plain run's, every one; from layer 1 the streams differ and the correction moves many
 * codes (28% measured; at least 10% required). A pairing gone wrong moves layer 0's, a
 * correction not applied leaves the later ones. The routed experts' pairing (their tokens found
 * in the FFN input) runs on olmoe-tiny. */
static void test_reference_asymmetric(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, 1, 8, 64};
    mq_pipeline_opts po;
    ref_gptq_opts ro;
    configure(&c, &po, &ro);
    ref_gptq_results rr[2];
    for (int k = 0; k < 2; k++) {
        moeq_model *m;
        ASSERT_OK(moeq_model_open(mq_test_model("olmoe-tiny"), NULL, &m));
        mq_calib_set cs;
        ASSERT_OK(mq_calib_load(moeq_model_tokenizer(m), &po.calib, &cs));
        ro.asym = k ? 0.5f : 0.0f;
        ASSERT_OK(ref_gptq_model(m, &cs, &ro, &rr[k]));
        mq_calib_free(&cs);
        moeq_model_free(m);
    }
    ASSERT_EQ_INT(rr[0].n, rr[1].n);
    int64_t diff[2] = {0, 0}, all[2] = {0, 0};
    for (int64_t i = 0; i < rr[0].n; i++) {
        const ref_gptq_result *a = &rr[0].r[i], *b = ref_gptq_results_find(&rr[1], a->module);
        ASSERT_TRUE(b != NULL);
        const int64_t n = a->q.rows * a->q.cols, l = a->layer > 0;
        for (int64_t k = 0; k < n; k++) diff[l] += a->q.codes[k] != b->q.codes[k];
        all[l] += n;
    }
    printf("  asymmetric calibration: codes changed in layer 0 %lld of %lld, later layers %lld of %lld\n",
           (long long)diff[0], (long long)all[0], (long long)diff[1], (long long)all[1]);
    if (diff[0] != 0) FAIL("layer 0 (both streams equal): %lld codes changed", (long long)diff[0]);
    if (diff[1] * 10 < all[1]) FAIL("later layers: the correction changed fewer than 10%% of the codes");
    ref_gptq_results_free(&rr[0]);
    ref_gptq_results_free(&rr[1]);
}

/* The pipeline's asymmetric calibration (--target unquantized) equals the reference's bit for
 * bit: MoE with routed experts paired by their token lists and the block-Hessian fallback (its
 * experts uncorrected, as in the reference), chunks of 3, activations in memory and in work
 * files; a shared expert and dense layers (qwen2moe-dense-tiny); a dense model's MLP with the
 * whole share (llama-tiny layout of the latent-free families: deepseek's latent slots too). */
static void test_target_unquantized_matches_reference(void) {
    cfg c = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, 16, 8, 64};
    match_reference_ex(mq_test_model("olmoe-tiny"), &c, 3, 0.5f, MQ_ACT_RAM);
    match_reference_ex(mq_test_model("olmoe-tiny"), &c, 0, 0.5f, MQ_ACT_DISK);
    cfg q = {MQ_QS_INT4, 16, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 6, 64};
    match_reference_ex(mq_test_with_tokenizer("qwen2moe-dense-tiny"), &q, 3, 1.0f, MQ_ACT_AUTO);
    cfg d = {MQ_QS_NVFP4, 0, -1, false, REF_SEQUENTIAL, false, REF_FALLBACK_BLOCK, -1, 6, 64};
    match_reference_ex(mq_test_with_tokenizer("deepseekv3-tiny"), &d, 5, 0.5f, MQ_ACT_AUTO);
}

static void test_chunks_threads_storage_byte_identical(void) {
    const char *model = mq_test_model("olmoe-tiny");
    char base[1100];
    snprintf(base, sizeof base, "%s/base", mq_test_tmpdir());
    mq_pipeline_opts o;
    default_gptq(&o);
    o.max_shard_bytes = 3 << 20;   /* several shards */
    moeq_set_threads(2);
    ASSERT_OK(mq_pipeline_run(model, base, &o, NULL));
    /* ahead: the experts read ahead (MOEQ_READ_AHEAD=1), or each chunk in turn (the default) */
    const struct { int chunk, threads; mq_act_storage act; bool ahead; } runs[] = {
        {1, 1, MQ_ACT_AUTO, true}, {3, 2, MQ_ACT_AUTO, true}, {8, 1, MQ_ACT_RAM, true}, {3, 3, MQ_ACT_DISK, true},
        {8, 16, MQ_ACT_AUTO, true}, {3, 2, MQ_ACT_AUTO, false}, {1, 3, MQ_ACT_AUTO, false}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char out[1100];
        snprintf(out, sizeof out, "%s/run%zu", mq_test_tmpdir(), i);
        o.expert_chunk = runs[i].chunk;
        o.act_storage = runs[i].act;
        moeq_set_threads(runs[i].threads);
        if (runs[i].ahead) setenv("MOEQ_READ_AHEAD", "1", 1);
        mq_pipeline_result r;
        ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
        unsetenv("MOEQ_READ_AHEAD");
        ASSERT_EQ_INT(runs[i].chunk, r.plan.chunk);
        ASSERT_EQ_INT(runs[i].act == MQ_ACT_DISK ? MQ_ACT_DISK : MQ_ACT_RAM, r.plan.storage);
        /* the most it reads ahead: a chunk's experts, or the next layer's attention (q/k/v/o, the
         * attention's, FFN's, q and k norms, the router) */
        const int64_t chunk_w = runs[i].chunk * 3 * 256 * 256 * 4, att_w = (4 * 256 * 256 + 4 * 256 + 8 * 256) * 4;
        ASSERT_EQ_INT(runs[i].ahead ? (chunk_w > att_w ? chunk_w : att_w) : 0, r.plan.read_ahead);
        same_checkpoint(base, out);
    }
    moeq_set_threads(0);
    /* bf16 activations are a different (lossy) calibration: the checkpoint changes */
    char out[1100], f1[1200], f2[1200];
    snprintf(out, sizeof out, "%s/bf16", mq_test_tmpdir());
    o.act_storage = MQ_ACT_BF16;
    o.max_shard_bytes = 0;
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    snprintf(f1, sizeof f1, "%s/model.safetensors", out);
    o.act_storage = MQ_ACT_RAM;
    snprintf(out, sizeof out, "%s/fp32", mq_test_tmpdir());
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    snprintf(f2, sizeof f2, "%s/model.safetensors", out);
    ASSERT_FALSE(same_file(f1, f2));
}

/* ---- the memory plan ------------------------------------------------------------------------------- */

static int count_entries(const char *dir) {
    int n = 0;
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static void test_memory_plan(void) {
    const char *model = mq_test_model("olmoe-tiny");
    const char *parent = mq_test_tmpdir();
    char out[1100];
    snprintf(out, sizeof out, "%s/q", parent);
    mq_pipeline_opts o;
    default_gptq(&o);
    /* a dry run: the plan, nothing written (with the read-ahead asked for: MOEQ_READ_AHEAD=1) */
    setenv("MOEQ_READ_AHEAD", "1", 1);
    o.dry_run = true;
    mq_pipeline_result r;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    ASSERT_EQ_INT(0, count_entries(parent));
    const mq_mem_plan *p = &r.plan;
    const int64_t S = 8, L = 64, D = 256;
    ASSERT_EQ_INT(8, p->samples);
    /* sequential GPTQ keeps the boundary, the FFN input and the FFN output (fp32) and the ids */
    ASSERT_EQ_INT(3 * S * L * D * 4 + p->tokens * 4, p->activations);
    ASSERT_EQ_INT(8, p->chunk);   /* the default budget holds every expert */
    ASSERT_EQ_INT(4, p->layers);
    ASSERT_TRUE(p->peak > p->activations + p->attention);
    ASSERT_TRUE(p->flops_forward > 0 && p->flops_hessian > 0 && p->flops_gptq > 0);
    ASSERT_TRUE(p->seconds > 0);
    /* the next chunk read ahead (8 experts' fp32 weights: 3 x 256 x 256 each), in the plan beside
     * the attention and the chunk before; where the budget falls short of it, the read-ahead
     * goes, not the chunk's experts */
    ASSERT_EQ_INT(8 * 3 * 256 * 256 * 4, p->read_ahead);
    const int64_t with_ahead = p->peak;
    o.max_memory = with_ahead - 1;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    ASSERT_EQ_INT(8, r.plan.chunk);
    ASSERT_EQ_INT(0, r.plan.read_ahead);
    ASSERT_EQ_INT(with_ahead - 8 * 3 * 256 * 256 * 4, r.plan.peak);
    o.max_memory = 0;
    /* MOEQ_READ_AHEAD=0 and the default (unset): none */
    setenv("MOEQ_READ_AHEAD", "0", 1);
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    ASSERT_EQ_INT(0, r.plan.read_ahead);
    ASSERT_EQ_INT(with_ahead - 8 * 3 * 256 * 256 * 4, r.plan.peak);
    unsetenv("MOEQ_READ_AHEAD");
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    ASSERT_EQ_INT(0, r.plan.read_ahead);
    ASSERT_EQ_INT(with_ahead - 8 * 3 * 256 * 256 * 4, r.plan.peak);
    /* a budget below the plan with one expert at a time and spilled activations is refused
     * before any work, naming what is needed */
    o.dry_run = false;
    o.max_memory = 4 << 20;
    ASSERT_STATUS(MOEQ_E_NOMEM, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("--max-memory");
    ASSERT_ERROR_MENTIONS("--activations disk");
    ASSERT_EQ_INT(0, count_entries(parent));
    /* a budget that only fits smaller chunks: the planner takes them. One expert's share of the
     * chunk from the plans of 8 and 4 experts (the chunk's memory also holds a part that does
     * not grow with it, GPTQ's per-thread scratch, large at many threads) */
    int64_t full = p->peak;
    o.dry_run = true;
    o.max_memory = 0;
    o.expert_chunk = 4;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    const int64_t per_expert = (full - r.plan.peak) / 4;
    ASSERT_TRUE(per_expert > 0);
    o.dry_run = false;
    o.expert_chunk = 0;
    o.max_memory = full - per_expert / 2;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    ASSERT_TRUE(r.plan.chunk < 8 && r.plan.chunk >= 1);
    ASSERT_TRUE(r.plan.peak <= o.max_memory);
    ASSERT_EQ_INT(1, count_entries(parent));   /* OUT_DIR only: the work directory is gone */
    unsetenv("MOEQ_READ_AHEAD");
}

/* ---- interruption and resume ---------------------------------------------------------------------- */

static int g_stop_after;   /* interrupt once this many layers are logged as done (0: never) */
static int g_layers_logged;

static void stop_log(void *user, int level, const char *msg) {
    (void)user;
    (void)level;
    if (strncmp(msg, "layer ", 6) == 0 && ++g_layers_logged == g_stop_after) moeq_interrupt();
}

static moeq_status run_until(const char *model, const char *out, const mq_pipeline_opts *o, int stop) {
    g_stop_after = stop;
    g_layers_logged = 0;
    moeq_set_log(stop_log, NULL);
    moeq_status s = mq_pipeline_run(model, out, o, NULL);
    moeq_set_log(NULL, NULL);
    moeq_clear_interrupt();
    return s;
}

static int g_replays, g_replays_from_snapshot;   /* "recomputing ..." messages of a resume */

static void replay_log(void *user, int level, const char *msg) {
    (void)user;
    (void)level;
    if (strncmp(msg, "recomputing", 11) == 0) {
        g_replays++;
        g_replays_from_snapshot += strstr(msg, "from the snapshot at the input of layer 3") != NULL;
    }
}

/* Flips one byte in the middle of the data of tensor `name` of the partial shard in dir. */
static void corrupt_tensor(const char *dir, const char *name) {
    DIR *d = opendir(dir);
    ASSERT_TRUE(d != NULL);
    struct dirent *e;
    bool done = false;
    while (!done && (e = readdir(d))) {
        if (!strstr(e->d_name, ".partial")) continue;
        char path[2400];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        mq_map map;
        ASSERT_OK(mq_map_file(path, &map));
        mq_st *st;
        ASSERT_OK(mq_st_open_buffer(map.data, map.size, path, &st));
        const mq_tensor_view *t = mq_st_find(st, name);
        size_t off = t ? (size_t)(t->data - (const uint8_t *)map.data) + t->nbytes / 2 : 0;
        mq_st_close(st);
        mq_unmap(&map);
        if (!t) continue;
        FILE *f = fopen(path, "r+b");
        ASSERT_TRUE(f != NULL);
        ASSERT_TRUE(fseek(f, (long)off, SEEK_SET) == 0);
        int c = fgetc(f);
        ASSERT_TRUE(fseek(f, (long)off, SEEK_SET) == 0);
        fputc(c ^ 0x5a, f);
        fclose(f);
        done = true;
    }
    closedir(d);
    ASSERT_TRUE(done);
}

/* Snapshots after every second layer (MOEQ_SNAPSHOT_EVERY=2; in_place: MOEQ_SNAPSHOT_IN_PLACE,
 * else written behind the next layer), interrupted after `stop` layers: the work directory holds
 * acts-2.bin and no other snapshot; the resume continues after `stop` layers, replays `replays`
 * of them from that snapshot and gives base's checkpoint. */
static void every_second_snapshot(const char *model, const char *base, const char *out, const mq_pipeline_opts *o0,
                                  int stop, bool in_place, int replays) {
    char work[1200], path[1300];
    snprintf(work, sizeof work, "%s.moeq-work", out);
    mq_pipeline_opts o = *o0;
    mq_pipeline_result r;
    o.resume = false;
    setenv("MOEQ_SNAPSHOT_EVERY", "2", 1);
    if (in_place) setenv("MOEQ_SNAPSHOT_IN_PLACE", "1", 1);
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, run_until(model, out, &o, stop));
    unsetenv("MOEQ_SNAPSHOT_EVERY");
    for (int l = 1; l <= 3; l++) {
        snprintf(path, sizeof path, "%s/acts-%d.bin", work, l);
        if (mq_file_exists(path) != (l == 2)) FAIL("%s: %s after %d layers", path, l == 2 ? "missing" : "present", stop);
    }
    o.resume = true;
    g_replays = g_replays_from_snapshot = 0;
    moeq_set_log(replay_log, NULL);
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    moeq_set_log(NULL, NULL);
    unsetenv("MOEQ_SNAPSHOT_IN_PLACE");
    ASSERT_EQ_INT(stop, r.layers_resumed);
    ASSERT_EQ_INT(replays, g_replays);
    ASSERT_EQ_INT(replays, g_replays_from_snapshot);
    same_checkpoint(base, out);
    mq_remove_tree(out);
}

static void test_resume(void) {
    const char *model = mq_test_model("olmoe-tiny");
    const char *dir = mq_test_tmpdir();
    char base[1100], out[1100], work[1200], path[1300];
    snprintf(base, sizeof base, "%s/base", dir);
    snprintf(out, sizeof out, "%s/q", dir);
    snprintf(work, sizeof work, "%s.moeq-work", out);
    mq_pipeline_opts o;
    default_gptq(&o);
    o.expert_chunk = 3;
    ASSERT_OK(mq_pipeline_run(model, base, &o, NULL));

    /* interrupted after two of four layers: no OUT_DIR, the work directory stays */
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, run_until(model, out, &o, 2));
    ASSERT_FALSE(mq_dir_exists(out));
    ASSERT_TRUE(mq_dir_exists(work));
    /* without --resume it is refused; with other options too, saying which */
    ASSERT_STATUS(MOEQ_E_EXISTS, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("--resume");
    o.resume = true;
    o.g.percdamp = 0.05;
    ASSERT_STATUS(MOEQ_E_ARG, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("percdamp");
    o.g.percdamp = 0.01;
    /* another chunk size, thread count and budget are fine: the result does not depend on them */
    o.expert_chunk = 5;
    moeq_set_threads(1);
    mq_pipeline_result r;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    moeq_set_threads(0);
    ASSERT_EQ_INT(2, r.layers_resumed);
    ASSERT_FALSE(mq_dir_exists(work));
    same_checkpoint(base, out);
    mq_remove_tree(out);

    /* a finished layer whose tensor no longer matches its CRC is redone (and the ones after it);
     * the activation snapshot at layer 3 cannot serve then: the activations are recomputed from
     * the checkpoint's layers 0 and 1 */
    o.resume = false;
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, run_until(model, out, &o, 3));
    snprintf(path, sizeof path, "%s/out", work);
    corrupt_tensor(path, "model.layers.2.mlp.experts.4.up_proj.weight_packed");
    o.resume = true;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    ASSERT_EQ_INT(2, r.layers_resumed);
    same_checkpoint(base, out);
    mq_remove_tree(out);

    /* a torn activation snapshot: recomputed through the finished layers */
    o.resume = false;
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, run_until(model, out, &o, 1));
    snprintf(path, sizeof path, "%s/acts-1.bin", work);
    ASSERT_TRUE(truncate(path, 1000) == 0);
    o.resume = true;
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    ASSERT_EQ_INT(1, r.layers_resumed);
    same_checkpoint(base, out);
    mq_remove_tree(out);

    /* snapshots after every second layer only (as at real size on a GPU, where one costs a
     * fifth of a layer): interrupted after three layers, the manifest names the one at the input
     * of layer 3 (the one at layer 2's was not written); the resume replays layer 3 from it,
     * only that one, and gives the same checkpoint */
    every_second_snapshot(model, base, out, &o, 3, false, 1);
    /* the same written in place (where the plan has no room for the copy written behind the
     * next layer): the same files, the same replay */
    every_second_snapshot(model, base, out, &o, 3, true, 1);
    /* interrupted after two layers, while the snapshot at the input of layer 3 is written behind
     * the next one: the stop waits for it and the manifest names it, so the resume replays
     * nothing */
    every_second_snapshot(model, base, out, &o, 2, false, 0);

    /* RTN resumes the same way */
    mq_pipeline_opts ro;
    mq_pipeline_opts_init(&ro, MQ_QS_INT4, MQ_FMT_GPTQ);
    snprintf(base, sizeof base, "%s/rtn-base", dir);
    snprintf(out, sizeof out, "%s/rtn", dir);
    ASSERT_OK(mq_pipeline_run(model, base, &ro, NULL));
    g_stop_after = 0;
    moeq_interrupt();   /* before the first layer: nothing worth keeping */
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, mq_pipeline_run(model, out, &ro, NULL));
    moeq_clear_interrupt();
    snprintf(work, sizeof work, "%s.moeq-work", out);
    ASSERT_FALSE(mq_dir_exists(work));
    ASSERT_OK(mq_pipeline_run(model, out, &ro, NULL));
    same_checkpoint(base, out);
}

/* The unquantized target: the same bytes for any chunk, thread count and activation storage; an
 * interrupted run resumes to them from the snapshot, which holds both streams (nothing
 * replayed), and so does one whose snapshot is torn (both streams recomputed from the
 * embeddings through the finished layers); a resume with another share is refused; the modes it
 * does not pair are refused before any work. */
static void test_target_unquantized_invariance_resume(void) {
    const char *model = mq_test_model("olmoe-tiny");
    const char *dir = mq_test_tmpdir();
    char base[1100], out[1100], work[1200], path[1300];
    snprintf(base, sizeof base, "%s/tbase", dir);
    snprintf(out, sizeof out, "%s/tq", dir);
    snprintf(work, sizeof work, "%s.moeq-work", out);
    mq_pipeline_opts o;
    default_gptq(&o);
    o.target_share = 0.5f;
    o.expert_chunk = 3;
    moeq_set_threads(2);
    ASSERT_OK(mq_pipeline_run(model, base, &o, NULL));
    o.expert_chunk = 8;
    o.act_storage = MQ_ACT_DISK;
    moeq_set_threads(3);
    ASSERT_OK(mq_pipeline_run(model, out, &o, NULL));
    same_checkpoint(base, out);
    mq_remove_tree(out);
    o.act_storage = MQ_ACT_AUTO;
    o.expert_chunk = 3;
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, run_until(model, out, &o, 2));
    ASSERT_TRUE(mq_dir_exists(work));
    snprintf(path, sizeof path, "%s/acts-2.bin", work);
    ASSERT_TRUE(mq_file_exists(path));
    o.resume = true;
    o.target_share = 0.7f;
    ASSERT_STATUS(MOEQ_E_ARG, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("target_unquantized");
    o.target_share = 0.5f;
    moeq_set_threads(1);
    mq_pipeline_result r;
    g_replays = 0;
    moeq_set_log(replay_log, NULL);
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    moeq_set_log(NULL, NULL);
    moeq_set_threads(0);
    ASSERT_EQ_INT(2, r.layers_resumed);
    ASSERT_EQ_INT(0, g_replays);
    same_checkpoint(base, out);
    mq_remove_tree(out);
    o.resume = false;
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, run_until(model, out, &o, 2));
    struct stat sb;   /* torn inside the unquantized stream (the second half), the quantized one whole */
    ASSERT_TRUE(stat(path, &sb) == 0);
    ASSERT_TRUE(truncate(path, sb.st_size - 400) == 0);
    o.resume = true;
    g_replays = 0;
    moeq_set_log(replay_log, NULL);
    ASSERT_OK(mq_pipeline_run(model, out, &o, &r));
    moeq_set_log(NULL, NULL);
    ASSERT_EQ_INT(2, g_replays);
    same_checkpoint(base, out);
    mq_remove_tree(out);
    /* refused: nonsequential, true-sequential */
    o.resume = false;
    o.sequential = false;
    ASSERT_STATUS(MOEQ_E_ARG, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_ERROR_MENTIONS("sequential");
    o.sequential = o.true_sequential = true;
    ASSERT_STATUS(MOEQ_E_ARG, mq_pipeline_run(model, out, &o, NULL));
    ASSERT_FALSE(mq_dir_exists(out));
}

/* Activation copies go over the pool in pieces (actbuf.c): fp32 copies and bf16 stores and loads
 * of a length that is not a whole number of pieces, from an offset, give every value as the
 * one-value conversions do, at 1 and 3 threads. */
static void test_activation_copies(void) {
    const size_t n = 5 * 65536 + 77, off = 3;
    float *src = malloc(sizeof(float) * (n + off)), *dst = malloc(sizeof(float) * (n + off));
    float *view = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n + off; i++) src[i] = (float)((i * 2654435761u) % 100003) * 1e-3f - 50.0f;
    const int saved = moeq_threads();
    for (int threads = 1; threads <= 3; threads += 2) {
        moeq_set_threads(threads);
        memset(dst, 0, sizeof(float) * (n + off));
        mq_copy_floats(dst + off, src + off, n);
        ASSERT_TRUE(dst[0] == 0 && memcmp(dst + off, src + off, sizeof(float) * n) == 0);
        mq_actbuf b;
        ASSERT_OK(mq_actbuf_init(&b, MQ_ACT_BF16, n + off, NULL, "test activations"));
        mq_actbuf_put(&b, off, n, src + off);
        const float *v = mq_actbuf_view(&b, off, n, view);
        for (size_t i = 0; i < n; i++)
            if (v[i] != mq_bf16_to_f32(mq_f32_to_bf16(src[off + i]))) FAIL("value %zu: %g", i, v[i]);
        mq_actbuf_free(&b);
    }
    /* in memory, fp32 and bf16: every page faulted in by the init (on the pool), not left to the
     * first layer's copies */
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (int k = 0; k < 2; k++) {
        mq_actbuf b;
        ASSERT_OK(mq_actbuf_init(&b, k ? MQ_ACT_BF16 : MQ_ACT_RAM, (size_t)3 << 20, NULL, "test activations"));
        void *base = k ? (void *)b.h : (void *)b.f;
        const size_t bytes = ((size_t)3 << 20) * (k ? 2 : 4), np = (bytes + page - 1) / page;
        unsigned char *v = malloc(np);
        ASSERT_EQ_INT(0, mincore(base, bytes, v));
        size_t in = 0;
        for (size_t i = 0; i < np; i++) in += v[i] & 1;
        ASSERT_EQ_INT((int64_t)np, (int64_t)in);
        free(v);
        mq_actbuf_free(&b);
    }
    moeq_set_threads(saved);
    free(src), free(dst), free(view);
}

TEST_MAIN(T(test_olmoe_nvfp4_sequential_block_fallback),
          T(test_olmoe_int4_gidx_nonsequential_rtn_fallback), T(test_olmoe_true_sequential),
          T(test_qwen2moe_dense_layers_shared_expert), T(test_mixtral_fused_nonsequential),
          T(test_qwen3moe_sequential), T(test_deepseek_sequential),
          T(test_deepseek_fp8_true_sequential), T(test_chunks_threads_storage_byte_identical),
          T(test_memory_plan), T(test_resume), T(test_reference_asymmetric),
          T(test_target_unquantized_matches_reference), T(test_target_unquantized_invariance_resume),
          T(test_activation_copies))
