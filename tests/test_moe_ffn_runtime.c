/*
 * The MoE kernels' entry points for the model runtime: experts packed from the formats module's
 * mq_qtensor (INT4 with BF16/F16/F32 scales, NVFP4 in the compressed-tensors and the ModelOpt
 * global-scale conventions) against the dense fp32 computation on mq_dequantize'd weights, the
 * same layer through the public descriptor (bit-identical), unsupported layouts refused, and the
 * packed dense Linear against mq_gemm_nt on the dequantized weight.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kernels/moe_ffn.h"

static uint64_t g_rng = 3;
static float rnd_normal(void) {
    mq_test_xorshift(&g_rng);
    float u1 = ((float)(g_rng >> 40) + 0.5f) * 0x1p-24f;
    mq_test_xorshift(&g_rng);
    float u2 = (float)(g_rng >> 40) * 0x1p-24f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

static float *randn(size_t n, float s) {
    float *p = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) p[i] = rnd_normal() * s;
    return p;
}

static mq_qtensor quant(const mq_qspec *s, int64_t rows, int64_t cols, float global) {
    float *w = randn((size_t)(rows * cols), 0.05f);
    mq_qtensor q;
    memset(&q, 0, sizeof q);
    moeq_status st = mq_quantize_rtn(s, w, rows, cols, global, "test", &q);
    if (st) FAIL("quantize: %s", moeq_last_error());
    free(w);
    return q;
}

static double sqnr_db(const float *ref, const float *out, size_t n) {
    double s = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        s += (double)ref[i] * ref[i];
        e += ((double)ref[i] - out[i]) * ((double)ref[i] - out[i]);
    }
    return e == 0 ? 300 : 10 * log10(s / e);
}

static void silu_mul(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

enum { E = 4, K = 2, D = 256, F = 128, FS = 256, T = 7 };

/* Dense fp32 MoE on dequantized weights (softmax over all, renormalised top-k, gated shared). */
static void dense_moe(const mq_qtensor *gate, const mq_qtensor *up, const mq_qtensor *down,
                      const mq_qtensor *sh /* [3] */, const float *router, const float *sgate,
                      const float *x, float *out) {
    float *w = malloc(sizeof(float) * D * FS), *h = malloc(sizeof(float) * FS * 2), *y = malloc(sizeof(float) * D);
    for (int t = 0; t < T; t++) {
        const float *xt = x + t * D;
        double lg[E], mx = -1e30, sum = 0;
        for (int e = 0; e < E; e++) {
            lg[e] = 0;
            for (int d = 0; d < D; d++) lg[e] += (double)xt[d] * router[e * D + d];
            if (lg[e] > mx) mx = lg[e];
        }
        for (int e = 0; e < E; e++) sum += lg[e] = exp(lg[e] - mx);
        int sel[K];
        double wt[K], ws = 0;
        int taken[E] = {0};
        for (int j = 0; j < K; j++) {
            int b = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (b < 0 || lg[e] > lg[b])) b = e;
            taken[b] = 1;
            sel[j] = b;
            ws += wt[j] = lg[b] / sum;
        }
        memset(out + t * D, 0, sizeof(float) * D);
        for (int j = 0; j < K + 1; j++) {
            const bool shared = j == K;
            const mq_qtensor *g = shared ? &sh[0] : &gate[sel[j]], *u = shared ? &sh[1] : &up[sel[j]];
            const mq_qtensor *dn = shared ? &sh[2] : &down[sel[j]];
            const int64_t f = g->rows;
            mq_dequantize(g, w);
            mq_gemm_nt(1, f, D, 1.0f, xt, D, w, D, 0.0f, h, f);
            mq_dequantize(u, w);
            mq_gemm_nt(1, f, D, 1.0f, xt, D, w, D, 0.0f, h + f, f);
            silu_mul(h, h + f, f);
            mq_dequantize(dn, w);
            mq_gemm_nt(1, D, f, 1.0f, h, f, w, f, 0.0f, y, D);
            double c;
            if (shared) {
                double l = 0;
                for (int d = 0; d < D; d++) l += (double)xt[d] * sgate[d];
                c = 1.0 / (1.0 + exp(-l));
            } else {
                c = wt[j] / ws;
            }
            for (int d = 0; d < D; d++) out[t * D + d] += (float)(c * y[d]);
        }
    }
    free(w);
    free(h);
    free(y);
}

