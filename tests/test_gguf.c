/* GGUF: the block decoders on hand-made blocks (expected values written out by hand or by the
 * type's definition, bit-exact), the reader on corrupt and truncated files, and the written
 * files of olmoe-tiny, llama-tiny and a qwen2moe-tiny variant read back: the header and KV types
 * by a reader written here (not io/gguf.c), every tensor decoded equal to the checkpoint's
 * dequantized weights (Q4_0 and NVFP4 codes exact; Q4_1 within its f16 offset), the combinations
 * llama.cpp would compute differently refused with nothing written, and `quantize --format
 * gguf` byte-identical to exporting the compressed-tensors checkpoint with f16 scales. */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export/gguf_export.h"
#include "export/layout.h"
#include "harness.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

/* ---- decoders ------------------------------------------------------------------------------- */

static void test_decode_float_types(void) {
    float y[4];
    uint8_t f32[8];
    float a = 1.5f, b = -0x1p-130f;   /* a subnormal too */
    memcpy(f32, &a, 4);
    memcpy(f32 + 4, &b, 4);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_F32, f32, 2, y));
    float w0[2] = {1.5f, -0x1p-130f};
    mq_test_same_floats(w0, y, 2, "f32");
    const uint8_t f16[8] = {0x00, 0x3C, 0x01, 0x00, 0xFF, 0xFB, 0x00, 0x7C};   /* 1, 2^-24, -65504, inf */
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_F16, f16, 4, y));
    float w1[4] = {1.0f, 0x1p-24f, -65504.0f, INFINITY};
    mq_test_same_floats(w1, y, 4, "f16");
    const uint8_t bf16[8] = {0x80, 0x3F, 0x00, 0xC0, 0x49, 0x40, 0x80, 0x00};   /* 1, -2, 3.140625, 2^-126 */
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_BF16, bf16, 4, y));
    float w2[4] = {1.0f, -2.0f, 3.140625f, 0x1p-126f};
    mq_test_same_floats(w2, y, 4, "bf16");
}

static void test_decode_q4_0_q4_1_q8_0(void) {
    uint8_t b[34];
    float y[32], w[32];
    /* Q4_0: d = 0.5 (f16 0x3800); byte j = j | (15 - j) << 4 */
    b[0] = 0x00, b[1] = 0x38;
    for (int j = 0; j < 16; j++) b[2 + j] = (uint8_t)(j | (15 - j) << 4);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q4_0, b, 32, y));
    for (int j = 0; j < 16; j++) {
        w[j] = (float)(j - 8) * 0.5f;        /* -4, -3.5, ..., 3.5 */
        w[j + 16] = (float)(7 - j) * 0.5f;   /* 3.5 ... -4 */
    }
    ASSERT_EQ_HEX(mq_test_f32_bits(-4.0f), mq_test_f32_bits(y[0]));
    ASSERT_EQ_HEX(mq_test_f32_bits(3.5f), mq_test_f32_bits(y[15]));
    ASSERT_EQ_HEX(mq_test_f32_bits(3.5f), mq_test_f32_bits(y[16]));
    mq_test_same_floats(w, y, 32, "q4_0");
    /* Q4_1: d = 1 (0x3C00), m = -1 (0xBC00) */
    b[0] = 0x00, b[1] = 0x3C, b[2] = 0x00, b[3] = 0xBC;
    for (int j = 0; j < 16; j++) b[4 + j] = (uint8_t)(j | (15 - j) << 4);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q4_1, b, 32, y));
    for (int j = 0; j < 16; j++) {
        w[j] = (float)j - 1.0f;
        w[j + 16] = (float)(15 - j) - 1.0f;
    }
    mq_test_same_floats(w, y, 32, "q4_1");
    /* Q8_0: d = 0.25 (0x3400), q_j = 8j - 128 */
    b[0] = 0x00, b[1] = 0x34;
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)(8 * j - 128);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q8_0, b, 32, y));
    for (int j = 0; j < 32; j++) w[j] = (float)(8 * j - 128) * 0.25f;
    ASSERT_EQ_HEX(mq_test_f32_bits(-32.0f), mq_test_f32_bits(y[0]));
    ASSERT_EQ_HEX(mq_test_f32_bits(30.0f), mq_test_f32_bits(y[31]));
    mq_test_same_floats(w, y, 32, "q8_0");
}

/* The Q4_K/Q5_K scale table used below, and the 6-bit scales and mins it encodes (worked out by
 * hand from the packing: j < 4 in the low 6 bits of bytes j and j + 4, j >= 4 in the nibbles of
 * byte j + 4 with the high 2 bits from the top of bytes j - 4 and j). */
static const uint8_t KSC[12] = {0x41, 2, 3, 4, 0x80, 1, 2, 3, 0x15, 0x16, 0x17, 0x18};
static const int KS[8] = {1, 2, 3, 4, 5 + 16, 6, 7, 8};
static const int KM[8] = {0, 1, 2, 3, 1 + 32, 1, 1, 1};

static void test_decode_q4_k_q5_k(void) {
    uint8_t b[176];
    float y[256], w[256];
    b[0] = 0x00, b[1] = 0x3C;   /* d = 1 */
    b[2] = 0x00, b[3] = 0x38;   /* dmin = 0.5 */
    memcpy(b + 4, KSC, 12);
    for (int i = 0; i < 128; i++) b[16 + i] = (uint8_t)((i % 16) | (15 - i % 16) << 4);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q4_K, b, 256, y));
    for (int n = 0; n < 256; n++) {
        int c = n / 64, hi = (n % 64) >= 32, l = n % 32, sub = 2 * c + hi;
        int q = hi ? 15 - l % 16 : l % 16;   /* byte 32c + l */
        w[n] = (1.0f * (float)KS[sub]) * (float)q - 0.5f * (float)KM[sub];
    }
    ASSERT_EQ_HEX(mq_test_f32_bits(0.0f), mq_test_f32_bits(y[0]));           /* 1*1*0 - 0.5*0 */
    ASSERT_EQ_HEX(mq_test_f32_bits(21.0f * 15 - 16.5f), mq_test_f32_bits(y[128 + 15]));   /* sub-block 4: 21, min 33 */
    mq_test_same_floats(w, y, 256, "q4_K");
    /* Q5_K: the same scales; fifth bits qh[l] bit 2c (low half) and 2c + 1 (high half) */
    memcpy(b + 4, KSC, 12);
    for (int l = 0; l < 32; l++) b[16 + l] = (uint8_t)(l * 37);
    for (int i = 0; i < 128; i++) b[48 + i] = (uint8_t)((i % 16) | (15 - i % 16) << 4);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q5_K, b, 256, y));
    for (int n = 0; n < 256; n++) {
        int c = n / 64, hi = (n % 64) >= 32, l = n % 32, sub = 2 * c + hi;
        int q = (hi ? 15 - l % 16 : l % 16) + 16 * (((uint8_t)(l * 37) >> (2 * c + hi)) & 1);
        w[n] = (1.0f * (float)KS[sub]) * (float)q - 0.5f * (float)KM[sub];
    }
    mq_test_same_floats(w, y, 256, "q5_K");
}

static void test_decode_q6_k(void) {
    uint8_t b[210];
    float y[256], w[256];
    for (int i = 0; i < 128; i++) b[i] = (uint8_t)(i * 29 + 7);          /* ql */
    for (int i = 0; i < 64; i++) b[128 + i] = (uint8_t)(i * 53 + 1);     /* qh */
    for (int i = 0; i < 16; i++) b[192 + i] = (uint8_t)(int8_t)(i - 8);  /* scales -8..7 */
    b[208] = 0x00, b[209] = 0x30;                                          /* d = 0.125 */
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_Q6_K, b, 256, y));
    /* value n: half h = n / 128 (ql + 64h, qh + 32h, scales + 8h); within it, quarter k = r / 32
     * and lane l: low 4 bits from ql[l + 32 (k & 1)] (k < 2: low nibble, else high), bits 4-5
     * from qh[l] >> 2k, scale l / 16 + 2k; q - 32 times d times the scale */
    for (int n = 0; n < 256; n++) {
        int h = n / 128, r = n % 128, k = r / 32, l = r % 32;
        uint8_t qlb = (uint8_t)((h * 64 + l + 32 * (k & 1)) * 29 + 7);
        int lo = k < 2 ? qlb & 0xF : qlb >> 4;
        int hb = ((uint8_t)((h * 32 + l) * 53 + 1) >> (2 * k)) & 3;
        int sc = h * 8 + l / 16 + 2 * k - 8;
        w[n] = 0.125f * (float)sc * (float)((lo | hb << 4) - 32);
    }
    mq_test_same_floats(w, y, 256, "q6_K");
}

static void test_decode_nvfp4(void) {
    /* code 8 reads as +0: ggml decodes from integers (kvalues_fp4), which have no -0 */
    static const float E2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, 0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    uint8_t b[36];
    float y[64], w[64];
    /* block scales: 1.0 (0x38), 1.25 (0x3A: 2^0 x 1.25), NaN code 0x7F (reads as 0), 2^-9 (0x01) */
    const uint8_t sc[4] = {0x38, 0x3A, 0x7F, 0x01};
    const float sv[4] = {1.0f, 1.25f, 0.0f, 0x1p-9f};
    memcpy(b, sc, 4);
    for (int s = 0; s < 4; s++)
        for (int j = 0; j < 8; j++) b[4 + 8 * s + j] = (uint8_t)(j | (j + 8) << 4);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_NVFP4, b, 64, y));
    for (int s = 0; s < 4; s++)
        for (int j = 0; j < 8; j++) {
            w[16 * s + j] = E2M1[j] * sv[s];
            w[16 * s + j + 8] = E2M1[j + 8] * sv[s];
        }
    ASSERT_EQ_HEX(mq_test_f32_bits(6.0f), mq_test_f32_bits(y[7]));
    ASSERT_EQ_HEX(mq_test_f32_bits(-7.5f), mq_test_f32_bits(y[16 + 15]));
    ASSERT_EQ_HEX(mq_test_f32_bits(0.0f), mq_test_f32_bits(y[32 + 7]));
    ASSERT_EQ_HEX(mq_test_f32_bits(3.0f * 0x1p-9f), mq_test_f32_bits(y[48 + 5]));
    mq_test_same_floats(w, y, 64, "nvfp4");
    /* the encoder puts codes back where the decoder reads them */
    uint8_t codes[64], b2[36];
    for (int i = 0; i < 64; i++) codes[i] = (uint8_t)((i * 7) & 15);
    mq_ggml_put_nvfp4(b2, codes, sc);
    ASSERT_OK(mq_ggml_dequantize(MQ_GGML_NVFP4, b2, 64, y));
    for (int i = 0; i < 64; i++) w[i] = E2M1[codes[i]] * sv[i / 16];
    mq_test_same_floats(w, y, 64, "nvfp4 encode");
}

