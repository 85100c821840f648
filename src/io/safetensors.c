/*
 * safetensors reading and writing. Follows the format as described in ../shared/docs/formats.md §1
 * (huggingface/safetensors README.md and safetensors/src/tensor.rs): an 8-byte little-endian
 * header length N, N bytes of JSON header, then the byte buffer the tensors tile exactly.
 *
 * Reader: the whole header is validated (length, JSON, every field, sizes, exact tiling of the
 * buffer, __metadata__ string->string, unique names) before any tensor byte is touched, so views
 * handed out never point outside the mapping. The JSON is parsed with cJSON. Sharded checkpoints
 * (model.safetensors.index.json) are merged into one name-sorted table searched by bsearch.
 *
 * Writer: the reference writer's layout (tensor.rs prepare()): tensors sorted by dtype descending
 * in the safetensors enum order (which moeq_dtype follows) and then by name, header padded with
 * spaces to a multiple of 8, so every tensor is naturally aligned; written atomically.
 */
#include "io/safetensors.h"
#include "formats/codecs_inline.h"   /* an F8_E4M3 tensor's values, as BF16's and F16's (core) */
#include "io/fp8.h"
#include "io/gguf_hf.h"
#include "core/page.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define ST_MAX_HEADER 100000000ull   /* safetensors MAX_HEADER_SIZE */
#define ST_INDEX_NAME "model.safetensors.index.json"
/* Largest integer a JSON number (a double in cJSON) holds exactly; no valid offset exceeds it. */
#define ST_MAX_JSON_INT 9007199254740992.0

/* ==== dtypes ================================================================================ */

static const struct {
    const char *name;
    size_t size;
} k_dtypes[MOEQ_DT_COUNT] = {
    [MOEQ_DT_BOOL] = {"BOOL", 1},    [MOEQ_DT_U8] = {"U8", 1},
    [MOEQ_DT_I8] = {"I8", 1},        [MOEQ_DT_F8_E5M2] = {"F8_E5M2", 1},
    [MOEQ_DT_F8_E4M3] = {"F8_E4M3", 1}, [MOEQ_DT_I16] = {"I16", 2},
    [MOEQ_DT_U16] = {"U16", 2},      [MOEQ_DT_F16] = {"F16", 2},
    [MOEQ_DT_BF16] = {"BF16", 2},    [MOEQ_DT_I32] = {"I32", 4},
    [MOEQ_DT_U32] = {"U32", 4},      [MOEQ_DT_F32] = {"F32", 4},
    [MOEQ_DT_F64] = {"F64", 8},      [MOEQ_DT_I64] = {"I64", 8},
    [MOEQ_DT_U64] = {"U64", 8},
};

static bool dtype_valid(moeq_dtype dt) { return (int)dt >= 0 && dt < MOEQ_DT_COUNT; }

const char *moeq_dtype_name(moeq_dtype dt) { return dtype_valid(dt) ? k_dtypes[dt].name : "?"; }

size_t moeq_dtype_size(moeq_dtype dt) { return dtype_valid(dt) ? k_dtypes[dt].size : 0; }

bool mq_dtype_from_name(const char *name, moeq_dtype *out) {
    if (!name) return false;
    for (int i = 0; i < MOEQ_DT_COUNT; i++) {
        if (strcmp(name, k_dtypes[i].name) == 0) {
            if (out) *out = (moeq_dtype)i;
            return true;
        }
    }
    return false;
}

/* ==== small helpers ========================================================================= */

/* A string hash set over borrowed keys (open addressing): duplicate-name checks in the writers
 * stay O(1) per tensor for checkpoints with tens of thousands of tensors. */
typedef struct {
    const char **slots;
    size_t cap, n;
} strset;

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;   /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static bool strset_has(const strset *set, const char *key) {
    if (!set->cap) return false;
    for (size_t i = hash_str(key) & (set->cap - 1);; i = (i + 1) & (set->cap - 1)) {
        if (!set->slots[i]) return false;
        if (strcmp(set->slots[i], key) == 0) return true;
    }
}

static moeq_status strset_add(strset *set, const char *key) {
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

static void strset_free(strset *set) {
    free(set->slots);
    memset(set, 0, sizeof *set);
}

/* The JSON the writers produce goes into a growing text buffer (core/page.h). */
static void sb_str(mq_page *b, const char *s) { mq_page_put(b, s, strlen(s)); }

/* A JSON string literal, escaped the way serde_json does (short forms, else \u00xx). */
static void sb_json_str(mq_page *b, const char *s) {
    mq_page_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        const char *esc = NULL;
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        default: break;
        }
        if (esc) {
            sb_str(b, esc);
        } else if (c < 0x20) {
            mq_page_printf(b, "\\u%04x", c);
        } else {
            mq_page_put(b, s, 1);
        }
    }
    mq_page_put(b, "\"", 1);
}

static void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* qsort that accepts an empty (possibly NULL) array, which qsort itself does not. */
static void sort_n(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *)) {
    if (n > 1) qsort(base, n, size, cmp);
}

static bool is_json_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* ==== reader ================================================================================ */

typedef struct {
    char *key, *value;
} st_meta;

typedef struct {
    char *path;     /* file path, or the label of a caller's buffer */
    mq_map map;     /* owned mapping; empty for a caller's buffer */
    st_meta *meta;  /* __metadata__, sorted by key */
    size_t n_meta;
    void *owner;    /* mq_st_from_views: what the views point into, freed with free_owner */
    void (*free_owner)(void *);
} st_file;

struct mq_st {
    st_file *files;
    size_t n_files;
    mq_tensor_view *t;   /* sorted by name; names owned */
    size_t n;
};

static int cmp_view_name(const void *a, const void *b) {
    return strcmp(((const mq_tensor_view *)a)->name, ((const mq_tensor_view *)b)->name);
}

static int cmp_meta_key(const void *a, const void *b) {
    return strcmp(((const st_meta *)a)->key, ((const st_meta *)b)->key);
}

/* Offsets while validating: data_offsets and the view they belong to. */
typedef struct {
    uint64_t begin, end;
    size_t idx;
} st_span;

static int cmp_span(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* A non-negative integral JSON number that a double holds exactly. On failure *why says which. */
static bool json_uint(const cJSON *v, uint64_t *out, const char **why) {
    if (!cJSON_IsNumber(v)) {
        *why = "is not a number";
        return false;
    }
    double d = v->valuedouble;
    if (d < 0) {
        *why = "is negative";
        return false;
    }
    if (!(d == floor(d)) || !isfinite(d)) {
        *why = "is not an integer";
        return false;
    }
    if (d > ST_MAX_JSON_INT) {
        *why = "is too large";
        return false;
    }
    *out = (uint64_t)d;
    return true;
}

static void free_views(mq_tensor_view *t, size_t n) {
    if (!t) return;
    for (size_t i = 0; i < n; i++) free((char *)t[i].name);
    free(t);
}

static void free_file(st_file *f) {
    for (size_t i = 0; i < f->n_meta; i++) {
        free(f->meta[i].key);
        free(f->meta[i].value);
    }
    free(f->meta);
    mq_unmap(&f->map);
    if (f->free_owner) f->free_owner(f->owner);
    free(f->path);
    memset(f, 0, sizeof *f);
}

static moeq_status parse_metadata(const char *path, const cJSON *obj, st_file *f) {
    if (!cJSON_IsObject(obj))
        return mq_err(MOEQ_E_FORMAT, "%s: __metadata__ is not a JSON object", path);
    size_t n = (size_t)cJSON_GetArraySize(obj);
    f->meta = calloc(n ? n : 1, sizeof *f->meta);
    if (!f->meta) return mq_err(MOEQ_E_NOMEM, "%s: out of memory reading __metadata__", path);
    for (const cJSON *kv = obj->child; kv; kv = kv->next) {
        if (!cJSON_IsString(kv))
            return mq_err(MOEQ_E_FORMAT,
                          "%s: __metadata__ value for key '%s' is not a string (only string->"
                          "string metadata is allowed)",
                          path, kv->string ? kv->string : "");
        st_meta *m = &f->meta[f->n_meta++];
        m->key = mq_strdup(kv->string ? kv->string : "");
        m->value = mq_strdup(kv->valuestring);
        if (!m->key || !m->value) return MOEQ_E_NOMEM;
    }
    sort_n(f->meta, f->n_meta, sizeof *f->meta, cmp_meta_key);
    for (size_t i = 1; i < f->n_meta; i++)
        if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0)
            return mq_err(MOEQ_E_FORMAT, "%s: __metadata__ has the key '%s' twice", path,
                          f->meta[i].key);
    return MOEQ_OK;
}

