/*
 * The fp32 forward pass against transformers: per-layer hidden states and logits from
 * ../shared/fixtures/models/<model>.golden.safetensors (see fixtures/README.md) must match within
 * 1e-4 relative (max|diff| / max|ref|). Also: chunked prefill through the KV cache equals one
 * prefill, results do not depend on the thread count, the calibration hooks see what they
 * document, and tests/data/<name>/ goldens (made by the lead on a GPU box) when present.
 * Without the shared folder the olmoe-tiny cases use the bundled models/olmoe-tiny and the copy of
 * its golden in tests/data.
 */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "model/model.h"

static const double GOLDEN_RTOL = 1e-4;

typedef struct {
    moeq_model *m;
    mq_st *golden;
    int32_t ids[4096];
    int64_t T;
} golden_case;

static void tensor_f32(const mq_st *st, const char *name, float *out, int64_t numel) {
    const mq_tensor_view *t = mq_st_find(st, name);
    if (!t) FAIL("golden tensor '%s' missing", name);
    ASSERT_EQ_INT(numel, t->numel);
    ASSERT_OK(mq_tensor_to_f32(t, out));
}

static void open_case(const char *model_dir, const char *golden_path, golden_case *g) {
    memset(g, 0, sizeof *g);
    moeq_model_options opt = {.no_tokenizer = 1};
    ASSERT_OK(moeq_model_open(model_dir, &opt, &g->m));
    ASSERT_OK(mq_st_open_file(golden_path, &g->golden));
    const mq_tensor_view *ids = mq_st_find(g->golden, "input_ids");
    ASSERT_TRUE(ids != NULL);
    ASSERT_TRUE(ids->dtype == MOEQ_DT_I32 || ids->dtype == MOEQ_DT_I64);
    ASSERT_TRUE(ids->numel <= 4096);
    g->T = ids->numel;
    for (int64_t i = 0; i < g->T; i++) {
        if (ids->dtype == MOEQ_DT_I32) {
            memcpy(&g->ids[i], ids->data + 4 * i, 4);
        } else {
            int64_t v;
            memcpy(&v, ids->data + 8 * i, 8);
            g->ids[i] = (int32_t)v;
        }
    }
}

static void close_case(golden_case *g) {
    mq_st_close(g->golden);
    moeq_model_free(g->m);
}

/* Layer by layer against the goldens; stops at the first layer out of tolerance. */
static void run_golden(const char *label, const char *model_dir, const char *golden_path) {
    golden_case g;
    open_case(model_dir, golden_path, &g);
    const mq_config *c = &g.m->cfg;
    int64_t T = g.T, D = c->D, V = c->vocab, L = c->n_layers;
    float *x = malloc(sizeof(float) * (size_t)(T * D));
    float *ref = malloc(sizeof(float) * (size_t)(T * (V > D ? V : D)));
    float *logits = malloc(sizeof(float) * (size_t)(T * V));
    mq_state *st = NULL;
    ASSERT_OK(mq_state_new(g.m, (int32_t)T, &st));
    ASSERT_OK(mq_embed(g.m, g.ids, T, x));
    char name[64];
    for (int64_t l = 0; l <= L; l++) {
        if (l > 0) {
            ASSERT_OK(mq_forward_layers(g.m, st, x, T, 0, (int)l - 1, (int)l, NULL));
            if (l == L) mq_final_norm(g.m, x, T);
        }
        snprintf(name, sizeof name, "hidden_states.%lld", (long long)l);
        tensor_f32(g.golden, name, ref, T * D);
        double err = mq_test_rel_maxdiff(x, ref, (size_t)(T * D));
        fprintf(stderr, "  %s %s: rel err %.3g\n", label, name, err);
        if (!(err <= GOLDEN_RTOL)) FAIL("%s: %s rel err %.3g > %.0e", label, name, err, GOLDEN_RTOL);
    }
    mq_lm_head(g.m, x, T, logits);
    tensor_f32(g.golden, "logits", ref, T * V);
    double err = mq_test_rel_maxdiff(logits, ref, (size_t)(T * V));
    fprintf(stderr, "  %s logits: rel err %.3g\n", label, err);
    if (!(err <= GOLDEN_RTOL)) FAIL("%s: logits rel err %.3g", label, err);
    mq_state_free(st);
    free(x);
    free(ref);
    free(logits);
    close_case(&g);
}

