/*
 * The work directory of a run (OUT_DIR.moeq-work unless --work-dir): out/ with the checkpoint
 * being assembled (planned shards, io/safetensors.h), the calibration activations at the last
 * boundary of a finished layer (acts-<layer>.bin, written before the manifest names it; not after
 * every layer when writing it costs more than a tenth of the layers since the last one), and
 * manifest.json: what the run is (the source files' sizes and sampled content hashes, every
 * option that changes the result, a hash of the calibration token ids, the checkpoint plan) and
 * what it has done (the global tensors and each finished layer with the CRC-32 of every tensor it
 * wrote, its report, and the boundary file). Each update is written to a temporary file, synced
 * and renamed, so a crash at any point leaves the previous manifest or the new one; a resume
 * checks the identity field by field, re-reads every finished tensor against its CRC (a torn or
 * corrupt one makes its layer and the ones after it be redone) and continues after the last
 * layer that checks out. A lock file keeps two runs out of one directory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "dist/dist.h"
#include "core/env.h"
#include "pipeline/internal.h"

/* 2: the options recorded as quant_options.def's RECORD column has them (the report's names and
 * values); a work directory of version 1 is not resumed, it says so */
#define MANIFEST_VERSION 2
static const char k_act_magic[8] = {'M', 'O', 'E', 'Q', 'A', 'C', 'T', '1'};

bool mq_fault_point(const char *where, int a, int b) {
    const char *f = mq_env(MQ_ENV_FAULT);
    if (!f || !*f) return false;
    const char *fr = mq_env(MQ_ENV_FAULT_RANK);
    if (fr && *fr && atoi(fr) != mq_dist_rank()) return false;
    char want[96];
    snprintf(want, sizeof want, "%s:%d", where, a);
    size_t n = strlen(want);
    if (strncmp(f, want, n) != 0) return false;
    if (f[n] == ':' && atoi(f + n + 1) != b) return false;
    if (f[n] != '\0' && f[n] != ':') return false;
    const char *mode = mq_env(MQ_ENV_FAULT_MODE);
    if (mode && !strcmp(mode, "error")) return true;
    if (mode && !strcmp(mode, "hang"))
        for (;;) pause();
    raise(SIGKILL);
    return false;
}

/* ---- identity ---------------------------------------------------------------------------------- */

/* CRC of a file's first MiB (the safetensors header lives there), 16 blocks spread over it and
 * its last 64 KiB: a changed or replaced file is caught without reading all of it. */
static moeq_status sampled_crc(const char *path, int64_t *size, uint32_t *crc) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return mq_err(MOEQ_E_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    moeq_status s = fstat(fd, &sb) == 0 ? MOEQ_OK : mq_err(MOEQ_E_IO, "%s: cannot stat", path);
    enum { BLK = 1 << 16, HEAD = 1 << 20 };
    uint8_t *buf = malloc(HEAD);
    if (!s && !buf) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    uint32_t c = 0;
    int64_t len = s ? 0 : (int64_t)sb.st_size;
    for (int i = -1; i <= 17 && !s; i++) {
        int64_t off = i < 0 ? 0 : i == 17 ? len - BLK : len / 17 * i;
        int64_t n = i < 0 ? HEAD : BLK;
        if (off < 0) off = 0;
        if (off + n > len) n = len - off;
        if (n <= 0) continue;
        s = mq_pread_all(fd, buf, (size_t)n, off, path);
        if (!s) c = mq_crc32(c, buf, (size_t)n);
    }
    free(buf);
    close(fd);
    *size = len;
    *crc = c;
    return s;
}

static int cmp_cstr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static moeq_status add_file(cJSON *arr, const char *dir, const char *name, const char *path) {
    int64_t size = 0;
    uint32_t crc = 0;
    moeq_status s = sampled_crc(path, &size, &crc);
    if (s) return s;
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "name", name);
    cJSON_AddNumberToObject(f, "size", (double)size);
    cJSON_AddNumberToObject(f, "crc", (double)crc);
    cJSON_AddItemToArray(arr, f);
    (void)dir;
    return MOEQ_OK;
}

static moeq_status source_identity(const mq_pipe *p, cJSON *src) {
    cJSON *files = cJSON_AddArrayToObject(src, "files");
    size_t n = mq_st_count(p->st);
    const char **paths = malloc((n ? n : 1) * sizeof *paths);
    if (!paths) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) paths[i] = mq_st_at(p->st, i)->file;
    if (n > 1) qsort(paths, n, sizeof *paths, cmp_cstr);
    moeq_status s = MOEQ_OK;
    for (size_t i = 0; i < n && !s; i++) {
        if (i > 0 && strcmp(paths[i], paths[i - 1]) == 0) continue;
        const char *base = strrchr(paths[i], '/');
        s = add_file(files, p->model_dir, base ? base + 1 : paths[i], paths[i]);
    }
    free(paths);
    const char *side[] = {"config.json", "tokenizer.json", "tiktoken.model"};
    for (int i = 0; i < 3 && !s; i++) {
        char *path = mq_path_join(p->model_dir, side[i]);
        if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
        if (mq_file_exists(path)) s = add_file(files, p->model_dir, side[i], path);
        free(path);
    }
    return s;
}

static cJSON *calib_identity(const mq_pipe *p) {
    cJSON *j = cJSON_CreateObject();
    uint32_t c = 0;
    for (int64_t s = 0; s < p->calib.n; s++) {
        c = mq_crc32(c, &p->calib.len[s], sizeof p->calib.len[s]);
        c = mq_crc32(c, p->calib.ids[s], sizeof(int32_t) * (size_t)p->calib.len[s]);
    }
    cJSON_AddNumberToObject(j, "samples", (double)p->calib.n);
    cJSON_AddNumberToObject(j, "tokens", (double)p->calib.total);
    cJSON_AddNumberToObject(j, "ids_crc", (double)c);
    return j;
}

