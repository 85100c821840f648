/*
 * Weight quantization schemes (NVFP4, INT4 sym/asym, MXFP4): group parameters, per-value
 * quantize/dequantize, the optional MSE scale search, and round-to-nearest over a whole tensor
 * into the canonical mq_qtensor. Conventions: formats.md sections 2.1-2.4 (compressed-tensors,
 * ModelOpt, GPTQ), torchao_gptq.md section 11; the op order is written out in formats.h.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats/formats.h"
#include "formats/kquant.h"
#include "formats/cpu/simd.h"

#define E4M3_MAX 448.0f
#define E2M1_MAX 6.0f
#define NVFP4_GS_NUM 2688.0f   /* 448 * 6, exact in fp32 */

mq_qspec mq_qspec_default(mq_qscheme scheme) {
    mq_qspec s;
    memset(&s, 0, sizeof s);
    s.scheme = scheme;
    s.group_size = scheme == MQ_QS_NVFP4 ? 16 : scheme == MQ_QS_MXFP4 ? 32 : scheme == MQ_QS_KQUANT ? 32 : 128;
    s.kq = MQ_KQ_Q4_K;   /* MQ_QS_KQUANT: group_size is its sub-block (mq_kq_spec) */
    s.int4_sym_div = 7.5f;
    s.scale_dtype = MOEQ_DT_BF16;
    s.nvfp4_conv = MQ_NVFP4_CT;
    s.nvfp4_scale_min = 0.0f;
    s.mse = false;
    s.mse_steps = 17;
    s.mse_lo = 0.70f;
    s.mse_hi = 1.10f;
    return s;
}

mq_qspec mq_qspec_reference(mq_qscheme scheme) {
    mq_qspec s = mq_qspec_default(scheme);
    s.int4_sym_div = 7.0f;
    s.scale_dtype = MOEQ_DT_F32;
    s.nvfp4_conv = MQ_NVFP4_MUL;
    s.nvfp4_scale_min = 0x1p-9f;
    return s;
}

const char *mq_qscheme_name(mq_qscheme scheme) {
    switch (scheme) {
    case MQ_QS_NVFP4: return "nvfp4";
    case MQ_QS_INT4: return "int4";
    case MQ_QS_MXFP4: return "mxfp4";
    case MQ_QS_KQUANT: return "kquant";
    default: return "none";
    }
}

int64_t mq_qspec_group(const mq_qspec *s, int64_t cols) {
    return s->group_size <= 0 ? cols : s->group_size;
}

moeq_status mq_qspec_check(const mq_qspec *s, int64_t rows, int64_t cols, const char *tensor) {
    if (rows <= 0 || cols <= 0)
        return mq_err(MOEQ_E_SHAPE, "tensor '%s': cannot quantize an empty weight [%lld, %lld]",
                      tensor, (long long)rows, (long long)cols);
    switch (s->scheme) {
    case MQ_QS_NVFP4:
    case MQ_QS_MXFP4: {
        int32_t want = s->scheme == MQ_QS_NVFP4 ? 16 : 32;
        if (s->group_size != want)
            return mq_err(MOEQ_E_ARG, "tensor '%s': %s needs group size %d, got %d", tensor,
                          mq_qscheme_name(s->scheme), want, s->group_size);
        if (cols % want)
            return mq_err(MOEQ_E_SHAPE, "tensor '%s': %s needs in-features divisible by %d, got %lld",
                          tensor, mq_qscheme_name(s->scheme), want, (long long)cols);
        if (s->mse && (s->mse_steps < 1 || !(s->mse_lo > 0) || !(s->mse_hi >= s->mse_lo)))
            return mq_err(MOEQ_E_ARG, "tensor '%s': bad MSE grid", tensor);
        return MOEQ_OK;
    }
    case MQ_QS_INT4:
        if (s->group_size != -1 && s->group_size <= 0)
            return mq_err(MOEQ_E_ARG, "tensor '%s': INT4 group size must be positive or -1, got %d",
                          tensor, s->group_size);
        if (s->group_size > 0 && cols % s->group_size)
            return mq_err(MOEQ_E_SHAPE,
                          "tensor '%s': in-features %lld not divisible by the group size %d",
                          tensor, (long long)cols, s->group_size);
        if (!s->asym && !(s->int4_sym_div > 0))
            return mq_err(MOEQ_E_ARG, "tensor '%s': INT4 symmetric divisor must be positive",
                          tensor);
        if (s->scale_dtype != MOEQ_DT_F32 && s->scale_dtype != MOEQ_DT_BF16 &&
            s->scale_dtype != MOEQ_DT_F16)
            return mq_err(MOEQ_E_ARG, "tensor '%s': INT4 scale dtype must be F32, BF16 or F16",
                          tensor);
        if (s->mse && (s->mse_steps < 1 || !(s->mse_lo > 0) || !(s->mse_hi >= s->mse_lo)))
            return mq_err(MOEQ_E_ARG, "tensor '%s': bad MSE grid", tensor);
        return MOEQ_OK;
    case MQ_QS_KQUANT: {
        const mq_kq_info *k = mq_kq_info_of(s->kq);
        if (s->kq < 0 || s->kq >= MQ_KQ_COUNT || s->group_size != k->sub)
            return mq_err(MOEQ_E_ARG, "tensor '%s': bad K-quant type or sub-block", tensor);
        if (cols % k->block)
            return mq_err(MOEQ_E_SHAPE, "tensor '%s': %s needs in-features divisible by %d, got %lld", tensor,
                          k->name, k->block, (long long)cols);
        if (s->mse && (s->mse_steps < 1 || !(s->mse_lo > 0) || !(s->mse_hi >= s->mse_lo)))
            return mq_err(MOEQ_E_ARG, "tensor '%s': bad MSE grid", tensor);
        return MOEQ_OK;
    }
    default:
        return mq_err(MOEQ_E_ARG, "tensor '%s': no quantization scheme", tensor);
    }
}

