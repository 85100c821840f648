/*
 * FP8 block-quantized source checkpoints (io/fp8.h), with fixtures made here from olmoe-tiny:
 * every decoder Linear weight (routers included) converted to F8_E4M3 with a weight_scale_inv per
 * block, in blocks of 128 x 128 (F32 scales; the routers' 8 rows make partial bottom blocks) and
 * of 48 x 80 (BF16 scales, partial blocks at the bottom and right of every weight; embeddings and
 * lm_head converted too). Independent answers:
 *  - the E4M3 decode against a formula written here (all 256 codes) and hand-made patterns;
 *  - every loaded weight (moeq_model_open and the lazy loader) equals, bit for bit, this file's
 *    decode of the stored code times its block's scale;
 *  - RTN and GPTQ from the FP8 copy give the same quantized tensors as from an F32 copy of those
 *    dequantized weights; Linears left unquantized (routers, --ignore) come out as BF16 of the
 *    dequantized weight; the output's config.json has moeq's quantization_config only; the
 *    checkpoint loads and evaluates, with the FP8 source as KL base (library and CLI);
 *  - broken sources (scale missing, misshapen, wrong block size, unknown fmt, no block size,
 *    weight_scale_inv beside a BF16 weight) are errors naming the tensor or field;
 *  - the checkpoint writer replaces a quantization_config it is handed, never adds a second.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "export/writer.h"
#include "formats/formats.h"
#include "harness.h"
#include "io/fp8.h"
#include "model/model.h"
#include "ckpt/source.h"

/* ---- an E4M3 decode of this file's own: (1 + m/8) * 2^(e-7), subnormals m/8 * 2^-6 ---------- */
static double ref_e4m3(uint8_t b) {
    int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    double v = e == 0 ? (m / 8.0) * pow(2.0, -6) : (1.0 + m / 8.0) * pow(2.0, e - 7);
    return sign ? -v : v;
}

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* bf16 of an fp32 value, round to nearest even (no NaN here) */
static uint16_t ref_bf16(float f) {
    uint32_t u = bits_of(f);
    uint32_t r = u + 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(r >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_e4m3_decode(void) {
    for (int b = 0; b < 256; b++) {
        float got = mq_e4m3_decode((uint8_t)b);
        double want = ref_e4m3((uint8_t)b);
        if (isnan(want)) {
            if (!isnan(got)) FAIL("code 0x%02X: expected NaN, got %g", b, (double)got);
            continue;
        }
        if (bits_of(got) != bits_of((float)want))
            FAIL("code 0x%02X: expected %.9g (0x%08X), got %.9g (0x%08X)", b, want,
                 bits_of((float)want), (double)got, bits_of(got));
    }
    /* hand-made patterns: S.EEEE.MMM */
    ASSERT_EQ_HEX(0x00000000u, bits_of(mq_e4m3_decode(0x00)));   /* +0 */
    ASSERT_EQ_HEX(0x80000000u, bits_of(mq_e4m3_decode(0x80)));   /* -0 */
    ASSERT_EQ_HEX(bits_of(0x1p-9f), bits_of(mq_e4m3_decode(0x01)));    /* smallest subnormal */
    ASSERT_EQ_HEX(bits_of(0x1.cp-7f), bits_of(mq_e4m3_decode(0x07)));  /* 7 * 2^-9 */
    ASSERT_EQ_HEX(bits_of(0x1p-6f), bits_of(mq_e4m3_decode(0x08)));    /* smallest normal */
    ASSERT_EQ_HEX(bits_of(1.0f), bits_of(mq_e4m3_decode(0x38)));
    ASSERT_EQ_HEX(bits_of(1.875f), bits_of(mq_e4m3_decode(0x3F)));
    ASSERT_EQ_HEX(bits_of(2.0f), bits_of(mq_e4m3_decode(0x40)));
    ASSERT_EQ_HEX(bits_of(-3.5f), bits_of(mq_e4m3_decode(0xC6)));
    ASSERT_EQ_HEX(bits_of(448.0f), bits_of(mq_e4m3_decode(0x7E)));    /* largest finite */
    ASSERT_EQ_HEX(bits_of(-448.0f), bits_of(mq_e4m3_decode(0xFE)));
    ASSERT_EQ_HEX(bits_of(256.0f), bits_of(mq_e4m3_decode(0x78)));    /* S.1111.000: no Inf */
    ASSERT_TRUE(isnan(mq_e4m3_decode(0x7F)));
    ASSERT_TRUE(isnan(mq_e4m3_decode(0xFF)));
    /* the safetensors conversion of a plain F8_E4M3 tensor uses it */
    uint8_t codes[4] = {0x38, 0xC6, 0x01, 0x7E};
    mq_tensor_view v = {.name = "t", .dtype = MOEQ_DT_F8_E4M3, .ndim = 1, .shape = {4},
                        .numel = 4, .data = codes, .nbytes = 4};
    float out[4];
    ASSERT_OK(mq_tensor_to_f32(&v, out));
    ASSERT_TRUE(out[0] == 1.0f && out[1] == -3.5f && out[2] == 0x1p-9f && out[3] == 448.0f);
}

/* ---- fixtures ---------------------------------------------------------------------------------- */
typedef struct {
    int br, bc;              /* block size */
    bool bf16_scales;        /* scale_inv in BF16 (else F32) */
    bool globals;            /* embed_tokens and lm_head in FP8 too */
    const char *drop_scale;  /* leave this scale tensor out */
    const char *bad_scale;   /* give this scale one row too many */
    const char *qconfig;     /* quantization_config JSON; NULL: the matching fp8 block */
    bool dequantized;        /* write F32 dequantized weights instead (the reference copy) */
} fp8_spec;

static char *read_all(const char *dir, const char *name, size_t *len) {
    char *p = mq_path_join(dir, name), *text = NULL;
    size_t n = 0;
    if (mq_read_file(p, &text, &n) != MOEQ_OK) FAIL("cannot read %s", p);
    free(p);
    if (len) *len = n;
    return text;
}

static char *read_path(const char *path) {
    char *text = NULL;
    size_t n = 0;
    if (mq_read_file(path, &text, &n) != MOEQ_OK) FAIL("cannot read %s", path);
    return text;
}

static void copy_file(const char *src, const char *dst, const char *name) {
    size_t n;
    char *data = read_all(src, name, &n);
    char *p = mq_path_join(dst, name);
    ASSERT_OK(mq_write_file_atomic(p, data, n));
    free(p);
    free(data);
}

static bool converted(const mq_tensor_view *t, bool globals) {
    if (t->ndim != 2) return false;
    if (globals && (!strcmp(t->name, "model.embed_tokens.weight") || !strcmp(t->name, "lm_head.weight")))
        return true;
    size_t n = strlen(t->name);
    return strncmp(t->name, "model.layers.", 13) == 0 && n > 7 && !strcmp(t->name + n - 7, ".weight");
}

/* The FP8 weight and scale of one tensor (codes [R*C], scales [SR*SC] as fp32 values). */
static void to_fp8(const float *w, int64_t R, int64_t C, const fp8_spec *sp, uint8_t *codes,
                   float *scales) {
    int64_t SR = (R + sp->br - 1) / sp->br, SC = (C + sp->bc - 1) / sp->bc;
    for (int64_t a = 0; a < SR; a++)
        for (int64_t b = 0; b < SC; b++) {
            float amax = 0;
            for (int64_t r = a * sp->br; r < R && r < (a + 1) * sp->br; r++)
                for (int64_t c = b * sp->bc; c < C && c < (b + 1) * sp->bc; c++)
                    amax = fmaxf(amax, fabsf(w[r * C + c]));
            float s = amax > 0 ? amax / 448.0f : 1.0f;
            if (sp->bf16_scales) s = from_bf16(ref_bf16(s));
            scales[a * SC + b] = s;
            for (int64_t r = a * sp->br; r < R && r < (a + 1) * sp->br; r++)
                for (int64_t c = b * sp->bc; c < C && c < (b + 1) * sp->bc; c++)
                    codes[r * C + c] = mq_e4m3_encode(w[r * C + c] / s);
        }
}

/* The weight this file expects from codes and scales: decode(code) * scale, in fp32. */
static void ref_dequant(const uint8_t *codes, const float *scales, int64_t R, int64_t C, int br,
                        int bc, float *out) {
    int64_t SC = (C + bc - 1) / bc;
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++)
            out[r * C + c] = (float)ref_e4m3(codes[r * C + c]) * scales[(r / br) * SC + c / bc];
}

/* Writes dst: olmoe-tiny with its Linears in FP8 as sp says (or, dequantized, in F32). */
static void make_fp8(const char *src, const char *dst, const fp8_spec *sp) {
    mkdir(dst, 0755);
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(src, &st));
    if (!st) return;
    mq_st_writer *w = mq_stw_new();
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *t = mq_st_at(st, i);
        if (!converted(t, sp->globals)) {
            ASSERT_OK(mq_stw_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes));
            continue;
        }
        int64_t R = t->shape[0], C = t->shape[1];
        int64_t SR = (R + sp->br - 1) / sp->br, SC = (C + sp->bc - 1) / sp->bc;
        float *f = malloc(sizeof(float) * (size_t)(R * C)), *sc = malloc(sizeof(float) * (size_t)(SR * SC));
        uint8_t *codes = malloc((size_t)(R * C));
        ASSERT_OK(mq_tensor_to_f32(t, f));
        to_fp8(f, R, C, sp, codes, sc);
        if (sp->dequantized) {
            ref_dequant(codes, sc, R, C, sp->br, sp->bc, f);
            ASSERT_OK(mq_stw_add(w, t->name, MOEQ_DT_F32, 2, t->shape, f, sizeof(float) * (size_t)(R * C)));
        } else {
            ASSERT_OK(mq_stw_add(w, t->name, MOEQ_DT_F8_E4M3, 2, t->shape, codes, (size_t)(R * C)));
            char name[512];
            snprintf(name, sizeof name, "%s_scale_inv", t->name);
            int64_t shape[2] = {SR, SC};
            if (sp->bad_scale && !strcmp(sp->bad_scale, name)) shape[0]++;
            size_t n = (size_t)(shape[0] * shape[1]);
            float *scv = calloc(n, sizeof(float));
            memcpy(scv, sc, sizeof(float) * (size_t)(SR * SC));
            if (!sp->drop_scale || strcmp(sp->drop_scale, name) != 0) {
                if (sp->bf16_scales) {
                    uint16_t *h = malloc(2 * n);
                    for (size_t k = 0; k < n; k++) h[k] = ref_bf16(scv[k]);
                    ASSERT_OK(mq_stw_add(w, name, MOEQ_DT_BF16, 2, shape, h, 2 * n));
                    free(h);
                } else {
                    ASSERT_OK(mq_stw_add(w, name, MOEQ_DT_F32, 2, shape, scv, 4 * n));
                }
            }
            free(scv);
        }
        free(f);
        free(sc);
        free(codes);
    }
    mq_test_write_model_st(w, dst);
    mq_st_close(st);

    char *cfg = read_all(src, "config.json", NULL);
    cJSON *root = cJSON_Parse(cfg);
    free(cfg);
    if (!sp->dequantized) {
        char block[256];
        snprintf(block, sizeof block, "{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                 "\"activation_scheme\": \"dynamic\", \"weight_block_size\": [%d, %d]}", sp->br, sp->bc);
        cJSON_AddItemToObject(root, "quantization_config", cJSON_Parse(sp->qconfig ? sp->qconfig : block));
    }
    char *text = cJSON_Print(root);
    char *p = mq_path_join(dst, "config.json");
    ASSERT_OK(mq_write_file_atomic(p, text, strlen(text)));
    free(p);
    free(text);
    cJSON_Delete(root);
    copy_file(src, dst, "tokenizer.json");
}

