/*
 * Chat templates as models ship them (moeq.h, "Chat templates"): chat_template.jinja or
 * tokenizer_config.json's chat_template (a string or a list of named templates) in a checkpoint
 * directory, or a GGUF file's tokenizer.chat_template; their special tokens; and the render of a
 * messages list with the variables transformers passes (messages, tools, documents,
 * add_generation_prompt, the special tokens, extra keyword arguments).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "core/core.h"
#include "io/gguf.h"
#include "runtime/template.h"

enum { SP_BOS, SP_EOS, SP_UNK, SP_PAD, SP_N };
static const char *const sp_names[SP_N] = {"bos_token", "eos_token", "unk_token", "pad_token"};

struct moeq_chat_template {
    mq_tt_template t;
    char *special[SP_N];
};

moeq_status moeq_chat_template_parse(const char *name, const char *text, size_t len,
                                     moeq_chat_template **out) {
    *out = NULL;
    if (!text) return mq_err(MOEQ_E_ARG, "moeq_chat_template_parse: text is NULL");
    moeq_chat_template *ct = calloc(1, sizeof *ct);
    if (!ct) return mq_err(MOEQ_E_NOMEM, "chat template: out of memory");
    snprintf(ct->t.name, sizeof ct->t.name, "%s", name ? name : "(text)");
    if (moeq_utf8_valid_prefix(text, len) != len) {
        free(ct);
        return mq_err(MOEQ_E_FORMAT, "chat template %s: not valid UTF-8 at byte offset %zu", name ? name : "(text)",
                      moeq_utf8_valid_prefix(text, len));
    }
    moeq_status st = mq_tt_parse(&ct->t, text, len);
    if (st) free(ct);
    else *out = ct;
    return st;
}

void moeq_chat_template_free(moeq_chat_template *t) {
    if (!t) return;
    mq_tt_arena_free(&t->t.arena);
    for (int i = 0; i < SP_N; i++) free(t->special[i]);
    free(t);
}

const char *moeq_chat_template_special(const moeq_chat_template *t, const char *name) {
    for (int i = 0; t && name && i < SP_N; i++)
        if (!strcmp(name, sp_names[i])) return t->special[i];
    return NULL;
}

/* ---- loading ------------------------------------------------------------------------------ */
static bool is_gguf_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    char m[4] = {0};
    bool r = fread(m, 1, 4, f) == 4 && !memcmp(m, "GGUF", 4);
    fclose(f);
    return r;
}

static moeq_status load_gguf(const char *path, const char *which, moeq_chat_template **out) {
    mq_gguf *g = NULL;
    moeq_status st = mq_gguf_open(path, &g);
    if (st) return st;
    char key[256];
    if (which && strcmp(which, "default") != 0) snprintf(key, sizeof key, "tokenizer.chat_template.%s", which);
    else snprintf(key, sizeof key, "tokenizer.chat_template");
    const char *s;
    size_t n;
    if (!mq_gguf_find_kv(g, key)) {
        mq_gguf_close(g);
        return mq_err(MOEQ_E_NOTFOUND, "%s: no chat template (GGUF key %s)", path, key);
    }
    st = mq_gguf_get_str(g, key, &s, &n);
    if (st) {
        mq_gguf_close(g);
        return st;
    }
    st = moeq_chat_template_parse(key, s, n, out);
    const mq_gguf_kv *toks = mq_gguf_find_kv(g, "tokenizer.ggml.tokens");
    static const char *const idkeys[SP_N] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                             "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"};
    for (int i = 0; !st && toks && i < SP_N; i++) {
        uint32_t id;
        if (!mq_gguf_find_kv(g, idkeys[i]) || mq_gguf_get_u32(g, idkeys[i], &id)) continue;
        if (mq_gguf_kv_str_at(toks, id, &s, &n)) (*out)->special[i] = mq_strndup(s, n);
    }
    mq_gguf_close(g);
    return st;
}

