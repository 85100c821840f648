/*
 * GPTQ Hessian accumulation (src/quant/hessian.c) against a direct double-precision sum, and the
 * calibration sample builder (src/quant/calib.c) against hand-computed slices and the tokenizer.
 */
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "harness.h"
#include "quant/calib.h"
#include "quant/hessian.h"

static uint64_t g_rng = 7;
static float rnd(void) {
    mq_test_xorshift(&g_rng);
    return (float)((double)(g_rng >> 11) * 0x1p-53 - 0.5);
}

static void test_hessian_matches_direct_sum(void) {
    const int64_t K = 40, T = 300;
    float *x = malloc((size_t)(T * K) * sizeof(float));
    for (int64_t i = 0; i < T * K; i++) x[i] = rnd() * (float)(1 + i % K);
    mq_hessian a, b;
    ASSERT_OK(mq_hessian_init(&a, K, "a"));
    ASSERT_OK(mq_hessian_init(&b, K, "b"));
    mq_hessian_add(&a, x, T);                      /* one call */
    mq_hessian_add(&b, x, 0);                      /* empty calls count nothing */
    for (int64_t t0 = 0; t0 < T; t0 += 37)         /* uneven batches */
        mq_hessian_add(&b, x + t0 * K, T - t0 < 37 ? T - t0 : 37);
    ASSERT_EQ_INT(T, a.n);
    ASSERT_EQ_INT(T, b.n);
    float *ha = malloc((size_t)(K * K) * sizeof(float)), *hb = malloc((size_t)(K * K) * sizeof(float));
    mq_hessian_get(&a, ha);
    mq_hessian_get(&b, hb);
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++) {
            double s = 0;
            for (int64_t t = 0; t < T; t++) s += (double)x[t * K + i] * x[t * K + j];
            s *= 2.0 / (double)T;
            double scale = sqrt((double)ha[i * K + i] * ha[j * K + j]);   /* cancellation */
            ASSERT_NEAR(s, ha[i * K + j], 1e-5 * scale);
            ASSERT_NEAR(s, hb[i * K + j], 1e-5 * scale);
            ASSERT_TRUE(ha[i * K + j] == ha[j * K + i]);   /* symmetric */
        }
    /* merge: two halves give the whole */
    mq_hessian c, d;
    ASSERT_OK(mq_hessian_init(&c, K, "c"));
    ASSERT_OK(mq_hessian_init(&d, K, "d"));
    mq_hessian_add(&c, x, 100);
    mq_hessian_add(&d, x + 100 * K, T - 100);
    mq_hessian_merge(&c, &d);
    ASSERT_EQ_INT(T, c.n);
    mq_hessian_get(&c, hb);
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++)
            ASSERT_NEAR(ha[i * K + j], hb[i * K + j], 1e-5 * sqrt((double)ha[i * K + i] * ha[j * K + j]));
    /* no rows: zero */
    mq_hessian_free(&d);
    ASSERT_OK(mq_hessian_init(&d, K, "d"));
    mq_hessian_get(&d, hb);
    for (int64_t i = 0; i < K * K; i++) ASSERT_TRUE(hb[i] == 0.0f);
    mq_hessian_free(&a);
    mq_hessian_free(&b);
    mq_hessian_free(&c);
    mq_hessian_free(&d);
    free(x);
    free(ha);
    free(hb);
}

