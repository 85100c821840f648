/* The lm-eval wikitext protocol on the whole fixture file (62 documents, ~404K tokens per model)
 * against reference.json's wikitext_fp32, computed with transformers in fp32 at max_length 512:
 * word perplexity within 1e-4 relative, exact words/bytes/documents/tokens. This is the slow test
 * of the suite (the three models take about a minute each on two busy cores). Under an emulator
 * (MOEQ_CROSS: the arm64 build under qemu, ~40x slower) only olmoe-tiny's first documents are
 * scored, each against its own per-document reference; the other two models have no per-document
 * reference and run the same code, so they are skipped there. */
#include <stdlib.h>

#include <cjson/cJSON.h>

#include "core/core.h"
#include "harness.h"

static cJSON *g_ref;

static const cJSON *reference(const char *model, const char *key) {
    if (!g_ref) {
        char *buf = NULL;
        size_t len = 0;
        ASSERT_OK(mq_read_file(mq_test_shared("fixtures/reference.json"), &buf, &len));
        g_ref = cJSON_ParseWithLength(buf, len);
        free(buf);
        ASSERT_TRUE(g_ref != NULL);
    }
    const cJSON *r = cJSON_GetObjectItem(cJSON_GetObjectItem(g_ref, model), key);
    if (!r) FAIL("reference.json has no %s.%s", model, key);
    return r;
}

static double ref_num(const cJSON *r, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(r, key);
    if (!cJSON_IsNumber(v)) FAIL("reference.json: no number '%s'", key);
    return v->valuedouble;
}

/* documents scored under an emulator: about 40K of the 404K tokens */
enum { EMULATED_DOCS = 6 };

static void check_model(const char *name) {
    const int emulated = getenv("MOEQ_CROSS") != NULL;
    char rel[256];
    snprintf(rel, sizeof rel, "fixtures/models/%s", name);
    char *dir = mq_strdup(mq_test_shared(rel));
    moeq_docs *docs = mq_test_wikitext_docs();
    moeq_model *m = mq_test_open_model(dir, NULL);
    const cJSON *ref = reference(name, "wikitext_fp32");
    double *doc_ll = calloc((size_t)moeq_docs_count(docs), sizeof(double));
    int64_t *doc_tok = calloc((size_t)moeq_docs_count(docs), sizeof(int64_t));
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    o.max_length = 512;
    if (emulated) o.limit = EMULATED_DOCS;
    o.doc_loglikelihood = doc_ll;
    o.doc_tokens = doc_tok;
    moeq_eval_result r;
    ASSERT_OK(moeq_eval(m, docs, &o, &r));
    fprintf(stderr,
            "  %s: word_perplexity %.6f (reference %.6f), loglikelihood %.4f (%.4f), %lld tokens, "
            "%.1f s, %.0f tokens/s\n",
            name, r.word_perplexity, ref_num(ref, "word_perplexity"), r.loglikelihood,
            ref_num(ref, "loglikelihood"), (long long)r.tokens, r.seconds, r.tokens_per_second);
    const cJSON *per_doc = cJSON_GetObjectItem(ref, "per_doc");
    if (emulated) {
        if (!per_doc) FAIL("reference.json: %s has no per_doc", name);
        ASSERT_EQ_INT(EMULATED_DOCS, r.documents);
        double ll = 0;
        for (int d = 0; d < EMULATED_DOCS; d++) {
            const cJSON *e = cJSON_GetArrayItem(per_doc, d);
            ASSERT_EQ_INT(ref_num(e, "tokens"), doc_tok[d]);
            ASSERT_REL(ref_num(e, "ll"), doc_ll[d], 1e-6);
            ll += ref_num(e, "ll");
        }
        ASSERT_REL(ll, r.loglikelihood, 1e-6);
        ASSERT_EQ_INT(-1, doc_tok[EMULATED_DOCS]); /* the limit held */
        goto done;
    }
    ASSERT_EQ_INT(ref_num(ref, "docs"), r.documents);
    ASSERT_EQ_INT(ref_num(ref, "words"), r.words);
    ASSERT_EQ_INT(ref_num(ref, "bytes"), r.bytes);
    ASSERT_EQ_INT(512, r.max_length);
    ASSERT_EQ_INT(0, r.prefix_token);
    /* every RTN entry of the reference was scored on the same 403954 tokens */
    ASSERT_EQ_INT(ref_num(reference(name, "wikitext_nvfp4_rtn"), "tokens"), r.tokens);
    ASSERT_REL(ref_num(ref, "word_perplexity"), r.word_perplexity, 1e-4);
    ASSERT_REL(ref_num(ref, "byte_perplexity"), r.byte_perplexity, 1e-5);
    ASSERT_REL(ref_num(ref, "bits_per_byte"), r.bits_per_byte, 1e-5);
    ASSERT_REL(ref_num(ref, "loglikelihood"), r.loglikelihood, 1e-6);
    if (per_doc) { /* olmoe-tiny: each document too */
        ASSERT_EQ_INT(cJSON_GetArraySize(per_doc), moeq_docs_count(docs));
        for (int d = 0; d < cJSON_GetArraySize(per_doc); d++) {
            const cJSON *e = cJSON_GetArrayItem(per_doc, d);
            ASSERT_EQ_INT(ref_num(e, "tokens"), doc_tok[d]);
            ASSERT_REL(ref_num(e, "ll"), doc_ll[d], 1e-6);
        }
    }
done:
    free(doc_ll);
    free(doc_tok);
    moeq_model_free(m);
    moeq_docs_free(docs);
    free(dir);
}

static void test_olmoe_tiny(void) { check_model("olmoe-tiny"); }
static void skip_emulated(void) {
    if (getenv("MOEQ_CROSS")) SKIP("no per-document reference to check a part against under %s",
                                   getenv("MOEQ_CROSS"));
}
static void test_qwen2moe_tiny(void) { skip_emulated(); check_model("qwen2moe-tiny"); }
static void test_llama_tiny(void) { skip_emulated(); check_model("llama-tiny"); }

TEST_MAIN(T(test_olmoe_tiny), T(test_qwen2moe_tiny), T(test_llama_tiny))
