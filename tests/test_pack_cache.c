/* The packed-layout cache (model/pack_cache.c), for a .gguf and a compressed-tensors checkpoint:
 *  - the first packed open writes it, the second maps it: every packed blob and layout equals a
 *    fresh repack (cache off) byte for byte, and so do the logits;
 *    (a Q4_K file too: its Linears and experts repacked with offsets, kernels/ggml_mat.h);
 *  - a damaged cache (a flipped byte in its data, in its header, truncated) or a stale one (the
 *    source's time changed; a source byte changed with its size and time kept) is detected,
 *    ignored and written again: the rewritten file equals the first one byte for byte (the
 *    stale cases: then maps). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export/gguf_export.h"
#include "harness.h"
#include "kernels/moe_ffn.h"
#include "model/model_internal.h"
#include "pipeline/pipeline.h"

static void make_ckpt(const char *out, mq_qscheme sch) {
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, sch, MQ_FMT_CT);
    o.spec.scale_dtype = MOEQ_DT_F16;
    if (sch == MQ_QS_INT4) o.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(mq_test_model("olmoe-tiny"), out, &o, NULL));
}

static moeq_model *open_packed(const char *src, mq_pack_cache_state want) {
    moeq_model_options o = {.keep_packed = 1, .no_tokenizer = 1};
    moeq_model *m = mq_test_open_model(src, &o);
    if (m) ASSERT_EQ_INT(want, mq_pack_cache_state_of(m->pcache));
    return m;
}

static void same_pmat(const mq_pmat *a, const uint8_t *ba, const mq_pmat *b, const uint8_t *bb) {
    ASSERT_EQ_INT(a->data - ba, b->data - bb);
    ASSERT_EQ_INT(a->rb_bytes, b->rb_bytes);
    ASSERT_TRUE(a->rows == b->rows && a->cols == b->cols && a->group == b->group);
    ASSERT_TRUE(a->nvfp4 == b->nvfp4 && a->stype == b->stype && a->neg_scales == b->neg_scales);
    for (int h = 0; h < 2; h++) ASSERT_TRUE(a->mul[h] == b->mul[h] && a->div[h] == b->div[h]);
}

static void same_linear(const mq_linear *a, const mq_linear *b) {
    ASSERT_EQ_INT(a->qw != NULL, b->qw != NULL);
    if (!a->qw || !b->qw) return;
    ASSERT_TRUE(a->qw->out == b->qw->out && a->qw->in == b->qw->in);
    ASSERT_EQ_INT(a->qw->bytes, b->qw->bytes);
    ASSERT_EQ_INT(a->qw->off != NULL, b->qw->off != NULL);   /* Q4_1 / Q4_K offsets */
    if (a->qw->off && b->qw->off) {
        ASSERT_EQ_INT(a->qw->off_at, b->qw->off_at);
        ASSERT_TRUE((const uint8_t *)a->qw->off == a->qw->blob + a->qw->off_at);
        ASSERT_TRUE((const uint8_t *)b->qw->off == b->qw->blob + b->qw->off_at);
    }
    same_pmat(&a->qw->W, a->qw->blob, &b->qw->W, b->qw->blob);
    if (a->qw->bytes == b->qw->bytes)
        ASSERT_TRUE(memcmp(a->qw->blob, b->qw->blob, a->qw->bytes) == 0);
}

