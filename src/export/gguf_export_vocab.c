/*
 * The tokenizer of a checkpoint as llama.cpp's gpt2 vocabulary (tokens, types, merges, special
 * ids, the pre-tokenizer's name). Part of the checkpoint -> GGUF converter (gguf_export.c).
 */
#include <stdlib.h>
#include <string.h>

#include "export/gguf_export_internal.h"
#include "io/tokenizer.h"

/* ---- the tokenizer ------------------------------------------------------------------------------ */

/* a == b, where a may spell CR and LF as the regex escapes \r and \n */
static bool same_regex(const char *a, const char *b) {
    for (; *a && *b; a++, b++) {
        if (a[0] == '\\' && (a[1] == 'r' || a[1] == 'n') && *b == (a[1] == 'r' ? '\r' : '\n')) {
            a++;
            continue;
        }
        if (*a != *b) return false;
        if (*a == '\\') {   /* an escape pair is compared whole */
            a++, b++;
            if (*a != *b) return false;
            if (!*a) return true;
        }
    }
    return !*a && !*b;
}

/* tokenizer.ggml.pre from the pre_tokenizer block: a lone byte-level split with GPT-2's regex is
 * "gpt-2"; a Split with Llama 3's or Qwen2's regex followed by a regex-less byte level is
 * "llama-bpe" or "qwen2". Anything else is refused: llama.cpp would split differently. */
static moeq_status pick_pre(const cJSON *tok, const char *path, const char **pre) {
    const cJSON *p = item(tok, "pre_tokenizer");
    const cJSON *ty = p ? item(p, "type") : NULL;
    if (ty && cJSON_IsString(ty) && !strcmp(ty->valuestring, "ByteLevel")) {
        if (flag(p, "use_regex", true) && !flag(p, "add_prefix_space", false)) {
            *pre = "gpt-2";
            return MOEQ_OK;
        }
    } else if (ty && cJSON_IsString(ty) && !strcmp(ty->valuestring, "Sequence")) {
        const cJSON *l = item(p, "pretokenizers");
        if (l && cJSON_GetArraySize(l) == 4) {   /* DeepSeek-V3's */
            bool ok = true;
            for (int i = 0; ok && i < 3; i++) {
                const cJSON *sp = cJSON_GetArrayItem(l, i), *t0 = item(sp, "type"), *pat = item(sp, "pattern");
                const cJSON *re = pat ? item(pat, "Regex") : NULL;
                ok = t0 && cJSON_IsString(t0) && !strcmp(t0->valuestring, "Split") && re && cJSON_IsString(re) &&
                     same_regex(re->valuestring, mq_gguf_re_deepseek3[i]);
            }
            const cJSON *bl = cJSON_GetArrayItem(l, 3), *t3 = item(bl, "type");
            if (ok && t3 && cJSON_IsString(t3) && !strcmp(t3->valuestring, "ByteLevel") && !flag(bl, "use_regex", true)) {
                *pre = "deepseek-v3";
                return MOEQ_OK;
            }
        }
        if (l && cJSON_GetArraySize(l) == 2) {
            const cJSON *sp = cJSON_GetArrayItem(l, 0), *bl = cJSON_GetArrayItem(l, 1);
            const cJSON *t0 = item(sp, "type"), *t1 = item(bl, "type"), *pat = item(sp, "pattern");
            const cJSON *re = pat ? item(pat, "Regex") : NULL;
            if (t0 && t1 && re && cJSON_IsString(t0) && cJSON_IsString(t1) && cJSON_IsString(re) &&
                !strcmp(t0->valuestring, "Split") && !strcmp(t1->valuestring, "ByteLevel") &&
                !flag(bl, "use_regex", true)) {
                if (!strcmp(re->valuestring, mq_gguf_re_llama3)) *pre = "llama-bpe";
                else if (!strcmp(re->valuestring, mq_gguf_re_qwen2)) *pre = "qwen2";
                else *pre = NULL;
                if (*pre) return MOEQ_OK;
            }
        }
    }
    return mq_err(MOEQ_E_UNSUPPORTED, "%s: pre_tokenizer is none of those llama.cpp names (GPT-2 byte level, "
                  "Llama 3, Qwen2 or DeepSeek-V3 splits): its tokens would differ", path);
}


void mq_gguf_vocab_free(vocab *v) {
    for (int64_t i = 0; i < v->n; i++) free(v->tok ? v->tok[i] : NULL);
    for (int64_t i = 0; i < v->n_merges; i++) free(v->merges[i]);
    MQ_FREE_EACH(v->tok, v->len, v->type, v->merges, v->mlen);
}

/* A special token's id as moeq's tokenizer takes it (io/tokenizer.c): tokenizer_config.json's
 * token string first, else config.json's *_token_id. */
