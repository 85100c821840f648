/*
 * The lazy model (model.h, "lazy loading"): the structure of moeq_model_open with the weights
 * left in the mapped files until a layer's parts are asked for (split from load.c).
 */
#define _GNU_SOURCE   /* SCHED_IDLE (the read-ahead thread) */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>
#include "ckpt/layout.h"
#include "io/fp8.h"
#include "io/gguf_hf.h"
#include "io/tokenizer.h"
#include "kernels/ggml_mat.h"
#include "kernels/moe_ffn.h"
#include "model/load_internal.h"
#include "model/model_internal.h"
#include "model/rotate.h"

/* ---- the lazy model (streaming) --------------------------------------------------------------- */
/* The structure of moeq_model_open (config, every tensor checked, Linear names and shapes) with
 * no weight loaded: parts of a layer are converted to fp32 when asked for and freed again, and
 * embeddings are read row by row from the mapping. */
struct mq_lazy_model {
    moeq_model *m;
    mq_st *st;
    want_list L;
    const mq_tensor_view *embed;
    const mq_rotation *rot;   /* borrowed; NULL: none */
    int64_t piece;            /* values a conversion task (mq_lazy_set_piece); 0: LAZY_PIECE */
    bool pack;                /* whole layers' quantized Linears packed (mq_lazy_set_packed) */
    bool *packed_layer;       /* [n_layers]: packed weights are loaded */
    int n_fallback;           /* quantized Linears the kernels refused (they run in fp32) */
};

void mq_lazy_close(mq_lazy_model *lz) {
    if (!lz) return;
    if (lz->m) {
        for (size_t i = 0; i < lz->L.n; i++)
            if (lz->L.w[i].dest) {
                mq_free(*lz->L.w[i].dest);
                *lz->L.w[i].dest = NULL;
            }
        lz->m->lm_head = NULL;
    }
    mq_want_free(&lz->L);
    mq_st_close(lz->st);
    if (lz->m) lz->m->lazy = NULL;
    moeq_model_free(lz->m);   /* packed weights still loaded go with their Linears */
    free(lz->packed_layer);
    free(lz);
}

moeq_status mq_lazy_open(const char *dir, bool tokenizer, mq_lazy_model **out) {
    return mq_lazy_open_config(dir, NULL, tokenizer, out);
}

moeq_status mq_lazy_open_config(const char *dir, mq_config *cfg, bool tokenizer, mq_lazy_model **out) {
    *out = NULL;
    mq_lazy_model *lz = calloc(1, sizeof *lz);
    moeq_model *m = calloc(1, sizeof *m);
    if (!lz || !m) {
        free(lz);
        free(m);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    lz->m = m;
    mq_gguf_docs docs;
    moeq_status s = mq_open_source(dir, tokenizer, cfg, &m->cfg, &lz->st, &docs);
    m->gguf_types = docs.types;
    docs.types = NULL;
    if (!s) {
        m->dir = mq_strdup(dir);
        m->layers = calloc((size_t)m->cfg.n_layers, sizeof(mq_layer));
        if (!m->dir || !m->layers) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    if (!s && !(lz->packed_layer = calloc((size_t)m->cfg.n_layers + 1, sizeof(bool))))
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) s = mq_build_wants(&lz->L, lz->st, m);
    if (!s) s = mq_check_wants(&lz->L, lz->st, m, dir);
    if (!s) {
        lz->embed = mq_st_find(lz->st, "model.embed_tokens.weight");
        for (size_t i = 0; i < lz->L.n; i++)
            if (lz->L.w[i].quantized && lz->L.w[i].what == MQ_PART_EMBED &&
                lz->L.w[i].dest == &m->embed)
                s = mq_err(MOEQ_E_UNSUPPORTED, "%s: quantized embeddings", dir);
    }
    if (!s && tokenizer) s = mq_open_tokenizer(dir, &docs, &m->tok);
    mq_gguf_docs_free(&docs);
    if (s) {
        mq_lazy_close(lz);
        return s;
    }
    mq_fill_info(m);
    /* the pipeline groups an expert's rows across samples: its products must not depend on it */
    mq_model_det_experts(m, true);
    *out = lz;
    return MOEQ_OK;
}

void mq_model_det_experts(moeq_model *m, bool on) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        for (int e = 0; ly->is_moe && e < m->cfg.n_experts; e++)
            ly->exp_gate[e].det = ly->exp_up[e].det = ly->exp_down[e].det = on;
    }
}

