/*
 * Loading a tokenizer (tokenizer.h says what is supported): tokenizer.json as the Hugging Face
 * tokenizers crate reads it (model vocabulary and merges, added tokens, pre-tokenizer Split and
 * ByteLevel stages, NFC normalizer, special ids from tokenizer_config.json), Kimi K2's
 * tiktoken.model (base64 token bytes and rank per line) into the same tables, and a GGUF's
 * tokenizer.ggml.* through io/gguf_hf.h. Encoding and decoding: tokenizer.c.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "io/tokenizer.h"
#include "io/gguf_hf.h"
#include "io/tokenizer_internal.h"

#include <cjson/cJSON.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Appends a NUL-terminated copy of s[0..n) to the arena; returns its offset via *off. */
static moeq_status arena_add(moeq_tokenizer *t, const char *s, size_t n, uint32_t *off) {
    size_t need = t->arena_len + n + 1;
    if (need > UINT32_MAX) return mq_err(MOEQ_E_FORMAT, "%s: vocabulary strings too large", t->path);
    if (need > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 1 << 16;
        while (cap < need) cap *= 2;
        char *a = realloc(t->arena, cap);
        if (!a) return mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
        t->arena = a;
        t->arena_cap = cap;
    }
    memcpy(t->arena + t->arena_len, s, n);
    t->arena[t->arena_len + n] = 0;
    *off = (uint32_t)t->arena_len;
    t->arena_len = need;
    return MOEQ_OK;
}

/* Adds a vocabulary entry (a repeated string keeps the last id, like a serde HashMap). */
static moeq_status vocab_add(moeq_tokenizer *t, const char *s, size_t n, int32_t id) {
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->v_mask;
    for (;;) {
        uint32_t e = t->v_slots[i];
        if (!e) break;
        e--;
        if (t->v_len[e] == n && memcmp(t->arena + t->v_off[e], s, n) == 0) {
            t->v_id[e] = id;
            return MOEQ_OK;
        }
        i = (i + 1) & t->v_mask;
    }
    uint32_t e = t->n_vocab++;
    moeq_status st = arena_add(t, s, n, &t->v_off[e]);
    if (st) return st;
    t->v_len[e] = (uint32_t)n;
    t->v_id[e] = id;
    t->v_slots[i] = e + 1;
    return MOEQ_OK;
}

/* A repeated pair keeps the last rank, as HF's HashMap collect does. */
static void merge_put(moeq_tokenizer *t, int32_t a, int32_t b, uint32_t rank, int32_t new_id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t mask = (1ull << (64 - t->m_shift)) - 1;
    uint64_t i = (key * 0x9e3779b97f4a7c15ull) >> t->m_shift;
    while (t->m_slots[i].key != EMPTY_KEY && t->m_slots[i].key != key) i = (i + 1) & mask;
    t->m_slots[i].key = key;
    t->m_slots[i].rank = rank;
    t->m_slots[i].new_id = new_id;
}

/* ---- loading ---------------------------------------------------------------------------------- */

static moeq_status parse_json_file(const char *path, cJSON **out) {
    char *text = NULL;
    size_t len = 0;
    *out = NULL;
    moeq_status st = mq_read_file(path, &text, &len);
    if (st) return st;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root) {
        size_t at = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        free(text);
        return mq_err(MOEQ_E_FORMAT, "%s: not valid JSON (error near byte %zu)", path, at);
    }
    free(text);
    *out = root;
    return MOEQ_OK;
}

static const cJSON *jget(const cJSON *obj, const char *key) {
    return cJSON_IsObject(obj) ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
}

/* Reads an optional boolean field (absent or null: def). */
static moeq_status jbool(const moeq_tokenizer *t, const cJSON *obj, const char *where,
                         const char *key, bool def, bool *out) {
    const cJSON *v = jget(obj, key);
    *out = def;
    if (!v || cJSON_IsNull(v)) return MOEQ_OK;
    if (!cJSON_IsBool(v))
        return mq_err(MOEQ_E_FORMAT, "%s: %s.%s must be true or false", t->path, where, key);
    *out = cJSON_IsTrue(v);
    return MOEQ_OK;
}

static bool json_id(const cJSON *v, int32_t *id) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0 && d < MAX_ID) || d != (double)(int32_t)d) return false;
    *id = (int32_t)d;
    return true;
}

static moeq_status unsupported(const moeq_tokenizer *t, const char *field, const cJSON *type,
                               const char *what) {
    return mq_err(MOEQ_E_UNSUPPORTED, "%s: %s '%s' is not supported (moeq reads %s)", t->path, field,
                  cJSON_IsString(type) ? type->valuestring : "(missing)", what);
}

static void build_byte_alphabet(moeq_tokenizer *t) {
    /* GPT-2 bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
     * take the code points 256, 257, ... in byte order. */
    int extra = 0;
    for (int i = 0; i < 512; i++) t->u2b[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        t->b2u[b] = (uint16_t)(printable ? b : 256 + extra++);
        t->u2b[t->b2u[b]] = (int16_t)b;
    }
}

