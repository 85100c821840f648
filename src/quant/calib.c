/*
 * Calibration samples for GPTQ (see calib.h). The default protocol follows
 * ../shared/docs/gptq_reference_study.md: calib.txt tokenized as one string without special
 * tokens, the first 128 consecutive 512-token chunks. IST-DASLab's gptq uses random 2048-token
 * windows (MQ_CALIB_RANDOM); torchao's scripts one document per sample (MQ_CALIB_DOCS).
 */
#include "quant/calib.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

void mq_calib_opts_init(mq_calib_opts *o) {
    memset(o, 0, sizeof *o);
    o->nsamples = 128;
    o->seqlen = 512;
    o->mode = MQ_CALIB_CHUNKS;
}

void mq_calib_free(mq_calib_set *s) {
    if (!s) return;
    for (int64_t i = 0; i < s->n; i++) free(s->ids[i]);
    free(s->ids);
    free(s->len);
    memset(s, 0, sizeof *s);
}

static moeq_status set_alloc(mq_calib_set *s, int64_t cap) {
    memset(s, 0, sizeof *s);
    s->ids = calloc((size_t)(cap > 0 ? cap : 1), sizeof *s->ids);
    s->len = calloc((size_t)(cap > 0 ? cap : 1), sizeof *s->len);
    if (!s->ids || !s->len) {
        mq_calib_free(s);
        return mq_err(MOEQ_E_NOMEM, "out of memory for calibration samples");
    }
    return MOEQ_OK;
}

/* Appends one sample: [bos] + ids[0..n). bos < 0: none. */
static moeq_status set_add(mq_calib_set *s, int32_t bos, const int32_t *ids, int64_t n) {
    int64_t len = n + (bos >= 0 ? 1 : 0);
    int32_t *v = malloc((size_t)len * sizeof(int32_t));
    if (!v) return mq_err(MOEQ_E_NOMEM, "out of memory for calibration samples");
    if (bos >= 0) v[0] = bos;
    memcpy(v + (bos >= 0 ? 1 : 0), ids, (size_t)n * sizeof(int32_t));
    s->ids[s->n] = v;
    s->len[s->n++] = len;
    s->total += len;
    if (len > s->max_len) s->max_len = len;
    return MOEQ_OK;
}

static moeq_status check_opts(const mq_calib_opts *o) {
    if (o->nsamples < 1) return mq_err(MOEQ_E_ARG, "--nsamples %lld: must be >= 1", (long long)o->nsamples);
    if (o->seqlen < 2) return mq_err(MOEQ_E_ARG, "--seqlen %lld: must be >= 2", (long long)o->seqlen);
    return MOEQ_OK;
}

static moeq_status from_ids(const int32_t *ids, int64_t n_ids, const mq_calib_opts *o, int32_t bos,
                            const char *what, mq_calib_set *out) {
    moeq_status st = check_opts(o);
    if (st) return st;
    if (n_ids <= 0) return mq_err(MOEQ_E_FORMAT, "%s: no calibration tokens", what);
    const int64_t L = o->seqlen - (bos >= 0 ? 1 : 0);
    if ((st = set_alloc(out, o->nsamples))) return st;
    if (o->mode == MQ_CALIB_RANDOM) {
        uint64_t r = o->seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
        for (int64_t i = 0; i < o->nsamples && !st; i++) {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            int64_t span = n_ids > L ? n_ids - L + 1 : 1, len = n_ids < L ? n_ids : L;
            st = set_add(out, bos, ids + (int64_t)(r % (uint64_t)span), len);
        }
    } else {
        for (int64_t i = 0; i < o->nsamples && i * L < n_ids && !st; i++) {
            int64_t len = n_ids - i * L < L ? n_ids - i * L : L;
            if (len < L && i > 0) break;   /* a short tail chunk only when it is the only one */
            st = set_add(out, bos, ids + i * L, len);
        }
        if (!st && out->n < o->nsamples && !o->pool)
            mq_warn("%s: %lld tokens make only %lld of the %lld calibration samples of %lld tokens",
                    what, (long long)n_ids, (long long)out->n, (long long)o->nsamples,
                    (long long)o->seqlen);
    }
    if (st) mq_calib_free(out);
    return st;
}

