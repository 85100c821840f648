/*
 * The public quantization API (moeq_quant_options / moeq_quantize), through moeq.h only, on the
 * bundled models/olmoe-tiny: option defaults and validation (each bad option rejected naming its
 * field), RTN INT4 and NVFP4 checkpoints checked tensor by tensor against a slow obvious RTN
 * written here from the source BF16 weights, determinism, equality with `moeq quantize` for the
 * same options, the existing-output rule (refused without force, untouched, replaced with it),
 * an interrupt leaving nothing behind, and GPTQ on a small calibration text giving a loadable
 * checkpoint and a report.
 */
#include <dirent.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "harness.h"

#define N_LINEARS 112               /* 4 layers x (q, k, v, o + 8 experts x 3) */
#define N_WEIGHTS 7340032           /* 4 x (4 x 256 x 256 + 24 x 256 x 256) */

/* ---- small file helpers ---------------------------------------------------------------------- */

static char *path2(const char *dir, const char *name) {
    static char buf[4][1024];
    static int k;
    char *p = buf[k++ & 3];
    if (snprintf(p, sizeof buf[0], "%s/%s", dir, name) >= (int)sizeof buf[0]) FAIL("path too long");
    return p;
}

static int exists(const char *path) {
    struct stat s;
    return stat(path, &s) == 0;
}

/* Copies a path2() result out of its rotating buffer. */
static void keep(char dst[1024], const char *src) {
    size_t n = strlen(src);
    if (n >= 1024) n = 1023;
    memcpy(dst, src, n);
    dst[n] = 0;
}

/* Entries of dir whose name contains ".tmp" (a temporary output left behind). */
static int tmp_leftovers(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    if (!d) return 0;
    for (struct dirent *e; (e = readdir(d));) n += strstr(e->d_name, ".tmp") != NULL;
    closedir(d);
    return n;
}

/* ---- a minimal safetensors reader: header lookup by tensor name --------------------------- */
typedef struct {
    char *buf;
    size_t len;
    uint64_t hlen;
} st_file;

static int st_open(const char *path, st_file *f) {
    f->buf = mq_test_slurp(path, &f->len);
    if (!f->buf || f->len < 8) return 0;
    memcpy(&f->hlen, f->buf, 8);   /* little-endian host */
    return f->hlen + 8 <= f->len;
}

/* Data of tensor `name` if it has dtype `dtype`, else NULL. */
static const uint8_t *st_get(const st_file *f, const char *name, const char *dtype,
                             size_t *nbytes) {
    char key[256];
    snprintf(key, sizeof key, "\"%s\":{", name);
    const char *h = f->buf + 8, *p = strstr(h, key);
    if (!p || p >= h + f->hlen) return NULL;
    const char *dt = strstr(p, "\"dtype\":\""), *off = strstr(p, "\"data_offsets\":[");
    if (!dt || !off) return NULL;
    dt += strlen("\"dtype\":\"");
    if (strncmp(dt, dtype, strlen(dtype)) != 0 || dt[strlen(dtype)] != '"') return NULL;
    unsigned long long a, b;
    if (sscanf(off + strlen("\"data_offsets\":["), "%llu,%llu", &a, &b) != 2) return NULL;
    if (b < a || 8 + f->hlen + b > f->len) return NULL;
    *nbytes = (size_t)(b - a);
    return (const uint8_t *)f->buf + 8 + f->hlen + a;
}