/* Fills *t (name, dtype, shape, numel, nbytes) and *sp (offsets) from one header entry. */
static moeq_status parse_entry(const char *path, const cJSON *e, uint64_t data_len,
                               mq_tensor_view *t, st_span *sp) {
    const char *name = t->name;
    if (!cJSON_IsObject(e))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': header entry is not a JSON object", path,
                      name);
    const cJSON *jdtype = NULL, *jshape = NULL, *joff = NULL;
    for (const cJSON *c = e->child; c; c = c->next) {
        const cJSON **slot = NULL;
        if (!c->string) continue;
        if (strcmp(c->string, "dtype") == 0) slot = &jdtype;
        else if (strcmp(c->string, "shape") == 0) slot = &jshape;
        else if (strcmp(c->string, "data_offsets") == 0) slot = &joff;
        else continue;   /* unknown fields are ignored, as serde does */
        if (*slot)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': field '%s' appears twice", path, name,
                          c->string);
        *slot = c;
    }
    if (!jdtype) return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': missing dtype", path, name);
    if (!jshape) return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': missing shape", path, name);
    if (!joff) return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': missing data_offsets", path, name);

    if (!cJSON_IsString(jdtype))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': dtype is not a string", path, name);
    if (!mq_dtype_from_name(jdtype->valuestring, &t->dtype))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': unknown dtype '%s'", path, name,
                      jdtype->valuestring);

    if (!cJSON_IsArray(jshape))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': shape is not an array", path, name);
    int ndim = cJSON_GetArraySize(jshape);
    if (ndim > MQ_MAX_DIMS)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': shape has %d dimensions (at most %d)", path,
                      name, ndim, MQ_MAX_DIMS);
    t->ndim = ndim;
    int64_t numel = 1;
    int d = 0;
    for (const cJSON *c = jshape->child; c; c = c->next, d++) {
        uint64_t v;
        const char *why;
        if (!json_uint(c, &v, &why))
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': shape dimension %d %s", path, name, d,
                          why);
        t->shape[d] = (int64_t)v;
        if (!mq_mul_i64(numel, (int64_t)v, &numel))
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': shape product overflows", path, name);
    }
    t->numel = numel;
    size_t nbytes;
    if ((uint64_t)numel > SIZE_MAX ||
        !mq_mul_size((size_t)numel, moeq_dtype_size(t->dtype), &nbytes))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': byte size of the shape overflows", path,
                      name);
    t->nbytes = nbytes;

    if (!cJSON_IsArray(joff) || cJSON_GetArraySize(joff) != 2)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': data_offsets is not an array [begin, end]",
                      path, name);
    const char *why;
    if (!json_uint(joff->child, &sp->begin, &why) || !json_uint(joff->child->next, &sp->end, &why))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': a data_offsets value %s", path, name, why);
    if (sp->begin > sp->end)
        return mq_err(MOEQ_E_FORMAT,
                      "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] end before begin",
                      path, name, sp->begin, sp->end);
    if (sp->end > data_len)
        return mq_err(MOEQ_E_FORMAT,
                      "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                      "] run past the end of the file (data buffer is %" PRIu64 " bytes)",
                      path, name, sp->begin, sp->end, data_len);
    if (sp->end - sp->begin != (uint64_t)nbytes) {
        char shp[256];
        format_shape(shp, sizeof shp, t->ndim, t->shape);
        return mq_err(MOEQ_E_FORMAT,
                      "%s: tensor '%s': dtype %s shape %s needs %zu bytes but data_offsets [%" PRIu64
                      ", %" PRIu64 "] span %" PRIu64,
                      path, name, moeq_dtype_name(t->dtype), shp, nbytes, sp->begin, sp->end,
                      sp->end - sp->begin);
    }
    return MOEQ_OK;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static moeq_status check_duplicates(const char *path, const mq_tensor_view *t, size_t n) {
    const char **names = malloc((n ? n : 1) * sizeof *names);
    if (!names) return mq_err(MOEQ_E_NOMEM, "%s: out of memory checking tensor names", path);
    for (size_t i = 0; i < n; i++) names[i] = t[i].name;
    sort_n(names, n, sizeof *names, cmp_str_ptr);
    moeq_status st = MOEQ_OK;
    for (size_t i = 1; i < n && st == MOEQ_OK; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            st = mq_err(MOEQ_E_FORMAT, "%s: duplicate tensor name '%s'", path, names[i]);
    free(names);
    return st;
}

/* The buffer must tile [0, data_len) exactly: sorted by offsets, each tensor begins where the
 * previous one ended (safetensors Metadata::validate). */
static moeq_status check_tiling(const char *path, st_span *sp, size_t n, const mq_tensor_view *t,
                                uint64_t data_len) {
    sort_n(sp, n, sizeof *sp, cmp_span);
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const char *name = t[sp[i].idx].name;
        if (sp[i].begin < at)
            return mq_err(MOEQ_E_FORMAT,
                          "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                          "] overlap tensor '%s' (which ends at %" PRIu64 ")",
                          path, name, sp[i].begin, sp[i].end, t[sp[i - 1].idx].name, at);
        if (sp[i].begin > at) {
            if (i == 0)
                return mq_err(MOEQ_E_FORMAT,
                              "%s: tensor '%s': the data buffer does not start at offset 0 (first "
                              "tensor begins at %" PRIu64 ")",
                              path, name, sp[i].begin);
            return mq_err(MOEQ_E_FORMAT,
                          "%s: tensor '%s': gap of %" PRIu64
                          " bytes between tensor '%s' (ends at %" PRIu64 ") and this one",
                          path, name, sp[i].begin - at, t[sp[i - 1].idx].name, at);
        }
        at = sp[i].end;
    }
    if (at != data_len)
        return mq_err(MOEQ_E_FORMAT,
                      "%s: %" PRIu64 " trailing bytes after the last tensor (tensors end at data "
                      "offset %" PRIu64 ", the file's data buffer is %" PRIu64 " bytes)",
                      path, data_len - at, at, data_len);
    return MOEQ_OK;
}