/* Every packed blob and layout of a equals b's; the logits of a few tokens too. */
static void same_packed(const moeq_model *a, const moeq_model *b) {
    int n_blobs = 0;
    for (int l = 0; l < a->cfg.n_layers; l++) {
        const mq_layer *x = &a->layers[l], *y = &b->layers[l];
        const mq_linear *la[4] = {&x->q, &x->k, &x->v, &x->o}, *lb[4] = {&y->q, &y->k, &y->v, &y->o};
        for (int i = 0; i < 4; i++) same_linear(la[i], lb[i]), n_blobs += la[i]->qw != NULL;
        for (int e = 0; x->exp_gate && y->exp_gate && e < a->cfg.n_experts; e++) {   /* one by one */
            same_linear(&x->exp_gate[e], &y->exp_gate[e]);
            same_linear(&x->exp_up[e], &y->exp_up[e]);
            same_linear(&x->exp_down[e], &y->exp_down[e]);
        }
        ASSERT_EQ_INT(x->pexperts != NULL, y->pexperts != NULL);
        if (!x->pexperts || !y->pexperts) continue;
        const moeq_moe_experts *p = x->pexperts, *q = y->pexperts;
        ASSERT_TRUE(p->scheme == q->scheme && p->group == q->group && p->E == q->E && p->D == q->D &&
                    p->F == q->F && p->Fs == q->Fs && p->n_mats == q->n_mats);
        ASSERT_EQ_INT(p->blob_bytes, q->blob_bytes);
        for (int e = 0; e < p->n_mats && e < q->n_mats; e++) {
            ASSERT_EQ_INT(p->ex[e].ffn, q->ex[e].ffn);
            same_pmat(&p->ex[e].gate_up, p->blob, &q->ex[e].gate_up, q->blob);
            same_pmat(&p->ex[e].down, p->blob, &q->ex[e].down, q->blob);
        }
        if (p->blob_bytes == q->blob_bytes) ASSERT_TRUE(memcmp(p->blob, q->blob, p->blob_bytes) == 0);
        n_blobs++;
    }
    ASSERT_TRUE(n_blobs >= a->cfg.n_layers);   /* the comparison compared something */
    const int32_t ids[5] = {11, 300, 2047, 5, 4000};
    const int64_t V = a->cfg.vocab;
    ASSERT_EQ_INT(V, b->cfg.vocab);
    float *la = mq_test_logits(a, ids, 5), *lb = mq_test_logits(b, ids, 5);
    ASSERT_TRUE(memcmp(la, lb, sizeof(float) * 5 * (size_t)V) == 0);
    free(la), free(lb);
}

static char *slurp(const char *path, size_t *n) {
    char *p = mq_test_slurp(path, n);
    ASSERT_TRUE(p != NULL);
    return p;
}

static void rewrite(const char *path, const char *data, size_t n) {
    FILE *f = fopen(path, "wb");
    ASSERT_TRUE(f && fwrite(data, 1, n, f) == n);
    if (f) fclose(f);
}

/* src opens packed with the cache as `how` says, holding what the fresh packing holds. */
static void opens_same(const char *src, mq_pack_cache_state how, const moeq_model *fresh) {
    moeq_model *m = open_packed(src, how);
    if (m && fresh) same_packed(m, fresh);
    moeq_model_free(m);
}

/* The cache of src (a file or folder) in a folder of the case's own. */
static void cache_cycle(const char *src, const char *tag, bool file_src) {
    char dir[1100];
    snprintf(dir, sizeof dir, "%s/cache-%s", mq_test_tmpdir(), tag);
    ASSERT_OK(moeq_set_pack_cache_dir(""));
    moeq_model *fresh = open_packed(src, MQ_PACK_CACHE_NONE);
    ASSERT_OK(moeq_set_pack_cache_dir(dir));
    moeq_model *built = open_packed(src, MQ_PACK_CACHE_BUILT);
    char path[1300];
    snprintf(path, sizeof path, "%s", built ? mq_pack_cache_path(built->pcache) : "");
    moeq_model_free(built);
    opens_same(src, MQ_PACK_CACHE_MAPPED, fresh);
    size_t n;
    char *good = slurp(path, &n);
    if (!good) return;
    /* damaged: a byte of the data (the last), of the key, of the entry table (only the header's
     * hash sees that one), truncated */
    const size_t at[3] = {n - 1, 16, 100};
    for (int k = 0; k < 4; k++) {
        char *bad = malloc(n);
        memcpy(bad, good, n);
        if (k < 3) bad[at[k]] ^= 0x20;
        rewrite(path, bad, k < 3 ? n : n / 2);
        free(bad);
        opens_same(src, MQ_PACK_CACHE_REBUILT, fresh);
        size_t n2;
        char *again = slurp(path, &n2);
        ASSERT_TRUE(again && n2 == n && memcmp(again, good, n) == 0);
        free(again);
    }
    /* stale: the source's time moved (a file source: the .gguf; a folder: its safetensors) */
    char victim[1300];
    if (file_src) snprintf(victim, sizeof victim, "%s", src);
    else snprintf(victim, sizeof victim, "%s/model.safetensors", src);
    struct stat st0;
    ASSERT_TRUE(stat(victim, &st0) == 0);
    struct timespec ts[2] = {st0.st_atim, st0.st_mtim};
    ts[1].tv_sec += 7;
    ASSERT_TRUE(utimensat(AT_FDCWD, victim, ts, 0) == 0);
    moeq_model_free(open_packed(src, MQ_PACK_CACHE_REBUILT));
    moeq_model_free(open_packed(src, MQ_PACK_CACHE_MAPPED));
    /* stale: the source's last byte changed, its size and time kept (the key's samples) */
    size_t sn;
    char *sb = slurp(victim, &sn);
    if (sb) {
        sb[sn - 1] ^= 1;
        rewrite(victim, sb, sn);
        free(sb);
        ASSERT_TRUE(utimensat(AT_FDCWD, victim, ts, 0) == 0);
        moeq_model_free(open_packed(src, MQ_PACK_CACHE_REBUILT));
        moeq_model_free(open_packed(src, MQ_PACK_CACHE_MAPPED));
    }
    free(good);
    moeq_model_free(fresh);
    ASSERT_OK(moeq_set_pack_cache_dir(NULL));
}