static const char *src_model(void) {
    static char path[1024];
    const char *m = mq_test_model("olmoe-tiny");
    snprintf(path, sizeof path, "%s", m);
    return path;
}

static char *sub(const char *name) { return mq_path_join(mq_test_tmpdir(), name); }

/* ---- (1) the loaded weights --------------------------------------------------------------------- */
/* The fp32 weight the model holds for checkpoint tensor `name` (NULL if not a weight we track). */
static const float *model_weight(const moeq_model *m, const char *name) {
    int l, e, n = 0;
    char part[32];
    if (!strcmp(name, "model.embed_tokens.weight")) return m->embed;
    if (!strcmp(name, "lm_head.weight")) return m->lm_head;
    if (sscanf(name, "model.layers.%d.mlp.experts.%d.%31[a-z]_proj.weight%n", &l, &e, part, &n) == 3 && n) {
        const mq_layer *ly = &m->layers[l];
        if (!strcmp(part, "gate")) return ly->exp_gate[e].w;
        if (!strcmp(part, "up")) return ly->exp_up[e].w;
        if (!strcmp(part, "down")) return ly->exp_down[e].w;
        return NULL;
    }
    n = 0;
    if (sscanf(name, "model.layers.%d.self_attn.%31[a-z]_proj.weight%n", &l, part, &n) == 2 && n) {
        const mq_layer *ly = &m->layers[l];
        if (!strcmp(part, "q")) return ly->q.w;
        if (!strcmp(part, "k")) return ly->k.w;
        if (!strcmp(part, "v")) return ly->v.w;
        if (!strcmp(part, "o")) return ly->o.w;
        return NULL;
    }
    n = 0;
    if (sscanf(name, "model.layers.%d.mlp.gate.weight%n", &l, &n) == 1 && n) return m->layers[l].router;
    return NULL;
}