moeq_model *mq_lazy_model_of(mq_lazy_model *lz) { return lz->m; }
void mq_lazy_set_rotation(mq_lazy_model *lz, const mq_rotation *r) { lz->rot = r; }
void mq_lazy_set_piece(mq_lazy_model *lz, int64_t values) { lz->piece = values > 0 ? values : 0; }
void mq_lazy_set_packed(mq_lazy_model *lz, bool on) { lz->pack = on; }
bool mq_lazy_packed(const mq_lazy_model *lz) { return lz->pack && lz->m->cfg.quant_method; }
mq_lazy_model *mq_model_lazy(const moeq_model *m) { return m ? m->lazy : NULL; }

/* Whether a load of (layer, what, e0, e1) is a whole decoder layer. */
static bool whole_layer(const mq_lazy_model *lz, int layer, unsigned what, int e0, int e1) {
    return layer >= 0 && (what & MQ_PART_LAYER) == MQ_PART_LAYER && e0 <= 0 &&
           e1 >= lz->m->cfg.n_experts;
}

/* Packed bytes of a quantized weight of n values, an upper bound for every layout the kernels
 * take: 4-bit codes plus at most one byte of scale per 8 values (INT4 groups of 32 keep an fp32
 * scale; NVFP4 one E4M3 byte per 16). */
static int64_t packed_estimate(int64_t n) { return n / 2 + n / 8 + 256; }

int64_t mq_lazy_layer_bytes(const mq_lazy_model *lz, int layer) {
    int64_t n = 0;
    for (size_t i = 0; i < lz->L.n; i++) {
        const want *w = &lz->L.w[i];
        if (w->layer != layer) continue;
        n += lz->pack && w->quantized && w->lin ? packed_estimate(w->count) : w->bytes;
    }
    return n;
}

int64_t mq_lazy_head_bytes(const mq_lazy_model *lz) {
    unsigned what = MQ_PART_HEAD | (lz->m->cfg.tie_embeddings ? MQ_PART_EMBED : 0);
    return mq_lazy_bytes(lz, -1, what, 0, 0);
}

const mq_st *mq_lazy_st(const mq_lazy_model *lz) { return lz->st; }

static bool want_selected(const want *w, int layer, unsigned what, int e0, int e1) {
    if (w->layer != layer || !(w->what & what)) return false;
    if (w->what == MQ_PART_EXPERTS) return w->expert >= e0 && w->expert < e1;
    return true;
}

void mq_lazy_prefetch(const mq_lazy_model *lz, int layer, unsigned what, int e0, int e1) {
    for (size_t i = 0; i < lz->L.n; i++) {
        const want *w = &lz->L.w[i];
        if (!want_selected(w, layer, what, e0, e1) || !w->t || w->quantized) continue;
        const size_t es = moeq_dtype_size(w->t->dtype);
        /* FP8 blocks, GGUF (a view is one whole matrix): the whole tensor */
        if (w->t->scale_inv || w->t->ggml) mq_prefetch(w->t->data, w->t->nbytes);
        else mq_prefetch(w->t->data + (size_t)w->off * es, (size_t)w->count * es);
    }
}

