/*
 * The streamed evaluation forward, a client of the streaming engine (stream/engine.h): models
 * opened with moeq_model_options.stream never sit in memory whole. The engine runs the layers
 * (loading each, reading the next ahead on the GPU, swapping the boundary's files); this file
 * brings what is eval's: the windows' embedding, each window's layer, the scores, the plan, the
 * work directory and its resume. Every window goes through layer l before any goes through layer l + 1; the layer's
 * weights are read (packed or converted to fp32, as a whole load would) when the pass starts and
 * freed when it ends. A kl_base runs in lockstep: layer l of the base, then layer l of the model,
 * so one layer of one model is resident at a time. What crosses from layer to layer is the
 * boundary: every window's rows of hidden state, per model, in memory where the budget allows,
 * else in two mapped files of the work directory (the engine's boundary store: read from one,
 * written to the other, so that the file of the last finished layer is intact until the next one
 * is).
 *
 * Each window runs its layer exactly as the whole-model forward runs it (mq_forward_layers on the
 * window's rows from position 0, its own KV cache), and the scores come from the same
 * mq_eval_score_window: the results equal the whole-model forward's bit for bit, whatever the
 * budget, the storage or the number of windows in flight.
 *
 * Resume: after a layer whose boundary is durable (synced files, or a snapshot of the memory
 * boundary taken when a minute of work would otherwise be at stake) the work directory's record
 * says so; an interrupted run continues from there with moeq_eval_options.resume.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>

#include <cjson/cJSON.h>

#include "eval/eval_gpu.h"
#include "eval/eval_run.h"
#include "stream/engine.h"

#define RECORD "eval-stream.json"
enum { MAX_MODELS = 2 };

/* Seconds of layers after which a memory boundary is snapshot to the work directory: below it a
 * lost run costs less than the snapshots would. */
static double g_snapshot_seconds = 60.0;
void mq_eval_set_snapshot_seconds(double s);   /* tests */
void mq_eval_set_snapshot_seconds(double s) { g_snapshot_seconds = s; }

/* One model's boundary: rows x D fp32 (the engine's store, stream/boundary.h), in memory (buf[0],
 * updated in place) or in two mapped files of the work directory (buf[0]: the input of the layer
 * being run; its outputs go to buf[1]; the engine swaps them after the layer). */
typedef struct {
    bool ram;
    mq_actbuf buf[2];
} boundary;

typedef struct {
    mq_state *st[MAX_MODELS];
    bool st_fp32[MAX_MODELS];   /* the state has the fp32 routed experts' scratch */
    float *x;                   /* [L, Dmax]: a window's rows copied from a file */
    int32_t *ids;               /* [L] */
} worker;

typedef struct {
    mq_eval_ctx *c;
    int nm;
    const moeq_model *m[MAX_MODELS];   /* [0] the model, [1] the kl_base */
    mq_lazy_model *lz[MAX_MODELS];     /* NULL: loaded whole */
    int64_t D[MAX_MODELS], Dmax;
    int64_t *row0;                     /* [w_hi - w_lo + 1]: each window's first boundary row (the
                                          boundary holds this rank's windows) */
    int64_t rows;
    boundary B[MAX_MODELS];
    worker *W;
    int n_workers;
    bool read_ahead;                    /* a stream's next layer read ahead: always on a GPU, on
                                           the CPU where the plan holds a second layer */
    /* progress in rows: rows x (layers of every model) + the scored rows */
    mq_engine_progress progress;
    /* work directory */
    char *dir;
    bool dir_made;
    bool touched;   /* the run got past its checks: the directory's files are its own */
    int lock_fd;
    char identity[17];
    int layers_done, durable_layers;
    double since_durable, t_forward;
    /* --device cuda (eval_gpu.h): the layers and the scoring on the GPU; -1: the CPU */
    int gpu_precision;
    mq_eval_gpu *gpu;
    bool pinned[MAX_MODELS];   /* the memory boundary page-locked for the device's copies */
    bool resident;             /* the boundary on the device (mq_eval_gpu_resident_begin) */
    float *stage;              /* a group's rows copied from files */
} stream;

/* ---- boundary storage ---------------------------------------------------------------------- */
static void boundary_free(boundary *b) {
    for (int i = 0; i < 2; i++) mq_actbuf_free(&b->buf[i]);
    b->ram = false;
}

static moeq_status work_dir_make(stream *S);

static moeq_status boundary_init(stream *S, int k, bool ram) {
    boundary *b = &S->B[k];
    const size_t n = (size_t)S->rows * (size_t)S->D[k];
    b->ram = ram;
    if (ram) return mq_actbuf_init(&b->buf[0], MQ_ACT_RAM, n, NULL, "eval boundary activations");
    moeq_status s = work_dir_make(S);
    for (int i = 0; i < 2 && !s; i++) {
        char name[64];
        snprintf(name, sizeof name, "boundary-%d-%c.f32", k, 'a' + i);
        char *path = mq_path_join(S->dir, name);
        /* kept: a later --resume continues from the file the record names */
        s = path ? mq_actbuf_open_kept(&b->buf[i], n, path, "eval boundary activations")
                 : mq_err(MOEQ_E_NOMEM, "out of memory");
        free(path);
    }
    return s;
}

/* The rows [r0, r0 + n) of model k's boundary: a pointer into memory, or copied into scratch
 * (a file's rows are the last finished layer's: never changed in place). */
static float *boundary_get(stream *S, int k, int64_t r0, int64_t n, float *scratch) {
    boundary *b = &S->B[k];
    const size_t D = (size_t)S->D[k];
    float *at = b->buf[0].f + (size_t)r0 * D;
    if (b->ram) return at;
    memcpy(scratch, at, (size_t)n * D * sizeof(float));
    return scratch;
}

