/*
 * tiktoken.model (Kimi K2's tokenizer): id-for-id equality with tiktoken 0.14 itself on
 * tests/data/kimi-tiny-tokenizer (a 956-rank vocabulary trained by scripts/gen_tiktoken_fixture.py,
 * laid out as Kimi K2's, golden.json made with tiktoken and Kimi's pat_str verbatim: cases for
 * Han runs and the characters whose Script_Extensions but not Script is Han, cased words with
 * contractions, digits, whitespace runs, emoji, specials), the decode round trip, the specials
 * and reserved names, where the split pattern cuts (on hand-made ranks whose tokens span the cuts:
 * the trained vocabulary has none, so its ids cannot tell), the merges recovered for GGUF, and
 * the errors of bad files.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "core/core.h"
#include "harness.h"
#include "io/tokenizer.h"

static const char *fixture_dir(void) { return mq_test_repo("tests/data/kimi-tiny-tokenizer"); }

static cJSON *golden(void) {
    char path[4200];
    snprintf(path, sizeof path, "%s/golden.json", fixture_dir());
    char *buf = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(path, &buf, &len));
    cJSON *g = cJSON_ParseWithLength(buf, len);
    free(buf);
    ASSERT_TRUE(g != NULL);
    return g;
}

static void expect_ids(const moeq_tokenizer *tok, const char *what, const char *text, size_t len,
                       const cJSON *ids) {
    int32_t *got = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, text, len, &got, &n));
    size_t want = (size_t)cJSON_GetArraySize(ids), i = 0;
    for (const cJSON *e = ids->child; e && i < n; e = e->next, i++)
        if (got[i] != (int32_t)e->valuedouble)
            FAIL("%s: first difference at token %zu: tiktoken %d, moeq %d", what, i,
                 (int)e->valuedouble, got[i]);
    if (n != want) FAIL("%s: tiktoken gives %zu ids, moeq %zu", what, want, n);
    char *back = NULL;
    size_t blen = 0;
    ASSERT_OK(moeq_tokenizer_decode(tok, got, n, &back, &blen));
    ASSERT_EQ_INT(len, blen);
    if (memcmp(back, text, len)) FAIL("%s: decode does not give the text back", what);
    free(back);
    free(got);
}

static void test_ids_equal_tiktoken(void) {
    cJSON *g = golden();
    moeq_tokenizer *tok = mq_test_tokenizer(fixture_dir());   /* a directory: finds tiktoken.model */
    ASSERT_EQ_INT(cJSON_GetObjectItem(g, "vocab_size")->valuedouble, moeq_tokenizer_vocab_size(tok));
    int n = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(g, "cases")) {
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        char what[64];
        snprintf(what, sizeof what, "case %d", n++);
        expect_ids(tok, what, text, strlen(text), cJSON_GetObjectItem(c, "ids"));
    }
    ASSERT_TRUE(n >= 20);
    char *text = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(mq_test_repo("data/demo-eval.txt"), &text, &len));
    expect_ids(tok, "data/demo-eval.txt", text, len, cJSON_GetObjectItem(g, "demo_eval_ids"));
    free(text);
    moeq_tokenizer_free(tok);
    cJSON_Delete(g);
}

/* Kimi K2's layout: 256 specials after the ranks, named ones from tokenizer_config.json. */
static void test_specials(void) {
    moeq_tokenizer *tok = NULL;
    char path[4200];
    snprintf(path, sizeof path, "%s/tiktoken.model", fixture_dir());
    ASSERT_OK(moeq_tokenizer_load(path, &tok));
    const int32_t base = 956;
    ASSERT_EQ_INT(base + 256, moeq_tokenizer_vocab_size(tok));
    ASSERT_EQ_INT(base, moeq_tokenizer_bos(tok));       /* "[BOS]" */
    ASSERT_EQ_INT(base + 1, moeq_tokenizer_eos(tok));   /* "[EOS]" */
    ASSERT_EQ_STR("<|im_middle|>", moeq_tokenizer_token(tok, base + 17));
    ASSERT_EQ_STR("<|reserved_token_961|>", moeq_tokenizer_token(tok, base + 5));
    ASSERT_EQ_STR("[PAD]", moeq_tokenizer_token(tok, base + 255));
    ASSERT_TRUE(moeq_tokenizer_token(tok, base + 256) == NULL);
    ASSERT_TRUE(mq_tokenizer_is_added(tok, base + 5) && !mq_tokenizer_is_added(tok, base - 1));
    ASSERT_EQ_STR("kimi-k2", mq_tokenizer_pre_name(tok));
    /* rank 0 is the byte '!' (the fixture's shuffled byte order), in the byte-level alphabet */
    ASSERT_EQ_STR("!", moeq_tokenizer_token(tok, 0));
    /* a reserved name written in text is that special, as tiktoken's allowed_special="all" */
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, "<|reserved_token_1000|>", 23, &ids, &n));
    ASSERT_EQ_INT(1, n);
    ASSERT_EQ_INT(1000, ids[0]);
    free(ids);
    moeq_tokenizer_free(tok);
}

