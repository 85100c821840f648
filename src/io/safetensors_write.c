/*
 * safetensors writing (format: ../shared/docs/formats.md section 1): one file in the reference
 * writer's layout (tensor.rs prepare(): tensors sorted by dtype descending in the safetensors enum
 * order, which moeq_dtype follows, then by name; the header padded with spaces to a multiple of
 * 8, so every tensor is naturally aligned), written atomically; and a checkpoint cut into shards
 * of at most a given size with its model.safetensors.index.json.
 */
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

#include "core/page.h"
#include "io/safetensors.h"
#include "io/safetensors_internal.h"

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
moeq_status mq_stw_check_tensor(const char *name, moeq_dtype dtype, int ndim, const int64_t *shape,
                                const void *data, size_t nbytes) {
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
    moeq_status s = mq_stw_check_tensor(name, dtype, ndim, shape, data, nbytes);
    if (s == MOEQ_OK && strset_has(&w->names, name))
        s = mq_err(MOEQ_E_EXISTS, "safetensors writer: tensor '%s' added twice", name);
    if (s == MOEQ_OK)
        s = mq_grow(&w->t, w->n, &w->cap, sizeof *w->t, 64, "safetensors writer table");
    char *nm;
    if ((s = st_name_add(s, &w->names, name, data, &nm)) != MOEQ_OK) return s;
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

/* *copy = the caller's data copied, after the checks (so a bad call costs no allocation). */
static moeq_status checked_copy(const char *name, moeq_dtype dtype, int ndim, const int64_t *shape,
                                const void *data, size_t nbytes, void **copy) {
    moeq_status s = mq_stw_check_tensor(name, dtype, ndim, shape, data, nbytes);
    if (s != MOEQ_OK) return s;
    if (!(*copy = mq_alloc(nbytes, name))) return MOEQ_E_NOMEM;
    if (nbytes) memcpy(*copy, data, nbytes);
    return MOEQ_OK;
}

moeq_status mq_stw_add(mq_st_writer *w, const char *name, moeq_dtype dtype, int ndim,
                       const int64_t *shape, const void *data, size_t nbytes) {
    void *copy = NULL;
    moeq_status s = checked_copy(name, dtype, ndim, shape, data, nbytes, &copy);
    return s ? s : mq_stw_add_owned(w, name, dtype, ndim, shape, copy, nbytes);
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
    for (size_t i = 0; i < w->n; i++)
        off = sb_tensor_entry(&h, ord[i]->name, ord[i]->dtype, ord[i]->ndim, ord[i]->shape, off,
                              ord[i]->nbytes);
    sb_header_end(&h);
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
    moeq_status s = mq_stw_check_tensor(name, dtype, ndim, shape, data, nbytes);
    if (s == MOEQ_OK && sw->finished)
        s = mq_err(MOEQ_E_ARG, "%s: tensor '%s' added after the checkpoint was finished", sw->dir,
                   name);
    if (s == MOEQ_OK && strset_has(&sw->names, name))
        s = mq_err(MOEQ_E_EXISTS, "%s: tensor '%s' added twice", sw->dir, name);
    if (s == MOEQ_OK)
        s = mq_grow(&sw->map, sw->n_map, &sw->cap_map, sizeof *sw->map, 256, "weight map");
    char *nm;
    if ((s = st_name_add(s, &sw->names, name, data, &nm)) != MOEQ_OK) return s;
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
    void *copy = NULL;
    moeq_status s = checked_copy(name, dtype, ndim, shape, data, nbytes, &copy);
    return s ? s : mq_shards_add_owned(sw, name, dtype, ndim, shape, copy, nbytes);
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

