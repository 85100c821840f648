/*
 * Tokenizer: id-for-id equality with HF tokenizers on the shared goldens, encode -> decode round
 * trip on all of wikitext-2, agreement with a slow obvious BPE written here (string pairs, linear
 * search for the lowest rank) on a slice of wikitext, hand-made cases, hand-built tokenizer.json
 * files for the features the fixture does not use, and the errors. Without ../shared the round
 * trip and the slow-reference check run on the repository's data/demo-*.txt instead.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>
#include <stdlib.h>

#include "core/core.h"
#include "harness.h"
#include "io/tokenizer.h"

/* The fixtures' tokenizer (olmoe-tiny's; the bundled models/olmoe-tiny has the same file). */
static const char *fixture_tokenizer(void) {
    static char buf[4200];
    snprintf(buf, sizeof buf, "%s/tokenizer.json", mq_test_model("olmoe-tiny"));
    return buf;
}

static moeq_tokenizer *load_fixture(void) {
    return mq_test_tokenizer(fixture_tokenizer());
}

static void assert_ids(const char *what, const int32_t *expect, size_t n_expect, const int32_t *got,
                       size_t n_got) {
    for (size_t i = 0; i < n_expect && i < n_got; i++)
        if (expect[i] != got[i])
            FAIL("%s: first difference at token %zu: expected %d, got %d", what, i, expect[i], got[i]);
    if (n_expect != n_got) FAIL("%s: expected %zu ids, got %zu", what, n_expect, n_got);
}

static void encode_expect(const moeq_tokenizer *tok, const char *text, const int32_t *expect,
                          size_t n_expect) {
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, text, strlen(text), &ids, &n));
    assert_ids(text, expect, n_expect, ids, n);
    char *back = NULL;
    size_t blen = 0;
    ASSERT_OK(moeq_tokenizer_decode(tok, ids, n, &back, &blen));
    ASSERT_EQ_INT(strlen(text), blen);
    ASSERT_EQ_STR(text, back);
    free(ids);
    free(back);
}

/* ---- HF goldens ------------------------------------------------------------------------------ */

static void test_golden_ids(void) {
    const char *golden = mq_test_shared("fixtures/tokenizer_golden.json");   /* skips: before any allocation */
    moeq_tokenizer *tok = load_fixture();
    char *json = NULL;
    ASSERT_OK(mq_read_file(golden, &json, NULL));
    cJSON *root = cJSON_Parse(json);
    ASSERT_TRUE(cJSON_IsArray(root));
    int cases = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, root) {
        const cJSON *text = cJSON_GetObjectItem(c, "text"), *jids = cJSON_GetObjectItem(c, "ids");
        ASSERT_TRUE(cJSON_IsString(text) && cJSON_IsArray(jids));
        size_t n_expect = (size_t)cJSON_GetArraySize(jids), k = 0;
        int32_t *expect = malloc(sizeof(int32_t) * (n_expect + 1));
        const cJSON *v;
        cJSON_ArrayForEach(v, jids) expect[k++] = (int32_t)v->valueint;
        encode_expect(tok, text->valuestring, expect, n_expect);
        free(expect);
        cases++;
    }
    ASSERT_TRUE(cases >= 20);
    cJSON_Delete(root);
    free(json);
    moeq_tokenizer_free(tok);
}

static void test_fixture_metadata(void) {
    moeq_tokenizer *tok = load_fixture();
    ASSERT_EQ_INT(4096, moeq_tokenizer_vocab_size(tok));
    ASSERT_EQ_INT(0, moeq_tokenizer_bos(tok));   /* tokenizer_config.json: <|endoftext|> */
    ASSERT_EQ_INT(0, moeq_tokenizer_eos(tok));
    ASSERT_EQ_STR("<|endoftext|>", moeq_tokenizer_token(tok, 0));
    ASSERT_EQ_STR("<|padding|>", moeq_tokenizer_token(tok, 1));
    ASSERT_EQ_STR("Ġ", moeq_tokenizer_token(tok, 222));    /* the space byte's alphabet char */
    ASSERT_EQ_STR("Ċ", moeq_tokenizer_token(tok, 200));
    ASSERT_TRUE(moeq_tokenizer_token(tok, -1) == NULL);
    ASSERT_TRUE(moeq_tokenizer_token(tok, 4096) == NULL);
    ASSERT_EQ_INT(222, mq_tokenizer_token_to_id(tok, "Ġ", strlen("Ġ")));
    ASSERT_EQ_INT(1, mq_tokenizer_token_to_id(tok, "<|padding|>", 11));
    ASSERT_EQ_INT(-1, mq_tokenizer_token_to_id(tok, "no such token", 13));
    size_t len = 0;
    const char *b = mq_tokenizer_token_bytes(tok, 222, &len);
    ASSERT_TRUE(b && len == 1 && b[0] == ' ');
    b = mq_tokenizer_token_bytes(tok, 0, &len);
    ASSERT_TRUE(b && len == 13 && !memcmp(b, "<|endoftext|>", 13));
    moeq_tokenizer_free(tok);
}

