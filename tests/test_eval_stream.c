/* The streamed evaluation (models opened with moeq_model_options.stream) against the whole-model
 * evaluation, which the other eval tests pin to lm-eval's figures:
 *  - every fixture family, bit for bit: boundaries in memory and in files, 1, 2 and 5 threads;
 *  - a kl_base in lockstep equals the whole-model KL exactly, and the saved-logits route where the
 *    saved top-k is the whole vocabulary;
 *  - quantized checkpoints packed a layer at a time (and dequantized) equal their whole loads;
 *  - an interrupted run resumes to the same result (boundary files, and memory snapshots);
 *  - the plan: a dry run runs nothing, a budget too small for one layer says what one layer needs,
 *    a streamed model refuses sessions, a truncated shard names its file. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"
#include "eval/eval.h"
#include "harness.h"
#include "pipeline/pipeline.h"

void mq_eval_set_snapshot_seconds(double s);   /* src/eval/stream.c, for tests */

static moeq_model *open_as(const char *dir, int stream, int packed) {
    moeq_model_options o = {.keep_packed = packed, .stream = stream};
    return mq_test_open_model(dir, &o);
}

/* Three documents of calibration text of different lengths (several windows each at L = 40). */
static moeq_docs *text_docs(void) {
    static const int len[] = {300, 700, 90};
    return mq_test_calib_docs(len, 3);
}

static void eval_opts(moeq_eval_options *o, double *ll) {
    *o = mq_test_text_eval(40, NULL);
    o->doc_loglikelihood = ll;
    o->entropy = 1;
}

static void assert_same_result(const moeq_eval_result *a, const moeq_eval_result *b,
                               const double *lla, const double *llb, int n_docs) {
    ASSERT_TRUE(a->loglikelihood == b->loglikelihood);
    ASSERT_EQ_INT(a->tokens, b->tokens);
    ASSERT_EQ_INT(a->documents, b->documents);
    ASSERT_TRUE(a->entropy_mean == b->entropy_mean);
    ASSERT_TRUE(a->has_kl == b->has_kl);
    if (a->has_kl) {
        ASSERT_TRUE(a->kl_mean == b->kl_mean);
        ASSERT_TRUE(a->kl_p99 == b->kl_p99);
        ASSERT_TRUE(a->top1_changed == b->top1_changed);
        ASSERT_TRUE(a->base_loglikelihood == b->base_loglikelihood);
    }
    for (int d = 0; d < n_docs; d++) ASSERT_TRUE(lla[d] == llb[d]);
}

/* Calibration-text documents and one model directory opened whole and streamed (packed). */
typedef struct {
    moeq_docs *docs;
    moeq_model *whole, *streamed;
} family;

static family open_family(const char *dir) {
    family f = {text_docs(), open_as(dir, 0, 1), open_as(dir, 1, 1)};
    return f;
}

/* Frees the family; the thread count back to the default. */
static void close_family(family *f) {
    moeq_set_threads(0);
    moeq_model_free(f->streamed);
    moeq_model_free(f->whole);
    moeq_docs_free(f->docs);
}

/* Whole against streamed for one model directory, at every storage and thread count. */
static void check_family(const char *dir) {
    family f = open_family(dir);
    double ll_w[3], ll_s[3];
    moeq_eval_options o;
    moeq_eval_result rw, rs;
    eval_opts(&o, ll_w);
    ASSERT_OK(moeq_eval(f.whole, f.docs, &o, &rw));
    ASSERT_EQ_INT(0, rw.plan.streamed);
    ASSERT_TRUE(isfinite(rw.loglikelihood) && rw.tokens > 100);
    /* memory boundary; then a budget that leaves no room for it (files) */
    int threads[3] = {1, 2, 5};
    for (int t = 0; t < 3; t++) {
        moeq_set_threads(threads[t]);
        eval_opts(&o, ll_s);
        o.dry_run = 1;
        ASSERT_OK(moeq_eval(f.streamed, f.docs, &o, &rs));
        ASSERT_EQ_INT(1, rs.plan.streamed);
        ASSERT_EQ_INT(0, rs.tokens);   /* planned, not run */
        /* unbudgeted, the next layer is read ahead; the plan without it, less half a boundary,
         * holds no boundary */
        ASSERT_TRUE(rs.plan.read_ahead_bytes == rs.plan.layer_bytes && rs.plan.layer_bytes > 0);
        const int64_t in_files = rs.plan.peak_bytes - rs.plan.read_ahead_bytes - rs.plan.boundary_bytes / 2;
        for (int files = 0; files < 2; files++) {
            eval_opts(&o, ll_s);
            o.max_memory = files ? in_files : 0;
            ASSERT_OK(moeq_eval(f.streamed, f.docs, &o, &rs));
            ASSERT_EQ_INT(1, rs.plan.streamed);
            ASSERT_EQ_INT(!files, rs.plan.boundary_in_memory[0]);
            ASSERT_TRUE(rs.plan.peak_bytes <= (files ? in_files : rs.plan.budget));
            assert_same_result(&rw, &rs, ll_w, ll_s, 3);
        }
    }
    close_family(&f);
}

