/*
 * GGUF v3 reading and writing, and the block codecs of the ggml types (layouts in gguf.h). The
 * reader parses field by field from a (buf, len) image with a cursor that refuses to move past
 * the end, so a corrupt or truncated file is an error naming the field; nothing is read through
 * a struct cast. The writer takes every KV and tensor shape up front, writes the header, then
 * takes the tensors' bytes in order (streamed: the caller never holds more than it produces).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "io/gguf.h"

/* ---- types -------------------------------------------------------------------------------- */

static const char *const vtype_names[] = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32",
                                          "FLOAT32", "BOOL", "STRING", "ARRAY", "UINT64", "INT64",
                                          "FLOAT64"};

const char *mq_gguf_vtype_name(uint32_t t) {
    return t < sizeof vtype_names / sizeof vtype_names[0] ? vtype_names[t] : "unknown";
}

/* Size of a fixed-size value type; 0 for STRING, ARRAY and unknown types. */
static size_t vtype_size(uint32_t t) {
    switch (t) {
    case MQ_GGUF_U8: case MQ_GGUF_I8: case MQ_GGUF_BOOL: return 1;
    case MQ_GGUF_U16: case MQ_GGUF_I16: return 2;
    case MQ_GGUF_U32: case MQ_GGUF_I32: case MQ_GGUF_F32: return 4;
    case MQ_GGUF_U64: case MQ_GGUF_I64: case MQ_GGUF_F64: return 8;
    }
    return 0;
}

typedef struct {
    uint32_t type;
    const char *name;
    int64_t block;
    size_t bytes;
} type_row;

static const type_row type_rows[] = {
    {MQ_GGML_F32, "f32", 1, 4},       {MQ_GGML_F16, "f16", 1, 2},
    {MQ_GGML_Q4_0, "q4_0", 32, 18},   {MQ_GGML_Q4_1, "q4_1", 32, 20},
    {MQ_GGML_Q5_0, "q5_0", 32, 22},   {MQ_GGML_Q5_1, "q5_1", 32, 24},
    {MQ_GGML_Q8_0, "q8_0", 32, 34},   {MQ_GGML_Q3_K, "q3_K", 256, 110},
    {MQ_GGML_Q4_K, "q4_K", 256, 144},
    {MQ_GGML_Q5_K, "q5_K", 256, 176}, {MQ_GGML_Q6_K, "q6_K", 256, 210},
    {MQ_GGML_IQ4_NL, "iq4_nl", 32, 18}, {MQ_GGML_IQ4_XS, "iq4_xs", 256, 136},
    {MQ_GGML_BF16, "bf16", 1, 2},     {MQ_GGML_NVFP4, "nvfp4", 64, 36},
};

bool mq_ggml_type_info(uint32_t type, const char **name, int64_t *block, size_t *block_bytes) {
    for (size_t i = 0; i < sizeof type_rows / sizeof type_rows[0]; i++) {
        if (type_rows[i].type != type) continue;
        if (name) *name = type_rows[i].name;
        if (block) *block = type_rows[i].block;
        if (block_bytes) *block_bytes = type_rows[i].bytes;
        return true;
    }
    if (name) *name = "unknown";
    if (block) *block = 0;
    if (block_bytes) *block_bytes = 0;
    return false;
}