/* Parses and validates one file held in [buf, buf+len). Adds its views to *t / *n (realloc'ed). */
static moeq_status parse_file(st_file *f, const uint8_t *buf, size_t len, mq_tensor_view **t_out,
                              size_t *n_out) {
    const char *path = f->path;
    if (len < 8)
        return mq_err(MOEQ_E_FORMAT,
                      "%s: file is %zu bytes, too short to hold the 8-byte header length", path,
                      len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | buf[i];
    if (hlen < 2)
        return mq_err(MOEQ_E_FORMAT, "%s: header length %" PRIu64 " is too small", path, hlen);
    if (hlen > ST_MAX_HEADER)
        return mq_err(MOEQ_E_FORMAT,
                      "%s: header length %" PRIu64 " exceeds the limit of %llu bytes", path, hlen,
                      ST_MAX_HEADER);
    if (hlen > len - 8)
        return mq_err(MOEQ_E_FORMAT,
                      "%s: header length %" PRIu64 " runs past the end of the file (%zu bytes)",
                      path, hlen, len);
    const char *hdr = (const char *)buf + 8;
    size_t hn = (size_t)hlen;
    uint64_t data_len = (uint64_t)(len - 8 - hn);
    const uint8_t *data = buf + 8 + hn;

    size_t k = 0;
    while (k < hn && is_json_ws(hdr[k])) k++;
    if (k == hn || hdr[k] != '{')
        return mq_err(MOEQ_E_FORMAT, "%s: header is not a JSON object (it must start with '{')",
                      path);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, hn, &end, 0);
    if (!root) {
        size_t at = end && end >= hdr && end <= hdr + hn ? (size_t)(end - hdr) : 0;
        return mq_err(MOEQ_E_FORMAT, "%s: header is not valid JSON (error near header byte %zu)",
                      path, at);
    }
    moeq_status st = MOEQ_OK;
    for (const char *p = end; p < hdr + hn; p++) {
        if (!is_json_ws(*p)) {
            st = mq_err(MOEQ_E_FORMAT,
                        "%s: unexpected bytes after the JSON header object (at header byte %zu)",
                        path, (size_t)(p - hdr));
            goto done;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = mq_err(MOEQ_E_FORMAT, "%s: header is not a JSON object", path);
        goto done;
    }

    size_t n_entries = (size_t)cJSON_GetArraySize(root);
    size_t base = *n_out, n_new = 0;
    mq_tensor_view *t = realloc(*t_out, (base + n_entries + 1) * sizeof *t);
    st_span *sp = calloc(n_entries + 1, sizeof *sp);
    if (t) *t_out = t;
    if (!t || !sp) {
        free(sp);
        st = mq_err(MOEQ_E_NOMEM, "%s: out of memory for %zu header entries", path, n_entries);
        goto done;
    }
    bool have_meta = false;
    for (const cJSON *e = root->child; e; e = e->next) {
        const char *key = e->string ? e->string : "";
        if (strcmp(key, "__metadata__") == 0) {
            if (have_meta) {
                st = mq_err(MOEQ_E_FORMAT, "%s: __metadata__ appears twice", path);
                break;
            }
            have_meta = true;
            if ((st = parse_metadata(path, e, f)) != MOEQ_OK) break;
            continue;
        }
        mq_tensor_view *v = &t[base + n_new];
        memset(v, 0, sizeof *v);
        v->name = mq_strdup(key);
        if (!v->name) {
            st = MOEQ_E_NOMEM;
            break;
        }
        n_new++;   /* counted now so the name is freed on error */
        v->file = f->path;
        sp[n_new - 1].idx = n_new - 1;
        if ((st = parse_entry(path, e, data_len, v, &sp[n_new - 1])) != MOEQ_OK) break;
    }
    *n_out = base + n_new;
    /* Duplicate names first (cJSON keeps duplicate keys), then the tiling (spans index the views
     * in header order), then the data pointers, and finally the views are sorted by name. */
    if (st == MOEQ_OK) st = check_duplicates(path, t + base, n_new);
    if (st == MOEQ_OK) st = check_tiling(path, sp, n_new, t + base, data_len);
    if (st == MOEQ_OK) {
        for (size_t i = 0; i < n_new; i++) t[base + sp[i].idx].data = data + sp[i].begin;
        sort_n(t + base, n_new, sizeof *t, cmp_view_name);
    }
    free(sp);
done:
    cJSON_Delete(root);
    return st;
}

static void st_free_parts(st_file *files, size_t n_files, mq_tensor_view *t, size_t n) {
    free_views(t, n);
    for (size_t i = 0; i < n_files; i++) free_file(&files[i]);
    free(files);
}

void mq_st_close(mq_st *st) {
    if (!st) return;
    st_free_parts(st->files, st->n_files, st->t, st->n);
    free(st);
}

static moeq_status st_new(size_t n_files, mq_st **out) {
    *out = NULL;
    mq_st *st = calloc(1, sizeof *st);
    st_file *files = calloc(n_files ? n_files : 1, sizeof *files);
    if (!st || !files) {
        free(st);
        free(files);
        return mq_err(MOEQ_E_NOMEM, "out of memory opening a safetensors checkpoint");
    }
    st->files = files;
    *out = st;
    return MOEQ_OK;
}

/* Opens (maps) and parses one file into st->files[st->n_files]. */
static moeq_status st_add_file(mq_st *st, const char *path) {
    st_file *f = &st->files[st->n_files++];
    f->path = mq_strdup(path);
    if (!f->path) return MOEQ_E_NOMEM;
    moeq_status s = mq_map_file(path, &f->map);
    if (s != MOEQ_OK) return s;
    return parse_file(f, f->map.data, f->map.size, &st->t, &st->n);
}

moeq_status mq_st_open_file(const char *path, mq_st **out) {
    mq_st *st;
    moeq_status s = st_new(1, &st);
    if (s != MOEQ_OK) return s;
    if ((s = st_add_file(st, path)) != MOEQ_OK) {
        mq_st_close(st);
        return s;
    }
    *out = st;
    return MOEQ_OK;
}

moeq_status mq_st_open_buffer(const void *buf, size_t len, const char *label, mq_st **out) {
    mq_st *st;
    moeq_status s = st_new(1, &st);
    if (s != MOEQ_OK) return s;
    st_file *f = &st->files[st->n_files++];
    f->path = mq_strdup(label ? label : "(buffer)");
    if (!f->path)
        s = MOEQ_E_NOMEM;
    else if (!buf && len)
        s = mq_err(MOEQ_E_ARG, "%s: NULL buffer", f->path);
    else
        s = parse_file(f, buf, len, &st->t, &st->n);
    if (s != MOEQ_OK) {
        mq_st_close(st);
        return s;
    }
    *out = st;
    return MOEQ_OK;
}

/* ---- sharded checkpoints ------------------------------------------------------------------ */

typedef struct {
    const char *tensor, *shard;   /* borrowed from the parsed index */
    size_t shard_idx;
} st_map_entry;

static int cmp_entry_shard(const void *a, const void *b) {
    return strcmp(((const st_map_entry *)a)->shard, ((const st_map_entry *)b)->shard);
}

static int cmp_entry_tensor(const void *a, const void *b) {
    return strcmp(((const st_map_entry *)a)->tensor, ((const st_map_entry *)b)->tensor);
}

static const mq_tensor_view *find_view(const mq_tensor_view *t, size_t n, const char *name) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(t[mid].name, name);
        if (c == 0) return &t[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Returns the path's last component (shard file names are compared by it). */
static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static moeq_status open_index(const char *dir, const char *index_path, mq_st **out) {
    char *text = NULL;
    size_t text_len = 0;
    moeq_status s = mq_read_file(index_path, &text, &text_len);
    if (s != MOEQ_OK) return s;
    cJSON *root = cJSON_ParseWithLength(text, text_len);
    free(text);
    if (!root) return mq_err(MOEQ_E_FORMAT, "%s: not valid JSON", index_path);

    st_map_entry *e = NULL;
    mq_st *st = NULL;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    size_t n_map = 0;
    if (!cJSON_IsObject(root)) {
        s = mq_err(MOEQ_E_FORMAT, "%s: not a JSON object", index_path);
        goto done;
    }
    if (!wm) {
        s = mq_err(MOEQ_E_FORMAT, "%s: no weight_map", index_path);
        goto done;
    }
    if (!cJSON_IsObject(wm)) {
        s = mq_err(MOEQ_E_FORMAT, "%s: weight_map is not a JSON object", index_path);
        goto done;
    }
    n_map = (size_t)cJSON_GetArraySize(wm);
    e = calloc(n_map ? n_map : 1, sizeof *e);
    if (!e) {
        s = mq_err(MOEQ_E_NOMEM, "%s: out of memory", index_path);
        goto done;
    }
    size_t i = 0;
    for (const cJSON *c = wm->child; c; c = c->next, i++) {
        const char *tn = c->string ? c->string : "";
        if (!cJSON_IsString(c) || !c->valuestring[0]) {
            s = mq_err(MOEQ_E_FORMAT, "%s: weight_map entry for tensor '%s' is not a file name",
                       index_path, tn);
            goto done;
        }
        /* Shards live in the checkpoint directory; refuse paths that leave it. */
        if (strchr(c->valuestring, '/') || strcmp(c->valuestring, "..") == 0 ||
            strcmp(c->valuestring, ".") == 0) {
            s = mq_err(MOEQ_E_FORMAT,
                       "%s: weight_map entry for tensor '%s' names '%s', which is not a plain file "
                       "name in the checkpoint directory",
                       index_path, tn, c->valuestring);
            goto done;
        }
        e[i].tensor = tn;
        e[i].shard = c->valuestring;
    }
    sort_n(e, n_map, sizeof *e, cmp_entry_tensor);
    for (i = 1; i < n_map; i++) {
        if (strcmp(e[i - 1].tensor, e[i].tensor) == 0) {
            s = mq_err(MOEQ_E_FORMAT, "%s: weight_map lists tensor '%s' twice", index_path,
                       e[i].tensor);
            goto done;
        }
    }
    /* Distinct shards, in name order (which is also their number order). */
    sort_n(e, n_map, sizeof *e, cmp_entry_shard);
    size_t n_shards = 0;
    for (i = 0; i < n_map; i++) {
        if (i == 0 || strcmp(e[i - 1].shard, e[i].shard) != 0) n_shards++;
        e[i].shard_idx = n_shards - 1;
    }
    if ((s = st_new(n_shards, &st)) != MOEQ_OK) goto done;
    for (i = 0; i < n_map; i++) {
        if (i > 0 && e[i].shard_idx == e[i - 1].shard_idx) continue;
        char *path = mq_path_join(dir, e[i].shard);
        if (!path) {
            s = MOEQ_E_NOMEM;
            goto done;
        }
        if (!mq_file_exists(path)) {
            s = mq_err(MOEQ_E_FORMAT,
                       "%s: shard '%s' (holding tensor '%s') is missing: %s does not exist",
                       index_path, e[i].shard, e[i].tensor, path);
            free(path);
            goto done;
        }
        s = st_add_file(st, path);
        free(path);
        if (s != MOEQ_OK) goto done;
    }
    sort_n(st->t, st->n, sizeof *st->t, cmp_view_name);
    for (i = 1; i < st->n; i++) {
        if (strcmp(st->t[i - 1].name, st->t[i].name) == 0) {
            const char *f1 = base_name(st->t[i - 1].file), *f2 = base_name(st->t[i].file);
            if (strcmp(f1, f2) > 0) {   /* qsort is not stable: name them in a fixed order */
                const char *tmp = f1;
                f1 = f2;
                f2 = tmp;
            }
            s = mq_err(MOEQ_E_FORMAT, "%s: tensor '%s' is stored in two shards: %s and %s",
                       index_path, st->t[i].name, f1, f2);
            goto done;
        }
    }
    for (i = 0; i < n_map; i++) {
        const mq_tensor_view *v = find_view(st->t, st->n, e[i].tensor);
        if (!v) {
            s = mq_err(MOEQ_E_FORMAT,
                       "%s: tensor '%s' is mapped to shard '%s', which does not contain it",
                       index_path, e[i].tensor, e[i].shard);
            goto done;
        }
        if (v->file != st->files[e[i].shard_idx].path) {
            s = mq_err(MOEQ_E_FORMAT,
                       "%s: tensor '%s' is mapped to shard '%s' but is stored in '%s'", index_path,
                       e[i].tensor, e[i].shard, base_name(v->file));
            goto done;
        }
    }
done:
    free(e);
    cJSON_Delete(root);
    if (s != MOEQ_OK) {
        mq_st_close(st);
        return s;
    }
    *out = st;
    return MOEQ_OK;
}

static bool has_suffix(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* ---- FP8 block-quantized weights ---------------------------------------------------------- */

static const char k_scale_suffix[] = "_scale_inv";

moeq_status mq_st_link_fp8(mq_st *st, int32_t br, int32_t bc, mq_block_dequant_fn dequant) {
    if (br < 1 || bc < 1 || !dequant)
        return mq_err(MOEQ_E_ARG, "FP8 block size %d x %d%s", br, bc, dequant ? "" : ", no decoder");
    const size_t sl = sizeof k_scale_suffix - 1;
    char name[1024];
    /* every scale names its weight */
    for (size_t i = 0; i < st->n; i++) {
        mq_tensor_view *s = &st->t[i];
        size_t len = strlen(s->name);
        if (!has_suffix(s->name, ".weight_scale_inv") || len - sl >= sizeof name) continue;
        memcpy(name, s->name, len - sl);
        name[len - sl] = '\0';
        mq_tensor_view *w = (mq_tensor_view *)find_view(st->t, st->n, name);
        if (!w)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s' has no weight '%s' beside it", s->file,
                          s->name, name);
        if (w->dtype != MOEQ_DT_F8_E4M3)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s' is %s, but it has a block scale '%s' (an "
                          "FP8 checkpoint stores such weights as F8_E4M3)", w->file, w->name,
                          moeq_dtype_name(w->dtype), s->name);
        if (w->ndim != 2)
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: tensor '%s': FP8 block-quantized weights are "
                          "read as 2-D [rows, cols] only (it has %d dimensions)", w->file, w->name,
                          w->ndim);
        if (s->dtype != MOEQ_DT_F32 && s->dtype != MOEQ_DT_BF16 && s->dtype != MOEQ_DT_F16)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': dtype %s (expected F32, BF16 or F16)",
                          s->file, s->name, moeq_dtype_name(s->dtype));
        int64_t sr = (w->shape[0] + br - 1) / br, sc = (w->shape[1] + bc - 1) / bc;
        if (s->ndim != 2 || s->shape[0] != sr || s->shape[1] != sc) {
            char got[96];
            format_shape(got, sizeof got, s->ndim, s->shape);
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': shape %s, expected [%lld, %lld] for "
                          "weight '%s' [%lld, %lld] in blocks of %d x %d (config.json "
                          "quantization_config.weight_block_size)", s->file, s->name, got,
                          (long long)sr, (long long)sc, w->name, (long long)w->shape[0],
                          (long long)w->shape[1], br, bc);
        }
        w->scale_inv = s;
        w->block_rows = br;
        w->block_cols = bc;
        w->dequant = dequant;
        s->is_block_scale = true;
    }
    /* and every FP8 weight has its scale */
    for (size_t i = 0; i < st->n; i++) {
        const mq_tensor_view *w = &st->t[i];
        if (w->dtype == MOEQ_DT_F8_E4M3 && has_suffix(w->name, ".weight") && !w->scale_inv)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s' is F8_E4M3 but its block scale "
                          "'%s_scale_inv' is missing", w->file, w->name, w->name);
    }
    return MOEQ_OK;
}

