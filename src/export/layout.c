/*
 * Packing and unpacking one quantized Linear in the checkpoint layouts vLLM loads:
 * compressed-tensors nvfp4-pack-quantized and pack-quantized (INT4), ModelOpt NVFP4, GPTQ v1.
 * Spec: ../shared/docs/formats.md sections 2.1-2.4 (tensor names, dtypes, shapes, packing and
 * the GPTQ v1 zero-point quirk). Unpacking rebuilds the same mq_qtensor, so a loader that
 * dequantizes it reproduces the in-memory fake quantization bit for bit.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "export/layout.h"

const char *mq_ckpt_format_name(mq_ckpt_format f) {
    switch (f) {
    case MQ_FMT_CT: return "compressed-tensors";
    case MQ_FMT_MODELOPT: return "modelopt";
    case MQ_FMT_GPTQ: return "gptq";
    case MQ_FMT_GGUF: return "gguf";
    }
    return "unknown";
}

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

/* ---- emitting ----------------------------------------------------------------------------- */

typedef struct {
    const char *module;
    mq_emit_fn emit;
    void *user;
} emitter;

static moeq_status emit_owned(const emitter *e, const char *suffix, moeq_dtype dt, int ndim,
                              const int64_t *shape, void *data, size_t nbytes) {
    char name[1024];
    if (snprintf(name, sizeof name, "%s.%s", e->module, suffix) >= (int)sizeof name) {
        mq_free(data);
        return mq_err(MOEQ_E_ARG, "module name too long: '%s'", e->module);
    }
    return e->emit(e->user, name, dt, ndim, shape, data, nbytes);
}

static moeq_status emit_f32_scalar(const emitter *e, const char *suffix, float v, int ndim) {
    float *d = mq_alloc(sizeof(float), "scalar tensor");
    if (!d) return MOEQ_E_NOMEM;
    *d = v;
    int64_t shape[1] = {1};
    return emit_owned(e, suffix, MOEQ_DT_F32, ndim, shape, d, sizeof(float));
}

/* Packed codes [N, K/2] and E4M3 scales [N, K/16]: identical in CT and ModelOpt. */
static moeq_status emit_nvfp4_common(const emitter *e, const mq_qtensor *q, const char *wname) {
    int64_t N = q->rows, K = q->cols;
    uint8_t *packed = mq_alloc((size_t)(N * (K / 2)), "packed NVFP4 weight");
    if (!packed) return MOEQ_E_NOMEM;
    mq_pack_u4_bytes(q->codes, N * K, packed);
    int64_t pshape[2] = {N, K / 2};
    moeq_status st = emit_owned(e, wname, MOEQ_DT_U8, 2, pshape, packed, (size_t)(N * (K / 2)));
    if (st) return st;
    uint8_t *sc = mq_alloc((size_t)(N * q->n_groups), "NVFP4 block scales");
    if (!sc) return MOEQ_E_NOMEM;
    for (int64_t i = 0; i < N * q->n_groups; i++) sc[i] = q->params[i].scale_code;
    int64_t sshape[2] = {N, q->n_groups};
    return emit_owned(e, "weight_scale", MOEQ_DT_F8_E4M3, 2, sshape, sc, (size_t)(N * q->n_groups));
}

/* The global scale in the other convention is the reciprocal. */
static float global_as(const mq_qtensor *q, mq_nvfp4_conv want) {
    return q->spec.nvfp4_conv == want ? q->global_scale : 1.0f / q->global_scale;
}

static void put_scale(void *dst, size_t i, moeq_dtype dt, float v) {
    if (dt == MOEQ_DT_BF16) ((uint16_t *)dst)[i] = mq_f32_to_bf16(v);
    else if (dt == MOEQ_DT_F16) ((uint16_t *)dst)[i] = mq_f32_to_f16(v);
    else ((float *)dst)[i] = v;
}