/* ---- little-endian helpers ------------------------------------------------------------------ */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static float f32_of(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* ---- reader ------------------------------------------------------------------------------- */

struct mq_gguf {
    mq_map map;
    bool mapped;
    char *label;
    uint32_t version, alignment;
    uint64_t data_offset;
    size_t n_kv, n_tensors;
    mq_gguf_kv *kv;
    mq_gguf_tensor *tensors;
};

typedef struct {
    const uint8_t *p;
    size_t len, pos;
    const char *label;
} cursor;

static moeq_status need(cursor *c, uint64_t n, const char *what) {
    if (n > c->len - c->pos)
        return mq_err(MOEQ_E_FORMAT, "%s: truncated GGUF: %s needs %llu bytes at offset %zu, the file has %zu",
                      c->label, what, (unsigned long long)n, c->pos, c->len);
    return MOEQ_OK;
}

static moeq_status get_u32(cursor *c, uint32_t *v, const char *what) {
    moeq_status s = need(c, 4, what);
    if (s) return s;
    *v = rd32(c->p + c->pos);
    c->pos += 4;
    return MOEQ_OK;
}

static moeq_status get_u64(cursor *c, uint64_t *v, const char *what) {
    moeq_status s = need(c, 8, what);
    if (s) return s;
    *v = rd64(c->p + c->pos);
    c->pos += 8;
    return MOEQ_OK;
}

/* A GGUF string: its bytes stay in the file. */
static moeq_status get_str(cursor *c, const uint8_t **s, uint64_t *n, const char *what) {
    moeq_status st = get_u64(c, n, what);
    if (!st) st = need(c, *n, what);
    if (st) return st;
    *s = c->p + c->pos;
    c->pos += (size_t)*n;
    return MOEQ_OK;
}

/* A KV key or a tensor name (what): *out its NUL-terminated copy (malloc'd), *n its length; path
 * names the file in the out-of-memory message. */
static moeq_status get_name(cursor *c, const char *what, const char *path, const char **out, uint64_t *n) {
    const uint8_t *s;
    moeq_status st = get_str(c, &s, n, what);
    if (st) return st;
    char *d = malloc((size_t)*n + 1);
    if (!d) return mq_err(MOEQ_E_NOMEM, "out of memory reading %s", path);
    memcpy(d, s, (size_t)*n);
    d[*n] = 0;
    *out = d;
    return MOEQ_OK;
}

void mq_gguf_close(mq_gguf *g) {
    if (!g) return;
    for (size_t i = 0; i < g->n_kv; i++) {
        free((char *)g->kv[i].key);
        free(g->kv[i].str_at);
    }
    for (size_t i = 0; i < g->n_tensors; i++) free((char *)g->tensors[i].name);
    free(g->kv);
    free(g->tensors);
    if (g->mapped) mq_unmap(&g->map);
    free(g->label);
    free(g);
}

/* One KV value of type t at the cursor (arrays: kv gets the element type, count and offsets). */
static moeq_status parse_value(cursor *c, mq_gguf_kv *kv) {
    const char *k = kv->key;
    moeq_status s;
    if (kv->type == MQ_GGUF_STRING) {
        s = get_str(c, &kv->data, &kv->n, k);
        return s ? mq_err_prefix(s, "KV '%s': ", k) : MOEQ_OK;
    }
    if (kv->type == MQ_GGUF_ARRAY) {
        if ((s = get_u32(c, &kv->arr_type, k)) || (s = get_u64(c, &kv->n, k)))
            return mq_err_prefix(s, "KV '%s': ", k);
        if (kv->arr_type == MQ_GGUF_ARRAY)
            return mq_err(MOEQ_E_FORMAT, "%s: KV '%s': nested arrays are not read", c->label, k);
        kv->data = c->p + c->pos;
        if (kv->arr_type == MQ_GGUF_STRING) {
            /* each element needs at least its 8-byte length: bounds the table first */
            if (kv->n > (c->len - c->pos) / 8)
                return mq_err(MOEQ_E_FORMAT, "%s: KV '%s': %llu strings cannot fit in the file",
                              c->label, k, (unsigned long long)kv->n);
            kv->str_at = malloc(((size_t)kv->n + 1) * sizeof *kv->str_at);
            if (!kv->str_at) return mq_err(MOEQ_E_NOMEM, "out of memory reading '%s'", k);
            for (uint64_t i = 0; i < kv->n; i++) {
                const uint8_t *sp;
                uint64_t sn;
                kv->str_at[i] = c->p + c->pos;
                if ((s = get_str(c, &sp, &sn, k)))
                    return mq_err_prefix(s, "KV '%s' element %llu: ", k, (unsigned long long)i);
            }
            kv->str_at[kv->n] = c->p + c->pos;
            return MOEQ_OK;
        }
        size_t es = vtype_size(kv->arr_type);
        if (!es)
            return mq_err(MOEQ_E_FORMAT, "%s: KV '%s': unknown array element type %u", c->label, k,
                          kv->arr_type);
        if (kv->n > (c->len - c->pos) / es)
            return mq_err(MOEQ_E_FORMAT, "%s: truncated GGUF: KV '%s' has %llu elements of %zu bytes, past the end of the file",
                          c->label, k, (unsigned long long)kv->n, es);
        c->pos += (size_t)kv->n * es;
        return MOEQ_OK;
    }
    size_t es = vtype_size(kv->type);
    if (!es) return mq_err(MOEQ_E_FORMAT, "%s: KV '%s': unknown value type %u", c->label, k, kv->type);
    if ((s = need(c, es, k))) return mq_err_prefix(s, "KV '%s': ", k);
    kv->data = c->p + c->pos;
    kv->n = 1;
    c->pos += es;
    return MOEQ_OK;
}

static moeq_status parse(mq_gguf *g, const uint8_t *buf, size_t len) {
    cursor c = {buf, len, 0, g->label};
    const char *L = g->label;
    moeq_status s = need(&c, 4, "the magic");
    if (s) return s;
    if (memcmp(buf, "GGUF", 4) != 0) return mq_err(MOEQ_E_FORMAT, "%s: not a GGUF file (bad magic)", L);
    c.pos = 4;
    uint64_t nt, nkv;
    if ((s = get_u32(&c, &g->version, "the version"))) return s;
    if (g->version != 2 && g->version != 3)
        return mq_err(MOEQ_E_FORMAT, "%s: GGUF version %u (moeq reads 2 and 3)", L, g->version);
    if ((s = get_u64(&c, &nt, "the tensor count")) || (s = get_u64(&c, &nkv, "the KV count"))) return s;
    /* a KV takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 8 + 4 + 8 */
    if (nkv > len / 13)
        return mq_err(MOEQ_E_FORMAT, "%s: truncated or corrupt GGUF: KV count %llu cannot fit in its %zu bytes", L,
                      (unsigned long long)nkv, len);
    if (nt > len / 32)
        return mq_err(MOEQ_E_FORMAT, "%s: truncated or corrupt GGUF: tensor count %llu cannot fit in its %zu bytes", L,
                      (unsigned long long)nt, len);
    g->kv = calloc(nkv ? (size_t)nkv : 1, sizeof *g->kv);
    g->tensors = calloc(nt ? (size_t)nt : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) return mq_err(MOEQ_E_NOMEM, "out of memory reading %s", L);
    g->alignment = 32;
    for (uint64_t i = 0; i < nkv; i++) {
        mq_gguf_kv *kv = &g->kv[i];
        uint64_t kn;
        if ((s = get_name(&c, "a KV key", L, &kv->key, &kn))) return s;
        g->n_kv = (size_t)i + 1;
        if (strlen(kv->key) != kn) return mq_err(MOEQ_E_FORMAT, "%s: KV key %llu holds a NUL byte", L, (unsigned long long)i);
        for (uint64_t j = 0; j < i; j++)
            if (!strcmp(g->kv[j].key, kv->key)) return mq_err(MOEQ_E_FORMAT, "%s: duplicate KV '%s'", L, kv->key);
        if ((s = get_u32(&c, &kv->type, kv->key))) return s;
        if ((s = parse_value(&c, kv))) return s;
        if (!strcmp(kv->key, "general.alignment")) {
            if (kv->type != MQ_GGUF_U32)
                return mq_err(MOEQ_E_FORMAT, "%s: general.alignment is %s, expected UINT32", L, mq_gguf_vtype_name(kv->type));
            uint32_t a = rd32(kv->data);
            if (a == 0 || (a & (a - 1)))
                return mq_err(MOEQ_E_FORMAT, "%s: general.alignment %u is not a power of two", L, a);
            g->alignment = a;
        }
    }
    for (uint64_t i = 0; i < nt; i++) {
        mq_gguf_tensor *t = &g->tensors[i];
        uint64_t nn;
        if ((s = get_name(&c, "a tensor name", L, &t->name, &nn))) return s;
        g->n_tensors = (size_t)i + 1;
        const char *N = t->name;
        if (nn == 0 || strlen(N) != nn) return mq_err(MOEQ_E_FORMAT, "%s: tensor %llu has an empty or NUL-holding name", L, (unsigned long long)i);
        if ((s = get_u32(&c, &t->n_dims, N))) return mq_err_prefix(s, "tensor '%s': ", N);
        if (t->n_dims < 1 || t->n_dims > MQ_GGUF_MAX_DIMS)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': %u dimensions (1 to 4)", L, N, t->n_dims);
        int64_t numel = 1;
        for (int d = 0; d < MQ_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            uint64_t ne;
            if ((s = get_u64(&c, &ne, N))) return mq_err_prefix(s, "tensor '%s': ", N);
            if (ne == 0 || ne > (uint64_t)INT64_MAX || !mq_mul_i64(numel, (int64_t)ne, &numel))
                return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': bad dimension %u: %llu", L, N, d, (unsigned long long)ne);
            t->ne[d] = (int64_t)ne;
        }
        t->numel = numel;
        if ((s = get_u32(&c, &t->type, N)) || (s = get_u64(&c, &t->offset, N)))
            return mq_err_prefix(s, "tensor '%s': ", N);
        int64_t blk;
        size_t bb;
        if (!mq_ggml_type_info(t->type, NULL, &blk, &bb))
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': ggml type %u is not one moeq reads", L, N, t->type);
        if (t->ne[0] % blk)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': ne[0] = %lld is not a multiple of the %lld-value block",
                          L, N, (long long)t->ne[0], (long long)blk);
        size_t nb;
        if (!mq_mul_size((size_t)(numel / blk), bb, &nb))
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': size overflows", L, N);
        t->nbytes = nb;
        for (uint64_t j = 0; j < i; j++)
            if (!strcmp(g->tensors[j].name, N)) return mq_err(MOEQ_E_FORMAT, "%s: duplicate tensor '%s'", L, N);
    }
    uint64_t a = g->alignment;
    uint64_t data = (c.pos + a - 1) / a * a;
    if (data > len && nt > 0) return mq_err(MOEQ_E_FORMAT, "%s: truncated GGUF: no data section", L);
    g->data_offset = data;
    for (size_t i = 0; i < g->n_tensors; i++) {
        mq_gguf_tensor *t = &g->tensors[i];
        if (t->offset % a)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': offset %llu is not a multiple of the alignment %u",
                          L, t->name, (unsigned long long)t->offset, g->alignment);
        if (t->offset > len - data || t->nbytes > len - data - t->offset)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': data [%llu, +%zu) past the end of the file (%zu bytes)",
                          L, t->name, (unsigned long long)(data + t->offset), t->nbytes, len);
        t->data = buf + data + t->offset;
    }
    /* tensors may come in any order, but must not overlap */
    for (size_t i = 0; i < g->n_tensors; i++)
        for (size_t j = i + 1; j < g->n_tensors; j++) {
            const mq_gguf_tensor *x = &g->tensors[i], *y = &g->tensors[j];
            if (x->offset < y->offset + y->nbytes && y->offset < x->offset + x->nbytes)
                return mq_err(MOEQ_E_FORMAT, "%s: tensors '%s' and '%s' overlap", L, x->name, y->name);
        }
    return MOEQ_OK;
}