double mq_qspec_bits_per_weight(const mq_qspec *s, int64_t rows, int64_t cols) {
    double n = (double)rows * (double)cols;
    double g = (double)mq_qspec_group(s, cols);
    switch (s->scheme) {
    case MQ_QS_NVFP4: return 4.0 + 8.0 / g + 32.0 / n;
    case MQ_QS_MXFP4: return 4.0 + 8.0 / g;
    case MQ_QS_KQUANT: return mq_kq_bpw(s->kq);
    case MQ_QS_INT4:
        return 4.0 + (s->scale_dtype == MOEQ_DT_F32 ? 32.0 : 16.0) / g + (s->asym ? 4.0 / g : 0.0);
    default: return 32.0;
    }
}

float mq_nvfp4_global_scale(const mq_qspec *s, float amax) {
    if (s->scheme != MQ_QS_NVFP4 || !(amax > 0) || !isfinite(amax)) return 1.0f;
    if (s->nvfp4_headroom > 1.0f) amax = amax * s->nvfp4_headroom;
    float g = s->nvfp4_conv == MQ_NVFP4_MUL ? amax / NVFP4_GS_NUM : NVFP4_GS_NUM / amax;
    return (g > 0 && isfinite(g)) ? g : 1.0f;
}

float mq_absmax(const float *x, int64_t n) {
    /* eight independent maxima (the loop is latency-bound otherwise); max is exact in any order */
    float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    bool nan = false;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) {
            float a = fabsf(x[i + k]);
            nan |= a != a;
            m[k] = a > m[k] ? a : m[k];
        }
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        nan |= a != a;
        m[0] = a > m[0] ? a : m[0];
    }
    if (nan) return NAN;
    for (int k = 1; k < 8; k++) m[0] = m[k] > m[0] ? m[k] : m[0];
    return m[0];
}

/* One pool task per chunk of ABSMAX_CHUNK values: a lone 117M-value weight (DeepSeek-V3's o_proj)
 * took 50 ms on one thread while the others waited. */
enum { ABSMAX_CHUNK = 1 << 18 };

typedef struct {
    const float *x;
    float *m;   /* [chunks] */
} absmax_ctx;

static void absmax_task(void *vctx, int64_t a, int64_t b) {
    const absmax_ctx *c = vctx;
    c->m[a / ABSMAX_CHUNK] = mq_absmax(c->x + a, b - a);
}

float mq_absmax_pool(const float *x, int64_t n) {
    const int64_t nc = (n + ABSMAX_CHUNK - 1) / ABSMAX_CHUNK;
    float *m = nc > 1 ? malloc((size_t)nc * sizeof *m) : NULL;
    if (!m) return mq_absmax(x, n);   /* one chunk, or no memory for the maxima: here */
    absmax_ctx c = {x, m};
    mq_parallel_ranges(n, ABSMAX_CHUNK, true, absmax_task, &c);
    float r = 0;
    for (int64_t t = 0; t < nc; t++) {
        if (m[t] != m[t]) {   /* NaN wins, as in mq_absmax */
            r = NAN;
            break;
        }
        r = m[t] > r ? m[t] : r;
    }
    free(m);
    return r;
}

/* ---- per-value ops ------------------------------------------------------------------------ */

/* Code and dequantized value of x for a group whose step is `step`. */
static inline uint8_t quant_step(const mq_qspec *s, float step, float zero, float x) {
    if (s->scheme == MQ_QS_KQUANT) {
        uint8_t c;
        mq_kq_qdq(mq_kq_info_of(s->kq), step, zero, &x, 1, &c, NULL);
        return c;
    }
    return mq_code_of_step(s->scheme == MQ_QS_INT4, s->asym, step, zero, x);
}

