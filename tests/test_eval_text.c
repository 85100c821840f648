/* Text side of the wikitext protocol: documents, the lm-eval detokenizer, word/byte counts, UTF-8.
 * References: the shared fixtures (detokenizer output and word counts made by Python with lm-eval's
 * preprocess_wikitext, per-document words/bytes of reference.json) and hand cases whose expected
 * strings were produced by running lm-eval's detokenizer in CPython. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/core.h"
#include "eval/eval.h"
#include "harness.h"

static cJSON *load_json(const char *path) {
    char *buf = NULL;
    size_t len = 0;
    ASSERT_OK(mq_read_file(path, &buf, &len));
    cJSON *j = cJSON_ParseWithLength(buf, len);
    free(buf);
    if (!j) FAIL("%s: not JSON", path);
    return j;
}

static void test_detok_matches_lm_eval_on_fixture_pages(void) {
    cJSON *j = load_json(mq_test_shared("fixtures/wikitext2_detok_check.json"));
    moeq_docs *d = mq_test_wikitext_docs();
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, j) {
        const char *page = cJSON_GetObjectItem(e, "page")->valuestring;
        const char *want = cJSON_GetObjectItem(e, "detok")->valuestring;
        size_t len = 0;
        const char *ours = moeq_docs_text(d, i, &len);
        /* our split of the text file gives the same pages */
        ASSERT_EQ_INT(strlen(page), len);
        ASSERT_TRUE(memcmp(ours, page, len) == 0);
        char *out = NULL;
        size_t out_len = 0;
        ASSERT_OK(moeq_wikitext_detokenize(page, strlen(page), &out, &out_len));
        ASSERT_EQ_INT(strlen(want), out_len);
        if (strcmp(out, want) != 0) {
            size_t k = 0;
            while (out[k] == want[k]) k++;
            FAIL("page %d differs at byte %zu: got \"%.40s\" want \"%.40s\"", i, k, out + k,
                 want + k);
        }
        ASSERT_EQ_INT(cJSON_GetObjectItem(e, "words")->valueint,
                      moeq_count_words(page, strlen(page)));
        free(out);
        i++;
    }
    ASSERT_EQ_INT(5, i);
    moeq_docs_free(d);
    cJSON_Delete(j);
}

static void test_wikitext_documents_words_bytes_match_reference(void) {
    cJSON *j = load_json(mq_test_shared("fixtures/reference.json"));
    const cJSON *fp = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "olmoe-tiny"), "wikitext_fp32");
    const cJSON *per_doc = cJSON_GetObjectItem(fp, "per_doc");
    moeq_docs *d = mq_test_wikitext_docs();
    ASSERT_EQ_INT(62, moeq_docs_count(d));
    ASSERT_EQ_INT(cJSON_GetArraySize(per_doc), moeq_docs_count(d));
    int64_t words = 0, bytes = 0;
    for (int64_t i = 0; i < moeq_docs_count(d); i++) {
        size_t len = 0;
        const char *t = moeq_docs_text(d, i, &len);
        const cJSON *r = cJSON_GetArrayItem(per_doc, (int)i);
        ASSERT_EQ_INT(cJSON_GetObjectItem(r, "bytes")->valuedouble, len);
        ASSERT_EQ_INT(cJSON_GetObjectItem(r, "words")->valuedouble, moeq_count_words(t, len));
        ASSERT_TRUE(len > 0 && t[len - 1] == '\n'); /* every page ends with one newline */
        words += moeq_count_words(t, len);
        bytes += (int64_t)len;
    }
    ASSERT_EQ_INT(cJSON_GetObjectItem(fp, "words")->valuedouble, words);
    ASSERT_EQ_INT(cJSON_GetObjectItem(fp, "bytes")->valuedouble, bytes);
    moeq_docs_free(d);
    cJSON_Delete(j);
}

