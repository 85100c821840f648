/*
 * Quantized MoE feed-forward op (src/kernels): the op against a slow dense reference written here
 * (dequantize every expert with its own decoders, route in double, run the FFNs in double), for
 * INT4 (groups 32 / 128) and NVFP4, softmax with and without renormalisation, sigmoid + selection
 * bias + route scale, shared expert with and without gate, an expert with zero tokens, all tokens
 * on one expert, top-k = E, T = 1; AVX2 vs scalar reference (bit-identical); 1 vs 2 vs 3 threads.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kernels/moe_ffn.h"

/* ---- random data ---------------------------------------------------------------------------- */
static uint64_t g_rng = 1;
static void seed(uint64_t s) { g_rng = s * 0x9E3779B97F4A7C15ull + 1; }
static uint32_t rnd_u32(void) { return (uint32_t)(mq_test_xorshift(&g_rng) >> 16); }
static float rnd_unit(void) { return mq_test_rnd_unitf(&g_rng); }
static float rnd_normal(void) { return mq_test_rnd_normalf(&g_rng); }

/* (the test's own E2M1 and E4M3 decoders are the harness's mq_test_e2m1_dec, mq_test_e4m3_dec) */

/* ---- a canonical (unpacked) problem ---------------------------------------------------------- */
typedef struct {
    int nvfp4, group, E, D, F, Fs;
    uint8_t *gu_c, *dn_c, *sgu_c, *sdn_c;          /* codes */
    void *gu_s, *dn_s, *sgu_s, *sdn_s;             /* scales: float (INT4) or E4M3 bytes */
    float *gu_g, *dn_g, sgu_g[2], sdn_g;           /* NVFP4 global scales: gate_up [E, 2] */
    int gu_g_pairs;                                /* 1: gate_up global is [E, 2] */
    float *router, *bias, *sgate;
} problem;

static void fill_q(int nvfp4, int group, size_t rows, size_t cols, uint8_t **codes, void **scales) {
    *codes = malloc(rows * cols);
    size_t ng = rows * (cols / (size_t)group);
    *scales = malloc(ng * (nvfp4 ? 1 : 4));
    for (size_t i = 0; i < rows * cols; i++) (*codes)[i] = (uint8_t)(rnd_u32() & 15);
    for (size_t i = 0; i < ng; i++) {
        if (nvfp4) {
            /* mostly normal scales around 1..8, some subnormal and some negative ones */
            uint8_t b = (uint8_t)(((40 + rnd_u32() % 40) & 0x7f));
            if (rnd_u32() % 17 == 0) b = (uint8_t)(1 + rnd_u32() % 7);
            if (rnd_u32() % 23 == 0) b |= 0x80;
            ((uint8_t *)*scales)[i] = b;
        } else {
            ((float *)*scales)[i] = (0.5f + rnd_unit()) * 0.02f * (rnd_u32() % 19 == 0 ? -1.0f : 1.0f);
        }
    }
}

static problem make_problem(int nvfp4, int group, int E, int D, int F, int Fs, uint64_t s) {
    seed(s);
    problem p;
    memset(&p, 0, sizeof p);
    p.nvfp4 = nvfp4;
    p.group = nvfp4 ? 16 : group;
    p.E = E;
    p.D = D;
    p.F = F;
    p.Fs = Fs;
    fill_q(nvfp4, p.group, (size_t)E * 2 * F, (size_t)D, &p.gu_c, &p.gu_s);
    fill_q(nvfp4, p.group, (size_t)E * D, (size_t)F, &p.dn_c, &p.dn_s);
    if (Fs) {
        fill_q(nvfp4, p.group, (size_t)2 * Fs, (size_t)D, &p.sgu_c, &p.sgu_s);
        fill_q(nvfp4, p.group, (size_t)D, (size_t)Fs, &p.sdn_c, &p.sdn_s);
    }
    p.gu_g = malloc(sizeof(float) * 2 * E);
    p.dn_g = malloc(sizeof(float) * E);
    p.gu_g_pairs = nvfp4 && (s & 1);
    for (int e = 0; e < E; e++) {
        p.gu_g[2 * e] = 20.0f + 200.0f * rnd_unit();
        p.gu_g[2 * e + 1] = p.gu_g_pairs ? 20.0f + 200.0f * rnd_unit() : p.gu_g[2 * e];
        p.dn_g[e] = 20.0f + 200.0f * rnd_unit();
    }
    p.sgu_g[0] = 37.5f;
    p.sgu_g[1] = p.gu_g_pairs ? 91.0f : 37.5f;
    p.sdn_g = 55.0f;
    p.router = malloc(sizeof(float) * E * D);
    p.bias = malloc(sizeof(float) * E);
    p.sgate = malloc(sizeof(float) * D);
    for (int i = 0; i < E * D; i++) p.router[i] = rnd_normal() * 0.1f;
    for (int e = 0; e < E; e++) p.bias[e] = rnd_normal() * 0.05f;
    for (int i = 0; i < D; i++) p.sgate[i] = rnd_normal() * 0.05f;
    return p;
}

