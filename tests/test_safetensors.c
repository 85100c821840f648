/*
 * safetensors reader/writer tests: a table of corrupt files in the style of llama.cpp's test-gguf
 * (each must fail with MOEQ_E_FORMAT and a message naming the file and the culprit), corrupt
 * sharded checkpoints, random mutations of a valid file (never a crash; run under ASan), writer
 * and shard-writer round trips, a byte-identical rewrite of a fixture written by the Python
 * reference writer, and the bundled fixture models and goldens.
 */
#define _DEFAULT_SOURCE
#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "harness.h"
#include "io/safetensors.h"
#include "ckpt/source.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* An in-memory file: 8-byte little-endian header length, header, data (bytes 1, 2, 3, ...). */
static uint8_t *make_file(const char *header, size_t data_len, int64_t hlen_field, size_t *len) {
    size_t hn = header ? strlen(header) : 0;
    *len = 8 + hn + data_len;
    uint8_t *b = malloc(*len ? *len : 1);
    uint64_t h = hlen_field >= 0 ? (uint64_t)hlen_field : (uint64_t)hn;
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(h >> (8 * i));
    if (hn) memcpy(b + 8, header, hn);
    for (size_t i = 0; i < data_len; i++) b[8 + hn + i] = (uint8_t)(i + 1);
    return b;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) FAIL("cannot create %s", path);
    if (n && fwrite(data, 1, n, f) != n) FAIL("cannot write %s", path);
    fclose(f);
}

static uint8_t *read_bytes(const char *path, size_t *n) {
    char *buf = NULL;
    if (mq_read_file(path, &buf, n) != MOEQ_OK) FAIL("cannot read %s: %s", path, moeq_last_error());
    return (uint8_t *)buf;
}

static char *join(const char *dir, const char *name) {
    static char buf[4][1024];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

/* Deterministic bytes for tensor payloads. */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(g_rng >> 33);
}
static void fill(uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)rnd();
}

static int count_dir_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* ---- dtypes ------------------------------------------------------------------------------- */

static void test_dtype_names(void) {
    static const struct {
        const char *name;
        size_t size;
    } want[MOEQ_DT_COUNT] = {
        {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
        {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
        {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8},
    };
    for (int i = 0; i < MOEQ_DT_COUNT; i++) {
        ASSERT_EQ_STR(want[i].name, moeq_dtype_name((moeq_dtype)i));
        ASSERT_EQ_INT(want[i].size, moeq_dtype_size((moeq_dtype)i));
        moeq_dtype dt;
        ASSERT_TRUE(mq_dtype_from_name(want[i].name, &dt));
        ASSERT_EQ_INT(i, dt);
    }
    moeq_dtype dt;
    ASSERT_FALSE(mq_dtype_from_name("bf16", &dt));
    ASSERT_FALSE(mq_dtype_from_name("F4", &dt));
    ASSERT_FALSE(mq_dtype_from_name("", &dt));
    ASSERT_EQ_INT(0, moeq_dtype_size(MOEQ_DT_COUNT));
}

/* ---- corrupt files ------------------------------------------------------------------------ */

typedef struct {
    const char *label;    /* file label; the message must name it */
    const char *header;   /* JSON header */
    size_t data_len;      /* bytes of data after the header */
    int64_t hlen;         /* >= 0: header length field to write instead of strlen(header) */
    int64_t size;         /* >= 0: cut the file to this many bytes */
    const char *culprit;  /* the message must mention this ... */
    const char *problem;  /* ... and this */
} bad_case;

#define F32_1(name, b, e) "\"" name "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" #b "," #e "]}"
#define F32_2(name, b, e) "\"" name "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[" #b "," #e "]}"

static const bad_case k_bad[] = {
    {"trunc5.safetensors", "{}", 0, -1, 5, "5 bytes", "8-byte header length"},
    {"empty.safetensors", "{}", 0, -1, 0, "0 bytes", "8-byte header length"},
    {"hlen_past_eof.safetensors", "{}", 0, 1000, -1, "header length 1000", "past the end"},
    {"hlen_cut.safetensors", "{\"a\":{}}      ", 0, -1, 12, "header length 14", "past the end"},
    {"hlen_huge.safetensors", "{}", 0, 100000001, -1, "100000001", "exceeds the limit"},
    {"hlen_max.safetensors", "{}", 0, INT64_MAX, -1, "9223372036854775807", "exceeds the limit"},
    {"hlen_tiny.safetensors", "{}", 0, 1, -1, "header length 1", "too small"},
    {"not_json.safetensors", "{\"a\": {\"dtype\": ", 0, -1, -1, "header", "not valid JSON"},
    {"not_json2.safetensors", "{\"a\" 1}", 0, -1, -1, "header", "not valid JSON"},
    {"array.safetensors", "[\"a\", 1]", 0, -1, -1, "header", "not a JSON object"},
    {"number.safetensors", "  42  ", 0, -1, -1, "header", "not a JSON object"},
    {"blank.safetensors", "        ", 0, -1, -1, "header", "not a JSON object"},
    {"garbage_after.safetensors", "{} {}", 0, -1, -1, "header", "unexpected bytes after"},
    {"nul_pad.safetensors", "{}\0\0\0\0\0\0", 0, 8, -1, "header", "unexpected bytes after"},
    {"offsets_past_eof.safetensors", "{" F32_2("a", 0, 8) "}", 4, -1, -1, "'a'",
     "past the end of the file"},
    {"overlap.safetensors", "{" F32_2("a", 0, 8) "," F32_2("b", 4, 12) "}", 12, -1, -1, "'b'",
     "overlap tensor 'a'"},
    {"overlap_same.safetensors", "{" F32_1("a", 0, 4) "," F32_1("b", 0, 4) "}", 4, -1, -1, "'b'",
     "overlap tensor 'a'"},
    {"gap.safetensors", "{" F32_1("a", 0, 4) "," F32_1("b", 8, 12) "}", 12, -1, -1, "'b'",
     "gap of 4 bytes"},
    {"not_at_zero.safetensors", "{" F32_1("a", 4, 8) "}", 8, -1, -1, "'a'", "offset 0"},
    {"trailing.safetensors", "{" F32_1("a", 0, 4) "}", 8, -1, -1, "4 trailing bytes",
     "after the last tensor"},
    {"trailing_empty.safetensors", "{}", 3, -1, -1, "3 trailing bytes", "after the last tensor"},
    {"size_mismatch.safetensors",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, -1, -1, "'a'",
     "needs 12 bytes"},
    {"dtype_mismatch.safetensors",
     "{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 16, -1, -1, "'w'",
     "needs 8 bytes"},
    {"product_overflow.safetensors",
     "{\"a\":{\"dtype\":\"BF16\",\"shape\":[4294967296,4294967296,4294967296],"
     "\"data_offsets\":[0,0]}}",
     0, -1, -1, "'a'", "shape product overflows"},
    {"bytes_overflow.safetensors",
     "{\"a\":{\"dtype\":\"F64\",\"shape\":[9007199254740992,512],\"data_offsets\":[0,0]}}", 0, -1,
     -1, "'a'", "byte size of the shape overflows"},
    {"negative_dim.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,0]}}",
     0, -1, -1, "'a'", "shape dimension 0 is negative"},
    {"fraction_dim.safetensors",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,1.5],\"data_offsets\":[0,0]}}", 0, -1, -1, "'a'",
     "shape dimension 1 is not an integer"},
    {"string_dim.safetensors",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, -1, -1, "'a'",
     "is not a number"},
    {"unknown_dtype.safetensors", "{\"a\":{\"dtype\":\"F17\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4, -1, -1, "'a'", "unknown dtype 'F17'"},
    {"dtype_not_string.safetensors", "{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}",
     4, -1, -1, "'a'", "dtype is not a string"},
    {"too_many_dims.safetensors",
     "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1, -1, -1,
     "'a'", "9 dimensions"},
    {"shape_not_array.safetensors", "{\"a\":{\"dtype\":\"U8\",\"shape\":3,\"data_offsets\":[0,3]}}",
     3, -1, -1, "'a'", "shape is not an array"},
    {"duplicate_name.safetensors", "{" F32_1("a", 0, 4) "," F32_1("a", 4, 8) "}", 8, -1, -1, "'a'",
     "duplicate tensor name"},
    {"duplicate_field.safetensors",
     "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, -1,
     -1, "'dtype'", "appears twice"},
    {"meta_not_string.safetensors", "{\"__metadata__\":{\"format\":\"pt\",\"k\":1}}", 0, -1, -1,
     "'k'", "is not a string"},
    {"meta_nested.safetensors", "{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}", 0, -1, -1, "'k'",
     "is not a string"},
    {"meta_not_object.safetensors", "{\"__metadata__\":\"pt\"}", 0, -1, -1, "__metadata__",
     "not a JSON object"},
    {"meta_twice.safetensors", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, -1, -1,
     "__metadata__", "twice"},
    {"meta_dup_key.safetensors", "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, -1, -1, "'k'",
     "twice"},
    {"missing_dtype.safetensors", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, -1, -1,
     "'a'", "missing dtype"},
    {"missing_shape.safetensors", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, -1, -1,
     "'a'", "missing shape"},
    {"missing_offsets.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, -1, -1, "'a'",
     "missing data_offsets"},
    {"entry_not_object.safetensors", "{\"a\":[1,2]}", 0, -1, -1, "'a'", "not a JSON object"},
    {"offsets_arity.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}",
     4, -1, -1, "'a'", "data_offsets is not an array [begin, end]"},
    {"offsets_reversed.safetensors",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4, -1, -1, "'a'",
     "end before begin"},
    {"offsets_negative.safetensors",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, -1, -1, "'a'",
     "is negative"},
    {"offsets_huge.safetensors",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[1e300,1e300]}}", 4, -1, -1, "'a'",
     "too large"},
    {"offsets_wrap.safetensors",
     "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[18446744073709551615,1]}}", 2, -1,
     -1, "'a'", "too large"},
};