static char *token_text(const cJSON *v) {
    if (cJSON_IsString(v)) return mq_strdup(v->valuestring);
    if (cJSON_IsObject(v)) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(c)) return mq_strdup(c->valuestring);
    }
    return NULL;
}

moeq_status moeq_chat_template_load(const char *path, const char *which, moeq_chat_template **out) {
    *out = NULL;
    if (!path) return mq_err(MOEQ_E_ARG, "moeq_chat_template_load: path is NULL");
    struct stat sb;
    if (stat(path, &sb) != 0) return mq_err(MOEQ_E_NOTFOUND, "%s: not found", path);
    if (S_ISREG(sb.st_mode) && is_gguf_file(path)) return load_gguf(path, which, out);
    char *cfg_path = mq_asprintf("%s/tokenizer_config.json", path), *jinja_path = mq_asprintf("%s/chat_template.jinja", path);
    char *cfg_text = NULL, *jt = NULL;
    size_t cfg_len = 0, jl = 0;
    cJSON *cfg = NULL;
    moeq_status st = MOEQ_OK;
    if (!cfg_path || !jinja_path) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto out;
    }
    if (stat(cfg_path, &sb) == 0) {
        st = mq_read_file(cfg_path, &cfg_text, &cfg_len);
        if (st) goto out;
        cfg = cJSON_ParseWithLength(cfg_text, cfg_len);
        if (!cfg || !cJSON_IsObject(cfg)) {
            st = mq_err(MOEQ_E_FORMAT, "%s: not a JSON object", cfg_path);
            goto out;
        }
    }
    const char *text = NULL;
    char name[600];
    if ((!which || !strcmp(which, "default")) && stat(jinja_path, &sb) == 0) {
        st = mq_read_file(jinja_path, &jt, &jl);
        if (st) goto out;
        snprintf(name, sizeof name, "%s", jinja_path);
        st = moeq_chat_template_parse(name, jt, jl, out);
    } else {
        const cJSON *ct = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "chat_template") : NULL;
        const char *want = which ? which : "default";
        if (cJSON_IsString(ct)) {
            if (which && strcmp(which, "default") != 0) {
                st = mq_err(MOEQ_E_NOTFOUND, "%s: chat_template is one template, not a list holding '%s'", cfg_path, which);
                goto out;
            }
            text = ct->valuestring;
            snprintf(name, sizeof name, "%s chat_template", cfg_path);
        } else if (cJSON_IsArray(ct)) {
            const cJSON *e, *only = NULL;
            int n = 0;
            cJSON_ArrayForEach(e, ct) {
                const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name"),
                            *tx = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (!cJSON_IsString(nm) || !cJSON_IsString(tx)) {
                    st = mq_err(MOEQ_E_FORMAT, "%s: chat_template[%d] needs string \"name\" and \"template\"", cfg_path, n);
                    goto out;
                }
                n++;
                only = tx;
                if (!strcmp(nm->valuestring, want)) text = tx->valuestring;
            }
            if (!text && !which && n == 1) text = only->valuestring;
            if (!text) {
                st = mq_err(MOEQ_E_NOTFOUND, "%s: chat_template has no template named '%s'", cfg_path, want);
                goto out;
            }
            snprintf(name, sizeof name, "%s chat_template '%s'", cfg_path, want);
        } else if (ct && !cJSON_IsNull(ct)) {
            st = mq_err(MOEQ_E_FORMAT, "%s: chat_template must be a string or a list of {name, template}", cfg_path);
            goto out;
        } else {
            st = mq_err(MOEQ_E_NOTFOUND, "%s: the model has no chat template (no chat_template.jinja, and "
                        "tokenizer_config.json has no chat_template)", path);
            goto out;
        }
        st = moeq_chat_template_parse(name, text, strlen(text), out);
    }
    for (int i = 0; !st && cfg && i < SP_N; i++)
        (*out)->special[i] = token_text(cJSON_GetObjectItemCaseSensitive(cfg, sp_names[i]));
out:
    cJSON_Delete(cfg);
    free(cfg_text);
    free(jt);
    free(cfg_path);
    free(jinja_path);
    return st;
}