static float bf16_at(const uint8_t *p, size_t i) {
    return mq_test_f32_from_bits((uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16);
}

/* fp32 -> bf16 -> fp32, round to nearest even (finite inputs). */
static float round_bf16(float x) {
    const uint32_t u = mq_test_f32_bits(x);
    return mq_test_f32_from_bits((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

/* The source weight of `module` as fp32 ([rows, cols]). */
static float *source_weight(const char *module, int64_t rows, int64_t cols) {
    st_file f;
    char name[256];
    snprintf(name, sizeof name, "%s.weight", module);
    size_t nb = 0;
    const uint8_t *p = NULL;
    if (st_open(mq_test_repo("models/olmoe-tiny/model.safetensors"), &f))
        p = st_get(&f, name, "BF16", &nb);
    float *w = NULL;
    if (p && nb == (size_t)(rows * cols * 2)) {
        w = malloc((size_t)(rows * cols) * sizeof *w);
        for (int64_t i = 0; w && i < rows * cols; i++) w[i] = bf16_at(p, (size_t)i);
    }
    free(f.buf);
    return w;
}

/* ---- reference quantizers (slow and obvious) ----------------------------------------------- */

/* INT4 symmetric, compressed-tensors defaults: scale = bf16(amax / 7.5) per group of 128,
 * q = round-half-even(w / scale) clamped to [-8, 7], stored as the unsigned code q + 8, eight per
 * int32 LSB first; scales stored as BF16. Returns the number of mismatches. */
/* signed: the default signed scales (amax / 8, negative where the group's largest magnitude is
 * positive), else the positive amax / 7.5 */
static int64_t check_int4(const st_file *f, const char *module, int64_t rows, int64_t cols, bool sgn) {
    const int64_t G = 128;
    float *w = source_weight(module, rows, cols);
    char name[256];
    size_t nq = 0, ns = 0;
    snprintf(name, sizeof name, "%s.weight_packed", module);
    const uint8_t *packed = st_get(f, name, "I32", &nq);
    snprintf(name, sizeof name, "%s.weight_scale", module);
    const uint8_t *scales = st_get(f, name, "BF16", &ns);
    if (!w || !packed || !scales || nq != (size_t)(rows * cols / 2) ||
        ns != (size_t)(rows * cols / G * 2)) {
        free(w);
        FAIL("%s: tensors missing or of the wrong size", module);
        return -1;
    }
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < cols / G; g++) {
            const float *x = w + r * cols + g * G;
            float amax = 0, hi = 0;
            for (int64_t j = 0; j < G; j++) {
                amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
                hi = x[j] > hi ? x[j] : hi;
            }
            float scale = amax > 0 ? round_bf16(amax / (sgn ? 8.0f : 7.5f)) : 0.0f;
            if (sgn && hi == amax && hi > 0) {   /* the largest magnitude is positive, or a tie */
                bool tie = false;
                for (int64_t j = 0; j < G; j++) tie |= x[j] == -amax;
                if (!tie) scale = -scale;
            }
            bad += bf16_at(scales, (size_t)(r * (cols / G) + g)) != scale;
            for (int64_t j = 0; j < G; j++) {
                double q = scale != 0 ? nearbyint((double)(x[j] / scale)) : 0;
                q = q < -8 ? -8 : q > 7 ? 7 : q;
                int64_t c = g * G + j, word = r * (cols / 8) + c / 8;
                const uint8_t *b = packed + 4 * word;
                uint32_t u = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                             (uint32_t)b[3] << 24;
                bad += ((u >> (4 * (c % 8))) & 15u) != (uint32_t)(q + 8);
            }
        }
    free(w);
    return bad;
}

static float e4m3_value(int code) {   /* positive float8_e4m3fn, codes 0..0x7E */
    int e = code >> 3, m = code & 7;
    return e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
}

/* Nearest E4M3 code to t >= 0, ties to the even code, saturating at 448. */
static int e4m3_nearest(float t) {
    int best = 0;
    for (int c = 1; c <= 0x7E; c++) {
        float d = fabsf(e4m3_value(c) - t), db = fabsf(e4m3_value(best) - t);
        if (d < db || (d == db && (c & 1) == 0)) best = c;
    }
    return best;
}

/* Nearest E2M1 code to x (sign from the sign bit), ties to the even index, saturating at 6. */
static int e2m1_nearest(float x) {
    static const float v[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    float a = fabsf(x);
    int best = 0;
    for (int i = 1; i < 8; i++) {
        float d = fabsf(v[i] - a), db = fabsf(v[best] - a);
        if (d < db || (d == db && (i & 1) == 0)) best = i;
    }
    return (signbit(x) ? 8 : 0) | best;
}

/* NVFP4 compressed-tensors of a Linear with its own global scale (down_proj): global scale
 * 2688 / amax(W) (a divisor), block scale e4m3(amax(block) / 6 * global), code e2m1(w / (block /
 * global)); two codes a byte, even column low. Returns the number of mismatches. */
static int64_t check_nvfp4(const st_file *f, const char *module, int64_t rows, int64_t cols) {
    float *w = source_weight(module, rows, cols);
    char name[256];
    size_t nq = 0, ns = 0, ng = 0;
    snprintf(name, sizeof name, "%s.weight_packed", module);
    const uint8_t *packed = st_get(f, name, "U8", &nq);
    snprintf(name, sizeof name, "%s.weight_scale", module);
    const uint8_t *scales = st_get(f, name, "F8_E4M3", &ns);
    snprintf(name, sizeof name, "%s.weight_global_scale", module);
    const uint8_t *gsp = st_get(f, name, "F32", &ng);
    if (!w || !packed || !scales || !gsp || nq != (size_t)(rows * cols / 2) ||
        ns != (size_t)(rows * cols / 16) || ng != 4) {
        free(w);
        FAIL("%s: tensors missing or of the wrong size", module);
        return -1;
    }
    float amax = 0, gs;
    for (int64_t i = 0; i < rows * cols; i++) amax = fabsf(w[i]) > amax ? fabsf(w[i]) : amax;
    memcpy(&gs, gsp, 4);
    int64_t bad = gs != 2688.0f / amax;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < cols / 16; b++) {
            const float *x = w + r * cols + b * 16;
            float bmax = 0;
            for (int j = 0; j < 16; j++) bmax = fabsf(x[j]) > bmax ? fabsf(x[j]) : bmax;
            int code = e4m3_nearest(gs * (bmax / 6.0f));
            if (code == 0 && bmax > 0) code = 1;
            bad += scales[r * (cols / 16) + b] != code;
            float step = e4m3_value(code) / gs;
            for (int j = 0; j < 16; j++) {
                int64_t c = b * 16 + j;
                uint8_t byte = packed[(r * cols + c) / 2];
                int got = c % 2 ? byte >> 4 : byte & 15;
                bad += got != (step > 0 ? e2m1_nearest(x[j] / step) : 0);
            }
        }
    free(w);
    return bad;
}

/* ---- helpers around the API ----------------------------------------------------------------- */

static int64_t g_progress_calls;
static int64_t g_interrupt_at;   /* > 0: interrupt when that many progress calls were seen */

static void on_progress(void *user, const char *label, int64_t done, int64_t total) {
    (void)user;
    (void)label;
    (void)done;
    (void)total;
    g_progress_calls++;
    if (g_interrupt_at > 0 && g_progress_calls == g_interrupt_at) moeq_interrupt();
}

static const char *model_dir(void) {
    static char dir[1024];
    if (snprintf(dir, sizeof dir, "%s", mq_test_repo("models/olmoe-tiny")) >= (int)sizeof dir)
        FAIL("path too long");
    return dir;
}

static int file_mentions(const char *path, const char *what) {
    size_t n;
    char *s = mq_test_slurp(path, &n);
    int yes = s && strstr(s, what) != NULL;
    free(s);
    return yes;
}

/* Runs `moeq quantize MODEL --out OUT ARGS --quiet` when the tests know the CLI ($MOEQ_CLI). */
static int run_cli(const char *out, const char *args) {
    const char *cli = getenv("MOEQ_CLI");
    if (!cli) return -1;
    char cmd[8192];
    if (snprintf(cmd, sizeof cmd, "'%s' quantize '%s' --out '%s' %s --quiet", cli, model_dir(), out,
                 args) >= (int)sizeof cmd)
        return -1;
    return system(cmd);
}

/* ---- cases -------------------------------------------------------------------------------- */

static void test_options_defaults(void) {
    moeq_quant_options o;
    memset(&o, 0x5a, sizeof o);
    moeq_quant_options_init(&o);
    ASSERT_EQ_INT(MOEQ_QUANT_SCHEME_UNSET, o.scheme);
    ASSERT_EQ_INT(MOEQ_QUANT_RTN, o.method);
    ASSERT_EQ_INT(MOEQ_FORMAT_COMPRESSED_TENSORS, o.format);
    ASSERT_EQ_INT(0, o.group_size);
    ASSERT_EQ_INT(0, o.asym + o.mse + o.no_fuse + o.reference + o.force + o.n_ignore);
    ASSERT_EQ_INT(MOEQ_INT4_SCALE_AUTO, o.int4_scale_sign);
    ASSERT_TRUE(o.ignore == NULL && o.calib == NULL && o.gptq.report == NULL);
    ASSERT_EQ_INT(65536, o.calib_tokens);
    ASSERT_EQ_INT(0, o.max_shard_bytes);
    ASSERT_EQ_INT(128, o.gptq.nsamples);
    ASSERT_EQ_INT(512, o.gptq.seqlen);
    ASSERT_EQ_INT(MOEQ_CALIB_CHUNKS, o.gptq.sampling);
    ASSERT_EQ_INT(0, o.gptq.seed);
    ASSERT_EQ_INT(0, o.gptq.calib_bos);
    ASSERT_NEAR(0.01, o.gptq.percdamp, 0);
    ASSERT_EQ_INT(128, o.gptq.block_size);
    ASSERT_EQ_INT(-1, o.gptq.act_order);
    ASSERT_EQ_INT(MOEQ_GPTQ_GROUPS_DYNAMIC, o.gptq.groups);
    ASSERT_EQ_INT(1, o.gptq.mse);
    ASSERT_EQ_INT(MOEQ_GPTQ_MSE_AUTO, o.gptq.mse_weight);
    ASSERT_EQ_INT(MOEQ_GPTQ_SEQUENTIAL, o.gptq.mode);
    ASSERT_EQ_INT(0, o.gptq.true_sequential);
    ASSERT_EQ_INT(32, o.gptq.min_expert_tokens);
    ASSERT_EQ_INT(MOEQ_EXPERT_FALLBACK_BLOCK, o.gptq.expert_fallback);
    ASSERT_EQ_INT(MOEQ_CALIB_BALANCE_NONE, o.gptq.calib_balance);
    ASSERT_EQ_INT(0, o.gptq.calib_pool);
}

/* Case i of the invalid settings: modifies o and returns the text the error must name. */
static const char *invalid_case(int i, moeq_quant_options *o, const char *calib) {
    static const char *bad_re[] = {"self_attn", "experts.("};
    o->scheme = MOEQ_QUANT_INT4;
    switch (i) {
    case 0: o->scheme = MOEQ_QUANT_SCHEME_UNSET; return "scheme";
    case 1: o->scheme = (moeq_quant_scheme)7; return "scheme";
    case 2: o->method = (moeq_quant_method)5; return "method";
    case 3: o->format = (moeq_ckpt_format)4; return "format";   /* past MOEQ_FORMAT_GGUF */
    case 4: o->scheme = MOEQ_QUANT_NVFP4A16; o->format = MOEQ_FORMAT_GPTQ; return "format";
    case 5: o->format = MOEQ_FORMAT_MODELOPT; return "format";
    case 6: o->scheme = MOEQ_QUANT_NVFP4A16; o->group_size = 32; return "group_size";
    case 7: o->group_size = -2; return "group_size";
    case 8: o->scheme = MOEQ_QUANT_NVFP4A16; o->asym = 1; return "asym";
    case 9: o->method = MOEQ_QUANT_GPTQ; return "calib";
    case 10: o->scheme = MOEQ_QUANT_NVFP4; return "calib";
    case 11: o->calib = calib; return "calib";   /* RTN weight-only does not use it */
    case 12: o->calib_tokens = 0; return "calib_tokens";
    case 13: o->max_shard_bytes = -1; return "max_shard_bytes";
    case 14: o->n_ignore = 1; return "ignore";
    case 15: o->ignore = bad_re; o->n_ignore = 2; return "experts.(";
    default: break;
    }
    o->method = MOEQ_QUANT_GPTQ;
    o->calib = calib;
    switch (i) {
    case 16: o->gptq.nsamples = 0; return "gptq.nsamples";
    case 17: o->gptq.seqlen = 1; return "gptq.seqlen";
    case 18: o->gptq.percdamp = -0.5; return "gptq.percdamp";
    case 19: o->gptq.percdamp = NAN; return "gptq.percdamp";
    case 20: o->gptq.block_size = 0; return "gptq.block_size";
    case 21: o->gptq.act_order = 2; return "gptq.act_order";
    case 22: o->gptq.sampling = (moeq_calib_sampling)3; return "gptq.sampling";
    case 23: o->gptq.groups = (moeq_gptq_groups)4; return "gptq.groups";
    case 24: o->gptq.mode = (moeq_gptq_mode)2; return "gptq.mode";
    case 25: o->gptq.expert_fallback = (moeq_expert_fallback)2; return "gptq.expert_fallback";
    case 26: o->gptq.min_expert_tokens = -1; return "gptq.min_expert_tokens";
    case 27:
        o->gptq.mode = MOEQ_GPTQ_NONSEQUENTIAL;
        o->gptq.true_sequential = 1;
        return "gptq.true_sequential";
    case 28: o->gptq.groups = MOEQ_GPTQ_GROUPS_GIDX; o->gptq.act_order = 0; return "gptq.act_order";
    case 29:
        o->scheme = MOEQ_QUANT_NVFP4A16;   /* act_order on, but g_idx is INT4-only */
        o->gptq.groups = MOEQ_GPTQ_GROUPS_GIDX;
        o->gptq.act_order = 1;
        return "INT4";
    case 30: o->gptq.mse_weight = (moeq_gptq_mse_weight)4; return "gptq.mse_weight";
    case 31: o->gptq.mse_weight = (moeq_gptq_mse_weight)-2; return "gptq.mse_weight";
    case 32: o->gpu_precision = MOEQ_GPU_TF32; return "gpu_precision";   /* a GPU's mode, without a device */
    case 33: o->gpu_precision = MOEQ_GPU_TF32X3; return "gpu_precision";
    case 34: o->gpu_precision = (moeq_gpu_precision)3; return "gpu_precision";
    case 35: o->gptq.target_unquantized = 1.5; return "gptq.target_unquantized";
    case 36: o->gptq.target_unquantized = NAN; return "gptq.target_unquantized";
    case 37: o->gptq.target_unquantized = 0.5; o->gptq.mode = MOEQ_GPTQ_NONSEQUENTIAL; return "gptq.target_unquantized";
    case 38: o->gptq.target_unquantized = 0.5; o->gptq.true_sequential = 1; return "gptq.target_unquantized";
    case 39: o->gptq.target_unquantized = 0.5; o->device = "cuda"; return "gptq.target_unquantized";
    case 40:
        o->gptq.target_unquantized = 0.5;
        o->gptq.expert_weighting = MOEQ_EXPERT_WEIGHT_GATE;
        return "gptq.target_unquantized";
    case 41: o->int4_scale_sign = (moeq_int4_scale_sign)3; return "int4_scale_sign";
    case 42: o->int4_scale_sign = MOEQ_INT4_SCALE_SIGNED; o->asym = 1; return "int4_scale_sign";
    case 43: o->int4_scale_sign = MOEQ_INT4_SCALE_POSITIVE; o->scheme = MOEQ_QUANT_NVFP4A16; return "int4_scale_sign";
    case 44: o->int4_scale_sign = MOEQ_INT4_SCALE_SIGNED; o->reference = 1; return "int4_scale_sign";
    case 45: o->gptq.calib_balance = (moeq_calib_balance)2; return "gptq.calib_balance";
    case 46: o->gptq.calib_balance = MOEQ_CALIB_BALANCE_EXPERTS; o->gptq.calib_pool = -1; return "gptq.calib_pool";
    case 47:   /* fewer candidates than samples */
        o->gptq.calib_balance = MOEQ_CALIB_BALANCE_EXPERTS;
        o->gptq.calib_pool = o->gptq.nsamples - 1;
        return "gptq.calib_pool";
    case 48: o->gptq.calib_pool = 512; return "gptq.calib_balance";   /* a pool, nothing to choose it for */
    default: return NULL;
    }
}

static void test_invalid_options(void) {
    const char *tmp = mq_test_tmpdir();
    const char *out = path2(tmp, "out");
    const char *calib = path2(tmp, "calib.txt");
    FILE *f = fopen(calib, "w");
    ASSERT_TRUE(f != NULL);
    if (!f) return;
    fputs("Some calibration text.\n", f);
    fclose(f);
    moeq_quant_options o;
    const char *field;
    for (int i = 0; (moeq_quant_options_init(&o), field = invalid_case(i, &o, calib)); i++) {
        moeq_status st = moeq_quantize(model_dir(), out, &o, NULL);
        if (st != MOEQ_E_ARG) FAIL("case %d (%s): expected MOEQ_E_ARG, got %s (%s)", i, field,
                                   moeq_status_name(st), moeq_last_error());
        if (!strstr(moeq_last_error(), field))
            FAIL("case %d: \"%s\" does not name %s", i, moeq_last_error(), field);
        ASSERT_FALSE(exists(out));
    }
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_INT4;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_quantize(model_dir(), out, NULL, NULL));
    ASSERT_ERROR_MENTIONS("opts");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_quantize(model_dir(), NULL, &o, NULL));
    ASSERT_ERROR_MENTIONS("out_dir");
    /* the output may not be the model itself */
    ASSERT_STATUS(MOEQ_E_ARG, moeq_quantize(model_dir(), model_dir(), &o, NULL));
    ASSERT_ERROR_MENTIONS("model directory");
    ASSERT_EQ_INT(0, tmp_leftovers(tmp));
}

static void test_rtn_int4(void) {
    const char *tmp = mq_test_tmpdir();
    char out[1024], again[1024], cli[1024];
    keep(out, path2(tmp, "int4"));
    keep(again, path2(tmp, "int4-again"));
    keep(cli, path2(tmp, "int4-cli"));
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_INT4;
    moeq_quant_result r;
    g_progress_calls = 0;
    moeq_set_progress(on_progress, NULL);
    ASSERT_OK(moeq_quantize(model_dir(), out, &o, &r));
    moeq_set_progress(NULL, NULL);
    ASSERT_TRUE(g_progress_calls > 0);
    ASSERT_EQ_INT(N_LINEARS, r.linears_quantized);
    ASSERT_EQ_INT(4, r.linears_kept);   /* the routers */
    ASSERT_EQ_INT(N_WEIGHTS, r.weights_quantized);
    ASSERT_TRUE(r.tensors_written > 0 && r.bytes_written > 0 && r.seconds >= 0);
    ASSERT_EQ_INT(0, r.gptq_linears);
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"quantization_config\""));
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"pack-quantized\""));

    st_file f;
    ASSERT_TRUE(st_open(path2(out, "model.safetensors"), &f));
    ASSERT_EQ_INT(0, check_int4(&f, "model.layers.1.mlp.experts.5.down_proj", 256, 256, true));
    ASSERT_EQ_INT(0, check_int4(&f, "model.layers.2.self_attn.k_proj", 256, 256, true));
    free(f.buf);
    /* the positive scales on request: other bytes, through the API and the CLI alike */
    char pos[1024], pos_cli[1024];
    keep(pos, path2(tmp, "int4-positive"));
    keep(pos_cli, path2(tmp, "int4-positive-cli"));
    o.int4_scale_sign = MOEQ_INT4_SCALE_POSITIVE;
    ASSERT_OK(moeq_quantize(model_dir(), pos, &o, NULL));
    o.int4_scale_sign = MOEQ_INT4_SCALE_AUTO;
    ASSERT_TRUE(st_open(path2(pos, "model.safetensors"), &f));
    ASSERT_EQ_INT(0, check_int4(&f, "model.layers.1.mlp.experts.5.down_proj", 256, 256, false));
    ASSERT_EQ_INT(0, check_int4(&f, "model.layers.2.self_attn.k_proj", 256, 256, false));
    free(f.buf);
    ASSERT_FALSE(mq_test_same_file(path2(out, "model.safetensors"), path2(pos, "model.safetensors")));
    int prc = run_cli(pos_cli, "--scheme int4 --int4-scale-sign positive");
    if (prc >= 0) {
        ASSERT_EQ_INT(0, prc);
        ASSERT_TRUE(mq_test_same_file(path2(pos, "model.safetensors"), path2(pos_cli, "model.safetensors")));
    }

    /* the checkpoint loads; same options give the same bytes, through the API and the CLI */
    moeq_model *m = mq_test_open_model(out, NULL);
    if (m) ASSERT_EQ_STR("compressed-tensors/pack-quantized", moeq_model_get_info(m)->quant_scheme);
    moeq_model_free(m);
    ASSERT_OK(moeq_quantize(model_dir(), again, &o, NULL));
    ASSERT_TRUE(mq_test_same_file(path2(out, "model.safetensors"), path2(again, "model.safetensors")));
    ASSERT_TRUE(mq_test_same_file(path2(out, "config.json"), path2(again, "config.json")));
    int rc = run_cli(cli, "--scheme int4");
    if (rc >= 0) {
        ASSERT_EQ_INT(0, rc);
        ASSERT_TRUE(mq_test_same_file(path2(out, "model.safetensors"), path2(cli, "model.safetensors")));
        ASSERT_TRUE(mq_test_same_file(path2(out, "config.json"), path2(cli, "config.json")));
    }

    /* an existing output: refused and left alone without force, replaced with it */
    o.scheme = MOEQ_QUANT_NVFP4A16;
    ASSERT_STATUS(MOEQ_E_EXISTS, moeq_quantize(model_dir(), out, &o, &r));
    ASSERT_ERROR_MENTIONS(out);
    ASSERT_ERROR_MENTIONS("already exists");
    ASSERT_EQ_INT(0, r.linears_quantized);
    ASSERT_TRUE(mq_test_same_file(path2(out, "model.safetensors"), path2(again, "model.safetensors")));
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"pack-quantized\""));
    o.force = 1;
    ASSERT_OK(moeq_quantize(model_dir(), out, &o, NULL));
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"nvfp4-pack-quantized\""));
    ASSERT_EQ_INT(0, tmp_leftovers(tmp));
}

