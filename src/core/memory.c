/*
 * Checked allocation and arithmetic. Every allocation failure names what was being allocated.
 *
 * Blocks of MQ_BIG_ALLOC bytes or more (weights, Hessians, activations) are mapped straight from
 * the kernel and unmapped on free, so the memory of a finished layer goes back to the system at
 * once: glibc would serve such sizes from its heaps once its dynamic mmap threshold has risen,
 * and a heap keeps freed blocks resident, which would make the streaming pipeline's resident
 * memory drift above its plan. A small table records the mapped blocks so mq_free can tell them
 * from heap blocks.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core.h"

enum { MQ_BIG_ALLOC = 1 << 20 };

typedef struct {
    void *p;
    size_t n;
} big_block;

static pthread_mutex_t g_big_lock = PTHREAD_MUTEX_INITIALIZER;
static big_block *g_big;       /* open addressing on the address; p == NULL: empty */
static size_t g_big_cap, g_big_n;

static size_t big_slot(const void *p, size_t cap) {
    uintptr_t h = (uintptr_t)p >> 12;
    h ^= h >> 17;
    h *= (uintptr_t)0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 7) & (cap - 1);
}

/* Inserts into a table of capacity cap (a power of two, less than half full). */
static void big_insert(big_block *t, size_t cap, big_block b) {
    size_t i = big_slot(b.p, cap);
    while (t[i].p) i = (i + 1) & (cap - 1);
    t[i] = b;
}

static bool big_register(void *p, size_t n) {
    pthread_mutex_lock(&g_big_lock);
    bool ok = true;
    if (2 * (g_big_n + 1) > g_big_cap) {
        size_t cap = g_big_cap ? 2 * g_big_cap : 256;
        big_block *t = calloc(cap, sizeof *t);
        if (!t) {
            ok = false;
        } else {
            for (size_t i = 0; i < g_big_cap; i++)
                if (g_big[i].p) big_insert(t, cap, g_big[i]);
            free(g_big);
            g_big = t;
            g_big_cap = cap;
        }
    }
    if (ok) {
        big_insert(g_big, g_big_cap, (big_block){p, n});
        g_big_n++;
    }
    pthread_mutex_unlock(&g_big_lock);
    return ok;
}

/* Removes p from the table; returns its size, or 0 when p is not a mapped block. */
static size_t big_unregister(void *p) {
    size_t n = 0;
    pthread_mutex_lock(&g_big_lock);
    if (g_big_cap) {
        size_t i = big_slot(p, g_big_cap);
        while (g_big[i].p && g_big[i].p != p) i = (i + 1) & (g_big_cap - 1);
        if (g_big[i].p == p) {
            n = g_big[i].n;
            g_big[i].p = NULL;
            g_big_n--;
            /* re-insert the rest of the probe run so later lookups still find them */
            for (size_t j = (i + 1) & (g_big_cap - 1); g_big[j].p; j = (j + 1) & (g_big_cap - 1)) {
                big_block b = g_big[j];
                g_big[j].p = NULL;
                big_insert(g_big, g_big_cap, b);
            }
        }
    }
    pthread_mutex_unlock(&g_big_lock);
    return n;
}

/* A zero-filled mapping (the kernel hands out zero pages), or NULL. */
static void *big_alloc(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    /* 2 MiB pages where the kernel has them: a 16 MiB Hessian is 8 page faults instead of
     * 4096, and the GEMMs over weights miss the TLB far less */
    if (n >= (size_t)4 << 20) madvise(p, n, MADV_HUGEPAGE);
#endif
    if (!big_register(p, n)) {
        munmap(p, n);
        return NULL;
    }
    return p;
}

bool mq_mul_size(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return false;
    *out = a * b;
    return true;
}

bool mq_add_size(size_t a, size_t b, size_t *out) {
    if (b > SIZE_MAX - a) return false;
    *out = a + b;
    return true;
}

bool mq_mul_i64(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0) return false;
    if (a != 0 && b > INT64_MAX / a) return false;
    *out = a * b;
    return true;
}

void *mq_alloc(size_t n, const char *what) {
    void *p = NULL;
    size_t rounded;
    if (n == 0) n = 1;
    if (!mq_add_size(n, 63, &rounded)) {
        mq_err(MOEQ_E_NOMEM, "out of memory: %s needs %zu bytes", what ? what : "buffer", n);
        return NULL;
    }
    rounded &= ~(size_t)63;
    p = rounded >= MQ_BIG_ALLOC ? big_alloc(rounded) : aligned_alloc(64, rounded);
    if (!p) mq_err(MOEQ_E_NOMEM, "out of memory: %s needs %zu bytes", what ? what : "buffer", n);
    return p;
}

void *mq_alloc_zero(size_t n, const char *what) {
    void *p = mq_alloc(n, what);
    if (p && n + 63 < MQ_BIG_ALLOC) memset(p, 0, n);   /* fresh mappings are zero already */
    return p;
}

void *mq_alloc_array(size_t count, size_t elem, const char *what) {
    size_t n;
    if (!mq_mul_size(count, elem, &n)) {
        mq_err(MOEQ_E_NOMEM, "out of memory: %s: %zu x %zu bytes overflows", what ? what : "array",
               count, elem);
        return NULL;
    }
    return mq_alloc(n, what);
}

void mq_free(void *p) {
    if (!p) return;
    size_t n = ((uintptr_t)p & 4095) == 0 ? big_unregister(p) : 0;
    if (n)
        munmap(p, n);
    else
        free(p);
}

enum { TOUCH_PIECE = 2 << 20, TOUCH_STRIDE = 4096 };   /* bytes a task; the smallest page */

typedef struct {
    void *const *base;
    const size_t *bytes;
} touch_ctx;

static int64_t touch_pieces(const touch_ctx *c, int64_t i) {   /* a NULL region has none */
    return c->base[i] ? (int64_t)((c->bytes[i] + TOUCH_PIECE - 1) / TOUCH_PIECE) : 0;
}

static void touch_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const touch_ctx *c = vctx;
    int64_t i = 0;
    while (t >= touch_pieces(c, i)) t -= touch_pieces(c, i++);   /* piece t's region: few, walked */
    volatile char *p = (char *)c->base[i];
    const size_t a = (size_t)t * TOUCH_PIECE, e = a + TOUCH_PIECE < c->bytes[i] ? a + TOUCH_PIECE : c->bytes[i];
    for (size_t k = a; k < e; k += TOUCH_STRIDE) p[k] = 0;
}

void mq_touch_pages(void *const *base, const size_t *bytes, int64_t n) {
    const touch_ctx c = {base, bytes};
    int64_t pieces = 0;
    for (int64_t i = 0; i < n; i++) pieces += touch_pieces(&c, i);
    if (pieces) mq_parallel_for(pieces, touch_task, (void *)&c);
}

char *mq_strdup(const char *s) { return s ? mq_strndup(s, strlen(s)) : NULL; }

char *mq_strndup(const char *s, size_t n) {
    char *r = malloc(n + 1);
    if (!r) {
        mq_err(MOEQ_E_NOMEM, "out of memory copying a string of %zu bytes", n);
        return NULL;
    }
    memcpy(r, s, n);
    r[n] = 0;
    return r;
}

char *mq_asprintf(const char *fmt, ...) {
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *r = NULL;
    if (n >= 0 && (r = malloc((size_t)n + 1)) != NULL) vsnprintf(r, (size_t)n + 1, fmt, ap2);
    va_end(ap2);
    if (!r) mq_err(MOEQ_E_NOMEM, "out of memory formatting a string");
    return r;
}
