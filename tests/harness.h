/*
 * Minimal test harness: each tests/test_*.c file is one ctest executable with a table of cases.
 *   static void test_something(void) { ASSERT_EQ_INT(2, 1 + 1); }
 *   TEST_MAIN(T(test_something))
 * A failing assertion prints file:line with both values and ends the case; the executable exits
 * 1 if any case failed, 77 (ctest SKIP) if every case was skipped, else 0.
 */
#ifndef MOEQ_TEST_HARNESS_H
#define MOEQ_TEST_HARNESS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "moeq.h"

typedef struct {
    const char *name;
    void (*fn)(void);
} mq_test_case;

int mq_test_run(int argc, char **argv, const mq_test_case *cases, size_t n);
/* Ends the current case: failed (skip 0; the message names file:line) or skipped (skip 1). */
void mq_test_end(int skip, const char *file, int line, const char *fmt, ...);

/* Path of a file under the shared fixtures folder: $MOEQ_SHARED, default <repo>/../shared.
 * Skips the current case with a clear message when the folder is missing. Returns a static
 * buffer (copy it before the next call). */
const char *mq_test_shared(const char *rel);
/* Path of a file in the repository (<repo>/rel; not checked). */
const char *mq_test_repo(const char *rel);
/* 1 when the shared fixtures folder ($MOEQ_SHARED, default ../shared) exists. */
int mq_test_have_shared(void);
/* A fixture model folder: the shared fixtures/models/<name> when the shared folder has it, else
 * the repository's bundled models/<name> (a byte-identical copy, e.g. olmoe-tiny), else skips
 * the case as mq_test_shared does. Static buffer. */
const char *mq_test_model(const char *name);
/* Its transformers golden: shared fixtures/models/<name>.golden.safetensors, else the copy in
 * tests/data/<name>.golden.safetensors, else skips. Static buffer. */
const char *mq_test_model_golden(const char *name);
/* Calibration text for tests that need "some text", not particular figures: the shared
 * fixtures/text/calib.txt when present, else the bundled data/demo-calib.txt. Static buffer. */
const char *mq_test_calib_text(void);
/* The whole file at path, NUL-terminated (malloc'd; its size in *n), or NULL where it cannot be
 * read whole. */
char *mq_test_slurp(const char *path, size_t *n);
/* 1 when both files read whole and hold the same bytes. */
int mq_test_same_file(const char *a, const char *b);
/* Writes w (io/safetensors.h) as dir/model.safetensors and frees it. */
struct mq_st_writer;
void mq_test_write_model_st(struct mq_st_writer *w, const char *dir);
/* A fresh temporary directory for this case (removed when the test executable ends). */
const char *mq_test_tmpdir(void);
/* A copy of tests/data/<name> (config.json, model.safetensors) with the bundled olmoe-tiny's
 * tokenizer beside it, in the case's temporary directory (GPTQ tokenizes its calibration text;
 * these models share its 4096 ids). Returns a static path. */
const char *mq_test_with_tokenizer(const char *name);
/* The shared fixture qwen2moe-tiny with norm_topk_prob false (what llama.cpp's qwen2moe
 * computes: shared experts, biases), in the case's temporary directory: its config.json changed,
 * its other files linked. Returns a static path. */
const char *mq_test_qwen2moe_nonorm(void);
/* moeq_model_open(dir, o) (o may be NULL); the case fails with the library's error. */
moeq_model *mq_test_open_model(const char *dir, const moeq_model_options *o);
/* The shared wikitext-2 test split (fixtures/text/wikitext2_test.txt) as wikitext documents
 * (skips as mq_test_shared does), and the repository's held-out text data/demo-eval.txt as one
 * document. */
moeq_docs *mq_test_wikitext_docs(void);
moeq_docs *mq_test_demo_docs(void);
/* n (1 to 4) wikitext documents " = One = ", " = Two = ", ... cut from the calibration text
 * (mq_test_calib_text): document i holds its next len[i] bytes. */
moeq_docs *mq_test_calib_docs(const int *len, int n);
/* Evaluation options for the text task (no detokenizer), windows of max_length tokens (0: the
 * default) and kl_base as --kl-base (may be NULL), the rest as moeq_eval_options_init sets them. */
moeq_eval_options mq_test_text_eval(int32_t max_length, const moeq_model *kl_base);
/* The perplexity texts of the runtime comparisons: check(docs, o, what) on the first two
 * wikitext documents (demo 0) or on data/demo-eval.txt (demo 1), o holding the matching task and
 * limit, 512-token windows and no prefix token. */