/* Stores a layer's output rows into the next file (in memory they were updated in place). */
static void boundary_put(stream *S, int k, int64_t r0, int64_t n, const float *x) {
    boundary *b = &S->B[k];
    if (b->ram) return;
    const size_t D = (size_t)S->D[k];
    memcpy(b->buf[1].f + (size_t)r0 * D, x, (size_t)n * D * sizeof(float));
}

/* ---- the passes ------------------------------------------------------------------------------ */
/* The state of worker w for model k, with the fp32 experts' scratch when layer l needs it. */
static moeq_status worker_state(stream *S, worker *w, int k, int l, mq_state **out) {
    const moeq_model *m = S->m[k];
    bool fp32 = l >= 0 && m->layers[l].is_moe && !m->layers[l].pexperts;
    if (w->st[k] && fp32 && !w->st_fp32[k]) {
        mq_state_free(w->st[k]);
        w->st[k] = NULL;
    }
    if (!w->st[k]) {
        moeq_status s = mq_state_new_ex(m, S->c->L, fp32, &w->st[k]);
        if (s) return s;
        w->st_fp32[k] = fp32;
    }
    *out = w->st[k];
    return MOEQ_OK;
}

/* The embedding of window item's tokens into every model's boundary (an engine item). */
/* Where window item `item` of worker t stands: its window, its document and its first row in
 * the boundaries. */
typedef struct {
    worker *w;
    int64_t wi;   /* the window's index in c->win */
    const mq_window *win;
    int64_t doc;   /* c->win_doc[wi] */
    int64_t r0;
} item_at;

static item_at item_of(const stream *S, int64_t item, int t) {
    const mq_eval_ctx *c = S->c;
    const int64_t wi = c->w_lo + item;
    return (item_at){&S->W[t], wi, &c->win[wi], c->win_doc[wi], S->row0[item]};
}

static moeq_status embed_item(void *user, int64_t item, int t) {
    stream *S = user;
    const item_at it = item_of(S, item, t);
    const int64_t n = it.win->n_input;
    moeq_status s = MOEQ_OK;
    mq_window_input(it.win, S->c->tok[it.doc], S->c->prefix, it.w->ids);
    for (int k = 0; k < S->nm && !s; k++) {
        float *x = S->B[k].buf[0].f + (size_t)it.r0 * (size_t)S->D[k];   /* memory or the mapped file */
        s = S->lz[k] ? mq_lazy_embed(S->lz[k], it.w->ids, n, x) : mq_embed(S->m[k], it.w->ids, n, x);
    }
    return s ? mq_err_prefix(s, "document %lld", (long long)it.doc + 1) : MOEQ_OK;
}

/* Window item through layer l of model k (the engine's run_item): the whole-model forward's
 * mq_forward_layers on the window's rows from position 0, its own KV cache. */
static moeq_status layer_item(void *user, int k, int l, int64_t item, int t) {
    stream *S = user;
    const item_at it = item_of(S, item, t);
    const int64_t n = it.win->n_input;
    mq_state *st = NULL;
    moeq_status s = worker_state(S, it.w, k, l, &st);
    if (!s) {
        float *x = boundary_get(S, k, it.r0, n, it.w->x);
        s = mq_forward_layers(S->m[k], st, x, n, 0, l, l + 1, NULL);
        if (!s) boundary_put(S, k, it.r0, n, x);
    }
    mq_engine_progress_add(&S->progress, n);
    if (s) return mq_err_prefix(s, "%s, layer %d, document %lld", k ? "KL base" : "model", l, (long long)it.doc + 1);
    return MOEQ_OK;
}

/* Scoring window item: the final norm of the scored rows, then the window's scores. */
static moeq_status score_item(void *user, int64_t item, int t) {
    stream *S = user;
    mq_eval_ctx *c = S->c;
    const item_at it = item_of(S, item, t);
    const int64_t n = it.win->n_input, ns = it.win->n_score;
    mq_eval_scratch *sc = &c->sc[t];
    float *x[MAX_MODELS] = {NULL, NULL};
    moeq_status s = mq_eval_scoring_init(c, sc);
    for (int k = 0; k < S->nm && !s; k++) {
        x[k] = boundary_get(S, k, it.r0 + n - ns, ns, it.w->x + (size_t)k * (size_t)c->L * (size_t)S->Dmax);
        mq_final_norm(S->m[k], x[k], ns);
    }
    if (!s) s = mq_eval_score_window(c, sc, it.wi, x[0], S->nm > 1 ? x[1] : NULL);
    if (!s) {
        c->win_done[it.wi] = 1;
        atomic_fetch_add(&c->tokens_done, ns);
    }
    mq_engine_progress_add(&S->progress, ns);
    return s ? mq_err_prefix(s, "document %lld", (long long)it.doc + 1) : MOEQ_OK;
}

/* ---- the plan ---------------------------------------------------------------------------- */
static int64_t mib(int64_t b) { return (b + (1 << 19)) >> 20; }

/* Whether the routed experts of m run in fp32 (the state's scratch) rather than packed. */
static bool experts_fp32(const stream *S, int k) {
    const moeq_model *m = S->m[k];
    if (m->cfg.n_experts == 0) return false;
    if (!S->lz[k]) {
        for (int l = 0; l < m->cfg.n_layers; l++)
            if (m->layers[l].is_moe && !m->layers[l].pexperts) return true;
        return false;
    }
    return !mq_lazy_packed(S->lz[k]);
}

typedef struct {
    int64_t fixed, resident, layer, head, window, score, boundary[MAX_MODELS], disk_window;
} plan_sizes;

static int64_t plan_peak(const stream *S, const plan_sizes *z, const bool ram[MAX_MODELS], int workers) {
    int64_t b = 0, disk = 0;
    for (int k = 0; k < S->nm; k++) {
        if (ram[k]) b += z->boundary[k];
        else disk = z->disk_window;
    }
    const int64_t layers = z->layer + (int64_t)workers * (z->window + disk);
    const int64_t scoring = z->head + (int64_t)workers * (z->score + disk * S->nm);
    return z->fixed + z->resident + b + (layers > scoring ? layers : scoring);
}

