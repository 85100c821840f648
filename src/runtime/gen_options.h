/* Inside the runtime: the generation option table's check of a struct filled by hand. */
#ifndef MOEQ_RUNTIME_GEN_OPTIONS_H
#define MOEQ_RUNTIME_GEN_OPTIONS_H

#include "core/core.h"

/* Every option of o that gen_options.def lists, as the text a flag would carry, through
 * moeq_gen_options_set: MOEQ_E_ARG "WHO: FIELD: KEY=VALUE: expected ..." for the first one the
 * table's range refuses (moeq_sampler_create's check, so a struct and a flag take the same). */
moeq_status mq_gen_options_check(const moeq_gen_options *o, const char *who);

#endif
