/*
 * Option values read from text, for the setters that take options by name
 * (moeq_quant_options_set, moeq_eval_options_set). Errors are MOEQ_E_ARG with the message
 * "KEY=VALUE: expected ..." (include/moeq.h promises that form; the CLI names its flag from it).
 */
#ifndef MOEQ_CORE_OPTVAL_H
#define MOEQ_CORE_OPTVAL_H

#include "core/core.h"

moeq_status mq_opt_bad(const char *key, const char *value, const char *want);
/* An integer in lo .. hi (lo > hi: any). */
moeq_status mq_opt_int(const char *key, const char *v, int64_t lo, int64_t hi, int64_t *out);
/* A finite number in lo .. hi. */
moeq_status mq_opt_double(const char *key, const char *v, double lo, double hi, double *out);
/* 1, true, True or 0, false, False. */
moeq_status mq_opt_bool(const char *key, const char *v, int *out);

#endif