/* Fewer windows than threads: each window runs with the whole pool inside its forward. */
static void check_few_windows(const char *dir) {
    family f = open_family(dir);
    double ll_w[3], ll_s[3];
    moeq_eval_options o;
    moeq_eval_result rw, rs;
    moeq_set_threads(5);
    eval_opts(&o, ll_w);
    o.limit = 1;
    ASSERT_OK(moeq_eval(f.whole, f.docs, &o, &rw));
    eval_opts(&o, ll_s);
    o.limit = 1;
    ASSERT_OK(moeq_eval(f.streamed, f.docs, &o, &rs));
    ASSERT_TRUE(rs.plan.windows < 5);
    assert_same_result(&rw, &rs, ll_w, ll_s, 1);
    close_family(&f);
}

static void test_every_family_equals_whole(void) {
    check_few_windows(mq_test_model("olmoe-tiny"));
    check_family(mq_test_model("olmoe-tiny"));
    if (mq_test_have_shared()) {
        check_family(mq_test_model("qwen2moe-tiny"));
        check_family(mq_test_model("llama-tiny"));
    }
    char dir[1024];
    /* and an FP8 block-scaled release (its weights dequantized as they are read) */
    const char *bundled[] = {"mixtral-tiny", "qwen3moe-tiny", "deepseekv3-tiny", "deepseekv3-fp8-tiny"};
    for (int i = 0; i < 4; i++) {
        snprintf(dir, sizeof dir, "%s", mq_test_with_tokenizer(bundled[i]));
        check_family(dir);
    }
}

/* A second model with the same tokenizer: qwen2moe-tiny beside llama-tiny, or olmoe-tiny beside
 * its INT4 quantization without the shared folder. */
static void kl_pair(char *model, char *base, size_t n) {
    if (mq_test_have_shared()) {
        snprintf(model, n, "%s", mq_test_model("qwen2moe-tiny"));
        snprintf(base, n, "%s", mq_test_model("llama-tiny"));
        return;
    }
    snprintf(base, n, "%s", mq_test_model("olmoe-tiny"));
    char *dir = mq_path_join(mq_test_tmpdir(), "olmoe-int4-kl");
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, MQ_QS_INT4, MQ_FMT_CT);
    q.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(base, dir, &q, NULL));
    snprintf(model, n, "%s", dir);
    free(dir);
}

