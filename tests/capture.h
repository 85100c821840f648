/*
 * What the calibration hooks (mq_hooks, model/model.h) saw, for the tests that check them: each
 * call's layer, site, expert and a copy of its input rows.
 *   mq_test_captures *cs = calloc(1, sizeof *cs);
 *   mq_hooks h = {mq_test_on_capture, cs};
 */
#ifndef MOEQ_TEST_CAPTURE_H
#define MOEQ_TEST_CAPTURE_H

#include <stdlib.h>
#include <string.h>

#include "model/model.h"

typedef struct {
    int layer, site, expert;
    int64_t rows, cols;
    float *x;
} mq_test_capture;

enum { MQ_TEST_MAX_CAPTURES = 256 };   /* calls past these are not kept */

typedef struct {
    mq_test_capture c[MQ_TEST_MAX_CAPTURES];
    int n;
} mq_test_captures;

static inline void mq_test_on_capture(void *user, int layer, mq_site site, int expert, const float *x,
                                      int64_t rows, int64_t cols) {
    mq_test_captures *cs = user;
    if (cs->n >= MQ_TEST_MAX_CAPTURES) return;
    mq_test_capture *c = &cs->c[cs->n++];
    c->layer = layer;
    c->site = site;
    c->expert = expert;
    c->rows = rows;
    c->cols = cols;
    c->x = malloc(sizeof(float) * (size_t)(rows * cols + 1));
    memcpy(c->x, x, sizeof(float) * (size_t)(rows * cols));
}

static inline void mq_test_free_captures(mq_test_captures *cs) {
    for (int i = 0; i < cs->n; i++) free(cs->c[i].x);
    cs->n = 0;
}

/* The first capture of layer (any layer where layer < 0), site and expert, or NULL. */
static inline const mq_test_capture *mq_test_find_capture(const mq_test_captures *cs, int layer, int site,
                                                          int expert) {
    for (int i = 0; i < cs->n; i++)
        if ((layer < 0 || cs->c[i].layer == layer) && cs->c[i].site == site && cs->c[i].expert == expert)
            return &cs->c[i];
    return NULL;
}

#endif
