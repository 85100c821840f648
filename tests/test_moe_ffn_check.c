/*
 * Argument validation of the quantized MoE FFN op (the shape function, as ExecuTorch's Meta
 * kernel for llama::quantized_moe_ffn): each case breaks one argument of a valid call and expects
 * the named status and a message naming the argument; valid calls return the output shape.
 * Also the value checks of packing (codes, scales, global scales) and the packed layout itself,
 * checked against hand-placed nibbles.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kernels/moe_ffn.h"

enum { E = 4, D = 64, F = 32, FS = 32 };

/* Backing buffers large enough for both schemes. */
static uint8_t g_guc[E * 2 * F * D], g_dnc[E * D * F], g_sguc[2 * FS * D], g_sdnc[D * FS];
static float g_gus[E * 2 * F * D / 16], g_dns[E * D * F / 16], g_sgus[2 * FS * D / 16],
    g_sdns[D * FS / 16];
static float g_gug[2 * E], g_dng[E], g_sgug[2], g_sdng[1];
static float g_x[3 * D], g_router[(E + 1) * D], g_bias[E], g_sgate[D + 1];

static moeq_tensor_ref tr(const void *p, moeq_dtype dt, int nd, int64_t a, int64_t b, int64_t c) {
    moeq_tensor_ref r = {p, dt, nd, {a, b, c, 0}, 0};
    size_t n = (size_t)a * (size_t)(nd > 1 ? b : 1) * (size_t)(nd > 2 ? c : 1);
    r.nbytes = n * (dt == MOEQ_DT_F32 ? 4 : dt == MOEQ_DT_F16 || dt == MOEQ_DT_BF16 ? 2 : 1);
    return r;
}

static void fill_buffers(void) {
    static int done = 0;
    if (done) return;
    done = 1;
    for (size_t i = 0; i < sizeof g_guc; i++) g_guc[i] = (uint8_t)(i * 7 % 16);
    for (size_t i = 0; i < sizeof g_dnc; i++) g_dnc[i] = (uint8_t)(i * 5 % 16);
    for (size_t i = 0; i < sizeof g_sguc; i++) g_sguc[i] = (uint8_t)(i * 3 % 16);
    for (size_t i = 0; i < sizeof g_sdnc; i++) g_sdnc[i] = (uint8_t)(i * 11 % 16);
    /* as floats: 0.01 (INT4 scales); as bytes these read 0x0a/0xd7/0x23/0x3c: valid E4M3 */
    for (size_t i = 0; i < sizeof g_gus / 4; i++) g_gus[i] = 0.01f;
    for (size_t i = 0; i < sizeof g_dns / 4; i++) g_dns[i] = 0.01f;
    for (size_t i = 0; i < sizeof g_sgus / 4; i++) g_sgus[i] = 0.01f;
    for (size_t i = 0; i < sizeof g_sdns / 4; i++) g_sdns[i] = 0.01f;
    for (int i = 0; i < 2 * E; i++) g_gug[i] = 100.0f;
    for (int i = 0; i < E; i++) g_dng[i] = 50.0f, g_bias[i] = 0.0f;
    g_sgug[0] = g_sgug[1] = g_sdng[0] = 80.0f;
    for (int i = 0; i < 3 * D; i++) g_x[i] = (float)((i * 37) % 19) / 19.0f - 0.5f;
    for (int i = 0; i < (E + 1) * D; i++) g_router[i] = (float)((i * 13) % 23) / 23.0f - 0.5f;
    for (int i = 0; i <= D; i++) g_sgate[i] = 0.01f * (float)(i % 5);
}