static cJSON *plan_identity(const mq_pipe *p) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "tensors", (double)p->plan.n_decls);
    cJSON_AddNumberToObject(j, "bytes", (double)p->plan_bytes);
    cJSON_AddNumberToObject(j, "layers", p->plan.n_layers);
    return j;
}

/* The first field of `now` that `then` does not hold equally, as text; NULL when equal. */
static char *first_difference(const cJSON *then, const cJSON *now, const char *where) {
    const cJSON *a;
    cJSON_ArrayForEach(a, now) {
        const cJSON *b = cJSON_IsArray(then) ? NULL : cJSON_GetObjectItemCaseSensitive(then, a->string);
        if (cJSON_IsArray(now)) break;
        if (!b) return mq_asprintf("%s.%s: not recorded by the interrupted run", where, a->string);
        if (!cJSON_Compare(a, b, 1)) {
            char *x = cJSON_PrintUnformatted(b), *y = cJSON_PrintUnformatted(a);
            char *r = mq_asprintf("%s.%s: %s then, %s now", where, a->string, x ? x : "?", y ? y : "?");
            free(x);
            free(y);
            return r;
        }
    }
    if (cJSON_IsArray(now) && !cJSON_Compare(then, now, 1)) return mq_asprintf("%s differ", where);
    /* options recorded only when set (drop_mtp, rotate): set then, not now */
    cJSON_ArrayForEach(a, then) {
        if (cJSON_IsArray(then) || !cJSON_IsObject(now)) break;
        if (a->string && !cJSON_GetObjectItemCaseSensitive(now, a->string))
            return mq_asprintf("%s.%s: set by the interrupted run, not now", where, a->string);
    }
    return NULL;
}

/* ---- the manifest ---------------------------------------------------------------------------------- */

static char *work_path(const mq_pipe *p, const char *name) { return mq_path_join(p->work_dir, name); }

/* The manifest's text in place of the last (whole or not at all), the directory synced after. */
static moeq_status manifest_put(const mq_pipe *p, const char *path, const char *text) {
    moeq_status s = mq_write_file_atomic(path, text, strlen(text));
    return s ? s : mq_fsync_dir(p->work_dir);
}

static moeq_status manifest_write(mq_pipe *p) {
    char *text = cJSON_Print(p->manifest);
    char *path = work_path(p, "manifest.json");
    moeq_status s = text && path ? manifest_put(p, path, text) : mq_err(MOEQ_E_NOMEM, "out of memory");
    free(text);
    free(path);
    return s;
}

static moeq_status lock_dir(mq_pipe *p) {
    char *path = work_path(p, "lock");
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    p->lock_fd = open(path, O_RDWR | O_CREAT, 0644);
    moeq_status s = MOEQ_OK;
    if (p->lock_fd < 0)
        s = mq_err(MOEQ_E_IO, "%s: cannot create: %s", path, strerror(errno));
    else if (flock(p->lock_fd, LOCK_EX | LOCK_NB) != 0)
        s = mq_err(MOEQ_E_EXISTS, "%s: another moeq run is using this work directory", p->work_dir);
    free(path);
    if (s && p->lock_fd >= 0) {
        close(p->lock_fd);
        p->lock_fd = -1;
    }
    return s;
}

void mq_work_release(mq_pipe *p, bool keep) {
    if (p->lock_fd >= 0) {
        close(p->lock_fd);
        p->lock_fd = -1;
    }
    if (!keep && p->work_dir) mq_remove_tree(p->work_dir);
}

/* The tensors of a layer (-1: the global ones) and their CRCs. */
static cJSON *layer_tensors(const mq_pipe *p, int l) {
    cJSON *t = cJSON_CreateObject();
    for (size_t i = 0; i < p->plan.n_decls; i++) {
        if (p->decl_layer[i] != l) continue;
        uint32_t crc;
        if (!mq_ckpt_writer_crc(p->w, p->plan.decls[i].name, &crc)) {
            cJSON_Delete(t);
            return NULL;
        }
        cJSON_AddNumberToObject(t, p->plan.decls[i].name, (double)crc);
    }
    return t;
}

/* ---- reading what an interrupted run left (pure: tests/fuzz/fuzz_workdir.c runs these) ---------- */

/* A manifest number as an integer in [lo, hi] (never a cast of a double out of range). */
static bool json_int(const cJSON *v, int64_t lo, int64_t hi, int64_t *out) {
    return cJSON_IsNumber(v) && mq_int_of(v->valuedouble, lo, hi, out);
}

/* A report figure: a finite number, else 0 (a record's report is for the summary only). */
moeq_status mq_work_manifest_parse(const char *path, const char *text, size_t len, cJSON **out) {
    *out = NULL;
    cJSON *m = cJSON_ParseWithLength(text, len);
    if (!m) return mq_err(MOEQ_E_FORMAT, "%s: not JSON", path);
    int64_t ver;
    if (!cJSON_IsObject(m) || !json_int(cJSON_GetObjectItemCaseSensitive(m, "version"), 0, INT32_MAX, &ver) ||
        ver != MANIFEST_VERSION || !cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(m, "identity"))) {
        cJSON_Delete(m);
        return mq_err(MOEQ_E_FORMAT, "%s: not a work manifest of this version of moeq", path);
    }
    if (!cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(m, "layers"))) {
        cJSON_Delete(m);
        return mq_err(MOEQ_E_FORMAT, "%s: a manifest without its layers", path);
    }
    *out = m;
    return MOEQ_OK;
}