static void test_rtn_nvfp4a16(void) {
    const char *tmp = mq_test_tmpdir();
    char out[1024], cli[1024];
    keep(out, path2(tmp, "nv"));
    keep(cli, path2(tmp, "nv-cli"));
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_NVFP4A16;
    const char *ignore[] = {"layers\\.3\\.self_attn"};
    o.ignore = ignore;
    o.n_ignore = 1;
    moeq_quant_result r;
    ASSERT_OK(moeq_quantize(model_dir(), out, &o, &r));
    ASSERT_EQ_INT(N_LINEARS - 4, r.linears_quantized);
    ASSERT_EQ_INT(4 + 4, r.linears_kept);
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"quantization_config\""));
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"model.layers.3.self_attn.o_proj\""));
    st_file f;
    ASSERT_TRUE(st_open(path2(out, "model.safetensors"), &f));
    ASSERT_EQ_INT(0, check_nvfp4(&f, "model.layers.0.mlp.experts.3.down_proj", 256, 256));
    ASSERT_EQ_INT(0, check_nvfp4(&f, "model.layers.2.self_attn.o_proj", 256, 256));
    size_t nb = 0;
    ASSERT_TRUE(st_get(&f, "model.layers.3.self_attn.q_proj.weight", "BF16", &nb) != NULL);
    free(f.buf);
    moeq_model *m = mq_test_open_model(out, NULL);
    if (m)
        ASSERT_EQ_STR("compressed-tensors/nvfp4-pack-quantized",
                      moeq_model_get_info(m)->quant_scheme);
    moeq_model_free(m);
    int rc = run_cli(cli, "--scheme nvfp4a16 --ignore 'layers\\.3\\.self_attn'");
    if (rc >= 0) {
        ASSERT_EQ_INT(0, rc);
        ASSERT_TRUE(mq_test_same_file(path2(out, "model.safetensors"), path2(cli, "model.safetensors")));
        ASSERT_TRUE(mq_test_same_file(path2(out, "config.json"), path2(cli, "config.json")));
    }
}