/* Room for n vocabulary entries. */
static moeq_status vocab_alloc(moeq_tokenizer *t, size_t n) {
    t->vocab_cap = (uint32_t)(n + 1);
    t->v_off = malloc(sizeof(uint32_t) * (n + 1));
    t->v_len = malloc(sizeof(uint32_t) * (n + 1));
    t->v_id = malloc(sizeof(int32_t) * (n + 1));
    uint32_t slots = pow2_at_least(2 * n + 2);
    t->v_slots = calloc(slots, sizeof(uint32_t));
    t->v_mask = slots - 1;
    if (!t->v_off || !t->v_len || !t->v_id || !t->v_slots)
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory for the vocabulary", t->path);
    return MOEQ_OK;
}

static moeq_status parse_vocab(moeq_tokenizer *t, const cJSON *vocab) {
    if (!cJSON_IsObject(vocab))
        return mq_err(MOEQ_E_FORMAT, "%s: model.vocab must be an object of token -> id", t->path);
    moeq_status st = vocab_alloc(t, (size_t)cJSON_GetArraySize(vocab));
    if (st) return st;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        int32_t id;
        if (!json_id(e, &id))
            return mq_err(MOEQ_E_FORMAT, "%s: model.vocab['%s']: id must be an integer in [0, %d)",
                          t->path, e->string ? e->string : "", MAX_ID);
        if ((st = vocab_add(t, e->string, strlen(e->string), id))) return st;
        if (id >= t->n_ids) t->n_ids = id + 1;
    }
    return MOEQ_OK;
}

/* One merge entry: "a b" (legacy) or ["a", "b"]. */
static moeq_status merge_parts(const moeq_tokenizer *t, const cJSON *m, size_t idx, const char **a,
                               size_t *na, const char **b, size_t *nb) {
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring, *sp = strchr(s, ' ');
        if (!sp || strchr(sp + 1, ' '))
            return mq_err(MOEQ_E_FORMAT, "%s: model.merges[%zu] '%s' is not two tokens separated by "
                          "one space", t->path, idx, s);
        *a = s;
        *na = (size_t)(sp - s);
        *b = sp + 1;
        *nb = strlen(sp + 1);
        return MOEQ_OK;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
        cJSON_IsString(m->child->next)) {
        *a = m->child->valuestring;
        *na = strlen(*a);
        *b = m->child->next->valuestring;
        *nb = strlen(*b);
        return MOEQ_OK;
    }
    return mq_err(MOEQ_E_FORMAT, "%s: model.merges[%zu] must be \"a b\" or [\"a\", \"b\"]", t->path,
                  idx);
}

/* Room for n merges. */
static moeq_status merges_alloc(moeq_tokenizer *t, size_t n) {
    uint32_t cap = pow2_at_least(2 * n + 2);
    int bits = 0;
    while ((1u << bits) < cap) bits++;
    t->m_shift = 64 - bits;
    t->m_slots = malloc(sizeof(merge_slot) * cap);
    if (!t->m_slots) return mq_err(MOEQ_E_NOMEM, "%s: out of memory for the merges", t->path);
    for (uint32_t i = 0; i < cap; i++) t->m_slots[i].key = EMPTY_KEY;
    return MOEQ_OK;
}

static moeq_status parse_merges(moeq_tokenizer *t, const cJSON *merges) {
    if (merges && !cJSON_IsArray(merges))
        return mq_err(MOEQ_E_FORMAT, "%s: model.merges must be an array", t->path);
    moeq_status st = merges_alloc(t, merges ? (size_t)cJSON_GetArraySize(merges) : 0);
    if (st) return st;
    char *buf = NULL;
    size_t buf_cap = 0, idx = 0;
    for (const cJSON *m = merges ? merges->child : NULL; m; m = m->next, idx++) {
        const char *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        if ((st = merge_parts(t, m, idx, &a, &na, &b, &nb))) break;
        if (na + nb + 1 > buf_cap) {
            buf_cap = 2 * (na + nb + 1);
            char *nbuf = realloc(buf, buf_cap);
            if (!nbuf) {
                st = mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
                break;
            }
            buf = nbuf;
        }
        memcpy(buf, a, na);
        memcpy(buf + na, b, nb);
        int32_t ia = vocab_find(t, a, na), ib = vocab_find(t, b, nb);
        int32_t im = vocab_find(t, buf, na + nb);
        if (ia < 0 || ib < 0 || im < 0) {
            const char *miss = ia < 0 ? a : ib < 0 ? b : buf;
            int nmiss = (int)(ia < 0 ? na : ib < 0 ? nb : na + nb);
            st = mq_err(MOEQ_E_FORMAT, "%s: model.merges[%zu]: token '%.*s' is not in the vocabulary",
                        t->path, idx, nmiss, miss);
            break;
        }
        merge_put(t, ia, ib, (uint32_t)idx, im);
    }
    free(buf);
    return st;
}