static void free_problem(problem *p) {
    free(p->gu_c); free(p->dn_c); free(p->sgu_c); free(p->sdn_c);
    free(p->gu_s); free(p->dn_s); free(p->sgu_s); free(p->sdn_s);
    free(p->gu_g); free(p->dn_g); free(p->router); free(p->bias); free(p->sgate);
}

static moeq_tensor_ref tref(const void *data, moeq_dtype dt, int ndim, int64_t a, int64_t b,
                            int64_t c) {
    moeq_tensor_ref r = {data, dt, ndim, {a, b, c, 0}, 0};
    size_t n = ndim >= 1 ? (size_t)a : 1;
    if (ndim >= 2) n *= (size_t)b;
    if (ndim >= 3) n *= (size_t)c;
    r.nbytes = n * (dt == MOEQ_DT_F32 ? 4 : 1);
    return r;
}

static moeq_moe_qweight qw(const problem *p, const uint8_t *codes, const void *scales,
                           const float *gs, int gs_pairs, int64_t E, int64_t rows, int64_t cols) {
    moeq_moe_qweight w;
    memset(&w, 0, sizeof w);
    moeq_dtype sdt = p->nvfp4 ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32;
    if (E > 0) {
        w.codes = tref(codes, MOEQ_DT_U8, 3, E, rows, cols);
        w.scales = tref(scales, sdt, 3, E, rows, cols / p->group);
        if (p->nvfp4) w.global_scale = gs_pairs ? tref(gs, MOEQ_DT_F32, 2, E, 2, 0) : tref(gs, MOEQ_DT_F32, 1, E, 0, 0);
    } else {
        w.codes = tref(codes, MOEQ_DT_U8, 2, rows, cols, 0);
        w.scales = tref(scales, sdt, 2, rows, cols / p->group, 0);
        if (p->nvfp4) w.global_scale = tref(gs, MOEQ_DT_F32, 1, gs_pairs ? 2 : 1, 0, 0);
    }
    return w;
}

static moeq_moe_experts_desc desc_of(const problem *p, float *gu_g_compact) {
    moeq_moe_experts_desc d = mq_test_moe_desc(p->nvfp4, p->group, p->E, p->D, p->F, p->Fs);
    /* [E] global scales are the gate entries of the [E, 2] array, compacted by the caller */
    for (int e = 0; e < p->E; e++) gu_g_compact[e] = p->gu_g[2 * e];
    d.gate_up = qw(p, p->gu_c, p->gu_s, p->gu_g_pairs ? p->gu_g : gu_g_compact, p->gu_g_pairs, p->E,
                   2 * p->F, p->D);
    d.down = qw(p, p->dn_c, p->dn_s, p->dn_g, 0, p->E, p->D, p->F);
    if (p->Fs) {
        d.shared_gate_up = qw(p, p->sgu_c, p->sgu_s, p->sgu_g, p->gu_g_pairs, 0, 2 * p->Fs, p->D);
        d.shared_down = qw(p, p->sdn_c, p->sdn_s, &p->sdn_g, 0, 0, p->D, p->Fs);
    }
    return d;
}

static moeq_moe_experts *pack(const problem *p) {
    float *tmp = malloc(sizeof(float) * p->E);
    moeq_moe_experts_desc d = desc_of(p, tmp);
    moeq_moe_experts *w = NULL;
    moeq_status st = moeq_moe_experts_pack(&d, &w);
    free(tmp);
    if (st) FAIL("pack: %s: %s", moeq_status_name(st), moeq_last_error());
    return w;
}