moeq_status mq_st_open_dir_files(const char *dir, mq_st **out) {
    *out = NULL;
    if (!mq_dir_exists(dir)) return mq_err(MOEQ_E_IO, "%s: not a directory", dir);
    char *path = mq_path_join(dir, ST_INDEX_NAME);
    if (!path) return MOEQ_E_NOMEM;
    moeq_status s;
    if (mq_file_exists(path)) {
        s = open_index(dir, path, out);
        free(path);
        return s;
    }
    free(path);
    if (!(path = mq_path_join(dir, "model.safetensors"))) return MOEQ_E_NOMEM;
    if (mq_file_exists(path)) {
        s = mq_st_open_file(path, out);
        free(path);
        return s;
    }
    free(path);
    path = NULL;

    DIR *d = opendir(dir);
    if (!d) return mq_err(MOEQ_E_IO, "%s: cannot list: %s", dir, strerror(errno));
    int count = 0;
    char first[2][256] = {{0}};
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' || !has_suffix(de->d_name, ".safetensors")) continue;
        if (count < 2) snprintf(first[count], sizeof first[count], "%s", de->d_name);
        if (count == 0) path = mq_path_join(dir, de->d_name);
        count++;
    }
    closedir(d);
    if (count == 0) {
        free(path);
        return mq_err(MOEQ_E_NOTFOUND,
                      "%s: no " ST_INDEX_NAME ", model.safetensors or other .safetensors file",
                      dir);
    }
    if (count > 1) {
        free(path);
        return mq_err(MOEQ_E_FORMAT,
                      "%s: %d .safetensors files (%s, %s, ...) but no " ST_INDEX_NAME
                      " saying how they form one checkpoint",
                      dir, count, first[0], first[1]);
    }
    if (!path) return MOEQ_E_NOMEM;
    s = mq_st_open_file(path, out);
    free(path);
    return s;
}

moeq_status mq_st_from_views(const char *path, mq_tensor_view *t, size_t n, void *owner,
                             void (*free_owner)(void *), mq_st **out) {
    *out = NULL;
    mq_st *st;
    moeq_status s = st_new(1, &st);
    if (s) {
        free_views(t, n);
        if (free_owner) free_owner(owner);
        return s;
    }
    st_file *f = &st->files[st->n_files++];
    f->owner = owner;
    f->free_owner = free_owner;
    st->t = t;
    st->n = n;
    if (!(f->path = mq_strdup(path ? path : "(views)"))) {
        mq_st_close(st);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) t[i].file = f->path;
    sort_n(t, n, sizeof *t, cmp_view_name);
    for (size_t i = 1; i < n; i++)
        if (!strcmp(t[i - 1].name, t[i].name)) {
            s = mq_err(MOEQ_E_FORMAT, "%s: two tensors are read as '%s'", f->path, t[i].name);
            mq_st_close(st);
            return s;
        }
    *out = st;
    return MOEQ_OK;
}

size_t mq_st_count(const mq_st *st) { return st ? st->n : 0; }

const mq_tensor_view *mq_st_at(const mq_st *st, size_t i) {
    return st && i < st->n ? &st->t[i] : NULL;
}

const mq_tensor_view *mq_st_find(const mq_st *st, const char *name) {
    return st && name ? find_view(st->t, st->n, name) : NULL;
}

const char *mq_st_metadata(const mq_st *st, const char *key) {
    if (!st || !key || st->n_files == 0) return NULL;
    const st_file *f = &st->files[0];
    if (f->n_meta == 0) return NULL;
    st_meta probe = {(char *)key, NULL};
    const st_meta *m = bsearch(&probe, f->meta, f->n_meta, sizeof *f->meta, cmp_meta_key);
    return m ? m->value : NULL;
}

/* ---- conversion ---------------------------------------------------------------------------- */

bool mq_tensor_whole_only(const mq_tensor_view *t) {
    return t->scale_inv || (t->ggml && t->ggml->mla_heads > 0);
}

moeq_status mq_tensor_range_to_f32(const mq_tensor_view *t, int64_t k0, int64_t k1, float *out) {
    if (k0 < 0 || k1 < k0 || k1 > t->numel)
        return mq_err(MOEQ_E_ARG, "%s: tensor '%s': values [%lld, %lld) of %lld", t->file ? t->file : "?",
                      t->name, (long long)k0, (long long)k1, (long long)t->numel);
    if (t->ggml) return mq_ggml_view_to_f32(t, k0, k1, out);
    if (k0 == 0 && k1 == t->numel) return mq_tensor_to_f32(t, out);
    if (t->scale_inv)
        return mq_err(MOEQ_E_ARG, "%s: tensor '%s': an FP8 block-quantized weight converts to fp32 only "
                      "as the whole 2-D tensor", t->file ? t->file : "?", t->name);
    mq_tensor_view v = *t;
    const size_t es = moeq_dtype_size(v.dtype);
    v.data += (size_t)k0 * es;
    v.numel = k1 - k0;
    v.nbytes = (size_t)(k1 - k0) * es;
    v.ndim = 1;
    v.shape[0] = k1 - k0;
    return mq_tensor_to_f32(&v, out);
}

moeq_status mq_tensor_to_f32(const mq_tensor_view *t, float *out) {
    if (t->ggml) return mq_ggml_view_to_f32(t, 0, t->numel, out);
    /* Views may be unaligned (a header length that is not a multiple of 8, mixed dtypes), so
     * elements are loaded with memcpy. */
    const uint8_t *p = t->data;
    size_t n = (size_t)t->numel;
    switch (t->dtype) {
    case MOEQ_DT_F32:
        if (n) memcpy(out, p, n * sizeof(float));
        return MOEQ_OK;
    case MOEQ_DT_BF16: {
        size_t i = 0;
#if defined(__SSE2__)
        /* eight a step (SSE2, every x86-64 CPU): each value's 16 bits become the high half of a
         * float, as mq_bf16_to_f32; the scalar loop below is its twin (MOEQ_FORCE_REF). Reading a
         * layer's experts is this loop on every core. */
        if (!mq_force_ref()) {
            const __m128i z = _mm_setzero_si128();
            for (; i + 8 <= n; i += 8) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(p + 2 * i));
                _mm_storeu_si128((__m128i *)(out + i), _mm_unpacklo_epi16(z, h));
                _mm_storeu_si128((__m128i *)(out + i + 4), _mm_unpackhi_epi16(z, h));
            }
        }
#endif
        for (; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = mq_bf16_to_f32(h);
        }
        return MOEQ_OK;
    }
    case MOEQ_DT_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = mq_f16_to_f32(h);
        }
        return MOEQ_OK;
    case MOEQ_DT_F64:
        for (size_t i = 0; i < n; i++) {
            double d;
            memcpy(&d, p + 8 * i, 8);
            out[i] = (float)d;
        }
        return MOEQ_OK;
    case MOEQ_DT_F8_E4M3:   /* float8_e4m3fn (e.g. NVFP4 block scales, FP8 checkpoints) */
        if (t->scale_inv) {
            const mq_tensor_view *sc = t->scale_inv;
            bool whole = t->ndim == 2 && t->block_rows > 0 && t->block_cols > 0 &&
                         t->numel == t->shape[0] * t->shape[1] &&
                         sc->shape[0] == (t->shape[0] + t->block_rows - 1) / t->block_rows &&
                         sc->shape[1] == (t->shape[1] + t->block_cols - 1) / t->block_cols;
            if (!whole)
                return mq_err(MOEQ_E_ARG, "%s: tensor '%s': an FP8 block-quantized weight converts "
                              "to fp32 only as the whole 2-D tensor", t->file ? t->file : "?",
                              t->name);
            return mq_fp8_dequant_rows(t, 0, t->shape[0], out);
        }
        for (size_t i = 0; i < n; i++) out[i] = mq_e4m3_decode_inl(p[i]);
        return MOEQ_OK;
    default:
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: tensor '%s': dtype %s is not a floating type",
                      t->file ? t->file : "?", t->name, moeq_dtype_name(t->dtype));
    }
}

