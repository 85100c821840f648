/*
 * The checkpoint writer (see writer.h). Config blocks follow formats.md section 2: compressed-
 * tensors' quantization_config with one config group for every Linear, ModelOpt's config form and
 * hf_quant_config.json, GPTQ's quantize_config.json.
 */
#include "export/writer.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct mq_ckpt_writer {
    mq_ckpt_opts o;
    char *dir;
    mq_shard_plan *plan;
    mq_shard_files *files;
    char **names;       /* declared names, sorted */
    uint32_t *crc;      /* [n] in the order of names */
    uint8_t *done;
    size_t n;
    mq_st **readers;    /* the partial shards opened for reading back (read_linear) */
    struct behind *wb;  /* write-behind (mq_ckpt_writer_behind), or NULL */
};

/* ---- write-behind ----------------------------------------------------------------------------
 * The tensors a layout emits are queued and written by one thread, in order, while the caller
 * goes on. Written from the pool's threads at once, buffered writes to one file take turns on the
 * file's lock in the kernel and spin for it: at 16 threads a chunk of 96 expert weights (113 MB)
 * spent 0.28 thread-seconds in pwrite against 0.02 on 2 threads, every core stalled for most of
 * the write stage. The queued bytes live in one ring of `cap` bytes mapped once: an emitter's
 * buffer is copied in and freed on its own thread, which then reuses it for its next tensor
 * (into freshly mapped buffers a weight's packing took 4-5 ms instead of 0.5-0.9, most of it
 * page faults). A caller waits for room; a tensor larger than the ring goes alone in its own
 * buffer. The first failure is kept and returned by every later call. */
typedef struct wb_item {
    long idx;                 /* its index in names */
    moeq_dtype dtype;
    void *data;               /* in the ring, or owned (the emitter's buffer) when reserved is 0 */
    size_t nbytes;
    size_t reserved;          /* ring bytes it holds (with the end skipped to fit it), or 0 */
    bool ready;               /* its bytes are in place */
    struct wb_item *next;
} wb_item;

struct behind {
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* any change: an item queued or written, the stop */
    pthread_t th;
    wb_item *head, *tail;
    size_t cap;
    uint8_t *ring;            /* [cap] (NULL: cap below RING_MIN, items in their own buffers) */
    size_t ring_head, ring_used;   /* next free byte; bytes held by queued items, from the oldest */
    size_t queued;            /* bytes queued in their own buffers */
    int pending;              /* items queued and not yet written */
    bool stop;
    moeq_status err;
    char msg[320];
};

