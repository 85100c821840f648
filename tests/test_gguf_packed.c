/* A .gguf run in place with keep_packed (kernels/ggml_mat.h, model/load_gguf.c):
 *  - a mapped row decodes to exactly io's decoder's values (mq_ggml_dequantize) for F32, F16,
 *    BF16, Q8_0, Q4_0, Q4_1, NVFP4 (times a scale), Q5_0, Q5_1, Q3_K, Q4_K, Q5_K and Q6_K, llama's
 *    rotated q/k rows through the row map;
 *  - the Q8_0 and BF16 row dots: the AVX2 twin equals the scalar reference bit for bit, and the
 *    reference is within the summation bound of a double-precision dot;
 *  - olmoe, qwen2moe (shared expert), qwen3moe and llama (dense, rotated q/k) files of every type the
 *    runtime reads in place (Q4_0, NVFP4: repacked for the packed kernels; Q4_1, Q8_0, F16, BF16:
 *    read from the mapping) give the logits of the same file decoded to fp32 within a derived
 *    tolerance, without fp32 copies (resident weight bytes at most the file's share). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export/gguf_export.h"
#include "harness.h"
#include "io/gguf.h"
#include "kernels/ggml_mat.h"
#include "model/model.h"
#include "pipeline/pipeline.h"

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint32_t fbits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* A finite f16 of moderate size (|v| in about 2^-8 .. 2^2), either sign. */
static uint16_t rand_f16(uint64_t *s) {
    uint16_t e = (uint16_t)(7 + rng_next(s) % 10), m = (uint16_t)(rng_next(s) & 0x3FF);
    return (uint16_t)((rng_next(s) & 1) << 15 | e << 10 | m);
}

/* rows x cols values of type in random blocks (valid everywhere: no NaN scales). */
static uint8_t *rand_blocks(uint32_t type, int64_t rows, int64_t cols, uint64_t *s, size_t *n) {
    int64_t b;
    size_t bb;
    ASSERT_TRUE(mq_ggml_mat_type_ok(type, &b, &bb));
    const size_t nb = (size_t)(rows * cols / b);
    uint8_t *p = malloc(nb * bb);
    for (size_t i = 0; i < nb * bb; i++) p[i] = (uint8_t)rng_next(s);
    for (size_t i = 0; i < nb; i++) {
        uint8_t *q = p + i * bb;
        uint16_t h = rand_f16(s);
        switch (type) {
        case MQ_GM_F32: {
            float f = (float)((int64_t)(rng_next(s) % 2001) - 1000) / 256.0f;
            memcpy(q, &f, 4);
            break;
        }
        case MQ_GM_F16: memcpy(q, &h, 2); break;
        case MQ_GM_BF16: q[1] = (uint8_t)(0x3C + rng_next(s) % 8) | (uint8_t)(rng_next(s) & 0x80); break;
        case MQ_GM_Q4_1: {
            uint16_t m = rand_f16(s);
            memcpy(q + 2, &m, 2);
        } /* fall through */
        case MQ_GM_Q8_0:
        case MQ_GM_Q4_0: memcpy(q, &h, 2); break;
        case MQ_GM_NVFP4:
            for (int k = 0; k < 4; k++) q[k] = (uint8_t)(rng_next(s) % 0x7F);
            break;
        case MQ_GM_Q5_1:
        case MQ_GM_Q4_K:
        case MQ_GM_Q5_K: {   /* d and dmin (Q5_1: d and m) */
            uint16_t m = rand_f16(s);
            memcpy(q + 2, &m, 2);
        } /* fall through */
        case MQ_GM_Q5_0: memcpy(q, &h, 2); break;
        case MQ_GM_Q3_K: memcpy(q + 108, &h, 2); break;
        case MQ_GM_Q6_K: memcpy(q + 208, &h, 2); break;
        }
    }
    *n = nb * bb;
    return p;
}

