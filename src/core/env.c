/* The environment switches (env.h): one snapshot of every row of env.def. */
#include "core/env.h"

#include "core/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static const char *const k_names[MQ_ENV_COUNT][2] = {
#define MQ_ENV(id, name, old, what) {name, old},
#include "core/env.def"
#undef MQ_ENV
};

/* A snapshot is never freed: a reader on another thread may hold it. A new one is made only when
 * a value changed, so a process makes one per change of its environment (a test's setenv), not
 * one per job. */
typedef struct snapshot {
    const char *value[MQ_ENV_COUNT];
    struct snapshot *prev;   /* older snapshots are never freed (a reader may still hold a value
                                of one) and stay linked, so they are kept, not lost */
} snapshot;

static _Atomic(snapshot *) g_snap;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *read_one(int i) {
    const char *v = getenv(k_names[i][0]);
    if (!v && k_names[i][1]) v = getenv(k_names[i][1]);
    return v;
}

void mq_env_reload(void) {
    pthread_mutex_lock(&g_lock);
    snapshot *cur = atomic_load(&g_snap);
    bool same = cur != NULL;
    for (int i = 0; i < MQ_ENV_COUNT && same; i++) {
        const char *v = read_one(i);
        same = (!v && !cur->value[i]) || (v && cur->value[i] && !strcmp(v, cur->value[i]));
    }
    snapshot *s = same ? NULL : calloc(1, sizeof *s);
    for (int i = 0; s && i < MQ_ENV_COUNT; i++) {
        const char *v = read_one(i);
        s->value[i] = v ? mq_strdup(v) : NULL;   /* getenv's string may change with the environment */
    }
    if (s) {
        s->prev = cur;
        atomic_store(&g_snap, s);   /* out of memory: the last snapshot stays */
    }
    pthread_mutex_unlock(&g_lock);
}

const char *mq_env(mq_env_id id) {
    snapshot *s = atomic_load(&g_snap);
    if (!s) {
        mq_env_reload();
        s = atomic_load(&g_snap);
    }
    return s && id >= 0 && id < MQ_ENV_COUNT ? s->value[id] : NULL;
}

bool mq_env_set(mq_env_id id) {
    const char *v = mq_env(id);
    return v && *v;
}