static void test_kl_base_in_lockstep(void) {
    char md[1024], bd[1024];
    kl_pair(md, bd, sizeof md);
    moeq_docs *docs = text_docs();
    moeq_model *mw = open_as(md, 0, 1), *bw = open_as(bd, 0, 1);
    moeq_model *ms = open_as(md, 1, 1), *bs = open_as(bd, 1, 1);
    double ll_w[3], ll_s[3], kl_w[3], kl_s[3];
    moeq_eval_options o;
    moeq_eval_result rw, rs, rr;
    eval_opts(&o, ll_w);
    o.kl_base = bw;
    o.doc_kl = kl_w;
    ASSERT_OK(moeq_eval(mw, docs, &o, &rw));
    ASSERT_TRUE(rw.has_kl && rw.kl_mean > 0 && rw.has_base);
    /* both streamed (in memory, then in files), then a streamed model beside a whole base */
    const moeq_model *bases[3] = {bs, bs, bw};
    for (int i = 0; i < 3; i++) {
        eval_opts(&o, ll_s);
        o.kl_base = bases[i];
        o.doc_kl = kl_s;
        if (i == 1) {
            o.dry_run = 1;
            ASSERT_OK(moeq_eval(ms, docs, &o, &rs));
            o.dry_run = 0;
            o.max_memory = rs.plan.peak_bytes - rs.plan.read_ahead_bytes - rs.plan.boundary_bytes * 3 / 2;
        }
        ASSERT_OK(moeq_eval(ms, docs, &o, &rs));
        if (i == 1) ASSERT_EQ_INT(0, rs.plan.boundary_in_memory[0] + rs.plan.boundary_in_memory[1]);
        assert_same_result(&rw, &rs, ll_w, ll_s, 3);
        for (int d = 0; d < 3; d++) ASSERT_TRUE(kl_w[d] == kl_s[d]);
    }
    /* the saved-logits route with the whole vocabulary saved: the same KL up to the order of its
     * sums (relative 1e-9: double sums of a few thousand terms each) */
    char *path = mq_path_join(mq_test_tmpdir(), "base.topk");
    eval_opts(&o, ll_s);
    o.save_logits = path;
    o.save_top_k = moeq_model_get_info(bs)->vocab_size;
    ASSERT_OK(moeq_eval(bs, docs, &o, &rr));
    eval_opts(&o, ll_s);
    o.kl_logits = path;
    ASSERT_OK(moeq_eval(ms, docs, &o, &rr));
    ASSERT_TRUE(rr.kl_top_k == o.save_top_k || rr.kl_top_k == moeq_model_get_info(bs)->vocab_size);
    ASSERT_NEAR(rw.kl_mean, rr.kl_mean, 1e-9 * rw.kl_mean);
    ASSERT_TRUE(rw.top1_changed == rr.top1_changed);
    free(path);
    moeq_model_free(ms);
    moeq_model_free(bs);
    moeq_model_free(mw);
    moeq_model_free(bw);
    moeq_docs_free(docs);
}

/* olmoe-tiny quantized here by round to nearest into each checkpoint layout: packed a layer at a
 * time equals the packed whole load, and dequantized the dequantized one. */
static void test_quantized_packed_and_dequantized(void) {
    /* compressed-tensors NVFP4 and INT4, ModelOpt NVFP4, GPTQ v1 INT4 */
    const mq_qscheme schemes[4] = {MQ_QS_NVFP4, MQ_QS_INT4, MQ_QS_NVFP4, MQ_QS_INT4};
    const mq_ckpt_format formats[4] = {MQ_FMT_CT, MQ_FMT_CT, MQ_FMT_MODELOPT, MQ_FMT_GPTQ};
    for (int i = 0; i < 4; i++) {
        char name[64];
        snprintf(name, sizeof name, "olmoe-q%d", i);
        char *dir = mq_path_join(mq_test_tmpdir(), name);
        mq_pipeline_opts q;
        mq_pipeline_opts_init(&q, schemes[i], formats[i]);
        if (schemes[i] == MQ_QS_INT4) q.spec.group_size = 32;
        ASSERT_OK(mq_pipeline_run(mq_test_model("olmoe-tiny"), dir, &q, NULL));
        moeq_docs *docs = text_docs();
        for (int packed = 0; packed < 2; packed++) {
            moeq_model *w = open_as(dir, 0, packed), *s = open_as(dir, 1, packed);
            if (packed) ASSERT_TRUE(moeq_model_get_info(w)->packed_linears > 0);
            ASSERT_TRUE(moeq_model_get_info(s)->weight_bytes < moeq_model_get_info(w)->weight_bytes ||
                        moeq_model_get_info(w)->n_layers == 1);
            double lw[3], ls[3];
            moeq_eval_options o;
            moeq_eval_result rw, rs;
            eval_opts(&o, lw);
            ASSERT_OK(moeq_eval(w, docs, &o, &rw));
            eval_opts(&o, ls);
            ASSERT_OK(moeq_eval(s, docs, &o, &rs));
            assert_same_result(&rw, &rs, lw, ls, 3);
            moeq_model_free(s);
            moeq_model_free(w);
        }
        moeq_docs_free(docs);
        free(dir);
    }
}

static int64_t g_stop_rows;
static void stop_cb(void *user, const char *label, int64_t done, int64_t total) {
    (void)user;
    (void)total;
    if (strcmp(label, "eval") == 0 && done >= g_stop_rows) moeq_interrupt();
}

/* Interrupted after about two layers, then resumed: the same result, the layers counted as
 * resumed, the work directory kept between and removed after. files: boundaries in files (each
 * layer durable), else in memory with a snapshot after every layer. */
