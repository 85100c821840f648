/*
 * The OpenAI layer of `moeq serve` (runtime/serve.c): request fields to generation options, with
 * OpenAI's defaults and every bad value refused naming its field; the response, stream-chunk and
 * error objects read back with cJSON; and moeq_gen on the bundled model: a prompt that extends
 * what a slot holds reuses its cache and gives the ids a fresh slot gives.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "harness.h"
#include "moeq.h"

static moeq_status parse(const char *body, int chat, const moeq_chat_template *t, moeq_openai_request *r) {
    return moeq_openai_parse(body, strlen(body), chat, t, r);
}

static void requests(void) {
    moeq_openai_request r;
    ASSERT_OK(parse("{\"prompt\": \"Hi\"}", 0, NULL, &r));
    ASSERT_EQ_STR("Hi", r.prompt);
    ASSERT_EQ_INT(1, r.add_bos);
    ASSERT_EQ_INT(16, r.gen.max_tokens);   /* OpenAI's default for completions */
    ASSERT_NEAR(1.0, r.gen.sampling.temperature, 0);
    ASSERT_EQ_INT(0, r.stream);
    ASSERT_EQ_INT(0, r.gen.n_stop);
    moeq_openai_request_free(&r);
    ASSERT_OK(parse("{\"prompt\": [\"Hi\"], \"max_tokens\": 5, \"temperature\": 0, \"top_p\": 0.5, \"top_k\": 7, "
                    "\"min_p\": 0.1, \"seed\": 42, \"presence_penalty\": 0.5, \"frequency_penalty\": -0.5, "
                    "\"repetition_penalty\": 1.1, \"repeat_last_n\": -1, \"stop\": [\"a\", \"bc\"], \"stream\": true, "
                    "\"stream_options\": {\"include_usage\": true}, \"ignore_eos\": true, \"model\": \"x\", \"user\": \"u\"}",
                    0, NULL, &r));
    ASSERT_EQ_INT(5, r.gen.max_tokens);
    ASSERT_NEAR(0.0, r.gen.sampling.temperature, 0);
    ASSERT_NEAR(0.5, r.gen.sampling.top_p, 0);
    ASSERT_EQ_INT(7, r.gen.sampling.top_k);
    ASSERT_NEAR(0.1, r.gen.sampling.min_p, 0);
    ASSERT_EQ_INT(42, (int64_t)r.gen.sampling.seed);
    ASSERT_NEAR(0.5, r.gen.sampling.presence_penalty, 0);
    ASSERT_NEAR(-0.5, r.gen.sampling.frequency_penalty, 0);
    ASSERT_NEAR(1.1, r.gen.sampling.repeat_penalty, 0);
    ASSERT_EQ_INT(-1, r.gen.sampling.repeat_last_n);
    ASSERT_EQ_INT(2, r.gen.n_stop);
    ASSERT_EQ_STR("bc", r.gen.stop[1]);
    ASSERT_EQ_INT(1, r.stream);
    ASSERT_EQ_INT(1, r.include_usage);
    ASSERT_EQ_INT(1, r.gen.ignore_eos);
    ASSERT_EQ_STR("x", r.model);
    moeq_openai_request_free(&r);
    static const struct {
        const char *body;
        moeq_status st;
        const char *mention;
    } bad[] = {
        {"{\"prompt\": ", MOEQ_E_FORMAT, "not valid JSON"},
        {"[]", MOEQ_E_FORMAT, "JSON object"},
        {"{}", MOEQ_E_ARG, "'prompt'"},
        {"{\"prompt\": 3}", MOEQ_E_ARG, "'prompt'"},
        {"{\"prompt\": \"a\", \"temperature\": -0.1}", MOEQ_E_ARG, "'temperature'"},
        {"{\"prompt\": \"a\", \"temperature\": \"hot\"}", MOEQ_E_ARG, "'temperature'"},
        {"{\"prompt\": \"a\", \"top_p\": 0}", MOEQ_E_ARG, "'top_p'"},
        {"{\"prompt\": \"a\", \"top_p\": 1.5}", MOEQ_E_ARG, "'top_p'"},
        {"{\"prompt\": \"a\", \"top_k\": 1.5}", MOEQ_E_ARG, "'top_k'"},
        {"{\"prompt\": \"a\", \"min_p\": 2}", MOEQ_E_ARG, "'min_p'"},
        {"{\"prompt\": \"a\", \"max_tokens\": 0}", MOEQ_E_ARG, "'max_tokens'"},
        {"{\"prompt\": \"a\", \"n\": 2}", MOEQ_E_ARG, "'n'"},
        {"{\"prompt\": \"a\", \"stop\": [\"\"]}", MOEQ_E_ARG, "'stop'"},
        {"{\"prompt\": \"a\", \"stop\": 5}", MOEQ_E_ARG, "'stop'"},
        {"{\"prompt\": \"a\", \"stream\": 1}", MOEQ_E_ARG, "'stream'"},
        {"{\"prompt\": \"a\", \"seed\": \"x\"}", MOEQ_E_ARG, "'seed'"},
        {"{\"prompt\": \"a\", \"repetition_penalty\": 0}", MOEQ_E_ARG, "'repetition_penalty'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moeq_status st = parse(bad[i].body, 0, NULL, &r);
        if (st != bad[i].st) FAIL("%s: expected %s, got %s", bad[i].body, moeq_status_name(bad[i].st), moeq_status_name(st));
        ASSERT_ERROR_MENTIONS(bad[i].mention);
        ASSERT_TRUE(r.prompt == NULL && r.stop_buf == NULL);
    }
    /* chat: the template renders the messages, tools and chat_template_kwargs */
    const char *tpl = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ tools|length if tools else 'none' }}"
                      "{{ '+' if add_generation_prompt }}{{ x|default('') }}";
    moeq_chat_template *t;
    ASSERT_OK(moeq_chat_template_parse("t", tpl, strlen(tpl), &t));
    ASSERT_OK(parse("{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": [{\"type\": \"function\"}], "
                    "\"chat_template_kwargs\": {\"x\": \"X\"}}", 1, t, &r));
    ASSERT_EQ_STR("[user:q]1+X", r.prompt);
    ASSERT_EQ_INT(0, r.add_bos);
    ASSERT_EQ_INT(0, r.gen.max_tokens);   /* chat: up to the context's end */
    moeq_openai_request_free(&r);
    ASSERT_STATUS(MOEQ_E_ARG, parse("{\"messages\": []}", 1, t, &r));
    ASSERT_ERROR_MENTIONS("'messages'");
    ASSERT_STATUS(MOEQ_E_ARG, parse("{\"messages\": [{\"content\": \"q\"}]}", 1, t, &r));
    ASSERT_ERROR_MENTIONS("messages[0]");
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, parse("{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}", 1, NULL, &r));
    ASSERT_ERROR_MENTIONS("no chat template");
    moeq_chat_template_free(t);
}