static moeq_status make_plan(stream *S, const moeq_eval_options *o, moeq_eval_result *res,
                             bool streamed, bool ram[MAX_MODELS]) {
    mq_eval_ctx *c = S->c;
    plan_sizes z = {0};
    const int64_t L = c->L;
    for (int k = 0; k < S->nm; k++) {
        const moeq_model *m = S->m[k];
        z.window += mq_state_bytes(m, c->L, experts_fp32(S, k));
        z.boundary[k] = S->rows * S->D[k] * 4;
        if (!S->lz[k]) {
            z.resident += m->info.weight_bytes;
            continue;
        }
        for (int l = 0; l < m->cfg.n_layers; l++) {
            int64_t lb = mq_lazy_layer_bytes(S->lz[k], l);
            z.layer = lb > z.layer ? lb : z.layer;
        }
        z.head += mq_lazy_head_bytes(S->lz[k]);
    }
    /* the window's ids, and what a thread's products keep of their own (OpenBLAS's buffers, the
     * packed kernels' quantized activations): 32 MiB covers both at full size */
    z.window += L * 4 + ((int64_t)32 << 20);
    z.disk_window = L * S->Dmax * 4;
    z.score = CHUNK * c->V * 4 * S->nm + c->V * 5 +
              (c->save_k ? L * (int64_t)mq_logits_record_size(c->save_k) : 0);
    /* per token: ids, KL, top-1, base log-likelihood, entropy, bounds (eval_run.h), per window its
     * record; and the process's own (the tokenizer, the documents, the allocator's and the
     * runtime's): 256 MiB covers it for every fixture and full-size vocabulary measured */
    z.fixed = c->tokens_total * 45 + c->n_win * 64 + ((int64_t)256 << 20);
    /* a GPU: the next layer read while the device runs this one, a group's rows staged */
    if (o->device >= 0) z.fixed += z.layer + (int64_t)16384 * S->Dmax * 4;
    const int64_t budget = o->max_memory > 0 ? o->max_memory : moeq_default_memory_budget();
    const int pool = mq_pool_size();
    /* a model loaded whole keeps its boundary in memory */
    bool choice[MAX_MODELS] = {true, true};
    int workers = pool;
    if (streamed) {
        /* memory for both boundaries, else the model's, else the base's, else neither; each with
         * every thread, else the most threads that fit with both boundaries in files */
        static const bool options[4][MAX_MODELS] = {{true, true}, {true, false}, {false, true}, {false, false}};
        bool found = false;
        for (int i = 0; i < 4 && !found; i++) {
            bool r[MAX_MODELS];
            for (int k = 0; k < MAX_MODELS; k++) r[k] = !S->lz[k] || options[i][k];
            if (plan_peak(S, &z, r, pool) <= budget) {
                memcpy(choice, r, sizeof r);
                found = true;
            }
        }
        if (!found) {
            for (int k = 0; k < MAX_MODELS; k++) choice[k] = !S->lz[k];
            for (workers = pool; workers > 1 && plan_peak(S, &z, choice, workers) > budget; workers--) {
            }
        }
        if (plan_peak(S, &z, choice, workers) > budget)
            return mq_err(MOEQ_E_NOMEM,
                          "--max-memory %lld MiB is too small for a streamed eval: one layer needs "
                          "%lld MiB (the largest layer's weights %lld MiB, one window of %lld "
                          "tokens in flight %lld MiB, its boundary rows in files; %lld MiB besides: "
                          "models loaded whole %lld MiB, the token records %lld MiB); scoring "
                          "needs the output layers, %lld MiB",
                          (long long)mib(budget), (long long)mib(plan_peak(S, &z, choice, 1)),
                          (long long)mib(z.layer), (long long)L,
                          (long long)mib(z.window + z.disk_window), (long long)mib(z.fixed + z.resident),
                          (long long)mib(z.resident), (long long)mib(z.fixed), (long long)mib(z.head));
        if (workers < pool)
            mq_warn("eval: --max-memory %lld MiB holds %d windows in flight, not one per thread "
                    "(%d); results do not change", (long long)mib(budget), workers, pool);
    }
    if (ram) {
        ram[0] = choice[0];
        ram[1] = choice[1];
    }
    S->n_workers = workers;
    /* on the CPU, the next step's weights read ahead (a thread of the lowest priority) where a
     * second layer fits beside the plan: a cold page cache then overlaps the forward; a GPU plan
     * counts its own read-ahead layer above */
    S->read_ahead = streamed && (o->device >= 0 || plan_peak(S, &z, choice, workers) + z.layer <= budget);
    if (S->read_ahead && o->device < 0) z.fixed += z.layer;
    double flops = 0;
    for (int k = 0; k < S->nm; k++) {
        const mq_config *cfg = &S->m[k]->cfg;
        for (int64_t w = c->w_lo; w < c->w_hi; w++) {
            const mq_window *win = &c->win[w];
            flops += mq_config_forward_flops(cfg, win->n_input, 0) -
                     2.0 * (double)cfg->vocab * (double)cfg->D * (double)(win->n_input - win->n_score);
        }
    }
    res->plan.streamed = streamed;
    res->plan.threads = workers;
    res->plan.budget = budget;
    res->plan.peak_bytes = plan_peak(S, &z, choice, workers);
    res->plan.resident_bytes = z.resident;
    res->plan.layer_bytes = z.layer;
    res->plan.read_ahead_bytes = S->read_ahead ? z.layer : 0;
    res->plan.head_bytes = z.head;
    res->plan.window_bytes = z.window;
    res->plan.score_bytes = z.score;
    res->plan.boundary_bytes = z.boundary[0];
    res->plan.disk_bytes = 0;
    for (int k = 0; k < S->nm; k++) {
        res->plan.boundary_in_memory[k] = streamed && choice[k];
        /* two files, or a snapshot of the memory */
        if (streamed) res->plan.disk_bytes += (choice[k] ? 1 : 2) * z.boundary[k];
    }
    res->plan.windows = c->w_hi - c->w_lo;
    res->plan.rows = S->rows;
    res->plan.flops = flops;
    res->plan.core_gflops = mq_measure_core_gflops(0.25);
    res->plan.eta_seconds = res->plan.core_gflops > 0 ? flops / (res->plan.core_gflops * 1e9) : 0;
    return MOEQ_OK;
}

