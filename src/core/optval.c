/* Option values read from text, for the setters by name (see optval.h). */
#include "core/optval.h"

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