static const cJSON *at(const cJSON *o, const char *path) {   /* "choices.0.delta.content" */
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *k = strtok(buf, "."); k && o; k = strtok(NULL, "."))
        o = (*k >= '0' && *k <= '9') ? cJSON_GetArrayItem(o, atoi(k)) : cJSON_GetObjectItemCaseSensitive(o, k);
    return o;
}

static void responses(void) {
    moeq_openai_request r;
    memset(&r, 0, sizeof r);
    r.chat = 1;
    moeq_gen_result g = {.text = "caf\xc3\xa9 \"ok\"", .text_len = 10, .prompt_tokens = 7, .reused_tokens = 3,
                         .completion_tokens = 4, .finish_reason = "eos"};
    char *s = moeq_openai_response(&r, "id1", "mod", 123, &g);
    cJSON *o = cJSON_Parse(s);
    ASSERT_TRUE(o != NULL);
    ASSERT_EQ_STR("chat.completion", at(o, "object")->valuestring);
    ASSERT_EQ_STR("assistant", at(o, "choices.0.message.role")->valuestring);
    ASSERT_EQ_STR("caf\xc3\xa9 \"ok\"", at(o, "choices.0.message.content")->valuestring);
    ASSERT_EQ_STR("stop", at(o, "choices.0.finish_reason")->valuestring);   /* EOS is "stop" to OpenAI */
    ASSERT_EQ_INT(11, at(o, "usage.total_tokens")->valuedouble);
    ASSERT_EQ_INT(3, at(o, "usage.prompt_tokens_details.cached_tokens")->valuedouble);
    ASSERT_EQ_INT(123, at(o, "created")->valuedouble);
    cJSON_Delete(o);
    free(s);
    s = moeq_openai_chunk(&r, "id1", "mod", 123, "ab", 2, 1, NULL, NULL);
    o = cJSON_Parse(s);
    ASSERT_EQ_STR("chat.completion.chunk", at(o, "object")->valuestring);
    ASSERT_EQ_STR("assistant", at(o, "choices.0.delta.role")->valuestring);
    ASSERT_EQ_STR("ab", at(o, "choices.0.delta.content")->valuestring);
    ASSERT_TRUE(cJSON_IsNull(at(o, "choices.0.finish_reason")));
    ASSERT_TRUE(strchr(s, '\n') == NULL);   /* one SSE data line */
    cJSON_Delete(o);
    free(s);
    s = moeq_openai_chunk(&r, "id1", "mod", 123, "", 0, 0, "length", NULL);
    o = cJSON_Parse(s);
    ASSERT_EQ_STR("length", at(o, "choices.0.finish_reason")->valuestring);
    ASSERT_TRUE(at(o, "choices.0.delta.content") == NULL);
    cJSON_Delete(o);
    free(s);
    r.chat = 0;
    s = moeq_openai_chunk(&r, "id1", "mod", 123, NULL, 0, 0, NULL, &g);
    o = cJSON_Parse(s);
    ASSERT_EQ_INT(0, cJSON_GetArraySize(at(o, "choices")));
    ASSERT_EQ_INT(4, at(o, "usage.completion_tokens")->valuedouble);
    cJSON_Delete(o);
    free(s);
    s = moeq_openai_response(&r, "id2", "mod", 1, &g);
    o = cJSON_Parse(s);
    ASSERT_EQ_STR("text_completion", at(o, "object")->valuestring);
    ASSERT_EQ_STR("caf\xc3\xa9 \"ok\"", at(o, "choices.0.text")->valuestring);
    cJSON_Delete(o);
    free(s);
    s = moeq_openai_error("bad \"x\"", "invalid_request_error", "x", NULL);
    o = cJSON_Parse(s);
    ASSERT_EQ_STR("bad \"x\"", at(o, "error.message")->valuestring);
    ASSERT_EQ_STR("x", at(o, "error.param")->valuestring);
    ASSERT_TRUE(cJSON_IsNull(at(o, "error.code")));
    cJSON_Delete(o);
    free(s);
}