static moeq_status parse_model(moeq_tokenizer *t, const cJSON *model) {
    if (!cJSON_IsObject(model)) return mq_err(MOEQ_E_FORMAT, "%s: 'model' object missing", t->path);
    const cJSON *type = jget(model, "type");
    if (type ? !(cJSON_IsString(type) && !strcmp(type->valuestring, "BPE"))
             : !jget(model, "merges"))
        return unsupported(t, "model.type", type, "BPE only");
    const cJSON *v = jget(model, "dropout");
    if (v && !cJSON_IsNull(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: model.dropout is not supported (encoding would be "
                      "random)", t->path);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        v = jget(model, affixes[i]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && !v->valuestring[0]))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: model.%s is not supported", t->path, affixes[i]);
    }
    moeq_status st;
    if ((st = jbool(t, model, "model", "fuse_unk", false, &t->fuse_unk)) ||
        (st = jbool(t, model, "model", "byte_fallback", false, &t->byte_fallback)) ||
        (st = jbool(t, model, "model", "ignore_merges", false, &t->ignore_merges)) ||
        (st = parse_vocab(t, jget(model, "vocab"))) || (st = parse_merges(t, jget(model, "merges"))))
        return st;
    t->unk_id = -1;
    v = jget(model, "unk_token");
    if (cJSON_IsString(v)) {
        t->unk_id = vocab_find(t, v->valuestring, strlen(v->valuestring));
        if (t->unk_id < 0)
            return mq_err(MOEQ_E_FORMAT, "%s: model.unk_token '%s' is not in the vocabulary", t->path,
                          v->valuestring);
    }
    return MOEQ_OK;
}

static moeq_status parse_added(moeq_tokenizer *t, const cJSON *arr) {
    if (!arr || cJSON_IsNull(arr)) return MOEQ_OK;
    if (!cJSON_IsArray(arr)) return mq_err(MOEQ_E_FORMAT, "%s: added_tokens must be an array", t->path);
    size_t n = (size_t)cJSON_GetArraySize(arr);
    t->added = calloc(n + 1, sizeof(added_token));
    if (!t->added) return mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
    size_t i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        char where[48];
        snprintf(where, sizeof where, "added_tokens[%zu]", i);
        const cJSON *content = jget(e, "content");
        added_token *a = &t->added[t->n_added];
        if (!json_id(jget(e, "id"), &a->id))
            return mq_err(MOEQ_E_FORMAT, "%s: %s.id must be an integer in [0, %d)", t->path, where,
                          MAX_ID);
        if (!cJSON_IsString(content) || !content->valuestring[0])
            return mq_err(MOEQ_E_FORMAT, "%s: %s.content must be a non-empty string", t->path, where);
        moeq_status st;
        if ((st = jbool(t, e, where, "single_word", false, &a->single_word)) ||
            (st = jbool(t, e, where, "lstrip", false, &a->lstrip)) ||
            (st = jbool(t, e, where, "rstrip", false, &a->rstrip)) ||
            (st = jbool(t, e, where, "normalized", true, &a->normalized)))
            return st;
        a->len = (uint32_t)strlen(content->valuestring);
        if ((st = arena_add(t, content->valuestring, a->len, &a->off))) return st;
        if (a->id >= t->n_ids) t->n_ids = a->id + 1;
        t->n_added++;
    }
    return MOEQ_OK;
}

static moeq_status build_added_index(moeq_tokenizer *t) {
    bool need_word = false;
    for (int p = 0; p < 2; p++) {
        added_index *ix = &t->pass[p];
        ix->order = malloc(sizeof(uint32_t) * (t->n_added + 1));
        if (!ix->order) return mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
        uint32_t n = 0;
        for (uint32_t i = 0; i < t->n_added; i++)
            if (t->added[i].normalized == (p == 1)) ix->order[n++] = i;
        /* Insertion sort keeps this free of global state; the lists are short. */
        for (uint32_t i = 1; i < n; i++) {
            uint32_t x = ix->order[i], j = i;
            while (j > 0) {
                const added_token *a = &t->added[ix->order[j - 1]], *b = &t->added[x];
                uint8_t fa = (uint8_t)t->arena[a->off], fb = (uint8_t)t->arena[b->off];
                if (fa < fb || (fa == fb && a->len >= b->len)) break;
                ix->order[j] = ix->order[j - 1];
                j--;
            }
            ix->order[j] = x;
        }
        memset(ix->start, 0, sizeof ix->start);
        for (uint32_t i = 0; i < n; i++) ix->start[(uint8_t)t->arena[t->added[ix->order[i]].off] + 1]++;
        for (int b = 0; b < 256; b++) ix->start[b + 1] += ix->start[b];
    }
    for (uint32_t i = 0; i < t->n_added; i++) need_word |= t->added[i].single_word;
    if (need_word) {
        int err;
        PCRE2_SIZE off;
        t->word_re = pcre2_compile((PCRE2_SPTR) "\\w", PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &err, &off, NULL);
        if (!t->word_re) return mq_err(MOEQ_E_NOMEM, "%s: cannot compile \\w", t->path);
    }
    return MOEQ_OK;
}

