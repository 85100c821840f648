/*
 * Packing one quantized Linear into the checkpoint layouts vLLM loads: compressed-tensors
 * nvfp4-pack-quantized and pack-quantized (INT4), ModelOpt NVFP4, GPTQ v1. Spec:
 * ../shared/docs/formats.md sections 2.1-2.4 (tensor names, dtypes, shapes, packing and the GPTQ
 * v1 zero-point quirk). The unpacking, which rebuilds the same mq_qtensor, is the readers'
 * (src/ckpt/layout_read.c), below the model loader and this writer both.
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

/* ---- emitting ----------------------------------------------------------------------------- */

/* A module's tensors go to emit (mq_layout_emit) or their declarations to describe
 * (mq_layout_describe), named "module.suffix". */
typedef struct {
    const char *module;
    mq_emit_fn emit;
    mq_describe_fn describe;
    void *user;
} emitter;

enum { NAME_CAP = 1024 };

static moeq_status tensor_name(const emitter *e, const char *suffix, char name[NAME_CAP]) {
    if (snprintf(name, NAME_CAP, "%s.%s", e->module, suffix) < NAME_CAP) return MOEQ_OK;
    return mq_err(MOEQ_E_ARG, "module name too long: '%s'", e->module);
}

static moeq_status emit_owned(const emitter *e, const char *suffix, moeq_dtype dt, int ndim,
                              const int64_t *shape, void *data, size_t nbytes) {
    char name[NAME_CAP];
    moeq_status s = tensor_name(e, suffix, name);
    if (s) {
        mq_free(data);
        return s;
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
    emitter e = {module, emit, NULL, user};
    if (fmt == MQ_FMT_GGUF) fmt = MQ_FMT_CT;   /* assembled as compressed-tensors */
    if (fmt == MQ_FMT_CT) return emit_f32_scalar(&e, "input_global_scale", 2688.0f / input_amax, 1);
    if (fmt == MQ_FMT_MODELOPT) return emit_f32_scalar(&e, "input_scale", input_amax / 2688.0f, 0);
    return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the GPTQ format has no activation scales", module);
}

/* Whether fmt holds a module of scheme sch with N out- and K in-features (what emitting and
 * describing check first; GGUF assembles all but llama.cpp's block types as compressed-tensors). */
static moeq_status layout_check(mq_ckpt_format fmt, const char *module, mq_qscheme sch, int64_t N,
                                int64_t K) {
    if (sch == MQ_QS_KQUANT && fmt != MQ_FMT_GGUF)
        return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': llama.cpp's block types are GGUF's", module);
    if (sch == MQ_QS_KQUANT) return MOEQ_OK;   /* its own checks: layout_ggml.c */
    if (fmt == MQ_FMT_GGUF) fmt = MQ_FMT_CT;
    if (sch == MQ_QS_NVFP4) {
        if (fmt == MQ_FMT_GPTQ)
            return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the GPTQ format holds INT4 only", module);
        if (K % 16)
            return mq_err(MOEQ_E_SHAPE, "module '%s': NVFP4 needs in-features %% 16 == 0, got %lld",
                          module, (long long)K);
        return MOEQ_OK;
    }
    if (sch != MQ_QS_INT4)
        return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': scheme %s has no checkpoint layout", module,
                      mq_qscheme_name(sch));
    if (fmt == MQ_FMT_MODELOPT)
        return mq_err(MOEQ_E_UNSUPPORTED, "module '%s': the ModelOpt format holds NVFP4 only",
                      module);
    if (K % 8)
        return mq_err(MOEQ_E_SHAPE, "module '%s': INT4 packing needs in-features %% 8 == 0, got %lld",
                      module, (long long)K);
    if (fmt == MQ_FMT_GPTQ && N % 8)
        return mq_err(MOEQ_E_SHAPE, "module '%s': GPTQ needs out-features %% 8 == 0, got %lld",
                      module, (long long)N);
    return MOEQ_OK;
}

moeq_status mq_layout_emit(mq_ckpt_format fmt, const char *module, const mq_qtensor *q,
                           float input_amax, mq_emit_fn emit, void *user) {
    emitter e = {module, emit, NULL, user};
    const mq_qscheme sch = q->spec.scheme;
    moeq_status st = layout_check(fmt, module, sch, q->rows, q->cols);
    if (st) return st;
    if (sch == MQ_QS_KQUANT) return mq_layout_ggml_emit(module, q, emit, user);
    if (fmt == MQ_FMT_GGUF) fmt = MQ_FMT_CT;
    if (sch == MQ_QS_NVFP4) {
        bool ct = fmt == MQ_FMT_CT;
        st = emit_nvfp4_common(&e, q, ct ? "weight_packed" : "weight");
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
    /* INT4 */
    if (fmt == MQ_FMT_CT) return emit_ct_int4(&e, q);
    if (q->spec.asym)
        for (int64_t i = 0; i < q->rows * q->n_groups; i++)
            if (q->params[i].zero < 1)
                return mq_err(MOEQ_E_ARG,
                              "module '%s': zero point 0 cannot be stored in GPTQ v1 (quantize "
                              "with int4_zero_min = 1)", module);
    return emit_gptq(&e, q);
}

/* ---- describing --------------------------------------------------------------------------- */
/* What mq_layout_emit will emit, without the data: the checkpoint writer plans its files from
 * this before any weight is quantized. Kept in step with the emitters above (tested). */

static moeq_status describe(const emitter *d, const char *suffix, moeq_dtype dt, int ndim, int64_t d0,
                            int64_t d1) {
    char name[NAME_CAP];
    moeq_status s = tensor_name(d, suffix, name);
    int64_t shape[2] = {d0, d1};
    return s ? s : d->describe(d->user, name, dt, ndim, shape);
}

moeq_status mq_layout_describe(mq_ckpt_format fmt, const char *module, const mq_qspec *spec,
                               int64_t N, int64_t K, bool g_idx, bool input_scale,
                               mq_describe_fn fn, void *user) {
    emitter d = {module, NULL, fn, user};
    moeq_status st = layout_check(fmt, module, spec->scheme, N, K);
    if (st) return st;
    if (spec->scheme == MQ_QS_KQUANT) return mq_layout_ggml_describe(module, spec, N, K, fn, user);
    if (fmt == MQ_FMT_GGUF) fmt = MQ_FMT_CT;
    const int64_t G = (K + mq_qspec_group(spec, K) - 1) / mq_qspec_group(spec, K);
    if (spec->scheme == MQ_QS_NVFP4) {
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
    /* INT4 */
    if (fmt == MQ_FMT_CT) {
        if ((st = describe(&d, "weight_packed", MOEQ_DT_I32, 2, N, K / 8))) return st;
        if ((st = describe(&d, "weight_scale", spec->scale_dtype, 2, N, G))) return st;
        if ((st = describe(&d, "weight_shape", MOEQ_DT_I64, 1, 2, 0))) return st;
        if (spec->asym && (st = describe(&d, "weight_zero_point", MOEQ_DT_I32, 2, (N + 7) / 8, G)))
            return st;
        if (g_idx) st = describe(&d, "weight_g_idx", MOEQ_DT_I32, 1, K, 0);
        return st;
    }
    if ((st = describe(&d, "qweight", MOEQ_DT_I32, 2, K / 8, N))) return st;
    if ((st = describe(&d, "qzeros", MOEQ_DT_I32, 2, G, N / 8))) return st;
    if ((st = describe(&d, "scales", MOEQ_DT_F16, 2, G, N))) return st;
    return describe(&d, "g_idx", MOEQ_DT_I32, 1, K, 0);
}
