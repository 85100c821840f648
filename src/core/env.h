/*
 * The library's environment switches, read in one place (env.c) from the table in env.def: a
 * snapshot of all of them is taken at the first use and again when a job starts (moeq_set_threads,
 * moeq_quantize's pipeline), never where a switch is used, so that one job sees one setting
 * throughout and a caller that changes the environment between jobs (tests) is seen.
 */
#ifndef MOEQ_CORE_ENV_H
#define MOEQ_CORE_ENV_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {   /* the CUDA backend reads its switches here too */
#endif

typedef enum {
#define MQ_ENV(id, name, old, what) MQ_ENV_##id,
#include "core/env.def"
#undef MQ_ENV
    MQ_ENV_COUNT
} mq_env_id;

/* The switch's value in the snapshot (NAME, else OLD_NAME), NULL when unset. Borrowed: valid
 * until the process ends. */
const char *mq_env(mq_env_id id);
/* Set and not empty. */
bool mq_env_set(mq_env_id id);
/* Takes the snapshot again (at the start of a job). */
void mq_env_reload(void);

#ifdef __cplusplus
}
#endif

#endif