static void *behind_thread(void *arg) {
    mq_ckpt_writer *w = arg;
    struct behind *b = w->wb;
    pthread_mutex_lock(&b->mu);
    for (;;) {   /* in queue order: the ring is freed from its oldest bytes on */
        while (!(b->head && b->head->ready) && !(b->stop && !b->head)) pthread_cond_wait(&b->cv, &b->mu);
        wb_item *it = b->head;
        if (!it) break;   /* stopped and drained */
        b->head = it->next;
        if (!b->head) b->tail = NULL;
        const bool failed = b->err != MOEQ_OK;
        pthread_mutex_unlock(&b->mu);
        uint32_t crc = 0;
        moeq_status s = failed ? MOEQ_OK
                               : mq_shard_files_put(w->files, w->names[it->idx], it->dtype, it->data, it->nbytes, &crc);
        pthread_mutex_lock(&b->mu);
        if (s && !b->err) {
            b->err = s;
            snprintf(b->msg, sizeof b->msg, "%s", moeq_last_error());
        } else if (!s && !failed) {
            w->crc[it->idx] = crc;
            w->done[it->idx] = 1;
        }
        if (it->reserved) b->ring_used -= it->reserved;
        else b->queued -= it->nbytes;
        b->pending--;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        if (!it->reserved) mq_free(it->data);
        free(it);
        pthread_mutex_lock(&b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* The kept failure as this thread's error (the caller holds b->mu). */
static moeq_status behind_failure(const struct behind *b) { return mq_err(b->err, "%s", b->msg); }

enum { RING_MIN = 1 << 16 };   /* smaller caps queue the emitters' own buffers */

moeq_status mq_ckpt_writer_behind(mq_ckpt_writer *w, size_t cap) {
    if (w->wb) return MOEQ_OK;
    struct behind *b = calloc(1, sizeof *b);
    if (!b) return mq_err(MOEQ_E_NOMEM, "out of memory");
    if (cap >= RING_MIN && !(b->ring = mq_alloc(cap, "the checkpoint writer's queue"))) {
        free(b);
        return MOEQ_E_NOMEM;
    }
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    b->cap = cap;
    w->wb = b;
    if (pthread_create(&b->th, NULL, behind_thread, w) != 0) {
        w->wb = NULL;
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->mu);
        mq_free(b->ring);
        free(b);
        return mq_err(MOEQ_E_IO, "%s: cannot start the thread that writes the checkpoint", w->dir);
    }
    return MOEQ_OK;
}

moeq_status mq_ckpt_writer_flush(mq_ckpt_writer *w) {
    struct behind *b = w->wb;
    if (!b) return MOEQ_OK;
    pthread_mutex_lock(&b->mu);
    while (b->pending > 0) pthread_cond_wait(&b->cv, &b->mu);
    moeq_status s = b->err ? behind_failure(b) : MOEQ_OK;
    pthread_mutex_unlock(&b->mu);
    return s;
}

/* The ring bytes for n more (*start; *reserved with the end skipped when n does not fit before
 * it), or false while the queued items hold too much of it. Under b->mu. */
static bool ring_reserve(struct behind *b, size_t n, size_t *start, size_t *reserved) {
    if (b->ring_used == 0) b->ring_head = 0;
    size_t at = b->ring_head, skip = at + n > b->cap ? b->cap - at : 0;
    if (skip) at = 0;
    if (b->ring_used + skip + n > b->cap) return false;
    *start = at;
    *reserved = skip + n;
    b->ring_head = at + n;
    b->ring_used += skip + n;
    return true;
}

/* Queues data (owned from here on, freed on failure too) for the writer's thread: copied into
 * the ring, which keeps the items in queue order, or (larger than the ring) queued alone. */
static moeq_status behind_put(mq_ckpt_writer *w, long idx, moeq_dtype dtype, void *data, size_t nbytes) {
    struct behind *b = w->wb;
    wb_item *it = malloc(sizeof *it);
    if (!it) {
        mq_free(data);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    *it = (wb_item){idx, dtype, data, nbytes, 0, true, NULL};
    const bool in_ring = b->ring && nbytes > 0 && nbytes <= b->cap;
    size_t start = 0;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        if (b->err) {
            moeq_status s = behind_failure(b);
            pthread_mutex_unlock(&b->mu);
            mq_free(data);
            free(it);
            return s;
        }
        if (in_ring ? ring_reserve(b, nbytes, &start, &it->reserved)
                    : b->pending == 0 || (!b->ring && b->queued + nbytes <= b->cap))
            break;
        pthread_cond_wait(&b->cv, &b->mu);
    }
    if (in_ring) it->ready = false;   /* queued in its place now, copied below */
    else b->queued += nbytes;
    if (b->tail) b->tail->next = it;
    else b->head = it;
    b->tail = it;
    b->pending++;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    if (!in_ring) return MOEQ_OK;
    memcpy(b->ring + start, data, nbytes);
    mq_free(data);
    pthread_mutex_lock(&b->mu);
    it->data = b->ring + start;
    it->ready = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return MOEQ_OK;
}

/* Stops the thread once it has written what is queued. */
static void behind_stop(mq_ckpt_writer *w) {
    struct behind *b = w->wb;
    if (!b) return;
    pthread_mutex_lock(&b->mu);
    b->stop = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->th, NULL);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    mq_free(b->ring);
    free(b);
    w->wb = NULL;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static const char *name_at(const void *ctx, size_t i) { return ((const mq_ckpt_writer *)ctx)->names[i]; }

static long name_index(const mq_ckpt_writer *w, const char *name) {
    return (long)mq_find_name(name, w->n, name_at, w);
}

/* name_index, or MOEQ_E_NOTFOUND naming the tensor. */
static moeq_status plan_index(const mq_ckpt_writer *w, const char *name, long *i) {
    *i = name_index(w, name);
    return *i < 0 ? mq_err(MOEQ_E_NOTFOUND, "%s: tensor '%s' is not in the checkpoint plan", w->dir, name) : MOEQ_OK;
}

void mq_ckpt_writer_close(mq_ckpt_writer *w) {
    if (!w) return;
    behind_stop(w);
    for (size_t k = 0; w->readers && k < mq_shard_plan_count(w->plan); k++) mq_st_close(w->readers[k]);
    free(w->readers);
    mq_shard_files_close(w->files);
    mq_shard_plan_free(w->plan);
    for (size_t i = 0; w->names && i < w->n; i++) free(w->names[i]);
    MQ_FREE_EACH(w->names, w->crc, w->done, w->dir);
    free(w);
}

moeq_status mq_ckpt_writer_open(const char *dir, const mq_tensor_decl *decls, size_t n,
                                const mq_ckpt_opts *o, bool resume, mq_ckpt_writer **out) {
    *out = NULL;
    mq_ckpt_writer *w = calloc(1, sizeof *w);
    if (!w) return mq_err(MOEQ_E_NOMEM, "out of memory");
    w->o = *o;
    w->n = n;
    w->dir = mq_strdup(dir);
    w->names = calloc(n ? n : 1, sizeof *w->names);
    w->crc = calloc(n ? n : 1, sizeof *w->crc);
    w->done = calloc(n ? n : 1, 1);
    moeq_status s = w->dir && w->names && w->crc && w->done ? MOEQ_OK
                                                            : mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t i = 0; i < n && !s; i++)
        if (!(w->names[i] = mq_strdup(decls[i].name))) s = MOEQ_E_NOMEM;
    if (!s) qsort(w->names, n, sizeof *w->names, cmp_str);
    size_t max = o->max_shard_bytes ? o->max_shard_bytes : (size_t)5 << 30;
    if (!s) s = mq_shard_plan_new(decls, n, max, &w->plan);
    if (!s) s = resume ? mq_shard_files_open(w->plan, dir, &w->files)
                       : mq_shard_files_create(w->plan, dir, &w->files);
    if (s) {
        mq_ckpt_writer_close(w);
        return s;
    }
    *out = w;
    return MOEQ_OK;
}

/* A caller's data, written now: after what is queued (the files then have one writer). */
moeq_status mq_ckpt_writer_put(mq_ckpt_writer *w, const char *name, moeq_dtype dtype,
                               const void *data, size_t nbytes) {
    long i;
    uint32_t crc;
    moeq_status s = plan_index(w, name, &i);
    if (!s) s = mq_ckpt_writer_flush(w);
    if (!s) s = mq_shard_files_put(w->files, name, dtype, data, nbytes, &crc);
    if (s) return s;
    w->crc[i] = crc;
    w->done[i] = 1;
    return MOEQ_OK;
}

/* The layouts' emitted tensors (owned here): queued with write-behind, after the checks that name
 * the tensor, else written now. */
static moeq_status emit_put(void *user, const char *name, moeq_dtype dtype, int ndim,
                            const int64_t *shape, void *data, size_t nbytes) {
    (void)ndim;
    (void)shape;   /* checked against the plan by size and dtype */
    mq_ckpt_writer *w = user;
    if (w->wb) {
        long i;
        moeq_status s = plan_index(w, name, &i);
        if (!s) s = mq_shard_files_check(w->files, name, dtype, nbytes);
        if (s) {
            mq_free(data);
            return s;
        }
        return behind_put(w, i, dtype, data, nbytes);
    }
    moeq_status s = mq_ckpt_writer_put(w, name, dtype, data, nbytes);
    mq_free(data);
    return s;
}

moeq_status mq_ckpt_writer_put_linear(mq_ckpt_writer *w, const char *module, const mq_qtensor *q,
                                      float input_amax) {
    return mq_layout_emit(w->o.format, module, q, input_amax, emit_put, w);
}

moeq_status mq_ckpt_writer_put_input_scale(mq_ckpt_writer *w, const char *module, float input_amax) {
    return mq_layout_emit_input_scale(w->o.format, module, input_amax, emit_put, w);
}

bool mq_ckpt_writer_crc(const mq_ckpt_writer *w, const char *name, uint32_t *crc) {
    long i = name_index(w, name);
    if (i < 0 || !w->done[i]) return false;
    *crc = w->crc[i];
    return true;
}

moeq_status mq_ckpt_writer_verify(mq_ckpt_writer *w, const char *name, uint32_t crc) {
    long i;
    moeq_status s = plan_index(w, name, &i);
    if (s) return s;
    uint32_t have;
    s = mq_shard_files_crc(w->files, name, &have);
    if (s) return s;
    if (have != crc)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': the data on disk has CRC %08x, the work "
                      "manifest recorded %08x", w->dir, name, have, crc);
    w->crc[i] = crc;
    w->done[i] = 1;
    return mq_shard_files_mark(w->files, name);
}

