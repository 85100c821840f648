/* moeq_eval on the fixture models, kept fast (a few documents or short texts):
 *  - the first wikitext documents of olmoe-tiny against reference.json's per-document values;
 *  - results identical for 1 and 2 threads;
 *  - log-likelihood and KL against a slow re-computation from full session logits (long double);
 *  - KL of a model against itself is exactly 0; saved top-k logits round trip and bound the KL;
 *  - mismatched saved logits, bad options, an empty document, a KL base with another vocabulary,
 *    and an interrupt that leaves the finished documents. */
#include <stdlib.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "core/core.h"
#include "eval/eval.h"
#include "pipeline/pipeline.h"
#include "io/safetensors.h"
#include "ckpt/source.h"
#include "harness.h"

static moeq_model *open_model(const char *name) {
    return mq_test_open_model(mq_test_model(name), NULL);
}

/* A model for checks that hold for any model: llama-tiny, or the bundled olmoe-tiny when the
 * shared folder is absent. */
static const char *any_model(void) { return mq_test_have_shared() ? "llama-tiny" : "olmoe-tiny"; }

/* A second model with the same tokenizer and another distribution: qwen2moe-tiny, or without the
 * shared folder olmoe-tiny quantized here to INT4 g32 by round to nearest. */
static moeq_model *open_other_model(void) {
    if (mq_test_have_shared()) return open_model("qwen2moe-tiny");
    char src[1024];
    snprintf(src, sizeof src, "%s", mq_test_model("olmoe-tiny"));
    char *dir = mq_path_join(mq_test_tmpdir(), "olmoe-int4");
    mq_pipeline_opts q;
    mq_pipeline_opts_init(&q, MQ_QS_INT4, MQ_FMT_CT);
    q.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(src, dir, &q, NULL));
    moeq_model *m = mq_test_open_model(dir, NULL);
    free(dir);
    return m;
}

/* Two short documents of calibration text (no detokenizer: --task text). */
static moeq_docs *calib_docs(void) {
    static const int len[] = {400, 1500};
    return mq_test_calib_docs(len, 2);
}

static void test_first_documents_match_reference_and_threads(void) {
    char *buf = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(mq_test_shared("fixtures/reference.json"), &buf, &len));
    cJSON *ref = cJSON_ParseWithLength(buf, len);
    free(buf);
    const cJSON *per_doc = cJSON_GetObjectItem(
        cJSON_GetObjectItem(cJSON_GetObjectItem(ref, "olmoe-tiny"), "wikitext_fp32"), "per_doc");
    moeq_model *m = open_model("olmoe-tiny");
    moeq_docs *docs = mq_test_wikitext_docs();
    double ll[2][62];
    int64_t tok[62];
    moeq_eval_result r[2];
    for (int run = 0; run < 2; run++) {
        moeq_set_threads(run == 0 ? 1 : 2);
        moeq_eval_options o;
        moeq_eval_options_init(&o);
        o.limit = 2;
        o.doc_loglikelihood = ll[run];
        o.doc_tokens = tok;
        ASSERT_OK(moeq_eval(m, docs, &o, &r[run]));
    }
    moeq_set_threads(0);
    ASSERT_EQ_INT(2, r[0].documents);
    ASSERT_EQ_INT(512, r[0].max_length);                   /* default: max_position_embeddings */
    ASSERT_TRUE(r[0].loglikelihood == r[1].loglikelihood); /* bit for bit */
    for (int d = 0; d < 2; d++) {
        const cJSON *e = cJSON_GetArrayItem(per_doc, d);
        ASSERT_TRUE(ll[0][d] == ll[1][d]);
        ASSERT_EQ_INT(cJSON_GetObjectItem(e, "tokens")->valuedouble, tok[d]);
        ASSERT_REL(cJSON_GetObjectItem(e, "ll")->valuedouble, ll[0][d], 1e-6);
    }
    ASSERT_EQ_INT(cJSON_GetObjectItem(cJSON_GetArrayItem(per_doc, 0), "words")->valuedouble +
                      cJSON_GetObjectItem(cJSON_GetArrayItem(per_doc, 1), "words")->valuedouble,
                  r[0].words);
    ASSERT_TRUE(isnan(ll[0][2]) && tok[2] == -1); /* past --limit: not evaluated */
    ASSERT_REL(exp(-(ll[0][0] + ll[0][1]) / (double)r[0].words), r[0].word_perplexity, 1e-12);
    ASSERT_REL(-(ll[0][0] + ll[0][1]) / (double)r[0].bytes / log(2.0), r[0].bits_per_byte, 1e-12);
    ASSERT_REL(exp(-r[0].loglikelihood / (double)r[0].tokens), r[0].token_perplexity, 1e-12);
    moeq_docs_free(docs);
    moeq_model_free(m);
    cJSON_Delete(ref);
}

