#define _GNU_SOURCE
#include "harness.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/gpu.h"
#include "core/core.h"
#include "io/safetensors.h"
#include "model/model.h"

#ifndef MOEQ_SOURCE_DIR
#define MOEQ_SOURCE_DIR "."
#endif

static jmp_buf g_jmp;
static int g_failed_case, g_skipped_case;
static char g_tmp_root[512];
static int g_tmp_count;

void mq_test_end(int skip, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    if (skip) fprintf(stderr, "  SKIP: ");
    else fprintf(stderr, "  FAIL %s:%d: ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    if (skip) g_skipped_case = 1;
    else g_failed_case = 1;
    longjmp(g_jmp, 1);
}

static const char *shared_root(void) {
    static char def[2048];
    const char *root = getenv("MOEQ_SHARED");
    if (root && *root) return root;
    snprintf(def, sizeof def, "%s/../shared", MOEQ_SOURCE_DIR);
    return def;
}

int mq_test_have_shared(void) {
    struct stat st;
    return stat(shared_root(), &st) == 0 && S_ISDIR(st.st_mode);
}

const char *mq_test_shared(const char *rel) {
    static char buf[4096];
    const char *root = shared_root();
    if (!mq_test_have_shared())
        SKIP("shared fixtures folder '%s' not found: set MOEQ_SHARED to the folder that "
                     "holds fixtures/ and docs/ (default: ../shared beside the repository)", root);
    struct stat st;
    snprintf(buf, sizeof buf, "%s/%s", root, rel);
    if (stat(buf, &st) != 0) SKIP("shared fixture '%s' is missing", buf);
    return buf;
}

const char *mq_test_repo(const char *rel) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", MOEQ_SOURCE_DIR, rel);
    return buf;
}

/* The shared fixture `shared_rel` when it exists, else the repository's `repo_rel` when that
 * exists, else skip with mq_test_shared's message. */
static const char *shared_or_repo(char *buf, size_t size, const char *shared_rel,
                                  const char *repo_rel) {
    struct stat st;
    snprintf(buf, size, "%s/%s", shared_root(), shared_rel);
    if (mq_test_have_shared() && stat(buf, &st) == 0) return buf;
    snprintf(buf, size, "%s/%s", MOEQ_SOURCE_DIR, repo_rel);
    if (stat(buf, &st) == 0) return buf;
    snprintf(buf, size, "%s", mq_test_shared(shared_rel));
    return buf;
}

/* fixtures/models/<name><suffix> of the shared folder, else <repo_dir>/<name><suffix> of the
 * repository, as shared_or_repo picks. */
static const char *model_fixture(char *buf, size_t size, const char *name, const char *suffix,
                                 const char *repo_dir) {
    char srel[512], rrel[512];
    snprintf(srel, sizeof srel, "fixtures/models/%s%s", name, suffix);
    snprintf(rrel, sizeof rrel, "%s/%s%s", repo_dir, name, suffix);
    return shared_or_repo(buf, size, srel, rrel);
}

const char *mq_test_model(const char *name) {
    static char buf[4096];
    return model_fixture(buf, sizeof buf, name, "", "models");
}

const char *mq_test_model_golden(const char *name) {
    static char buf[4096];
    return model_fixture(buf, sizeof buf, name, ".golden.safetensors", "tests/data");
}

const char *mq_test_calib_text(void) {
    static char buf[4096];
    return shared_or_repo(buf, sizeof buf, "fixtures/text/calib.txt", "data/demo-calib.txt");
}

static void remove_tmp_root(void) {
    if (g_tmp_root[0]) {
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp_root);
        if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", g_tmp_root);
    }
}

char *mq_test_slurp(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = NULL;
    long len = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (len >= 0 && fseek(f, 0, SEEK_SET) == 0 && (b = malloc((size_t)len + 1)) &&
        fread(b, 1, (size_t)len, f) == (size_t)len) {
        b[len] = 0;
        *n = (size_t)len;
    } else {
        free(b);
        b = NULL;
    }
    fclose(f);
    return b;
}