/* ---- hand-made cases on the fixture (ids read off its vocab.json by hand) --------------------- */

static void test_hand_cases(void) {
    moeq_tokenizer *tok = load_fixture();
    encode_expect(tok, "", NULL, 0);
    /* "\n\n" is one whitespace word; "ĊĊ" is not in the vocabulary, so two "Ċ" (200). */
    encode_expect(tok, "\n\n", (const int32_t[]){200, 200}, 2);
    /* Only spaces: \s+(?!\S) takes all three; no "ĠĠ" merge exists. */
    encode_expect(tok, "   ", (const int32_t[]){222, 222, 222}, 3);
    /* Specials in the middle split the text; the pieces are encoded alone (a = 66, b = 67). */
    encode_expect(tok, "a<|endoftext|>b", (const int32_t[]){66, 0, 67}, 3);
    encode_expect(tok, "<|endoftext|><|padding|>", (const int32_t[]){0, 1}, 2);
    encode_expect(tok, "a<|padding|><|endoftext|>\n", (const int32_t[]){66, 1, 0, 200}, 4);
    /* Not a special token: no id 0 may appear. */
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, "<|endoftext|", 12, &ids, &n));
    for (size_t i = 0; i < n; i++) ASSERT_TRUE(ids[i] != 0);
    free(ids);
    /* Text may contain NUL bytes: the length is explicit. */
    ASSERT_OK(moeq_tokenizer_encode(tok, "a\0b", 3, &ids, &n));
    ASSERT_EQ_INT(3, n);
    ASSERT_EQ_INT(66, ids[0]);
    ASSERT_EQ_INT(67, ids[2]);
    ASSERT_EQ_STR("Ā", moeq_tokenizer_token(tok, ids[1]));   /* byte 0 -> U+0100 */
    free(ids);
    moeq_tokenizer_free(tok);
}

static void test_invalid_utf8(void) {
    moeq_tokenizer *tok = load_fixture();
    static const struct {
        const char *s;
        size_t len, offset;
    } bad[] = {
        {"ab\xff" "cd", 5, 2},          /* invalid lead byte */
        {"abc\xe6\x97", 5, 3},          /* truncated at the end */
        {"\xc0\xaf", 2, 0},             /* overlong '/' */
        {"x\xed\xa0\x80", 4, 1},        /* UTF-16 surrogate */
        {"\xf4\x90\x80\x80", 4, 0},     /* above U+10FFFF */
        {"ok \x80", 4, 3},              /* lone continuation byte */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int32_t *ids = (int32_t *)1;
        size_t n = 99;
        ASSERT_STATUS(MOEQ_E_FORMAT, moeq_tokenizer_encode(tok, bad[i].s, bad[i].len, &ids, &n));
        ASSERT_TRUE(ids == NULL && n == 0);
        char want[64];
        snprintf(want, sizeof want, "byte offset %zu", bad[i].offset);
        ASSERT_ERROR_MENTIONS(want);
    }
    ASSERT_EQ_INT(7, mq_utf8_check("h\xc3\xa9llo", 7));   /* valid: returns the length */
    moeq_tokenizer_free(tok);
}