/* Slow reference: the windows of each document run through moeq_session_forward with all logits,
 * scored in long double. */
typedef struct {
    long double ll, kl_sum, ent_sum;
    int64_t tokens, changed;
} slow_result;

static long double row_lse(const float *l, int64_t V) {
    long double s = 0;
    for (int64_t v = 0; v < V; v++) s += expl((long double)l[v]);
    return logl(s);
}

static int64_t row_argmax(const float *l, int64_t V) {
    int64_t a = 0;
    for (int64_t v = 1; v < V; v++)
        if (l[v] > l[a]) a = v;
    return a;
}

/* temp: m's logits divided by it (in float, as moeq_eval), the base's unchanged. */
static slow_result slow_eval(moeq_model *m, moeq_model *base, const moeq_docs *docs, int32_t L,
                             float temp) {
    slow_result res = {0};
    const moeq_tokenizer *tok = moeq_model_tokenizer(m);
    int64_t V = moeq_model_get_info(m)->vocab_size;
    moeq_session *s = NULL, *sb = NULL;
    ASSERT_OK(moeq_session_create(m, L, &s));
    ASSERT_OK(moeq_session_create(base, L, &sb));
    float *lg = malloc(sizeof(float) * (size_t)(L * V)),
          *lgb = malloc(sizeof(float) * (size_t)(L * V));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)L);
    for (int64_t d = 0; d < moeq_docs_count(docs); d++) {
        size_t len = 0;
        const char *text = moeq_docs_text(docs, d, &len);
        int32_t *T = NULL;
        size_t n = 0;
        ASSERT_OK(moeq_tokenizer_encode(tok, text, len, &T, &n));
        int64_t nw = mq_rolling_window_count((int64_t)n, L);
        mq_window *w = calloc((size_t)nw + 1, sizeof *w);
        mq_rolling_windows((int64_t)n, L, w);
        for (int64_t k = 0; k < nw; k++) {
            mq_window_input(&w[k], T, moeq_tokenizer_bos(tok), ids);
            moeq_session_reset(s);
            moeq_session_reset(sb);
            ASSERT_OK(moeq_session_forward(s, ids, w[k].n_input, lg));
            ASSERT_OK(moeq_session_forward(sb, ids, w[k].n_input, lgb));
            for (int32_t i = 0; i < w[k].n_score; i++) {
                int64_t row = w[k].n_input - w[k].n_score + i;
                float *l = lg + row * V;
                const float *lb = lgb + row * V;
                for (int64_t v = 0; v < V; v++) l[v] /= temp;
                long double z = row_lse(l, V), zb = row_lse(lb, V), kl = 0;
                for (int64_t v = 0; v < V; v++) res.ent_sum -= expl(l[v] - z) * (l[v] - z);
                res.ll += (long double)l[T[w[k].first_target + i]] - z;
                for (int64_t v = 0; v < V; v++)
                    kl += expl(lb[v] - zb) * ((lb[v] - zb) - (l[v] - z));
                res.kl_sum += kl;
                res.changed += row_argmax(l, V) != row_argmax(lb, V);
                res.tokens++;
            }
        }
        free(w);
        free(T);
    }
    free(lg);
    free(lgb);
    free(ids);
    moeq_session_free(s);
    moeq_session_free(sb);
    return res;
}

