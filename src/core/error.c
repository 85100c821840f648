/* Status names and the per-thread last-error message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define MQ_ERR_CAP 2048
static _Thread_local char g_last_error[MQ_ERR_CAP];

const char *moeq_version(void) { return MOEQ_VERSION_STRING; }

const char *moeq_status_name(moeq_status st) {
    switch (st) {
#define MQ__NAME(name, value, text)                                                                \
    case name: return #name;
        MOEQ_STATUS_LIST(MQ__NAME)
#undef MQ__NAME
    }
    return "unknown";
}

const char *moeq_status_text(moeq_status st) {
    switch (st) {
#define MQ__TEXT(name, value, text)                                                                \
    case name: return text;
        MOEQ_STATUS_LIST(MQ__TEXT)
#undef MQ__TEXT
    }
    return "unknown status";
}

const char *moeq_last_error(void) { return g_last_error; }

moeq_status mq_err(moeq_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return st;
}

moeq_status mq_err_prefix(moeq_status st, const char *fmt, ...) {
    char prefix[512];
    char old[MQ_ERR_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, g_last_error, sizeof old);
    const char *rest = old[0] ? old : moeq_status_text(st);
    /* Truncation of very long messages is acceptable; build the string piecewise. */
    size_t n = strlen(prefix);
    if (n > sizeof g_last_error - 3) n = sizeof g_last_error - 3;
    memcpy(g_last_error, prefix, n);
    g_last_error[n++] = ':';
    g_last_error[n++] = ' ';
    size_t m = strlen(rest);
    if (m > sizeof g_last_error - 1 - n) m = sizeof g_last_error - 1 - n;
    memcpy(g_last_error + n, rest, m);
    g_last_error[n + m] = 0;
    return st;
}

void mq_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "moeq: internal error: assertion '%s' failed at %s:%d\n", expr, file, line);
    abort();
}

#ifdef MOEQ_SANITIZE_BUILD
/* -DMOEQ_SANITIZE=ON: UBSan's first report ends the program (a failing test), with its stack; the
 * runtime asks for these defaults. The checks are built recoverable because GCC's non-recovering
 * ones miscompiled AVX2 code. */
const char *__ubsan_default_options(void);
const char *__ubsan_default_options(void) { return "halt_on_error=1:print_stacktrace=1"; }
#endif