/* ==== writer ================================================================================ */

typedef struct {
    char *name;
    moeq_dtype dtype;
    int ndim;
    int64_t shape[MQ_MAX_DIMS];
    void *data;   /* mq_alloc'ed, owned */
    size_t nbytes;
} stw_tensor;

struct mq_st_writer {
    stw_tensor *t;
    size_t n, cap;
    strset names;
    st_meta *meta;   /* set keys other than "format" */
    size_t n_meta;
    char *format;    /* "pt" unless set */
    size_t data_bytes;
};

mq_st_writer *mq_stw_new(void) {
    mq_st_writer *w = calloc(1, sizeof *w);
    if (w) w->format = mq_strdup("pt");
    if (!w || !w->format) {
        free(w);
        mq_err(MOEQ_E_NOMEM, "out of memory: safetensors writer");
        return NULL;
    }
    return w;
}

void mq_stw_free(mq_st_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n; i++) {
        free(w->t[i].name);
        mq_free(w->t[i].data);
    }
    free(w->t);
    strset_free(&w->names);
    for (size_t i = 0; i < w->n_meta; i++) {
        free(w->meta[i].key);
        free(w->meta[i].value);
    }
    free(w->meta);
    free(w->format);
    free(w);
}

/* Argument checks shared by the file and shard writers (not the duplicate check). */
static moeq_status check_tensor_args(const char *name, moeq_dtype dtype, int ndim,
                                     const int64_t *shape, const void *data, size_t nbytes) {
    if (!name || !name[0]) return mq_err(MOEQ_E_ARG, "safetensors writer: empty tensor name");
    if (strcmp(name, "__metadata__") == 0)
        return mq_err(MOEQ_E_ARG, "safetensors writer: '__metadata__' is not a tensor name");
    if (!dtype_valid(dtype))
        return mq_err(MOEQ_E_ARG, "safetensors writer: tensor '%s': invalid dtype %d", name,
                      (int)dtype);
    if (ndim < 0 || ndim > MQ_MAX_DIMS || (ndim > 0 && !shape))
        return mq_err(MOEQ_E_ARG, "safetensors writer: tensor '%s': %d dimensions (0..%d allowed)",
                      name, ndim, MQ_MAX_DIMS);
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return mq_err(MOEQ_E_SHAPE, "safetensors writer: tensor '%s': negative dimension %d",
                          name, i);
        if (!mq_mul_i64(numel, shape[i], &numel))
            return mq_err(MOEQ_E_SHAPE, "safetensors writer: tensor '%s': shape product overflows",
                          name);
    }
    size_t need;
    if ((uint64_t)numel > SIZE_MAX || !mq_mul_size((size_t)numel, moeq_dtype_size(dtype), &need))
        return mq_err(MOEQ_E_SHAPE, "safetensors writer: tensor '%s': byte size overflows", name);
    if (need != nbytes) {
        char shp[256];
        format_shape(shp, sizeof shp, ndim, shape);
        return mq_err(MOEQ_E_SHAPE,
                      "safetensors writer: tensor '%s': dtype %s shape %s needs %zu bytes, got %zu",
                      name, moeq_dtype_name(dtype), shp, need, nbytes);
    }
    if (nbytes && !data)
        return mq_err(MOEQ_E_ARG, "safetensors writer: tensor '%s': NULL data", name);
    return MOEQ_OK;
}

moeq_status mq_stw_add_owned(mq_st_writer *w, const char *name, moeq_dtype dtype, int ndim,
                             const int64_t *shape, void *data, size_t nbytes) {
    moeq_status s = check_tensor_args(name, dtype, ndim, shape, data, nbytes);
    if (s == MOEQ_OK && strset_has(&w->names, name))
        s = mq_err(MOEQ_E_EXISTS, "safetensors writer: tensor '%s' added twice", name);
    if (s == MOEQ_OK && w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 64;
        stw_tensor *t = realloc(w->t, cap * sizeof *t);
        if (!t) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory: safetensors writer table");
        } else {
            w->t = t;
            w->cap = cap;
        }
    }
    char *nm = s == MOEQ_OK ? mq_strdup(name) : NULL;
    if (s == MOEQ_OK && !nm) s = MOEQ_E_NOMEM;
    if (s == MOEQ_OK && (s = strset_add(&w->names, nm)) != MOEQ_OK) free(nm);
    if (s != MOEQ_OK) {
        mq_free(data);
        return s;
    }
    stw_tensor *t = &w->t[w->n++];
    memset(t, 0, sizeof *t);
    t->name = nm;
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->data = data;
    t->nbytes = nbytes;
    w->data_bytes += nbytes;
    return MOEQ_OK;
}

moeq_status mq_stw_add(mq_st_writer *w, const char *name, moeq_dtype dtype, int ndim,
                       const int64_t *shape, const void *data, size_t nbytes) {
    /* Check before copying, so a bad call costs no allocation. */
    moeq_status s = check_tensor_args(name, dtype, ndim, shape, data, nbytes);
    if (s != MOEQ_OK) return s;
    void *copy = mq_alloc(nbytes, name);
    if (!copy) return MOEQ_E_NOMEM;
    if (nbytes) memcpy(copy, data, nbytes);
    return mq_stw_add_owned(w, name, dtype, ndim, shape, copy, nbytes);
}

moeq_status mq_stw_set_metadata(mq_st_writer *w, const char *key, const char *value) {
    if (!key || !value) return mq_err(MOEQ_E_ARG, "safetensors writer: NULL metadata key/value");
    char *v = mq_strdup(value);
    if (!v) return MOEQ_E_NOMEM;
    if (strcmp(key, "format") == 0) {
        free(w->format);
        w->format = v;
        return MOEQ_OK;
    }
    for (size_t i = 0; i < w->n_meta; i++) {
        if (strcmp(w->meta[i].key, key) == 0) {
            free(w->meta[i].value);
            w->meta[i].value = v;
            return MOEQ_OK;
        }
    }
    st_meta *m = realloc(w->meta, (w->n_meta + 1) * sizeof *m);
    char *k = mq_strdup(key);
    if (m) w->meta = m;
    if (!m || !k) {
        free(v);
        free(k);
        return mq_err(MOEQ_E_NOMEM, "out of memory: safetensors metadata");
    }
    w->meta[w->n_meta].key = k;
    w->meta[w->n_meta].value = v;
    w->n_meta++;
    return MOEQ_OK;
}

size_t mq_stw_data_bytes(const mq_st_writer *w) { return w ? w->data_bytes : 0; }
size_t mq_stw_count(const mq_st_writer *w) { return w ? w->n : 0; }

/* The reference order: dtype descending (enum order = alignment order), then name. */
static int cmp_stw_order(const void *a, const void *b) {
    const stw_tensor *x = *(const stw_tensor *const *)a, *y = *(const stw_tensor *const *)b;
    if (x->dtype != y->dtype) return x->dtype > y->dtype ? -1 : 1;
    return strcmp(x->name, y->name);
}

moeq_status mq_stw_write(mq_st_writer *w, const char *path) {
    const stw_tensor **ord = malloc((w->n ? w->n : 1) * sizeof *ord);
    if (!ord) return mq_err(MOEQ_E_NOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < w->n; i++) ord[i] = &w->t[i];
    sort_n(ord, w->n, sizeof *ord, cmp_stw_order);
    sort_n(w->meta, w->n_meta, sizeof *w->meta, cmp_meta_key);

    mq_page h = {0};
    sb_str(&h, "{\"__metadata__\":{\"format\":");
    sb_json_str(&h, w->format);
    for (size_t i = 0; i < w->n_meta; i++) {
        mq_page_put(&h, ",", 1);
        sb_json_str(&h, w->meta[i].key);
        mq_page_put(&h, ":", 1);
        sb_json_str(&h, w->meta[i].value);
    }
    mq_page_put(&h, "}", 1);
    uint64_t off = 0;
    for (size_t i = 0; i < w->n; i++) {
        const stw_tensor *t = ord[i];
        mq_page_put(&h, ",", 1);
        sb_json_str(&h, t->name);
        mq_page_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", moeq_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) mq_page_printf(&h, "%s%" PRId64, d ? "," : "", t->shape[d]);
        mq_page_printf(&h, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + t->nbytes);
        off += t->nbytes;
    }
    mq_page_put(&h, "}", 1);
    while (!h.oom && h.n % 8 != 0) mq_page_put(&h, " ", 1);   /* data starts 8-aligned */
    moeq_status s = MOEQ_OK;
    if (h.oom) s = mq_err(MOEQ_E_NOMEM, "%s: out of memory building the header", path);
    else if (h.n > ST_MAX_HEADER)
        s = mq_err(MOEQ_E_ARG, "%s: header of %zu bytes exceeds the safetensors limit", path, h.n);

    mq_atomic_file af;
    if (s == MOEQ_OK) s = mq_atomic_open(&af, path);
    if (s == MOEQ_OK) {
        uint8_t len8[8];
        for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i));
        s = mq_atomic_write(&af, len8, 8);
        if (s == MOEQ_OK) s = mq_atomic_write(&af, h.s, h.n);
        for (size_t i = 0; i < w->n && s == MOEQ_OK; i++)
            s = mq_atomic_write(&af, ord[i]->data, ord[i]->nbytes);
        if (s == MOEQ_OK)
            s = mq_atomic_commit(&af);
        else
            mq_atomic_abort(&af);
    }
    free(h.s);
    free(ord);
    return s;
}