static void check_bad(const bad_case *c) {
    size_t len;
    /* Header strings may hold NULs (nul_pad): take the length from the explicit field. */
    uint8_t *b = make_file(c->header, c->data_len, c->hlen, &len);
    if (c->hlen >= 0 && c->hlen <= 64 && c->header && (size_t)c->hlen > strlen(c->header)) {
        /* nul_pad: the header is the literal with its NULs; rebuild with that many bytes. */
        free(b);
        len = 8 + (size_t)c->hlen + c->data_len;
        b = calloc(1, len);
        for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)c->hlen >> (8 * i));
        memcpy(b + 8, c->header, strlen(c->header));
    }
    if (c->size >= 0 && (size_t)c->size < len) len = (size_t)c->size;
    /* An exactly-sized copy, so ASan sees any read past the end. */
    uint8_t *exact = malloc(len ? len : 1);
    memcpy(exact, b, len);
    free(b);
    char label[256];
    snprintf(label, sizeof label, "bad/%s", c->label);
    mq_st *st = NULL;
    moeq_status s = mq_st_open_buffer(exact, len, label, &st);
    if (s != MOEQ_E_FORMAT) {
        mq_st_close(st);
        free(exact);
        FAIL("%s: expected MOEQ_E_FORMAT, got %s (%s)", c->label, moeq_status_name(s),
             moeq_last_error());
    }
    free(exact);
    ASSERT_TRUE(st == NULL);
    ASSERT_ERROR_MENTIONS(label);
    ASSERT_ERROR_MENTIONS(c->culprit);
    ASSERT_ERROR_MENTIONS(c->problem);
}

static void test_corrupt_table(void) {
    for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) check_bad(&k_bad[i]);
}

/* The same error through a real file: the message names the path. */
static void test_corrupt_file_path(void) {
    const char *dir = mq_test_tmpdir();
    size_t len;
    uint8_t *b = make_file("{" F32_2("layer.w", 0, 8) "," F32_2("layer.v", 4, 12) "}", 12, -1,
                           &len);
    char *path = join(dir, "overlap.safetensors");
    write_bytes(path, b, len);
    free(b);
    mq_st *st = NULL;
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_st_open_file(path, &st));
    ASSERT_ERROR_MENTIONS(path);
    ASSERT_ERROR_MENTIONS("'layer.v'");
    ASSERT_STATUS(MOEQ_E_IO, mq_st_open_file(join(dir, "nope.safetensors"), &st));
    ASSERT_ERROR_MENTIONS("nope.safetensors");
    ASSERT_STATUS(MOEQ_E_IO, mq_st_open_file(dir, &st));   /* a directory */
    ASSERT_ERROR_MENTIONS(dir);
}

/* cJSON's nesting limit turns a deeply nested header into a parse error, not a stack overflow. */
static void test_deep_nesting(void) {
    size_t depth = 100000;
    char *h = malloc(depth + 16);
    strcpy(h, "{\"a\":");
    memset(h + 5, '[', depth);
    h[5 + depth] = 0;
    size_t len;
    uint8_t *b = make_file(h, 0, -1, &len);
    mq_st *st = NULL;
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_st_open_buffer(b, len, "deep.safetensors", &st));
    ASSERT_ERROR_MENTIONS("deep.safetensors");
    ASSERT_ERROR_MENTIONS("not valid JSON");
    free(b);
    free(h);
}

