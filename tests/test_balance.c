/*
 * Expert-balanced calibration (src/pipeline/balance.c):
 *  - the streamed counts (layer by layer, groups of samples, experts loaded a chunk at a time)
 *    equal the tokens each expert's hook sees in the model's own forward (mq_forward_layers on
 *    the eagerly loaded model, one sample at a time), for every fixture family, any group size
 *    and chunk, and any thread count;
 *  - the lazy greedy choice equals a plain greedy written here (every gain recomputed at every
 *    step), on random count tables full of ties, and a hand-made table picks what balance means.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "model/model.h"
#include "pipeline/internal.h"
#include "quant/calib.h"

typedef struct {
    int32_t *cnt;   /* [n_moe][E] of the sample */
    const int *moe_index;
    int64_t E;
} hook_counts;

static void on_expert(void *user, int layer, mq_site site, int expert, const float *x, int64_t rows,
                      int64_t cols) {
    (void)x;
    (void)cols;
    hook_counts *h = user;
    if (site == MQ_SITE_EXPERT) h->cnt[h->moe_index[layer] * h->E + expert] += (int32_t)rows;
}

static void pool_of(const char *model, int64_t n, int64_t seqlen, mq_calib_set *pool) {
    moeq_model_options opt = {0};
    moeq_model *m = mq_test_open_model(model, &opt);
    mq_calib_opts co;
    mq_calib_opts_init(&co);
    co.path = mq_test_calib_text();
    co.nsamples = n;
    co.seqlen = seqlen;
    co.mode = MQ_CALIB_RANDOM;   /* windows of one length at random places */
    co.seed = 7;
    ASSERT_OK(mq_calib_load(moeq_model_tokenizer(m), &co, pool));
    moeq_model_free(m);
}

/* counts of samples from the forward, one at a time, the experts' hooks counting rows */
static int64_t top_k;

static int32_t *forward_counts(const char *dir, const mq_calib_set *pool, int *n_moe, int64_t *E) {
    moeq_model_options opt = {.no_tokenizer = 1};
    moeq_model *m = mq_test_open_model(dir, &opt);
    mq_model_det_experts(m, true);
    int moe_index[64], nm = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) moe_index[l] = m->layers[l].is_moe ? nm++ : -1;
    *n_moe = nm;
    *E = m->cfg.n_experts;
    top_k = m->cfg.top_k;
    int32_t *all = calloc((size_t)(pool->n * nm * (*E > 0 ? *E : 1)) + 1, sizeof(int32_t));
    mq_state *st = NULL;
    ASSERT_OK(mq_state_new(m, (int32_t)pool->max_len, &st));
    float *x = malloc(sizeof(float) * (size_t)(pool->max_len * m->cfg.D));
    for (int64_t s = 0; s < pool->n; s++) {
        hook_counts h = {all + s * nm * *E, moe_index, *E};
        mq_hooks hk = {on_expert, &h};
        ASSERT_OK(mq_embed(m, pool->ids[s], pool->len[s], x));
        ASSERT_OK(mq_forward_layers(m, st, x, pool->len[s], 0, 0, m->cfg.n_layers, &hk));
    }
    free(x);
    mq_state_free(st);
    moeq_model_free(m);
    return all;
}

static int32_t *streamed_counts(const char *dir, const mq_calib_set *pool, int64_t group, int chunk) {
    mq_lazy_model *lz = NULL;
    ASSERT_OK(mq_lazy_open(dir, false, &lz));
    mq_balance_counter k;
    ASSERT_OK(mq_balance_counter_init(&k, lz, group, pool->max_len, chunk));
    const int64_t E = mq_lazy_model_of(lz)->cfg.n_experts;
    int32_t *c = calloc((size_t)(pool->n * k.n_moe * (E > 0 ? E : 1)) + 1, sizeof(int32_t));
    for (int64_t s0 = 0; s0 < pool->n; s0 += group) {
        int64_t g = pool->n - s0 < group ? pool->n - s0 : group;
        ASSERT_OK(mq_balance_count_group(&k, pool, s0, g, c, NULL, NULL));
    }
    mq_balance_counter_free(&k);
    mq_lazy_close(lz);
    return c;
}

