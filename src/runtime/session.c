/*
 * Sessions (include/moeq.h): a model's KV cache and position, and the forward of new tokens to
 * their logits (embeddings, the decoder layers of model/forward.c, the final norm and lm_head),
 * on the CPU or, with a device, on a GPU (session_gpu.c: the layers, their KV cache and the
 * output layer there; the embeddings looked up here).
 */
#include <stdlib.h>
#include <string.h>

#include "backend/gpu.h"
#include "core/optval.h"
#include "model/model.h"
#include "runtime/session_gpu.h"

struct moeq_session {
    const moeq_model *m;
    mq_state *st;
    int32_t pos;
    int32_t max_tokens;
    float *x;
    int64_t x_rows;
    mq_session_gpu *gpu;   /* the device's forward, or NULL (the CPU's: st) */
};

void moeq_session_options_init(moeq_session_options *o) {
    memset(o, 0, sizeof *o);
    o->device = -1;
    o->gpu_precision = MOEQ_GPU_FP32;
}

moeq_status moeq_session_options_set(moeq_session_options *o, const char *key, const char *v) {
    if (!o || !key || !v) return mq_err(MOEQ_E_ARG, "moeq_session_options_set: NULL argument");
    if (!strcmp(key, "device")) {
        int d = -1;
        moeq_status st = mq_gpu_parse_device(v, &d);
        if (st) return mq_opt_bad(key, v, "cpu, cuda or cuda:N");
        o->device = d;
        return MOEQ_OK;
    }
    if (!strcmp(key, "gpu-precision")) {
        static const char names[] = "fp32|tf32x3|tf32|bf16";
        const int i = mq_opt_choice_index(v, names);
        if (i < 0) return mq_opt_bad_choice(key, v, names);
        o->gpu_precision = MOEQ_GPU_FP32 + i;
        return MOEQ_OK;
    }
    if (!strcmp(key, "max-gpu-memory")) return mq_opt_size(key, v, &o->max_gpu_memory);
    return mq_err(MOEQ_E_ARG, "unknown session option '%s' (device, gpu-precision, max-gpu-memory)", key);
}

moeq_status moeq_session_create(const moeq_model *m, int32_t max_tokens, moeq_session **out) {
    return moeq_session_create_ex(m, max_tokens, NULL, out);
}

moeq_status moeq_session_create_ex(const moeq_model *m, int32_t max_tokens, const moeq_session_options *o,
                                   moeq_session **out) {
    if (!m || !out) return mq_err(MOEQ_E_ARG, "moeq_session_create: NULL argument");
    if (m->lazy)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: opened with stream (weights a layer at a time): "
                      "only moeq_eval runs it; open it without stream to generate", m->dir);
    *out = NULL;
    moeq_session *s = calloc(1, sizeof *s);
    if (!s) return mq_err(MOEQ_E_NOMEM, "out of memory");
    s->m = m;
    s->max_tokens = max_tokens;
    moeq_status st = o && o->device >= 0 ? mq_session_gpu_open(m, max_tokens, o, &s->gpu)
                                         : mq_state_new(m, max_tokens, &s->st);
    if (st) free(s);
    else *out = s;
    return st;
}

void moeq_session_free(moeq_session *s) {
    if (!s) return;
    mq_state_free(s->st);
    mq_session_gpu_close(s->gpu);
    mq_free(s->x);
    free(s);
}

void moeq_session_reset(moeq_session *s) {
    if (s->st) mq_state_reset(s->st);   /* a GPU's cache is overwritten from position 0 */
    s->pos = 0;
}

int32_t moeq_session_pos(const moeq_session *s) { return s->pos; }

const char *moeq_session_device(const moeq_session *s) { return s->gpu ? mq_session_gpu_describe(s->gpu) : "cpu"; }

moeq_status moeq_session_forward(moeq_session *s, const int32_t *ids, int32_t n, float *logits) {
    if (!s || (!ids && n > 0)) return mq_err(MOEQ_E_ARG, "moeq_session_forward: NULL argument");
    if (n < 0) return mq_err(MOEQ_E_ARG, "moeq_session_forward: negative token count %d", n);
    if (n == 0) return MOEQ_OK;
    if ((int64_t)s->pos + n > s->max_tokens)
        return mq_err(MOEQ_E_ARG, "session full: %d + %d tokens exceed its %d positions", s->pos, n,
                      s->max_tokens);
    const mq_config *c = &s->m->cfg;
    if (n > s->x_rows) {
        mq_free(s->x);
        s->x = mq_alloc_array((size_t)n, (size_t)c->D * 4, "session activations");
        s->x_rows = s->x ? n : 0;
        if (!s->x) return MOEQ_E_NOMEM;
    }
    moeq_status st = mq_embed(s->m, ids, n, s->x);
    if (!st && s->gpu) {
        st = mq_session_gpu_forward(s->gpu, s->x, n, s->pos, logits);
        if (!st) s->pos += n;
        return st;
    }
    if (!st) st = mq_forward_layers(s->m, s->st, s->x, n, s->pos, 0, c->n_layers, NULL);
    if (st) return st;
    if (logits) {
        mq_final_norm(s->m, s->x, n);
        st = mq_lm_head(s->m, s->x, n, logits);
    }
    s->pos += n;   /* the layers have filled the cache either way */
    return st;
}
