/*
 * Reading one quantized Linear of a checkpoint in the layouts export/layout.c writes
 * (compressed-tensors nvfp4-pack-quantized and pack-quantized INT4, ModelOpt NVFP4, GPTQ v1;
 * ../shared/docs/formats.md sections 2.1-2.4): which layout a module is stored in, and its
 * tensors unpacked into the same mq_qtensor the writer packed, so a loader that dequantizes it
 * reproduces the in-memory fake quantization bit for bit. Below model and export, which both read
 * checkpoints through it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/layout.h"

static const char *const quant_suffixes[] = {
    "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "weight_shape",
    "weight_zero_point", "weight_g_idx", "weight_scale_2", "input_scale", "qweight", "qzeros",
    "scales", "g_idx", "weight_scale_inv"};

bool mq_layout_is_quant_suffix(const char *suffix) {
    if (mq_layout_ggml_suffix(suffix, NULL)) return true;
    for (size_t i = 0; i < sizeof quant_suffixes / sizeof quant_suffixes[0]; i++)
        if (strcmp(suffix, quant_suffixes[i]) == 0) return true;
    return false;
}

/* ---- reading ------------------------------------------------------------------------------ */

typedef struct {
    const char *module;
    mq_lookup_fn lookup;
    void *user;
} reader;

static const mq_tensor_view *find(const reader *r, const char *suffix) {
    char name[1024];
    if (snprintf(name, sizeof name, "%s.%s", r->module, suffix) >= (int)sizeof name) return NULL;
    return r->lookup(r->user, name);
}

mq_linear_kind mq_layout_detect(const char *module, mq_lookup_fn lookup, void *user) {
    reader r = {module, lookup, user};
    const mq_tensor_view *t;
    if (mq_layout_ggml_find(module, lookup, user, NULL)) return MQ_LIN_GGML;
    if ((t = find(&r, "weight_packed"))) {
        if (t->dtype == MOEQ_DT_U8) return MQ_LIN_CT_NVFP4;
        return MQ_LIN_CT_INT4;
    }
    if (find(&r, "qweight")) return MQ_LIN_GPTQ;
    if ((t = find(&r, "weight"))) {
        if (t->dtype == MOEQ_DT_U8 && find(&r, "weight_scale")) return MQ_LIN_MODELOPT_NVFP4;
        if (t->dtype == MOEQ_DT_F8_E4M3 && find(&r, "weight_scale_inv")) return MQ_LIN_FP8_BLOCK;
        return MQ_LIN_DENSE;
    }
    return MQ_LIN_ABSENT;
}

/* Fetches P.suffix and checks dtype and shape; ndim_alt lets a scalar be [1] or []. */
static moeq_status need(const reader *r, const char *suffix, moeq_dtype dt, int ndim,
                        const int64_t *shape, const mq_tensor_view **out) {
    const mq_tensor_view *t = find(r, suffix);
    if (!t) return mq_err(MOEQ_E_FORMAT, "module '%s': tensor '%s.%s' is missing", r->module,
                          r->module, suffix);
    if (dt != MOEQ_DT_COUNT && t->dtype != dt)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': dtype %s, expected %s", t->file,
                      r->module, suffix, moeq_dtype_name(t->dtype), moeq_dtype_name(dt));
    if (ndim >= 0) {
        bool ok = t->ndim == ndim;
        for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
        if (!ok) {
            char got[128] = "", want[128] = "";
            for (int i = 0; i < t->ndim; i++)
                snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? "," : "",
                         (long long)t->shape[i]);
            for (int i = 0; i < ndim; i++)
                snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", i ? "," : "",
                         (long long)shape[i]);
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': shape [%s], expected [%s]", t->file,
                          r->module, suffix, got, want);
        }
    }
    *out = t;
    return MOEQ_OK;
}

/* A positive finite F32 scalar stored as [] or [1]. */
static moeq_status need_scalar(const reader *r, const char *suffix, float *v) {
    const mq_tensor_view *t = find(r, suffix);
    if (!t) return mq_err(MOEQ_E_FORMAT, "module '%s': tensor '%s.%s' is missing", r->module,
                          r->module, suffix);
    if (t->dtype != MOEQ_DT_F32 || t->numel != 1 || t->nbytes != 4)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': expected one F32 value", t->file,
                      r->module, suffix);
    memcpy(v, t->data, 4);
    if (!(*v > 0) || !isfinite(*v))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': global scale %g is not positive and finite",
                      t->file, r->module, suffix, (double)*v);
    return MOEQ_OK;
}

static inline uint32_t rd_u32(const uint8_t *p, int64_t i) {
    uint32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
}

static float get_scale(const mq_tensor_view *t, int64_t i) {
    const uint8_t *p = t->data;
    uint16_t h;
    float f;
    switch (t->dtype) {
    case MOEQ_DT_BF16: memcpy(&h, p + 2 * i, 2); return mq_bf16_to_f32(h);
    case MOEQ_DT_F16: memcpy(&h, p + 2 * i, 2); return mq_f16_to_f32(h);
    default: memcpy(&f, p + 4 * i, 4); return f;
    }
}