static void test_against_slow_session_reference(void) {
    moeq_model *m = open_model("olmoe-tiny"), *base = open_other_model();
    moeq_docs *docs = calib_docs();
    const int32_t L = 48; /* several windows, the last one partial */
    slow_result want = slow_eval(m, base, docs, L, 1.0f);
    moeq_eval_options o = mq_test_text_eval(L, base);
    moeq_eval_result r;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_EQ_INT(want.tokens, r.tokens);
    ASSERT_EQ_INT(want.tokens, r.kl_tokens);
    ASSERT_TRUE(r.tokens > 4 * L);
    ASSERT_REL((double)want.ll, r.loglikelihood, 1e-6);
    ASSERT_REL((double)(want.kl_sum / want.tokens), r.kl_mean, 1e-5);
    ASSERT_REL((double)want.changed / (double)want.tokens, r.top1_changed, 1e-12);
    ASSERT_TRUE(r.kl_p99 > r.kl_mean && r.kl_top_k == 0);
    moeq_docs_free(docs);
    moeq_model_free(m);
    moeq_model_free(base);
}

/* --temperature and --entropy against the slow reference: the model's logits divided by T (the
 * base's not), the entropy of the tempered distribution. */
static void test_temperature_and_entropy(void) {
    moeq_model *m = open_model("olmoe-tiny"), *base = open_other_model();
    moeq_docs *docs = calib_docs();
    const int32_t L = 48;
    const float T = 1.3f;
    slow_result want = slow_eval(m, base, docs, L, T);
    moeq_eval_options o = mq_test_text_eval(L, base);
    o.temperature = T;
    o.entropy = 1;
    moeq_eval_result r, plain;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_EQ_INT(want.tokens, r.tokens);
    ASSERT_REL((double)want.ll, r.loglikelihood, 1e-6);
    ASSERT_REL((double)(want.kl_sum / want.tokens), r.kl_mean, 1e-5);
    ASSERT_TRUE(r.has_entropy);
    ASSERT_REL((double)(want.ent_sum / want.tokens), r.entropy_mean, 1e-6);
    /* a higher temperature flattens the distribution; T = 1 is the plain evaluation */
    o.temperature = 1.0;
    ASSERT_OK(moeq_eval(m, docs, &o, &plain));
    ASSERT_TRUE(plain.entropy_mean < r.entropy_mean && plain.loglikelihood != r.loglikelihood);
    o.temperature = 0;
    o.entropy = 0;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_TRUE(r.loglikelihood == plain.loglikelihood && r.kl_mean == plain.kl_mean);
    ASSERT_FALSE(r.has_entropy);
    const double bad[3] = {-1.0, NAN, 1e300};
    for (int i = 0; i < 3; i++) {
        o.temperature = bad[i];
        ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
        ASSERT_ERROR_MENTIONS("--temperature");
    }
    moeq_docs_free(docs);
    moeq_model_free(m);
    moeq_model_free(base);
}

static void test_kl_against_itself_is_zero(void) {
    moeq_model *m = open_model(any_model());
    moeq_docs *docs = calib_docs();
    moeq_eval_options o = mq_test_text_eval(0, m);
    moeq_eval_result r;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_TRUE(r.has_kl && r.kl_tokens == r.tokens && r.tokens > 100);
    ASSERT_TRUE(r.kl_mean == 0.0 && r.kl_p99 == 0.0 && r.top1_changed == 0.0);
    ASSERT_TRUE(r.has_base && r.base_loglikelihood == r.loglikelihood);
    /* documents of many windows: the base's log-likelihood is summed as the model's (per
     * window, then per document), so a model against itself prints the same perplexity bits */
    double ll[2], llb[2];
    o = mq_test_text_eval(64, m);
    o.doc_loglikelihood = ll;
    o.doc_base_loglikelihood = llb;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_TRUE(r.tokens > 8 * 64 && r.kl_mean == 0.0);
    ASSERT_TRUE(memcmp(&r.base_loglikelihood, &r.loglikelihood, sizeof(double)) == 0);
    ASSERT_TRUE(memcmp(llb, ll, sizeof ll) == 0);
    moeq_docs_free(docs);
    moeq_model_free(m);
}

