/*
 * tokenizer.json reader and byte-level BPE encoder/decoder, following the Hugging Face tokenizers
 * crate pipeline (tokenizer/added_vocabulary.rs, pre_tokenizers/byte_level.rs, models/bpe):
 *   1. added tokens are cut out of the text (leftmost-longest; lstrip/rstrip/single_word),
 *   2. each remaining piece goes through the Split regexes and ByteLevel's GPT-2 regex,
 *   3. each word is mapped to GPT-2's byte alphabet and merged by BPE: the lowest merge rank
 *      first, the leftmost pair on ties, stale queue entries skipped exactly as HF does,
 *   4. decoding maps the byte alphabet back to bytes.
 * Kimi K2's tiktoken.model (base64 token bytes and rank per line) is read into the same tables:
 * each rank's bytes in the byte alphabet as the vocabulary, Kimi's split pattern
 * (mq_tokenizer_kimi_split) and the special tokens of tokenizer_config.json; its pieces merge as
 * tiktoken merges them (tiktoken_merge), and merge pairs are recovered from the ranks only for
 * GGUF (mq_tokenizer_merges).
 * What is and is not supported is listed in tokenizer.h. Speed: merge ranks sit in a hash keyed
 * by the id pair, each encode call keeps a word -> ids cache, and no step allocates per
 * character; the regexes are PCRE2 JIT code.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "io/tokenizer.h"
#include "io/gguf_hf.h"

#include <cjson/cJSON.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_SPLITS 8            /* regex levels: Split pre-tokenizers + ByteLevel's own */
#define MAX_ID (1 << 24)        /* ids beyond this are treated as a corrupt file */
#define CACHE_MAX_WORD 256      /* longer words are not cached */
#define CACHE_MAX_ENTRIES (1u << 17)