/* The merges written to GGUF: one per token above the bytes (the fixture's vocabulary was trained
 * by merging, so each token is reachable), in rank order, each pair joining into a token of a
 * higher rank than both halves. */
static void test_recovered_merges(void) {
    moeq_tokenizer *tok = mq_test_tokenizer(fixture_dir());
    int32_t *pairs = NULL;
    size_t n = 0;
    ASSERT_OK(mq_tokenizer_merges(tok, &pairs, &n));
    ASSERT_EQ_INT(956 - 256, n);
    int32_t last = -1;
    for (size_t i = 0; i < n; i++) {
        const char *a = moeq_tokenizer_token(tok, pairs[2 * i]), *b = moeq_tokenizer_token(tok, pairs[2 * i + 1]);
        char joined[512];
        snprintf(joined, sizeof joined, "%s%s", a, b);
        int32_t id = mq_tokenizer_token_to_id(tok, joined, strlen(joined));
        if (id <= last || id <= pairs[2 * i] || id <= pairs[2 * i + 1])
            FAIL("merge %zu ('%s' '%s' -> %d) out of rank order (previous %d)", i, a, b, id, last);
        last = id;
    }
    free(pairs);
    moeq_tokenizer_free(tok);
}

static const char *write_file(const char *dir, const char *name, const char *content) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    ASSERT_OK(mq_write_file_atomic(path, content, strlen(content)));
    return path;
}

/* All 256 bytes in byte order, then the given extra lines. */
static char *ranks_file(const char *extra) {
    size_t cap = 256 * 16 + strlen(extra) + 1, at = 0;
    char *s = malloc(cap);
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int b = 0; b < 256; b++)
        at += (size_t)snprintf(s + at, cap - at, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    snprintf(s + at, cap - at, "%s", extra);
    return s;
}

/* Where Moonshot's pattern cuts, on a vocabulary whose tokens span the places a different split
 * would not cut (ids 256 "tU", 257 "字、", 258 "e" + U+0301): camelCase is cut at each
 * lower-to-upper step (llama.cpp's kimi-k2 scan keeps the run of letters whole), the ideographic
 * comma is not Han (Script; PCRE2's bare \\p{Han} is Script_Extensions and would join it to the
 * 字), and a combining mark stays in its word. */