static moeq_status add_split(moeq_tokenizer *t, const char *where, const char *pat, bool literal) {
    if (t->n_split >= MAX_SPLITS)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: %s: more than %d split regexes", t->path, where,
                      MAX_SPLITS);
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0), &err,
                                   &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: %s: regex not accepted by PCRE2 at offset %zu: %s",
                      t->path, where, (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);   /* falls back to the interpreter if it fails */
    t->split[t->n_split++] = re;
    return MOEQ_OK;
}

static moeq_status parse_byte_level(moeq_tokenizer *t, const cJSON *pt, const char *where) {
    bool use_regex;
    moeq_status st;
    if ((st = jbool(t, pt, where, "add_prefix_space", true, &t->prefix_space)) ||
        (st = jbool(t, pt, where, "use_regex", true, &use_regex)))
        return st;
    t->bl_level = t->n_split;
    return use_regex ? add_split(t, where, GPT2_SPLIT, false) : MOEQ_OK;
}

static moeq_status parse_split(moeq_tokenizer *t, const cJSON *pt, const char *where) {
    const cJSON *pat = jget(pt, "pattern"), *beh = jget(pt, "behavior");
    bool invert;
    moeq_status st = jbool(t, pt, where, "invert", false, &invert);
    if (st) return st;
    if (invert)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: %s.invert true is not supported", t->path, where);
    if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated")) {
        char field[80];
        snprintf(field, sizeof field, "%s.behavior", where);
        return unsupported(t, field, beh, "Isolated");
    }
    const cJSON *re = jget(pat, "Regex"), *lit = jget(pat, "String");
    if (cJSON_IsString(re)) return add_split(t, where, re->valuestring, false);
    if (cJSON_IsString(lit)) return add_split(t, where, lit->valuestring, true);
    return mq_err(MOEQ_E_FORMAT, "%s: %s.pattern must be {\"Regex\": ...} or {\"String\": ...}",
                  t->path, where);
}

static moeq_status parse_pre_tokenizer(moeq_tokenizer *t, const cJSON *pt) {
    const cJSON *type = jget(pt, "type");
    const char *ty = cJSON_IsString(type) ? type->valuestring : "";
    if (!strcmp(ty, "ByteLevel")) return parse_byte_level(t, pt, "pre_tokenizer");
    if (strcmp(ty, "Sequence"))
        return unsupported(t, "pre_tokenizer.type", type, "ByteLevel or Sequence[Split..., ByteLevel]");
    const cJSON *list = jget(pt, "pretokenizers");
    int n = cJSON_IsArray(list) ? cJSON_GetArraySize(list) : 0, i = 0;
    for (const cJSON *e = n ? list->child : NULL; e; e = e->next, i++) {
        char where[64];
        snprintf(where, sizeof where, "pre_tokenizer.pretokenizers[%d]", i);
        const cJSON *et = jget(e, "type");
        const char *ety = cJSON_IsString(et) ? et->valuestring : "";
        moeq_status st;
        if (!strcmp(ety, "Split") && i < n - 1)
            st = parse_split(t, e, where);
        else if (!strcmp(ety, "ByteLevel") && i == n - 1)
            st = parse_byte_level(t, e, where);
        else {
            char field[80];
            snprintf(field, sizeof field, "%s.type", where);
            st = unsupported(t, field, et, "Split entries followed by one ByteLevel");
        }
        if (st) return st;
    }
    if (n == 0)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: pre_tokenizer.pretokenizers is empty (moeq reads "
                      "Split entries followed by one ByteLevel)", t->path);
    return MOEQ_OK;
}

/* null, NFC, or a Sequence of NFC entries. */
static moeq_status parse_normalizer(moeq_tokenizer *t, const cJSON *norm) {
    if (!norm || cJSON_IsNull(norm)) return MOEQ_OK;
    const cJSON *type = jget(norm, "type");
    const char *ty = cJSON_IsString(type) ? type->valuestring : "";
    if (!strcmp(ty, "NFC")) {
        t->nfc = true;
        return MOEQ_OK;
    }
    if (strcmp(ty, "Sequence")) return unsupported(t, "normalizer.type", type, "null or NFC");
    const cJSON *list = jget(norm, "normalizers");
    int i = 0;
    for (const cJSON *e = cJSON_IsArray(list) ? list->child : NULL; e; e = e->next, i++) {
        const cJSON *et = jget(e, "type");
        if (!cJSON_IsString(et) || strcmp(et->valuestring, "NFC")) {
            char field[64];
            snprintf(field, sizeof field, "normalizer.normalizers[%d].type", i);
            return unsupported(t, field, et, "NFC only");
        }
        t->nfc = true;
    }
    return MOEQ_OK;
}