/* ---- the dense reference ---------------------------------------------------------------------- */
/* Dequantized row r of a [rows, cols] matrix (expert base already applied). */
static void deq_row(const problem *p, const uint8_t *codes, const void *scales, double gs,
                    int64_t r, int64_t cols, double *out) {
    int64_t ng = cols / p->group;
    for (int64_t k = 0; k < cols; k++) {
        uint8_t c = codes[r * cols + k];
        int64_t si = r * ng + k / p->group;
        if (p->nvfp4) out[k] = mq_test_e2m1_dec(c) * mq_test_e4m3_dec(((const uint8_t *)scales)[si]) / gs;
        else out[k] = ((int)c - 8) * (double)((const float *)scales)[si];
    }
}

/* y[D] = FFN of one expert (e < 0: shared) on x[D], in double. */
static void ref_ffn(const problem *p, int e, const float *x, double *y) {
    const int64_t D = p->D, F = e < 0 ? p->Fs : p->F, ng_d = D / p->group, ng_f = F / p->group;
    const size_t sb = p->nvfp4 ? 1 : 4;
    const uint8_t *guc = e < 0 ? p->sgu_c : p->gu_c + (size_t)e * 2 * F * D;
    const uint8_t *gus = e < 0 ? p->sgu_s : (const uint8_t *)p->gu_s + (size_t)e * 2 * F * ng_d * sb;
    const uint8_t *dnc = e < 0 ? p->sdn_c : p->dn_c + (size_t)e * D * F;
    const uint8_t *dns = e < 0 ? p->sdn_s : (const uint8_t *)p->dn_s + (size_t)e * D * ng_f * sb;
    double gsg = e < 0 ? p->sgu_g[0] : p->gu_g[2 * e], gsu = e < 0 ? p->sgu_g[1] : p->gu_g[2 * e + 1];
    double gsd = e < 0 ? p->sdn_g : p->dn_g[e];
    double *row = malloc(sizeof(double) * (size_t)(D > F ? D : F)), *mid = malloc(sizeof(double) * (size_t)F);
    for (int64_t f = 0; f < F; f++) {
        double g = 0, u = 0;
        deq_row(p, guc, gus, gsg, f, D, row);
        for (int64_t k = 0; k < D; k++) g += row[k] * x[k];
        deq_row(p, guc, gus, gsu, F + f, D, row);
        for (int64_t k = 0; k < D; k++) u += row[k] * x[k];
        mid[f] = g / (1.0 + exp(-g)) * u;
    }
    for (int64_t d = 0; d < D; d++) {
        double acc = 0;
        deq_row(p, dnc, dns, gsd, d, F, row);
        for (int64_t f = 0; f < F; f++) acc += row[f] * mid[f];
        y[d] = acc;
    }
    free(row);
    free(mid);
}

typedef struct {
    int k, renorm, use_bias, use_sgate;
    moeq_moe_scoring scoring;
    float route_scale;
} routing;

/* Group-limited selection (DeepSeek-V3's n_group / topk_group) of the runs below; 0: none. */
static int g_n_group, g_topk_group;

static void ref_forward(const problem *p, const routing *r, const float *x, int64_t T, double *out,
                        int *expert_tokens) {
    const int64_t D = p->D, E = p->E;
    double *pr = malloc(sizeof(double) * (size_t)E), *y = malloc(sizeof(double) * (size_t)D);
    int *taken = malloc(sizeof(int) * (size_t)E);
    if (expert_tokens) memset(expert_tokens, 0, sizeof(int) * (size_t)E);
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * D;
        double mx = -INFINITY, sum = 0;
        for (int64_t e = 0; e < E; e++) {
            double l = 0;
            for (int64_t d = 0; d < D; d++) l += (double)xt[d] * p->router[e * D + d];
            pr[e] = l;
            if (l > mx) mx = l;
        }
        for (int64_t e = 0; e < E; e++) {
            if (r->scoring == MOEQ_MOE_SOFTMAX) sum += pr[e] = exp(pr[e] - mx);
            else pr[e] = 1.0 / (1.0 + exp(-pr[e]));
        }
        if (r->scoring == MOEQ_MOE_SOFTMAX)
            for (int64_t e = 0; e < E; e++) pr[e] /= sum;
        memset(taken, 0, sizeof(int) * (size_t)E);
        if (g_n_group > 1) {
            double sc[256];
            for (int64_t e = 0; e < E; e++) sc[e] = pr[e] + (r->use_bias ? p->bias[e] : 0.0);
            mq_test_ref_groups(sc, E, g_n_group, g_topk_group, taken);
        }
        int sel[64];
        double w[64], wsum = 0;
        for (int j = 0; j < r->k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                if (taken[e]) continue;
                double s = pr[e] + (r->use_bias ? p->bias[e] : 0.0);
                double bs = best < 0 ? 0 : pr[best] + (r->use_bias ? p->bias[best] : 0.0);
                if (best < 0 || s > bs) best = e;
            }
            taken[best] = 1;
            sel[j] = best;
            w[j] = pr[best];
            wsum += w[j];
            if (expert_tokens) expert_tokens[best]++;
        }
        double *o = out + t * D;
        memset(o, 0, sizeof(double) * (size_t)D);
        for (int j = 0; j < r->k; j++) {
            double wj = (r->renorm ? w[j] / wsum : w[j]) * r->route_scale;
            ref_ffn(p, sel[j], xt, y);
            for (int64_t d = 0; d < D; d++) o[d] += wj * y[d];
        }
        if (p->Fs) {
            double g = 1.0;
            if (r->use_sgate) {
                double l = 0;
                for (int64_t d = 0; d < D; d++) l += (double)xt[d] * p->sgate[d];
                g = 1.0 / (1.0 + exp(-l));
            }
            ref_ffn(p, -1, xt, y);
            for (int64_t d = 0; d < D; d++) o[d] += g * y[d];
        }
    }
    free(pr);
    free(y);
    free(taken);
}