static void test_decode_lossy_and_errors(void) {
    moeq_tokenizer *tok = load_fixture();
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, "日本", strlen("日本"), &ids, &n));
    ASSERT_TRUE(n >= 2);
    /* Dropping the last token leaves a partial character: from_utf8_lossy gives one U+FFFD. */
    char *raw = NULL, *text = NULL;
    size_t rlen = 0, tlen = 0;
    ASSERT_OK(mq_tokenizer_decode_bytes(tok, ids, n - 1, &raw, &rlen));
    ASSERT_OK(moeq_tokenizer_decode(tok, ids, n - 1, &text, &tlen));
    ASSERT_TRUE(rlen < strlen("日本") && !memcmp(raw, "日本", rlen));
    char want[16];
    snprintf(want, sizeof want, "%s\xef\xbf\xbd", "日");
    ASSERT_TRUE(rlen > 3);   /* the fixture splits 本 into byte tokens */
    ASSERT_EQ_STR(want, text);
    free(raw);
    free(text);
    int32_t bad[2] = {66, 4096};
    ASSERT_STATUS(MOEQ_E_ARG, moeq_tokenizer_decode(tok, bad, 2, &text, &tlen));
    ASSERT_ERROR_MENTIONS("4096");
    free(ids);
    moeq_tokenizer_free(tok);
}

/* ---- a slow, obvious byte-level BPE for cross-checking ------------------------------------------ */

typedef struct {
    char *key;   /* "left\x01right" for merges, the token for the vocabulary */
    int value;
} ref_entry;

static int ref_cmp(const void *a, const void *b) {
    return strcmp(((const ref_entry *)a)->key, ((const ref_entry *)b)->key);
}

static int ref_find(const ref_entry *t, size_t n, const char *key) {
    ref_entry k = {(char *)key, 0};
    const ref_entry *e = bsearch(&k, t, n, sizeof k, ref_cmp);
    return e ? e->value : -1;
}

typedef struct {
    ref_entry *vocab, *merges;
    size_t n_vocab, n_merges;
    char alpha[256][3];   /* GPT-2 byte -> alphabet character (UTF-8) */
    pcre2_code *re;
} ref_tok;

static void ref_load(ref_tok *r, const char *path) {
    char *json = NULL;
    ASSERT_OK(mq_read_file(path, &json, NULL));
    cJSON *root = cJSON_Parse(json), *model = cJSON_GetObjectItem(root, "model");
    const cJSON *vocab = cJSON_GetObjectItem(model, "vocab"), *merges = cJSON_GetObjectItem(model, "merges");
    r->n_vocab = (size_t)cJSON_GetArraySize(vocab);
    r->n_merges = (size_t)cJSON_GetArraySize(merges);
    r->vocab = calloc(r->n_vocab, sizeof(ref_entry));
    r->merges = calloc(r->n_merges, sizeof(ref_entry));
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) r->vocab[i++] = (ref_entry){strdup(e->string), e->valueint};
    i = 0;
    cJSON_ArrayForEach(e, merges) {
        const char *a = cJSON_GetArrayItem(e, 0)->valuestring, *b = cJSON_GetArrayItem(e, 1)->valuestring;
        r->merges[i].key = mq_asprintf("%s\x01%s", a, b);
        r->merges[i].value = (int)i;
        i++;
    }
    qsort(r->vocab, r->n_vocab, sizeof(ref_entry), ref_cmp);
    qsort(r->merges, r->n_merges, sizeof(ref_entry), ref_cmp);
    cJSON_Delete(root);
    free(json);
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int cp = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae) ? b : 256 + n++;
        if (cp < 0x80) {
            r->alpha[b][0] = (char)cp;
            r->alpha[b][1] = 0;
        } else {
            r->alpha[b][0] = (char)(0xc0 | (cp >> 6));
            r->alpha[b][1] = (char)(0x80 | (cp & 0x3f));
            r->alpha[b][2] = 0;
        }
    }
    int err;
    PCRE2_SIZE off;
    r->re = pcre2_compile((PCRE2_SPTR) "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+"
                          "|\\s+(?!\\S)|\\s+", PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &off, NULL);
    ASSERT_TRUE(r->re != NULL);
}

static void ref_free(ref_tok *r) {
    for (size_t i = 0; i < r->n_vocab; i++) free(r->vocab[i].key);
    for (size_t i = 0; i < r->n_merges; i++) free(r->merges[i].key);
    free(r->vocab);
    free(r->merges);
    pcre2_code_free(r->re);
}