void mq_test_on_eval_text(int demo, void (*check)(const moeq_docs *docs, const moeq_eval_options *o,
                                                  const char *what));
/* Options for GPTQ of scheme calibrated on the text file calib: nsamples samples of seqlen tokens,
 * the rest as moeq_quant_options_init leaves it. */
moeq_quant_options mq_test_gptq_options(moeq_quant_scheme scheme, const char *calib, int64_t nsamples,
                                        int64_t seqlen);
/* moeq_tokenizer_load(path); the case fails with the library's error. */
moeq_tokenizer *mq_test_tokenizer(const char *path);
/* The logits [n, vocab_size] a fresh session of m gives for ids (malloc'd). */
float *mq_test_logits(const moeq_model *m, const int32_t *ids, int32_t n);
/* A float's bits; mq_test_same_floats fails the case at the first of n values whose bits differ,
 * naming what, the index and both values. */
uint32_t mq_test_f32_bits(float f);
float mq_test_f32_from_bits(uint32_t u);
void mq_test_same_floats(const float *want, const float *got, int64_t n, const char *what);
/* Largest |a-b| / max|b| over n values (0 if b is all zero and a == b). */
double mq_test_rel_maxdiff(const float *a, const float *b, size_t n);
/* The index of the largest of x[0..n-1], ties to the lower (greedy decoding's pick). */
int32_t mq_test_argmax(const float *x, int32_t n);

/* Deterministic random data: xorshift64 (13, 7, 17) on the state mq_test_rng (0 until a test
 * seeds it, and 0 stays 0). mq_test_rnd_unit: in (0, 1); mq_test_rnd_normal: N(0, 1) by
 * Box-Muller from two of those. */
extern uint64_t mq_test_rng;
double mq_test_rnd_unit(void);
double mq_test_rnd_normal(void);
/* Inputs [T, K] (malloc'd) with correlated features and uneven scales, from the state seeded
 * with seed: feature k has scale exp(0.7 N(0, 1)), and x[t][k] = (z_k + 0.7 z_{k-1}) * scale[k]
 * with the running z a row (so GPTQ's error feedback and act-order both matter). */
double *mq_test_correlated_inputs(int64_t T, int64_t K, uint64_t seed);
/* One xorshift64 (13, 7, 17) step of a test's own state; returns the new state. */
uint64_t mq_test_xorshift(uint64_t *state);
/* From a test's own state: a float in [0, 1) of the step's bits 16..39, and N(0, 1) by Box-Muller
 * from two of those (the first moved off 0 by 2^-25). */
float mq_test_rnd_unitf(uint64_t *state);
float mq_test_rnd_normalf(uint64_t *state);
/* N x K weights 0.02 N(0, 1), 1% of them 6 times larger (so that group scales vary), from the
 * state seeded with seed (malloc'd). */
float *mq_test_weights(int64_t N, int64_t K, uint64_t seed);
/* A MoE experts descriptor (moeq_moe_ffn) with its shape and scheme set and the rest zero (the
 * tensors and NVFP4's divisor convention to fill in). */
moeq_moe_experts_desc mq_test_moe_desc(int nvfp4, int group_size, int E, int D, int F, int Fs);
/* The GPU backend on device 0 (backend/gpu.h's mq_gpu); the case is skipped in a build without
 * CUDA or where no GPU opens. */
struct mq_gpu *mq_test_open_gpu(void);
/* The bound of a logit's difference between a GPU forward at precision p and the CPU's for model m
 * (loaded with fp32 weights) over sums of up to T positions: tests/test_gpu_eval.c's header
 * derives it. */
double mq_test_logit_eps(const moeq_model *m, moeq_gpu_precision p, int64_t T);
/* The tests' own decoders of an E2M1 code (its 4 bits) and an E4M3 byte, written from the formats'
 * definitions and independent of the library's codecs they check. */
double mq_test_e2m1_dec(uint8_t c);
double mq_test_e4m3_dec(uint8_t b);
/* DeepSeek-V3's group-limited routing, the tests' reference: the experts outside the topk_group
 * of the n_group groups with the largest sums of their two best scores s[] (ties to the lower
 * group) marked taken (taken[e] = 1), the others 0. */
void mq_test_ref_groups(const double *s, int64_t E, int n_group, int topk_group, int *taken);

