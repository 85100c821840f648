/*
 * The OpenAI-compatible layer of `moeq serve` (moeq.h, "OpenAI-compatible requests"): request
 * bodies of /v1/completions and /v1/chat/completions into a prompt and generation options, and
 * the response, stream-chunk and error objects back, in the shapes OpenAI's API documents (and
 * llama.cpp's and vLLM's servers answer with). No HTTP here: the CLI owns the sockets.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "core/core.h"

void moeq_openai_request_free(moeq_openai_request *r) {
    if (!r) return;
    free(r->prompt);
    free(r->model);
    for (int32_t i = 0; r->stop_buf && i < r->gen.n_stop; i++) free(r->stop_buf[i]);
    free(r->stop_buf);
    memset(r, 0, sizeof *r);
}

static const cJSON *field(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static moeq_status int_field(const cJSON *o, const char *k, int64_t lo, int64_t hi, int64_t *v) {
    const cJSON *x = field(o, k);
    if (!x) return MOEQ_OK;
    if (!cJSON_IsNumber(x) || !mq_int_of(x->valuedouble, lo, hi, v))
        return mq_err(MOEQ_E_ARG, "'%s' must be an integer in [%lld, %lld]", k, (long long)lo, (long long)hi);
    return MOEQ_OK;
}

static moeq_status bool_field(const cJSON *o, const char *k, int *v) {
    const cJSON *x = field(o, k);
    if (!x) return MOEQ_OK;
    if (!cJSON_IsBool(x)) return mq_err(MOEQ_E_ARG, "'%s' must be true or false", k);
    *v = cJSON_IsTrue(x);
    return MOEQ_OK;
}

/* The request field of each row of gen_options.def ("a|b": either name), NULL where none. */
static const char *const g_json_fields[] = {
#define MQ_GOPT(key, kind, p1, p2, field, def, samples, json, metavar, help) json,
#include "runtime/gen_options.def"
#undef MQ_GOPT
};

/* Field k of o, when given, to the generation option x: its JSON value as the text the flag
 * would carry, through moeq_gen_options_set, so that a field takes exactly what the flag takes. */
static moeq_status gen_field(const cJSON *o, const char *k, const moeq_option_info *x, moeq_gen_options *g) {
    const cJSON *v = field(o, k);
    if (!v) return MOEQ_OK;
    char text[64];
    int64_t i = 0;
    if (x->kind == MOEQ_OPTION_SWITCH) {
        if (!cJSON_IsBool(v)) return mq_err(MOEQ_E_ARG, "'%s' must be true or false", k);
        snprintf(text, sizeof text, "%s", cJSON_IsTrue(v) ? "true" : "false");
    } else if (!cJSON_IsNumber(v)) {
        return mq_err(MOEQ_E_ARG, "'%s' must be a number", k);
    } else if (x->kind == MOEQ_OPTION_INT) {
        if (!mq_int_of(v->valuedouble, INT64_MIN, INT64_MAX, &i)) return mq_err(MOEQ_E_ARG, "'%s' must be an integer", k);
        snprintf(text, sizeof text, "%lld", (long long)i);
    } else {
        snprintf(text, sizeof text, "%.17g", v->valuedouble);
    }
    if (!moeq_gen_options_set(g, x->key, text)) return MOEQ_OK;
    char why[256];   /* the setter's "KEY=VALUE: expected ..." told by the field's name */
    const char *e = strstr(moeq_last_error(), ": expected ");
    snprintf(why, sizeof why, "%s", e ? e : ": not accepted");
    return mq_err(MOEQ_E_ARG, "'%s' %s%s", k, text, why);
}

static moeq_status parse_stop(const cJSON *o, moeq_openai_request *r) {
    const cJSON *s = field(o, "stop");
    if (!s) return MOEQ_OK;
    int n = cJSON_IsString(s) ? 1 : cJSON_IsArray(s) ? cJSON_GetArraySize(s) : -1;
    if (n < 0 || n > 16) return mq_err(MOEQ_E_ARG, "'stop' must be a string or a list of at most 16 strings");
    r->stop_buf = calloc((size_t)n + 1, sizeof(char *));
    if (!r->stop_buf) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        const cJSON *e = cJSON_IsString(s) ? s : cJSON_GetArrayItem(s, i);
        if (!cJSON_IsString(e) || !e->valuestring[0]) return mq_err(MOEQ_E_ARG, "'stop' strings must be non-empty strings");
        r->stop_buf[i] = mq_strdup(e->valuestring);
        if (!r->stop_buf[i]) return mq_err(MOEQ_E_NOMEM, "out of memory");
        r->gen.n_stop = i + 1;
    }
    r->gen.stop = (const char *const *)r->stop_buf;
    return MOEQ_OK;
}