/* The reference fp32 values of FP8 tensor `name` of the file, from its raw codes and scales
 * (malloc'ed; NULL when the tensor is not FP8). */
static float *ref_weight(const mq_st *raw, const char *name, int br, int bc, int64_t *numel) {
    const mq_tensor_view *t = mq_st_find(raw, name);
    if (!t || t->dtype != MOEQ_DT_F8_E4M3) return NULL;
    char sn[512];
    snprintf(sn, sizeof sn, "%s_scale_inv", name);
    const mq_tensor_view *s = mq_st_find(raw, sn);
    if (!s) {
        FAIL("no %s", sn);
        return NULL;
    }
    float *sc = malloc(sizeof(float) * (size_t)s->numel);
    for (int64_t i = 0; i < s->numel; i++) {
        if (s->dtype == MOEQ_DT_BF16) {
            uint16_t h;
            memcpy(&h, s->data + 2 * i, 2);
            sc[i] = from_bf16(h);
        } else {
            memcpy(&sc[i], s->data + 4 * i, 4);
        }
    }
    float *out = malloc(sizeof(float) * (size_t)t->numel);
    ref_dequant(t->data, sc, t->shape[0], t->shape[1], br, bc, out);
    free(sc);
    *numel = t->numel;
    return out;
}

/* Every FP8 tensor of dir's file against the model's fp32 weights, bit for bit; returns the
 * number of tensors compared. */
