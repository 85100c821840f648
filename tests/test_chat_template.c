/*
 * Chat templates: moeq's renderer against jinja2 as transformers configures it, byte for byte
 * (tests/data/chat_goldens.json from scripts/gen_chat_goldens.py: the real templates of the
 * families moeq reads, with system/user/assistant turns, multi-turn, tools, thinking and
 * add_generation_prompt on and off, and a template of the remaining constructs); the errors
 * (syntax, unsupported constructs, raise_exception) naming the template line; loading a model's
 * template from tokenizer_config.json (a string or named templates), chat_template.jinja and a
 * GGUF file, with its special tokens.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "core/core.h"
#include "harness.h"
#include "io/gguf.h"

static char *slurp_repo(const char *rel, size_t *n) { return mq_test_slurp(mq_test_repo(rel), n); }

static void goldens(void) {
    size_t n;
    char *text = slurp_repo("tests/data/chat_goldens.json", &n);
    ASSERT_TRUE(text != NULL);
    cJSON *doc = cJSON_ParseWithLength(text, n);
    ASSERT_TRUE(doc != NULL);
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(doc, "cases"), *c;
    int total = 0, errors = 0, families = 0;
    char last[256] = "";
    moeq_chat_template *t = NULL;
    cJSON_ArrayForEach(c, cases) {
        const char *tname = cJSON_GetObjectItemCaseSensitive(c, "template")->valuestring;
        const char *cname = cJSON_GetObjectItemCaseSensitive(c, "case")->valuestring;
        const char *vars = cJSON_GetObjectItemCaseSensitive(c, "vars_json")->valuestring;
        const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, "output"), *err = cJSON_GetObjectItemCaseSensitive(c, "error");
        int agp = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt"));
        if (strcmp(last, tname) != 0) {
            moeq_chat_template_free(t);
            char rel[300];
            snprintf(rel, sizeof rel, "tests/data/chat_templates/%s", tname);
            size_t tl;
            char *tt = slurp_repo(rel, &tl);
            ASSERT_TRUE(tt != NULL);
            ASSERT_OK(moeq_chat_template_parse(tname, tt, tl, &t));
            free(tt);
            snprintf(last, sizeof last, "%s", tname);
            families++;
        }
        char *out = NULL;
        size_t out_len = 0;
        moeq_status st = moeq_chat_template_render(t, vars, strlen(vars), &out, &out_len);
        if (cJSON_IsString(err)) {
            /* jinja2 failed: so must moeq, with the template's message */
            if (st != MOEQ_E_ARG) FAIL("%s %s agp=%d: expected MOEQ_E_ARG (%s), got %s", tname, cname, agp, err->valuestring, moeq_status_name(st));
            const char *colon = strstr(err->valuestring, ": ");
            ASSERT_TRUE(colon != NULL);
            ASSERT_ERROR_MENTIONS(colon + 2);
            ASSERT_ERROR_MENTIONS(tname);
            errors++;
        } else {
            if (st) FAIL("%s %s agp=%d: %s: %s", tname, cname, agp, moeq_status_name(st), moeq_last_error());
            const char *w = want->valuestring;
            size_t wl = strlen(w);
            if (out_len != wl || memcmp(out, w, wl) != 0) {
                size_t i = 0;
                while (i < wl && i < out_len && out[i] == w[i]) i++;
                FAIL("%s %s agp=%d: differs from jinja2 at byte %zu (lengths %zu, %zu):\n--- jinja2 from there:\n%.200s\n--- moeq from there:\n%.200s",
                     tname, cname, agp, i, wl, out_len, w + i, out + i);
            }
        }
        free(out);
        total++;
    }
    moeq_chat_template_free(t);
    cJSON_Delete(doc);
    free(text);
    ASSERT_TRUE(total >= 70);
    ASSERT_TRUE(errors >= 2);
    ASSERT_TRUE(families >= 8);
    printf("  %d cases of %d templates equal jinja2's (%d of them its errors)\n", total, families, errors);
}

/* Each text must fail with st, and the message must name the line and what went wrong. */
static void expect_error(const char *text, moeq_status st, const char *line, const char *what) {
    moeq_chat_template *t = NULL;
    moeq_status s = moeq_chat_template_parse("bad", text, strlen(text), &t);
    if (!s) {
        char *out = NULL;
        size_t n;
        const char *vars = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 3, \"s\": \"x\"}";
        s = moeq_chat_template_render(t, vars, strlen(vars), &out, &n);
        free(out);
        moeq_chat_template_free(t);
    } else {
        ASSERT_TRUE(t == NULL);
    }
    if (s != st) FAIL("%s: expected %s, got %s (%s)", text, moeq_status_name(st), moeq_status_name(s), moeq_last_error());
    ASSERT_ERROR_MENTIONS("chat template bad");
    if (line) ASSERT_ERROR_MENTIONS(line);
    ASSERT_ERROR_MENTIONS(what);
}