char *mq_work_identity_diff(const cJSON *manifest, const cJSON *identity) {
    static const char *const parts[] = {"source", "options", "calibration", "plan"};
    const cJSON *then = cJSON_GetObjectItemCaseSensitive(manifest, "identity");
    for (int i = 0; i < 4; i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(then, parts[i]);
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(identity, parts[i]);
        char *d = a ? first_difference(a, b, parts[i]) : mq_asprintf("%s: not recorded", parts[i]);
        if (d) {
            char *r = mq_asprintf("the %s %s from the interrupted run's (%s)", parts[i],
                                  i == 1 ? "differ" : "differs", d);
            free(d);
            return r ? r : mq_strdup("out of memory");
        }
    }
    return NULL;
}

/* The records of layer l's tensors (an object of name: CRC) check out: every CRC a 32-bit
 * integer that the data on disk has (chk->verify), as many tensors as the plan has there. */
static moeq_status check_tensors(const mq_work_check *chk, const char *path, const cJSON *tensors, int l) {
    if (!cJSON_IsObject(tensors)) return mq_err(MOEQ_E_FORMAT, "%s: layer %d: no tensors object", path, l);
    const cJSON *e;
    int n = 0;
    cJSON_ArrayForEach(e, tensors) {
        int64_t crc;
        if (!json_int(e, 0, UINT32_MAX, &crc))
            return mq_err(MOEQ_E_FORMAT, "%s: bad CRC of tensor '%s'", path, e->string);
        moeq_status s = chk->verify(chk->user, e->string, (uint32_t)crc);
        if (s) return s;
        n++;
    }
    const int want = chk->count(chk->user, l);
    if (n != want)
        return mq_err(MOEQ_E_FORMAT, "%s: %d tensors recorded for %s %d, the plan has %d", path, n,
                      l < 0 ? "the globals" : "layer", l, want);
    return MOEQ_OK;
}

int mq_work_layers_check(cJSON *manifest, const char *path, int n_layers, const mq_work_check *chk) {
    cJSON *layers = cJSON_GetObjectItemCaseSensitive(manifest, "layers");
    cJSON *globals = cJSON_GetObjectItemCaseSensitive(manifest, "globals");
    if (globals && check_tensors(chk, path, globals, -1)) {
        mq_warn("%s; the global tensors are written again", moeq_last_error());
        cJSON_DeleteItemFromObjectCaseSensitive(manifest, "globals");
    }
    int l = 0;
    for (const cJSON *rec = cJSON_IsArray(layers) ? layers->child : NULL; rec; rec = rec->next, l++) {
        int64_t li;
        if (l >= n_layers) {
            mq_warn("%s: records past the plan's %d layers; they are dropped", path, n_layers);
            break;
        }
        if (!json_int(cJSON_GetObjectItemCaseSensitive(rec, "layer"), 0, INT32_MAX, &li) || li != l) {
            mq_warn("%s: the %s record is not layer %d's; layer %d and the ones after it are redone", path,
                    l == 0 ? "first layer" : "next layer", l, l);
            break;
        }
        if (check_tensors(chk, path, cJSON_GetObjectItemCaseSensitive(rec, "tensors"), l)) {
            mq_warn("%s; layer %d and the ones after it are redone", moeq_last_error(), l);
            break;
        }
    }
    /* the records past the last good layer go */
    while (cJSON_IsArray(layers) && cJSON_GetArraySize(layers) > l) cJSON_DeleteItemFromArray(layers, l);
    return l;
}

static moeq_status writer_verify(void *user, const char *tensor, uint32_t crc) {
    return mq_ckpt_writer_verify(((mq_pipe *)user)->w, tensor, crc);
}

static int plan_count(void *user, int l) {
    const mq_pipe *p = user;
    int want = 0;
    for (size_t i = 0; i < p->plan.n_decls; i++) want += p->decl_layer[i] == l;
    return want;
}

/* Takes over the finished layers of the interrupted run that check out. */
static void resume_layers(mq_pipe *p, const char *mpath) {
    const mq_work_check chk = {writer_verify, plan_count, p};
    const int done = mq_work_layers_check(p->manifest, mpath, p->plan.n_layers, &chk);
    int l = 0;
    const cJSON *rec;
    cJSON_ArrayForEach(rec, cJSON_GetObjectItemCaseSensitive(p->manifest, "layers")) {
        if (l >= done) break;
        const cJSON *rep = cJSON_GetObjectItemCaseSensitive(rec, "report");
        mq_layer_report *lr = &p->layers[l++];
        mq_layer_seconds_get(lr, rep);
        int64_t v;
        lr->peak_anon = json_int(cJSON_GetObjectItemCaseSensitive(rep, "peak_anon_bytes"), 0, INT64_MAX, &v) ? v : 0;
        lr->chunks = json_int(cJSON_GetObjectItemCaseSensitive(rep, "expert_chunks"), 0, INT32_MAX, &v) ? (int)v : 0;
        const cJSON *mods = cJSON_GetObjectItemCaseSensitive(rep, "modules");
        cJSON_Delete(lr->modules);
        lr->modules = cJSON_IsArray(mods) ? cJSON_Duplicate(mods, 1) : cJSON_CreateArray();
    }
    p->layers_done = done;
}