static int compare_weights(const moeq_model *m, const char *dir, int br, int bc, bool layers_only) {
    char *path = mq_path_join(dir, "model.safetensors");
    mq_st *raw = NULL;
    ASSERT_OK(mq_st_open_file(path, &raw));   /* a single file: not linked, raw codes */
    free(path);
    int n = 0;
    for (size_t i = 0; raw && i < mq_st_count(raw); i++) {
        const char *name = mq_st_at(raw, i)->name;
        int64_t numel = 0;
        float *ref = ref_weight(raw, name, br, bc, &numel);
        if (ref && layers_only && strncmp(name, "model.layers.", 13) != 0) {
            free(ref);
            continue;
        }
        if (!ref) continue;
        const float *got = model_weight(m, name);
        if (!got) {
            FAIL("%s: not loaded", name);
        } else {
            for (int64_t k = 0; k < numel; k++)
                if (bits_of(got[k]) != bits_of(ref[k])) {
                    FAIL("%s[%lld]: loaded %.9g, expected %.9g", name, (long long)k,
                         (double)got[k], (double)ref[k]);
                    break;
                }
            n++;
        }
        free(ref);
    }
    mq_st_close(raw);
    return n;
}

static void check_loaded(const char *dir, int br, int bc, int expect_tensors) {
    moeq_model *m = mq_test_open_model(dir, NULL);
    if (!m) return;
    ASSERT_EQ_STR("fp8/e4m3", moeq_model_get_info(m)->quant_scheme);
    ASSERT_EQ_INT(br, m->cfg.fp8_block_rows);
    ASSERT_EQ_INT(bc, m->cfg.fp8_block_cols);
    ASSERT_EQ_INT(expect_tensors, compare_weights(m, dir, br, bc, false));
    moeq_model_free(m);

    /* the lazy loader (the streaming pipeline's), layer by layer */
    mq_lazy_model *lz = NULL;
    ASSERT_OK(mq_lazy_open(dir, false, &lz));
    if (!lz) return;
    moeq_model *lm = mq_lazy_model_of(lz);
    unsigned all = MQ_PART_ATTN | MQ_PART_FFN_NORM | MQ_PART_ROUTER | MQ_PART_MLP |
                   MQ_PART_SHARED | MQ_PART_EXPERTS;
    for (int l = 0; l < lm->cfg.n_layers; l++)
        ASSERT_OK(mq_lazy_load(lz, l, all, 0, lm->cfg.n_experts));
    /* lm_head is never loaded lazily, embeddings are read by row */
    ASSERT_EQ_INT(116, compare_weights(lm, dir, br, bc, true));
    int32_t ids[3] = {0, 17, 4095};
    float *x = malloc(sizeof(float) * 3 * (size_t)lm->cfg.D);
    ASSERT_OK(mq_lazy_embed(lz, ids, 3, x));
    moeq_model *full = mq_test_open_model(dir, NULL);
    for (int t = 0; full && t < 3; t++)
        ASSERT_TRUE(memcmp(x + t * lm->cfg.D, full->embed + (int64_t)ids[t] * lm->cfg.D,
                           sizeof(float) * (size_t)lm->cfg.D) == 0);
    moeq_model_free(full);
    free(x);
    mq_lazy_close(lz);
}