moeq_status mq_gguf_parse(const void *buf, size_t len, const char *label, mq_gguf **out) {
    *out = NULL;
    mq_gguf *g = calloc(1, sizeof *g);
    if (!g || !(g->label = mq_strdup(label ? label : "GGUF"))) {
        free(g);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    moeq_status s = parse(g, buf, len);
    if (s) {
        mq_gguf_close(g);
        return s;
    }
    *out = g;
    return MOEQ_OK;
}

moeq_status mq_gguf_open(const char *path, mq_gguf **out) {
    *out = NULL;
    mq_map m;
    moeq_status s = mq_map_file(path, &m);
    if (s) return s;
    mq_gguf *g;
    if ((s = mq_gguf_parse(m.data, m.size, path, &g))) {
        mq_unmap(&m);
        return s;
    }
    g->map = m;
    g->mapped = true;
    *out = g;
    return MOEQ_OK;
}

uint32_t mq_gguf_version(const mq_gguf *g) { return g->version; }
uint32_t mq_gguf_alignment(const mq_gguf *g) { return g->alignment; }
uint64_t mq_gguf_data_offset(const mq_gguf *g) { return g->data_offset; }
size_t mq_gguf_kv_count(const mq_gguf *g) { return g->n_kv; }
const mq_gguf_kv *mq_gguf_kv_at(const mq_gguf *g, size_t i) { return i < g->n_kv ? &g->kv[i] : NULL; }
size_t mq_gguf_tensor_count(const mq_gguf *g) { return g->n_tensors; }
const mq_gguf_tensor *mq_gguf_tensor_at(const mq_gguf *g, size_t i) {
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const mq_gguf_kv *mq_gguf_find_kv(const mq_gguf *g, const char *key) {
    for (size_t i = 0; i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

const mq_gguf_tensor *mq_gguf_find_tensor(const mq_gguf *g, const char *name) {
    for (size_t i = 0; i < g->n_tensors; i++)
        if (!strcmp(g->tensors[i].name, name)) return &g->tensors[i];
    return NULL;
}

static moeq_status typed(const mq_gguf *g, const char *key, uint32_t type, const mq_gguf_kv **kv) {
    *kv = mq_gguf_find_kv(g, key);
    if (!*kv) return mq_err(MOEQ_E_NOTFOUND, "%s: no KV '%s'", g->label, key);
    if ((*kv)->type != type)
        return mq_err(MOEQ_E_FORMAT, "%s: KV '%s' is %s, expected %s", g->label, key,
                      mq_gguf_vtype_name((*kv)->type), mq_gguf_vtype_name(type));
    return MOEQ_OK;
}

moeq_status mq_gguf_get_u32(const mq_gguf *g, const char *key, uint32_t *v) {
    const mq_gguf_kv *kv;
    moeq_status s = typed(g, key, MQ_GGUF_U32, &kv);
    if (!s) *v = rd32(kv->data);
    return s;
}

moeq_status mq_gguf_get_f32(const mq_gguf *g, const char *key, float *v) {
    const mq_gguf_kv *kv;
    moeq_status s = typed(g, key, MQ_GGUF_F32, &kv);
    if (!s) *v = f32_of(rd32(kv->data));
    return s;
}

moeq_status mq_gguf_get_bool(const mq_gguf *g, const char *key, bool *v) {
    const mq_gguf_kv *kv;
    moeq_status s = typed(g, key, MQ_GGUF_BOOL, &kv);
    if (!s) *v = kv->data[0] != 0;
    return s;
}

moeq_status mq_gguf_get_str(const mq_gguf *g, const char *key, const char **str, size_t *len) {
    const mq_gguf_kv *kv;
    moeq_status s = typed(g, key, MQ_GGUF_STRING, &kv);
    if (!s) {
        *str = (const char *)kv->data;
        *len = (size_t)kv->n;
    }
    return s;
}

bool mq_gguf_kv_str_at(const mq_gguf_kv *kv, uint64_t i, const char **s, size_t *len) {
    if (kv->type != MQ_GGUF_ARRAY || kv->arr_type != MQ_GGUF_STRING || i >= kv->n) return false;
    *len = (size_t)rd64(kv->str_at[i]);
    *s = (const char *)kv->str_at[i] + 8;
    return true;
}

bool mq_gguf_kv_num_at(const mq_gguf_kv *kv, uint64_t i, double *v) {
    uint32_t t = kv->type == MQ_GGUF_ARRAY ? kv->arr_type : kv->type;
    uint64_t n = kv->type == MQ_GGUF_ARRAY ? kv->n : 1;
    if (i >= n || t == MQ_GGUF_STRING) return false;
    const uint8_t *p = kv->data + i * vtype_size(t);
    switch (t) {
    case MQ_GGUF_U8: case MQ_GGUF_BOOL: *v = p[0]; return true;
    case MQ_GGUF_I8: *v = (int8_t)p[0]; return true;
    case MQ_GGUF_U16: *v = rd16(p); return true;
    case MQ_GGUF_I16: *v = (int16_t)rd16(p); return true;
    case MQ_GGUF_U32: *v = rd32(p); return true;
    case MQ_GGUF_I32: *v = (int32_t)rd32(p); return true;
    case MQ_GGUF_F32: *v = f32_of(rd32(p)); return true;
    case MQ_GGUF_U64: *v = (double)rd64(p); return true;
    case MQ_GGUF_I64: *v = (double)(int64_t)rd64(p); return true;
    case MQ_GGUF_F64: {
        uint64_t b = rd64(p);
        double d;
        memcpy(&d, &b, 8);
        *v = d;
        return true;
    }
    }
    return false;
}

/* ---- block decoders --------------------------------------------------------------------------
 * Each follows its type's definition with ggml's order of float operations, so the values are
 * the ones ggml's reference dequantization produces. */

/* E2M1 as ggml decodes it: from a table of integers (twice the value), so code 8 is +0, not -0. */
static float e2m1_value(uint8_t c) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return c & 8 && c != 8 ? -mag[c & 7] : mag[c & 7];
}

/* UE4M3 as ggml reads it: the sign bit ignored, 0 and 0x7F give 0. */
static float ue4m3_value(uint8_t x) {
    if (x == 0 || x == 0x7F) return 0.0f;
    int e = (x >> 3) & 0xF, m = x & 7;
    return e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
}

/* The 6-bit scale and min j (0..7) of a Q4_K/Q5_K block's 12-byte table. */
static void k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* IQ4_NL and IQ4_XS: 4-bit indices into ggml's kvalues_iq4nl, 32 values per scale. */
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* 32 values of scale dl from 16 bytes: low nibbles the first 16, high nibbles the next. */
static void dec_iq4_32(const uint8_t *qs, float dl, float *y) {
    for (int j = 0; j < 16; j++) {
        y[j] = dl * (float)iq4_values[qs[j] & 0xF];
        y[j + 16] = dl * (float)iq4_values[qs[j] >> 4];
    }
}

/* IQ4_XS: d, scales_h (u16, 2 bits per sub-block), scales_l[4] (a nibble each), qs[128]. */
static void dec_iq4_xs(const uint8_t *b, float *y) {
    const float d = mq_f16_to_f32(rd16(b));
    const uint16_t sh = rd16(b + 2);
    for (int j = 0; j < 8; j++) {
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | ((sh >> (2 * j)) & 3) << 4;
        dec_iq4_32(b + 8 + 16 * j, d * (float)(ls - 32), y + 32 * j);
    }
}

static void dec_q4_0(const uint8_t *b, float *y) {
    float d = mq_f16_to_f32(rd16(b));
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((b[2 + j] & 0xF) - 8) * d;
        y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
    }
}

static void dec_q4_1(const uint8_t *b, float *y) {
    float d = mq_f16_to_f32(rd16(b)), m = mq_f16_to_f32(rd16(b + 2));
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(b[4 + j] & 0xF) * d + m;
        y[j + 16] = (float)(b[4 + j] >> 4) * d + m;
    }
}

static void dec_q8_0(const uint8_t *b, float *y) {
    float d = mq_f16_to_f32(rd16(b));
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

/* Q5_0 and Q5_1: the fifth bit of value j in bit j of the u32 qh (dequantize_row_q5_0/1). */
static void dec_q5(const uint8_t *b, float *y, bool one) {
    float d = mq_f16_to_f32(rd16(b)), m = one ? mq_f16_to_f32(rd16(b + 2)) : 0.0f;
    const uint8_t *p = b + (one ? 4 : 2);
    uint32_t qh = rd32(p);
    for (int j = 0; j < 16; j++) {
        int x0 = (p[4 + j] & 0xF) | (int)((qh >> j) << 4 & 0x10);
        int x1 = (p[4 + j] >> 4) | (int)((qh >> (j + 12)) & 0x10);
        if (one) {
            y[j] = (float)x0 * d + m;
            y[j + 16] = (float)x1 * d + m;
        } else {
            y[j] = (float)(x0 - 16) * d;
            y[j + 16] = (float)(x1 - 16) * d;
        }
    }
}

/* Q3_K (dequantize_row_q3_K): hmask[32], qs[64], 12 bytes of 6-bit scales, d. */
static void dec_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *q = b + 32, *sc = b + 96;
    float d = mq_f16_to_f32(rd16(b + 108));
    int8_t scales[16];
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
        scales[j] = (int8_t)((lo | ((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32);
    }
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
        for (int j = 0, shift = 0; j < 4; j++, shift += 2, m = (uint8_t)(m << 1)) {
            for (int h = 0; h < 2; h++) {   /* two sub-blocks of 16: q[l] and q[l + 16] */
                float dl = d * (float)scales[is++];
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)(((q[l + 16 * h] >> shift) & 3) - ((hm[l + 16 * h] & m) ? 0 : 4));
            }
        }
        q += 32;
    }
}

static void dec_q4_k(const uint8_t *b, float *y) {
    float d = mq_f16_to_f32(rd16(b)), dmin = mq_f16_to_f32(rd16(b + 2));
    const uint8_t *sc = b + 4, *q = b + 16;
    for (int j = 0; j < 4; j++) {   /* 64 values: 32 low nibbles, then 32 high */
        uint8_t s0, m0, s1, m1;
        k_scale_min(sc, 2 * j, &s0, &m0);
        k_scale_min(sc, 2 * j + 1, &s1, &m1);
        float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
        for (int l = 0; l < 32; l++) y[l] = d0 * (float)(q[l] & 0xF) - n0;
        for (int l = 0; l < 32; l++) y[32 + l] = d1 * (float)(q[l] >> 4) - n1;
        y += 64;
        q += 32;
    }
}

static void dec_q5_k(const uint8_t *b, float *y) {
    float d = mq_f16_to_f32(rd16(b)), dmin = mq_f16_to_f32(rd16(b + 2));
    const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + 48;
    for (int j = 0; j < 4; j++) {
        uint8_t s0, m0, s1, m1;
        k_scale_min(sc, 2 * j, &s0, &m0);
        k_scale_min(sc, 2 * j + 1, &s1, &m1);
        float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
        uint8_t lo = (uint8_t)(1u << (2 * j)), hi = (uint8_t)(2u << (2 * j));
        for (int l = 0; l < 32; l++) y[l] = d0 * (float)((ql[l] & 0xF) + (qh[l] & lo ? 16 : 0)) - n0;
        for (int l = 0; l < 32; l++) y[32 + l] = d1 * (float)((ql[l] >> 4) + (qh[l] & hi ? 16 : 0)) - n1;
        y += 64;
        ql += 32;
    }
}

static void dec_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = mq_f16_to_f32(rd16(b + 208));
    for (int half = 0; half < 2; half++) {   /* 128 values each */
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

static void dec_nvfp4(const uint8_t *b, float *y) {
    for (int s = 0; s < 4; s++) {
        float d = ue4m3_value(b[s]);
        const uint8_t *q = b + 4 + s * 8;
        for (int j = 0; j < 8; j++) {
            y[s * 16 + j] = e2m1_value(q[j] & 0xF) * d;
            y[s * 16 + j + 8] = e2m1_value(q[j] >> 4) * d;
        }
    }
}

moeq_status mq_ggml_dequantize(uint32_t type, const void *src, int64_t n, float *dst) {
    const uint8_t *p = src;
    int64_t blk;
    size_t bb;
    const char *name;
    if (!mq_ggml_type_info(type, &name, &blk, &bb))
        return mq_err(MOEQ_E_FORMAT, "ggml type %u cannot be decoded", type);
    if (n % blk) return mq_err(MOEQ_E_ARG, "%s: %lld values are not whole blocks of %lld", name, (long long)n, (long long)blk);
    int64_t nb = n / blk;
    for (int64_t i = 0; i < nb; i++, p += bb, dst += blk) {
        switch (type) {
        case MQ_GGML_F32: dst[0] = f32_of(rd32(p)); break;
        case MQ_GGML_F16: dst[0] = mq_f16_to_f32(rd16(p)); break;
        case MQ_GGML_BF16: dst[0] = mq_bf16_to_f32(rd16(p)); break;
        case MQ_GGML_Q4_0: dec_q4_0(p, dst); break;
        case MQ_GGML_Q4_1: dec_q4_1(p, dst); break;
        case MQ_GGML_Q8_0: dec_q8_0(p, dst); break;
        case MQ_GGML_Q5_0: dec_q5(p, dst, false); break;
        case MQ_GGML_Q5_1: dec_q5(p, dst, true); break;
        case MQ_GGML_Q3_K: dec_q3_k(p, dst); break;
        case MQ_GGML_Q4_K: dec_q4_k(p, dst); break;
        case MQ_GGML_Q5_K: dec_q5_k(p, dst); break;
        case MQ_GGML_Q6_K: dec_q6_k(p, dst); break;
        case MQ_GGML_NVFP4: dec_nvfp4(p, dst); break;
        case MQ_GGML_IQ4_NL: dec_iq4_32(p + 2, mq_f16_to_f32(rd16(p)), dst); break;
        case MQ_GGML_IQ4_XS: dec_iq4_xs(p, dst); break;
        }
    }
    return MOEQ_OK;
}

moeq_status mq_gguf_tensor_to_f32(const mq_gguf_tensor *t, float *dst) {
    moeq_status s = mq_ggml_dequantize(t->type, t->data, t->numel, dst);
    return s ? mq_err_prefix(s, "tensor '%s': ", t->name) : MOEQ_OK;
}

/* ---- block encoders ------------------------------------------------------------------------ */

static void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

void mq_ggml_put_q4_0(uint8_t *blk, const uint8_t *codes, uint16_t d_f16) {
    wr16(blk, d_f16);
    for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t)((codes[j] & 0xF) | (codes[j + 16] & 0xF) << 4);
}

void mq_ggml_put_q4_1(uint8_t *blk, const uint8_t *codes, uint16_t d_f16, uint16_t m_f16) {
    wr16(blk, d_f16);
    wr16(blk + 2, m_f16);
    for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t)((codes[j] & 0xF) | (codes[j + 16] & 0xF) << 4);
}