static int32_t id_of(const vocab *v, const cJSON *cfg_id, const cJSON *tc, const char *key) {
    const cJSON *t = tc ? item(tc, key) : NULL;
    if (t && cJSON_IsObject(t)) t = item(t, "content");
    if (t && cJSON_IsString(t))
        for (int64_t i = 0; i < v->n; i++)
            if (v->tok[i] && v->len[i] == strlen(t->valuestring) && !memcmp(v->tok[i], t->valuestring, v->len[i]))
                return (int32_t)i;
    if (cfg_id && cJSON_IsArray(cfg_id)) cfg_id = cJSON_GetArrayItem(cfg_id, 0);
    int64_t id;
    /* an id that is no id of the vocabulary is none */
    if (cfg_id && cJSON_IsNumber(cfg_id) && mq_int_of(cfg_id->valuedouble, 0, v->n - 1, &id)) return (int32_t)id;
    return -1;
}

/* A tiktoken.model (Kimi K2) as llama.cpp's converter writes it: the ranks' bytes in the
 * byte-level alphabet, the merges recovered from the ranks in rank order, the specials as control
 * tokens, the split pattern by name ("kimi-k2"). */
static moeq_status read_vocab_tiktoken(const char *dir, const cJSON *cfg, int64_t vocab_size, vocab *v) {
    char *path = mq_path_join(dir, "tiktoken.model");
    moeq_tokenizer *tok = NULL;
    cJSON *tc = NULL;
    int32_t *pairs = NULL;
    size_t np = 0;
    moeq_status s = path ? moeq_tokenizer_load(path, &tok) : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s && !(v->pre = mq_tokenizer_pre_name(tok)))
        s = mq_err(MOEQ_E_UNSUPPORTED, "%s: its split pattern has no llama.cpp name", path);
    if (!s && moeq_tokenizer_vocab_size(tok) > vocab_size)
        s = mq_err(MOEQ_E_FORMAT, "%s: token ids reach %d, past vocab_size %lld", path,
                   moeq_tokenizer_vocab_size(tok) - 1, (long long)vocab_size);
    if (!s) s = mq_gguf_read_json(dir, "tokenizer_config.json", false, &tc);
    if (!s) s = mq_tokenizer_merges(tok, &pairs, &np);
    if (!s) {
        v->n = vocab_size;
        v->tok = calloc((size_t)vocab_size, sizeof *v->tok);
        v->len = calloc((size_t)vocab_size, sizeof *v->len);
        v->type = calloc((size_t)vocab_size, sizeof *v->type);
        v->merges = calloc(np + 1, sizeof *v->merges);
        v->mlen = calloc(np + 1, sizeof *v->mlen);
        if (!v->tok || !v->len || !v->type || !v->merges || !v->mlen) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    for (int64_t i = 0; !s && i < vocab_size; i++) {
        const char *t = moeq_tokenizer_token(tok, (int32_t)i);
        v->tok[i] = t ? mq_strdup(t) : mq_asprintf("[PAD%lld]", (long long)i);
        v->type[i] = !t ? 5 : mq_tokenizer_is_added(tok, (int32_t)i) ? 3 : 1;
        if (!v->tok[i]) s = mq_err(MOEQ_E_NOMEM, "out of memory");
        else v->len[i] = strlen(v->tok[i]);
    }
    for (size_t i = 0; !s && i < np; i++) {
        char *m = mq_asprintf("%s %s", moeq_tokenizer_token(tok, pairs[2 * i]), moeq_tokenizer_token(tok, pairs[2 * i + 1]));
        if (!m) s = mq_err(MOEQ_E_NOMEM, "out of memory");
        else v->mlen[v->n_merges] = strlen(m), v->merges[v->n_merges++] = m;
    }
    if (!s) {
        v->bos = id_of(v, item(cfg, "bos_token_id"), tc, "bos_token");
        v->eos = id_of(v, item(cfg, "eos_token_id"), tc, "eos_token");
        v->pad = id_of(v, item(cfg, "pad_token_id"), tc, "pad_token");
        v->add_bos = tc ? flag(tc, "add_bos_token", false) : false;
    }
    free(pairs);
    cJSON_Delete(tc);
    moeq_tokenizer_free(tok);
    free(path);
    return s;
}