/* olmoe-tiny: 4 layers x (4 attention + 1 router + 8 experts x 3) = 116 decoder Linears */
static void test_load_blocks_128(void) {
    char *dir = sub("fp8-128");
    fp8_spec sp = {.br = 128, .bc = 128};
    make_fp8(src_model(), dir, &sp);
    check_loaded(dir, 128, 128, 116);
    free(dir);
}

static void test_load_blocks_48x80_bf16_scales(void) {
    char *dir = sub("fp8-48x80");
    fp8_spec sp = {.br = 48, .bc = 80, .bf16_scales = true, .globals = true};
    make_fp8(src_model(), dir, &sp);
    check_loaded(dir, 48, 80, 118);
    free(dir);
}

/* ---- (2) quantizing from an FP8 source ----------------------------------------------------------- */
static const char *calib_file(void) {
    static char path[1024];
    snprintf(path, sizeof path, "%s", mq_test_calib_text());
    return path;
}

static moeq_status quantize(const char *src, const char *out, bool gptq, const char *const *ignore,
                            int n_ignore) {
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_NVFP4A16;
    o.method = gptq ? MOEQ_QUANT_GPTQ : MOEQ_QUANT_RTN;
    o.ignore = ignore;
    o.n_ignore = n_ignore;
    if (gptq) {
        o.calib = calib_file();
        o.gptq.nsamples = 4;
        o.gptq.seqlen = 64;
    }
    return moeq_quantize(src, out, &o, NULL);
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* The checkpoint out_fp8 (made from the FP8 source fp8) against out_ref (made from the F32
 * dequantized copy): quantized tensors byte-identical, unquantized FP8 Linears BF16 of the
 * dequantized weight, no scale_inv, config.json with one quantization_config, moeq's. */
static void compare_outputs(const char *fp8, const char *out_fp8, const char *out_ref, int br, int bc) {
    mq_st *a = NULL, *b = NULL, *raw = NULL;
    ASSERT_OK(mq_st_open_dir(out_fp8, &a));
    ASSERT_OK(mq_st_open_dir(out_ref, &b));
    char *rp = mq_path_join(fp8, "model.safetensors");
    ASSERT_OK(mq_st_open_file(rp, &raw));
    free(rp);
    if (!a || !b || !raw) goto done;
    ASSERT_EQ_INT(mq_st_count(b), mq_st_count(a));
    int n_same = 0, n_bf16 = 0;
    for (size_t i = 0; i < mq_st_count(a); i++) {
        const mq_tensor_view *t = mq_st_at(a, i);
        if (ends_with(t->name, "_scale_inv")) FAIL("%s passed through", t->name);
        const mq_tensor_view *r = mq_st_find(b, t->name);
        if (!r) {
            FAIL("%s: not in the reference output", t->name);
            continue;
        }
        int64_t numel = 0;
        float *ref = ref_weight(raw, t->name, br, bc, &numel);
        if (ref) {   /* an FP8 source weight written unquantized: BF16 of its dequantized values */
            ASSERT_EQ_STR("BF16", moeq_dtype_name(t->dtype));
            for (int64_t k = 0; k < numel && t->dtype == MOEQ_DT_BF16; k++) {
                uint16_t h;
                memcpy(&h, t->data + 2 * k, 2);
                if (h != ref_bf16(ref[k])) {
                    FAIL("%s[%lld]: 0x%04X, expected bf16 0x%04X", t->name, (long long)k, h,
                         ref_bf16(ref[k]));
                    break;
                }
            }
            n_bf16++;
            free(ref);
            continue;
        }
        if (t->dtype != r->dtype || t->nbytes != r->nbytes || memcmp(t->data, r->data, t->nbytes))
            FAIL("%s differs from the F32 source's", t->name);
        else
            n_same++;
    }
    ASSERT_TRUE(n_bf16 >= 4);   /* the routers at least */
    ASSERT_TRUE(n_same > 300);
    /* config.json: moeq's block only */
    char *text = read_all(out_fp8, "config.json", NULL);
    int n_qc = 0;
    for (const char *c = strstr(text, "\"quantization_config\""); c; c = strstr(c + 1, "\"quantization_config\""))
        n_qc++;
    ASSERT_EQ_INT(1, n_qc);
    cJSON *root = cJSON_Parse(text);
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
    ASSERT_EQ_STR("compressed-tensors", cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(q, "quant_method")));
    ASSERT_TRUE(cJSON_GetObjectItemCaseSensitive(q, "weight_block_size") == NULL);
    ASSERT_TRUE(cJSON_GetObjectItemCaseSensitive(q, "fmt") == NULL);
    ASSERT_TRUE(strstr(text, "weight_block_size") == NULL);
    cJSON_Delete(root);
    free(text);
done:
    mq_st_close(a);
    mq_st_close(b);
    mq_st_close(raw);
}