/* The shared fixture and its golden; olmoe-tiny falls back to the bundled model and the golden's
 * copy in tests/data when the shared folder is absent. */
static void fixture_paths(const char *model, char *dir, char *gold, size_t size) {
    snprintf(dir, size, "%s", mq_test_model(model));
    snprintf(gold, size, "%s", mq_test_model_golden(model));
}

static void golden_fixture(const char *model) {
    char dir[4096], gold[4096];
    fixture_paths(model, dir, gold, sizeof dir);
    run_golden(model, dir, gold);
}

static void test_golden_olmoe(void) { golden_fixture("olmoe-tiny"); }
static void test_golden_qwen2moe(void) { golden_fixture("qwen2moe-tiny"); }
static void test_golden_llama(void) { golden_fixture("llama-tiny"); }

/* The bundled demo model is the fixture's olmoe-tiny: same golden. */
static void test_golden_bundled_olmoe(void) {
    char gold[4096];
    snprintf(gold, sizeof gold, "%s", mq_test_model_golden("olmoe-tiny"));
    run_golden("bundled olmoe-tiny", mq_test_repo("models/olmoe-tiny"), gold);
}

/* tests/data/<name>/ holds a model directory; its golden is tests/data/<name>.golden.safetensors
 * (same layout as the shared goldens), or that of its twin <base> for <base>-fused. Every such
 * folder is checked, so goldens added later are picked up without code changes. */
static void test_golden_tests_data(void) {
    char root[4096];
    snprintf(root, sizeof root, "%s", mq_test_repo("tests/data"));
    DIR *d = opendir(root);
    if (!d) SKIP("no tests/data folder");
    char names[64][256];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && n < 64) {
        char cfg[4600];
        snprintf(cfg, sizeof cfg, "%s/%s/config.json", root, e->d_name);
        if (e->d_name[0] != '.' && access(cfg, R_OK) == 0) snprintf(names[n++], 256, "%s", e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    int checked = 0;
    for (int i = 0; i < n; i++) {
        char dir[4400], gold[4600], base[256];
        snprintf(dir, sizeof dir, "%s/%.200s", root, names[i]);
        snprintf(base, sizeof base, "%.200s", names[i]);
        size_t len = strlen(base);
        snprintf(gold, sizeof gold, "%s/%s.golden.safetensors", root, base);
        if (access(gold, R_OK) != 0 && len > 6 && strcmp(base + len - 6, "-fused") == 0) {
            base[len - 6] = 0;
            snprintf(gold, sizeof gold, "%s/%s.golden.safetensors", root, base);
        }
        /* deepseekv3-tiny holds deepseekv3-fp8-tiny's weights dequantized (tests/data/README.md) */
        if (access(gold, R_OK) != 0 && strcmp(base, "deepseekv3-tiny") == 0)
            snprintf(gold, sizeof gold, "%s/deepseekv3-fp8-tiny.golden.safetensors", root);
        if (access(gold, R_OK) != 0) FAIL("tests/data/%s has no golden (%s)", names[i], gold);
        run_golden(names[i], dir, gold);
        checked++;
    }
    if (!checked) SKIP("tests/data holds no model folders");
}

/* ---- KV cache, sessions, threads ------------------------------------------------------------ */
static float *session_logits(moeq_model *m, const int32_t *ids, int64_t T, const int *chunks,
                             int n_chunks) {
    int64_t V = m->cfg.vocab;
    float *out = malloc(sizeof(float) * (size_t)(T * V));
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, (int32_t)T, &s));
    int64_t done = 0;
    for (int i = 0; i < n_chunks; i++) {
        ASSERT_OK(moeq_session_forward(s, ids + done, chunks[i], out + done * V));
        done += chunks[i];
        ASSERT_EQ_INT(done, moeq_session_pos(s));
    }
    ASSERT_EQ_INT(T, done);
    moeq_session_free(s);
    return out;
}