moeq_status mq_calib_keep(mq_calib_set *s, const int64_t *keep, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        if (keep[i] <= keep[i - 1]) return mq_err(MOEQ_E_ARG, "mq_calib_keep: indices not increasing");
    if (n > 0 && (keep[0] < 0 || keep[n - 1] >= s->n))
        return mq_err(MOEQ_E_ARG, "mq_calib_keep: index outside the %lld samples", (long long)s->n);
    int64_t j = 0, w = 0;
    s->total = s->max_len = 0;
    for (int64_t i = 0; i < s->n; i++) {
        if (j < n && keep[j] == i) {
            s->ids[w] = s->ids[i];
            s->len[w] = s->len[i];
            s->total += s->len[w];
            if (s->len[w] > s->max_len) s->max_len = s->len[w];
            w++;
            j++;
        } else {
            free(s->ids[i]);
        }
    }
    s->n = w;
    return MOEQ_OK;
}

moeq_status mq_calib_cover(const int32_t *ids, int64_t n_ids, int64_t chunk, mq_calib_set *out) {
    memset(out, 0, sizeof *out);
    if (n_ids <= 0 || chunk <= 0)
        return mq_err(MOEQ_E_ARG, "calibration needs tokens (got %lld) and a positive chunk",
                      (long long)n_ids);
    moeq_status st = set_alloc(out, (n_ids + chunk - 1) / chunk);
    for (int64_t off = 0; off < n_ids && !st; off += chunk)
        st = set_add(out, -1, ids + off, n_ids - off < chunk ? n_ids - off : chunk);
    if (st) mq_calib_free(out);
    return st;
}

moeq_status mq_calib_from_ids(const int32_t *ids, int64_t n_ids, const mq_calib_opts *o,
                              mq_calib_set *out) {
    memset(out, 0, sizeof *out);
    return from_ids(ids, n_ids, o, -1, "calibration ids", out);
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* The documents of the file: JSONL records' "text", or for a text file either the whole text
 * (one document) or, with per_line, each non-empty line. Pointers into text or into cJSON
 * strings copied to the heap; lens in bytes. */
typedef struct {
    char **doc;
    size_t *len;
    int64_t *line;       /* the document's line in the file (0: the whole file), for messages */
    int64_t n, cap;
} doc_list;

static void docs_free(doc_list *d) {
    for (int64_t i = 0; i < d->n; i++) free(d->doc[i]);
    free(d->doc);
    free(d->len);
    free(d->line);
    memset(d, 0, sizeof *d);
}

static moeq_status docs_add(doc_list *d, const char *s, size_t n, int64_t line) {
    if (d->n == d->cap) {
        int64_t cap = d->cap ? 2 * d->cap : 256;
        char **a = realloc(d->doc, (size_t)cap * sizeof *a);
        if (a) d->doc = a;
        size_t *b = realloc(d->len, (size_t)cap * sizeof *b);
        if (b) d->len = b;
        int64_t *c = realloc(d->line, (size_t)cap * sizeof *c);
        if (c) d->line = c;
        if (!a || !b || !c) return mq_err(MOEQ_E_NOMEM, "out of memory reading calibration documents");
        d->cap = cap;
    }
    d->doc[d->n] = mq_strndup(s, n);
    if (!d->doc[d->n]) return mq_err(MOEQ_E_NOMEM, "out of memory reading calibration documents");
    d->line[d->n] = line;
    d->len[d->n++] = n;
    return MOEQ_OK;
}

/* Document i tokenized; an error (text that is not UTF-8) names the file and the line. */
static moeq_status doc_encode(const moeq_tokenizer *tok, const doc_list *d, int64_t i, const char *path,
                              int32_t **ids, size_t *n) {
    moeq_status st = moeq_tokenizer_encode(tok, d->doc[i], d->len[i], ids, n);
    if (st && d->line[i] > 0) return mq_err_prefix(st, "%s:%lld", path, (long long)d->line[i]);
    if (st) return mq_err_prefix(st, "%s", path);
    return MOEQ_OK;
}

static bool blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r') return false;
    return true;
}