static moeq_tensor_ref tr(const void *p, moeq_dtype dt, int nd, int64_t a, int64_t b, int64_t c,
                          size_t es) {
    moeq_tensor_ref r = {p, dt, nd, {a, b, c, 0}, 0};
    r.nbytes = (size_t)a * (size_t)(nd > 1 ? b : 1) * (size_t)(nd > 2 ? c : 1) * es;
    return r;
}

/* The same layer as the public descriptor's dense arrays (codes, scales, global scales). */
static moeq_moe_experts *pack_via_desc(const mq_qtensor *gate, const mq_qtensor *up,
                                       const mq_qtensor *down, const mq_qtensor *sh) {
    const int nv = gate[0].spec.scheme == MQ_QS_NVFP4;
    const int64_t g = gate[0].group_size;
    uint8_t *guc = malloc(E * 2 * F * D), *dnc = malloc(E * D * F), *sguc = malloc(2 * FS * D);
    float *gus = malloc(sizeof(float) * E * 2 * F * D / g), *dns = malloc(sizeof(float) * E * D * F / g);
    float *sgus = malloc(sizeof(float) * 2 * FS * D / g), *sdns = malloc(sizeof(float) * D * FS / g);
    uint8_t *b_gus = (uint8_t *)gus, *b_dns = (uint8_t *)dns, *b_sgus = (uint8_t *)sgus, *b_sdns = (uint8_t *)sdns;
    float ggs[2 * E], dgs[E], sggs[2], sdgs[1];
    for (int e = 0; e <= E; e++) {
        const bool s = e == E;
        const mq_qtensor *m[3] = {s ? &sh[0] : &gate[e], s ? &sh[1] : &up[e], s ? &sh[2] : &down[e]};
        const int64_t f = m[0]->rows;
        uint8_t *gc = s ? sguc : guc + (size_t)e * 2 * F * D;
        memcpy(gc, m[0]->codes, (size_t)(f * D));
        memcpy(gc + f * D, m[1]->codes, (size_t)(f * D));
        if (!s) memcpy(dnc + (size_t)e * D * F, m[2]->codes, (size_t)(D * F));
        const int64_t ngu = f * D / g, ndn = D * f / g;
        for (int64_t i = 0; i < ngu; i++) {
            const int64_t o = (s ? 0 : (int64_t)e * 2 * F * D / g);
            if (nv) {
                (s ? b_sgus : b_gus)[o + i] = m[0]->params[i].scale_code;
                (s ? b_sgus : b_gus)[o + ngu + i] = m[1]->params[i].scale_code;
            } else {
                (s ? sgus : gus)[o + i] = m[0]->params[i].scale;
                (s ? sgus : gus)[o + ngu + i] = m[1]->params[i].scale;
            }
        }
        for (int64_t i = 0; i < ndn; i++) {
            const int64_t o = s ? 0 : (int64_t)e * D * F / g;
            if (nv) (s ? b_sdns : b_dns)[o + i] = m[2]->params[i].scale_code;
            else (s ? sdns : dns)[o + i] = m[2]->params[i].scale;
        }
        (s ? sggs : ggs)[s ? 0 : 2 * e] = m[0]->global_scale;
        (s ? sggs : ggs)[s ? 1 : 2 * e + 1] = m[1]->global_scale;
        (s ? sdgs : dgs)[s ? 0 : e] = m[2]->global_scale;
    }
    uint8_t *sdnc = malloc(D * FS);
    memcpy(sdnc, sh[2].codes, D * FS);
    const moeq_dtype sdt = nv ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32;
    const size_t ss = nv ? 1 : 4;
    moeq_moe_experts_desc d = mq_test_moe_desc(nv, (int)g, (int)E, (int)D, (int)F, (int)FS);
    d.nvfp4_global_multiplier = nv && gate[0].spec.nvfp4_conv == MQ_NVFP4_MUL;
    d.gate_up.codes = tr(guc, MOEQ_DT_U8, 3, E, 2 * F, D, 1);
    d.gate_up.scales = tr(gus, sdt, 3, E, 2 * F, D / g, ss);
    d.down.codes = tr(dnc, MOEQ_DT_U8, 3, E, D, F, 1);
    d.down.scales = tr(dns, sdt, 3, E, D, F / g, ss);
    d.shared_gate_up.codes = tr(sguc, MOEQ_DT_U8, 2, 2 * FS, D, 0, 1);
    d.shared_gate_up.scales = tr(sgus, sdt, 2, 2 * FS, D / g, 0, ss);
    d.shared_down.codes = tr(sdnc, MOEQ_DT_U8, 2, D, FS, 0, 1);
    d.shared_down.scales = tr(sdns, sdt, 2, D, FS / g, 0, ss);
    if (nv) {
        d.gate_up.global_scale = tr(ggs, MOEQ_DT_F32, 2, E, 2, 0, 4);
        d.down.global_scale = tr(dgs, MOEQ_DT_F32, 1, E, 0, 0, 4);
        d.shared_gate_up.global_scale = tr(sggs, MOEQ_DT_F32, 1, 2, 0, 0, 4);
        d.shared_down.global_scale = tr(sdgs, MOEQ_DT_F32, 1, 1, 0, 0, 4);
    }
    moeq_moe_experts *w = NULL;
    moeq_status st = moeq_moe_experts_pack(&d, &w);
    if (st) FAIL("pack via desc: %s", moeq_last_error());
    free(guc); free(dnc); free(sguc); free(sdnc); free(gus); free(dns); free(sgus); free(sdns);
    return w;
}