moeq_status mq_ckpt_writer_sync(mq_ckpt_writer *w) {
    moeq_status s = mq_ckpt_writer_flush(w);
    return s ? s : mq_shard_files_sync(w->files);
}
moeq_status mq_ckpt_writer_sync_all(const mq_ckpt_writer *w) { return mq_shard_files_sync_all(w->files); }

static const mq_tensor_view *reader_lookup(void *user, const char *name) {
    mq_ckpt_writer *w = user;
    size_t shard;
    if (!mq_shard_plan_find(w->plan, name, &shard, NULL, NULL) || !w->readers[shard]) return NULL;
    return mq_st_find(w->readers[shard], name);
}

moeq_status mq_ckpt_writer_read_linear(mq_ckpt_writer *w, const char *module, int64_t rows,
                                       int64_t cols, mq_qtensor *out) {
    size_t k = mq_shard_plan_count(w->plan);
    if (!w->readers && !(w->readers = calloc(k, sizeof *w->readers)))
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = mq_shard_files_sync(w->files);
    for (size_t i = 0; i < k && !s; i++) {
        if (w->readers[i]) continue;
        char *base = mq_asprintf(".%s.partial", mq_shard_plan_file(w->plan, i));
        char *path = base ? mq_path_join(w->dir, base) : NULL;
        s = path ? mq_st_open_file(path, &w->readers[i]) : mq_err(MOEQ_E_NOMEM, "out of memory");
        free(base);
        free(path);
    }
    if (s) return s;
    return mq_layout_read(module, rows, cols, reader_lookup, w, out);
}