/* Loads out and evaluates it on some text against the FP8 source as KL base. */
static void eval_against(const char *out, const char *fp8) {
    moeq_model *m = NULL, *base = NULL;
    ASSERT_OK(moeq_model_open(out, NULL, &m));
    ASSERT_OK(moeq_model_open(fp8, NULL, &base));
    moeq_docs *docs = NULL;
    const char text[] = "The cat sat on the mat. It was a sunny day, and the children played in "
                        "the park until the evening came.";
    ASSERT_OK(moeq_docs_parse("text", text, sizeof text - 1, MOEQ_DOCS_WHOLE, &docs));
    if (m && base && docs) {
        moeq_eval_options eo = mq_test_text_eval(0, base);
        moeq_eval_result r;
        ASSERT_OK(moeq_eval(m, docs, &eo, &r));
        ASSERT_TRUE(r.tokens > 10 && isfinite(r.token_perplexity) && r.token_perplexity > 1);
        ASSERT_TRUE(r.has_kl && r.kl_mean >= 0 && r.kl_mean < 1);
        /* the source against itself: KL 0 */
        eo.kl_base = base;
        ASSERT_OK(moeq_eval(base, docs, &eo, &r));
        ASSERT_NEAR(0.0, r.kl_mean, 1e-9);
    }
    moeq_docs_free(docs);
    moeq_model_free(m);
    moeq_model_free(base);
}

static void quantize_case(bool gptq) {
    const char *tag = gptq ? "gptq" : "rtn";
    char name[64];
    snprintf(name, sizeof name, "q-%s-src", tag);
    char *fp8 = sub(name);
    snprintf(name, sizeof name, "q-%s-ref", tag);
    char *ref = sub(name);
    snprintf(name, sizeof name, "q-%s-out", tag);
    char *out = sub(name);
    snprintf(name, sizeof name, "q-%s-out-ref", tag);
    char *out_ref = sub(name);
    fp8_spec sp = {.br = 48, .bc = 80};
    make_fp8(src_model(), fp8, &sp);
    sp.dequantized = true;
    make_fp8(src_model(), ref, &sp);
    const char *ignore[] = {"layers\\.1\\.self_attn\\.o_proj"};
    ASSERT_OK(quantize(fp8, out, gptq, ignore, 1));
    ASSERT_OK(quantize(ref, out_ref, gptq, ignore, 1));
    compare_outputs(fp8, out, out_ref, 48, 80);
    eval_against(out, fp8);
    free(fp8);
    free(ref);
    free(out);
    free(out_ref);
}

static void test_quantize_rtn(void) { quantize_case(false); }
static void test_quantize_gptq(void) { quantize_case(true); }

/* ---- the CLI: inspect and eval --kl-base with an FP8 source --------------------------------------- */
static int run(const char *fmt, const char *a, const char *b, const char *c, const char *log) {
    const char *cli = getenv("MOEQ_CLI");
    char args[4096], cmd[8192];
    snprintf(args, sizeof args, fmt, a, b, c);
    snprintf(cmd, sizeof cmd, "'%s' %s > '%s' 2>&1", cli, args, log);
    return system(cmd);
}

static void test_cli(void) {
    if (!getenv("MOEQ_CLI")) {
        SKIP("MOEQ_CLI is not set (ctest sets it)");
        return;
    }
    char *fp8 = sub("cli-fp8"), *out = sub("cli-out"), *log = sub("cli.log"), *txt = sub("cli.txt");
    fp8_spec sp = {.br = 128, .bc = 128};
    make_fp8(src_model(), fp8, &sp);
    const char text[] = "Once upon a time there was a small town by the sea, and every morning the "
                        "fishermen went out with their boats.\n";
    ASSERT_OK(mq_write_file_atomic(txt, text, sizeof text - 1));
    ASSERT_EQ_INT(0, run("inspect '%s' --weights%s%s", fp8, "", "", log));
    char *s = read_path(log);
    printf("%s", s);   /* shown by ctest --output-on-failure */
    ASSERT_TRUE(strstr(s, "quantization          fp8") != NULL);
    ASSERT_TRUE(strstr(s, "FP8 e4m3 weights with one weight_scale_inv per 128 x 128 block") != NULL);
    ASSERT_TRUE(strstr(s, "fp8 (block scales)") != NULL);
    ASSERT_TRUE(strstr(s, "128x128") != NULL);
    free(s);
    ASSERT_EQ_INT(0, run("quantize '%s' --out '%s' --scheme int4 --method rtn --quiet%s", fp8, out, "", log));
    ASSERT_EQ_INT(0, run("eval '%s' --task text --data '%s' --kl-base '%s' --json", out, txt, fp8, log));
    s = read_path(log);
    ASSERT_TRUE(strstr(s, "\"kl_mean\"") != NULL);
    free(s);
    ASSERT_EQ_INT(0, run("eval '%s' --task text --data '%s' --kl-base '%s' --json", fp8, txt, out, log));
    s = read_path(log);
    ASSERT_TRUE(strstr(s, "\"kl_mean\"") != NULL);
    free(s);
    free(fp8);
    free(out);
    free(log);
    free(txt);
}