/* Per-id token strings and decoded bytes, byte ids of the alphabet. */
static moeq_status build_id_tables(moeq_tokenizer *t) {
    size_t n = (size_t)t->n_ids;
    t->id_off = malloc(sizeof(int64_t) * (n + 1));
    t->id_len = calloc(n + 1, sizeof(uint32_t));
    t->dec_off = calloc(n + 1, sizeof(uint32_t));
    t->dec_len = calloc(n + 1, sizeof(uint32_t));
    t->dec = malloc(t->arena_len + 1);
    if (!t->id_off || !t->id_len || !t->dec_off || !t->dec_len || !t->dec)
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
    for (size_t i = 0; i < n; i++) t->id_off[i] = -1;
    /* The first vocabulary entry of an id names it; an added token overrides (HF id_to_token). */
    for (uint32_t e = 0; e < t->n_vocab; e++)
        if (t->id_off[t->v_id[e]] < 0) {
            t->id_off[t->v_id[e]] = t->v_off[e];
            t->id_len[t->v_id[e]] = t->v_len[e];
        }
    for (uint32_t i = 0; i < t->n_added; i++) {
        t->id_off[t->added[i].id] = t->added[i].off;
        t->id_len[t->added[i].id] = t->added[i].len;
    }
    /* ByteLevel decoder: all characters in the alphabet -> their bytes, else the raw UTF-8. */
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (t->id_off[i] < 0) continue;
        const uint8_t *s = (const uint8_t *)t->arena + t->id_off[i];
        size_t len = t->id_len[i], k = 0, o = at;
        bool mapped = true;
        while (k < len) {
            uint32_t cp;
            int step = utf8_step(s, len, k, &cp);
            if (step < 0 || cp >= 512 || t->u2b[cp] < 0) {
                mapped = false;
                break;
            }
            t->dec[o++] = (char)t->u2b[cp];
            k += (size_t)step;
        }
        if (!mapped) {
            memcpy(t->dec + at, s, len);
            o = at + len;
        }
        t->dec_off[i] = (uint32_t)at;
        t->dec_len[i] = (uint32_t)(o - at);
        at = o;
    }
    for (int b = 0; b < 256; b++) {
        char c[2];
        int len = put_cp(c, t->b2u[b]);
        t->byte_id[b] = vocab_find(t, c, (size_t)len);
        /* HF byte_fallback looks up "<0xXX>" for each UTF-8 byte of the (mapped) character. */
        for (int k = 0; k < 2; k++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", k < len ? (uint8_t)c[k] : 0);
            t->fallback_id[b][k] = k < len ? vocab_find(t, name, 6) : -1;
        }
        if (len == 2 && t->fallback_id[b][0] >= 0 && t->fallback_id[b][1] < 0)
            t->fallback_id[b][0] = -1;   /* all bytes must exist, else unk */
    }
    return MOEQ_OK;
}

/* "X" or {"content": "X"} -> id, -1 when absent or unknown. */
static int32_t special_from_config(const moeq_tokenizer *t, const cJSON *v) {
    if (cJSON_IsObject(v)) v = jget(v, "content");
    if (!cJSON_IsString(v)) return -1;
    return mq_tokenizer_token_to_id(t, v->valuestring, strlen(v->valuestring));
}

static int32_t id_from_config(const cJSON *v) {
    if (cJSON_IsArray(v)) v = v->child;   /* eos_token_id may be a list: the first one */
    int32_t id;
    return json_id(v, &id) ? id : -1;
}

/* bos/eos from tokenizer_config.json next to tokenizer.json, else config.json's *_token_id. */
static moeq_status load_special_ids(moeq_tokenizer *t) {
    t->bos = t->eos = -1;
    const char *slash = strrchr(t->path, '/');
    char *dir = slash ? mq_strndup(t->path, (size_t)(slash - t->path + 1)) : mq_strdup("");
    if (!dir) return MOEQ_E_NOMEM;
    static const char *const files[2] = {"tokenizer_config.json", "config.json"};
    moeq_status st = MOEQ_OK;
    for (int f = 0; f < 2 && st == MOEQ_OK && (t->bos < 0 || t->eos < 0); f++) {
        char *p = mq_asprintf("%s%s", dir, files[f]);
        if (!p) {
            st = mq_err(MOEQ_E_NOMEM, "out of memory");
            break;
        }
        cJSON *root = NULL;
        if (mq_file_exists(p) && (st = parse_json_file(p, &root)) == MOEQ_OK) {
            if (f == 0) {
                if (t->bos < 0) t->bos = special_from_config(t, jget(root, "bos_token"));
                if (t->eos < 0) t->eos = special_from_config(t, jget(root, "eos_token"));
            } else {
                if (t->bos < 0) t->bos = id_from_config(jget(root, "bos_token_id"));
                if (t->eos < 0) t->eos = id_from_config(jget(root, "eos_token_id"));
            }
        }
        cJSON_Delete(root);
        free(p);
    }
    free(dir);
    return st;
}

