/*
 * The residual-stream rotation of rotate.h: classification of the hub's tensor names, the
 * block-diagonal randomized Hadamard transform (fast Walsh-Hadamard butterflies, fp32) and the
 * fold of the RMSNorm weights into the Linears that read their outputs. QuaRot (arXiv
 * 2404.00456) section 4 / SpinQuant R1, with blocks as in MR-GPTQ (arXiv 2509.23202).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/rotate.h"

moeq_status mq_rotation_check(const mq_config *c, int block) {
    if (block < 2 || (block & (block - 1)))
        return mq_err(MOEQ_E_ARG, "rotate_block: %d is not a power of two >= 2", block);
    if (c->D % block)
        return mq_err(MOEQ_E_ARG, "rotate_block: %d does not divide the hidden size %d", block,
                      (int)c->D);
    if (c->mla)
        return mq_err(MOEQ_E_UNSUPPORTED, "rotate: %s: multi-head latent attention (q_a/kv_a with "
                      "their own norms, multi-token-prediction layers that read the embeddings "
                      "through enorm/hnorm) is not shown exact here; refused", c->model_type);
    if (c->quant_method && strcmp(c->quant_method, "fp8") != 0)
        return mq_err(MOEQ_E_UNSUPPORTED, "rotate: the source is quantized (%s); rotate the "
                      "unquantized model", c->quant_method);
    switch (c->arch) {
    case MQ_ARCH_LLAMA: case MQ_ARCH_OLMOE: case MQ_ARCH_QWEN2_MOE: case MQ_ARCH_QWEN3_MOE:
    case MQ_ARCH_MIXTRAL:
        return MOEQ_OK;   /* pre-norm RMSNorm blocks; q/k norms act on q/k outputs */
    default:
        return mq_err(MOEQ_E_UNSUPPORTED, "rotate: model_type %s is not a plain pre-norm RMSNorm "
                      "family here; refused", c->model_type);
    }
}

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static moeq_status read_vec(const mq_st *st, const char *name, int64_t D, float *out) {
    const mq_tensor_view *t = mq_st_find(st, name);
    if (!t) return mq_err(MOEQ_E_FORMAT, "rotate: tensor '%s' missing", name);
    if (t->numel != D)
        return mq_err(MOEQ_E_SHAPE, "rotate: tensor '%s' has %lld values, expected %lld", name,
                      (long long)t->numel, (long long)D);
    moeq_status s = mq_tensor_to_f32(t, out);
    return s ? mq_err(s, "rotate: tensor '%s': cannot convert to fp32", name) : MOEQ_OK;
}

moeq_status mq_rotation_init(mq_rotation *r, const mq_config *c, const mq_st *st, int block,
                             uint64_t seed) {
    memset(r, 0, sizeof *r);
    r->D = c->D;
    r->block = block;
    r->n_layers = c->n_layers;
    r->sign = mq_alloc_array((size_t)c->D, sizeof(float), "rotation signs");
    r->norms = mq_alloc_array((size_t)(2 * c->n_layers + 1) * (size_t)c->D, sizeof(float),
                              "rotation norms");
    if (!r->sign || !r->norms) {
        mq_rotation_free(r);
        return MOEQ_E_NOMEM;
    }
    uint64_t z = seed;
    for (int64_t i = 0; i < c->D; i++) r->sign[i] = (splitmix64(&z) >> 63) ? -1.0f : 1.0f;
    moeq_status s = MOEQ_OK;
    char n[96];
    for (int l = 0; l < c->n_layers && !s; l++) {
        snprintf(n, sizeof n, "model.layers.%d.input_layernorm.weight", l);
        s = read_vec(st, n, c->D, r->norms + (size_t)(2 * l) * (size_t)c->D);
        snprintf(n, sizeof n, "model.layers.%d.post_attention_layernorm.weight", l);
        if (!s) s = read_vec(st, n, c->D, r->norms + (size_t)(2 * l + 1) * (size_t)c->D);
    }
    if (!s) s = read_vec(st, "model.norm.weight", c->D, r->norms + (size_t)(2 * c->n_layers) * (size_t)c->D);
    if (s) mq_rotation_free(r);
    return s;
}

void mq_rotation_free(mq_rotation *r) {
    if (!r) return;
    mq_free(r->sign);
    mq_free(r->norms);
    r->sign = r->norms = NULL;
}

static bool ends_with(const char *s, const char *suf) {
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && strcmp(s + n - k, suf) == 0;
}

