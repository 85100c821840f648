/* Checkpoint layouts of one quantized Linear (formats.md 2.1-2.4): tensor names, dtypes and shapes,
 * hand-made packing bit vectors, malformed inputs, and pack -> unpack -> dequant round trips that
 * are bit-identical to the in-memory quantization. */
#include <stdlib.h>

#include "export/layout.h"
#include "harness.h"

/* ---- an in-memory "checkpoint": emitted tensors, looked up by name ---------------------- */
typedef struct {
    mq_tensor_view t[32];
    char names[32][256];
    int n;
} memckpt;

static moeq_status mem_emit(void *user, const char *name, moeq_dtype dt, int ndim,
                            const int64_t *shape, void *data, size_t nbytes) {
    memckpt *m = user;
    if (m->n == 32) {
        mq_free(data);
        return mq_err(MOEQ_E_ARG, "too many tensors");
    }
    mq_tensor_view *t = &m->t[m->n];
    memset(t, 0, sizeof *t);
    snprintf(m->names[m->n], 256, "%s", name);
    t->name = m->names[m->n];
    t->dtype = dt;
    t->ndim = ndim;
    t->numel = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        t->numel *= shape[i];
    }
    t->data = data;
    t->nbytes = nbytes;
    t->file = "mem";
    m->n++;
    return MOEQ_OK;
}

static const mq_tensor_view *mem_find(void *user, const char *name) {
    memckpt *m = user;
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->t[i].name, name) == 0) return &m->t[i];
    return NULL;
}

static void mem_free(memckpt *m) {
    for (int i = 0; i < m->n; i++) mq_free((void *)m->t[i].data);
    m->n = 0;
}

static void expect_tensor(memckpt *m, const char *name, moeq_dtype dt, int ndim, int64_t d0,
                          int64_t d1) {
    const mq_tensor_view *t = mem_find(m, name);
    if (!t) {
        FAIL("tensor '%s' not emitted", name);
        return;
    }
    ASSERT_EQ_INT(dt, t->dtype);
    ASSERT_EQ_INT(ndim, t->ndim);
    if (ndim > 0) ASSERT_EQ_INT(d0, t->shape[0]);
    if (ndim > 1) ASSERT_EQ_INT(d1, t->shape[1]);
}

static uint32_t rd32(const mq_tensor_view *t, int64_t i) {
    uint32_t v;
    memcpy(&v, t->data + 4 * i, 4);
    return v;
}

static uint32_t rng = 99;
static float rnd(void) {
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / 16777216.0f * 2.0f - 1.0f;
}

/* ---- names, dtypes, shapes, bit vectors ------------------------------------------------- */