int mq_test_same_file(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *x = mq_test_slurp(a, &na), *y = mq_test_slurp(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

void mq_test_write_model_st(mq_st_writer *w, const char *dir) {
    char *path = mq_path_join(dir, "model.safetensors");
    moeq_status st = mq_stw_write(w, path);
    free(path);
    mq_stw_free(w);
    ASSERT_OK(st);
}

const char *mq_test_tmpdir(void) {
    static char buf[600];
    if (!g_tmp_root[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(g_tmp_root, sizeof g_tmp_root, "%s/moeq-test-XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(g_tmp_root)) {
            g_tmp_root[0] = 0;
            FAIL("cannot create a temporary directory");
        }
        atexit(remove_tmp_root);
    }
    snprintf(buf, sizeof buf, "%s/case%d", g_tmp_root, ++g_tmp_count);
    if (mkdir(buf, 0755) != 0) FAIL("cannot create %s", buf);
    return buf;
}

int32_t mq_test_argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

double mq_test_rel_maxdiff(const float *a, const float *b, size_t n) {
    double maxref = 0, maxdiff = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d != d) return INFINITY;
        if (d > maxdiff) maxdiff = d;
        if (fabs((double)b[i]) > maxref) maxref = fabs((double)b[i]);
    }
    if (maxref == 0) return maxdiff == 0 ? 0 : INFINITY;
    return maxdiff / maxref;
}

int mq_test_run(int argc, char **argv, const mq_test_case *cases, size_t n) {
    volatile int failed = 0, skipped = 0, ran = 0;
    const char *only = argc > 1 ? argv[1] : NULL;
    for (volatile size_t i = 0; i < n; i++) {
        if (only && !strstr(cases[i].name, only)) continue;
        ran++;
        g_failed_case = g_skipped_case = 0;
        fprintf(stderr, "[ RUN  ] %s\n", cases[i].name);
        if (setjmp(g_jmp) == 0) cases[i].fn();
        if (g_failed_case) {
            failed++;
            fprintf(stderr, "[ FAIL ] %s\n", cases[i].name);
        } else if (g_skipped_case) {
            skipped++;
            fprintf(stderr, "[ SKIP ] %s\n", cases[i].name);
        } else {
            fprintf(stderr, "[  OK  ] %s\n", cases[i].name);
        }
    }
    fprintf(stderr, "%d cases: %d passed, %d failed, %d skipped\n", ran, ran - failed - skipped,
            failed, skipped);
    if (failed) return 1;
    if (ran > 0 && skipped == ran) return 77;
    return 0;
}

static void copy_file(const char *from, const char *to) {
    char *data;
    size_t len;
    ASSERT_OK(mq_read_file(from, &data, &len));
    ASSERT_OK(mq_write_file_atomic(to, data, len));
    free(data);
}

const char *mq_test_with_tokenizer(const char *name) {
    static char dir[4200];
    snprintf(dir, sizeof dir, "%s/%s", mq_test_tmpdir(), name);
    ASSERT_TRUE(mkdir(dir, 0755) == 0);
    const char *files[] = {"config.json", "model.safetensors"};
    const char *tok[] = {"tokenizer.json", "tokenizer_config.json"};
    char a[8500], b[8500];
    for (int i = 0; i < 2; i++) {
        snprintf(a, sizeof a, "%s/%s/%s", mq_test_repo("tests/data"), name, files[i]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i]);
        copy_file(a, b);
        snprintf(a, sizeof a, "%s/%s", mq_test_repo("models/olmoe-tiny"), tok[i]);
        snprintf(b, sizeof b, "%s/%s", dir, tok[i]);
        copy_file(a, b);
    }
    return dir;
}

uint64_t mq_test_rng;