static void test_interrupt_leaves_nothing(void) {
    const char *tmp = mq_test_tmpdir();
    const char *out = path2(tmp, "cut");
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_INT4;
    g_progress_calls = 0;
    g_interrupt_at = 3;   /* in the middle of writing */
    moeq_set_progress(on_progress, NULL);
    moeq_status st = moeq_quantize(model_dir(), out, &o, NULL);
    moeq_set_progress(NULL, NULL);
    g_interrupt_at = 0;
    moeq_clear_interrupt();
    ASSERT_STATUS(MOEQ_E_INTERRUPTED, st);
    ASSERT_FALSE(exists(out));
    ASSERT_EQ_INT(0, tmp_leftovers(tmp));
}

static void test_gptq_small(void) {
    const char *tmp = mq_test_tmpdir();
    char out[1024], calib[1024], report[1024];
    keep(out, path2(tmp, "gptq"));
    keep(calib, path2(tmp, "calib.txt"));
    keep(report, path2(tmp, "report.json"));
    FILE *f = fopen(calib, "w");
    ASSERT_TRUE(f != NULL);
    if (!f) return;
    for (int i = 0; i < 8; i++)
        fprintf(f, "Paragraph %d. The quick brown fox jumps over the lazy dog, and the clocks "
                   "were striking thirteen on a bright cold day in April while rivers ran to the "
                   "sea.\n", i);
    fclose(f);
    moeq_quant_options o = mq_test_gptq_options(MOEQ_QUANT_INT4, calib, 4, 24);
    o.gptq.expert_fallback = MOEQ_EXPERT_FALLBACK_RTN;
    o.gptq.min_expert_tokens = 8;
    moeq_quant_result r;
    ASSERT_OK(moeq_quantize(model_dir(), out, &o, &r));
    ASSERT_EQ_INT(4, r.gptq_samples);
    ASSERT_EQ_INT(4 * 24, r.gptq_tokens);
    ASSERT_EQ_INT(N_LINEARS, r.gptq_linears);
    ASSERT_EQ_INT(N_LINEARS, r.linears_quantized);
    ASSERT_TRUE(r.gptq_loss > 0 && r.gptq_loss <= r.gptq_rtn_loss);
    ASSERT_TRUE(exists(path2(out, "gptq_report.json")));
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"quantization_config\""));
    ASSERT_TRUE(file_mentions(path2(out, "config.json"), "\"actorder\""));
    /* the default scale search scores by GPTQ over the group (plain with one group per row) */
    ASSERT_TRUE(file_mentions(path2(out, "gptq_report.json"), "\"mse_weight\":\t\"gptq\""));

    /* loadable, and it runs */
    moeq_model *m = mq_test_open_model(out, NULL);
    if (!m) return;
    ASSERT_EQ_STR("compressed-tensors/pack-quantized", moeq_model_get_info(m)->quant_scheme);
    moeq_session *s = NULL;
    ASSERT_OK(moeq_session_create(m, 8, &s));
    int32_t ids[4] = {5, 17, 300, 42};
    int32_t vocab = moeq_model_get_info(m)->vocab_size;
    float *logits = malloc(sizeof(float) * 4 * (size_t)vocab);
    if (s && logits) {
        ASSERT_OK(moeq_session_forward(s, ids, 4, logits));
        int finite = 1;
        for (int64_t i = 0; i < 4 * (int64_t)vocab; i++) finite &= isfinite(logits[i]) != 0;
        ASSERT_TRUE(finite);
    }
    free(logits);
    moeq_session_free(s);
    moeq_model_free(m);

    /* an explicit report path, and refusal to overwrite without force before any GPTQ work */
    o.gptq.report = report;
    ASSERT_STATUS(MOEQ_E_EXISTS, moeq_quantize(model_dir(), out, &o, &r));
    ASSERT_ERROR_MENTIONS("already exists");
    ASSERT_FALSE(exists(report));
    o.force = 1;
    ASSERT_OK(moeq_quantize(model_dir(), out, &o, &r));
    ASSERT_TRUE(file_mentions(report, "\"modules\""));
    o.group_size = -1;
    ASSERT_OK(moeq_quantize(model_dir(), out, &o, &r));
    ASSERT_TRUE(file_mentions(report, "\"mse_weight\":\t\"plain\""));
    o.gptq.mse_weight = MOEQ_GPTQ_MSE_GPTQ;   /* asked for: kept */
    ASSERT_OK(moeq_quantize(model_dir(), out, &o, &r));
    ASSERT_TRUE(file_mentions(report, "\"mse_weight\":\t\"gptq\""));
}