/* Valid corner cases the reference reader accepts. */
static void test_accepts_edge_cases(void) {
    static const struct {
        const char *header;
        size_t data_len;
        size_t count;
    } ok[] = {
        {"{}", 0, 0},
        {" \n\t{}\r\n   ", 0, 0},
        {"{\"__metadata__\":{\"format\":\"pt\"}}", 0, 0},
        {"{\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]}}", 8, 1},
        {"{\"z\":{\"dtype\":\"F32\",\"shape\":[0,7],\"data_offsets\":[0,0]},"
         "\"y\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[0,0]}}",
         0, 2},
        /* zero-size tensors between and after others, fields in any order, unknown fields */
        {"{\"b\":{\"data_offsets\":[2,3],\"shape\":[1],\"dtype\":\"U8\",\"extra\":[1]},"
         "\"e\":{\"dtype\":\"I32\",\"shape\":[2,0],\"data_offsets\":[2,2]},"
         "\"a\":{\"dtype\":\"I16\",\"shape\":[1],\"data_offsets\":[0,2]},"
         "\"q\":{\"dtype\":\"BOOL\",\"shape\":[0],\"data_offsets\":[3,3]}}",
         3, 4},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        size_t len;
        uint8_t *b = make_file(ok[i].header, ok[i].data_len, -1, &len);
        mq_st *st = NULL;
        moeq_status s = mq_st_open_buffer(b, len, "ok.safetensors", &st);
        if (s != MOEQ_OK) {
            free(b);
            FAIL("case %zu: %s: %s", i, moeq_status_name(s), moeq_last_error());
        }
        ASSERT_EQ_INT(ok[i].count, mq_st_count(st));
        if (i == 3) {
            const mq_tensor_view *v = mq_st_find(st, "s");
            ASSERT_TRUE(v != NULL);
            ASSERT_EQ_INT(0, v->ndim);
            ASSERT_EQ_INT(1, v->numel);
            ASSERT_EQ_INT(8, v->nbytes);
            ASSERT_TRUE(v->data == b + len - 8);
        }
        if (i == 5) {
            /* sorted by name; offsets resolved to the right bytes */
            ASSERT_EQ_STR("a", mq_st_at(st, 0)->name);
            ASSERT_EQ_STR("q", mq_st_at(st, 3)->name);
            const mq_tensor_view *v = mq_st_find(st, "b");
            ASSERT_EQ_INT(MOEQ_DT_U8, v->dtype);
            ASSERT_EQ_INT(3, v->data[0]);   /* data byte 2 holds 3 */
            ASSERT_EQ_INT(0, mq_st_find(st, "e")->numel);
            ASSERT_EQ_INT(2, mq_st_find(st, "e")->ndim);
        }
        if (i == 2) ASSERT_EQ_STR("pt", mq_st_metadata(st, "format"));
        ASSERT_TRUE(mq_st_find(st, "missing") == NULL);
        mq_st_close(st);
        free(b);
    }
}

/* Random mutations of a valid file: every result is OK or MOEQ_E_FORMAT, and on OK every view
 * lies inside the buffer. Under ASan this also proves no out-of-bounds read. */
static void test_mutations_never_crash(void) {
    const char *hdr =
        "{\"__metadata__\":{\"format\":\"pt\"},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[16,22]},"
        "\"c\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[22,23]},"
        "\"d\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[23,23]}}";
    size_t len;
    uint8_t *base = make_file(hdr, 23, -1, &len);
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_buffer(base, len, "base", &st));
    ASSERT_EQ_INT(4, mq_st_count(st));
    mq_st_close(st);
    static const char pool[] = "{}[],:\"0123456789-.e ";
    int n_ok = 0, n_bad = 0;
    g_rng = 12345;
    for (int iter = 0; iter < 4000; iter++) {
        size_t n = len;
        uint8_t *m = malloc(len + 8);
        memcpy(m, base, len);
        int edits = 1 + (int)(rnd() % 3);
        for (int e = 0; e < edits; e++) {
            if (n == 0) break;
            uint32_t kind = rnd() % 10, at = (uint32_t)(rnd() % n);
            if (kind < 5) m[at] = (uint8_t)pool[rnd() % (sizeof pool - 1)];   /* JSON-ish */
            else if (kind < 7) m[at] ^= (uint8_t)(1u << (rnd() % 8));
            else if (kind < 8) m[rnd() % 8] = (uint8_t)rnd();                 /* length field */
            else n = at;                                                         /* truncate */
        }
        uint8_t *exact = malloc(n ? n : 1);
        memcpy(exact, m, n);
        free(m);
        moeq_status s = mq_st_open_buffer(exact, n, "mut", &st);
        if (s == MOEQ_OK) {
            n_ok++;
            unsigned sum = 0;
            for (size_t i = 0; i < mq_st_count(st); i++) {
                const mq_tensor_view *v = mq_st_at(st, i);
                if (v->nbytes && (v->data < exact || v->data + v->nbytes > exact + n))
                    FAIL("mutation %d: tensor '%s' outside the buffer", iter, v->name);
                for (size_t k = 0; k < v->nbytes; k++) sum += v->data[k];
            }
            (void)sum;
            mq_st_close(st);
        } else {
            n_bad++;
            if (s != MOEQ_E_FORMAT) FAIL("mutation %d: %s: %s", iter, moeq_status_name(s),
                                         moeq_last_error());
            if (!strstr(moeq_last_error(), "mut")) FAIL("message '%s' lacks the label",
                                                        moeq_last_error());
        }
        free(exact);
    }
    free(base);
    /* Both outcomes must occur, or the mutator is not exercising the reader. */
    ASSERT_TRUE(n_ok > 50);
    ASSERT_TRUE(n_bad > 1000);
}

/* ---- conversion --------------------------------------------------------------------------- */

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static mq_tensor_view view_of(moeq_dtype dt, const void *data, int64_t n) {
    mq_tensor_view v;
    memset(&v, 0, sizeof v);
    v.name = "t";
    v.file = "mem";
    v.dtype = dt;
    v.ndim = 1;
    v.shape[0] = n;
    v.numel = n;
    v.data = data;
    v.nbytes = (size_t)n * moeq_dtype_size(dt);
    return v;
}