/* A valid descriptor: INT4 g32 or NVFP4, with a shared expert. */
static moeq_moe_experts_desc valid_desc(int nvfp4) {
    fill_buffers();
    const int g = nvfp4 ? 16 : 32;
    const moeq_dtype sdt = nvfp4 ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32;
    moeq_moe_experts_desc d = mq_test_moe_desc(nvfp4, g, E, D, F, FS);
    d.gate_up.codes = tr(g_guc, MOEQ_DT_U8, 3, E, 2 * F, D);
    d.gate_up.scales = tr(g_gus, sdt, 3, E, 2 * F, D / g);
    d.down.codes = tr(g_dnc, MOEQ_DT_U8, 3, E, D, F);
    d.down.scales = tr(g_dns, sdt, 3, E, D, F / g);
    d.shared_gate_up.codes = tr(g_sguc, MOEQ_DT_U8, 2, 2 * FS, D, 0);
    d.shared_gate_up.scales = tr(g_sgus, sdt, 2, 2 * FS, D / g, 0);
    d.shared_down.codes = tr(g_sdnc, MOEQ_DT_U8, 2, D, FS, 0);
    d.shared_down.scales = tr(g_sdns, sdt, 2, D, FS / g, 0);
    if (nvfp4) {
        d.gate_up.global_scale = tr(g_gug, MOEQ_DT_F32, 1, E, 0, 0);
        d.down.global_scale = tr(g_dng, MOEQ_DT_F32, 1, E, 0, 0);
        d.shared_gate_up.global_scale = tr(g_sgug, MOEQ_DT_F32, 1, 1, 0, 0);
        d.shared_down.global_scale = tr(g_sdng, MOEQ_DT_F32, 1, 1, 0, 0);
    }
    return d;
}

static const moeq_tensor_ref k_absent = {NULL, MOEQ_DT_F32, 0, {0, 0, 0, 0}, 0};

/* ---- experts descriptor ------------------------------------------------------------------- */
typedef struct {
    int nvfp4;
    moeq_status st;
    const char *mentions;
} desc_case;

static void break_desc(int id, moeq_moe_experts_desc *d) {
    switch (id) {
        case 0: d->scheme = (moeq_moe_scheme)7; break;
        case 1: d->group_size = 0; break;
        case 2: d->group_size = 48; break;
        case 3: d->group_size = 32; break;                     /* NVFP4 */
        case 4: d->n_experts = 0; break;
        case 5: d->hidden = 0; break;
        case 6: d->ffn = 0; break;
        case 7: d->shared_ffn = -1; break;
        case 8: d->hidden = 48; break;                         /* INT4 g32 */
        case 9: d->ffn = 40; break;
        case 10: d->hidden = 40; break;                        /* NVFP4 */
        case 11: d->ffn = 24; break;                           /* NVFP4 */
        case 12: d->shared_ffn = 48; break;
        case 13: d->gate_up.codes.data = NULL; break;
        case 14: d->gate_up.codes.dtype = MOEQ_DT_F32; break;
        case 15: d->gate_up.codes.shape[1] = F; break;
        case 16: d->gate_up.codes.ndim = 2; break;
        case 17: d->gate_up.codes.nbytes -= 1; break;
        case 18: d->gate_up.scales.dtype = MOEQ_DT_BF16; break;
        case 19: d->gate_up.scales.dtype = MOEQ_DT_F32; break;  /* NVFP4 */
        case 20: d->gate_up.scales.shape[2] += 1; break;
        case 21: d->down.codes.shape[1] = F; d->down.codes.shape[2] = D; break;
        case 22: d->down.scales.data = NULL; break;
        case 23: d->down.global_scale = tr(g_dng, MOEQ_DT_F32, 1, E, 0, 0); break;   /* INT4 */
        case 24: d->gate_up.global_scale.data = NULL; break;   /* NVFP4 */
        case 25: d->gate_up.global_scale.shape[0] = E + 1; break;
        case 26: d->down.global_scale = tr(g_gug, MOEQ_DT_F32, 2, E, 2, 0); break;
        case 27: d->shared_gate_up.codes.data = NULL; break;
        case 28: d->shared_ffn = 0; break;                     /* shared tensors still given */
        case 29: d->shared_down.codes.shape[1] = 2 * FS; break;
        case 30: d->down.scales.nbytes = 0; break;
        case 31: d->shared_down.global_scale.dtype = MOEQ_DT_F16; break;   /* NVFP4 */
        case 32: d->scheme = MOEQ_MOE_NVFP4; break;            /* from INT4: group 32 */
        case 33: d->down.codes.ndim = 5; break;
        case 34: d->nvfp4_global_multiplier = 2; break;        /* NVFP4 */
        case 35: d->nvfp4_global_multiplier = 1; break;        /* INT4 */
    }
}