static void test_saved_logits(void) {
    moeq_model *m = open_model("olmoe-tiny"), *other = open_other_model();
    moeq_docs *docs = calib_docs();
    char *path = mq_path_join(mq_test_tmpdir(), "olmoe.topk");
    moeq_eval_options o = mq_test_text_eval(64, NULL);
    moeq_eval_result plain, saved, self, approx, exact;
    ASSERT_OK(moeq_eval(m, docs, &o, &plain));
    o.save_logits = path;
    ASSERT_OK(moeq_eval(m, docs, &o, &saved));
    ASSERT_TRUE(plain.loglikelihood == saved.loglikelihood); /* saving changes nothing */
    struct stat sb;
    ASSERT_TRUE(stat(path, &sb) == 0);
    ASSERT_EQ_INT(MQ_LOGITS_HEADER +
                      (size_t)saved.tokens * mq_logits_record_size(MOEQ_EVAL_DEFAULT_TOP_K),
                  sb.st_size);

    o.save_logits = NULL;
    o.kl_logits = path;
    ASSERT_OK(moeq_eval(m, docs, &o, &self));
    ASSERT_TRUE(self.has_kl && self.kl_top_k == 64 && self.kl_tokens == self.tokens);
    ASSERT_NEAR(0.0, self.kl_mean, 1e-9);
    ASSERT_TRUE(self.top1_changed == 0.0);

    ASSERT_OK(moeq_eval(other, docs, &o, &approx));
    o.kl_logits = NULL;
    o.kl_base = m;
    ASSERT_OK(moeq_eval(other, docs, &o, &exact));
    fprintf(stderr,
            "  other model vs olmoe-tiny: KL exact %.6f, from top-64 %.6f (gap %.2f%%, "
            "bound %.4f), top1_changed %.4f\n",
            exact.kl_mean, approx.kl_mean, 100 * (exact.kl_mean - approx.kl_mean) / exact.kl_mean,
            approx.kl_gap_bound, exact.top1_changed);
    ASSERT_TRUE(approx.kl_mean <= exact.kl_mean + 1e-9);
    ASSERT_TRUE(exact.kl_mean - approx.kl_mean <= approx.kl_gap_bound);
    ASSERT_TRUE(approx.kl_mean > 0.5 * exact.kl_mean);
    ASSERT_TRUE(approx.top1_changed == exact.top1_changed); /* the base's top-1 is stored exactly */
    ASSERT_TRUE(approx.loglikelihood == exact.loglikelihood);
    free(path);
    moeq_docs_free(docs);
    moeq_model_free(m);
    moeq_model_free(other);
}

static void test_saved_logits_mismatch(void) {
    moeq_model *m = open_model(any_model());
    moeq_docs *docs = calib_docs();
    char *path = mq_path_join(mq_test_tmpdir(), "saved.topk");
    moeq_eval_options o = mq_test_text_eval(64, NULL);
    o.save_logits = path;
    o.save_top_k = 4;
    moeq_eval_result r;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    o.save_logits = NULL;
    o.kl_logits = path;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_EQ_INT(4, r.kl_top_k);
    o.limit = 1;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("saved.topk: saved for other token ids");
    o.limit = 0;
    o.task = MOEQ_TASK_WIKITEXT; /* the detokenizer changes the ids */
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("saved.topk: saved for other token ids");
    o.task = MOEQ_TASK_TEXT;
    o.max_length = 32;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("saved with --max-length 64, this run uses 32");
    o.max_length = 64;
    o.add_bos = 1;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("--add-bos");
    o.add_bos = 0;

    /* another vocabulary: rewrite the header */
    char *buf = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(path, &buf, &len));
    mq_logits_header h;
    ASSERT_OK(mq_logits_header_decode(path, (const uint8_t *)buf, len, &h));
    h.vocab = 5000;
    mq_logits_header_encode(&h, (uint8_t *)buf);
    char *other = mq_path_join(mq_test_tmpdir(), "vocab.topk");
    ASSERT_OK(mq_write_file_atomic(other, buf, len));
    o.kl_logits = other;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("vocab.topk: saved with a vocabulary of 5000 tokens, the model has 4096");
    /* truncated */
    ASSERT_OK(mq_write_file_atomic(other, buf, len - 3));
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("truncated");
    o.kl_logits = "/nonexistent/x.topk";
    ASSERT_STATUS(MOEQ_E_IO, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("/nonexistent/x.topk");
    free(buf);
    free(other);
    free(path);
    moeq_docs_free(docs);
    moeq_model_free(m);
}