/* ---- work directory, identity and resume --------------------------------------------------- */
static uint64_t fnv_str(uint64_t h, const char *s) { return mq_fnv1a(h, s, strlen(s) + 1); }

/* What the boundaries depend on: each model (its directory's config and the sizes and times of
 * its files), how it runs (packed, activation quantizer), and the windows' token ids. */
static moeq_status run_identity(stream *S) {
    mq_eval_ctx *c = S->c;
    uint64_t h = MQ_FNV_INIT;
    char buf[512];
    for (int k = 0; k < S->nm; k++) {
        const moeq_model *m = S->m[k];
        char *real = realpath(m->dir, NULL);
        h = fnv_str(h, real ? real : m->dir);
        free(real);
        char *cfg_path = mq_path_join(m->dir, "config.json");
        char *text = NULL;
        size_t len = 0;
        if (cfg_path && mq_read_file(cfg_path, &text, &len) == MOEQ_OK) h = mq_fnv1a(h, text, len);
        free(text);
        free(cfg_path);
        /* every file of the directory (or the one .gguf file) by name, size and time, in any
         * order (a sum of hashes) */
        uint64_t files = 0;
        struct stat self;
        if (stat(m->dir, &self) == 0 && S_ISREG(self.st_mode)) {
            snprintf(buf, sizeof buf, "%s:%lld:%lld.%09ld", m->dir, (long long)self.st_size,
                     (long long)self.st_mtim.tv_sec, self.st_mtim.tv_nsec);
            files += fnv_str(MQ_FNV_INIT, buf);
        }
        DIR *dir = opendir(m->dir);
        for (struct dirent *e; dir && (e = readdir(dir));) {
            struct stat sb;
            char *fp = mq_path_join(m->dir, e->d_name);
            if (fp && stat(fp, &sb) == 0 && S_ISREG(sb.st_mode)) {
                snprintf(buf, sizeof buf, "%s:%lld:%lld.%09ld", e->d_name, (long long)sb.st_size,
                         (long long)sb.st_mtim.tv_sec, sb.st_mtim.tv_nsec);
                files += fnv_str(MQ_FNV_INIT, buf);
            }
            free(fp);
        }
        if (dir) closedir(dir);
        snprintf(buf, sizeof buf, "files=%016llx streamed=%d packed=%d act=%d",
                 (unsigned long long)files, S->lz[k] != NULL, S->lz[k] && mq_lazy_packed(S->lz[k]),
                 m->act_quant);
        h = fnv_str(h, buf);
    }
    snprintf(buf, sizeof buf, "L=%d prefix=%d bos=%d windows=%lld [%lld, %lld) ids=%016llx", c->L,
             c->prefix, c->add_bos, (long long)c->n_win, (long long)c->w_lo, (long long)c->w_hi,
             (unsigned long long)c->ids_checksum);
    h = fnv_str(h, buf);
    if (S->gpu_precision >= 0) {   /* a GPU's boundaries differ from the CPU's in the last bits */
        snprintf(buf, sizeof buf, "gpu precision=%d", S->gpu_precision);
        h = fnv_str(h, buf);
    }
    snprintf(S->identity, sizeof S->identity, "%016llx", (unsigned long long)h);
    return MOEQ_OK;
}

/* Names the work directory; it is made when first needed (work_dir_make). */
static moeq_status work_dir_name(stream *S, const moeq_eval_options *o) {
    if (o->work_dir) {
        S->dir = mq_strdup(o->work_dir);
    } else {
        const char *tmp = getenv("TMPDIR");
        S->dir = mq_asprintf("%s/moeq-eval-%s", tmp && *tmp ? tmp : "/tmp", S->identity);
    }
    S->dir_made = !o->work_dir;   /* the default directory is the run's own */
    return S->dir ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
}

static moeq_status work_dir_make(stream *S) {
    if (S->lock_fd >= 0) return MOEQ_OK;
    if (!mq_dir_exists(S->dir)) {
        if (mkdir(S->dir, 0755) != 0)
            return mq_err(MOEQ_E_IO, "eval work directory %s: cannot create: %s", S->dir, strerror(errno));
        S->dir_made = true;
    }
    char *lock = mq_path_join(S->dir, "lock");
    if (!lock) return mq_err(MOEQ_E_NOMEM, "out of memory");
    S->lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    free(lock);
    if (S->lock_fd < 0 || flock(S->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        if (S->lock_fd >= 0) close(S->lock_fd);
        S->lock_fd = -1;   /* not ours: nothing of it is removed */
        return mq_err(MOEQ_E_EXISTS, "eval work directory %s is in use by another run", S->dir);
    }
    return MOEQ_OK;
}

/* The record of the layers whose boundaries are durable: which file of each model holds them. */
static moeq_status record_write(stream *S, int layers_done, const char *const files[MAX_MODELS]) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "identity", S->identity);
    cJSON_AddNumberToObject(j, "layers_done", layers_done);
    cJSON_AddNumberToObject(j, "rows", (double)S->rows);
    cJSON *a = cJSON_AddArrayToObject(j, "boundaries");
    for (int k = 0; k < S->nm; k++) cJSON_AddItemToArray(a, cJSON_CreateString(files[k]));
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    char *path = mq_path_join(S->dir, RECORD);
    moeq_status s = text && path ? mq_write_file_atomic(path, text, strlen(text))
                                 : mq_err(MOEQ_E_NOMEM, "out of memory");
    free(text);
    free(path);
    if (!s) S->durable_layers = layers_done;
    return s;
}