static void test_to_f32(void) {
    /* Hand-made bit patterns with known values; stored at an odd address to check unaligned
     * loads. */
    static const uint16_t f16[] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x8400, 0x3555, 0x7c00, 0x0000};
    static const float f16_want[] = {1.0f, -2.0f, 65504.0f, 0x1p-24f, -0x1p-14f,
                                     0.333251953125f, INFINITY, 0.0f};
    static const uint16_t bf16[] = {0x3f80, 0xc0a0, 0x0001, 0x7f7f, 0xff80, 0x3eab};
    static const float bf16_want[] = {1.0f, -5.0f, 0x1p-133f, 0x1.fep127f, -INFINITY,
                                      0.333984375f};
    static const double f64[] = {1.5, -1e-3, 3.0e38, 1e-50};
    uint8_t buf[64 + 1];
    float out[16];

    memcpy(buf + 1, f16, sizeof f16);
    mq_tensor_view v = view_of(MOEQ_DT_F16, buf + 1, 8);
    ASSERT_OK(mq_tensor_to_f32(&v, out));
    for (int i = 0; i < 8; i++) ASSERT_EQ_HEX(fbits(f16_want[i]), fbits(out[i]));

    memcpy(buf + 1, bf16, sizeof bf16);
    v = view_of(MOEQ_DT_BF16, buf + 1, 6);
    ASSERT_OK(mq_tensor_to_f32(&v, out));
    for (int i = 0; i < 6; i++) ASSERT_EQ_HEX(fbits(bf16_want[i]), fbits(out[i]));

    /* longer than a vector step, every length to 40 at an odd address: bit for bit the
     * scalar conversion (the value's bits as a float's high half) */
    uint16_t hb[40];
    uint8_t raw[2 * 40 + 1];
    float got[40];
    uint32_t x = 777;
    for (int i = 0; i < 40; i++) {
        x = x * 1664525u + 1013904223u;
        hb[i] = (uint16_t)(x >> 16);
    }
    memcpy(raw + 1, hb, sizeof hb);
    for (int n = 0; n <= 40; n++) {
        memset(got, 0xAA, sizeof got);
        v = view_of(MOEQ_DT_BF16, raw + 1, n);
        ASSERT_OK(mq_tensor_to_f32(&v, got));
        for (int i = 0; i < n; i++) ASSERT_EQ_HEX((uint32_t)hb[i] << 16, fbits(got[i]));
        for (int i = n; i < 40; i++) ASSERT_EQ_HEX(0xAAAAAAAAu, fbits(got[i]));
    }

    memcpy(buf + 1, f64, sizeof f64);
    v = view_of(MOEQ_DT_F64, buf + 1, 4);
    ASSERT_OK(mq_tensor_to_f32(&v, out));
    for (int i = 0; i < 4; i++) ASSERT_EQ_HEX(fbits((float)f64[i]), fbits(out[i]));

    const float f32[] = {1.25f, -0.0f, 7e-40f};
    memcpy(buf + 1, f32, sizeof f32);
    v = view_of(MOEQ_DT_F32, buf + 1, 3);
    ASSERT_OK(mq_tensor_to_f32(&v, out));
    ASSERT_TRUE(memcmp(out, f32, sizeof f32) == 0);

    /* float8_e4m3fn bytes, decoded by hand: 0x38 = 1.0, 0xC0 = -2.0, 0x7E = 448 (max),
     * 0x01 = 2^-9 (smallest subnormal), 0x7F = NaN. */
    const uint8_t e4m3[] = {0x38, 0xC0, 0x7E, 0x01, 0x7F};
    memcpy(buf + 1, e4m3, sizeof e4m3);
    v = view_of(MOEQ_DT_F8_E4M3, buf + 1, 5);
    ASSERT_OK(mq_tensor_to_f32(&v, out));
    ASSERT_NEAR(1.0, out[0], 0);
    ASSERT_NEAR(-2.0, out[1], 0);
    ASSERT_NEAR(448.0, out[2], 0);
    ASSERT_NEAR(0x1p-9, out[3], 0);
    ASSERT_TRUE(out[4] != out[4]);
    v = view_of(MOEQ_DT_I32, buf, 4);
    ASSERT_STATUS(MOEQ_E_UNSUPPORTED, mq_tensor_to_f32(&v, out));
    ASSERT_ERROR_MENTIONS("I32");
}

/* ---- writer ------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    moeq_dtype dt;
    int ndim;
    int64_t shape[3];
} spec;

static const spec k_specs[] = {
    {"w.bf16", MOEQ_DT_BF16, 2, {3, 5}},  {"x.f32", MOEQ_DT_F32, 2, {2, 3}},
    {"scalar", MOEQ_DT_F64, 0, {0}},      {"empty", MOEQ_DT_F16, 2, {0, 4}},
    {"ids", MOEQ_DT_I64, 1, {7}},         {"mask", MOEQ_DT_BOOL, 1, {5}},
    {"bytes", MOEQ_DT_U8, 1, {3}},        {"i8", MOEQ_DT_I8, 3, {1, 1, 3}},
    {"i16", MOEQ_DT_I16, 1, {3}},         {"u16", MOEQ_DT_U16, 1, {1}},
    {"e4m3", MOEQ_DT_F8_E4M3, 2, {2, 2}}, {"e5m2", MOEQ_DT_F8_E5M2, 1, {1}},
    {"i32", MOEQ_DT_I32, 1, {3}},         {"u32", MOEQ_DT_U32, 1, {1}},
    {"u64", MOEQ_DT_U64, 1, {2}},         {"a\"quote\\", MOEQ_DT_F32, 1, {1}},
    {"zero.i32", MOEQ_DT_I32, 1, {0}},
};
#define N_SPECS (sizeof k_specs / sizeof k_specs[0])

static size_t spec_bytes(const spec *s) {
    size_t n = moeq_dtype_size(s->dt);
    for (int d = 0; d < s->ndim; d++) n *= (size_t)s->shape[d];
    return n;
}

static void test_writer_roundtrip(void) {
    const char *dir = mq_test_tmpdir();
    char *path = join(dir, "rt.safetensors");
    uint8_t *payload[N_SPECS];
    mq_st_writer *w = mq_stw_new();
    ASSERT_TRUE(w != NULL);
    g_rng = 7;
    size_t total = 0;
    /* Added in an order unrelated to the file order. */
    for (size_t i = 0; i < N_SPECS; i++) {
        size_t nb = spec_bytes(&k_specs[i]);
        payload[i] = malloc(nb + 1);
        fill(payload[i], nb);
        total += nb;
        ASSERT_OK(mq_stw_add(w, k_specs[i].name, k_specs[i].dt, k_specs[i].ndim, k_specs[i].shape,
                             payload[i], nb));
    }
    ASSERT_OK(mq_stw_set_metadata(w, "source", "moeq test"));
    ASSERT_EQ_INT(N_SPECS, mq_stw_count(w));
    ASSERT_EQ_INT(total, mq_stw_data_bytes(w));
    ASSERT_OK(mq_stw_write(w, path));
    mq_stw_free(w);

    size_t len;
    uint8_t *file = read_bytes(path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | file[i];
    ASSERT_EQ_INT(0, hlen % 8);
    ASSERT_EQ_INT(len, 8 + hlen + total);
    const char *want_start = "{\"__metadata__\":{\"format\":\"pt\",\"source\":\"moeq test\"},";
    ASSERT_TRUE(memcmp(file + 8, want_start, strlen(want_start)) == 0);
    /* Padding is spaces after the closing brace. */
    size_t last = 8 + (size_t)hlen - 1;
    while (file[last] == ' ') last--;
    ASSERT_EQ_INT('}', file[last]);
    ASSERT_TRUE(8 + hlen - 1 - last < 8);

    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_buffer(file, len, path, &st));
    ASSERT_EQ_INT(N_SPECS, mq_st_count(st));
    ASSERT_EQ_STR("pt", mq_st_metadata(st, "format"));
    ASSERT_EQ_STR("moeq test", mq_st_metadata(st, "source"));
    const uint8_t *data0 = file + 8 + hlen;
    size_t prev_off = 0, prev_size = 8;
    for (size_t i = 0; i < N_SPECS; i++) {
        const spec *s = &k_specs[i];
        const mq_tensor_view *v = mq_st_find(st, s->name);
        if (!v) FAIL("tensor '%s' missing after the round trip", s->name);
        ASSERT_EQ_INT(s->dt, v->dtype);
        ASSERT_EQ_INT(s->ndim, v->ndim);
        for (int d = 0; d < s->ndim; d++) ASSERT_EQ_INT(s->shape[d], v->shape[d]);
        ASSERT_EQ_INT(spec_bytes(s), v->nbytes);
        ASSERT_TRUE(v->nbytes == 0 || memcmp(v->data, payload[i], v->nbytes) == 0);
        /* natural alignment of every tensor in the file */
        size_t off = (size_t)(v->data - file);
        if (off % moeq_dtype_size(s->dt) != 0)
            FAIL("tensor '%s' at file offset %zu is not %zu-aligned", s->name, off,
                 moeq_dtype_size(s->dt));
    }
    /* File order: walking the data in offset order, element sizes never grow. */
    for (size_t pos = 0; pos < total;) {
        const mq_tensor_view *next = NULL;
        for (size_t i = 0; i < mq_st_count(st); i++) {
            const mq_tensor_view *v = mq_st_at(st, i);
            if ((size_t)(v->data - data0) == pos && v->nbytes) next = v;
        }
        if (!next) FAIL("no tensor starts at data offset %zu", pos);
        ASSERT_TRUE(moeq_dtype_size(next->dtype) <= prev_size);
        prev_size = moeq_dtype_size(next->dtype);
        prev_off = pos;
        pos += next->nbytes;
    }
    (void)prev_off;
    mq_st_close(st);
    /* Reading the file from disk agrees with the buffer. */
    ASSERT_OK(mq_st_open_file(path, &st));
    ASSERT_EQ_INT(N_SPECS, mq_st_count(st));
    ASSERT_EQ_STR(path, mq_st_find(st, "ids")->file);
    mq_st_close(st);
    free(file);
    for (size_t i = 0; i < N_SPECS; i++) free(payload[i]);
    /* nothing but the output in the directory (the temporary name is gone) */
    ASSERT_EQ_INT(1, count_dir_entries(dir));
}