static const desc_case k_desc_cases[] = {
    {0, MOEQ_E_UNSUPPORTED, "scheme 7"},
    {0, MOEQ_E_UNSUPPORTED, "group_size 0"},
    {0, MOEQ_E_UNSUPPORTED, "group_size 48"},
    {1, MOEQ_E_UNSUPPORTED, "NVFP4 needs 16"},
    {0, MOEQ_E_ARG, "n_experts 0"},
    {0, MOEQ_E_ARG, "hidden 0"},
    {0, MOEQ_E_ARG, "ffn 0"},
    {0, MOEQ_E_ARG, "shared_ffn -1"},
    {0, MOEQ_E_SHAPE, "hidden 48 is not a multiple of the group_size 32"},
    {0, MOEQ_E_SHAPE, "ffn 40 is not a multiple of the group_size 32"},
    {1, MOEQ_E_SHAPE, "hidden 40 is not a multiple of the NVFP4 block 16"},
    {1, MOEQ_E_SHAPE, "ffn 24 is not a multiple of the NVFP4 block 16"},
    {0, MOEQ_E_SHAPE, "shared_ffn 48"},
    {0, MOEQ_E_ARG, "gate_up.codes: data is NULL"},
    {0, MOEQ_E_ARG, "gate_up.codes: dtype F32, expected U8"},
    {0, MOEQ_E_SHAPE, "gate_up.codes: shape [4, 32, 64], expected [4, 64, 64]"},
    {0, MOEQ_E_SHAPE, "gate_up.codes: shape [4, 64], expected [4, 64, 64]"},
    {0, MOEQ_E_ARG, "gate_up.codes: buffer of 16383 bytes"},
    {0, MOEQ_E_ARG, "gate_up.scales: dtype BF16, expected F32"},
    {1, MOEQ_E_ARG, "gate_up.scales: dtype F32, expected F8_E4M3"},
    {0, MOEQ_E_SHAPE, "gate_up.scales: shape [4, 64, 3], expected [4, 64, 2]"},
    {0, MOEQ_E_SHAPE, "down.codes: shape [4, 32, 64], expected [4, 64, 32]"},
    {0, MOEQ_E_ARG, "down.scales: data is NULL"},
    {0, MOEQ_E_ARG, "down.global_scale: must be absent (INT4)"},
    {1, MOEQ_E_ARG, "gate_up.global_scale: data is NULL"},
    {1, MOEQ_E_SHAPE, "gate_up.global_scale: shape [5], expected [4]"},
    {1, MOEQ_E_SHAPE, "down.global_scale: shape [4, 2], expected [4]"},
    {0, MOEQ_E_ARG, "shared_gate_up.codes: data is NULL"},
    {0, MOEQ_E_ARG, "shared_gate_up.codes: must be absent (shared_ffn is 0)"},
    {0, MOEQ_E_SHAPE, "shared_down.codes: shape [64, 64], expected [64, 32]"},
    {0, MOEQ_E_ARG, "down.scales: buffer of 0 bytes"},
    {1, MOEQ_E_ARG, "shared_down.global_scale: dtype F16, expected F32"},
    {0, MOEQ_E_UNSUPPORTED, "NVFP4 needs 16"},
    {0, MOEQ_E_SHAPE, "down.codes: ndim 5"},
    {1, MOEQ_E_ARG, "nvfp4_global_multiplier 2 (expected 0 or 1)"},
    {0, MOEQ_E_ARG, "nvfp4_global_multiplier is set for an INT4 layer"},
};