static moeq_status run_op(const problem *p, const moeq_moe_experts *w, const routing *r,
                          const float *x, int64_t T, float *out) {
    moeq_moe_ffn_args a;
    memset(&a, 0, sizeof a);
    a.x = tref(x, MOEQ_DT_F32, 2, T, p->D, 0);
    a.router = tref(p->router, MOEQ_DT_F32, 2, p->E, p->D, 0);
    if (r->use_bias) a.router_bias = tref(p->bias, MOEQ_DT_F32, 1, p->E, 0, 0);
    if (r->use_sgate) a.shared_gate = tref(p->sgate, MOEQ_DT_F32, 1, p->D, 0, 0);
    a.experts = w;
    a.top_k = r->k;
    a.scoring = r->scoring;
    a.renormalize = r->renorm;
    a.route_scale = r->route_scale;
    a.n_group = g_n_group;
    a.topk_group = g_topk_group;
    return moeq_moe_ffn(&a, out, (size_t)(T * p->D));
}

static double sqnr_db(const double *ref, const float *out, size_t n) {
    double s = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        s += ref[i] * ref[i];
        e += (ref[i] - out[i]) * (ref[i] - out[i]);
    }
    return e == 0 ? 300.0 : 10.0 * log10(s / e);
}

static int g_outliers;   /* make_x: a few channels 50x larger, as LLM hidden states have */

static float *make_x(int64_t T, int64_t D) {
    float *x = malloc(sizeof(float) * (size_t)(T * D));
    for (int64_t i = 0; i < T * D; i++) x[i] = rnd_normal();
    if (g_outliers)
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 3; d < D; d += 37) x[t * D + d] *= 50.0f;
    return x;
}

/* Runs the op and the reference; asserts SQNR > 40 dB. Returns the SQNR; fills expert_tokens. */
static double check_case(const problem *p, const routing *r, int64_t T, int *expert_tokens) {
    moeq_moe_experts *w = pack(p);
    if (!w) return 0;
    float *x = make_x(T, p->D), *out = malloc(sizeof(float) * (size_t)(T * p->D));
    double *ref = malloc(sizeof(double) * (size_t)(T * p->D));
    ASSERT_OK(run_op(p, w, r, x, T, out));
    ref_forward(p, r, x, T, ref, expert_tokens);
    double db = sqnr_db(ref, out, (size_t)(T * p->D));
    moeq_moe_experts_free(w);
    free(x);
    free(out);
    free(ref);
    if (!(db > 40.0)) FAIL("SQNR %.2f dB <= 40 dB", db);
    return db;
}

/* ---- cases ------------------------------------------------------------------------------------ */
static void test_int4_g32_softmax_renorm(void) {
    problem p = make_problem(0, 32, 8, 128, 96, 0, 11);
    routing r = {2, 1, 0, 0, MOEQ_MOE_SOFTMAX, 1.0f};
    double db = check_case(&p, &r, 13, NULL);
    printf("    int4 g32 softmax+renorm: %.1f dB\n", db);
    free_problem(&p);
}