uint64_t mq_test_xorshift(uint64_t *state) {
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

double mq_test_rnd_unit(void) { return ((double)(mq_test_xorshift(&mq_test_rng) >> 11) + 0.5) * 0x1p-53; }

float mq_test_rnd_unitf(uint64_t *state) {
    return (float)((uint32_t)(mq_test_xorshift(state) >> 16) & 0xffffff) * 0x1p-24f;
}

float mq_test_rnd_normalf(uint64_t *state) {
    float u1 = mq_test_rnd_unitf(state) + 0x1p-25f, u2 = mq_test_rnd_unitf(state);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

double *mq_test_correlated_inputs(int64_t T, int64_t K, uint64_t seed) {
    mq_test_rng = seed;
    double *x = malloc((size_t)(T * K) * sizeof(double));
    double *scale = malloc((size_t)K * sizeof(double));
    if (!x || !scale) FAIL("out of memory for %lld x %lld inputs", (long long)T, (long long)K);
    for (int64_t k = 0; k < K; k++) scale[k] = exp(0.7 * mq_test_rnd_normal());
    for (int64_t t = 0; t < T; t++) {
        double prev = 0;
        for (int64_t k = 0; k < K; k++) {
            double z = mq_test_rnd_normal() + 0.7 * prev;
            prev = z;
            x[t * K + k] = z * scale[k];
        }
    }
    free(scale);
    return x;
}

moeq_model *mq_test_open_model(const char *dir, const moeq_model_options *o) {
    moeq_model *m = NULL;
    ASSERT_OK(moeq_model_open(dir, o, &m));
    return m;
}

moeq_tokenizer *mq_test_tokenizer(const char *path) {
    moeq_tokenizer *t = NULL;
    ASSERT_OK(moeq_tokenizer_load(path, &t));
    return t;
}

moeq_docs *mq_test_wikitext_docs(void) {
    moeq_docs *d = NULL;
    ASSERT_OK(moeq_docs_load(mq_test_shared("fixtures/text/wikitext2_test.txt"), MOEQ_DOCS_WIKITEXT, &d));
    return d;
}

moeq_docs *mq_test_demo_docs(void) {
    moeq_docs *d = NULL;
    ASSERT_OK(moeq_docs_load(mq_test_repo("data/demo-eval.txt"), MOEQ_DOCS_WHOLE, &d));
    return d;
}

moeq_docs *mq_test_calib_docs(const int *len, int n) {
    static const char *const heading[4] = {"One", "Two", "Three", "Four"};
    char *buf = NULL, *text = NULL;
    size_t size = 0, at = 0;
    ASSERT_TRUE(n >= 1 && n <= 4);
    ASSERT_OK(mq_read_file(mq_test_calib_text(), &buf, &size));
    for (int i = 0; i < n; i++) {
        ASSERT_TRUE(len[i] >= 0 && at + (size_t)len[i] <= size);
        char *more = mq_asprintf("%s = %s = \n%.*s%s", text ? text : "", heading[i], len[i], buf + at,
                                 i + 1 < n ? "\n" : "");
        free(text);
        text = more;
        at += (size_t)len[i];
    }
    moeq_docs *d = NULL;
    ASSERT_OK(moeq_docs_parse("calib", text, strlen(text), MOEQ_DOCS_WIKITEXT, &d));
    ASSERT_EQ_INT(n, moeq_docs_count(d));
    free(text);
    free(buf);
    return d;
}

moeq_eval_options mq_test_text_eval(int32_t max_length, const moeq_model *kl_base) {
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    o.task = MOEQ_TASK_TEXT;
    if (max_length) o.max_length = max_length;
    o.kl_base = kl_base;
    return o;
}

void mq_test_on_eval_text(int demo, void (*check)(const moeq_docs *docs, const moeq_eval_options *o,
                                                  const char *what)) {
    moeq_docs *docs = demo ? mq_test_demo_docs() : mq_test_wikitext_docs();
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    o.task = demo ? MOEQ_TASK_TEXT : MOEQ_TASK_WIKITEXT;
    o.limit = demo ? 0 : 2;
    o.max_length = 512;
    o.prefix_token = 0;
    check(docs, &o, demo ? "data/demo-eval.txt" : "wikitext, 2 documents");
    moeq_docs_free(docs);
}

moeq_quant_options mq_test_gptq_options(moeq_quant_scheme scheme, const char *calib, int64_t nsamples,
                                        int64_t seqlen) {
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = scheme;
    o.method = MOEQ_QUANT_GPTQ;
    o.calib = calib;
    o.gptq.nsamples = nsamples;
    o.gptq.seqlen = seqlen;
    return o;
}

float *mq_test_logits(const moeq_model *m, const int32_t *ids, int32_t n) {
    const int64_t V = moeq_model_get_info(m)->vocab_size;
    float *l = malloc(sizeof(float) * (size_t)n * (size_t)V);
    moeq_session *s = NULL;
    if (!l) FAIL("out of memory for %d x %lld logits", n, (long long)V);
    ASSERT_OK(moeq_session_create(m, n, &s));
    moeq_status st = moeq_session_forward(s, ids, n, l);
    moeq_session_free(s);
    ASSERT_OK(st);
    return l;
}

double mq_test_rnd_normal(void) {
    double u = mq_test_rnd_unit(), v = mq_test_rnd_unit();
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

float *mq_test_weights(int64_t N, int64_t K, uint64_t seed) {
    mq_test_rng = seed;
    float *w = malloc((size_t)(N * K) * sizeof(float));
    if (!w) FAIL("out of memory for %lld x %lld weights", (long long)N, (long long)K);
    for (int64_t i = 0; i < N * K; i++) {
        double v = 0.02 * mq_test_rnd_normal();
        if (mq_test_rnd_unit() < 0.01) v *= 6;
        w[i] = (float)v;
    }
    return w;
}

moeq_moe_experts_desc mq_test_moe_desc(int nvfp4, int group_size, int E, int D, int F, int Fs) {
    moeq_moe_experts_desc d;
    memset(&d, 0, sizeof d);
    d.scheme = nvfp4 ? MOEQ_MOE_NVFP4 : MOEQ_MOE_INT4;
    d.group_size = group_size;
    d.n_experts = E;
    d.hidden = D;
    d.ffn = F;
    d.shared_ffn = Fs;
    return d;
}

mq_gpu *mq_test_open_gpu(void) {
    if (!mq_gpu_built()) SKIP("this build has no CUDA backend (configure with -DMOEQ_CUDA=ON)");
    mq_gpu *g = NULL;
    if (mq_gpu_open(0, &g) != MOEQ_OK) SKIP("no usable GPU: %s", moeq_last_error());
    return g;
}

double mq_test_e2m1_dec(uint8_t c) {
    static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    return (c & 8) ? -mag[c & 7] : mag[c & 7];
}

double mq_test_e4m3_dec(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? m / 512.0 : ldexp(1.0 + m / 8.0, e - 7);
    return (b & 0x80) ? -v : v;
}

const char *mq_test_qwen2moe_nonorm(void) {
    static char dir[1100];
    char s[1024];
    snprintf(s, sizeof s, "%s", mq_test_shared("fixtures/models/qwen2moe-tiny"));
    snprintf(dir, sizeof dir, "%s/qwen2moe-nonorm", mq_test_tmpdir());
    mkdir(dir, 0755);
    const char *files[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) {
        char a[1200], b[1200];
        snprintf(a, sizeof a, "%s/%s", s, files[i]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i]);
        if (symlink(a, b) != 0) FAIL("symlink %s", b);
    }
    char cp[1200], *text;
    size_t len;
    snprintf(cp, sizeof cp, "%s/config.json", s);
    ASSERT_OK(mq_read_file(cp, &text, &len));
    char *p = strstr(text, "\"norm_topk_prob\": true");
    ASSERT_TRUE(p != NULL);
    memcpy(p, "\"norm_topk_prob\":false", 22);
    snprintf(cp, sizeof cp, "%s/config.json", dir);
    ASSERT_OK(mq_write_file_atomic(cp, text, len));
    free(text);
    return dir;
}

void mq_test_ref_groups(const double *s, int64_t E, int n_group, int topk_group, int *taken) {
    const int G = n_group, EG = (int)(E / G);
    double gs[64];
    int chosen[64] = {0};
    if (G > 64) FAIL("mq_test_ref_groups: %d groups, at most 64", G);
    for (int g = 0; g < G; g++) {
        double b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * EG; e < (g + 1) * EG; e++) {
            if (s[e] > b1) {
                b2 = b1;
                b1 = s[e];
            } else if (s[e] > b2) {
                b2 = s[e];
            }
        }
        gs[g] = b1 + b2;
    }
    for (int j = 0; j < topk_group; j++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!chosen[g] && (best < 0 || gs[g] > gs[best])) best = g;
        chosen[best] = 1;
    }
    for (int64_t e = 0; e < E; e++) taken[e] = !chosen[e / EG];
}