/* The reference writer's exact layout: rewriting a fixture written by Python safetensors gives
 * the same bytes. */
static void test_writer_matches_reference_bytes(void) {
    char src[1024];
    snprintf(src, sizeof src, "%s/model.safetensors", mq_test_model("olmoe-tiny"));
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_file(src, &st));
    mq_st_writer *w = mq_stw_new();
    /* Added in reverse order: the writer must sort. */
    for (size_t i = mq_st_count(st); i-- > 0;) {
        const mq_tensor_view *v = mq_st_at(st, i);
        ASSERT_OK(mq_stw_add(w, v->name, v->dtype, v->ndim, v->shape, v->data, v->nbytes));
    }
    char *out = join(mq_test_tmpdir(), "copy.safetensors");
    ASSERT_OK(mq_stw_write(w, out));
    mq_stw_free(w);
    mq_st_close(st);
    size_t na, nb;
    uint8_t *a = read_bytes(src, &na), *b = read_bytes(out, &nb);
    ASSERT_EQ_INT(na, nb);
    size_t diff = 0;
    while (diff < na && a[diff] == b[diff]) diff++;
    if (diff != na) FAIL("rewrite differs from the reference file at byte %zu", diff);
    free(a);
    free(b);
}

static void test_writer_rejects(void) {
    mq_st_writer *w = mq_stw_new();
    float x[4] = {0};
    int64_t s2[2] = {2, 2}, s3[1] = {3}, neg[1] = {-1};
    int64_t s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    ASSERT_OK(mq_stw_add(w, "a", MOEQ_DT_F32, 2, s2, x, sizeof x));
    ASSERT_STATUS(MOEQ_E_EXISTS, mq_stw_add(w, "a", MOEQ_DT_F32, 2, s2, x, sizeof x));
    ASSERT_ERROR_MENTIONS("'a'");
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_stw_add(w, "b", MOEQ_DT_F32, 1, s3, x, sizeof x));
    ASSERT_ERROR_MENTIONS("'b'");
    ASSERT_ERROR_MENTIONS("needs 12 bytes, got 16");
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_stw_add(w, "c", MOEQ_DT_BF16, 2, s2, x, sizeof x));
    ASSERT_ERROR_MENTIONS("'c'");
    ASSERT_STATUS(MOEQ_E_SHAPE, mq_stw_add(w, "d", MOEQ_DT_F32, 1, neg, x, 0));
    ASSERT_ERROR_MENTIONS("negative");
    ASSERT_STATUS(MOEQ_E_ARG, mq_stw_add(w, "e", MOEQ_DT_U8, 9, s9, x, 1));
    ASSERT_ERROR_MENTIONS("'e'");
    ASSERT_STATUS(MOEQ_E_ARG, mq_stw_add(w, "__metadata__", MOEQ_DT_U8, 0, NULL, x, 1));
    ASSERT_STATUS(MOEQ_E_ARG, mq_stw_add(w, "", MOEQ_DT_U8, 0, NULL, x, 1));
    ASSERT_STATUS(MOEQ_E_ARG, mq_stw_add(w, "f", MOEQ_DT_COUNT, 0, NULL, x, 1));
    ASSERT_STATUS(MOEQ_E_ARG, mq_stw_add(w, "g", MOEQ_DT_U8, 1, s3, NULL, 3));
    /* The owned variant frees the buffer on error too (a leak here shows under ASan). */
    void *owned = mq_alloc(16, "test");
    ASSERT_STATUS(MOEQ_E_EXISTS, mq_stw_add_owned(w, "a", MOEQ_DT_F32, 2, s2, owned, 16));
    owned = mq_alloc(16, "test");
    ASSERT_OK(mq_stw_add_owned(w, "h", MOEQ_DT_F32, 2, s2, owned, 16));
    ASSERT_EQ_INT(2, mq_stw_count(w));
    ASSERT_EQ_INT(32, mq_stw_data_bytes(w));
    /* Writing into a missing directory fails cleanly with the path. */
    ASSERT_STATUS(MOEQ_E_IO, mq_stw_write(w, "/nonexistent-moeq-dir/x.safetensors"));
    ASSERT_ERROR_MENTIONS("/nonexistent-moeq-dir/x.safetensors");
    mq_stw_free(w);
}

/* Many tensors: find() must locate every one (sorted table + binary search). */
static void test_many_tensors(void) {
    const char *dir = mq_test_tmpdir();
    mq_st_writer *w = mq_stw_new();
    const int n = 20000;
    char name[64];
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w", i / 64, i % 64);
        int32_t v = i * 3 + 1;
        int64_t one = 1;
        ASSERT_OK(mq_stw_add(w, name, MOEQ_DT_I32, 1, &one, &v, 4));
    }
    char *path = join(dir, "many.safetensors");
    ASSERT_OK(mq_stw_write(w, path));
    mq_stw_free(w);
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_file(path, &st));
    ASSERT_EQ_INT(n, mq_st_count(st));
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w", i / 64, i % 64);
        const mq_tensor_view *v = mq_st_find(st, name);
        if (!v) FAIL("'%s' not found", name);
        int32_t got;
        memcpy(&got, v->data, 4);
        ASSERT_EQ_INT(i * 3 + 1, got);
    }
    for (size_t i = 1; i < mq_st_count(st); i++)
        ASSERT_TRUE(strcmp(mq_st_at(st, i - 1)->name, mq_st_at(st, i)->name) < 0);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.mlp.experts.64.w") == NULL);
    mq_st_close(st);
}

