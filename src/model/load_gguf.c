/*
 * A .gguf opened with keep_packed (issue 56): the file stays mapped and its matrices are used in
 * place (kernels/ggml_mat.h): Linears, the embeddings and lm_head of the types read in place
 * through mq_ggml_mat, and the routed experts of a MoE layer stored Q4_0 or NVFP4 repacked once
 * into the fused MoE op's layout. What is neither (K-quants, deepseek2's merged kv_b) is decoded
 * to fp32 by load.c as before.
 */
#include <stdlib.h>
#include <string.h>

#include "io/gguf_hf.h"
#include "kernels/ggml_mat.h"
#include "model/model_internal.h"

static moeq_status view_mat(const mq_tensor_view *t, int64_t rows, int64_t cols, mq_ggml_mat *m) {
    const mq_ggml_view *g = t->ggml;
    if (!g || g->mla_heads > 0)
        return mq_err(MOEQ_E_UNSUPPORTED, "tensor '%s' is not one GGUF matrix", t->name);
    if (t->numel != rows * cols || (t->ndim == 2 && g->row != cols))
        return mq_err(MOEQ_E_UNSUPPORTED, "tensor '%s' is not [%lld, %lld]", t->name,
                      (long long)rows, (long long)cols);
    moeq_status s = mq_ggml_mat_init(m, t->data, g->type, rows, cols, g->scaled ? g->scale : 1.0f,
                                     g->perm_hd, t->name);
    if (!s && mq_ggml_mat_bytes(m) != t->nbytes)
        s = mq_err(MOEQ_E_UNSUPPORTED, "tensor '%s': %zu bytes, not %zu", t->name, t->nbytes,
                   mq_ggml_mat_bytes(m));
    return s;
}

moeq_status mq_gguf_map_mat(const mq_tensor_view *t, int64_t rows, int64_t cols,
                            struct mq_ggml_mat **out) {
    *out = NULL;
    mq_ggml_mat m;
    moeq_status s = view_mat(t, rows, cols, &m);
    if (s) return s;
    mq_ggml_mat *p = mq_alloc(sizeof *p, "ggml matrix");
    if (!p) return MOEQ_E_NOMEM;
    *p = m;
    *out = p;
    return MOEQ_OK;
}

moeq_status mq_gguf_map_linear(const mq_tensor_view *t, mq_linear *lin, mq_pack_cache *c) {
    mq_ggml_mat m;
    moeq_status s = view_mat(t, lin->out, lin->in, &m);
    if (s) return s;
    if (!mq_packed_weight_ggml_check(&m, lin->name)) {
        if (mq_pack_cache_get_weight(c, lin->name, &lin->qw)) return MOEQ_OK;
        s = mq_packed_weight_from_ggml(&m, lin->name, &lin->qw);
        if (!s) return mq_pack_cache_put_weight(c, lin->name, lin->qw);
        if (s != MOEQ_E_UNSUPPORTED) return s;
    }
    if (!(lin->gw = mq_alloc(sizeof m, "ggml matrix"))) return MOEQ_E_NOMEM;
    *lin->gw = m;
    return MOEQ_OK;
}

moeq_status mq_gguf_map_experts(const mq_tensor_view *const *v, int E, bool shared,
                                const char *what, mq_pack_cache *c, moeq_moe_experts **out) {
    *out = NULL;
    const int n = E + (shared ? 1 : 0);
    mq_ggml_expert *ex = mq_alloc_zero(sizeof *ex * (size_t)n, "experts");
    if (!ex) return MOEQ_E_NOMEM;
    moeq_status s = MOEQ_OK;
    for (int e = 0; e < n && !s; e++) {
        const mq_tensor_view *const *p = e < E ? v + e : v + 3 * E;
        const int step = e < E ? E : 1;
        const mq_tensor_view *g = p[0], *u = p[step], *d = p[2 * step];
        if (!g || !u || !d) {
            s = mq_err(MOEQ_E_UNSUPPORTED, "%s: expert %d is not whole in the file", what, e);
            break;
        }
        const int64_t F = g->shape[0], D = g->shape[1];
        s = view_mat(g, F, D, &ex[e].gate);
        if (!s) s = view_mat(u, F, D, &ex[e].up);
        if (!s) s = view_mat(d, D, F, &ex[e].down);
    }
    if (!s) s = mq_moe_experts_ggml_check(ex, E, shared, what);
    if (!s && mq_pack_cache_get_experts(c, what, out)) {
        mq_free(ex);
        return MOEQ_OK;
    }
    if (!s) s = mq_moe_experts_from_ggml(ex, E, shared, what, out);
    if (!s) s = mq_pack_cache_put_experts(c, what, *out);
    mq_free(ex);
    return s;
}

static void detach_linear(const mq_pack_cache *c, mq_linear *l) {
    if (l->qw && mq_pack_cache_owns(c, l->qw->blob)) l->qw->blob = NULL;
}

void mq_gguf_detach_cached(moeq_model *m) {
    const mq_pack_cache *c = m->pcache;
    if (!c) return;
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
        mq_layer *ly = &m->layers[l];
        mq_linear *lin[MQ_LAYER_LINEARS];
        mq_layer_linears(ly, lin);
        for (int i = 0; i < MQ_LAYER_LINEARS; i++) detach_linear(c, lin[i]);
        for (int e = 0; ly->exp_gate && e < m->cfg.n_experts; e++) {
            detach_linear(c, &ly->exp_gate[e]);
            detach_linear(c, &ly->exp_up[e]);
            detach_linear(c, &ly->exp_down[e]);
        }
        if (ly->pexperts && mq_pack_cache_owns(c, ly->pexperts->blob)) ly->pexperts->blob = NULL;
    }
}