static void test_ct_nvfp4_layout(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_qtensor q;
    ASSERT_OK(mq_qtensor_init(&q, &s, 2, 32, "t"));
    q.global_scale = 448.0f;
    /* row 0 codes 0,1,2,...,15 then 15..0; row 1 all 0x9 */
    for (int i = 0; i < 16; i++) q.codes[i] = (uint8_t)i, q.codes[16 + i] = (uint8_t)(15 - i);
    for (int i = 0; i < 32; i++) q.codes[32 + i] = 0x9;
    q.params[0].scale_code = 0x76, q.params[0].scale = 224;
    q.params[1].scale_code = 0x01, q.params[1].scale = 0x1p-9f;
    q.params[2].scale_code = 0x38, q.params[2].scale = 1;
    q.params[3].scale_code = 0x00, q.params[3].scale = 0;
    memckpt m = {0};
    ASSERT_OK(mq_layout_emit(MQ_FMT_CT, "model.layers.0.self_attn.q_proj", &q, 10.0f, mem_emit, &m));
    ASSERT_EQ_INT(4, m.n);
    expect_tensor(&m, "model.layers.0.self_attn.q_proj.weight_packed", MOEQ_DT_U8, 2, 2, 16);
    expect_tensor(&m, "model.layers.0.self_attn.q_proj.weight_scale", MOEQ_DT_F8_E4M3, 2, 2, 2);
    expect_tensor(&m, "model.layers.0.self_attn.q_proj.weight_global_scale", MOEQ_DT_F32, 1, 1, 0);
    expect_tensor(&m, "model.layers.0.self_attn.q_proj.input_global_scale", MOEQ_DT_F32, 1, 1, 0);
    const mq_tensor_view *p = mem_find(&m, "model.layers.0.self_attn.q_proj.weight_packed");
    ASSERT_EQ_HEX(0x10, p->data[0]);    /* even column in the low nibble */
    ASSERT_EQ_HEX(0x32, p->data[1]);
    ASSERT_EQ_HEX(0xFE, p->data[7]);
    ASSERT_EQ_HEX(0xEF, p->data[8]);
    ASSERT_EQ_HEX(0x99, p->data[16]);
    const mq_tensor_view *sc = mem_find(&m, "model.layers.0.self_attn.q_proj.weight_scale");
    ASSERT_EQ_HEX(0x76, sc->data[0]);
    ASSERT_EQ_HEX(0x01, sc->data[1]);
    ASSERT_EQ_HEX(0x38, sc->data[2]);
    float v;
    memcpy(&v, mem_find(&m, "model.layers.0.self_attn.q_proj.weight_global_scale")->data, 4);
    ASSERT_NEAR(448.0, v, 0);
    memcpy(&v, mem_find(&m, "model.layers.0.self_attn.q_proj.input_global_scale")->data, 4);
    ASSERT_NEAR(268.8f, v, 0);
    ASSERT_EQ_INT(MQ_LIN_CT_NVFP4, mq_layout_detect("model.layers.0.self_attn.q_proj", mem_find, &m));
    mq_qtensor back;
    ASSERT_OK(mq_layout_read("model.layers.0.self_attn.q_proj", 2, 32, mem_find, &m, &back));
    ASSERT_TRUE(memcmp(q.codes, back.codes, 64) == 0);
    ASSERT_NEAR(448.0, back.global_scale, 0);
    for (int i = 0; i < 4; i++) {
        ASSERT_EQ_HEX(q.params[i].scale_code, back.params[i].scale_code);
        ASSERT_NEAR(q.params[i].scale, back.params[i].scale, 0);
    }
    mq_qtensor_free(&back);
    /* no activation scale without calibration (W4A16) */
    mem_free(&m);
    ASSERT_OK(mq_layout_emit(MQ_FMT_CT, "x", &q, 0, mem_emit, &m));
    ASSERT_EQ_INT(3, m.n);
    mem_free(&m);
    mq_qtensor_free(&q);
}

static void test_modelopt_nvfp4_layout(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    s.nvfp4_conv = MQ_NVFP4_MUL;
    mq_qtensor q;
    ASSERT_OK(mq_qtensor_init(&q, &s, 1, 16, "t"));
    q.global_scale = 0.25f;
    q.codes[0] = 0x3;
    q.codes[1] = 0xC;
    memckpt m = {0};
    ASSERT_OK(mq_layout_emit(MQ_FMT_MODELOPT, "m.w1", &q, 5376.0f, mem_emit, &m));
    ASSERT_EQ_INT(4, m.n);
    expect_tensor(&m, "m.w1.weight", MOEQ_DT_U8, 2, 1, 8);
    expect_tensor(&m, "m.w1.weight_scale", MOEQ_DT_F8_E4M3, 2, 1, 1);
    expect_tensor(&m, "m.w1.weight_scale_2", MOEQ_DT_F32, 0, 0, 0);
    expect_tensor(&m, "m.w1.input_scale", MOEQ_DT_F32, 0, 0, 0);
    ASSERT_EQ_HEX(0xC3, mem_find(&m, "m.w1.weight")->data[0]);
    float v;
    memcpy(&v, mem_find(&m, "m.w1.weight_scale_2")->data, 4);
    ASSERT_NEAR(0.25, v, 0);
    memcpy(&v, mem_find(&m, "m.w1.input_scale")->data, 4);
    ASSERT_NEAR(2.0, v, 0);
    ASSERT_EQ_INT(MQ_LIN_MODELOPT_NVFP4, mq_layout_detect("m.w1", mem_find, &m));
    mem_free(&m);
    /* a CT-convention tensor stored as ModelOpt gets the reciprocal */
    q.spec.nvfp4_conv = MQ_NVFP4_CT;
    q.global_scale = 448.0f;
    ASSERT_OK(mq_layout_emit(MQ_FMT_MODELOPT, "m.w1", &q, 0, mem_emit, &m));
    memcpy(&v, mem_find(&m, "m.w1.weight_scale_2")->data, 4);
    ASSERT_NEAR(1.0f / 448.0f, v, 0);
    mem_free(&m);
    mq_qtensor_free(&q);
}

