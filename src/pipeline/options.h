/*
 * The options of moeq_quant_options by name (options.c, generated from the table in
 * quant_options.def).
 */
#ifndef MOEQ_PIPELINE_OPTIONS_H
#define MOEQ_PIPELINE_OPTIONS_H

#include "core/optval.h"

/* quant_options.def's IDENTITY column */
enum { MQ_QO_RUN = 0, MQ_QO_ID = 1 };

#endif
