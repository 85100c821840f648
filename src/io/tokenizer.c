/*
 * The byte-level BPE encoder/decoder (its tables are loaded by tokenizer_load.c from
 * tokenizer.json, tiktoken.model or a GGUF), following the Hugging Face tokenizers crate pipeline
 * (tokenizer/added_vocabulary.rs, pre_tokenizers/byte_level.rs, models/bpe):
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
#include "io/tokenizer_internal.h"

#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

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
    return mq_reserve(p, cap, need, elem, 64) ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "tokenizer: out of memory");
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
        if (count == 0) return MOEQ_OK;   /* a word that encodes to nothing: ids may still be NULL */
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
            return cache_put(e, h, s, n, e->n > start ? e->ids + start : NULL, e->n - start);
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
    return cache_put(e, h, s, n, e->n > start ? e->ids + start : NULL, e->n - start);
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
