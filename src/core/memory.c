/*
 * Checked allocation and arithmetic. Every allocation failure names what was being allocated.
 *
 * Blocks of MQ_BIG_ALLOC bytes or more (weights, Hessians, activations) are mapped straight from
 * the kernel, and what is freed is either reused (below) or unmapped: glibc would serve such sizes
 * from its heaps once its dynamic mmap threshold has risen, and a heap keeps freed blocks
 * resident with no bound, which would make the streaming pipeline's resident memory drift above
 * its plan. A small table records the mapped blocks so mq_free can tell them
 * from heap blocks.
 *
 * Recycling: a freed mapping is kept and handed out again for a request of the same size, since
 * the pipeline allocates the same buffers chunk after chunk and layer after layer, and a fresh
 * mapping costs a page fault and the kernel's zeroing of every page (the development VM's 4 KB
 * faults run at 0.4 GB/s; a 2-layer OLMoE-1B-7B run at 2 threads spent 24 s of its 350 CPU
 * seconds in the kernel, 17 s with recycling; at 16 threads the faults also contend). Resident
 * memory never exceeds what it would be without: a request the kept blocks cannot serve first
 * unmaps kept blocks of at least its size (the oldest first), so the mapped bytes only grow where
 * the live ones would. A kept block's old contents stay (mq_alloc_zero clears it on the pool);
 * mq_mem_release unmaps every kept block. MOEQ_DEBUG_RECYCLE=0 turns it off.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core.h"
#include "core/env.h"

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

/* ---- kept blocks (recycling) ---- */
static big_block *g_kept;          /* under g_big_lock: freed mappings, the oldest first */
static size_t g_kept_n, g_kept_cap;
static int g_recycle = -1;         /* MOEQ_DEBUG_RECYCLE=0 turns it off (measurements); -1: not read */

static bool recycle_on(void) {
    if (g_recycle < 0) {
        const char *e = mq_env(MQ_ENV_RECYCLE);
        g_recycle = !(e && e[0] == '0');
    }
    return g_recycle;
}

/* A kept block of exactly n bytes (the newest: its pages are the likeliest in cache), taken out
 * of the kept list; NULL if none. Under g_big_lock. */
static void *kept_take(size_t n) {
    for (size_t i = g_kept_n; i-- > 0;)
        if (g_kept[i].n == n) {
            void *p = g_kept[i].p;
            memmove(g_kept + i, g_kept + i + 1, (g_kept_n - i - 1) * sizeof *g_kept);
            g_kept_n--;
            return p;
        }
    return NULL;
}

/* Unmaps the oldest kept blocks until at least n bytes went (or none is left). */
static void kept_drop(size_t n) {
    size_t gone = 0;
    while (gone < n) {
        pthread_mutex_lock(&g_big_lock);
        big_block b = {NULL, 0};
        if (g_kept_n) {
            b = g_kept[0];
            memmove(g_kept, g_kept + 1, (g_kept_n - 1) * sizeof *g_kept);
            g_kept_n--;
        }
        pthread_mutex_unlock(&g_big_lock);
        if (!b.p) return;
        munmap(b.p, b.n);
        gone += b.n;
    }
}

void mq_mem_release(void) { kept_drop(SIZE_MAX); }

size_t mq_mem_kept_bytes(void) {
    pthread_mutex_lock(&g_big_lock);
    size_t n = 0;
    for (size_t i = 0; i < g_kept_n; i++) n += g_kept[i].n;
    pthread_mutex_unlock(&g_big_lock);
    return n;
}

/* Keeps a freed mapping for reuse; false (the caller unmaps it) when off or the list is full. */
static bool kept_put(void *p, size_t n) {
    if (!recycle_on()) return false;
    pthread_mutex_lock(&g_big_lock);
    if (g_kept_n == g_kept_cap) {
        size_t cap = g_kept_cap ? 2 * g_kept_cap : 64;
        big_block *t = realloc(g_kept, cap * sizeof *t);
        if (t) g_kept = t, g_kept_cap = cap;
    }
    const bool ok = g_kept_n < g_kept_cap;
    if (ok) g_kept[g_kept_n++] = (big_block){p, n};
    pthread_mutex_unlock(&g_big_lock);
    return ok;
}

/* A mapping of n bytes, or NULL: a kept one (*reused: its old contents) or a fresh one (zero
 * pages), after unmapping as many kept bytes as it adds. */