uint64_t mq_ckpt_writer_bytes(const mq_ckpt_writer *w) { return mq_shard_plan_total(w->plan); }

/* ---- config blocks ------------------------------------------------------------------------ */

/* Sorted names of every unquantized Linear, plus lm_head. */
static cJSON *ignore_list(const char *const *kept, size_t n_kept) {
    const char **names = malloc((n_kept + 1) * sizeof *names);
    cJSON *arr = cJSON_CreateArray();
    if (!names || !arr) {
        free(names);
        cJSON_Delete(arr);
        return NULL;
    }
    size_t n = 0;
    names[n++] = "lm_head";
    for (size_t k = 0; k < n_kept; k++) names[n++] = kept[k];
    qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateString(names[i]));
    free(names);
    return arr;
}

static cJSON *ct_args(const mq_qspec *s, bool weights, bool act_order) {
    cJSON *a = cJSON_CreateObject();
    bool nv = s->scheme == MQ_QS_NVFP4;
    cJSON_AddNumberToObject(a, "num_bits", 4);
    cJSON_AddStringToObject(a, "type", nv ? "float" : "int");
    cJSON_AddBoolToObject(a, "symmetric", nv || !s->asym);
    if (nv || s->group_size > 0) cJSON_AddNumberToObject(a, "group_size", nv ? 16 : s->group_size);
    else cJSON_AddNullToObject(a, "group_size");
    cJSON_AddStringToObject(a, "strategy", nv ? "tensor_group" : s->group_size > 0 ? "group" : "channel");
    if (weights) cJSON_AddFalseToObject(a, "dynamic");
    else cJSON_AddStringToObject(a, "dynamic", "local");
    if (act_order) cJSON_AddStringToObject(a, "actorder", "group");
    else cJSON_AddNullToObject(a, "actorder");
    cJSON_AddNullToObject(a, "block_structure");
    cJSON_AddStringToObject(a, "observer", weights && s->mse ? "mse" : nv ? "static_minmax" : "minmax");
    cJSON_AddItemToObject(a, "observer_kwargs", cJSON_CreateObject());
    return a;
}