/* ---- (3) broken sources ---------------------------------------------------------------------- */
/* The source made by sp fails to open (eager and lazy) and to quantize with status st, and each
 * message mentions `what`. */
static void expect_broken(const char *name, const fp8_spec *sp, moeq_status st, const char *what) {
    char *dir = sub(name);
    make_fp8(src_model(), dir, sp);
    moeq_model *m = NULL;
    ASSERT_STATUS(st, moeq_model_open(dir, NULL, &m));
    ASSERT_ERROR_MENTIONS(what);
    printf("%s: %s\n", name, moeq_last_error());
    moeq_model_free(m);
    mq_lazy_model *lz = NULL;
    ASSERT_STATUS(st, mq_lazy_open(dir, false, &lz));
    ASSERT_ERROR_MENTIONS(what);
    mq_lazy_close(lz);
    char *out = mq_path_join(dir, "out");
    ASSERT_STATUS(st, quantize(dir, out, false, NULL, 0));
    ASSERT_ERROR_MENTIONS(what);
    struct stat sb;
    ASSERT_TRUE(stat(out, &sb) != 0);   /* nothing left behind */
    free(out);
    free(dir);
}

static void test_broken_sources(void) {
    const char *q = "model.layers.2.self_attn.q_proj.weight_scale_inv";
    fp8_spec sp = {.br = 128, .bc = 128, .drop_scale = q};
    expect_broken("no-scale", &sp, MOEQ_E_FORMAT, q);
    sp = (fp8_spec){.br = 128, .bc = 128, .bad_scale = "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"};
    expect_broken("bad-scale", &sp, MOEQ_E_FORMAT, "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv");
    /* scales made for 128 x 128, config says 64 x 128 */
    sp = (fp8_spec){.br = 128, .bc = 128, .qconfig = "{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                    "\"weight_block_size\": [64, 128]}"};
    expect_broken("wrong-block", &sp, MOEQ_E_FORMAT, "weight_block_size");
    sp.qconfig = "{\"quant_method\": \"fp8\", \"fmt\": \"e5m2\", \"weight_block_size\": [128, 128]}";
    expect_broken("e5m2", &sp, MOEQ_E_UNSUPPORTED, "e5m2");
    sp.qconfig = "{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\"}";
    expect_broken("no-block", &sp, MOEQ_E_UNSUPPORTED, "weight_block_size");
    sp.qconfig = "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 0]}";
    expect_broken("zero-block", &sp, MOEQ_E_FORMAT, "weight_block_size");
    sp.qconfig = "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], "
                 "\"activation_scheme\": \"static\"}";
    expect_broken("static", &sp, MOEQ_E_UNSUPPORTED, "activation_scheme");
    /* not an FP8 config at all: the F8_E4M3 weights have no meaning */
    sp.qconfig = "{\"quant_method\": \"bitsandbytes\"}";
    char *dir = sub("bnb");
    make_fp8(src_model(), dir, &sp);
    moeq_model *m = NULL;
    ASSERT_TRUE(moeq_model_open(dir, NULL, &m) != MOEQ_OK);
    ASSERT_ERROR_MENTIONS("F8_E4M3");
    char *out = mq_path_join(dir, "out");
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, quantize(dir, out, false, NULL, 0));
    ASSERT_ERROR_MENTIONS("quantization_config");
    free(out);
    free(dir);
}

