/*
 * libFuzzer target for chat templates (runtime/template*.c, chat_template.c, serve.c): the input
 * is up to three parts cut at FUZZ_SEP lines (fuzz_common.h): the template text, a JSON object of
 * its variables, an OpenAI request body for /v1/chat/completions. Parsing gives MOEQ_OK or an
 * input error naming the template; a parsed template renders into valid UTF-8 or fails the same
 * way (a raise_exception, an undefined value used, a construct outside the subset, a loop past
 * the memory bound); the request is parsed into a prompt or refused with an input error.
 * Seeds: tests/fuzz/corpus.py (the templates of tests/data/chat_templates with the goldens'
 * variables).
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[3];
    size_t len[3];
    int n = fuzz_split(data, size, 3, part, len);
    moeq_chat_template *t = NULL;
    moeq_status s = moeq_chat_template_parse("fuzz", (const char *)part[0], len[0], &t);
    if (s != MOEQ_OK) {
        fuzz_check_error(s, "chat template fuzz", "parse");
        if (t) abort();
        return 0;
    }
    const char *vars = n > 1 ? (const char *)part[1] : "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}";
    size_t vlen = n > 1 ? len[1] : strlen(vars);
    char *out = NULL;
    size_t out_len = 0;
    s = moeq_chat_template_render(t, vars, vlen, &out, &out_len);
    if (s == MOEQ_OK) {
        if (!out || out[out_len] != 0 || moeq_utf8_valid_prefix(out, out_len) != out_len) {
            fprintf(stderr, "render: output is not NUL-terminated valid UTF-8\n");
            abort();
        }
    } else {
        fuzz_check_error(s, "chat template fuzz", "render");
        if (out) abort();
    }
    free(out);
    if (n > 2) {
        moeq_openai_request r;
        s = moeq_openai_parse((const char *)part[2], len[2], 1, t, &r);
        if (s == MOEQ_OK) {
            if (!r.prompt || moeq_utf8_valid_prefix(r.prompt, r.prompt_len) != r.prompt_len) abort();
            moeq_openai_request_free(&r);
        } else {
            fuzz_check_error(s, NULL, "request");
        }
    }
    moeq_chat_template_free(t);
    return 0;
}