/* ==== sharded checkpoint writer ============================================================= */

typedef struct {
    char *name;
    size_t shard;
} shw_entry;

struct mq_shard_writer {
    char *dir;
    size_t max_bytes;     /* 0: no limit */
    mq_st_writer *cur;    /* the shard being filled */
    char **tmp;           /* flushed shards, in order */
    size_t n_tmp;
    char **written;       /* final files written by finish (removed if it does not complete) */
    size_t n_written;
    shw_entry *map;
    size_t n_map, cap_map;
    strset names;
    uint64_t total;
    bool finished;
};

moeq_status mq_shards_open(const char *dir, size_t max_shard_bytes, mq_shard_writer **out) {
    *out = NULL;
    if (!mq_dir_exists(dir)) return mq_err(MOEQ_E_IO, "%s: output directory does not exist", dir);
    mq_shard_writer *sw = calloc(1, sizeof *sw);
    if (!sw) return mq_err(MOEQ_E_NOMEM, "out of memory: shard writer");
    sw->dir = mq_strdup(dir);
    sw->max_bytes = max_shard_bytes;
    sw->cur = mq_stw_new();
    if (!sw->dir || !sw->cur) {
        mq_shards_free(sw);
        return MOEQ_E_NOMEM;
    }
    *out = sw;
    return MOEQ_OK;
}

static moeq_status shards_flush(mq_shard_writer *sw) {
    char **tmp = realloc(sw->tmp, (sw->n_tmp + 1) * sizeof *tmp);
    if (!tmp) return mq_err(MOEQ_E_NOMEM, "out of memory: shard list");
    sw->tmp = tmp;
    /* A hidden name that no reader takes for a checkpoint file; renamed by finish(). */
    char *path = mq_asprintf("%s/.moeq-shard-%05zu.safetensors.tmp.%ld", sw->dir, sw->n_tmp + 1,
                             (long)getpid());
    if (!path) return MOEQ_E_NOMEM;
    moeq_status s = mq_stw_write(sw->cur, path);
    if (s != MOEQ_OK) {
        free(path);
        return s;
    }
    sw->tmp[sw->n_tmp++] = path;
    mq_stw_free(sw->cur);
    sw->cur = mq_stw_new();
    return sw->cur ? MOEQ_OK : MOEQ_E_NOMEM;
}

moeq_status mq_shards_add_owned(mq_shard_writer *sw, const char *name, moeq_dtype dtype, int ndim,
                                const int64_t *shape, void *data, size_t nbytes) {
    moeq_status s = check_tensor_args(name, dtype, ndim, shape, data, nbytes);
    if (s == MOEQ_OK && sw->finished)
        s = mq_err(MOEQ_E_ARG, "%s: tensor '%s' added after the checkpoint was finished", sw->dir,
                   name);
    if (s == MOEQ_OK && strset_has(&sw->names, name))
        s = mq_err(MOEQ_E_EXISTS, "%s: tensor '%s' added twice", sw->dir, name);
    if (s == MOEQ_OK && sw->n_map == sw->cap_map) {
        size_t cap = sw->cap_map ? sw->cap_map * 2 : 256;
        shw_entry *m = realloc(sw->map, cap * sizeof *m);
        if (!m) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory: weight map");
        } else {
            sw->map = m;
            sw->cap_map = cap;
        }
    }
    char *nm = s == MOEQ_OK ? mq_strdup(name) : NULL;
    if (s == MOEQ_OK && !nm) s = MOEQ_E_NOMEM;
    if (s == MOEQ_OK && (s = strset_add(&sw->names, nm)) != MOEQ_OK) {
        free(nm);
        nm = NULL;
    }
    if (s != MOEQ_OK) {
        mq_free(data);
        return s;
    }
    sw->map[sw->n_map].name = nm;   /* owned from here, also on a later error */
    sw->map[sw->n_map].shard = sw->n_tmp;
    sw->n_map++;

    size_t cur = mq_stw_data_bytes(sw->cur);
    /* Start a new shard when this tensor would push the current one past the limit. */
    if (sw->max_bytes && cur > 0 && (cur >= sw->max_bytes || nbytes > sw->max_bytes - cur)) {
        if ((s = shards_flush(sw)) != MOEQ_OK) {
            mq_free(data);
            return s;
        }
        sw->map[sw->n_map - 1].shard = sw->n_tmp;
    }
    sw->total += nbytes;
    return mq_stw_add_owned(sw->cur, name, dtype, ndim, shape, data, nbytes);
}

moeq_status mq_shards_add(mq_shard_writer *sw, const char *name, moeq_dtype dtype, int ndim,
                          const int64_t *shape, const void *data, size_t nbytes) {
    moeq_status s = check_tensor_args(name, dtype, ndim, shape, data, nbytes);
    if (s != MOEQ_OK) return s;
    void *copy = mq_alloc(nbytes, name);
    if (!copy) return MOEQ_E_NOMEM;
    if (nbytes) memcpy(copy, data, nbytes);
    return mq_shards_add_owned(sw, name, dtype, ndim, shape, copy, nbytes);
}

static int cmp_shw_name(const void *a, const void *b) {
    return strcmp(((const shw_entry *)a)->name, ((const shw_entry *)b)->name);
}

static moeq_status note_written(mq_shard_writer *sw, char *path) {
    char **w = realloc(sw->written, (sw->n_written + 1) * sizeof *w);
    if (!w) {
        free(path);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    sw->written = w;
    sw->written[sw->n_written++] = path;
    return MOEQ_OK;
}

moeq_status mq_shards_finish(mq_shard_writer *sw) {
    if (sw->finished) return MOEQ_OK;
    moeq_status s;
    if (sw->n_tmp == 0) {
        /* One shard: a plain model.safetensors, and no index. A stale index from an earlier
         * write would shadow it, so it goes. */
        char *path = mq_path_join(sw->dir, "model.safetensors");
        char *idx = mq_path_join(sw->dir, ST_INDEX_NAME);
        if (!path || !idx) {
            free(path);
            free(idx);
            return MOEQ_E_NOMEM;
        }
        s = mq_stw_write(sw->cur, path);
        if (s == MOEQ_OK) unlink(idx);
        free(path);
        free(idx);
        if (s == MOEQ_OK) sw->finished = true;
        return s;
    }
    if (mq_stw_count(sw->cur) > 0 && (s = shards_flush(sw)) != MOEQ_OK) return s;
    size_t k = sw->n_tmp;
    char **final = calloc(k, sizeof *final);
    if (!final) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t i = 0; i < k; i++) {
        final[i] = mq_asprintf("model-%05zu-of-%05zu.safetensors", i + 1, k);
        if (!final[i]) {
            s = MOEQ_E_NOMEM;
            goto done;
        }
    }
    for (size_t i = 0; i < k; i++) {
        char *path = mq_path_join(sw->dir, final[i]);
        if (!path) {
            s = MOEQ_E_NOMEM;
            goto done;
        }
        if (rename(sw->tmp[i], path) != 0) {
            s = mq_err(MOEQ_E_IO, "%s: cannot rename into place: %s", path, strerror(errno));
            free(path);
            goto done;
        }
        free(sw->tmp[i]);
        sw->tmp[i] = NULL;
        if ((s = note_written(sw, path)) != MOEQ_OK) goto done;
    }
    sort_n(sw->map, sw->n_map, sizeof *sw->map, cmp_shw_name);
    /* The layout transformers' save_pretrained writes: json.dumps(indent=2, sort_keys=True). */
    mq_page j = {0};
    mq_page_printf(&j, "{\n  \"metadata\": {\n    \"total_size\": %" PRIu64 "\n  },\n  \"weight_map\": {",
           sw->total);
    for (size_t i = 0; i < sw->n_map; i++) {
        sb_str(&j, i ? ",\n    " : "\n    ");
        sb_json_str(&j, sw->map[i].name);
        sb_str(&j, ": ");
        sb_json_str(&j, final[sw->map[i].shard]);
    }
    sb_str(&j, sw->n_map ? "\n  }\n}\n" : "}\n}\n");
    if (j.oom) {
        s = mq_err(MOEQ_E_NOMEM, "%s: out of memory building the index", sw->dir);
    } else {
        char *idx = mq_path_join(sw->dir, ST_INDEX_NAME);
        s = idx ? mq_write_file_atomic(idx, j.s, j.n) : MOEQ_E_NOMEM;
        free(idx);
    }
    free(j.s);
    if (s == MOEQ_OK) sw->finished = true;
done:
    for (size_t i = 0; i < k; i++) free(final[i]);
    free(final);
    return s;
}

void mq_shards_free(mq_shard_writer *sw) {
    if (!sw) return;
    for (size_t i = 0; i < sw->n_tmp; i++) {
        if (sw->tmp[i]) unlink(sw->tmp[i]);
        free(sw->tmp[i]);
    }
    free(sw->tmp);
    for (size_t i = 0; i < sw->n_written; i++) {
        if (!sw->finished) unlink(sw->written[i]);
        free(sw->written[i]);
    }
    free(sw->written);
    for (size_t i = 0; i < sw->n_map; i++) free(sw->map[i].name);
    free(sw->map);
    strset_free(&sw->names);
    mq_stw_free(sw->cur);
    free(sw->dir);
    free(sw);
}