static void *big_alloc(size_t n, bool *reused) {
    pthread_mutex_lock(&g_big_lock);
    void *p = kept_take(n);
    pthread_mutex_unlock(&g_big_lock);
    *reused = p != NULL;
    if (!p) {
        kept_drop(n);
        p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
        /* 2 MiB pages where the kernel has them: a 16 MiB Hessian is 8 page faults instead of
         * 4096, and the GEMMs over weights miss the TLB far less */
        if (n >= (size_t)4 << 20) madvise(p, n, MADV_HUGEPAGE);
#endif
    }
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

/* MOEQ_DEBUG_ALLOC_POISON=1 fills what mq_alloc hands out with 0xff bytes (NaN floats) in place of
 * the fresh mappings' zeros, so a test run shows any reader of memory it never wrote (a kept
 * block holds old values). */
static int g_poison = -1;

static bool poison_on(void) {
    if (g_poison < 0) {
        const char *e = mq_env(MQ_ENV_ALLOC_POISON);
        g_poison = e && e[0] == '1';
    }
    return g_poison;
}

static void *alloc_any(size_t n, const char *what, bool *reused) {
    void *p = NULL;
    size_t rounded;
    *reused = false;
    if (n == 0) n = 1;
    if (!mq_add_size(n, 63, &rounded)) {
        mq_err(MOEQ_E_NOMEM, "out of memory: %s needs %zu bytes", what ? what : "buffer", n);
        return NULL;
    }
    rounded &= ~(size_t)63;
    p = rounded >= MQ_BIG_ALLOC ? big_alloc(rounded, reused) : aligned_alloc(64, rounded);
    if (!p) mq_err(MOEQ_E_NOMEM, "out of memory: %s needs %zu bytes", what ? what : "buffer", n);
    return p;
}

void *mq_alloc(size_t n, const char *what) {
    bool reused;
    void *p = alloc_any(n, what, &reused);
    if (p && poison_on()) memset(p, 0xff, n);
    return p;
}

static void pieces_for(void *const *base, const size_t *bytes, int64_t n, bool zero);

void *mq_alloc_zero(size_t n, const char *what) {
    bool reused;
    void *p = alloc_any(n, what, &reused);
    /* fresh mappings are zero already; a kept one is cleared on the pool in 2 MB pieces, as the
     * page faults of a fresh one would spread, not all on the allocating thread */
    if (p && (reused || n + 63 < MQ_BIG_ALLOC)) pieces_for(&p, &n, 1, true);
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
    if (n) {
        if (!kept_put(p, n)) munmap(p, n);
    } else {
        free(p);
    }
}

enum { TOUCH_PIECE = 2 << 20, TOUCH_STRIDE = 4096 };   /* bytes a task; the smallest page */

typedef struct {
    void *const *base;
    const size_t *bytes;
    bool zero;   /* clear every byte (mq_alloc_zero), not one a page */
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
    if (c->zero) memset((char *)c->base[i] + a, 0, e - a);
    else
        for (size_t k = a; k < e; k += TOUCH_STRIDE) p[k] = 0;
}

static void pieces_for(void *const *base, const size_t *bytes, int64_t n, bool zero) {
    const touch_ctx c = {base, bytes, zero};
    int64_t pieces = 0;
    for (int64_t i = 0; i < n; i++) pieces += touch_pieces(&c, i);
    if (pieces) mq_parallel_for(pieces, touch_task, (void *)&c);
}

void mq_touch_pages(void *const *base, const size_t *bytes, int64_t n) { pieces_for(base, bytes, n, false); }

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

void mq_free_each(void *const *p, size_t n) {
    for (size_t i = 0; i < n; i++) free(p[i]);
}

void mq_release_each(void *const *p, size_t n) {
    for (size_t i = 0; i < n; i++) mq_free(p[i]);
}

int64_t mq_find_name(const char *key, size_t n, const char *(*name_at)(const void *ctx, size_t i), const void *ctx) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        const int c = strcmp(name_at(ctx, mid), key);
        if (c == 0) return (int64_t)mid;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

bool mq_reserve(void *arrp, size_t *cap, size_t need, size_t elem, size_t first) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : first;
    while (c < need) c *= 2;
    void *arr;
    memcpy(&arr, arrp, sizeof arr);
    void *a = realloc(arr, c * elem);
    if (!a) return false;
    memcpy(arrp, &a, sizeof a);
    *cap = c;
    return true;
}

moeq_status mq_grow(void *arrp, size_t n, size_t *cap, size_t elem, size_t first, const char *what) {
    return mq_reserve(arrp, cap, n + 1, elem, first) ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory: %s", what);
}