static void test_rows_equal_io_decoder(void) {
    static const uint32_t types[] = {MQ_GM_F32, MQ_GM_F16, MQ_GM_BF16, MQ_GM_Q8_0, MQ_GM_Q4_0,
                                     MQ_GM_Q4_1, MQ_GM_NVFP4, MQ_GM_Q5_0, MQ_GM_Q5_1, MQ_GM_Q3_K,
                                     MQ_GM_Q4_K, MQ_GM_Q5_K, MQ_GM_Q6_K};
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (int perm = 0; perm < 2; perm++) {
            const int64_t rows = 16, cols = types[ti] >= MQ_GM_Q3_K && types[ti] <= MQ_GM_Q6_K ? 512 : 128,
                          hd = 8;
            size_t n;
            uint8_t *p = rand_blocks(types[ti], rows, cols, &s, &n);
            float *all = malloc(sizeof(float) * rows * cols), *row = malloc(sizeof(float) * cols);
            ASSERT_OK(mq_ggml_dequantize(types[ti], p, rows * cols, all));
            const float scale = types[ti] == MQ_GM_NVFP4 ? 0.375f : 1.0f;
            mq_ggml_mat m;
            ASSERT_OK(mq_ggml_mat_init(&m, p, types[ti], rows, cols, scale, perm ? (int32_t)hd : 0, "t"));
            ASSERT_EQ_INT(n, mq_ggml_mat_bytes(&m));
            for (int64_t r = 0; r < rows; r++) {
                mq_ggml_mat_row(&m, r, row);
                /* HF row h*hd + j*hd/2 + i is stored row h*hd + 2i + j */
                const int64_t h = r / hd, k = r % hd, i = k % (hd / 2), j = k / (hd / 2);
                const int64_t sr = perm ? h * hd + 2 * i + j : r;
                for (int64_t c = 0; c < cols; c++) {
                    float want = all[sr * cols + c] * scale;
                    if (fbits(want) != fbits(row[c])) {
                        FAIL("type %u perm %d: row %lld col %lld: %.9g, expected %.9g", types[ti],
                             perm, (long long)r, (long long)c, (double)row[c], (double)want);
                        r = rows;
                        break;
                    }
                }
            }
            free(p), free(all), free(row);
        }
}

/* |ref - exact| <= gamma_n * sum|w x| (n products and sums in fp32, u = 2^-24), and the AVX2 twin
 * equal to the reference bit for bit. */
static void test_dot_twins(void) {
    uint64_t s = 42;
    const mq_ggml_dot_kernels *r = &mq_ggml_dot_ref;
    for (int it = 0; it < 40; it++) {
        const int64_t n = 32 * (1 + (int64_t)(rng_next(&s) % 40));
        for (int bf = 0; bf < 2; bf++) {
            size_t nbytes;
            uint8_t *p = rand_blocks(bf ? MQ_GM_BF16 : MQ_GM_Q8_0, 1, n, &s, &nbytes);
            float *x = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * n);
            for (int64_t i = 0; i < n; i++) x[i] = (float)((int64_t)(rng_next(&s) % 20001) - 10000) / 3000.0f;
            ASSERT_OK(mq_ggml_dequantize(bf ? MQ_GM_BF16 : MQ_GM_Q8_0, p, n, w));
            double exact = 0, mag = 0;
            for (int64_t i = 0; i < n; i++) exact += (double)w[i] * x[i], mag += fabs((double)w[i] * x[i]);
            const float got = bf ? r->bf16(p, x, n) : r->q8_0(p, x, n / 32);
            const double u = ldexp(1, -24), gamma = (double)(n + 1) * u / (1 - (double)(n + 1) * u);
            if (!(fabs(got - exact) <= gamma * mag))
                FAIL("%s n=%lld: %.9g against %.17g (bound %.3g)", bf ? "bf16" : "q8_0", (long long)n,
                     (double)got, exact, gamma * mag);
#ifdef MQ_TEST_X86
            if (mq_cpu_has_avx2_fma()) {
                const float a = bf ? mq_ggml_dot_avx2.bf16(p, x, n) : mq_ggml_dot_avx2.q8_0(p, x, n / 32);
                if (fbits(a) != fbits(got)) FAIL("avx2 %.9g, reference %.9g", (double)a, (double)got);
            }
#endif
            free(p), free(x), free(w);
        }
    }
}