/* ---- sharded checkpoints: reader errors --------------------------------------------------- */

/* Writes a shard holding F32 [1] tensors named in the NULL-terminated list, value = index. */
static void write_shard(const char *dir, const char *file, const char *const *names) {
    mq_st_writer *w = mq_stw_new();
    int64_t one = 1;
    for (int i = 0; names[i]; i++) {
        float v = (float)i;
        ASSERT_OK(mq_stw_add(w, names[i], MOEQ_DT_F32, 1, &one, &v, 4));
    }
    ASSERT_OK(mq_stw_write(w, join(dir, file)));
    mq_stw_free(w);
}

static void write_index(const char *dir, const char *text) {
    write_bytes(join(dir, "model.safetensors.index.json"), text, strlen(text));
}

typedef struct {
    const char *what;
    const char *index;
    moeq_status st;
    const char *m1, *m2;
} bad_index;

static void test_sharded_errors(void) {
    static const char *const s1[] = {"a", "b", NULL};
    static const char *const s2[] = {"c", "a2", NULL};
    static const char *const s3[] = {"c", NULL};   /* c again: in two shards */
    static const bad_index cases[] = {
        {"missing shard",
         "{\"weight_map\":{\"a\":\"s1.safetensors\",\"z\":\"model-00009-of-00009.safetensors\"}}",
         MOEQ_E_FORMAT, "model-00009-of-00009.safetensors", "missing"},
        {"tensor absent from its shard",
         "{\"weight_map\":{\"a\":\"s1.safetensors\",\"nothere\":\"s1.safetensors\"}}",
         MOEQ_E_FORMAT, "'nothere'", "'s1.safetensors', which does not contain it"},
        {"tensor in another shard",
         "{\"weight_map\":{\"a\":\"s2.safetensors\",\"b\":\"s1.safetensors\"}}",
         MOEQ_E_FORMAT, "'a'", "stored in 's1.safetensors'"},
        {"index not JSON", "{\"weight_map\": {\"a\": \"s1.safetensors\"", MOEQ_E_FORMAT,
         "model.safetensors.index.json", "not valid JSON"},
        {"index not an object", "[1,2]", MOEQ_E_FORMAT, "model.safetensors.index.json",
         "not a JSON object"},
        {"weight_map not an object", "{\"weight_map\":[\"s1.safetensors\"]}", MOEQ_E_FORMAT,
         "model.safetensors.index.json", "weight_map is not a JSON object"},
        {"no weight_map", "{\"metadata\":{}}", MOEQ_E_FORMAT, "model.safetensors.index.json",
         "no weight_map"},
        {"weight_map value not a string", "{\"weight_map\":{\"a\":1}}", MOEQ_E_FORMAT, "'a'",
         "not a file name"},
        {"shard outside the directory", "{\"weight_map\":{\"a\":\"../s1.safetensors\"}}",
         MOEQ_E_FORMAT, "'a'", "not a plain file name"},
        {"tensor listed twice",
         "{\"weight_map\":{\"a\":\"s1.safetensors\",\"a\":\"s1.safetensors\"}}", MOEQ_E_FORMAT,
         "'a'", "twice"},
        {"tensor in two shards",
         "{\"weight_map\":{\"c\":\"s2.safetensors\",\"x\":\"s3.safetensors\"}}", MOEQ_E_FORMAT,
         "'c'", "s2.safetensors and s3.safetensors"},
        {"corrupt shard", "{\"weight_map\":{\"a\":\"s1.safetensors\",\"q\":\"bad.safetensors\"}}",
         MOEQ_E_FORMAT, "bad.safetensors", "header length"},
    };
    const char *dir = mq_test_tmpdir();
    write_shard(dir, "s1.safetensors", s1);
    write_shard(dir, "s2.safetensors", s2);
    write_shard(dir, "s3.safetensors", s3);
    write_bytes(join(dir, "bad.safetensors"), "\x40\0\0\0\0\0\0\0{}", 10);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_index(dir, cases[i].index);
        mq_st *st = NULL;
        moeq_status s = mq_st_open_dir(dir, &st);
        if (s != cases[i].st) {
            mq_st_close(st);
            FAIL("%s: expected %s, got %s (%s)", cases[i].what, moeq_status_name(cases[i].st),
                 moeq_status_name(s), moeq_last_error());
        }
        if (!strstr(moeq_last_error(), cases[i].m1) || !strstr(moeq_last_error(), cases[i].m2))
            FAIL("%s: message \"%s\" lacks \"%s\" / \"%s\"", cases[i].what, moeq_last_error(),
                 cases[i].m1, cases[i].m2);
    }
    /* A valid index; a shard may hold tensors the map does not list (accepted, visible once). */
    write_index(dir, "{\"metadata\":{\"total_size\":16},\"weight_map\":{\"a\":\"s1.safetensors\","
                     "\"c\":\"s2.safetensors\"}}");
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(dir, &st));
    ASSERT_EQ_INT(4, mq_st_count(st));   /* a, b (s1) + c, a2 (s2) */
    ASSERT_TRUE(mq_st_find(st, "b") != NULL);
    ASSERT_TRUE(strstr(mq_st_find(st, "c")->file, "s2.safetensors") != NULL);
    float v;
    ASSERT_OK(mq_tensor_to_f32(mq_st_find(st, "a2"), &v));
    ASSERT_EQ_INT(1, (int)v);
    ASSERT_TRUE(mq_st_find(st, "x") == NULL);
    mq_st_close(st);
}

static void test_open_dir_fallbacks(void) {
    static const char *const one[] = {"t", NULL};
    mq_st *st = NULL;
    const char *dir = mq_test_tmpdir();
    ASSERT_STATUS(MOEQ_E_NOTFOUND, mq_st_open_dir(dir, &st));
    ASSERT_ERROR_MENTIONS(dir);
    write_shard(dir, "weights.safetensors", one);   /* the single *.safetensors file */
    ASSERT_OK(mq_st_open_dir(dir, &st));
    ASSERT_EQ_INT(1, mq_st_count(st));
    mq_st_close(st);
    write_shard(dir, "other.safetensors", one);
    ASSERT_STATUS(MOEQ_E_FORMAT, mq_st_open_dir(dir, &st));
    ASSERT_ERROR_MENTIONS("no model.safetensors.index.json");
    static const char *const two[] = {"u", "v", NULL};
    write_shard(dir, "model.safetensors", two);   /* model.safetensors wins */
    ASSERT_OK(mq_st_open_dir(dir, &st));
    ASSERT_EQ_INT(2, mq_st_count(st));
    mq_st_close(st);
    ASSERT_STATUS(MOEQ_E_IO, mq_st_open_dir(join(dir, "nodir"), &st));
    ASSERT_ERROR_MENTIONS("nodir");
}