static moeq_status parse_body(const cJSON *o, int chat, const moeq_chat_template *t, moeq_openai_request *r) {
    moeq_status st;
    const cJSON *m = field(o, "model");
    if (m && !cJSON_IsString(m)) return mq_err(MOEQ_E_ARG, "'model' must be a string");
    if (m && !(r->model = mq_strdup(m->valuestring))) return mq_err(MOEQ_E_NOMEM, "out of memory");
    int64_t n = 1;
    if ((st = int_field(o, "n", 1, 1, &n))) return mq_err(MOEQ_E_ARG, "'n' must be 1 (one choice per request)");
    if (chat) {
        const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(o, "messages"), *e;
        if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
            return mq_err(MOEQ_E_ARG, "'messages' must be a non-empty list of messages");
        int i = 0;
        cJSON_ArrayForEach(e, msgs) {
            if (!cJSON_IsObject(e) || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(e, "role")))
                return mq_err(MOEQ_E_ARG, "'messages[%d]' must be an object with a string 'role'", i);
            i++;
        }
        if (!t) return mq_err(MOEQ_E_UNSUPPORTED, "the model has no chat template: use /v1/completions");
        cJSON *extra = cJSON_CreateObject();
        const cJSON *kw = field(o, "chat_template_kwargs"), *tools = field(o, "tools");
        if (kw && !cJSON_IsObject(kw)) {
            cJSON_Delete(extra);
            return mq_err(MOEQ_E_ARG, "'chat_template_kwargs' must be an object");
        }
        cJSON_ArrayForEach(e, kw) cJSON_AddItemToObject(extra, e->string, cJSON_Duplicate(e, 1));
        if (tools) cJSON_AddItemToObject(extra, "tools", cJSON_Duplicate(tools, 1));
        char *mj = cJSON_PrintUnformatted(msgs), *ej = cJSON_PrintUnformatted(extra);
        cJSON_Delete(extra);
        if (!mj || !ej) {
            free(mj);
            free(ej);
            return mq_err(MOEQ_E_NOMEM, "out of memory");
        }
        st = moeq_chat_apply(t, mj, strlen(mj), 1, ej, &r->prompt, &r->prompt_len);
        free(mj);
        free(ej);
        if (st) return st;
        r->gen.max_tokens = 0;
    } else {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "prompt");
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1) p = cJSON_GetArrayItem(p, 0);
        if (!cJSON_IsString(p))
            return mq_err(MOEQ_E_ARG, "'prompt' must be a string (or a list of one string)");
        r->prompt_len = strlen(p->valuestring);
        if (!(r->prompt = mq_strdup(p->valuestring))) return mq_err(MOEQ_E_NOMEM, "out of memory");
        r->add_bos = 1;
        r->gen.max_tokens = 16;   /* OpenAI's default for completions */
    }
    int64_t mt = r->gen.max_tokens;
    if ((st = int_field(o, "max_tokens", 1, INT32_MAX, &mt))) return st;
    if ((st = int_field(o, "max_completion_tokens", 1, INT32_MAX, &mt))) return st;
    r->gen.max_tokens = (int32_t)mt;
    /* OpenAI's defaults where they differ from moeq_gen_options_init: temperature 1, and a seed
     * from the clock (each request its own draws unless it names one) */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r->gen.sampling.temperature = 1.0;
    r->gen.sampling.seed = (uint64_t)(int64_t)(ts.tv_nsec ^ ((int64_t)ts.tv_sec << 20));
    const moeq_option_info *x;
    for (int i = 0; (x = moeq_gen_option_info(i)); i++)
        for (const char *k = g_json_fields[i]; k && *k;) {   /* "a|b": each name in turn */
            char name[48];
            const size_t len = strcspn(k, "|");
            snprintf(name, sizeof name, "%.*s", (int)len, k);
            if ((st = gen_field(o, name, x, &r->gen))) return st;
            k += len + (k[len] == '|');
        }
    if ((st = bool_field(o, "stream", &r->stream))) return st;
    const cJSON *so = field(o, "stream_options");
    if (so && !cJSON_IsObject(so)) return mq_err(MOEQ_E_ARG, "'stream_options' must be an object");
    if (so && (st = bool_field(so, "include_usage", &r->include_usage))) return st;
    return parse_stop(o, r);
}