/* bf16_rows, in every twin, gives each (row, token) pair the bits of the reference's single dot
 * product: widths with every tail (8, 16, 24 past a multiple of 32), row and token counts that
 * leave partial tiles, x rows with a stride, y with a leading dimension; a slot outside the pairs
 * stays untouched. */
static void test_dot_bf16_rows_twins(void) {
    uint64_t s = 99;
    const mq_ggml_dot_kernels *tw[3] = {&mq_ggml_dot_ref, NULL, NULL};
    const char *names[3] = {"ref", "avx2", "avx512"};
#if MQ_TEST_X86
    if (mq_cpu_has_avx2_fma()) tw[1] = &mq_ggml_dot_avx2;
    if (mq_cpu_has_avx512()) tw[2] = &mq_ggml_dot_avx512;
#endif
    for (int it = 0; it < 60; it++) {
        const int64_t n = 8 * (1 + (int64_t)(rng_next(&s) % 40)), nr = 1 + (int64_t)(rng_next(&s) % MQ_GM_BF16_ROWS);
        const int64_t T = 1 + (int64_t)(rng_next(&s) % 11), ldx = n + 8 * (int64_t)(rng_next(&s) % 3);
        const int64_t ldy = nr + (int64_t)(rng_next(&s) % 5);
        size_t nbytes;
        uint8_t *p = rand_blocks(MQ_GM_BF16, nr, n, &s, &nbytes);
        float *x = malloc(sizeof(float) * (size_t)(T * ldx)), *y = malloc(sizeof(float) * (size_t)(T * ldy));
        for (int64_t i = 0; i < T * ldx; i++) x[i] = (float)((int64_t)(rng_next(&s) % 20001) - 10000) / 3000.0f;
        const uint8_t *rows[MQ_GM_BF16_ROWS];
        for (int64_t r = 0; r < nr; r++) rows[r] = p + (size_t)(r * n * 2);
        for (int k = 0; k < 3; k++) {
            if (!tw[k]) continue;
            for (int64_t i = 0; i < T * ldy; i++) y[i] = -7.0f;
            tw[k]->bf16_rows(rows, nr, x, ldx, T, n, y, ldy);
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = 0; c < ldy; c++) {
                    const float want = c < nr ? mq_ggml_dot_ref.bf16(rows[c], x + t * ldx, n) : -7.0f;
                    if (fbits(y[t * ldy + c]) != fbits(want))
                        FAIL("%s n=%lld rows=%lld T=%lld: pair (%lld, %lld) %.9g, reference %.9g", names[k],
                             (long long)n, (long long)nr, (long long)T, (long long)c, (long long)t,
                             (double)y[t * ldy + c], (double)want);
                }
        }
        free(p), free(x), free(y);
    }
}

/* Experts repacked from GGUF blocks (Q4_0, NVFP4 with a per-matrix multiplier) are byte for byte
 * what the op's own packing makes of the same codes and scales, unpacked here by ggml's layout. */
static void unpack_ref(uint32_t type, const uint8_t *p, int64_t rows, int64_t cols, uint8_t *codes,
                       float *fsc, uint8_t *bsc) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = r * cols + c;
            if (type == MQ_GM_Q4_0) {   /* {f16 d; qs[16]}: value j low nibble of qs[j], j+16 high */
                const uint8_t *b = p + (i / 32) * 18;
                const int j = (int)(i % 32);
                codes[i] = j < 16 ? b[2 + j] & 0xF : b[2 + j - 16] >> 4;
                if (j == 0) fsc[i / 32] = mq_f16_to_f32((uint16_t)(b[0] | b[1] << 8));
            } else {   /* {d[4]; qs[32]}: sub-block k, value j low of qs[8k + j], j+8 high */
                const uint8_t *b = p + (i / 64) * 36;
                const int j = (int)(i % 64), k = j / 16, jj = j % 16;
                codes[i] = jj < 8 ? b[4 + 8 * k + jj] & 0xF : b[4 + 8 * k + jj - 8] >> 4;
                if (jj == 0) bsc[i / 16] = b[k];
            }
        }
}