/* ---- shard writer ------------------------------------------------------------------------- */

static void test_shard_writer(void) {
    const char *dir = mq_test_tmpdir();
    mq_shard_writer *sw = NULL;
    ASSERT_OK(mq_shards_open(dir, 200, &sw));
    float vals[64];
    int64_t s16 = 16, s64 = 64, s0 = 0;
    /* z (0 B), t0..t9 (64 B each), big (256 B): with a 200-byte limit the shards are
     * {z,t0,t1,t2} {t3,t4,t5} {t6,t7,t8} {t9} {big}. */
    ASSERT_OK(mq_shards_add(sw, "z", MOEQ_DT_F32, 1, &s0, NULL, 0));
    char name[32];
    for (int i = 0; i < 10; i++) {
        for (int k = 0; k < 16; k++) vals[k] = (float)(i * 100 + k);
        snprintf(name, sizeof name, "t%d", i);
        ASSERT_OK(mq_shards_add(sw, name, MOEQ_DT_F32, 1, &s16, vals, 64));
    }
    ASSERT_STATUS(MOEQ_E_EXISTS, mq_shards_add(sw, "t3", MOEQ_DT_F32, 1, &s16, vals, 64));
    ASSERT_ERROR_MENTIONS("'t3'");
    for (int k = 0; k < 64; k++) vals[k] = (float)(-k);
    float *big = mq_alloc(256, "big");
    memcpy(big, vals, 256);
    ASSERT_OK(mq_shards_add_owned(sw, "big", MOEQ_DT_F32, 1, &s64, big, 256));
    /* Flushed shards sit under temporary names until finish. */
    ASSERT_FALSE(mq_file_exists(join(dir, "model-00001-of-00005.safetensors")));
    ASSERT_OK(mq_shards_finish(sw));
    mq_shards_free(sw);

    static const char *const expect_shard[] = {"t0", "1", "t1", "1", "t2", "1", "t3", "2",
                                               "t4", "2", "t5", "2", "t6", "3", "t7", "3",
                                               "t8", "3", "t9", "4", "big", "5", "z", "1"};
    ASSERT_EQ_INT(6, count_dir_entries(dir));   /* 5 shards + index, no temporaries */
    size_t ilen;
    char *itext = (char *)read_bytes(join(dir, "model.safetensors.index.json"), &ilen);
    cJSON *idx = cJSON_Parse(itext);
    ASSERT_TRUE(idx != NULL);
    cJSON *ts = cJSON_GetObjectItem(cJSON_GetObjectItem(idx, "metadata"), "total_size");
    ASSERT_TRUE(cJSON_IsNumber(ts));
    ASSERT_EQ_INT(10 * 64 + 256, (long long)ts->valuedouble);
    cJSON *wm = cJSON_GetObjectItem(idx, "weight_map");
    ASSERT_EQ_INT(12, cJSON_GetArraySize(wm));
    const char *prev = "";
    for (cJSON *e = wm->child; e; e = e->next) {   /* sorted by name */
        ASSERT_TRUE(strcmp(prev, e->string) < 0);
        prev = e->string;
    }
    for (size_t i = 0; i < sizeof expect_shard / sizeof expect_shard[0]; i += 2) {
        char want[64];
        snprintf(want, sizeof want, "model-0000%s-of-00005.safetensors", expect_shard[i + 1]);
        cJSON *e = cJSON_GetObjectItem(wm, expect_shard[i]);
        if (!cJSON_IsString(e)) FAIL("weight_map lacks '%s'", expect_shard[i]);
        ASSERT_EQ_STR(want, e->valuestring);
    }
    cJSON_Delete(idx);
    free(itext);

    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(dir, &st));
    ASSERT_EQ_INT(12, mq_st_count(st));
    for (int i = 0; i < 10; i++) {
        snprintf(name, sizeof name, "t%d", i);
        const mq_tensor_view *v = mq_st_find(st, name);
        ASSERT_TRUE(v != NULL);
        float got[16];
        ASSERT_OK(mq_tensor_to_f32(v, got));
        for (int k = 0; k < 16; k++) ASSERT_EQ_INT(i * 100 + k, (int)got[k]);
    }
    const mq_tensor_view *v = mq_st_find(st, "big");
    ASSERT_TRUE(strstr(v->file, "model-00005-of-00005.safetensors") != NULL);
    ASSERT_TRUE(memcmp(v->data, vals, 256) == 0);
    ASSERT_EQ_INT(0, mq_st_find(st, "z")->numel);
    ASSERT_EQ_STR("pt", mq_st_metadata(st, "format"));
    mq_st_close(st);
}

static void test_shard_writer_single(void) {
    const char *dir = mq_test_tmpdir();
    /* A stale index from an earlier sharded write must not shadow the new single file. */
    write_index(dir, "{\"weight_map\":{\"old\":\"model-00001-of-00002.safetensors\"}}");
    mq_shard_writer *sw = NULL;
    ASSERT_OK(mq_shards_open(dir, 0, &sw));   /* 0: no limit */
    uint16_t h[3] = {0x3f80, 0x4000, 0x4040};
    int64_t s3 = 3;
    ASSERT_OK(mq_shards_add(sw, "w", MOEQ_DT_BF16, 1, &s3, h, 6));
    ASSERT_OK(mq_shards_add(sw, "s", MOEQ_DT_BF16, 0, NULL, h, 2));
    ASSERT_OK(mq_shards_finish(sw));
    mq_shards_free(sw);
    ASSERT_EQ_INT(1, count_dir_entries(dir));
    ASSERT_TRUE(mq_file_exists(join(dir, "model.safetensors")));
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(dir, &st));
    ASSERT_EQ_INT(2, mq_st_count(st));
    float f[3];
    ASSERT_OK(mq_tensor_to_f32(mq_st_find(st, "w"), f));
    ASSERT_EQ_INT(3, (int)f[2]);
    mq_st_close(st);
}

static void test_shard_writer_abandoned(void) {
    const char *dir = mq_test_tmpdir();
    mq_shard_writer *sw = NULL;
    ASSERT_OK(mq_shards_open(dir, 100, &sw));
    uint8_t buf[80] = {0};
    int64_t s80 = 80;
    char name[16];
    for (int i = 0; i < 5; i++) {
        snprintf(name, sizeof name, "x%d", i);
        ASSERT_OK(mq_shards_add(sw, name, MOEQ_DT_U8, 1, &s80, buf, 80));
    }
    ASSERT_EQ_INT(4, count_dir_entries(dir));   /* four flushed temporaries so far */
    mq_shards_free(sw);                         /* never finished: everything goes */
    ASSERT_EQ_INT(0, count_dir_entries(dir));
    ASSERT_STATUS(MOEQ_E_IO, mq_shards_open(join(dir, "missing"), 100, &sw));
    ASSERT_ERROR_MENTIONS("missing");
}

/* ---- fixtures ----------------------------------------------------------------------------- */

