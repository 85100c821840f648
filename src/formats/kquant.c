/*
 * llama.cpp's K-quants (Q3_K, Q4_K, Q5_K, Q6_K) and their 32-value fallbacks (Q4_0, Q5_0, Q5_1,
 * Q8_0) as a grid moeq rounds to: the block layouts of ggml-common.h and ggml-quants.c
 * (dequantize_row_* for the values, quantize_row_*_ref for the byte order), and the search for a
 * block's scales. Layouts and value formulas: kquant.h.
 *
 * The search follows ggml's two levels: each sub-block's step (and offset) fitted by weighted
 * least squares over a grid of trial inverse scales (make_qkx2_quants for the asymmetric types,
 * make_qx_quants for the symmetric ones), then the fp16 super-scale and the integer
 * multipliers. ggml rounds each sub-block's scale to its multiplier once; with the spec's MSE
 * search moeq tries the super-scale over the grid and, for each, the neighbouring multipliers of
 * every sub-block, scoring each candidate by the weighted squared error of the values rounded to
 * the exact grid the file will hold.
 */
#include <math.h>
#include <string.h>

#include "formats/kquant.h"
#include "formats/cpu/simd.h"

const int8_t mq_kq_iq4_table[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                    1,    13,   25,  38,  53,  69,  89,  113};

static const mq_kq_info k_info[MQ_KQ_COUNT] = {
    /* name, ggml, block, sub, bytes, qmin, qmax, zero, mult_lo, mult_hi, min_hi */
    [MQ_KQ_Q3_K] = {"q3_K", 11, 256, 16, 110, 0, 7, 4, -32, 31, 0},
    [MQ_KQ_Q4_K] = {"q4_K", 12, 256, 32, 144, 0, 15, -1, 0, 63, 63},
    [MQ_KQ_Q5_K] = {"q5_K", 13, 256, 32, 176, 0, 31, -1, 0, 63, 63},
    [MQ_KQ_Q6_K] = {"q6_K", 14, 256, 16, 210, 0, 63, 32, -128, 127, 0},
    [MQ_KQ_Q5_0] = {"q5_0", 6, 32, 32, 22, 0, 31, 16, 0, 0, 0},
    [MQ_KQ_Q5_1] = {"q5_1", 7, 32, 32, 24, 0, 31, -1, 0, 0, 0},
    [MQ_KQ_Q8_0] = {"q8_0", 8, 32, 32, 34, 1, 255, 128, 0, 0, 0},
    [MQ_KQ_Q4_0] = {"q4_0", 2, 32, 32, 18, 0, 15, 8, 0, 0, 0},
    [MQ_KQ_IQ4_NL] = {"iq4_nl", 20, 32, 32, 18, 0, 15, 0, 0, 0, 0, mq_kq_iq4_table},
    [MQ_KQ_IQ4_XS] = {"iq4_xs", 23, 256, 32, 136, 0, 15, 0, -32, 31, 0, mq_kq_iq4_table},
};

const mq_kq_info *mq_kq_info_of(mq_kq_type t) {
    return t >= 0 && t < MQ_KQ_COUNT ? &k_info[t] : &k_info[MQ_KQ_Q4_K];
}

const char *mq_kq_name(mq_kq_type t) { return mq_kq_info_of(t)->name; }

mq_qspec mq_kq_spec(mq_kq_type t) {
    mq_qspec s = mq_qspec_default(MQ_QS_KQUANT);
    s.kq = t;
    s.group_size = mq_kq_info_of(t)->sub;
    return s;
}

bool mq_kq_parse(const char *name, mq_kq_type *t) {
    for (int i = 0; i < MQ_KQ_COUNT; i++) {
        const char *a = k_info[i].name, *b = name;
        while (*a && *b && (*a | 0x20) == (*b | 0x20)) a++, b++;
        if (!*a && !*b) {
            *t = (mq_kq_type)i;
            return true;
        }
    }
    return false;
}

bool mq_kq_of_ggml(uint32_t ggml_type, mq_kq_type *t) {
    for (int i = 0; i < MQ_KQ_COUNT; i++)
        if (k_info[i].ggml_type == ggml_type) {
            *t = (mq_kq_type)i;
            return true;
        }
    return false;
}

double mq_kq_bpw(mq_kq_type t) {
    const mq_kq_info *k = mq_kq_info_of(t);
    return 8.0 * k->bytes / k->block;
}

static inline bool has_sub(const mq_kq_info *t) { return t->mult_hi != 0; }

int mq_kq_mult(const mq_kq_info *t, uint8_t c) {
    if (!has_sub(t)) return 1;
    if (t->mult_lo == -128) return (int8_t)c;
    if (t->mult_lo < 0) return (int)c - 32;
    return c;
}

static inline uint8_t mult_code(const mq_kq_info *t, int mult) {
    if (t->mult_lo == -128) return (uint8_t)(int8_t)mult;
    return (uint8_t)(t->mult_lo < 0 ? mult + 32 : mult);
}

/* ---- rounding ------------------------------------------------------------------------------- */

/* The index of the table value nearest v (16 ascending values; a tie between two goes to the
 * lower): the number of midpoints between neighbours that v exceeds. NaN: 0. */
static inline uint8_t nearest_in_table(const int8_t *tab, float v) {
    int lo = 0, hi = 15;   /* the midpoints below v are a prefix: bisect for its length */
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (v > 0.5f * (float)(tab[mid] + tab[mid + 1])) lo = mid + 1;
        else hi = mid;
    }
    return (uint8_t)lo;
}

