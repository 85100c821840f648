/*
 * Evaluation documents: the wikitext layout (a document starts at each " = Title = " line, as the
 * EleutherAI/wikitext_document_level pages do), JSONL (one object a line, the document in its
 * "page" field, else "text"; parsed with cJSON) and whole-file text. The text must be UTF-8:
 * invalid input is an error naming the file and byte offset, as Python's decode would fail.
 */
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "eval/eval.h"

struct moeq_docs {
    char *data; /* all document texts (the file itself, or decoded JSONL strings) */
    size_t data_len;
    int64_t n, cap;
    size_t *off, *len;
};

static moeq_status docs_add(moeq_docs *d, const char *name, size_t off, size_t len) {
    if (d->n == d->cap) {
        int64_t cap = d->cap ? 2 * d->cap : 64;
        size_t *o = realloc(d->off, sizeof(size_t) * (size_t)cap);
        if (o) d->off = o;
        size_t *l = o ? realloc(d->len, sizeof(size_t) * (size_t)cap) : NULL;
        if (l) d->len = l;
        if (!o || !l) return mq_err(MOEQ_E_NOMEM, "%s: out of memory for the document list", name);
        d->cap = cap;
    }
    d->off[d->n] = off;
    d->len[d->n] = len;
    d->n++;
    return MOEQ_OK;
}

/* A title line, after stripping whitespace, is "= Title =" with a single '=' on each side
 * (section headings are "= = Section = =", and " = National record " is text). */
static bool is_title_line(const char *s, size_t n) {
    size_t w;
    while (n && (w = mq_utf8_space_len(s, n)) != 0) s += w, n -= w;
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r')) n--;
    if (n < 4 || s[0] != '=' || s[1] != ' ' || s[n - 1] != '=' || s[n - 2] != ' ') return false;
    if (s[2] == '=' || s[n - 3] == '=') return false;
    return true;
}

static moeq_status split_wikitext(moeq_docs *d, const char *name) {
    const char *s = d->data;
    size_t n = d->data_len, doc_start = 0, line = 0;
    while (line < n) {
        const char *nl = memchr(s + line, '\n', n - line);
        size_t end = nl ? (size_t)(nl - s) : n;
        if (line > doc_start && is_title_line(s + line, end - line)) {
            moeq_status st = docs_add(d, name, doc_start, line - doc_start);
            if (st) return st;
            doc_start = line;
        }
        line = nl ? end + 1 : n;
    }
    if (n > doc_start) return docs_add(d, name, doc_start, n - doc_start);
    return MOEQ_OK;
}

static moeq_status split_jsonl(moeq_docs *d, const char *name) {
    /* The decoded strings go into a new buffer, each with a NUL: a string plus its NUL is always
     * shorter than the JSON line that holds it. */
    char *raw = d->data;
    size_t n = d->data_len, pos = 0, line_no = 0, used = 0;
    char *out = malloc(n + 1);
    if (!out) return mq_err(MOEQ_E_NOMEM, "%s: out of memory", name);
    moeq_status st = MOEQ_OK;
    while (pos < n && st == MOEQ_OK) {
        line_no++;
        const char *nl = memchr(raw + pos, '\n', n - pos);
        size_t end = nl ? (size_t)(nl - raw) : n, a = pos, w;
        pos = nl ? end + 1 : n;
        while (a < end && (w = mq_utf8_space_len(raw + a, end - a)) != 0) a += w;
        if (a == end) continue; /* blank line */
        cJSON *obj = cJSON_ParseWithLength(raw + a, end - a);
        if (!obj || !cJSON_IsObject(obj)) {
            st = mq_err(MOEQ_E_FORMAT, "%s:%zu: not a JSON object", name, line_no);
        } else {
            cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, "page");
            if (!f) f = cJSON_GetObjectItemCaseSensitive(obj, "text");
            if (!f || !cJSON_IsString(f) || !f->valuestring) {
                st = mq_err(MOEQ_E_FORMAT, "%s:%zu: needs a string field \"page\" or \"text\"",
                            name, line_no);
            } else {
                size_t len = strlen(f->valuestring), bad = 0;
                if (!mq_utf8_valid(f->valuestring, len, &bad))
                    st = mq_err(MOEQ_E_FORMAT,
                                "%s:%zu: the decoded string is not valid UTF-8 "
                                "(byte %zu of the string)",
                                name, line_no, bad);
                else if (used + len + 1 > n)
                    st = mq_err(MOEQ_E_FORMAT, "%s:%zu: decoded string longer than its line", name,
                                line_no);
                else {
                    memcpy(out + used, f->valuestring, len + 1); /* with its NUL */
                    st = docs_add(d, name, used, len);
                    used += len + 1;
                }
            }
        }
        cJSON_Delete(obj);
    }
    free(d->data);
    d->data = out;
    d->data_len = used;
    return st;
}