/* BPE on one word: repeatedly merge the leftmost pair of lowest rank. */
static void ref_word(const ref_tok *r, const char *w, size_t n, int32_t *out, size_t *n_out) {
    char **parts = malloc(sizeof(char *) * n);
    size_t m = n;
    for (size_t i = 0; i < n; i++) parts[i] = strdup(r->alpha[(uint8_t)w[i]]);
    for (;;) {
        int best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < m; i++) {
            char *key = mq_asprintf("%s\x01%s", parts[i], parts[i + 1]);
            int rank = ref_find(r->merges, r->n_merges, key);
            free(key);
            if (rank >= 0 && (best < 0 || rank < best)) {
                best = rank;
                at = i;
            }
        }
        if (best < 0) break;
        char *joined = mq_asprintf("%s%s", parts[at], parts[at + 1]);
        free(parts[at]);
        free(parts[at + 1]);
        parts[at] = joined;
        memmove(parts + at + 1, parts + at + 2, sizeof(char *) * (m - at - 2));
        m--;
    }
    for (size_t i = 0; i < m; i++) {
        out[(*n_out)++] = ref_find(r->vocab, r->n_vocab, parts[i]);
        free(parts[i]);
    }
    free(parts);
}

/* Whole text: specials cut out by strstr, the GPT-2 regex, then ref_word. */
static int32_t *ref_encode(const ref_tok *r, const char *s, size_t n, size_t *n_out) {
    int32_t *out = malloc(sizeof(int32_t) * (n + 1));
    *n_out = 0;
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    size_t p = 0;
    while (p < n) {
        const char *sp = strstr(s + p, "<|endoftext|>");
        size_t end = sp ? (size_t)(sp - s) : n;
        while (p < end) {
            ASSERT_TRUE(pcre2_match(r->re, (PCRE2_SPTR)s, end, p, 0, md, NULL) > 0);
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            ASSERT_EQ_INT(p, ov[0]);   /* the GPT-2 regex matches everywhere */
            ref_word(r, s + p, ov[1] - p, out, n_out);
            p = ov[1];
        }
        if (sp) {
            out[(*n_out)++] = 0;
            p += 13;
        }
    }
    pcre2_match_data_free(md);
    return out;
}

/* The first 200 kB of a text file (cut at a line break) with a special token in the middle. */
static void matches_slow_reference(const char *path, const char *what) {
    char *text = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(path, &text, &len));
    moeq_tokenizer *tok = load_fixture();
    /* A slice that ends on a line break, plus a special token in the middle. */
    size_t cut = len < 200000 ? len : 200000;
    while (cut > 0 && text[cut - 1] != '\n') cut--;
    char *slice = mq_asprintf("%.*s<|endoftext|>%.*s", (int)(cut / 2), text, (int)(cut - cut / 2),
                              text + cut / 2);
    size_t slen = strlen(slice);
    ref_tok r;
    memset(&r, 0, sizeof r);
    ref_load(&r, fixture_tokenizer());
    size_t n_ref = 0, n = 0;
    int32_t *expect = ref_encode(&r, slice, slen, &n_ref);
    int32_t *ids = NULL;
    ASSERT_OK(moeq_tokenizer_encode(tok, slice, slen, &ids, &n));
    assert_ids(what, expect, n_ref, ids, n);
    ASSERT_TRUE(n > slen / 8);   /* sanity: a 4096-token vocabulary on English prose */
    ref_free(&r);
    free(expect);
    free(ids);
    free(slice);
    free(text);
    moeq_tokenizer_free(tok);
}

static void test_matches_slow_reference_on_wikitext(void) {
    matches_slow_reference(mq_test_shared("fixtures/text/wikitext2_test.txt"),
                           "wikitext slice vs slow reference");
}

static void test_matches_slow_reference_on_demo_text(void) {
    matches_slow_reference(mq_test_repo("data/demo-calib.txt"), "demo-calib.txt vs slow reference");
    matches_slow_reference(mq_test_repo("data/demo-eval.txt"), "demo-eval.txt vs slow reference");
}

/* encode -> decode gives the text back byte for byte; min_len guards against a wrong file. */
static void round_trip(const char *path, size_t min_len) {
    char *text = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(path, &text, &len));
    ASSERT_TRUE(len > min_len);
    moeq_tokenizer *tok = load_fixture();
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, text, len, &ids, &n));
    char *back = NULL;
    size_t blen = 0;
    ASSERT_OK(moeq_tokenizer_decode(tok, ids, n, &back, &blen));
    ASSERT_EQ_INT(len, blen);
    for (size_t i = 0; i < len; i++)
        if (back[i] != text[i]) FAIL("round trip differs at byte %zu", i);
    free(back);
    free(ids);
    free(text);
    moeq_tokenizer_free(tok);
}