static void check_family(const char *name, const char *model_dir) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", model_dir);
    mq_calib_set pool;
    pool_of(dir, 7, 96, &pool);
    int n_moe;
    int64_t E;
    int32_t *want = forward_counts(dir, &pool, &n_moe, &E);
    const size_t n = (size_t)(pool.n * n_moe * E);
    ASSERT_TRUE(n_moe > 0 && E > 1);
    int64_t tokens = 0;
    for (size_t i = 0; i < n; i++) tokens += want[i];
    ASSERT_EQ_INT(pool.total * n_moe * top_k, tokens);   /* every token top_k times a layer */
    const int64_t groups[] = {1, 3, 7};
    const int chunks[] = {0, 1, 3};
    for (int a = 0; a < 3; a++) {
        int32_t *got = streamed_counts(dir, &pool, groups[a], chunks[a]);
        for (size_t i = 0; i < n; i++)
            if (got[i] != want[i])
                FAIL("%s, groups of %lld, chunk %d: sample %lld, MoE layer %lld, expert %lld: %d tokens streamed, %d in the forward",
                     name, (long long)groups[a], chunks[a], (long long)(i / (size_t)(n_moe * E)),
                     (long long)(i / (size_t)E % (size_t)n_moe), (long long)(i % (size_t)E), got[i], want[i]);
        free(got);
    }
    /* another thread count: the same counts */
    int threads = moeq_threads();
    moeq_set_threads(threads > 1 ? 1 : 3);
    int32_t *got = streamed_counts(dir, &pool, 4, 2);
    moeq_set_threads(threads);
    ASSERT_TRUE(memcmp(got, want, n * sizeof(int32_t)) == 0);
    free(got);
    free(want);
    mq_calib_free(&pool);
}

static void test_counts_olmoe(void) { check_family("olmoe-tiny", mq_test_model("olmoe-tiny")); }
/* a shared expert with its sigmoid gate, renormalised top-k */
static void test_counts_qwen2moe(void) { check_family("qwen2moe-tiny", mq_test_model("qwen2moe-tiny")); }
/* MLA attention, a dense first layer, the group-limited sigmoid router with its bias, shared
 * experts */
static void test_counts_deepseek(void) { check_family("deepseekv3-tiny", mq_test_with_tokenizer("deepseekv3-tiny")); }

/* a dense model has nothing to count: no MoE layers, the pass stops at once */
static void test_counts_dense(void) {
    const char *dir = mq_test_model("llama-tiny");
    mq_calib_set pool;
    pool_of(dir, 2, 32, &pool);
    mq_lazy_model *lz = NULL;
    ASSERT_OK(mq_lazy_open(dir, false, &lz));
    mq_balance_counter k;
    ASSERT_OK(mq_balance_counter_init(&k, lz, 2, pool.max_len, 0));
    ASSERT_EQ_INT(0, k.n_moe);
    int32_t c = 0;
    ASSERT_OK(mq_balance_count_group(&k, &pool, 0, 2, &c, NULL, NULL));
    mq_balance_counter_free(&k);
    mq_lazy_close(lz);
    mq_calib_free(&pool);
}

/* ---- selection ---- */

static uint64_t g_rng = 88172645463325252ull;
static uint32_t rnd(void) {
    mq_test_xorshift(&g_rng);
    return (uint32_t)(g_rng >> 11);
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* the plain greedy: every remaining candidate's gain afresh at every step, the largest (the
 * lowest index among equals) taken */
static void slow_greedy(const int32_t *c, int64_t n, int64_t w, int64_t want, int64_t *out) {
    int64_t *tot = calloc((size_t)w, sizeof *tot);
    char *taken = calloc((size_t)n, 1);
    for (int64_t p = 0; p < want; p++) {
        int64_t best = -1;
        double bg = 0;
        for (int64_t i = 0; i < n; i++) {
            if (taken[i]) continue;
            double g = 0;
            for (int64_t j = 0; j < w; j++) g += log1p((double)(tot[j] + c[i * w + j])) - log1p((double)tot[j]);
            if (best < 0 || g > bg) {
                best = i;
                bg = g;
            }
        }
        taken[best] = 1;
        out[p] = best;
        for (int64_t j = 0; j < w; j++) tot[j] += c[best * w + j];
    }
    qsort(out, (size_t)want, sizeof *out, cmp64);
    free(tot);
    free(taken);
}