int64_t mq_lazy_bytes(const mq_lazy_model *lz, int layer, unsigned what, int e0, int e1) {
    int64_t n = 0;
    for (size_t i = 0; i < lz->L.n; i++)
        if (want_selected(&lz->L.w[i], layer, what, e0, e1)) n += lz->L.w[i].bytes;
    return n;
}

/* The residual-stream rotation of one loaded fp32 want (rotate.h). Routed and shared experts by
 * their part (fused experts have no name of their own), everything else by its tensor name. */
static moeq_status rotate_want(const mq_rotation *r, const want *w, float *x) {
    int layer = w->layer;
    mq_rot_kind k;
    if (w->expert >= 0) k = w->part == 2 ? MQ_ROT_WRITE : MQ_ROT_READ_FFN;
    else k = mq_rot_classify(w->name, &layer);
    const int64_t D = r->D;
    if (k == MQ_ROT_NONE) return MOEQ_OK;
    if (w->count % D)
        return mq_err(MOEQ_E_SHAPE, "rotate: tensor '%s': %lld values, not rows of %lld", w->name,
                      (long long)w->count, (long long)D);
    if (k == MQ_ROT_WRITE) return mq_rotation_apply(r, k, layer, x, D, w->count / D, w->name);
    return mq_rotation_apply(r, k, layer, x, w->count / D, D, w->name);
}

/* A lazy load converts in pieces of 2 MB of fp32 (a huge page's worth: two threads rarely fault
 * in one page): a chunk of 8 experts is 24 tensors, which as one task each left a third of 16
 * threads idle in the second of two rounds. A piece: elements [k0, k1) of want idx. */
enum { LAZY_PIECE = 512 * 1024 };

typedef struct {
    size_t idx;
    int64_t k0, k1;
} lazy_piece;

typedef struct {
    const mq_lazy_model *lz;
    const size_t *idx;          /* the wants loaded here */
    const bool *convert;        /* per want: read here (not only allocated, not dequantized) */
    const lazy_piece *piece;
    moeq_status *status;        /* per want */
} lazy_job;

static void lazy_piece_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const lazy_job *j = ctx;
    const lazy_piece *pc = &j->piece[i];
    /* Ctrl-C: the pieces left are skipped (the caller sees the flag after the loop); a piece is
     * a few MB, read from the page cache or the disk, so the loop ends within a second */
    if (moeq_interrupted()) return;
    moeq_status st = mq_want_piece_to_f32(&j->lz->L.w[j->idx[pc->idx]], pc->k0, pc->k1);
    /* a conversion fails by its dtype alone, so every piece of a want as its first does: that
     * one reports (one writer a want) */
    if (pc->k0 == 0) j->status[pc->idx] = st;
}

/* The values of a want a piece converts: those that convert only whole, whole
 * (want_piece_to_f32). */
static int64_t piece_step(const want *w, int64_t len) {
    return mq_tensor_whole_only(w->t) && w->count > 0 ? w->count : len;
}

/* The residual-stream rotation, a whole want at a time, after all its pieces. */
static void lazy_rotate_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const lazy_job *j = ctx;
    const want *w = &j->lz->L.w[j->idx[i]];
    if (j->convert[i] && !j->status[i]) j->status[i] = rotate_want(j->lz->rot, w, *w->dest);
}

moeq_status mq_lazy_load(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1) {
    return mq_lazy_load_ex(lz, layer, what, e0, e1, NULL, NULL);
}