/* tokenizer.json's document (root), read from t->path or made elsewhere (a GGUF's). */
static moeq_status load_json_root(moeq_tokenizer *t, const cJSON *root) {
    moeq_status st = MOEQ_OK;
    if (!cJSON_IsObject(root))
        st = mq_err(MOEQ_E_FORMAT, "%s: top level is not a JSON object", t->path);
    const cJSON *norm = jget(root, "normalizer"), *dec = jget(root, "decoder");
    if (st == MOEQ_OK) st = parse_normalizer(t, norm);
    if (st == MOEQ_OK && !(cJSON_IsString(jget(dec, "type")) &&
                           !strcmp(jget(dec, "type")->valuestring, "ByteLevel")))
        st = unsupported(t, "decoder.type", jget(dec, "type"), "ByteLevel");
    if (st == MOEQ_OK) st = parse_model(t, jget(root, "model"));
    if (st == MOEQ_OK) st = parse_added(t, jget(root, "added_tokens"));
    if (st == MOEQ_OK) st = parse_pre_tokenizer(t, jget(root, "pre_tokenizer"));
    return st;
}

static moeq_status load_json(moeq_tokenizer *t) {
    cJSON *root = NULL;
    moeq_status st = parse_json_file(t->path, &root);
    if (st == MOEQ_OK) st = load_json_root(t, root);
    cJSON_Delete(root);
    return st;
}

/* ---- tiktoken.model (Kimi K2) ------------------------------------------------------------------ */

/* tokenization_kimi.py's pat_str in PCRE2 terms. Its class intersections
 * [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]] become a negative lookahead before the class, and
 * \p{Han} is the Script property (sc:) as tiktoken's regex engine reads it: PCRE2's bare \p{Han}
 * means Script_Extensions, which also takes 、 and 。 (checked against tiktoken 0.14). */
const char mq_tokenizer_kimi_split[] =
    "[\\p{sc:Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?(?:(?!\\p{sc:Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])*"
    "(?:(?!\\p{sc:Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?(?:(?!\\p{sc:Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])+"
    "(?:(?!\\p{sc:Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

enum { KIMI_RESERVED = 256 };   /* tokenization_kimi.py: 256 special ids right after the ranks */

static int b64_value(uint8_t c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

/* Standard base64 with padding, s[0..n) -> out (room for 3n/4 bytes); the length, or -1. */
static long b64_decode(const char *s, size_t n, uint8_t *out) {
    if (n == 0 || n % 4) return -1;
    size_t pad = s[n - 1] == '=' ? (s[n - 2] == '=' ? 2 : 1) : 0;
    long len = 0;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t v = 0;
        for (size_t k = 0; k < 4; k++) {
            int d = i + k >= n - pad ? 0 : b64_value((uint8_t)s[i + k]);
            if (d < 0) return -1;
            v = v << 6 | (uint32_t)d;
        }
        size_t take = i + 4 == n ? 3 - pad : 3;
        for (size_t k = 0; k < take; k++) out[len++] = (uint8_t)(v >> (16 - 8 * k));
    }
    return len;
}

/* Lines "BASE64 RANK": every rank of 0..N-1 once, every byte among the tokens. */
static moeq_status read_ranks(moeq_tokenizer *t, const char *text, size_t len) {
    size_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    if (len && text[len - 1] != '\n') lines++;
    moeq_status st = vocab_alloc(t, lines);
    if (st) return st;
    uint8_t *raw = malloc(len + 1);
    char *mapped = malloc(2 * len + 2);
    bool *seen = calloc(lines + 1, 1);
    if (!raw || !mapped || !seen) st = mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
    size_t line = 0;
    for (size_t at = 0; st == MOEQ_OK && at < len; line++) {
        const char *ln = text + at, *nl = memchr(ln, '\n', len - at);
        size_t n = nl ? (size_t)(nl - ln) : len - at;
        at += n + 1;
        if (n && ln[n - 1] == '\r') n--;
        const char *sp = memchr(ln, ' ', n);
        long nb = sp ? b64_decode(ln, (size_t)(sp - ln), raw) : -1;
        char *end = NULL;
        long long rank = -1;
        if (sp && sp + 1 < ln + n && sp[1] >= '0' && sp[1] <= '9') {
            rank = strtoll(sp + 1, &end, 10);
            if (end != ln + n) rank = -1;
        }
        if (nb <= 0 || rank < 0) {
            st = mq_err(MOEQ_E_FORMAT, "%s: line %zu is not \"BASE64 RANK\"", t->path, line + 1);
            break;
        }
        if ((size_t)rank >= lines || seen[rank]) {
            st = mq_err(MOEQ_E_FORMAT, "%s: line %zu: rank %lld %s (the ranks must be 0..%zu, each "
                        "once)", t->path, line + 1, rank, (size_t)rank >= lines ? "is out of range" :
                        "repeats", lines - 1);
            break;
        }
        size_t k = 0;
        for (long i = 0; i < nb; i++) k += (size_t)put_cp(mapped + k, t->b2u[raw[i]]);
        if (vocab_find(t, mapped, k) >= 0) {
            st = mq_err(MOEQ_E_FORMAT, "%s: line %zu: the token of rank %lld repeats an earlier one",
                        t->path, line + 1, rank);
            break;
        }
        seen[rank] = true;
        st = vocab_add(t, mapped, k, (int32_t)rank);
    }
    t->n_ids = (int32_t)lines;
    for (int b = 0; st == MOEQ_OK && b < 256; b++) {
        char c[2];
        if (vocab_find(t, c, (size_t)put_cp(c, t->b2u[b])) < 0)
            st = mq_err(MOEQ_E_FORMAT, "%s: byte 0x%02x has no rank (tiktoken needs all 256)", t->path, b);
    }
    free(raw);
    free(mapped);
    free(seen);
    return st;
}