void mq_ggml_put_nvfp4(uint8_t *blk, const uint8_t *codes, const uint8_t *scales) {
    for (int s = 0; s < 4; s++) {
        blk[s] = scales[s] & 0x7F;
        for (int j = 0; j < 8; j++)
            blk[4 + s * 8 + j] = (uint8_t)((codes[s * 16 + j] & 0xF) | (codes[s * 16 + j + 8] & 0xF) << 4);
    }
}

void mq_ggml_put_q8_0(uint8_t *blk, const float *x) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    wr16(blk, mq_f32_to_f16(d));
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* ---- writer ------------------------------------------------------------------------------- */

typedef struct {
    char *name;
    uint32_t n_dims, type;
    int64_t ne[MQ_GGUF_MAX_DIMS];
    size_t nbytes;
    uint64_t offset;
} wtensor;

struct mq_gguf_writer {
    uint8_t *kv;          /* serialised KVs */
    size_t kv_len, kv_cap;
    uint64_t n_kv;
    wtensor *t;
    size_t n_t, cap_t;
    bool oom;
    FILE *f;
    const char *path;
    size_t cur;           /* tensor being written */
    size_t cur_done;      /* its bytes so far */
    uint64_t pos;         /* bytes into the data section */
};

mq_gguf_writer *mq_gguf_writer_new(void) { return calloc(1, sizeof(mq_gguf_writer)); }