static void test_decode_bad_lengths(void) {
    float y[64];
    uint8_t b[64] = {0};
    ASSERT_STATUS(MOEQ_E_ARG, mq_ggml_dequantize(MQ_GGML_Q4_0, b, 31, y));
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_ggml_dequantize(10, b, 256, y));
}

/* ---- reader: corrupt and truncated files ------------------------------------------------------ */

/* A small valid GGUF: 3 KVs (one a string array), 2 tensors (F32 {4}, Q4_0 {32, 2}). */
static uint8_t *small_gguf(size_t *len) {
    const char *path = mq_test_tmpdir();
    static char file[1100];
    snprintf(file, sizeof file, "%s/small.gguf", path);
    mq_gguf_writer *w = mq_gguf_writer_new();
    mq_gguf_kv_str(w, "general.architecture", "llama");
    mq_gguf_kv_u32(w, "general.alignment", 32);
    const char *toks[2] = {"a", "bc"};
    size_t lens[2] = {1, 2};
    mq_gguf_kv_arr_str(w, "tokenizer.ggml.tokens", toks, lens, 2);
    int64_t ne0[1] = {4}, ne1[2] = {32, 2};
    ASSERT_OK(mq_gguf_writer_tensor(w, "a", 1, ne0, MQ_GGML_F32));
    ASSERT_OK(mq_gguf_writer_tensor(w, "b", 2, ne1, MQ_GGML_Q4_0));
    FILE *f = fopen(file, "wb");
    ASSERT_TRUE(f != NULL);
    ASSERT_OK(mq_gguf_writer_begin(w, f, file));
    float fa[4] = {1, 2, 3, 4};
    uint8_t q[36];
    for (int i = 0; i < 36; i++) q[i] = (uint8_t)i;
    ASSERT_OK(mq_gguf_writer_data(w, fa, 16));
    ASSERT_OK(mq_gguf_writer_data(w, q, 36));
    ASSERT_OK(mq_gguf_writer_end(w));
    mq_gguf_writer_free(w);
    fclose(f);
    char *text;
    ASSERT_OK(mq_read_file(file, &text, len));
    return (uint8_t *)text;
}

static void test_reader_valid(void) {
    size_t len;
    uint8_t *buf = small_gguf(&len);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_parse(buf, len, "small", &g));
    ASSERT_EQ_INT(3, mq_gguf_version(g));
    ASSERT_EQ_INT(3, mq_gguf_kv_count(g));
    ASSERT_EQ_INT(2, mq_gguf_tensor_count(g));
    const mq_gguf_tensor *t = mq_gguf_find_tensor(g, "b");
    ASSERT_TRUE(t != NULL);
    ASSERT_EQ_INT(64, t->numel);
    ASSERT_EQ_INT(36, t->nbytes);
    ASSERT_EQ_INT(0, (mq_gguf_data_offset(g) + t->offset) % 32);
    ASSERT_EQ_INT(3, t->data[3]);
    const mq_gguf_kv *kv = mq_gguf_find_kv(g, "tokenizer.ggml.tokens");
    const char *s;
    size_t sl;
    ASSERT_TRUE(mq_gguf_kv_str_at(kv, 1, &s, &sl));
    ASSERT_EQ_INT(2, sl);
    ASSERT_TRUE(!memcmp(s, "bc", 2));
    uint32_t u;
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_gguf_get_u32(g, "general.architecture", &u));   /* a STRING */
    ASSERT_STATUS(MOEQ_E_NOTFOUND, mq_gguf_get_u32(g, "nope", &u));
    mq_gguf_close(g);
    free(buf);
}

static void expect_bad(const uint8_t *buf, size_t len, const char *what) {
    mq_gguf *g = NULL;
    moeq_status s = mq_gguf_parse(buf, len, "bad", &g);
    if (s != MOEQ_E_FORMAT) FAIL("%s: expected MOEQ_E_FORMAT, got %d", what, (int)s);
    if (g) FAIL("%s: a result with an error", what);
    mq_gguf_close(g);
}

static void test_reader_truncated(void) {
    size_t len;
    uint8_t *buf = small_gguf(&len);
    /* every prefix short of the last tensor's end fails cleanly (the padding after it may go) */
    for (size_t n = 0; n < len; n++) {
        uint8_t *cut = malloc(n ? n : 1);
        memcpy(cut, buf, n);
        mq_gguf *g = NULL;
        moeq_status s = mq_gguf_parse(cut, n, "cut", &g);
        if (!s) FAIL("prefix of %zu bytes (of %zu) parsed", n, len);
        mq_gguf_close(g);
        free(cut);
    }
    free(buf);
}

static void test_reader_corrupt(void) {
    size_t len;
    uint8_t *buf = small_gguf(&len);
    uint8_t *c = malloc(len);
    /* header fields */
    memcpy(c, buf, len), c[0] = 'X', expect_bad(c, len, "magic");
    memcpy(c, buf, len), c[4] = 4, expect_bad(c, len, "version 4");
    memcpy(c, buf, len), c[15] = 0x7F, expect_bad(c, len, "tensor count");
    memcpy(c, buf, len), c[23] = 0x7F, expect_bad(c, len, "KV count");
    /* the first KV: key length 20 at 24, type at 52 */
    memcpy(c, buf, len), c[52] = 99, expect_bad(c, len, "KV type");
    memcpy(c, buf, len), c[31] = 0x40, expect_bad(c, len, "key length");
    /* general.alignment's value: find it and make it 3 */
    mq_gguf *g;
    ASSERT_OK(mq_gguf_parse(buf, len, "ok", &g));
    size_t av = (size_t)(mq_gguf_find_kv(g, "general.alignment")->data - buf);
    uint64_t b_off = mq_gguf_find_tensor(g, "b")->offset;
    uint64_t data_off = mq_gguf_data_offset(g);
    mq_gguf_close(g);
    memcpy(c, buf, len), c[av] = 3, expect_bad(c, len, "alignment 3");
    memcpy(c, buf, len), c[av] = 0, expect_bad(c, len, "alignment 0");
    /* tensor b's info: name "b" (8 + 1), n_dims, ne0, ne1, type, offset: find it by its name */
    size_t bi = 0;
    for (size_t i = 0; i + 9 < data_off; i++)
        if (!memcmp(buf + i, "\x01\0\0\0\0\0\0\0b\x02\0\0\0", 13)) bi = i;
    ASSERT_TRUE(bi > 0);
    size_t dims = bi + 9, ne0 = dims + 4, type = ne0 + 16, off = type + 4;
    memcpy(c, buf, len), c[dims] = 5, expect_bad(c, len, "5 dimensions");
    memcpy(c, buf, len), c[ne0] = 0, expect_bad(c, len, "ne 0");
    memcpy(c, buf, len), c[ne0] = 33, expect_bad(c, len, "ne0 not whole blocks");
    memcpy(c, buf, len), c[ne0 + 7] = 0x7F, expect_bad(c, len, "ne overflow");
    memcpy(c, buf, len), c[type] = 99, expect_bad(c, len, "unknown type");
    memcpy(c, buf, len), c[off] = (uint8_t)(b_off + 1), expect_bad(c, len, "misaligned offset");
    memcpy(c, buf, len), c[off] = 0, expect_bad(c, len, "overlapping tensors");
    memcpy(c, buf, len), c[off + 3] = 1, expect_bad(c, len, "offset past the end");
    memcpy(c, buf, len), c[bi + 8] = 'a', expect_bad(c, len, "duplicate tensor");
    free(c);
    free(buf);
}

/* ---- the written files -------------------------------------------------------------------------- */

/* An independent walk over a GGUF header: the KVs' keys and types (and u32/f32/string values),
 * the tensor infos and the data offset. Trusts its input (the files come from the writer). */
typedef struct {
    char key[96];
    uint32_t type, arr_type;
    uint64_t n;
    uint32_t u32;
    float f32;
    char str[64];
} hkv;

typedef struct {
    hkv kv[64];
    int n_kv;
    uint64_t n_t, data;
} header;