mq_rot_kind mq_rot_classify(const char *t, int *layer) {
    *layer = -1;
    if (!strcmp(t, "model.embed_tokens.weight")) return MQ_ROT_EMBED;
    if (!strcmp(t, "model.norm.weight")) return MQ_ROT_NORM;
    if (!strcmp(t, "lm_head.weight")) return MQ_ROT_READ_FINAL;
    if (strncmp(t, "model.layers.", 13) != 0) return MQ_ROT_NONE;
    char *end;
    long l = strtol(t + 13, &end, 10);
    if (end == t + 13 || *end != '.') return MQ_ROT_NONE;
    *layer = (int)l;
    const char *leaf = end + 1;
    if (!strcmp(leaf, "input_layernorm.weight") || !strcmp(leaf, "post_attention_layernorm.weight"))
        return MQ_ROT_NORM;
    if (!strcmp(leaf, "self_attn.q_proj.weight") || !strcmp(leaf, "self_attn.k_proj.weight") ||
        !strcmp(leaf, "self_attn.v_proj.weight"))
        return MQ_ROT_READ_ATTN;
    if (!strcmp(leaf, "self_attn.o_proj.weight")) return MQ_ROT_WRITE;
    if (!strcmp(leaf, "self_attn.o_proj.bias")) return MQ_ROT_WRITE_BIAS;
    if (strncmp(leaf, "mlp.", 4) != 0 && strncmp(leaf, "block_sparse_moe.", 17) != 0)
        return MQ_ROT_NONE;
    /* the FFN block: router, routed and shared experts, dense MLP */
    if (ends_with(leaf, ".gate.weight") || ends_with(leaf, ".shared_expert_gate.weight") ||
        ends_with(leaf, "gate_proj.weight") || ends_with(leaf, "up_proj.weight") ||
        ends_with(leaf, ".w1.weight") || ends_with(leaf, ".w3.weight"))
        return MQ_ROT_READ_FFN;
    if (ends_with(leaf, "down_proj.weight") || ends_with(leaf, ".w2.weight")) return MQ_ROT_WRITE;
    if (ends_with(leaf, "down_proj.bias") || ends_with(leaf, ".w2.bias")) return MQ_ROT_WRITE_BIAS;
    return MQ_ROT_NONE;
}

/* One block of b values: sign, butterflies, 1/sqrt(b). */
static void fwht_block(float *x, const float *s, int b) {
    for (int i = 0; i < b; i++) x[i] *= s[i];
    for (int h = 1; h < b; h *= 2)
        for (int i = 0; i < b; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                float a = x[j], c = x[j + h];
                x[j] = a + c;
                x[j + h] = a - c;
            }
    const float k = (float)(1.0 / sqrt((double)b));
    for (int i = 0; i < b; i++) x[i] *= k;
}

void mq_rotation_vec(const mq_rotation *r, float *x) {
    for (int64_t o = 0; o < r->D; o += r->block) fwht_block(x + o, r->sign + o, r->block);
}

/* R^T W for W [D, cols]: the same transform down every column, done on whole rows. */
static void rotate_rows(const mq_rotation *r, float *w, int64_t cols) {
    const int b = r->block;
    const float k = (float)(1.0 / sqrt((double)b));
    for (int64_t o = 0; o < r->D; o += b) {
        float *blk = w + o * cols;
        for (int i = 0; i < b; i++)
            if (r->sign[o + i] < 0)
                for (int64_t c = 0; c < cols; c++) blk[i * cols + c] = -blk[i * cols + c];
        for (int h = 1; h < b; h *= 2)
            for (int i = 0; i < b; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    float *a = blk + (int64_t)j * cols, *c = blk + (int64_t)(j + h) * cols;
                    for (int64_t q = 0; q < cols; q++) {
                        float u = a[q], v = c[q];
                        a[q] = u + v;
                        c[q] = u - v;
                    }
                }
        for (int64_t q = 0; q < (int64_t)b * cols; q++) blk[q] *= k;
    }
}

moeq_status mq_rotation_apply(const mq_rotation *r, mq_rot_kind k, int layer, float *x,
                              int64_t rows, int64_t cols, const char *name) {
    const int64_t D = r->D;
    const float *g = NULL;
    switch (k) {
    case MQ_ROT_NONE:
        return MOEQ_OK;
    case MQ_ROT_NORM:
        if (rows * cols != D) break;
        for (int64_t i = 0; i < D; i++) x[i] = 1.0f;
        return MOEQ_OK;
    case MQ_ROT_WRITE_BIAS:
        if (rows * cols != D) break;
        mq_rotation_vec(r, x);
        return MOEQ_OK;
    case MQ_ROT_WRITE:
        if (rows != D) break;
        rotate_rows(r, x, cols);
        return MOEQ_OK;
    case MQ_ROT_READ_ATTN: case MQ_ROT_READ_FFN: case MQ_ROT_READ_FINAL:
        if (k == MQ_ROT_READ_FINAL) g = r->norms + (size_t)(2 * r->n_layers) * (size_t)D;
        else if (layer < 0 || layer >= r->n_layers)
            return mq_err(MOEQ_E_ARG, "rotate: tensor '%s': layer %d outside the model", name, layer);
        else g = r->norms + (size_t)(2 * layer + (k == MQ_ROT_READ_FFN)) * (size_t)D;
        /* fall through */
    case MQ_ROT_EMBED:
        if (cols != D) break;
        for (int64_t i = 0; i < rows; i++) {
            float *row = x + i * D;
            if (g)
                for (int64_t j = 0; j < D; j++) row[j] *= g[j];
            mq_rotation_vec(r, row);
        }
        return MOEQ_OK;
    }
    return mq_err(MOEQ_E_SHAPE, "rotate: tensor '%s' [%lld, %lld] does not fit the hidden size %lld",
                  name, (long long)rows, (long long)cols, (long long)D);
}