static void test_wikitext_round_trip(void) {
    round_trip(mq_test_shared("fixtures/text/wikitext2_test.txt"), 1000000);
}

static void test_demo_text_round_trip(void) {
    round_trip(mq_test_repo("data/demo-calib.txt"), 40000);
    round_trip(mq_test_repo("data/demo-eval.txt"), 10000);
}

/* ---- hand-built tokenizer.json files ---------------------------------------------------------- */

static const char *write_file(const char *dir, const char *name, const char *content) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    ASSERT_OK(mq_write_file_atomic(path, content, strlen(content)));
    return path;
}

/* Vocabulary of a few alphabet characters and merges; Ġ is the space byte, Ċ the newline. */
#define SMALL_VOCAB                                                                                \
    "\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"Ġ\":3,\"ab\":4,\"abc\":5,\"Ġa\":6,\"<m>\":7,\"bc\":8,"   \
    "\"Ċ\":9,\"x\":10,\"y\":11,\"xy\":12,\"yy\":13,\"ca\":14}"

static moeq_tokenizer *load_text(const char *dir, const char *json) {
    return mq_test_tokenizer(write_file(dir, "tokenizer.json", json));
}

/* Legacy "a b" merges, add_prefix_space, and added tokens with lstrip/rstrip/single_word. */
static void test_small_tokenizer_added_token_flags(void) {
    const char *dir = mq_test_tmpdir();
    moeq_tokenizer *tok = load_text(dir,
        "{\"version\":\"1.0\",\"added_tokens\":["
        "{\"id\":7,\"content\":\"<m>\",\"single_word\":false,\"lstrip\":true,\"rstrip\":true,"
        "\"normalized\":false,\"special\":true},"
        "{\"id\":13,\"content\":\"yy\",\"single_word\":true,\"lstrip\":false,\"rstrip\":false,"
        "\"normalized\":true,\"special\":false}],"
        "\"normalizer\":null,"
        "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"use_regex\":true},"
        "\"decoder\":{\"type\":\"ByteLevel\"},"
        "\"model\":{\"type\":\"BPE\"," SMALL_VOCAB ","
        "\"merges\":[\"a b\",\"ab c\",\"Ġ a\",\"b c\",\"x y\"]}}");
    ASSERT_EQ_INT(15, moeq_tokenizer_vocab_size(tok));
    ASSERT_EQ_INT(-1, moeq_tokenizer_bos(tok));   /* no tokenizer_config.json / config.json */
    ASSERT_EQ_INT(-1, moeq_tokenizer_eos(tok));
    int32_t *ids = NULL;
    size_t n = 0;
    struct {
        const char *text;
        int32_t ids[8];
        size_t n;
    } cases[] = {
        /* Prefix space makes " abc": ab (rank 0) merges before Ġa (rank 2), then abc. */
        {"abc", {3, 5}, 2},
        {"bc", {3, 8}, 2},
        /* <m> takes the spaces around it; each remaining piece gets its own prefix space. */
        {"a <m> b", {6, 7, 3, 1}, 4},
        {"a<m>b", {6, 7, 3, 1}, 4},
        /* single_word: "yy" only when no word character touches it. */
        {"yy", {13}, 1},
        {"ayy", {6, 11, 11}, 3},
        {"yy.", {13, 3}, 2},      /* '.' is no word char but it is not in this vocabulary */
        {"xy", {3, 12}, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ASSERT_OK(moeq_tokenizer_encode(tok, cases[i].text, strlen(cases[i].text), &ids, &n));
        assert_ids(cases[i].text, cases[i].ids, cases[i].n, ids, n);
        free(ids);
    }
    char *text = NULL;
    ASSERT_OK(moeq_tokenizer_decode(tok, (const int32_t[]){6, 7, 3, 1}, 4, &text, NULL));
    ASSERT_EQ_STR(" a<m> b", text);
    free(text);
    moeq_tokenizer_free(tok);

    /* bos/eos from tokenizer_config.json (object and string forms). */
    write_file(dir, "tokenizer_config.json",
               "{\"bos_token\":{\"content\":\"<m>\",\"lstrip\":false},\"eos_token\":\"abc\"}");
    tok = load_text(dir, "{\"added_tokens\":[{\"id\":7,\"content\":\"<m>\",\"normalized\":false}],"
                         "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"decoder\":{\"type\":\"ByteLevel\"},"
                         "\"model\":{\"type\":\"BPE\"," SMALL_VOCAB ",\"merges\":[]}}");
    ASSERT_EQ_INT(7, moeq_tokenizer_bos(tok));
    ASSERT_EQ_INT(5, moeq_tokenizer_eos(tok));
    moeq_tokenizer_free(tok);
}

/* Llama-3 / Qwen layout: Sequence[Split, ByteLevel(use_regex false)], pair merges, ignore_merges. */
static void test_small_tokenizer_sequence_split(void) {
    const char *dir = mq_test_tmpdir();
    write_file(dir, "config.json", "{\"bos_token_id\":1,\"eos_token_id\":[2,3]}");
    moeq_tokenizer *tok = load_text(dir,
        "{\"added_tokens\":[],\"normalizer\":null,"
        "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":["
        "{\"type\":\"Split\",\"pattern\":{\"Regex\":\" ?[a-c]+|[^a-c]+\"},\"behavior\":\"Isolated\","
        "\"invert\":false},"
        "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":false,\"use_regex\":false}]},"
        "\"decoder\":{\"type\":\"ByteLevel\"},"
        "\"model\":{\"type\":\"BPE\",\"ignore_merges\":true," SMALL_VOCAB ","
        "\"merges\":[[\"a\",\"b\"],[\"ab\",\"c\"],[\"Ġ\",\"a\"],[\"b\",\"c\"],[\"x\",\"y\"]]}}");
    ASSERT_EQ_INT(1, moeq_tokenizer_bos(tok));   /* from config.json */
    ASSERT_EQ_INT(2, moeq_tokenizer_eos(tok));
    struct {
        const char *text;
        int32_t ids[8];
        size_t n;
    } cases[] = {
        /* "ca" is a vocabulary word that no merge builds: ignore_merges takes it whole. */
        {"ca ab", {14, 3, 4}, 3},
        /* Without a regex at the ByteLevel stage, "xy\n" is one piece: x y merge, then Ċ. */
        {"xy\n", {12, 9}, 2},
        {"abcab", {5, 4}, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        ASSERT_OK(moeq_tokenizer_encode(tok, cases[i].text, strlen(cases[i].text), &ids, &n));
        assert_ids(cases[i].text, cases[i].ids, cases[i].n, ids, n);
        free(ids);
    }
    moeq_tokenizer_free(tok);
}

static void test_load_errors(void) {
    const char *dir = mq_test_tmpdir();
    moeq_tokenizer *tok = (moeq_tokenizer *)1;
    char missing[1024];
    snprintf(missing, sizeof missing, "%s/nope/tokenizer.json", dir);
    ASSERT_STATUS(MOEQ_E_IO, moeq_tokenizer_load(missing, &tok));
    ASSERT_ERROR_MENTIONS(missing);
    ASSERT_TRUE(tok == NULL);

    static const struct {
        const char *json;
        moeq_status st;
        const char *mentions;
    } bad[] = {
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}", MOEQ_E_FORMAT, "not valid JSON"},
        {"[1, 2]", MOEQ_E_FORMAT, "not a JSON object"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"decoder\":{\"type\":\"ByteLevel\"},"
         "\"model\":{\"type\":\"Unigram\",\"vocab\":[[\"a\",0.0]]}}",
         MOEQ_E_UNSUPPORTED, "model.type 'Unigram'"},
        {"{\"pre_tokenizer\":{\"type\":\"Metaspace\",\"replacement\":\"_\"},"
         "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
         "\"merges\":[]}}",
         MOEQ_E_UNSUPPORTED, "pre_tokenizer.type 'Metaspace'"},
        {"{\"normalizer\":{\"type\":\"NFKC\"},\"pre_tokenizer\":{\"type\":\"ByteLevel\"},"
         "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
         "\"merges\":[]}}",
         MOEQ_E_UNSUPPORTED, "normalizer.type 'NFKC'"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"decoder\":{\"type\":\"Sequence\"},"
         "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
         MOEQ_E_UNSUPPORTED, "decoder.type 'Sequence'"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"decoder\":{\"type\":\"ByteLevel\"},"
         "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a b\"]}}",
         MOEQ_E_FORMAT, "model.merges[0]: token 'ab' is not in the vocabulary"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"decoder\":{\"type\":\"ByteLevel\"},"
         "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-3},\"merges\":[]}}",
         MOEQ_E_FORMAT, "model.vocab['a']"},
        {"{\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\","
         "\"pattern\":{\"Regex\":\"(unclosed\"},\"behavior\":\"Isolated\"},{\"type\":\"ByteLevel\"}]},"
         "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
         "\"merges\":[]}}",
         MOEQ_E_UNSUPPORTED, "pre_tokenizer.pretokenizers[0]: regex"},
        {"{\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\"},"
         "{\"type\":\"ByteLevel\"}]},\"decoder\":{\"type\":\"ByteLevel\"},"
         "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
         MOEQ_E_UNSUPPORTED, "pre_tokenizer.pretokenizers[0].type 'Digits'"},
        {"{\"added_tokens\":[{\"id\":\"x\",\"content\":\"<s>\"}],\"pre_tokenizer\":{\"type\":\"ByteLevel\"},"
         "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
         "\"merges\":[]}}",
         MOEQ_E_FORMAT, "added_tokens[0].id"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *path = write_file(dir, "tokenizer.json", bad[i].json);
        tok = (moeq_tokenizer *)1;
        ASSERT_STATUS(bad[i].st, moeq_tokenizer_load(path, &tok));
        ASSERT_TRUE(tok == NULL);
        ASSERT_ERROR_MENTIONS(path);
        ASSERT_ERROR_MENTIONS(bad[i].mentions);
    }
    /* A corrupt tokenizer_config.json next to a good tokenizer.json is reported by name. */
    write_file(dir, "tokenizer.json",
               "{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"decoder\":{\"type\":\"ByteLevel\"},"
               "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}");
    const char *cfg = write_file(dir, "tokenizer_config.json", "{\"bos_token\": ");
    char cfg_path[1024];
    snprintf(cfg_path, sizeof cfg_path, "%s", cfg);
    char tj[1024];
    snprintf(tj, sizeof tj, "%s/tokenizer.json", dir);
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_tokenizer_load(tj, &tok));
    ASSERT_ERROR_MENTIONS(cfg_path);
}

/* ---- NFC (Qwen2/Qwen3 normalizer); expected forms from Python's unicodedata.normalize ----------- */

static void test_nfc_unit(void) {
    static const struct {
        const char *in, *nfc;
    } cases[] = {
        {"e\xcc\x81", "\xc3\xa9"},                                    /* e + acute -> é */
        {"\xe1\xb8\x8b\xcc\xa3", "\xe1\xb8\x8d\xcc\x87"},             /* reorder, then compose */
        {"\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", "\xea\xb0\x81"},     /* Hangul L V T */
        {"\xea\xb0\x80\xe1\x86\xa8", "\xea\xb0\x81"},                 /* Hangul LV + T */
        {"\xe2\x84\xab", "\xc3\x85"},                                 /* singleton Å (U+212B) */
        {"\xe2\x84\xa6", "\xce\xa9"},                                 /* Ohm -> Omega */
        {"\xe0\xa5\x98", "\xe0\xa4\x95\xe0\xa4\xbc"},                 /* excluded from composition */
        {"a\xcc\xa8\xcc\x81", "\xc4\x85\xcc\x81"},                    /* ogonek composes first */
        {"a\xcc\x81\xcc\xa8", "\xc4\x85\xcc\x81"},
        {"\xcc\x81" "e", "\xcc\x81" "e"},                             /* leading mark stays */
        {"\xcd\x84", "\xcc\x88\xcc\x81"},                             /* non-starter decomposition */
        {"\xe1\xbe\x82", "\xe1\xbe\x82"},                             /* already composed */
        {"A\xcc\x8a\xcc\x81x\xcc\x80\xcc\x80", "\xc7\xbax\xcc\x80\xcc\x80"},   /* blocked 2nd grave */
        {"plain ASCII", "plain ASCII"},
        /* Only the spans around marks are rewritten; the starter before a mark takes part. */
        {"xe\xcc\x81y", "x\xc3\xa9y"},
        {"\xc3\xa9\xcc\xa3!", "\xe1\xba\xb9\xcc\x81!"},                  /* é + dot below */
        {"ok \xe1\x84\x80\xe1\x85\xa1 \xcc\x81", "ok \xea\xb0\x80 \xcc\x81"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        size_t n = 0;
        ASSERT_OK(mq_nfc(cases[i].in, strlen(cases[i].in), &out, &n));
        ASSERT_EQ_INT(strlen(cases[i].nfc), n);
        ASSERT_EQ_STR(cases[i].nfc, out);
        free(out);
    }
    ASSERT_TRUE(mq_nfc_quick_yes("caf\xc3\xa9 \xe6\x97\xa5", 9));   /* café 日 */
    ASSERT_FALSE(mq_nfc_quick_yes("e\xcc\x81", 3));
    ASSERT_FALSE(mq_nfc_quick_yes("\xe2\x84\xab", 3));
}

/* Writes the fixture tokenizer.json with `normalizer` replaced; returns its path. */
static const char *fixture_with_normalizer(const char *normalizer_json) {
    char *json = NULL;
    ASSERT_OK(mq_read_file(fixture_tokenizer(), &json, NULL));
    cJSON *root = cJSON_Parse(json);
    cJSON_ReplaceItemInObject(root, "normalizer", cJSON_Parse(normalizer_json));
    char *text = cJSON_PrintUnformatted(root);
    const char *path = write_file(mq_test_tmpdir(), "tokenizer.json", text);
    free(text);
    cJSON_Delete(root);
    free(json);
    return path;
}

static void test_nfc_normalizer(void) {
    moeq_tokenizer *plain = load_fixture(), *nfc = NULL;
    ASSERT_OK(moeq_tokenizer_load(fixture_with_normalizer("{\"type\":\"NFC\"}"), &nfc));
    /* Decomposed input encodes as its composed form; specials still cut the text first. */
    const char *in = "Cafe\xcc\x81<|endoftext|>\xe2\x84\xab ok", *composed = "Caf\xc3\xa9<|endoftext|>\xc3\x85 ok";
    int32_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    ASSERT_OK(moeq_tokenizer_encode(nfc, in, strlen(in), &a, &na));
    ASSERT_OK(moeq_tokenizer_encode(plain, composed, strlen(composed), &b, &nb));
    assert_ids("NFC input", b, nb, a, na);
    free(a);
    free(b);
    /* wikitext is already NFC (it holds combining marks, so the slow path runs): same ids.
     * (Only with the shared folder: the bundled text has no combining marks.) */
    if (mq_test_have_shared()) {
        char *text = NULL;
        size_t len = 0;
        ASSERT_OK(mq_read_file(mq_test_shared("fixtures/text/wikitext2_test.txt"), &text, &len));
        ASSERT_FALSE(mq_nfc_quick_yes(text, len));
        ASSERT_OK(moeq_tokenizer_encode(nfc, text, len, &a, &na));
        ASSERT_OK(moeq_tokenizer_encode(plain, text, len, &b, &nb));
        assert_ids("wikitext with NFC", b, nb, a, na);
        free(a);
        free(b);
        free(text);
    }
    moeq_tokenizer_free(nfc);
    /* Sequence of NFC loads; anything else in a Sequence is named. */
    ASSERT_OK(moeq_tokenizer_load(
        fixture_with_normalizer("{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"}]}"), &nfc));
    moeq_tokenizer_free(nfc);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_tokenizer_load(
        fixture_with_normalizer("{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"},"
                                "{\"type\":\"Lowercase\"}]}"), &nfc));
    ASSERT_ERROR_MENTIONS("normalizer.normalizers[1].type 'Lowercase'");
    moeq_tokenizer_free(plain);
}

TEST_MAIN(T(test_golden_ids), T(test_fixture_metadata), T(test_hand_cases), T(test_invalid_utf8),
          T(test_decode_lossy_and_errors), T(test_matches_slow_reference_on_wikitext),
          T(test_wikitext_round_trip), T(test_matches_slow_reference_on_demo_text),
          T(test_demo_text_round_trip), T(test_small_tokenizer_added_token_flags),
          T(test_small_tokenizer_sequence_split), T(test_load_errors), T(test_nfc_unit),
          T(test_nfc_normalizer))