static void test_bad_options_and_empty_document(void) {
    moeq_model *m = open_model(any_model());
    moeq_docs *docs = calib_docs();
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    moeq_eval_result r;
    o.max_length = 513;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("--max-length 513 exceeds the model's max_position_embeddings 512");
    o.max_length = 0;
    o.kl_base = m;
    o.kl_logits = "x";
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("--kl-base and --kl-logits");
    moeq_docs_free(docs);

    /* An empty document counts with 0 tokens and its words/bytes (lm-eval's behaviour);
     * with --add-bos it is the single token BOS, scored after the prefix. */
    const char *jl = "{\"text\": \"\"}\n{\"text\": \"Hello there.\"}\n";
    ASSERT_OK(moeq_docs_parse("e.jsonl", jl, strlen(jl), MOEQ_DOCS_JSONL, &docs));
    moeq_eval_options_init(&o);
    o.task = MOEQ_TASK_TEXT;
    double ll[2];
    int64_t tok[2];
    o.doc_loglikelihood = ll;
    o.doc_tokens = tok;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_EQ_INT(2, r.documents);
    ASSERT_EQ_INT(1, r.empty_documents);
    ASSERT_EQ_INT(0, tok[0]);
    ASSERT_TRUE(ll[0] == 0.0);
    ASSERT_EQ_INT(1 + 2, r.words); /* "" is one (empty) word, "Hello there." two */
    ASSERT_EQ_INT(12, r.bytes);
    ASSERT_TRUE(tok[1] > 0 && r.tokens == tok[1]);
    o.add_bos = 1;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    ASSERT_EQ_INT(0, r.empty_documents);
    ASSERT_EQ_INT(1, tok[0]);
    ASSERT_EQ_INT(tok[1] + 1, r.tokens);
    /* log p(BOS | BOS) from a session */
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, 4, &s));
    float lg[4096];
    int32_t bos = 0;
    ASSERT_OK(moeq_session_forward(s, &bos, 1, lg));
    ASSERT_NEAR((double)(lg[0] - row_lse(lg, 4096)), ll[0], 1e-5);
    moeq_session_free(s);
    moeq_docs_free(docs);
    moeq_model_free(m);
}

/* A copy of any_model() whose embedding and lm_head (llama-tiny's is tied) have 4100 rows. */
static char *make_other_vocab_model(void) {
    char *dir = mq_path_join(mq_test_tmpdir(), "vocab4100");
    ASSERT_TRUE(mkdir(dir, 0755) == 0);
    const char *src = mq_test_model(any_model());
    char *src_dir = mq_strdup(src);
    static const char *const copy[] = {"tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 2; i++) {
        char *a = mq_path_join(src_dir, copy[i]), *b = mq_path_join(dir, copy[i]);
        char *buf = NULL;
        size_t len = 0;
        ASSERT_OK(mq_read_file(a, &buf, &len));
        ASSERT_OK(mq_write_file_atomic(b, buf, len));
        free(buf);
        free(a);
        free(b);
    }
    char *cfg_path = mq_path_join(src_dir, "config.json");
    char *buf = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(cfg_path, &buf, &len));
    cJSON *cfg = cJSON_ParseWithLength(buf, len);
    free(buf);
    cJSON_ReplaceItemInObject(cfg, "vocab_size", cJSON_CreateNumber(4100));
    char *out = cJSON_Print(cfg);
    char *cfg_out = mq_path_join(dir, "config.json");
    ASSERT_OK(mq_write_file_atomic(cfg_out, out, strlen(out)));
    free(out);
    free(cfg_out);
    cJSON_Delete(cfg);
    free(cfg_path);

    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(src_dir, &st));
    mq_st_writer *w = mq_stw_new();
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *t = mq_st_at(st, i);
        if (strcmp(t->name, "model.embed_tokens.weight") == 0 || strcmp(t->name, "lm_head.weight") == 0) {
            int64_t shape[2] = {4100, t->shape[1]};
            size_t row = (size_t)t->shape[1] * moeq_dtype_size(t->dtype);
            uint8_t *data = calloc(4100, row);
            memcpy(data, t->data, t->nbytes);
            ASSERT_OK(mq_stw_add(w, t->name, t->dtype, 2, shape, data, 4100 * row));
            free(data);
        } else {
            ASSERT_OK(mq_stw_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes));
        }
    }
    mq_test_write_model_st(w, dir);
    mq_st_close(st);
    free(src_dir);
    return dir;
}