static void test_int4_g128_softmax_no_renorm(void) {
    problem p = make_problem(0, 128, 6, 256, 128, 0, 12);
    routing r = {3, 0, 0, 0, MOEQ_MOE_SOFTMAX, 1.0f};
    double db = check_case(&p, &r, 9, NULL);
    printf("    int4 g128 softmax: %.1f dB\n", db);
    free_problem(&p);
}

static void test_nvfp4_sigmoid_bias_route_scale(void) {
    problem p = make_problem(1, 16, 8, 96, 48, 0, 13);   /* odd seed: separate gate/up scales */
    routing r = {3, 1, 1, 0, MOEQ_MOE_SIGMOID, 2.5f};
    double db = check_case(&p, &r, 7, NULL);
    printf("    nvfp4 sigmoid+bias+scale: %.1f dB\n", db);
    free_problem(&p);
}

/* DeepSeek-V3's routing: 16 experts in 4 groups, the 2 best groups eligible, top-3 among their 8,
 * with a shared expert; the choices must differ from the plain top-3 for some tokens. */
static void test_group_limited_sigmoid(void) {
    for (int nv = 0; nv < 2; nv++) {
        problem p = make_problem(nv, nv ? 16 : 32, 16, 64, 32, 32, 21 + (uint64_t)nv);
        routing r = {3, 1, 1, 0, MOEQ_MOE_SIGMOID, 2.5f};
        int plain[16], grouped[16];
        check_case(&p, &r, 24, plain);
        g_n_group = 4;
        g_topk_group = 2;
        double db = check_case(&p, &r, 24, grouped);
        g_n_group = g_topk_group = 0;
        int differ = 0;
        for (int e = 0; e < 16; e++) differ += plain[e] != grouped[e];
        printf("    %s sigmoid+bias, 4 groups top-2, top-3: %.1f dB; %d experts' token counts "
               "differ from the plain top-3\n", nv ? "nvfp4" : "int4", db, differ);
        ASSERT_TRUE(differ > 0);
        free_problem(&p);
    }
}

static void test_nvfp4_softmax_no_renorm(void) {
    problem p = make_problem(1, 16, 5, 64, 32, 0, 14);
    routing r = {2, 0, 0, 0, MOEQ_MOE_SOFTMAX, 1.0f};
    check_case(&p, &r, 6, NULL);
    free_problem(&p);
}

static void test_shared_expert_with_gate(void) {
    for (int nv = 0; nv < 2; nv++) {
        problem p = make_problem(nv, 32, 4, 64, 32, 96, 15 + (uint64_t)nv);
        routing r = {2, 1, 0, 1, MOEQ_MOE_SOFTMAX, 1.0f};
        double db = check_case(&p, &r, 5, NULL);
        routing r2 = {1, 0, 0, 0, MOEQ_MOE_SOFTMAX, 1.0f};   /* shared expert without gate */
        double db2 = check_case(&p, &r2, 3, NULL);
        printf("    %s shared expert gated %.1f dB, ungated %.1f dB\n", nv ? "nvfp4" : "int4", db, db2);
        free_problem(&p);
    }
}

static void test_top_k_equals_E_and_one_token(void) {
    problem p = make_problem(0, 32, 4, 64, 64, 0, 17);
    routing r = {4, 0, 0, 0, MOEQ_MOE_SOFTMAX, 1.0f};
    check_case(&p, &r, 1, NULL);
    check_case(&p, &r, 6, NULL);
    free_problem(&p);
}

static void test_zero_token_expert_and_all_on_one(void) {
    /* bias +10 on expert 5 (sigmoid scores are < 1): with k = 1 every token goes there and the
     * other experts get none; with k = 2, expert 5 plus the best other one */
    problem p = make_problem(1, 16, 8, 64, 32, 0, 18);
    for (int e = 0; e < p.E; e++) p.bias[e] = e == 5 ? 10.0f : 0.0f;
    int tokens[8];
    routing r = {1, 0, 1, 0, MOEQ_MOE_SIGMOID, 1.0f};
    check_case(&p, &r, 11, tokens);
    ASSERT_EQ_INT(11, tokens[5]);
    for (int e = 0; e < 8; e++)
        if (e != 5) ASSERT_EQ_INT(0, tokens[e]);
    routing r2 = {2, 1, 1, 0, MOEQ_MOE_SIGMOID, 1.0f};
    check_case(&p, &r2, 3, tokens);
    int zero = 0;
    for (int e = 0; e < 8; e++) zero += tokens[e] == 0;
    ASSERT_TRUE(zero >= 4);   /* at most 3 other experts were used */
    free_problem(&p);
}