moeq_status mq_gguf_read_vocab(const char *dir, const cJSON *cfg, int64_t vocab_size, vocab *v) {
    memset(v, 0, sizeof *v);
    char *found = mq_tokenizer_find(dir);   /* tokenizer.json first, as the loader takes it */
    size_t fl = found ? strlen(found) : 0;
    bool tiktoken = fl >= 14 && !strcmp(found + fl - 14, "tiktoken.model");
    free(found);
    if (tiktoken) return read_vocab_tiktoken(dir, cfg, vocab_size, v);
    cJSON *tok, *tc;
    moeq_status s = mq_gguf_read_json(dir, "tokenizer.json", true, &tok);
    if (s) return s;
    if ((s = mq_gguf_read_json(dir, "tokenizer_config.json", false, &tc))) {
        cJSON_Delete(tok);
        return s;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    const cJSON *model = item(tok, "model"), *mty = model ? item(model, "type") : NULL;
    const cJSON *voc = model ? item(model, "vocab") : NULL, *mer = model ? item(model, "merges") : NULL;
    const cJSON *added = item(tok, "added_tokens");
    if (!mty || !cJSON_IsString(mty) || strcmp(mty->valuestring, "BPE") || !voc || !cJSON_IsObject(voc)) {
        s = mq_err(MOEQ_E_UNSUPPORTED, "%s: only byte-level BPE tokenizers are written to GGUF", path);
        goto done;
    }
    if ((s = pick_pre(tok, path, &v->pre))) goto done;
    /* every id a row of the embedding: [0, vocab_size) */
    const int64_t n = vocab_size;
    const cJSON *e;
    double top = -1;
    cJSON_ArrayForEach(e, voc) if (cJSON_IsNumber(e) && e->valuedouble > top) top = e->valuedouble;
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = item(e, "id");
        if (id && cJSON_IsNumber(id) && id->valuedouble > top) top = id->valuedouble;
    }
    if (top >= (double)vocab_size) {
        s = mq_err(MOEQ_E_FORMAT, "%s: token ids reach %.0f, past vocab_size %lld", path, top, (long long)vocab_size);
        goto done;
    }
    v->n = n;
    v->tok = calloc((size_t)n, sizeof *v->tok);
    v->len = calloc((size_t)n, sizeof *v->len);
    v->type = calloc((size_t)n, sizeof *v->type);
    if (!v->tok || !v->len || !v->type) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    cJSON_ArrayForEach(e, voc) {
        int64_t id;
        if (!cJSON_IsNumber(e) || !mq_int_of(e->valuedouble, 0, n - 1, &id)) {
            s = mq_err(MOEQ_E_FORMAT, "%s: vocab entry '%s' has no valid id", path, e->string);
            goto done;
        }
        free(v->tok[id]);
        v->tok[id] = mq_strdup(e->string);
        v->len[id] = strlen(e->string);
        v->type[id] = 1;
        if (!v->tok[id]) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory");
            goto done;
        }
    }
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = item(e, "id"), *content = item(e, "content");
        int64_t i;
        if (!id || !cJSON_IsNumber(id) || !mq_int_of(id->valuedouble, 0, n - 1, &i) || !content ||
            !cJSON_IsString(content))
            continue;
        free(v->tok[i]);
        v->tok[i] = mq_strdup(content->valuestring);
        v->len[i] = strlen(content->valuestring);
        v->type[i] = flag(e, "special", false) ? 3 : 4;
        if (!v->tok[i]) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory");
            goto done;
        }
    }
    for (int64_t i = 0; i < n; i++)
        if (!v->tok[i]) {   /* rows of the embedding past the tokenizer: llama.cpp's padding names */
            v->tok[i] = mq_asprintf("[PAD%lld]", (long long)i);
            if (!v->tok[i]) {
                s = mq_err(MOEQ_E_NOMEM, "out of memory");
                goto done;
            }
            v->len[i] = strlen(v->tok[i]);
            v->type[i] = 5;
        }
    int64_t nm = mer && cJSON_IsArray(mer) ? cJSON_GetArraySize(mer) : 0;
    v->merges = calloc((size_t)(nm ? nm : 1), sizeof *v->merges);
    v->mlen = calloc((size_t)(nm ? nm : 1), sizeof *v->mlen);
    if (!v->merges || !v->mlen) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    cJSON_ArrayForEach(e, mer) {
        char *m = NULL;
        if (cJSON_IsString(e)) m = mq_strdup(e->valuestring);
        else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                 cJSON_IsString(cJSON_GetArrayItem(e, 1)))
            m = mq_asprintf("%s %s", cJSON_GetArrayItem(e, 0)->valuestring, cJSON_GetArrayItem(e, 1)->valuestring);
        else {
            s = mq_err(MOEQ_E_FORMAT, "%s: merge %lld is neither \"a b\" nor [a, b]", path, (long long)v->n_merges);
            goto done;
        }
        if (!m) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory");
            goto done;
        }
        v->merges[v->n_merges] = m;
        v->mlen[v->n_merges++] = strlen(m);
    }
    v->bos = id_of(v, item(cfg, "bos_token_id"), tc, "bos_token");
    v->eos = id_of(v, item(cfg, "eos_token_id"), tc, "eos_token");
    v->pad = id_of(v, item(cfg, "pad_token_id"), tc, "pad_token");
    v->add_bos = tc ? flag(tc, "add_bos_token", false) : false;
done:
    cJSON_Delete(tok);
    cJSON_Delete(tc);
    return s;
}