void mq_gguf_writer_free(mq_gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_t; i++) free(w->t[i].name);
    free(w->t);
    free(w->kv);
    free(w);
}

static void put(mq_gguf_writer *w, const void *p, size_t n) {
    if (w->oom) return;
    if (w->kv_len + n > w->kv_cap) {
        size_t cap = w->kv_cap ? w->kv_cap : 4096;
        while (cap < w->kv_len + n) cap *= 2;
        uint8_t *k = realloc(w->kv, cap);
        if (!k) {
            w->oom = true;
            return;
        }
        w->kv = k;
        w->kv_cap = cap;
    }
    memcpy(w->kv + w->kv_len, p, n);
    w->kv_len += n;
}

static void put32(mq_gguf_writer *w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put(w, b, 4);
}

static void put64(mq_gguf_writer *w, uint64_t v) {
    put32(w, (uint32_t)v);
    put32(w, (uint32_t)(v >> 32));
}

static void put_str(mq_gguf_writer *w, const char *s, size_t n) {
    put64(w, n);
    put(w, s, n);
}

static void key(mq_gguf_writer *w, const char *k, uint32_t type) {
    put_str(w, k, strlen(k));
    put32(w, type);
    w->n_kv++;
}

void mq_gguf_kv_u32(mq_gguf_writer *w, const char *k, uint32_t v) {
    key(w, k, MQ_GGUF_U32);
    put32(w, v);
}