static void check_resume(bool files) {
    const char *dir = mq_test_model("olmoe-tiny");
    moeq_docs *docs = text_docs();
    moeq_model *m = open_as(dir, 1, 1);
    double ll_a[3], ll_b[3];
    moeq_eval_options o;
    moeq_eval_result ra, rb;
    eval_opts(&o, ll_a);
    ASSERT_OK(moeq_eval(m, docs, &o, &ra));
    char *work = mq_path_join(mq_test_tmpdir(), files ? "work-files" : "work-memory");
    moeq_set_threads(1);   /* the plan below is the interrupted run's */
    eval_opts(&o, ll_b);
    o.work_dir = work;
    o.dry_run = 1;
    ASSERT_OK(moeq_eval(m, docs, &o, &rb));
    o.dry_run = 0;
    if (files) o.max_memory = rb.plan.peak_bytes - rb.plan.read_ahead_bytes - rb.plan.boundary_bytes / 2;
    else mq_eval_set_snapshot_seconds(0);
    g_stop_rows = rb.plan.rows * 2 + 1;   /* during the third layer */
    moeq_set_progress(stop_cb, NULL);
    moeq_status st = moeq_eval(m, docs, &o, &rb);
    moeq_set_progress(NULL, NULL);
    moeq_clear_interrupt();
    moeq_set_threads(0);
    ASSERT_EQ_INT(MOEQ_E_INTERRUPTED, st);
    ASSERT_EQ_INT(0, rb.documents);
    ASSERT_EQ_INT(!files, rb.plan.boundary_in_memory[0]);
    char *record = mq_path_join(work, "eval-stream.json");
    ASSERT_TRUE(mq_file_exists(record));
    /* a resume with other options is refused, naming the directory */
    moeq_eval_options other = o;
    other.max_length = 32;
    other.resume = 1;
    ASSERT_EQ_INT(MOEQ_E_ARG, moeq_eval(m, docs, &other, &rb));
    ASSERT_ERROR_MENTIONS("other models, data or options");
    o.resume = 1;
    ASSERT_OK(moeq_eval(m, docs, &o, &rb));
    ASSERT_EQ_INT(2, rb.plan.layers_resumed);
    assert_same_result(&ra, &rb, ll_a, ll_b, 3);
    ASSERT_FALSE(mq_file_exists(record));
    mq_eval_set_snapshot_seconds(60);
    free(record);
    free(work);
    moeq_model_free(m);
    moeq_docs_free(docs);
}

static void test_resume_from_files(void) { check_resume(true); }
static void test_resume_from_snapshots(void) { check_resume(false); }

static void test_plan_errors(void) {
    const char *dir = mq_test_model("olmoe-tiny");
    moeq_docs *docs = text_docs();
    moeq_model *m = open_as(dir, 1, 1);
    moeq_eval_options o;
    moeq_eval_result r;
    double ll[3];
    eval_opts(&o, ll);
    o.max_memory = 1 << 20;
    ASSERT_EQ_INT(MOEQ_E_NOMEM, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("too small for a streamed eval: one layer needs");
    moeq_session *s = NULL;
    ASSERT_EQ_INT(MOEQ_E_UNSUPPORTED, moeq_session_create(m, 16, &s));
    ASSERT_ERROR_MENTIONS("only moeq_eval runs it");
    moeq_model_free(m);
    /* a shard cut short: the open names the file */
    char *cut = mq_path_join(mq_test_tmpdir(), "cut");
    ASSERT_EQ_INT(0, mkdir(cut, 0755));
    const char *files[] = {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"};
    for (int i = 0; i < 4; i++) {
        char *src = mq_path_join(dir, files[i]), *dst = mq_path_join(cut, files[i]), *buf = NULL;
        size_t len = 0;
        if (mq_file_exists(src)) {
            ASSERT_OK(mq_read_file(src, &buf, &len));
            if (i == 3) len /= 2;
            ASSERT_OK(mq_write_file_atomic(dst, buf, len));
        }
        free(buf);
        free(src);
        free(dst);
    }
    moeq_model_options mo = {.stream = 1};
    ASSERT_TRUE(moeq_model_open(cut, &mo, &m) != MOEQ_OK);
    ASSERT_ERROR_MENTIONS("model.safetensors");
    free(cut);
    moeq_docs_free(docs);
}

TEST_MAIN(T(test_every_family_equals_whole), T(test_kl_base_in_lockstep),
          T(test_quantized_packed_and_dequantized), T(test_resume_from_files),
          T(test_resume_from_snapshots), T(test_plan_errors))