moeq_status mq_lazy_load_ex(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1,
                            bool (*alloc_only)(float **dest, void *user), void *user) {
    size_t n = 0;
    int64_t n_pieces = 0;
    const int64_t piece_len = lz->piece > 0 ? lz->piece : LAZY_PIECE;
    for (size_t i = 0; i < lz->L.n; i++) n += want_selected(&lz->L.w[i], layer, what, e0, e1);
    size_t *idx = malloc((n ? n : 1) * sizeof *idx);
    moeq_status *status = calloc(n ? n : 1, sizeof *status);
    bool *convert = calloc(n ? n : 1, sizeof *convert);   /* read here (not only allocated) */
    lazy_piece *piece = NULL;
    if (!idx || !status || !convert) {
        free(idx);
        free(status);
        free(convert);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    moeq_status s = MOEQ_OK;
    if (lz->pack && whole_layer(lz, layer, what, e0, e1) && !lz->packed_layer[layer]) {
        s = mq_pack_layers(&lz->L, lz->st, lz->m, layer, layer + 1, &lz->n_fallback, NULL);
        /* once a Linear runs packed, the BF16 / F16 embeddings and lm_head are read in place, as
         * a whole open reads them, so that a streamed eval computes what a whole one does (out
         * of memory: they stay fp32) */
        if (!s && lz->m->n_packed > 0) (void)mq_map_float_head(&lz->L, lz->m, false);
        lz->packed_layer[layer] = true;   /* also after a failure: the release frees what it made */
    }
    n = 0;
    for (size_t i = 0; i < lz->L.n && !s; i++) {
        want *w = &lz->L.w[i];
        if (!want_selected(w, layer, what, e0, e1) || *w->dest || w->packed) continue;
        *w->dest = mq_alloc_array((size_t)w->count, sizeof(float), w->name);
        if (!*w->dest) {
            s = MOEQ_E_NOMEM;
            break;
        }
        /* quantized sources are dequantized below, on this thread, for their messages */
        convert[n] = !w->quantized && !(alloc_only && alloc_only(w->dest, user));
        if (convert[n]) n_pieces += (w->count + piece_step(w, piece_len) - 1) / piece_step(w, piece_len);
        idx[n++] = i;
    }
    if (!s && n_pieces && !(piece = malloc((size_t)n_pieces * sizeof *piece))) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) {
        int64_t np = 0;
        for (size_t k = 0; k < n; k++) {
            const want *w = &lz->L.w[idx[k]];
            if (!convert[k]) continue;
            const int64_t step = piece_step(w, piece_len);
            for (int64_t k0 = 0; k0 < w->count; k0 += step)
                piece[np++] = (lazy_piece){k, k0, k0 + step < w->count ? k0 + step : w->count};
        }
        lazy_job j = {lz, idx, convert, piece, status};
        mq_parallel_for(np, lazy_piece_task, &j);
        if (moeq_interrupted()) s = mq_err(MOEQ_E_INTERRUPTED, "layer %d: loading its weights interrupted", layer);
        if (!s && lz->rot) mq_parallel_for((int64_t)n, lazy_rotate_task, &j);
        for (size_t k = 0; k < n && !s; k++)
            if (status[k])
                s = mq_err(status[k], "tensor '%s': cannot convert to fp32", lz->L.w[idx[k]].name);
        for (size_t k = 0; k < n && !s; k++) {
            const want *w = &lz->L.w[idx[k]];
            if (w->quantized && !(alloc_only && alloc_only(w->dest, user)))
                s = mq_load_linear_weight(lz->st, w->module, w->shape[0], w->shape[1], *w->dest, NULL);
        }
    }
    free(idx);
    free(status);
    free(convert);
    free(piece);
    if (s) mq_lazy_release(lz, layer, what, e0, e1);
    return s;
}

/* ---- read-ahead (model.h) ---- */

struct mq_lazy_ahead {
    mq_lazy_model *lz;
    int layer, e0, e1;
    unsigned what;
    size_t *idx;                  /* the wants it fills */
    size_t n;
    lazy_piece *piece;
    int64_t n_pieces;
    moeq_status *status;          /* per want, written by its first piece */
    atomic_int_fast64_t next;     /* the next piece to claim, by the thread or the pool */
    atomic_int_fast64_t by_thread;
    atomic_bool stop;
    pthread_t th;
    bool started;
};