static inline float dequant_step(const mq_qspec *s, float step, float zero, uint8_t code) {
    if (s->scheme == MQ_QS_KQUANT) {
        const mq_gparams g = {step, zero, 0, 0};
        return mq_kq_value(mq_kq_info_of(s->kq), &g, code);
    }
    return mq_value_of_code(s->scheme == MQ_QS_INT4, s->asym, step, zero, code);
}

uint8_t mq_quant_value(const mq_qspec *s, float global_scale, const mq_gparams *g, float x) {
    return quant_step(s, mq_group_step(s, global_scale, g), g->zero, x);
}

float mq_dequant_value(const mq_qspec *s, float global_scale, const mq_gparams *g, uint8_t code) {
    return dequant_step(s, mq_group_step(s, global_scale, g), g->zero, code);
}

void mq_qdq_n(const mq_qspec *s, float global_scale, const mq_gparams *g, const float *x,
              int64_t n, uint8_t *codes, float *deq) {
    for (int64_t i = 0; i < n; i++) {
        float step = mq_group_step(s, global_scale, &g[i]);
        uint8_t c = quant_step(s, step, g[i].zero, x[i]);
        if (codes) codes[i] = c;
        if (deq) deq[i] = dequant_step(s, step, g[i].zero, c);
    }
}

/* ---- group parameters --------------------------------------------------------------------- */

void mq_int4_asym_params(const mq_qspec *s, float lo, float hi, mq_gparams *out) {
    out->zero = 0.0f;
    out->scale_code = 0;
    float scale = (hi - lo) / 15.0f;
    if (scale > 0.0f) {
        scale = mq_round_to_dtype(scale, s->scale_dtype);
        if (scale == 0.0f) scale = mq_round_to_dtype(0x1p-24f, s->scale_dtype);
        float z = rintf(-lo / scale);
        float zmin = (float)s->int4_zero_min;
        out->zero = z < zmin ? zmin : z > 15.0f ? 15.0f : z;
    } else {
        scale = 0.0f;
    }
    out->scale = scale;
}

/* NVFP4's scale code of the block scale t: t clamped to [scale_min, 448], then encoded. */
static inline uint32_t nvfp4_encode_clamped(const mq_qspec *s, float t) {
    t = t < s->nvfp4_scale_min ? s->nvfp4_scale_min : t;
    t = t > E4M3_MAX ? E4M3_MAX : t;
    return mq_e4m3_encode(t);
}

/* Params from the max-based statistic times multiplier m (m = 1: plain RTN). */
static void params_scaled(const mq_qspec *s, float global_scale, float amax, float xmin,
                          float xmax, float m, mq_gparams *out) {
    out->zero = 0.0f;
    out->scale_code = 0;
    switch (s->scheme) {
    case MQ_QS_NVFP4: {
        float t = amax / E2M1_MAX;
        t = s->nvfp4_conv == MQ_NVFP4_MUL ? t / global_scale : global_scale * t;
        if (m != 1.0f) t = t * m;
        uint8_t code = (uint8_t)nvfp4_encode_clamped(s, t);
        if (code == 0 && amax > 0) code = 0x01;   /* keep a tiny non-zero block alive: 2^-9 */
        out->scale_code = code;
        out->scale = mq_e4m3_value(code);
        return;
    }
    case MQ_QS_MXFP4: {
        float t = amax / E2M1_MAX;
        if (m != 1.0f) t = t * m;
        if (!(amax > 0)) {
            out->scale_code = 0;
            out->scale = 0.0f;
            return;
        }
        out->scale_code = mq_e8m0_encode_ceil(t);
        out->scale = mq_e8m0_decode(out->scale_code);
        return;
    }
    case MQ_QS_INT4: {
        float scale;
        if (s->asym) {
            float lo = xmin < 0.0f ? xmin : 0.0f, hi = xmax > 0.0f ? xmax : 0.0f;
            if (m != 1.0f) {
                lo = lo * m;
                hi = hi * m;
            }
            mq_int4_asym_params(s, lo, hi, out);
            return;
        } else {
            /* signed scales: the group's largest magnitude takes the code -8, the grid's longer
             * side, whichever its sign (amax / 8 with the sign opposite to it) */
            const bool flip = s->int4_signed_scale && xmax > -xmin;
            scale = amax / (s->int4_signed_scale ? 8.0f : s->int4_sym_div);
            if (m != 1.0f) scale = scale * m;
            if (scale > 0.0f) {
                scale = mq_round_to_dtype(scale, s->scale_dtype);
                /* a non-zero group must not get a zero scale when the storage dtype underflows */
                if (scale == 0.0f) scale = 0x1p-24f;
                if (flip) scale = -scale;
            } else {
                scale = 0.0f;
            }
        }
        out->scale = scale;
        return;
    }
    default: out->scale = 0.0f; return;
    }
}