static void test_experts_check_rejects_each_argument(void) {
    const size_t n = sizeof k_desc_cases / sizeof k_desc_cases[0];
    for (size_t i = 0; i < n; i++) {
        moeq_moe_experts_desc d = valid_desc(k_desc_cases[i].nvfp4);
        ASSERT_OK(moeq_moe_experts_check(&d));
        break_desc((int)i, &d);
        moeq_status st = moeq_moe_experts_check(&d);
        if (st != k_desc_cases[i].st || !strstr(moeq_last_error(), k_desc_cases[i].mentions))
            FAIL("case %zu: expected %s mentioning \"%s\", got %s: \"%s\"", i,
                 moeq_status_name(k_desc_cases[i].st), k_desc_cases[i].mentions,
                 moeq_status_name(st), moeq_last_error());
        /* pack refuses the same descriptor without packing anything */
        moeq_moe_experts *w = (moeq_moe_experts *)&d;
        ASSERT_EQ_INT(st, moeq_moe_experts_pack(&d, &w));
        ASSERT_TRUE(w == NULL);
    }
    ASSERT_STATUS(MOEQ_E_ARG, moeq_moe_experts_check(NULL));
    ASSERT_ERROR_MENTIONS("descriptor is NULL");
}

static void test_experts_accepts_variants(void) {
    moeq_moe_experts_desc d = valid_desc(1);
    d.gate_up.global_scale = tr(g_gug, MOEQ_DT_F32, 2, E, 2, 0);      /* separate gate/up scales */
    d.shared_gate_up.global_scale = tr(g_sgug, MOEQ_DT_F32, 1, 2, 0, 0);
    ASSERT_OK(moeq_moe_experts_check(&d));
    d = valid_desc(0);
    d.shared_ffn = 0;
    d.shared_gate_up.codes = d.shared_gate_up.scales = d.shared_down.codes = d.shared_down.scales = k_absent;
    ASSERT_OK(moeq_moe_experts_check(&d));
    moeq_moe_experts *w = NULL;
    ASSERT_OK(moeq_moe_experts_pack(&d, &w));
    /* E row blocks of 8 rows: (2F/8) * (D*4 + D/32*8*4 bytes) + (D/8) * (F*4 + F/32*32) */
    ASSERT_EQ_INT(E * ((2 * F / 8) * 320 + (D / 8) * 192), moeq_moe_experts_bytes(w));
    moeq_moe_experts_free(w);
    moeq_moe_experts_free(NULL);
    ASSERT_STATUS(MOEQ_E_ARG, moeq_moe_experts_pack(&d, NULL));
}

/* ---- value checks while packing ------------------------------------------------------------ */
static void test_pack_rejects_bad_values(void) {
    moeq_moe_experts *w = NULL;
    moeq_moe_experts_desc d = valid_desc(0);
    uint8_t save = g_guc[(2 * 2 * F + 3) * D + 5];
    g_guc[(2 * 2 * F + 3) * D + 5] = 16;   /* expert 2, row 3, col 5 */
    ASSERT_STATUS(MOEQ_E_FORMAT, moeq_moe_experts_pack(&d, &w));
    ASSERT_ERROR_MENTIONS("gate_up.codes: expert 2 row 3 col 5: code 16 > 15");
    ASSERT_TRUE(w == NULL);
    g_guc[(2 * 2 * F + 3) * D + 5] = save;

    g_dns[(1 * D + 7) * (F / 32)] = NAN;   /* expert 1, row 7, group 0 */
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_moe_experts_pack(&d, &w));
    ASSERT_ERROR_MENTIONS("down.scales: expert 1 row 7 group 0: not finite");
    g_dns[(1 * D + 7) * (F / 32)] = 0.01f;

    g_sgus[2] = INFINITY;                  /* shared gate_up, row 1 (2 groups per row) */
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_moe_experts_pack(&d, &w));
    ASSERT_ERROR_MENTIONS("shared_gate_up.scales: row 1 group 0: not finite");
    g_sgus[2] = 0.01f;

    d = valid_desc(1);
    uint8_t *s8 = (uint8_t *)g_gus;
    uint8_t sv = s8[(0 * 2 * F + F + 2) * (D / 16) + 1];
    s8[(0 * 2 * F + F + 2) * (D / 16) + 1] = 0x7f;   /* expert 0, up row 2 = row F + 2 */
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_moe_experts_pack(&d, &w));
    ASSERT_ERROR_MENTIONS("gate_up.scales: expert 0 row 34 group 1: E4M3 NaN");
    s8[(0 * 2 * F + F + 2) * (D / 16) + 1] = sv;

    g_dng[3] = 0.0f;
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_moe_experts_pack(&d, &w));
    ASSERT_ERROR_MENTIONS("down.global_scale: expert 3: 0");
    g_dng[3] = INFINITY;
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_moe_experts_pack(&d, &w));
    ASSERT_ERROR_MENTIONS("down.global_scale: expert 3");
    g_dng[3] = 50.0f;
    g_sgug[0] = -1.0f;
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_moe_experts_pack(&d, &w));
    ASSERT_ERROR_MENTIONS("shared_gate_up.global_scale: -1");
    g_sgug[0] = 80.0f;
    ASSERT_OK(moeq_moe_experts_pack(&d, &w));
    moeq_moe_experts_free(w);
}

