/* Option values read from text, for the setters by name (see optval.h). */
#include "core/optval.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

moeq_status mq_opt_bad(const char *key, const char *value, const char *want) {
    return mq_err(MOEQ_E_ARG, "%s=%s: expected %s", key, value, want);
}

moeq_status mq_opt_int(const char *key, const char *v, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno) return mq_opt_bad(key, v, "an integer");
    if (lo <= hi && (x < lo || x > hi))
        return mq_err(MOEQ_E_ARG, "%s=%s: expected an integer from %lld to %lld", key, v, (long long)lo,
                      (long long)hi);
    *out = x;
    return MOEQ_OK;
}

moeq_status mq_opt_double(const char *key, const char *v, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x)) return mq_opt_bad(key, v, "a number");
    if (x < lo || x > hi) {
        if (isinf(hi)) return mq_err(MOEQ_E_ARG, "%s=%s: expected a number >= %g", key, v, lo);
        return mq_err(MOEQ_E_ARG, "%s=%s: expected a number from %g to %g", key, v, lo, hi);
    }
    *out = x;
    return MOEQ_OK;
}

moeq_status mq_opt_bool(const char *key, const char *v, int *out) {
    if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "True")) *out = 1;
    else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "False")) *out = 0;
    else return mq_opt_bad(key, v, "true or false");
    return MOEQ_OK;
}

moeq_status mq_opt_size(const char *key, const char *v, int64_t *out) {
    static const struct {
        const char *suffix;
        double unit;
    } units[] = {{"", 1},       {"B", 1},           {"K", 1e3},           {"KB", 1e3},
                 {"M", 1e6},    {"MB", 1e6},        {"G", 1e9},           {"GB", 1e9},
                 {"T", 1e12},   {"TB", 1e12},       {"KiB", 1024.0},      {"MiB", 1048576.0},
                 {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || errno || !(x >= 0)) return mq_opt_bad(key, v, "a size such as 6GB");
    while (*end == ' ') end++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        const char *s = units[i].suffix;
        size_t n = strlen(s), k = 0;
        if (strlen(end) != n) continue;
        while (k < n && toupper((unsigned char)end[k]) == toupper((unsigned char)s[k])) k++;
        if (k < n) continue;
        const double b = x * units[i].unit;
        if (b > 1e18) break;
        *out = (int64_t)b;
        return MOEQ_OK;
    }
    return mq_opt_bad(key, v, "a size such as 6GB");
}

int mq_opt_choice_index(const char *v, const char *names) {
    const size_t n = strlen(v);
    int i = 0;
    for (const char *c = names; c; i++) {
        const char *bar = strchr(c, '|');
        const size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (n > 0 && len == n && !strncmp(c, v, n)) return i;
        c = bar ? bar + 1 : NULL;
    }
    return -1;
}

const char *mq_opt_choice_name(const char *names, int i, char *buf, size_t cap) {
    for (const char *c = names; c && cap > 0; i--) {
        const char *bar = strchr(c, '|');
        const size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (i == 0) {
            const size_t k = len < cap - 1 ? len : cap - 1;
            memcpy(buf, c, k);
            buf[k] = 0;
            return buf;
        }
        c = bar ? bar + 1 : NULL;
    }
    return NULL;
}

moeq_status mq_opt_bad_choice(const char *key, const char *v, const char *names) {
    char want[160];
    size_t k = 0;
    for (const char *c = names; *c && k + 8 < sizeof want; c++) {
        /* "a|b|c" as "a, b or c" */
        if (*c != '|') {
            want[k++] = *c;
            continue;
        }
        const bool last = !strchr(c + 1, '|');
        const char *sep = last ? " or " : ", ";
        for (const char *s = sep; *s; s++) want[k++] = *s;
    }
    want[k] = 0;
    return mq_opt_bad(key, v, want);
}