static void test_select_is_greedy(void) {
    for (int round = 0; round < 200; round++) {
        int64_t n = 1 + rnd() % 40, w = 1 + rnd() % 24, want = 1 + rnd() % (uint32_t)n;
        int32_t *c = malloc(sizeof(int32_t) * (size_t)(n * w));
        int sparse = round % 3;   /* many zeros and repeated rows: ties */
        for (int64_t i = 0; i < n * w; i++) c[i] = (int32_t)(rnd() % 5 < (uint32_t)sparse ? 0 : rnd() % (round % 2 ? 4 : 300));
        if (round % 4 == 0 && n > 2) memcpy(c + w, c, sizeof(int32_t) * (size_t)w);   /* a duplicate */
        int64_t got[64], ref[64];
        ASSERT_OK(mq_balance_select(c, n, w, want, got));
        slow_greedy(c, n, w, want, ref);
        for (int64_t p = 0; p < want; p++)
            if (got[p] != ref[p])
                FAIL("round %d (n %lld, width %lld, want %lld): pick %lld is %lld, the plain greedy's %lld", round,
                     (long long)n, (long long)w, (long long)want, (long long)p, (long long)got[p], (long long)ref[p]);
        free(c);
    }
}

/* Three candidates over two experts: 0 and 1 give expert 0 a hundred tokens each, 2 gives
 * expert 1 five. Choosing two: 0 first (log 101 beats log 6), then 2 (log 6 = 1.79 beats the
 * second hundred's log 201 - log 101 = 0.69), though the first two samples have 20 times its
 * tokens. */
static void test_select_by_hand(void) {
    const int32_t c[] = {100, 0, 100, 0, 0, 5};
    int64_t got[2];
    ASSERT_OK(mq_balance_select(c, 3, 2, 2, got));
    ASSERT_EQ_INT(0, got[0]);
    ASSERT_EQ_INT(2, got[1]);
    /* want >= n: everything, in order */
    int64_t all[3];
    ASSERT_OK(mq_balance_select(c, 3, 2, 5, all));
    for (int i = 0; i < 3; i++) ASSERT_EQ_INT(i, all[i]);
}

/* ---- the pipeline: a balanced run calibrates on exactly the samples the choice names ---- */

/* The first n lines of the calibration text with something besides spaces (docs mode's
 * documents), each with its newline; returns how many. */
static int doc_lines(char **lines, int n) {
    size_t len;
    char *t = mq_test_slurp(mq_test_calib_text(), &len);
    ASSERT_TRUE(t != NULL);
    int k = 0;
    for (char *at = t; *at && k < n;) {
        char *end = strchr(at, '\n');
        size_t l = end ? (size_t)(end - at) : strlen(at);
        int blank = 1;
        for (size_t i = 0; i < l; i++) blank &= at[i] == ' ' || at[i] == '\t' || at[i] == '\r';
        if (!blank) {
            lines[k] = malloc(l + 2);
            memcpy(lines[k], at, l);
            lines[k][l] = '\n';
            lines[k++][l + 1] = 0;
        }
        at += l + (end ? 1 : 0);
    }
    free(t);
    return k;
}

static void write_lines(const char *path, char **lines, const int64_t *idx, int64_t n) {
    FILE *f = fopen(path, "w");
    ASSERT_TRUE(f != NULL);
    for (int64_t i = 0; i < n; i++) fputs(lines[idx ? idx[i] : i], f);
    fclose(f);
}

static void quantize_docs(const char *model, const char *calib, const char *out, int64_t nsamples, int64_t pool,
                          moeq_quant_result *r) {
    moeq_quant_options o = mq_test_gptq_options(MOEQ_QUANT_INT4, calib, nsamples, 32);
    o.gptq.sampling = MOEQ_CALIB_DOCS;
    o.gptq.min_expert_tokens = 4;
    if (pool > 0) {
        o.gptq.calib_balance = MOEQ_CALIB_BALANCE_EXPERTS;
        o.gptq.calib_pool = pool;
    }
    ASSERT_OK(moeq_quantize(model, out, &o, r));
}