static void chunked_for(const char *model) {
    char dir[4096], gold[4096];
    fixture_paths(model, dir, gold, sizeof dir);
    golden_case g;
    open_case(dir, gold, &g);
    int64_t V = g.m->cfg.vocab, T = g.T;
    int one[1] = {(int)T};
    int three[3] = {50, 1, (int)T - 51};
    int tokens[128];
    for (int i = 0; i < 128; i++) tokens[i] = 1;
    float *a = session_logits(g.m, g.ids, T, one, 1);
    float *b = session_logits(g.m, g.ids, T, three, 3);
    float *c = session_logits(g.m, g.ids, T, tokens, (int)T);   /* token by token: decode path */
    double e1 = mq_test_rel_maxdiff(b, a, (size_t)(T * V));
    double e2 = mq_test_rel_maxdiff(c, a, (size_t)(T * V));
    fprintf(stderr, "  %s: chunks 50+1+77 vs prefill %.3g, one by one vs prefill %.3g\n", model, e1, e2);
    ASSERT_TRUE(e1 <= 1e-5);
    ASSERT_TRUE(e2 <= 1e-5);
    /* and the session path agrees with the goldens */
    float *ref = malloc(sizeof(float) * (size_t)(T * V));
    tensor_f32(g.golden, "logits", ref, T * V);
    ASSERT_TRUE(mq_test_rel_maxdiff(a, ref, (size_t)(T * V)) <= GOLDEN_RTOL);
    free(ref);
    free(a);
    free(b);
    free(c);
    close_case(&g);
}

static void test_chunked_olmoe(void) { chunked_for("olmoe-tiny"); }
static void test_chunked_qwen2moe(void) { chunked_for("qwen2moe-tiny"); }
static void test_chunked_llama(void) { chunked_for("llama-tiny"); }

static void test_threads_bit_identical(void) {
    const char *models[] = {"olmoe-tiny", "qwen2moe-tiny", "llama-tiny"};
    for (int mi = 0; mi < 3; mi++) {
        if (mi > 0 && !mq_test_have_shared()) continue;   /* only olmoe-tiny is bundled */
        char dir[4096], gold[4096];
        fixture_paths(models[mi], dir, gold, sizeof dir);
        golden_case g;
        open_case(dir, gold, &g);
        int64_t V = g.m->cfg.vocab, T = g.T;
        int chunks[2] = {100, (int)T - 100};
        float *ref = NULL;
        for (int th = 1; th <= 3; th++) {
            moeq_set_threads(th);
            float *out = session_logits(g.m, g.ids, T, chunks, 2);
            if (!ref) {
                ref = out;
                continue;
            }
            if (memcmp(ref, out, sizeof(float) * (size_t)(T * V)) != 0)
                FAIL("%s: logits with %d threads differ from 1 thread", models[mi], th);
            free(out);
        }
        moeq_set_threads(0);
        free(ref);
        close_case(&g);
    }
}

/* moeq_model_open with the tokenizer, and the info it fills. */
static void test_model_info(void) {
    moeq_model *m = mq_test_open_model(mq_test_repo("models/olmoe-tiny"), NULL);
    const moeq_model_info *i = moeq_model_get_info(m);
    ASSERT_EQ_STR("olmoe", i->model_type);
    ASSERT_EQ_INT(4096, i->vocab_size);
    ASSERT_EQ_INT(256, i->hidden_size);
    ASSERT_EQ_INT(4, i->n_layers);
    ASSERT_EQ_INT(4, i->n_heads);
    ASSERT_EQ_INT(4, i->n_kv_heads);
    ASSERT_EQ_INT(64, i->head_dim);
    ASSERT_EQ_INT(8, i->n_experts);
    ASSERT_EQ_INT(2, i->n_experts_per_tok);
    ASSERT_EQ_INT(256, i->moe_intermediate_size);
    ASSERT_EQ_INT(512, i->max_position_embeddings);
    /* The bf16 file holds 2 bytes per parameter plus its header (< 20 KB). */
    ASSERT_TRUE(18914848 - 2 * i->n_params > 0 && 18914848 - 2 * i->n_params < 20000);
    ASSERT_EQ_INT(0, i->eos_token_id);
    ASSERT_EQ_INT(0, i->bos_token_id);   /* config says null; the tokenizer's <|endoftext|> */
    ASSERT_TRUE(i->quant_scheme == NULL);
    const moeq_tokenizer *tok = moeq_model_tokenizer(m);
    ASSERT_TRUE(tok != NULL);
    ASSERT_EQ_INT(4096, moeq_tokenizer_vocab_size(tok));
    moeq_model_free(m);
    moeq_model_free(NULL);
}

TEST_MAIN(T(test_model_info), T(test_golden_olmoe), T(test_golden_qwen2moe), T(test_golden_llama),
          T(test_golden_bundled_olmoe), T(test_golden_tests_data), T(test_chunked_olmoe),
          T(test_chunked_qwen2moe), T(test_chunked_llama), T(test_threads_bit_identical))