static void test_calib_chunks_and_random(void) {
    int32_t ids[100];
    for (int i = 0; i < 100; i++) ids[i] = 1000 + i;
    mq_calib_opts o;
    mq_calib_opts_init(&o);
    ASSERT_EQ_INT(128, o.nsamples);
    ASSERT_EQ_INT(512, o.seqlen);
    o.nsamples = 3;
    o.seqlen = 30;
    mq_calib_set s;
    ASSERT_OK(mq_calib_from_ids(ids, 100, &o, &s));
    ASSERT_EQ_INT(3, s.n);
    for (int k = 0; k < 3; k++) {
        ASSERT_EQ_INT(30, s.len[k]);
        for (int t = 0; t < 30; t++) ASSERT_EQ_INT(1000 + 30 * k + t, s.ids[k][t]);
    }
    ASSERT_EQ_INT(90, s.total);
    mq_calib_free(&s);
    /* more samples than the stream holds: the full chunks only */
    o.nsamples = 10;
    ASSERT_OK(mq_calib_from_ids(ids, 100, &o, &s));
    ASSERT_EQ_INT(3, s.n);
    mq_calib_free(&s);
    /* a stream shorter than one sample: one short sample */
    ASSERT_OK(mq_calib_from_ids(ids, 12, &o, &s));
    ASSERT_EQ_INT(1, s.n);
    ASSERT_EQ_INT(12, s.len[0]);
    mq_calib_free(&s);
    /* random windows: inside the stream, consecutive ids, reproducible, seed-dependent */
    o.mode = MQ_CALIB_RANDOM;
    o.nsamples = 20;
    o.seed = 5;
    mq_calib_set r1, r2, r3;
    ASSERT_OK(mq_calib_from_ids(ids, 100, &o, &r1));
    ASSERT_OK(mq_calib_from_ids(ids, 100, &o, &r2));
    o.seed = 6;
    ASSERT_OK(mq_calib_from_ids(ids, 100, &o, &r3));
    ASSERT_EQ_INT(20, r1.n);
    int differ = 0;
    for (int k = 0; k < 20; k++) {
        ASSERT_EQ_INT(30, r1.len[k]);
        ASSERT_TRUE(r1.ids[k][0] >= 1000 && r1.ids[k][29] <= 1099);
        for (int t = 1; t < 30; t++) ASSERT_EQ_INT(r1.ids[k][0] + t, r1.ids[k][t]);
        ASSERT_EQ_INT(r1.ids[k][0], r2.ids[k][0]);
        differ += r1.ids[k][0] != r3.ids[k][0];
    }
    ASSERT_TRUE(differ > 0);
    mq_calib_free(&r1);
    mq_calib_free(&r2);
    mq_calib_free(&r3);
    o.seqlen = 1;
    ASSERT_STATUS(MOEQ_E_ARG, mq_calib_from_ids(ids, 100, &o, &s));
    ASSERT_ERROR_MENTIONS("--seqlen");
}

static moeq_tokenizer *load_tok(void) {
    char path[4200];
    snprintf(path, sizeof path, "%s/tokenizer.json", mq_test_model("olmoe-tiny"));
    return mq_test_tokenizer(path);
}

static const char *write_tmp(const char *name, const char *text) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", mq_test_tmpdir(), name);
    ASSERT_OK(mq_write_file_atomic(path, text, strlen(text)));
    return path;
}