static inline uint8_t round_code(const mq_kq_info *t, float step, float off, float x) {
    if (t->table) return step == 0.0f ? nearest_in_table(t->table, 0.0f) : nearest_in_table(t->table, x / step);
    if (step == 0.0f) return (uint8_t)(t->zero < 0 ? t->qmin : t->zero);
    float q = t->zero < 0 ? rintf((x + off) / step) : rintf(x / step) + (float)t->zero;
    q = q < (float)t->qmin ? (float)t->qmin : q > (float)t->qmax ? (float)t->qmax : q;
    return (uint8_t)(int)q;
}

/* The values a table type's SIMD rounding took (the first of those left to the scalar loop). */
static int64_t qdq_table_simd(const mq_kq_info *t, const float *step, bool per_value, const float *x,
                              int64_t n, uint8_t *code, float *dq) {
#if defined(__x86_64__)
    if (t->table && mq_cpu_has_avx2_fma() && !mq_force_ref())
        return mq_kq_qdq_table_avx2(t->table, step, per_value, x, n, code, dq);
#endif
    (void)t, (void)step, (void)per_value, (void)x, (void)n, (void)code, (void)dq;
    return 0;
}

void mq_kq_qdq(const mq_kq_info *t, float step, float off, const float *x, int64_t n,
               uint8_t *code, float *dq) {
    const mq_gparams g = {step, off, 0, 0};
    for (int64_t i = qdq_table_simd(t, &step, false, x, n, code, dq); i < n; i++) {
        const uint8_t c = round_code(t, step, off, x[i]);
        if (code) code[i] = c;
        if (dq) dq[i] = mq_kq_value(t, &g, c);
    }
}

void mq_kq_qdq_column(const mq_kq_info *t, const float *step, const float *off, const float *x,
                      int64_t n, uint8_t *code, float *dq) {
    for (int64_t i = qdq_table_simd(t, step, true, x, n, code, dq); i < n; i++) {
        const mq_gparams g = {step[i], off[i], 0, 0};
        const uint8_t c = round_code(t, step[i], off[i], x[i]);
        code[i] = c;
        dq[i] = mq_kq_value(t, &g, c);
    }
}

/* ---- scoring candidate grids ---------------------------------------------------------------- */

void mq_kq_sse_ref(const mq_kq_info *t, const float *step, const float *off, int nc, const float *x,
                   int64_t n, int64_t stride, const float *w, double *sse) {
    for (int c = 0; c < nc; c++) {
        const mq_gparams g = {step[c], off[c], 0, 0};
        double e = 0;
        for (int64_t i = 0; i < n; i++) {
            const float v = x[i * stride];
            const double d = (double)v - mq_kq_value(t, &g, round_code(t, step[c], off[c], v));
            e += (w ? w[i] : 1.0) * d * d;
        }
        sse[c] = e;
    }
}

/* Candidates scored per sub-block and call (a multiple of the AVX2 twin's 8 lanes). */
enum { KQ_CAND = 256 };

/* mq_kq_sse_ref's scores by a SIMD twin where the CPU has one (bit-identical): the table types'
 * by the AVX-512 one where there is AVX-512, every type by the AVX2 one where there is AVX2; nc
 * <= KQ_CAND, the arrays KQ_CAND long. */
static void score(const mq_kq_info *t, float *step, float *off, int nc, const float *x, int64_t n,
                  int64_t stride, const float *w, double *sse) {
#if defined(__x86_64__)
    if (nc > 0 && mq_cpu_has_avx2_fma() && !mq_force_ref()) {
        for (int k = nc; k % 8; k++) {   /* padding lanes: any valid grid */
            step[k] = step[0];
            off[k] = off[0];
        }
        if (t->table && mq_cpu_has_avx512()) mq_kq_sse_table_avx512(t, step, nc, x, n, stride, w, sse);
        else mq_kq_sse_avx2(t, step, off, nc, x, n, stride, w, sse);
        return;
    }
#endif
    mq_kq_sse_ref(t, step, off, nc, x, n, stride, w, sse);
}

/* ---- one sub-block's continuous fit ----------------------------------------------------------- */

enum { FIT_STEPS = 20 };

void mq_kq_asym_trials_ref(const float *x, int64_t n, int64_t st, const float *w,
                           const mq_kq_sums *s, const float *iscale, int nt, float *D, float *sc,
                           float *mn, double *e) {
    const int nmax = s->nmax;
    for (int k = 0; k < nt; k++) {
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int64_t i = 0; i < n; i++) {
            float l = rintf(iscale[k] * (x[i * st] - s->min));
            l = l < 0 ? 0 : l > nmax ? (float)nmax : l;
            const float wi = w ? w[i] : 1.0f;
            sum_l += wi * l;
            sum_l2 += wi * l * l;
            sum_xl += wi * l * x[i * st];
        }
        D[k] = s->sum_w * sum_l2 - sum_l * sum_l;
        sc[k] = (s->sum_w * sum_xl - s->sum_x * sum_l) / D[k];
        mn[k] = (sum_l2 * s->sum_x - sum_l * sum_xl) / D[k];
        if (s->clamp && mn[k] > 0) {
            mn[k] = 0;
            sc[k] = sum_xl / sum_l2;
        }
        double err = 0;
        for (int64_t i = 0; i < n; i++) {
            float l = rintf(iscale[k] * (x[i * st] - s->min));
            l = l < 0 ? 0 : l > nmax ? (float)nmax : l;
            const float d = sc[k] * l + mn[k] - x[i * st];
            err += (double)(w ? w[i] : 1.0f) * d * d;
        }
        e[k] = err;
    }
}

