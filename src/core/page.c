/* A growing text buffer and the report pages' SVG helpers (page.h). */
#include "core/page.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Room for n more bytes and the NUL after them; false (and oom) when it cannot be had. */
static bool page_room(mq_page *b, size_t n) {
    if (b->oom) return false;
    if (b->s && b->n + n < b->cap) return true;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap <= b->n + n) cap *= 2;
    char *g = realloc(b->s, cap);
    if (!g) {
        b->oom = true;
        return false;
    }
    b->s = g;
    b->cap = cap;
    return true;
}

void mq_page_put(mq_page *b, const char *t, size_t n) {
    if (n == 0 || !page_room(b, n)) return;
    memcpy(b->s + b->n, t, n);
    b->n += n;
    b->s[b->n] = 0;
}

void mq_page_printf(mq_page *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = true;
            return;
        }
        if (b->s && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        if (!page_room(b, (size_t)k)) return;
    }
}

void mq_page_text(mq_page *b, const char *t) {
    for (; t && *t; t++) {
        switch (*t) {
        case '&': mq_page_printf(b, "&amp;"); break;
        case '<': mq_page_printf(b, "&lt;"); break;
        case '>': mq_page_printf(b, "&gt;"); break;
        case '"': mq_page_printf(b, "&quot;"); break;
        default: mq_page_printf(b, "%c", *t);
        }
    }
}

void mq_page_label(mq_page *b, double x, double y, const char *anchor, const char *text) {
    mq_page_printf(b, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" font-size=\"11\">", x, y, anchor);
    mq_page_text(b, text);
    mq_page_printf(b, "</text>");
}

void mq_page_shade(double t, char out[8]) {
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    int r = (int)lround(247 - t * (247 - 8)), g = (int)lround(251 - t * (251 - 48)),
        bl = (int)lround(255 - t * (255 - 107));
    snprintf(out, 8, "#%02x%02x%02x", r & 255, g & 255, bl & 255);
}

void mq_page_begin(mq_page *b, const char *title) {
    mq_page_printf(b, "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n"
                   "<meta charset=\"utf-8\"/>\n<title>");
    mq_page_text(b, title);
    mq_page_printf(b, "</title>\n<style>\n"
                   "body{font-family:sans-serif;margin:24px;color:#222;max-width:1000px}"
                   "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
                   "h2{margin-top:32px;font-size:18px}p.note{color:#555;font-size:13px}\n</style>\n</head>\n<body>\n<h1>");
    mq_page_text(b, title);
    mq_page_printf(b, "</h1>\n");
}

void mq_page_end(mq_page *b) {
    mq_page_printf(b, "<p class=\"note\">Drawn by moeq %s.</p>\n</body>\n</html>\n", moeq_version());
}

moeq_status mq_page_save(mq_page *b, const char *path) {
    moeq_status st = b->oom ? mq_err(MOEQ_E_NOMEM, "out of memory drawing %s", path)
                            : mq_write_file_atomic(path, b->s, b->n);
    free(b->s);
    b->s = NULL;
    b->n = b->cap = 0;
    return st;
}