/* ---- rendering ---------------------------------------------------------------------------- */
static moeq_status render(const moeq_chat_template *t, const char *vars_json, size_t len, const char *messages,
                          size_t mlen, int agp, const char *extra, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    if (!t) return mq_err(MOEQ_E_ARG, "chat template: NULL template");
    /* on the heap: nothing the longjmp of an error returns to is a local changed after setjmp */
    mq_tt_arena *arena = malloc(sizeof *arena);
    if (!arena) return mq_err(MOEQ_E_NOMEM, "chat template: out of memory");
    mq_tt_arena_init(arena, (size_t)512 << 20);
    mq_tt_ctx c = {.name = t->t.name, .a = arena};
    if (setjmp(c.jb)) {
        mq_tt_arena_free(arena);
        free(arena);
        return mq_err(c.st, "%s", c.msg);
    }
    tv *vars = mq_tv_dict(&c, TV_DICT);
    mq_tv_dict_set(&c, vars, mq_tv_str_ref(&c, "tools", 5), &mq_tt_none);
    mq_tv_dict_set(&c, vars, mq_tv_str_ref(&c, "documents", 9), &mq_tt_none);
    mq_tv_dict_set(&c, vars, mq_tv_str_ref(&c, "add_generation_prompt", 21), &mq_tt_false);
    for (int i = 0; i < SP_N; i++)
        if (t->special[i])
            mq_tv_dict_set(&c, vars, mq_tv_str_ref(&c, sp_names[i], strlen(sp_names[i])),
                        mq_tv_str_ref(&c, t->special[i], strlen(t->special[i])));
    const char *objs[2] = {vars_json, extra};
    size_t lens[2] = {len, extra ? strlen(extra) : 0};
    if (messages) {
        tv *m = mq_tv_from_json(&c, "messages", messages, mlen);
        if (m->k != TV_LIST) mq_tt_fail(&c, MOEQ_E_FORMAT, 0, "messages: expected a JSON array of messages");
        for (size_t i = 0; i < m->u.l.n; i++)
            if (m->u.l.v[i]->k != TV_DICT) mq_tt_fail(&c, MOEQ_E_FORMAT, 0, "messages[%zu]: expected a JSON object", i);
        mq_tv_dict_set(&c, vars, mq_tv_str_ref(&c, "messages", 8), m);
        mq_tv_dict_set(&c, vars, mq_tv_str_ref(&c, "add_generation_prompt", 21), mq_tv_bool(agp));
        objs[0] = NULL;
    }
    for (int k = 0; k < 2; k++) {
        if (!objs[k]) continue;
        tv *o = mq_tv_from_json(&c, k ? "extra variables" : "variables", objs[k], lens[k]);
        if (o->k != TV_DICT) mq_tt_fail(&c, MOEQ_E_FORMAT, 0, "%s: expected a JSON object", k ? "extra variables" : "variables");
        for (size_t i = 0; i < o->u.d.n; i++) mq_tv_dict_set(&c, vars, o->u.d.key[i], o->u.d.val[i]);
    }
    moeq_status st = mq_tt_render(&t->t, &c, vars, out, out_len);
    mq_tt_arena_free(arena);
    free(arena);
    return st;
}

moeq_status moeq_chat_template_render(const moeq_chat_template *t, const char *vars_json, size_t len,
                                      char **out, size_t *out_len) {
    if (!vars_json) return mq_err(MOEQ_E_ARG, "moeq_chat_template_render: vars_json is NULL");
    return render(t, vars_json, len, NULL, 0, 0, NULL, out, out_len);
}

moeq_status moeq_chat_apply(const moeq_chat_template *t, const char *messages_json, size_t len,
                            int add_generation_prompt, const char *extra_json, char **out,
                            size_t *out_len) {
    if (!messages_json) return mq_err(MOEQ_E_ARG, "moeq_chat_apply: messages_json is NULL");
    return render(t, NULL, 0, messages_json, len, add_generation_prompt, extra_json, out, out_len);
}