/* Asymmetric: the grid scale * l + min (l = 0..nmax) with the least weighted squared error among
 * the trial inverse scales (nmax - 1 + 0.1 k) / (max - min), k = 0..20, each refitted by least
 * squares for its codes (ggml's make_qkx2_quants with rmin -1, rdelta 0.1, nstep 20). clamp: the
 * grid reaches 0 (min <= 0: the K-quants' mins are stored unsigned). *off = -min. */
static void fit_asym(const float *x, int64_t st, const float *w, int n, int nmax, bool clamp,
                     float *scale, float *off) {
    float min = x[0], max = x[0], sum_w = 0, sum_x = 0;
    for (int i = 0; i < n; i++) {
        const float v = x[i * st], wi = w ? w[i] : 1.0f;
        min = v < min ? v : min;
        max = v > max ? v : max;
        sum_w += wi;
        sum_x += wi * v;
    }
    if (clamp && min > 0) min = 0;
    if (!(max > min)) {
        *scale = 0;
        *off = -min;
        return;
    }
    float iscale = (float)nmax / (max - min), best_scale = 1 / iscale, best_min = min;
    double best = 0;
    for (int i = 0; i < n; i++) {
        float l = rintf(iscale * (x[i * st] - min));
        l = l < 0 ? 0 : l > nmax ? (float)nmax : l;
        const float d = best_scale * l + min - x[i * st];
        best += (double)(w ? w[i] : 1.0f) * d * d;
    }
    /* the trials scored together (by the AVX2 twin where the CPU has it), then taken in order */
    enum { NT = FIT_STEPS + 1, NT8 = (NT + 7) / 8 * 8 };
    float is[NT8], D[NT8], sc[NT8], mn[NT8];
    double e[NT8];
    for (int k = 0; k < NT8; k++) is[k] = (-1.0f + 0.1f * (float)(k < NT ? k : 0) + (float)nmax) / (max - min);
    const mq_kq_sums sums = {min, sum_w, sum_x, nmax, clamp};
#if defined(__x86_64__)
    if (mq_cpu_has_avx2_fma() && !mq_force_ref())
        mq_kq_asym_trials_avx2(x, n, st, w, &sums, is, NT, D, sc, mn, e);
    else
#endif
        mq_kq_asym_trials_ref(x, n, st, w, &sums, is, NT, D, sc, mn, e);
    for (int k = 0; k < NT; k++)
        if (D[k] > 0 && e[k] < best) {
            best = e[k];
            best_scale = sc[k];
            best_min = mn[k];
        }
    *scale = best_scale;
    *off = -best_min;
}

void mq_kq_sym_trials_ref(const float *x, int64_t n, int64_t st, const float *w, int nmax,
                          const float *iscale, int nt, float *sumlx, float *suml2) {
    for (int k = 0; k < nt; k++) {
        float slx = 0, sl2 = 0;
        for (int64_t i = 0; i < n; i++) {
            float l = rintf(iscale[k] * x[i * st]);
            l = l < -nmax ? (float)-nmax : l > nmax - 1 ? (float)(nmax - 1) : l;
            const float wi = w ? w[i] : 1.0f;
            slx += wi * x[i * st] * l;
            sl2 += wi * l * l;
        }
        sumlx[k] = slx;
        suml2[k] = sl2;
    }
}

/* Symmetric: the scale of the grid l * scale (l = -nmax .. nmax-1) with the largest weighted
 * sum(x l)^2 / sum(l^2) among the trial inverse scales -(nmax + 0.1 k) / max, k = -9..9
 * (ggml's make_qx_quants), max the value of largest magnitude. 0 for an all-zero sub-block. */
static float fit_sym(const float *x, int64_t st, const float *w, int n, int nmax) {
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i * st]);
        if (a > amax) amax = a, max = x[i * st];
    }
    if (amax < 1e-15f) return 0.0f;
    /* the trials summed together (by the AVX2 twin where the CPU has it), then taken in order */
    enum { NT = 19, NT8 = (NT + 7) / 8 * 8 };
    float is[NT8], sumlx[NT8], suml2[NT8];
    for (int k = 0; k < NT8; k++) is[k] = -((float)nmax + 0.1f * (float)(k < NT ? k - 9 : 0)) / max;
#if defined(__x86_64__)
    if (mq_cpu_has_avx2_fma() && !mq_force_ref())
        mq_kq_sym_trials_avx2(x, n, st, w, nmax, is, NT, sumlx, suml2);
    else
#endif
        mq_kq_sym_trials_ref(x, n, st, w, nmax, is, NT, sumlx, suml2);
    float scale = 0, best = 0;
    bool any = false;
    for (int k = 0; k < NT; k++)
        if (suml2[k] > 0 && (!any || sumlx[k] * sumlx[k] > best * suml2[k])) {
            scale = sumlx[k] / suml2[k];
            best = scale * sumlx[k];
            any = true;
        }
    return any ? scale : -max / (float)nmax;
}