void mq_gguf_kv_i32(mq_gguf_writer *w, const char *k, int32_t v) {
    key(w, k, MQ_GGUF_I32);
    put32(w, (uint32_t)v);
}

void mq_gguf_kv_f32(mq_gguf_writer *w, const char *k, float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    key(w, k, MQ_GGUF_F32);
    put32(w, b);
}

void mq_gguf_kv_bool(mq_gguf_writer *w, const char *k, bool v) {
    uint8_t b = v;
    key(w, k, MQ_GGUF_BOOL);
    put(w, &b, 1);
}

void mq_gguf_kv_str(mq_gguf_writer *w, const char *k, const char *s) {
    key(w, k, MQ_GGUF_STRING);
    put_str(w, s, strlen(s));
}

void mq_gguf_kv_arr_str(mq_gguf_writer *w, const char *k, const char *const *s, const size_t *lens,
                        uint64_t n) {
    key(w, k, MQ_GGUF_ARRAY);
    put32(w, MQ_GGUF_STRING);
    put64(w, n);
    for (uint64_t i = 0; i < n; i++) put_str(w, s[i], lens[i]);
}

void mq_gguf_kv_arr_i32(mq_gguf_writer *w, const char *k, const int32_t *v, uint64_t n) {
    key(w, k, MQ_GGUF_ARRAY);
    put32(w, MQ_GGUF_I32);
    put64(w, n);
    for (uint64_t i = 0; i < n; i++) put32(w, (uint32_t)v[i]);
}

