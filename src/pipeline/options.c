/*
 * moeq_quant_options by name: the defaults, the setter other languages and the CLI use
 * (moeq_quant_options_set, by `moeq quantize`'s flag names) and the description of every option
 * (moeq_quant_option_info), all generated from the one table in quant_options.def.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/options.h"

size_t moeq_quant_options_size(void) { return sizeof(moeq_quant_options); }

void moeq_quant_options_set_ignore(moeq_quant_options *o, const char *const *patterns, int32_t n) {
    o->ignore = patterns;
    o->n_ignore = n;
}

/* ---- the options that are more than a field ---------------------------------------------- */

/* mse: the scale search for RTN and (already on by default) for GPTQ */
static moeq_status set_mse(moeq_quant_options *o, const char *key, const char *v) {
    int on = 0;
    moeq_status st = mq_opt_bool(key, v, &on);
    if (!st) o->mse = o->gptq.mse = on;
    return st;
}

static moeq_status set_gpu_tf32(moeq_quant_options *o, const char *key, const char *v) {
    int on = 0;
    moeq_status st = mq_opt_bool(key, v, &on);
    if (!st) o->gpu_precision = on ? MOEQ_GPU_TF32 : MOEQ_GPU_FP32;
    return st;
}

static moeq_status set_static_groups(moeq_quant_options *o, const char *key, const char *v) {
    int on = 0;
    moeq_status st = mq_opt_bool(key, v, &on);
    if (!st) o->gptq.groups = on ? MOEQ_GPTQ_GROUPS_STATIC : MOEQ_GPTQ_GROUPS_DYNAMIC;
    return st;
}

/* LO:HI or LO:HI:N, LO and HI > 0 (their order and N's range are moeq_quantize's checks, which
 * name the fields) */
static moeq_status set_scale_search(moeq_quant_options *o, const char *key, const char *v) {
    char *end;
    double lo = strtod(v, &end), hi = 0;
    long n = 0;
    static const char want[] = "LO:HI or LO:HI:N with LO and HI > 0, e.g. 0.9:1.5";
    if (end == v || *end != ':') return mq_opt_bad(key, v, want);
    const char *h = end + 1;
    hi = strtod(h, &end);
    if (end == h) return mq_opt_bad(key, v, want);
    if (*end == ':') {
        const char *s = end + 1;
        n = strtol(s, &end, 10);
        if (end == s) return mq_opt_bad(key, v, want);
    }
    if (*end || !(lo > 0) || !(hi > 0) || n < 0 || n > INT32_MAX) return mq_opt_bad(key, v, want);
    o->scale_lo = lo;
    o->scale_hi = hi;
    o->scale_steps = (int32_t)n;
    return MOEQ_OK;
}

/* F,F,...: up to 8 candidates; "" or "none": no sweep */
static moeq_status set_damp_sweep(moeq_quant_options *o, const char *key, const char *v) {
    double x[8];
    int32_t n = 0;
    for (const char *q = v; *q && strcmp(v, "none");) {
        char *end;
        errno = 0;
        const double d = strtod(q, &end);
        if (end == q || errno || !isfinite(d) || d < 0 || n == 8 || (*end && *end != ','))
            return mq_opt_bad(key, v, "up to 8 damping fractions >= 0 separated by commas, e.g. 0.003,0.01,0.03,0.1");
        x[n++] = d;
        q = *end ? end + 1 : end;
    }
    memcpy(o->gptq.damp_sweep, x, sizeof x[0] * (size_t)n);
    o->gptq.n_damp_sweep = n;
    return MOEQ_OK;
}

/* quantized | unquantized | unquantized:A, A in (0, 1] */
static moeq_status set_target(moeq_quant_options *o, const char *key, const char *v) {
    static const char want[] = "quantized, unquantized or unquantized:A with A in (0, 1]";
    double a = 0.5;
    if (!strcmp(v, "quantized")) {
        a = 0;
    } else if (strncmp(v, "unquantized", 11) != 0 || (v[11] && v[11] != ':')) {
        return mq_opt_bad(key, v, want);
    } else if (v[11] == ':') {
        char *end;
        errno = 0;
        a = strtod(v + 12, &end);
        if (end == v + 12 || *end || errno || !(a > 0 && a <= 1)) return mq_opt_bad(key, v, want);
    }
    o->gptq.target_unquantized = a;
    return MOEQ_OK;
}

/* ---- the generated forms ------------------------------------------------------------------ */

void moeq_quant_options_init(moeq_quant_options *o) {
    memset(o, 0, sizeof *o);
#define MQ_QOPT(key, kind, p1, p2, field, def, metavar, identity, record, help) o->field = def;
#include "pipeline/quant_options.def"
#undef MQ_QOPT
}

/* One statement per kind (core/optval.h's), and the list, which has a setter of its own. */
#define MQ_OPTSET_LIST(p1, p2, field)                                                              \
    return mq_err(MOEQ_E_ARG, "%s: a list, set with moeq_quant_options_set_ignore", key);

moeq_status moeq_quant_options_set(moeq_quant_options *o, const char *key, const char *v) {
    if (!o || !key || !v) return mq_err(MOEQ_E_ARG, "moeq_quant_options_set: NULL argument");
    moeq_status st = MOEQ_OK;
#define MQ_QOPT(name, kind, p1, p2, field, def, metavar, identity, record, help)                  \
    if (!strcmp(key, name)) {                                                                      \
        MQ_OPTSET_##kind(p1, p2, field) return st;                                                 \
    }
#include "pipeline/quant_options.def"
#undef MQ_QOPT
    return mq_err(MOEQ_E_ARG, "unknown quantize option '%s' (the names of moeq quantize's flags)", key);
}

/* The public description of a row (core/optval.h's, and the list). */
#define MQ_OPTINFO_LIST(p1, p2) MOEQ_OPTION_LIST, NULL, 0, 0

static const moeq_option_info g_quant_options[] = {
#define MQ_QOPT(name, kind, p1, p2, field, def, metavar, identity, record, help)                  \
    {name, MQ_OPTINFO_##kind(p1, p2), metavar, help, identity == MQ_QO_ID},
#include "pipeline/quant_options.def"
#undef MQ_QOPT
};

const moeq_option_info *moeq_quant_option_info(int i) {
    const int n = (int)(sizeof g_quant_options / sizeof g_quant_options[0]);
    return i >= 0 && i < n ? &g_quant_options[i] : NULL;
}