static void test_calib_files(void) {
    moeq_tokenizer *tok = load_tok();
    const char *text = "The quick brown fox jumps over the lazy dog.\nA second line of text here.\n"
                       "\nAnd a third, after a blank line.\n";
    int32_t *ids;
    size_t n;
    ASSERT_OK(moeq_tokenizer_encode(tok, text, strlen(text), &ids, &n));
    mq_calib_opts o;
    mq_calib_opts_init(&o);
    o.path = write_tmp("calib.txt", text);
    o.nsamples = 4;
    o.seqlen = 5;
    mq_calib_set s;
    ASSERT_OK(mq_calib_load(tok, &o, &s));   /* the whole text as one string, chunked */
    ASSERT_TRUE(s.n >= 1);
    for (int64_t k = 0; k < s.n; k++)
        for (int64_t t = 0; t < s.len[k]; t++) ASSERT_EQ_INT(ids[k * 5 + t], s.ids[k][t]);
    mq_calib_free(&s);
    /* BOS first, counted in seqlen */
    o.bos = true;
    ASSERT_OK(mq_calib_load(tok, &o, &s));
    ASSERT_EQ_INT(moeq_tokenizer_bos(tok), s.ids[0][0]);
    ASSERT_EQ_INT(5, s.len[0]);
    ASSERT_EQ_INT(ids[0], s.ids[0][1]);
    ASSERT_EQ_INT(ids[4], s.ids[1][1]);
    mq_calib_free(&s);
    o.bos = false;
    /* documents: one per non-empty line, truncated */
    o.mode = MQ_CALIB_DOCS;
    o.nsamples = 10;
    o.seqlen = 100;
    ASSERT_OK(mq_calib_load(tok, &o, &s));
    ASSERT_EQ_INT(3, s.n);
    int32_t *d3;
    size_t n3;
    const char *third = "And a third, after a blank line.";
    ASSERT_OK(moeq_tokenizer_encode(tok, third, strlen(third), &d3, &n3));
    ASSERT_EQ_INT((int64_t)n3, s.len[2]);
    for (size_t t = 0; t < n3; t++) ASSERT_EQ_INT(d3[t], s.ids[2][t]);
    mq_calib_free(&s);
    /* JSONL: one document per record */
    o.path = write_tmp("calib.jsonl", "{\"text\": \"And a third, after a blank line.\"}\n\n"
                                      "{\"text\": \"x\", \"meta\": 1}\n");
    ASSERT_OK(mq_calib_load(tok, &o, &s));
    ASSERT_EQ_INT(2, s.n);
    ASSERT_EQ_INT((int64_t)n3, s.len[0]);
    mq_calib_free(&s);
    /* refused inputs, each with an error naming the file (and a JSONL record's line); text that is
     * not UTF-8 named only "tokenizer" before (found by fuzz_calib, tests/fuzz/regressions/calib/) */
    static const struct {
        const char *name, *text;   /* text NULL: name is a path that does not exist */
        mq_calib_mode mode;
        moeq_status status;
        const char *mention;
    } bad[] = {
        {"bad.jsonl", "{\"text\": \"fine\"}\n{\"txt\": 3}\n", MQ_CALIB_DOCS, MOEQ_E_FORMAT, "bad.jsonl:2"},
        {"empty.txt", "\n\n", MQ_CALIB_DOCS, MOEQ_E_FORMAT, "empty.txt"},
        {"empty2.txt", "", MQ_CALIB_CHUNKS, MOEQ_E_FORMAT, "empty2.txt"},
        {"/nonexistent/calib.txt", NULL, MQ_CALIB_CHUNKS, MOEQ_E_IO, "/nonexistent/calib.txt"},
        {"latin1.txt", "caf\xe9 au lait\n", MQ_CALIB_CHUNKS, MOEQ_E_FORMAT,
         "latin1.txt: tokenizer: input is not valid UTF-8 at byte offset 3"},
        {"latin1.jsonl", "{\"text\": \"fine\"}\n\n{\"text\": \"caf\xe9\"}\n", MQ_CALIB_DOCS, MOEQ_E_FORMAT,
         "latin1.jsonl:3: tokenizer: input is not valid UTF-8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        o.path = bad[i].text ? write_tmp(bad[i].name, bad[i].text) : bad[i].name;
        o.mode = bad[i].mode;
        ASSERT_STATUS(bad[i].status, mq_calib_load(tok, &o, &s));
        ASSERT_ERROR_MENTIONS(bad[i].mention);
    }
    o.mode = MQ_CALIB_CHUNKS;
    free(ids);
    free(d3);
    moeq_tokenizer_free(tok);
}

/* Tokens of one document, for comparing a sample with what it should hold. */
static void assert_sample_is(const moeq_tokenizer *tok, const mq_calib_set *s, int64_t k, const char *doc) {
    int32_t *ids;
    size_t n;
    ASSERT_OK(moeq_tokenizer_encode(tok, doc, strlen(doc), &ids, &n));
    ASSERT_EQ_INT((int64_t)n, s->len[k]);
    for (size_t t = 0; t < n; t++) ASSERT_EQ_INT(ids[t], s->ids[k][t]);
    free(ids);
}

/* Calibration data as users have it: JSONL gzip-compressed, chat "messages", another field. */
static void test_calib_jsonl_gz_messages(void) {
    moeq_tokenizer *tok = load_tok();
    const char *jl = "{\"text\": \"The first document.\"}\n"
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi there.\"}, {\"role\": \"assistant\", "
                     "\"content\": [{\"type\": \"text\", \"text\": \"Part one. \"}, {\"type\": \"text\", \"text\": \"Part two.\"}]}]}\n"
                     "{\"text\": \"The third.\", \"body\": \"Another field.\"}\n";
    char gz[512];
    snprintf(gz, sizeof gz, "%s/calib.jsonl.gz", mq_test_tmpdir());
    gzFile g = gzopen(gz, "wb");
    ASSERT_TRUE(g != NULL);
    ASSERT_EQ_INT((int)strlen(jl), gzwrite(g, jl, (unsigned)strlen(jl)));
    ASSERT_EQ_INT(Z_OK, gzclose(g));
    mq_calib_opts o;
    mq_calib_opts_init(&o);
    o.path = gz;
    o.mode = MQ_CALIB_DOCS;
    o.nsamples = 10;
    o.seqlen = 100;
    mq_calib_set s;
    ASSERT_OK(mq_calib_load(tok, &o, &s));
    ASSERT_EQ_INT(3, s.n);
    assert_sample_is(tok, &s, 0, "The first document.");
    assert_sample_is(tok, &s, 1, "user: Hi there.\nassistant: Part one. Part two.");
    assert_sample_is(tok, &s, 2, "The third.");
    mq_calib_free(&s);
    /* --calib-field: that field of every record; a record without it is an error naming the line */
    o.field = "body";
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_calib_load(tok, &o, &s));
    ASSERT_ERROR_MENTIONS("calib.jsonl.gz:1");
    ASSERT_ERROR_MENTIONS("\"body\"");
    o.path = write_tmp("body.jsonl", "{\"body\": \"Another field.\"}\n");
    ASSERT_OK(mq_calib_load(tok, &o, &s));
    ASSERT_EQ_INT(1, s.n);
    assert_sample_is(tok, &s, 0, "Another field.");
    mq_calib_free(&s);
    o.path = write_tmp("plain.txt", "plain text\n");
    ASSERT_STATUS(MOEQ_E_ARG, mq_calib_load(tok, &o, &s));
    ASSERT_ERROR_MENTIONS("--calib-field");
    o.field = NULL;
    /* a message without a role */
    o.path = write_tmp("chat.jsonl", "{\"messages\": [{\"content\": \"x\"}]}\n");
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_calib_load(tok, &o, &s));
    ASSERT_ERROR_MENTIONS("chat.jsonl:1");
    /* what W4A4's activation calibration reads: the documents joined by blank lines */
    char *all;
    size_t n;
    ASSERT_OK(mq_calib_read_all(gz, NULL, &all, &n));
    const char *want = "The first document.\n\nuser: Hi there.\nassistant: Part one. Part two.\n\nThe third.";
    ASSERT_EQ_STR(want, all);
    ASSERT_EQ_INT((int64_t)strlen(want), (int64_t)n);
    free(all);
    /* a .gz that is not gzip, and a truncated one */
    o.path = write_tmp("plain.gz", "not compressed\n");
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_calib_load(tok, &o, &s));
    ASSERT_ERROR_MENTIONS("plain.gz");
    char *bytes;
    size_t nb;
    ASSERT_OK(mq_read_file(gz, &bytes, &nb));
    char cut[512];
    snprintf(cut, sizeof cut, "%s/cut.jsonl.gz", mq_test_tmpdir());
    ASSERT_OK(mq_write_file_atomic(cut, bytes, nb / 2));
    free(bytes);
    o.path = cut;
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_calib_load(tok, &o, &s));
    ASSERT_ERROR_MENTIONS("cut.jsonl.gz");
    moeq_tokenizer_free(tok);
}