void mq_kq_table_trials_ref(const int8_t *tab, const float *x, int64_t n, int64_t st, const float *w,
                            const float *iscale, int nt, float *sxt, float *stt) {
    for (int k = 0; k < nt; k++) {
        float sx = 0, s2 = 0;
        for (int64_t i = 0; i < n; i++) {
            const float v = x[i * st], wi = w ? w[i] : 1.0f;
            const float tv = (float)tab[nearest_in_table(tab, v * iscale[k])];
            sx += wi * v * tv;
            s2 += wi * tv * tv;
        }
        sxt[k] = sx;
        stt[k] = s2;
    }
}

/* A table type's sub-block: the step s of the grid s * table[l] with the largest weighted
 * sum(x t)^2 / sum(t^2) (t the table values of the nearest codes; the least squared error for
 * those codes, at s = sum(x t) / sum(t^2)) among the trials that put the value of largest
 * magnitude, max, near either end of the table: s = max / (e + k), e = table[0] or table[15],
 * k = -TAB_TRIALS .. TAB_TRIALS. The table is lopsided (-127 .. 113), so which end the block's
 * largest value takes is part of the fit. 0 for an all-zero sub-block. */
enum { TAB_TRIALS = 8 };
static float fit_table(const int8_t *tab, const float *x, int64_t st, const float *w, int n) {
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i * st]);
        if (a > amax) amax = a, max = x[i * st];
    }
    if (amax < 1e-15f) return 0.0f;
    /* the trials summed together (by a SIMD twin where the CPU has one), then taken in order:
     * both ends of the table, k ascending */
    enum { NK = 2 * TAB_TRIALS + 1, NT = 2 * NK, NT8 = (NT + 7) / 8 * 8 };
    float is[NT8], sxt[NT8], stt[NT8];
    for (int u = 0; u < NT8; u++) {
        const int e = u < NT ? u / NK : 0, k = u < NT ? u % NK - TAB_TRIALS : 0;
        is[u] = 1.0f / (max / ((float)(e ? tab[15] : tab[0]) + (float)k));
    }
#if defined(__x86_64__)
    if (mq_cpu_has_avx2_fma() && !mq_force_ref()) {
        if (mq_cpu_has_avx512()) mq_kq_table_trials_avx512(tab, x, n, st, w, is, NT, sxt, stt);
        else mq_kq_table_trials_avx2(tab, x, n, st, w, is, NT, sxt, stt);
    } else
#endif
        mq_kq_table_trials_ref(tab, x, n, st, w, is, NT, sxt, stt);
    float scale = 0, best = -1;
    for (int u = 0; u < NT; u++)
        if (stt[u] > 0 && sxt[u] * sxt[u] > best * stt[u]) {
            best = sxt[u] * sxt[u] / stt[u];
            scale = sxt[u] / stt[u];
        }
    return best >= 0 ? scale : max / (float)tab[0];
}

/* One sub-block's continuous fit by its type's family: the step and (asymmetric) the offset. */
static void fit_sub_cont(const mq_kq_info *t, const float *x, int64_t st, const float *w, int n, float *scale,
                         float *off) {
    *off = 0.0f;
    if (t->table) *scale = fit_table(t->table, x, st, w, n);
    else if (t->zero < 0) fit_asym(x, st, w, n, t->qmax, true, scale, off);
    else *scale = fit_sym(x, st, w, n, t->zero);
}

/* ---- the block's super-scales ---------------------------------------------------------------- */

static inline float f16r(float v) { return mq_f16_to_f32(mq_f32_to_f16(v)); }