static void test_split_points(void) {
    const char *dir = mq_test_tmpdir();
    write_file(dir, "tokenizer_config.json",
               "{\"auto_map\": {\"AutoTokenizer\": [\"tokenization_kimi.TikTokenTokenizer\", null]}}");
    char *text = ranks_file("dFU= 256\n5a2X44CB 257\nZcyB 258\n");
    moeq_tokenizer *tok = mq_test_tokenizer(write_file(dir, "tiktoken.model", text));
    free(text);
    static const struct {
        const char *text;
        int32_t ids[8];
        size_t n;
    } cases[] = {
        {"tU", {'t', 'U'}, 2},
        {"\xe5\xad\x97\xe3\x80\x81", {0xe5, 0xad, 0x97, 0xe3, 0x80, 0x81}, 6},
        {"e\xcc\x81", {258}, 1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int32_t *ids = NULL;
        size_t n = 0;
        ASSERT_OK(moeq_tokenizer_encode(tok, cases[c].text, strlen(cases[c].text), &ids, &n));
        bool same = n == cases[c].n;
        for (size_t i = 0; same && i < n; i++) same = ids[i] == cases[c].ids[i];
        if (!same) FAIL("case %zu: %zu ids, the first %d: not where Moonshot's pattern cuts", c, n, n ? ids[0] : -1);
        free(ids);
    }
    moeq_tokenizer_free(tok);
}

static void test_errors(void) {
    const char *dir = mq_test_tmpdir();
    static const char kimi_cfg[] =
        "{\"auto_map\": {\"AutoTokenizer\": [\"tokenization_kimi.TikTokenTokenizer\", null]}}";
    moeq_tokenizer *tok = (moeq_tokenizer *)1;
    /* a good small file first: "ab" (YWI=) is rank 256 */
    write_file(dir, "tokenizer_config.json", kimi_cfg);
    char *good = ranks_file("YWI= 256\n");
    ASSERT_OK(moeq_tokenizer_load(write_file(dir, "tiktoken.model", good), &tok));
    ASSERT_EQ_INT(257 + 256, moeq_tokenizer_vocab_size(tok));
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, "abc", 3, &ids, &n));
    ASSERT_EQ_INT(2, n);
    ASSERT_EQ_INT(256, ids[0]);
    ASSERT_EQ_INT('c', ids[1]);
    free(ids);
    moeq_tokenizer_free(tok);
    free(good);

    static const struct {
        const char *extra, *mentions;
    } bad[] = {
        {"YWI 256\n", "line 257 is not \"BASE64 RANK\""},
        {"Y$I= 256\n", "line 257 is not \"BASE64 RANK\""},
        {"YWI= x\n", "line 257 is not \"BASE64 RANK\""},
        {"YWI= 300\n", "rank 300 is out of range"},
        {"YWI= 5\n", "rank 5 repeats"},
        {"YQ== 256\n", "repeats an earlier one"},
        {"YWI= 256\n\n", "line 258 is not \"BASE64 RANK\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *text = ranks_file(bad[i].extra);
        const char *path = write_file(dir, "tiktoken.model", text);
        free(text);
        tok = (moeq_tokenizer *)1;
        ASSERT_STATUS(MOEQ_E_FORMAT, moeq_tokenizer_load(path, &tok));
        ASSERT_TRUE(tok == NULL);
        ASSERT_ERROR_MENTIONS(path);
        ASSERT_ERROR_MENTIONS(bad[i].mentions);
    }
    /* a byte with no rank: rank 255 given to "ab" instead of byte 0xff */
    char *text = ranks_file("");
    char *last = strstr(text, "/w== 255\n");
    ASSERT_TRUE(last != NULL);
    memcpy(last, "YWI= 255\n", 9);
    const char *path = write_file(dir, "tiktoken.model", text);
    free(text);
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_tokenizer_load(path, &tok));
    ASSERT_ERROR_MENTIONS("byte 0xff has no rank");

    /* the split pattern lives in the tokenizer's code: only Kimi's is known */
    text = ranks_file("");
    char model[1024];
    snprintf(model, sizeof model, "%s", write_file(dir, "tiktoken.model", text));
    path = model;
    free(text);
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s", write_file(dir, "tokenizer_config.json",
             "{\"auto_map\": {\"AutoTokenizer\": [\"tokenization_qwen.QWenTokenizer\", null]}}"));
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_tokenizer_load(path, &tok));
    ASSERT_ERROR_MENTIONS(cfg);
    ASSERT_ERROR_MENTIONS("tokenization_qwen.QWenTokenizer");
    write_file(dir, "tokenizer_config.json", "{\"auto_map\": {\"AutoTokenizer\": [\"tokenization_kimi.X\"]},"
               " \"added_tokens_decoder\": {\"x1\": {\"content\": \"[BOS]\"}}}");
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_tokenizer_load(path, &tok));
    ASSERT_ERROR_MENTIONS("added_tokens_decoder['x1']");
    ASSERT_TRUE(remove(cfg) == 0);
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_tokenizer_load(path, &tok));
    ASSERT_ERROR_MENTIONS("no tokenizer_config.json");

    /* a directory with neither file */
    char empty[1024];
    snprintf(empty, sizeof empty, "%s/empty", dir);
    ASSERT_TRUE(mkdir(empty, 0755) == 0);
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_tokenizer_load(empty, &tok));
    ASSERT_ERROR_MENTIONS("no tokenizer.json or tiktoken.model");
}

TEST_MAIN(T(test_ids_equal_tiktoken), T(test_specials), T(test_split_points), T(test_recovered_merges),
          T(test_errors))