moeq_status moeq_openai_parse(const char *body, size_t len, int chat, const moeq_chat_template *t,
                              moeq_openai_request *r) {
    memset(r, 0, sizeof *r);
    moeq_gen_options_init(&r->gen);
    r->chat = chat != 0;
    if (!body) return mq_err(MOEQ_E_ARG, "moeq_openai_parse: NULL body");
    cJSON *o = cJSON_ParseWithLength(body, len);
    if (!o) return mq_err(MOEQ_E_FORMAT, "the request body is not valid JSON");
    moeq_status st = cJSON_IsObject(o) ? parse_body(o, r->chat, t, r)
                                       : mq_err(MOEQ_E_FORMAT, "the request body must be a JSON object");
    cJSON_Delete(o);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", moeq_last_error());
        moeq_openai_request_free(r);
        mq_err(st, "%s", msg);
    }
    return st;
}

static const char *finish_name(const char *f) { return f && !strcmp(f, "length") ? "length" : "stop"; }

static cJSON *head(const moeq_openai_request *r, const char *id, const char *model, int64_t created,
                   const char *object) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)created);
    cJSON_AddStringToObject(o, "model", model);
    cJSON_AddStringToObject(o, "system_fingerprint", "moeq-" MOEQ_VERSION_STRING);
    return o;
}

static void add_usage(cJSON *o, const moeq_gen_result *g) {
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", g->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", g->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)g->prompt_tokens + g->completion_tokens);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", g->reused_tokens);
}

static char *take(cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

char *moeq_openai_response(const moeq_openai_request *r, const char *id, const char *model,
                           int64_t created, const moeq_gen_result *g) {
    cJSON *o = head(r, id, model, created, r->chat ? "chat.completion" : "text_completion");
    cJSON *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddItemToArray(ch, c);
    cJSON_AddNumberToObject(c, "index", 0);
    if (r->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", g->text ? g->text : "");
    } else {
        cJSON_AddStringToObject(c, "text", g->text ? g->text : "");
    }
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddStringToObject(c, "finish_reason", finish_name(g->finish_reason));
    add_usage(o, g);
    return take(o);
}

char *moeq_openai_chunk(const moeq_openai_request *r, const char *id, const char *model,
                        int64_t created, const char *text, size_t len, int first,
                        const char *finish_reason, const moeq_gen_result *usage) {
    cJSON *o = head(r, id, model, created, r->chat ? "chat.completion.chunk" : "text_completion");
    cJSON *ch = cJSON_AddArrayToObject(o, "choices");
    if (usage) {
        add_usage(o, usage);
        return take(o);
    }
    char *piece = mq_strndup(text ? text : "", text ? len : 0);
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(ch, c);
    cJSON_AddNumberToObject(c, "index", 0);
    if (r->chat) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (first) cJSON_AddStringToObject(d, "role", "assistant");
        if (!finish_reason || len) cJSON_AddStringToObject(d, "content", piece ? piece : "");
    } else {
        cJSON_AddStringToObject(c, "text", piece ? piece : "");
    }
    free(piece);
    cJSON_AddNullToObject(c, "logprobs");
    if (finish_reason) cJSON_AddStringToObject(c, "finish_reason", finish_name(finish_reason));
    else cJSON_AddNullToObject(c, "finish_reason");
    return take(o);
}

char *moeq_openai_error(const char *message, const char *type, const char *param, const char *code) {
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "message", message ? message : "");
    cJSON_AddStringToObject(e, "type", type ? type : "invalid_request_error");
    if (param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    return take(o);
}