/* Gate-score weighting: rows scaled by sqrt(w) give (2/n) sum w x x^T, the obvious weighted sum
 * computed here in double. */
static void test_hessian_weighted_rows(void) {
    const int64_t K = 24, T = 200;
    float *x = malloc((size_t)(T * K) * sizeof(float)), *xw = malloc((size_t)(T * K) * sizeof(float));
    float *w = malloc((size_t)T * sizeof(float));
    for (int64_t i = 0; i < T * K; i++) x[i] = xw[i] = rnd() * (float)(1 + i % 5);
    for (int64_t t = 0; t < T; t++) w[t] = (float)(t % 7) / 7.0f + (t % 3 == 0 ? 0.0f : 0.05f);
    mq_hessian_weight_rows(xw, T, K, w);
    mq_hessian h;
    ASSERT_OK(mq_hessian_init(&h, K, "w"));
    mq_hessian_add(&h, xw, T);
    float *H = malloc((size_t)(K * K) * sizeof(float));
    mq_hessian_get(&h, H);
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++) {
            double s = 0, d = 0;
            for (int64_t t = 0; t < T; t++) {
                s += (double)w[t] * x[t * K + i] * x[t * K + j];
                d += (double)w[t] * fabs((double)x[t * K + i] * x[t * K + j]);
            }
            ASSERT_NEAR(2.0 * s / (double)T, H[i * K + j], 1e-5 * 2.0 * d / (double)T + 1e-12);
        }
    /* a zero weight removes the row: the same as leaving it out of an unweighted sum */
    for (int64_t t = 0; t < T; t++) w[t] = t % 2 ? 1.0f : 0.0f;
    memcpy(xw, x, (size_t)(T * K) * sizeof(float));
    mq_hessian_weight_rows(xw, T, K, w);
    for (int64_t t = 0; t < T; t += 2)
        for (int64_t k = 0; k < K; k++) ASSERT_TRUE(xw[t * K + k] == 0.0f);
    for (int64_t t = 1; t < T; t += 2)
        for (int64_t k = 0; k < K; k++) ASSERT_TRUE(xw[t * K + k] == x[t * K + k]);
    mq_hessian_free(&h);
    free(H);
    free(w);
    free(xw);
    free(x);
}