/* A memory boundary's snapshot, written under a temporary name in pieces of 64 MB with a poll
 * between them: all of wikitext-2's rows are gigabytes (minutes on a slow disk), and Ctrl-C must
 * not wait for them. Interrupted, the file is dropped and the record before it stays. */
static moeq_status snapshot_write(const char *path, const float *f, size_t bytes) {
    enum { PIECE = 64 << 20 };
    mq_atomic_file af;
    moeq_status s = mq_atomic_open(&af, path);
    if (s) return s;
    for (size_t off = 0; off < bytes && !s; off += PIECE) {
        if (moeq_interrupted()) s = mq_err(MOEQ_E_INTERRUPTED, "%s: interrupted while written", path);
        else s = mq_atomic_write(&af, (const char *)f + off, bytes - off < PIECE ? bytes - off : PIECE);
    }
    if (s) {
        mq_atomic_abort(&af);
        return s;
    }
    return mq_atomic_commit(&af);
}

static const char *base_name(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* After layer l of every model: the boundary files synced (or the memory snapshot written when
 * enough work is at stake), then the record. */
static moeq_status layer_durable(stream *S, int layers_done, double layer_seconds) {
    S->since_durable += layer_seconds;
    bool any_file = false, any_ram = false;
    for (int k = 0; k < S->nm; k++) {
        if (!S->lz[k]) continue;
        any_file |= !S->B[k].ram;
        any_ram |= S->B[k].ram;
    }
    if (!any_file && !(any_ram && S->since_durable >= g_snapshot_seconds)) return MOEQ_OK;
    const char *files[MAX_MODELS] = {"", ""};
    char snap[MAX_MODELS][64];
    moeq_status sd = work_dir_make(S);
    if (sd) return sd;
    for (int k = 0; k < S->nm; k++) {
        boundary *b = &S->B[k];
        if (!b->ram) {   /* the engine swapped the pair: buf[0] holds the finished layer's rows */
            moeq_status s = mq_actbuf_sync(&b->buf[0]);
            if (s) return s;
            files[k] = base_name(b->buf[0].path);
            continue;
        }
        snprintf(snap[k], sizeof snap[k], "snapshot-%d.f32", k);
        char *p = mq_path_join(S->dir, snap[k]);
        if (!p) return mq_err(MOEQ_E_NOMEM, "out of memory");
        moeq_status s = snapshot_write(p, b->buf[0].f, (size_t)S->rows * (size_t)S->D[k] * sizeof(float));
        free(p);
        if (s) return s;
        files[k] = snap[k];
    }
    S->since_durable = 0;
    return record_write(S, layers_done, files);
}

/* With resume: the layers a record in the work directory says are done, checked against this run
 * before anything of the directory is touched; files[k] the file that holds model k's boundary
 * (free()). 0 layers when there is no record. */
static moeq_status resume_check(stream *S, int *layers_done, char *files[MAX_MODELS]) {
    *layers_done = 0;
    char *path = mq_path_join(S->dir, RECORD), *text = NULL;
    size_t len = 0;
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!mq_dir_exists(S->dir) || !mq_file_exists(path)) {
        mq_info("eval: nothing to resume in %s; starting afresh", S->dir);
        free(path);
        return MOEQ_OK;
    }
    moeq_status s = mq_read_file(path, &text, &len);
    cJSON *j = s ? NULL : cJSON_ParseWithLength(text, len);
    free(text);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "identity");
    const cJSON *ld = cJSON_GetObjectItemCaseSensitive(j, "layers_done");
    const cJSON *rw = cJSON_GetObjectItemCaseSensitive(j, "rows");
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(j, "boundaries");
    if (!s && (!cJSON_IsString(id) || !cJSON_IsNumber(ld) || !cJSON_IsNumber(rw) ||
               !cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != S->nm))
        s = mq_err(MOEQ_E_FORMAT, "%s: not a record of a streamed eval", path);
    if (!s && strcmp(id->valuestring, S->identity) != 0)
        s = mq_err(MOEQ_E_ARG, "%s: the work directory holds an eval of other models, data or "
                   "options (identity %s, this run %s): give another --work-dir or drop --resume",
                   path, id->valuestring, S->identity);
    const int n_layers = S->m[0]->cfg.n_layers;
    /* numbers from a file are range-checked before any cast */
    if (!s && (!(ld->valuedouble >= 1 && ld->valuedouble <= n_layers) ||
               ld->valuedouble != (double)ld->valueint || rw->valuedouble != (double)S->rows))
        s = mq_err(MOEQ_E_FORMAT, "%s: layers_done %g or rows %g out of range", path,
                   ld->valuedouble, rw->valuedouble);
    for (int k = 0; k < S->nm && !s; k++) {
        const cJSON *f = cJSON_GetArrayItem(bs, k);
        if (!cJSON_IsString(f) || strchr(f->valuestring, '/') || !*f->valuestring) {
            s = mq_err(MOEQ_E_FORMAT, "%s: boundary %d: not a file name", path, k);
            break;
        }
        char *fp = mq_path_join(S->dir, f->valuestring);
        const size_t bytes = (size_t)S->rows * (size_t)S->D[k] * sizeof(float);
        struct stat sb;
        if (!fp) s = mq_err(MOEQ_E_NOMEM, "out of memory");
        else if (stat(fp, &sb) != 0 || (size_t)sb.st_size != bytes)
            s = mq_err(MOEQ_E_FORMAT, "%s: missing or not %zu bytes (the record %s names it)", fp,
                       bytes, path);
        files[k] = fp;
    }
    if (!s) *layers_done = ld->valueint;
    cJSON_Delete(j);
    free(path);
    return s;
}

