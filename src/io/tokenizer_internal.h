/*
 * The tokenizer's tables and what its loading (tokenizer_load.c: tokenizer.json, tiktoken.model)
 * and its encoding and decoding (tokenizer.c) share: the limits, the GPT-2 split pattern, the
 * token and merge tables, UTF-8 stepping, the vocabulary and merge-rank hash lookups. Internal to
 * src/io/.
 */
#ifndef MOEQ_IO_TOKENIZER_INTERNAL_H
#define MOEQ_IO_TOKENIZER_INTERNAL_H

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "io/tokenizer.h"

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

static inline uint64_t hash_bytes(const void *p, size_t n) {
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

static inline uint32_t pow2_at_least(size_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* Length of the valid UTF-8 character at s[i], or minus the length of the maximal invalid
 * subpart there (the unit that from_utf8_lossy replaces by one U+FFFD). */
static inline int utf8_step(const uint8_t *s, size_t n, size_t i, uint32_t *cp) {
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

static inline bool is_white_space(uint32_t c) {   /* Unicode White_Space, as Rust's char::is_whitespace */
    return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

/* ---- vocabulary hash ------------------------------------------------------------------------ */

static inline int32_t vocab_find(const moeq_tokenizer *t, const char *s, size_t n) {
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

/* UTF-8 of one alphabet code point (< 0x800); returns the length. */
static inline int put_cp(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

#endif