static void test_experts_repack_equals_op_packing(void) {
    uint64_t s = 7;
    for (int nv = 0; nv < 2; nv++) {
        const uint32_t type = nv ? MQ_GM_NVFP4 : MQ_GM_Q4_0;
        const int32_t E = 3, D = 128, F = 64, n = E + 1, group = nv ? 16 : 32;
        mq_ggml_expert gx[4];
        mq_moe_expert_src src[4];
        uint8_t *bufs[4][3], *codes[4][3], *bsc[4][3];
        float *fsc[4][3];
        for (int e = 0; e < n; e++) {
            const int64_t ffn = e < E ? F : 2 * F;   /* the shared expert wider */
            mq_ggml_mat *mm[3] = {&gx[e].gate, &gx[e].up, &gx[e].down};
            mq_moe_src *ms[3] = {&src[e].gate, &src[e].up, &src[e].down};
            src[e].ffn = (int32_t)ffn;
            for (int k = 0; k < 3; k++) {
                const int64_t rows = k < 2 ? ffn : D, cols = k < 2 ? D : ffn;
                size_t nb;
                bufs[e][k] = rand_blocks(type, rows, cols, &s, &nb);
                const float g = nv ? 0.25f * (float)(1 + e + k) : 1.0f;
                ASSERT_OK(mq_ggml_mat_init(mm[k], bufs[e][k], type, rows, cols, g, 0, "x"));
                codes[e][k] = malloc((size_t)(rows * cols));
                fsc[e][k] = malloc(sizeof(float) * (size_t)(rows * cols / 16));
                bsc[e][k] = malloc((size_t)(rows * cols / 16));
                unpack_ref(type, bufs[e][k], rows, cols, codes[e][k], fsc[e][k], bsc[e][k]);
                *ms[k] = (mq_moe_src){codes[e][k], nv ? bsc[e][k] : (const uint8_t *)fsc[e][k],
                                      nv ? 1 : 4, g, 1};
            }
        }
        moeq_moe_experts *got = NULL, *want = NULL;
        mq_moe_names names = {"test", "gate", "up", "down", 0};
        ASSERT_OK(mq_moe_experts_from_ggml(gx, E, 1, "test", &got));
        ASSERT_OK(mq_moe_experts_build(nv, group, E, D, src, 1, &names, &want));
        if (got && want) {
            ASSERT_EQ_INT(want->blob_bytes, got->blob_bytes);
            ASSERT_EQ_INT(want->Fs, got->Fs);
            for (int e = 0; e < n; e++) {
                const mq_pmat *a[2] = {&want->ex[e].gate_up, &want->ex[e].down},
                              *b[2] = {&got->ex[e].gate_up, &got->ex[e].down};
                for (int k = 0; k < 2; k++) {
                    ASSERT_EQ_INT(a[k]->data - want->blob, b[k]->data - got->blob);
                    ASSERT_EQ_INT(a[k]->rb_bytes, b[k]->rb_bytes);
                    ASSERT_EQ_INT(a[k]->stype, b[k]->stype);
                    ASSERT_EQ_INT(a[k]->neg_scales, b[k]->neg_scales);
                    for (int h = 0; h < 2; h++)
                        ASSERT_TRUE(a[k]->mul[h] == b[k]->mul[h] && a[k]->div[h] == b[k]->div[h]);
                }
            }
            if (want->blob_bytes == got->blob_bytes)
                ASSERT_TRUE(memcmp(want->blob, got->blob, want->blob_bytes) == 0);
        }
        moeq_moe_experts_free(got);
        moeq_moe_experts_free(want);
        for (int e = 0; e < n; e++)
            for (int k = 0; k < 3; k++) free(bufs[e][k]), free(codes[e][k]), free(fsc[e][k]), free(bsc[e][k]);
    }
}