/* The file's bytes; gzip-compressed files (a .gz name or the gzip magic) are inflated. */
static moeq_status read_input(const char *path, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    unsigned char magic[2] = {0, 0};
    FILE *f = fopen(path, "rb");
    if (f) {
        size_t got = fread(magic, 1, 2, f);
        fclose(f);
        if (got < 2) magic[0] = 0;
    }
    if (!(ends_with(path, ".gz") || (magic[0] == 0x1f && magic[1] == 0x8b))) return mq_read_file(path, out, len);
    gzFile g = gzopen(path, "rb");
    if (!g) return mq_err(MOEQ_E_IO, "%s: cannot open", path);
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap + 1);
    moeq_status st = buf ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory reading %s", path);
    while (!st) {
        if (cap - n < (1 << 16)) {
            char *grown = realloc(buf, 2 * cap + 1);
            if (!grown) {
                st = mq_err(MOEQ_E_NOMEM, "out of memory reading %s", path);
                break;
            }
            buf = grown;
            cap *= 2;
        }
        int r = gzread(g, buf + n, (unsigned)(cap - n));
        if (r < 0) {
            int code = 0;
            const char *msg = gzerror(g, &code);
            st = mq_err(MOEQ_E_FORMAT, "%s: not a readable gzip file (%s)", path, msg ? msg : "zlib error");
        } else if (gzdirect(g)) {
            /* zlib passes data without the gzip header through unchanged */
            st = mq_err(MOEQ_E_FORMAT, "%s: not gzip data (the name ends in .gz)", path);
        } else if (r == 0) {
            break;
        } else {
            n += (size_t)r;
        }
    }
    /* a truncated stream ends without error from gzread; gzclose_r reports it */
    int rc = gzclose_r(g);
    if (!st && rc != Z_OK) st = mq_err(MOEQ_E_FORMAT, "%s: truncated or corrupt gzip data", path);
    if (st) {
        free(buf);
        return st;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return MOEQ_OK;
}

/* A chat record's "messages": [{"role": R, "content": C}, ...] as "R: C" lines (C a string, or a
 * list of parts whose "text" strings are concatenated). Documented as plain role names, not a
 * chat template. */
static moeq_status join_messages(const cJSON *msgs, const char *path, int64_t line_no, doc_list *d) {
    size_t cap = 256, n = 0;
    char *buf = malloc(cap);
    if (!buf) return mq_err(MOEQ_E_NOMEM, "out of memory reading calibration documents");
    const cJSON *m;
    moeq_status st = MOEQ_OK;
    cJSON_ArrayForEach(m, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsString(role) || !(cJSON_IsString(content) || cJSON_IsArray(content))) {
            st = mq_err(MOEQ_E_FORMAT, "%s:%lld: a message needs a string \"role\" and a \"content\" string or "
                        "list of parts", path, (long long)line_no);
            break;
        }
        for (int part = -1;; part++) {
            const char *piece;
            if (part == -1) {
                piece = role->valuestring;
            } else if (cJSON_IsString(content)) {
                if (part > 0) break;
                piece = content->valuestring;
            } else {
                const cJSON *it = cJSON_GetArrayItem(content, part);
                if (!it) break;
                const cJSON *t = cJSON_GetObjectItemCaseSensitive(it, "text");
                piece = cJSON_IsString(t) ? t->valuestring : "";
            }
            const char *sep = part == -1 ? (n ? "\n" : "") : part == 0 ? ": " : "";
            size_t need = n + strlen(sep) + strlen(piece) + 1;
            if (need > cap) {
                while (cap < need) cap *= 2;
                char *grown = realloc(buf, cap);
                if (!grown) {
                    free(buf);
                    return mq_err(MOEQ_E_NOMEM, "out of memory reading calibration documents");
                }
                buf = grown;
            }
            n += (size_t)sprintf(buf + n, "%s%s", sep, piece);
        }
    }
    if (!st) st = docs_add(d, buf, n, line_no);
    free(buf);
    return st;
}

/* JSONL: each record's `field` (NULL: "text", else "messages"): a string, or a messages list. */
static moeq_status read_docs(const char *path, const char *field, const char *text, size_t len,
                             bool per_line, doc_list *d) {
    size_t i = 0;
    while (i < len && (text[i] == ' ' || text[i] == '\t' || text[i] == '\r' || text[i] == '\n')) i++;
    bool jsonl = ends_with(path, ".jsonl") || ends_with(path, ".jsonl.gz") || (i < len && text[i] == '{');
    if (field && !jsonl) return mq_err(MOEQ_E_ARG, "%s: --calib-field %s needs a JSONL file", path, field);
    if (!jsonl && !per_line) return docs_add(d, text, len, 0);
    int64_t line_no = 0;
    for (size_t p = 0; p < len;) {
        const char *nl = memchr(text + p, '\n', len - p);
        size_t e = nl ? (size_t)(nl - text) : len;
        line_no++;
        const char *line = text + p;
        size_t n = e - p;
        p = e + 1;
        if (blank(line, n)) continue;
        if (!jsonl) {
            moeq_status st = docs_add(d, line, n, line_no);
            if (st) return st;
            continue;
        }
        cJSON *j = cJSON_ParseWithLength(line, n);
        if (!cJSON_IsObject(j)) {
            cJSON_Delete(j);
            return mq_err(MOEQ_E_FORMAT, "%s:%lld: not a JSON object", path, (long long)line_no);
        }
        const char *name = field;
        if (!name) name = cJSON_HasObjectItem(j, "text") || !cJSON_HasObjectItem(j, "messages") ? "text" : "messages";
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, name);
        moeq_status st;
        if (cJSON_IsString(t)) st = docs_add(d, t->valuestring, strlen(t->valuestring), line_no);
        else if (cJSON_IsArray(t)) st = join_messages(t, path, line_no, d);
        else
            st = mq_err(MOEQ_E_FORMAT, "%s:%lld: expected a string or a messages list in \"%s\"%s", path,
                        (long long)line_no, name, field ? "" : " (or --calib-field NAME)");
        cJSON_Delete(j);
        if (st) return st;
    }
    return MOEQ_OK;
}