static moeq_status emit_ct_int4(const emitter *e, const mq_qtensor *q) {
    int64_t N = q->rows, K = q->cols, G = q->n_groups;
    uint32_t *packed = mq_alloc_array((size_t)(N * (K / 8)), 4, "packed INT4 weight");
    if (!packed) return MOEQ_E_NOMEM;
    for (int64_t r = 0; r < N; r++) mq_pack_u4_words(q->codes + r * K, K, packed + r * (K / 8));
    int64_t pshape[2] = {N, K / 8};
    moeq_status st = emit_owned(e, "weight_packed", MOEQ_DT_I32, 2, pshape, packed,
                                (size_t)(N * (K / 8)) * 4);
    if (st) return st;
    moeq_dtype sdt = q->spec.scale_dtype;
    size_t esz = sdt == MOEQ_DT_F32 ? 4 : 2;
    void *sc = mq_alloc_array((size_t)(N * G), esz, "INT4 scales");
    if (!sc) return MOEQ_E_NOMEM;
    for (int64_t i = 0; i < N * G; i++) put_scale(sc, (size_t)i, sdt, q->params[i].scale);
    int64_t sshape[2] = {N, G};
    if ((st = emit_owned(e, "weight_scale", sdt, 2, sshape, sc, (size_t)(N * G) * esz))) return st;
    int64_t *shp = mq_alloc(2 * sizeof(int64_t), "weight_shape");
    if (!shp) return MOEQ_E_NOMEM;
    shp[0] = N;
    shp[1] = K;
    int64_t two[1] = {2};
    if ((st = emit_owned(e, "weight_shape", MOEQ_DT_I64, 1, two, shp, 2 * sizeof(int64_t))))
        return st;
    if (q->spec.asym) {
        /* zero points [N, G] packed eight rows per word along the out dim (rows padded with 0) */
        int64_t NW = (N + 7) / 8;
        uint32_t *zp = mq_alloc_zero((size_t)(NW * G) * 4, "INT4 zero points");
        if (!zp) return MOEQ_E_NOMEM;
        for (int64_t r = 0; r < N; r++)
            for (int64_t g = 0; g < G; g++)
                zp[(r / 8) * G + g] |= ((uint32_t)q->params[r * G + g].zero & 0xF) << (4 * (r % 8));
        int64_t zshape[2] = {NW, G};
        if ((st = emit_owned(e, "weight_zero_point", MOEQ_DT_I32, 2, zshape, zp, (size_t)(NW * G) * 4)))
            return st;
    }
    if (q->g_idx) {
        int32_t *gi = mq_alloc_array((size_t)K, 4, "g_idx");
        if (!gi) return MOEQ_E_NOMEM;
        memcpy(gi, q->g_idx, (size_t)K * 4);
        int64_t gshape[1] = {K};
        if ((st = emit_owned(e, "weight_g_idx", MOEQ_DT_I32, 1, gshape, gi, (size_t)K * 4)))
            return st;
    }
    return MOEQ_OK;
}

static moeq_status emit_gptq(const emitter *e, const mq_qtensor *q) {
    int64_t N = q->rows, K = q->cols, G = q->n_groups;
    /* qweight[r, n] = sum_j code[n, 8r + j] << 4j: the transpose of the CT packing */
    uint32_t *qw = mq_alloc_array((size_t)((K / 8) * N), 4, "GPTQ qweight");
    if (!qw) return MOEQ_E_NOMEM;
    for (int64_t r = 0; r < K / 8; r++)
        for (int64_t n = 0; n < N; n++) {
            uint32_t w = 0;
            for (int j = 0; j < 8; j++) w |= (uint32_t)(q->codes[n * K + 8 * r + j] & 0xF) << (4 * j);
            qw[r * N + n] = w;
        }
    int64_t qshape[2] = {K / 8, N};
    moeq_status st = emit_owned(e, "qweight", MOEQ_DT_I32, 2, qshape, qw, (size_t)((K / 8) * N) * 4);
    if (st) return st;
    /* qzeros[g, c] = sum_j (z[g, 8c + j] - 1) << 4j (v1 stores zero - 1; symmetric -> 0x77777777) */
    uint32_t *qz = mq_alloc_zero((size_t)(G * (N / 8)) * 4, "GPTQ qzeros");
    if (!qz) return MOEQ_E_NOMEM;
    for (int64_t g = 0; g < G; g++)
        for (int64_t n = 0; n < N; n++) {
            int z = q->spec.asym ? (int)q->params[n * G + g].zero : 8;
            qz[g * (N / 8) + n / 8] |= ((uint32_t)(z - 1) & 0xF) << (4 * (n % 8));
        }
    int64_t zshape[2] = {G, N / 8};
    if ((st = emit_owned(e, "qzeros", MOEQ_DT_I32, 2, zshape, qz, (size_t)(G * (N / 8)) * 4)))
        return st;
    uint16_t *sc = mq_alloc_array((size_t)(G * N), 2, "GPTQ scales");
    if (!sc) return MOEQ_E_NOMEM;
    for (int64_t g = 0; g < G; g++)
        for (int64_t n = 0; n < N; n++) sc[g * N + n] = mq_f32_to_f16(q->params[n * G + g].scale);
    int64_t sshape[2] = {G, N};
    if ((st = emit_owned(e, "scales", MOEQ_DT_F16, 2, sshape, sc, (size_t)(G * N) * 2))) return st;
    int32_t *gi = mq_alloc_array((size_t)K, 4, "GPTQ g_idx");
    if (!gi) return MOEQ_E_NOMEM;
    for (int64_t k = 0; k < K; k++) gi[k] = (int32_t)mq_qtensor_group_of(q, k);
    int64_t gshape[1] = {K};
    return emit_owned(e, "g_idx", MOEQ_DT_I32, 1, gshape, gi, (size_t)K * 4);
}