static moeq_status read_nvfp4(const reader *r, int64_t N, int64_t K, bool ct, mq_qtensor *out) {
    if (K % 16)
        return mq_err(MOEQ_E_FORMAT, "module '%s': NVFP4 weight with in-features %lld (not a multiple of 16)",
                      r->module, (long long)K);
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    s.nvfp4_conv = ct ? MQ_NVFP4_CT : MQ_NVFP4_MUL;
    moeq_status st = mq_qtensor_init(out, &s, N, K, r->module);
    if (st) return st;
    const mq_tensor_view *w, *sc;
    int64_t wshape[2] = {N, K / 2}, sshape[2] = {N, K / 16};
    if ((st = need(r, ct ? "weight_packed" : "weight", MOEQ_DT_U8, 2, wshape, &w))) return st;
    if ((st = need(r, "weight_scale", MOEQ_DT_F8_E4M3, 2, sshape, &sc))) return st;
    if ((st = need_scalar(r, ct ? "weight_global_scale" : "weight_scale_2", &out->global_scale)))
        return st;
    mq_unpack_u4_bytes(w->data, N * K, out->codes);
    for (int64_t i = 0; i < N * (K / 16); i++) {
        uint8_t b = sc->data[i];
        if ((b & 0x7F) == 0x7F)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.weight_scale': NaN block scale at row %lld, block %lld",
                          sc->file, r->module, (long long)(i / (K / 16)), (long long)(i % (K / 16)));
        out->params[i].scale_code = b;
        out->params[i].scale = mq_e4m3_decode(b);
    }
    return MOEQ_OK;
}

static moeq_status check_scales(const reader *r, const mq_tensor_view *t, const char *suffix) {
    if (!(t->dtype == MOEQ_DT_BF16 || t->dtype == MOEQ_DT_F16 || t->dtype == MOEQ_DT_F32))
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': dtype %s, expected BF16, F16 or F32",
                      t->file, r->module, suffix, moeq_dtype_name(t->dtype));
    for (int64_t i = 0; i < t->numel; i++)
        if (!isfinite(get_scale(t, i)))
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': non-finite scale at index %lld",
                          t->file, r->module, suffix, (long long)i);
    return MOEQ_OK;
}

/* Group count from the scales and the group size it implies. */
static moeq_status int4_groups(const reader *r, const mq_tensor_view *sc, int dim, int64_t K,
                               const char *suffix, int64_t *G, mq_qspec *s) {
    if (sc->ndim != 2 || sc->shape[dim] <= 0 || K % sc->shape[dim])
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': cannot infer the group size of %lld inputs",
                      sc->file, r->module, suffix, (long long)K);
    *G = sc->shape[dim];
    s->group_size = *G == 1 ? -1 : (int32_t)(K / *G);
    s->scale_dtype = sc->dtype;
    return MOEQ_OK;
}

static moeq_status read_gidx(const reader *r, const char *suffix, int64_t K, int64_t G,
                             int64_t gs, mq_qtensor *out) {
    const mq_tensor_view *t = find(r, suffix);
    if (!t) return MOEQ_OK;
    int64_t shape[1] = {K};
    moeq_status st = need(r, suffix, MOEQ_DT_I32, 1, shape, &t);
    if (st) return st;
    bool trivial = true;
    for (int64_t k = 0; k < K; k++) {
        int32_t g = (int32_t)rd_u32(t->data, k);
        if (g < 0 || g >= G)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.%s': group %d of input %lld out of range [0, %lld)",
                          t->file, r->module, suffix, g, (long long)k, (long long)G);
        if (g != k / gs) trivial = false;
    }
    if (trivial) return MOEQ_OK;
    out->g_idx = mq_alloc_array((size_t)K, 4, "g_idx");
    if (!out->g_idx) return MOEQ_E_NOMEM;
    memcpy(out->g_idx, t->data, (size_t)K * 4);
    return MOEQ_OK;
}