/* An INT4 tensor of spec s, rows x 16, code (column + row) mod 16; its group params left to set. */
static mq_qtensor int4_codes(const mq_qspec *s, int rows) {
    mq_qtensor q;
    ASSERT_OK(mq_qtensor_init(&q, s, rows, 16, "t"));
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 16; c++) q.codes[r * 16 + c] = (uint8_t)((c + r) & 15);
    return q;
}

static void test_ct_int4_layout(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 8;
    s.asym = true;
    mq_qtensor q = int4_codes(&s, 3);
    for (int i = 0; i < 6; i++) {
        q.params[i].scale = 0.5f * (float)(i + 1);
        q.params[i].zero = (float)(i + 3);
    }
    memckpt m = {0};
    ASSERT_OK(mq_layout_emit(MQ_FMT_CT, "e.down_proj", &q, 0, mem_emit, &m));
    ASSERT_EQ_INT(4, m.n);
    expect_tensor(&m, "e.down_proj.weight_packed", MOEQ_DT_I32, 2, 3, 2);
    expect_tensor(&m, "e.down_proj.weight_scale", MOEQ_DT_BF16, 2, 3, 2);
    expect_tensor(&m, "e.down_proj.weight_shape", MOEQ_DT_I64, 1, 2, 0);
    expect_tensor(&m, "e.down_proj.weight_zero_point", MOEQ_DT_I32, 2, 1, 2);
    const mq_tensor_view *p = mem_find(&m, "e.down_proj.weight_packed");
    ASSERT_EQ_HEX(0x76543210u, rd32(p, 0));   /* LSB first */
    ASSERT_EQ_HEX(0xFEDCBA98u, rd32(p, 1));
    ASSERT_EQ_HEX(0x87654321u, rd32(p, 2));
    /* zero points: rows 0,1,2 of group 0 are 3,5,7 -> nibbles 0,1,2 of word (0, 0) */
    const mq_tensor_view *z = mem_find(&m, "e.down_proj.weight_zero_point");
    ASSERT_EQ_HEX(0x753u, rd32(z, 0));
    ASSERT_EQ_HEX(0x864u, rd32(z, 1));
    int64_t shp[2];
    memcpy(shp, mem_find(&m, "e.down_proj.weight_shape")->data, 16);
    ASSERT_EQ_INT(3, shp[0]);
    ASSERT_EQ_INT(16, shp[1]);
    uint16_t b;
    memcpy(&b, mem_find(&m, "e.down_proj.weight_scale")->data + 2, 2);
    ASSERT_EQ_HEX(0x3F80, b);   /* params[1].scale = 1.0 */
    mq_qtensor back;
    ASSERT_OK(mq_layout_read("e.down_proj", 3, 16, mem_find, &m, &back));
    ASSERT_TRUE(back.spec.asym);
    ASSERT_EQ_INT(8, back.group_size);
    ASSERT_TRUE(memcmp(q.codes, back.codes, 48) == 0);
    for (int i = 0; i < 6; i++) {
        ASSERT_NEAR(q.params[i].scale, back.params[i].scale, 0);
        ASSERT_NEAR(q.params[i].zero, back.params[i].zero, 0);
    }
    mq_qtensor_free(&back);
    mem_free(&m);
    /* symmetric: no zero point; act-order g_idx is written and read back */
    q.spec.asym = false;
    q.g_idx = mq_alloc(16 * 4, "g");
    for (int c = 0; c < 16; c++) q.g_idx[c] = c % 2;
    ASSERT_OK(mq_layout_emit(MQ_FMT_CT, "e.down_proj", &q, 0, mem_emit, &m));
    ASSERT_TRUE(mem_find(&m, "e.down_proj.weight_zero_point") == NULL);
    expect_tensor(&m, "e.down_proj.weight_g_idx", MOEQ_DT_I32, 1, 16, 0);
    ASSERT_OK(mq_layout_read("e.down_proj", 3, 16, mem_find, &m, &back));
    ASSERT_FALSE(back.spec.asym);
    ASSERT_TRUE(back.g_idx != NULL);
    if (back.g_idx) ASSERT_EQ_INT(1, back.g_idx[3]);
    mq_qtensor_free(&back);
    mem_free(&m);
    mq_qtensor_free(&q);
}