/* The search's error of nc candidate quantizers on the group (see formats.h): the obvious
 * per-value loop through quant_step / dequant_step, in value order, in double. */
void mq_mse_sse_ref(const mq_qspec *s, const float *step, const float *zero, int nc,
                    const float *x, int64_t n, int64_t stride, const float *h, double *sse) {
    for (int c = 0; c < nc; c++) {
        double e = 0.0;
        for (int64_t i = 0; i < n; i++) {
            float v = x[i * stride];
            double d = (double)v - dequant_step(s, step[c], zero[c],
                                                quant_step(s, step[c], zero[c], v));
            double d2 = d * d;
            e += h ? (double)h[i] * d2 : d2;
        }
        sse[c] = e;
    }
}

/* Candidates are scored MSE_CHUNK at a time (a multiple of the AVX2 twin's 8 lanes). */
enum { MSE_CHUNK = 32 };

typedef struct {
    mq_gparams cand[MSE_CHUNK];
    float step[MSE_CHUNK], zero[MSE_CHUNK];
    double sse[MSE_CHUNK];
    int n;
    double best;
    mq_gparams best_p;
    bool simd;   /* score with the AVX2 twin */
} mse_state;

/* Scores the pending candidates; the first one with the least error wins (strictly less than
 * the best so far), as in a one-by-one scan of the grid. */
static void mse_flush(const mq_qspec *s, const float *x, int64_t n, int64_t stride,
                      const float *h, mse_state *m) {
    if (!m->n) return;
    for (int k = m->n; k % 8; k++) {   /* padding lanes: any valid quantizer */
        m->step[k] = m->step[0];
        m->zero[k] = m->zero[0];
    }
#if defined(__x86_64__)
    if (m->simd)
        mq_mse_sse_avx2(s, m->step, m->zero, m->n, x, n, stride, h, m->sse);
    else
#endif
        mq_mse_sse_ref(s, m->step, m->zero, m->n, x, n, stride, h, m->sse);
    for (int k = 0; k < m->n; k++)
        if (m->sse[k] < m->best) {
            m->best = m->sse[k];
            m->best_p = m->cand[k];
        }
    m->n = 0;
}

/* NVFP4's scale code of the block scale t (t0 times a multiplier) for amax > 0: as
 * params_scaled computes it, a 0 code raised to the smallest subnormal. */
static inline uint32_t nvfp4_code_of(const mq_qspec *s, float t) {
    const uint32_t code = nvfp4_encode_clamped(s, t);
    return code == 0 ? 0x01u : code;
}

/* The NVFP4 scale code of multiplier m, as params_scaled computes it from t0 = the block scale
 * before the multiplier (amax / 6 with the global scale applied), for amax > 0. */
static inline uint8_t nvfp4_code(const mq_qspec *s, float t0, float m) {
    return (uint8_t)nvfp4_code_of(s, t0 * m);   /* t0 * 1 = t0: as params_scaled skipping m == 1 */
}

/* Multiplier i of the search grid. */
static inline float grid_m(const mq_qspec *s, int32_t i) {
    return s->mse_steps == 1 ? s->mse_lo
                             : s->mse_lo + (s->mse_hi - s->mse_lo) * (float)i /
                                               (float)(s->mse_steps - 1);
}

/* The search's candidates of one group in grid order (m_i = lo + (hi - lo) i / (steps - 1),
 * increasing), consecutive repeats removed (rounded scales repeat along the grid: E4M3 has 3
 * mantissa bits). */
typedef struct {
    const mq_qspec *s;
    float gs, amax, xmin, xmax, t0;
    int32_t i;            /* next grid point */
    unsigned code, last;  /* NVFP4 dense grid: next and last code */
    bool dense;
    mq_gparams prev;
} cand_iter;

/* What the grid gives every group of a spec: its first and last multipliers and whether it is
 * dense for NVFP4 (consecutive points less than 6.25% apart; the default grid: 3.6%). Then no
 * E4M3 code lies strictly between the codes of two neighbours (each code rounds an interval
 * wider than 6.8% of its value; clamping only narrows the gaps), so a group's candidates are
 * every code from the first point's to the last point's: two encodes instead of one per point. */
typedef struct {
    float m_first, m_last;
    bool dense;
} grid_info;

static grid_info grid_info_of(const mq_qspec *s) {
    const int32_t steps = s->mse_steps;
    grid_info g = {grid_m(s, 0), grid_m(s, steps - 1), false};
    g.dense = s->scheme == MQ_QS_NVFP4 && steps > 1 && s->mse_lo > 0 && s->mse_hi >= s->mse_lo &&
              (s->mse_hi - s->mse_lo) / (float)(steps - 1) < 0.0625f * s->mse_lo;
    return g;
}

