/*
 * moeq_gen_options by name: the defaults, the setter and the description generated from the one
 * table in gen_options.def, so that `moeq generate`, `moeq chat`, the server's request fields and
 * any binding read the same keys with the same ranges.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "core/optval.h"
#include "runtime/gen_options.h"

size_t moeq_gen_options_size(void) { return sizeof(moeq_gen_options); }

/* ---- the options that are more than a field ---------------------------------------------- */

/* (0, 1]: the sampler keeps at least one candidate, and 0 would keep none */
static moeq_status set_top_p(moeq_gen_options *o, const char *key, const char *v) {
    double d = 0;
    moeq_status st = mq_opt_double(key, v, -HUGE_VAL, HUGE_VAL, &d);
    if (!st && !(d > 0 && d <= 1)) st = mq_opt_bad(key, v, "a number in (0, 1]");
    if (!st) o->sampling.top_p = d;
    return st;
}

/* a divisor of the positive logits: positive */
static moeq_status set_repeat_penalty(moeq_gen_options *o, const char *key, const char *v) {
    double d = 0;
    moeq_status st = mq_opt_double(key, v, -HUGE_VAL, HUGE_VAL, &d);
    if (!st && !(d > 0)) st = mq_opt_bad(key, v, "a number > 0 (1: off)");
    if (!st) o->sampling.repeat_penalty = d;
    return st;
}

/* ---- the generated forms ------------------------------------------------------------------ */

static void table_defaults(moeq_gen_options *o) {
    memset(o, 0, sizeof *o);
#define MQ_GOPT(key, kind, p1, p2, field, def, samples, json, metavar, help) o->field = def;
#include "runtime/gen_options.def"
#undef MQ_GOPT
}

void moeq_sampler_options_init(moeq_sampler_options *o) {
    if (!o) return;
    moeq_gen_options g;
    table_defaults(&g);
    *o = g.sampling;
}

void moeq_gen_options_init(moeq_gen_options *o) {
    table_defaults(o);
    o->sampling.temperature = 0;   /* greedy until a caller asks for sampling */
}

moeq_status moeq_gen_options_set(moeq_gen_options *o, const char *key, const char *v) {
    if (!o || !key || !v) return mq_err(MOEQ_E_ARG, "moeq_gen_options_set: NULL argument");
    moeq_status st = MOEQ_OK;
#define MQ_GOPT(name, kind, p1, p2, field, def, samples, json, metavar, help)                      \
    if (!strcmp(key, name)) {                                                                      \
        MQ_OPTSET_##kind(p1, p2, field) return st;                                                 \
    }
#include "runtime/gen_options.def"
#undef MQ_GOPT
    return mq_err(MOEQ_E_ARG, "unknown generation option '%s' (the names of moeq generate's flags)", key);
}

static const moeq_option_info g_gen_options[] = {
#define MQ_GOPT(name, kind, p1, p2, field, def, samples, json, metavar, help)                      \
    {name, MQ_OPTINFO_##kind(p1, p2), metavar, help, samples},
#include "runtime/gen_options.def"
#undef MQ_GOPT
};

const moeq_option_info *moeq_gen_option_info(int i) {
    const int n = (int)(sizeof g_gen_options / sizeof g_gen_options[0]);
    return i >= 0 && i < n ? &g_gen_options[i] : NULL;
}

/* Each row's value as the text its flag would carry: numbers exactly ("%.17g" reads back the same
 * double), integers in full. */
#define MQ_GTEXT_NUM(field) snprintf(v, sizeof v, "%.17g", (double)o->field)
#define MQ_GTEXT_NUM_FN(field) MQ_GTEXT_NUM(field)
#define MQ_GTEXT_INT(field) snprintf(v, sizeof v, "%lld", (long long)o->field)
#define MQ_GTEXT_SWITCH(field) snprintf(v, sizeof v, "%s", o->field ? "true" : "false")

moeq_status mq_gen_options_check(const moeq_gen_options *o, const char *who) {
    moeq_gen_options scratch;
    char v[64], why[256];
    moeq_gen_options_init(&scratch);
#define MQ_GOPT(key, kind, p1, p2, field, def, samples, json, metavar, help)                       \
    MQ_GTEXT_##kind(field);                                                                        \
    if (moeq_gen_options_set(&scratch, key, v)) {                                                  \
        const char *f = #field;                                                                    \
        snprintf(why, sizeof why, "%s", moeq_last_error());                                        \
        return mq_err(MOEQ_E_ARG, "%s: %s: %s", who, strchr(f, '.') ? strchr(f, '.') + 1 : f, why); \
    }
#include "runtime/gen_options.def"
#undef MQ_GOPT
    return MOEQ_OK;
}