static void test_gptq_layout(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 8;
    s.scale_dtype = MOEQ_DT_F16;
    mq_qtensor q = int4_codes(&s, 8);
    for (int i = 0; i < 16; i++) q.params[i].scale = 0.25f * (float)(i + 1);
    memckpt m = {0};
    ASSERT_OK(mq_layout_emit(MQ_FMT_GPTQ, "l.o_proj", &q, 0, mem_emit, &m));
    ASSERT_EQ_INT(4, m.n);
    expect_tensor(&m, "l.o_proj.qweight", MOEQ_DT_I32, 2, 2, 8);
    expect_tensor(&m, "l.o_proj.qzeros", MOEQ_DT_I32, 2, 2, 1);
    expect_tensor(&m, "l.o_proj.scales", MOEQ_DT_F16, 2, 2, 8);
    expect_tensor(&m, "l.o_proj.g_idx", MOEQ_DT_I32, 1, 16, 0);
    const mq_tensor_view *qw = mem_find(&m, "l.o_proj.qweight");
    /* qweight[r, n] packs inputs 8r..8r+7 of output n: n=0,r=0 -> 0..7; n=1,r=0 -> 1..8 */
    ASSERT_EQ_HEX(0x76543210u, rd32(qw, 0));
    ASSERT_EQ_HEX(0x87654321u, rd32(qw, 1));
    ASSERT_EQ_HEX(0xFEDCBA98u, rd32(qw, 8));
    ASSERT_EQ_HEX(0x77777777u, rd32(mem_find(&m, "l.o_proj.qzeros"), 0));
    uint16_t h;
    memcpy(&h, mem_find(&m, "l.o_proj.scales")->data + 2 * 8, 2);   /* scales[1, 0] = params[0*2+1] */
    ASSERT_EQ_HEX(mq_f32_to_f16(0.5f), h);
    ASSERT_EQ_INT(1, rd32(mem_find(&m, "l.o_proj.g_idx"), 9));
    mq_qtensor back;
    ASSERT_OK(mq_layout_read("l.o_proj", 8, 16, mem_find, &m, &back));
    ASSERT_FALSE(back.spec.asym);
    ASSERT_TRUE(back.g_idx == NULL);   /* trivial g_idx is dropped */
    ASSERT_TRUE(memcmp(q.codes, back.codes, 128) == 0);
    for (int i = 0; i < 16; i++) ASSERT_NEAR(q.params[i].scale, back.params[i].scale, 0);
    mq_qtensor_free(&back);
    mem_free(&m);
    /* asym: v1 stores zero - 1; zero 0 cannot be stored */
    q.spec.asym = true;
    for (int i = 0; i < 16; i++) q.params[i].zero = (float)(1 + i % 15);
    ASSERT_OK(mq_layout_emit(MQ_FMT_GPTQ, "l.o_proj", &q, 0, mem_emit, &m));
    /* group 0 holds rows n = 0..7 -> zeros 1,3,5,...,15 -> stored 0,2,4,...,14 */
    ASSERT_EQ_HEX(0xECA86420u, rd32(mem_find(&m, "l.o_proj.qzeros"), 0));
    ASSERT_OK(mq_layout_read("l.o_proj", 8, 16, mem_find, &m, &back));
    ASSERT_TRUE(back.spec.asym);
    for (int i = 0; i < 16; i++) ASSERT_NEAR(q.params[i].zero, back.params[i].zero, 0);
    mq_qtensor_free(&back);
    mem_free(&m);
    q.params[3].zero = 0;
    ASSERT_STATUS(MOEQ_E_ARG, mq_layout_emit(MQ_FMT_GPTQ, "l.o_proj", &q, 0, mem_emit, &m));
    ASSERT_ERROR_MENTIONS("l.o_proj");
    mem_free(&m);
    mq_qtensor_free(&q);
}

/* ---- round trips ------------------------------------------------------------------------ */

static void round_trip(mq_ckpt_format fmt, mq_qspec s, int64_t N, int64_t K) {
    float *w = malloc(sizeof(float) * N * K), *d1 = malloc(sizeof(float) * N * K);
    float *d2 = malloc(sizeof(float) * N * K);
    for (int64_t i = 0; i < N * K; i++) w[i] = rnd() * (i % 7 == 0 ? 3.0f : 0.5f);
    mq_qtensor q, back;
    ASSERT_OK(mq_quantize_rtn(&s, w, N, K, 0, "w", &q));
    mq_dequantize(&q, d1);
    memckpt m = {0};
    ASSERT_OK(mq_layout_emit(fmt, "mod", &q, 0, mem_emit, &m));
    ASSERT_OK(mq_layout_read("mod", N, K, mem_find, &m, &back));
    mq_dequantize(&back, d2);
    if (memcmp(d1, d2, sizeof(float) * N * K) != 0)
        FAIL("%s %s round trip is not bit-identical", mq_ckpt_format_name(fmt),
             mq_qscheme_name(s.scheme));
    mq_qtensor_free(&q);
    mq_qtensor_free(&back);
    mem_free(&m);
    free(w); free(d1); free(d2);
}