static inline void cand_init(cand_iter *it, const mq_qspec *s, const grid_info *grid, float gs,
                             float amax, float xmin, float xmax) {
    it->s = s;
    it->gs = gs;
    it->amax = amax;
    it->xmin = xmin;
    it->xmax = xmax;
    it->i = 0;
    it->dense = false;
    if (s->scheme != MQ_QS_NVFP4) return;
    float t0 = amax / E2M1_MAX;
    it->t0 = t0 = s->nvfp4_conv == MQ_NVFP4_MUL ? t0 / gs : gs * t0;
    it->dense = grid->dense && isfinite(t0);
    if (it->dense) {
        it->code = nvfp4_code(s, t0, grid->m_first);
        it->last = nvfp4_code(s, t0, grid->m_last);
    }
}

static inline bool cand_next(cand_iter *it, mq_gparams *c) {
    if (it->dense) {   /* distinct by construction */
        if (it->code > it->last) return false;
        *c = (mq_gparams){mq_e4m3_value((uint8_t)it->code), 0.0f, (uint8_t)it->code, 0};
        it->code++;
        return true;
    }
    const mq_qspec *s = it->s;
    while (it->i < s->mse_steps) {
        float m = grid_m(s, it->i);
        if (s->scheme == MQ_QS_NVFP4) {
            uint8_t code = nvfp4_code(s, it->t0, m);
            *c = (mq_gparams){mq_e4m3_value(code), 0.0f, code, 0};
        } else {
            params_scaled(s, it->gs, it->amax, it->xmin, it->xmax, m, c);
        }
        bool repeat = it->i > 0 && c->scale == it->prev.scale && c->zero == it->prev.zero;
        it->i++;
        if (repeat) continue;
        it->prev = *c;
        return true;
    }
    return false;
}

/* A group's plain (m = 1) params from its range [xmin, xmax] (xmin <= 0 <= xmax); false if
 * there is nothing to search (no MSE, or an all-zero group), else the candidates' iterator. */
static bool group_start_range(const mq_qspec *s, const grid_info *grid, float global_scale,
                              float xmin, float xmax, mq_gparams *out, cand_iter *it) {
    const float amax = -xmin > xmax ? -xmin : xmax;
    params_scaled(s, global_scale, amax, xmin, xmax, 1.0f, out);
    if (!s->mse || !(amax > 0)) return false;
    cand_init(it, s, grid, global_scale, amax, xmin, xmax);
    return true;
}

/* The group's range statistics and its plain params (group_start_range). */
static bool group_start(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                        int64_t stride, mq_gparams *out, cand_iter *it) {
    float xmin = 0.0f, xmax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i * stride];
        xmin = v < xmin ? v : xmin;
        xmax = v > xmax ? v : xmax;
    }
    const grid_info grid = grid_info_of(s);
    return group_start_range(s, &grid, global_scale, xmin, xmax, out, it);
}

void mq_group_params_h(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                       int64_t stride, const float *h, mq_gparams *out) {
    /* a K-quant sub-block's scale is a multiple of its block's: mq_kq_fit_block */
    MQ_ASSERT(s->scheme != MQ_QS_KQUANT);
    cand_iter it;
    if (!group_start(s, global_scale, x, n, stride, out, &it)) return;
    /* the first least error wins */
    mse_state st;
    st.n = 0;
    st.best = INFINITY;
    st.best_p = *out;
    st.simd = false;
#if defined(__x86_64__)
    st.simd = mq_cpu_has_avx2_fma() && !mq_force_ref();
#endif
    mq_gparams c;
    while (cand_next(&it, &c)) {
        if (st.n == MSE_CHUNK) mse_flush(s, x, n, stride, h, &st);
        st.cand[st.n] = c;
        st.step[st.n] = mq_group_step(s, global_scale, &c);
        st.zero[st.n] = c.zero;
        st.n++;
    }
    mse_flush(s, x, n, stride, h, &st);
    *out = st.best_p;
}

int mq_group_candidates(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                        int64_t stride, mq_gparams *plain, mq_gparams *cand) {
    cand_iter it;
    if (!group_start(s, global_scale, x, n, stride, plain, &it)) return 0;
    int k = 0;
    while (cand_next(&it, &cand[k])) k++;
    return k;
}