static void run_layer_case(mq_qspec spec, const char *label) {
    mq_qtensor gate[E], up[E], down[E], sh[3];
    for (int e = 0; e < E; e++) {
        gate[e] = quant(&spec, F, D, 0);
        up[e] = quant(&spec, F, D, 0);
        down[e] = quant(&spec, D, F, 0);
    }
    sh[0] = quant(&spec, FS, D, 0);
    sh[1] = quant(&spec, FS, D, 0);
    sh[2] = quant(&spec, D, FS, 0);
    float *router = randn(E * D, 0.2f), *sgate = randn(D, 0.1f), *x = randn(T * D, 1.0f);
    float *ref = malloc(sizeof(float) * T * D), *o1 = malloc(sizeof(float) * T * D), *o2 = malloc(sizeof(float) * T * D);
    dense_moe(gate, up, down, sh, router, sgate, x, ref);
    mq_moe_layer L = {NULL, router, NULL, sgate, K, MOEQ_MOE_SOFTMAX, 1, 1.0f, 0, 0};
    ASSERT_OK(mq_moe_experts_from_qtensors(gate, up, down, E, &sh[0], &sh[1], &sh[2], "layer", &L.experts));
    ASSERT_OK(mq_moe_layer_forward(&L, x, T, o1));
    double db = sqnr_db(ref, o1, T * D);
    printf("    %s: %.1f dB vs dense fp32, packed %zu bytes\n", label, db, moeq_moe_experts_bytes(L.experts));
    if (!(db > 70)) FAIL("%s: SQNR %.1f dB", label, db);
    /* the public descriptor path packs the same layer to the same bits of output */
    mq_moe_layer L2 = L;
    L2.experts = pack_via_desc(gate, up, down, sh);
    ASSERT_OK(mq_moe_layer_forward(&L2, x, T, o2));
    ASSERT_TRUE(memcmp(o1, o2, sizeof(float) * T * D) == 0);
    ASSERT_EQ_INT(moeq_moe_experts_bytes(L.experts), moeq_moe_experts_bytes(L2.experts));
    mq_moe_layer_free(&L);
    mq_moe_layer_free(&L2);
    for (int e = 0; e < E; e++) {
        mq_qtensor_free(&gate[e]);
        mq_qtensor_free(&up[e]);
        mq_qtensor_free(&down[e]);
    }
    for (int i = 0; i < 3; i++) mq_qtensor_free(&sh[i]);
    free(router); free(sgate); free(x); free(ref); free(o1); free(o2);
}

static void test_layer_from_qtensors(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);   /* g128, BF16 scales */
    s.group_size = 32;
    run_layer_case(s, "int4 g32 bf16 scales");
    s.scale_dtype = MOEQ_DT_F16;
    s.group_size = 64;
    run_layer_case(s, "int4 g64 f16 scales");
    s.scale_dtype = MOEQ_DT_F32;
    s.group_size = 128;
    run_layer_case(s, "int4 g128 f32 scales");
    mq_qspec n = mq_qspec_default(MQ_QS_NVFP4);
    run_layer_case(n, "nvfp4 compressed-tensors");
    n.nvfp4_conv = MQ_NVFP4_MUL;
    run_layer_case(n, "nvfp4 modelopt");
}