/* ---- op arguments ---------------------------------------------------------------------------- */
static moeq_moe_experts *g_w;   /* INT4 with a shared expert */

static moeq_moe_ffn_args valid_args(void) {
    if (!g_w) {
        moeq_moe_experts_desc d = valid_desc(0);
        moeq_status st = moeq_moe_experts_pack(&d, &g_w);
        if (st) FAIL("pack: %s", moeq_last_error());
    }
    moeq_moe_ffn_args a;
    memset(&a, 0, sizeof a);
    a.x = tr(g_x, MOEQ_DT_F32, 2, 3, D, 0);
    a.router = tr(g_router, MOEQ_DT_F32, 2, E, D, 0);
    a.router_bias = tr(g_bias, MOEQ_DT_F32, 1, E, 0, 0);
    a.shared_gate = tr(g_sgate, MOEQ_DT_F32, 1, D, 0, 0);
    a.experts = g_w;
    a.top_k = 2;
    a.scoring = MOEQ_MOE_SIGMOID;
    a.renormalize = 1;
    a.route_scale = 2.5f;
    return a;
}

static void break_args(int id, moeq_moe_ffn_args *a) {
    switch (id) {
        case 0: a->experts = NULL; break;
        case 1: a->x.ndim = 3; break;
        case 2: a->x.dtype = MOEQ_DT_BF16; break;
        case 3: a->x.shape[1] = D + 1; break;
        case 4: a->x.data = NULL; break;
        case 5: a->x.nbytes -= 4; break;
        case 6: a->router.data = NULL; break;
        case 7: a->router.dtype = MOEQ_DT_F16; break;
        case 8: a->router.shape[0] = E + 1; break;
        case 9: a->router.nbytes = 16; break;
        case 10: a->router_bias.dtype = MOEQ_DT_F16; break;
        case 11: a->router_bias.shape[0] = E - 1; break;
        case 12: a->shared_gate.shape[0] = D + 1; break;
        case 13: a->top_k = 0; break;
        case 14: a->top_k = E + 1; break;
        case 15: a->scoring = (moeq_moe_scoring)5; break;
        case 16: a->renormalize = 2; break;
        case 17: a->route_scale = NAN; break;
        case 18: a->route_scale = -INFINITY; break;
        case 19: a->x.shape[0] = -2; break;
        case 20: a->shared_gate.dtype = MOEQ_DT_F64; break;
        case 21: a->router_bias.ndim = 2; break;
        case 22: a->n_group = 3; break;                       /* does not divide 4 experts */
        case 23: a->n_group = 4; break;                       /* groups of one */
        case 24: a->n_group = 2; a->topk_group = 0; break;
        case 25: a->n_group = 2; a->topk_group = 3; break;
        case 26: a->n_group = 2; a->topk_group = 1; a->top_k = 3; break;
        case 27: a->n_group = -1; break;
    }
}

