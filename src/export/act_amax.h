/*
 * Calibration of activation ranges for W4A4 checkpoints: the absolute max of each Linear's input
 * over a calibration text (what llm-compressor's static_minmax observer stores as
 * input_global_scale = 448*6/amax, and ModelOpt as input_scale = amax/(448*6)).
 */
#ifndef MOEQ_EXPORT_ACT_AMAX_H
#define MOEQ_EXPORT_ACT_AMAX_H

#include "model/model.h"

typedef struct mq_act_amax mq_act_amax;

/* Runs the fp32 model over ids in consecutive chunks of `chunk` tokens (the last one shorter) and
 * records the input amax of every decoder Linear by module name. A routed expert that received no
 * token takes the largest amax of its layer's experts at the same site (vLLM uses one activation
 * scale per fused MoE layer). Interruptible (MOEQ_E_INTERRUPTED). */
moeq_status mq_act_amax_collect(const moeq_model *m, const int32_t *ids, int64_t n_ids,
                                int64_t chunk, mq_act_amax **out);
/* The amax of the input of `module`; 0 if the module was not seen. */
float mq_act_amax_get(const mq_act_amax *a, const char *module);
void mq_act_amax_free(mq_act_amax *a);

#endif