moeq_status mq_work_prepare(mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    p->work_dir = o->work_dir ? mq_strdup(o->work_dir) : mq_asprintf("%s.moeq-work", p->out_dir);
    p->build_dir = p->work_dir ? mq_path_join(p->work_dir, "out") : NULL;
    if (!p->work_dir || !p->build_dir) return mq_err(MOEQ_E_NOMEM, "out of memory");
    /* the finished checkpoint is renamed from the work directory to OUT_DIR: one file system */
    char *parent = mq_strdup(p->out_dir);
    char *slash = parent ? strrchr(parent, '/') : NULL;
    if (slash) *(slash == parent ? slash + 1 : slash) = '\0';
    struct stat a, b;
    bool exists = mq_dir_exists(p->work_dir);
    if (parent && exists && stat(slash ? parent : ".", &a) == 0 && stat(p->work_dir, &b) == 0 &&
        a.st_dev != b.st_dev) {
        free(parent);
        return mq_err(MOEQ_E_ARG, "--work-dir %s: must be on the file system of %s (the finished "
                      "checkpoint is renamed into place)", p->work_dir, p->out_dir);
    }
    free(parent);
    cJSON *src = cJSON_CreateObject();
    moeq_status s = source_identity(p, src);
    cJSON *identity = cJSON_CreateObject();
    cJSON_AddItemToObject(identity, "source", src);
    cJSON_AddItemToObject(identity, "options", mq_settings_json(p, true));
    cJSON_AddItemToObject(identity, "calibration", calib_identity(p));
    cJSON_AddItemToObject(identity, "plan", plan_identity(p));
    if (s) {
        cJSON_Delete(identity);
        return s;
    }
    char *mpath = work_path(p, "manifest.json");
    bool have_manifest = mpath && mq_file_exists(mpath);
    if (exists && !o->resume) {
        cJSON_Delete(identity);
        free(mpath);
        if (!have_manifest && !mq_file_exists(p->build_dir))
            return mq_err(MOEQ_E_EXISTS, "%s: exists and is not a moeq work directory (choose "
                          "another --work-dir)", p->work_dir);
        return mq_err(MOEQ_E_EXISTS, "%s: holds an interrupted run for %s: add --resume to "
                      "continue it, or delete the directory to start over", p->work_dir, p->out_dir);
    }
    if (exists && have_manifest) {
        if ((s = lock_dir(p))) goto done;
        char *text = NULL;
        size_t len;
        s = mq_read_file(mpath, &text, &len);
        if (!s) s = mq_work_manifest_parse(mpath, text, len, &p->manifest);
        free(text);
        if (s) {   /* never guessed at: the run starts over only when told to */
            mq_err_prefix(s, "--resume: delete %s to start over", p->work_dir);
            goto done;
        }
        char *d = mq_work_identity_diff(p->manifest, identity);
        if (d) {
            s = mq_err(MOEQ_E_ARG, "--resume: %s: %s; resume with the same source and options, or "
                       "delete %s to start over", mpath, d, p->work_dir);
            free(d);
            goto done;
        }
        s = mq_ckpt_writer_open(p->build_dir, p->plan.decls, p->plan.n_decls, &p->ckpt_opts, true, &p->w);
        if (s) {
            mq_err_prefix(s, "--resume: %s", p->work_dir);
            goto done;
        }
        resume_layers(p, mpath);
        if (p->layers_done > 0)
            mq_info("resuming %s: %d of %d layers were finished", p->out_dir, p->layers_done,
                    p->plan.n_layers);
        goto done;
    }
    if (o->resume && !exists) mq_info("%s: no interrupted run to resume; starting a new one", p->work_dir);
    /* the checkpoint and the work files must fit where they are written (the shards are made at
     * their full size but sparse: without this check a full disk would show only mid-run) */
    struct statvfs fs;
    char *where = mq_strdup(p->work_dir);
    char *cut = where ? strrchr(where, '/') : NULL;
    if (cut) *(cut == where ? cut + 1 : cut) = '\0';
    if (where && statvfs(cut ? where : ".", &fs) == 0) {
        double free_b = (double)fs.f_bavail * (double)fs.f_frsize;
        double need = (double)p->mp.disk_output + (double)p->mp.disk_work;
        if (need > free_b) {
            s = mq_err(MOEQ_E_IO, "%s: %.2f GB free, the checkpoint and the work files need %.2f GB",
                       cut ? where : ".", free_b / 1e9, need / 1e9);
            free(where);
            goto done;
        }
    }
    free(where);
    if (exists) mq_remove_tree(p->work_dir);   /* a directory without a manifest: never got going */
    if (mkdir(p->work_dir, 0755) != 0 || mkdir(p->build_dir, 0755) != 0) {
        s = mq_err(MOEQ_E_IO, "%s: cannot create the work directory: %s", p->work_dir, strerror(errno));
        goto done;
    }
    p->work_fresh = true;
    if ((s = lock_dir(p))) goto done;
    p->manifest = cJSON_CreateObject();
    cJSON_AddNumberToObject(p->manifest, "version", MANIFEST_VERSION);
    cJSON_AddStringToObject(p->manifest, "tool", "moeq " MOEQ_VERSION_STRING);
    cJSON_AddStringToObject(p->manifest, "out_dir", p->out_dir);
    cJSON_AddItemToObject(p->manifest, "identity", identity);
    identity = NULL;
    cJSON_AddArrayToObject(p->manifest, "layers");
    s = mq_ckpt_writer_open(p->build_dir, p->plan.decls, p->plan.n_decls, &p->ckpt_opts, false, &p->w);
    if (!s) s = manifest_write(p);
done:
    cJSON_Delete(identity);
    free(mpath);
    return s;
}

bool mq_work_globals_done(const mq_pipe *p) {
    return cJSON_GetObjectItemCaseSensitive(p->manifest, "globals") != NULL;
}

moeq_status mq_work_globals_written(mq_pipe *p) {
    moeq_status s = mq_ckpt_writer_sync(p->w);
    cJSON *t = s ? NULL : layer_tensors(p, -1);
    if (!s && !t) s = mq_err(MOEQ_E_ARG, "%s: a global tensor was not written", p->work_dir);
    if (s) return s;
    cJSON_AddItemToObject(p->manifest, "globals", t);
    return manifest_write(p);
}