static cJSON *config_ct(const mq_ckpt_opts *o, cJSON *ignore) {
    cJSON *q = cJSON_CreateObject();
    bool nv = o->spec.scheme == MQ_QS_NVFP4;
    cJSON_AddStringToObject(q, "quant_method", "compressed-tensors");
    cJSON_AddStringToObject(q, "format", nv ? "nvfp4-pack-quantized" : "pack-quantized");
    cJSON_AddStringToObject(q, "quantization_status", "compressed");
    cJSON_AddStringToObject(q, "version", "0.12.2");
    cJSON_AddNullToObject(q, "kv_cache_scheme");
    cJSON_AddNullToObject(q, "global_compression_ratio");
    cJSON_AddItemToObject(q, "sparsity_config", cJSON_CreateObject());
    cJSON_AddItemToObject(q, "transform_config", cJSON_CreateObject());
    cJSON_AddItemToObject(q, "ignore", ignore);
    cJSON *groups = cJSON_AddObjectToObject(q, "config_groups");
    cJSON *g0 = cJSON_AddObjectToObject(groups, "group_0");
    cJSON *targets = cJSON_AddArrayToObject(g0, "targets");
    cJSON_AddItemToArray(targets, cJSON_CreateString("Linear"));
    cJSON_AddItemToObject(g0, "weights", ct_args(&o->spec, true, o->act_order));
    if (nv && o->act_quant) cJSON_AddItemToObject(g0, "input_activations", ct_args(&o->spec, false, false));
    else cJSON_AddNullToObject(g0, "input_activations");
    cJSON_AddNullToObject(g0, "output_activations");
    cJSON_AddNullToObject(g0, "format");
    return q;
}

static cJSON *modelopt_producer(void) {
    cJSON *pr = cJSON_CreateObject();
    cJSON_AddStringToObject(pr, "name", "modelopt");
    cJSON_AddStringToObject(pr, "version", "0.37.0");
    return pr;
}

/* config.json form (vLLM reads quant_algo, group_size, ignore, kv_cache_scheme). */
static cJSON *config_modelopt(const mq_ckpt_opts *o, cJSON *ignore) {
    cJSON *q = cJSON_CreateObject();
    cJSON_AddStringToObject(q, "quant_method", "modelopt");
    cJSON_AddStringToObject(q, "quant_algo", o->act_quant ? "NVFP4" : "W4A16_NVFP4");
    cJSON_AddNumberToObject(q, "group_size", 16);
    cJSON_AddNullToObject(q, "kv_cache_scheme");
    cJSON_AddItemToObject(q, "ignore", ignore);
    cJSON_AddItemToObject(q, "producer", modelopt_producer());
    return q;
}

/* hf_quant_config.json (the legacy form; group_size, kv_cache_quant_algo, exclude_modules are
 * required by vLLM). */