static void test_round_trips_are_bit_identical(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    round_trip(MQ_FMT_CT, s, 24, 64);
    s.nvfp4_conv = MQ_NVFP4_MUL;
    round_trip(MQ_FMT_MODELOPT, s, 24, 64);
    s = mq_qspec_reference(MQ_QS_NVFP4);
    round_trip(MQ_FMT_MODELOPT, s, 24, 64);
    s.mse = true;
    round_trip(MQ_FMT_MODELOPT, s, 24, 64);
    s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 32;
    round_trip(MQ_FMT_CT, s, 20, 128);
    s.asym = true;
    round_trip(MQ_FMT_CT, s, 20, 128);
    s.group_size = -1;
    round_trip(MQ_FMT_CT, s, 20, 128);
    s = mq_qspec_default(MQ_QS_INT4);
    s.scale_dtype = MOEQ_DT_F16;
    round_trip(MQ_FMT_GPTQ, s, 16, 256);
    s.asym = true;
    s.int4_zero_min = 1;
    s.mse = true;
    round_trip(MQ_FMT_GPTQ, s, 16, 256);
    s.scale_dtype = MOEQ_DT_F32;
    round_trip(MQ_FMT_CT, s, 16, 256);
}

static void test_malformed_tensors_are_format_errors(void) {
    mq_qspec s = mq_qspec_default(MQ_QS_NVFP4);
    mq_qtensor q, back;
    ASSERT_OK(mq_qtensor_init(&q, &s, 2, 32, "t"));
    q.global_scale = 1;
    memckpt m = {0};
    ASSERT_OK(mq_layout_emit(MQ_FMT_CT, "bad", &q, 0, mem_emit, &m));
    /* a shape that does not match the model config */
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_layout_read("bad", 4, 32, mem_find, &m, &back));
    ASSERT_ERROR_MENTIONS("bad.weight_packed");
    mq_qtensor_free(&back);
    /* NaN block scale */
    ((uint8_t *)mem_find(&m, "bad.weight_scale")->data)[1] = 0xFF;
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_layout_read("bad", 2, 32, mem_find, &m, &back));
    ASSERT_ERROR_MENTIONS("bad.weight_scale");
    mq_qtensor_free(&back);
    ((uint8_t *)mem_find(&m, "bad.weight_scale")->data)[1] = 0x38;
    /* zero / negative global scale */
    float zero = 0;
    memcpy((void *)mem_find(&m, "bad.weight_global_scale")->data, &zero, 4);
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_layout_read("bad", 2, 32, mem_find, &m, &back));
    ASSERT_ERROR_MENTIONS("weight_global_scale");
    mq_qtensor_free(&back);
    mem_free(&m);
    ASSERT_STATUS(MOEQ_E_NOTFOUND, mq_layout_read("absent", 2, 32, mem_find, &m, &back));
    mq_qtensor_free(&back);
    /* INT4 g_idx out of range */
    s = mq_qspec_default(MQ_QS_INT4);
    s.group_size = 8;
    mq_qtensor_free(&q);
    ASSERT_OK(mq_qtensor_init(&q, &s, 8, 16, "t"));
    q.g_idx = mq_alloc_zero(16 * 4, "g");
    q.g_idx[5] = 1;
    ASSERT_OK(mq_layout_emit(MQ_FMT_CT, "gi", &q, 0, mem_emit, &m));
    int32_t bad = 7;
    memcpy((uint8_t *)mem_find(&m, "gi.weight_g_idx")->data + 4 * 5, &bad, 4);
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_layout_read("gi", 8, 16, mem_find, &m, &back));
    ASSERT_ERROR_MENTIONS("gi.weight_g_idx");
    mq_qtensor_free(&back);
    mem_free(&m);
    /* format/scheme mismatches */
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_layout_emit(MQ_FMT_MODELOPT, "gi", &q, 0, mem_emit, &m));
    mq_qtensor_free(&q);
}

TEST_MAIN(T(test_ct_nvfp4_layout), T(test_modelopt_nvfp4_layout), T(test_ct_int4_layout),
          T(test_gptq_layout), T(test_round_trips_are_bit_identical),
          T(test_malformed_tensors_are_format_errors))