#define ALIGN 32u

moeq_status mq_gguf_writer_tensor(mq_gguf_writer *w, const char *name, uint32_t n_dims,
                                  const int64_t *ne, uint32_t type) {
    int64_t blk;
    size_t bb;
    if (!mq_ggml_type_info(type, NULL, &blk, &bb)) return mq_err(MOEQ_E_ARG, "%s: unknown ggml type %u", name, type);
    if (n_dims < 1 || n_dims > MQ_GGUF_MAX_DIMS) return mq_err(MOEQ_E_ARG, "%s: %u dimensions", name, n_dims);
    if (ne[0] % blk)
        return mq_err(MOEQ_E_SHAPE, "%s: %lld columns are not whole %lld-value blocks of its type",
                      name, (long long)ne[0], (long long)blk);
    moeq_status s = mq_grow(&w->t, w->n_t, &w->cap_t, sizeof *w->t, 64, "GGUF writer's tensors");
    if (s) return s;
    wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    if (!(t->name = mq_strdup(name))) return mq_err(MOEQ_E_NOMEM, "out of memory");
    t->n_dims = n_dims;
    t->type = type;
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        t->ne[d] = ne[d];
        numel *= ne[d];
    }
    t->nbytes = (size_t)(numel / blk) * bb;
    t->offset = w->n_t ? (w->t[w->n_t - 1].offset + w->t[w->n_t - 1].nbytes + ALIGN - 1) / ALIGN * ALIGN : 0;
    w->n_t++;
    return MOEQ_OK;
}