static cJSON *hf_quant_config(const mq_ckpt_opts *o, cJSON *ignore) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddItemToObject(r, "producer", modelopt_producer());
    cJSON *q = cJSON_AddObjectToObject(r, "quantization");
    cJSON_AddStringToObject(q, "quant_algo", o->act_quant ? "NVFP4" : "W4A16_NVFP4");
    cJSON_AddNullToObject(q, "kv_cache_quant_algo");
    cJSON_AddNumberToObject(q, "group_size", 16);
    cJSON_AddItemToObject(q, "exclude_modules", ignore);
    return r;
}

static cJSON *config_gptq(const mq_ckpt_opts *o) {
    cJSON *q = cJSON_CreateObject();
    cJSON_AddStringToObject(q, "quant_method", "gptq");
    cJSON_AddNumberToObject(q, "bits", 4);
    cJSON_AddNumberToObject(q, "group_size", o->spec.group_size > 0 ? o->spec.group_size : -1);
    cJSON_AddBoolToObject(q, "desc_act", o->act_order);
    cJSON_AddBoolToObject(q, "sym", !o->spec.asym);
    cJSON_AddFalseToObject(q, "lm_head");
    cJSON_AddStringToObject(q, "checkpoint_format", "gptq");
    cJSON_AddStringToObject(q, "pack_dtype", "int32");
    cJSON_AddNumberToObject(q, "damp_percent", 0.01);
    cJSON_AddTrueToObject(q, "true_sequential");
    cJSON_AddFalseToObject(q, "static_groups");
    return q;
}

static moeq_status write_json(const char *dir, const char *name, const cJSON *j) {
    char *text = cJSON_Print(j);
    if (!text) return mq_err(MOEQ_E_NOMEM, "out of memory printing %s", name);
    char *path = mq_path_join(dir, name);
    moeq_status s = path ? mq_write_file_atomic(path, text, strlen(text))
                         : mq_err(MOEQ_E_NOMEM, "out of memory");
    free(path);
    free(text);
    return s;
}

static moeq_status copy_file(const char *src_dir, const char *dst_dir, const char *name) {
    char *src = mq_path_join(src_dir, name), *dst = mq_path_join(dst_dir, name);
    moeq_status s = MOEQ_OK;
    if (!src || !dst) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    else if (mq_file_exists(src)) {
        char *data;
        size_t len;
        s = mq_read_file(src, &data, &len);
        if (!s) {
            s = mq_write_file_atomic(dst, data, len);
            free(data);
        }
    }
    free(src);
    free(dst);
    return s;
}

static const char *const extra_files[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tiktoken.model"};

/* The Python files beside the weights: models loaded with trust_remote_code (Kimi K2's
 * tokenization_kimi.py and modeling_deepseek.py, named by auto_map) need them in the output too. */
static moeq_status copy_python_files(const char *src_dir, const char *dst_dir) {
    DIR *d = opendir(src_dir);
    if (!d) return MOEQ_OK;   /* the files above were found by name; nothing more to list */
    moeq_status s = MOEQ_OK;
    for (struct dirent *e; !s && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n > 3 && !strcmp(e->d_name + n - 3, ".py") && e->d_name[0] != '.')
            s = copy_file(src_dir, dst_dir, e->d_name);
    }
    closedir(d);
    return s;
}

