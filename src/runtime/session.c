/*
 * Sessions (include/moeq.h): a model's KV cache and position, and the forward of new tokens to
 * their logits (embeddings, the decoder layers of model/forward.c, the final norm and lm_head).
 */
#include <stdlib.h>

#include "model/model.h"

struct moeq_session {
    const moeq_model *m;
    mq_state *st;
    int32_t pos;
    int32_t max_tokens;
    float *x;
    int64_t x_rows;
};

moeq_status moeq_session_create(const moeq_model *m, int32_t max_tokens, moeq_session **out) {
    if (!m || !out) return mq_err(MOEQ_E_ARG, "moeq_session_create: NULL argument");
    if (m->lazy)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: opened with stream (weights a layer at a time): "
                      "only moeq_eval runs it; open it without stream to generate", m->dir);
    *out = NULL;
    moeq_session *s = calloc(1, sizeof *s);
    if (!s) return mq_err(MOEQ_E_NOMEM, "out of memory");
    s->m = m;
    s->max_tokens = max_tokens;
    moeq_status st = mq_state_new(m, max_tokens, &s->st);
    if (st) free(s);
    else *out = s;
    return st;
}

void moeq_session_free(moeq_session *s) {
    if (!s) return;
    mq_state_free(s->st);
    mq_free(s->x);
    free(s);
}

void moeq_session_reset(moeq_session *s) {
    mq_state_reset(s->st);
    s->pos = 0;
}

int32_t moeq_session_pos(const moeq_session *s) { return s->pos; }

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
    if (!st) st = mq_forward_layers(s->m, s->st, s->x, n, s->pos, 0, c->n_layers, NULL);
    if (st) return st;
    if (logits) {
        mq_final_norm(s->m, s->x, n);
        st = mq_lm_head(s->m, s->x, n, logits);
    }
    s->pos += n;   /* the layers have filled the cache either way */
    return st;
}