int mq_group_candidates_rows(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                             int64_t ld, int64_t rows, mq_gparams *plain, mq_gparams *cand,
                             int64_t room, int *nc, float *step, float *zero) {
    enum { BLOCK = 64 };
    const grid_info grid = grid_info_of(s);
    /* every non-negative E4M3 code's value and step, once a call (a division a candidate else) */
    float code_value[128], code_step[128];
    if (s->scheme == MQ_QS_NVFP4)
        for (int c = 0; c < 128; c++) {
            const mq_gparams g = {mq_e4m3_value((uint8_t)c), 0.0f, (uint8_t)c, 0};
            code_value[c] = g.scale;
            code_step[c] = mq_group_step(s, global_scale, &g);
        }
    /* NVFP4 on a dense grid (the default): a row's candidates are the codes from its first
     * point's to its last point's, and its plain params the code of t0 itself: three encodes a
     * row, computed for a block of rows in straight-line loops of fixed length */
    const bool codes_only = s->mse && grid.dense;
    const bool mul = s->nvfp4_conv == MQ_NVFP4_MUL;
    int most = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += BLOCK) {
        const int64_t m = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        float lo[BLOCK], hi[BLOCK], t0[BLOCK];
        uint32_t c_plain[BLOCK], c_first[BLOCK], c_last[BLOCK];
        for (int64_t i = 0; i < BLOCK; i++) lo[i] = hi[i] = 0.0f;
        /* each row's range as group_start takes it, value by value in the same order */
        for (int64_t t = 0; t < n; t++) {
            const float *xt = x + t * ld + r0;
            for (int64_t i = 0; i < m; i++) {
                const float v = xt[i];
                lo[i] = v < lo[i] ? v : lo[i];
                hi[i] = v > hi[i] ? v : hi[i];
            }
        }
        if (codes_only)
            for (int64_t i = 0; i < BLOCK; i++) {   /* rows past m: zeros, unused */
                const float amax = -lo[i] > hi[i] ? -lo[i] : hi[i], t = amax / E2M1_MAX;
                t0[i] = mul ? t / global_scale : global_scale * t;
                c_plain[i] = nvfp4_code_of(s, t0[i]);
                c_first[i] = nvfp4_code_of(s, t0[i] * grid.m_first);
                c_last[i] = nvfp4_code_of(s, t0[i] * grid.m_last);
            }
        for (int64_t i = 0; i < m; i++) {
            mq_gparams *c = cand + (r0 + i) * room, *p = &plain[r0 + i];
            const float amax = -lo[i] > hi[i] ? -lo[i] : hi[i];
            int k = 0;
            if (codes_only && amax > 0 && isfinite(t0[i])) {
                *p = (mq_gparams){code_value[c_plain[i]], 0.0f, (uint8_t)c_plain[i], 0};
                for (uint32_t code = c_first[i]; code <= c_last[i]; code++, k++) {
                    c[k] = (mq_gparams){code_value[code], 0.0f, (uint8_t)code, 0};
                    if (step) {
                        step[k * rows + r0 + i] = code_step[code];
                        zero[k * rows + r0 + i] = 0.0f;
                    }
                }
            } else {
                cand_iter it;
                if (group_start_range(s, &grid, global_scale, lo[i], hi[i], p, &it))
                    while (cand_next(&it, &c[k])) k++;
                for (int j = 0; step && j < (k > 0 ? k : 1); j++) {
                    const mq_gparams *g = k > 0 ? &c[j] : p;
                    step[j * rows + r0 + i] = mq_group_step(s, global_scale, g);
                    zero[j * rows + r0 + i] = g->zero;
                }
            }
            nc[r0 + i] = k;
            most = k > most ? k : most;
        }
    }
    return most;
}

void mq_group_params(const mq_qspec *s, float global_scale, const float *x, int64_t n,
                     int64_t stride, mq_gparams *out) {
    mq_group_params_h(s, global_scale, x, n, stride, NULL, out);
}

/* ---- tensors ------------------------------------------------------------------------------ */

static moeq_status qtensor_alloc(mq_qtensor *q, const mq_qspec *s, int64_t rows, int64_t cols,
                                 const char *tensor, bool zero) {
    memset(q, 0, sizeof *q);
    moeq_status st = mq_qspec_check(s, rows, cols, tensor);
    if (st) return st;
    q->spec = *s;
    q->rows = rows;
    q->cols = cols;
    q->group_size = mq_qspec_group(s, cols);
    q->n_groups = cols / q->group_size;
    q->global_scale = 1.0f;
    const size_t np = (size_t)rows * (size_t)q->n_groups;
    q->codes = zero ? mq_alloc_zero((size_t)rows * (size_t)cols, "quantized codes")
                    : mq_alloc_array((size_t)rows, (size_t)cols, "quantized codes");
    /* zeroed as the codes are: a fresh mapping comes zero (a memset here ran on the calling
     * thread before GPTQ's tasks, 2 MB for each of a chunk's expert Linears) */
    size_t pbytes = 0;
    q->params = !mq_mul_size(np, sizeof(mq_gparams), &pbytes) ? NULL
              : zero ? mq_alloc_zero(pbytes, "quantization params")
                     : mq_alloc(pbytes, "quantization params");
    if (!q->codes || !q->params) {
        mq_qtensor_free(q);
        return mq_err_prefix(MOEQ_E_NOMEM, "tensor '%s'", tensor);
    }
    return MOEQ_OK;
}