/* The boundaries the record names, into this run's storage. */
static moeq_status resume_apply(stream *S, char *files[MAX_MODELS]) {
    moeq_status s = MOEQ_OK;
    for (int k = 0; k < S->nm && !s; k++) {
        const char *fp = files[k];
        const size_t bytes = (size_t)S->rows * (size_t)S->D[k] * sizeof(float);
        boundary *b = &S->B[k];
        if (b->ram) {
            int fd = open(fp, O_RDONLY | O_CLOEXEC);
            s = fd < 0 ? mq_err(MOEQ_E_IO, "%s: cannot open: %s", fp, strerror(errno))
                       : mq_pread_all(fd, b->buf[0].f, bytes, 0, fp);
            if (fd >= 0) close(fd);
        } else if (strcmp(fp, b->buf[1].path) == 0) {   /* the named file becomes the current one */
            mq_actbuf_swap(&b->buf[0], &b->buf[1]);
        } else if (strcmp(fp, b->buf[0].path) != 0) {   /* a snapshot takes the current file's place */
            char *path = mq_strdup(b->buf[0].path);
            mq_actbuf_free(&b->buf[0]);
            if (!path) s = mq_err(MOEQ_E_NOMEM, "out of memory");
            else if (rename(fp, path) != 0) s = mq_err(MOEQ_E_IO, "%s: cannot rename: %s", fp, strerror(errno));
            else s = mq_actbuf_open_kept(&b->buf[0], bytes / sizeof(float), path, "eval boundary activations");
            free(path);
        }
    }
    return s;
}

static void stream_free(stream *S, bool remove_dir) {
    for (int k = 0; k < MAX_MODELS; k++)
        if (S->pinned[k]) mq_eval_gpu_unpin(S->B[k].buf[0].f);
    mq_free(S->stage);
    mq_eval_gpu_close(S->gpu);
    for (int i = 0; S->W && i < S->n_workers; i++) {
        for (int k = 0; k < MAX_MODELS; k++) mq_state_free(S->W[i].st[k]);
        mq_free(S->W[i].x);
        mq_free(S->W[i].ids);
    }
    free(S->W);
    for (int k = 0; k < MAX_MODELS; k++) boundary_free(&S->B[k]);
    free(S->row0);
    if (S->dir && remove_dir && S->lock_fd >= 0 && S->touched) {
        if (S->dir_made) mq_remove_tree(S->dir);
        else {   /* a directory the user named: only what this run put there */
            static const char *const ours[] = {RECORD, "lock", "boundary-0-a.f32", "boundary-0-b.f32",
                                               "boundary-1-a.f32", "boundary-1-b.f32",
                                               "snapshot-0.f32", "snapshot-1.f32"};
            for (size_t i = 0; i < sizeof ours / sizeof ours[0]; i++) {
                char *p = mq_path_join(S->dir, ours[i]);
                if (p) unlink(p);
                free(p);
            }
        }
    }
    if (S->lock_fd >= 0) close(S->lock_fd);
    free(S->dir);
}

static moeq_status stream_setup(stream *S, mq_eval_ctx *c) {
    memset(S, 0, sizeof *S);
    S->c = c;
    S->lock_fd = -1;
    S->gpu_precision = -1;
    for (int k = 0; k < MAX_MODELS; k++) S->B[k].buf[0].fd = S->B[k].buf[1].fd = -1;
    S->m[0] = c->m;
    S->nm = 1;
    if (c->base) S->m[S->nm++] = c->base;
    for (int k = 0; k < S->nm; k++) {
        S->lz[k] = mq_model_lazy(S->m[k]);
        S->D[k] = S->m[k]->cfg.D;
        S->Dmax = S->D[k] > S->Dmax ? S->D[k] : S->Dmax;
    }
    const int64_t nw = c->w_hi - c->w_lo;
    S->row0 = calloc((size_t)nw + 1, sizeof *S->row0);
    if (!S->row0) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int64_t w = 0; w < nw; w++) S->row0[w + 1] = S->row0[w] + c->win[c->w_lo + w].n_input;
    S->rows = S->row0[nw];
    return MOEQ_OK;
}

moeq_status mq_eval_stream_plan_only(mq_eval_ctx *c, const moeq_eval_options *o, moeq_eval_result *res) {
    stream S;
    moeq_status s = stream_setup(&S, c);
    const bool streamed = mq_model_lazy(c->m) || (c->base && mq_model_lazy(c->base));
    if (!s) s = make_plan(&S, o, res, streamed, NULL);
    stream_free(&S, false);
    return s;
}

/* Loads (or frees) model k's final norm and lm_head for scoring (a tied one: the embeddings). */
static moeq_status head_load(stream *S, int k, bool load) {
    mq_lazy_model *lz = S->lz[k];
    if (!lz) return MOEQ_OK;
    moeq_model *m = mq_lazy_model_of(lz);
    const unsigned what = MQ_PART_HEAD | (m->cfg.tie_embeddings ? MQ_PART_EMBED : 0);
    if (!load) {
        mq_lazy_release(lz, -1, what, 0, 0);
        return MOEQ_OK;
    }
    moeq_status s = mq_lazy_load(lz, -1, what, 0, 0);
    if (!s && m->cfg.tie_embeddings) m->lm_head = m->embed;
    return s;
}

/* ---- the GPU's passes (eval_gpu.h) --------------------------------------------------------- */
/* Every window through layer l of model k on the device, in groups of whole windows whose rows
 * are consecutive in the boundary. */
