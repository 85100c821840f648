/*
 * Problem collector for src/model: config and checkpoint validation gathers every problem and
 * reports them together, so one failed load says everything that is wrong.
 */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

/* The last-error buffer holds 2048 bytes; keep the list inside it. */
enum { SHOWN_CAP = 1700 };

void mq_problems_init(mq_problems *p) { memset(p, 0, sizeof *p); }

void mq_problems_free(mq_problems *p) {
    free(p->buf);
    memset(p, 0, sizeof *p);
}

void mq_problems_add(mq_problems *p, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    p->n++;
    size_t n = strlen(line), need = p->len + n + 3;
    if (p->len + n + 2 > SHOWN_CAP) return;
    if (need > p->cap) {
        size_t cap = need < 256 ? 256 : need * 2;
        char *b = realloc(p->buf, cap);
        if (!b) return;
        p->buf = b;
        p->cap = cap;
    }
    if (p->len) {
        memcpy(p->buf + p->len, "; ", 2);
        p->len += 2;
    }
    memcpy(p->buf + p->len, line, n + 1);
    p->len += n;
    p->n_shown++;
}

moeq_status mq_problems_error(const mq_problems *p, moeq_status st, const char *prefix_fmt, ...) {
    char prefix[600];
    va_list ap;
    va_start(ap, prefix_fmt);
    vsnprintf(prefix, sizeof prefix, prefix_fmt, ap);
    va_end(ap);
    if (p->n == p->n_shown)
        return mq_err(st, "%s: %d problem%s: %s", prefix, p->n, p->n == 1 ? "" : "s",
                      p->buf ? p->buf : "");
    return mq_err(st, "%s: %d problems: %s (and %d more)", prefix, p->n, p->buf ? p->buf : "",
                  p->n - p->n_shown);
}