/* GPT-2's pre-tokenization regex (pre_tokenizers/byte_level.rs). */
static const char GPT2_SPLIT[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef struct {
    uint32_t off, len;     /* content in the arena */
    int32_t id;
    bool single_word, lstrip, rstrip, normalized;
} added_token;

/* The added tokens of one matching pass grouped by first byte, longest first. */
typedef struct {
    uint32_t start[257];
    uint32_t *order;       /* indices into tok->added */
} added_index;

typedef struct {
    uint64_t key;          /* (left id << 32) | right id; EMPTY_KEY when free */
    uint32_t rank;
    int32_t new_id;
} merge_slot;
#define EMPTY_KEY UINT64_MAX

struct moeq_tokenizer {
    char *path;
    int32_t n_ids;                 /* vocab size: largest id + 1 */

    char *arena;                   /* every string, NUL-terminated */
    size_t arena_len, arena_cap;

    /* model vocabulary: entries and an open-addressing hash of entry index + 1 */
    uint32_t n_vocab, vocab_cap;
    uint32_t *v_off, *v_len;
    int32_t *v_id;
    uint32_t *v_slots;
    uint32_t v_mask;

    /* per id: the token string (added token content wins) and its decoded bytes */
    int64_t *id_off;               /* -1: no token has this id */
    uint32_t *id_len;
    char *dec;
    uint32_t *dec_off, *dec_len;

    merge_slot *m_slots;
    int m_shift;

    int32_t byte_id[256];          /* id of each byte's alphabet character, -1 if absent */
    int32_t fallback_id[256][2];   /* byte_fallback ids of the character's UTF-8 bytes */
    uint16_t b2u[256];             /* GPT-2 byte -> code point */
    int16_t u2b[512];              /* code point -> byte, -1 if not in the alphabet */
    int32_t unk_id;
    bool fuse_unk, byte_fallback, ignore_merges;

    added_token *added;
    uint32_t n_added;
    added_index pass[2];           /* 0: normalized=false tokens, 1: normalized=true */
    pcre2_code *word_re;           /* "\w" for single_word checks; NULL when unused */

    pcre2_code *split[MAX_SPLITS];
    int n_split;
    int bl_level;                  /* index of the ByteLevel stage among the split levels */
    bool prefix_space;
    bool nfc;                      /* normalizer: NFC */

    int32_t bos, eos;
    const char *pre_name;          /* the split pattern's name when it is a known one, else NULL */
    bool tiktoken;                 /* ranks merge by the joined bytes (tiktoken.model), no merges */
};

/* ---- small helpers ------------------------------------------------------------------------ */

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    h *= 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

static uint32_t pow2_at_least(size_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* Length of the valid UTF-8 character at s[i], or minus the length of the maximal invalid
 * subpart there (the unit that from_utf8_lossy replaces by one U+FFFD). */
static int utf8_step(const uint8_t *s, size_t n, size_t i, uint32_t *cp) {
    uint8_t c = s[i];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int need;
    uint8_t lo = 0x80, hi = 0xbf;
    uint32_t v;
    if (c >= 0xc2 && c <= 0xdf) {
        need = 1;
        v = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        need = 2;
        v = c & 0x0f;
        if (c == 0xe0) lo = 0xa0;      /* no overlong forms */
        if (c == 0xed) hi = 0x9f;      /* no surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 3;
        v = c & 0x07;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;      /* nothing above U+10FFFF */
    } else {
        return -1;
    }
    for (int k = 1; k <= need; k++) {
        if (i + (size_t)k >= n) return -k;
        uint8_t b = s[i + (size_t)k];
        if (b < lo || b > hi) return -k;
        lo = 0x80;
        hi = 0xbf;
        v = (v << 6) | (b & 0x3f);
    }
    *cp = v;
    return need + 1;
}

size_t mq_utf8_check(const char *text, size_t n) {
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int k = utf8_step(s, n, i, &cp);
        if (k < 0) return i;
        i += (size_t)k;
    }
    return n;
}

static bool is_white_space(uint32_t c) {   /* Unicode White_Space, as Rust's char::is_whitespace */
    return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

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

/* ---- vocabulary hash ------------------------------------------------------------------------ */

static int32_t vocab_find(const moeq_tokenizer *t, const char *s, size_t n) {
    if (!t->v_slots) return -1;
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->v_mask;
    for (;;) {
        uint32_t e = t->v_slots[i];
        if (!e) return -1;
        e--;
        if (t->v_len[e] == n && memcmp(t->arena + t->v_off[e], s, n) == 0) return t->v_id[e];
        i = (i + 1) & t->v_mask;
    }
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

/* ---- merge-rank hash ------------------------------------------------------------------------ */

static inline const merge_slot *merge_find(const moeq_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t mask = (1ull << (64 - t->m_shift)) - 1;
    uint64_t i = (key * 0x9e3779b97f4a7c15ull) >> t->m_shift;
    for (;;) {
        const merge_slot *m = &t->m_slots[i];
        if (m->key == key) return m;
        if (m->key == EMPTY_KEY) return NULL;
        i = (i + 1) & mask;
    }
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

/* UTF-8 of one alphabet code point (< 0x800); returns the length. */
static int put_cp(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
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
    free(t->path);
    free(t->arena);
    free(t->v_off);
    free(t->v_len);
    free(t->v_id);
    free(t->v_slots);
    free(t->id_off);
    free(t->id_len);
    free(t->dec);
    free(t->dec_off);
    free(t->dec_len);
    free(t->m_slots);
    free(t->added);
    free(t->pass[0].order);
    free(t->pass[1].order);
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

/* ---- lookups -------------------------------------------------------------------------------- */

int32_t moeq_tokenizer_vocab_size(const moeq_tokenizer *t) { return t ? t->n_ids : 0; }
int32_t moeq_tokenizer_bos(const moeq_tokenizer *t) { return t ? t->bos : -1; }
int32_t moeq_tokenizer_eos(const moeq_tokenizer *t) { return t ? t->eos : -1; }

const char *moeq_tokenizer_token(const moeq_tokenizer *t, int32_t id) {
    if (!t || id < 0 || id >= t->n_ids || t->id_off[id] < 0) return NULL;
    return t->arena + t->id_off[id];
}

const char *mq_tokenizer_token_bytes(const moeq_tokenizer *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_ids || t->id_off[id] < 0) return NULL;
    *len = t->dec_len[id];
    return t->dec + t->dec_off[id];
}

int32_t mq_tokenizer_token_to_id(const moeq_tokenizer *t, const char *s, size_t len) {
    for (uint32_t i = 0; i < t->n_added; i++)
        if (t->added[i].len == len && !memcmp(t->arena + t->added[i].off, s, len)) return t->added[i].id;
    return vocab_find(t, s, len);
}

/* ---- encoding ------------------------------------------------------------------------------- */

typedef struct {
    int32_t id, prev, next;
    uint32_t len;          /* 0: merged into its left neighbour */
} bpe_sym;

typedef struct {
    uint32_t rank, pos;
    int32_t new_id;
} bpe_merge;

typedef struct {
    uint64_t hash;
    uint32_t key_off, key_len, ids_off, n_ids;
} cache_entry;

/* Per-call state: the output, scratch buffers and the word cache (so calls stay thread-safe). */
typedef struct {
    const moeq_tokenizer *tok;
    int32_t *ids;
    size_t n, cap;
    pcre2_match_data *md;
    bpe_sym *sym;
    bpe_merge *heap;
    size_t sym_cap;
    char *wbuf, *pbuf;     /* mapped word (ignore_merges); prefix-space copy (ByteLevel level) */
    size_t wbuf_cap, pbuf_cap;
    uint32_t *t_off, *t_len;   /* tiktoken merging: the parts of the mapped word, */
    int32_t *t_rank;           /* and the rank of each part joined with the next */
    size_t t_cap;
    uint32_t *c_slots;     /* entry index + 1 */
    uint32_t c_mask;
    cache_entry *c_ent;
    size_t c_n, c_cap;
    char *c_keys;
    size_t c_keys_len, c_keys_cap;
    int32_t *c_ids;
    size_t c_ids_len, c_ids_cap;
} enc_state;

static moeq_status grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return MOEQ_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return mq_err(MOEQ_E_NOMEM, "tokenizer: out of memory");
    *p = q;
    *cap = c;
    return MOEQ_OK;
}

static inline moeq_status push_id(enc_state *e, int32_t id) {
    if (e->n == e->cap) {
        moeq_status st = grow((void **)&e->ids, &e->cap, e->n + 1, sizeof(int32_t));
        if (st) return st;
    }
    e->ids[e->n++] = id;
    return MOEQ_OK;
}

static bool cache_get(const enc_state *e, uint64_t h, const char *s, size_t n, size_t *first,
                      size_t *count) {
    if (!e->c_slots) return false;
    for (uint32_t i = (uint32_t)h & e->c_mask;; i = (i + 1) & e->c_mask) {
        uint32_t k = e->c_slots[i];
        if (!k) return false;
        const cache_entry *c = &e->c_ent[k - 1];
        if (c->hash == h && c->key_len == n && !memcmp(e->c_keys + c->key_off, s, n)) {
            *first = c->ids_off;
            *count = c->n_ids;
            return true;
        }
    }
}

static moeq_status cache_put(enc_state *e, uint64_t h, const char *s, size_t n, const int32_t *ids,
                             size_t n_ids) {
    if (n > CACHE_MAX_WORD) return MOEQ_OK;
    if (e->c_n >= CACHE_MAX_ENTRIES) {   /* full: start over rather than grow without bound */
        memset(e->c_slots, 0, sizeof(uint32_t) * (e->c_mask + 1));
        e->c_n = e->c_keys_len = e->c_ids_len = 0;
    }
    if (!e->c_slots || 2 * (e->c_n + 1) > (size_t)e->c_mask + 1) {
        uint32_t size = e->c_slots ? 2 * (e->c_mask + 1) : 4096;
        uint32_t *slots = calloc(size, sizeof(uint32_t));
        if (!slots) return mq_err(MOEQ_E_NOMEM, "tokenizer: out of memory");
        for (size_t k = 0; k < e->c_n; k++) {
            uint32_t i = (uint32_t)e->c_ent[k].hash & (size - 1);
            while (slots[i]) i = (i + 1) & (size - 1);
            slots[i] = (uint32_t)k + 1;
        }
        free(e->c_slots);
        e->c_slots = slots;
        e->c_mask = size - 1;
    }
    moeq_status st;
    if ((st = grow((void **)&e->c_ent, &e->c_cap, e->c_n + 1, sizeof(cache_entry))) ||
        (st = grow((void **)&e->c_keys, &e->c_keys_cap, e->c_keys_len + n, 1)) ||
        (st = grow((void **)&e->c_ids, &e->c_ids_cap, e->c_ids_len + n_ids, sizeof(int32_t))))
        return st;
    cache_entry *c = &e->c_ent[e->c_n];
    c->hash = h;
    c->key_off = (uint32_t)e->c_keys_len;
    c->key_len = (uint32_t)n;
    c->ids_off = (uint32_t)e->c_ids_len;
    c->n_ids = (uint32_t)n_ids;
    /* an empty piece leaves its buffer unallocated: no offset from NULL */
    if (n) memcpy(e->c_keys + e->c_keys_len, s, n);
    if (n_ids) memcpy(e->c_ids + e->c_ids_len, ids, n_ids * sizeof(int32_t));
    e->c_keys_len += n;
    e->c_ids_len += n_ids;
    uint32_t i = (uint32_t)h & e->c_mask;
    while (e->c_slots[i]) i = (i + 1) & e->c_mask;
    e->c_slots[i] = (uint32_t)++e->c_n;
    return MOEQ_OK;
}

/* Binary min-heap on (rank, pos), HF's Merge ordering. */
static inline bool merge_less(const bpe_merge *a, const bpe_merge *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(bpe_merge *h, size_t *n, bpe_merge m) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!merge_less(&m, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = m;
}

static bpe_merge heap_pop(bpe_merge *h, size_t *n) {
    bpe_merge top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && merge_less(&h[c + 1], &h[c])) c++;
        if (!merge_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static inline void push_pair(const moeq_tokenizer *t, bpe_merge *h, size_t *nh, const bpe_sym *sym,
                             int32_t pos) {
    const merge_slot *m = merge_find(t, sym[pos].id, sym[sym[pos].next].id);
    if (m) heap_push(h, nh, (bpe_merge){m->rank, (uint32_t)pos, m->new_id});
}

/* Initial symbols of a word: one per byte (each byte is one alphabet character), with HF's
 * byte_fallback / unk / fuse_unk handling of characters missing from the vocabulary. */
static size_t bpe_init(const moeq_tokenizer *t, const uint8_t *s, size_t n, bpe_sym *sym) {
    size_t m = 0;
    bool last_unk = false;
    for (size_t i = 0; i < n; i++) {
        int32_t ids[2] = {t->byte_id[s[i]], -1};
        bool unk = false;
        if (ids[0] < 0) {
            if (t->byte_fallback && t->fallback_id[s[i]][0] >= 0) {
                ids[0] = t->fallback_id[s[i]][0];
                ids[1] = t->fallback_id[s[i]][1];
            } else if (t->unk_id >= 0) {
                if (t->fuse_unk && last_unk) {
                    sym[m - 1].len++;
                    continue;
                }
                ids[0] = t->unk_id;
                unk = true;
            } else {
                continue;   /* HF drops characters it cannot represent */
            }
        }
        last_unk = unk;
        for (int k = 0; k < 2 && ids[k] >= 0; k++) {
            sym[m] = (bpe_sym){ids[k], (int32_t)m - 1, (int32_t)m + 1, 1};
            m++;
        }
    }
    if (m) sym[m - 1].next = -1;
    return m;
}

/* The rank of the alphabet string m[0..n) (its id), INT32_MAX when it is no token or not below
 * limit. */
static inline int32_t rank_of(const moeq_tokenizer *t, const char *m, size_t n, int32_t limit) {
    int32_t r = vocab_find(t, m, n);
    return r < 0 || r >= limit ? INT32_MAX : r;
}

/* The characters of an alphabet string m[0..n) (1 or 2 UTF-8 bytes each): offsets and lengths;
 * returns their count. */
static size_t alphabet_chars(const char *m, size_t n, uint32_t *off, uint32_t *len) {
    size_t np = 0;
    for (size_t i = 0; i < n; i += len[np - 1]) {
        off[np] = (uint32_t)i;
        len[np++] = ((uint8_t)m[i] & 0x80) ? 2 : 1;
    }
    return np;
}

/* tiktoken's merging of one piece (m: its k bytes in the alphabet): the adjacent pair whose
 * joined bytes have the lowest rank below `limit` merges first, the leftmost of equals, until no
 * joined pair is such a token. Leaves the parts in off/len (room for k each, rank for k - 1) and
 * returns their count. Quadratic in the piece, as tiktoken's own loop. */
static size_t tiktoken_merge(const moeq_tokenizer *t, const char *m, size_t k, int32_t limit, uint32_t *off,
                             uint32_t *len, int32_t *rank) {
    size_t np = alphabet_chars(m, k, off, len);
    for (size_t i = 0; i + 1 < np; i++) rank[i] = rank_of(t, m + off[i], len[i] + len[i + 1], limit);
    while (np > 1) {
        size_t at = 0;
        for (size_t i = 1; i + 1 < np; i++)
            if (rank[i] < rank[at]) at = i;
        if (rank[at] == INT32_MAX) break;
        len[at] += len[at + 1];
        memmove(off + at + 1, off + at + 2, (np - at - 2) * sizeof *off);
        memmove(len + at + 1, len + at + 2, (np - at - 2) * sizeof *len);
        if (at + 3 < np) memmove(rank + at + 1, rank + at + 2, (np - at - 3) * sizeof *rank);
        np--;
        if (at + 1 < np) rank[at] = rank_of(t, m + off[at], len[at] + len[at + 1], limit);
        if (at > 0) rank[at - 1] = rank_of(t, m + off[at - 1], len[at - 1] + len[at], limit);
    }
    return np;
}

/* One piece through tiktoken_merge, its parts' ids into the output. Exact where merge pairs
 * recovered from the ranks could differ (a token reached through a split other than its own). */
static moeq_status tiktoken_word(enc_state *e, const char *m, size_t k) {
    const moeq_tokenizer *t = e->tok;
    if (k + 1 > e->t_cap) {
        size_t cap = 2 * (k + 1);
        uint32_t *o = realloc(e->t_off, sizeof *o * cap);
        if (o) e->t_off = o;
        uint32_t *l = o ? realloc(e->t_len, sizeof *l * cap) : NULL;
        if (l) e->t_len = l;
        int32_t *r = l ? realloc(e->t_rank, sizeof *r * cap) : NULL;
        if (!r) return mq_err(MOEQ_E_NOMEM, "tokenizer: out of memory");
        e->t_rank = r;
        e->t_cap = cap;
    }
    size_t np = tiktoken_merge(t, m, k, INT32_MAX, e->t_off, e->t_len, e->t_rank);
    moeq_status st = MOEQ_OK;
    for (size_t i = 0; i < np && !st; i++) st = push_id(e, vocab_find(t, m + e->t_off[i], e->t_len[i]));
    return st;
}

static moeq_status bpe_word(enc_state *e, const char *s, size_t n) {
    const moeq_tokenizer *t = e->tok;
    moeq_status st;
    if (n == 1 && t->byte_id[(uint8_t)s[0]] >= 0) return push_id(e, t->byte_id[(uint8_t)s[0]]);
    uint64_t h = hash_bytes(s, n);
    size_t first, count;
    if (cache_get(e, h, s, n, &first, &count)) {
        if ((st = grow((void **)&e->ids, &e->cap, e->n + count, sizeof(int32_t)))) return st;
        memcpy(e->ids + e->n, e->c_ids + first, count * sizeof(int32_t));
        e->n += count;
        return MOEQ_OK;
    }
    size_t start = e->n;
    if (t->ignore_merges) {   /* a word that is itself a token skips the merges */
        if ((st = grow((void **)&e->wbuf, &e->wbuf_cap, 2 * n, 1))) return st;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) k += (size_t)put_cp(e->wbuf + k, t->b2u[(uint8_t)s[i]]);
        int32_t id = vocab_find(t, e->wbuf, k);
        if (id >= 0) {
            if ((st = push_id(e, id))) return st;
            return cache_put(e, h, s, n, e->ids + start, 1);
        }
        if (t->tiktoken) {
            if ((st = tiktoken_word(e, e->wbuf, k))) return st;
            return cache_put(e, h, s, n, e->ids + start, e->n - start);
        }
    }
    if (2 * n > e->sym_cap) {   /* byte_fallback may give two symbols per byte */
        size_t cap = 2 * n;
        bpe_sym *sym = realloc(e->sym, sizeof(bpe_sym) * cap);
        if (sym) e->sym = sym;
        bpe_merge *heap = sym ? realloc(e->heap, sizeof(bpe_merge) * 3 * cap) : NULL;
        if (!heap) return mq_err(MOEQ_E_NOMEM, "tokenizer: out of memory");
        e->heap = heap;
        e->sym_cap = cap;
    }
    bpe_sym *sym = e->sym;
    size_t m = bpe_init(t, (const uint8_t *)s, n, sym), nh = 0;
    for (size_t i = 0; i + 1 < m; i++) push_pair(t, e->heap, &nh, sym, (int32_t)i);
    while (nh) {
        bpe_merge top = heap_pop(e->heap, &nh);
        bpe_sym *a = &sym[top.pos];
        if (a->len == 0 || a->next < 0) continue;
        bpe_sym *b = &sym[a->next];
        /* Expired entry: the pair at this position no longer merges into the same token. */
        const merge_slot *cur = merge_find(t, a->id, b->id);
        if (!cur || cur->new_id != top.new_id) continue;
        a->id = top.new_id;
        a->len += b->len;
        b->len = 0;
        a->next = b->next;
        if (a->next >= 0) sym[a->next].prev = (int32_t)top.pos;
        if (a->prev >= 0) push_pair(t, e->heap, &nh, sym, a->prev);
        if (a->next >= 0) push_pair(t, e->heap, &nh, sym, (int32_t)top.pos);
    }
    for (int32_t i = m ? 0 : -1; i >= 0; i = sym[i].next)
        if ((st = push_id(e, sym[i].id))) return st;
    return cache_put(e, h, s, n, e->ids + start, e->n - start);
}

/* Split level `level` (a Split regex or ByteLevel's): matches and the gaps between them are
 * pieces (behavior Isolated); each goes to the next level, the last level feeds BPE. */
static moeq_status pretokenize(enc_state *e, int level, const char *s, size_t n) {
    const moeq_tokenizer *t = e->tok;
    moeq_status st;
    if (n == 0) return MOEQ_OK;
    if (level == t->bl_level && t->prefix_space && s[0] != ' ') {
        /* Only this level writes pbuf, and it is visited once per piece: no aliasing. */
        if ((st = grow((void **)&e->pbuf, &e->pbuf_cap, n + 1, 1))) return st;
        e->pbuf[0] = ' ';
        memmove(e->pbuf + 1, s, n);
        s = e->pbuf;
        n++;
    }
    if (level == t->n_split) return bpe_word(e, s, n);
    const pcre2_code *re = t->split[level];
    size_t gap = 0, from = 0;
    while (from < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: split regex %d failed: %s", t->path, level,
                          (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) {   /* empty match: no piece; search again one character later */
            from = ms + 1;
            while (from < n && ((uint8_t)s[from] & 0xc0) == 0x80) from++;
            continue;
        }
        if (ms > gap && (st = pretokenize(e, level + 1, s + gap, ms - gap))) return st;
        if ((st = pretokenize(e, level + 1, s + ms, me - ms))) return st;
        gap = from = me;
    }
    return gap < n ? pretokenize(e, level + 1, s + gap, n - gap) : MOEQ_OK;
}

static bool is_word_at(const moeq_tokenizer *t, pcre2_match_data *md, const char *s, size_t n,
                       size_t at) {
    return pcre2_match(t->word_re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK, md, NULL) >= 0;
}

/* Longest added token of this pass that starts at s[p], or NULL. */
static const added_token *added_at(const moeq_tokenizer *t, const added_index *ix, const char *s,
                                   size_t n, size_t p) {
    uint8_t b = (uint8_t)s[p];
    for (uint32_t k = ix->start[b]; k < ix->start[b + 1]; k++) {
        const added_token *a = &t->added[ix->order[k]];
        if (a->len <= n - p && !memcmp(t->arena + a->off, s + p, a->len)) return a;
    }
    return NULL;
}

static moeq_status split_added(enc_state *e, int pass, const char *s, size_t n);

/* Cuts the added tokens of pass `pass` out of s (HF AddedVocabulary::find_matches); the pieces in
 * between go to the next pass, and after the last pass to the pre-tokenizer. */
static moeq_status cut_added(enc_state *e, int pass, const char *s, size_t n) {
    const moeq_tokenizer *t = e->tok;
    moeq_status st;
    const added_index *ix = &t->pass[pass];
    if (ix->start[256] == 0) return split_added(e, pass + 1, s, n);
    size_t done = 0, p = 0;
    while (p < n) {
        const added_token *a = ix->start[(uint8_t)s[p] + 1] > ix->start[(uint8_t)s[p]]
                                   ? added_at(t, ix, s, n, p) : NULL;
        if (!a) {
            p++;
            continue;
        }
        size_t start = p, stop = p + a->len;
        p = stop;
        if (a->single_word) {
            /* No word character may touch the match (look back one character). */
            bool left_ok = true;
            if (start > 0) {
                size_t q = start - 1;
                while (q > 0 && ((uint8_t)s[q] & 0xc0) == 0x80) q--;
                left_ok = !is_word_at(t, e->md, s, n, q);
            }
            bool right_ok = stop == n || !is_word_at(t, e->md, s, n, stop);
            if (!left_ok || !right_ok) continue;
        }
        if (a->lstrip) {
            while (start > done) {
                size_t q = start - 1;
                while (q > done && ((uint8_t)s[q] & 0xc0) == 0x80) q--;
                uint32_t cp;
                if (utf8_step((const uint8_t *)s, n, q, &cp) < 0 || !is_white_space(cp)) break;
                start = q;
            }
        }
        if (a->rstrip) {
            uint32_t cp;
            int k;
            while (stop < n && (k = utf8_step((const uint8_t *)s, n, stop, &cp)) > 0 &&
                   is_white_space(cp))
                stop += (size_t)k;
            p = stop;
        }
        if (start > done && (st = split_added(e, pass + 1, s + done, start - done))) return st;
        if ((st = push_id(e, a->id))) return st;
        done = stop;
    }
    return done < n ? split_added(e, pass + 1, s + done, n - done) : MOEQ_OK;
}

static moeq_status split_added(enc_state *e, int pass, const char *s, size_t n) {
    if (pass == 2) return pretokenize(e, 0, s, n);
    if (pass == 1 && e->tok->nfc && !mq_nfc_quick_yes(s, n)) {
        /* The normalizer runs on the pieces left by the non-normalized tokens (HF
         * extract_and_normalize); the normalized copy lives until the piece is encoded. */
        char *norm = NULL;
        size_t nn = 0;
        moeq_status st = mq_nfc(s, n, &norm, &nn);
        if (st == MOEQ_OK) st = cut_added(e, 1, norm, nn);
        free(norm);
        return st;
    }
    return cut_added(e, pass, s, n);
}

moeq_status moeq_tokenizer_encode(const moeq_tokenizer *t, const char *text, size_t len,
                                  int32_t **ids, size_t *n_ids) {
    if (!t || (!text && len) || !ids || !n_ids)
        return mq_err(MOEQ_E_ARG, "moeq_tokenizer_encode: NULL argument");
    *ids = NULL;
    *n_ids = 0;
    size_t bad = mq_utf8_check(text, len);
    if (bad < len)
        return mq_err(MOEQ_E_FORMAT, "tokenizer: input is not valid UTF-8 at byte offset %zu "
                      "(byte 0x%02x)", bad, (uint8_t)text[bad]);
    enc_state e;
    memset(&e, 0, sizeof e);
    e.tok = t;
    moeq_status st = MOEQ_OK;
    if (len) {
        e.md = pcre2_match_data_create(1, NULL);
        if (!e.md || grow((void **)&e.ids, &e.cap, len / 4 + 16, sizeof(int32_t)))
            st = mq_err(MOEQ_E_NOMEM, "tokenizer: out of memory");
        if (st == MOEQ_OK) st = split_added(&e, 0, text, len);
    }
    pcre2_match_data_free(e.md);
    free(e.sym);
    free(e.heap);
    free(e.wbuf);
    free(e.t_off);
    free(e.t_len);
    free(e.t_rank);
    free(e.pbuf);
    free(e.c_slots);
    free(e.c_ent);
    free(e.c_keys);
    free(e.c_ids);
    if (st) {
        free(e.ids);
        return st;
    }
    if (!e.ids && !(e.ids = malloc(sizeof(int32_t)))) return mq_err(MOEQ_E_NOMEM, "out of memory");
    *ids = e.ids;
    *n_ids = e.n;
    return MOEQ_OK;
}

/* ---- decoding ------------------------------------------------------------------------------- */

/* skip_unknown: ids the tokenizer lacks decode to nothing instead of failing (a model's
 * embedding rows past the tokenizer's ids, e.g. OLMoE's 50,304 rows for 50,280 tokens). */
static moeq_status decode_bytes(const moeq_tokenizer *t, const int32_t *ids, size_t n_ids,
                                bool skip_unknown, char **out, size_t *len) {
    if (!t || (!ids && n_ids) || !out) return mq_err(MOEQ_E_ARG, "tokenizer decode: NULL argument");
    *out = NULL;
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_ids || t->id_off[ids[i]] < 0) {
            if (skip_unknown) continue;
            return mq_err(MOEQ_E_ARG, "%s: decode: id %d at position %zu is not in the vocabulary "
                          "(size %d)", t->path, ids[i], i, t->n_ids);
        }
        total += t->dec_len[ids[i]];
    }
    char *o = malloc(total + 1);
    if (!o) return mq_err(MOEQ_E_NOMEM, "tokenizer decode: out of memory");
    size_t at = 0;
    for (size_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_ids || t->id_off[ids[i]] < 0) continue;
        memcpy(o + at, t->dec + t->dec_off[ids[i]], t->dec_len[ids[i]]);
        at += t->dec_len[ids[i]];
    }
    o[at] = 0;
    *out = o;
    if (len) *len = at;
    return MOEQ_OK;
}

moeq_status mq_tokenizer_decode_bytes(const moeq_tokenizer *t, const int32_t *ids, size_t n_ids,
                                      char **out, size_t *len) {
    return decode_bytes(t, ids, n_ids, false, out, len);
}

moeq_status moeq_tokenizer_decode_ex(const moeq_tokenizer *t, const int32_t *ids, size_t n_ids,
                                     unsigned flags, char **text, size_t *len) {
    if (text) *text = NULL;
    if (flags & ~(unsigned)MOEQ_DECODE_SKIP_UNKNOWN)
        return mq_err(MOEQ_E_ARG, "tokenizer decode: unknown flags 0x%x", flags);
    if (!text) return mq_err(MOEQ_E_ARG, "tokenizer decode: NULL argument");
    char *raw;
    size_t n;
    moeq_status st = decode_bytes(t, ids, n_ids, (flags & MOEQ_DECODE_SKIP_UNKNOWN) != 0, &raw, &n);
    if (st) return st;
    if (mq_utf8_check(raw, n) == n) {
        *text = raw;
        if (len) *len = n;
        return MOEQ_OK;
    }
    /* String::from_utf8_lossy: each maximal invalid subpart becomes U+FFFD (3 bytes). */
    char *o = malloc(3 * n + 1);
    if (!o) {
        free(raw);
        return mq_err(MOEQ_E_NOMEM, "tokenizer decode: out of memory");
    }
    size_t i = 0, k = 0;
    while (i < n) {
        uint32_t cp;
        int step = utf8_step((const uint8_t *)raw, n, i, &cp);
        if (step > 0) {
            memcpy(o + k, raw + i, (size_t)step);
            k += (size_t)step;
            i += (size_t)step;
        } else {
            memcpy(o + k, "\xef\xbf\xbd", 3);
            k += 3;
            i += (size_t)-step;
        }
    }
    o[k] = 0;
    free(raw);
    *text = o;
    if (len) *len = k;
    return MOEQ_OK;
}

moeq_status moeq_tokenizer_decode(const moeq_tokenizer *t, const int32_t *ids, size_t n_ids,
                                  char **text, size_t *len) {
    return moeq_tokenizer_decode_ex(t, ids, n_ids, 0, text, len);
}

const char *mq_tokenizer_pre_name(const moeq_tokenizer *t) { return t->pre_name; }

bool mq_tokenizer_is_added(const moeq_tokenizer *t, int32_t id) {
    for (uint32_t i = 0; i < t->n_added; i++)
        if (t->added[i].id == id) return true;
    return false;
}

static int cmp_rank(const void *a, const void *b) {
    uint32_t x = ((const uint32_t *)a)[2], y = ((const uint32_t *)b)[2];
    return (x > y) - (x < y);
}

/* tiktoken: the merge that makes each token is its own bytes merged with only the lower ranks
 * (tiktoken_merge with the token's rank as the limit); when that ends in two parts they are the pair, the
 * recovery transformers' TikTokenConverter and llama.cpp's converter make. A token it does not
 * reach gets no merge. tokenizer.json: the merges as read, by rank. */
moeq_status mq_tokenizer_merges(const moeq_tokenizer *t, int32_t **pairs, size_t *n_pairs) {
    *pairs = NULL;
    *n_pairs = 0;
    size_t n = 0;
    uint32_t (*rows)[3] = NULL;   /* left, right, rank */
    if (!t->tiktoken) {
        size_t cap = t->m_slots ? (size_t)1 << (64 - t->m_shift) : 0;
        rows = malloc(sizeof *rows * (cap + 1));
        if (!rows) return mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
        for (size_t i = 0; i < cap; i++)
            if (t->m_slots[i].key != EMPTY_KEY) {
                rows[n][0] = (uint32_t)(t->m_slots[i].key >> 32);
                rows[n][1] = (uint32_t)t->m_slots[i].key;
                rows[n++][2] = t->m_slots[i].rank;
            }
    } else {
        size_t max_len = 0;
        for (uint32_t e = 0; e < t->n_vocab; e++)
            if (t->v_len[e] > max_len) max_len = t->v_len[e];
        rows = malloc(sizeof *rows * (t->n_vocab + 1));
        uint32_t *off = malloc(sizeof(uint32_t) * (max_len + 1)), *len = malloc(sizeof(uint32_t) * (max_len + 1));
        int32_t *rank = malloc(sizeof(int32_t) * (max_len + 1));
        if (!rows || !off || !len || !rank) {
            free(rows);
            free(off);
            free(len);
            free(rank);
            return mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
        }
        for (uint32_t e = 0; e < t->n_vocab; e++) {
            /* the token's own bytes merged with the lower ranks only end in its two halves */
            const char *m = t->arena + t->v_off[e];
            int32_t id = t->v_id[e];
            if (tiktoken_merge(t, m, t->v_len[e], id, off, len, rank) != 2) continue;
            int32_t a = vocab_find(t, m, len[0]), b = vocab_find(t, m + off[1], len[1]);
            if (a < 0 || b < 0 || a >= id || b >= id) continue;   /* a byte ranked above the token */
            rows[n][0] = (uint32_t)a;
            rows[n][1] = (uint32_t)b;
            rows[n++][2] = (uint32_t)id;
        }
        free(rank);
        free(off);
        free(len);
    }
    qsort(rows, n, sizeof *rows, cmp_rank);
    int32_t *p = malloc(sizeof(int32_t) * (2 * n + 1));
    if (!p) {
        free(rows);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory", t->path);
    }
    for (size_t i = 0; i < n; i++) p[2 * i] = (int32_t)rows[i][0], p[2 * i + 1] = (int32_t)rows[i][1];
    free(rows);
    *pairs = p;
    *n_pairs = n;
    return MOEQ_OK;
}