/* 16-bit scale storage is chosen only when lossless: bf16-exact scales pack smaller than f32. */
static void test_int4_scale_storage_size(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 32;
    mq_qtensor g = quant(&s, F, D, 0), u = quant(&s, F, D, 0), d = quant(&s, D, F, 0);
    moeq_moe_experts *w = NULL;
    ASSERT_OK(mq_moe_experts_from_qtensors(&g, &u, &d, 1, NULL, NULL, NULL, "x", &w));
    /* per row block: 4 bytes per column of codes + 2 bytes x 8 rows per group */
    const size_t rbd = (size_t)D * 4 + (D / 32) * 16, rbf = (size_t)F * 4 + (F / 32) * 16;
    ASSERT_EQ_INT((2 * F / 8) * ((rbd + 63) / 64 * 64) + (D / 8) * ((rbf + 63) / 64 * 64),
                  moeq_moe_experts_bytes(w));
    moeq_moe_experts_free(w);
    u.params[5].scale = 0.0123456789f;   /* not exact in bf16 or f16: everything goes fp32 */
    ASSERT_OK(mq_moe_experts_from_qtensors(&g, &u, &d, 1, NULL, NULL, NULL, "x", &w));
    const size_t rbd4 = (size_t)D * 4 + (D / 32) * 32, rbf4 = (size_t)F * 4 + (F / 32) * 32;
    ASSERT_EQ_INT((2 * F / 8) * ((rbd4 + 63) / 64 * 64) + (D / 8) * ((rbf4 + 63) / 64 * 64),
                  moeq_moe_experts_bytes(w));
    moeq_moe_experts_free(w);
    mq_qtensor_free(&g);
    mq_qtensor_free(&u);
    mq_qtensor_free(&d);
}

static void test_unsupported_layouts_refused(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 32;
    mq_qtensor g = quant(&s, F, D, 0), u = quant(&s, F, D, 0), d = quant(&s, D, F, 0);
    moeq_moe_experts *w = (moeq_moe_experts *)&s;
    u.spec.asym = true;
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_moe_experts_from_qtensors(&g, &u, &d, 1, NULL, NULL, NULL, "L3", &w));
    ASSERT_ERROR_MENTIONS("L3: expert 0 up: asymmetric INT4");
    ASSERT_TRUE(w == NULL);
    u.spec.asym = false;
    int32_t *gi = malloc(sizeof(int32_t) * D);
    for (int c = 0; c < D; c++) gi[c] = c / 32;
    g.g_idx = gi;   /* the natural order written out: accepted */
    ASSERT_OK(mq_moe_experts_from_qtensors(&g, &u, &d, 1, NULL, NULL, NULL, "L3", &w));
    moeq_moe_experts_free(w);
    gi[0] = 1;      /* act-order: refused */
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_moe_experts_from_qtensors(&g, &u, &d, 1, NULL, NULL, NULL, "L3", &w));
    ASSERT_ERROR_MENTIONS("L3: expert 0 gate: act-order groups");
    g.g_idx = NULL;
    free(gi);
    mq_qspec n = mq_qspec_default(MQ_QS_NVFP4);
    mq_qtensor nd = quant(&n, D, F, 0);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_moe_experts_from_qtensors(&g, &u, &nd, 1, NULL, NULL, NULL, "L3", &w));
    ASSERT_ERROR_MENTIONS("down: scheme nvfp4, the layer uses int4");
    ASSERT_STATUS(MOEQ_E_ARG, mq_moe_experts_from_qtensors(&g, &u, &d, 1, &g, NULL, NULL, "L3", &w));
    ASSERT_ERROR_MENTIONS("shared expert needs gate, up and down");
    mq_qtensor_free(&nd);
    mq_qtensor_free(&g);
    mq_qtensor_free(&u);
    mq_qtensor_free(&d);
}