/* ---- activation snapshots ------------------------------------------------------------------------- */

static char *acts_name(int layer) { return mq_asprintf("acts-%d.bin", layer); }

/* A snapshot holds the quantized stream's boundary and, with the unquantized target, the
 * unquantized stream's after it: "rows" r in [0, streams * S) are sample r % S of stream r / S. */
static int snap_streams(const mq_pipe *p) { return 1 + (p->target ? 1 : 0); }
static const mq_actbuf *snap_buf(const mq_pipe *p, int64_t r) { return r < p->calib.n ? &p->X : &p->XF; }

/* Row r's *n values: in its buffer, or read into tmp (mq_actbuf_view). */
static const float *snap_row(const mq_pipe *p, int64_t r, float *tmp, size_t *n) {
    const int64_t smp = r % p->calib.n;
    *n = (size_t)(p->calib.len[smp] * p->c->D);
    return mq_actbuf_view(snap_buf(p, r), (size_t)(smp * p->LD), *n, tmp);
}

bool mq_work_boundary(const cJSON *manifest, int *layer, uint32_t *crc) {
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(manifest, "boundary");
    int64_t l, c;
    if (!json_int(cJSON_GetObjectItemCaseSensitive(b, "layer"), 1, INT32_MAX, &l) ||
        !json_int(cJSON_GetObjectItemCaseSensitive(b, "crc"), 0, UINT32_MAX, &c))
        return false;
    *layer = (int)l;
    *crc = (uint32_t)c;
    return true;
}

/* The layer whose input the manifest's snapshot holds, or -1. */
static int boundary_layer(const mq_pipe *p) {
    int l;
    uint32_t crc;
    return mq_work_boundary(p->manifest, &l, &crc) ? l : -1;
}

/* Whether layer l's output boundary is snapshotted: a snapshot saves the replay of the layers
 * since the last one at a resume, so at real size on a GPU, where writing one (2 GB for
 * OLMoE-1B-7B at 128 x 2048 tokens: about 1 s) is a fifth of a layer, one is written once the
 * layers since the last have taken SNAPSHOT_RATIO times what that one cost (a resume then
 * replays a few layers' forward at most); on the CPU, whose layers take minutes, after every
 * layer. Several ranks: always (their resume needs the snapshot at the first layer it runs).
 * MOEQ_DEBUG_SNAPSHOT_EVERY=N (tests): after every N-th layer. */
enum { SNAPSHOT_RATIO = 10 };

static bool snapshot_due(mq_pipe *p, int l) {
    p->since_snapshot += p->layers[l].total;
    if (p->ranks > 1) return true;
    const char *e = mq_env(MQ_ENV_SNAPSHOT_EVERY);
    if (e && atoi(e) > 0) return (l + 1) % atoi(e) == 0;
    return p->snapshot_cost <= 0 || p->since_snapshot >= SNAPSHOT_RATIO * p->snapshot_cost;
}

/* The boundary at the input of `layer`: header, every sample's rows, CRC of the rows. It is a
 * cache of what the checkpoint recomputes (pipeline.c: a resume without it replays the finished
 * layers), so it is renamed into place without fsync: a process that is killed leaves it whole
 * in the page cache, and a machine that crashes leaves at worst a file whose CRC fails. Gigabytes
 * a layer at real size (128 x 2048 tokens of OLMoE-1B-7B: 2 GB): with fp32 in memory every
 * sample's CRC and write go over the pool, each at its own offset. */
typedef struct {
    const mq_pipe *p;
    mq_atomic_file *af;
    const int64_t *off;           /* [n] each sample's byte offset in the file */
    uint32_t *crc;
    moeq_status *st;
} boundary_job;

static void boundary_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const boundary_job *j = ctx;
    size_t n;
    const float *v = snap_row(j->p, i, NULL, &n);
    j->crc[i] = mq_crc32(0, v, n * sizeof(float));
    j->st[i] = mq_atomic_pwrite(j->af, v, n * sizeof(float), j->off[i]);
}

static moeq_status write_boundary(mq_pipe *p, int layer, uint32_t *crc_out) {
    char *name = acts_name(layer), *path = name ? work_path(p, name) : NULL;
    free(name);
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    const int64_t D = p->c->D, S = p->calib.n, R = S * snap_streams(p);
    const bool pool = p->X.kind != MQ_ACT_BF16;   /* fp32 in memory (or mapped) */
    float *tmp = pool ? NULL : mq_alloc_array((size_t)p->LD, sizeof(float), "activation snapshot");
    uint32_t *part = pool ? calloc((size_t)R + 1, sizeof *part) : NULL;
    int64_t *off = pool ? calloc((size_t)R + 1, sizeof *off) : NULL;
    moeq_status *sst = pool ? calloc((size_t)R + 1, sizeof *sst) : NULL;
    mq_atomic_file af;
    moeq_status s = (pool ? part && off && sst : tmp != NULL) ? mq_atomic_open(&af, path)
                                                               : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (s) {
        mq_free(tmp);
        free(part), free(off), free(sst), free(path);
        return s;
    }
    int64_t hdr[4] = {MANIFEST_VERSION, layer, S, D};
    s = mq_atomic_write(&af, k_act_magic, 8);
    if (!s) s = mq_atomic_write(&af, hdr, sizeof hdr);
    uint32_t crc = 0;
    if (pool) {
        int64_t at = 8 + (int64_t)sizeof hdr;
        for (int64_t i = 0; i < R; i++) {
            off[i] = at;
            at += p->calib.len[i % S] * D * (int64_t)sizeof(float);
        }
        if (!s && fflush(af.f) != 0) s = mq_err(MOEQ_E_IO, "%s: write failed: %s", af.tmp_path, strerror(errno));
        boundary_job j = {p, &af, off, part, sst};
        if (!s) mq_parallel_for(R, boundary_task, &j);
        for (int64_t i = 0; i < R && !s; i++) {
            s = sst[i];
            crc = mq_crc32_combine(crc, part[i], (uint64_t)(p->calib.len[i % S] * D) * sizeof(float));
        }
        if (!s) s = mq_atomic_pwrite(&af, &crc, sizeof crc, at);
    } else {
        for (int64_t i = 0; i < R && !s; i++) {
            size_t n;
            const float *v = snap_row(p, i, tmp, &n);
            crc = mq_crc32(crc, v, n * sizeof(float));
            s = mq_atomic_write(&af, v, n * sizeof(float));
        }
        if (!s) s = mq_atomic_write(&af, &crc, sizeof crc);
    }
    if (!s) s = mq_atomic_commit_ex(&af, false);
    else mq_atomic_abort(&af);
    mq_free(tmp);
    free(part), free(off), free(sst), free(path);
    *crc_out = crc;
    return s;
}