static uint64_t u64_at(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint32_t u32_at(const uint8_t *p) { return (uint32_t)u64_at((const uint8_t[8]){p[0], p[1], p[2], p[3]}); }

static size_t skip_value(const uint8_t *p, uint32_t t) {
    static const size_t sz[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (t == 8) return 8 + (size_t)u64_at(p);
    if (t == 9) {
        uint32_t et = u32_at(p);
        uint64_t n = u64_at(p + 4);
        size_t k = 12;
        for (uint64_t i = 0; i < n; i++) k += skip_value(p + k, et);
        return k;
    }
    return sz[t];
}

static void read_header(const uint8_t *b, header *h) {
    memset(h, 0, sizeof *h);
    if (memcmp(b, "GGUF", 4) || u32_at(b + 4) != 3) FAIL("not GGUF v3");
    h->n_t = u64_at(b + 8);
    uint64_t nkv = u64_at(b + 16);
    size_t p = 24;
    for (uint64_t i = 0; i < nkv && i < 64; i++) {
        hkv *k = &h->kv[h->n_kv++];
        uint64_t kl = u64_at(b + p);
        snprintf(k->key, sizeof k->key, "%.*s", (int)kl, (const char *)b + p + 8);
        p += 8 + kl;
        k->type = u32_at(b + p);
        p += 4;
        if (k->type == 4) k->u32 = u32_at(b + p);
        if (k->type == 6) memcpy(&k->f32, b + p, 4);
        if (k->type == 8) snprintf(k->str, sizeof k->str, "%.*s", (int)u64_at(b + p), (const char *)b + p + 8);
        if (k->type == 9) k->arr_type = u32_at(b + p), k->n = u64_at(b + p + 4);
        p += skip_value(b + p, k->type);
    }
    for (uint64_t i = 0; i < h->n_t; i++) {
        p += 8 + u64_at(b + p);
        uint32_t nd = u32_at(b + p);
        p += 4 + 8 * nd + 4;
        if (u64_at(b + p) % 32) FAIL("tensor %llu: offset not aligned", (unsigned long long)i);
        p += 8;
    }
    h->data = (p + 31) / 32 * 32;
}

static const hkv *hfind(const header *h, const char *key) {
    for (int i = 0; i < h->n_kv; i++)
        if (!strcmp(h->kv[i].key, key)) return &h->kv[i];
    return NULL;
}

static void expect_kv(const header *h, const char *key, uint32_t type) {
    const hkv *k = hfind(h, key);
    if (!k) FAIL("no KV %s", key);
    else if (k->type != type) FAIL("KV %s: type %u, llama.cpp reads %u", key, k->type, type);
}

/* The checkpoint module or tensor a GGUF name comes from (the test's own table). */
static bool source_of(const char *g, bool mixtral, char *src, size_t n, int *expert_kind, bool *linear) {
    static const char *const map[][3] = {
        {"attn_norm.weight", "input_layernorm.weight", ""}, {"ffn_norm.weight", "post_attention_layernorm.weight", ""},
        {"attn_q.weight", "self_attn.q_proj", "L"}, {"attn_k.weight", "self_attn.k_proj", "L"},
        {"attn_v.weight", "self_attn.v_proj", "L"}, {"attn_output.weight", "self_attn.o_proj", "L"},
        {"attn_q.bias", "self_attn.q_proj.bias", ""}, {"attn_k.bias", "self_attn.k_proj.bias", ""},
        {"attn_v.bias", "self_attn.v_proj.bias", ""},
        {"attn_q_norm.weight", "self_attn.q_norm.weight", ""}, {"attn_k_norm.weight", "self_attn.k_norm.weight", ""},
        {"ffn_gate.weight", "mlp.gate_proj", "L"}, {"ffn_up.weight", "mlp.up_proj", "L"}, {"ffn_down.weight", "mlp.down_proj", "L"},
        {"ffn_gate_inp.weight", "mlp.gate.weight", ""}, {"ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight", ""},
        {"ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj", "L"}, {"ffn_up_shexp.weight", "mlp.shared_expert.up_proj", "L"},
        {"ffn_down_shexp.weight", "mlp.shared_expert.down_proj", "L"},
        {"ffn_gate_exps.weight", "mlp.experts.%d.gate_proj", "E"}, {"ffn_up_exps.weight", "mlp.experts.%d.up_proj", "E"},
        {"ffn_down_exps.weight", "mlp.experts.%d.down_proj", "E"},
    };
    *expert_kind = 0;
    *linear = false;
    if (!strcmp(g, "token_embd.weight")) return snprintf(src, n, "model.embed_tokens.weight"), true;
    if (!strcmp(g, "output_norm.weight")) return snprintf(src, n, "model.norm.weight"), true;
    if (!strcmp(g, "output.weight")) return snprintf(src, n, "lm_head"), *linear = true, true;
    int l;
    char rest[96];
    if (sscanf(g, "blk.%d.%95s", &l, rest) != 2) return false;
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(rest, map[i][0])) {
            *linear = map[i][2][0] != 0;
            *expert_kind = map[i][2][0] == 'E';
            (void)mixtral;
            snprintf(src, n, "model.layers.%d.%s", l, map[i][1]);
            return true;
        }
    return false;
}

typedef struct {
    int64_t n_q4_0, n_q4_1, n_nvfp4, n_scale, n_exact_float;
} rt_counts;

/* Every GGUF tensor against the checkpoint ckpt (CT with f16 INT4 scales). */
static void check_file(const char *file, const char *ckpt, int64_t heads, int64_t kv_heads, rt_counts *cnt) {
    memset(cnt, 0, sizeof *cnt);
    char *raw;
    size_t len;
    ASSERT_OK(mq_read_file(file, &raw, &len));
    header h;
    read_header((const uint8_t *)raw, &h);
    const hkv *arch = hfind(&h, "general.architecture");
    ASSERT_TRUE(arch != NULL);
    char ak[128];
    const char *u32_keys[] = {"context_length", "embedding_length", "block_count", "feed_forward_length",
                              "attention.head_count", "attention.head_count_kv", "vocab_size"};
    for (size_t i = 0; i < sizeof u32_keys / sizeof u32_keys[0]; i++) {
        snprintf(ak, sizeof ak, "%s.%s", arch->str, u32_keys[i]);
        expect_kv(&h, ak, 4);
    }
    snprintf(ak, sizeof ak, "%s.rope.freq_base", arch->str);
    expect_kv(&h, ak, 6);
    snprintf(ak, sizeof ak, "%s.attention.layer_norm_rms_epsilon", arch->str);
    expect_kv(&h, ak, 6);
    expect_kv(&h, "general.alignment", 4);
    expect_kv(&h, "tokenizer.ggml.model", 8);
    expect_kv(&h, "tokenizer.ggml.pre", 8);
    expect_kv(&h, "tokenizer.ggml.tokens", 9);
    expect_kv(&h, "tokenizer.ggml.token_type", 9);
    expect_kv(&h, "tokenizer.ggml.merges", 9);
    expect_kv(&h, "tokenizer.ggml.eos_token_id", 4);
    const hkv *tm = hfind(&h, "tokenizer.ggml.model"), *tp = hfind(&h, "tokenizer.ggml.pre");
    if (!tm || !tp) return;
    char tms[64], tps[64];
    snprintf(tms, sizeof tms, "%s", tm->str);
    snprintf(tps, sizeof tps, "%s", tp->str);
    ASSERT_EQ_STR("gpt2", tms);
    ASSERT_EQ_STR("gpt-2", tps);
    ASSERT_EQ_INT(5, hfind(&h, "tokenizer.ggml.token_type")->arr_type);   /* INT32 */
    snprintf(ak, sizeof ak, "%s.vocab_size", arch->str);
    ASSERT_EQ_INT(hfind(&h, ak)->u32, hfind(&h, "tokenizer.ggml.tokens")->n);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    ASSERT_EQ_INT(h.n_t, mq_gguf_tensor_count(g));
    ASSERT_EQ_INT(h.data, mq_gguf_data_offset(g));
    mq_st *st;
    ASSERT_OK(mq_st_open_dir(ckpt, &st));
    for (size_t i = 0; i < mq_gguf_tensor_count(g); i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        size_t nl = strlen(t->name);
        if (nl > 6 && !strcmp(t->name + nl - 6, ".scale")) {
            cnt->n_scale++;
            continue;   /* checked with its weight */
        }
        char src[300];
        int ek;
        bool lin;
        if (!source_of(t->name, false, src, sizeof src, &ek, &lin)) {
            FAIL("unexpected GGUF tensor %s", t->name);
            continue;
        }
        float *dec = malloc((size_t)t->numel * sizeof(float)), *ref = malloc((size_t)t->numel * sizeof(float));
        ASSERT_OK(mq_gguf_tensor_to_f32(t, dec));
        /* the global multipliers of an NVFP4 tensor */
        char sname[160];
        snprintf(sname, sizeof sname, "%.*s.scale", (int)(nl - 7), t->name);
        const mq_gguf_tensor *sc = mq_gguf_find_tensor(g, sname);
        float *scv = NULL;
        if (sc) {
            scv = malloc((size_t)sc->numel * sizeof(float));
            ASSERT_OK(mq_gguf_tensor_to_f32(sc, scv));
        }
        int64_t E = t->n_dims == 3 ? t->ne[2] : 1, rows = t->n_dims >= 2 ? t->ne[1] : 1, cols = t->ne[0];
        int64_t ph = strstr(t->name, "attn_q.") ? heads : strstr(t->name, "attn_k.") ? kv_heads : 0;
        for (int64_t e = 0; e < E; e++) {
            char mod[300];
            snprintf(mod, sizeof mod, src, (int)e);
            float *r = ref + e * rows * cols;
            if (lin) {
                ASSERT_OK(mq_load_linear_weight(st, mod, rows, cols, r, NULL));
            } else {
                const mq_tensor_view *v = mq_st_find(st, mod);
                if (!v && !strcmp(t->name, "output.weight")) v = mq_st_find(st, "model.embed_tokens.weight");
                ASSERT_TRUE(v != NULL && v->numel == t->numel);
                ASSERT_OK(mq_tensor_to_f32(v, r));
            }
            if (ph > 0) {   /* llama.cpp's row order: row h*hd + 2i + j is HF row h*hd + j*hd/2 + i */
                float *tmp = malloc((size_t)(rows * cols) * sizeof(float));
                int64_t hd = rows / ph;
                for (int64_t row = 0; row < rows; row++) {
                    int64_t hh = row / hd, w = row % hd;
                    memcpy(tmp + row * cols, r + (hh * hd + (w % 2) * (hd / 2) + w / 2) * cols, (size_t)cols * 4);
                }
                memcpy(r, tmp, (size_t)(rows * cols) * 4);
                free(tmp);
            }
        }
        int64_t n = t->numel;
        if (t->type == MQ_GGML_Q4_0 || t->type == MQ_GGML_F32 || t->type == MQ_GGML_BF16) {
            for (int64_t k = 0; k < n; k++)
                if (mq_test_f32_bits(dec[k]) != mq_test_f32_bits(ref[k]) && !(dec[k] == 0 && ref[k] == 0)) {
                    FAIL("%s value %lld: GGUF %.9g, checkpoint %.9g", t->name, (long long)k, (double)dec[k], (double)ref[k]);
                    break;
                }
            if (t->type == MQ_GGML_Q4_0) cnt->n_q4_0++;
            else cnt->n_exact_float++;
        } else if (t->type == MQ_GGML_F16) {
            /* the checkpoint's value rounded to f16 (round to nearest even) */
            for (int64_t k = 0; k < n; k++)
                if (mq_test_f32_bits(dec[k]) != mq_test_f32_bits(mq_f16_to_f32(mq_f32_to_f16(ref[k])))) {
                    FAIL("%s value %lld: GGUF %.9g, checkpoint %.9g", t->name, (long long)k, (double)dec[k], (double)ref[k]);
                    break;
                }
            cnt->n_exact_float++;
        } else if (t->type == MQ_GGML_Q4_1) {
            /* m = -zero*d rounded to f16: off by at most 2^-11 |m| (|m| <= 15 d) plus a rounding */
            double amax = 0;
            for (int64_t k = 0; k < n; k++) amax = fmax(amax, fabs(ref[k]));
            for (int64_t k = 0; k < n; k++)
                if (fabs(dec[k] - ref[k]) > 0x1p-10 * amax) {
                    FAIL("%s value %lld: GGUF %.9g, checkpoint %.9g", t->name, (long long)k, (double)dec[k], (double)ref[k]);
                    break;
                }
            cnt->n_q4_1++;
        } else if (t->type == MQ_GGML_NVFP4) {
            ASSERT_TRUE(scv != NULL);
            /* e2m1 * e4m3 (exact) times the multiplier, against e2m1 * (s / global): 2 roundings */
            for (int64_t k = 0; k < n; k++) {
                float v = dec[k] * scv[k / (rows * cols)];
                if (fabs((double)v - ref[k]) > 0x1p-22 * fabs(ref[k])) {
                    FAIL("%s value %lld: GGUF %.9g, checkpoint %.9g", t->name, (long long)k, (double)v, (double)ref[k]);
                    break;
                }
            }
            cnt->n_nvfp4++;
        } else {
            FAIL("%s: unexpected type %u", t->name, t->type);
        }
        free(scv);
        free(dec);
        free(ref);
    }
    mq_st_close(st);
    mq_gguf_close(g);
    free(raw);
}

static bool same_bytes(const char *a, const char *b) {
    char *x, *y;
    size_t nx, ny;
    if (mq_read_file(a, &x, &nx) || mq_read_file(b, &y, &ny)) return false;
    bool same = nx == ny && !memcmp(x, y, nx);
    free(x);
    free(y);
    return same;
}

/* quantize (RTN) into compressed-tensors with f16 scales, export, check; then the public
 * quantize --format gguf with the same options must write the same bytes. */
static void roundtrip(const char *model, mq_qscheme sch, int group, bool asym, const char *tag,
                      int64_t heads, int64_t kv_heads, rt_counts *cnt) {
    char tmp[1024], ckpt[1100], file[1100], file2[1100];
    snprintf(tmp, sizeof tmp, "%s", mq_test_tmpdir());
    snprintf(ckpt, sizeof ckpt, "%s/%s-ct", tmp, tag);
    snprintf(file, sizeof file, "%s/%s.gguf", tmp, tag);
    snprintf(file2, sizeof file2, "%s/q", tmp);   /* the same base name (general.name) */
    mkdir(file2, 0755);
    snprintf(file2, sizeof file2, "%s/q/%s.gguf", tmp, tag);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, sch, MQ_FMT_CT);
    o.spec.scale_dtype = MOEQ_DT_F16;
    /* symmetric INT4 with the public default's signed scales: Q4_0 blocks with negative d, as
     * llama.cpp's own quantizer writes them */
    if (sch == MQ_QS_INT4) o.spec.group_size = group, o.spec.asym = asym, o.spec.int4_signed_scale = !asym;
    ASSERT_OK(mq_pipeline_run(model, ckpt, &o, NULL));
    ASSERT_OK(mq_gguf_export(ckpt, file, MQ_GGUF_REST_AUTO));
    check_file(file, ckpt, heads, kv_heads, cnt);
    moeq_quant_options q;
    moeq_quant_options_init(&q);
    q.scheme = sch == MQ_QS_INT4 ? MOEQ_QUANT_INT4 : MOEQ_QUANT_NVFP4A16;
    q.format = MOEQ_FORMAT_GGUF;
    if (sch == MQ_QS_INT4) q.group_size = group, q.asym = asym;
    ASSERT_OK(moeq_quantize(model, file2, &q, NULL));
    if (!same_bytes(file, file2)) FAIL("%s: quantize --format gguf differs from exporting the f16 checkpoint", tag);
    char work[1200];
    snprintf(work, sizeof work, "%s.moeq-work", file2);
    ASSERT_FALSE(mq_file_exists(work));
}