static moeq_status add_special(moeq_tokenizer *t, const char *content, int32_t id) {
    added_token *a = &t->added[t->n_added];
    a->id = id;
    a->len = (uint32_t)strlen(content);
    moeq_status st = arena_add(t, content, a->len, &a->off);
    if (st) return st;
    if (id >= t->n_ids) t->n_ids = id + 1;
    t->n_added++;
    return MOEQ_OK;
}

/* tokenizer_config.json: the module named by auto_map decides the split pattern (it lives in
 * Python code), added_tokens_decoder names the special ids; the unnamed of the 256 after the
 * ranks are "<|reserved_token_ID|>", as tokenization_kimi.py names them. Specials are matched
 * anywhere in the text, as its encode (tiktoken's allowed_special="all") does. */
static moeq_status tiktoken_config(moeq_tokenizer *t, const char *cfg_path) {
    if (!mq_file_exists(cfg_path))
        return mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer_config.json beside it (its auto_map names "
                      "the tokenizer's code, which holds the split pattern)", t->path);
    cJSON *cfg = NULL;
    moeq_status st = parse_json_file(cfg_path, &cfg);
    if (st) return st;
    const cJSON *am = jget(jget(cfg, "auto_map"), "AutoTokenizer");
    const cJSON *cls = cJSON_IsArray(am) ? am->child : am;
    const char *name = cJSON_IsString(cls) ? cls->valuestring : "(none)";
    if (strncmp(name, "tokenization_kimi.", 18)) {
        st = mq_err(MOEQ_E_UNSUPPORTED, "%s: auto_map.AutoTokenizer '%s': the split pattern of a "
                    "tiktoken tokenizer is in its Python code, and moeq knows Kimi's "
                    "(tokenization_kimi.TikTokenTokenizer)", cfg_path, name);
        goto done;
    }
    if ((st = add_split(t, "tiktoken.model (Kimi's split pattern)", mq_tokenizer_kimi_split, false))) goto done;
    t->bl_level = t->n_split;   /* a byte level without its own regex */
    t->pre_name = "kimi-k2";
    const cJSON *dec = jget(cfg, "added_tokens_decoder");
    if (dec && !cJSON_IsObject(dec)) {
        st = mq_err(MOEQ_E_FORMAT, "%s: added_tokens_decoder must be an object", cfg_path);
        goto done;
    }
    int32_t base = t->n_ids;
    t->added = calloc((size_t)(KIMI_RESERVED + (dec ? cJSON_GetArraySize(dec) : 0) + 1), sizeof *t->added);
    if (!t->added) {
        st = mq_err(MOEQ_E_NOMEM, "%s: out of memory", cfg_path);
        goto done;
    }
    for (const cJSON *e = dec ? dec->child : NULL; e && !st; e = e->next) {
        char *end = NULL;
        long id = strtol(e->string, &end, 10);
        const cJSON *c = jget(e, "content");
        if (!*e->string || *end || id < 0 || id >= MAX_ID || !cJSON_IsString(c) || !c->valuestring[0])
            st = mq_err(MOEQ_E_FORMAT, "%s: added_tokens_decoder['%s'] needs an id key and a "
                        "non-empty content", cfg_path, e->string);
        else
            st = add_special(t, c->valuestring, (int32_t)id);
    }
    uint32_t named = t->n_added;
    for (int32_t id = base; id < base + KIMI_RESERVED && !st; id++) {
        bool has = false;
        for (uint32_t i = 0; i < named && !has; i++) has = t->added[i].id == id;
        char nm[40];
        snprintf(nm, sizeof nm, "<|reserved_token_%d|>", id);
        if (!has) st = add_special(t, nm, id);
    }
done:
    cJSON_Delete(cfg);
    return st;
}