/* The snapshot at the input of `layer` (>= 1), once the manifest no longer names it. */
static void drop_snapshot(const mq_pipe *p, int layer) {
    if (layer < 1) return;
    char *name = acts_name(layer), *path = name ? work_path(p, name) : NULL;
    if (path) unlink(path);
    free(name);
    free(path);
}

/* A snapshot written behind the next layer (the plan's snapshot_copy): the boundary copied on the
 * pool into one buffer (its samples' rows back to back, with their CRCs), then written by a thread
 * of its own while the next layer computes, which would otherwise wait for the disk (22 GB at 1-2
 * GB/s on the GPU machine at 4096 documents: 10-20 s a snapshot, against 1.5 s to copy). The
 * manifest names it at the end of that next layer (mq_work_layer_done waits for it there), so
 * what a resume finds does not depend on how fast the disk was; a run that stops or fails before
 * then waits for it too (it saves the resume a layer's replay or more). */
struct mq_snap_job {
    pthread_t th;
    char *path;
    float *buf;
    size_t n;                     /* values */
    int64_t hdr[4];
    uint32_t crc;
    int layer;
    moeq_status st;
    char msg[256];                /* its error (errors are per thread) */
    double seconds;
    double copy_seconds;          /* the copy before it, on the layers' path */
};

typedef struct {
    const mq_pipe *p;
    float *dst;
    const int64_t *at;            /* [S] each sample's first value in dst */
    uint32_t *crc;
} snap_copy_job;

static void snap_copy_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const snap_copy_job *j = ctx;
    float *d = j->dst + j->at[i];
    size_t n;
    const float *v = snap_row(j->p, i, d, &n);
    if (v != d) memcpy(d, v, n * sizeof(float));
    j->crc[i] = mq_crc32(0, d, n * sizeof(float));
}

static void *snap_thread(void *arg) {
    struct mq_snap_job *j = arg;
    const double t0 = mq_now();
    enum { PIECE = 64 << 20 };
    mq_atomic_file af;
    moeq_status s = mq_atomic_open(&af, j->path);
    if (!s) {
        s = mq_atomic_write(&af, k_act_magic, 8);
        if (!s) s = mq_atomic_write(&af, j->hdr, sizeof j->hdr);
        const char *b = (const char *)j->buf;
        for (size_t off = 0, bytes = j->n * sizeof(float); off < bytes && !s; off += PIECE)
            s = mq_atomic_write(&af, b + off, bytes - off < PIECE ? bytes - off : PIECE);
        if (!s) s = mq_atomic_write(&af, &j->crc, sizeof j->crc);
        if (!s) s = mq_atomic_commit_ex(&af, false);
        else mq_atomic_abort(&af);
    }
    if (s) snprintf(j->msg, sizeof j->msg, "%s", moeq_last_error());
    j->st = s;
    j->seconds = mq_now() - t0;
    return NULL;
}

static void snap_free(struct mq_snap_job *j) {
    mq_free(j->buf);
    free(j->path);
    free(j);
}

/* Copies the boundary at the input of `layer` and starts its thread. */
static moeq_status snap_start(mq_pipe *p, int layer) {
    const int64_t D = p->c->D, S = p->calib.n, R = S * snap_streams(p);
    struct mq_snap_job *j = calloc(1, sizeof *j);
    int64_t *at = calloc((size_t)R + 1, sizeof *at);
    uint32_t *part = calloc((size_t)R + 1, sizeof *part);
    char *name = acts_name(layer);
    if (j && name) j->path = work_path(p, name);
    free(name);
    int64_t n = 0;
    for (int64_t i = 0; i < R; i++) {
        if (at) at[i] = n;
        n += p->calib.len[i % S] * D;
    }
    if (p->snap_spare && p->snap_spare_n < (size_t)n) {
        mq_free(p->snap_spare);
        p->snap_spare = NULL;
    }
    if (j && j->path && at && part) {
        j->buf = p->snap_spare ? p->snap_spare
                               : mq_alloc_array((size_t)(n > 0 ? n : 1), sizeof(float), "activation snapshot");
        p->snap_spare = NULL;
    }
    if (!j || !j->path || !at || !part || !j->buf) {
        if (j) snap_free(j);
        free(at), free(part);
        return mq_err(MOEQ_E_NOMEM, "out of memory for the activation snapshot's copy");
    }
    j->n = (size_t)n;
    j->layer = layer;
    j->hdr[0] = MANIFEST_VERSION, j->hdr[1] = layer, j->hdr[2] = S, j->hdr[3] = D;
    snap_copy_job c = {p, j->buf, at, part};
    mq_parallel_for(R, snap_copy_task, &c);
    for (int64_t i = 0; i < R; i++)
        j->crc = mq_crc32_combine(j->crc, part[i], (uint64_t)(p->calib.len[i % S] * D) * sizeof(float));
    free(at), free(part);
    if (pthread_create(&j->th, NULL, snap_thread, j) != 0) {
        snap_free(j);
        return mq_err(MOEQ_E_IO, "%s: cannot start the thread that writes the activation snapshot", p->work_dir);
    }
    p->snap_bg = j;
    return MOEQ_OK;
}

