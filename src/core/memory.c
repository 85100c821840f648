/* Checked allocation and arithmetic. Every allocation failure names what was being allocated. */
#include <stdlib.h>
#include <string.h>

#include "core.h"

bool mq_mul_size(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return false;
    *out = a * b;
    return true;
}

bool mq_add_size(size_t a, size_t b, size_t *out) {
    if (b > SIZE_MAX - a) return false;
    *out = a + b;
    return true;
}

bool mq_mul_i64(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0) return false;
    if (a != 0 && b > INT64_MAX / a) return false;
    *out = a * b;
    return true;
}

void *mq_alloc(size_t n, const char *what) {
    void *p = NULL;
    size_t rounded;
    if (n == 0) n = 1;
    if (!mq_add_size(n, 63, &rounded)) {
        mq_err(MOEQ_E_NOMEM, "out of memory: %s needs %zu bytes", what ? what : "buffer", n);
        return NULL;
    }
    rounded &= ~(size_t)63;
    p = aligned_alloc(64, rounded);
    if (!p) mq_err(MOEQ_E_NOMEM, "out of memory: %s needs %zu bytes", what ? what : "buffer", n);
    return p;
}

void *mq_alloc_zero(size_t n, const char *what) {
    void *p = mq_alloc(n, what);
    if (p) memset(p, 0, n);
    return p;
}

void *mq_alloc_array(size_t count, size_t elem, const char *what) {
    size_t n;
    if (!mq_mul_size(count, elem, &n)) {
        mq_err(MOEQ_E_NOMEM, "out of memory: %s: %zu x %zu bytes overflows", what ? what : "array",
               count, elem);
        return NULL;
    }
    return mq_alloc(n, what);
}

void mq_free(void *p) { free(p); }

char *mq_strdup(const char *s) { return s ? mq_strndup(s, strlen(s)) : NULL; }

char *mq_strndup(const char *s, size_t n) {
    char *r = malloc(n + 1);
    if (!r) {
        mq_err(MOEQ_E_NOMEM, "out of memory copying a string of %zu bytes", n);
        return NULL;
    }
    memcpy(r, s, n);
    r[n] = 0;
    return r;
}

char *mq_asprintf(const char *fmt, ...) {
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *r = NULL;
    if (n >= 0 && (r = malloc((size_t)n + 1)) != NULL) vsnprintf(r, (size_t)n + 1, fmt, ap2);
    va_end(ap2);
    if (!r) mq_err(MOEQ_E_NOMEM, "out of memory formatting a string");
    return r;
}