moeq_status mq_layout_emit_input_scale(mq_ckpt_format fmt, const char *module, float input_amax,
                                       mq_emit_fn emit, void *user) {
    emitter e = {module, emit, user};
    if (fmt == MQ_FMT_GGUF) fmt = MQ_FMT_CT;   /* assembled as compressed-tensors */
    if (fmt == MQ_FMT_CT) return emit_f32_scalar(&e, "input_global_scale", 2688.0f / input_amax, 1);
    if (fmt == MQ_FMT_MODELOPT) return emit_f32_scalar(&e, "input_scale", input_amax / 2688.0f, 0);
    return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the GPTQ format has no activation scales", module);
}

moeq_status mq_layout_emit(mq_ckpt_format fmt, const char *module, const mq_qtensor *q,
                           float input_amax, mq_emit_fn emit, void *user) {
    emitter e = {module, emit, user};
    if (q->spec.scheme == MQ_QS_KQUANT) {
        if (fmt != MQ_FMT_GGUF)
            return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': llama.cpp's block types are GGUF's", module);
        return mq_layout_ggml_emit(module, q, emit, user);
    }
    if (fmt == MQ_FMT_GGUF) fmt = MQ_FMT_CT;
    int64_t N = q->rows, K = q->cols;
    mq_qscheme sch = q->spec.scheme;
    if (sch == MQ_QS_NVFP4) {
        if (fmt == MQ_FMT_GPTQ)
            return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the GPTQ format holds INT4 only", module);
        if (K % 16)
            return mq_err(MOEQ_E_SHAPE, "module '%s': NVFP4 needs in-features %% 16 == 0, got %lld",
                          module, (long long)K);
        bool ct = fmt == MQ_FMT_CT;
        moeq_status st = emit_nvfp4_common(&e, q, ct ? "weight_packed" : "weight");
        if (st) return st;
        if (ct) {
            if ((st = emit_f32_scalar(&e, "weight_global_scale", global_as(q, MQ_NVFP4_CT), 1)))
                return st;
        } else {
            if ((st = emit_f32_scalar(&e, "weight_scale_2", global_as(q, MQ_NVFP4_MUL), 0)))
                return st;
        }
        if (input_amax > 0) st = mq_layout_emit_input_scale(fmt, module, input_amax, emit, user);
        return st;
    }
    if (sch == MQ_QS_INT4) {
        if (fmt == MQ_FMT_MODELOPT)
            return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the ModelOpt format holds NVFP4 only",
                          module);
        if (K % 8)
            return mq_err(MOEQ_E_SHAPE, "module '%s': INT4 packing needs in-features %% 8 == 0, got %lld",
                          module, (long long)K);
        if (fmt == MQ_FMT_CT) return emit_ct_int4(&e, q);
        if (N % 8)
            return mq_err(MOEQ_E_SHAPE, "module '%s': GPTQ needs out-features %% 8 == 0, got %lld",
                          module, (long long)N);
        if (q->spec.asym)
            for (int64_t i = 0; i < N * q->n_groups; i++)
                if (q->params[i].zero < 1)
                    return mq_err(MOEQ_E_ARG,
                                  "module '%s': zero point 0 cannot be stored in GPTQ v1 (quantize "
                                  "with int4_zero_min = 1)", module);
        return emit_gptq(&e, q);
    }
    return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': scheme %s has no checkpoint layout", module,
                  mq_qscheme_name(sch));
}