/* A scale_inv beside a BF16 weight, or with no weight at all. */
static void test_scale_without_fp8_weight(void) {
    mq_st_writer *w = mq_stw_new();
    uint16_t wb[4 * 4] = {0};
    float s[1] = {1.0f};
    int64_t ws[2] = {4, 4}, ss[2] = {1, 1};
    ASSERT_OK(mq_stw_add(w, "a.weight", MOEQ_DT_BF16, 2, ws, wb, sizeof wb));
    ASSERT_OK(mq_stw_add(w, "a.weight_scale_inv", MOEQ_DT_F32, 2, ss, s, sizeof s));
    const char *p = mq_test_tmpdir();
    char *path = mq_path_join(p, "x.safetensors");
    ASSERT_OK(mq_stw_write(w, path));
    mq_stw_free(w);
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_file(path, &st));
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_st_link_fp8(st, 128, 128, mq_fp8_block_dequant));
    ASSERT_ERROR_MENTIONS("a.weight");
    mq_st_close(st);
    free(path);

    w = mq_stw_new();
    ASSERT_OK(mq_stw_add(w, "b.weight_scale_inv", MOEQ_DT_F32, 2, ss, s, sizeof s));
    path = mq_path_join(p, "y.safetensors");
    ASSERT_OK(mq_stw_write(w, path));
    mq_stw_free(w);
    ASSERT_OK(mq_st_open_file(path, &st));
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_st_link_fp8(st, 128, 128, mq_fp8_block_dequant));
    ASSERT_ERROR_MENTIONS("b.weight_scale_inv");
    mq_st_close(st);
    free(path);

    /* a linked weight refuses to convert as a slice */
    uint8_t codes[3 * 5];
    for (int i = 0; i < 15; i++) codes[i] = (uint8_t)(0x30 + i);
    float sc[2 * 3] = {1, 2, 4, 8, 16, 32};
    w = mq_stw_new();
    int64_t cs[2] = {3, 5}, scs[2] = {2, 3};
    ASSERT_OK(mq_stw_add(w, "c.weight", MOEQ_DT_F8_E4M3, 2, cs, codes, sizeof codes));
    ASSERT_OK(mq_stw_add(w, "c.weight_scale_inv", MOEQ_DT_F32, 2, scs, sc, sizeof sc));
    path = mq_path_join(p, "z.safetensors");
    ASSERT_OK(mq_stw_write(w, path));
    mq_stw_free(w);
    ASSERT_OK(mq_st_open_file(path, &st));
    ASSERT_OK(mq_st_link_fp8(st, 2, 2, mq_fp8_block_dequant));   /* blocks of 2 x 2: partial at the bottom and right */
    const mq_tensor_view *t = mq_st_find(st, "c.weight");
    float out[15], ref[15];
    ASSERT_OK(mq_tensor_to_f32(t, out));
    ref_dequant(codes, sc, 3, 5, 2, 2, ref);
    for (int i = 0; i < 15; i++) ASSERT_EQ_HEX(bits_of(ref[i]), bits_of(out[i]));
    ASSERT_TRUE(out[14] == (float)ref_e4m3(codes[14]) * 32.0f);   /* row 2, column 4: block [1, 2] */
    mq_tensor_view v = *t;
    v.ndim = 1;
    v.shape[0] = 15;
    ASSERT_STATUS(MOEQ_E_ARG, mq_tensor_to_f32(&v, out));
    ASSERT_ERROR_MENTIONS("c.weight");
    mq_st_close(st);
    free(path);
}

/* The checkpoint writer replaces a quantization_config in the config it is given (never two). */
static void test_writer_replaces_quantization_config(void) {
    char *dir = sub("w");
    mkdir(dir, 0755);
    mq_tensor_decl d = {.name = "x", .dtype = MOEQ_DT_F32, .ndim = 1, .shape = {1}};
    mq_ckpt_opts o = {.format = MQ_FMT_CT, .spec = mq_qspec_default(MQ_QS_NVFP4)};
    mq_ckpt_writer *w = NULL;
    ASSERT_OK(mq_ckpt_writer_open(dir, &d, 1, &o, false, &w));
    float x = 1.0f;
    ASSERT_OK(mq_ckpt_writer_put(w, "x", MOEQ_DT_F32, &x, sizeof x));
    cJSON *cfg = cJSON_Parse("{\"model_type\": \"olmoe\", \"quantization_config\": {\"quant_method\": "
                             "\"fp8\", \"fmt\": \"e4m3\", \"weight_block_size\": [128, 128]}}");
    ASSERT_OK(mq_ckpt_writer_finish(w, cfg, dir, NULL, 0));
    mq_ckpt_writer_close(w);
    cJSON_Delete(cfg);
    char *text = read_all(dir, "config.json", NULL);
    int n_qc = 0;
    for (const char *c = strstr(text, "\"quantization_config\""); c; c = strstr(c + 1, "\"quantization_config\""))
        n_qc++;
    ASSERT_EQ_INT(1, n_qc);
    ASSERT_TRUE(strstr(text, "weight_block_size") == NULL && strstr(text, "compressed-tensors") != NULL);
    free(text);
    free(dir);
}

TEST_MAIN(T(test_e4m3_decode), T(test_scale_without_fp8_weight), T(test_load_blocks_128),
          T(test_load_blocks_48x80_bf16_scales), T(test_broken_sources), T(test_quantize_rtn),
          T(test_quantize_gptq), T(test_cli), T(test_writer_replaces_quantization_config))