/* Gives every document of a split file its own NUL terminator. */
static moeq_status terminate_docs(moeq_docs *d, const char *name) {
    size_t total;
    if (!mq_add_size(d->data_len, (size_t)d->n + 1, &total))
        return mq_err(MOEQ_E_NOMEM, "%s: too large", name);
    char *buf = malloc(total);
    if (!buf) return mq_err(MOEQ_E_NOMEM, "%s: out of memory (%zu bytes)", name, total);
    size_t used = 0;
    for (int64_t i = 0; i < d->n; i++) {
        memcpy(buf + used, d->data + d->off[i], d->len[i]);
        d->off[i] = used;
        used += d->len[i];
        buf[used++] = 0;
    }
    free(d->data);
    d->data = buf;
    d->data_len = used;
    return MOEQ_OK;
}

void moeq_docs_free(moeq_docs *d) {
    if (!d) return;
    MQ_FREE_EACH(d->data, d->off, d->len, d);
}

/* Takes ownership of buf (len bytes plus a NUL). */
static moeq_status docs_from_buffer(const char *name, char *buf, size_t len,
                                    moeq_docs_layout layout, moeq_docs **out) {
    *out = NULL;
    moeq_status st = MOEQ_OK;
    size_t bad = 0;
    if (layout != MOEQ_DOCS_WIKITEXT && layout != MOEQ_DOCS_JSONL && layout != MOEQ_DOCS_WHOLE)
        st = mq_err(MOEQ_E_ARG, "%s: unknown document layout %d", name, (int)layout);
    else if (len == 0)
        st = mq_err(MOEQ_E_FORMAT, "%s: the file is empty", name);
    else if (!mq_utf8_valid(buf, len, &bad))
        st = mq_err(MOEQ_E_FORMAT, "%s: invalid UTF-8 at byte offset %zu", name, bad);
    moeq_docs *d = st ? NULL : calloc(1, sizeof *d);
    if (!st && !d) st = mq_err(MOEQ_E_NOMEM, "%s: out of memory", name);
    if (st) {
        free(buf);
        return st;
    }
    d->data = buf;
    d->data_len = len;
    if (layout == MOEQ_DOCS_WIKITEXT)
        st = split_wikitext(d, name);
    else if (layout == MOEQ_DOCS_JSONL)
        st = split_jsonl(d, name);
    else
        st = docs_add(d, name, 0, len);
    if (st == MOEQ_OK && d->n == 0) st = mq_err(MOEQ_E_FORMAT, "%s: no documents", name);
    if (st == MOEQ_OK && layout == MOEQ_DOCS_WIKITEXT) st = terminate_docs(d, name);
    if (st != MOEQ_OK) {
        moeq_docs_free(d);
        return st;
    }
    *out = d;
    return MOEQ_OK;
}

moeq_status moeq_docs_parse(const char *name, const char *data, size_t len, moeq_docs_layout layout,
                            moeq_docs **out) {
    *out = NULL;
    char *buf = malloc(len + 1);
    if (!buf)
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory (%zu bytes)", name ? name : "(text)", len);
    if (len) memcpy(buf, data, len);
    buf[len] = 0;
    return docs_from_buffer(name ? name : "(text)", buf, len, layout, out);
}

moeq_status moeq_docs_load(const char *path, moeq_docs_layout layout, moeq_docs **out) {
    *out = NULL;
    char *buf = NULL;
    size_t len = 0;
    moeq_status st = mq_read_file(path, &buf, &len);
    if (st) return st;
    return docs_from_buffer(path, buf, len, layout, out);
}

int64_t moeq_docs_count(const moeq_docs *d) { return d ? d->n : 0; }

const char *moeq_docs_text(const moeq_docs *d, int64_t i, size_t *len) {
    if (!d || i < 0 || i >= d->n) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = d->len[i];
    return d->data + d->off[i];
}