static void test_olmoe_q4_0(void) {
    rt_counts c;
    roundtrip(mq_test_model("olmoe-tiny"), MQ_QS_INT4, 32, false, "olmoe-g32", 0, 0, &c);
    ASSERT_EQ_INT(4 * 7, c.n_q4_0);   /* q, k, v, o and the 3 stacked expert tensors per layer */
    ASSERT_EQ_INT(0, c.n_scale);
}

static void test_olmoe_q4_0_g128_split(void) {
    rt_counts c;
    roundtrip(mq_test_model("olmoe-tiny"), MQ_QS_INT4, 128, false, "olmoe-g128", 0, 0, &c);
    ASSERT_EQ_INT(4 * 7, c.n_q4_0);
}

static void test_olmoe_q4_1(void) {
    rt_counts c;
    roundtrip(mq_test_model("olmoe-tiny"), MQ_QS_INT4, 64, true, "olmoe-asym", 0, 0, &c);
    ASSERT_EQ_INT(4 * 7, c.n_q4_1);
}

static void test_llama_permuted_q4_0(void) {
    rt_counts c;
    roundtrip(mq_test_shared("fixtures/models/llama-tiny"), MQ_QS_INT4, 32, false, "llama-g32", 4, 2, &c);
    ASSERT_EQ_INT(4 * 7, c.n_q4_0);   /* q, k, v, o, gate, up, down */
}

static void test_llama_nvfp4(void) {
    rt_counts c;
    roundtrip(mq_test_shared("fixtures/models/llama-tiny"), MQ_QS_NVFP4, 16, false, "llama-nvfp4", 4, 2, &c);
    ASSERT_EQ_INT(4 * 7, c.n_nvfp4);
    ASSERT_EQ_INT(4 * 7, c.n_scale);
}

static void test_qwen2moe_shared_experts(void) {
    rt_counts c;
    roundtrip(mq_test_qwen2moe_nonorm(), MQ_QS_INT4, 32, false, "qwen2moe-g32", 0, 0, &c);
    ASSERT_EQ_INT(4 * 10, c.n_q4_0);   /* q, k, v, o, 3 stacked experts, 3 shared expert */
}

static void expect_refused(const char *model, moeq_quant_scheme sch, const char *why, const char *tag) {
    char file[1100];
    snprintf(file, sizeof file, "%s/%s.gguf", mq_test_tmpdir(), tag);
    moeq_quant_options q;
    moeq_quant_options_init(&q);
    q.scheme = sch;
    q.format = MOEQ_FORMAT_GGUF;
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_quantize(model, file, &q, NULL));
    if (!strstr(moeq_last_error(), why)) FAIL("%s: message '%s' does not say '%s'", tag, moeq_last_error(), why);
    ASSERT_FALSE(mq_file_exists(file));
    char work[1200];
    snprintf(work, sizeof work, "%s.moeq-work", file);
    ASSERT_FALSE(mq_file_exists(work));
}

static void test_refusals(void) {
    char olmoe[1024];
    snprintf(olmoe, sizeof olmoe, "%s", mq_test_model("olmoe-tiny"));
    expect_refused(olmoe, MOEQ_QUANT_NVFP4A16, "global scale", "olmoe-nvfp4");
    const char *q = mq_test_shared("fixtures/models/qwen2moe-tiny");
    char qwen[1024];
    snprintf(qwen, sizeof qwen, "%s", q);
    expect_refused(qwen, MOEQ_QUANT_INT4, "norm_topk_prob", "qwen2moe-norm");
    /* export-gguf of a compressed-tensors NVFP4 olmoe checkpoint: refused too */
    char ckpt[1100], file[1100];
    snprintf(ckpt, sizeof ckpt, "%s/olmoe-ct-nvfp4", mq_test_tmpdir());
    snprintf(file, sizeof file, "%s/olmoe-ct-nvfp4.gguf", mq_test_tmpdir());
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_NVFP4, MQ_FMT_CT);
    ASSERT_OK(mq_pipeline_run(olmoe, ckpt, &o, NULL));
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, moeq_export_gguf(ckpt, file, NULL));
    ASSERT_FALSE(mq_file_exists(file));
}

/* --gguf-rest f16 and f32: the embeddings and lm_head rounded to f16 or widened to f32 */
static void test_rest_f16_f32(void) {
    char tmp[1024], ckpt[1100], f16[1100], f32[1100];
    snprintf(tmp, sizeof tmp, "%s", mq_test_tmpdir());
    snprintf(ckpt, sizeof ckpt, "%s/ct", tmp);
    snprintf(f16, sizeof f16, "%s/f16.gguf", tmp);
    snprintf(f32, sizeof f32, "%s/f32.gguf", tmp);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.scale_dtype = MOEQ_DT_F16;
    o.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(mq_test_model("olmoe-tiny"), ckpt, &o, NULL));
    rt_counts c;
    ASSERT_OK(mq_gguf_export(ckpt, f16, MQ_GGUF_REST_F16));
    check_file(f16, ckpt, 0, 0, &c);
    ASSERT_EQ_INT(4 * 7, c.n_q4_0);
    ASSERT_OK(mq_gguf_export(ckpt, f32, MQ_GGUF_REST_F32));
    check_file(f32, ckpt, 0, 0, &c);
    ASSERT_EQ_INT(4 * 7, c.n_q4_0);
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(f16, &g));
    ASSERT_EQ_INT(MQ_GGML_F16, mq_gguf_find_tensor(g, "output.weight")->type);
    mq_gguf_close(g);
    ASSERT_OK(mq_gguf_open(f32, &g));
    ASSERT_EQ_INT(MQ_GGML_F32, mq_gguf_find_tensor(g, "token_embd.weight")->type);
    mq_gguf_close(g);
}