static moeq_status rec_finish(mq_pipe *p);

/* Waits for the snapshot being written; where it was written whole, the manifest names it (and the
 * one before goes). A failed one is only a warning: it is a cache of what a resume recomputes.
 * drop: NULL writes the manifest now (and removes the snapshot it no longer names); else the
 * caller writes it, and removes *drop (-1: none) after. */
static moeq_status snap_finish(mq_pipe *p, int *drop) {
    if (drop) *drop = -1;
    struct mq_snap_job *j = p->snap_bg;
    if (!j) return MOEQ_OK;
    pthread_join(j->th, NULL);
    p->snap_bg = NULL;
    if (!p->snap_spare) {   /* for the next snapshot */
        p->snap_spare = j->buf, p->snap_spare_n = j->n;
        j->buf = NULL;
    }
    moeq_status s = MOEQ_OK;
    if (j->st) {
        mq_warn("%s: the activation snapshot was not written (%s); a resume recomputes them", j->path, j->msg);
    } else {
        /* what it cost: the disk's time and the copy the layers waited for, which the ratio
         * spaces out */
        p->snapshot_cost = j->seconds + j->copy_seconds;
        const int old = boundary_layer(p);
        cJSON *b = cJSON_CreateObject();
        if (!b) s = mq_err(MOEQ_E_NOMEM, "out of memory");
        if (!s) {
            cJSON_AddNumberToObject(b, "layer", j->layer);
            cJSON_AddNumberToObject(b, "crc", (double)j->crc);
            if (!cJSON_ReplaceItemInObjectCaseSensitive(p->manifest, "boundary", b))
                cJSON_AddItemToObject(p->manifest, "boundary", b);
            if (!drop) s = manifest_write(p);
        }
        if (!s && old != j->layer) {
            if (drop) *drop = old;
            else drop_snapshot(p, old);
        }
    }
    snap_free(j);
    return s;
}

moeq_status mq_work_snapshot_wait(mq_pipe *p) {
    moeq_status s = rec_finish(p), s2 = snap_finish(p, NULL);
    return s ? s : s2;
}

void mq_work_join(mq_pipe *p) {
    if (rec_finish(p)) mq_warn("%s", moeq_last_error());
    if (snap_finish(p, NULL)) mq_warn("%s", moeq_last_error());
}

/* ---- a layer's record, made durable behind the next layer ---------------------------------------- */

/* The manifest may name a layer only once its tensors are on the disk: the shards' fdatasync (0.1
 * s a layer of OLMoE-1B-7B on the GPU machine's disk) and the manifest's own write and fsync (as
 * long again when it has to wait for a snapshot's data on ext4) happen on a thread of their own
 * while the next layer computes; the next layer's record waits for them first. A run that is
 * killed in between redoes at most that one layer; one that stops or fails waits for it
 * (mq_work_snapshot_wait). */
struct mq_rec_job {
    pthread_t th;
    const mq_pipe *p;             /* read only: its writer's files, its work directory */
    char *text;                   /* the manifest */
    char *path;
    int drop[2];                  /* snapshots the manifest no longer names (-1: none) */
    moeq_status st;
    char msg[256];                /* its error (errors are per thread) */
};

static void *rec_thread(void *arg) {
    struct mq_rec_job *j = arg;
    moeq_status s = mq_ckpt_writer_sync_all(j->p->w);
    if (!s) s = manifest_put(j->p, j->path, j->text);
    for (int i = 0; i < 2 && !s; i++) drop_snapshot(j->p, j->drop[i]);
    if (s) snprintf(j->msg, sizeof j->msg, "%s", moeq_last_error());
    j->st = s;
    return NULL;
}

static void rec_free(struct mq_rec_job *j) {
    free(j->text);
    free(j->path);
    free(j);
}

