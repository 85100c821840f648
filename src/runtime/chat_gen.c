/*
 * Generation over a held context (moeq.h, "moeq_gen"): the session keeps the ids it was fed, so
 * a prompt that extends them (a chat's next turn) feeds only the new part. The loop is the one
 * `moeq generate` runs (sampler over the prompt's history, EOS ids of the model, stop strings
 * cut exactly), with the text handed out in certain pieces as it grows. One process-wide mutex
 * puts the forward passes of all moeq_gen objects in turn: the model's weights are shared and
 * the thread pool takes one job at a time anyway.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"

static pthread_mutex_t g_forward_mu = PTHREAD_MUTEX_INITIALIZER;

struct moeq_gen {
    const moeq_model *m;
    moeq_session *s;
    int32_t n_ctx;
    int32_t *held;   /* the ids fed to s, in order */
    int32_t n_held;
    float *logits;
};

void moeq_gen_result_free(moeq_gen_result *r) {
    if (!r) return;
    free(r->text);
    r->text = NULL;
    r->text_len = 0;
}

moeq_status moeq_gen_create(const moeq_model *m, int32_t n_ctx, moeq_gen **out) {
    return moeq_gen_create_ex(m, n_ctx, NULL, out);
}

moeq_status moeq_gen_create_ex(const moeq_model *m, int32_t n_ctx, const moeq_session_options *so, moeq_gen **out) {
    *out = NULL;
    if (!m) return mq_err(MOEQ_E_ARG, "moeq_gen_create: NULL model");
    const moeq_model_info *info = moeq_model_get_info(m);
    if (n_ctx <= 0 || n_ctx > info->max_position_embeddings) n_ctx = info->max_position_embeddings;
    if (n_ctx < 2) return mq_err(MOEQ_E_ARG, "moeq_gen_create: a context of %d tokens", n_ctx);
    moeq_gen *g = calloc(1, sizeof *g);
    if (!g) return mq_err(MOEQ_E_NOMEM, "out of memory");
    g->m = m;
    g->n_ctx = n_ctx;
    g->held = malloc(sizeof(int32_t) * (size_t)n_ctx);
    g->logits = malloc(sizeof(float) * (size_t)info->vocab_size);
    moeq_status st = !g->held || !g->logits ? mq_err(MOEQ_E_NOMEM, "out of memory") : moeq_session_create_ex(m, n_ctx, so, &g->s);
    if (st) {
        moeq_gen_free(g);
        return st;
    }
    *out = g;
    return MOEQ_OK;
}

void moeq_gen_free(moeq_gen *g) {
    if (!g) return;
    moeq_session_free(g->s);
    free(g->held);
    free(g->logits);
    free(g);
}

void moeq_gen_reset(moeq_gen *g) {
    if (!g) return;
    moeq_session_reset(g->s);
    g->n_held = 0;
}