typedef struct {
    char buf[4096];
    size_t n;
} pieces;
static int collect(void *user, const char *text, size_t len) {
    pieces *p = user;
    if (p->n + len < sizeof p->buf) memcpy(p->buf + p->n, text, len), p->n += len;
    return 0;
}

static void gen_keeps_cache(void) {
    moeq_model *m;
    moeq_model_options mo = {0};
    ASSERT_OK(moeq_model_open(mq_test_repo("models/olmoe-tiny"), &mo, &m));
    const moeq_tokenizer *tok = moeq_model_tokenizer(m);
    int32_t *a, *b;
    size_t na, nb;
    const char *ta = "The history of the", *tb = "The history of the world is long, and the";
    ASSERT_OK(moeq_tokenizer_encode(tok, ta, strlen(ta), &a, &na));
    ASSERT_OK(moeq_tokenizer_encode(tok, tb, strlen(tb), &b, &nb));
    ASSERT_TRUE(nb > na + 2 && memcmp(a, b, na * sizeof *a) == 0);
    moeq_gen *g, *fresh;
    ASSERT_OK(moeq_gen_create(m, 128, &g));
    ASSERT_OK(moeq_gen_create(m, 128, &fresh));
    moeq_gen_options o;
    moeq_gen_options_init(&o);
    o.max_tokens = 1;   /* holds a (the one sampled id is not fed) */
    moeq_gen_result r1, r2, r3;
    ASSERT_OK(moeq_gen_run(g, a, na, &o, NULL, NULL, &r1));
    ASSERT_EQ_INT(0, r1.reused_tokens);
    o.max_tokens = 12;
    pieces p = {0};
    ASSERT_OK(moeq_gen_run(g, b, nb, &o, collect, &p, &r2));
    ASSERT_EQ_INT((int64_t)na, r2.reused_tokens);
    ASSERT_OK(moeq_gen_run(fresh, b, nb, &o, NULL, NULL, &r3));
    ASSERT_EQ_INT(0, r3.reused_tokens);
    ASSERT_EQ_STR(r3.text, r2.text);   /* the kept cache gives what a fresh prefill gives */
    ASSERT_EQ_INT((int64_t)r2.text_len, (int64_t)p.n);   /* the pieces add up to the text */
    ASSERT_TRUE(memcmp(p.buf, r2.text, p.n) == 0);
    ASSERT_EQ_STR("length", r2.finish_reason);
    /* a prompt that does not extend what it holds starts over */
    moeq_gen_result r4;
    ASSERT_OK(moeq_gen_run(g, a, na, &o, NULL, NULL, &r4));
    ASSERT_EQ_INT(0, r4.reused_tokens);
    /* a stop string cuts exactly before it */
    const char *stops[1] = {r3.text + 3};
    char want[64];
    snprintf(want, sizeof want, "%.3s", r3.text);
    o.stop = stops;
    o.n_stop = 1;
    moeq_gen_result r5;
    ASSERT_OK(moeq_gen_run(fresh, b, nb, &o, NULL, NULL, &r5));
    ASSERT_EQ_STR(want, r5.text);
    ASSERT_EQ_STR("stop", r5.finish_reason);
    ASSERT_EQ_INT(0, r5.stop_index);
    /* too long for the context */
    int32_t big[200] = {0};
    ASSERT_STATUS(MOEQ_E_ARG, moeq_gen_run(g, big, 200, &o, NULL, NULL, &r4));
    ASSERT_ERROR_MENTIONS("context of 128 tokens");
    moeq_gen_result_free(&r1);
    moeq_gen_result_free(&r2);
    moeq_gen_result_free(&r3);
    moeq_gen_result_free(&r5);
    free(a);
    free(b);
    moeq_gen_free(g);
    moeq_gen_free(fresh);
    moeq_model_free(m);
}

TEST_MAIN(T(requests), T(responses), T(gen_keeps_cache))