/* Q4_1 and Q4_K Linears repacked as symmetric INT4 plus per-block offsets (packed_weight_from_ggml)
 * against a double-precision product with io's decoded values, for several token counts and
 * row counts that are no multiple of 16.
 *
 * Bound. The kernels use x rounded per block of 32 to v = rne(x * 32512 / amax) (moe_ffn.h):
 * |x - x^| <= amax / 65024 per value, so the symmetric part is off by at most
 * sum_blocks amax_b / 65024 * sum_(i in b) |s_b (q_i - 8)|. The rest is fp32 rounding: the block
 * products are exact integers, the scaled sums, the block sums of x and the offsets' dot take
 * at most K + 64 roundings each, and the offset 8 s - off0 one rounding: 4 (K + 64) u M with
 * M = sum_i (|s (q_i - 8)| + |off_b| + |off0_b|) |x_i| covers them. A wrong code, scale or
 * offset is off by O(|w x|). */
static void test_asym_repack_forward(void) {
    uint64_t s = 99;
    static const uint32_t types[2] = {MQ_GM_Q4_1, MQ_GM_Q4_K};
    for (int ti = 0; ti < 2; ti++)
        for (int shape = 0; shape < 2; shape++) {
            const int64_t rows = shape ? 40 : 16, cols = shape ? 768 : 256;
            size_t nb;
            uint8_t *p = rand_blocks(types[ti], rows, cols, &s, &nb);
            float *w = malloc(sizeof(float) * rows * cols);
            ASSERT_OK(mq_ggml_dequantize(types[ti], p, rows * cols, w));
            mq_ggml_mat m;
            ASSERT_OK(mq_ggml_mat_init(&m, p, types[ti], rows, cols, 1.0f, 0, "asym"));
            struct mq_packed_weight *pw = NULL;
            ASSERT_OK(mq_packed_weight_from_ggml(&m, "asym", &pw));
            if (!pw) return;
            ASSERT_TRUE(pw->off != NULL);
            for (int64_t T = 1; T <= 70; T += 23) {
                float *x = malloc(sizeof(float) * T * cols), *y = malloc(sizeof(float) * T * rows);
                for (int64_t i = 0; i < T * cols; i++)
                    x[i] = (float)((int64_t)(rng_next(&s) % 20001) - 10000) / 4000.0f;
                ASSERT_OK(mq_packed_weight_forward(pw, x, T, y));
                for (int64_t t = 0; t < T; t++)
                    for (int64_t r = 0; r < rows; r++) {
                        double exact = 0, quant = 0, mag = 0;
                        for (int64_t b = 0; b < cols / 32; b++) {
                            const float *xb = x + t * cols + 32 * b;
                            const float off = pw->off[r * (cols / 32) + b];
                            double amax = 0, sym = 0;
                            for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(xb[i]));
                            for (int i = 0; i < 32; i++) {
                                const double wi = w[r * cols + 32 * b + i], ws = wi - off;
                                exact += wi * xb[i];
                                sym += fabs(ws);
                                mag += (fabs(ws) + 2 * fabs(off) + fabs(wi)) * fabs(xb[i]);
                            }
                            quant += amax / 65024 * sym;
                        }
                        const double tol = quant + 4.0 * (double)(cols + 64) * ldexp(1, -24) * mag;
                        const double got = y[t * rows + r];
                        if (!(fabs(got - exact) <= tol)) {
                            FAIL("type %u [%lld, %lld] T %lld row %lld token %lld: %.9g against %.9g "
                                 "(bound %.3g)", types[ti], (long long)rows, (long long)cols,
                                 (long long)T, (long long)r, (long long)t, got, exact, tol);
                            t = T;
                            break;
                        }
                    }
                free(x), free(y);
            }
            mq_packed_weight_free(pw);
            free(p), free(w);
        }
}