/* The AVX2 twins of the kernels exist in x86 builds only (elsewhere their tests skip). */
#if defined(__x86_64__) || defined(__i386__)
#define MQ_TEST_X86 1
#else
#define MQ_TEST_X86 0
#endif
/* The NEON twins exist in AArch64 builds only (the SDOT ones run where mq_cpu_has_neon_dot()). */
#if defined(__aarch64__)
#define MQ_TEST_ARM 1
#else
#define MQ_TEST_ARM 0
#endif

#define T(fn) {#fn, fn}
#define TEST_MAIN(...)                                                                             \
    int main(int argc, char **argv) {                                                              \
        static const mq_test_case cases_[] = {__VA_ARGS__};                                        \
        return mq_test_run(argc, argv, cases_, sizeof cases_ / sizeof cases_[0]);                  \
    }

#define FAIL(...) mq_test_end(0, __FILE__, __LINE__, __VA_ARGS__)
#define SKIP(...) mq_test_end(1, __FILE__, __LINE__, __VA_ARGS__)

#define ASSERT_TRUE(x)                                                                             \
    do {                                                                                           \
        if (!(x)) FAIL("expected true: %s", #x);                                                   \
    } while (0)
#define ASSERT_FALSE(x)                                                                            \
    do {                                                                                           \
        if (x) FAIL("expected false: %s", #x);                                                     \
    } while (0)
#define ASSERT_EQ_INT(expected, actual)                                                            \
    do {                                                                                           \
        long long e_ = (long long)(expected), a_ = (long long)(actual);                            \
        if (e_ != a_) FAIL("%s == %s: expected %lld, got %lld", #expected, #actual, e_, a_);       \
    } while (0)
#define ASSERT_EQ_HEX(expected, actual)                                                            \
    do {                                                                                           \
        unsigned long long e_ = (unsigned long long)(expected), a_ = (unsigned long long)(actual); \
        if (e_ != a_) FAIL("%s == %s: expected 0x%llx, got 0x%llx", #expected, #actual, e_, a_);   \
    } while (0)
#define ASSERT_EQ_STR(expected, actual)                                                            \
    do {                                                                                           \
        const char *e_ = (expected), *a_ = (actual);                                               \
        if (!e_ || !a_ || strcmp(e_, a_) != 0)                                                     \
            FAIL("%s == %s: expected \"%s\", got \"%s\"", #expected, #actual, e_ ? e_ : "(null)",  \
                 a_ ? a_ : "(null)");                                                              \
    } while (0)
#define ASSERT_NEAR(expected, actual, tol)                                                         \
    do {                                                                                           \
        double e_ = (double)(expected), a_ = (double)(actual), t_ = (double)(tol);                 \
        if (!(fabs(e_ - a_) <= t_))                                                                \
            FAIL("%s ~ %s: expected %.9g, got %.9g (|diff| %.3g > %.3g)", #expected, #actual, e_,  \
                 a_, fabs(e_ - a_), t_);                                                           \
    } while (0)
#define ASSERT_REL(expected, actual, rtol)                                                         \
    do {                                                                                           \
        double e_ = (double)(expected), a_ = (double)(actual), t_ = (double)(rtol);                \
        if (!(fabs(e_ - a_) <= t_ * fabs(e_)))                                                     \
            FAIL("%s ~ %s: expected %.12g, got %.12g (rel diff %.3g > %.3g)", #expected, #actual,  \
                 e_, a_, fabs(e_ - a_) / fabs(e_), t_);                                            \
    } while (0)
#define ASSERT_OK(expr)                                                                            \
    do {                                                                                           \
        moeq_status s_ = (expr);                                                                   \
        if (s_ != MOEQ_OK)                                                                         \
            FAIL("%s failed: %s: %s", #expr, moeq_status_name(s_), moeq_last_error());             \
    } while (0)
#define ASSERT_STATUS(expected, expr)                                                              \
    do {                                                                                           \
        moeq_status s_ = (expr);                                                                   \
        if (s_ != (expected))                                                                      \
            FAIL("%s: expected %s, got %s (%s)", #expr, moeq_status_name(expected),                \
                 moeq_status_name(s_), moeq_last_error());                                         \
    } while (0)
/* Asserts the last error message contains a substring (errors must name the culprit). */
#define ASSERT_ERROR_MENTIONS(substr)                                                              \
    do {                                                                                           \
        if (!strstr(moeq_last_error(), (substr)))                                                  \
            FAIL("error message \"%s\" does not mention \"%s\"", moeq_last_error(), (substr));     \
    } while (0)

#endif