size_t mq_gguf_writer_tensor_bytes(const mq_gguf_writer *w, size_t i) { return i < w->n_t ? w->t[i].nbytes : 0; }

static moeq_status fwrite_all(mq_gguf_writer *w, const void *p, size_t n) {
    if (n && fwrite(p, 1, n, w->f) != n) return mq_err(MOEQ_E_IO, "%s: write failed", w->path);
    return MOEQ_OK;
}

static moeq_status pad(mq_gguf_writer *w, uint64_t *pos) {
    static const uint8_t zeros[ALIGN];
    size_t n = (size_t)((ALIGN - *pos % ALIGN) % ALIGN);
    *pos += n;
    return fwrite_all(w, zeros, n);
}

moeq_status mq_gguf_writer_begin(mq_gguf_writer *w, FILE *f, const char *path) {
    w->f = f;
    w->path = path;
    /* the header and tensor infos after the KVs, in one buffer */
    size_t kv_len = w->kv_len;
    uint64_t n_kv = w->n_kv;
    for (size_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        put_str(w, t->name, strlen(t->name));
        put32(w, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) put64(w, (uint64_t)t->ne[d]);
        put32(w, t->type);
        put64(w, t->offset);
    }
    if (w->oom) return mq_err(MOEQ_E_NOMEM, "out of memory building the GGUF header of %s", path);
    uint8_t head[24];
    memcpy(head, "GGUF", 4);
    uint32_t ver = 3;
    uint64_t nt = w->n_t;
    for (int i = 0; i < 4; i++) head[4 + i] = (uint8_t)(ver >> (8 * i));
    for (int i = 0; i < 8; i++) head[8 + i] = (uint8_t)(nt >> (8 * i));
    for (int i = 0; i < 8; i++) head[16 + i] = (uint8_t)(n_kv >> (8 * i));
    moeq_status s = fwrite_all(w, head, 24);
    if (!s) s = fwrite_all(w, w->kv, w->kv_len);
    uint64_t pos = 24 + w->kv_len;
    w->kv_len = kv_len;   /* the infos are not KVs */
    if (!s) s = pad(w, &pos);
    w->cur = 0;
    w->cur_done = 0;
    w->pos = 0;
    return s;
}

moeq_status mq_gguf_writer_data(mq_gguf_writer *w, const void *data, size_t n) {
    const uint8_t *p = data;
    while (n > 0) {
        if (w->cur >= w->n_t) return mq_err(MOEQ_E_FORMAT, "%s: more tensor data than declared", w->path);
        wtensor *t = &w->t[w->cur];
        size_t k = t->nbytes - w->cur_done < n ? t->nbytes - w->cur_done : n;
        moeq_status s = fwrite_all(w, p, k);
        if (s) return s;
        p += k;
        n -= k;
        w->cur_done += k;
        w->pos += k;
        if (w->cur_done == t->nbytes) {
            w->cur++;
            w->cur_done = 0;
            if (w->cur < w->n_t && (s = pad(w, &w->pos))) return s;
        }
    }
    return MOEQ_OK;
}

moeq_status mq_gguf_writer_end(mq_gguf_writer *w) {
    /* zero-byte tensors do not exist (every ne >= 1), so a short one is a caller's bug */
    if (w->cur != w->n_t)
        return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s' has %zu of its %zu bytes", w->path,
                      w->t[w->cur].name, w->cur_done, w->t[w->cur].nbytes);
    return MOEQ_OK;
}