/* The held-out split of the damping sweep: the whole Hessian is the unsplit one bit for bit
 * however the rows come (calls crossing the boundary or ending on it); the held-out part and
 * the fitting part are the direct sums of their rows. */
static void test_hessian_split(void) {
    const int64_t K = 32, T = 260, hold = 190;
    float *x = malloc((size_t)(T * K) * sizeof(float));
    for (int64_t i = 0; i < T * K; i++) x[i] = rnd() * (float)(1 + i % 3);
    mq_hessian a;
    ASSERT_OK(mq_hessian_init(&a, K, "a"));
    mq_hessian_add(&a, x, T);
    float *Ha = malloc((size_t)(K * K) * sizeof(float));
    mq_hessian_get(&a, Ha);
    static const int64_t cuts[3][2] = {{37, 0}, {190, 0}, {1, 189}};   /* batch size, first call */
    float *whole = malloc((size_t)(K * K) * sizeof(float)), *held = malloc((size_t)(K * K) * sizeof(float));
    float *fit = malloc((size_t)(K * K) * sizeof(float));
    for (int c = 0; c < 3; c++) {
        mq_hessian b;
        ASSERT_OK(mq_hessian_init_split(&b, K, hold, "b"));
        int64_t t0 = 0;
        if (cuts[c][1]) {
            mq_hessian_add(&b, x, cuts[c][1]);
            t0 = cuts[c][1];
        }
        for (; t0 < T; t0 += cuts[c][0])
            mq_hessian_add(&b, x + t0 * K, T - t0 < cuts[c][0] ? T - t0 : cuts[c][0]);
        int64_t nf = -1, nh = -1;
        mq_hessian_get_split(&b, whole, held, &nf, &nh);
        ASSERT_EQ_INT(hold, nf);
        ASSERT_EQ_INT(T - hold, nh);
        ASSERT_TRUE(memcmp(whole, Ha, (size_t)(K * K) * sizeof(float)) == 0);
        mq_hessian_fit_from_split(whole, held, K, nf, nh, fit);
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j < K; j++) {
                double sh = 0, sf = 0;
                for (int64_t t = 0; t < T; t++) {
                    double v = (double)x[t * K + i] * x[t * K + j];
                    if (t < hold) sf += v;
                    else sh += v;
                }
                double scale = sqrt((double)Ha[i * K + i] * Ha[j * K + j]);
                ASSERT_NEAR(2.0 * sh / (double)(T - hold), held[i * K + j], 1e-4 * scale);
                ASSERT_NEAR(2.0 * sf / (double)hold, fit[i * K + j], 1e-4 * scale);
                ASSERT_TRUE(held[i * K + j] == held[j * K + i]);
            }
        mq_hessian_free(&b);
    }
    /* no row reaches the held-out part: it is zero, the fit is the whole */
    mq_hessian d;
    ASSERT_OK(mq_hessian_init_split(&d, K, T + 5, "d"));
    mq_hessian_add(&d, x, T);
    int64_t nf, nh;
    mq_hessian_get_split(&d, d.sum, d.fit, &nf, &nh);   /* in place, as the pipeline does */
    ASSERT_EQ_INT(T, nf);
    ASSERT_EQ_INT(0, nh);
    for (int64_t i = 0; i < K * K; i++) {
        ASSERT_TRUE(d.fit[i] == 0.0f);
        ASSERT_TRUE(d.sum[i] == Ha[i]);
    }
    mq_hessian_free(&d);
    mq_hessian_free(&a);
    free(fit);
    free(held);
    free(whole);
    free(Ha);
    free(x);
}