static moeq_status read_ct_int4(const reader *r, int64_t N, int64_t K, mq_qtensor *out) {
    if (K % 8)
        return mq_err(MOEQ_E_FORMAT, "module '%s': INT4 weight with in-features %lld (not a multiple of 8)",
                      r->module, (long long)K);
    const mq_tensor_view *w = NULL, *sc = NULL, *zp = NULL, *shp = NULL;   /* set by need() */
    int64_t wshape[2] = {N, K / 8};
    moeq_status st = need(r, "weight_packed", MOEQ_DT_I32, 2, wshape, &w);
    if (st) return st;
    if ((st = need(r, "weight_scale", MOEQ_DT_COUNT, -1, NULL, &sc))) return st;
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    int64_t G = 0;
    if ((st = check_scales(r, sc, "weight_scale"))) return st;
    if ((st = int4_groups(r, sc, 1, K, "weight_scale", &G, &s))) return st;
    if (sc->shape[0] != N)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.weight_scale': %lld rows, expected %lld",
                      sc->file, r->module, (long long)sc->shape[0], (long long)N);
    int64_t two[1] = {2};
    if (find(r, "weight_shape")) {
        if ((st = need(r, "weight_shape", MOEQ_DT_I64, 1, two, &shp))) return st;
        int64_t d[2];
        memcpy(d, shp->data, 16);
        if (d[0] != N || d[1] != K)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.weight_shape' says [%lld, %lld], expected [%lld, %lld]",
                          shp->file, r->module, (long long)d[0], (long long)d[1], (long long)N,
                          (long long)K);
    }
    if (find(r, "weight_zero_point")) {
        int64_t zshape[2] = {(N + 7) / 8, G};
        if ((st = need(r, "weight_zero_point", MOEQ_DT_I32, 2, zshape, &zp))) return st;
        s.asym = true;
    }
    if ((st = mq_qtensor_init(out, &s, N, K, r->module))) return st;
    for (int64_t n = 0; n < N; n++)
        mq_unpack_u4_words((const uint32_t *)(const void *)w->data + n * (K / 8), K,
                           out->codes + n * K);
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            mq_gparams *p = &out->params[n * G + g];
            p->scale = get_scale(sc, n * G + g);
            if (zp) p->zero = (float)((rd_u32(zp->data, (n / 8) * G + g) >> (4 * (n % 8))) & 0xF);
        }
    return read_gidx(r, "weight_g_idx", K, G, out->group_size, out);
}

static moeq_status read_gptq(const reader *r, int64_t N, int64_t K, mq_qtensor *out) {
    if (K % 8 || N % 8)
        return mq_err(MOEQ_E_FORMAT, "module '%s': GPTQ weight [%lld, %lld] is not a multiple of 8",
                      r->module, (long long)N, (long long)K);
    const mq_tensor_view *qw, *qz, *sc;
    int64_t wshape[2] = {K / 8, N};
    moeq_status st = need(r, "qweight", MOEQ_DT_I32, 2, wshape, &qw);
    if (st) return st;
    if ((st = need(r, "scales", MOEQ_DT_COUNT, -1, NULL, &sc))) return st;
    if ((st = check_scales(r, sc, "scales"))) return st;
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    int64_t G = 0;
    if ((st = int4_groups(r, sc, 0, K, "scales", &G, &s))) return st;
    if (sc->shape[1] != N)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s.scales': %lld columns, expected %lld", sc->file,
                      r->module, (long long)sc->shape[1], (long long)N);
    int64_t zshape[2] = {G, N / 8};
    if ((st = need(r, "qzeros", MOEQ_DT_I32, 2, zshape, &qz))) return st;
    /* v1 stores zero - 1; the loaders add 1 back without masking (0xF reads as 16) */
    for (int64_t i = 0; i < G * N; i++) {
        int z = (int)((rd_u32(qz->data, i / 8) >> (4 * (i % 8))) & 0xF) + 1;
        if (z != 8) s.asym = true;
    }
    if (s.asym) s.int4_zero_min = 1;
    if ((st = mq_qtensor_init(out, &s, N, K, r->module))) return st;
    for (int64_t rr = 0; rr < K / 8; rr++)
        for (int64_t n = 0; n < N; n++) {
            uint32_t v = rd_u32(qw->data, rr * N + n);
            for (int j = 0; j < 8; j++) out->codes[n * K + 8 * rr + j] = (uint8_t)((v >> (4 * j)) & 0xF);
        }
    for (int64_t g = 0; g < G; g++)
        for (int64_t n = 0; n < N; n++) {
            mq_gparams *p = &out->params[n * G + g];
            p->scale = get_scale(sc, g * N + n);
            int64_t i = g * N + n;
            p->zero = s.asym ? (float)(((rd_u32(qz->data, i / 8) >> (4 * (i % 8))) & 0xF) + 1) : 0.0f;
        }
    return read_gidx(r, "g_idx", K, G, out->group_size, out);
}

moeq_status mq_layout_read(const char *module, int64_t rows, int64_t cols, mq_lookup_fn lookup,
                           void *user, mq_qtensor *out) {
    memset(out, 0, sizeof *out);
    reader r = {module, lookup, user};
    switch (mq_layout_detect(module, lookup, user)) {
    case MQ_LIN_CT_NVFP4: return read_nvfp4(&r, rows, cols, true, out);
    case MQ_LIN_MODELOPT_NVFP4: return read_nvfp4(&r, rows, cols, false, out);
    case MQ_LIN_CT_INT4: return read_ct_int4(&r, rows, cols, out);
    case MQ_LIN_GPTQ: return read_gptq(&r, rows, cols, out);
    case MQ_LIN_GGML: return mq_layout_ggml_read(module, rows, cols, lookup, user, out);
    case MQ_LIN_DENSE:
        return mq_err(MOEQ_E_ARG, "module '%s' is not quantized", module);
    case MQ_LIN_FP8_BLOCK:
        return mq_err(MOEQ_E_UNSUPPORTED, "module '%s' is FP8 block-quantized: it loads "
                      "dequantized to fp32, not as a 4-bit tensor", module);
    default: return mq_err(MOEQ_E_NOTFOUND, "module '%s': no weight tensors", module);
    }
}