static void errors_name_the_line(void) {
    expect_error("a\n{% macro m() %}x{% endmacro %}", MOEQ_E_UNSUPPORTED, "line 2", "'macro'");
    expect_error("{% if x %}\nno end", MOEQ_E_FORMAT, "line 1", "'if' is never closed");
    expect_error("x\n\n{{ messages | frobnicate }}", MOEQ_E_UNSUPPORTED, "line 3", "filter 'frobnicate'");
    expect_error("{{ s.zfill(3) }}", MOEQ_E_UNSUPPORTED, "line 1", "zfill");
    expect_error("{{ 1 +  }}", MOEQ_E_FORMAT, "line 1", "expected an expression");
    expect_error("{{ 1 ", MOEQ_E_FORMAT, "line 1", "not closed");
    expect_error("{% endfor %}", MOEQ_E_FORMAT, "line 1", "unexpected 'endfor'");
    expect_error("{% frob %}", MOEQ_E_FORMAT, "line 1", "unknown statement 'frob'");
    expect_error("\n{{ raise_exception('no ' ~ n) }}", MOEQ_E_ARG, "line 2", "raise_exception: no 3");
    expect_error("{{ nothing.attr }}", MOEQ_E_ARG, "line 1", "undefined");
    expect_error("{{ s + n }}", MOEQ_E_ARG, "line 1", "unsupported operand");
    expect_error("{{ n // 0 }}", MOEQ_E_ARG, "line 1", "by zero");
    expect_error("{{ lipsum() }}", MOEQ_E_UNSUPPORTED, "line 1", "lipsum");
    expect_error("{% set d = {} %}{% set d.x = 1 %}", MOEQ_E_ARG, "line 1", "non-namespace");
    expect_error("{% for i in range(100000000) %}{% endfor %}", MOEQ_E_ARG, "line 1", "range()");
    expect_error("{{ '\\u12' }}", MOEQ_E_FORMAT, "line 1", "escape");
    /* a loop whose output grows past the limit stops with an error, not a crash */
    expect_error("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                 MOEQ_E_NOMEM, NULL, "bytes");
    /* nesting that would run the stack out is refused */
    char deep[2 * 5000 + 16];
    memset(deep, '(', 5000);
    memset(deep + 5000, ')', 5000);
    memcpy(deep, "{{", 2);
    memcpy(deep + 10000 - 2, "}}", 3);
    expect_error(deep, MOEQ_E_UNSUPPORTED, "line 1", "nested deeper");
    static char deep2[10 * 3000 + 16];
    for (int i = 0; i < 3000; i++) strcat(deep2, "{% if 1 %}");
    expect_error(deep2, MOEQ_E_UNSUPPORTED, "line 1", "nested deeper");
    static char deep3[4 * 5000 + 64] = "{{ ";
    for (int i = 0; i < 5000; i++) strcat(deep3, "not ");
    strcat(deep3, "1 }}");
    expect_error(deep3, MOEQ_E_UNSUPPORTED, "line 1", "nested deeper");
    /* not UTF-8 */
    expect_error("ab\xff", MOEQ_E_FORMAT, NULL, "UTF-8");
    /* bad messages */
    moeq_chat_template *t = NULL;
    ASSERT_OK(moeq_chat_template_parse("m", "{{ messages[0].content }}", 25, &t));
    char *out = NULL;
    size_t n;
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_chat_apply(t, "{\"role\": 1}", 11, 1, NULL, &out, &n));
    ASSERT_ERROR_MENTIONS("array");
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_chat_apply(t, "[{\"role\": ", 10, 1, NULL, &out, &n));
    ASSERT_ERROR_MENTIONS("byte offset");
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_chat_apply(t, "[1]", 3, 1, NULL, &out, &n));
    ASSERT_ERROR_MENTIONS("messages[0]");
    ASSERT_TRUE(out == NULL);
    moeq_chat_template_free(t);
}