/* ==== planned shards ======================================================================== */
/* Shards whose tensor list is known before any data: the layout of each file (the reference
 * writer's order, as mq_stw_write) and its header are fixed up front, files are created at their
 * full size, and tensor data goes to its planned place whenever it is ready. A run resumed after
 * a crash reopens the files and writes the rest; the bytes do not depend on the order of the
 * writes, so they equal an uninterrupted run's. */

typedef struct {
    char *name;
    moeq_dtype dtype;
    int ndim;
    int64_t shape[MQ_MAX_DIMS];
    size_t nbytes;
    size_t shard;
    int64_t offset;     /* in the shard file (header included) */
    bool written;
} sp_tensor;

typedef struct {
    char *file;         /* final name */
    char *header;       /* 8-byte length + JSON, as written */
    size_t header_len;
    int64_t size;       /* file size */
} sp_shard;

struct mq_shard_plan {
    sp_tensor *t;       /* in declaration order */
    size_t n;
    size_t *by_name;    /* indices sorted by name */
    sp_shard *s;
    size_t n_shards;
    uint64_t total;
};

void mq_shard_plan_free(mq_shard_plan *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n; i++) free(p->t[i].name);
    for (size_t i = 0; i < p->n_shards; i++) {
        free(p->s[i].file);
        free(p->s[i].header);
    }
    free(p->t);
    free(p->by_name);
    free(p->s);
    free(p);
}