moeq_status mq_ckpt_writer_finish(mq_ckpt_writer *w, const cJSON *src_config, const char *src_dir,
                                  const char *const *kept, size_t n_kept) {
    moeq_status s = mq_ckpt_writer_flush(w);
    if (!s) s = mq_shard_files_finish(w->files);
    if (s) return s;
    cJSON *config = cJSON_Duplicate(src_config, 1);
    cJSON *ign = ignore_list(kept, n_kept);
    if (!config || !ign) {
        cJSON_Delete(config);
        cJSON_Delete(ign);
        return mq_err(MOEQ_E_NOMEM, "out of memory writing config.json");
    }
    const mq_ckpt_opts *o = &w->o;
    cJSON *side = NULL, *qc;
    if (o->format == MQ_FMT_CT || o->format == MQ_FMT_GGUF) {
        qc = config_ct(o, ign);
    } else if (o->format == MQ_FMT_MODELOPT) {
        side = hf_quant_config(o, cJSON_Duplicate(ign, 1));
        qc = config_modelopt(o, ign);
    } else {
        cJSON_Delete(ign);
        qc = config_gptq(o);
    }
    /* replaces the source's own block (an FP8 source's), never merged beside it */
    cJSON_DeleteItemFromObjectCaseSensitive(config, "quantization_config");
    cJSON_AddItemToObject(config, "quantization_config", qc);
    s = write_json(w->dir, "config.json", config);
    if (!s && side) s = write_json(w->dir, "hf_quant_config.json", side);
    if (!s && o->format == MQ_FMT_GPTQ) s = write_json(w->dir, "quantize_config.json", qc);
    cJSON_Delete(config);
    cJSON_Delete(side);
    for (size_t i = 0; !s && i < sizeof extra_files / sizeof extra_files[0]; i++)
        s = copy_file(src_dir, w->dir, extra_files[i]);
    if (!s) s = copy_python_files(src_dir, w->dir);
    if (!s) s = mq_fsync_dir(w->dir);
    return s;
}

/* ---- the output directory ------------------------------------------------------------------ */

moeq_status mq_ckpt_check_out(const char *model_dir, const char *out_dir, bool force,
                              bool *exists_out) {
    size_t olen = strlen(out_dir);
    while (olen > 1 && out_dir[olen - 1] == '/') olen--;
    char *out = mq_strndup(out_dir, olen);
    if (!out) return mq_err(MOEQ_E_NOMEM, "out of memory");
    struct stat sin, sout;
    bool exists = stat(out, &sout) == 0;
    moeq_status s = MOEQ_OK;
    if (exists && stat(model_dir, &sin) == 0 && sin.st_dev == sout.st_dev && sin.st_ino == sout.st_ino)
        s = mq_err(MOEQ_E_ARG, "%s: the output directory is the model directory", out_dir);
    else if (exists && !force)
        s = mq_err(MOEQ_E_EXISTS, "%s: already exists (use --force to replace it)", out_dir);
    else if (exists && !mq_dir_exists(out) && !(olen > 5 && !strcmp(out + olen - 5, ".gguf")))
        s = mq_err(MOEQ_E_EXISTS, "%s: exists and is not a directory", out_dir);
    else if (exists && mq_dir_exists(out) && olen > 5 && !strcmp(out + olen - 5, ".gguf"))
        s = mq_err(MOEQ_E_EXISTS, "%s: exists and is a directory (a GGUF output is one file)", out_dir);
    free(out);
    if (exists_out) *exists_out = exists;
    return s;
}

moeq_status mq_ckpt_publish(const char *tmp, const char *out) {
    struct stat sb;
    if (stat(out, &sb) != 0) {
        if (rename(tmp, out) != 0)
            return mq_err(MOEQ_E_IO, "%s: cannot rename the finished checkpoint into place: %s", out,
                          strerror(errno));
        return MOEQ_OK;
    }
    char *old = mq_asprintf("%s.old-%ld", out, (long)getpid());
    if (!old) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = MOEQ_OK;
    if (rename(out, old) != 0) {
        s = mq_err(MOEQ_E_IO, "%s: cannot move the existing directory aside: %s", out, strerror(errno));
    } else if (rename(tmp, out) != 0) {
        s = mq_err(MOEQ_E_IO, "%s: cannot rename the finished checkpoint into place: %s", out,
                   strerror(errno));
        if (rename(old, out) != 0) mq_warn("%s: the previous checkpoint is left at %s", out, old);
    } else {
        mq_remove_tree(old);
    }
    free(old);
    return s;
}