static moeq_status gpu_layer_pass(void *user, int k, int l) {
    stream *S = user;
    mq_eval_ctx *c = S->c;
    const int64_t cap = mq_eval_gpu_group_rows(S->gpu);
    moeq_status s = MOEQ_OK;
    const int64_t lo = c->w_lo;   /* row0 holds this rank's windows [w_lo, w_hi) */
    for (int64_t w0 = lo, w1; w0 < c->w_hi && !s; w0 = w1) {
        if (moeq_interrupted()) return MOEQ_E_INTERRUPTED;
        for (w1 = w0 + 1; w1 < c->w_hi && S->row0[w1 + 1 - lo] - S->row0[w0 - lo] <= cap; w1++) {
        }
        const int64_t r0 = S->row0[w0 - lo], n = S->row0[w1 - lo] - r0;
        if (S->resident) {
            s = mq_eval_gpu_layer_run_at(S->gpu, w0, w1, NULL, r0);
        } else {
            float *x = boundary_get(S, k, r0, n, S->stage);
            s = mq_eval_gpu_layer_run(S->gpu, w0, w1, x);
            if (!s) boundary_put(S, k, r0, n, x);
        }
        if (s)
            return mq_err_prefix(s, "%s, layer %d, documents %lld..%lld", k ? "KL base" : "model", l,
                                 (long long)c->win_doc[w0] + 1, (long long)c->win_doc[w1 - 1] + 1);
        mq_engine_progress_add(&S->progress, n);
    }
    return s;
}

/* The engine's callbacks: the parts of a layer it loads (on the GPU: the experts' codes are the
 * device's), what the device does around the rows, and after layer l of every model. */
static unsigned layer_parts(void *user, int k, int l) {
    stream *S = user;
    return S->gpu ? mq_eval_gpu_layer_parts(S->gpu, k, l) : MQ_PART_LAYER;
}

static moeq_status gpu_layer_begin(void *user, int k, int l) {
    stream *S = user;
    return mq_eval_gpu_layer_begin(S->gpu, k, l);
}

static void gpu_layer_end(void *user, int k, int l) {
    (void)k, (void)l;
    stream *S = user;
    mq_eval_gpu_layer_end(S->gpu);
}

static void cpu_layer_end(void *user, int k, int l) {
    stream *S = user;
    for (int i = 0; i < S->n_workers; i++)
        if (S->W[i].st[k]) mq_state_drop_layer(S->W[i].st[k], l);
}

static moeq_status layer_done(void *user, int l, double dt) {
    stream *S = user;
    S->t_forward += dt;
    S->layers_done = l + 1;
    moeq_status s = MOEQ_OK;
    /* a snapshot of the boundary is due: the device's rows come back first */
    if (S->resident && S->since_durable + dt >= g_snapshot_seconds)
        for (int k = 0; k < S->nm && !s; k++) s = mq_eval_gpu_resident_read(S->gpu, k, S->B[k].buf[0].f);
    return s ? s : layer_durable(S, l + 1, dt);
}

/* Layers [first, max_layers) of every model through the engine: in lockstep (the base's layer l,
 * then the model's; a kl_base may have a different depth: each model runs the layers it has),
 * every window through a layer on the CPU's workers, or the device's groups of windows with the
 * next layer read ahead while the device runs this one. */
static moeq_status run_layers(stream *S, int first, int max_layers) {
    mq_engine_client e = {
        .user = S, .n_streams = S->nm, .first = first, .end = max_layers, .parts = layer_parts,
        .layer_done = layer_done, .n_items = S->c->w_hi - S->c->w_lo, .workers = S->n_workers,
        .interrupt_msg = "eval interrupted"};   /* before a layer's load, too */
    for (int k = 0; k < S->nm; k++) {
        e.n_layers[k] = S->m[k]->cfg.n_layers;
        e.lz[k] = S->lz[k];
        e.cur[k] = &S->B[k].buf[0];
        e.next[k] = &S->B[k].buf[1];
    }
    if (S->gpu) {
        e.release_after_begin = true;   /* on the device now */
        e.read_ahead = true;
        e.begin_layer = gpu_layer_begin;
        e.run_layer = gpu_layer_pass;
        e.end_layer = gpu_layer_end;
    } else {
        e.read_ahead = S->read_ahead;
        e.run_item = layer_item;
        e.end_layer = cpu_layer_end;
    }
    return mq_engine_run(&e);
}

/* Every window's scores on the device, windows in order. */
static moeq_status gpu_score_pass(stream *S) {
    mq_eval_ctx *c = S->c;
    moeq_status s = mq_eval_gpu_head_begin(S->gpu);
    for (int64_t wi = c->w_lo; wi < c->w_hi && !s; wi++) {
        if (moeq_interrupted()) return MOEQ_E_INTERRUPTED;
        const mq_window *win = &c->win[wi];
        const int64_t r0 = S->row0[wi - c->w_lo], n = win->n_input, ns = win->n_score;
        float *x[MAX_MODELS] = {NULL, NULL};
        for (int k = 0; k < S->nm; k++)
            x[k] = boundary_get(S, k, r0 + n - ns, ns, S->W[0].x + (size_t)k * (size_t)c->L * (size_t)S->Dmax);
        if (!s) s = mq_eval_gpu_score_window(S->gpu, wi, x[0], S->nm > 1 ? x[1] : NULL);
        if (!s) {
            c->win_done[wi] = 1;
            atomic_fetch_add(&c->tokens_done, ns);
        }
        mq_engine_progress_add(&S->progress, ns);
    }
    return s;
}

