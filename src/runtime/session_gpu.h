/*
 * A session's forward on a CUDA device (moeq_session_options.device >= 0; session_gpu.c): every
 * layer resident on the GPU with its KV cache, the backend's pieces (backend/gpu.h) driven in
 * model/forward.c's order. session.c embeds the tokens on the host and hands their rows here.
 */
#ifndef MOEQ_RUNTIME_SESSION_GPU_H
#define MOEQ_RUNTIME_SESSION_GPU_H

#include "model/model.h"

typedef struct mq_session_gpu mq_session_gpu;

/* Checks m (what the GPU pieces lack: MOEQ_E_UNSUPPORTED), opens device o->device, plans the
 * bytes every layer, the KV cache of max_tokens positions and the output layer take on it
 * (MOEQ_E_NOMEM naming them and what the device or o->max_gpu_memory allows, before anything
 * goes up), then uploads them. */
moeq_status mq_session_gpu_open(const moeq_model *m, int32_t max_tokens, const moeq_session_options *o,
                                mq_session_gpu **out);
void mq_session_gpu_close(mq_session_gpu *G);
/* n tokens at positions pos .. pos + n - 1 (the cache holds [0, pos)), their embeddings x [n, D]
 * (host): through every layer on the device, and with logits (host [n, V], or NULL) the final
 * norm and lm_head of every row. */
moeq_status mq_session_gpu_forward(mq_session_gpu *G, const float *x, int64_t n, int64_t pos, float *logits);
/* "cuda:N NAME (PRECISION)". */
const char *mq_session_gpu_describe(const mq_session_gpu *G);

#endif