/* ---- models ------------------------------------------------------------------------------------ */
/* model quantized (sch; INT4 g32, asym for Q4_1) with the Linears matching ignore kept and every
 * unquantized matrix written as rest; returns the file (static). */
static const char *make_file(const char *model, const char *tag, mq_qscheme sch, bool asym,
                             const char *ignore, mq_gguf_rest rest) {
    static char file[1100];
    char ckpt[1100];
    snprintf(ckpt, sizeof ckpt, "%s/%s-ckpt", mq_test_tmpdir(), tag);
    snprintf(file, sizeof file, "%s/%s.gguf", mq_test_tmpdir(), tag);
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, sch, MQ_FMT_CT);
    o.spec.scale_dtype = MOEQ_DT_F16;
    if (sch == MQ_QS_INT4) o.spec.group_size = 32, o.spec.asym = asym;
    const char *ign[1] = {ignore};
    if (ignore) o.ignore = ign, o.n_ignore = 1;
    ASSERT_OK(mq_pipeline_run(model, ckpt, &o, NULL));
    ASSERT_OK(mq_gguf_export(ckpt, file, rest));
    return file;
}

/* The logits of the file in place (keep_packed) against the file decoded to fp32.
 *
 * Tolerance. Both runs use the same weight values (a mapped row decodes to io's bits, test
 * above; the repack keeps the codes and the f16 / E4M3 scales). They differ (a) in the order of
 * each dot product's sums: |dy| <= gamma_K * sum|w x|, gamma_K ~ K u, u = 2^-24, K <= the widest
 * input; (b) on the packed kernels only, in the activations, rounded per block of 16/32 to
 * split int16 (moe_ffn.h): relative error <= 1 / (2 * 32512) < 2^-15 of the block's largest.
 * Each decoder layer puts such relative perturbations through about seven Linears, norms,
 * softmax and SwiGLU; allowing a growth of 10 per layer, the logits stay within
 * 10 * L * (K u + 2^-15 [packed]) of their largest value. A wrong row, scale, code or layout is
 * off by O(1) and fails by orders of magnitude. */
static void packed_equals_decoded(const char *file, const char *tag, bool repacked) {
    moeq_model_options po = {.keep_packed = 1}, fo = {0};
    moeq_model *mp = NULL, *mf = NULL;
    ASSERT_OK(moeq_model_open(file, &po, &mp));
    ASSERT_OK(moeq_model_open(file, &fo, &mf));
    if (!mp || !mf) return;
    const moeq_model_info *ip = moeq_model_get_info(mp), *ifp = moeq_model_get_info(mf);
    ASSERT_TRUE(ip->packed_linears > 0);
    ASSERT_EQ_INT(0, ip->fallback_linears);
    /* no fp32 copies: the packed model holds less than half the decoded one's bytes (F16 is half) */
    if (!(ip->weight_bytes * 2 < ifp->weight_bytes))
        FAIL("%s: %lld resident bytes against %lld decoded", tag, (long long)ip->weight_bytes,
             (long long)ifp->weight_bytes);
    const char *text = "The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building.";
    int32_t *ids = NULL;
    size_t n = 0;
    ASSERT_OK(moeq_tokenizer_encode(moeq_model_tokenizer(mf), text, strlen(text), &ids, &n));
    const int64_t V = ip->vocab_size;
    float *lp = mq_test_logits(mp, ids, (int32_t)n), *lf = mq_test_logits(mf, ids, (int32_t)n);
    const mq_config *c = &mf->cfg;
    int64_t K = c->D;
    if (c->ffn > K) K = c->ffn;
    if (c->moe_ffn > K) K = c->moe_ffn;
    if (c->shared_ffn > K) K = c->shared_ffn;
    const double tol = 10.0 * c->n_layers * ((double)K * ldexp(1, -24) + (repacked ? ldexp(1, -15) : 0));
    const double d = mq_test_rel_maxdiff(lp, lf, n * (size_t)V);
    printf("  %s: max |dlogit| / max |logit| = %.3g (tolerance %.3g), %lld / %lld weight bytes\n",
           tag, d, tol, (long long)ip->weight_bytes, (long long)ifp->weight_bytes);
    if (!(d <= tol)) FAIL("%s: logits differ by %.3g of their largest (tolerance %.3g)", tag, d, tol);
    free(lp), free(lf), free(ids);
    moeq_model_free(mp);
    moeq_model_free(mf);
}