static moeq_status rec_start(mq_pipe *p, int drop0, int drop1) {
    struct mq_rec_job *j = calloc(1, sizeof *j);
    if (j) {
        j->p = p;
        j->text = cJSON_Print(p->manifest);
        j->path = work_path(p, "manifest.json");
        j->drop[0] = drop0, j->drop[1] = drop1;
    }
    if (!j || !j->text || !j->path) {
        if (j) rec_free(j);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    if (pthread_create(&j->th, NULL, rec_thread, j) != 0) {
        rec_free(j);
        return mq_err(MOEQ_E_IO, "%s: cannot start the thread that records a layer", p->work_dir);
    }
    p->rec_bg = j;
    return MOEQ_OK;
}

static moeq_status rec_finish(mq_pipe *p) {
    struct mq_rec_job *j = p->rec_bg;
    if (!j) return MOEQ_OK;
    pthread_join(j->th, NULL);
    p->rec_bg = NULL;
    moeq_status s = j->st ? mq_err(j->st, "%s", j->msg) : MOEQ_OK;
    rec_free(j);
    return s;
}

bool mq_work_acts_read(const char *path, const mq_acts_shape *a, float *tmp, mq_acts_put_fn put, void *user) {
    const int fd = open(path, O_RDONLY);
    if (fd < 0) return false;
    const int64_t rows = a->samples * a->streams;
    /* the file is exactly the header, every row and the CRC: longer or shorter is another file */
    int64_t want = 8 + 4 * (int64_t)sizeof(int64_t) + (int64_t)sizeof(uint32_t);
    for (int64_t i = 0; i < rows; i++) want += a->len[i % a->samples] * a->D * (int64_t)sizeof(float);
    struct stat sb;
    char magic[8];
    int64_t hdr[4];
    bool good = fstat(fd, &sb) == 0 && (int64_t)sb.st_size == want && !mq_pread_all(fd, magic, 8, 0, path) &&
                !mq_pread_all(fd, hdr, sizeof hdr, 8, path) && memcmp(magic, k_act_magic, 8) == 0 &&
                hdr[0] == MANIFEST_VERSION && hdr[1] == a->layer && hdr[2] == a->samples && hdr[3] == a->D;
    int64_t off = 8 + (int64_t)sizeof hdr;
    uint32_t crc = 0;
    for (int64_t i = 0; i < rows && good; i++) {
        const size_t n = (size_t)(a->len[i % a->samples] * a->D);
        if (mq_pread_all(fd, tmp, n * sizeof(float), off, path)) {
            good = false;
            break;
        }
        off += (int64_t)(n * sizeof(float));
        crc = mq_crc32(crc, tmp, n * sizeof(float));
        put(user, i, tmp, n);
    }
    uint32_t stored;
    if (good) good = !mq_pread_all(fd, &stored, sizeof stored, off, path) && stored == crc && crc == a->crc;
    close(fd);
    return good;
}

static void put_row(void *user, int64_t i, const float *v, size_t n) {
    const mq_pipe *p = user;
    mq_actbuf_put((mq_actbuf *)snap_buf(p, i), (size_t)(i % p->calib.n * p->LD), n, v);
}

moeq_status mq_work_load_boundary(mq_pipe *p, int upto, int *at) {
    *at = 0;
    int layer;
    uint32_t crc;
    if (!mq_work_boundary(p->manifest, &layer, &crc) || layer > upto) return MOEQ_OK;
    char *name = acts_name(layer), *path = name ? work_path(p, name) : NULL;
    free(name);
    float *tmp = path ? mq_alloc_array((size_t)p->LD, sizeof(float), "activation snapshot") : NULL;
    if (!tmp) {
        free(path);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    const mq_acts_shape a = {layer, p->calib.n, p->c->D, p->calib.len, snap_streams(p), crc};
    if (mq_work_acts_read(path, &a, tmp, put_row, p)) *at = layer;
    else mq_warn("%s: the activations at layer %d are missing, corrupt or another run's; they are recomputed",
                 path, layer);
    mq_free(tmp);
    free(path);
    return MOEQ_OK;
}

static moeq_status layer_done(mq_pipe *p, int l);

moeq_status mq_work_layer_done(mq_pipe *p, int l) {
    const double t0 = mq_now();
    moeq_status s = layer_done(p, l);
    p->layers[l].snapshot = mq_now() - t0;
    return s;
}

static moeq_status layer_done(mq_pipe *p, int l) {
    const double t_sync = mq_now();
    moeq_status s = rec_finish(p);   /* the layer before's, made durable while this one ran */
    p->layers[l].snapshot_sync = mq_now() - t_sync;
    if (s) return s;
    if ((s = mq_ckpt_writer_flush(p->w))) return s;   /* queued writes (the layer flushed them) */
    cJSON *rec = cJSON_CreateObject();
    cJSON_AddNumberToObject(rec, "layer", l);
    cJSON *t = layer_tensors(p, l);
    if (!t) {
        cJSON_Delete(rec);
        return mq_err(MOEQ_E_ARG, "%s: layer %d left a tensor unwritten", p->work_dir, l);
    }
    cJSON_AddItemToObject(rec, "tensors", t);
    const mq_layer_report *lr = &p->layers[l];
    cJSON *rep = cJSON_AddObjectToObject(rec, "report");
    mq_layer_seconds_put(rep, lr);
    cJSON_AddNumberToObject(rep, "peak_anon_bytes", (double)lr->peak_anon);
    cJSON_AddNumberToObject(rep, "expert_chunks", lr->chunks);
    cJSON_AddItemToObject(rep, "modules", cJSON_Duplicate(lr->modules, 1));
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(p->manifest, "layers"), rec);
    /* the snapshot written behind this layer, named now (it was taken before this layer ran) */
    int dropped = -1;
    if ((s = snap_finish(p, &dropped))) return s;
    const bool due = p->calibrate && l + 1 < p->plan.n_layers && snapshot_due(p, l);
    const bool behind = due && p->mp.snapshot_copy > 0;   /* the plan had room for the copy */
    const bool snapshot = due && !behind;
    const int old = boundary_layer(p);
    uint32_t crc = 0;
    if (behind) {   /* copied now, written while the next layer runs, named after it */
        const double t0 = mq_now();
        s = snap_start(p, l + 1);
        if (!s && p->snap_bg) p->snap_bg->copy_seconds = p->layers[l].snapshot_copy = mq_now() - t0;
        p->since_snapshot = 0;
    } else if (snapshot) {
        const double t0 = mq_now();
        s = write_boundary(p, l + 1, &crc);
        p->snapshot_cost = p->layers[l].snapshot_copy = mq_now() - t0;
        p->since_snapshot = 0;
    }
    if (s) return s;
    if (snapshot) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddNumberToObject(b, "layer", l + 1);
        cJSON_AddNumberToObject(b, "crc", (double)crc);
        if (!cJSON_ReplaceItemInObjectCaseSensitive(p->manifest, "boundary", b))
            cJSON_AddItemToObject(p->manifest, "boundary", b);
    }
    s = rec_start(p, dropped, snapshot && old != l + 1 ? old : -1);
    p->layers_done = l + 1;
    if (!s) mq_fault_point("layer", l, 0);
    return s;
}