static void test_rest_q8_0(void) {
    char ckpt[1100], file[1100];
    snprintf(ckpt, sizeof ckpt, "%s/olmoe-rest", mq_test_tmpdir());
    snprintf(file, sizeof file, "%s/olmoe-rest.gguf", mq_test_tmpdir());
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_GGUF);
    ASSERT_OK(mq_pipeline_run(mq_test_model("olmoe-tiny"), file, &o, NULL));
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    ASSERT_EQ_INT(MQ_GGML_BF16, mq_gguf_find_tensor(g, "token_embd.weight")->type);
    mq_gguf_close(g);
    ASSERT_OK(moeq_export_gguf(mq_test_model("olmoe-tiny"), file, "q8_0"));   /* the unquantized source */
    ASSERT_OK(mq_gguf_open(file, &g));
    const mq_gguf_tensor *t = mq_gguf_find_tensor(g, "token_embd.weight");
    ASSERT_EQ_INT(MQ_GGML_Q8_0, t->type);
    ASSERT_EQ_INT(MQ_GGML_Q8_0, mq_gguf_find_tensor(g, "blk.0.ffn_up_exps.weight")->type);
    ASSERT_EQ_INT(MQ_GGML_F32, mq_gguf_find_tensor(g, "blk.0.ffn_gate_inp.weight")->type);
    /* Q8_0 within half a step of the source, the step d = amax/127 being stored as f16 (codes
     * from the unrounded d: up to 127 |f16(d) - d| <= 127 d 2^-11 more) */
    mq_st *st;
    ASSERT_OK(mq_st_open_dir(mq_test_model("olmoe-tiny"), &st));
    const mq_tensor_view *v = mq_st_find(st, "model.embed_tokens.weight");
    float *a = malloc((size_t)t->numel * 4), *b = malloc((size_t)t->numel * 4);
    ASSERT_OK(mq_gguf_tensor_to_f32(t, a));
    ASSERT_OK(mq_tensor_to_f32(v, b));
    for (int64_t blk = 0; blk < t->numel / 32; blk++) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(b[blk * 32 + j]));
        for (int j = 0; j < 32; j++)
            if (fabsf(a[blk * 32 + j] - b[blk * 32 + j]) > amax / 127.0f * (0.5f + 127.0f * 0x1p-11f) * 1.001f + 1e-7f) {
                FAIL("q8_0 value %lld off by more than half a step", (long long)(blk * 32 + j));
                blk = t->numel;
                break;
            }
    }
    free(a);
    free(b);
    mq_st_close(st);
    mq_gguf_close(g);
    char *text;
    ASSERT_OK(moeq_gguf_describe(file, 1, &text));
    ASSERT_TRUE(strstr(text, "olmoe.expert_count") != NULL);
    ASSERT_TRUE(strstr(text, "blk.3.ffn_down_exps.weight") != NULL);
    free(text);
}

/* The model imported from a GGUF computes what the checkpoint it came from does, bit for bit: both
 * models' logits over ids; frees both models. */
static void same_logits(moeq_model *ckpt, moeq_model *imported, const int32_t *ids, int32_t n, const char *tag) {
    const int64_t V = moeq_model_get_info(ckpt)->vocab_size;
    ASSERT_EQ_INT(V, moeq_model_get_info(imported)->vocab_size);
    float *la = mq_test_logits(ckpt, ids, n), *lb = mq_test_logits(imported, ids, n);
    char what[256];
    snprintf(what, sizeof what, "%s: logits of the checkpoint (expected) and the imported GGUF", tag);
    mq_test_same_floats(la, lb, n * V, what);
    free(la);
    free(lb);
    moeq_model_free(ckpt);
    moeq_model_free(imported);
}

/* GGUF -> checkpoint (moeq_import_gguf): the imported model's logits equal those of the
 * compressed-tensors checkpoint it came from (fp32 path, bit for bit: Q4_0 decodes exactly), and
 * its rebuilt tokenizer gives the same ids. */
static void import_check(const char *model, const char *tag) {
    char tmp[1024], ckpt[1100], file[1100], imp[1100];
    snprintf(tmp, sizeof tmp, "%s", mq_test_tmpdir());
    snprintf(ckpt, sizeof ckpt, "%s/%s-ct", tmp, tag);
    snprintf(file, sizeof file, "%s/%s.gguf", tmp, tag);
    snprintf(imp, sizeof imp, "%s/%s-imported", tmp, tag);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.scale_dtype = MOEQ_DT_F16;
    o.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(model, ckpt, &o, NULL));
    ASSERT_OK(mq_gguf_export(ckpt, file, MQ_GGUF_REST_AUTO));
    ASSERT_OK(moeq_import_gguf(file, imp));
    moeq_model *a = mq_test_open_model(ckpt, NULL), *b = mq_test_open_model(imp, NULL);
    const char *text = "The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building.\n"
                       " = Section = \n Its base is square.";
    int32_t *ia = NULL, *ib = NULL;
    size_t na = 0, nb = 0;
    ASSERT_OK(moeq_tokenizer_encode(moeq_model_tokenizer(a), text, strlen(text), &ia, &na));
    ASSERT_OK(moeq_tokenizer_encode(moeq_model_tokenizer(b), text, strlen(text), &ib, &nb));
    ASSERT_EQ_INT(na, nb);
    for (size_t i = 0; i < na && i < nb; i++)
        if (ia[i] != ib[i]) {
            FAIL("token %zu: %d against %d", i, ia[i], ib[i]);
            break;
        }
    same_logits(a, b, ia, (int32_t)na, tag);
    free(ia);
    free(ib);
}

static void test_import_olmoe(void) { import_check(mq_test_model("olmoe-tiny"), "olmoe"); }

static void test_import_llama_permuted(void) {
    char model[1024];
    snprintf(model, sizeof model, "%s", mq_test_shared("fixtures/models/llama-tiny"));
    import_check(model, "llama");
}

static void test_import_qwen2moe(void) { import_check(mq_test_qwen2moe_nonorm(), "qwen2moe"); }

static void test_import_refuses(void) {
    size_t len;
    uint8_t *buf = small_gguf(&len);   /* llama without the hparams */
    char file[1100], dir[1100];
    snprintf(file, sizeof file, "%s/small.gguf", mq_test_tmpdir());
    snprintf(dir, sizeof dir, "%s/small-imported", mq_test_tmpdir());
    ASSERT_OK(mq_write_file_atomic(file, buf, len));
    free(buf);
    ASSERT_STATUS(MOEQ_E_NOTFOUND, moeq_import_gguf(file, dir));
    if (!strstr(moeq_last_error(), "llama.embedding_length")) FAIL("message: %s", moeq_last_error());
    ASSERT_FALSE(mq_file_exists(dir));
}

/* ---- DeepSeek-V3 as llama.cpp's deepseek2 ------------------------------------------------------ */

/* tests/data/NAME with the bundled tokenizer (symlinks) in the test's directory. */
static const char *deepseek_model(const char *name) {
    static char dir[1100];
    snprintf(dir, sizeof dir, "%s/%s", mq_test_tmpdir(), name);
    if (mq_dir_exists(dir)) return dir;
    mkdir(dir, 0755);
    const char *files[4][2] = {{"tests/data/", "config.json"}, {"tests/data/", "model.safetensors"},
                               {"models/olmoe-tiny/", "tokenizer.json"}, {"models/olmoe-tiny/", "tokenizer_config.json"}};
    for (int i = 0; i < 4; i++) {
        char rel[256], a[1200], b[1200];
        if (i < 2) snprintf(rel, sizeof rel, "%s%s/%s", files[i][0], name, files[i][1]);
        else snprintf(rel, sizeof rel, "%s%s", files[i][0], files[i][1]);
        snprintf(a, sizeof a, "%s", mq_test_repo(rel));
        snprintf(b, sizeof b, "%s/%s", dir, files[i][1]);
        if (symlink(a, b) != 0) FAIL("symlink %s", b);
    }
    return dir;
}

static void expect_u32(const header *h, const char *key, uint32_t v) {
    const hkv *k = hfind(h, key);
    if (!k || k->type != 4) FAIL("KV %s: not a UINT32", key);
    else if (k->u32 != v) FAIL("KV %s: %u, expected %u", key, k->u32, v);
}

static void expect_f32(const header *h, const char *key, float v) {
    const hkv *k = hfind(h, key);
    if (!k || k->type != 6) FAIL("KV %s: not a FLOAT32", key);
    else if (mq_test_f32_bits(k->f32) != mq_test_f32_bits(v)) FAIL("KV %s: %.9g, expected %.9g", key, (double)k->f32, (double)v);
}

static void expect_tensor(const mq_gguf *g, const char *name, uint32_t type, uint32_t nd, int64_t a, int64_t b,
                          int64_t c) {
    const mq_gguf_tensor *t = mq_gguf_find_tensor(g, name);
    if (!t) {
        FAIL("no tensor %s", name);
        return;
    }
    int64_t ne[3] = {a, b, c};
    if (t->type != type || t->n_dims != nd) FAIL("%s: type %u, %u dims; expected %u, %u", name, t->type, t->n_dims, type, nd);
    for (uint32_t d = 0; d < nd && d < t->n_dims; d++)
        if (t->ne[d] != ne[d]) FAIL("%s: ne[%u] %lld, expected %lld", name, d, (long long)t->ne[d], (long long)ne[d]);
}