/* bf16 -> float from the bit fields, independent of the library's shift trick. */
static float decode_bf16_slow(uint16_t h) {
    int sign = h >> 15, exp = (h >> 7) & 0xff, man = h & 0x7f;
    double v;
    if (exp == 0xff) v = man ? NAN : INFINITY;
    else if (exp == 0) v = ldexp((double)man, -126 - 7);
    else v = ldexp(1.0 + man / 128.0, exp - 127);
    return (float)(sign ? -v : v);
}

static void check_model(const char *model, size_t n_tensors, bool has_lm_head, uint16_t emb0) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", mq_test_model(model));
    mq_st *st = NULL;
    ASSERT_OK(mq_st_open_dir(dir, &st));
    ASSERT_EQ_INT(n_tensors, mq_st_count(st));
    ASSERT_EQ_STR("pt", mq_st_metadata(st, "format"));
    const mq_tensor_view *emb = mq_st_find(st, "model.embed_tokens.weight");
    ASSERT_TRUE(emb != NULL);
    ASSERT_EQ_INT(MOEQ_DT_BF16, emb->dtype);
    ASSERT_EQ_INT(2, emb->ndim);
    ASSERT_EQ_INT(4096, emb->shape[0]);
    ASSERT_EQ_INT(256, emb->shape[1]);
    uint16_t first;
    memcpy(&first, emb->data, 2);
    ASSERT_EQ_HEX(emb0, first);   /* read from the file with Python */
    ASSERT_EQ_INT(has_lm_head, mq_st_find(st, "lm_head.weight") != NULL);
    const mq_tensor_view *norm = mq_st_find(st, "model.layers.3.post_attention_layernorm.weight");
    ASSERT_TRUE(norm != NULL);
    ASSERT_EQ_INT(1, norm->ndim);
    ASSERT_EQ_INT(256, norm->shape[0]);
    for (size_t i = 0; i < mq_st_count(st); i++)
        ASSERT_EQ_INT(MOEQ_DT_BF16, mq_st_at(st, i)->dtype);

    float *f = malloc((size_t)emb->numel * sizeof *f);
    ASSERT_OK(mq_tensor_to_f32(emb, f));
    for (int64_t i = 0; i < emb->numel; i++) {
        uint16_t h;
        memcpy(&h, emb->data + 2 * i, 2);
        float want = decode_bf16_slow(h);
        if (memcmp(&want, &f[i], 4) != 0) {
            float got = f[i];
            free(f);
            FAIL("%s: element %lld: 0x%04x -> %.9g, want %.9g", model, (long long)i, h, got,
                 want);
        }
    }
    free(f);
    mq_st_close(st);
}

/* olmoe-tiny: the shared fixture or the bundled copy. */
static void test_fixture_model_olmoe(void) { check_model("olmoe-tiny", 135, true, 0xbc32); }

static void test_fixture_models(void) {
    check_model("qwen2moe-tiny", 155, true, 0x3d3c);
    check_model("llama-tiny", 38, false, 0xbcda);
    mq_st *st = NULL;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", mq_test_shared("fixtures/models/qwen2moe-tiny"));
    ASSERT_OK(mq_st_open_dir(dir, &st));
    const mq_tensor_view *g = mq_st_find(st, "model.layers.0.mlp.shared_expert_gate.weight");
    ASSERT_TRUE(g != NULL);
    ASSERT_EQ_INT(1, g->shape[0]);
    ASSERT_EQ_INT(256, g->shape[1]);
    const mq_tensor_view *b = mq_st_find(st, "model.layers.0.self_attn.k_proj.bias");
    ASSERT_TRUE(b != NULL);
    ASSERT_EQ_INT(128, b->shape[0]);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.mlp.experts.7.down_proj.weight") != NULL);
    ASSERT_TRUE(mq_st_find(st, "model.layers.0.mlp.experts.8.down_proj.weight") == NULL);
    mq_st_close(st);
}

static void test_fixture_goldens(void) {
    static const struct {
        const char *model;
        uint32_t logit0, logit1;   /* bits of logits[0,0..1], read with Python */
    } g[] = {
        {"olmoe-tiny", 3214951036u, 3231808512u},
        {"qwen2moe-tiny", 3226564444u, 3238090685u},
        {"llama-tiny", 3214695234u, 3234376595u},
    };
    for (size_t m = 0; m < 3; m++) {
        /* olmoe-tiny's golden is also in tests/data; the others only in the shared folder */
        if (m > 0 && !mq_test_have_shared()) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s", mq_test_model_golden(g[m].model));
        mq_st *st = NULL;
        ASSERT_OK(mq_st_open_file(path, &st));
        ASSERT_EQ_INT(7, mq_st_count(st));   /* input_ids, logits, hidden_states.0..4 */
        ASSERT_EQ_STR("transformers fp32, fresh load", mq_st_metadata(st, "source"));
        ASSERT_TRUE(mq_st_metadata(st, "format") == NULL);
        const mq_tensor_view *ids = mq_st_find(st, "input_ids");
        ASSERT_TRUE(ids != NULL);
        ASSERT_EQ_INT(MOEQ_DT_I32, ids->dtype);
        ASSERT_EQ_INT(1, ids->ndim);
        ASSERT_EQ_INT(128, ids->shape[0]);
        int32_t first[4];
        memcpy(first, ids->data, sizeof first);
        ASSERT_EQ_INT(222, first[0]);
        ASSERT_EQ_INT(30, first[1]);
        ASSERT_EQ_INT(326, first[2]);
        ASSERT_EQ_INT(318, first[3]);
        const mq_tensor_view *lg = mq_st_find(st, "logits");
        ASSERT_EQ_INT(MOEQ_DT_F32, lg->dtype);
        ASSERT_EQ_INT(2, lg->ndim);
        ASSERT_EQ_INT(128, lg->shape[0]);
        ASSERT_EQ_INT(4096, lg->shape[1]);
        float *f = malloc((size_t)lg->numel * sizeof *f);
        ASSERT_OK(mq_tensor_to_f32(lg, f));
        uint32_t b0, b1;
        memcpy(&b0, &f[0], 4);
        memcpy(&b1, &f[1], 4);
        free(f);
        ASSERT_EQ_HEX(g[m].logit0, b0);
        ASSERT_EQ_HEX(g[m].logit1, b1);
        const mq_tensor_view *hs = mq_st_find(st, "hidden_states.4");
        ASSERT_TRUE(hs != NULL);
        ASSERT_EQ_INT(256, hs->shape[1]);
        mq_st_close(st);
    }
}

TEST_MAIN(T(test_dtype_names), T(test_corrupt_table), T(test_corrupt_file_path),
          T(test_deep_nesting), T(test_accepts_edge_cases), T(test_mutations_never_crash),
          T(test_to_f32), T(test_writer_roundtrip), T(test_writer_matches_reference_bytes),
          T(test_writer_rejects), T(test_many_tensors), T(test_sharded_errors),
          T(test_open_dir_fallbacks), T(test_shard_writer), T(test_shard_writer_single),
          T(test_shard_writer_abandoned), T(test_fixture_model_olmoe), T(test_fixture_models),
          T(test_fixture_goldens))