moeq_status mq_qtensor_init(mq_qtensor *q, const mq_qspec *s, int64_t rows, int64_t cols,
                            const char *tensor) {
    return qtensor_alloc(q, s, rows, cols, tensor, true);
}

moeq_status mq_qtensor_init_unset(mq_qtensor *q, const mq_qspec *s, int64_t rows, int64_t cols,
                                  const char *tensor) {
    return qtensor_alloc(q, s, rows, cols, tensor, false);
}

void mq_qtensor_free(mq_qtensor *q) {
    if (!q) return;
    mq_free(q->codes);
    mq_free(q->params);
    mq_free(q->g_idx);
    q->codes = NULL;
    q->params = NULL;
    q->g_idx = NULL;
}

moeq_status mq_check_finite(const float *w, int64_t rows, int64_t cols, const char *tensor) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float v = w[r * cols + c];
            if (!isfinite(v))
                return mq_err(MOEQ_E_NUMERIC, "tensor '%s': non-finite weight %g at row %lld, column %lld",
                              tensor, (double)v, (long long)r, (long long)c);
        }
    return MOEQ_OK;
}

/* Finiteness of several arrays on the pool, in chunks of FINITE_CHUNK values (a lone large weight
 * no longer runs on one thread). */
enum { FINITE_CHUNK = 1 << 18 };

typedef struct {
    const float *const *x;
    const int64_t *n, *first;   /* first[i]: array i's first chunk; first[count]: all chunks */
    int64_t count;
    uint8_t *bad;               /* [chunks] */
} finite_ctx;

static void finite_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const finite_ctx *c = vctx;
    int64_t i = 0;   /* the array of chunk t: a binary search over first[] */
    for (int64_t lo = 0, hi = c->count - 1; lo <= hi;) {
        const int64_t mid = (lo + hi) / 2;
        if (c->first[mid] <= t) i = mid, lo = mid + 1;
        else hi = mid - 1;
    }
    const int64_t a = (t - c->first[i]) * FINITE_CHUNK, b = a + FINITE_CHUNK < c->n[i] ? a + FINITE_CHUNK : c->n[i];
    const float *x = c->x[i];
    int bad = 0;   /* x - x is 0 for finite x, NaN for inf or NaN (an OR the compiler vectorises) */
    for (int64_t k = a; k < b; k++) bad |= (x[k] - x[k]) != 0.0f;
    c->bad[t] = (uint8_t)bad;
}

moeq_status mq_all_finite_many(const float *const *x, const int64_t *n, int64_t count, uint8_t *ok) {
    int64_t *first = malloc(((size_t)count + 1) * sizeof *first);
    if (!first) return mq_err(MOEQ_E_NOMEM, "out of memory for the finiteness checks");
    first[0] = 0;
    for (int64_t i = 0; i < count; i++)
        first[i + 1] = first[i] + (x[i] && n[i] > 0 ? (n[i] + FINITE_CHUNK - 1) / FINITE_CHUNK : 0);
    uint8_t *bad = malloc((size_t)first[count] + 1);
    if (!bad) {
        free(first);
        return mq_err(MOEQ_E_NOMEM, "out of memory for the finiteness checks");
    }
    finite_ctx c = {x, n, first, count, bad};
    mq_parallel_for(first[count], finite_task, &c);
    for (int64_t i = 0; i < count; i++) {
        ok[i] = 1;
        for (int64_t t = first[i]; t < first[i + 1]; t++) ok[i] &= (uint8_t)!bad[t];
    }
    free(bad);
    free(first);
    return MOEQ_OK;
}

#define ROWS_PER_TASK 8

typedef struct {
    const float *w;
    mq_qtensor *q;
} rtn_ctx;

static void rtn_task(void *vctx, int64_t r0, int64_t r1) {
    rtn_ctx *c = vctx;
    mq_qtensor *q = c->q;
    if (q->spec.scheme == MQ_QS_KQUANT) {
        for (int64_t r = r0; r < r1; r++)
            mq_kq_quantize_row(mq_kq_info_of(q->spec.kq), &q->spec, c->w + r * q->cols, q->cols, NULL,
                               q->params + r * q->n_groups, q->codes + r * q->cols);
        return;
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < q->n_groups; g++) {
            const float *x = c->w + r * q->cols + g * q->group_size;
            mq_gparams *p = &q->params[r * q->n_groups + g];
            mq_group_params(&q->spec, q->global_scale, x, q->group_size, 1, p);
            float step = mq_group_step(&q->spec, q->global_scale, p);
            uint8_t *codes = q->codes + r * q->cols + g * q->group_size;
            for (int64_t i = 0; i < q->group_size; i++)
                codes[i] = quant_step(&q->spec, step, p->zero, x[i]);
        }
}