/* Forming H from the sum (row blocks in tiles on the pool): bit for bit the obvious loop, in
 * place or not, for sizes that are not multiples of the tile and any thread count. */
static void test_hessian_form_tiles(void) {
    static const int64_t Ks[] = {1, 31, 33, 77, 130};
    for (size_t c = 0; c < sizeof Ks / sizeof Ks[0]; c++) {
        const int64_t K = Ks[c], T = 19, hold = 11;
        float *x = malloc((size_t)(T * K) * sizeof(float));
        for (int64_t i = 0; i < T * K; i++) x[i] = rnd();
        mq_hessian h;
        ASSERT_OK(mq_hessian_init_split(&h, K, hold, "h"));
        mq_hessian_add(&h, x, T);
        float *want = malloc((size_t)(K * K) * sizeof(float)), *want_held = malloc((size_t)(K * K) * sizeof(float));
        const float scale = 2.0f / (float)T, sh = 2.0f / (float)(T - hold);
        for (int64_t a = 0; a < K; a++)
            for (int64_t b = 0; b < K; b++) {
                const int64_t i = a > b ? a * K + b : b * K + a;   /* the lower triangle's element */
                want[a * K + b] = scale * h.sum[i];
                want_held[a * K + b] = sh * (h.sum[i] - h.fit[i]);
            }
        float *out = malloc((size_t)(K * K) * sizeof(float));
        for (int threads = 1; threads <= 3; threads += 2) {
            moeq_set_threads(threads);
            mq_hessian_get(&h, out);
            ASSERT_TRUE(memcmp(out, want, (size_t)(K * K) * sizeof(float)) == 0);
        }
        int64_t nf, nh;
        mq_hessian_get_split(&h, h.sum, h.fit, &nf, &nh);   /* in place */
        ASSERT_TRUE(memcmp(h.sum, want, (size_t)(K * K) * sizeof(float)) == 0);
        ASSERT_TRUE(memcmp(h.fit, want_held, (size_t)(K * K) * sizeof(float)) == 0);
        mq_hessian_free(&h);
        free(x);
        free(want);
        free(want_held);
        free(out);
    }
    moeq_set_threads(0);
}

TEST_MAIN(T(test_hessian_matches_direct_sum), T(test_hessian_form_tiles), T(test_calib_chunks_and_random), T(test_calib_files),
          T(test_calib_jsonl_gz_messages), T(test_hessian_weighted_rows), T(test_hessian_split))