static void test_packed_linear(void) {
    const int64_t shapes[3][2] = {{128, 256}, {40, 128}, {16, 64}};   /* 40: padded to 48 rows */
    for (int nv = 0; nv < 2; nv++)
        for (int si = 0; si < 3; si++) {
            const int64_t R = shapes[si][0], C = shapes[si][1];
            mq_qspec s = mq_qspec_default(nv ? MQ_QS_NVFP4 : MQ_QS_INT4);
            if (!nv) s.group_size = 64;
            mq_qtensor q = quant(&s, R, C, 0);
            struct mq_packed_weight *pw = NULL;
            ASSERT_OK(mq_packed_weight_from_qtensor(&q, "lin", &pw));
            float *w = malloc(sizeof(float) * (size_t)(R * C));
            mq_dequantize(&q, w);
            for (int64_t T2 = 1; T2 <= 70; T2 += 23) {
                float *x = randn((size_t)(T2 * C), 1.0f), *ref = malloc(sizeof(float) * (size_t)(T2 * R));
                float *y = malloc(sizeof(float) * (size_t)(T2 * R)), *y1 = malloc(sizeof(float) * (size_t)(T2 * R));
                mq_gemm_nt(T2, R, C, 1.0f, x, C, w, C, 0.0f, ref, R);
                moeq_set_threads(1);
                ASSERT_OK(mq_packed_weight_forward(pw, x, T2, y1));
                moeq_set_threads(2);
                ASSERT_OK(mq_packed_weight_forward(pw, x, T2, y));
                moeq_set_threads(0);
                ASSERT_TRUE(memcmp(y, y1, sizeof(float) * (size_t)(T2 * R)) == 0);
                double db = sqnr_db(ref, y, (size_t)(T2 * R));
                if (!(db > 75)) FAIL("nvfp4 %d [%lld, %lld] T %lld: %.1f dB", nv, (long long)R, (long long)C, (long long)T2, db);
                free(x); free(ref); free(y); free(y1);
            }
            ASSERT_TRUE(mq_packed_weight_bytes(pw) >= (size_t)(R * C / 2));
            mq_packed_weight_free(pw);
            free(w);
            mq_qtensor_free(&q);
        }
    mq_packed_weight_free(NULL);
}

/* q, k and v in one call (mq_packed_weights_forward): each output has the bits of its own call,
 * a padded Linear (40 rows) included, on 1 and 2 threads; other widths or schemes are refused. */
static void test_packed_linears_together(void) {
    const int64_t C = 128, rows[3] = {128, 40, 64};
    for (int nv = 0; nv < 2; nv++) {
        mq_qspec s = mq_qspec_default(nv ? MQ_QS_NVFP4 : MQ_QS_INT4);
        if (!nv) s.group_size = 32;
        mq_qtensor q[3];
        struct mq_packed_weight *pw[3];
        for (int k = 0; k < 3; k++) {
            q[k] = quant(&s, rows[k], C, 0);
            ASSERT_OK(mq_packed_weight_from_qtensor(&q[k], "lin", &pw[k]));
        }
        for (int64_t T2 = 1; T2 <= 70; T2 += 69) {
            float *x = randn((size_t)(T2 * C), 1.0f);
            for (int th = 1; th <= 2; th++) {
                moeq_set_threads(th);
                float *one[3], *all[3];
                for (int k = 0; k < 3; k++) {
                    one[k] = malloc(sizeof(float) * (size_t)(T2 * rows[k]));
                    all[k] = malloc(sizeof(float) * (size_t)(T2 * rows[k]));
                    ASSERT_OK(mq_packed_weight_forward(pw[k], x, T2, one[k]));
                }
                ASSERT_OK(mq_packed_weights_forward((const struct mq_packed_weight *const *)pw, 3, x, T2, all));
                for (int k = 0; k < 3; k++) {
                    if (memcmp(one[k], all[k], sizeof(float) * (size_t)(T2 * rows[k])) != 0)
                        FAIL("nvfp4 %d T %lld threads %d: Linear %d differs from its own call", nv,
                             (long long)T2, th, k);
                    free(one[k]);
                    free(all[k]);
                }
            }
            moeq_set_threads(0);
            free(x);
        }
        for (int k = 0; k < 3; k++) {
            mq_packed_weight_free(pw[k]);
            mq_qtensor_free(&q[k]);
        }
    }
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 32;
    mq_qtensor a = quant(&s, 32, 128, 0), b = quant(&s, 32, 64, 0);
    struct mq_packed_weight *pw[2];
    ASSERT_OK(mq_packed_weight_from_qtensor(&a, "a", &pw[0]));
    ASSERT_OK(mq_packed_weight_from_qtensor(&b, "b", &pw[1]));
    float x[128] = {0}, ya[32], yb[32], *y[2] = {ya, yb};
    ASSERT_STATUS(MOEQ_E_ARG, mq_packed_weights_forward((const struct mq_packed_weight *const *)pw, 2, x, 1, y));
    ASSERT_ERROR_MENTIONS("widths 128 and 64");
    mq_packed_weight_free(pw[0]);
    mq_packed_weight_free(pw[1]);
    mq_qtensor_free(&a);
    mq_qtensor_free(&b);
}

TEST_MAIN(T(test_layer_from_qtensors), T(test_int4_scale_storage_size),
          T(test_unsupported_layouts_refused), T(test_packed_linear), T(test_packed_linears_together))