static const struct {
    moeq_status st;
    const char *mentions;
} k_arg_cases[] = {
    {MOEQ_E_ARG, "experts is NULL"},
    {MOEQ_E_SHAPE, "x: ndim 3, expected 2"},
    {MOEQ_E_ARG, "x: dtype BF16, expected F32"},
    {MOEQ_E_SHAPE, "x: shape [3, 65], expected [3, 64]"},
    {MOEQ_E_ARG, "x: data is NULL"},
    {MOEQ_E_ARG, "x: buffer of 764 bytes"},
    {MOEQ_E_ARG, "router: data is NULL"},
    {MOEQ_E_ARG, "router: dtype F16, expected F32"},
    {MOEQ_E_SHAPE, "router: shape [5, 64], expected [4, 64]"},
    {MOEQ_E_ARG, "router: buffer of 16 bytes"},
    {MOEQ_E_ARG, "router_bias: dtype F16"},
    {MOEQ_E_SHAPE, "router_bias: shape [3], expected [4]"},
    {MOEQ_E_SHAPE, "shared_gate: shape [65], expected [64]"},
    {MOEQ_E_ARG, "top_k 0"},
    {MOEQ_E_ARG, "top_k 5: must be in 1..4"},
    {MOEQ_E_UNSUPPORTED, "scoring 5"},
    {MOEQ_E_ARG, "renormalize 2"},
    {MOEQ_E_ARG, "route_scale nan"},
    {MOEQ_E_ARG, "route_scale -inf"},
    {MOEQ_E_SHAPE, "x: -2 tokens"},
    {MOEQ_E_ARG, "shared_gate: dtype F64"},
    {MOEQ_E_SHAPE, "router_bias: shape [4, 0], expected [4]"},
    {MOEQ_E_ARG, "n_group 3: must be 0, 1 or divide n_experts 4"},
    {MOEQ_E_ARG, "n_group 4: must be 0, 1 or divide n_experts 4 into groups of at least 2"},
    {MOEQ_E_ARG, "topk_group 0: must be in 1..n_group 2"},
    {MOEQ_E_ARG, "topk_group 3: must be in 1..n_group 2"},
    {MOEQ_E_ARG, "top_k 3 exceeds the 2 experts of topk_group 1 groups"},
    {MOEQ_E_ARG, "n_group -1"},
};

static void test_op_check_rejects_each_argument(void) {
    int64_t shape[2] = {-1, -1};
    moeq_moe_ffn_args a = valid_args();
    ASSERT_OK(moeq_moe_ffn_check(&a, shape));
    ASSERT_EQ_INT(3, shape[0]);
    ASSERT_EQ_INT(D, shape[1]);
    const size_t n = sizeof k_arg_cases / sizeof k_arg_cases[0];
    float out[3 * D];
    for (size_t i = 0; i < n; i++) {
        a = valid_args();
        break_args((int)i, &a);
        shape[0] = shape[1] = -7;
        moeq_status st = moeq_moe_ffn_check(&a, shape);
        if (st != k_arg_cases[i].st || !strstr(moeq_last_error(), k_arg_cases[i].mentions))
            FAIL("case %zu: expected %s mentioning \"%s\", got %s: \"%s\"", i,
                 moeq_status_name(k_arg_cases[i].st), k_arg_cases[i].mentions,
                 moeq_status_name(st), moeq_last_error());
        ASSERT_EQ_INT(-7, shape[0]);                         /* nothing written on failure */
        ASSERT_EQ_INT(st, moeq_moe_ffn(&a, out, 3 * D));     /* compute checks first */
    }
    ASSERT_STATUS(MOEQ_E_ARG, moeq_moe_ffn_check(NULL, shape));
    ASSERT_ERROR_MENTIONS("args is NULL");
    a = valid_args();
    ASSERT_STATUS(MOEQ_E_ARG, moeq_moe_ffn_check(&a, NULL));
    ASSERT_ERROR_MENTIONS("out_shape is NULL");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_moe_ffn(&a, NULL, 3 * D));
    ASSERT_ERROR_MENTIONS("out is NULL");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_moe_ffn(&a, out, 3 * D - 1));
    ASSERT_ERROR_MENTIONS("out holds 191 floats, [3, 64] needs 192");
    ASSERT_OK(moeq_moe_ffn(&a, out, 3 * D));
}