static void apply_messages(void) {
    const char *tpl = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}{% if enable_thinking is defined %}"
                      "[think={{ enable_thinking }}]{% endif %}{{ tools is none }}";
    moeq_chat_template *t = NULL;
    ASSERT_OK(moeq_chat_template_parse("x", tpl, strlen(tpl), &t));
    const char *msgs = "[{\"role\": \"user\", \"content\": \"caf\\u00e9\"}]";
    char *out;
    size_t n;
    ASSERT_OK(moeq_chat_apply(t, msgs, strlen(msgs), 1, "{\"enable_thinking\": false}", &out, &n));
    ASSERT_EQ_STR("<user>caf\xc3\xa9<assistant>[think=False]True", out);
    free(out);
    ASSERT_OK(moeq_chat_apply(t, msgs, strlen(msgs), 0, NULL, &out, &n));
    ASSERT_EQ_STR("<user>caf\xc3\xa9True", out);
    free(out);
    moeq_chat_template_free(t);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    ASSERT_TRUE(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void load_from_model(void) {
    const char *dir = mq_test_tmpdir();
    char p[2048], d[1024];
    snprintf(d, sizeof d, "%s/chatmodel", dir);
    ASSERT_TRUE(mkdir(d, 0755) == 0);
    snprintf(p, sizeof p, "%s/tokenizer_config.json", d);
    moeq_chat_template *t = NULL;
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_chat_template_load(d, NULL, &t));
    write_file(p, "{\"bos_token\": \"<s>\", \"eos_token\": {\"content\": \"</s>\", \"lstrip\": false}, "
                  "\"chat_template\": \"{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ unk_token is defined }}\"}");
    ASSERT_OK(moeq_chat_template_load(d, NULL, &t));
    ASSERT_EQ_STR("<s>", moeq_chat_template_special(t, "bos_token"));
    ASSERT_EQ_STR("</s>", moeq_chat_template_special(t, "eos_token"));
    ASSERT_TRUE(moeq_chat_template_special(t, "pad_token") == NULL);
    const char *msgs = "[{\"role\": \"user\", \"content\": \"hi\"}]";
    char *out;
    size_t n;
    ASSERT_OK(moeq_chat_apply(t, msgs, strlen(msgs), 1, NULL, &out, &n));
    ASSERT_EQ_STR("<s>hi</s>False", out);
    free(out);
    moeq_chat_template_free(t);
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_chat_template_load(d, "tool_use", &t));
    /* named templates */
    write_file(p, "{\"chat_template\": [{\"name\": \"default\", \"template\": \"D\"}, {\"name\": \"tool_use\", \"template\": \"T\"}]}");
    ASSERT_OK(moeq_chat_template_load(d, NULL, &t));
    ASSERT_OK(moeq_chat_apply(t, "[]", 2, 0, NULL, &out, &n));
    ASSERT_EQ_STR("D", out);
    free(out);
    moeq_chat_template_free(t);
    ASSERT_OK(moeq_chat_template_load(d, "tool_use", &t));
    ASSERT_OK(moeq_chat_apply(t, "[]", 2, 0, NULL, &out, &n));
    ASSERT_EQ_STR("T", out);
    free(out);
    moeq_chat_template_free(t);
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_chat_template_load(d, "rag", &t));
    ASSERT_ERROR_MENTIONS("'rag'");
    write_file(p, "{\"chat_template\": 5}");
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_chat_template_load(d, NULL, &t));
    ASSERT_ERROR_MENTIONS("tokenizer_config.json");
    /* a syntax error names the file it came from */
    write_file(p, "{\"chat_template\": \"ok\\n{% if %}\"}");
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_chat_template_load(d, NULL, &t));
    ASSERT_ERROR_MENTIONS("tokenizer_config.json chat_template line 2");
    /* chat_template.jinja comes first */
    snprintf(p, sizeof p, "%s/chat_template.jinja", d);
    write_file(p, "J{{ messages|length }}\n");
    ASSERT_OK(moeq_chat_template_load(d, NULL, &t));
    ASSERT_OK(moeq_chat_apply(t, "[]", 2, 0, NULL, &out, &n));
    ASSERT_EQ_STR("J0", out);   /* its trailing newline dropped, as jinja2 drops it */
    free(out);
    moeq_chat_template_free(t);
}

static void load_from_gguf(void) {
    char p[1024];
    snprintf(p, sizeof p, "%s/chat.gguf", mq_test_tmpdir());
    mq_gguf_writer *w = mq_gguf_writer_new();
    ASSERT_TRUE(w != NULL);
    mq_gguf_kv_str(w, "general.architecture", "llama");
    mq_gguf_kv_str(w, "tokenizer.chat_template", "{{ bos_token }}[{{ messages[0].content }}]");
    const char *toks[3] = {"<unk>", "<s>", "</s>"};
    const size_t lens[3] = {5, 3, 4};
    mq_gguf_kv_arr_str(w, "tokenizer.ggml.tokens", toks, lens, 3);
    mq_gguf_kv_u32(w, "tokenizer.ggml.bos_token_id", 1);
    mq_gguf_kv_u32(w, "tokenizer.ggml.eos_token_id", 2);
    FILE *f = fopen(p, "wb");
    ASSERT_TRUE(f != NULL);
    ASSERT_OK(mq_gguf_writer_begin(w, f, p));
    ASSERT_OK(mq_gguf_writer_end(w));
    fclose(f);
    mq_gguf_writer_free(w);
    moeq_chat_template *t = NULL;
    ASSERT_OK(moeq_chat_template_load(p, NULL, &t));
    ASSERT_EQ_STR("</s>", moeq_chat_template_special(t, "eos_token"));
    char *out;
    size_t n;
    const char *q = "[{\"role\":\"user\",\"content\":\"q\"}]";
    ASSERT_OK(moeq_chat_apply(t, q, strlen(q), 1, NULL, &out, &n));
    ASSERT_EQ_STR("<s>[q]", out);
    free(out);
    moeq_chat_template_free(t);
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_chat_template_load(p, "rag", &t));
    ASSERT_ERROR_MENTIONS("tokenizer.chat_template.rag");
}

TEST_MAIN(T(goldens), T(errors_name_the_line), T(apply_messages), T(load_from_model), T(load_from_gguf))