static void test_pipeline_uses_the_choice(void) {
    enum { POOL = 40, WANT = 8 };
    char *lines[64];
    int n_lines = doc_lines(lines, 64);
    ASSERT_TRUE(n_lines == 64);
    char dir[1024], tmp[1024], pool_txt[1200], chosen_txt[1200], out_a[1200], out_b[1200], st_a[1300], st_b[1300];
    snprintf(dir, sizeof dir, "%s", mq_test_model("olmoe-tiny"));
    snprintf(tmp, sizeof tmp, "%s", mq_test_tmpdir());
    snprintf(pool_txt, sizeof pool_txt, "%s/pool.txt", tmp);
    snprintf(chosen_txt, sizeof chosen_txt, "%s/chosen.txt", tmp);
    snprintf(out_a, sizeof out_a, "%s/balanced", tmp);
    snprintf(out_b, sizeof out_b, "%s/direct", tmp);
    write_lines(pool_txt, lines, NULL, n_lines);   /* more lines than the pool takes */

    /* the choice, found here: the forward's counts of the first POOL documents, the plain greedy */
    moeq_model *m = mq_test_open_model(dir, NULL);
    mq_calib_opts co;
    mq_calib_opts_init(&co);
    co.path = pool_txt;
    co.nsamples = POOL;
    co.seqlen = 32;
    co.mode = MQ_CALIB_DOCS;
    mq_calib_set pool;
    ASSERT_OK(mq_calib_load(moeq_model_tokenizer(m), &co, &pool));
    moeq_model_free(m);
    ASSERT_EQ_INT(POOL, pool.n);
    int n_moe;
    int64_t E, chosen[WANT];
    int32_t *c = forward_counts(dir, &pool, &n_moe, &E);
    slow_greedy(c, POOL, n_moe * E, WANT, chosen);
    free(c);
    mq_calib_free(&pool);
    ASSERT_TRUE(chosen[WANT - 1] >= WANT);   /* not simply the first ones */
    write_lines(chosen_txt, lines, chosen, WANT);

    moeq_quant_result ra, rb;
    quantize_docs(dir, pool_txt, out_a, WANT, POOL, &ra);
    quantize_docs(dir, chosen_txt, out_b, WANT, 0, &rb);
    snprintf(st_a, sizeof st_a, "%s/model.safetensors", out_a);
    snprintf(st_b, sizeof st_b, "%s/model.safetensors", out_b);
    ASSERT_TRUE(mq_test_same_file(st_a, st_b));
    ASSERT_EQ_INT(POOL, ra.balance_candidates);
    ASSERT_EQ_INT(0, rb.balance_candidates);
    ASSERT_EQ_INT(rb.gptq_tokens, ra.gptq_tokens);
    ASSERT_TRUE(ra.balance_under[1] <= ra.balance_under[0]);
    ASSERT_TRUE(ra.balance_fewest[1] >= ra.balance_fewest[0]);
    for (int i = 0; i < n_lines; i++) free(lines[i]);
}

/* A dense model has no experts to balance: a warning, and the first samples, as without it. */
static void test_pipeline_dense_unchanged(void) {
    char *lines[16];
    int n_lines = doc_lines(lines, 16);
    char dir[1024], tmp[1024], txt[1200], out_a[1200], out_b[1200], st_a[1300], st_b[1300];
    snprintf(dir, sizeof dir, "%s", mq_test_model("llama-tiny"));
    snprintf(tmp, sizeof tmp, "%s", mq_test_tmpdir());
    snprintf(txt, sizeof txt, "%s/docs.txt", tmp);
    snprintf(out_a, sizeof out_a, "%s/a", tmp);
    snprintf(out_b, sizeof out_b, "%s/b", tmp);
    write_lines(txt, lines, NULL, n_lines);
    moeq_quant_result ra, rb;
    quantize_docs(dir, txt, out_a, 3, 12, &ra);
    quantize_docs(dir, txt, out_b, 3, 0, &rb);
    snprintf(st_a, sizeof st_a, "%s/model.safetensors", out_a);
    snprintf(st_b, sizeof st_b, "%s/model.safetensors", out_b);
    ASSERT_TRUE(mq_test_same_file(st_a, st_b));
    ASSERT_EQ_INT(3, ra.gptq_samples);
    ASSERT_EQ_INT(0, ra.balance_candidates);
    for (int i = 0; i < n_lines; i++) free(lines[i]);
}

TEST_MAIN(T(test_counts_olmoe), T(test_counts_qwen2moe), T(test_counts_deepseek), T(test_counts_dense), T(test_select_is_greedy),
          T(test_select_by_hand),
          T(test_pipeline_uses_the_choice), T(test_pipeline_dense_unchanged))
