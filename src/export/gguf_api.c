/*
 * The public GGUF entry points of include/moeq.h: moeq_export_gguf (export/gguf_export.c) and
 * moeq_gguf_describe (what `moeq inspect FILE.gguf` prints, from io/gguf.c's reader).
 */
#include <stdlib.h>
#include <string.h>

#include "export/gguf_export.h"
#include "io/gguf.h"

static moeq_status export_gguf(const char *ckpt_dir, const char *out_path, const char *rest, bool dequant) {
    if (!ckpt_dir || !out_path) return mq_err(MOEQ_E_ARG, "%s is NULL", !ckpt_dir ? "ckpt_dir" : "out_path");
    mq_gguf_rest r = MQ_GGUF_REST_AUTO;
    if (rest && !mq_gguf_rest_parse(rest, &r))
        return mq_err(MOEQ_E_ARG, "gguf rest \"%s\": expected auto, f32, f16, bf16 or q8_0", rest);
    if (!mq_dir_exists(ckpt_dir)) return mq_err(MOEQ_E_NOTFOUND, "checkpoint directory '%s' not found", ckpt_dir);
    if (mq_dir_exists(out_path)) return mq_err(MOEQ_E_EXISTS, "%s: is a directory (a GGUF output is one file)", out_path);
    return dequant ? mq_gguf_export_dequantized(ckpt_dir, out_path, r) : mq_gguf_export(ckpt_dir, out_path, r);
}

moeq_status moeq_export_gguf(const char *ckpt_dir, const char *out_path, const char *rest) {
    return export_gguf(ckpt_dir, out_path, rest, false);
}

moeq_status moeq_export_gguf_dequantized(const char *ckpt_dir, const char *out_path, const char *rest) {
    return export_gguf(ckpt_dir, out_path, rest, true);
}

/* A KV's value in one line: numbers, a quoted string (cut at 60 bytes), or an array's element
 * type and count with its first elements. */
static void print_value(FILE *f, const mq_gguf_kv *kv) {
    if (kv->type == MQ_GGUF_STRING) {
        int n = kv->n > 60 ? 60 : (int)kv->n;
        fprintf(f, "\"%.*s\"%s", n, (const char *)kv->data, kv->n > 60 ? "..." : "");
        return;
    }
    if (kv->type == MQ_GGUF_ARRAY) {
        fprintf(f, "[%s x %llu]", mq_gguf_vtype_name(kv->arr_type), (unsigned long long)kv->n);
        for (uint64_t i = 0; i < kv->n && i < 4; i++) {
            const char *s;
            size_t len;
            double v;
            if (mq_gguf_kv_str_at(kv, i, &s, &len)) fprintf(f, " \"%.*s\"", (int)(len > 24 ? 24 : len), s);
            else if (mq_gguf_kv_num_at(kv, i, &v)) fprintf(f, " %.9g", v);
        }
        if (kv->n > 4) fprintf(f, " ...");
        return;
    }
    double v;
    if (kv->type == MQ_GGUF_BOOL) fprintf(f, "%s", kv->data[0] ? "true" : "false");
    else if (mq_gguf_kv_num_at(kv, 0, &v)) fprintf(f, "%.9g", v);
}

typedef struct {
    uint32_t type;
    int64_t n, values;
    uint64_t bytes;
} type_sum;

moeq_status moeq_gguf_describe(const char *path, int list_tensors, char **text) {
    if (!path || !text) return mq_err(MOEQ_E_ARG, "%s is NULL", !path ? "path" : "text");
    *text = NULL;
    mq_gguf *g;
    moeq_status s = mq_gguf_open(path, &g);
    if (s) return s;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) {
        mq_gguf_close(g);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    const char *arch = "?";
    size_t alen = 1;
    mq_gguf_get_str(g, "general.architecture", &arch, &alen);
    fprintf(f, "%s\n  %-20s GGUF v%u, alignment %u, %zu KVs, %zu tensors\n  %-20s %.*s\n", path, "format",
            mq_gguf_version(g), mq_gguf_alignment(g), mq_gguf_kv_count(g), mq_gguf_tensor_count(g),
            "architecture", (int)alen, arch);
    fprintf(f, "metadata\n");
    for (size_t i = 0; i < mq_gguf_kv_count(g); i++) {
        const mq_gguf_kv *kv = mq_gguf_kv_at(g, i);
        fprintf(f, "  %-44s %-8s ", kv->key, mq_gguf_vtype_name(kv->type));
        print_value(f, kv);
        fputc('\n', f);
    }
    /* bytes and values per type */
    type_sum per[16];
    int np = 0;
    uint64_t total = 0;
    int64_t params = 0;
    for (size_t i = 0; i < mq_gguf_tensor_count(g); i++) {
        const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
        int k = 0;
        while (k < np && per[k].type != t->type) k++;
        if (k == np && np < 16) per[np++] = (type_sum){t->type, 0, 0, 0};
        if (k < np) {
            per[k].n++;
            per[k].values += t->numel;
            per[k].bytes += t->nbytes;
        }
        total += t->nbytes;
        params += t->numel;
    }
    fprintf(f, "tensors: %zu, %lld values, %.2f MB (%.3f bits per value)\n", mq_gguf_tensor_count(g),
            (long long)params, (double)total / 1e6, params ? 8.0 * (double)total / (double)params : 0.0);
    for (int k = 0; k < np; k++) {
        const char *name;
        mq_ggml_type_info(per[k].type, &name, NULL, NULL);
        fprintf(f, "  %-8s %6lld tensors %12lld values %10.2f MB\n", name, (long long)per[k].n,
                (long long)per[k].values, (double)per[k].bytes / 1e6);
    }
    if (list_tensors) {
        for (size_t i = 0; i < mq_gguf_tensor_count(g); i++) {
            const mq_gguf_tensor *t = mq_gguf_tensor_at(g, i);
            const char *name;
            mq_ggml_type_info(t->type, &name, NULL, NULL);
            fprintf(f, "  %-40s %-6s {", t->name, name);
            for (uint32_t d = 0; d < t->n_dims; d++) fprintf(f, "%s%lld", d ? ", " : "", (long long)t->ne[d]);
            fprintf(f, "}  offset %llu, %zu bytes\n", (unsigned long long)(mq_gguf_data_offset(g) + t->offset), t->nbytes);
        }
    }
    mq_gguf_close(g);
    if (fclose(f) != 0 || !buf) {
        free(buf);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    *text = buf;
    return MOEQ_OK;
}

moeq_status moeq_import_gguf(const char *gguf_path, const char *out_dir) {
    if (!gguf_path || !out_dir) return mq_err(MOEQ_E_ARG, "%s is NULL", !gguf_path ? "gguf_path" : "out_dir");
    return mq_gguf_import(gguf_path, out_dir);
}