/* Source row of GGUF row w of an [nope | rope] block without rope_interleave (the test's own
 * indexing): rotary row nope + 2i + j holds row nope + j * rope / 2 + i. */
static int64_t ds_src(int64_t w, int64_t nope, int64_t rope, bool permuted) {
    if (!permuted || w < nope) return w;
    int64_t k = w - nope;
    return nope + (k % 2 == 0 ? k / 2 : rope / 2 + k / 2);
}

/* One DeepSeek-V3 fixture through RTN INT4 g32 (f16 scales; layer 0's down_proj, 80 inputs, kept
 * float): the deepseek2 KVs and tensor shapes against llama.cpp's loader, written out here;
 * attn_k_b / attn_v_b / q / kv_a against the checkpoint's kv_b_proj, q and kv_a (dequantized),
 * split, transposed and permuted by the test's own indexing, bit for bit; then the file read
 * back: kv_b_proj merged bit for bit, and the imported model's logits equal to the checkpoint's. */
static void deepseek_check(const char *fixture, const char *tag, bool qlora, char imp[1100]) {
    const char *model = deepseek_model(fixture);
    char ckpt[1100], file[1100];
    snprintf(ckpt, sizeof ckpt, "%s/%s-ct", mq_test_tmpdir(), tag);
    snprintf(file, sizeof file, "%s/%s.gguf", mq_test_tmpdir(), tag);
    snprintf(imp, 1100, "%s/%s-imported", mq_test_tmpdir(), tag);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.scale_dtype = MOEQ_DT_F16;
    o.spec.group_size = 32;
    const char *ign[1] = {"model\\.layers\\.0\\.mlp\\.down_proj"};
    o.ignore = ign;
    o.n_ignore = 1;
    ASSERT_OK(mq_pipeline_run(model, ckpt, &o, NULL));
    ASSERT_OK(mq_gguf_export(ckpt, file, MQ_GGUF_REST_AUTO));
    const int64_t H = 4, nope = 16, rope = 8, v = 16, r = 32, D = 64, hq = nope + rope, hb = nope + v;
    const int64_t L = qlora ? 3 : 2, E = qlora ? 16 : 8;

    char *raw;
    size_t len;
    ASSERT_OK(mq_read_file(file, &raw, &len));
    header h;
    read_header((const uint8_t *)raw, &h);
    free(raw);
    expect_u32(&h, "deepseek2.block_count", (uint32_t)L);   /* the MTP layer left out */
    expect_u32(&h, "deepseek2.attention.head_count", 4);
    expect_u32(&h, "deepseek2.attention.head_count_kv", 1);
    expect_u32(&h, "deepseek2.attention.key_length", 40);   /* kv_lora + rope */
    expect_u32(&h, "deepseek2.attention.value_length", 32);
    expect_u32(&h, "deepseek2.attention.key_length_mla", 24);
    expect_u32(&h, "deepseek2.attention.value_length_mla", 16);
    expect_u32(&h, "deepseek2.rope.dimension_count", 8);
    expect_u32(&h, "deepseek2.attention.q_lora_rank", qlora ? 64 : 0);
    expect_u32(&h, "deepseek2.attention.kv_lora_rank", 32);
    expect_u32(&h, "deepseek2.leading_dense_block_count", 1);
    expect_u32(&h, "deepseek2.feed_forward_length", 80);
    expect_u32(&h, "deepseek2.expert_count", (uint32_t)E);
    expect_u32(&h, "deepseek2.expert_used_count", qlora ? 3 : 2);
    expect_u32(&h, "deepseek2.expert_feed_forward_length", 32);
    expect_u32(&h, "deepseek2.expert_shared_count", 1);
    expect_u32(&h, "deepseek2.expert_gating_func", 2);
    expect_f32(&h, "deepseek2.expert_weights_scale", qlora ? 2.5f : 1.5f);
    expect_kv(&h, "deepseek2.expert_weights_norm", 7);
    expect_f32(&h, "deepseek2.attention.layer_norm_rms_epsilon", 1e-6f);
    if (qlora) {
        expect_u32(&h, "deepseek2.expert_group_count", 4);
        expect_u32(&h, "deepseek2.expert_group_used_count", 2);
        const hkv *t = hfind(&h, "deepseek2.rope.scaling.type");
        if (!t || strcmp(t->str, "yarn")) FAIL("rope.scaling.type is not yarn");
        expect_f32(&h, "deepseek2.rope.scaling.factor", 4.0f);
        expect_u32(&h, "deepseek2.rope.scaling.original_context_length", 256);
        /* mscale 1, mscale_all_dim 0.8: transformers' cos/sin factor A = g(1)/g(0.8) and softmax
         * scale g(0.8)^2/sqrt(24); llama.cpp's a and a^2 g(m)^2 with m = multiplier/0.1 */
        double l4 = log(4.0), A = (1 + 0.1 * l4) / (1 + 0.08 * l4), G = 1 + 0.08 * l4;
        expect_f32(&h, "deepseek2.rope.scaling.attn_factor", (float)A);
        expect_f32(&h, "deepseek2.rope.scaling.yarn_log_multiplier", (float)(0.1 * ((G / A - 1) / (0.1 * l4))));
    } else {
        if (hfind(&h, "deepseek2.expert_group_count")) FAIL("n_group 1 written as expert groups");
        if (hfind(&h, "deepseek2.rope.scaling.type")) FAIL("rope scaling written for default RoPE");
    }

    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    ASSERT_TRUE(mq_gguf_find_tensor(g, "blk.0.attn_kv_b.weight") == NULL);
    char n[96];
    snprintf(n, sizeof n, "blk.%lld.attn_norm.weight", (long long)L);
    ASSERT_TRUE(mq_gguf_find_tensor(g, n) == NULL);
    for (int l = 0; l < L; l++) {
#define TN(s) (snprintf(n, sizeof n, "blk.%d.%s", l, s), n)
        if (qlora) {
            expect_tensor(g, TN("attn_q_a.weight"), MQ_GGML_Q4_0, 2, D, 64, 0);
            expect_tensor(g, TN("attn_q_a_norm.weight"), MQ_GGML_F32, 1, 64, 0, 0);
            expect_tensor(g, TN("attn_q_b.weight"), MQ_GGML_Q4_0, 2, 64, H * hq, 0);
        } else {
            expect_tensor(g, TN("attn_q.weight"), MQ_GGML_Q4_0, 2, D, H * hq, 0);
        }
        expect_tensor(g, TN("attn_kv_a_mqa.weight"), MQ_GGML_Q4_0, 2, D, r + rope, 0);
        expect_tensor(g, TN("attn_kv_a_norm.weight"), MQ_GGML_F32, 1, r, 0, 0);
        expect_tensor(g, TN("attn_k_b.weight"), MQ_GGML_F32, 3, nope, r, H);
        expect_tensor(g, TN("attn_v_b.weight"), MQ_GGML_Q4_0, 3, r, v, H);
        expect_tensor(g, TN("attn_output.weight"), MQ_GGML_Q4_0, 2, H * v, D, 0);
        if (l == 0) {
            expect_tensor(g, TN("ffn_gate.weight"), MQ_GGML_Q4_0, 2, D, 80, 0);
            expect_tensor(g, TN("ffn_down.weight"), qlora ? MQ_GGML_F32 : MQ_GGML_BF16, 2, 80, D, 0);
        } else {
            expect_tensor(g, TN("ffn_gate_inp.weight"), MQ_GGML_F32, 2, D, E, 0);
            expect_tensor(g, TN("exp_probs_b.bias"), MQ_GGML_F32, 1, E, 0, 0);
            expect_tensor(g, TN("ffn_up_exps.weight"), MQ_GGML_Q4_0, 3, D, 32, E);
            expect_tensor(g, TN("ffn_down_exps.weight"), MQ_GGML_Q4_0, 3, 32, D, E);
            expect_tensor(g, TN("ffn_gate_shexp.weight"), MQ_GGML_Q4_0, 2, D, 32, 0);
        }
        /* the latent attention's tensors against the checkpoint's Linears */
        mq_st *st;
        ASSERT_OK(mq_st_open_dir(ckpt, &st));
        char mod[128];
        float *kvb = malloc(sizeof(float) * (size_t)(H * hb * r)), *q = malloc(sizeof(float) * (size_t)(H * hq * D));
        float *kva = malloc(sizeof(float) * (size_t)((r + rope) * D)), *gk = malloc(sizeof(float) * (size_t)(H * nope * r));
        float *gv = malloc(sizeof(float) * (size_t)(H * v * r)), *gq = malloc(sizeof(float) * (size_t)(H * hq * D));
        float *ga = malloc(sizeof(float) * (size_t)((r + rope) * D));
        snprintf(mod, sizeof mod, "model.layers.%d.self_attn.kv_b_proj", l);
        ASSERT_OK(mq_load_linear_weight(st, mod, H * hb, r, kvb, NULL));
        snprintf(mod, sizeof mod, "model.layers.%d.self_attn.kv_a_proj_with_mqa", l);
        ASSERT_OK(mq_load_linear_weight(st, mod, r + rope, D, kva, NULL));
        ASSERT_OK(mq_gguf_tensor_to_f32(mq_gguf_find_tensor(g, TN("attn_k_b.weight")), gk));
        ASSERT_OK(mq_gguf_tensor_to_f32(mq_gguf_find_tensor(g, TN("attn_v_b.weight")), gv));
        ASSERT_OK(mq_gguf_tensor_to_f32(mq_gguf_find_tensor(g, TN("attn_kv_a_mqa.weight")), ga));
        if (!qlora) {
            snprintf(mod, sizeof mod, "model.layers.%d.self_attn.q_proj", l);
            ASSERT_OK(mq_load_linear_weight(st, mod, H * hq, D, q, NULL));
            ASSERT_OK(mq_gguf_tensor_to_f32(mq_gguf_find_tensor(g, TN("attn_q.weight")), gq));
        }
        int bad = 0;
        for (int64_t hh = 0; hh < H && bad < 4; hh++)
            for (int64_t c = 0; c < r; c++) {
                for (int64_t i = 0; i < nope; i++)   /* ne {nope, r, H}: element (i, c, h) */
                    if (mq_test_f32_bits(gk[(hh * r + c) * nope + i]) != mq_test_f32_bits(kvb[(hh * hb + i) * r + c]) && bad++ < 4)
                        FAIL("%s layer %d attn_k_b (%lld, %lld, %lld)", tag, l, (long long)i, (long long)c, (long long)hh);
                for (int64_t j = 0; j < v; j++)   /* ne {r, v, H}: element (c, j, h) */
                    if (mq_test_f32_bits(gv[(hh * v + j) * r + c]) != mq_test_f32_bits(kvb[(hh * hb + nope + j) * r + c]) && bad++ < 4)
                        FAIL("%s layer %d attn_v_b (%lld, %lld, %lld)", tag, l, (long long)c, (long long)j, (long long)hh);
            }
        for (int64_t w = 0; w < r + rope && bad < 4; w++)
            for (int64_t c = 0; c < D; c++)
                if (mq_test_f32_bits(ga[w * D + c]) != mq_test_f32_bits(kva[ds_src(w, r, rope, !qlora) * D + c]) && bad++ < 4)
                    FAIL("%s layer %d attn_kv_a_mqa row %lld", tag, l, (long long)w);
        for (int64_t w = 0; !qlora && w < H * hq && bad < 4; w++)
            for (int64_t c = 0; c < D; c++)
                if (mq_test_f32_bits(gq[w * D + c]) != mq_test_f32_bits(q[(w / hq * hq + ds_src(w % hq, nope, rope, true)) * D + c]) &&
                    bad++ < 4)
                    FAIL("%s layer %d attn_q row %lld", tag, l, (long long)w);
        mq_st_close(st);
        /* read back: kv_b_proj merged as it was */
        if (l == 0) ASSERT_OK(moeq_import_gguf(file, imp));
        ASSERT_OK(mq_st_open_dir(imp, &st));
        snprintf(mod, sizeof mod, "model.layers.%d.self_attn.kv_b_proj.weight", l);
        const mq_tensor_view *tv = mq_st_find(st, mod);
        ASSERT_TRUE(tv != NULL);
        if (tv && tv->numel == H * hb * r) {
            ASSERT_OK(mq_tensor_to_f32(tv, gk = realloc(gk, sizeof(float) * (size_t)(H * hb * r))));
            for (int64_t k = 0; k < H * hb * r; k++)
                if (mq_test_f32_bits(gk[k]) != mq_test_f32_bits(kvb[k])) {
                    FAIL("%s layer %d: imported kv_b_proj value %lld", tag, l, (long long)k);
                    break;
                }
        }
        mq_st_close(st);
        free(kvb), free(q), free(kva), free(gk), free(gv), free(gq), free(ga);
#undef TN
    }
    mq_gguf_close(g);

    /* the imported model computes what the checkpoint does, bit for bit */
    moeq_model *a = mq_test_open_model(ckpt, NULL), *b = mq_test_open_model(imp, NULL);
    int32_t ids[48];
    for (int i = 0; i < 48; i++) ids[i] = (int32_t)((i * 977 + 13) % 4096);
    same_logits(a, b, ids, 48, tag);
}

