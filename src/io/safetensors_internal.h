/*
 * What the safetensors reader (safetensors.c), writer and sharded writers (safetensors_write.c)
 * and planned shards (safetensors_plan.c) share: the file's constants, a string set for
 * duplicate names, JSON text helpers, a shape's text. Internal to src/io/.
 */
#ifndef MOEQ_IO_SAFETENSORS_INTERNAL_H
#define MOEQ_IO_SAFETENSORS_INTERNAL_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "core/page.h"
#include "io/safetensors.h"

#define ST_MAX_HEADER 100000000ull   /* safetensors MAX_HEADER_SIZE */
#define ST_INDEX_NAME "model.safetensors.index.json"
/* Largest integer a JSON number (a double in cJSON) holds exactly; no valid offset exceeds it. */
#define ST_MAX_JSON_INT 9007199254740992.0

static inline bool dtype_valid(moeq_dtype dt) { return (int)dt >= 0 && dt < MOEQ_DT_COUNT; }

/* A __metadata__ entry. */
typedef struct {
    char *key, *value;
} st_meta;

static inline int cmp_meta_key(const void *a, const void *b) {
    return strcmp(((const st_meta *)a)->key, ((const st_meta *)b)->key);
}

/* ==== small helpers ========================================================================= */

/* A string hash set over borrowed keys (open addressing): duplicate-name checks in the writers
 * stay O(1) per tensor for checkpoints with tens of thousands of tensors. */
typedef struct {
    const char **slots;
    size_t cap, n;
} strset;

static inline uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;   /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static inline bool strset_has(const strset *set, const char *key) {
    if (!set->cap) return false;
    for (size_t i = hash_str(key) & (set->cap - 1);; i = (i + 1) & (set->cap - 1)) {
        if (!set->slots[i]) return false;
        if (strcmp(set->slots[i], key) == 0) return true;
    }
}

static inline moeq_status strset_add(strset *set, const char *key) {
    if ((set->n + 1) * 2 > set->cap) {
        size_t cap = set->cap ? set->cap * 2 : 64;
        const char **slots = calloc(cap, sizeof *slots);
        if (!slots) return mq_err(MOEQ_E_NOMEM, "out of memory: tensor name set");
        for (size_t j = 0; j < set->cap; j++) {
            if (!set->slots[j]) continue;
            size_t i = hash_str(set->slots[j]) & (cap - 1);
            while (slots[i]) i = (i + 1) & (cap - 1);
            slots[i] = set->slots[j];
        }
        free(set->slots);
        set->slots = slots;
        set->cap = cap;
    }
    size_t i = hash_str(key) & (set->cap - 1);
    while (set->slots[i]) i = (i + 1) & (set->cap - 1);
    set->slots[i] = key;
    set->n++;
    return MOEQ_OK;
}

static inline void strset_free(strset *set) {
    free(set->slots);
    memset(set, 0, sizeof *set);
}

/* The JSON the writers produce goes into a growing text buffer (core/page.h). */
static inline void sb_str(mq_page *b, const char *s) { mq_page_put(b, s, strlen(s)); }

/* A JSON string literal, escaped the way serde_json does (short forms, else \u00xx). */
static inline void sb_json_str(mq_page *b, const char *s) {
    mq_page_put(b, "\"", 1);
    for (; *s; s++) {
        char t[8];
        const char *esc = mq_json_escape((unsigned char)*s, t);
        if (esc) sb_str(b, esc);
        else mq_page_put(b, s, 1);
    }
    mq_page_put(b, "\"", 1);
}

static inline void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* qsort that accepts an empty (possibly NULL) array, which qsort itself does not. */
static inline void sort_n(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *)) {
    if (n > 1) qsort(base, n, size, cmp);
}

static inline bool is_json_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* One tensor's header entry, ,"NAME":{"dtype":..,"shape":[..],"data_offsets":[off, off + nbytes]};
 * returns where the next tensor's data starts. */
static inline uint64_t sb_tensor_entry(mq_page *h, const char *name, moeq_dtype dtype, int ndim,
                                       const int64_t *shape, uint64_t off, size_t nbytes) {
    mq_page_put(h, ",", 1);
    sb_json_str(h, name);
    mq_page_printf(h, ":{\"dtype\":\"%s\",\"shape\":[", moeq_dtype_name(dtype));
    for (int d = 0; d < ndim; d++) mq_page_printf(h, "%s%" PRId64, d ? "," : "", shape[d]);
    mq_page_printf(h, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + nbytes);
    return off + nbytes;
}

/* The header's end: the closing brace, then spaces up to a multiple of 8 (the data starts
 * 8-aligned). */
static inline void sb_header_end(mq_page *h) {
    mq_page_put(h, "}", 1);
    while (!h->oom && h->n % 8 != 0) mq_page_put(h, " ", 1);
}

/* After an add's checks (s): *out = a copy of name, registered in names (whose duplicates the
 * caller has refused); on any failure the tensor's data (owned, mq_alloc'd) is released. */
static inline moeq_status st_name_add(moeq_status s, strset *names, const char *name, void *data, char **out) {
    char *nm = NULL;
    if (s == MOEQ_OK) {
        nm = mq_strdup(name);
        s = nm ? strset_add(names, nm) : MOEQ_E_NOMEM;
    }
    if (s != MOEQ_OK) {
        free(nm);
        nm = NULL;
        mq_free(data);
    }
    *out = nm;
    return s;
}

/* A writer's checks of one tensor's arguments (name, dtype, shape, byte count against the shape;
 * data may be "" for a planned tensor). Messages start with "safetensors writer". */
moeq_status mq_stw_check_tensor(const char *name, moeq_dtype dtype, int ndim, const int64_t *shape,
                                const void *data, size_t nbytes);

#endif