static void test_gguf_cache(void) {
    char ckpt[1100], file[1100];
    snprintf(ckpt, sizeof ckpt, "%s/ct", mq_test_tmpdir());
    snprintf(file, sizeof file, "%s/olmoe.gguf", mq_test_tmpdir());
    make_ckpt(ckpt, MQ_QS_INT4);
    ASSERT_OK(mq_gguf_export(ckpt, file, MQ_GGUF_REST_Q8_0));
    cache_cycle(file, "gguf", true);
}

/* A Q4_K file (moeq's own K-quant GGUF): its Linears and experts repacked with their offsets. */
static void test_kquant_cache(void) {
    char file[1100];
    snprintf(file, sizeof file, "%s/olmoe-q4_k.gguf", mq_test_tmpdir());
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_Q4_K;
    o.format = MOEQ_FORMAT_GGUF;
    ASSERT_OK(moeq_quantize(mq_test_model("olmoe-tiny"), file, &o, NULL));
    moeq_model *m = NULL;
    ASSERT_OK(moeq_set_pack_cache_dir(""));
    m = open_packed(file, MQ_PACK_CACHE_NONE);
    if (m) ASSERT_TRUE(m->layers[0].q.qw && m->layers[0].q.qw->off && m->layers[0].exp_down[0].qw &&
                       m->layers[0].exp_down[0].qw->off);
    moeq_model_free(m);
    ASSERT_OK(moeq_set_pack_cache_dir(NULL));
    cache_cycle(file, "q4_k", true);
}

static void test_checkpoint_cache(void) {
    char ckpt[1100];
    snprintf(ckpt, sizeof ckpt, "%s/nvfp4", mq_test_tmpdir());
    make_ckpt(ckpt, MQ_QS_NVFP4);
    cache_cycle(ckpt, "ct", false);
}

/* The default place: beside a .gguf in a writable folder ("<file>.moeqpack"). */
static void test_default_beside(void) {
    char ckpt[1100], file[1100], side[1200];
    snprintf(ckpt, sizeof ckpt, "%s/ct", mq_test_tmpdir());
    snprintf(file, sizeof file, "%s/m.gguf", mq_test_tmpdir());
    make_ckpt(ckpt, MQ_QS_INT4);
    ASSERT_OK(mq_gguf_export(ckpt, file, MQ_GGUF_REST_AUTO));
    ASSERT_OK(moeq_set_pack_cache_dir(NULL));
    moeq_model *m = open_packed(file, MQ_PACK_CACHE_BUILT);
    snprintf(side, sizeof side, "%s.moeqpack", file);
    if (m) ASSERT_EQ_STR(side, mq_pack_cache_path(m->pcache));
    ASSERT_TRUE(mq_file_exists(side));
    moeq_model_free(m);
    moeq_model_free(open_packed(file, MQ_PACK_CACHE_MAPPED));
}

TEST_MAIN(T(test_gguf_cache), T(test_kquant_cache), T(test_checkpoint_cache), T(test_default_beside))