static void test_deepseek_qlora_yarn(void) {
    char imp[1100];
    deepseek_check("deepseekv3-tiny", "ds-yarn", true, imp);
}

static void test_deepseek_no_qlora(void) {
    char imp[1100];
    deepseek_check("deepseekv3-noqlora-tiny", "ds-noqlora", false, imp);
}

/* NVFP4 (llama.cpp's deepseek2 applies no global scales) and latent norms llama.cpp would run
 * with another eps are refused, leaving nothing. */
static void test_deepseek_refusals(void) {
    expect_refused(deepseek_model("deepseekv3-tiny"), MOEQ_QUANT_NVFP4A16, "deepseek2", "ds-nvfp4");
    char dir[1100], cp[1200], *text;
    size_t len;
    snprintf(dir, sizeof dir, "%s/ds-eps", mq_test_tmpdir());
    mkdir(dir, 0755);
    snprintf(cp, sizeof cp, "%s", mq_test_repo("tests/data/deepseekv3-noqlora-tiny/config.json"));
    ASSERT_OK(mq_read_file(cp, &text, &len));
    char *p = strstr(text, "\"rms_norm_eps\": 1e-06");
    ASSERT_TRUE(p != NULL);
    if (p) memcpy(p, "\"rms_norm_eps\": 1e-05", 21);
    snprintf(cp, sizeof cp, "%s/config.json", dir);
    ASSERT_OK(mq_write_file_atomic(cp, text, len));
    free(text);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_gguf_check_model(dir, MQ_QS_INT4, false));
    if (!strstr(moeq_last_error(), "latent norms")) FAIL("message: %s", moeq_last_error());
}

typedef struct {
    float *x[3];   /* layer 0's q/kv_a input, kv_b input (the normed latents), o input */
    int64_t rows;
} mla_caps;

static void on_mla(void *user, int layer, mq_site site, int expert, const float *x, int64_t rows, int64_t cols) {
    (void)expert;
    mla_caps *c = user;
    int k = site == MQ_SITE_QKV ? 0 : site == MQ_SITE_KV_B ? 1 : site == MQ_SITE_O ? 2 : -1;
    if (layer != 0 || k < 0 || c->x[k]) return;
    c->x[k] = malloc(sizeof(float) * (size_t)(rows * cols));
    memcpy(c->x[k], x, sizeof(float) * (size_t)(rows * cols));
    c->rows = rows;
}

/* act_quant q8_0 on an imported deepseek2 file with a Q4_0 attn_v_b: layer 0's attention output
 * (o_proj's input) recomputed here in double from the hooked inputs as llama.cpp's absorbed MLA
 * computes it: q and kv_a on the Q8_0-rounded normed input, scores over [k_nope | k_rot] with k_nope
 * from kv_b's nope rows, each head's softmax-weighted sum of the normed latents Q8_0-rounded, then
 * kv_b's v rows of the head. The forward matches it; the same without the latent rounding (the
 * expanded attention's values) is clearly off. */
static void test_deepseek_act_quant_latent(void) {
    char imp[1100];
    deepseek_check("deepseekv3-noqlora-tiny", "ds-noqlora", false, imp);
    moeq_model_options mo = {.no_tokenizer = 1, .act_quant = MOEQ_ACT_QUANT_Q8_0};
    moeq_model *m = mq_test_open_model(imp, &mo);
    if (!m) return;
    const mq_layer *ly = &m->layers[0];
    ASSERT_TRUE(ly->vb_act_q && ly->q.act_q && ly->kv_a.act_q && !ly->kv_b.act_q);
    enum { TT = 40 };
    const int64_t D = m->cfg.D, H = m->cfg.n_heads, nope = m->cfg.qk_nope, rd = m->cfg.rope_dim, vd = m->cfg.v_head_dim;
    const int64_t r = m->cfg.kv_lora_rank, hq = nope + rd, hb = nope + vd;
    int32_t ids[TT];
    for (int i = 0; i < TT; i++) ids[i] = (int32_t)((i * 7919 + 13) % m->cfg.vocab);
    float *x = malloc(sizeof(float) * (size_t)(TT * D));
    mq_state *st = NULL;
    ASSERT_OK(mq_state_new(m, TT, &st));
    ASSERT_OK(mq_embed(m, ids, TT, x));
    mla_caps cs = {{NULL, NULL, NULL}, 0};
    mq_hooks hk = {on_mla, &cs};
    ASSERT_OK(mq_forward_layers(m, st, x, TT, 0, 0, 1, &hk));
    ASSERT_TRUE(cs.x[0] && cs.x[1] && cs.x[2]);
    if (!cs.x[0] || !cs.x[1] || !cs.x[2]) return;
    mq_q8_0_act_qdq(cs.x[0], TT, D);
    double *q = calloc((size_t)(TT * H * hq), sizeof(double)), *kr = calloc((size_t)(TT * rd), sizeof(double));
    double *kn = calloc((size_t)(TT * H * nope), sizeof(double)), *ref = calloc((size_t)(TT * H * vd), sizeof(double));
    double *plain = calloc((size_t)(TT * H * vd), sizeof(double));
    for (int64_t t = 0; t < TT; t++) {
        for (int64_t o = 0; o < H * hq; o++)
            for (int64_t i = 0; i < D; i++) q[t * H * hq + o] += (double)ly->q.w[o * D + i] * cs.x[0][t * D + i];
        for (int64_t o = 0; o < rd; o++)
            for (int64_t i = 0; i < D; i++) kr[t * rd + o] += (double)ly->kv_a.w[(r + o) * D + i] * cs.x[0][t * D + i];
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < nope; i++)
                for (int64_t c = 0; c < r; c++)
                    kn[(t * H + h) * nope + i] += (double)ly->kv_b.w[(h * hb + i) * r + c] * cs.x[1][t * r + c];
        /* RoPE on adjacent pairs (the imported checkpoint's rope_interleave), base rope_theta */
        for (int64_t i = 0; i < rd / 2; i++) {
            double a = (double)t * pow(m->cfg.rope_theta, -2.0 * (double)i / (double)rd), cs_ = cos(a), sn = sin(a);
            for (int64_t h = 0; h <= H; h++) {
                double *v = h < H ? q + (t * H + h) * hq + nope + 2 * i : kr + t * rd + 2 * i, u0 = v[0], u1 = v[1];
                v[0] = u0 * cs_ - u1 * sn;
                v[1] = u1 * cs_ + u0 * sn;
            }
        }
    }
    float ol[64];
    double sc[TT];
    ASSERT_TRUE(r <= 64);
    for (int64_t t = 0; t < TT; t++)
        for (int64_t h = 0; h < H; h++) {
            double mx = -INFINITY, sum = 0;
            for (int64_t u = 0; u <= t; u++) {
                double d = 0;
                for (int64_t i = 0; i < nope; i++) d += q[(t * H + h) * hq + i] * kn[(u * H + h) * nope + i];
                for (int64_t i = 0; i < rd; i++) d += q[(t * H + h) * hq + nope + i] * kr[u * rd + i];
                sc[u] = d * m->cfg.attn_scale;
                mx = fmax(mx, sc[u]);
            }
            for (int64_t u = 0; u <= t; u++) sum += (sc[u] = exp(sc[u] - mx));
            for (int64_t c = 0; c < r; c++) {
                double a = 0;
                for (int64_t u = 0; u <= t; u++) a += sc[u] / sum * cs.x[1][u * r + c];
                ol[c] = (float)a;
            }
            for (int pass = 0; pass < 2; pass++) {
                if (pass) mq_q8_0_act_qdq(ol, 1, r);
                for (int64_t j = 0; j < vd; j++) {
                    double a = 0;
                    for (int64_t c = 0; c < r; c++) a += (double)ly->kv_b.w[(h * hb + nope + j) * r + c] * ol[c];
                    (pass ? ref : plain)[(t * H + h) * vd + j] = a;
                }
            }
        }
    double mxv = 0, e_ref = 0, e_plain = 0;
    for (int64_t k = 0; k < TT * H * vd; k++) {
        mxv = fmax(mxv, fabs(ref[k]));
        e_ref = fmax(e_ref, fabs(ref[k] - cs.x[2][k]));
        e_plain = fmax(e_plain, fabs(plain[k] - cs.x[2][k]));
    }
    if (!(e_ref <= 2e-5 * mxv)) FAIL("latent attention with the rounding: max error %.3g of %.3g", e_ref, mxv);
    if (!(e_plain >= 1e-3 * mxv)) FAIL("without the latent rounding the error is only %.3g of %.3g", e_plain, mxv);
    free(q), free(kr), free(kn), free(ref), free(plain), free(x);
    for (int k = 0; k < 3; k++) free(cs.x[k]);
    mq_state_free(st);
    moeq_model_free(m);
}