int32_t moeq_gen_n_ctx(const moeq_gen *g) { return g ? g->n_ctx : 0; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Feeds ids[0..n) and records them as held; the logits of the last one go to g->logits. The
 * prompt is fed in pieces of at most 512 so that other slots get their turn between them. */
static moeq_status feed(moeq_gen *g, const int32_t *ids, int32_t n) {
    moeq_status st = MOEQ_OK;
    for (int32_t i = 0; i < n && !st;) {
        int32_t k = n - i < 512 ? n - i : 512;
        bool last = i + k == n;
        pthread_mutex_lock(&g_forward_mu);
        if (last && k > 1) st = moeq_session_forward(g->s, ids + i, k - 1, NULL);
        if (!st) st = last ? moeq_session_forward(g->s, ids + i + (k > 1 ? k - 1 : 0), 1, g->logits)
                           : moeq_session_forward(g->s, ids + i, k, NULL);
        pthread_mutex_unlock(&g_forward_mu);
        if (st) break;
        memcpy(g->held + g->n_held, ids + i, sizeof(int32_t) * (size_t)k);
        g->n_held += k;
        i += k;
    }
    if (st) moeq_gen_reset(g);   /* a failed step leaves the cache unknown */
    return st;
}

size_t moeq_gen_find_stop(const char *t, size_t n, size_t from, const char *const *stop, int32_t n_stop,
                          int32_t *which) {
    for (size_t p = from; p < n; p++)
        for (int32_t k = 0; k < n_stop; k++) {
            size_t m = strlen(stop[k]);
            if (m && m <= n - p && !memcmp(t + p, stop[k], m)) {
                if (which) *which = k;
                return p;
            }
        }
    return n + 1;
}

size_t moeq_gen_certain(const char *t, size_t n, const char *const *stop, int32_t n_stop) {
    if (n >= 3 && !memcmp(t + n - 3, "\xef\xbf\xbd", 3)) n -= 3;   /* U+FFFD: more bytes may complete it */
    size_t hold = 0;   /* the longest tail that begins a stop string */
    for (int32_t k = 0; k < n_stop; k++) {
        size_t m = strlen(stop[k]);
        for (size_t h = m > 0 && m - 1 < n ? m - 1 : n; h > hold; h--)
            if (!memcmp(t + n - h, stop[k], h)) {
                hold = h;
                break;
            }
    }
    return n - hold;
}

moeq_status moeq_gen_run(moeq_gen *g, const int32_t *prompt, size_t n_prompt,
                         const moeq_gen_options *o, moeq_gen_piece_fn piece, void *user,
                         moeq_gen_result *r) {
    memset(r, 0, sizeof *r);
    r->stop_index = -1;
    if (!g || !o || (!prompt && n_prompt)) return mq_err(MOEQ_E_ARG, "moeq_gen_run: NULL argument");
    if (n_prompt == 0) return mq_err(MOEQ_E_ARG, "moeq_gen_run: an empty prompt");
    if (n_prompt >= (size_t)g->n_ctx)
        return mq_err(MOEQ_E_ARG, "the prompt of %zu tokens leaves no room in the context of %d tokens",
                      n_prompt, g->n_ctx);
    const moeq_tokenizer *tok = moeq_model_tokenizer(g->m);
    if (!tok) return mq_err(MOEQ_E_ARG, "moeq_gen_run: the model has no tokenizer");
    const int32_t V = moeq_model_get_info(g->m)->vocab_size;
    int32_t room = g->n_ctx - (int32_t)n_prompt;
    int32_t max_new = o->max_tokens > 0 && o->max_tokens < room ? o->max_tokens : room;
    int32_t eos[64], n_eos = o->ignore_eos ? 0 : moeq_model_eos_ids(g->m, eos, 64);
    if (n_eos > 64) n_eos = 64;

    moeq_sampler *smp = NULL;
    moeq_status st = moeq_sampler_create(&o->sampling, &smp);
    if (!st) st = moeq_sampler_accept(smp, prompt, n_prompt);
    int32_t *gen = malloc(sizeof(int32_t) * (size_t)(max_new + 1));
    if (!st && !gen) st = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (st) {
        moeq_sampler_free(smp);
        free(gen);
        return st;
    }
    /* what the session holds already: kept when it is a proper prefix of the prompt */
    int32_t keep = 0;
    if (g->n_held > 0 && (size_t)g->n_held < n_prompt && !memcmp(g->held, prompt, sizeof(int32_t) * (size_t)g->n_held))
        keep = g->n_held;
    else
        moeq_gen_reset(g);
    r->prompt_tokens = (int32_t)n_prompt;
    r->reused_tokens = keep;
    double t0 = now_s();
    st = feed(g, prompt + keep, (int32_t)n_prompt - keep);
    r->prefill_seconds = now_s() - t0;

    char *text = NULL;
    size_t text_len = 0, printed = 0, cut = 0;
    int32_t n_gen = 0, n_text = 0;
    const char *finish = "length";
    while (!st && n_gen < max_new) {
        int32_t next;
        st = moeq_sampler_sample(smp, g->logits, V, &next);
        if (st) break;
        gen[n_gen++] = next;
        bool is_eos = false;
        for (int32_t k = 0; k < n_eos; k++) is_eos |= next == eos[k];
        if (is_eos) {
            finish = "eos";
            break;
        }
        n_text = n_gen;
        free(text);
        text = NULL;
        st = moeq_tokenizer_decode_ex(tok, gen, (size_t)n_gen, MOEQ_DECODE_SKIP_UNKNOWN, &text, &text_len);
        if (st) break;
        size_t at = moeq_gen_find_stop(text, text_len, printed, o->stop, o->n_stop, &r->stop_index);
        if (at <= text_len) {
            cut = at;
            finish = "stop";
            break;
        }
        cut = moeq_gen_certain(text, text_len, o->stop, o->n_stop);
        if (cut > printed) {
            if (piece && piece(user, text + printed, cut - printed)) {
                printed = cut;
                finish = "cancelled";
                break;
            }
            printed = cut;
        }
        if (n_gen == max_new) break;
        if (moeq_interrupted()) {
            finish = "interrupted";
            break;
        }
        double t1 = now_s();
        st = feed(g, &next, 1);
        r->decode_seconds += now_s() - t1;
    }
    if (!st && strcmp(finish, "stop") != 0 && strcmp(finish, "cancelled") != 0) {
        free(text);
        text = NULL;
        st = moeq_tokenizer_decode_ex(tok, gen, (size_t)n_text, MOEQ_DECODE_SKIP_UNKNOWN, &text, &text_len);
        cut = text_len;
    }
    if (!st && !strcmp(finish, "cancelled")) cut = printed;
    else if (!st && cut > printed && piece) piece(user, text + printed, cut - printed);   /* the rest */
    moeq_sampler_free(smp);
    free(gen);
    if (st) {
        free(text);
        return st;
    }
    if (!text) text = calloc(1, 1);
    if (!text) return mq_err(MOEQ_E_NOMEM, "out of memory");
    text[cut] = 0;
    r->text = text;
    r->text_len = cut;
    r->completion_tokens = n_gen;
    r->finish_reason = finish;
    return MOEQ_OK;
}