static inline float grid_mult(const mq_qspec *s, int i) {
    return s->mse_steps <= 1 ? s->mse_lo
                             : s->mse_lo + (s->mse_hi - s->mse_lo) * (float)i / (float)(s->mse_steps - 1);
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* A sub-block's candidate multipliers for super-scales d (and dmin): a0..a1 and mins b0..b1,
 * those within `radius` of its rounded continuous scale (and min). */
typedef struct {
    int a0, a1, b0, b1;
} mult_box;

/* fminf(fmaxf(v, -256), 256), NaN to -256 as there, without the library calls */
static inline float clamp256(float v) {
    v = v > -256.0f ? v : -256.0f;
    return v < 256.0f ? v : 256.0f;
}

static mult_box box_of(const mq_kq_info *t, float scale, float off, float d, float dmin, int radius) {
    const int asym = t->zero < 0;
    const int r = d != 0.0f ? clampi((int)rintf(clamp256(scale / d)), t->mult_lo, t->mult_hi) : 0;
    const int rm = asym && dmin != 0.0f ? clampi((int)rintf(clamp256(off / dmin)), 0, t->min_hi) : 0;
    const int rs = d != 0.0f ? radius : 0, rms = asym && dmin != 0.0f ? radius : 0;
    return (mult_box){clampi(r - rs, t->mult_lo, t->mult_hi), clampi(r + rs, t->mult_lo, t->mult_hi),
                      clampi(rm - rms, 0, t->min_hi), clampi(rm + rms, 0, t->min_hi)};
}

/* A block's values and its sub-blocks' continuous fits, for the search of its multipliers. */
typedef struct {
    const mq_kq_info *t;
    const float *x, *w;   /* sub-block j: x + j * sub * st, w + j * sub (w may be NULL) */
    int64_t st;
    const float *scale, *off;   /* [nsub] */
    int nsub, radius;
} block_search;

/* Super-scale pairs scored per call of search_pairs: every sub-block's candidates of them fit
 * KQ_CAND. */
static int pairs_per_call(int radius) { return KQ_CAND / ((2 * radius + 1) * (2 * radius + 1)); }

/* The super-scale pairs (ds[k], dms[k]), k = 0..n-1 (n <= pairs_per_call), in order: each pair's
 * total error is the sum over the sub-blocks (in order) of each one's least error among its
 * multipliers (box_of; a, then b, ascending, the first least winning), and the first pair whose
 * total is below *best replaces *best and the groups g, as a scan one pair and one multiplier at
 * a time would. All the candidates of a sub-block are scored in one call of the scorer. Returns
 * the index of the last pair taken, -1 when none. */
static int search_pairs(const block_search *b, const float *ds, const float *dms, int n,
                        double *best, mq_gparams *g) {
    const mq_kq_info *t = b->t;
    const int asym = t->zero < 0;
    double sse[KQ_CAND], total[KQ_CAND];
    float step[KQ_CAND], off[KQ_CAND];
    mult_box box[KQ_CAND];
    int16_t pick_a[16][KQ_CAND], pick_b[16][KQ_CAND];   /* each sub-block's choice for pair k */
    for (int k = 0; k < n; k++) total[k] = 0;
    for (int j = 0; j < b->nsub; j++) {
        int nc = 0;
        for (int k = 0; k < n; k++) {
            const mult_box m = box[k] = box_of(t, b->scale[j], b->off[j], ds[k], dms[k], b->radius);
            for (int a = m.a0; a <= m.a1; a++)
                for (int c = m.b0; c <= m.b1; c++) {
                    step[nc] = ds[k] * (float)a;
                    off[nc++] = asym ? dms[k] * (float)c : 0.0f;
                }
        }
        score(t, step, off, nc, b->x + (int64_t)j * t->sub * b->st, t->sub, b->st,
              b->w ? b->w + j * t->sub : NULL, sse);
        /* a pair's total adds its sub-blocks' errors in their order whatever the loop order */
        for (int k = 0, at = 0; k < n; k++) {
            /* candidate u is (a0 + u / nb, b0 + u % nb): a, then b, ascending; the first least
             * is kept without a branch (the comparisons are a coin toss to the predictor) */
            const int nb = box[k].b1 - box[k].b0 + 1, cnt = (box[k].a1 - box[k].a0 + 1) * nb;
            double bj = INFINITY;
            int bu = -1;
            for (int u = 0; u < cnt; u++) {
                const double e = sse[at + u];
                const bool lt = e < bj;
                bj = lt ? e : bj;
                bu = lt ? u : bu;
            }
            at += cnt;
            if (bu >= 0) {
                pick_a[j][k] = (int16_t)(box[k].a0 + bu / nb);
                pick_b[j][k] = (int16_t)(box[k].b0 + bu % nb);
            }
            total[k] += bj;
        }
    }
    int found = -1;
    for (int k = 0; k < n; k++)
        if (total[k] < *best) {
            *best = total[k];
            found = k;
        }
    /* a finite total: every sub-block picked a multiplier for that pair */
    for (int j = 0; found >= 0 && j < b->nsub; j++) {
        const int a = pick_a[j][found], c = pick_b[j][found];
        g[j] = (mq_gparams){ds[found] * (float)a, asym ? dms[found] * (float)c : 0.0f,
                            mult_code(t, a), (uint8_t)c};
    }
    return found;
}

/* A queue of super-scale pairs for search_pairs, scored when full (or flushed); d_best and
 * dmin_best: the pair taken last. */
typedef struct {
    const block_search *b;
    float ds[KQ_CAND], dms[KQ_CAND];
    int n, cap;
    double best;
    float d_best, dmin_best;
    mq_gparams *g;
} pair_queue;

static void queue_flush(pair_queue *q) {
    const int f = search_pairs(q->b, q->ds, q->dms, q->n, &q->best, q->g);
    if (f >= 0) {
        q->d_best = q->ds[f];
        q->dmin_best = q->dms[f];
    }
    q->n = 0;
}

static void queue_push(pair_queue *q, float d, float dmin) {
    q->ds[q->n] = d;
    q->dms[q->n++] = dmin;
    if (q->n == q->cap) queue_flush(q);
}

/* Q4_0, Q5_0, Q5_1, Q8_0: one step (and offset) per 32 values, both fp16. */
static void fit_single(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t st,
                       const float *w, mq_gparams *g) {
    float d0, m0 = 0;
    if (t->table) {
        d0 = fit_table(t->table, x, st, w, t->block);
    } else if (t->zero >= 0) {
        float amax = 0, max = 0;
        for (int i = 0; i < t->block; i++) {
            const float a = fabsf(x[i * st]);
            if (a > amax) amax = a, max = x[i * st];
        }
        /* Q8_0: amax / 127 (codes -127..127); Q5_0: the largest magnitude gets -16 (ggml) */
        d0 = t->qmin > 0 ? amax / (float)(t->zero - t->qmin) : max / -(float)t->zero;
    } else {
        float off;
        fit_asym(x, st, w, t->block, t->qmax, false, &d0, &off);
        m0 = f16r(-off);
    }
    const int nd = s->mse ? s->mse_steps : 1;
    const float off = t->zero < 0 ? -m0 : 0.0f;
    double best = INFINITY, sse[KQ_CAND];
    float prev = NAN, ds[KQ_CAND], offs[KQ_CAND];
    int n = 0;
    *g = (mq_gparams){0, off, 1, 0};
    for (int k = 0; k <= nd; k++) {   /* the candidates scored KQ_CAND at a time, then in order */
        if (k < nd) {
            const float d = f16r(d0 * (s->mse ? grid_mult(s, k) : 1.0f));
            if (d == prev || !isfinite(d)) continue;
            prev = d;
            offs[n] = off;
            ds[n++] = d;
            if (n < KQ_CAND) continue;
        }
        score(t, ds, offs, n, x, t->block, st, w, sse);
        for (int c = 0; c < n; c++)
            if (sse[c] < best) {
                best = sse[c];
                *g = (mq_gparams){ds[c], off, 1, 0};
            }
        n = 0;
    }
}

void mq_kq_fit_block(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t stride,
                     const float *w, mq_gparams *g) {
    float d, dmin;
    mq_kq_fit_block_d(t, s, x, stride, w, g, &d, &dmin);
}

void mq_kq_fit_block_d(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t stride,
                       const float *w, mq_gparams *g, float *d_out, float *dmin_out) {
    *d_out = *dmin_out = 0.0f;
    if (!has_sub(t)) {
        fit_single(t, s, x, stride, w, g);
        return;
    }
    const int nsub = t->block / t->sub, asym = t->zero < 0;
    float scale[16], off[16];
    float top = 0, top_min = 0;
    for (int j = 0; j < nsub; j++) {
        const float *xj = x + (int64_t)j * t->sub * stride;
        const float *wj = w ? w + j * t->sub : NULL;
        fit_sub_cont(t, xj, stride, wj, t->sub, &scale[j], &off[j]);
        if (asym) {
            top = scale[j] > top ? scale[j] : top;
            top_min = off[j] > top_min ? off[j] : top_min;
        } else if (fabsf(scale[j]) > fabsf(top)) {
            top = scale[j];
        }
    }
    /* ggml: d = max / 63 and dmin = max min / 63 (Q4_K, Q5_K), or the largest-magnitude scale
     * over -128 (Q6_K) or -32 (Q3_K, IQ4_XS), which gets that multiplier */
    const float d0 = asym ? top / (float)t->mult_hi : top / (float)t->mult_lo;
    const float m0 = asym ? f16r(top_min / (float)t->min_hi) : 0.0f;
    const int nd = s->mse ? s->mse_steps : 1, radius = s->mse ? 1 : 0;
    /* symmetric grids are lopsided (-4..3, -32..31): which side the block's largest values get
     * is the sign of d, taken from one sub-block's fit, so the search tries the other too */
    const int sides = s->mse && !asym ? 2 : 1;
    const block_search bs = {t, x, w, stride, scale, off, nsub, radius};
    pair_queue q;
    q.b = &bs;
    q.n = 0;
    q.cap = pairs_per_call(radius);
    q.best = INFINITY;
    q.d_best = 0;
    q.g = g;
    float prev = NAN;
    for (int k = 0; k < nd * sides; k++) {
        const float d = f16r((k < nd ? d0 : -d0) * (s->mse ? grid_mult(s, k % nd) : 1.0f));
        if (d == prev || !isfinite(d)) continue;
        prev = d;
        queue_push(&q, d, m0);
    }
    queue_flush(&q);
    *d_out = q.d_best;
    *dmin_out = q.dmin_best = m0;
    if (!asym || !s->mse || m0 == 0.0f) return;
    prev = m0;   /* the min's super-scale over the same grid, d fixed */
    for (int k = 0; k < nd; k++) {
        const float dm = f16r(top_min / (float)t->min_hi * grid_mult(s, k));
        if (dm == prev || !isfinite(dm)) continue;
        prev = dm;
        queue_push(&q, q.d_best, dm);
    }
    queue_flush(&q);
    *dmin_out = q.dmin_best;
}

void mq_kq_fit_sub(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t stride,
                   const float *w, float d, float dmin, mq_gparams *g) {
    float scale, off;
    fit_sub_cont(t, x, stride, w, t->sub, &scale, &off);
    const block_search bs = {t, x, w, stride, &scale, &off, 1, s->mse ? 2 : 0};
    double best = INFINITY;
    search_pairs(&bs, &d, &dmin, 1, &best, g);
}

/* ---- rows ------------------------------------------------------------------------------------- */

void mq_kq_quantize_row(const mq_kq_info *t, const mq_qspec *s, const float *x, int64_t cols,
                        const float *w, mq_gparams *params, uint8_t *codes) {
    const int nsub = t->block / t->sub;
    for (int64_t b = 0; b < cols / t->block; b++) {
        const float *xb = x + b * t->block;
        mq_gparams *g = params + b * nsub;
        mq_kq_fit_block(t, s, xb, 1, w ? w + b * t->block : NULL, g);
        for (int j = 0; j < nsub; j++)
            mq_kq_qdq(t, g[j].scale, g[j].zero, xb + j * t->sub, t->sub, codes + b * t->block + j * t->sub, NULL);
    }
}

void mq_kq_dequant_row(const mq_kq_info *t, const mq_gparams *params, const uint8_t *codes,
                       int64_t cols, float *out) {
    for (int64_t i = 0; i < cols; i++) out[i] = mq_kq_value(t, &params[i / t->sub], codes[i]);
}

/* ---- block bytes ------------------------------------------------------------------------------ */

static inline void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* The one fp16 value v with steps[j] == v * mult[j] for every j (mult 0: any); 0 when every
 * mult is 0. false when none. */
static bool implied(const float *steps, const int *mult, int n, uint16_t *out) {
    float v = 0;
    bool found = false;
    for (int j = 0; j < n; j++) {
        if (!mult[j]) {
            if (steps[j] != 0.0f) return false;
            continue;
        }
        const float u = steps[j] / (float)mult[j];
        if (found && u != v) return false;
        v = u, found = true;
    }
    const uint16_t h = mq_f32_to_f16(v);
    if (mq_f16_to_f32(h) != v) return false;
    for (int j = 0; j < n; j++)
        if (steps[j] != v * (float)mult[j]) return false;
    *out = h;
    return true;
}

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K 12-byte table (get_scale_min_k4). */
static void k4_get(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void k4_put(uint8_t *q, const uint8_t *sc, const uint8_t *mn) {
    memset(q, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            q[j] |= sc[j];
            q[j + 4] |= mn[j];
        } else {
            q[j + 4] = (uint8_t)((sc[j] & 0xF) | ((mn[j] & 0xF) << 4));
            q[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            q[j] |= (uint8_t)((mn[j] >> 4) << 6);
        }
    }
}

/* Q3_K: the 6-bit stored scale of sub-block j (0..15) of the 12-byte table. */
static uint8_t k3_get(const uint8_t *q, int j) {
    const int lo = j < 8 ? q[j] & 0xF : q[j - 8] >> 4;
    return (uint8_t)(lo | ((q[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
}

static void k3_put(uint8_t *q, const uint8_t *v) {
    memset(q, 0, 12);
    for (int j = 0; j < 16; j++) {
        if (j < 8) q[j] |= v[j] & 0xF;
        else q[j - 8] |= (uint8_t)((v[j] & 0xF) << 4);
        q[8 + j % 4] |= (uint8_t)((v[j] >> 4) << (2 * (j / 4)));
    }
}

bool mq_kq_pack_block(const mq_kq_info *t, const mq_gparams *g, const uint8_t *c, uint8_t *blk) {
    const int nsub = t->block / t->sub;
    for (int i = 0; i < t->block; i++)   /* Q8_0's code 0 (-128) is a valid byte too */
        if (c[i] > t->qmax) return false;
    float steps[16], offs[16];
    int mult[16], mins[16];
    uint8_t sc[16], mn[16];
    for (int j = 0; j < nsub; j++) {
        steps[j] = g[j].scale;
        offs[j] = g[j].zero;
        mult[j] = mq_kq_mult(t, g[j].scale_code);
        mins[j] = g[j].min_code;
        sc[j] = g[j].scale_code;
        mn[j] = g[j].min_code;
        if (has_sub(t) && (mult[j] < t->mult_lo || mult[j] > t->mult_hi || mins[j] > t->min_hi)) return false;
        if (t->zero >= 0 && offs[j] != 0.0f) return false;
    }
    uint16_t d = 0, dmin = 0;
    if (!has_sub(t)) {
        mult[0] = 1;
        if (!implied(steps, mult, 1, &d)) return false;
        if (t->zero < 0) {   /* Q5_1: m = -off */
            const float m = -offs[0];
            dmin = mq_f32_to_f16(m);
            if (mq_f16_to_f32(dmin) != m) return false;
        }
    } else {
        if (!implied(steps, mult, nsub, &d)) return false;
        if (t->zero < 0 && !implied(offs, mins, nsub, &dmin)) return false;
    }
    switch (t->ggml_type) {
    case 11: {   /* Q3_K */
        uint8_t *hm = blk, *qs = blk + 32;
        memset(blk, 0, 96);
        for (int i = 0; i < 256; i++) {
            qs[(i / 128) * 32 + i % 32] |= (uint8_t)((c[i] & 3) << (2 * ((i % 128) / 32)));
            if (c[i] & 4) hm[i % 32] |= (uint8_t)(1u << (i / 32));
        }
        k3_put(blk + 96, sc);
        wr16(blk + 108, d);
        return true;
    }
    case 12: case 13: {   /* Q4_K, Q5_K */
        const bool five = t->ggml_type == 13;
        wr16(blk, d);
        wr16(blk + 2, dmin);
        k4_put(blk + 4, sc, mn);
        uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        memset(blk + 16, 0, five ? 160 : 128);
        for (int i = 0; i < 256; i++) {
            qs[(i / 64) * 32 + i % 32] |= (uint8_t)((c[i] & 0xF) << ((i / 32) % 2 ? 4 : 0));
            if (five && (c[i] & 16)) qh[i % 32] |= (uint8_t)(1u << (i / 32));
        }
        return true;
    }
    case 14: {   /* Q6_K */
        uint8_t *ql = blk, *qh = blk + 128;
        memset(blk, 0, 192);
        for (int i = 0; i < 256; i++) {
            const int h = i / 128, r = i % 128;
            ql[64 * h + r % 64] |= (uint8_t)((c[i] & 0xF) << (r >= 64 ? 4 : 0));
            qh[32 * h + r % 32] |= (uint8_t)((c[i] >> 4) << (2 * (r / 32)));
        }
        memcpy(blk + 192, sc, 16);
        wr16(blk + 208, d);
        return true;
    }
    case 6: case 7: {   /* Q5_0, Q5_1 */
        const int o = t->ggml_type == 7 ? 4 : 2;
        wr16(blk, d);
        if (o == 4) wr16(blk + 2, dmin);
        uint32_t qh = 0;
        for (int j = 0; j < 32; j++) qh |= (uint32_t)((c[j] >> 4) & 1) << j;
        for (int k = 0; k < 4; k++) blk[o + k] = (uint8_t)(qh >> (8 * k));
        for (int j = 0; j < 16; j++) blk[o + 4 + j] = (uint8_t)((c[j] & 0xF) | (c[j + 16] & 0xF) << 4);
        return true;
    }
    case 23: {   /* IQ4_XS */
        wr16(blk, d);
        uint16_t sh = 0;
        memset(blk + 4, 0, 4);
        for (int j = 0; j < 8; j++) {
            blk[4 + j / 2] |= (uint8_t)((sc[j] & 0xF) << (4 * (j % 2)));
            sh |= (uint16_t)((sc[j] >> 4) << (2 * j));
        }
        wr16(blk + 2, sh);
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 16; i++)
                blk[8 + 16 * j + i] = (uint8_t)((c[32 * j + i] & 0xF) | (c[32 * j + i + 16] & 0xF) << 4);
        return true;
    }
    case 2: case 20:   /* Q4_0, IQ4_NL */
        wr16(blk, d);
        for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t)((c[j] & 0xF) | (c[j + 16] & 0xF) << 4);
        return true;
    case 8:   /* Q8_0 */
        wr16(blk, d);
        for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(c[j] - 128);
        return true;
    }
    return false;
}

void mq_kq_unpack_block(const mq_kq_info *t, const uint8_t *blk, mq_gparams *g, uint8_t *c) {
    switch (t->ggml_type) {
    case 11: {
        const uint8_t *hm = blk, *qs = blk + 32;
        const float d = mq_f16_to_f32(rd16(blk + 108));
        for (int j = 0; j < 16; j++) {
            const uint8_t v = k3_get(blk + 96, j);
            g[j] = (mq_gparams){d * (float)((int)v - 32), 0.0f, v, 0};
        }
        for (int i = 0; i < 256; i++)
            c[i] = (uint8_t)(((qs[(i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3) |
                             ((hm[i % 32] >> (i / 32)) & 1) << 2);
        return;
    }
    case 12: case 13: {
        const bool five = t->ggml_type == 13;
        const float d = mq_f16_to_f32(rd16(blk)), dmin = mq_f16_to_f32(rd16(blk + 2));
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            k4_get(blk + 4, j, &sc, &mn);
            g[j] = (mq_gparams){d * (float)sc, dmin * (float)mn, sc, mn};
        }
        const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        for (int i = 0; i < 256; i++) {
            uint8_t v = (uint8_t)((qs[(i / 64) * 32 + i % 32] >> ((i / 32) % 2 ? 4 : 0)) & 0xF);
            if (five) v |= (uint8_t)(((qh[i % 32] >> (i / 32)) & 1) << 4);
            c[i] = v;
        }
        return;
    }
    case 14: {
        const uint8_t *ql = blk, *qh = blk + 128;
        const float d = mq_f16_to_f32(rd16(blk + 208));
        for (int j = 0; j < 16; j++) g[j] = (mq_gparams){d * (float)(int8_t)blk[192 + j], 0.0f, blk[192 + j], 0};
        for (int i = 0; i < 256; i++) {
            const int h = i / 128, r = i % 128;
            c[i] = (uint8_t)(((ql[64 * h + r % 64] >> (r >= 64 ? 4 : 0)) & 0xF) |
                             ((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4);
        }
        return;
    }
    case 6: case 7: {
        const int o = t->ggml_type == 7 ? 4 : 2;
        const float d = mq_f16_to_f32(rd16(blk));
        g[0] = (mq_gparams){d, o == 4 ? -mq_f16_to_f32(rd16(blk + 2)) : 0.0f, 1, 0};
        const uint32_t qh = (uint32_t)blk[o] | (uint32_t)blk[o + 1] << 8 | (uint32_t)blk[o + 2] << 16 |
                            (uint32_t)blk[o + 3] << 24;
        for (int j = 0; j < 16; j++) {
            c[j] = (uint8_t)((blk[o + 4 + j] & 0xF) | ((qh >> j) & 1) << 4);
            c[j + 16] = (uint8_t)((blk[o + 4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
        return;
    }
    case 23: {
        const float d = mq_f16_to_f32(rd16(blk));
        const uint16_t sh = rd16(blk + 2);
        for (int j = 0; j < 8; j++) {
            const uint8_t ls = (uint8_t)(((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | ((sh >> (2 * j)) & 3) << 4);
            g[j] = (mq_gparams){d * (float)((int)ls - 32), 0.0f, ls, 0};
            for (int i = 0; i < 16; i++) {
                c[32 * j + i] = blk[8 + 16 * j + i] & 0xF;
                c[32 * j + i + 16] = blk[8 + 16 * j + i] >> 4;
            }
        }
        return;
    }
    case 2: case 20: {
        g[0] = (mq_gparams){mq_f16_to_f32(rd16(blk)), 0.0f, 1, 0};
        for (int j = 0; j < 16; j++) {
            c[j] = blk[2 + j] & 0xF;
            c[j + 16] = blk[2 + j] >> 4;
        }
        return;
    }
    default: {   /* Q8_0 */
        g[0] = (mq_gparams){mq_f16_to_f32(rd16(blk)), 0.0f, 1, 0};
        for (int j = 0; j < 32; j++) c[j] = (uint8_t)(blk[2 + j] + 128);
    }
    }
}