/* ---- describing --------------------------------------------------------------------------- */
/* What mq_layout_emit will emit, without the data: the checkpoint writer plans its files from
 * this before any weight is quantized. Kept in step with the emitters above (tested). */

typedef struct {
    const char *module;
    mq_describe_fn fn;
    void *user;
} describer;

static moeq_status describe(const describer *d, const char *suffix, moeq_dtype dt, int ndim,
                            int64_t d0, int64_t d1) {
    char name[1024];
    if (snprintf(name, sizeof name, "%s.%s", d->module, suffix) >= (int)sizeof name)
        return mq_err(MOEQ_E_ARG, "module name too long: '%s'", d->module);
    int64_t shape[2] = {d0, d1};
    return d->fn(d->user, name, dt, ndim, shape);
}

moeq_status mq_layout_describe(mq_ckpt_format fmt, const char *module, const mq_qspec *spec,
                               int64_t N, int64_t K, bool g_idx, bool input_scale,
                               mq_describe_fn fn, void *user) {
    describer d = {module, fn, user};
    if (spec->scheme == MQ_QS_KQUANT) {
        if (fmt != MQ_FMT_GGUF)
            return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': llama.cpp's block types are GGUF's", module);
        return mq_layout_ggml_describe(module, spec, N, K, fn, user);
    }
    if (fmt == MQ_FMT_GGUF) fmt = MQ_FMT_CT;
    moeq_status st;
    const int64_t G = (K + mq_qspec_group(spec, K) - 1) / mq_qspec_group(spec, K);
    if (spec->scheme == MQ_QS_NVFP4) {
        if (fmt == MQ_FMT_GPTQ)
            return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the GPTQ format holds INT4 only", module);
        if (K % 16)
            return mq_err(MOEQ_E_SHAPE, "module '%s': NVFP4 needs in-features %% 16 == 0, got %lld",
                          module, (long long)K);
        bool ct = fmt == MQ_FMT_CT;
        if ((st = describe(&d, ct ? "weight_packed" : "weight", MOEQ_DT_U8, 2, N, K / 2))) return st;
        if ((st = describe(&d, "weight_scale", MOEQ_DT_F8_E4M3, 2, N, K / 16))) return st;
        if (ct) {
            if ((st = describe(&d, "weight_global_scale", MOEQ_DT_F32, 1, 1, 0))) return st;
            if (input_scale) st = describe(&d, "input_global_scale", MOEQ_DT_F32, 1, 1, 0);
        } else {
            if ((st = describe(&d, "weight_scale_2", MOEQ_DT_F32, 0, 0, 0))) return st;
            if (input_scale) st = describe(&d, "input_scale", MOEQ_DT_F32, 0, 0, 0);
        }
        return st;
    }
    if (spec->scheme != MQ_QS_INT4)
        return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': scheme %s has no checkpoint layout", module,
                      mq_qscheme_name(spec->scheme));
    if (fmt == MQ_FMT_MODELOPT)
        return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the ModelOpt format holds NVFP4 only",
                      module);
    if (K % 8)
        return mq_err(MOEQ_E_SHAPE, "module '%s': INT4 packing needs in-features %% 8 == 0, got %lld",
                      module, (long long)K);
    if (fmt == MQ_FMT_CT) {
        if ((st = describe(&d, "weight_packed", MOEQ_DT_I32, 2, N, K / 8))) return st;
        if ((st = describe(&d, "weight_scale", spec->scale_dtype, 2, N, G))) return st;
        if ((st = describe(&d, "weight_shape", MOEQ_DT_I64, 1, 2, 0))) return st;
        if (spec->asym && (st = describe(&d, "weight_zero_point", MOEQ_DT_I32, 2, (N + 7) / 8, G)))
            return st;
        if (g_idx) st = describe(&d, "weight_g_idx", MOEQ_DT_I32, 1, K, 0);
        return st;
    }
    if (N % 8)
        return mq_err(MOEQ_E_SHAPE, "module '%s': GPTQ needs out-features %% 8 == 0, got %lld",
                      module, (long long)N);
    if ((st = describe(&d, "qweight", MOEQ_DT_I32, 2, K / 8, N))) return st;
    if ((st = describe(&d, "qzeros", MOEQ_DT_I32, 2, G, N / 8))) return st;
    if ((st = describe(&d, "scales", MOEQ_DT_F16, 2, G, N))) return st;
    return describe(&d, "g_idx", MOEQ_DT_I32, 1, K, 0);
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