static void test_many_tokens_tile_remainders(void) {
    /* 4-row tiles and remainders 1..3 per expert, more tokens than one task's tile */
    problem p = make_problem(0, 64, 3, 128, 64, 128, 19);
    routing r = {2, 1, 0, 1, MOEQ_MOE_SOFTMAX, 1.0f};
    for (int64_t T = 1; T <= 7; T++) check_case(&p, &r, T, NULL);
    check_case(&p, &r, 37, NULL);
    free_problem(&p);
}

/* Same output bits for the reference kernels, the SIMD kernels (AVX2; NEON on Arm) and 1 / 2 / 3
 * threads. */
static void test_ref_avx2_threads_identical(void) {
    if (!mq_cpu_has_avx2_fma() && !MQ_TEST_ARM) SKIP("no AVX2+FMA on this CPU");
    for (int nv = 0; nv < 2; nv++) {
        problem p = make_problem(nv, 32, 6, 128, 64, 64, 20 + (uint64_t)nv);
        moeq_moe_experts *w = pack(&p);
        routing r = {3, 1, 1, 1, MOEQ_MOE_SIGMOID, 1.5f};
        const int64_t T = 23;
        float *x = make_x(T, p.D);
        x[5] = NAN;   /* a poisoned token must stay identical too (NaN in its row) */
        size_t n = (size_t)(T * p.D);
        float *o[4];
        /* under qemu-user (MOEQ_CROSS) contended locks crawl: one thread there */
        const int emu = getenv("MOEQ_CROSS") != NULL;
        const int threads[4] = {1, 1, emu ? 1 : 2, emu ? 1 : 3}, ref[4] = {1, 0, 0, 0};
        for (int i = 0; i < 4; i++) {
            o[i] = malloc(sizeof(float) * n);
            moeq_set_threads(threads[i]);
            moeq_set_force_ref(ref[i]);
            ASSERT_OK(run_op(&p, w, &r, x, T, o[i]));
        }
        moeq_set_force_ref(0);
        moeq_set_threads(0);
        for (int i = 1; i < 4; i++)
            if (memcmp(o[0], o[i], n * sizeof(float)) != 0) {
                size_t j = 0;
                while (j < n && !memcmp(&o[0][j], &o[i][j], sizeof(float))) j++;
                FAIL("run %d differs from the reference at %zu: %.9g vs %.9g", i, j, o[0][j], o[i][j]);
            }
        for (size_t j = 0; j < (size_t)p.D; j++) ASSERT_TRUE(isnan(o[1][j]));   /* token 0 */
        ASSERT_TRUE(isfinite(o[1][p.D]));                                       /* token 1 */
        for (int i = 0; i < 4; i++) free(o[i]);
        free(x);
        moeq_moe_experts_free(w);
        free_problem(&p);
    }
}

static void test_outlier_channels(void) {
    g_outliers = 1;
    for (int nv = 0; nv < 2; nv++) {
        problem p = make_problem(nv, 128, 8, 256, 128, 128, 23 + (uint64_t)nv);
        routing r = {2, 1, 0, 1, MOEQ_MOE_SOFTMAX, 1.0f};
        double db = check_case(&p, &r, 9, NULL);
        printf("    %s with outlier channels: %.1f dB\n", nv ? "nvfp4" : "int4 g128", db);
        if (!(db > 60.0)) FAIL("outlier channels: %.1f dB", db);
        free_problem(&p);
    }
    g_outliers = 0;
}

static void test_empty_input(void) {
    problem p = make_problem(0, 32, 4, 64, 32, 0, 21);
    moeq_moe_experts *w = pack(&p);
    routing r = {2, 1, 0, 0, MOEQ_MOE_SOFTMAX, 1.0f};
    ASSERT_OK(run_op(&p, w, &r, NULL, 0, NULL));
    moeq_moe_experts_free(w);
    free_problem(&p);
}

TEST_MAIN(T(test_int4_g32_softmax_renorm), T(test_int4_g128_softmax_no_renorm),
          T(test_nvfp4_sigmoid_bias_route_scale), T(test_group_limited_sigmoid),
          T(test_nvfp4_softmax_no_renorm),
          T(test_shared_expert_with_gate), T(test_top_k_equals_E_and_one_token),
          T(test_zero_token_expert_and_all_on_one), T(test_many_tokens_tile_remainders),
          T(test_ref_avx2_threads_identical), T(test_outlier_channels), T(test_empty_input))
