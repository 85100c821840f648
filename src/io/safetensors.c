/*
 * safetensors reading (the writers are safetensors_write.c and safetensors_plan.c). Follows the
 * format as described in ../shared/docs/formats.md §1 (huggingface/safetensors README.md and
 * safetensors/src/tensor.rs): an 8-byte little-endian header length N, N bytes of JSON header,
 * then the byte buffer the tensors tile exactly.
 *
 * The whole header is validated (length, JSON, every field, sizes, exact tiling of the buffer,
 * __metadata__ string->string, unique names) before any tensor byte is touched, so views handed
 * out never point outside the mapping. The JSON is parsed with cJSON. Sharded checkpoints
 * (model.safetensors.index.json) are merged into one name-sorted table searched by bsearch.
 */
#include "io/safetensors.h"
#include "io/safetensors_internal.h"
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


/* ==== dtypes ================================================================================ */

bool mq_dtype_from_name(const char *name, moeq_dtype *out) {
    if (!name) return false;
    for (int i = 0; i < MOEQ_DT_COUNT; i++) {
        if (strcmp(name, moeq_dtype_name((moeq_dtype)i)) == 0) {
            if (out) *out = (moeq_dtype)i;
            return true;
        }
    }
    return false;
}

/* ==== reader ================================================================================ */

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

static const char *view_name(const void *t, size_t i) { return ((const mq_tensor_view *)t)[i].name; }

static const mq_tensor_view *find_view(const mq_tensor_view *t, size_t n, const char *name) {
    const int64_t i = mq_find_name(name, n, view_name, t);
    return i < 0 ? NULL : &t[i];
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

moeq_status mq_st_link_fp8(mq_st *st, int32_t br, int32_t bc, mq_block_dequant_fn dequant) {
    if (br < 1 || bc < 1 || !dequant)
        return mq_err(MOEQ_E_ARG, "FP8 block size %d x %d%s", br, bc, dequant ? "" : ", no decoder");
    const size_t sl = strlen("_scale_inv");
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

/* A 16-bit element of an unaligned view. */
static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
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
        for (; i < n; i++) out[i] = mq_bf16_to_f32(load_u16(p + 2 * i));
        return MOEQ_OK;
    }
    case MOEQ_DT_F16:
        for (size_t i = 0; i < n; i++) out[i] = mq_f16_to_f32(load_u16(p + 2 * i));
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