/* Whether some 2-D matrix of the file is of a type the runtime repacks for the packed kernels
 * (the tolerance's 2^-15 term): Q4_0, NVFP4, Q4_1 and Q4_K. */
static bool kq_repacked(const char *file) {
    mq_gguf *g = NULL;
    ASSERT_OK(mq_gguf_open(file, &g));
    bool any = false;
    for (size_t i = 0; g && i < mq_gguf_tensor_count(g); i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        any |= t->n_dims >= 2 && (t->type == MQ_GM_Q4_0 || t->type == MQ_GM_NVFP4 ||
                                  t->type == MQ_GM_Q4_1 || t->type == MQ_GM_Q4_K);
    }
    mq_gguf_close(g);
    return any;
}

/* A compressed-tensors checkpoint run packed keeps its BF16 embeddings and lm_head in the mapped
 * file (no fp32 copy) and gives the fp32 path's logits within the same tolerance. */
static void test_checkpoint_bf16_head(void) {
    char ckpt[1100];
    snprintf(ckpt, sizeof ckpt, "%s/ct", mq_test_tmpdir());
    mq_pipeline_opts o;
    mq_pipeline_opts_init(&o, MQ_QS_INT4, MQ_FMT_CT);
    o.spec.group_size = 32;
    ASSERT_OK(mq_pipeline_run(mq_test_model("olmoe-tiny"), ckpt, &o, NULL));
    moeq_model_options po = {.keep_packed = 1};
    moeq_model *m = mq_test_open_model(ckpt, &po);
    if (m) ASSERT_TRUE(m->embed_g && m->head_g && !m->embed && !m->lm_head);
    if (m) ASSERT_TRUE(m->embed_g->type == MQ_GM_BF16 && m->head_g->type == MQ_GM_BF16);
    moeq_model_free(m);
    packed_equals_decoded(ckpt, "olmoe-ct", true);
}

static void family(const char *model, const char *name, bool moe, bool nvfp4) {
    char tag[64];
    snprintf(tag, sizeof tag, "%s-q4_0", name);
    packed_equals_decoded(make_file(model, tag, MQ_QS_INT4, false, NULL, MQ_GGUF_REST_Q8_0), tag, true);
    if (nvfp4) {   /* llama.cpp's olmoe and qwen2moe graphs take no NVFP4 (the export refuses) */
        snprintf(tag, sizeof tag, "%s-nvfp4", name);
        packed_equals_decoded(make_file(model, tag, MQ_QS_NVFP4, false, NULL, MQ_GGUF_REST_BF16), tag, true);
    }
    snprintf(tag, sizeof tag, "%s-q4_1", name);
    packed_equals_decoded(make_file(model, tag, MQ_QS_INT4, true, NULL, MQ_GGUF_REST_F16), tag, true);
    /* Q8_0 Linears (the MLPs, or everything of a dense model) read in place */
    snprintf(tag, sizeof tag, "%s-q8_0", name);
    packed_equals_decoded(make_file(model, tag, MQ_QS_INT4, false, moe ? "mlp" : ".", MQ_GGUF_REST_Q8_0),
                          tag, moe);
}

/* llama.cpp's K-quant files as moeq writes them (moeq_quantize --format gguf): q4_k_m is llama.cpp's
 * mixture (Q4_K, Q5_K for attn_output, Q6_K for some ffn_down and the output, Q8_0 for attn_k/v
 * of MoE models), q3_k, q5_k and q6_k one type for every Linear (a width that is no whole
 * number of 256-blocks falls back as llama.cpp's quantizer does), iq4_xs llama.cpp's IQ4_XS
 * file (IQ4_NL where it falls back). */