/* DeepSeek-V3's pre-tokenizer (three Splits, then ByteLevel without its regex) on the bundled
 * vocabulary: written as llama.cpp's "deepseek-v3" (the third regex given here with CR/LF spelled
 * as the regex escapes \r \n, which moeq reads as the same regex), rebuilt by the importer with
 * the same ids, digits split in threes; one regex changed is refused. */
static cJSON *ds3_pre(const char *third) {
    cJSON *seq = cJSON_CreateObject(), *l = cJSON_AddArrayToObject(seq, "pretokenizers");
    cJSON_AddStringToObject(seq, "type", "Sequence");
    const char *re[3] = {mq_gguf_re_deepseek3[0], mq_gguf_re_deepseek3[1], third};
    for (int i = 0; i < 3; i++) {
        cJSON *sp = cJSON_CreateObject(), *pat;
        cJSON_AddStringToObject(sp, "type", "Split");
        pat = cJSON_AddObjectToObject(sp, "pattern");
        cJSON_AddStringToObject(pat, "Regex", re[i]);
        cJSON_AddStringToObject(sp, "behavior", "Isolated");
        cJSON_AddBoolToObject(sp, "invert", false);
        cJSON_AddItemToArray(l, sp);
    }
    cJSON *bl = cJSON_CreateObject();
    cJSON_AddStringToObject(bl, "type", "ByteLevel");
    cJSON_AddBoolToObject(bl, "add_prefix_space", false);
    cJSON_AddBoolToObject(bl, "trim_offsets", true);
    cJSON_AddBoolToObject(bl, "use_regex", false);
    cJSON_AddItemToArray(l, bl);
    return seq;
}

static void ds3_model(const char *dir, const char *third) {
    mkdir(dir, 0755);
    const char *files[3][2] = {{"tests/data/deepseekv3-noqlora-tiny/config.json", "config.json"},
                               {"tests/data/deepseekv3-noqlora-tiny/model.safetensors", "model.safetensors"},
                               {"models/olmoe-tiny/tokenizer_config.json", "tokenizer_config.json"}};
    for (int i = 0; i < 3; i++) {
        char a[1200], b[1200];
        snprintf(a, sizeof a, "%s", mq_test_repo(files[i][0]));
        snprintf(b, sizeof b, "%s/%s", dir, files[i][1]);
        if (symlink(a, b) != 0) FAIL("symlink %s", b);
    }
    char p[1200], *text;
    size_t len;
    snprintf(p, sizeof p, "%s", mq_test_repo("models/olmoe-tiny/tokenizer.json"));
    ASSERT_OK(mq_read_file(p, &text, &len));
    cJSON *t = cJSON_ParseWithLength(text, len);
    free(text);
    ASSERT_TRUE(t != NULL);
    cJSON_ReplaceItemInObjectCaseSensitive(t, "pre_tokenizer", ds3_pre(third));
    text = cJSON_PrintUnformatted(t);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    ASSERT_OK(mq_write_file_atomic(p, text, strlen(text)));
    free(text);
    cJSON_Delete(t);
}

static void encode(const moeq_model *m, const char *s, int32_t **ids, size_t *n) {
    *ids = NULL, *n = 0;
    ASSERT_OK(moeq_tokenizer_encode(moeq_model_tokenizer(m), s, strlen(s), ids, n));
}

static void test_deepseek3_pre_tokenizer(void) {
    char dir[1100], file[1100], imp[1100];
    snprintf(dir, sizeof dir, "%s/ds3-tok", mq_test_tmpdir());
    snprintf(file, sizeof file, "%s/ds3-tok.gguf", mq_test_tmpdir());
    snprintf(imp, sizeof imp, "%s/ds3-tok-imported", mq_test_tmpdir());
    /* the third regex with \r \n as escapes, where mq_gguf_re_deepseek3 has the characters */
    char third[512];
    const char *c = mq_gguf_re_deepseek3[2];
    size_t k = 0;
    for (; *c && k + 3 < sizeof third; c++) {
        if (*c == '\r' || *c == '\n') third[k++] = '\\', third[k++] = *c == '\r' ? 'r' : 'n';
        else third[k++] = *c;
    }
    third[k] = 0;
    ASSERT_TRUE(strchr(third, '\n') == NULL && strstr(third, "\\r\\n") != NULL);
    ds3_model(dir, third);
    ASSERT_OK(mq_gguf_export(dir, file, MQ_GGUF_REST_F32));
    mq_gguf *g;
    ASSERT_OK(mq_gguf_open(file, &g));
    const char *pre = "";
    size_t pl = 0;
    ASSERT_OK(mq_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pl));
    if (pl != 11 || memcmp(pre, "deepseek-v3", 11)) FAIL("tokenizer.ggml.pre '%.*s'", (int)pl, pre);
    mq_gguf_close(g);
    ASSERT_OK(moeq_import_gguf(file, imp));
    moeq_model *a = mq_test_open_model(dir, NULL), *b = mq_test_open_model(imp, NULL);
    const char *text = "Tower 1958: 333 m high, 12345678 yen; don't stop!!\r\n\t(x+y)=z \xe6\x9d\xb1\xe4\xba\xac"
                       "\xe3\x82\xbf\xe3\x83\xaf\xe3\x83\xbc\xe3\x81\xaf";
    int32_t *ia, *ib, *i1, *i2;
    size_t na, nb, n1, n2;
    encode(a, text, &ia, &na);
    encode(b, text, &ib, &nb);
    ASSERT_EQ_INT(na, nb);
    for (size_t i = 0; i < na && i < nb; i++)
        if (ia[i] != ib[i]) {
            FAIL("token %zu: %d against %d", i, ia[i], ib[i]);
            break;
        }
    /* \p{N}{1,3}: "12345" is "123" then "45" */
    free(ia), free(ib);
    encode(a, "12345", &ia, &na);
    encode(a, "123", &i1, &n1);
    encode(a, "45", &i2, &n2);
    ASSERT_EQ_INT(n1 + n2, na);
    for (size_t i = 0; i < na && i < n1 + n2; i++)
        ASSERT_EQ_INT(i < n1 ? i1[i] : i2[i - n1], ia[i]);
    free(ia), free(i1), free(i2);
    moeq_model_free(a);
    moeq_model_free(b);
    /* a changed regex is another tokenizer: refused */
    char dir2[1100], file2[1100];
    snprintf(dir2, sizeof dir2, "%s/ds3-other", mq_test_tmpdir());
    snprintf(file2, sizeof file2, "%s/ds3-other.gguf", mq_test_tmpdir());
    char other[512];
    snprintf(other, sizeof other, "%s", mq_gguf_re_deepseek3[2]);
    other[strlen(other) - 4] = 0;   /* without the last "|\s+" */
    ds3_model(dir2, other);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_gguf_export(dir2, file2, MQ_GGUF_REST_F32));
    if (!strstr(moeq_last_error(), "DeepSeek-V3")) FAIL("message: %s", moeq_last_error());
    ASSERT_FALSE(mq_file_exists(file2));
}

TEST_MAIN(T(test_decode_float_types), T(test_decode_q4_0_q4_1_q8_0), T(test_decode_q4_k_q5_k),
          T(test_decode_q6_k), T(test_decode_nvfp4), T(test_decode_bad_lengths), T(test_reader_valid),
          T(test_reader_truncated), T(test_reader_corrupt), T(test_olmoe_q4_0), T(test_olmoe_q4_0_g128_split),
          T(test_olmoe_q4_1), T(test_llama_permuted_q4_0), T(test_llama_nvfp4), T(test_qwen2moe_shared_experts),
          T(test_refusals), T(test_rest_f16_f32), T(test_rest_q8_0), T(test_import_olmoe), T(test_import_llama_permuted),
          T(test_import_qwen2moe), T(test_import_refuses), T(test_deepseek_qlora_yarn), T(test_deepseek_no_qlora),
          T(test_deepseek_refusals), T(test_deepseek_act_quant_latent), T(test_deepseek3_pre_tokenizer))