/* Converts piece i, which the caller claimed. */
static void ahead_piece(mq_lazy_ahead *a, int64_t i) {
    const lazy_piece *pc = &a->piece[i];
    moeq_status st = mq_want_piece_to_f32(&a->lz->L.w[a->idx[pc->idx]], pc->k0, pc->k1);
    if (pc->k0 == 0) a->status[pc->idx] = st;   /* one writer a want, as lazy_piece_task */
}

/* Claims and converts pieces until none is left; returns how many it converted. */
static int64_t ahead_drain(mq_lazy_ahead *a) {
    int64_t done = 0;
    for (;;) {
        if (atomic_load(&a->stop)) break;
        const int64_t i = atomic_fetch_add(&a->next, 1);
        if (i >= a->n_pieces) break;
        ahead_piece(a, i);
        done++;
    }
    return done;
}

static void *ahead_main(void *arg) {
    mq_lazy_ahead *a = arg;
#ifdef SCHED_IDLE
    /* only on cores nothing else wants: the pool's threads take a core back at once */
    struct sched_param sp = {0};
    (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
#endif
    atomic_fetch_add(&a->by_thread, ahead_drain(a));
    return NULL;
}

static void ahead_pool_task(void *ctx, int64_t i, int thread) {
    (void)i, (void)thread;
    mq_lazy_ahead *a = ctx;
    if (atomic_load(&a->next) < a->n_pieces) {   /* claim one piece (the thread may take it first) */
        const int64_t k = atomic_fetch_add(&a->next, 1);
        if (k < a->n_pieces) ahead_piece(a, k);
    }
}

static void ahead_free(mq_lazy_ahead *a) {
    free(a->idx);
    free(a->piece);
    free(a->status);
    free(a);
}

moeq_status mq_lazy_ahead_start(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1,
                                mq_lazy_ahead **out) {
    *out = NULL;
    if (lz->rot) return MOEQ_OK;   /* the rotation follows the whole load */
    const int64_t piece_len = lz->piece > 0 ? lz->piece : LAZY_PIECE;
    size_t n = 0;
    for (size_t i = 0; i < lz->L.n; i++) {
        const want *w = &lz->L.w[i];
        if (!want_selected(w, layer, what, e0, e1)) continue;
        if (*w->dest || w->quantized || w->packed || !w->t || mq_tensor_whole_only(w->t)) return MOEQ_OK;
        n++;
    }
    if (n == 0) return MOEQ_OK;
    mq_lazy_ahead *a = calloc(1, sizeof *a);
    if (a) {
        a->idx = malloc(n * sizeof *a->idx);
        a->status = calloc(n, sizeof *a->status);
    }
    if (!a || !a->idx || !a->status) {
        if (a) ahead_free(a);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    *a = (mq_lazy_ahead){.lz = lz, .layer = layer, .e0 = e0, .e1 = e1, .what = what, .idx = a->idx,
                         .status = a->status};
    int64_t np = 0;
    moeq_status s = MOEQ_OK;
    for (size_t i = 0; i < lz->L.n && !s; i++) {
        want *w = &lz->L.w[i];
        if (!want_selected(w, layer, what, e0, e1)) continue;
        if (!(*w->dest = mq_alloc_array((size_t)w->count, sizeof(float), w->name))) s = MOEQ_E_NOMEM;
        else {
            a->idx[a->n++] = i;
            np += (w->count + piece_len - 1) / piece_len;
        }
    }
    if (!s && !(a->piece = malloc((size_t)(np ? np : 1) * sizeof *a->piece))) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t k = 0; k < a->n && !s; k++) {
        const want *w = &lz->L.w[a->idx[k]];
        for (int64_t k0 = 0; k0 < w->count; k0 += piece_len)
            a->piece[a->n_pieces++] = (lazy_piece){k, k0, k0 + piece_len < w->count ? k0 + piece_len : w->count};
    }
    if (!s) a->started = pthread_create(&a->th, NULL, ahead_main, a) == 0;   /* else the finish converts */
    if (s) {
        mq_lazy_release(lz, layer, what, e0, e1);
        ahead_free(a);
        return s;
    }
    *out = a;
    return MOEQ_OK;
}

moeq_status mq_lazy_ahead_finish(mq_lazy_ahead *a, int64_t *by_thread, int64_t *pieces) {
    if (!a) return MOEQ_OK;
    const int64_t left = a->n_pieces - atomic_load(&a->next);
    if (left > 0) mq_parallel_for(left, ahead_pool_task, a);
    if (a->started) pthread_join(a->th, NULL);   /* its last piece */
    moeq_status s = MOEQ_OK;
    for (size_t k = 0; k < a->n && !s; k++)
        if (a->status[k]) s = mq_err(a->status[k], "tensor '%s': cannot convert to fp32", a->lz->L.w[a->idx[k]].name);
    if (by_thread) *by_thread = atomic_load(&a->by_thread);
    if (pieces) *pieces = a->n_pieces;
    if (s) mq_lazy_release(a->lz, a->layer, a->what, a->e0, a->e1);
    ahead_free(a);
    return s;
}

void mq_lazy_ahead_cancel(mq_lazy_ahead *a) {
    if (!a) return;
    atomic_store(&a->stop, true);
    if (a->started) pthread_join(a->th, NULL);
    mq_lazy_release(a->lz, a->layer, a->what, a->e0, a->e1);
    ahead_free(a);
}

void mq_lazy_release(mq_lazy_model *lz, int layer, unsigned what, int e0, int e1) {
    if (layer >= 0 && lz->packed_layer[layer] && whole_layer(lz, layer, what, e0, e1)) {
        for (size_t i = 0; i < lz->L.n; i++) {
            want *w = &lz->L.w[i];
            if (w->layer != layer || !w->packed) continue;
            if (w->expert < 0) {
                mq_packed_weight_free(w->lin->qw);
                w->lin->qw = NULL;
            }
            w->packed = false;
        }
        moeq_moe_experts_free(lz->m->layers[layer].pexperts);
        lz->m->layers[layer].pexperts = NULL;
        lz->packed_layer[layer] = false;
    }
    if (layer < 0 && (what & MQ_PART_EMBED) && lz->m->lm_head == lz->m->embed)
        lz->m->lm_head = NULL;   /* tied: lm_head borrowed the embeddings */
    for (size_t i = 0; i < lz->L.n; i++) {
        want *w = &lz->L.w[i];
        if (!want_selected(w, layer, what, e0, e1) || !*w->dest) continue;
        mq_free(*w->dest);
        *w->dest = NULL;
    }
}

moeq_status mq_lazy_embed(const mq_lazy_model *lz, const int32_t *ids, int64_t T, float *x) {
    const mq_config *c = &lz->m->cfg;
    const int64_t D = c->D;
    for (int64_t t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= c->vocab)
            return mq_err(MOEQ_E_ARG, "token id %d at position %lld is outside the vocabulary "
                          "(0..%d)", ids[t], (long long)t, c->vocab - 1);
        if (lz->embed->scale_inv) {   /* FP8 block-quantized embeddings: one row */
            moeq_status s = mq_fp8_dequant_rows(lz->embed, ids[t], 1, x + t * D);
            if (s) return s;
            if (lz->rot) mq_rotation_vec(lz->rot, x + t * D);
            continue;
        }
        /* one row (a GGUF's: the blocks of that row) */
        moeq_status s = mq_tensor_range_to_f32(lz->embed, (int64_t)ids[t] * D, (int64_t)ids[t] * D + D, x + t * D);
        if (s) return mq_err(s, "tensor 'model.embed_tokens.weight': cannot convert to fp32");
        if (lz->rot) mq_rotation_vec(lz->rot, x + t * D);
    }
    return MOEQ_OK;
}