moeq_status mq_quantize_rtn(const mq_qspec *s, const float *w, int64_t rows, int64_t cols,
                            float global_scale, const char *tensor, mq_qtensor *out) {
    moeq_status st = mq_qtensor_init(out, s, rows, cols, tensor);
    if (st) return st;
    const int64_t n = rows * cols;
    uint8_t ok = 0;
    if ((st = mq_all_finite_many(&w, &n, 1, &ok))) return st;
    if (!ok && (st = mq_check_finite(w, rows, cols, tensor))) return st;   /* the message */
    if (s->scheme == MQ_QS_NVFP4)
        out->global_scale = global_scale > 0 ? global_scale
                                             : mq_nvfp4_global_scale(s, mq_absmax_pool(w, rows * cols));
    rtn_ctx c = {w, out};
    mq_parallel_ranges(rows, ROWS_PER_TASK, true, rtn_task, &c);
    return MOEQ_OK;
}

typedef struct {
    const mq_qtensor *q;
    float *w;
} deq_ctx;

/* The 16 codes' values before the step (E2M1's, or the INT4 code less 8 or the zero point):
 * value = base[code] * step is dequant_step's product, the same bits, without its branches and
 * call per value (a layer's experts are 100M values that every rank dequantizes under mpirun). */
static void code_base(const mq_qspec *s, float zero, float base[16]) {
    for (int c = 0; c < 16; c++)
        base[c] = s->scheme != MQ_QS_INT4 ? mq_e2m1_decode((uint8_t)c)
                : s->asym                 ? (float)c - zero
                                          : (float)c - 8.0f;
}

void mq_dequant_n(const mq_qspec *s, float global_scale, const mq_gparams *g, const uint8_t *codes,
                  int64_t n, float *out) {
    if (s->scheme == MQ_QS_KQUANT) {
        const mq_kq_info *k = mq_kq_info_of(s->kq);
        for (int64_t i = 0; i < n; i++) out[i] = mq_kq_value(k, &g[i], codes[i]);
        return;
    }
    float base[16];
    const bool asym = s->scheme == MQ_QS_INT4 && s->asym;
    code_base(s, 0.0f, base);
    for (int64_t i = 0; i < n; i++) {
        const float step = mq_group_step(s, global_scale, &g[i]);
        out[i] = (asym ? (float)codes[i] - g[i].zero : base[codes[i] & 15]) * step;
    }
}

void mq_dequantize_rows(const mq_qtensor *q, float *w_all, int64_t r0, int64_t r1) {
    const bool asym = q->spec.scheme == MQ_QS_INT4 && q->spec.asym;
    float base[16];
    code_base(&q->spec, 0.0f, base);
    if (r1 > q->rows) r1 = q->rows;
    if (q->spec.scheme == MQ_QS_KQUANT) {
        for (int64_t r = r0; r < r1; r++)
            mq_kq_dequant_row(mq_kq_info_of(q->spec.kq), q->params + r * q->n_groups, q->codes + r * q->cols, q->cols,
                              w_all + r * q->cols);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const mq_gparams *p = &q->params[r * q->n_groups];
        const uint8_t *codes = q->codes + r * q->cols;
        float *w = w_all + r * q->cols;
        if (!q->g_idx) {
            for (int64_t g = 0; g < q->n_groups; g++) {
                const float step = mq_group_step(&q->spec, q->global_scale, &p[g]);
                if (asym) code_base(&q->spec, p[g].zero, base);
                const uint8_t *cg = codes + g * q->group_size;
                float *wg = w + g * q->group_size;
                for (int64_t i = 0; i < q->group_size; i++) wg[i] = base[cg[i] & 15] * step;
            }
        } else {
            for (int64_t i = 0; i < q->cols; i++) {
                const mq_gparams *pg = &p[q->g_idx[i]];
                w[i] = dequant_step(&q->spec, mq_group_step(&q->spec, q->global_scale, pg),
                                    pg->zero, codes[i]);
            }
        }
    }
}

static void deq_task(void *vctx, int64_t r0, int64_t r1) {
    const deq_ctx *c = vctx;
    mq_dequantize_rows(c->q, c->w, r0, r1);
}

void mq_dequantize(const mq_qtensor *q, float *w) {
    deq_ctx c = {q, w};
    mq_parallel_ranges(q->rows, ROWS_PER_TASK, true, deq_task, &c);
}