/* (reading the member not last written reinterprets its bytes: C11 6.5.2.3) */
typedef union {
    float f;
    uint32_t u;
} f32_word;

uint32_t mq_test_f32_bits(float f) { return ((f32_word){.f = f}).u; }

float mq_test_f32_from_bits(uint32_t u) { return ((f32_word){.u = u}).f; }

void mq_test_same_floats(const float *want, const float *got, int64_t n, const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (mq_test_f32_bits(want[i]) != mq_test_f32_bits(got[i])) {
            FAIL("%s: value %lld: expected %.9g, got %.9g", what, (long long)i, (double)want[i],
                 (double)got[i]);
            return;
        }
}

double mq_test_logit_eps(const moeq_model *m, moeq_gpu_precision p, int64_t T) {
    const mq_config *c = &m->cfg;
    const int64_t D = c->D, V = c->vocab;
    double gmax = 0, wmax = 0;
    for (int64_t i = 0; i < D; i++) gmax = fmax(gmax, fabs((double)m->final_norm[i]));
    for (int64_t v = 0; v < V; v++) {
        double s = 0;
        for (int64_t k = 0; k < D; k++) s += (double)m->lm_head[v * D + k] * (double)m->lm_head[v * D + k];
        wmax = fmax(wmax, sqrt(s));
    }
    const double Z = gmax * sqrt((double)D) * wmax;
    int64_t K = D;
    const int64_t widths[] = {c->ffn, c->moe_ffn, c->shared_ffn, T, (int64_t)c->n_heads * c->head_dim};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++) K = widths[i] > K ? widths[i] : K;
    const double u = 0x1p-24, gamma_d = (double)D * u / (1.0 - (double)D * u), lambda = 6, P = 6;
    const double acc = lambda * sqrt((double)K) * u;   /* one fp32 sum of K terms */
    double head = 2 * gamma_d, layer = acc;
    if (p == MOEQ_GPU_TF32X3) {
        head = 3 * 0x1p-22 + 3 * gamma_d + gamma_d;
        layer = 3 * 0x1p-22 + 3 * acc;
    } else if (p == MOEQ_GPU_TF32) {
        head = 2 * 0x1p-11 + 2 * gamma_d;
        layer = 2 * 0x1p-11 + acc;
    } else if (p == MOEQ_GPU_BF16) {
        head = 2 * 0x1p-11 + 2 * gamma_d;
        layer = 3 * 0x1p-9 + acc;
    }
    return (head + c->n_layers * P * layer) * Z;
}