static moeq_status load_tiktoken(moeq_tokenizer *t) {
    char *text = NULL;
    size_t len = 0;
    moeq_status st = mq_read_file(t->path, &text, &len);
    if (st) return st;
    st = read_ranks(t, text, len);
    free(text);
    t->ignore_merges = true;   /* tiktoken takes a piece that is a token as it is */
    t->tiktoken = true;
    t->unk_id = -1;
    const char *slash = strrchr(t->path, '/');
    char *cfg = mq_asprintf("%.*stokenizer_config.json", slash ? (int)(slash - t->path + 1) : 0, t->path);
    if (!cfg) return mq_err(MOEQ_E_NOMEM, "out of memory");
    if (st == MOEQ_OK) st = tiktoken_config(t, cfg);
    free(cfg);
    return st;
}

static bool is_tiktoken_file(const char *path) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t n = strlen(base);
    return !strcmp(base, "tiktoken.model") || (n > 9 && !strcmp(base + n - 9, ".tiktoken"));
}

char *mq_tokenizer_find(const char *dir) {
    static const char *const names[] = {"tokenizer.json", "tiktoken.model"};
    for (int i = 0; i < 2; i++) {
        char *p = mq_path_join(dir, names[i]);
        if (!p || mq_file_exists(p)) return p;
        free(p);
    }
    return NULL;
}

void moeq_tokenizer_free(moeq_tokenizer *t) {
    if (!t) return;
    MQ_FREE_EACH(t->path, t->arena, t->v_off, t->v_len, t->v_id, t->v_slots, t->id_off, t->id_len, t->dec,
                 t->dec_off, t->dec_len, t->m_slots, t->added, t->pass[0].order, t->pass[1].order);
    pcre2_code_free(t->word_re);
    for (int i = 0; i < t->n_split; i++) pcre2_code_free(t->split[i]);
    free(t);
}

/* The steps after the vocabulary is read, for every source. */
static moeq_status finish_load(moeq_tokenizer *t, moeq_status st) {
    if (st == MOEQ_OK && t->n_ids == 0) st = mq_err(MOEQ_E_FORMAT, "%s: empty vocabulary", t->path);
    if (st == MOEQ_OK) st = build_added_index(t);
    if (st == MOEQ_OK) st = build_id_tables(t);
    return st;
}

moeq_status mq_tokenizer_from_json(const char *label, const cJSON *root, const cJSON *config,
                                   moeq_tokenizer **out) {
    *out = NULL;
    moeq_tokenizer *t = calloc(1, sizeof *t);
    if (!t || !(t->path = mq_strdup(label ? label : "tokenizer.json"))) {
        free(t);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory", label ? label : "tokenizer.json");
    }
    build_byte_alphabet(t);
    moeq_status st = finish_load(t, load_json_root(t, root));
    /* as load_special_ids reads a config.json beside tokenizer.json */
    t->bos = config ? id_from_config(jget(config, "bos_token_id")) : -1;
    t->eos = config ? id_from_config(jget(config, "eos_token_id")) : -1;
    if (st) {
        moeq_tokenizer_free(t);
        return st;
    }
    *out = t;
    return MOEQ_OK;
}

/* A GGUF file's tokenizer, rebuilt from tokenizer.ggml.* as moeq_model_open rebuilds it. */
static moeq_status load_gguf(const char *path, moeq_tokenizer **out) {
    mq_gguf *g;
    moeq_status st = mq_gguf_open(path, &g);
    if (st) return st;
    cJSON *doc = NULL, *ids = cJSON_CreateObject();
    st = ids ? mq_gguf_hf_tokenizer(g, path, &doc) : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!st) mq_gguf_hf_special_ids(g, ids);
    if (!st) st = mq_tokenizer_from_json(path, doc, ids, out);
    cJSON_Delete(doc);
    cJSON_Delete(ids);
    mq_gguf_close(g);
    return st;
}

moeq_status moeq_tokenizer_load(const char *path, moeq_tokenizer **out) {
    if (!out || !path) return mq_err(MOEQ_E_ARG, "moeq_tokenizer_load: NULL argument");
    *out = NULL;
    if (mq_is_gguf_file(path)) return load_gguf(path, out);
    struct stat sb;
    char *found = NULL;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        if (!(found = mq_tokenizer_find(path)))
            return mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer.json or tiktoken.model", path);
        path = found;
    }
    moeq_tokenizer *t = calloc(1, sizeof *t);
    if (!t || !(t->path = mq_strdup(path))) {
        free(t);
        moeq_status st = mq_err(MOEQ_E_NOMEM, "%s: out of memory", path);
        free(found);
        return st;
    }
    free(found);
    build_byte_alphabet(t);
    moeq_status st = finish_load(t, is_tiktoken_file(t->path) ? load_tiktoken(t) : load_json(t));
    if (st == MOEQ_OK) st = load_special_ids(t);
    if (st) {
        moeq_tokenizer_free(t);
        return st;
    }
    *out = t;
    return MOEQ_OK;
}