/* Expected outputs from CPython running preprocess_wikitext.wikitext_detokenizer. */
static void test_detok_regex_semantics(void) {
    static const char *const cases[][2] = {
        {"( a ( b ) c )", "(a ( b) c )"}, /* inner may hold an opener; ends at 1st ')' */
        {"x ( unclosed", "x ( unclosed"},
        {"( \n multi \n line \n ) end", "(multi\nline) end"}, /* spans newlines */
        {"(\xc2\xa0nbsp\xe3\x80\x80)", "(nbsp)"},             /* U+00A0, U+3000 are \s */
        {"(\xe2\x80\x8b zw \xe2\x80\x8b)", "(\xe2\x80\x8b zw \xe2\x80\x8b)"}, /* U+200B is not */
        {"\" a \" b \" c", "\"a\" b \" c"},
        {"' it ' s ' ok '", "'it' s'ok'"},
        {"path /' 5/ and /' x/", "path /'[0-9]/ and /' x/"}, /* literal replacement text */
        {"the dogs ' bones", "the dogs' bones"},
        {"a @-@ b @,@ c @.@ d", "a-b,c.d"},
        {"= = = = H = = = =", "==== H ===="},
        {"= = = H = = =", "=== H ==="},
        {"10 \xc2\xb0 C", "10\xc2\xb0"
                          "C"},
        {"line \n next", "line\nnext"},
        {"a N b", "a 1 b"},
        {"John 's", "John's"},
        {"( )", "()"},
        {"(   )x", "()x"},
        {"[ a ] { b } ( c )", "[a] {b} (c)"},
        {"\"\"", "\"\""},
        {"'''", "'''"},
        {" , . ; : ! ? ", " ,. ;:!? "},
        {"( a \xc2\x85)", "(a)"},
        {"( \x1c a \x1f )", "(a)"},
        {"\xe2\x80\xa8( a \xe2\x80\xa9)", "\xe2\x80\xa8(a)"},
        {"", ""},
        {"s ' s '", "s's'"},
        {"{ x [ y ) ] }", "{x [y )]}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        size_t n = 0;
        ASSERT_OK(moeq_wikitext_detokenize(cases[i][0], strlen(cases[i][0]), &out, &n));
        if (strcmp(out, cases[i][1]) != 0 || n != strlen(cases[i][1]))
            FAIL("case %zu \"%s\": got \"%s\", want \"%s\"", i, cases[i][0], out, cases[i][1]);
        free(out);
    }
}

static void test_word_count_python_whitespace(void) {
    static const struct {
        const char *s;
        int64_t words;
    } cases[] = {
        {"", 1},
        {" ", 2},
        {"a", 1},
        {"a b", 2},
        {" a ", 3},
        {"a \t\n b", 2},
        {"a\xc2\xa0"
         "b",
         2}, /* U+00A0 */
        {"a\xe3\x80\x80"
         "b\xe2\x80\x8a"
         "c",
         3}, /* U+3000, U+200A */
        {"a\xe2\x80\x8b"
         "b",
         1}, /* U+200B zero width space: not whitespace */
        {"a\x1c"
         "b\x1f"
         "c\x0b"
         "d",
         4}, /* \x1c-\x1f and \v */
        {"a\xc2\x85"
         "b",
         2}, /* U+0085 */
        {"a\xe1\x9a\x80"
         "b\xe2\x81\x9f"
         "c",
         3}, /* U+1680, U+205F */
        {"a\xe2\x80\xaf"
         "b\xe2\x80\xa8"
         "c\xe2\x80\xa9",
         4}, /* U+202F, U+2028, U+2029 */
        {"\xc3\xa9t\xc3\xa9 x", 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (moeq_count_words(cases[i].s, strlen(cases[i].s)) != cases[i].words)
            FAIL("case %zu: got %lld words, want %lld", i,
                 (long long)moeq_count_words(cases[i].s, strlen(cases[i].s)),
                 (long long)cases[i].words);
}

static void test_py_isspace_table(void) {
    /* The full set of code points with str.isspace() in CPython (29 of them). */
    static const uint32_t spaces[] = {
        0x9,    0xa,    0xb,    0xc,    0xd,    0x1c,   0x1d,   0x1e,   0x1f,   0x20,
        0x85,   0xa0,   0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006,
        0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000};
    size_t k = 0, count = 0;
    for (uint32_t c = 0; c < 0x110000; c++) {
        bool want = k < sizeof spaces / sizeof spaces[0] && spaces[k] == c;
        if (want) k++;
        if (mq_py_isspace(c) != want)
            FAIL("U+%04X: isspace %d, want %d", c, mq_py_isspace(c), want);
        count += want;
    }
    ASSERT_EQ_INT(29, count);
}

static void test_utf8_validation(void) {
    static const struct {
        const char *s;
        size_t bad; /* (size_t)-1: valid */
    } cases[] = {
        {"plain", (size_t)-1},
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", (size_t)-1},
        {"ab\x80", 2},           /* stray continuation byte */
        {"a\xc0\xaf", 1},        /* overlong '/' */
        {"a\xe0\x80\xaf", 1},    /* overlong, 3 bytes */
        {"xy\xed\xa0\x80", 2},   /* UTF-16 surrogate U+D800 */
        {"\xf4\x90\x80\x80", 0}, /* above U+10FFFF */
        {"ok\xe2\x82", 2},       /* truncated at the end */
        {"\xc3(", 0},            /* bad continuation */
        {"\xf5\x80\x80\x80", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t bad = 12345;
        bool ok = mq_utf8_valid(cases[i].s, strlen(cases[i].s), &bad);
        ASSERT_EQ_INT(cases[i].bad == (size_t)-1, ok);
        if (!ok) ASSERT_EQ_INT(cases[i].bad, bad);
    }
}

static void test_docs_layouts(void) {
    moeq_docs *d = NULL;
    const char *wt =
        " = A = \n text a \n = = Section = = \n more\n = National record \n = B = \n b\n";
    ASSERT_OK(moeq_docs_parse("wt.txt", wt, strlen(wt), MOEQ_DOCS_WIKITEXT, &d));
    ASSERT_EQ_INT(2, moeq_docs_count(d));
    ASSERT_EQ_STR(" = A = \n text a \n = = Section = = \n more\n = National record \n",
                  moeq_docs_text(d, 0, NULL));
    ASSERT_EQ_STR(" = B = \n b\n", moeq_docs_text(d, 1, NULL));
    ASSERT_TRUE(moeq_docs_text(d, 2, NULL) == NULL);
    moeq_docs_free(d);

    const char *lead = "preamble\n = T = \nbody"; /* text before the first title, no final \n */
    ASSERT_OK(moeq_docs_parse("lead.txt", lead, strlen(lead), MOEQ_DOCS_WIKITEXT, &d));
    ASSERT_EQ_INT(2, moeq_docs_count(d));
    ASSERT_EQ_STR("preamble\n", moeq_docs_text(d, 0, NULL));
    ASSERT_EQ_STR(" = T = \nbody", moeq_docs_text(d, 1, NULL));
    moeq_docs_free(d);

    const char *jl =
        "{\"page\": \"p1 \\u00e9\\n\", \"text\": \"ignored\"}\n\n  \n{\"text\": \"t2\"}";
    ASSERT_OK(moeq_docs_parse("d.jsonl", jl, strlen(jl), MOEQ_DOCS_JSONL, &d));
    ASSERT_EQ_INT(2, moeq_docs_count(d));
    size_t len = 0;
    ASSERT_EQ_STR("p1 \xc3\xa9\n", moeq_docs_text(d, 0, &len));
    ASSERT_EQ_INT(6, len);
    ASSERT_EQ_STR("t2", moeq_docs_text(d, 1, NULL));
    moeq_docs_free(d);

    ASSERT_OK(moeq_docs_parse("w.txt", wt, strlen(wt), MOEQ_DOCS_WHOLE, &d));
    ASSERT_EQ_INT(1, moeq_docs_count(d));
    ASSERT_EQ_STR(wt, moeq_docs_text(d, 0, NULL));
    moeq_docs_free(d);
}

static void test_docs_errors(void) {
    moeq_docs *d = NULL;
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_docs_parse("empty.txt", "", 0, MOEQ_DOCS_WIKITEXT, &d));
    ASSERT_ERROR_MENTIONS("empty.txt");
    ASSERT_ERROR_MENTIONS("empty");
    ASSERT_TRUE(d == NULL);
    const char bad[] = " = A = \nab\xff"
                       "cd\n";
    ASSERT_STATUS(MOEQ_E_FORMAT,
                  moeq_docs_parse("bad.txt", bad, sizeof bad - 1, MOEQ_DOCS_WHOLE, &d));
    ASSERT_ERROR_MENTIONS("bad.txt: invalid UTF-8 at byte offset 10");
    const char *jl = "{\"page\": \"ok\"}\n{\"page\": 3}\n";
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_docs_parse("d.jsonl", jl, strlen(jl), MOEQ_DOCS_JSONL, &d));
    ASSERT_ERROR_MENTIONS("d.jsonl:2");
    jl = "{\"page\": \"ok\"}\nnot json\n";
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_docs_parse("d.jsonl", jl, strlen(jl), MOEQ_DOCS_JSONL, &d));
    ASSERT_ERROR_MENTIONS("d.jsonl:2: not a JSON object");
    jl = "\n \n";
    ASSERT_STATUS(MOEQ_E_FORMAT,
                  moeq_docs_parse("blank.jsonl", jl, strlen(jl), MOEQ_DOCS_JSONL, &d));
    ASSERT_ERROR_MENTIONS("blank.jsonl: no documents");
    jl = "{\"text\": \"\\ud800\"}\n"; /* a lone surrogate escape cannot become UTF-8 */
    ASSERT_TRUE(moeq_docs_parse("s.jsonl", jl, strlen(jl), MOEQ_DOCS_JSONL, &d) != MOEQ_OK);
    ASSERT_ERROR_MENTIONS("s.jsonl:1");
    ASSERT_STATUS(MOEQ_E_IO, moeq_docs_load("/nonexistent/file.txt", MOEQ_DOCS_WIKITEXT, &d));
    ASSERT_ERROR_MENTIONS("/nonexistent/file.txt");
}

/* The option table (src/eval/eval_options.def) is what moeq_eval_options_set takes: every key
 * moeq_eval_option_info lists is accepted with a value of its kind and shows in the settings'
 * JSON; a value it does not take names the key; the defaults are the table's. */
static void test_eval_option_table(void) {
    moeq_eval_options o;
    int n = 0;
    char buf[64], key[64];
    for (const moeq_option_info *x; (x = moeq_eval_option_info(n)); n++) {
        ASSERT_TRUE(x->key && x->help && *x->help && !x->identity);
        ASSERT_TRUE((x->kind == MOEQ_OPTION_CHOICE) == (x->choices != NULL));
        const char *v = "x.bin";
        if (x->kind == MOEQ_OPTION_SWITCH) v = "true";
        if (x->kind == MOEQ_OPTION_NUMBER) v = "1.5";
        if (x->kind == MOEQ_OPTION_INT) snprintf(buf, sizeof buf, "%lld", (long long)x->max), v = buf;
        if (x->kind == MOEQ_OPTION_CHOICE) v = strrchr(x->choices, '|') + 1;
        if (!strcmp(x->key, "device")) v = "cuda:3";
        if (!strcmp(x->key, "max-memory") || !strcmp(x->key, "max-gpu-memory")) v = "2GiB";
        moeq_eval_options_init(&o);
        if (moeq_eval_options_set(&o, x->key, v)) FAIL("%s=%s: %s", x->key, v, moeq_last_error());
        char *j = moeq_eval_settings_json(&o);
        cJSON *js = cJSON_Parse(j);
        moeq_string_free(j);
        snprintf(key, sizeof key, "%s", x->key);
        for (char *c = key; *c; c++) *c = *c == '-' ? '_' : *c;
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(js, key);
        if (!e) FAIL("settings: no %s", key);
        /* the value set is the value recorded */
        if (cJSON_IsString(e) && strcmp(e->valuestring, v)) FAIL("settings %s: %s, set %s", key, e->valuestring, v);
        if (cJSON_IsBool(e) && !cJSON_IsTrue(e)) FAIL("settings %s: false, set true", key);
        if (cJSON_IsNumber(e) && x->kind != MOEQ_OPTION_TEXT && e->valuedouble != strtod(v, NULL))
            FAIL("settings %s: %g, set %s", key, e->valuedouble, v);
        ASSERT_TRUE(cJSON_GetArraySize(js) >= 16);
        cJSON_Delete(js);
        if (x->kind != MOEQ_OPTION_SWITCH && x->kind != MOEQ_OPTION_TEXT) {
            ASSERT_STATUS(MOEQ_E_ARG, moeq_eval_options_set(&o, x->key, "-x-"));
            snprintf(buf, sizeof buf, "%s=-x-: expected ", x->key);
            if (!strstr(moeq_last_error(), buf)) FAIL("%s: message '%s'", x->key, moeq_last_error());
        }
    }
    ASSERT_TRUE(n >= 16);
    ASSERT_TRUE(moeq_eval_option_info(-1) == NULL && moeq_eval_option_info(n) == NULL);
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval_options_set(&o, "bogus", "1"));
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval_options_set(&o, "temperature", "0"));
    ASSERT_STATUS(MOEQ_E_ARG, moeq_eval_options_set(&o, "max-memory", "lots"));
    ASSERT_ERROR_MENTIONS("max-memory=lots: expected a size");
    moeq_eval_options_init(&o);
    ASSERT_TRUE(o.task == MOEQ_TASK_WIKITEXT && o.device == -1 && o.prefix_token == -1 && o.temperature == 1);
    ASSERT_TRUE(o.save_top_k == MOEQ_EVAL_DEFAULT_TOP_K && o.max_length == 0 && o.gpu_precision == MOEQ_GPU_FP32);
}

TEST_MAIN(T(test_eval_option_table), T(test_detok_matches_lm_eval_on_fixture_pages),
          T(test_wikitext_documents_words_bytes_match_reference), T(test_detok_regex_semantics),
          T(test_word_count_python_whitespace), T(test_py_isspace_table), T(test_utf8_validation),
          T(test_docs_layouts), T(test_docs_errors))