static void test_op_check_accepts_variants(void) {
    int64_t shape[2];
    moeq_moe_ffn_args a = valid_args();
    a.shared_gate = tr(g_sgate, MOEQ_DT_F32, 2, 1, D, 0);   /* [1, D] */
    a.router_bias = k_absent;
    a.scoring = MOEQ_MOE_SOFTMAX;
    a.top_k = E;
    ASSERT_OK(moeq_moe_ffn_check(&a, shape));
    a.n_group = 2;   /* two groups of two, both eligible; then one of them, top-2 inside it */
    a.topk_group = 2;
    ASSERT_OK(moeq_moe_ffn_check(&a, shape));
    a.topk_group = 1;
    a.top_k = 2;
    ASSERT_OK(moeq_moe_ffn_check(&a, shape));
    a.n_group = 1;   /* one group: topk_group is not read */
    a.topk_group = 0;
    ASSERT_OK(moeq_moe_ffn_check(&a, shape));
    a.n_group = 0;
    a.top_k = E;
    a.x = tr(NULL, MOEQ_DT_F32, 2, 0, D, 0);                 /* no tokens */
    ASSERT_OK(moeq_moe_ffn_check(&a, shape));
    ASSERT_EQ_INT(0, shape[0]);
    ASSERT_OK(moeq_moe_ffn(&a, NULL, 0));
    /* a shared gate needs a shared expert */
    moeq_moe_experts_desc d = valid_desc(0);
    d.shared_ffn = 0;
    d.shared_gate_up.codes = d.shared_gate_up.scales = d.shared_down.codes = d.shared_down.scales = k_absent;
    moeq_moe_experts *w = NULL;
    ASSERT_OK(moeq_moe_experts_pack(&d, &w));
    a = valid_args();
    a.experts = w;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_moe_ffn_check(&a, shape));
    ASSERT_ERROR_MENTIONS("shared_gate given but the experts have no shared expert");
    a.shared_gate = k_absent;
    ASSERT_OK(moeq_moe_ffn_check(&a, shape));
    moeq_moe_experts_free(w);
    moeq_moe_experts_free(g_w);
    g_w = NULL;
}

/* ---- packed layout --------------------------------------------------------------------------- */
/* Hand-placed nibbles: code(row l, col k) goes to byte (k/8)*32 + 4l + k%4, low nibble for
 * k%8 < 4, high nibble otherwise; scales follow as [group][row]. */
static void test_pack_layout_bits(void) {
    enum { R = 8, K = 64 };
    uint8_t codes[R * K];
    float scales[R * 2];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++) codes[r * K + k] = (uint8_t)((r + 3 * k) & 15);
    for (int i = 0; i < R * 2; i++) scales[i] = 1.0f + (float)i;
    mq_moe_src src = {codes, (const uint8_t *)scales, 4, 1.0f, 0};
    size_t rbb = mq_moe_rb_bytes(K, 32, MQ_MOE_S_F32);
    ASSERT_EQ_INT(320, rbb);   /* 256 code bytes + 2 groups x 8 rows x 4 */
    uint8_t *dst = malloc(rbb);
    mq_moe_pack_rb(&src, R, K, 32, 0, MQ_MOE_S_F32, 0, dst);
    ASSERT_EQ_HEX(12 << 4, dst[0]);                /* row 0: col 0 (0) low, col 4 (12) high */
    ASSERT_EQ_HEX(((1 + 12) << 4) | 1, dst[4]);    /* row 1: col 0 = 1, col 4 = 13 */
    ASSERT_EQ_HEX((((2 + 3 * 14) & 15) << 4) | ((2 + 3 * 10) & 15), dst[32 + 8 + 2]);   /* row 2, col 10/14 */
    ASSERT_EQ_HEX((((7 + 3 * 63) & 15) << 4) | ((7 + 3 * 59) & 15), dst[7 * 32 + 28 + 3]);
    float s;
    memcpy(&s, dst + 256 + (1 * 8 + 5) * 4, 4);    /* group 1, row 5 = scales[5 * 2 + 1] */
    ASSERT_EQ_INT(12, (int)s);
    free(dst);
}

TEST_MAIN(T(test_experts_check_rejects_each_argument), T(test_experts_accepts_variants),
          T(test_pack_rejects_bad_values), T(test_op_check_rejects_each_argument),
          T(test_op_check_accepts_variants), T(test_pack_layout_bits))
