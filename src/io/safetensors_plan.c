/*
 * safetensors shards planned before any tensor data (format: ../shared/docs/formats.md section
 * 1): each file's layout (the reference writer's order, as mq_stw_write) and header fixed up
 * front, the files created at their full size, tensor data written to its place whenever it is
 * ready, and a crashed run's files reopened to write the rest.
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
        off = sb_tensor_entry(&h, t->name, t->dtype, t->ndim, t->shape, off, t->nbytes);
    }
    sb_header_end(&h);
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
        if ((s = mq_stw_check_tensor(d->name, d->dtype, d->ndim, d->shape, "", nb))) break;
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

static const char *sorted_name(const void *p, size_t i) {
    const mq_shard_plan *P = p;
    return P->t[P->by_name[i]].name;
}

static const sp_tensor *plan_find(const mq_shard_plan *p, const char *name) {
    const int64_t i = mq_find_name(name, p->n, sorted_name, p);
    return i < 0 ? NULL : &p->t[p->by_name[i]];
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
    MQ_FREE_EACH(f->tmp, f->fd, f->dirty, f->done, f->dir, f);
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