static void test_kl_base_with_other_vocabulary(void) {
    char *dir = make_other_vocab_model();
    moeq_model *m = open_model(any_model()), *base = NULL;
    ASSERT_OK(moeq_model_open(dir, NULL, &base));
    ASSERT_EQ_INT(4100, moeq_model_get_info(base)->vocab_size);
    moeq_docs *docs = calib_docs();
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    o.kl_base = base;
    moeq_eval_result r;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval(m, docs, &o, &r));
    ASSERT_ERROR_MENTIONS("--kl-base");
    ASSERT_ERROR_MENTIONS("vocabulary of 4100 tokens, the model has 4096");
    moeq_docs_free(docs);
    moeq_model_free(base);
    moeq_model_free(m);
    free(dir);
}

/* Interrupt from the progress callback once the first document is done (one thread: windows run
 * in order and the callback follows each): the result holds exactly that document. */
static int64_t g_stop_after;
static void stop_cb(void *user, const char *label, int64_t done, int64_t total) {
    (void)user;
    (void)total;
    if (strcmp(label, "eval") == 0 && done >= g_stop_after) moeq_interrupt();
}

static void test_interrupt_keeps_finished_documents(void) {
    moeq_model *m = open_model("olmoe-tiny");
    moeq_docs *docs = calib_docs();
    moeq_eval_options o = mq_test_text_eval(32, NULL);
    double ll[2], full_ll[2];
    int64_t tok[2];
    o.doc_loglikelihood = full_ll;
    o.doc_tokens = tok;
    moeq_eval_result r;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    char *path = mq_path_join(mq_test_tmpdir(), "partial.topk");
    o.save_logits = path;
    o.doc_loglikelihood = ll;
    g_stop_after = tok[0];
    moeq_set_threads(1);
    moeq_set_progress(stop_cb, NULL);
    moeq_status st = moeq_eval(m, docs, &o, &r);
    moeq_set_progress(NULL, NULL);
    moeq_clear_interrupt();
    moeq_set_threads(0);
    ASSERT_EQ_INT(MOEQ_E_INTERRUPTED, st);
    ASSERT_ERROR_MENTIONS("interrupted after 1 of 2 documents");
    ASSERT_EQ_INT(1, r.interrupted);
    ASSERT_EQ_INT(1, r.documents);
    ASSERT_EQ_INT(tok[0], r.tokens);
    ASSERT_TRUE(ll[0] == full_ll[0] && r.loglikelihood == full_ll[0]);
    ASSERT_TRUE(isnan(ll[1]));
    ASSERT_FALSE(mq_file_exists(path)); /* no partial logits file */
    free(path);
    moeq_docs_free(docs);
    moeq_model_free(m);
}

TEST_MAIN(T(test_first_documents_match_reference_and_threads),
          T(test_against_slow_session_reference), T(test_temperature_and_entropy), T(test_kl_against_itself_is_zero),
          T(test_saved_logits), T(test_saved_logits_mismatch),
          T(test_bad_options_and_empty_document), T(test_kl_base_with_other_vocabulary),
          T(test_interrupt_keeps_finished_documents))