moeq_status mq_calib_read_all(const char *path, const char *field, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    char *raw;
    size_t n;
    moeq_status st = read_input(path, &raw, &n);
    if (st) return st;
    doc_list d = {0};
    st = read_docs(path, field, raw, n, false, &d);
    free(raw);
    size_t total = 0;
    for (int64_t i = 0; !st && i < d.n; i++) total += d.len[i] + 2;
    char *out = st ? NULL : malloc(total + 1);
    if (!st && !out) st = mq_err(MOEQ_E_NOMEM, "out of memory reading %s", path);
    if (!st) {
        size_t k = 0;
        for (int64_t i = 0; i < d.n; i++) {
            if (i) {
                memcpy(out + k, "\n\n", 2);
                k += 2;
            }
            memcpy(out + k, d.doc[i], d.len[i]);
            k += d.len[i];
        }
        out[k] = 0;
        *text = out;
        *len = k;
    }
    docs_free(&d);
    return st;
}

moeq_status mq_calib_load(const moeq_tokenizer *tok, const mq_calib_opts *o, mq_calib_set *out) {
    memset(out, 0, sizeof *out);
    moeq_status st = check_opts(o);
    if (st) return st;
    if (!tok) return mq_err(MOEQ_E_ARG, "%s: calibration needs the model's tokenizer", o->path);
    int32_t bos = o->bos ? moeq_tokenizer_bos(tok) : -1;
    if (o->bos && bos < 0)
        return mq_err(MOEQ_E_ARG, "%s: the tokenizer has no BOS token for --calib-bos", o->path);
    char *text;
    size_t len;
    if ((st = read_input(o->path, &text, &len))) return st;
    doc_list d = {0};
    st = read_docs(o->path, o->field, text, len, o->mode == MQ_CALIB_DOCS, &d);
    free(text);
    if (st) {
        docs_free(&d);
        return st;
    }
    if (o->mode == MQ_CALIB_DOCS) {
        if ((st = set_alloc(out, o->nsamples))) goto done;
        const int64_t L = o->seqlen - (bos >= 0 ? 1 : 0);
        for (int64_t i = 0; i < d.n && out->n < o->nsamples && !st; i++) {
            int32_t *ids;
            size_t n;
            if ((st = doc_encode(tok, &d, i, o->path, &ids, &n))) break;
            if (n > 0) st = set_add(out, bos, ids, (int64_t)n < L ? (int64_t)n : L);
            free(ids);
        }
        if (!st && out->n == 0) st = mq_err(MOEQ_E_FORMAT, "%s: no calibration documents", o->path);
        if (!st && out->n < o->nsamples && !o->pool)
            mq_warn("%s: only %lld documents for %lld calibration samples", o->path,
                    (long long)out->n, (long long)o->nsamples);
        if (st) mq_calib_free(out);
    } else {
        /* one token stream: the documents tokenized one by one, concatenated */
        int32_t *all = NULL;
        int64_t n_all = 0;
        for (int64_t i = 0; i < d.n && !st; i++) {
            int32_t *ids;
            size_t n;
            if ((st = doc_encode(tok, &d, i, o->path, &ids, &n))) break;
            int32_t *grown = realloc(all, (size_t)(n_all + (int64_t)n + 1) * sizeof(int32_t));
            if (!grown) {
                free(ids);
                st = mq_err(MOEQ_E_NOMEM, "out of memory tokenizing %s", o->path);
                break;
            }
            all = grown;
            memcpy(all + n_all, ids, n * sizeof(int32_t));
            n_all += (int64_t)n;
            free(ids);
        }
        if (!st) st = from_ids(all, n_all, o, bos, o->path, out);
        free(all);
    }
done:
    docs_free(&d);
    return st;
}