moeq_status mq_eval_stream(mq_eval_ctx *c, const moeq_eval_options *o, moeq_eval_result *res) {
    stream S;
    bool ram[MAX_MODELS] = {true, true};
    moeq_status s = stream_setup(&S, c);
    /* with a GPU, models loaded whole run there too: a stream only where a model is one */
    const bool lazy = S.lz[0] || (S.nm > 1 && S.lz[1]);
    if (!s) s = make_plan(&S, o, res, o->device < 0 || lazy, ram);
    if (!s && o->device >= 0) {
        S.gpu_precision = o->gpu_precision;
        s = mq_eval_gpu_open(c, o, S.nm, S.m, &S.gpu);
        if (!s) mq_eval_gpu_describe(S.gpu, res->device, sizeof res->device);
    }
    if (!s) s = run_identity(&S);
    /* the work directory, made for boundary files, a resume, or the snapshots of long runs */
    if (!s) s = work_dir_name(&S, o);
    int first = 0;
    char *resume_files[MAX_MODELS] = {NULL, NULL};
    if (!s && o->resume && mq_dir_exists(S.dir)) s = work_dir_make(&S);
    if (!s && o->resume) s = resume_check(&S, &first, resume_files);
    S.touched = !s;   /* from here on the directory's files are this run's */
    for (int k = 0; k < S.nm && !s; k++) s = boundary_init(&S, k, !S.lz[k] || ram[k]);
    S.W = s ? NULL : calloc((size_t)S.n_workers, sizeof *S.W);
    if (!s && !S.W) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int i = 0; i < S.n_workers && !s; i++) {
        worker *w = &S.W[i];
        w->ids = mq_alloc_array((size_t)c->L, sizeof(int32_t), "eval window ids");
        w->x = mq_alloc_array((size_t)c->L * (size_t)S.Dmax * (size_t)S.nm, sizeof(float),
                              "eval window rows");
        if (!w->ids || !w->x) s = MOEQ_E_NOMEM;
    }
    if (!s && S.gpu) {   /* the group's rows go up from, and back into, the boundary or the stage */
        for (int k = 0; k < S.nm; k++)
            if (S.B[k].ram)
                S.pinned[k] = mq_eval_gpu_pin(S.gpu, S.B[k].buf[0].f, (size_t)S.rows * (size_t)S.D[k] * sizeof(float));
        const size_t n = (size_t)mq_eval_gpu_group_rows(S.gpu) * (size_t)S.Dmax;
        if (!(S.stage = mq_alloc_array(n, sizeof(float), "eval GPU group rows"))) s = MOEQ_E_NOMEM;
    }
    if (!s && first > 0) s = resume_apply(&S, resume_files);
    for (int k = 0; k < MAX_MODELS; k++) free(resume_files[k]);
    res->plan.layers_resumed = first;
    int64_t layer_rows = 0;
    for (int k = 0; k < S.nm; k++) layer_rows += S.rows * (S.m[k]->cfg.n_layers - first);
    int64_t rows_total = layer_rows;
    for (int64_t w = c->w_lo; w < c->w_hi; w++) rows_total += c->win[w].n_score;
    double flops_done = 0;
    mq_mem_watch_start();
    mq_engine_progress_init(&S.progress, "eval", rows_total);
    mq_progress("eval", 0, rows_total);
    if (!s && first == 0) s = mq_engine_items(c->w_hi - c->w_lo, S.n_workers, embed_item, &S);
    int max_layers = 0;
    for (int k = 0; k < S.nm; k++)
        max_layers = S.m[k]->cfg.n_layers > max_layers ? S.m[k]->cfg.n_layers : max_layers;
    if (!s && S.gpu) {
        /* every model's boundary in memory: kept on the device where it fits, so that the rows
         * go up once and come back once instead of crossing the bus at every layer */
        bool all_ram = true;
        const float *host[MAX_MODELS] = {NULL, NULL};
        int64_t Dk[MAX_MODELS] = {0, 0};
        for (int k = 0; k < S.nm; k++) {
            all_ram &= S.B[k].ram;
            host[k] = S.B[k].buf[0].f;
            Dk[k] = S.D[k];
        }
        S.resident = all_ram && mq_eval_gpu_resident_begin(S.gpu, S.rows, host, Dk);
    }
    if (!s) s = run_layers(&S, first, max_layers);
    for (int k = 0; k < S.nm && !s && S.resident; k++) s = mq_eval_gpu_resident_read(S.gpu, k, S.B[k].buf[0].f);
    for (int k = 0; k < S.nm; k++) {
        const mq_config *cfg = &S.m[k]->cfg;
        for (int64_t w = c->w_lo; w < c->w_hi; w++)
            flops_done += (mq_config_forward_flops(cfg, c->win[w].n_input, 0) -
                           2.0 * (double)cfg->vocab * (double)cfg->D * (double)c->win[w].n_input) *
                          (double)(cfg->n_layers - first) / (double)cfg->n_layers;
    }
    /* scoring: both output layers resident, each window's scored rows normed and scored */
    for (int i = 0; i < S.n_workers && !s; i++)
        for (int k = 0; k < MAX_MODELS; k++) {
            mq_state_free(S.W[i].st[k]);
            S.W[i].st[k] = NULL;
        }
    for (int k = 0; k < S.nm && !s; k++) s = head_load(&S, k, true);
    if (!s && S.gpu) {
        s = gpu_score_pass(&S);
    } else if (!s) {
        s = mq_engine_items(c->w_hi - c->w_lo, S.n_workers, score_item, &S);
    }
    for (int k = 0; k < S.nm; k++) head_load(&S, k, false);
    mq_progress("eval", atomic_load(&S.progress.done), S.progress.total);
    res->plan.peak_anon_bytes = mq_mem_watch_peak();
    mq_mem_watch_stop();
    res->plan.forward_gflops = S.t_forward > 0 ? flops_done / S.t_forward * 1e-9 : 0;
    /* keep the work directory where a later --resume has something to continue */
    const bool keep = s && S.durable_layers > 0;
    if (keep)
        mq_warn("eval: %s after %d of %d layers; %s keeps the finished layers: the same command "
                "with --resume continues from there", s == MOEQ_E_INTERRUPTED ? "interrupted" : "failed",
                S.durable_layers, max_layers, S.dir);
    stream_free(&S, !keep);
    if (s == MOEQ_E_INTERRUPTED) return MOEQ_E_INTERRUPTED;
    return s;
}
