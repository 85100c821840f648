/*
 * Option values read from text, for the setters that take options by name
 * (moeq_quant_options_set, moeq_eval_options_set). Errors are MOEQ_E_ARG with the message
 * "KEY=VALUE: expected ..." (include/moeq.h promises that form; the CLI names its flag from it).
 * Below them, the pieces an option table (a .def file of rows MQ_xOPT(KEY, KIND, P1, P2, FIELD,
 * ...)) generates its setter and its moeq_option_info from, one macro per KIND.
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

/* A byte count: a number with an optional K, M, G, T (powers of 1000) or KiB, MiB, GiB, TiB
 * suffix, B optional, any case: 6GB, 500MB, 2GiB, 1048576. */
moeq_status mq_opt_size(const char *key, const char *v, int64_t *out);
/* The position of v among the names "a|b|c", or -1. */
int mq_opt_choice_index(const char *v, const char *names);
/* The i-th of the names "a|b|c" into buf; NULL when there is none. */
const char *mq_opt_choice_name(const char *names, int i, char *buf, size_t cap);
/* "KEY=VALUE: expected a, b or c" */
moeq_status mq_opt_bad_choice(const char *key, const char *v, const char *names);

/* ---- a table's setter: one statement per KIND storing the text v of option `key` in o->FIELD
 * (st: the status; a setter defines o, key, v and st and expands MQ_OPTSET_##KIND) ------------
 *   SWITCH  true/false (1/0)            NOT     the same, stored negated (--no-x)
 *   INT     an integer in P1 .. P2 (P1 > P2: any)
 *   NUM     a finite number in P1 .. P2
 *   TEXT    a string, kept by pointer    SIZE    bytes (mq_opt_size)
 *   ENUM    one of the names P2 ("a|b|c"), stored as P1 + its position
 *   NAME    the same, the name itself stored (a static string)
 *   FLAG_FN a switch, TEXT_FN a string and NUM_FN a number that the function P1(o, key, v) reads */
#define MQ_OPTSET_SWITCH(p1, p2, field)                                                            \
    {                                                                                              \
        int b_ = 0;                                                                                \
        if (!(st = mq_opt_bool(key, v, &b_))) o->field = b_;                                       \
    }
#define MQ_OPTSET_NOT(p1, p2, field)                                                               \
    {                                                                                              \
        int b_ = 0;                                                                                \
        if (!(st = mq_opt_bool(key, v, &b_))) o->field = !b_;                                      \
    }
#define MQ_OPTSET_INT(p1, p2, field)                                                               \
    {                                                                                              \
        int64_t x_ = 0;                                                                            \
        if (!(st = mq_opt_int(key, v, p1, p2, &x_))) o->field = x_;                                \
    }
#define MQ_OPTSET_NUM(p1, p2, field)                                                               \
    {                                                                                              \
        double x_ = 0;                                                                             \
        if (!(st = mq_opt_double(key, v, p1, p2, &x_))) o->field = x_;                             \
    }
#define MQ_OPTSET_TEXT(p1, p2, field) o->field = v;
#define MQ_OPTSET_SIZE(p1, p2, field) st = mq_opt_size(key, v, &o->field);
#define MQ_OPTSET_ENUM(p1, p2, field)                                                              \
    {                                                                                              \
        const int i_ = mq_opt_choice_index(v, p2);                                                 \
        if (i_ < 0) return mq_opt_bad_choice(key, v, p2);                                          \
        o->field = p1 + i_;                                                                        \
    }
#define MQ_OPTSET_NAME(p1, p2, field)                                                              \
    if (mq_opt_choice_index(v, p2) < 0) return mq_opt_bad_choice(key, v, p2);                      \
    o->field = v;
#define MQ_OPTSET_FLAG_FN(p1, p2, field) st = p1(o, key, v);
#define MQ_OPTSET_TEXT_FN(p1, p2, field) st = p1(o, key, v);
#define MQ_OPTSET_NUM_FN(p1, p2, field) st = p1(o, key, v);

/* ---- a table's moeq_option_info: the row's kind as a CLI and bindings see it, its choices and
 * its range (moeq_option_info's kind, choices, min, max) ---------------------------------------- */
#define MQ_OPTINFO_SWITCH(p1, p2) MOEQ_OPTION_SWITCH, NULL, 0, 0
#define MQ_OPTINFO_NOT(p1, p2) MOEQ_OPTION_SWITCH, NULL, 0, 0
#define MQ_OPTINFO_FLAG_FN(p1, p2) MOEQ_OPTION_SWITCH, NULL, 0, 0
#define MQ_OPTINFO_INT(p1, p2) MOEQ_OPTION_INT, NULL, (int64_t)(p1), (int64_t)(p2)
#define MQ_OPTINFO_NUM(p1, p2) MOEQ_OPTION_NUMBER, NULL, 0, 0
#define MQ_OPTINFO_NUM_FN(p1, p2) MOEQ_OPTION_NUMBER, NULL, 0, 0
#define MQ_OPTINFO_TEXT(p1, p2) MOEQ_OPTION_TEXT, NULL, 0, 0
#define MQ_OPTINFO_SIZE(p1, p2) MOEQ_OPTION_TEXT, NULL, 0, 0
#define MQ_OPTINFO_TEXT_FN(p1, p2) MOEQ_OPTION_TEXT, NULL, 0, 0
#define MQ_OPTINFO_ENUM(p1, p2) MOEQ_OPTION_CHOICE, p2, 0, 0
#define MQ_OPTINFO_NAME(p1, p2) MOEQ_OPTION_CHOICE, p2, 0, 0

#endif
