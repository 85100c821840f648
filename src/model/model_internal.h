/*
 * Helpers private to src/model: a collector of problems (config fields, tensors) reported
 * together in one error message.
 */
#ifndef MOEQ_MODEL_INTERNAL_H
#define MOEQ_MODEL_INTERNAL_H

#include "model/model.h"

typedef struct {
    char *buf;      /* "; "-separated problems */
    size_t len, cap;
    int n;          /* problems added */
    int n_shown;    /* problems that fit into the message */
} mq_problems;

void mq_problems_init(mq_problems *p);
void mq_problems_free(mq_problems *p);
void mq_problems_add(mq_problems *p, const char *fmt, ...) MQ_PRINTF(2, 3);
/* Sets the last error to "<prefix>: N problem(s): a; b; c (and K more)" and returns st. */
moeq_status mq_problems_error(const mq_problems *p, moeq_status st, const char *prefix_fmt, ...)
    MQ_PRINTF(3, 4);

#endif