/* Progress of a GPTQ run reaches its total exactly, never going back, on a model whose dense
 * layer's MLP and MoE layers' shared expert differ in size (DeepSeek-V3's layout: the dense
 * layer's units were counted at the shared expert's size, so a run ended short of its total and
 * the ETA was about 10x too long on full-size DeepSeek-V3 shapes). */
typedef struct {
    int64_t last, total, calls, backwards;
} progress_seen;

static void on_progress_seen(void *user, const char *label, int64_t done, int64_t total) {
    progress_seen *p = user;
    if (strcmp(label, "quantize") != 0) return;
    if (done < p->last) p->backwards++;
    p->last = done;
    p->total = total;
    p->calls++;
}

static void test_progress_reaches_total(void) {
    const char *tmp = mq_test_tmpdir();
    char out[1024];
    keep(out, path2(tmp, "progress"));
    moeq_quant_options o = mq_test_gptq_options(MOEQ_QUANT_INT4, mq_test_calib_text(), 4, 16);
    o.gptq.expert_fallback = MOEQ_EXPERT_FALLBACK_RTN;
    o.group_size = 16;   /* the fixture's widths (80, 32) take groups of 16 */
    progress_seen seen = {0, 0, 0, 0};
    moeq_set_progress(on_progress_seen, &seen);
    moeq_status st = moeq_quantize(mq_test_with_tokenizer("deepseekv3-tiny"), out, &o, NULL);
    moeq_set_progress(NULL, NULL);
    ASSERT_OK(st);
    ASSERT_TRUE(seen.calls > 3);
    ASSERT_EQ_INT(0, seen.backwards);
    ASSERT_TRUE(seen.total > 0);
    ASSERT_EQ_INT(seen.total, seen.last);
}

TEST_MAIN(T(test_progress_reaches_total), T(test_options_defaults), T(test_invalid_options), T(test_rtn_int4), T(test_rtn_nvfp4a16),
          T(test_interrupt_leaves_nothing), T(test_gptq_small))