static const mq_shard_plan *g_sort_plan;   /* qsort context (plans are built on one thread) */
static int cmp_plan_name(const void *a, const void *b) {
    return strcmp(g_sort_plan->t[*(const size_t *)a].name, g_sort_plan->t[*(const size_t *)b].name);
}
static int cmp_plan_order(const void *a, const void *b) {
    const sp_tensor *x = &g_sort_plan->t[*(const size_t *)a], *y = &g_sort_plan->t[*(const size_t *)b];
    if (x->dtype != y->dtype) return x->dtype > y->dtype ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Lays out shard k: its tensors in mq_stw_write's order, the header, the offsets. */
static moeq_status plan_layout_shard(mq_shard_plan *p, size_t k, size_t *idx, size_t n_idx) {
    g_sort_plan = p;
    sort_n(idx, n_idx, sizeof *idx, cmp_plan_order);
    mq_page h = {0};
    sb_str(&h, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (size_t i = 0; i < n_idx; i++) {
        const sp_tensor *t = &p->t[idx[i]];
        mq_page_put(&h, ",", 1);
        sb_json_str(&h, t->name);
        mq_page_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", moeq_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) mq_page_printf(&h, "%s%" PRId64, d ? "," : "", t->shape[d]);
        mq_page_printf(&h, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + t->nbytes);
        off += t->nbytes;
    }
    mq_page_put(&h, "}", 1);
    while (!h.oom && h.n % 8 != 0) mq_page_put(&h, " ", 1);
    if (h.oom) {
        free(h.s);
        return mq_err(MOEQ_E_NOMEM, "out of memory building a shard header");
    }
    if (h.n > ST_MAX_HEADER) {
        free(h.s);
        return mq_err(MOEQ_E_ARG, "shard %zu: header of %zu bytes exceeds the safetensors limit",
                      k + 1, h.n);
    }
    sp_shard *s = &p->s[k];
    s->header_len = 8 + h.n;
    s->header = malloc(s->header_len);
    if (!s->header) {
        free(h.s);
        return mq_err(MOEQ_E_NOMEM, "out of memory building a shard header");
    }
    for (int i = 0; i < 8; i++) s->header[i] = (char)(uint8_t)((uint64_t)h.n >> (8 * i));
    memcpy(s->header + 8, h.s, h.n);
    free(h.s);
    int64_t pos = (int64_t)s->header_len;
    for (size_t i = 0; i < n_idx; i++) {
        p->t[idx[i]].offset = pos;
        pos += (int64_t)p->t[idx[i]].nbytes;
    }
    s->size = pos;
    return MOEQ_OK;
}

moeq_status mq_shard_plan_new(const mq_tensor_decl *decl, size_t n, size_t max_bytes,
                              mq_shard_plan **out) {
    *out = NULL;
    mq_shard_plan *p = calloc(1, sizeof *p);
    if (!p) return mq_err(MOEQ_E_NOMEM, "out of memory: shard plan");
    p->t = calloc(n ? n : 1, sizeof *p->t);
    p->by_name = calloc(n ? n : 1, sizeof *p->by_name);
    moeq_status s = p->t && p->by_name ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory: shard plan");
    /* greedy assignment, as mq_shards_add: a new shard when the next tensor would overflow */
    size_t shard = 0, cur = 0, cur_n = 0;
    for (size_t i = 0; i < n && !s; i++, p->n++) {
        const mq_tensor_decl *d = &decl[i];
        int64_t numel = 1;
        for (int k = 0; k < d->ndim && k < MQ_MAX_DIMS; k++) (void)mq_mul_i64(numel, d->shape[k], &numel);
        size_t nb = (size_t)numel * moeq_dtype_size(d->dtype);
        if ((s = check_tensor_args(d->name, d->dtype, d->ndim, d->shape, "", nb))) break;
        sp_tensor *t = &p->t[i];
        t->name = mq_strdup(d->name);
        if (!t->name) {
            s = MOEQ_E_NOMEM;
            break;
        }
        t->dtype = d->dtype;
        t->ndim = d->ndim;
        memcpy(t->shape, d->shape, sizeof(int64_t) * (size_t)d->ndim);
        t->nbytes = nb;
        if (max_bytes && cur_n > 0 && (cur >= max_bytes || nb > max_bytes - cur)) {
            shard++;
            cur = 0;
            cur_n = 0;
        }
        t->shard = shard;
        cur += nb;
        cur_n++;
        p->total += nb;
        p->by_name[i] = i;
    }
    if (!s) {
        g_sort_plan = p;
        sort_n(p->by_name, p->n, sizeof *p->by_name, cmp_plan_name);
        for (size_t i = 1; i < p->n && !s; i++)
            if (strcmp(p->t[p->by_name[i]].name, p->t[p->by_name[i - 1]].name) == 0)
                s = mq_err(MOEQ_E_EXISTS, "checkpoint plan: tensor '%s' declared twice",
                           p->t[p->by_name[i]].name);
    }
    if (!s) {
        p->n_shards = shard + 1;
        p->s = calloc(p->n_shards, sizeof *p->s);
        size_t *idx = malloc((p->n ? p->n : 1) * sizeof *idx);
        if (!p->s || !idx) s = mq_err(MOEQ_E_NOMEM, "out of memory: shard plan");
        for (size_t k = 0; k < p->n_shards && !s; k++) {
            size_t m = 0;
            for (size_t i = 0; i < p->n; i++)
                if (p->t[i].shard == k) idx[m++] = i;
            s = plan_layout_shard(p, k, idx, m);
            p->s[k].file = p->n_shards == 1
                               ? mq_strdup("model.safetensors")
                               : mq_asprintf("model-%05zu-of-%05zu.safetensors", k + 1, p->n_shards);
            if (!s && !p->s[k].file) s = MOEQ_E_NOMEM;
        }
        free(idx);
    }
    if (s) {
        mq_shard_plan_free(p);
        return s;
    }
    *out = p;
    return MOEQ_OK;
}

size_t mq_shard_plan_count(const mq_shard_plan *p) { return p->n_shards; }
const char *mq_shard_plan_file(const mq_shard_plan *p, size_t shard) { return p->s[shard].file; }
int64_t mq_shard_plan_file_size(const mq_shard_plan *p, size_t shard) { return p->s[shard].size; }
uint64_t mq_shard_plan_total(const mq_shard_plan *p) { return p->total; }

static const sp_tensor *plan_find(const mq_shard_plan *p, const char *name) {
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(p->t[p->by_name[mid]].name, name);
        if (c == 0) return &p->t[p->by_name[mid]];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

bool mq_shard_plan_find(const mq_shard_plan *p, const char *name, size_t *shard, int64_t *offset,
                        size_t *nbytes) {
    const sp_tensor *t = plan_find(p, name);
    if (!t) return false;
    if (shard) *shard = t->shard;
    if (offset) *offset = t->offset;
    if (nbytes) *nbytes = t->nbytes;
    return true;
}

/* ---- the files ---- */
struct mq_shard_files {
    mq_shard_plan *p;   /* borrowed */
    char *dir;
    char **tmp;         /* the files being filled */
    int *fd;
    uint8_t *dirty;     /* written since the last sync */
    uint8_t *done;      /* [n] tensor written (or marked) */
};

void mq_shard_files_close(mq_shard_files *f) {
    if (!f) return;
    for (size_t k = 0; f->fd && k < f->p->n_shards; k++) {
        if (f->fd[k] >= 0) close(f->fd[k]);
        if (f->tmp) free(f->tmp[k]);
    }
    free(f->tmp);
    free(f->fd);
    free(f->dirty);
    free(f->done);
    free(f->dir);
    free(f);
}

static moeq_status files_new(mq_shard_plan *p, const char *dir, mq_shard_files **out) {
    mq_shard_files *f = calloc(1, sizeof *f);
    if (!f) return mq_err(MOEQ_E_NOMEM, "out of memory");
    f->p = p;
    f->dir = mq_strdup(dir);
    f->tmp = calloc(p->n_shards, sizeof *f->tmp);
    f->fd = malloc(p->n_shards * sizeof *f->fd);
    f->dirty = calloc(p->n_shards, 1);
    f->done = calloc(p->n ? p->n : 1, 1);
    if (!f->dir || !f->tmp || !f->fd || !f->dirty || !f->done) {
        free(f->fd);
        f->fd = NULL;
        mq_shard_files_close(f);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    for (size_t k = 0; k < p->n_shards; k++) f->fd[k] = -1;
    for (size_t k = 0; k < p->n_shards; k++) {
        /* a hidden name no reader takes for a checkpoint file; renamed by finish */
        char *base = mq_asprintf(".%s.partial", p->s[k].file);
        f->tmp[k] = base ? mq_path_join(dir, base) : NULL;
        free(base);
        if (!f->tmp[k]) {
            mq_shard_files_close(f);
            return mq_err(MOEQ_E_NOMEM, "out of memory");
        }
    }
    *out = f;
    return MOEQ_OK;
}

moeq_status mq_shard_files_create(mq_shard_plan *p, const char *dir, mq_shard_files **out) {
    *out = NULL;
    mq_shard_files *f;
    moeq_status s = files_new(p, dir, &f);
    for (size_t k = 0; k < p->n_shards && !s; k++) {
        f->fd[k] = open(f->tmp[k], O_RDWR | O_CREAT | O_TRUNC, 0644);
        if (f->fd[k] < 0) {
            s = mq_err(MOEQ_E_IO, "%s: cannot create: %s", f->tmp[k], strerror(errno));
            break;
        }
        s = mq_pwrite_all(f->fd[k], p->s[k].header, p->s[k].header_len, 0, f->tmp[k]);
        if (!s && ftruncate(f->fd[k], (off_t)p->s[k].size) != 0)
            s = mq_err(MOEQ_E_IO, "%s: cannot size the file to %lld bytes: %s", f->tmp[k],
                       (long long)p->s[k].size, strerror(errno));
        f->dirty[k] = 1;
    }
    if (s) {
        for (size_t k = 0; k < p->n_shards; k++) unlink(f->tmp[k]);
        mq_shard_files_close(f);
        return s;
    }
    *out = f;
    return MOEQ_OK;
}

moeq_status mq_shard_files_open(mq_shard_plan *p, const char *dir, mq_shard_files **out) {
    *out = NULL;
    mq_shard_files *f;
    moeq_status s = files_new(p, dir, &f);
    char *head = NULL;
    for (size_t k = 0; k < p->n_shards && !s; k++) {
        f->fd[k] = open(f->tmp[k], O_RDWR);
        if (f->fd[k] < 0 && errno == ENOENT) {
            /* an earlier finish() renamed it before the run was stopped: take it back */
            char *final = mq_path_join(dir, p->s[k].file);
            if (final && rename(final, f->tmp[k]) == 0) f->fd[k] = open(f->tmp[k], O_RDWR);
            free(final);
        }
        if (f->fd[k] < 0) {
            s = mq_err(MOEQ_E_NOTFOUND, "%s: cannot open the partial shard: %s", f->tmp[k],
                       strerror(errno));
            break;
        }
        struct stat sb;
        if (fstat(f->fd[k], &sb) != 0 || (int64_t)sb.st_size != p->s[k].size) {
            s = mq_err(MOEQ_E_FORMAT, "%s: %lld bytes, the plan says %lld", f->tmp[k],
                       (long long)sb.st_size, (long long)p->s[k].size);
            break;
        }
        head = realloc(head, p->s[k].header_len);
        if (!head) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory");
            break;
        }
        s = mq_pread_all(f->fd[k], head, p->s[k].header_len, 0, f->tmp[k]);
        if (!s && memcmp(head, p->s[k].header, p->s[k].header_len) != 0)
            s = mq_err(MOEQ_E_FORMAT, "%s: its header is not the planned one", f->tmp[k]);
    }
    free(head);
    if (s) {
        mq_shard_files_close(f);
        return s;
    }
    *out = f;
    return MOEQ_OK;
}

static moeq_status files_tensor(const mq_shard_files *f, const char *name, const sp_tensor **t) {
    *t = plan_find(f->p, name);
    if (!*t) return mq_err(MOEQ_E_NOTFOUND, "%s: tensor '%s' is not in the checkpoint plan", f->dir, name);
    return MOEQ_OK;
}

/* files_tensor, and the data's dtype and size as planned. */
static moeq_status files_tensor_as(const mq_shard_files *f, const char *name, moeq_dtype dtype, size_t nbytes,
                                   const sp_tensor **t) {
    moeq_status s = files_tensor(f, name, t);
    if (!s && ((*t)->dtype != dtype || (*t)->nbytes != nbytes))
        s = mq_err(MOEQ_E_SHAPE, "%s: tensor '%s' is %s of %zu bytes, the plan says %s of %zu", f->dir, name,
                   moeq_dtype_name(dtype), nbytes, moeq_dtype_name((*t)->dtype), (*t)->nbytes);
    return s;
}

moeq_status mq_shard_files_check(const mq_shard_files *f, const char *name, moeq_dtype dtype, size_t nbytes) {
    const sp_tensor *t;
    return files_tensor_as(f, name, dtype, nbytes, &t);
}

moeq_status mq_shard_files_put(mq_shard_files *f, const char *name, moeq_dtype dtype,
                               const void *data, size_t nbytes, uint32_t *crc) {
    const sp_tensor *t;
    moeq_status s = files_tensor_as(f, name, dtype, nbytes, &t);
    if (s) return s;
    s = mq_pwrite_all(f->fd[t->shard], data, nbytes, t->offset, f->tmp[t->shard]);
    if (s) return s;
    f->dirty[t->shard] = 1;
    f->done[t - f->p->t] = 1;
    if (crc) *crc = mq_crc32(0, data, nbytes);
    return MOEQ_OK;
}

moeq_status mq_shard_files_crc(mq_shard_files *f, const char *name, uint32_t *crc) {
    const sp_tensor *t;
    moeq_status s = files_tensor(f, name, &t);
    if (s) return s;
    enum { CHUNK = 1 << 22 };
    uint8_t *buf = malloc(CHUNK);
    if (!buf) return mq_err(MOEQ_E_NOMEM, "out of memory");
    uint32_t c = 0;
    for (size_t done = 0; done < t->nbytes && !s;) {
        size_t k = t->nbytes - done < CHUNK ? t->nbytes - done : CHUNK;
        s = mq_pread_all(f->fd[t->shard], buf, k, t->offset + (int64_t)done, f->tmp[t->shard]);
        if (!s) c = mq_crc32(c, buf, k);
        done += k;
    }
    free(buf);
    if (!s) *crc = c;
    return s;
}

moeq_status mq_shard_files_mark(mq_shard_files *f, const char *name) {
    const sp_tensor *t;
    moeq_status s = files_tensor(f, name, &t);
    if (!s) f->done[t - f->p->t] = 1;
    return s;
}

moeq_status mq_shard_files_sync(mq_shard_files *f) {
    for (size_t k = 0; k < f->p->n_shards; k++) {
        if (!f->dirty[k]) continue;
        if (fdatasync(f->fd[k]) != 0)
            return mq_err(MOEQ_E_IO, "%s: fsync failed: %s", f->tmp[k], strerror(errno));
        f->dirty[k] = 0;
    }
    return MOEQ_OK;
}

moeq_status mq_shard_files_sync_all(const mq_shard_files *f) {
    for (size_t k = 0; k < f->p->n_shards; k++)
        if (fdatasync(f->fd[k]) != 0) return mq_err(MOEQ_E_IO, "%s: fsync failed: %s", f->tmp[k], strerror(errno));
    return MOEQ_OK;
}

moeq_status mq_shard_files_finish(mq_shard_files *f) {
    mq_shard_plan *p = f->p;
    for (size_t i = 0; i < p->n; i++)
        if (!f->done[i])
            return mq_err(MOEQ_E_ARG, "%s: tensor '%s' was never written", f->dir, p->t[i].name);
    moeq_status s = mq_shard_files_sync(f);
    for (size_t k = 0; k < p->n_shards && !s; k++) {
        char *path = mq_path_join(f->dir, p->s[k].file);
        if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
        if (rename(f->tmp[k], path) != 0)
            s = mq_err(MOEQ_E_IO, "%s: cannot rename into place: %s", path, strerror(errno));
        free(path);
    }
    char *idx = mq_path_join(f->dir, ST_INDEX_NAME);
    if (!idx) return mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s && p->n_shards == 1) {
        unlink(idx);   /* a stale index would shadow model.safetensors */
    } else if (!s) {
        /* the layout transformers' save_pretrained writes: json.dumps(indent=2, sort_keys=True) */
        mq_page j = {0};
        mq_page_printf(&j, "{\n  \"metadata\": {\n    \"total_size\": %" PRIu64 "\n  },\n  \"weight_map\": {",
               p->total);
        for (size_t i = 0; i < p->n; i++) {
            const sp_tensor *t = &p->t[p->by_name[i]];
            sb_str(&j, i ? ",\n    " : "\n    ");
            sb_json_str(&j, t->name);
            sb_str(&j, ": ");
            sb_json_str(&j, p->s[t->shard].file);
        }
        sb_str(&j, p->n ? "\n  }\n}\n" : "}\n}\n");
        s = j.oom ? mq_err(MOEQ_E_NOMEM, "%s: out of memory building the index", f->dir)
                  : mq_write_file_atomic(idx, j.s, j.n);
        free(j.s);
    }
    free(idx);
    return s;
}