static void kquant_family(const char *model, const char *name) {
    static const struct {
        moeq_quant_scheme s;
        const char *tag;
    } kq[] = {{MOEQ_QUANT_Q4_K_M, "q4_k_m"}, {MOEQ_QUANT_Q3_K, "q3_k"}, {MOEQ_QUANT_Q5_K, "q5_k"},
              {MOEQ_QUANT_Q6_K, "q6_k"}, {MOEQ_QUANT_IQ4_XS, "iq4_xs"}};
    for (size_t i = 0; i < sizeof kq / sizeof kq[0]; i++) {
        char tag[64], file[1100];
        snprintf(tag, sizeof tag, "%s-%s", name, kq[i].tag);
        snprintf(file, sizeof file, "%s/%s.gguf", mq_test_tmpdir(), tag);
        moeq_quant_options o;
        moeq_quant_options_init(&o);
        o.scheme = kq[i].s;
        o.format = MOEQ_FORMAT_GGUF;
        ASSERT_OK(moeq_quantize(model, file, &o, NULL));
        packed_equals_decoded(file, tag, kq_repacked(file));
    }
}

static void test_olmoe(void) {
    family(mq_test_model("olmoe-tiny"), "olmoe", true, false);
    kquant_family(mq_test_model("olmoe-tiny"), "olmoe");
}

/* qwen2moe-tiny with norm_topk_prob false (what llama.cpp's qwen2moe computes, so what the export
 * writes), its files linked into a new folder. */
static void test_qwen2moe(void) {
    char src[1024], dir[1100];
    snprintf(src, sizeof src, "%s", mq_test_shared("fixtures/models/qwen2moe-tiny"));
    snprintf(dir, sizeof dir, "%s/qwen2moe-nonorm", mq_test_tmpdir());
    ASSERT_TRUE(mkdir(dir, 0755) == 0);
    const char *files[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) {
        char a[1200], b[1200];
        snprintf(a, sizeof a, "%s/%s", src, files[i]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i]);
        ASSERT_TRUE(symlink(a, b) == 0);
    }
    char p[1200];
    snprintf(p, sizeof p, "%s/config.json", src);
    size_t len;
    char *text = mq_test_slurp(p, &len), *at = text ? strstr(text, "\"norm_topk_prob\": true") : NULL;
    ASSERT_TRUE(at != NULL);
    if (!at) return;
    memcpy(at, "\"norm_topk_prob\":false", 22);   /* same length as the original */
    snprintf(p, sizeof p, "%s/config.json", dir);
    FILE *f = fopen(p, "wb");
    ASSERT_TRUE(f && fwrite(text, 1, len, f) == len);
    fclose(f);
    free(text);
    family(dir, "qwen2moe", true, false);
    kquant_family(dir, "qwen2moe");
}

/* Mixtral: llama's graph with experts (q/k rows rotated); its 96-wide experts have no whole
 * NVFP4 blocks of 64, so NVFP4 experts are covered by test_experts_repack_equals_op_packing */
static void test_mixtral(void) {
    char m[1024];
    snprintf(m, sizeof m, "%s", mq_test_with_tokenizer("mixtral-tiny"));
    const char *f = make_file(m, "mixtral-q4_0", MQ_QS_INT4, false, NULL, MQ_GGUF_REST_AUTO);
    packed_equals_decoded(f, "mixtral-q4_0", true);
    kquant_family(m, "mixtral");
}

static void test_llama(void) {
    char m[1024];
    snprintf(m, sizeof m, "%s", mq_test_shared("fixtures/models/llama-tiny"));
    family(m, "llama", false, true);
    kquant_family(m, "llama");
}

TEST_MAIN(T(test_rows_equal_io_decoder), T(test_dot_twins), T(test_dot_bf16_rows_twins), T(test_experts_repack_equals_op_packing), T(test_asym_repack_forward), T(test_checkpoint_bf16_head), T(test_olmoe), T(test_qwen2moe),
          T(test_mixtral),
          T(test_llama))
